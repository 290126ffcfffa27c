"""Hugging Face decoders with ``attn_implementation="cplib"`` against HF's own
eager attention in one process (loss and every parameter gradient): tiny
random Qwen3, Mistral (window smaller than a shard), Gemma 3 (sliding and
full layers), gpt-oss (sinks, alternating sliding layers, MoE) and
DeepSeek-V3 (MLA, MoE), under context_parallel at world sizes 2 and 4 with
and without load balancing, with packed documents against each document
alone, and outside any context (padding masks included; padding under the
context: tests/hf/test_hf_padding.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from cp_reference import use_ring
from cplib import _cp_options, _RotateMethod, context_parallel
from harness import assert_close

VOCAB = 64
# fp64 where the model allows; the MoE models' grouped matmul has no fp64.
# HF's eager attention takes its softmax in float32 even for float64 models,
# so against eager float64 agrees to float32's softmax error; against the
# same "cplib" model in one process it agrees to float64's, up to the float32
# casts some models make (Gemma 3's norms round their inputs to float32).
EAGER_TOL = {torch.float64: dict(atol=1e-5, rtol=1e-5), torch.float32: dict(atol=3e-5, rtol=3e-4)}
EXACT_TOL = {torch.float64: dict(atol=1e-7, rtol=1e-7), torch.float32: dict(atol=3e-5, rtol=3e-4)}


def _model(name: str, seed: int = 0):
    import transformers as tf

    import cplib.hf  # noqa: F401  (registers attn_implementation="cplib")

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  max_position_embeddings=256, attn_implementation="eager")
    if name == "qwen3":
        config, cls, dtype = tf.Qwen3Config(**common), tf.Qwen3ForCausalLM, torch.float64
    elif name == "mistral":
        config = tf.MistralConfig(**common, sliding_window=5)
        cls, dtype = tf.MistralForCausalLM, torch.float64
    elif name == "gemma3":
        config = tf.Gemma3TextConfig(**common, sliding_window=6,
                                     layer_types=["sliding_attention", "full_attention"])
        cls, dtype = tf.Gemma3ForCausalLM, torch.float64
    elif name == "gpt_oss":
        config = tf.GptOssConfig(**common, sliding_window=6, num_local_experts=4,
                                 num_experts_per_tok=2,
                                 layer_types=["sliding_attention", "full_attention"])
        cls, dtype = tf.GptOssForCausalLM, torch.float32
    elif name == "deepseek_v3":
        common.pop("head_dim")
        common["num_key_value_heads"] = 4  # MLA expands k/v to every head
        config = tf.DeepseekV3Config(**common, q_lora_rank=None, kv_lora_rank=16,
                                     qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                                     n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                                     topk_group=1, first_k_dense_replace=1,
                                     moe_intermediate_size=16)
        cls, dtype = tf.DeepseekV3ForCausalLM, torch.float32
    else:
        raise ValueError(name)
    torch.manual_seed(seed)
    model = cls(config).to(dtype)
    if name == "gpt_oss":  # sinks start at 0; random ones test more
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_()
    return model, dtype


MODELS = ["qwen3", "mistral", "gemma3", "gpt_oss", "deepseek_v3"]


def _loss(model, ids, pos, labels, **kw):
    logits = model(input_ids=ids, position_ids=pos, use_cache=False, **kw).logits
    return F.cross_entropy(logits.flatten(0, 1).double(), labels.flatten(), ignore_index=-100,
                           reduction="sum")


def _batch(s: int, bounds: list[int]):
    ids = torch.randint(0, VOCAB, (2, s), generator=torch.Generator().manual_seed(3))
    pos = torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])]).expand(2, s)
    # Labels never cross a document (nor the sequence end).
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    for b in bounds[1:-1]:
        labels[:, b - 1] = -100
    return ids, pos.clone(), labels


def _summed(loss, model, reduce: bool):
    """``loss`` and ``model``'s gradients, summed over the ranks with ``reduce``."""
    total = loss.detach().clone()
    grads = {}
    if reduce:
        dist.all_reduce(total)
    for name, p in model.named_parameters():
        if p.grad is not None:
            grads[name] = p.grad.clone()
            if reduce:
                dist.all_reduce(grads[name])
    return total, grads


def _compare(what, total, grads, refs) -> int:
    """A loss and gradients against each ``(label, ref_loss, ref_model, tol)``."""
    count = 0
    for label, ref_loss, ref, tol in refs:
        w = f"{what} vs {label}"
        assert_close(total, ref_loss.detach(), what=f"{w}: loss", **tol)
        for name, pr in ref.named_parameters():
            if pr.grad is None:  # an expert no token was routed to, in both
                assert name not in grads or not grads[name].any(), f"{w}: grad of {name}"
                continue
            assert_close(grads[name], pr.grad, what=f"{w}: grad of {name}", **tol)
            count += 1
    assert count > 8, what
    return count


def _references(ref, exact, ids, pos, labels, bounds, dtype):
    """HF eager and the same "cplib" model, one process, every document alone."""
    return [("eager", _single_process(ref, ids, pos, labels, bounds), ref, EAGER_TOL[dtype]),
            ("one process", _single_process(exact, ids, pos, labels, bounds), exact,
             EXACT_TOL[dtype])]


