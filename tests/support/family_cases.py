"""Every decoder family of the pinned transformers, tiny (issue 53, item 2).

``families()`` enumerates them from transformers itself, never by hand, so a
new release cannot add a family the report has not seen: every model type of
``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, plus the text model of every multimodal
config whose ``text_config`` is a class of its own (``"<type>:text"``: Qwen2-VL,
GLM-5-Next, Mistral Large 4, Step 3.7, ...). Which of these are decoders is
decided by running them (tests/support/family_runs.py: a family whose earlier
logits move when the last token changes is not causal and is left out), not by
a list.

``tiny_model(family, attn_implementation, seed)`` builds one in fp32, eval
mode, dropout 0, with the same weights in every process for a seed. Sizes are
set by config field name (``_GENERIC``), so every family gets them without an
entry of its own; ``_ENGAGE`` makes what matters under context parallelism
happen at the test length ``SEQ``: sliding windows and Llama 4's chunks of
``WINDOW`` < ``SEQ`` tokens, MoE routing over 4 experts, sparse indexers
keeping ``TOPK`` < ``SEQ`` keys, MLA's low-rank paths. Hybrid families take
tests/support/hybrid_cases.py's overrides; ``family_overrides.py`` holds the
few a family needs beyond that.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch

from family_overrides import FAMILY_OVERRIDES, INPUT_SHAPES, LABELS, POST_BUILD

VOCAB = 64
SEQ = 32      # the test length: 2 ranks x 16, or 4 head-tail chunks of 8
WINDOW = 12   # windows and chunks: shorter than SEQ, not a multiple of a shard
TOPK = 8      # a sparse indexer's kept keys: fewer than SEQ
# Input ids are drawn from [FIRST_ID, LAST_ID): never a pad/bos/eos id, nor a
# multimodal placeholder (those are moved to the top of the vocabulary).
FIRST_ID, LAST_ID = 3, VOCAB - 8

_WIDTH, _LAYERS, _HEADS, _KV_HEADS, _HEAD_DIM, _FFN, _MOE_FFN = 32, 2, 4, 2, 8, 48, 16
# Sizes, by every name transformers' configs give them.
_GENERIC: dict[str, Any] = {
    **dict.fromkeys(["hidden_size", "d_model", "n_embd", "n_embed", "embed_dim", "emb_dim",
                     "word_embed_proj_dim", "embedding_size", "embedding_dim",
                     "hidden_size_global"], _WIDTH),
    **dict.fromkeys(["num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers",
                     "encoder_layers", "num_decoder_layers"], _LAYERS),
    **dict.fromkeys(["num_attention_heads", "n_head", "n_heads", "num_heads",
                     "decoder_attention_heads", "encoder_attention_heads",
                     "attention_heads"], _HEADS),
    **dict.fromkeys(["num_key_value_heads", "num_kv_heads", "n_kv_heads"], _KV_HEADS),
    "head_dim": _HEAD_DIM, "d_kv": _HEAD_DIM,
    **dict.fromkeys(["intermediate_size", "n_inner", "ffn_dim", "decoder_ffn_dim",
                     "encoder_ffn_dim", "d_ff", "dff", "ffn_hidden_size"], _FFN),
    **dict.fromkeys(["max_position_embeddings", "n_positions", "n_ctx", "max_seq_len"], 512),
    "vocab_size": VOCAB,
    # MoE: 4 experts, 2 per token, small experts, one shared; the routing is
    # what differs between a shard and the whole sequence.
    **dict.fromkeys(["num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"], 4),
    **dict.fromkeys(["num_experts_per_tok", "moe_topk", "moe_k", "top_k_experts"], 2),
    **dict.fromkeys(["moe_intermediate_size", "shared_expert_intermediate_size",
                     "shared_intermediate_size", "moe_hidden_size", "expert_ffn_hidden_size"],
                    _MOE_FFN),
    **dict.fromkeys(["n_shared_experts", "num_shared_experts", "moe_num_shared_experts"], 1),
    "n_group": 1, "topk_group": 1, "router_jitter_noise": 0.0, "decoder_sparse_step": 1,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}
# What must happen at SEQ tokens for the run to test it (only where the
# config has the field).
_ENGAGE: dict[str, Any] = {
    "sliding_window": WINDOW, "use_sliding_window": True, "max_window_layers": 1,
    "sliding_window_pattern": 2, "attention_chunk_size": WINDOW,
    "index_topk": TOPK, "index_n_heads": 2, "index_head_dim": _HEAD_DIM,
    "first_k_dense_replace": 1, "is_decoder": True, "add_cross_attention": False,
}
# MLA (DeepSeek and kin): low ranks; k/v expanded to every query head.
_MLA: dict[str, Any] = dict(q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4,
                            qk_nope_head_dim=4, v_head_dim=8, num_key_value_heads=_HEADS)


@functools.lru_cache(maxsize=1)
def _catalog() -> dict[str, tuple[type, str | None]]:
    """family -> (its config class, its model class name or None: found in
    the config's modeling module). Imports every config module (seconds)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as LM

    out: dict[str, tuple[type, str | None]] = {t: (CONFIG_MAPPING[t], LM[t]) for t in LM}
    for t in CONFIG_MAPPING_NAMES:
        try:
            text = (getattr(CONFIG_MAPPING[t], "sub_configs", None) or {}).get("text_config")
        except Exception:  # a config module that needs an optional package
            continue
        if text is None or text.__name__ == "AutoConfig" or getattr(text, "model_type", "") in LM:
            continue
        out[f"{t}:text"] = (text, None)
    return out


def families() -> list[str]:
    """Every candidate decoder family of the installed transformers, sorted."""
    return sorted(_catalog())


def _modeling_module(config_class: type):
    name = config_class.__module__.replace(".configuration_", ".modeling_")
    return importlib.import_module(name)


def model_class(family: str) -> type:
    """The family's causal LM; for a ``:text`` family its text model (the
    class of the config's modeling module built on that config: a
    ``*ForCausalLM`` first, then a ``*TextModel``, then any)."""
    import transformers

    config_class, name = _catalog()[family]
    if name is not None:
        return getattr(transformers, name)
    module = _modeling_module(config_class)
    built_on = [c for c in vars(module).values()
                if isinstance(c, type) and issubclass(c, transformers.PreTrainedModel)
                and getattr(c, "config_class", None) is config_class
                and not c.__name__.endswith("PreTrainedModel")]
    for suffix in ("ForCausalLM", "TextModel", "Model"):
        for c in built_on:
            if c.__name__.endswith(suffix):
                return c
    raise LookupError(f"{family}: no model class in {module.__name__} takes "
                      f"{config_class.__name__}")


def _is_size(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _value(config, name: str) -> Any:
    """A config's attribute; None where it has none or holds it per layer."""
    try:
        return getattr(config, name, None)
    except Exception:  # transformers' AmbiguousGlobalPerLayerAttributeError
        return None


def _two_layers(values: list) -> list:
    """Two layers' entries of a fixed per-layer list: its first entry and
    the first that differs (a sliding and a full layer, a dense and a sparse
    MLP), so both kinds run."""
    other = next((v for v in values if v != values[0]), values[0])
    return [values[0], other]


def _fixed_per_layer_lists(config_class: type, default) -> dict[str, list]:
    """Fields whose default is a list with one entry per default layer, given
    as a constant (lists the config derives from its layer count when left
    None are derived again from the tiny count)."""
    layers = next((_value(default, f) for f in ("num_hidden_layers", "num_layers", "n_layer",
                                               "n_layers") if _is_size(_value(default, f))), None)
    out = {}
    for name, field in config_class.__dataclass_fields__.items():
        value = _value(default, name)
        if field.default is None or not isinstance(value, (list, tuple)) or len(value) != layers:
            continue
        out[name] = _two_layers(list(value))
    return out


def _sub_config(config_class: type, key: str, default, given: Any):
    """A tiny sub-config (vision tower, text part, ...): ``given`` as it is,
    or a dict of overrides (with ``model_type`` where the slot takes any
    config), or the default's class with the generic sizes and the
    overrides of its own model type."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if given is not None and not isinstance(given, dict):
        return given
    given = dict(given or {})
    sub = _value(default, key) if default is not None else None
    cls = CONFIG_MAPPING[given.pop("model_type")] if "model_type" in given else type(sub)
    if not hasattr(cls, "__dataclass_fields__"):
        return None
    return cls(**_tiny_kwargs(cls, {**FAMILY_OVERRIDES.get(cls.model_type, {}), **given}))


def _tiny_kwargs(config_class: type, extra: dict[str, Any]) -> dict[str, Any]:
    """Constructor arguments for a tiny ``config_class``: the generic sizes
    and engagements for the fields it has, dropout 0, token ids inside the
    vocabulary, its sub-configs (vision towers, ...) tiny too, then ``extra``."""
    fields = set(getattr(config_class, "__dataclass_fields__", {}))
    subs = set(getattr(config_class, "sub_configs", None) or {})
    try:
        default = config_class()
    except Exception:  # a default that does not validate: its sub-configs from ``extra``
        default = None
        extra = {**extra, **{k: _sub_config(config_class, k, None, v) for k, v in extra.items()
                             if k in subs}}
        default = config_class(**{k: v for k, v in extra.items() if k in subs})
    kw: dict[str, Any] = _fixed_per_layer_lists(config_class, default)
    kw.update({k: v for k, v in {**_GENERIC, **_ENGAGE}.items() if k in fields})
    if "kv_lora_rank" in fields:
        kw.update({k: v for k, v in _MLA.items() if k in fields})
        if "head_dim" in fields:  # MLA's head_dim is its rotary part
            kw["head_dim"] = _MLA["qk_rope_head_dim"]
        if "qk_head_dim" in fields:
            kw["qk_head_dim"] = _MLA["qk_rope_head_dim"] + _MLA["qk_nope_head_dim"]
    if "rotary_dim" in fields and _is_size(_value(default, "rotary_dim")):
        kw["rotary_dim"] = _HEAD_DIM // 2  # GPT-J, CodeGen: a part of each head
    top = VOCAB - 1
    for f in sorted(fields):
        value = _value(default, f)
        if ("dropout" in f or f.endswith("pdrop") or "layerdrop" in f) and _is_size(value):
            kw[f] = type(value)(0)
        elif (f.endswith("_token_id") or f.endswith("_token_index")) and f not in kw \
                and _is_size(value) and value >= VOCAB - 8:
            kw[f], top = top, top - 1  # placeholders stay distinct, above the inputs
    for key in subs:
        if _value(default, key) is not None or key in extra:
            kw[key] = _sub_config(config_class, key, default, extra.get(key))
    kw.update({k: v for k, v in extra.items() if k not in subs})
    return kw


def _hybrid_overrides(family: str) -> dict[str, Any]:
    """hybrid_cases.py's overrides for the hybrid families (and their
    ``*_text`` / ``:text`` spellings)."""
    from hybrid_cases import FAMILY_CONFIGS

    base = family.split(":")[0].removesuffix("_text")
    return dict(FAMILY_CONFIGS[base][0]) if base in FAMILY_CONFIGS else {}


def tiny_config(family: str):
    """The family's tiny config: the one its model class takes (a composite
    config's text part, as ``AutoModelForCausalLM.from_config`` takes it)."""
    config_class, _ = _catalog()[family]
    own = getattr(model_class(family), "config_class", None)
    if own is not None and own is not config_class and \
            own in (getattr(config_class, "sub_configs", None) or {}).values():
        config_class = own
    extra = {**_hybrid_overrides(family), **FAMILY_OVERRIDES.get(family, {})}
    return config_class(**_tiny_kwargs(config_class, extra))


def input_shape(family: str, batch: int = 1, seq: int = SEQ) -> tuple[int, ...]:
    """The shape of ``input_ids`` the family takes (MusicGen: one row per codebook)."""
    return INPUT_SHAPES.get(family, lambda b, s: (b, s))(batch, seq)


def tiny_model(family: str, attn_implementation: str = "eager", seed: int = 0):
    """The family's tiny model, fp32, eval mode, every dropout module at 0:
    the same weights for a seed in every process and every attention
    implementation. Raises what transformers raises for an implementation
    the family refuses."""
    config = tiny_config(family)
    cls = model_class(family)
    torch.manual_seed(seed)
    model = cls._from_config(config, attn_implementation=attn_implementation,
                             dtype=torch.float32)
    if family in POST_BUILD:
        POST_BUILD[family](model)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model.float().eval()


def labels_for(family: str, ids: torch.Tensor) -> torch.Tensor:
    """The labels the family's loss takes for ``ids`` (a copy)."""
    return LABELS.get(family, lambda t: t)(ids).clone()


def trains_with_labels(family: str) -> bool:
    """Whether the family's model is a causal LM (not a bare text model that
    returns hidden states): what HF Trainer can train."""
    return not family.endswith(":text") or model_class(family).__name__.endswith("ForCausalLM")


def has_lm_head(model) -> bool:
    """Whether the model returns logits (a causal LM) or hidden states (a
    text model, scored through ``text_head``)."""
    return hasattr(model, "get_output_embeddings") and model.get_output_embeddings() is not None


def text_head(width: int, seed: int = 1) -> torch.Tensor:
    """A fixed (width, VOCAB) projection for text models without an LM head
    (width: their output's, which a projection may set): the same in every
    process, not a parameter."""
    return torch.randn(width, VOCAB, generator=torch.Generator().manual_seed(seed)) / width ** 0.5
