"""learnmesh processes: worker, trainer, and the `learnmesh` command that runs them."""
