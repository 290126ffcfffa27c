"""Bad input to every public communicating op and to context_parallel, in
three kinds: the same bad input on every rank, bad input on one rank, and
ranks whose calls disagree. Every rank must raise the same exception class,
quickly, naming what is wrong; no rank may hang or die. The ranks' process
groups time out after 15 s, so a regression fails here instead of hanging CI.

All cases of a world size run in one spawn (each case on a fresh group, so a
case that went wrong cannot misalign the next); the parametrized tests then
read their case's outcome."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import cplib
from cplib.comm.native import ops  # raises a kernel's error as its Python class
from harness import RankPool

_TIMEOUT_S = 15.0
_QUICK_S = 5.0  # a handshake answers in milliseconds; the timeout is 15 s


def _qkv(rank: int, *, b=1, h=2, hkv=None, length=8, d=4, dtype=torch.float32):
    torch.manual_seed(0)
    q = torch.randn(b, h, length, d).to(dtype)
    kv = torch.randn(b, h if hkv is None else hkv, length, d).to(dtype)
    return q, kv, kv.clone()


def _ring(rank, g, **kw):
    shape = {k: kw.pop(k) for k in ("b", "h", "hkv", "length", "d", "dtype") if k in kw}
    q, k, v = _qkv(rank, **shape)
    cplib.ring_sdpa(q, k, v, g, **kw)


def _ring_on(bad_rank, **bad):
    """ring_sdpa with ``bad`` arguments on ``bad_rank`` (None: every rank)."""
    def case(rank, g):
        _ring(rank, g, **(bad if bad_rank in (None, rank) else {}))
    return case


def _ring_by_rank(*per_rank):
    """ring_sdpa with the arguments ``per_rank[rank]``."""
    def case(rank, g):
        _ring(rank, g, **dict(per_rank[rank]))
    return case


def _ring_backward_causal(rank, g):
    q, k, v = _qkv(rank)
    out, lse = cplib.ring_sdpa(q, k, v, g, is_causal=True)
    ops.ring_sdpa_backward(torch.ones_like(out), q, k, v, out, lse, g.group_name, rank == 0)


def _ring_other_group(rank, g):
    # Two group objects over the same ranks: each rank passes its own.
    other = dist.new_group(list(range(dist.get_world_size())))
    _ring(rank, g if rank == 0 else other)


def _ring_destroyed(rank, g):
    doomed = dist.new_group(list(range(dist.get_world_size())))
    dist.destroy_process_group(doomed)
    _ring(rank, doomed)


def _ring_meta_cu_seqlens(rank, g):
    _ring(rank, g, cu_seqlens=torch.tensor([0, 5, 16], device="meta"))


def _ring_vs_ulysses(rank, g):
    q, k, v = _qkv(rank)
    if rank == 0:
        cplib.ring_sdpa(q, k, v, g)
    else:
        cplib.ulysses_sdpa(q, k, v, g)


def _ulysses_on(bad_rank, is_causal=False, **bad):
    def case(rank, g):
        shape = bad if bad_rank in (None, rank) else {}
        cplib.ulysses_sdpa(*_qkv(rank, **shape), g, is_causal=is_causal)
    return case


def _usp_same_group(rank, g):
    cplib.usp_sdpa(*_qkv(rank), g, g, is_causal=True)


def _usp_one_bad_scale(rank, g):
    from cplib.ulysses.usp_layout import usp_groups

    groups = usp_groups(g, 2)  # 2 x 2: ranks 0 and 2 (and 1 and 3) never meet in Ulysses
    cplib.usp_sdpa(*_qkv(rank), groups.ulysses_group, groups.ring_group,
                   scale=float("nan") if rank == 3 else None)


def _flex_on(bad_rank, **bad):
    def case(rank, g):
        kw = bad if bad_rank in (None, rank) else {}
        k = torch.randn(1, 2, kw.get("length", 4), 4).to(kw.get("dtype", torch.float32))
        cplib.flex_cp_allgather(k, k.clone(), kw.get("seq_dim", 2), g)
    return case


def _conv_on(bad_rank, **bad):
    def case(rank, g):
        kw = bad if bad_rank in (None, rank) else {}
        channels = kw.pop("channels", 3)
        x = torch.randn(1, channels, 8, 8)
        w = torch.randn(4, channels, 3, 3)
        cplib.tp_conv(x, w, padding=kw.get("padding", 1), stride=kw.get("stride", 1),
                      dim=kw.get("dim", -1), group=g)
    return case


def _mesh(g):
    from torch.distributed.device_mesh import DeviceMesh
    return DeviceMesh.from_group(g, "cpu")


def _shard_on(bad_rank, **bad):
    def case(rank, g):
        kw = bad if bad_rank in (None, rank) else {}
        buf = torch.arange(kw.get("length", 16)).view(1, -1)
        cplib.shard(_mesh(g), [buf], [kw.get("seq_dim", 1)])
    return case


def _unshard_on(bad_rank, **bad):
    def case(rank, g):
        kw = bad if bad_rank in (None, rank) else {}
        buf = torch.randn(1, 4, kw.get("features", 3))
        cplib.unshard(_mesh(g), [buf], [kw.get("seq_dim", 1)])
    return case


def _cp_on(bad_rank, **bad):
    def case(rank, g):
        kw = bad if bad_rank in (None, rank) else {}
        buf = torch.arange(kw.pop("length", 16)).view(1, -1)
        with cplib.context_parallel(_mesh(g), buffers=[buf], buffer_seq_dims=[1], **kw):
            pass
    return case


def _balancer(seq_length: int):
    from cplib.ring.load_balancer import _HeadTailLoadBalancer
    return _HeadTailLoadBalancer(seq_length, 2, "cpu")


def _unshard_lengths(*per_rank, seq_length=16, entry=cplib.unshard):
    """Unshard of a (1, per_rank[rank]) shard with a head-tail balancer of
    ``seq_length``: lengths that are not its layout."""
    def case(rank, g):
        entry(_mesh(g), [torch.randn(1, per_rank[rank])], [1], _balancer(seq_length))
    return case


def _shard_balanced(rank, g):
    cplib.shard(_mesh(g), [torch.arange(12).view(1, -1)], [1], _balancer(16))


def _cp_sdpa_on(bad_rank, ulysses_degree=1, **bad):
    """F.scaled_dot_product_attention inside context_parallel, with ``bad``
    arguments on ``bad_rank`` only (rejected before the ring's handshake)."""
    def case(rank, g):
        import torch.nn.functional as F

        kw = bad if rank == bad_rank else {}
        q = torch.randn(1, 4, 16, 4)
        with cplib.context_parallel(_mesh(g), buffers=[q], buffer_seq_dims=[2],
                                    ulysses_degree=ulysses_degree):
            F.scaled_dot_product_attention(q, q, q, **kw)
    return case


def _cp_mha_need_weights_on_rank_1(rank, g):
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(1, 16, 8)
    with cplib.context_parallel(_mesh(g), buffers=[x], buffer_seq_dims=[1]):
        mha(x, x, x, need_weights=rank == 1)


class _Attention(torch.nn.Module):
    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def _style(seq_dim=2, ulysses_degree=1, flex=False):
    kind = cplib._ContextParallel.AttentionType
    return cplib._ContextParallel(seq_dim=seq_dim, ulysses_degree=ulysses_degree,
                                  attention_type=kind.FLEX if flex else kind.SDPA)


def _style_on(bad_rank, **bad):
    """parallelize_module with ``bad`` style arguments on ``bad_rank``, then a
    forward (which the style's checks must stop on every rank)."""
    def case(rank, g):
        from torch.distributed.tensor.parallel import parallelize_module

        attn = parallelize_module(_Attention(), _mesh(g),
                                  _style(**(bad if rank == bad_rank else {})))
        q = torch.randn(1, 2, 8, 4)
        cplib._enable_context_parallel_dispatcher()
        try:
            attn(q, q, q)
        finally:
            cplib._disable_context_parallel_dispatcher()
    return case


def _style_dispatcher_on_rank_0(rank, g):
    from torch.distributed.tensor.parallel import parallelize_module

    attn = parallelize_module(_Attention(), _mesh(g), _style())
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

    probe = parallelize_module(_FlexAttention(), _mesh(g), _style(flex=True))
    q = torch.randn(1, 2, 4, 4)
    probe(q, torch.randn(1, 2, 4, 8) if rank == 1 else q, q)


def _mask_on(entry, bad_rank):
    """A mask that is not a key padding (it varies with the query) on
    ``bad_rank``; a key-padding one elsewhere."""
    def case(rank, g):
        q, k, v = _qkv(rank)
        mask = torch.ones(1, 1, 8, 8, dtype=torch.bool) if rank == bad_rank else \
            torch.ones(1, 1, 1, 8, dtype=torch.bool)
        entry(q, k, v, g, attn_mask=mask)
    return case


def _cp_modules_on_rank_1(rank, g):
    buf = torch.arange(16).view(1, -1)
    with cplib.context_parallel(_mesh(g), buffers=[buf], buffer_seq_dims=[1],
                                modules=[torch.nn.Linear(2, 2)] if rank == 1 else None):
        pass


def _ring_non_member(rank, g):
    # Each rank passes the group made of the other one: new_group returns
    # GroupMember.NON_GROUP_MEMBER (an int) to the ranks it leaves out.
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    _ring(rank, groups[1 - rank])


def _shard_destroyed_mesh(rank, g):
    doomed = dist.new_group(list(range(dist.get_world_size())))
    mesh = _mesh(doomed)
    dist.destroy_process_group(doomed)
    cplib.shard(mesh, [torch.arange(16).view(1, -1)], [1])


# (name, world size, case, exception class, text every rank's message contains)
CASES = [
    # ring_sdpa: the same bad input everywhere
    ("ring/same/scale-negative", 2, _ring_on(None, scale=-1.0), ValueError, "scale=-1.0"),
    ("ring/same/scale-tensor", 2, _ring_on(None, scale=torch.ones(2)), ValueError,
     "scale must be a number"),
    ("ring/same/rotate-list", 2, _ring_on(None, rotate=["p2p"]), ValueError, "rotate=['p2p']"),
    ("ring/same/window-float", 2, _ring_on(None, window=1.5), ValueError, "window=1.5"),
    ("ring/same/window-tensor", 2, _ring_on(None, window=torch.tensor(3)), ValueError, "window="),
    ("ring/same/window-side-float", 2, _ring_on(None, window=(2, 0.5)), ValueError, "window="),
    ("ring/same/cu-seqlens-list", 2, _ring_on(None, cu_seqlens=[0, 16]), ValueError,
     "cu_seqlens must be a torch.Tensor"),
    ("ring/same/seq-len-float", 2, _ring_on(None, seq_len=16.0), ValueError, "seq_len"),
    ("ring/same/batch-zero", 2, _ring_on(None, b=0), ValueError, "empty batch"),
    ("ring/same/complex", 2, _ring_on(None, dtype=torch.complex64), ValueError,
     "unsupported dtype"),
    ("ring/same/meta-cu-seqlens", 2, _ring_meta_cu_seqlens, ValueError, "meta device"),
    ("ring/same/destroyed-group", 2, _ring_destroyed, ValueError, "destroyed"),
    # ring_sdpa: bad on rank 1 only
    ("ring/one/scale-nan", 2, _ring_on(1, scale=float("nan")), ValueError,
     "invalid input on rank 1"),
    ("ring/one/dtype-int", 2, _ring_on(1, dtype=torch.int64), ValueError, "unsupported dtype"),
    ("ring/one/rotate", 2, _ring_on(1, rotate="ring"), ValueError, "rotate='ring'"),
    ("ring/one/window", 2, _ring_on(1, window=-1), ValueError, "window=-1"),
    ("ring/one/cu-seqlens", 2, _ring_on(1, cu_seqlens=torch.tensor([0, 9, 3, 16])), ValueError,
     "strictly increasing"),
    ("ring/one/heads", 2, _ring_on(1, h=3, hkv=2), ValueError, "not a multiple"),
    ("ring/one/odd-length-balanced", 2, _ring_on(1, length=7, load_balanced=True), ValueError,
     "load_balanced needs even"),
    # ring_sdpa: ranks disagree
    ("ring/disagree/is-causal", 2, _ring_on(1, is_causal=True), ValueError,
     "disagree on is_causal (rank 0: False, rank 1: True)"),
    ("ring/disagree/load-balanced", 2, _ring_on(1, load_balanced=True), ValueError,
     "disagree on layout"),
    # Non-causal ranks may hold different lengths (joint streams); causal ones may not.
    ("ring/disagree/length", 2, _ring_by_rank({"is_causal": True}, {"is_causal": True,
                                                                     "length": 6}), ValueError,
     "disagree on q.size(2) (rank 0: 8, rank 1: 6)"),
    ("ring/disagree/heads", 2, _ring_on(1, h=4, hkv=4), ValueError, "disagree on q.size(1)"),
    ("ring/disagree/kv-heads", 2, _ring_on(1, hkv=1), ValueError, "disagree on k.size(1)"),
    ("ring/disagree/batch", 2, _ring_on(1, b=2), ValueError, "disagree on q.size(0)"),
    ("ring/disagree/head-dim", 2, _ring_on(1, d=8), ValueError, "disagree on q.size(3)"),
    ("ring/disagree/dtype", 2, _ring_on(1, dtype=torch.float64), ValueError,
     "disagree on q.dtype (rank 0: Float, rank 1: Double)"),
    ("ring/disagree/rotate", 2, _ring_on(1, rotate="allgather"), ValueError,
     "disagree on rotate"),
    ("ring/disagree/window-given", 2, _ring_on(1, window=2), ValueError, "window is not None"),
    ("ring/disagree/window", 2, _ring_by_rank({"window": 2}, {"window": 3}), ValueError,
     "disagree on window[0] (rank 0: 2, rank 1: 3)"),
    ("ring/disagree/cu-seqlens-one-rank", 2, _ring_on(1, cu_seqlens=torch.tensor([0, 5, 16])),
     ValueError, "cu_seqlens is not None"),
    ("ring/disagree/cu-seqlens", 2,
     _ring_by_rank({"cu_seqlens": torch.tensor([0, 5, 16])},
                   {"cu_seqlens": torch.tensor([0, 6, 16])}), ValueError,
     "disagree on cu_seqlens (hash of its values)"),
    ("ring/disagree/group-objects", 2, _ring_other_group, ValueError,
     "different process groups"),
    ("ring-backward/disagree/is-causal", 2, _ring_backward_causal, ValueError,
     "ring_sdpa_backward: ranks disagree on is_causal"),
    ("ops/disagree/ring-vs-ulysses", 2, _ring_vs_ulysses, ValueError, "different ops"),
    # Ulysses and USP
    ("ulysses/same/heads", 2, _ulysses_on(None, h=3, hkv=3), ValueError,
     "cannot be split over the Ulysses degree 2"),
    ("ulysses/one/heads", 2, _ulysses_on(1, h=3, hkv=3), ValueError, "invalid input on rank 1"),
    ("ulysses/disagree/length", 2, _ulysses_on(1, is_causal=True, length=6), ValueError,
     "disagree on q.size(2) (rank 0: 8, rank 1: 6)"),
    ("usp/same/one-group-twice", 2, _usp_same_group, ValueError, "share 2 ranks"),
    ("usp/one/scale", 4, _usp_one_bad_scale, ValueError, "scale=nan"),
    # flex_cp_allgather
    ("flex/same/complex", 2, _flex_on(None, dtype=torch.complex64), ValueError,
     "expected a floating dtype"),
    ("flex/same/seq-dim-float", 2, _flex_on(None, seq_dim=2.0), ValueError,
     "seq_dim must be an int"),
    ("flex/one/seq-dim", 2, _flex_on(1, seq_dim=5), ValueError, "seq_dim=5"),
    ("flex/disagree/length", 2, _flex_on(1, length=5), ValueError, "disagree on k.size(2)"),
    # tp_conv
    ("conv/same/stride-float", 2, _conv_on(None, stride=1.5), ValueError, "stride=1.5"),
    ("conv/one/padding", 2, _conv_on(1, padding=-1), ValueError, "padding"),
    ("conv/one/channel-dim", 2, _conv_on(1, dim=1), NotImplementedError, "channel dim"),
    ("conv/disagree/channels", 2, _conv_on(1, channels=2), ValueError, "disagree on x.size(1)"),
    ("conv/disagree/padding", 2, _conv_on(1, padding=2), ValueError, "disagree on padding[0]"),
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
    ("ring/one/query-mask", 2, _mask_on(cplib.ring_sdpa, 1), NotImplementedError,
     "attn_mask (got (1, 1, 8, 8))"),
    ("ulysses/one/query-mask", 2, _mask_on(cplib.ulysses_sdpa, 1), NotImplementedError,
     "attn_mask (got (1, 1, 8, 8))"),
    ("style/one/seq-dim", 2, _style_on(1, seq_dim=1), NotImplementedError, "seq_dim=1"),
    ("style/disagree/ulysses-degree", 2, _style_on(1, ulysses_degree=2), ValueError,
     "disagree on ulysses_degree (rank 0: 1, rank 1: 2)"),
    ("style/one/dispatcher-off", 2, _style_dispatcher_on_rank_0, RuntimeError,
     "invalid input on rank 1: cplib: this module was parallelized with _ContextParallel but "
     "the context parallel dispatcher is off"),
    ("flex-style/one/key-dim", 2, _flex_style_key_dim_on_rank_1, ValueError,
     "same embedding dimension"),
    # Groups this rank cannot use, named
    ("ring/same/not-a-member", 2, _ring_non_member, ValueError,
     "group=GroupMember.NON_GROUP_MEMBER (-100): this process is not a member"),
    ("shard/same/destroyed-mesh", 2, _shard_destroyed_mesh, ValueError,
     "the process group of the device mesh (registered as '"),
]

_BY_NAME = {c[0]: c for c in CASES}


def _run_cases(names: list[str]) -> dict[str, tuple[str | None, str, float]]:
    """Every case on a fresh group: (exception class, message, seconds)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for name in names:
        g = dist.new_group(list(range(n)))
        start = time.monotonic()
        try:
            _BY_NAME[name][2](rank, g)
            out[name] = (None, "", time.monotonic() - start)
        except Exception as exc:  # the outcome is what the test checks
            out[name] = (type(exc).__name__, str(exc), time.monotonic() - start)
    return out


_outcomes: dict[int, list[dict]] = {}


def _outcome(world_size: int, name: str) -> list[tuple[str | None, str, float]]:
    if world_size not in _outcomes:
        pool = RankPool(world_size, timeout_s=_TIMEOUT_S)
        try:
            _outcomes[world_size] = pool.run(
                _run_cases, [c[0] for c in CASES if c[1] == world_size])
        finally:
            pool.close()
    return [per_rank[name] for per_rank in _outcomes[world_size]]


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_every_rank_raises_alike(name):
    _, world_size, _, exc_type, text = _BY_NAME[name]
    outcome = _outcome(world_size, name)
    for rank, (cls, msg, seconds) in enumerate(outcome):
        assert cls == exc_type.__name__, f"rank {rank}: {cls}: {msg}"
        assert text in msg, f"rank {rank}: {msg!r} lacks {text!r}"
        assert seconds < _QUICK_S, f"rank {rank} took {seconds:.1f} s: {msg}"
    assert len({msg for _, msg, _ in outcome}) == 1 or name.startswith("usp/"), outcome


def _unshard_without_handshake() -> None:
    # A world of one makes no handshake: the shard is checked on its own.
    from cplib.ring.load_balancer import _HeadTailLoadBalancer
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    with pytest.raises(ValueError, match=r"buffer 0 has length 12 along seq_dim 1 on rank 0, but "
                                         r"the load balancer's layout of seq_length=16 over 1 "
                                         r"ranks gives it 16"):
        cplib.unshard(mesh, [torch.randn(1, 12)], [1], _HeadTailLoadBalancer(16, 1, "cpu"))
    full = torch.randn(1, 16)
    torch.testing.assert_close(cplib.unshard(mesh, [full], [1],
                                             _HeadTailLoadBalancer(16, 1, "cpu"))[0], full)


def test_unshard_checks_its_own_length_without_handshake(threaded):
    threaded(1, _unshard_without_handshake)


# ---------------------------------------------------------------- no communication


def test_merge_rejects_meta_and_expanded_out():
    out, lse = torch.zeros(1, 2, 4, 8), torch.full((1, 2, 4), float("-inf"))
    blk, blk_lse = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4)
    with pytest.raises(ValueError, match="blk_out on the meta device"):
        cplib.merge_partial_(out, lse, blk.to("meta"), blk_lse)
    with pytest.raises(ValueError, match="inputs mix the meta device"):
        ops.merge_partial_(out, lse, blk.to("meta"), blk_lse)
    expanded = torch.zeros(1, 2, 1, 8).expand(1, 2, 4, 8)
    with pytest.raises(ValueError, match="out .*share memory"):
        cplib.merge_partial_(expanded, lse, blk, blk_lse)
    cplib.merge_partial_(out, lse, blk, blk_lse)  # the valid call still merges
    torch.testing.assert_close(out, blk)


def test_fake_kernel_rejects_real_tensors_beside_meta():
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="inputs mix the meta device"):
        ops.ring_sdpa(q, q, q, "0", cu_seqlens=torch.tensor([0, 16], device="meta"))


def test_load_balancers_name_bad_arguments():
    from cplib.ring.load_balancer import (
        AnyLengthPerDocumentLoadBalancer,
        _HeadTailLoadBalancer,
        _PerDocumentHeadTailLoadBalancer,
        _PTRRLoadBalancer,
    )

    with pytest.raises(ValueError, match=r"cu_seqlens=\[0, 10, 6, 16\] must be strictly "
                                         r"increasing .*document 1 \(\[10, 6\)\) has length -4"):
        AnyLengthPerDocumentLoadBalancer([0, 10, 6, 16], 2, "cpu")
    with pytest.raises(ValueError, match="seq_length must be an int >= 0, got -8"):
        _HeadTailLoadBalancer(-8, 2, "cpu")
    with pytest.raises(ValueError, match="world_size must be an int >= 1, got 0"):
        _HeadTailLoadBalancer(8, 0, "cpu")
    with pytest.raises(ValueError, match="document length .* got -4"):
        _PerDocumentHeadTailLoadBalancer([[8, -4]], 2, "cpu")
    with pytest.raises(ValueError, match="block_mask must be a flex attention BlockMask, got "
                                         "Tensor"):
        _PTRRLoadBalancer(torch.ones(1, 1, 8, 8), 2)
    # A valid one still shards as before.
    lb = AnyLengthPerDocumentLoadBalancer([0, 6, 16], 2, "cpu")
    assert sorted(lb._generate_indices()[0].tolist()) == list(range(16))


# ---------------------------------------------------------------- a rank on meta tensors


def _meta_beside_real() -> dict:
    """ring_sdpa with one rank on meta tensors and the other on CPU ones (both
    orders), a meta rank whose own argument is bad, every rank on meta
    tensors (shapes only, one handshake), and meta tensors under
    FakeTensorMode (no communication at all)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    rank = dist.get_rank()
    out = {}
    cases = {
        "meta-first": lambda g: "meta" if rank == 0 else "cpu",
        "meta-second": lambda g: "meta" if rank == 1 else "cpu",
    }
    for name, device_of in cases.items():
        g = dist.new_group([0, 1])
        q, k, v = (t.to(device_of(g)) for t in _qkv(rank))
        start = time.monotonic()
        try:
            cplib.ring_sdpa(q, k, v, g, is_causal=True)
            out[name] = (None, "", 0.0)
        except Exception as exc:  # the outcome is what the test checks
            out[name] = (type(exc).__name__, str(exc), time.monotonic() - start)
    g = dist.new_group([0, 1])
    q, k, v = (t.to("meta" if rank == 0 else "cpu") for t in _qkv(rank))
    try:
        cplib.ring_sdpa(q, k, v, g, scale=-1.0 if rank == 0 else None)
        out["meta-bad-scale"] = (None, "", 0.0)
    except Exception as exc:
        out["meta-bad-scale"] = (type(exc).__name__, str(exc), 0.0)
    g = dist.new_group([0, 1])
    q, k, v = (t.to("meta").requires_grad_() for t in _qkv(rank))
    ops.handshake_debug_count(True)
    o, _ = cplib.ring_sdpa(q, k, v, g, is_causal=True)
    o.sum().backward()
    out["all-meta"] = (o.device.type, tuple(q.grad.shape), ops.handshake_debug_count(True))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fq = mode.from_tensor(torch.randn(1, 2, 8 + rank, 4))  # ranks disagree: never told
        fo, _ = cplib.ring_sdpa(fq, fq, fq, g, is_causal=True)
    out["fake"] = (tuple(fo.shape), ops.handshake_debug_count(True))
    return out


def test_a_rank_on_meta_tensors_fails_with_the_others():
    pool = RankPool(2, timeout_s=_TIMEOUT_S)
    try:
        results = pool.run(_meta_beside_real)
    finally:
        pool.close()
    for name, meta_rank in (("meta-first", 0), ("meta-second", 1)):
        outcome = [r[name] for r in results]
        for rank, (cls, msg, seconds) in enumerate(outcome):
            assert cls == "ValueError", f"{name} rank {rank}: {cls}: {msg}"
            assert "ring_sdpa: ranks disagree on q.device type" in msg, msg
            assert f"rank {meta_rank}: meta" in msg, msg
            assert seconds < _QUICK_S, f"{name} rank {rank} took {seconds:.1f} s"
        assert outcome[0][1] == outcome[1][1], outcome
    bad = [r["meta-bad-scale"] for r in results]
    assert all(cls == "ValueError" for cls, _, _ in bad), bad
    assert all("invalid input on rank 0" in msg and "scale=-1.0" in msg for _, msg, _ in bad), bad
    for r in results:
        assert r["all-meta"] == ("meta", (1, 2, 8, 4), 1), r["all-meta"]
        assert r["fake"][1] == 0, r["fake"]
