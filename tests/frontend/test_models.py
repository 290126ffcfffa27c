"""Whole models under cplib context parallelism against the same model on the
full sequence in one process: loss and every parameter gradient (and the
input gradient where the input is a float tensor)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from cplib import context_parallel
from harness import assert_close
from model_cases import _compare_grads, _llama, _lm_loss, _setup

IMPL = "native"  # the ring op under test; cp_reference's stand-in is "reference"
TOL = dict(atol=2e-5, rtol=2e-4)


# --------------------------------------------------- TransformerEncoder stack


def _encoder(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(d_model=32, nhead=8, dim_feedforward=64, dropout=0.0,
                                       batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)


def _check_encoder_stack(impl: str, is_causal: bool, rotate: str) -> int:
    mesh, rank, n = _setup(impl)
    b, s = 2, 16 * n
    ref = _encoder(0)
    cp_model = copy.deepcopy(ref)
    x = torch.randn(b, s, 32, generator=torch.Generator().manual_seed(1))
    target = torch.randn(b, s, 32, generator=torch.Generator().manual_seed(2))

    xr = x.clone().requires_grad_(True)
    mask = nn.Transformer.generate_square_subsequent_mask(s) if is_causal else None
    ref_loss = F.mse_loss(ref(xr, mask=mask, is_causal=is_causal), target, reduction="sum")
    ref_loss.backward()

    xc, tc = x.clone(), target.clone()
    with context_parallel(mesh, buffers=[xc, tc], buffer_seq_dims=[1, 1],
                          rotate_method=rotate, load_balance=is_causal) as cp:
        xc.requires_grad_(True)
        local_mask = nn.Transformer.generate_square_subsequent_mask(s // n) if is_causal else None
        out = cp_model(xc, mask=local_mask, is_causal=is_causal)
        loss = F.mse_loss(out, tc, reduction="sum")
        loss.backward()
        (dx,) = cp.unshard([xc.grad], [1])
        xc.requires_grad_(False)
    total = loss.detach().clone()
    dist.all_reduce(total)
    what = f"encoder causal={is_causal} rotate={rotate}"
    assert_close(total, ref_loss.detach(), what=f"{what}: loss", **TOL)
    assert_close(dx, xr.grad, what=f"{what}: grad of input", **TOL)
    return _compare_grads(cp_model, ref, what)


@pytest.mark.parametrize("world_size", [2, 4])
def test_transformer_encoder_stack(ranks, world_size):
    pool = ranks(world_size)
    for is_causal, rotate in ((True, "p2p"), (False, "alltoall"), (True, "allgather")):
        counts = pool.run(_check_encoder_stack, IMPL, is_causal, rotate)
        assert counts == [len(list(_encoder(0).parameters()))] * world_size


# ------------------------------------------------------ Hugging Face Llama


def _check_llama(impl: str, load_balance: bool) -> int:
    mesh, rank, n = _setup(impl)
    b, s = 2, 32 * n
    ref = _llama(0)
    cp_model = copy.deepcopy(ref)
    ids = torch.randint(0, 96, (b, s), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(s).expand(b, s)
    # Labels are shifted on the full sequence, so sharding never cuts a pair.
    labels = torch.cat([ids[:, 1:], torch.full((b, 1), -100)], dim=1)

    ref_loss = _lm_loss(ref, ids, pos, labels)
    ref_loss.backward()

    with context_parallel(mesh, buffers=[ids, pos, labels], buffer_seq_dims=[1, 1, 1],
                          load_balance=load_balance):
        assert ids.shape == (b, s // n)
        loss = _lm_loss(cp_model, ids, pos, labels)
        loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    assert ids.shape == (b, s)
    what = f"llama lb={load_balance}"
    assert_close(total, ref_loss.detach(), what=f"{what}: loss", **TOL)
    return _compare_grads(cp_model, ref, what)


def test_hf_llama_matches_single_process(ranks):
    pool = ranks(2)
    for load_balance in (True, False):
        counts = pool.run(_check_llama, IMPL, load_balance)
        assert counts[0] == counts[1] and counts[0] > 10


# ----------------------------------------------------------------- compile


class _Block(nn.Module):
    """A pre-norm transformer block that calls SDPA directly."""

    def __init__(self, dim: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.norm2(x))


def _check_compiled_block(impl: str, backend: str) -> None:
    mesh, rank, n = _setup(impl)
    torch.manual_seed(0)
    eager, block = _Block(), None
    block = copy.deepcopy(eager)
    x = torch.randn(2, 16 * n, 32, generator=torch.Generator().manual_seed(4))
    xe, xc = x.clone(), x.clone()
    torch._dynamo.reset()
    compiled = torch.compile(block, backend=backend, fullgraph=True)
    with context_parallel(mesh, buffers=[xe, xc], buffer_seq_dims=[1, 1]):
        xe.requires_grad_(True)
        xc.requires_grad_(True)
        out_e = eager(xe)
        out_c = compiled(xc)  # fullgraph=True: any graph break raises
        assert_close(out_c, out_e, what=f"compiled ({backend}) output", **TOL)
        out_e.square().sum().backward()
        out_c.square().sum().backward()
        assert_close(xc.grad, xe.grad, what=f"compiled ({backend}) grad of input", **TOL)
        for (name, pe), pc in zip(eager.named_parameters(), block.parameters()):
            assert_close(pc.grad, pe.grad, what=f"compiled ({backend}) grad of {name}", **TOL)
        xe.requires_grad_(False)
        xc.requires_grad_(False)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_block_matches_eager(ranks, backend):
    ranks(2).run(_check_compiled_block, IMPL, backend)
