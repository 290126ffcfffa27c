"""cplib.decode: see docs/decode.md."""
