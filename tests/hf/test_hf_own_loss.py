"""Hugging Face models that compute their loss themselves (BERT's masked-LM
head builds its own ``nn.CrossEntropyLoss``, as about 380 of transformers'
model classes do) rather than through the model's ``loss_function``: under
context parallelism ``labels=`` raises NotImplementedError on every rank
(cplib/clients/hf_own_loss.py), and the loss the message points to,
``cplib.loss.cross_entropy(logits, labels, shift=False)`` on the model's
logits, is the single-process loss, as the mean over the CP ranks of the
loss and of every parameter gradient.

Before, on 2 gloo ranks (S = 32, a quarter of the labels -100, all on the
first rank): each rank's loss was the mean over its own shard, and the
ranks' mean loss was off by 7.8e-4 relative (3.0e-5 on 4 ranks), silently.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from client_cases import assert_rank_mean

TOL = dict(atol=1e-9, rtol=1e-9)  # float64 throughout


def _bert():
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.BertConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                        num_hidden_layers=2, num_attention_heads=4,
                        max_position_embeddings=128, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
    return tf.BertForMaskedLM(cfg).to(torch.float64)


def _batch(s: int):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 64, (2, s), generator=g)
    labels = torch.randint(0, 64, (2, s), generator=g)
    labels[0, : s // 4] = -100  # all on the first rank
    return ids, torch.arange(s).expand(2, s).contiguous(), labels


def _own_loss_refused_and_cplib_loss_exact() -> str:
    import cplib
    import cplib.loss

    n = dist.get_world_size()
    ids, pos, labels = _batch(16 * n)
    ref = _bert()
    model = copy.deepcopy(ref)
    want = ref(input_ids=ids, position_ids=pos, labels=labels).loss
    want.backward()
    want_grads = {name: p.grad.clone() for name, p in ref.named_parameters()}
    with cplib.context_parallel(DeviceMesh("cpu", list(range(n))), buffers=[ids, pos, labels],
                                buffer_seq_dims=[1, 1, 1], load_balance=True):
        try:
            model(input_ids=ids, position_ids=pos, labels=labels)
        except NotImplementedError as exc:
            message = str(exc)
        else:
            message = "no error"
        logits = model(input_ids=ids, position_ids=pos).logits
        loss = cplib.loss.cross_entropy(logits, labels, shift=False)
        loss.backward()
    assert_rank_mean(f"BERT MLM n={n}", model, loss, (want.detach(), want_grads), **TOL)
    # Outside the region the model is HF's own, labels and all.
    assert torch.allclose(model(input_ids=ids, position_ids=pos, labels=labels).loss,
                          want, **TOL)
    return message


def test_a_model_computing_its_own_loss_raises_and_cplib_loss_is_exact(ranks):
    got = ranks(2).run(_own_loss_refused_and_cplib_loss_exact)
    assert got[0] == got[1], got
    assert "BertForMaskedLM computes its loss from labels= itself" in got[0], got[0]
    assert "cplib.loss.cross_entropy" in got[0], got[0]
