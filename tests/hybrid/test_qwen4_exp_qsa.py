"""Qwen4-Exp's indexed attention layers (the QSA indexer: per query, top-k key
blocks among every earlier token, read from transformers' S x S mask).
``attn_implementation="cplib"`` builds no such mask: setting it on a model
with such layers raises NotImplementedError naming the family and its
indexed attention (cplib/integrations/transformers/family_verdicts.py). With
SDPA under context parallelism the model is refused by name on every rank,
at its forward's start (a shard holds only its own tokens). A model of only
linear layers runs (tests/hybrid/test_hybrid_families.py). Before, the
indexer failed inside transformers with an AttributeError."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hybrid_cases import VOCAB, tiny_model

QSA = dict(layer_types=["linear_attention", "indexed_attention"], indexer_n_heads=2,
           indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=8, indexer_compress_ratio=4)


def _ids(s: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, s), generator=torch.Generator().manual_seed(3))


def test_cplib_attention_refuses_the_qsa_indexer_by_name():
    with pytest.raises(NotImplementedError, match="qwen4_exp.*indexed"):
        tiny_model("qwen4_exp", attn_implementation="cplib", overrides=QSA)
    # The same model on SDPA runs (transformers' own path), and refuses the switch.
    model = tiny_model("qwen4_exp", attn_implementation="sdpa", overrides=QSA)
    assert model(input_ids=_ids(16), use_cache=False).logits.shape == (1, 16, VOCAB)
    with pytest.raises(NotImplementedError, match="qwen4_exp.*indexed"):
        model.set_attn_implementation("cplib")


def _under_cp(attn: str) -> str:
    import cplib

    n = dist.get_world_size()
    ids, pos = _ids(16 * n), torch.arange(16 * n)[None]
    try:
        model = tiny_model("qwen4_exp", attn_implementation=attn, overrides=QSA)
        with torch.no_grad(), cplib.context_parallel(
                DeviceMesh("cpu", list(range(n))), buffers=[ids, pos], buffer_seq_dims=[1, 1]):
            model(input_ids=ids, position_ids=pos, use_cache=False)
    except NotImplementedError as exc:
        assert "qwen4_exp" in str(exc) and "indexed" in str(exc), str(exc)
        return str(exc).split(":")[1]
    return "ran"


@pytest.mark.parametrize("attn", ["cplib", "sdpa"])
def test_the_qsa_indexer_is_refused_on_every_rank_under_cp(ranks, attn):
    got = ranks(2).run(_under_cp, attn)
    assert got[0] == got[1] != "ran", got
