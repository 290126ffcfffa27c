"""Shared pieces of the whole-model tests (frontend/test_models.py,
frontend/test_cp_documents.py, frontend/test_cp_placement.py,
ulysses/test_ulysses_usp.py, diffusers/test_diffusers.py): the rank's mesh and
the front end's options, a tiny Hugging Face Llama and its summed loss, the
parameter gradients summed over the ranks and compared with the reference
model's, and the Llama with packed documents against every document alone."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from cp_reference import use_ring
from cplib import _cp_options, _RotateMethod, context_parallel
from harness import assert_close

TOL = dict(atol=2e-5, rtol=2e-4)


def _setup(impl: str) -> tuple[DeviceMesh, int, int]:
    use_ring(impl)
    _cp_options.enable_load_balance = True
    _cp_options.rotate_method = _RotateMethod.P2P
    n = dist.get_world_size()
    return DeviceMesh("cpu", list(range(n))), dist.get_rank(), n


def _reduced_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameter gradients summed over the context-parallel ranks (each rank
    holds the contribution of its own tokens)."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        out[name] = g
    return out


def _compare_grads(cp_model: nn.Module, ref_model: nn.Module, what: str) -> int:
    grads = _reduced_grads(cp_model)
    for name, p in ref_model.named_parameters():
        assert_close(grads[name], p.grad, what=f"{what}: grad of {name}", **TOL)
    return len(grads)


def _llama(seed: int, max_positions: int = 256):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_positions, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float()


def _lm_loss(model, ids, pos, labels):
    logits = model(input_ids=ids, position_ids=pos).logits
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                           reduction="sum")


def _mesh() -> DeviceMesh:
    use_ring("native")
    _cp_options.enable_load_balance = True
    _cp_options.rotate_method = _RotateMethod.P2P
    return DeviceMesh("cpu", list(range(dist.get_world_size())))


def _check_llama_documents(s: int, load_balance, documents: list[int] | None) -> int:
    """The tiny Llama at sequence length ``s`` under context_parallel (with
    ``position_ids`` restarting at each document of ``documents``, bounds
    [0, ..., s]) against every document alone in one process: the loss and
    every parameter gradient, summed over the ranks."""
    mesh = _mesh()
    ref = _llama(0, max_positions=2048)
    cp_model = copy.deepcopy(ref)
    ids = torch.randint(0, 96, (1, s), generator=torch.Generator().manual_seed(3))
    bounds = documents or [0, s]
    pos = torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])]).view(1, s)
    # Labels never cross a document (nor the sequence end).
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    for b in bounds[1:-1]:
        labels[0, b - 1] = -100
    # Reference: every document on its own, in one process.
    ref_loss = sum(_lm_loss(ref, ids[:, a:b], pos[:, a:b], labels[:, a:b])
                   for a, b in zip(bounds, bounds[1:]))
    ref_loss.backward()
    extra = {"position_ids": pos.clone()} if documents else {}
    with context_parallel(mesh, buffers=[ids, pos, labels], buffer_seq_dims=[1, 1, 1],
                          load_balance=load_balance, **extra):
        loss = _lm_loss(cp_model, ids, pos, labels)
        loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    assert ids.shape == (1, s)
    what = f"llama S={s} lb={load_balance} docs={documents}"
    assert_close(total, ref_loss.detach(), what=f"{what}: loss", **TOL)
    grads = _reduced_grads(cp_model)
    for name, p in ref.named_parameters():
        assert_close(grads[name], p.grad, what=f"{what}: grad of {name}", **TOL)
    return len(grads)
