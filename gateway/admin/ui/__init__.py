"""Static files of the operations dashboard (served at /admin/ui)."""
