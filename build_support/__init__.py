"""Helpers of setup.py (no torch imports)."""
