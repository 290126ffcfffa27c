"""Hybrid Hugging Face models (``attn_implementation="cplib"``) trained under
``cplib.context_parallel`` with ``labels=``: the mean over the CP ranks of the
loss and of every parameter gradient equals one process's (fp32), for tiny
Qwen3-Next and Qwen3.5 (Gated DeltaNet with GQA-style value heads: 4 key
heads, 8 value heads) by both exchanges (head re-sharding and state
passing), head-tail and sequential (uneven) shards, and Falcon-H1 (Mamba2).
Without cplib.hybrid each Gated DeltaNet / Mamba layer restarts from a zero
state at every shard border and the loss misses by ~1e-3."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from harness import assert_close
from hybrid_cases import VOCAB, tiny_model

LINEAR = dict(linear_num_key_heads=4, linear_num_value_heads=8)


def _model(family: str):
    model = tiny_model(family, overrides=LINEAR if family != "falcon_h1" else {})
    with torch.no_grad():  # sharper logits: a wrong hidden state shows in the loss
        model.get_output_embeddings().weight.mul_(8)
    return model.train()


def _batch(s: int):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (2, s), generator=g)
    labels = ids.clone()
    labels[0, : s // 3] = -100  # unevenly on the ranks
    return ids, torch.arange(s).expand(2, s).contiguous(), labels


def _one_process(model, ids, pos, labels):
    loss = model(input_ids=ids, position_ids=pos, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _check(family: str, s: int, load_balance: bool, way: str) -> int:
    import cplib

    n = dist.get_world_size()
    ids, pos, labels = _batch(s)
    ref = _model(family)
    model = copy.deepcopy(ref)
    want, want_grads = _one_process(ref, ids, pos, labels)
    with cplib.context_parallel(DeviceMesh("cpu", list(range(n))), buffers=[ids, pos, labels],
                                buffer_seq_dims=[1, 1, 1], load_balance=load_balance), \
            cplib.recurrence_exchange(way):
        loss = model(input_ids=ids, position_ids=pos, labels=labels).loss
        loss.backward()
    what = f"{family} S={s} n={n} load_balance={load_balance} {way}"
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    assert_close(mean / n, want, what=f"{what}: mean loss", atol=0, rtol=2e-5)
    for name, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        assert_close(g / n, want_grads[name], what=f"{what}: mean grad of {name}", atol=1e-5,
                     rtol=0)
    return 1


def _check_all() -> int:
    n = dist.get_world_size()
    count = 0
    for family in ("qwen3_next", "qwen3_5"):
        for way in ("heads", "state"):
            count += _check(family, 16 * n, True, way)
            count += _check(family, 16 * n + 3, False, way)  # sequential, uneven shards
    count += _check("qwen3_5", 16 * n, True, "auto")
    count += _check("falcon_h1", 16 * n, True, "auto")
    count += _check("falcon_h1", 16 * n + 3, False, "auto")
    return count


@pytest.mark.parametrize("world_size", [2, 4])
def test_hybrid_models_train_exactly_under_cp(ranks, world_size):
    assert ranks(world_size).run(_check_all) == [11] * world_size
