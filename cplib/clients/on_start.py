"""What cplib's context parallelism installs into transformers as it starts
(cplib/frontend/start_hooks.py), whichever switch the user turned on
(``import cplib.hf``, ``cplib.patch_torch()``, or none): hybrid models'
recurrent and conv layers carried across the ranks or refused
(hf_hybrid.py), the token-wise and router losses over the whole sequence
and the refusal of HF's other losses (hf_loss.py), and the refusal of
attention paths that would stay within a shard (hf_attention_guard.py), of
models that pool one token (hf_pooled.py) and of labels given to a model
that computes its loss itself (hf_own_loss.py). Each install is idempotent
and local."""

from __future__ import annotations

import sys

from .hf_attention_guard import install_attention_guard
from .hf_hybrid import install_hybrid_layers
from .hf_loss import install_hf_losses
from .hf_own_loss import install_own_loss_refusal
from .hf_pooled import install_pooled_refusal

__all__ = ["install_into_transformers"]


def install_into_transformers() -> None:
    """The five installs, once transformers' models are imported (before,
    none of its models exists, and none is built without that import)."""
    if "transformers.modeling_utils" not in sys.modules:
        return
    install_hybrid_layers()
    install_hf_losses("context_parallel")  # never taken back: outside CP it is HF's own loss
    install_attention_guard()
    install_pooled_refusal()
    install_own_loss_refusal()
