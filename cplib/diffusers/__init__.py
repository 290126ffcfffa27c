"""cplib.diffusers: see docs/diffusers.md."""
