"""Hugging Face models under cplib: ``import cplib.hf`` registers
``attn_implementation="cplib"`` with ``transformers.AttentionInterface``
(and a mask function with ``AttentionMaskInterface``, so that no S x S mask
is built for it).

A model built or switched with it (``from_config(cfg,
attn_implementation="cplib")``, ``model.set_attn_implementation("cplib")``)
computes every layer's attention

* inside ``cplib.context_parallel(...)`` with cplib's ring (or USP with
  ``ulysses_degree``) on the local shards, with the layer's sliding window,
  sinks (gpt-oss), scaling, GQA and head dims (MLA), the context's
  documents (``position_ids=`` / ``cu_seqlens=``) and a 2-D padding
  ``attention_mask`` listed among the context's buffers (seq dim 1);
* outside any context as exact single-device attention with the same
  semantics (so one model object works either way), padding masks included.

and ``model(..., labels=labels).loss`` inside a context shifts the labels
over the whole sequence and normalises by the global count of valid labels,
and MoE routers' load-balancing loss covers the whole sequence
(cplib/clients/hf_loss.py, installed here and by ``cplib.patch_torch()``):
the mean over the CP ranks of the loss, and of the parameter gradients, is
the single-process value.

Hybrid models (Qwen3-Next, Qwen3.5, Kimi Linear, Falcon-H1, Granite 4,
LFM2, ...): inside a context their recurrent and conv layers run exactly or
raise NotImplementedError naming the layer (cplib/clients/hf_hybrid.py, the
list in hybrid_families.py; installed here, by ``cplib.patch_torch()`` and
whenever context parallelism starts); outside one they are transformers' own.

Importing ``cplib`` alone does not import transformers; this module does.
"""

from __future__ import annotations

from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from ._attention import cplib_attention_forward, cplib_mask
from ..clients.hf_loss import install_hf_losses
from ..clients.hf_hybrid import install_hybrid_layers

__all__ = ["cplib_attention_forward", "cplib_mask", "ATTN_IMPLEMENTATION"]

ATTN_IMPLEMENTATION = "cplib"

AttentionInterface.register(ATTN_IMPLEMENTATION, cplib_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, cplib_mask)
# model(..., labels=labels).loss under context parallelism: labels shifted
# over the whole sequence, the loss normalised by the global count, the
# router loss over every token (cplib/clients/hf_loss.py).
install_hf_losses("cplib.hf")
# Hybrid models: their recurrent and conv layers exact or refused under CP (hybrid.py).
install_hybrid_layers()
