"""Hugging Face's gradient checkpointing in a compiled model under context
parallelism: each checkpointed layer runs eagerly, through cplib's dispatch.

transformers checkpoints a layer (``GradientCheckpointingLayer``) by calling
the layer's ``_gradient_checkpointing_func`` (``torch.utils.checkpoint``)
on its forward. In a compiled model dynamo traces that call as a
higher-order op whose body it traces without the torch function modes in
effect: under context parallelism the layer's attention then ran torch's
SDPA on the shard alone (a tiny Llama under Trainer's ``torch_compile`` and
``gradient_checkpointing``, 2 ranks: the loss off by 1.8e-3, silently).
Under context parallelism (a ``cplib.context_parallel`` region, or the
dispatcher ``_ContextParallel`` modules take) the installed
``_gradient_checkpointing_func`` leaves dynamo (``torch.compiler.disable``):
the checkpoint runs eagerly, and its recomputation keeps the dispatch
(cplib/frontend/mode_kept.py). Everything around the layers stays compiled;
without context parallelism, or without compiling, nothing changes.
Installed whenever cplib's context parallelism starts while transformers is
imported (on_start.py).
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

import torch

from ..frontend.sdpa_dispatch import active_config, dispatcher_enabled

__all__ = ["install_checkpointing_outside_dynamo"]

_ATTR = "_gradient_checkpointing_func"
_installed: list[bool] = []
_lock = threading.Lock()  # threaded ranks start their contexts at once


@torch.compiler.disable
def _eager_checkpoint(checkpoint: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return checkpoint(*args, **kwargs)


def _checkpoint(checkpoint: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if torch.compiler.is_compiling() and (active_config() is not None or dispatcher_enabled()):
        return _eager_checkpoint(checkpoint, *args, **kwargs)
    return checkpoint(*args, **kwargs)


def _get(layer: Any) -> Callable[..., Any]:
    try:
        checkpoint = layer.__dict__[_ATTR]
    except KeyError:
        raise AttributeError(_ATTR) from None
    return functools.partial(_checkpoint, checkpoint)


def _set(layer: Any, checkpoint: Callable[..., Any]) -> None:
    layer.__dict__[_ATTR] = checkpoint


def install_checkpointing_outside_dynamo() -> None:
    """Puts a property over ``GradientCheckpointingLayer``'s checkpoint
    function (idempotent); layers set before the install keep theirs, read
    through it."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    with _lock:
        if not _installed:
            setattr(GradientCheckpointingLayer, _ATTR, property(_get, _set))
            _installed.append(True)
