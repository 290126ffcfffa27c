"""The document placement through the front end: a Hugging Face Llama (SDPA
route) under ``context_parallel(..., position_ids=pos,
load_balance="placement")`` against every document alone in one process;
shard / unshard / ``cp.unshard`` / ``context_parallel_unshard`` with
``DocumentPlacementLoadBalancer``; ``_context_parallel_shard`` +
``_ContextParallel`` + ``attention_documents(placement=True)``; the flex path
(``_create_cp_block_mask`` with the balancer: the local mask is the full
mask's, rows and keys in the placement's order); and errors on every rank:
placement without documents, with Ulysses, ranks whose placements differ,
and a module call that would read its inputs in another layout than the
one ``_context_parallel_shard`` made."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

import cplib
from harness import assert_close
from model_cases import _check_llama_documents as _check_llama
from ring_mask_cases import masked_reference, visible


def _mesh() -> DeviceMesh:
    return DeviceMesh("cpu", list(range(dist.get_world_size())))


def test_hf_llama_packed_documents_placement(ranks):
    pool = ranks(2)
    for s, docs in ((257, [0, 100, 101, 200, 257]), (256, [0, 30, 60, 90, 256])):
        counts = pool.run(_check_llama, s, "placement", docs)
        assert counts[0] == counts[1] > 10


class _Attention(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _check_layouts() -> int:
    n, rank = dist.get_world_size(), dist.get_rank()
    mesh = _mesh()
    s = 24 * n + 5
    cu = [0, 3, 4, 10 * n, s]
    lb = cplib.DocumentPlacementLoadBalancer(torch.tensor(cu), n, "cpu")
    x = torch.randn(2, 3, s, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (xs,) = cplib.shard(mesh, [x], [2], lb)
    assert xs.shape[2] == lb.lengths()[rank]
    (back,) = cplib.unshard(mesh, [xs], [2], lb)
    assert torch.equal(back, x)
    assert torch.equal(cplib.context_parallel_unshard(mesh, [xs], [2], lb)[0], x)
    # the context: attention within documents, its handle unshards the layout
    q, k, v = (torch.randn(1, 2, s, 8, dtype=torch.float64,
                           generator=torch.Generator().manual_seed(i)) for i in range(3))
    ref = masked_reference(q, k, v, torch.ones(1, 2, s, 8), visible(s, causal=True,
                                                                     cu_seqlens=cu))[0]
    bufs = [q.clone(), k.clone(), v.clone()]
    with cplib.context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2],
                                cu_seqlens=torch.tensor(cu), load_balance="placement") as cp:
        assert isinstance(cp.load_balancer, cplib.DocumentPlacementLoadBalancer)
        out = F.scaled_dot_product_attention(*bufs, is_causal=True)
        (full,) = cp.unshard([out], [2])
    assert_close(full, ref, atol=1e-10, rtol=1e-10, what="context_parallel placement")
    # the module entry point, sharded by _context_parallel_shard
    attn = parallelize_module(_Attention(), mesh, cplib._ContextParallel(
        seq_dim=2, attention_type=cplib._ContextParallel.AttentionType.SDPA))
    cplib._enable_context_parallel_dispatcher()
    try:
        lq, lk, lv = cplib._context_parallel_shard(mesh, (q, k, v), (2, 2, 2), lb)
        with cplib.attention_documents(torch.tensor(cu), placement=True):
            out = attn(lq, lk, lv)
    finally:
        cplib._disable_context_parallel_dispatcher()
    assert_close(cplib.unshard(mesh, [out], [2], lb)[0], ref, atol=1e-10, rtol=1e-10,
                 what="_ContextParallel placement")
    return 3


def test_placement_shard_unshard_context_and_module(ranks):
    assert ranks(2).run(_check_layouts) == [3, 3]


def _check_flex() -> int:
    from torch.nn.attention.flex_attention import create_mask

    n, rank = dist.get_world_size(), dist.get_rank()
    mesh = _mesh()
    s = 128 * n
    cu = [0, 40, 41, 70 * n, s]
    lb = cplib.DocumentPlacementLoadBalancer(cu, n, "cpu")
    doc = torch.bucketize(torch.arange(s), torch.tensor(cu[1:]), right=True)

    def document_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    cp_mask = cplib.create_cp_block_mask(document_causal, 1, 1, s, s, mesh, lb)
    idx = lb._generate_indices()[0]
    mine = idx[rank * (s // n):(rank + 1) * (s // n)]
    # the local mask is the full mask's rows of this rank, keys in the layout's order
    want = create_mask(document_causal, 1, 1, s, s, device="cpu")[0, 0][mine][:, idx]
    assert torch.equal(create_mask(cp_mask.mask_mod, 1, 1, s // n, s, device="cpu")[0, 0], want)
    # (flex attention on it, the ring and the all-gather, with and without
    # the mask: tests/flex/test_flex_positions.py, for every layout)
    return 1


def test_placement_flex_path(ranks):
    assert ranks(2).run(_check_flex) == [1, 1]


def _nobody_left_in_a_collective() -> None:
    """Every rank reaches one more collective after the errors."""
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size()


def _check_errors() -> list[str]:
    n, rank = dist.get_world_size(), dist.get_rank()
    mesh = _mesh()
    x = torch.randn(1, 2, 16 * n, 4)
    seen = []
    for kwargs, exc in ((dict(load_balance="placement"), ValueError),
                        (dict(load_balance="placement", cu_seqlens=torch.tensor([0, 5, 16 * n]),
                              ulysses_degree=2), NotImplementedError)):
        with pytest.raises(exc) as info:
            with cplib.context_parallel(mesh, buffers=[x], buffer_seq_dims=[2], **kwargs):
                pass
        seen.append(str(info.value))
    # ranks that place different documents disagree in the handshake
    cu = [0, 5 + rank, 16 * n]
    with pytest.raises(ValueError) as info:
        cplib.shard(mesh, [x], [2], cplib.DocumentPlacementLoadBalancer(cu, n, "cpu"))
    seen.append(str(info.value))
    seen += _bad_document_lengths(mesh, x)
    _nobody_left_in_a_collective()
    return seen


def _bad_document_lengths(mesh: DeviceMesh, x: torch.Tensor) -> list[str]:
    """Documents that do not sum to S (on every rank, on rank 1 only, with a
    flex BlockMask) and a zero-length document (the balancer, the context):
    each a ValueError, on every rank."""
    from torch.nn.attention.flex_attention import create_block_mask

    n, rank, s = dist.get_world_size(), dist.get_rank(), x.shape[2]
    short = [0, 5, s - 4]
    placed = cplib.DocumentPlacementLoadBalancer
    mask = create_block_mask(lambda b, h, q, k: q >= k, 1, 1, s, s, device="cpu", BLOCK_SIZE=4)
    seen = []
    for case in (lambda: cplib._context_parallel_shard(mesh, [x], [2], placed(short, n, "cpu")),
                 lambda: cplib._context_parallel_shard(
                     mesh, [x], [2], placed(short if rank == 1 else [0, 5, s], n, "cpu")),
                 lambda: cplib._context_parallel_shard(mesh, [mask], [0],
                                                       placed(short, n, "cpu")),
                 lambda: placed([0, 5, 5, s], n, "cpu"),
                 lambda: cplib.context_parallel(
                     mesh, buffers=[x], buffer_seq_dims=[2], load_balance="placement",
                     cu_seqlens=torch.tensor([0, 5, 5, s] if rank == 1 else [0, 5, s])
                 ).__enter__()):
        with pytest.raises(ValueError) as info:
            case()
        seen.append(str(info.value))
    return seen


def test_placement_errors_on_every_rank(ranks):
    results = ranks(2).run(_check_errors)
    assert results[0] == results[1], results
    no_docs, ulysses, differ, short, short_on_1, short_mask, zero, zero_on_1 = results[0]
    assert "load_balance='placement' needs the documents" in no_docs
    assert "ulysses_degree=2" in ulysses
    assert "document placement (hash)" in differ
    # S = 32: the documents end at 28
    assert "length 32 along seq_dim 2" in short and "seq_length=28" in short, short
    assert "on rank 1" in short_on_1 and "seq_length=28" in short_on_1, short_on_1
    assert "(1, 28)" in short_mask and "sequence length 32" in short_mask, short_mask
    assert "cu_seqlens=[0, 5, 5, 32]" in zero and "document 1 ([5, 5)) has length 0" in zero
    assert "on rank 1" in zero_on_1 and "got 5 then 5 at index 2" in zero_on_1, zero_on_1



class _Reversed(cplib._LoadBalancer):
    """A user's own layout (the sequence reversed), which SDPA cannot read."""

    def __init__(self, s: int):
        self.s = s

    def _generate_indices(self, restore: bool = False) -> torch.Tensor:
        return torch.arange(self.s - 1, -1, -1).unsqueeze(0)


