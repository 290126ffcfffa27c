"""cplib.conv: see docs/conv.md."""
