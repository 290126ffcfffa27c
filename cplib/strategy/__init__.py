"""cplib.strategy: see docs/strategy.md."""

from . import placement  # noqa: F401  (registers the document placement candidate)
from . import flex_cost  # noqa: F401  (registers the flex ring / all-gather candidates)