def _check_module_reads_the_shards_layout() -> list[str]:
    """An SDPA module must read its inputs in the layout
    _context_parallel_shard made: inputs in the placement attended without
    attention_documents(placement=True), with per_document=True or with
    other documents; head-tail inputs attended as a placement; one rank
    inside attention_documents and the other not; USP's sequential layout
    read as head-tail; a layout for another Ulysses degree; a user's own
    balancer (NotImplementedError). Each raises the same error on every rank
    before any exchange, and nothing hangs."""
    n, rank = dist.get_world_size(), dist.get_rank()
    mesh = _mesh()
    s = 16 * n
    cu = [0, 5, 9, s]
    q, k, v = (torch.randn(1, 2, s, 4) for _ in range(3))
    attn = parallelize_module(_Attention(), mesh, cplib._ContextParallel(
        seq_dim=2, attention_type=cplib._ContextParallel.AttentionType.SDPA))
    placed = cplib.DocumentPlacementLoadBalancer(cu, n, "cpu")
    cases = ((placed, None), (placed, dict(per_document=True)),
             (placed, dict(cu_seqlens=torch.tensor([0, 6, s]), placement=True)),
             (cplib._HeadTailLoadBalancer(s, n, "cpu"), dict(placement=True)),
             (placed, dict(placement=True) if rank == 0 else None),
             (cplib.usp_load_balancer(s, n, 1, head_tail=False), None),
             (cplib.usp_load_balancer(s, n, 2), None),
             (_Reversed(s), None))
    seen = []
    cplib._enable_context_parallel_dispatcher()
    try:
        for lb, documents in cases:
            lq, lk, lv = cplib._context_parallel_shard(mesh, (q, k, v), (2, 2, 2), lb)
            with pytest.raises((ValueError, NotImplementedError)) as info:
                if documents is None:
                    attn(lq, lk, lv)
                else:
                    with cplib.attention_documents(
                            **{"cu_seqlens": torch.tensor(cu), **documents}):
                        attn(lq, lk, lv)
            seen.append(f"{info.type.__name__}: {info.value}")
    finally:
        cplib._disable_context_parallel_dispatcher()
    _nobody_left_in_a_collective()
    return seen


def test_module_reads_the_shards_layout_or_raises_on_every_rank(ranks):
    results = ranks(2).run(_check_module_reads_the_shards_layout)
    assert results[0] == results[1], results
    missing, per_document, other_docs, head_tail, one_rank, sequential, usp, own = results[0]
    assert missing.startswith("ValueError")
    assert "DocumentPlacementLoadBalancer (placement" in missing
    assert "attention_documents(cu_seqlens, placement=True)" in missing
    assert "DocumentPlacementLoadBalancer (placement layout)" in per_document
    assert "cu_seqlens [0, 6, " in other_docs and "[0, 5, 9, " in other_docs
    assert "attention_documents(placement=True)" in head_tail and "HeadTail" in head_tail
    assert "placement layout" in one_rank
    assert "(sequential layout)" in sequential and "as head-tail" in sequential
    assert "ulysses_degree=2" in usp and "usp_load_balancer(S, 2, 1)" in usp
    assert own.startswith("NotImplementedError") and "_Reversed" in own
