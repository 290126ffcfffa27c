"""cplib.merge: see docs/merge.md."""
