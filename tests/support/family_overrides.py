"""Per-family config overrides for tests/support/family_cases.py: only what a
family needs beyond the generic sizes, each with why. Most make the tiny
config buildable (a list per layer, a rotary split that must add up to half
a head); the rest make a feature engage at the test length."""

from __future__ import annotations

from typing import Any, Callable

# Multimodal RoPE: three sections adding up to half of the tiny head (8).
_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
_PER_TYPE_ROPE = {t: {"rope_type": "default", "rope_theta": 10000.0}
                  for t in ("full_attention", "sliding_attention")}
_GEMMA_PER_LAYER = dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=64,
                        num_kv_shared_layers=0, global_head_dim=16)

FAMILY_OVERRIDES: dict[str, dict[str, Any]] = {
    **{f: {"rope_parameters": _MROPE} for f in (
        "qwen2_vl:text", "qwen2_5_vl:text", "qwen2_5_omni_thinker:text", "paddleocr_vl:text",
        "glm4v:text", "glm_image:text", "glm_ocr:text", "cosmos3_edge:text", "hunyuan_vl:text")},
    # GLM-4.5V rotates half of each head: a head of 16 gives 4 rotary pairs.
    **{f: {"rope_parameters": {**_MROPE, "partial_rotary_factor": 0.5}, "head_dim": 16}
       for f in ("glm4v_moe:text", "glm_image:text", "glm_ocr:text")},
    # Its RoPE is per layer type (the default config has none it can build from).
    "cohere_compass_text": {"rope_parameters": _PER_TYPE_ROPE,
                            "layer_types": ["sliding_attention", "full_attention"]},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": 12},
    # DBRX's attention config lacks the rope_theta and clip its modeling reads.
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
             "ffn_config": {"ffn_hidden_size": 16, "moe_num_experts": 4, "moe_top_k": 2}},
    # No GQA in their eager attention (k/v heads must equal q heads).
    "unlimited_ocr:text": {"num_key_value_heads": 4},
    "deepseek_ocr2:text": {"num_key_value_heads": 4, "mlp_layer_types": ["dense", "sparse"]},
    "ernie4_5_vl_moe:text": {"moe_intermediate_size": [16, 16],
                             "rope_parameters": {**_MROPE, "mrope_section": [1, 1, 2]}},
    # Speculative-decoding drafters: every layer reads the backbone's K/V.
    **{f: {"backbone_hidden_size": 32, "num_centroids": 8, "centroid_intermediate_top_k": 2,
           "text_config": {"model_type": f.replace("assistant", "text"),
                           "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}}
       for f in ("gemma4_assistant", "gemma4_unified_assistant")},
    "pix2struct:text": {"initializer_range": 0.02},  # its modeling reads the composite's
    "gemma3n_text": {**_GEMMA_PER_LAYER, "laurel_rank": 4, "intermediate_size": [48, 48],
                     "activation_sparsity_pattern": [0.95, 0.0]},
    "gemma3n": {},
    **{f: dict(_GEMMA_PER_LAYER) for f in ("gemma4_text", "gemma4_unified_text")},
    "reformer": {"attn_layers": ["local", "lsh"], "axial_pos_embds_dim": [16, 16],
                 "axial_pos_shape": [4, 8], "local_attn_chunk_length": 8,
                 "lsh_attn_chunk_length": 8, "num_buckets": 4, "num_hashes": 1},
    "musicgen": {"num_codebooks": 1}, "musicgen_melody": {"num_codebooks": 1},
    "blt": {"encoder_hash_byte_group_vocab": 64, "patching_mode": "space"},
    # Embedding tables and convs the generic names do not reach (megabytes
    # of gradients each run otherwise).
    "roc_bert": {"pronunciation_embed_dim": 32, "pronunciation_vocab_size": 64,
                 "shape_embed_dim": 32, "shape_vocab_size": 64},
    "phi4_multimodal": {"audio_config": {"nemo_conv_channels": 32, "ext_pw_out_channel": 32,
                                         "depthwise_separable_out_channel": 32}},
    "got_ocr2": {"vision_config": {"output_channels": 32, "mlp_dim": 48}},
    # Sparse and compressed attention engaged at SEQ tokens: Qwen4-Exp's QSA
    # indexer keeps 8 tokens in blocks of 2; MiniMax-M3's keeps 2 blocks of
    # 4; DeepSeek-V4 compresses by 4 and by 8 (its default 128 never fills a
    # block); Step 3.7 gets a sliding layer.
    **{f: {"layer_types": ["linear_attention", "indexed_attention"], "indexer_n_heads": 2,
           "indexer_kv_heads": 1, "indexer_head_dim": 8, "indexer_budget": 8,
           "indexer_compress_ratio": 2, "hc_lowrank": 8}
       for f in ("qwen4_exp", "qwen4_exp_text")},
    "minimax_m3_vl_text": {"layer_types": ["minimax_m3_sparse", "full_attention"],
                           "index_block_size": 4, "index_topk_blocks": 2, "index_local_blocks": 1,
                           "dense_intermediate_size": 48},
    "deepseek_v4": {"layer_types": ["compressed_sparse_attention", "heavily_compressed_attention"],
                    "compress_rates": {"compressed_sparse_attention": 4,
                                       "heavily_compressed_attention": 8},
                    "o_groups": 2, "o_lora_rank": 8},
    "step3p7:text": {"layer_types": ["sliding_attention", "full_attention"]},
    "longcat_flash": {"zero_expert_num": 2},  # identity experts beside the routed ones
    # GLM-5-Next: a linear layer and an indexed (sparse) one, the indexer
    # pooling keys by 4 and keeping TOPK of them.
    "glm5_next:text": {"layer_types": ["linear_attention", "indexed_attention"],
                       "indexer_types": ["full", "full"], "mlp_layer_types": ["dense", "sparse"],
                       "head_dim": 0, "index_kpool": 4},
}

# Called on the built model (what a user of the family must call first).
POST_BUILD: dict[str, Callable[[Any], None]] = {
    "xmod": lambda model: model.set_default_language("en_XX"),
}

# input_ids shapes other than (batch, seq).
INPUT_SHAPES: dict[str, Callable[[int, int], tuple[int, ...]]] = {}
# labels other than input_ids' shape: MusicGen's are (batch, seq, codebooks).
LABELS: dict[str, Callable[[Any], Any]] = {
    "musicgen": lambda ids: ids[..., None], "musicgen_melody": lambda ids: ids[..., None]}
