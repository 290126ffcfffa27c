"""One ring call as a record: what ``ring_sdpa``'s caller asked for, in the
order and with the names of the arguments every ring op shares after its
tensors (``kRingCallArgs`` in csrc/torch/ring/ring_call.h, composed into the
schemas of ``ring_sdpa``, ``ring_sdpa_backward``, ``..._covered`` and
``ring_describe_call``). The entry point builds it once; the op, the fake
kernels, the checks, the autograd formula and the cost model take it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..attention.names import Layout
from ..comm.native import ops

__all__ = ["RingCall"]


@dataclass(frozen=True, slots=True, eq=False)
class RingCall:
    """``layout``, ``backend``, ``rotate`` and ``ring_pass`` are names
    (cplib/attention/names.py); ``window`` is ``[left, right]`` (the op's
    ``int[]?``, see ``args.window_arg``); ``group_name`` is None only for the
    local checks of a world of one (Ulysses' attention)."""

    group_name: str | None
    is_causal: bool = False
    layout: str = Layout.SEQUENTIAL
    scale: float | None = None
    backend: str = "auto"
    rotate: str = "p2p"
    cu_seqlens: torch.Tensor | None = None
    window: list[int] | None = None
    seq_len: int | None = None
    q_positions: torch.Tensor | None = None
    kv_positions: torch.Tensor | None = None
    ring_pass: str = "kv"

    def op_args(self) -> tuple:
        """The ops' shared arguments, in schema order."""
        return (self.group_name, self.is_causal, self.layout, self.scale, self.backend,
                self.rotate, self.cu_seqlens, self.window, self.seq_len, self.q_positions,
                self.kv_positions, self.ring_pass)

    @property
    def has_positions(self) -> bool:
        return self.q_positions is not None or self.kv_positions is not None

    def replace(self, **changes) -> RingCall:
        return dataclasses.replace(self, **changes)


ARGS = len(dataclasses.fields(RingCall))


def _check_schema() -> None:
    """The record's fields are the ops' shared arguments (a build of the
    native layer with another list fails here, at import)."""
    names = [f.name for f in dataclasses.fields(RingCall)]
    schema = [a.name for a in ops.ring_sdpa.default._schema.arguments[3:3 + ARGS]]
    if names != schema:
        raise ImportError(f"cplib: RingCall's fields {names} are not the arguments of "
                          f"cplib_c::ring_sdpa {schema}: the native library is of another build")


_check_schema()