def _single_process(model, ids, pos, labels, bounds):
    """Loss (backward done) of ``model`` in one process, every document alone."""
    loss = sum(_loss(model, ids[:, a:b], pos[:, a:b], labels[:, a:b])
               for a, b in zip(bounds, bounds[1:]))
    loss.backward()
    return loss


def _check_cp(name: str, load_balance: bool, documents: bool) -> int:
    use_ring("native")
    _cp_options.rotate_method = _RotateMethod.P2P
    n, rank = dist.get_world_size(), dist.get_rank()
    mesh = DeviceMesh("cpu", list(range(n)))
    s = 16 * n
    bounds = [0, 5, 6, s // 2 + 3, s] if documents else [0, s]
    ids, pos, labels = _batch(s, bounds)
    ref, dtype = _model(name)
    model = copy.deepcopy(ref)
    model.set_attn_implementation("cplib")
    exact = copy.deepcopy(model)
    # The references run on rank 0 only (every rank holds the full batch).
    refs = _references(ref, exact, ids, pos, labels, bounds, dtype) if rank == 0 else None
    extra = {"position_ids": pos.clone()} if documents else {}
    with context_parallel(mesh, buffers=[ids, pos, labels], buffer_seq_dims=[1, 1, 1],
                          load_balance=load_balance, **extra):
        loss = _loss(model, ids, pos, labels)
        loss.backward()
    total, grads = _summed(loss, model, reduce=True)
    if rank == 0:
        _compare(f"{name} n={n} lb={load_balance} docs={documents}", total, grads, refs)
    return 1


def _check_models() -> int:
    count = 0
    for name in MODELS:
        for lb in (True, False):
            count += _check_cp(name, lb, False)
        count += _check_cp(name, True, True)
    return count


@pytest.mark.parametrize("world_size", [2, 4])
def test_hf_models_under_context_parallel(ranks, world_size):
    assert ranks(world_size).run(_check_models) == [3 * len(MODELS)] * world_size


# ------------------------------------------------------------ USP


def _check_usp() -> int:
    use_ring("native")
    n, rank = dist.get_world_size(), dist.get_rank()
    mesh = DeviceMesh("cpu", list(range(n)))
    s = 16 * n
    for name in ("qwen3", "deepseek_v3"):  # no windows: USP takes documents/windows elsewhere
        ids, pos, labels = _batch(s, [0, s])
        ref, dtype = _model(name)
        model = copy.deepcopy(ref)
        model.set_attn_implementation("cplib")
        exact = copy.deepcopy(model)
        refs = _references(ref, exact, ids, pos, labels, [0, s], dtype) if rank == 0 else None
        with context_parallel(mesh, buffers=[ids, pos, labels], buffer_seq_dims=[1, 1, 1],
                              load_balance=True, ulysses_degree=2):
            loss = _loss(model, ids, pos, labels)
            loss.backward()
        total, grads = _summed(loss, model, reduce=True)
        if rank == 0:
            _compare(f"{name} usp u=2", total, grads, refs)
    return 1


def test_hf_usp_under_context_parallel(ranks):
    assert ranks(4).run(_check_usp) == [1] * 4


# ------------------------------------------------------------ one process


@pytest.mark.parametrize("name", MODELS)
def test_hf_cplib_outside_context_matches_eager(name):
    """The same model object outside any context: packed documents and a
    left-padding mask, against HF's eager attention."""
    s = 24
    ref, dtype = _model(name)
    model = copy.deepcopy(ref)
    model.set_attn_implementation("cplib")
    bounds = [0, 7, 8, s]
    ids, pos, labels = _batch(s, bounds)
    # Packed documents against each document alone (HF's eager masks packed
    # position_ids only in the models that pass them to their mask builders;
    # "cplib" always does, as HF's flash-attention path does).
    doc_losses = [_single_process(ref, ids, pos, labels, bounds),
                  _single_process(model, ids, pos, labels, [0, s])]
    assert_close(doc_losses[1], doc_losses[0], what=f"{name} documents outside CP: loss",
                 **EAGER_TOL[dtype])
    # Padding: the last tokens of row 0 (right padding: with left padding
    # HF's eager gives padding rows NaN in float64, which reaches the loss).
    mask = torch.ones(2, s, dtype=torch.long)
    mask[0, -4:] = 0
    plain = torch.arange(s).expand(2, s)
    lab = labels.clone()
    lab[0, -5:] = -100
    losses = [_loss(m, ids, plain, lab, attention_mask=mask) for m in (ref, model)]
    for loss in losses:
        loss.backward()
    _compare(f"{name} outside CP", *_summed(losses[1], model, reduce=False),
             [("eager", losses[0], ref, EAGER_TOL[dtype])])


def test_import_cplib_does_not_import_transformers():
    import subprocess
    import sys

    import os
    import tempfile

    from harness import cplib_import_root

    code = "import sys, cplib; assert 'transformers' not in sys.modules, 'imported'"
    # From an empty folder, with the cplib under test first on the path (not
    # the source tree that the current folder may hold).
    env = dict(os.environ, PYTHONPATH=cplib_import_root())
    with tempfile.TemporaryDirectory() as cwd:
        subprocess.run([sys.executable, "-c", code], check=True, cwd=cwd, env=env)
