"""cplib.attention: the layer every attention feature shares; see docs/attention.md."""
