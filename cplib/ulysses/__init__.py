"""cplib.ulysses: see docs/ulysses.md."""
