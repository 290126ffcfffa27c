"""cplib.hybrid: the sequence-mixing layers of hybrid models that are not
attention (Gated DeltaNet, Kimi Delta Attention, Mamba2's SSD, short causal
convs) under context parallelism, around the user's own kernels; see
docs/hybrid.md. Hugging Face models reach it through cplib.hf."""

from .choice import recurrence_exchange

__all__ = ["recurrence_exchange"]
