"""transformers' attention paths that context parallelism cannot shard raise
by name in a plain ``cplib.context_parallel`` region (no ``import cplib.hf``),
on every rank, instead of giving another result
(cplib/clients/hf_attention_guard.py).

Before, on 2 gloo ranks with a tiny Mistral (S = 32): ``sliding_window=24``
on SDPA lost its window (each 16-token shard is no longer than the window,
so transformers skipped the mask and SDPA ran plain causal attention): the
mean loss missed one process's by 7.5e-4, silently. A tiny Llama on
``attn_implementation="eager"`` attended within each shard: loss off by
2.0e-3.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


def _model(kind: str, attn: str, window: int | None = None):
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  attn_implementation=attn)
    if kind == "mistral":
        return transformers.MistralForCausalLM(
            transformers.MistralConfig(**common, sliding_window=window))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))


def _under_cp(kind: str, attn: str, window: int | None = None) -> str:
    """The mean loss over the ranks minus one process's, or the error's text."""
    import cplib

    n = dist.get_world_size()
    model = _model(kind, attn, window)
    ids = torch.randint(0, 64, (1, 16 * n), generator=torch.Generator().manual_seed(1))
    pos, labels = torch.arange(16 * n)[None], ids.clone()
    with torch.no_grad():
        want = model(input_ids=ids, position_ids=pos, labels=labels).loss
        try:
            with cplib.context_parallel(DeviceMesh("cpu", list(range(n))),
                                        buffers=[ids, pos, labels], buffer_seq_dims=[1, 1, 1]):
                loss = model(input_ids=ids, position_ids=pos, labels=labels).loss
        except NotImplementedError as exc:
            return str(exc)
        # Outside the region the model is transformers' own again.
        assert torch.equal(model(input_ids=ids, position_ids=pos, labels=labels).loss, want)
    dist.all_reduce(loss)
    return f"{abs(loss.item() / n - want.item()):.1e}"


def test_sdpa_sliding_window_shorter_than_the_sequence_raises(ranks):
    got = ranks(2).run(_under_cp, "mistral", "sdpa", 24)  # shards of 16 <= 24 < 32
    assert got[0] == got[1], got
    assert "sliding_window=24" in got[0] and "32-token" in got[0], got[0]
    # A window no shorter than the sequence changes nothing: it runs, exactly.
    got = ranks(2).run(_under_cp, "mistral", "sdpa", 32)
    assert float(got[0]) < 1e-6, got


def test_eager_attention_raises_under_cp(ranks):
    got = ranks(2).run(_under_cp, "llama", "eager")
    assert got[0] == got[1], got
    assert "attn_implementation='eager'" in got[0], got[0]
    assert float(ranks(2).run(_under_cp, "llama", "sdpa")[0]) < 1e-6
