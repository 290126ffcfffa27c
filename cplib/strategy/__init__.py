"""cplib.strategy: see docs/strategy.md."""
