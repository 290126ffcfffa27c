"""Bad input to the attention and layer ops (ring_sdpa and its backward,
ulysses_sdpa, usp_sdpa, flex_cp_allgather, tp_conv), for the matrix of
tests/support/bad_input.py: (name, world size, case, exception class, text
every rank's message contains). A case is ``case(rank, group)``, run on
every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

import cplib
from cplib.comm.native import ops  # raises a kernel's error as its Python class


def qkv(rank: int, *, b=1, h=2, hkv=None, length=8, d=4, dtype=torch.float32):
    torch.manual_seed(0)
    q = torch.randn(b, h, length, d).to(dtype)
    kv = torch.randn(b, h if hkv is None else hkv, length, d).to(dtype)
    return q, kv, kv.clone()


def _ring(rank, g, **kw):
    shape = {k: kw.pop(k) for k in ("b", "h", "hkv", "length", "d", "dtype") if k in kw}
    q, k, v = qkv(rank, **shape)
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
    q, k, v = qkv(rank)
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
    q, k, v = qkv(rank)
    if rank == 0:
        cplib.ring_sdpa(q, k, v, g)
    else:
        cplib.ulysses_sdpa(q, k, v, g)


def _ulysses_on(bad_rank, is_causal=False, **bad):
    def case(rank, g):
        shape = bad if bad_rank in (None, rank) else {}
        cplib.ulysses_sdpa(*qkv(rank, **shape), g, is_causal=is_causal)
    return case


def _usp_same_group(rank, g):
    cplib.usp_sdpa(*qkv(rank), g, g, is_causal=True)


def _usp_pure_ulysses_groups(rank, g):
    from cplib.ulysses.usp_layout import usp_groups

    groups = usp_groups(g, 2)  # 2 ranks, U = 2: pure Ulysses, no ring group
    cplib.usp_sdpa(*qkv(rank), groups.ulysses_group, groups.ring_group)


def _usp_one_bad_scale(rank, g):
    from cplib.ulysses.usp_layout import usp_groups

    groups = usp_groups(g, 2)  # 2 x 2: ranks 0 and 2 (and 1 and 3) never meet in Ulysses
    cplib.usp_sdpa(*qkv(rank), groups.ulysses_group, groups.ring_group,
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
        w = torch.randn(4, channels, 3, 3)[(...,) + (0,) * (4 - kw.get("weight_dims", 4))]
        cplib.tp_conv(x, w, padding=kw.get("padding", 1), stride=kw.get("stride", 1),
                      dim=kw.get("dim", -1), group=g)
    return case


def mesh(g):
    from torch.distributed.device_mesh import DeviceMesh
    return DeviceMesh.from_group(g, "cpu")


def _mask_on(entry, bad_rank):
    """A mask that is not a key padding (it varies with the query) on
    ``bad_rank``; a key-padding one elsewhere."""
    def case(rank, g):
        q, k, v = qkv(rank)
        mask = torch.ones(1, 1, 8, 8, dtype=torch.bool) if rank == bad_rank else \
            torch.ones(1, 1, 1, 8, dtype=torch.bool)
        entry(q, k, v, g, attn_mask=mask)
    return case


def _ring_non_member(rank, g):
    # Each rank passes the group made of the other one: new_group returns
    # GroupMember.NON_GROUP_MEMBER (an int) to the ranks it leaves out.
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    _ring(rank, groups[1 - rank])


OPS_CASES = [
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
    # ring_sdpa: ranks disagree
    ("ring/disagree/is-causal", 2, _ring_on(1, is_causal=True), ValueError,
     "disagree on is_causal (rank 0: False, rank 1: True)"),
    ("ring/disagree/load-balanced", 2, _ring_on(1, load_balanced=True), ValueError,
     "disagree on layout"),
    # Non-causal ranks may hold different lengths (joint streams); causal ones
    # only those of one sequence's shards (8 and 6 are not: 14 cuts into 7 and 7).
    ("ring/disagree/length", 2, _ring_by_rank({"is_causal": True}, {"is_causal": True,
                                                                     "length": 6}), ValueError,
     "local lengths differ (q [8, 6]"),
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
    ("usp/same/no-ring-group", 2, _usp_pure_ulysses_groups, ValueError,
     "ring_group is None (usp_groups gives None there when the Ulysses degree is the world "
     "size): that is not USP; call cplib.ulysses_sdpa"),
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
    # A weight of another rank than x: one of issue 53's two aborts at exit.
    ("conv/same/weight-dims", 2, _conv_on(None, weight_dims=3), ValueError,
     "weight must have 4 dimensions like x, got shape [4, 3, 3]"),
    ("conv/one/weight-dims", 2, _conv_on(1, weight_dims=3), ValueError,
     "invalid input on rank 1: cplib.tp_conv: weight must have 4 dimensions"),
    ("conv/one/channel-dim", 2, _conv_on(1, dim=1), NotImplementedError, "channel dim"),
    ("conv/disagree/channels", 2, _conv_on(1, channels=2), ValueError, "disagree on x.size(1)"),
    ("conv/disagree/padding", 2, _conv_on(1, padding=2), ValueError, "disagree on padding[0]"),
    # Arguments the Python wrappers reject on one rank, before the op the
    # other ranks are in: the error travels in that op's handshake.
    ("ring/one/query-mask", 2, _mask_on(cplib.ring_sdpa, 1), NotImplementedError,
     "attn_mask (got (1, 1, 8, 8))"),
    ("ulysses/one/query-mask", 2, _mask_on(cplib.ulysses_sdpa, 1), NotImplementedError,
     "attn_mask (got (1, 1, 8, 8))"),
    # Groups this rank cannot use, named
    ("ring/same/not-a-member", 2, _ring_non_member, ValueError,
     "group=GroupMember.NON_GROUP_MEMBER (-100): this process is not a member"),
]
