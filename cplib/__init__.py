"""cplib: context parallelism for PyTorch as a native extension."""

from __future__ import annotations

import logging

from . import _native  # noqa: F401  (loads cplib._C and its ops)
from ._flex_allgather import flex_cp_allgather
from ._merge import merge_partial_
from ._tp_conv import disable_dtensor_conv, enable_dtensor_conv, tp_conv

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = ["flex_cp_allgather", "merge_partial_", "__version__"]
__all__ += ["tp_conv", "enable_dtensor_conv", "disable_dtensor_conv"]
