"""Why a family is not exact under a switch: the causes the report groups
failures by (tests/support/family_table.py). Each rule reads the
classification (class, error, the family's features from
family_steps._features) and names one cause, read off transformers 5.23's
modeling code; the first rule that matches wins. NOTES adds what only
reading a family's code shows."""

from __future__ import annotations

import re
from typing import Any, Callable

Entry = dict[str, Any]


def _err(e: Entry, *patterns: str) -> bool:
    return any(re.search(p, e.get("error", "")) for p in patterns)


def _wrong(e: Entry) -> bool:
    return e["class"] == "wrong" or e.get("helper_loss", {}).get("class") == "wrong"


# (cause, rule(features, switch, entry)): ordered, most specific first.
RULES: list[tuple[str, Callable[[set, str, Entry], bool]]] = [
    ("hang: one rank raises outside cplib (the indexer on its own shard) while the other waits "
     "in cplib's handshake, which has no timeout of the group's",
     lambda f, s, e: e["class"] == "hang"),
    ("build: the family picks its attention class from a dict keyed by "
     "config._attn_implementation ('eager', 'sdpa', 'flash_attention_2'); 'cplib' is no key",
     lambda f, s, e: e["class"] == "build_fails" and _err(e, r"KeyError: 'cplib'")),
    ("sparse indexer reads transformers' S x S mask (attention_mask[...] to pick top-k keys), "
     "which the 'cplib' mask function returns as None",
     lambda f, s, e: "indexer" in f and _err(e, r"NoneType' object is not subscriptable")),
    ("compressed attention (DeepSeek-V4): the compressors append compressed K/V to the local "
     "keys, which reach the ring as q 16 vs kv 20 (refused, naming no model); outside CP the "
     "compressor's causal block bias, a 4-D mask, is dropped",
     lambda f, s, e: "compressor" in f and (_wrong(e) or _err(e, r"equal local q and kv"))),
    ("sparse indexer under CP on SDPA: its top-k selection reaches cplib as a 4-D mask, "
     "refused by a generic mask error that names no model",
     lambda f, s, e: "indexer" in f and e["class"] == "refused_unnamed"),
    ("sparse indexer whose selection the layer turns into a mask for eager and sdpa only: "
     "'cplib' ignores it (block_indices=) and attends to every earlier key",
     lambda f, s, e: "indexer" in f and _wrong(e)),
    ("attention computed inline (torch.bmm / matmul / baddbmm in the layer), never through the "
     "attention interface: with 'cplib' the mask function returns None, so the layer gets no "
     "causal mask and attends to later tokens; under CP it attends within its shard",
     lambda f, s, e: "interface" not in f and e["class"] in ("wrong", "crash")),
    ("causal only through the mask: the decoder's self-attention is built with is_causal=False, "
     "so 'cplib' (which drops the mask) attends to later tokens",
     lambda f, s, e: "self_attn_not_causal" in f and _wrong(e) and s == "cplib_outside"),
    ("window or chunk only in transformers' mask_function (the layer passes no sliding_window "
     "to the interface; Llama 4's chunked attention): cplib_mask ignores mask_function, so the "
     "layer attends over the whole causal past",
     lambda f, s, e: ("window" in f or "chunks" in f) and _wrong(e)),
    ("the model's forward takes no position_ids: its positions (learned, sinusoidal or "
     "rotary from its own arange) are numbered from 0 on each shard",
     lambda f, s, e: "no_position_ids" in f and _wrong(e) and s != "cplib_outside"),
    ("a 4-D mask transformers builds (from a mask_function: chunks, windows the layer does not "
     "carry; or inline: Kosmos-2's _make_causal_mask, BLT's patch cross-attention) refused "
     "under CP by a generic mask error that names no model",
     lambda f, s, e: e["class"] == "refused_unnamed"
     and _err(e, r"only key-padding masks", r"attention mask of shape")),
    ("cplib's attention refuses a feature (logit soft-capping, an additive position_bias) "
     "with a message that names no family or layer",
     lambda f, s, e: e["class"] == "refused_unnamed" and _err(e, r"softcap", r"position_bias")),
    ("the position_ids guard refuses (the model does not pass position_ids down, or numbers "
     "its own) with a message that names no model",
     lambda f, s, e: e["class"] == "refused_unnamed" and _err(e, r"position_ids")),
    ("SDPA's broadcast of one K/V head over the query heads (torch accepts it) is refused: "
     "'pass enable_gqa', which transformers cannot pass",
     lambda f, s, e: _err(e, r"enable_gqa")),
    ("Trainer under CP adds position_ids = arange(S) to a batch without them "
     "(_prepare_context_parallel_inputs); RoBERTa-style models (positions from padding_idx + 1) "
     "and Kosmos-2 number their own positions otherwise, so the CP step trains other positions "
     "than Trainer's one-process step (transformers' Trainer; cplib is given a valid arange)",
     lambda f, s, e: s == "trainer" and _wrong(e)),
    ("the family does not build, or its reference does not run, in one process "
     "(transformers or this environment: NOTES and the error say which)",
     lambda f, s, e: e["class"] == "build_fails"),
    ("wrong, no rule matched (read the family)", lambda f, s, e: _wrong(e)),
]

# Read in each family's modeling file (transformers 5.23.0).
NOTES: dict[str, str] = {
    "doge": "DogeAttention.prepare_dynamic_mask adds a learned per-key bias (dt_states) and a "
            "top-k over keys to the 4-D mask it hands the interface.",
    "bigbird_pegasus": "BigBirdPegasusDecoderLayer builds self_attn without is_causal=True "
                       "(Bart's passes it): causality lives in the mask alone.",
    "minimax_m3_vl_text": "MiniMaxM3VLAttention builds the indexer's block mask only for "
                          "eager/sdpa; 'cplib' gets block_indices= and ignores it.",
    "phimoe": "PhimoeAttention passes no sliding_window= to the interface.",
    "qwen2_moe": "Qwen2MoeAttention passes no sliding_window= to the interface.",
    "llama4": "chunked_attention layers: the chunk is create_chunked_causal_mask's alone.",
    "llama4_text": "chunked_attention layers: the chunk is create_chunked_causal_mask's alone.",
    "kosmos-2:text": "Kosmos2TextTransformer builds its causal mask inline (_make_causal_mask).",
    "git": "GitForCausalLM's loss slices off image tokens even without pixel_values.",
    "gemma4_assistant": "a speculative-decoding drafter: every layer reads the backbone's K/V.",
    "gemma4_unified_assistant": "a speculative-decoding drafter: every layer reads the "
                                "backbone's K/V.",
    "gemma3n": "its vision tower needs timm, not installed here.",
    "falcon": "FALCON_ATTENTION_CLASSES[config._attn_implementation]; on SDPA one K/V head "
              "(multi_query) against 4 query heads.",
    "xlstm": "Trainer's one-process step: in train mode xLSTM's chunkwise kernel fails at this "
             "length (transformers).",
    "blt": "Trainer: the default cache, DynamicCache(config=BltConfig), reads "
           "num_hidden_layers, which BltConfig lacks (one process too).",
}


def cause(features: set, switch: str, entry: Entry) -> str | None:
    """The first rule's cause for a non-exact entry, None for exact or a
    refusal by name."""
    if entry["class"] in ("exact", "refused", "not_decoder", "n/a") and not (
            entry["class"] == "refused" and _wrong(entry)):
        return None
    return next((name for name, rule in RULES if rule(features, switch, entry)), "other")
