"""cplib.comm: see docs/comm.md."""
