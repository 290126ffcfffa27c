"""``cplib.attention_window`` and ``cplib.attention_documents`` with no
context parallelism in effect: the SDPA calls made inside get the window and
the documents in this process (cplib/frontend/one_process_sdpa.py), the
same attention the ring computes for them under context parallelism
(tests/frontend/test_cp_documents.py pins the ring against the same
reference). fp64, against an explicit mask: out and the gradients of q, k
and v; a row that sees no key gives zeros.

Before, both blocks were ignored outside context parallelism: torch's SDPA
ran without the window and across documents, silently."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cplib
from harness import assert_close
from ring_mask_cases import masked_reference, visible

S = 37
CU = torch.tensor([0, 5, 20, S])


def _inputs():
    g = torch.Generator().manual_seed(5)
    return [torch.randn(2, 4, S, 8, generator=g, dtype=torch.float64) for _ in range(4)]


def _sdpa_in_blocks(window, documents: bool, q, k, v, **kw) -> torch.Tensor:
    with cplib.attention_window(window) if window is not None else _nothing(), \
            cplib.attention_documents(CU) if documents else _nothing():
        return F.scaled_dot_product_attention(q, k, v, **kw)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("window,documents,causal", [
    (3, False, True), ((4, 2), False, False), (None, True, True), ((6, None), True, True)])
def test_window_and_documents_outside_context_parallelism(window, documents, causal):
    q, k, v, cot = _inputs()
    mask = visible(S, causal=causal, cu_seqlens=CU if documents else None, window=window)
    want = masked_reference(q, k, v, cot, mask)
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = _sdpa_in_blocks(window, documents, q, k, v, is_causal=causal)
    out.backward(cot)
    for name, got, exp in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad),
                              (want[0],) + want[2:]):
        assert_close(got, exp, atol=1e-12, rtol=1e-12, what=f"{name} {window} {documents}")
    plain = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert (plain - out).abs().max() > 1e-3  # what was computed before


def test_key_padding_and_rows_that_see_nothing():
    q, k, v, cot = _inputs()
    padding = torch.ones(2, 1, 1, S, dtype=torch.bool)
    padding[0, ..., :2] = False  # batch 0: its first two keys are padding
    mask = visible(S, causal=True, window=3) & padding
    seen = mask.any(-1, keepdim=True)  # batch 0's first two rows see nothing: zeros
    # The reference gives those rows all keys (no NaN) and no cotangent.
    want = masked_reference(q, k, v, cot * seen, mask | ~seen)
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = _sdpa_in_blocks(3, False, q, k, v, attn_mask=padding, is_causal=True)
    out.backward(cot)
    assert not seen[0, 0, :2].any() and torch.equal(out[0, :, :2], torch.zeros_like(out[0, :, :2]))
    for name, got, exp in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad),
                              (want[0],) + want[2:]):
        exp = torch.where(seen, exp, 0) if name == "out" else exp
        assert_close(got, exp, atol=1e-12, rtol=1e-12, what=name)


def test_window_none_turns_an_outer_window_off_and_cross_attention_raises():
    q, k, v, _ = _inputs()
    with cplib.attention_window(3), cplib.attention_window(None):
        got = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert_close(got, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=0, rtol=0,
                 what="attention_window(None) inside attention_window(3)")
    with cplib.attention_window(3), pytest.raises(NotImplementedError, match="37 queries and 9"):
        F.scaled_dot_product_attention(q, k[:, :, :9], v[:, :, :9])
    with cplib.attention_documents(CU), pytest.raises(ValueError, match="cover 37 tokens"):
        F.scaled_dot_product_attention(q[:, :, :9], k[:, :, :9], v[:, :, :9])


def test_multihead_attention_needing_weights_raises():
    """nn.MultiheadAttention computes its weights without SDPA: no window."""
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(1, S, 8)
    with cplib.attention_window(3), pytest.raises(NotImplementedError, match="need_weights"):
        mha(x, x, x)
    with cplib.attention_window(3):
        got, _ = mha(x, x, x, need_weights=False)
    assert_close(got, mha(x, x, x, need_weights=False, attn_mask=~visible(S, causal=False,
                                                                           window=3))[0],
                 atol=1e-6, rtol=1e-5, what="MultiheadAttention in attention_window(3)")
