"""Hugging Face's 2-D padding ``attention_mask`` under context parallelism:
a tiny Qwen3 (and Mistral, whose window meets the padding) in float32 with
``attn_implementation="cplib"``, the mask listed among the context's
buffers like ``input_ids``, against HF's eager attention on the full batch
in one process: logits at the non-padded positions and every parameter
gradient of the loss over the non-padded tokens, world sizes 2 and 4, ring,
Ulysses and USP, with and without load balancing.

Fully padded query rows (left padding sees only padding) get eager's value
(a uniform average over every key: the dtype's lowest value swallows their
scores), in one process and under context parallelism alike, and the labels
are those HF's collator makes (the last pad predicts the first token), so
every position's logits and the loss through those rows are compared.
Before, such a row attended to its masked keys under CP: the loss was off
by 1.8e-4 (Llama) and hybrid models' gradients by 21-69% relative.
float32, because HF's eager mask in float64 adds float64's lowest value to
the scores, which overflows to -inf in those rows and gives NaN that
reaches every gradient.
"""

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
# HF's eager against cplib's ring, both float32 (test_hf_models' tolerance).
TOL = dict(atol=3e-5, rtol=3e-4)


def _model(name: str):
    import transformers as tf

    import cplib.hf  # noqa: F401  (registers attn_implementation="cplib")

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  max_position_embeddings=128, attn_implementation="eager")
    if name == "qwen3":
        model_cls, config = tf.Qwen3ForCausalLM, tf.Qwen3Config(**common)
    else:  # a window shorter than a shard, across the padding's edge
        model_cls, config = tf.MistralForCausalLM, tf.MistralConfig(**common, sliding_window=5)
    torch.manual_seed(0)
    return model_cls(config).float()


def _batch(s: int):
    """Row 0 left-padded past a whole shard (some ranks hold only padding
    keys in it), row 1 right-padded; positions as ``generate`` makes them."""
    ids = torch.randint(0, VOCAB, (2, s), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, s, dtype=torch.long)
    mask[0, : s // 2 + 1] = 0
    mask[1, -3:] = 0
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    # HF's collator: -100 at the padding, shifted: each position predicts the
    # next real token, the last left pad included (it predicts the first token).
    labels = torch.cat([ids[:, 1:], torch.zeros(2, 1, dtype=ids.dtype)], dim=1)
    real = torch.cat([mask[:, 1:].bool(), torch.zeros(2, 1, dtype=torch.bool)], 1)
    labels = labels.masked_fill(~real, -100)
    return ids, mask, pos, labels


def _loss(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1).double(), labels.flatten(), ignore_index=-100,
                           reduction="sum")


def _eager(model, ids, mask, pos, labels):
    """Loss (backward done) and logits of HF eager on the full batch."""
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
    loss = _loss(logits, labels)
    loss.backward()
    return loss.detach(), logits.detach()


def _check_case(name, pristine, refs, n, ulysses, lb) -> None:
    rank = dist.get_rank()
    mesh = DeviceMesh("cpu", list(range(n)))
    ids, mask, pos, labels = _batch(8 * n)
    model = copy.deepcopy(pristine)
    model.set_attn_implementation("cplib")
    with context_parallel(mesh, buffers=[ids, mask, pos, labels], buffer_seq_dims=[1] * 4,
                          load_balance=lb, ulysses_degree=ulysses) as cp:
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos,
                       use_cache=False).logits
        loss = _loss(logits, labels)
        loss.backward()
        (full_logits,) = cp.unshard([logits.detach()], [1])
    total = loss.detach().clone()
    dist.all_reduce(total)
    grads = {}
    for pname, p in model.named_parameters():
        grads[pname] = p.grad.clone()
        dist.all_reduce(grads[pname])
    if rank != 0:
        return
    ref_loss, ref_logits, ref = refs
    what = f"{name} n={n} ulysses={ulysses} lb={lb}"
    assert_close(full_logits, ref_logits, what=f"{what}: logits (padding rows too)", **TOL)
    assert_close(total, ref_loss, what=f"{what}: loss", **TOL)
    count = 0
    for pname, pr in ref.named_parameters():
        assert_close(grads[pname], pr.grad, what=f"{what}: grad of {pname}", **TOL)
        count += 1
    assert count > 8, what


