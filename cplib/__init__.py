"""cplib: context parallelism for PyTorch as a native extension."""

from __future__ import annotations

import logging

# comm: the native library (cplib._C and its ops), the handshake's switch.
from .comm import native as _native  # noqa: F401  (loads cplib._C and its ops)
from .comm.consistency import consistency_checks, consistency_checks_enabled, set_consistency_checks
from .comm.handshake import register_group

# The front end: torch's context-parallel API, sharding, documents.
from .frontend.context_parallel import ContextParallelHandle, context_parallel
from .frontend.attention_blocks import attention_documents, attention_window
from .frontend.documents import cu_seqlens_from_position_ids
from .frontend.options import (
    _CausalBehavior,
    _cp_options,
    _is_causal_behavior,
    _RotateMethod,
    set_rotate_method,
)
from .frontend.sdpa_dispatch import (
    _disable_context_parallel_dispatcher,
    _enable_context_parallel_dispatcher,
)
from .frontend.sharding import _context_parallel_shard, shard
from .frontend.unshard import context_parallel_unshard, unshard
from .frontend.style import _ContextParallel

# ring: ring attention and its sequence layouts (load balancers).
from .ring.load_balancer import (
    AnyLengthHeadTailLoadBalancer,
    AnyLengthPerDocumentLoadBalancer,
    _HeadTailLoadBalancer,
    _LoadBalancer,
    _PerDocumentHeadTailLoadBalancer,
    _PTRRLoadBalancer,
)
from .ring.op import ring_pass_auto
from .ring.placement import DocumentPlacementLoadBalancer
# ring_sdpa, with rotate="auto" (the strategy's cost model asked for the rotation).
from .ring.entry import ring_sdpa

# ulysses: Ulysses and USP (Ulysses x ring).
from .ulysses.op import ulysses_reshard, ulysses_sdpa
from .ulysses.usp import usp_sdpa
from .ulysses.usp_layout import usp_load_balancer

# flex: flex attention under context parallelism.
from .flex.allgather import flex_cp_allgather
from .flex.block_mask import _create_cp_block_mask, _create_cp_block_mask as create_cp_block_mask

# strategy: strategy="auto", the cost model that chooses ring, Ulysses or USP.
from .strategy.auto import AttentionShape, AutoStrategy
from .strategy.calibration import Calibration
from .strategy.explain import explain

# decode: inference over a sharded KV cache.
from .decode.kv_cache import ShardedKVCache
from .decode.op import decode_sdpa

# merge: partial attention results merged in place.
from .merge.op import merge_partial_

# integrations: torch's context-parallel names replaced by cplib's where
# accelerate, HF Trainer and torchtitan import them; cplib's reach into
# transformers (cplib/integrations/, one registry of every replacement).
from .integrations import install_integrations as _install_integrations
from .integrations.torch_names import patch_torch, unpatch_torch
from .frontend.start_hooks import on_context_parallel_start as _on_context_parallel_start
from . import loss  # noqa: F401  (cplib.loss.cross_entropy: a loss of your own under CP)

# conv: halo-exchange convolution and its DTensor handlers.
from .conv.dtensor import disable_dtensor_conv, enable_dtensor_conv
from .conv.seq_halo import seq_halo
from .conv.tp_conv import tp_conv

# hybrid: recurrent and conv layers of hybrid models (transformers' are
# reached through cplib/integrations/transformers/, installed whenever context
# parallelism starts: never a per-shard recurrence, loss or attention).
from .hybrid import recurrence_exchange

# Every start of context parallelism (a region, _context_parallel_shard,
# _ContextParallel) puts the integrations in place (frontend/start_hooks.py).
_on_context_parallel_start(_install_integrations)

# Public names for what torch keeps private (same objects).
LoadBalancer = _LoadBalancer
HeadTailLoadBalancer = _HeadTailLoadBalancer
PerDocumentHeadTailLoadBalancer = _PerDocumentHeadTailLoadBalancer
PTRRLoadBalancer = _PTRRLoadBalancer
ContextParallel = _ContextParallel
RotateMethod = _RotateMethod
enable_context_parallel_dispatcher = _enable_context_parallel_dispatcher
disable_context_parallel_dispatcher = _disable_context_parallel_dispatcher

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    # torch's _context_parallel names, same signatures and semantics
    "_CausalBehavior",
    "_context_parallel_shard",
    "_ContextParallel",
    "_cp_options",
    "_disable_context_parallel_dispatcher",
    "_enable_context_parallel_dispatcher",
    "_is_causal_behavior",
    "_RotateMethod",
    "context_parallel",
    "context_parallel_unshard",
    "set_rotate_method",
    "flex_cp_allgather",
    "_HeadTailLoadBalancer",
    "_LoadBalancer",
    "_PerDocumentHeadTailLoadBalancer",
    "_PTRRLoadBalancer",
    # cplib's public names
    "ContextParallel",
    "ContextParallelHandle",
    "HeadTailLoadBalancer",
    "LoadBalancer",
    "PerDocumentHeadTailLoadBalancer",
    "PTRRLoadBalancer",
    "RotateMethod",
    "disable_context_parallel_dispatcher",
    "enable_context_parallel_dispatcher",
    "merge_partial_",
    "patch_torch",
    "unpatch_torch",
    "consistency_checks",
    "consistency_checks_enabled",
    "set_consistency_checks",
    "register_group",
    "ring_sdpa",
    "ring_pass_auto",
    "decode_sdpa",
    "ShardedKVCache",
    "ulysses_reshard",
    "ulysses_sdpa",
    "usp_sdpa",
    "usp_load_balancer",
    "tp_conv",
    "seq_halo",
    "recurrence_exchange",
    "enable_dtensor_conv",
    "disable_dtensor_conv",
    "_create_cp_block_mask",
    "create_cp_block_mask",
    "shard",
    "unshard",
    "__version__",
    "attention_window",
    "attention_documents",
    "cu_seqlens_from_position_ids",
    "AnyLengthHeadTailLoadBalancer",
    "AnyLengthPerDocumentLoadBalancer",
    "DocumentPlacementLoadBalancer",
    "AttentionShape",
    "AutoStrategy",
    "Calibration",
    "explain",
]
