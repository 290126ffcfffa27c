"""Left padding under ``cplib.context_parallel``, hybrid models
(``attn_implementation="cplib"``, the 2-D mask among the buffers, the labels
HF's collator makes: the last pad predicts the first token): the mean over
the ranks of the loss and of every parameter gradient equals one eager
process's. Before, the rows that see nothing got another value under CP
than in one process: gradients off by 21-69% relative (Falcon-H1, LFM2,
Nemotron-H, Qwen3-Next)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from harness import assert_close
from hybrid_cases import VOCAB, tiny_model

FAMILIES = ("falcon_h1", "lfm2", "nemotron_h", "qwen3_next")


def _batch(s: int):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, VOCAB, (2, s), generator=g)
    mask = torch.ones(2, s, dtype=torch.long)
    mask[0, : s // 2 + 1] = 0  # left padding past a shard
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    labels = ids.masked_fill(mask == 0, -100)  # HF's collator; the model shifts them
    return ids, mask, pos, labels


def _loss_and_grads(model, ids, mask, pos, labels):
    loss = model(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels,
                 use_cache=False).loss
    loss.backward()
    return loss.detach()


def _check(family: str) -> int:
    import cplib

    n = dist.get_world_size()
    model = tiny_model(family).train()
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    batch = _batch(8 * n)
    want = _loss_and_grads(ref, *batch)
    with cplib.context_parallel(DeviceMesh("cpu", list(range(n))), buffers=list(batch),
                                buffer_seq_dims=[1] * 4, load_balance=True):
        loss = _loss_and_grads(model, *batch)
    dist.all_reduce(loss)
    assert_close(loss / n, want, what=f"{family}: mean loss", atol=0, rtol=2e-5)
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        g = p.grad.clone()
        dist.all_reduce(g)
        assert_close(g / n, r.grad, what=f"{family}: mean grad of {name}", atol=1e-5, rtol=0)
    return 1


def _check_all() -> int:
    return sum(_check(family) for family in FAMILIES)


def test_left_padded_hybrid_models_train_as_one_eager_process(ranks):
    assert ranks(2).run(_check_all) == [len(FAMILIES)] * 2
