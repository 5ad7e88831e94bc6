"""Admin REST API under /admin (roles viewer < operator < admin)."""
