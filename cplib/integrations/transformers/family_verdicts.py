"""The classification of every family of transformers 5.23 (families.py
reads it; tests/integrations/test_every_family.py checks it against what
each family computes). ``EXACT`` families compute one process's loss and
gradients under context parallelism on ``"sdpa"`` and ``"cplib"`` (other
guards may still refuse an input of theirs by name: a window shorter than
the sequence on SDPA, labels a model scores itself, a recurrence cplib
cannot carry); every other family is refused where its verdict says, with
the layer that cannot run and what would work."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["Refusal", "Verdict", "FAMILIES"]


@dataclass(frozen=True)
class Refusal:
    layer: str  # what cannot run ("its attention layers")
    reason: str  # why, as the rest of the sentence
    instead: str  # what would work
    when: Callable[[Any], bool] | None = None  # of the config; None: always

    def applies_to(self, config: Any) -> bool:
        return self.when is None or config is None or bool(self.when(config))


@dataclass(frozen=True)
class Verdict:
    sdpa: Refusal | None = None  # under CP with "sdpa" (a region, the module path, Trainer)
    cplib: Refusal | None = None  # under CP with attn_implementation="cplib"
    settable: Refusal | None = None  # "cplib" itself, in one process too
    # No attention layers (Mamba, RWKV, xLSTM): the implementation's name is moot.
    attention_free: bool = False


_ALONE = "run it without context parallelism"
_EAGER = 'use attn_implementation="eager" or "sdpa"'
_ALONE_EAGER = 'run it without context parallelism, with attn_implementation="eager" or "sdpa"'
INLINE = Refusal(
    "its attention layers", "compute attention inline, never through transformers' attention "
    "interface: cplib cannot reach them (under context parallelism they attend within this "
    "rank's shard; with \"cplib\" they would get no mask)", _ALONE)
CLASS_BY_NAME = Refusal(
    "its attention layers", "are picked from a table keyed by the implementation's name "
    "(eager, sdpa, flash), which has no \"cplib\"", _EAGER)
SPARSE = Refusal(
    "its indexed (sparse) attention", "selects its keys with an indexer that reads "
    "transformers' S x S mask over the whole sequence, which no rank holds (and \"cplib\" "
    "builds no such mask)", _ALONE_EAGER)
COMPRESSED = Refusal(
    "its compressed attention", "appends compressed key/value blocks of its own sequence to "
    "the keys, with a causal block bias in transformers' 4-D mask", _ALONE_EAGER)
POSITIONS = Refusal(
    "its forward", "takes no position_ids: it numbers the positions of each shard from 0",
    _ALONE)
OWN_POSITIONS = Refusal(
    "its positions", "are numbered by the model itself (not from position_ids), so each "
    "shard would get its own", _ALONE)
PADDING_POSITIONS = Refusal(
    "its positions", "start at padding_idx + 1 in one process, while under context "
    "parallelism it is given the positions of the whole sequence (Trainer's arange)", _ALONE)
INLINE_MASK = Refusal(
    "its attention mask", "is built by the model as a 4-D tensor (not from transformers' "
    "mask interface), which no rank can hold for the whole sequence", _ALONE)
SOFTCAP = Refusal("its attention", "soft-caps the attention logits, which cplib's kernels do "
                  "not", _EAGER)
POSITION_BIAS = Refusal("its attention", "adds a relative position bias to the logits, which "
                        "cplib's kernels do not take", _EAGER)
CAUSAL_BY_MASK = Refusal(
    "its decoder self-attention", "is built non-causal, causal only through transformers' "
    "mask, which \"cplib\" does not build", _EAGER)
DYNAMIC_MASK = Refusal(
    "its attention", "adds a learned per-key bias and a top-k over the keys to the 4-D mask "
    "it hands the attention", _ALONE_EAGER)
NOT_A_DECODER = Refusal(
    "its text model", "is not a decoder (a later token moves earlier outputs) or has no text "
    "model of its own; cplib classifies the decoders of transformers", _ALONE)
UNTESTED = Refusal(
    "its layers", "could not be built in the test that classifies every family (a missing "
    "optional dependency, or a model that reads another model's cache)", _ALONE)


def _windowed(config: Any) -> bool:
    return bool(getattr(config, "sliding_window", None)) and \
        getattr(config, "use_sliding_window", True) is not False


def _chunked(config: Any) -> bool:
    text = getattr(config, "text_config", None) or config
    return "chunked_attention" in (getattr(text, "layer_types", None) or ()) or \
        getattr(text, "attention_chunk_size", None) is not None


def _indexed(config: Any) -> bool:
    text = getattr(config, "text_config", None) or config
    return "indexed_attention" in (getattr(text, "layer_types", None) or ())


MASK_FUNCTION_WINDOW = Refusal(
    "its sliding-window layers", "keep their window in transformers' mask function alone "
    "(the layer passes none to the attention), which \"cplib\" does not build and SDPA "
    "under context parallelism cannot take", _EAGER, _windowed)
MASK_FUNCTION_CHUNKS = Refusal(
    "its chunked attention layers", "keep their chunks in transformers' mask function alone, "
    "which \"cplib\" does not build and SDPA under context parallelism cannot take", _EAGER,
    _chunked)
SPARSE_LAYERS = Refusal(SPARSE.layer, SPARSE.reason, SPARSE.instead, _indexed)

_EXACT = (
    "afmoe apertus arcee aria axk1 bailing_hybrid bamba beam bert bert_generation biogpt bitnet "
    "bridgetower clip clipseg cohere cohere2 cohere2_moe cohere_compass cosmos3_edge ctrl cwm "
    "dbrx deepseek_ocr2 deepseek_v2 deepseek_v3 diffllama diffusion_gemma dots1 electra emu3 "
    "ernie ernie4_5 ernie4_5_moe ernie4_5_vl_moe exaone4 exaone_moe falcon_h1 flex_olmo flint "
    "fuyu gemma gemma3 gemma4 gemma4_unified glm glm4 glm4_moe glm4_moe_lite glm4v glm4v_moe "
    "glm_image glm_ocr got_ocr2 gpt2 gpt_bigcode gpt_neox gpt_oss granite granite4_vision "
    "granite_docling granite_swa granitemoe granitemoe_swa granitemoehybrid granitemoeshared "
    "helium hrm_text hunyuan_v1_dense hunyuan_v1_moe hunyuan_vl hy_v3 hyperclovax jais2 jamba "
    "jetmoe kimi_linear kolibri1 laguna lfm2 lfm2_moe lfm3 llama longcat_flash mellum "
    "metaclip_2 mimo_v2_flash minicpm3 minimax minimax_m2 ministral ministral3 mistral mixtral "
    "mllama modernbert_decoder molmo2 moshi muse_glimmer muse_spark nanochat nemotron "
    "nemotron_h olmo olmo2 olmo3 olmo_hybrid olmoe opt paddleocr_vl persimmon phi phi3 "
    "phi4_multimodal qwen2 qwen2_5_omni qwen2_5_vl qwen2_vl qwen3 qwen3_5 qwen3_5_moe qwen3_moe "
    "qwen3_next qwen3_omni_moe qwen3_vl qwen3_vl_moe recurrent_gemma roc_bert seed_oss smollm3 "
    "solar_open stablelm starcoder2 step3p7 x_clip youtu zamba zamba2 zaya").split()
_ATTENTION_FREE = "falcon_mamba mamba mamba2 rwkv xlstm".split()
_INLINE = ("big_bird bloom codegen gpt_neox_japanese groupvit megatron_bert mpt rembert roformer "
           "xglm").split()
_NO_POSITION_IDS = ("bart blenderbot blenderbot_small marian mbart musicgen musicgen_melody "
                    "pegasus plbart prophetnet owlv2 owlvit pp_formulanet sam3_lite_text").split()
_PADDING_POSITIONS = ("camembert data2vec roberta roberta_prelayernorm xlm_roberta "
                      "xlm_roberta_xl xmod kosmos2_5").split()
_NOT_DECODERS = ("aimv2 align altclip blip chinese_clip clap clvp cpmant embedding_gemma2 flava "
                 "reformer siglip siglip2 t5gemma2 tipsv2 videoprism xlm xlnet").split()
_SPARSE = "minimax_m3_vl".split()
# DeepSeek Sparse Attention, exact under context parallelism and with
# "cplib" (sparse/: the indexer over the whole sequence, the selected keys'
# latents read from their owners).
_DSA = "axk2 deepseek_v32 dots3_note glm_moe_dsa hy_v4 mistral_large4".split()


def _everywhere(refusal: Refusal) -> Verdict:
    return Verdict(refusal, refusal, refusal)


def _under_cp(refusal: Refusal) -> Verdict:
    return Verdict(refusal, refusal)


# Encoders (no decoder of theirs in the family test), exact by the test named.
_ENCODERS = {"modernbert": "tests/hf/test_hf_task_losses.py"}

FAMILIES: dict[str, Verdict] = {
    **{f: Verdict() for f in _EXACT},
    **{f: Verdict() for f in _ENCODERS},
    **{f: Verdict(attention_free=True) for f in _ATTENTION_FREE},
    **{f: _everywhere(INLINE) for f in _INLINE},
    **{f: _under_cp(POSITIONS) for f in _NO_POSITION_IDS},
    # ... and their decoders' attention is computed inline ("cplib" in one process).
    "mvp": Verdict(POSITIONS, POSITIONS, INLINE),
    "trocr": Verdict(POSITIONS, POSITIONS, INLINE),
    **{f: _under_cp(PADDING_POSITIONS) for f in _PADDING_POSITIONS},
    **{f: _under_cp(NOT_A_DECODER) for f in _NOT_DECODERS},
    **{f: _everywhere(SPARSE) for f in _SPARSE},
    **{f: Verdict() for f in _DSA},
    # Their indexed layers only where the config has some (linear ones are exact).
    "glm5_next": _everywhere(SPARSE_LAYERS),
    "qwen4_exp": _everywhere(SPARSE_LAYERS),
    "deepseek_v4": _everywhere(COMPRESSED),
    "openai": Verdict(INLINE, INLINE),  # one process: its own causal buffer, exact
    "falcon": Verdict(INLINE_MASK, CLASS_BY_NAME, CLASS_BY_NAME),  # its mask: always 4-D
    "git": Verdict(INLINE, CLASS_BY_NAME, CLASS_BY_NAME),
    "gpt_neo": Verdict(INLINE, CLASS_BY_NAME, CLASS_BY_NAME),
    "gptj": Verdict(INLINE, CLASS_BY_NAME, CLASS_BY_NAME),
    "bigbird_pegasus": Verdict(POSITIONS, POSITIONS, CAUSAL_BY_MASK),
    "llama4": _everywhere(MASK_FUNCTION_CHUNKS),
    "phimoe": _everywhere(MASK_FUNCTION_WINDOW),
    "qwen2_moe": _everywhere(MASK_FUNCTION_WINDOW),
    "doge": _everywhere(DYNAMIC_MASK),
    "gemma2": Verdict(None, SOFTCAP, SOFTCAP),
    "vaultgemma": Verdict(None, SOFTCAP, SOFTCAP),
    "inkling": Verdict(None, POSITION_BIAS, POSITION_BIAS),
    "inkling2": Verdict(None, POSITION_BIAS, POSITION_BIAS),
    "pix2struct": Verdict(INLINE_MASK, POSITION_BIAS, POSITION_BIAS),
    "whisper": _under_cp(OWN_POSITIONS),
    "moss_transcribe_diarize": _under_cp(OWN_POSITIONS),
    "kosmos2": _under_cp(INLINE_MASK),
    "blt": _under_cp(INLINE_MASK),
    "unlimited_ocr": Verdict(INLINE_MASK, None),
    **{f: _everywhere(UNTESTED) for f in ("gemma3n", "gemma4_assistant",
                                          "gemma4_unified_assistant")},
}
