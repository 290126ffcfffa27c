"""Step 1 of ``context_parallel``: every argument checked on every rank
before any collective, and the layout chosen (``ContextPlan``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.args import window_arg
from ..diffusers.plans import plan_of
from .documents import context_documents
from ..ring.load_balancer import (
    AnyLengthHeadTailLoadBalancer,
    AnyLengthPerDocumentLoadBalancer,
    _LoadBalancer,
)
from ..attention.names import Layout, layout_of
from ..ring.placement import DocumentPlacementLoadBalancer
from .options import _cp_options, _RotateMethod, parse_rotate_method
from .sharding import check_shardable
from ..ulysses.usp_layout import UspLoadBalancer, check_degrees

__all__ = ["ContextPlan", "plan_context"]


def _validate(buffers: list, seq_dims: list, no_restore: list, world_size: int,
              load_balance: bool | None, ring_degree: int, enclosing: list) -> bool:
    """All argument checks, from shapes alone (identical on every rank), and
    against the buffers that enclosing contexts hold sharded (``enclosing``).
    Returns whether the head-tail layout (over ``ring_degree`` positions) is used."""
    if len(buffers) != len(seq_dims):
        raise ValueError(
            f"cplib.context_parallel: buffer_seq_dims has {len(seq_dims)} entries but there are "
            f"{len(buffers)} buffers; give one sequence dim per buffer"
        )
    for i, b in enumerate(buffers):
        if isinstance(b, torch.Tensor) and (b.requires_grad or isinstance(b, torch.nn.Parameter)):
            raise ValueError(
                f"cplib.context_parallel: buffer {i} (shape {tuple(b.shape)}) requires grad; "
                "buffers are resharded in place, so pass inputs (ids, labels, positions), not "
                "parameters or tensors that require grad"
            )
        if any(b is other for other in buffers[:i]):
            raise ValueError(f"cplib.context_parallel: buffer {i} is listed twice")
        if any(b is other for other in enclosing):
            raise ValueError(
                f"cplib.context_parallel: buffer {i} (shape {tuple(b.shape)}) is already "
                "sharded by an enclosing context_parallel; a nested one would shard its "
                "shard again: give each buffer to one context")
    for t in no_restore:
        if not any(t is b for b in buffers):
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"cplib.context_parallel: no_restore_buffers must be a subset of buffers; a "
                f"tensor of shape {shape} is not one of the buffers"
            )
    check_shardable(buffers, seq_dims, world_size, any_length=True)
    if not buffers:
        return bool(_cp_options.enable_load_balance if load_balance is None else load_balance)
    lengths = [b.shape[d] for b, d in zip(buffers, seq_dims)]
    wanted = _cp_options.enable_load_balance if load_balance is None else load_balance
    divisible = all(length % (2 * ring_degree) == 0 for length in lengths)
    same = len(set(lengths)) == 1
    if load_balance and not same:
        raise ValueError(
            f"cplib.context_parallel: load_balance=True needs every buffer's sequence length to "
            f"be the same; got lengths {lengths}"
        )
    if ring_degree != world_size and not same:
        # Joint streams of different lengths: sequential shards, whose uneven
        # rows the (non-causal) Ulysses exchange and the ring learn per call.
        return False
    if load_balance:
        return True  # head-tail for any length (chunks within one token of each other)
    # Without an explicit request, fall back to sequential sharding as torch does.
    return bool(wanted and divisible and same)


@dataclass(frozen=True)
class ContextPlan:
    """What step 1 of ``context_parallel`` decided, before any collective."""

    seq_dims: list[int]
    no_restore: list[torch.Tensor]
    rotate: _RotateMethod
    ring_degree: int
    layout: Layout         # of the ring's shards
    balanced: bool         # load balancing in effect
    seq_len: int | None    # the buffers' one length (None: no buffers)
    one_length: bool       # every buffer has it (else joint streams, each cut on its own)
    documents: torch.Tensor | None  # cu_seqlens, global
    window: list[int] | None
    balancer: _LoadBalancer | None
    indices: torch.Tensor | None    # the balancer's permutation


def plan_context(buffers: list[torch.Tensor], world_size: int, buffer_seq_dims, no_restore_buffers,
          rotate_method, load_balance, ulysses_degree: int, cu_seqlens, position_ids, window,
          modules, enclosing: list[torch.Tensor]) -> ContextPlan:
    """Step 1 of ``context_parallel``, on every rank before any collective:
    every argument checked (ValueError naming it), and the layout chosen: the
    sequence dims, the buffers not to restore, the rotation, the ring degree,
    the layout of the shards, the global length, the documents, the window
    and the load balancer with its indices. ``enclosing``: the buffers that
    enclosing contexts hold sharded, none of which may be sharded again."""
    if buffer_seq_dims is None and buffers:
        raise ValueError(f"cplib.context_parallel: buffer_seq_dims is None but there are "
                         f"{len(buffers)} buffers; give one sequence dim per buffer")
    seq_dims = [] if buffer_seq_dims is None else list(buffer_seq_dims)
    no_restore = [] if no_restore_buffers is None else list(no_restore_buffers)
    rotate = parse_rotate_method(_cp_options.rotate_method if rotate_method is None
                                 else rotate_method)
    ring_degree = check_degrees(world_size, ulysses_degree)
    # load_balance's strings are the documents layouts' names.
    per_document = isinstance(load_balance, str) and load_balance == Layout.PER_DOCUMENT
    placement = isinstance(load_balance, str) and load_balance == Layout.PLACEMENT
    if not (load_balance is None or isinstance(load_balance, bool) or per_document or placement):
        raise ValueError(f"cplib.context_parallel: load_balance={load_balance!r} is not "
                         "True, False, None, 'per_document' or 'placement'")
    if modules and (load_balance or per_document):
        raise ValueError(f"cplib.context_parallel: modules= shards sequentially (the "
                         f"model's _cp_plan cuts each input in rank order); "
                         f"load_balance={load_balance!r} does not apply; leave it None or "
                         "False")
    for i, m in enumerate(modules):  # checked again on entry; here on every rank alike
        plan_of(m, i)
    balanced = _validate(buffers, seq_dims, no_restore, world_size,
                         True if per_document or placement
                         else (False if modules else load_balance),
                         ring_degree, enclosing)
    seq_len = buffers[0].shape[seq_dims[0]] if buffers else None
    # Buffers of different lengths (text and image tokens) have no one
    # global length: the attention ops then learn every rank's rows.
    one_length = len({b.shape[d] for b, d in zip(buffers, seq_dims)}) <= 1
    documents = context_documents(cu_seqlens, position_ids, seq_len)
    if (per_document or placement) and documents is None:
        raise ValueError(f"cplib.context_parallel: load_balance={load_balance!r} needs the "
                         "documents (cu_seqlens or position_ids)")
    if placement and ulysses_degree != 1:
        raise NotImplementedError(f"cplib.context_parallel: load_balance='placement' with "
                                  f"ulysses_degree={ulysses_degree}: the placement is a ring "
                                  "layout; use ulysses_degree=1 or load_balance='per_document'")
    sides = None
    if window is not None:
        sides = window_arg(window)  # ValueError naming a bad window, before any sharding
    balancer = None
    if not one_length:
        pass  # sequential shards of every buffer, each cut on its own
    elif ulysses_degree != 1 and buffers and (balanced or seq_len % world_size):
        # USP: the ring layout over N/U positions, each ring shard cut in U pieces.
        balancer = UspLoadBalancer(seq_len, world_size, ulysses_degree, buffers[0].device,
                                   head_tail=balanced,
                                   documents=documents.tolist() if per_document else None)
    elif per_document:
        balancer = AnyLengthPerDocumentLoadBalancer(documents.tolist(), world_size,
                                                    buffers[0].device)
    elif placement:
        balancer = DocumentPlacementLoadBalancer(documents.tolist(), world_size,
                                                 buffers[0].device)
    elif balanced and buffers:
        balancer = AnyLengthHeadTailLoadBalancer(seq_len, world_size, buffers[0].device)
    indices = balancer._generate_indices() if balancer is not None else None
    layout = layout_of("context_parallel", balanced, per_document,
                       isinstance(balancer, DocumentPlacementLoadBalancer))
    return ContextPlan(seq_dims, no_restore, rotate, ring_degree, layout, balanced, seq_len,
                       one_length, documents, sides, balancer, indices)
