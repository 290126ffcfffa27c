"""Hugging Face's losses other than the causal LM's, under a plain
``cplib.context_parallel`` region (no ``import cplib.hf``): the masked-LM
(ModernBERT) and token-classification (Llama) losses are the single-process loss,
as the mean over the CP ranks of the loss and of every parameter gradient
(and as their sum with ``num_items_in_batch=`` where the model passes it
on to its loss); a model that pools one
token (sequence classification) and a loss that reads the whole sequence at
once (question answering) raise NotImplementedError on every rank
(cplib/clients/hf_loss.py, hf_pooled.py).

Before, on 2 gloo ranks (S = 32, a quarter of the labels -100, unevenly on
the ranks): HF's own losses averaged each rank's shard (the mean loss off by
2.8e-5 relative for ModernBERT's MLM, 4.3e-4 for Llama's token classifier),
and the sequence classifier pooled each rank's last token: per-shard
results, silently.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from client_cases import assert_rank_mean

TOL = dict(atol=1e-6, rtol=1e-6)  # HF takes these losses in float32 (logits.float())


def _model(task: str):
    import transformers as tf

    torch.manual_seed(0)
    if task == "masked":  # BERT's own MLM head takes nn.CrossEntropyLoss (docs/hf.md)
        cfg = tf.ModernBertConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  global_attn_every_n_layers=1, pad_token_id=0, bos_token_id=1,
                                  eos_token_id=2, cls_token_id=1, sep_token_id=2,
                                  attn_implementation="sdpa")
        return tf.ModernBertForMaskedLM(cfg).to(torch.float64)
    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         num_labels=5, pad_token_id=0, classifier_dropout=0.0,
                         attn_implementation="sdpa")
    cls = {"token": tf.LlamaForTokenClassification, "sequence":
           tf.LlamaForSequenceClassification, "qa": tf.LlamaForQuestionAnswering}[task]
    return cls(cfg).to(torch.float64)


def _batch(task: str, s: int):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 64, (2, s), generator=g)
    labels = torch.randint(0, 64 if task == "masked" else 5, (2, s), generator=g)
    labels[0, : s // 4] = -100  # all on the first rank(s)
    labels[1, -3:] = -100
    return ids, torch.arange(s).expand(2, s).contiguous(), labels


def _one_process(model, ids, pos, labels, **kw):
    loss = model(input_ids=ids, position_ids=pos, labels=labels, **kw).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _check(task: str, num_items: bool) -> int:
    import cplib

    n = dist.get_world_size()
    s = 16 * n
    ids, pos, labels = _batch(task, s)
    ref = _model(task)
    model = copy.deepcopy(ref)
    kw = {"num_items_in_batch": int((labels != -100).sum())} if num_items else {}
    want, want_grads = _one_process(ref, ids, pos, labels, **kw)
    with cplib.context_parallel(DeviceMesh("cpu", list(range(n))), buffers=[ids, pos, labels],
                                buffer_seq_dims=[1, 1, 1], load_balance=True):
        loss = model(input_ids=ids, position_ids=pos, labels=labels, **kw).loss
        loss.backward()
    # With num_items_in_batch the caller (Trainer) multiplies by n.
    assert_rank_mean(f"{task} n={n} num_items={num_items}", model, loss, (want, want_grads),
                     scale=n if num_items else 1, **TOL)
    return 1


def _check_all() -> int:
    # Llama's token classifier does not pass num_items_in_batch on to its loss.
    return sum(_check(task, num_items) for task, num_items in
               (("masked", False), ("masked", True), ("token", False)))


@pytest.mark.parametrize("world_size", [2, 4])
def test_masked_lm_and_token_classification_losses_are_single_process(ranks, world_size):
    assert ranks(world_size).run(_check_all) == [3] * world_size


def _refusal(task: str) -> str:
    import cplib

    n = dist.get_world_size()
    ids, pos, labels = _batch("token", 16 * n)
    model = _model(task)
    kw = (dict(start_positions=torch.tensor([3, 20]), end_positions=torch.tensor([5, 30]))
          if task == "qa" else {})
    with cplib.context_parallel(DeviceMesh("cpu", list(range(n))), buffers=[ids, pos],
                                buffer_seq_dims=[1, 1], load_balance=True):
        try:
            model(input_ids=ids, position_ids=pos, **kw)
        except NotImplementedError as exc:
            message = str(exc)
        else:
            message = "no error"
    # Outside the region the model is HF's own.
    out = model(input_ids=ids, position_ids=pos, **kw)
    assert torch.isfinite(out.logits if task == "sequence" else out.loss).all()
    return message


def test_pooled_model_and_whole_sequence_loss_raise_on_every_rank(ranks):
    got = ranks(2).run(_refusal, "sequence")  # pooled: with or without labels
    assert got[0] == got[1], got
    assert "LlamaForSequenceClassification classifies one pooled token" in got[0], got[0]
    got = ranks(2).run(_refusal, "qa")
    assert got[0] == got[1], got
    assert "ForQuestionAnsweringLoss reads the whole sequence" in got[0], got[0]
