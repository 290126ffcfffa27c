"""``cplib.ring_sdpa``: the ring's entry point. ``rotate="auto"`` is
resolved here (:func:`ring_rotation`: the cost model's choice for the call,
cplib/strategy/) and an explicit rotation passed down to the op
(cplib/ring/op.py)."""

from __future__ import annotations

from typing import Literal

import torch

from ..comm.native import GroupLike, group_size
from ..strategy.auto import AutoStrategy, choose_for_call, workload_from_call
from ..strategy.candidates import data_layout
from .call import RingCall
from .op import ring_inputs, ring_run

__all__ = ["ring_sdpa", "ring_rotation"]


def ring_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: GroupLike,
    *,
    is_causal: bool = False,
    load_balanced: bool = False,
    scale: float | None = None,
    rotate: str = "p2p",
    backend: str | None = None,
    cu_seqlens: torch.Tensor | None = None,
    window: int | tuple[int | None, int | None] | None = None,
    seq_len: int | None = None,
    per_document: bool = False,
    sinks: torch.Tensor | None = None,
    q_positions: torch.Tensor | None = None,
    kv_positions: torch.Tensor | None = None,
    ring_pass: Literal["kv", "q", "auto"] = "kv",
    attn_mask: torch.Tensor | None = None,
    placement: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring attention of the local shards ``q`` (B, Hq, S_local, D) and ``k``/``v``
    (B, Hkv, S_local, D; v's head dim may differ from q/k's, as in MLA) over
    ``group`` (a ProcessGroup or its name).

    Returns ``(out, lse)``: ``out`` (B, Hq, S_local, D_v) in q's dtype and ``lse``
    (B, Hq, S_local), float32 (float64 for float64 inputs), the natural-log
    log-sum-exp of the scaled scores over every key of the global sequence.
    With ``load_balanced`` the shards are in head-tail layout (rank r holds
    chunks r and 2N-1-r of 2N). K/V rotate with their own Hkv heads (GQA).
    ``rotate`` is "p2p", "alltoall", "allgather" or "auto" (chosen by
    cplib's cost model for these shapes, mask and group, agreed across the
    ranks, cached; cplib/strategy/; "p2p" with explicit positions or
    pass-Q); ``backend`` is None/"auto",
    "flash", "efficient" or "cudnn" (CUDA only; CPU always uses flash).
    Only ``out`` is differentiable.

    ``cu_seqlens`` (integer tensor ``[0, s1, ..., S]`` of global document
    boundaries, the same on every rank): attention stays within each document
    (causal within it with ``is_causal``). ``window``: ``(left, right)`` or
    ``w`` for ``(w, w)``; query i sees key j iff ``i - left <= j <= i + right``
    in global positions (``None`` on a side: no limit; ``is_causal`` makes
    right 0). ``seq_len``: the global length S when the shards are uneven
    (any S >= world size; see ``cplib.attention.layout``); by default S is the
    local length times the world size. Blocks nobody can see are neither
    computed nor sent (p2p and alltoall). ``per_document``: the shards are
    cut head-tail inside every document (``cplib.attention.layout`` with
    ``documents``; needs ``cu_seqlens`` and ``seq_len``). ``placement``: the
    shards are in the document placement of
    :class:`cplib.DocumentPlacementLoadBalancer` (documents kept whole on one
    rank where the balance allows; needs ``cu_seqlens`` and ``seq_len``).

    ``sinks`` (Hq,): attention sinks (gpt-oss), one logit per q head that
    joins every row's softmax denominator once and contributes no value;
    ``out`` and ``lse`` then include it. Differentiable in ``sinks`` too
    (its gradient covers this rank's rows).

    ``q_positions`` / ``kv_positions`` (1-D integer tensors, both or
    neither): the global positions of this rank's q rows and k/v rows, in
    local order, the same for every batch row. The mask is then read on them
    (causal: ``kv_pos <= q_pos``; the window and the documents likewise), the
    ranks may hold different lengths (zero queries too), and q and k/v may
    cover different tokens: T new queries against a persistent cache of P + T
    keys. They exclude ``load_balanced``, ``seq_len`` and ``per_document``.

    ``ring_pass``: "kv" rotates k/v (differentiable); "q" rotates the queries
    and returns each partial (out, lse) to its owner (forward only: cheaper
    when few new queries meet a long cache); "auto" picks the one that moves
    fewer bytes (:func:`ring_pass_auto`), and "kv" whenever a gradient is
    needed. The choice is logged at debug level on the "cplib" logger.

    ``attn_mask``: a key-padding mask (boolean, True = attend, or additive)
    of this rank's keys, broadcastable to (B, 1, 1, S_local); it travels with
    its K/V block (cplib/attention/key_padding.py). Other shapes raise
    NotImplementedError.

    Every call begins with cplib's handshake (see
    :func:`cplib.consistency_checks`): every rank raises the same error, or
    none does; its backward through autograd is covered by it (one handshake
    per fwd+bwd). Plain meta tensors on a real process group compute shapes
    only but take part in the handshake, so a rank on meta tensors beside
    ranks on real ones raises the same ValueError naming the device on every
    rank; under FakeTensorMode or torch.compile nothing communicates. On an
    NCCL group, call :func:`cplib.register_group` once on every rank so that
    the handshake runs in host memory (no wait for the GPU).
    """
    auto = isinstance(rotate, str) and rotate == "auto"
    inputs = ring_inputs(q, k, v, group,
                         is_causal=is_causal, load_balanced=load_balanced, scale=scale,
                         rotate="p2p" if auto else rotate, backend=backend,
                         cu_seqlens=cu_seqlens, window=window, seq_len=seq_len,
                         per_document=per_document, sinks=sinks, q_positions=q_positions,
                         kv_positions=kv_positions, ring_pass=ring_pass, attn_mask=attn_mask,
                         placement=placement)
    call = inputs.call
    if auto and not call.has_positions and call.ring_pass != "q":
        inputs = inputs.with_rotation(ring_rotation(inputs.q, inputs.k, inputs.v, call,
                                                    backward=inputs.grad))
    return ring_run(inputs)


def ring_rotation(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: RingCall, *,
                  backward: bool, auto: AutoStrategy | None = None) -> str:
    """``ring_sdpa(rotate="auto")``'s rotation for this call ("p2p" while
    torch.compile traces: the choice is host work a graph cannot hold, and
    every rotation computes the same result)."""
    if torch.compiler.is_compiling():
        return "p2p"
    auto = auto or _RING_AUTO
    w = workload_from_call(q, k, v, group_size(call.group_name), is_causal=call.is_causal,
                           window=call.window, seq_len=call.seq_len, layout=str(call.layout),
                           backward=backward, node_ranks=auto.ranks_per_node)
    chosen = choose_for_call(auto, call.group_name, w, call.cu_seqlens, q, ("ring",),
                             data_layout(str(call.layout), w.world_size),
                             record=auto is not _RING_AUTO)
    return chosen.rotate or "p2p"


# ring_sdpa's own strategy (no options): its choices are not recorded.
_RING_AUTO = AutoStrategy()
