"""The sequence-mixing layers that are not attention in transformers' models,
and what each does under ``cplib.context_parallel``: runs exactly (its
kernel functions get the exchange, cplib/integrations/transformers/hybrid.py) or raises, naming the
layer. Enumerated from transformers 5.23's source: every ``modeling_*.py``
with a causal conv, a linear-attention / delta-rule / SSM scan or another
recurrence over the sequence (``tests/hybrid/test_hybrid_families.py`` reads
the source again and fails on a mixer missing here).

A family is a ``transformers.models.<family>`` package; models that wrap
another family's text model (Qwen3.5 VL, LFM2-VL, LFM3-VL, Nemotron 3.5
Transcribe) reach that family's layers.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Mixer", "FAMILIES", "SELECTORS", "KERNEL_ROLES", "mixer_of"]

DELTA = "delta rule: conv by halo, then head re-sharding or state passing"
SSD = "Mamba2 SSD: conv by halo, then state passing"
CONV = "short conv by halo"


@dataclass(frozen=True)
class Mixer:
    """A layer class of a family: ``path`` when it runs exactly under CP, else
    ``refusal`` (why not; the error says so and what to do)."""

    name: str
    path: str | None = None
    refusal: str | None = None


_MAMBA1 = ("Mamba (v1) selective scan: its state passing is not implemented (a per-channel "
           "decay; cplib does Mamba2's SSD)")


def _refused(name: str, why: str) -> Mixer:
    return Mixer(name, refusal=why)


FAMILIES: dict[str, tuple[Mixer, ...]] = {
    # Gated DeltaNet and Kimi Delta Attention (per-channel gates): exact.
    "qwen3_next": (Mixer("Qwen3NextGatedDeltaNet", DELTA),),
    "qwen3_5": (Mixer("Qwen3_5GatedDeltaNet", DELTA),),
    "qwen3_5_moe": (Mixer("Qwen3_5MoeGatedDeltaNet", DELTA),),
    "qwen4_exp": (Mixer("Qwen4ExpTextGatedDeltaNet", DELTA),
                  _refused("Qwen4ExpTextPLELayer", "its n-gram embedding of the previous tokens "
                           "and its dilated conv are computed inline")),
    "olmo_hybrid": (Mixer("OlmoHybridGatedDeltaNet", DELTA),),
    "kimi_linear": (Mixer("KimiLinearDeltaAttention", DELTA),),
    "bailing_hybrid": (Mixer("BailingHybridDeltaAttention", DELTA),),
    "glm5_next": (Mixer("Glm5NextTextLinearAttention", DELTA),),
    # Mamba2 (SSD): exact.
    "falcon_h1": (Mixer("FalconH1Mixer", SSD),),
    "granitemoehybrid": (Mixer("GraniteMoeHybridMambaLayer", SSD),),
    "bamba": (Mixer("BambaMixer", SSD),),
    "zamba2": (Mixer("Zamba2MambaMixer", SSD),),
    "nemotron_h": (Mixer("NemotronHMamba2Mixer", SSD),),
    "mamba2": (Mixer("Mamba2Mixer", SSD),),
    # Short causal convolutions: exact.
    "lfm2": (Mixer("Lfm2ShortConv", CONV),),
    "lfm2_moe": (Mixer("Lfm2MoeShortConv", CONV),),
    "lfm3": (Mixer("Lfm3ShortConv", CONV),),
    "inkling": (Mixer("InklingShortConvolution", CONV),),
    "inkling2": (Mixer("Inkling2ShortConvolution", CONV),
                 _refused("Inkling2DynamicShortConvolution",
                          "a short conv with per-token taps computed inline (no kernel "
                          "function to exchange around)")),
    # Raise: their recurrence (or token shift) is computed inline or not yet carried.
    "minimax": (_refused("MiniMaxLightningAttention",
                         "lightning attention's block recurrence is computed inline"),),
    "mamba": (_refused("MambaMixer", _MAMBA1),),
    "falcon_mamba": (_refused("FalconMambaMixer", _MAMBA1),),
    "jamba": (_refused("JambaMambaMixer", _MAMBA1),),
    "zamba": (_refused("ZambaMambaMixer", _MAMBA1),),
    "recurrent_gemma": (_refused("RecurrentGemmaRecurrentBlock",
                                 "the RG-LRU recurrence and its conv are computed inline"),),
    "rwkv": (_refused("RwkvSelfAttention", "the WKV recurrence and the token shift are "
                      "computed inline"),
             _refused("RwkvFeedForward", "its token shift reads the previous position")),
    "xlstm": (_refused("xLSTMLayer", "the mLSTM recurrence is computed inline"),),
    "zaya": (_refused("ZayaCCAProjection", "its causal convs and delayed value state are "
                      "computed inline"),),
}

# Token selectors of a family's attention layers that read the whole sequence
# (Qwen4-Exp's QSA indexer: top-k key blocks among every earlier token, from
# the S x S mask): refused under context parallelism, like the mixers above.
SELECTORS: dict[str, tuple[Mixer, ...]] = {
    "qwen4_exp": (_refused("Qwen4ExpTextQSAIndexer",
                           "its indexer selects key blocks among every earlier token of the "
                           "sequence (sparse attention), which a shard does not hold"),),
}

# The kernel functions a family's layers call by their module-level name, and
# the role each plays under CP (cplib/integrations/transformers/hybrid.py gives each its exchange).
KERNEL_ROLES: dict[str, str] = {
    "causal_conv1d_fn": "conv",
    "torch_chunk_gated_delta_rule": "delta",
    "chunk_kimi_delta_attention": "delta",
    "mamba2_chunk_scan": "ssd",
    # Fused conv + scan (+ norm + out_proj) in one mamba_ssm call: declined
    # under CP, so the layer takes its unfused path through the two above.
    "mamba2_split_conv1d_scan_combined": "unfused",
    # One-token decode steps from a cache: never under CP.
    "causal_conv1d_update": "decode",
    "torch_recurrent_gated_delta_rule": "decode",
    "recurrent_kimi_delta_attention": "decode",
    "mamba2_selective_state_update": "decode",
}


def mixer_of(family: str, class_name: str) -> Mixer | None:
    for mixer in FAMILIES.get(family, ()):
        if mixer.name == class_name:
            return mixer
    return None
