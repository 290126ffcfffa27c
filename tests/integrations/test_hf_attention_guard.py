"""transformers' attention paths that context parallelism cannot shard raise
by name in a plain ``cplib.context_parallel`` region (no ``import cplib.hf``),
on every rank, instead of giving another result
(cplib/clients/hf_attention_guard.py).

Before, on 2 gloo ranks with a tiny Mistral (S = 32): ``sliding_window=24``
on SDPA lost its window (each 16-token shard is no longer than the window,
so transformers skipped the mask and SDPA ran plain causal attention): the
mean loss missed one process's by 7.5e-4, silently. A tiny Llama on
``attn_implementation="eager"`` attended within each shard: loss off by
2.0e-3 (``"flex_attention"`` too: logits off by 0.24 at S = 256). Two
packed 16-token documents, one per rank, in a region given no documents:
each rank's positions count 0..15, transformers saw no document start, and
attention ran across the border (on SDPA and on "cplib" alike): loss off by
6.2e-3 on both.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


def _model(kind: str, attn: str, window: int | None = None):
    import transformers

    if attn == "cplib":
        import cplib.hf  # noqa: F401  (registers it; takes the context's documents)
    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  attn_implementation=attn)
    if kind == "mistral":
        return transformers.MistralForCausalLM(
            transformers.MistralConfig(**common, sliding_window=window))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))


def _under_cp(kind: str, attn: str, window: int | None = None, packed: bool = False) -> str:
    """The mean loss over the ranks minus one process's, or the error's text;
    ``packed``: one 16-token document per rank (sequential shards), no cache,
    so that transformers looks for documents in position_ids."""
    import cplib

    n = dist.get_world_size()
    model = _model(kind, attn, window)
    ids = torch.randint(0, 64, (1, 16 * n), generator=torch.Generator().manual_seed(1))
    pos = (torch.arange(16).repeat(n) if packed else torch.arange(16 * n))[None]
    labels, kw = ids.clone(), dict(use_cache=False) if packed else {}
    with torch.no_grad():
        try:
            with cplib.context_parallel(DeviceMesh("cpu", list(range(n))),
                                        buffers=[ids, pos, labels], buffer_seq_dims=[1, 1, 1],
                                        load_balance=not packed):
                loss = model(input_ids=ids, position_ids=pos, labels=labels, **kw).loss
        except NotImplementedError as exc:
            return str(exc)
        # Outside the region: one process, transformers' own path.
        want = model(input_ids=ids, position_ids=pos, labels=labels, **kw).loss
    dist.all_reduce(loss)
    return f"{abs(loss.item() / n - want.item()):.1e}"


def test_sdpa_sliding_window_shorter_than_the_sequence_raises(ranks):
    got = ranks(2).run(_under_cp, "mistral", "sdpa", 24)  # shards of 16 <= 24 < 32
    assert got[0] == got[1], got
    assert "sliding_window=24" in got[0] and "32-token" in got[0], got[0]
    # A window no shorter than the sequence changes nothing: it runs, exactly.
    got = ranks(2).run(_under_cp, "mistral", "sdpa", 32)
    assert float(got[0]) < 1e-6, got


def _lookup_under_cp(attn: str) -> str:
    """What a layer's lookup of ``attn`` gives in a region (a model on flex
    builds its BlockMasks first: seconds on CPU, for the same lookup)."""
    import cplib
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    x = torch.zeros(1, 2 * dist.get_world_size())
    with cplib.context_parallel(DeviceMesh("cpu", list(range(dist.get_world_size()))),
                                buffers=[x], buffer_seq_dims=[1]):
        try:
            ALL_ATTENTION_FUNCTIONS.get_interface(attn, None)
        except NotImplementedError as exc:
            return str(exc)
    return "no error"


def test_eager_and_flex_attention_raise_under_cp(ranks):
    got = ranks(2).run(_under_cp, "llama", "eager")
    assert got[0] == got[1] and "attn_implementation='eager'" in got[0], got
    got = ranks(2).run(_lookup_under_cp, "flex_attention")
    assert got[0] == got[1] and "_ContextParallel(attention_type=FLEX)" in got[0], got
    assert float(ranks(2).run(_under_cp, "llama", "sdpa")[0]) < 1e-6


def test_packed_position_ids_without_the_contexts_documents_raise(ranks):
    for attn in ("sdpa", "cplib"):
        got = ranks(2).run(_under_cp, "llama", attn, None, True)
        assert got[0] == got[1] and "packed documents, but" in got[0], got


def _without_position_ids(use_cache: bool, mask: bool) -> str:
    """The error's text for a model given no position_ids in a region (with
    the default cache of a forward, or a 2-D mask, or neither)."""
    import cplib

    n = dist.get_world_size()
    model = _model("llama", "sdpa")
    ids = torch.randint(0, 64, (1, 16 * n), generator=torch.Generator().manual_seed(1))
    buffers = [ids, ids.clone()] + ([torch.ones_like(ids)] if mask else [])
    mesh = DeviceMesh("cpu", list(range(n)))
    with torch.no_grad(), cplib.context_parallel(mesh, buffers=buffers,
                                                 buffer_seq_dims=[1] * len(buffers)):
        try:
            model(input_ids=buffers[0], labels=buffers[1], use_cache=use_cache,
                  attention_mask=buffers[2] if mask else None)
        except NotImplementedError as exc:
            return str(exc)
    return "no error"


def test_missing_position_ids_raise_with_a_cache_or_a_mask(ranks):
    """Before, the default cache (and a 2-D mask) kept transformers from
    looking at the positions it numbered per shard: the rotary embeddings of
    ranks past the first were another sequence's, silently."""
    for use_cache, mask, text in ((True, False, "numbers each shard alone"),
                                  (False, True, "numbers each shard alone"),
                                  (False, False, "was not given position_ids")):
        got = ranks(2).run(_without_position_ids, use_cache, mask)
        assert got[0] == got[1] and text in got[0], (use_cache, mask, got)


