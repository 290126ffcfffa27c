"""cplib.ring: see docs/ring.md."""
