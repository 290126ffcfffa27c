"""Context-parallel options: the process-wide defaults that torch's API exposes
(``_cp_options``, ``set_rotate_method``) and the per-context configuration
that cplib resolves from them and from explicit arguments."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any

from ..attention.names import ROTATIONS, Layout

__all__ = [
    "_CausalBehavior",
    "_RotateMethod",
    "_ContextParallelOptions",
    "_cp_options",
    "_is_causal_behavior",
    "set_rotate_method",
    "RingConfig",
    "rotate_method_name",
    "parse_rotate_method",
    "explicit_rotation",
]

logger = logging.getLogger(__name__)


class _CausalBehavior(Enum):
    SKIP = None
    NOT_IS_CAUSAL = False
    IS_CAUSAL = True


class _RotateMethod(Enum):
    ALL_TO_ALL = auto()
    ALL_GATHER = auto()
    P2P = auto()  # cplib's addition: the double-buffered neighbour (send/recv) ring


# torch's members by the ring's rotation names (cplib/attention/names.py): ALL_TO_ALL
# is "alltoall", and so on.
_NAMES = {name: next(m for m in _RotateMethod if m.name.replace("_", "").lower() == name)
          for name in ROTATIONS}


@dataclass
class _ContextParallelOptions:
    # Kept for parity with torch; cplib's merge always accumulates in fp32.
    convert_to_f32: bool = True
    enable_load_balance: bool = True
    # torch defaults to all-gather; cplib's default is the O(S/N)-memory ring.
    rotate_method: _RotateMethod = _RotateMethod.P2P
    # cplib: the layout of the last _context_parallel_shard (None: none yet),
    # which _ContextParallel's SDPA calls check how they read their inputs
    # against (cplib/frontend/shard_layout.py).
    shard_layout: Any = None


_cp_options = _ContextParallelOptions()


def parse_rotate_method(rotate_method: str | _RotateMethod) -> _RotateMethod:
    if isinstance(rotate_method, _RotateMethod):
        return rotate_method
    try:
        return _NAMES[rotate_method]
    except (KeyError, TypeError):
        raise NotImplementedError(
            f"Context Parallel does not support using {rotate_method!r} for kv shards "
            f"rotation; choose one of {sorted(_NAMES)}"
        ) from None


def rotate_method_name(method: _RotateMethod) -> str:
    """The string the ring op takes for ``method``."""
    return next(name for name, m in _NAMES.items() if m is method)


def explicit_rotation(rotate_method: str | _RotateMethod | None) -> str | None:
    """The rotation strategy="auto" must keep: an argument, or a process-wide
    one other than cplib's default (a call of set_rotate_method("p2p") cannot
    be told from the default), else None."""
    if rotate_method is not None:
        return rotate_method_name(parse_rotate_method(rotate_method))
    if _cp_options.rotate_method is not _RotateMethod.P2P:
        return rotate_method_name(_cp_options.rotate_method)
    return None


def set_rotate_method(rotate_method: str) -> None:
    """Sets the process-wide K/V rotation used by context parallel SDPA:
    ``"p2p"`` (cplib's default: a neighbour ring of batched send/recv, O(S/N)
    memory), ``"alltoall"`` (one split all-to-all per step, as torch's) or
    ``"allgather"`` (one gather up front, O(S) memory). Any other value
    raises NotImplementedError, as in torch."""
    _cp_options.rotate_method = parse_rotate_method(rotate_method)


def _is_causal_behavior(rank: int, world_size: int, i: int, is_causal: bool) -> _CausalBehavior:
    """What ring step ``i`` on ``rank`` computes against the K/V block that
    started on rank ``(rank - i) % world_size``: the causal diagonal at step 0,
    a full block from earlier ranks (or from any rank under head-tail load
    balancing), and nothing from later ranks otherwise."""
    if not is_causal:
        return _CausalBehavior.NOT_IS_CAUSAL
    if i == 0:
        return _CausalBehavior.IS_CAUSAL
    source = (rank - i) % world_size
    if source < rank or _cp_options.enable_load_balance:
        return _CausalBehavior.NOT_IS_CAUSAL
    return _CausalBehavior.SKIP


@dataclass(frozen=True)
class RingConfig:
    """What every SDPA call of one context-parallel region needs: the group,
    the layout of its shards (cplib.attention.names.Layout: sequential, head-tail,
    per-document head-tail or the document placement) and the rotation;
    cplib's additions: the global length when shards are uneven, the batch's
    documents, and the default sliding window."""

    group_name: str
    world_size: int
    layout: Layout
    rotate: str
    # USP (cplib/ulysses/usp_layout.py): with ulysses_degree U > 1, Ulysses runs over
    # ulysses_group and the ring over group_name (this rank's ring group).
    ulysses_degree: int = 1
    ulysses_group: str | None = None
    seq_len: int | None = None
    cu_seqlens: Any = None  # torch.Tensor | None
    window: Any = None  # int | (left, right) | None
    # strategy="auto" (cplib/strategy/auto.py): the rotation is chosen per call.
    strategy: Any = None

    # The layout as ring_sdpa's keywords name it.
    @property
    def load_balanced(self) -> bool:
        return self.layout != Layout.SEQUENTIAL

    @property
    def per_document(self) -> bool:
        return self.layout == Layout.PER_DOCUMENT

    @property
    def placement(self) -> bool:
        return self.layout == Layout.PLACEMENT
