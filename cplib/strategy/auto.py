"""``strategy="auto"``: the options a user gives (:class:`AutoStrategy`), and
the agreed choice for one call (:func:`choose_for_call`), which the entry
points ask for: ``ring_sdpa(rotate="auto")`` (the rotation: cplib/ring/entry.py),
an SDPA call routed by ``context_parallel`` / ``_ContextParallel`` (the
rotation of the context's ring or USP) and the entry of ``context_parallel``
when the attention's shape is given (the Ulysses degree, the rotation and the
layout, before anything is sharded: cplib/frontend/strategy_route.py), a
FLEX module's call (cplib/flex/strategy_route.py)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import torch

from .calibration import Calibration, as_calibration
from .candidates import Candidate
from .choice import Choice, agreed_choice, calibration_for
from .explain import DEFAULT_MARGIN, constraints_of
from .workload import NO_LIMIT, Workload, element_size, ranks_per_node

__all__ = ["AttentionShape", "AutoStrategy", "parse_strategy", "workload_from_call",
           "choose_for_call"]


@dataclass(frozen=True)
class AttentionShape:
    """The attention calls a ``context_parallel`` block will make, so that
    ``strategy="auto"`` can choose the Ulysses degree (which decides how the
    buffers are sharded) on entry: q / kv heads, head dim, dtype, causal,
    batch."""

    q_heads: int
    head_dim: int
    kv_heads: int | None = None
    dtype: torch.dtype = torch.bfloat16
    is_causal: bool = True
    batch: int = 1

    def __post_init__(self) -> None:
        for name in ("q_heads", "head_dim", "batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"cplib.AttentionShape: {name}={value!r} must be a positive "
                                 "int")
        kv = self.q_heads if self.kv_heads is None else self.kv_heads
        if isinstance(kv, bool) or not isinstance(kv, int) or kv < 1 or self.q_heads % kv:
            raise ValueError(f"cplib.AttentionShape: kv_heads={self.kv_heads!r} must divide "
                             f"q_heads={self.q_heads}")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"cplib.AttentionShape: dtype={self.dtype!r} is not a torch.dtype")


@dataclass(frozen=True)
class AutoStrategy:
    """``strategy="auto"`` with options. ``memory_limit``: bytes per rank
    that the chosen candidate's predicted peak must fit (ValueError when none
    does); ``calibration``: a Calibration, a built-in default's name
    ("h100", "cpu") or a dict of overrides, instead of the measured one;
    ``attention``: the calls' shape, so that ``context_parallel`` can choose
    the Ulysses degree on entry; ``ranks_per_node``: the node size (default:
    ``LOCAL_WORLD_SIZE``, else the whole group); ``families``: the candidate
    families allowed (e.g. ``("ring",)``); ``rotate`` / ``ulysses_degree``:
    pins, as explicit settings of the entry points are; ``margin``: torch's
    default (the ring with all-gather) is kept unless another candidate is
    predicted more than this fraction faster (0 for the plain fastest)."""

    memory_limit: int | None = None
    calibration: Calibration | str | Mapping[str, float] | None = None
    attention: AttentionShape | None = None
    ranks_per_node: int | None = None
    families: tuple[str, ...] | None = None
    rotate: str | None = None
    ulysses_degree: int | None = None
    margin: float = DEFAULT_MARGIN
    # The context-parallel group the choices are agreed over (set by the front end).
    group: str | None = None
    # The choices made under this strategy (ContextParallelHandle.explain).
    choices: list = field(default_factory=list, compare=False, repr=False)

    def check(self, op: str) -> "AutoStrategy":
        """ValueError (naming the value) for a bad option; returns self."""
        constraints_of(self.rotate, None, self.memory_limit, 1, margin=self.margin)
        if self.calibration is not None:
            as_calibration(self.calibration)
        if self.attention is not None and not isinstance(self.attention, AttentionShape):
            raise ValueError(f"cplib.{op}: AutoStrategy.attention must be a "
                             f"cplib.AttentionShape, got {type(self.attention).__name__}")
        if self.ranks_per_node is not None and (isinstance(self.ranks_per_node, bool) or not
                                                isinstance(self.ranks_per_node, int)
                                                or self.ranks_per_node < 1):
            raise ValueError(f"cplib.{op}: ranks_per_node={self.ranks_per_node!r} must be a "
                             "positive int")
        if self.families is not None and (isinstance(self.families, str) or not all(
                isinstance(f, str) for f in self.families)):
            raise ValueError(f"cplib.{op}: families={self.families!r} must be a tuple of "
                             "family names")
        return self

    def pinned(self, rotate: str | None = None, ulysses_degree: int | None = None,
               group: str | None = None) -> "AutoStrategy":
        """A copy with the explicit settings of the entry point added, the
        group it chooses for, and its own list of choices."""
        return replace(self, rotate=self.rotate if rotate is None else rotate,
                       ulysses_degree=self.ulysses_degree if ulysses_degree is None
                       else ulysses_degree, group=self.group if group is None else group,
                       choices=[])

    def record(self, choice: Choice) -> None:
        """Notes a choice made under this strategy (a cached one too: another
        context may have made it), once."""
        if not any(c is choice for c in self.choices):
            self.choices.append(choice)

    def explain(self) -> list[Choice]:
        """The choices made under this strategy so far (one per distinct call)."""
        return list(self.choices)


def parse_strategy(value: Any, op: str) -> AutoStrategy | None:
    """None (explicit settings and torch's defaults), "auto" or an
    AutoStrategy; ValueError naming anything else."""
    if value is None:
        return None
    if isinstance(value, str) and value == "auto":
        return AutoStrategy()
    if isinstance(value, AutoStrategy):
        return value.check(op)
    raise ValueError(f"cplib.{op}: strategy={value!r} is not None, 'auto' or a "
                     "cplib.AutoStrategy")


def _documents(cu_seqlens: torch.Tensor | None) -> tuple[int, ...] | None:
    if cu_seqlens is None:
        return None
    return tuple(int(x) for x in cu_seqlens.tolist())


def workload_from_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, world_size: int,
                       *, is_causal: bool, window: list[int] | None, seq_len: int | None,
                       layout: str, backward: bool, node_ranks: int | None) -> Workload:
    """The Workload of a call on local shards (B, H, S_local, D): S is
    ``seq_len`` or the local length times the world size. Documents are left
    out here (read only when a choice is made: they may live on the GPU)."""
    sides = None
    if window is not None:
        left, right = window
        sides = (min(left, NO_LIMIT), 0 if is_causal else min(right, NO_LIMIT))
    s = seq_len if seq_len is not None else q.shape[2] * world_size
    return Workload(int(s), int(q.shape[0]), int(q.shape[1]), int(k.shape[1]), int(q.shape[3]),
                    int(v.shape[3]), element_size(q.dtype), world_size,
                    ranks_per_node(world_size, node_ranks), bool(is_causal), sides, None,
                    layout, q.device.type, backward)


def choose_for_call(auto: AutoStrategy, group_name: str, w: Workload,
                    cu_seqlens: torch.Tensor | None, q: torch.Tensor,
                    families: tuple[str, ...] | None, data: tuple | None,
                    record: bool = True) -> Candidate:
    """The agreed choice for a call whose Workload ``w`` has no documents yet
    (they are read on a cache miss only; the key needs just their kind)."""
    docs_kind = (0, 0, w.seq_len) if cu_seqlens is not None and cu_seqlens.numel() > 2 else None
    keyed = replace(w, documents=docs_kind)
    constraints = constraints_of(auto.rotate, auto.ulysses_degree, auto.memory_limit,
                                 w.world_size, families or auto.families, data, auto.margin)

    def calibration() -> Calibration:
        return calibration_for(group_name, q.device, w.head_dim, q.dtype, auto.calibration)

    choice = agreed_choice(group_name, keyed, constraints, calibration,
                           full=lambda: replace(w, documents=_documents(cu_seqlens)))
    if record:
        auto.record(choice)
    return choice.chosen
