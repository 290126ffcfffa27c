"""The sparse-attention (DeepSeek Sparse Attention) families cplib runs
under context parallelism, and the two classes of each it reaches: the
attention layer (its forward, its ``expand_kv``) and its indexer.

What they share, read from transformers 5.23's modeling code: MLA (one
latent per token, ``kv_a_layernorm``'s output and the roped shared key,
expanded to every head by ``expand_kv(k_pass, k_rot)``), a lightning indexer
whose ``forward`` scores its queries against its one-head keys (after
``past_key_values.update_indexer(k, layer_idx)``), masks them with the 3-D
mask it is given and returns the top-k key positions, and a layer that
turns those positions into a mask (eager, SDPA) or passes them as
``indices=`` (any other implementation). What differs (RoPE interleaved or
not, the queries from a LoRA residual or from the hidden states, a
position-dependent query scale, a gate, sinks, layers that reuse the
previous layer's selection or latents) stays in the model's own code, which
cplib calls.

GLM-5-Next's indexer pools keys by blocks counted from the first real token
and assumes its queries are the last rows of the keys; Qwen4-Exp, MiniMax-M3
and DeepSeek-V4 select or compress otherwise: not listed, so refused
(family_verdicts.py).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SparseFamily", "SPARSE_FAMILIES"]


@dataclass(frozen=True)
class SparseFamily:
    attention: str  # the attention layer's class
    indexer: str  # its indexer's class
    # The indexer's arguments that hold one row per query (scored in blocks).
    per_query: tuple[str, ...] = ("hidden_states", "q_resid", "position_embeddings",
                                  "position_ids")


SPARSE_FAMILIES: dict[str, SparseFamily] = {
    "deepseek_v32": SparseFamily("DeepseekV32Attention", "DeepseekV32Indexer"),
    "glm_moe_dsa": SparseFamily("GlmMoeDsaAttention", "GlmMoeDsaIndexer"),
    "mistral_large4": SparseFamily("MistralLarge4TextAttention", "MistralLarge4TextIndexer"),
    "hy_v4": SparseFamily("HYV4Attention", "HYV4Indexer"),
    "axk2": SparseFamily("AXK2Attention", "AXK2Indexer"),
    "dots3_note": SparseFamily("Dots3NoteTextAttention", "Dots3NoteTextIndexer"),
}