def _check_padding() -> int:
    use_ring("native")
    _cp_options.rotate_method = _RotateMethod.P2P
    n, rank = dist.get_world_size(), dist.get_rank()
    cases = [("qwen3", 1, True), ("qwen3", 1, False), ("qwen3", n, False), ("qwen3", n, True),
             ("mistral", 1, True)]
    if n == 4:
        cases.append(("qwen3", 2, True))
    done = 0
    for name in ("qwen3", "mistral"):
        pristine = _model(name)
        refs = None
        if rank == 0:  # every rank holds the full batch; the reference runs once
            ref = copy.deepcopy(pristine)
            refs = (*_eager(ref, *_batch(8 * n)), ref)
        for case_name, ulysses, lb in cases:
            if case_name == name:
                _check_case(name, pristine, refs, n, ulysses, lb)
                done += 1
    return done


@pytest.mark.parametrize("world_size", [2, 4])
def test_hf_padding_mask_under_context_parallel(ranks, world_size):
    expected = 6 if world_size == 4 else 5
    assert ranks(world_size).run(_check_padding) == [expected] * world_size


def _check_bad_masks() -> int:
    use_ring("native")
    n = dist.get_world_size()
    mesh = DeviceMesh("cpu", list(range(n)))
    model = _model("qwen3")
    model.set_attn_implementation("cplib")
    s = 8 * n
    ids, mask, pos, labels = _batch(s)
    full_mask = mask.clone()
    # Padding on rank 0's shard only (head-tail: chunks 0 and 2n - 1): the
    # other ranks pass the mask too, so the ranks' q/k agree.
    few = torch.ones_like(mask)
    few[0, :2] = 0
    plain = torch.arange(s).expand(2, s)
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        ref = eager(input_ids=ids, attention_mask=few, position_ids=plain,
                    use_cache=False).logits
    plain = plain.clone()
    with torch.no_grad(), context_parallel(mesh, buffers=[ids, mask, pos, few, plain],
                                           buffer_seq_dims=[1] * 5, load_balance=True) as cp:
        assert bool(few.all()) == (dist.get_rank() != 0)
        got = model(input_ids=ids, attention_mask=few, position_ids=plain,
                    use_cache=False).logits
        (got,) = cp.unshard([got], [1])
        assert_close(got, ref, what="padding on one rank", **TOL)
        local = s // n
        # A custom 4-D mask (not key-padding): the shape is named, on every rank.
        custom = torch.ones(2, 1, local, local, dtype=torch.bool)
        with pytest.raises(NotImplementedError, match=rf"\(2, 1, {local}, {local}\)"):
            model(input_ids=ids, attention_mask=custom, position_ids=pos, use_cache=False)
        # The whole (unsharded) mask: it does not cover this rank's keys.
        with pytest.raises(ValueError, match=rf"attention_mask \(got shape \(2, {s}\)\)"):
            model(input_ids=ids, attention_mask=full_mask, position_ids=pos, use_cache=False)
        # A 4-D key-padding mask of the local keys is the 2-D one.
        two_d = model(input_ids=ids, attention_mask=mask, position_ids=pos,
                      use_cache=False).logits
        four_d = model(input_ids=ids, attention_mask=mask.bool()[:, None, None, :],
                       position_ids=pos, use_cache=False).logits
        real = mask.bool()
        assert_close(four_d[real], two_d[real], atol=0, rtol=0, what="4-D key-padding mask")
        # An all-ones mask is no padding (cplib_mask passes None on every rank).
        model(input_ids=ids, attention_mask=torch.ones_like(mask), position_ids=pos,
              use_cache=False)
    return 1


def test_hf_bad_masks_under_context_parallel(ranks):
    assert ranks(2).run(_check_bad_masks) == [1, 1]


def test_cplib_outside_context_parallelism_is_eager_on_padding_rows():
    """One process: ``attn_implementation="cplib"`` gives the rows that see
    nothing eager's value and gradient (before: softmax over every key, a
    loss off through the last pad's label), Qwen3 and Mistral's window."""
    for name in ("qwen3", "mistral"):
        eager = _model(name)
        mine = copy.deepcopy(eager)
        mine.set_attn_implementation("cplib")
        batch = _batch(16)
        want_loss, want_logits = _eager(eager, *batch)
        got_loss, got_logits = _eager(mine, *batch)
        assert_close(got_logits, want_logits, what=f"{name}: logits", **TOL)
        assert_close(got_loss, want_loss, what=f"{name}: loss", **TOL)
        for (pname, p), q in zip(mine.named_parameters(), eager.parameters()):
            assert_close(p.grad, q.grad, what=f"{name}: grad of {pname}", **TOL)
