"""Shared pieces of the flex CP tests (flex/test_flex_cp.py,
flex/test_flex_ring*.py, flex/test_gpu_flex_ring.py): the masks on global
positions, document lengths, balancers, the module that ``_ContextParallel``
wraps (and one per process, eager or compiled), and the per-rank switches
(CPU backward guard, rotate method) restored on exit."""

from __future__ import annotations

import contextlib
import unittest.mock

import torch
import torch.distributed as dist
import torch.nn.attention.flex_attention as fa
from torch import nn
from torch.nn.attention.flex_attention import AuxRequest
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

import cplib
from cplib import (
    _ContextParallel,
    _HeadTailLoadBalancer,
    _PerDocumentHeadTailLoadBalancer,
    _PTRRLoadBalancer,
)

# ------------------------------------------------------------------ masks


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding_window(window: int):
    def sliding_window_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)
    return sliding_window_causal


def prefix_lm(prefix: int):
    def prefix_lm_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) | (kv_idx < prefix)
    return prefix_lm_causal


def document_lengths(B: int, S: int, docs: int, unit: int, seed: int) -> list[list[int]]:
    """``docs`` random document lengths per batch row, multiples of ``unit``, summing to S."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(B):
        cuts = (torch.randperm(S // unit - 1, generator=g)[: docs - 1] + 1).sort().values
        bounds = [0, *cuts.tolist(), S // unit]
        rows.append([(bounds[i + 1] - bounds[i]) * unit for i in range(docs)])
    return rows


def document_causal(lengths: list[list[int]]):
    doc_ids = torch.stack([
        torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in lengths
    ])

    def document_causal_mask(b, h, q_idx, kv_idx):
        return (doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & (q_idx >= kv_idx)
    return document_causal_mask


# ------------------------------------------------------------------ per-rank plumbing


@contextlib.contextmanager
def cpu_flex_grads():
    """Lifts torch's "no flex backward on CPU" guard (``_validate_device``):
    flex's own dense implementation differentiates fine."""
    with unittest.mock.patch.object(fa, "_validate_device", lambda *args: None), \
            torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=512):
        yield


@contextlib.contextmanager
def rotate(method: str):
    """``set_rotate_method(method)`` in this (rank) process, restored on exit."""
    from cplib.frontend.options import _cp_options

    before = _cp_options.rotate_method
    cplib.set_rotate_method(method)
    try:
        yield
    finally:
        _cp_options.rotate_method = before


class FlexAttention(nn.Module):
    """A module with flex_attention's signature (what _ContextParallel wraps)."""

    def forward(self, query, key, value, score_mod=None, block_mask=None, scale=None,
                enable_gqa=False, return_aux=None):
        return fa.flex_attention(query, key, value, score_mod=score_mod, block_mask=block_mask,
                                 scale=scale, enable_gqa=enable_gqa, return_aux=return_aux)


class Model(nn.Module):
    """Calls its attention submodule, so compiling the model traces the CP
    hook and the attention as one frame (compiling the attention module
    itself would compile its forward pre-hook as a separate frame)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = FlexAttention()

    def forward(self, *args, **kwargs):
        return self.attn(*args, **kwargs)


_meshes: dict[int, DeviceMesh] = {}


def mesh() -> DeviceMesh:
    """This process's CPU mesh over the whole world (one per world size)."""
    n = dist.get_world_size()
    if n not in _meshes:
        _meshes[n] = DeviceMesh("cpu", list(range(n)))
    return _meshes[n]


def cp_model() -> nn.Module:
    return parallelize_module(Model(), mesh(), {"attn": _ContextParallel(
        seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX)})


_models: dict[str, object] = {}


def shared_model(compiled: bool):
    """``cp_model()``, eager or compiled (aot_eager, fullgraph), made once per
    process and mode and reused by every case (flex/test_flex_ring*.py)."""
    key = "compiled" if compiled else "eager"
    if key not in _models:
        model = cp_model()
        _models[key] = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled \
            else model
    return _models[key]


def balancer(kind: str, S: int, block_mask, lengths):
    if kind == "none":
        return None
    if kind == "head_tail":
        return _HeadTailLoadBalancer(S, dist.get_world_size(), "cpu")
    if kind == "per_document_head_tail":
        return _PerDocumentHeadTailLoadBalancer(lengths, dist.get_world_size(), "cpu")
    if kind == "ptrr":
        return _PTRRLoadBalancer(block_mask, dist.get_world_size())
    if kind == "any_length_head_tail":
        return cplib.AnyLengthHeadTailLoadBalancer(S, dist.get_world_size(), "cpu")
    bounds = torch.tensor([0, *(lengths[0] if lengths else [])]).cumsum(0)  # one row's documents
    if kind == "placement":
        return cplib.DocumentPlacementLoadBalancer(bounds, dist.get_world_size(), "cpu")
    if kind == "any_length_per_document":
        return cplib.AnyLengthPerDocumentLoadBalancer(bounds.tolist(), dist.get_world_size(),
                                                      "cpu")
    raise AssertionError(kind)


def randn(shape, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64).to(dtype)


def flex_reference(q, k, v, block_mask, score_mod, gqa, cot_out, cot_lse,
               dtype: torch.dtype = torch.float64):
    """out, lse, dq, dk, dv of flex_attention on the whole sequence, in ``dtype``."""
    q, k, v = (t.detach().to(dtype).requires_grad_(True) for t in (q, k, v))
    out, aux = fa.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                 enable_gqa=gqa, return_aux=AuxRequest(lse=True))
    torch.autograd.backward([out, aux.lse], [cot_out.to(dtype), cot_lse.to(aux.lse.dtype)])
    return [t.detach() for t in (out, aux.lse, q.grad, k.grad, v.grad)]
