"""cplib.flex: see docs/flex.md."""
