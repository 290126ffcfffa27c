"""cplib.strategy: see docs/strategy.md."""

from . import placement  # noqa: F401  (registers the document placement candidate)
