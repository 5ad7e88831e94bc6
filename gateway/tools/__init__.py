"""Tools, resources and prompts that components register into the gateway registry."""
