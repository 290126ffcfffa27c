"""``model(input_ids=ids, position_ids=pos, labels=labels).loss`` of a Hugging
Face causal LM (``attn_implementation="cplib"``) under
``cplib.context_parallel``: the mean over the CP ranks of the returned loss,
and of every parameter gradient, equals the single-process loss and
gradient (the same model in one process, fp64), with head-tail, sequential
(uneven S) and document-placement layouts, packed documents, ``-100`` labels
falling unevenly on the ranks, ``shift_labels=`` given, and labels passed
whole. With ``num_items_in_batch=`` (Hugging Face's sign that the caller
scales by its number of processes, as Trainer does) the sum over the ranks is
the single-process loss instead. Labels of another length raise ValueError on
every rank. (HF's own loss shifts inside each shard: without cplib.hf's loss
the mean differs.)"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from client_cases import assert_rank_mean

VOCAB = 64
# HF takes the loss in float32 (logits.float()) even for a float64 model; the
# bug this guards against (labels shifted inside shards) moves it by ~1e-3.
TOL = dict(atol=1e-6, rtol=1e-6)


def _llama():
    import transformers as tf

    import cplib.hf  # noqa: F401  (attn_implementation="cplib" and the CP loss)

    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, attn_implementation="cplib")
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(cfg).to(torch.float64)


def _batch(s: int, bounds: list[int]):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, s), generator=g)
    pos = torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])]).expand(2, s)
    labels = ids.clone()
    labels[0, 1: s // 3] = -100  # a prompt: unevenly on the ranks
    labels[1, s - 5:] = -100
    return ids, pos.contiguous(), labels


def _single_process(model, ids, pos, labels, **kw):
    loss = model(input_ids=ids, position_ids=pos, labels=labels, use_cache=False, **kw).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _check(s: int, load_balance, documents: bool, mode: str = "labels",
           compiled: bool = False) -> int:
    import cplib

    n = dist.get_world_size()
    mesh = DeviceMesh("cpu", list(range(n)))
    bounds = [0, 7, 8, s // 2 + 3, s] if documents else [0, s]
    ids, pos, labels = _batch(s, bounds)
    ref = _llama()
    model = copy.deepcopy(ref)
    kw = {}
    if mode in ("shift_labels", "num_items"):  # already shifted, listed as a buffer
        shifted = F.pad(labels[:, 1:], (0, 1), value=-100)
        if mode == "num_items":  # and the global count
            kw = {"num_items_in_batch": int((shifted != -100).sum())}
        # HF computes a loss only with labels; shift_labels then replaces them.
        want, want_grads = _single_process(ref, ids, pos, shifted, shift_labels=shifted, **kw)
    else:
        want, want_grads = _single_process(ref, ids, pos, labels)
        shifted = None
    buffers = [ids, pos] + ([labels] if mode == "labels" else [shifted] if shifted is not None
                            else [])
    docs = {"position_ids": pos.clone()} if documents else {}
    with cplib.context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                                load_balance=load_balance, **docs):
        if shifted is not None:
            loss = model(input_ids=ids, position_ids=pos, labels=shifted, shift_labels=shifted,
                         use_cache=False, **kw).loss
        else:  # "labels" (a buffer, sharded) or "full labels" (not a buffer)
            # aot_eager: the dynamo trace is what failed, and it compiles in a third of the time.
            run = torch.compile(model, backend="aot_eager") if compiled else model
            loss = run(input_ids=ids, position_ids=pos, labels=labels, use_cache=False).loss
        loss.backward()
    what = f"S={s} n={n} load_balance={load_balance} docs={documents} {mode} {compiled=}"
    # num_items_in_batch: the caller (Trainer) multiplies by its process count.
    assert_rank_mean(what, model, loss, (want, want_grads),
                     scale=n if mode == "num_items" else 1, **TOL)
    return 1


def _check_hf_own_loss_differs() -> int:
    """HF's own loss (shifting inside each shard, a mean per rank) misses:
    what cplib.hf's loss fixes."""
    import cplib
    from transformers.loss.loss_utils import ForCausalLMLoss

    n = dist.get_world_size()
    s = 16 * n
    ids, pos, labels = _batch(s, [0, s])
    model = _llama()
    want, _ = _single_process(copy.deepcopy(model), ids, pos, labels)
    model.loss_function = ForCausalLMLoss  # a loss set on the model is used as it is
    with cplib.context_parallel(DeviceMesh("cpu", list(range(n))), buffers=[ids, pos, labels],
                                buffer_seq_dims=[1, 1, 1], load_balance=True):
        loss = model(input_ids=ids, position_ids=pos, labels=labels, use_cache=False).loss
    dist.all_reduce(loss)
    assert abs(loss.item() / n - want.item()) > 1e-4, (loss.item() / n, want.item())
    return 1


def _check_all() -> int:
    n = dist.get_world_size()
    count = _check_hf_own_loss_differs()
    count += _check(16 * n, True, False)
    count += _check(16 * n + 3, False, False)  # sequential, uneven shards
    count += _check(16 * n + 1, "placement", True)
    count += _check(16 * n, True, True, mode="full labels")
    count += _check(16 * n, "placement", True, mode="shift_labels")
    count += _check(16 * n, True, False, mode="num_items")
    return count


@pytest.mark.parametrize("world_size", [2, 4])
def test_hf_loss_mean_over_ranks_is_single_process(ranks, world_size):
    assert ranks(world_size).run(_check_all) == [7] * world_size


def test_hf_loss_of_a_compiled_model_is_single_process(ranks):
    """torch.compile(model): before, dynamo failed in the loss's layout lookup
    (TypeError: 'int' object is not subscriptable, at logits.shape[-2])."""
    assert ranks(2).run(_check, 32, True, False, "labels", True) == [1, 1]


def _check_bad_labels() -> list[str]:
    import cplib

    n = dist.get_world_size()
    mesh = DeviceMesh("cpu", list(range(n)))
    s = 16 * n
    ids, pos, labels = _batch(s, [0, s])
    model = _llama()
    with cplib.context_parallel(mesh, buffers=[ids, pos], buffer_seq_dims=[1, 1],
                                load_balance=True):
        try:
            model(input_ids=ids, position_ids=pos, labels=labels[:, :-1], use_cache=False)
        except ValueError as exc:
            return [str(exc)]
    return ["no error"]


def test_hf_loss_labels_of_another_length_raise(ranks):
    results = ranks(2).run(_check_bad_labels)
    assert results[0] == results[1], results
    assert "labels has 31 positions" in results[0][0] and "buffers" in results[0][0], results
