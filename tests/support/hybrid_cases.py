"""Tiny instances of every hybrid family transformers ships
(cplib/clients/hybrid_families.py): a config per family, small enough to run a
forward under context parallelism in a fraction of a second, with at least
one of the family's sequence mixers (and its attention layers, where it has
them)."""

from __future__ import annotations

import importlib

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 64

_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, moe_intermediate_size=16,
               shared_expert_intermediate_size=16, num_experts=4, num_local_experts=4,
               n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
               max_position_embeddings=512, num_hidden_layers=2, pad_token_id=0,
               bos_token_id=1, eos_token_id=2)

_LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
               linear_value_head_dim=8)
_TWO = ["linear_attention", "full_attention"]
_MLA = dict(qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, kv_lora_rank=8,
            num_key_value_heads=4)
_SWA = dict(swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8,
            sliding_window_size=16, d_rel=4, rel_extent=64)
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=2, mamba_d_state=8,
               mamba_d_conv=4, mamba_expand=1, mamba_chunk_size=16)

# Per family: (config overrides, config class name or None for the family's own).
FAMILY_CONFIGS: dict[str, tuple[dict, str | None]] = {
    "qwen3_next": (dict(layer_types=_TWO, **_LINEAR), None),
    "qwen3_5": (dict(layer_types=_TWO, **_LINEAR), "Qwen3_5TextConfig"),
    "qwen3_5_moe": (dict(layer_types=_TWO, **_LINEAR), "Qwen3_5MoeTextConfig"),
    # Qwen4-Exp's and GLM-5-Next's full-attention layers are indexed (sparse)
    # attention, which needs an S x S mask and runs on eager or SDPA only:
    # their tiny models keep the linear layers.
    "qwen4_exp": (dict(layer_types=["linear_attention"] * 2, **_LINEAR), "Qwen4ExpTextConfig"),
    "olmo_hybrid": (dict(layer_types=_TWO, **_LINEAR), None),
    "kimi_linear": (dict(layer_types=_TWO, linear_head_dim=8, linear_num_heads=4, **_MLA), None),
    "bailing_hybrid": (dict(layer_types=_TWO, **_MLA), None),
    "glm5_next": (dict(layer_types=["linear_attention"] * 2, linear_head_dim=8,
                       linear_num_heads=4, q_lora_rank=8, **{**_MLA, "qk_rope_head_dim": 0,
                                                             "qk_nope_head_dim": 8}),
                  "Glm5NextTextConfig"),
    "falcon_h1": (dict(mamba_d_ssm=32, **_MAMBA2), None),
    "granitemoehybrid": (dict(layer_types=["mamba", "attention"], **_MAMBA2), None),
    "bamba": (dict(attn_layer_indices=[1], **_MAMBA2), None),
    "zamba2": (dict(layers_block_type=["mamba", "hybrid"], mamba_d_state=8, mamba_ngroups=2,
                    n_mamba_heads=4, mamba_expand=1, chunk_size=16, num_mem_blocks=1), None),
    "nemotron_h": (dict(layers_block_type=["mamba", "attention"], ssm_state_size=8,
                        mamba_num_heads=4, mamba_head_dim=8, n_groups=2, chunk_size=16), None),
    "mamba2": (dict(num_heads=4, head_dim=8, state_size=8, expand=1, n_groups=2,
                    chunk_size=16), None),
    "lfm2": (dict(layer_types=["conv", "full_attention"], conv_L_cache=3), None),
    "lfm2_moe": (dict(layer_types=["conv", "full_attention"], conv_L_cache=3,
                      num_dense_layers=1), None),
    "lfm3": (dict(layer_types=["conv", "full_attention"], conv_L_cache=7), None),
    "inkling": (dict(conv_kernel_size=4, **_SWA), "InklingTextConfig"),
    "inkling2": (dict(conv_kernel_size=4, **_SWA), "Inkling2TextConfig"),
    "minimax": (dict(layer_types=_TWO, block_size=16), None),
    "mamba": (dict(state_size=8), None),
    "falcon_mamba": (dict(state_size=8), None),
    "jamba": (dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                   expert_layer_offset=1, mamba_d_state=8, mamba_expand=1), None),
    "zamba": (dict(num_hidden_layers=4, attn_layer_period=1, attn_layer_offset=0, mamba_d_state=8,
                   mamba_expand=1,
                   n_mamba_heads=2, attention_head_dim=8, attention_hidden_size=64), None),
    "recurrent_gemma": (dict(lru_width=32, block_types=["recurrent", "attention"],
                             attention_window_size=64), None),
    "rwkv": (dict(attention_hidden_size=32), None),
    "xlstm": (dict(embedding_dim=32, num_heads=4, num_blocks=2, chunk_size=16, qk_dim_factor=1.0),
              None),
    "zaya": (dict(layer_types=["hybrid", "hybrid"], num_experts_per_tok=1),
             None),
}


def _config_class(family: str, name: str | None):
    module = importlib.import_module(f"transformers.models.{family}.configuration_{family}")
    if name is not None:
        return getattr(module, name)
    return next(c for n, c in vars(module).items()
                if isinstance(c, type) and n.endswith("Config") and c.__module__ == module.__name__
                and getattr(c, "model_type", None) == family)


def tiny_config(family: str, overrides: dict | None = None):
    base, name = FAMILY_CONFIGS[family]
    cls = _config_class(family, name)
    known = set(getattr(cls, "__dataclass_fields__", {})) or None
    kw = {k: v for k, v in {**_COMMON, **base, **(overrides or {})}.items()
          if known is None or k in known}
    return cls(**kw)


def tiny_model(family: str, seed: int = 0, attn_implementation: str = "cplib",
               overrides: dict | None = None):
    """The family's causal LM (its text model where it has none), tiny, fp32,
    eval mode."""
    import transformers as tf

    import cplib.hf  # noqa: F401  (attn_implementation="cplib", the hybrid layers)

    config = tiny_config(family, overrides)
    torch.manual_seed(seed)
    auto = tf.AutoModelForCausalLM if type(config) in tf.AutoModelForCausalLM._model_mapping \
        else tf.AutoModel
    model = auto.from_config(config, attn_implementation=attn_implementation)
    return model.float().eval()


class _CausalAttention(nn.Module):
    """A leaf that calls causal SDPA (what ``_ContextParallel`` parallelizes)."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class HybridBlock(nn.Module):
    """A model of the user's own around one of transformers' sequence mixers:
    ``h = x + mixer(x)``, then ``h + causal attention over h`` (``.attn``)."""

    def __init__(self, mixer: nn.Module, hidden: int = 32, heads: int = 4):
        super().__init__()
        self.mixer, self.heads = mixer, heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.attn = _CausalAttention()

    def forward(self, x):
        h = x + self.mixer(x)
        b, s, d = h.shape
        q, k, v = self.qkv(h).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return h + self.attn(q, k, v).transpose(1, 2).reshape(b, s, d)


def hybrid_block(family: str, mixer_class: str) -> HybridBlock:
    """A HybridBlock (hidden 32) holding ``family``'s ``mixer_class`` of its
    tiny config, built without ``cplib.hf``."""
    config = tiny_config(family)
    config._attn_implementation = "sdpa"
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    torch.manual_seed(0)
    return HybridBlock(getattr(module, mixer_class)(config, layer_idx=0)).float()
