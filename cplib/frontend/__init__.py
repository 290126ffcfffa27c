"""cplib.frontend: see docs/frontend.md."""
