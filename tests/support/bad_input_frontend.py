"""Bad input to the front end (shard, unshard, context_parallel and SDPA or
MultiheadAttention inside it, the _ContextParallel style, flex under the
style), for the matrix of tests/support/bad_input.py: (name, world size,
case, exception class, text every rank's message contains)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import cplib
from bad_input_ops import mesh


def _shard_on(bad_rank, **bad):
    def case(rank, g):
        kw = bad if bad_rank in (None, rank) else {}
        buf = torch.arange(kw.get("length", 16)).view(1, -1)
        cplib.shard(mesh(g), [buf], [kw.get("seq_dim", 1)])
    return case


def _unshard_on(bad_rank, **bad):
    def case(rank, g):
        kw = bad if bad_rank in (None, rank) else {}
        buf = torch.randn(1, 4, kw.get("features", 3))
        cplib.unshard(mesh(g), [buf], [kw.get("seq_dim", 1)])
    return case


def _cp_on(bad_rank, **bad):
    def case(rank, g):
        kw = bad if bad_rank in (None, rank) else {}
        buf = torch.arange(kw.pop("length", 16)).view(1, -1)
        with cplib.context_parallel(mesh(g), buffers=[buf], buffer_seq_dims=[1], **kw):
            pass
    return case


def _balancer(seq_length: int):
    from cplib.ring.load_balancer import _HeadTailLoadBalancer
    return _HeadTailLoadBalancer(seq_length, 2, "cpu")


def _unshard_lengths(*per_rank, seq_length=16, entry=cplib.unshard):
    """Unshard of a (1, per_rank[rank]) shard with a head-tail balancer of
    ``seq_length``: lengths that are not its layout."""
    def case(rank, g):
        entry(mesh(g), [torch.randn(1, per_rank[rank])], [1], _balancer(seq_length))
    return case


def _shard_balanced(rank, g):
    cplib.shard(mesh(g), [torch.arange(12).view(1, -1)], [1], _balancer(16))


def _cp_sdpa_on(bad_rank, ulysses_degree=1, **bad):
    """F.scaled_dot_product_attention inside context_parallel, with ``bad``
    arguments on ``bad_rank`` only (rejected before the ring's handshake)."""
    def case(rank, g):
        import torch.nn.functional as F

        kw = bad if rank == bad_rank else {}
        q = torch.randn(1, 4, 16, 4)
        with cplib.context_parallel(mesh(g), buffers=[q], buffer_seq_dims=[2],
                                    ulysses_degree=ulysses_degree):
            F.scaled_dot_product_attention(q, q, q, **kw)
    return case


def _cp_mha_need_weights_on_rank_1(rank, g):
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(1, 16, 8)
    with cplib.context_parallel(mesh(g), buffers=[x], buffer_seq_dims=[1]):
        mha(x, x, x, need_weights=rank == 1)


class _Attention(torch.nn.Module):
    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def _style(seq_dim=2, ulysses_degree=1, flex=False):
    kind = cplib._ContextParallel.AttentionType
    return cplib._ContextParallel(seq_dim=seq_dim, ulysses_degree=ulysses_degree,
                                  attention_type=kind.FLEX if flex else kind.SDPA)


def _style_on(bad_rank, **bad):
    """parallelize_module with ``bad`` style arguments on ``bad_rank`` (None:
    every rank), then a forward (which the style's checks must stop on every
    rank)."""
    def case(rank, g):
        from torch.distributed.tensor.parallel import parallelize_module

        attn = parallelize_module(_Attention(), mesh(g),
                                  _style(**(bad if bad_rank in (None, rank) else {})))
        q = torch.randn(1, 2, 8, 4)
        cplib._enable_context_parallel_dispatcher()
        try:
            attn(q, q, q)
        finally:
            cplib._disable_context_parallel_dispatcher()
    return case


def _style_dispatcher_on_rank_0(rank, g):
    from torch.distributed.tensor.parallel import parallelize_module

    attn = parallelize_module(_Attention(), mesh(g), _style())
    q = torch.randn(1, 2, 8, 4)
    if rank == 0:
        cplib._enable_context_parallel_dispatcher()
    try:
        attn(q, q, q)
    finally:
        cplib._disable_context_parallel_dispatcher()


class _FlexAttention(torch.nn.Module):
    def forward(self, q, k, v):
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(q, k, v)


def _flex_style_key_dim_on_rank_1(rank, g):
    """flex's own check fails in rank 1's flex call; rank 0's call's
    handshake raises it too."""
    from torch.distributed.tensor.parallel import parallelize_module

    probe = parallelize_module(_FlexAttention(), mesh(g), _style(flex=True))
    q = torch.randn(1, 2, 4, 4)
    probe(q, torch.randn(1, 2, 4, 8) if rank == 1 else q, q)


def _cp_modules_on_rank_1(rank, g):
    buf = torch.arange(16).view(1, -1)
    with cplib.context_parallel(mesh(g), buffers=[buf], buffer_seq_dims=[1],
                                modules=[torch.nn.Linear(2, 2)] if rank == 1 else None):
        pass


def _shard_destroyed_mesh(rank, g):
    doomed = dist.new_group(list(range(dist.get_world_size())))
    doomed_mesh = mesh(doomed)
    dist.destroy_process_group(doomed)
    cplib.shard(doomed_mesh, [torch.arange(16).view(1, -1)], [1])


FRONTEND_CASES = [
    # shard / unshard
    ("shard/same/seq-dim-float", 2, _shard_on(None, seq_dim=1.0), ValueError,
     "must be an int"),
    ("shard/one/seq-dim", 2, _shard_on(1, seq_dim=3), ValueError, "out of range"),
    ("shard/disagree/length", 2, _shard_on(1, length=12), ValueError,
     "disagree on buffer 0.size(1) (rank 0: 16, rank 1: 12)"),
    ("unshard/one/seq-dim", 2, _unshard_on(1, seq_dim=7), ValueError, "out of range"),
    ("unshard/disagree/features", 2, _unshard_on(1, features=5), ValueError,
     "disagree on buffer 0.size(2)"),
    # Shard lengths that are not the load balancer's layout: every rank raises
    # before the all-gather (gloo aborted on one rank, the other returned zeros).
    ("unshard/disagree/length-vs-balancer", 2, _unshard_lengths(8, 6), ValueError,
     "shards have lengths [8, 6] along seq_dim 1"),
    ("unshard/same/length-vs-balancer", 2, _unshard_lengths(6, 6), ValueError,
     "layout of seq_length=16 over 2 ranks needs [8, 8]"),
    ("cp-unshard/disagree/length-vs-balancer", 2,
     _unshard_lengths(8, 6, entry=cplib.context_parallel_unshard), ValueError,
     "context_parallel_unshard: buffer 0's shards have lengths [8, 6]"),
    ("shard/same/length-vs-balancer", 2, _shard_balanced, ValueError, "seq_length=16"),
    # context_parallel
    ("cp/same/ulysses-degree", 2, _cp_on(None, ulysses_degree=3), ValueError, "ulysses_degree"),
    ("cp/one/load-balance", 2, _cp_on(1, load_balance="x"), ValueError, "load_balance='x'"),
    ("cp/one/rotate", 2, _cp_on(1, rotate_method=3), NotImplementedError, "rotation"),
    ("cp/disagree/ulysses-degree", 2, _cp_on(1, ulysses_degree=2), ValueError,
     "disagree on ulysses_degree (rank 0: 1, rank 1: 2)"),
    ("cp/disagree/buffer-length", 2, _cp_on(1, length=12), ValueError,
     "disagree on buffer 0.size(1) (rank 0: 16, rank 1: 12)"),
    ("cp/disagree/rotate", 2, _cp_on(1, rotate_method="allgather"), ValueError,
     "disagree on rotate_method"),
    ("cp/one/modules", 2, _cp_modules_on_rank_1, ValueError, "has no _cp_plan"),
    # Arguments the Python wrappers reject on one rank, before the op the
    # other ranks are in: the error travels in that op's handshake.
    ("cp-sdpa/one/dropout", 2, _cp_sdpa_on(1, dropout_p=0.5), NotImplementedError,
     "invalid input on rank 1: cplib: context-parallel SDPA does not support dropout "
     "(dropout_p=0.5)"),
    ("cp-sdpa/one/query-mask", 2, _cp_sdpa_on(1, attn_mask=torch.ones(16, 16, dtype=torch.bool)),
     NotImplementedError, "attn_mask (got (16, 16))"),
    ("usp/one/cp-dropout", 4, _cp_sdpa_on(3, ulysses_degree=2, dropout_p=0.5),
     NotImplementedError, "dropout_p=0.5"),
    ("cp-mha/one/need-weights", 2, _cp_mha_need_weights_on_rank_1, NotImplementedError,
     "need_weights=False"),
    ("style/one/seq-dim", 2, _style_on(1, seq_dim=1), NotImplementedError, "seq_dim=1"),
    # One of issue 53's two aborts at exit.
    ("style/same/ulysses-degree", 2, _style_on(None, ulysses_degree=3), ValueError,
     "invalid input on every rank (rank 0's error): cplib: ulysses_degree=3 does not divide "
     "the context-parallel world size 2"),
    ("style/disagree/ulysses-degree", 2, _style_on(1, ulysses_degree=2), ValueError,
     "disagree on ulysses_degree (rank 0: 1, rank 1: 2)"),
    ("style/one/dispatcher-off", 2, _style_dispatcher_on_rank_0, RuntimeError,
     "invalid input on rank 1: cplib: this module was parallelized with _ContextParallel but "
     "the context parallel dispatcher is off"),
    ("flex-style/one/key-dim", 2, _flex_style_key_dim_on_rank_1, ValueError,
     "same embedding dimension"),
    # Groups this rank cannot use, named
    ("shard/same/destroyed-mesh", 2, _shard_destroyed_mesh, ValueError,
     "the process group of the device mesh (registered as '"),
]