def _in_a_region(attn: str, bounds: list[int] | None, load_balance: bool, use_cache: bool,
                 model_positions: bool) -> str:
    """The mean loss's error against one process, or the error's text, for a
    region given the documents ``bounds`` (None: none) and a model given its
    position_ids (``model_positions``) or not."""
    import cplib

    n = dist.get_world_size()
    model = _model("llama", attn)
    ids = torch.randint(0, 64, (1, 16 * n), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(b - a) for a, b in zip(bounds or [0, 16 * n],
                                                          (bounds or [0, 16 * n])[1:])])[None]
    labels = ids.clone()
    docs = {"position_ids": pos} if bounds else {}
    with torch.no_grad():
        try:
            with cplib.context_parallel(DeviceMesh("cpu", list(range(n))),
                                        buffers=[ids, labels, pos], buffer_seq_dims=[1, 1, 1],
                                        load_balance=load_balance, **docs):
                given = {"position_ids": pos} if model_positions else {}
                loss = model(input_ids=ids, labels=labels, use_cache=use_cache, **given).loss
        except NotImplementedError as exc:
            return str(exc)
        with cplib.attention_documents(position_ids=pos) if bounds else contextlib.nullcontext():
            want = model(input_ids=ids, position_ids=pos, labels=labels, use_cache=False).loss
    dist.all_reduce(loss)
    return f"{abs(loss.item() / n - want.item()):.1e}"


def test_missing_position_ids_raise_in_a_region_given_documents(ranks):
    """Before, the region's documents switched the check off: with documents
    of 10 and 22 tokens on 2 ranks, the second rank's rotary positions ran
    0..15 instead of 6..21, and the mean loss missed one process's by 1.0e-4
    (with the default cache and without), silently."""
    for use_cache in (False, True):
        got = ranks(2).run(_in_a_region, "cplib", [0, 10, 32], False, use_cache, False)
        assert got[0] == got[1] and "numbers each shard alone" in got[0], (use_cache, got)
    # Documents that each fill a shard: transformers' numbering is theirs.
    got = ranks(2).run(_in_a_region, "cplib", [0, 16, 32], False, True, False)
    assert float(got[0]) < 1e-6, got


def test_sdpa_without_a_cache_runs_on_load_balanced_shards_and_documents(ranks):
    """``use_cache=False`` (what gradient checkpointing forces in training):
    transformers looks for packed documents in this rank's position_ids, and
    took a load-balanced shard's jump (0..7, 24..31), or the context's
    documents seen from one shard, for document starts; it built a 4-D mask,
    which the ring refuses (NotImplementedError). The documents are cplib's
    under context parallelism: the context's, or none (checked)."""
    for bounds, load_balance in ((None, True), ([0, 10, 32], True), ([0, 10, 32], False)):
        got = ranks(2).run(_in_a_region, "sdpa", bounds, load_balance, False, True)
        assert float(got[0]) < 1e-6, (bounds, load_balance, got)
