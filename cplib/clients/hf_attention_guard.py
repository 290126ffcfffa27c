"""Hugging Face attention paths that context parallelism cannot shard,
refused by name instead of computing something else.

Under context parallelism (a ``cplib.context_parallel`` region, or a module
parallelized with ``_ContextParallel``) every SDPA call runs over the whole
sequence, but two of transformers' attention paths would give another
result without a word:

* eager attention (``attn_implementation="eager"``, each model's
  ``eager_attention_forward``; ``"paged|eager"``) and the flash-attn kernels
  (``"flash_attention_2"``, ...) attend from this rank's queries to this
  rank's keys only;
* a sliding-window layer on SDPA: transformers builds its window mask from
  the shard's length and skips it (``is_causal=True``) when the shard is no
  longer than the window, so a window shorter than the whole sequence is
  lost (a longer shard gets a 4-D mask, which the ring refuses anyway).

Every model's attention layer looks its function up through
``AttentionInterface.get_interface`` when it runs; the guard wraps that
lookup. Outside context parallelism it returns what transformers returns.
Under it, the paths above raise NotImplementedError naming the
implementation (or the window and the sequence length) and what to use
instead; the condition reads the config and shapes only, the same on every
rank, and comes before any collective. ``attn_implementation="cplib"``
(``import cplib.hf``) takes windows; any other registered function runs.
The guard is installed whenever cplib's context parallelism starts while
transformers is imported (cplib/frontend/start_hooks.py).
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable

from ..frontend.sdpa_dispatch import active_config

__all__ = ["install_attention_guard", "install_if_transformers_loaded"]

# transformers' implementations that attend within the local shard only.
_LOCAL_ONLY = ("eager", "paged|eager", "flash_attention_2", "flash_attention_3",
               "flash_attention_4")
_installed: list[Callable] = []  # the original get_interface, once installed


def _refuse_local(implementation: str) -> None:
    raise NotImplementedError(
        f"cplib: attn_implementation={implementation!r} computes attention on this rank's "
        "sequence shard alone under context parallelism (its keys and values never leave "
        "the rank); use attn_implementation=\"sdpa\", or \"cplib\" (import cplib.hf), whose "
        "attention runs over the whole sequence")


def _windowed_sdpa(sdpa: Callable) -> Callable:
    """transformers' SDPA attention, refusing a sliding window shorter than
    the whole sequence under context parallelism."""

    @functools.wraps(sdpa)
    def attention(module: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        window, config = kwargs.get("sliding_window"), active_config()
        if window is not None and config is not None:
            seq_len = config.seq_len or query.shape[-2] * config.world_size
            if seq_len > window:
                raise NotImplementedError(
                    f"cplib: {type(module).__name__} has sliding_window={window}, shorter than "
                    f"the {seq_len}-token sequence under context parallelism, and "
                    "attn_implementation=\"sdpa\" cannot carry it (transformers builds the "
                    "window mask from this rank's shard); use attn_implementation=\"cplib\" "
                    "(import cplib.hf), which runs the window over the whole sequence")
        return sdpa(module, query, *args, **kwargs)

    return attention


def install_attention_guard() -> None:
    """Wraps ``AttentionInterface.get_interface`` (idempotent)."""
    if _installed:
        return
    from transformers.modeling_utils import AttentionInterface

    original = AttentionInterface.get_interface

    @functools.wraps(original)
    def get_interface(self: Any, attn_implementation: str, default: Callable) -> Callable:
        fn = original(self, attn_implementation, default)
        if active_config() is None:
            return fn
        if attn_implementation in _LOCAL_ONLY:
            _refuse_local(attn_implementation)
        if attn_implementation == "sdpa":
            return _windowed_sdpa(fn)
        return fn

    _installed.append(original)
    AttentionInterface.get_interface = get_interface


def install_if_transformers_loaded() -> None:
    """:func:`install_attention_guard` once transformers' models are imported."""
    if "transformers.modeling_utils" in sys.modules:
        install_attention_guard()
