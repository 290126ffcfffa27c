"""Routing ``scaled_dot_product_attention`` to cplib's ring attention.

A ``TorchFunctionMode`` sees every call of the SDPA builtin made while it is
active, however the caller reached it: ``F.scaled_dot_product_attention``, a
reference taken before the mode was entered, ``nn.MultiheadAttention`` /
``nn.TransformerEncoderLayer`` (through ``F.multi_head_attention_forward``,
which the mode re-enters so that its inner SDPA call is seen too), or a
Hugging Face model. Everything else runs unchanged.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Sequence
from typing import Any, Callable, TypeVar

import torch
import torch.nn.functional as F
from torch._ops import HigherOrderOperator
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from ..attention.args import backend_arg, check_inputs, scale_arg, window_arg
from .documents import current_window, documents_stack
from .dtensor_sdpa import disable_dtensor_sdpa, enable_dtensor_sdpa
from .mode_kept import (AUTOGRAD_ENTRIES, autograd_past_shard_hooks, autograd_with_mode,
                        body_with_mode, may_be_recomputed, recompute_only_under, with_inner_sdpa)
from ..comm.handshake import agreed, forward_error
from ..comm.native import call_translating, group_name_of
from ..flex.call import is_graph_call
from ..flex.cp_mode import LetsFlexModulesThrough, refuse_flex_call
from .options import RingConfig
from ..ring.call import RingCall

__all__ = ["CPDispatchMode", "routed_sdpa", "sdpa_backend_hint",
           "_enable_context_parallel_dispatcher", "_disable_context_parallel_dispatcher",
           "dispatcher_enabled", "agreed_before_attention", "active_config",
           "max_over_cp_ranks", "CALLS_SDPA", "MHA", "check_mha_weights"]

T = TypeVar("T")

_SDPA = torch._C._nn.scaled_dot_product_attention
MHA = F.multi_head_attention_forward
_FLEX = torch.ops.higher_order.flex_attention
_MHA_SIGNATURE = inspect.signature(MHA)
# Python-level functionals whose body calls SDPA (F.multi_head_attention_forward):
# the mode re-enters them so that inner call is routed too; every other
# function runs as is (cheap, and simple for torch.compile to trace).
CALLS_SDPA = frozenset(
    f for f in vars(F).values()
    if isinstance(f, types.FunctionType) and "scaled_dot_product_attention" in f.__code__.co_names
)

# The CUDA kernels that return a log-sum-exp: SDPBackend value -> (torch flag, ring name).
_CUDA_BACKENDS = {1: ("flash", "flash"), 2: ("mem_efficient", "efficient"), 3: ("cudnn", "cudnn")}


def _sdpa_signature(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *,
                    scale=None, enable_gqa=False):
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


def sdpa_backend_hint(device: torch.device) -> str | None:
    """The ring's block kernel as ``torch.nn.attention.sdpa_kernel`` allows it:
    None (let the op choose as SDPA would) on CPU or when every fused CUDA
    kernel is enabled, else the enabled one SDPA's priority order puts first."""
    if device.type != "cuda":
        return None
    enabled = [_CUDA_BACKENDS[b][1] for b in torch._C._get_sdp_priority_order()
               if b in _CUDA_BACKENDS
               and getattr(torch._C, f"_get_{_CUDA_BACKENDS[b][0]}_sdp_enabled")()]
    if len(enabled) == len(_CUDA_BACKENDS):
        return None
    if not enabled:
        raise NotImplementedError(
            "cplib: context-parallel attention on CUDA needs the flash, memory-efficient or "
            "cuDNN SDPA kernel (they return the log-sum-exp the ring merges), but "
            "torch.nn.attention.sdpa_kernel enabled none of them"
        )
    return enabled[0]


def _check_sdpa_args(q, k, v, attn_mask, dropout_p, enable_gqa) -> None:
    if dropout_p != 0.0:
        raise NotImplementedError(
            f"cplib: context-parallel SDPA does not support dropout (dropout_p={dropout_p}); "
            "set the attention dropout to 0"
        )
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, torch.Tensor) or t.ndim != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"cplib: context-parallel SDPA needs 4-D (batch, heads, seq, dim) tensors; "
                f"{name} is {shape}"
            )
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"cplib: key {tuple(k.shape)} and value {tuple(v.shape)} must agree in batch, "
            "heads and sequence length"
        )
    hq, hkv = q.shape[1], k.shape[1]
    # One K/V head broadcasts over the query heads without enable_gqa, as in torch (Falcon).
    if hq != hkv and hkv != 1 and not enable_gqa:
        raise ValueError(
            f"cplib: query has {hq} heads but key/value have {hkv}; pass enable_gqa=True for "
            "grouped-query attention"
        )
    if hq % hkv:
        raise ValueError(
            f"cplib: query heads ({hq}) must be a multiple of key/value heads ({hkv})"
        )
    if attn_mask is not None:  # key-padding masks only (NotImplementedError naming others)
        from ..attention.key_padding import check_key_padding
        check_key_padding("scaled_dot_product_attention", attn_mask, k)


def context_extras(config: RingConfig, window=None) -> dict:
    """ring_sdpa's keywords for the context's layout, documents and ``window``,
    only where set: plain contexts (and the tests' stand-in ring) take none."""
    extras = {}
    if config.seq_len is not None:
        extras["seq_len"] = config.seq_len
    if config.cu_seqlens is not None:
        extras["cu_seqlens"] = config.cu_seqlens
    if config.per_document:
        extras["per_document"] = True
    if config.placement:
        extras["placement"] = True
    if window is not None:
        extras["window"] = window
    return extras


def agreed_before_attention(op: str, group_name: str, ulysses_group: str | None,
                            tensors: Sequence, check: Callable[[], T]) -> T:
    """``check()``'s result; an exception it raises is raised on every rank
    of a context whose attention runs over ``group_name`` (the ring group) and
    ``ulysses_group`` (USP; None without Ulysses): it travels in the handshake
    the other ranks' routed attention starts with (the Ulysses group's, then
    the ring group's, as ``usp_sdpa`` forwards its own errors), so that a rank
    whose call is rejected here never leaves the others waiting."""
    if torch.compiler.is_compiling():
        return check()
    # Registered as the ops register them, so that this handshake takes the
    # collective theirs take (see group_name_of).
    first = group_name_of(ulysses_group or group_name)
    if first != group_name:
        group_name_of(group_name)
    try:
        return agreed(op, first, tensors, check)
    except Exception as exc:
        if first != group_name:  # USP: the other Ulysses groups wait in the ring's
            forward_error(op, group_name, exc)
        raise


def _agreed_in(config: RingConfig, op: str, tensors: Sequence, check: Callable[[], T]) -> T:
    return agreed_before_attention(op, config.group_name,
                                   config.ulysses_group if config.ulysses_degree > 1 else None,
                                   tensors, check)


def routed_sdpa(config: RingConfig, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``scaled_dot_product_attention(*args, **kwargs)`` on this rank's
    sequence shards, computed over the whole sequence by the ring op."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]

    def check():
        q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa = _sdpa_signature(*args,
                                                                                      **kwargs)
        _check_sdpa_args(q, k, v, attn_mask, dropout_p, enable_gqa)
        backend, window = sdpa_backend_hint(q.device), current_window(config.window)
        if config.ulysses_degree > 1:
            return q, k, v, attn_mask, (bool(is_causal), scale, backend, window)
        # The ring's call, checked as ring_sdpa checks its own: the context's
        # layout, rotation and documents with this call's mask.
        check_inputs("ring_sdpa", q=q, k=k, v=v)
        return q, k, v, attn_mask, RingCall(
            config.group_name, bool(is_causal), config.layout, scale_arg("ring_sdpa", scale),
            backend_arg("ring_sdpa", backend), config.rotate, config.cu_seqlens,
            window_arg(window), config.seq_len)

    q, k, v, attn_mask, call = _agreed_in(config, "scaled_dot_product_attention", tensors, check)
    if config.ulysses_degree > 1:
        is_causal, scale, backend, window = call
        if config.strategy is not None:  # strategy="auto": the rotation for these shapes
            from .strategy_route import routed_config
            config = routed_config(config, q, k, v, is_causal, window)
        return _routed_ulysses(config, q, k, v, is_causal, scale, backend, window, attn_mask)
    if config.strategy is not None:
        from .strategy_route import routed_config
        call = call.replace(rotate=routed_config(config, q, k, v, call.is_causal,
                                                 call.window).rotate)
    from ..ring.op import ring_attention  # lives beside this module; imported when first needed

    out, _ = ring_attention(q, k, v, call, attn_mask=attn_mask)
    return out


def _routed_ulysses(config: RingConfig, q, k, v, is_causal: bool, scale, backend, window,
                    attn_mask=None) -> torch.Tensor:
    # Ulysses over the Ulysses group; the ring over the ring group unless it is one rank.
    # The lse is discarded here, so it is not exchanged back.
    from ..ulysses.op import ulysses_attention
    from ..ulysses.usp import usp_attention

    extras = dict(cu_seqlens=config.cu_seqlens, window=window, seq_len=config.seq_len)
    if config.ulysses_degree == config.world_size:  # the layout is sequential: no per_document
        out, _ = ulysses_attention(q, k, v, config.ulysses_group, is_causal, scale, backend,
                                   attn_mask, False, **extras)
    else:
        out, _ = usp_attention(q, k, v, config.ulysses_group, config.group_name, is_causal,
                               config.load_balanced, scale, config.rotate, backend, attn_mask,
                               False, per_document=config.per_document, **extras)
    return out


def check_mha_weights(args: tuple, kwargs: dict, what: str = "context parallelism cannot shard"
               ) -> None:
    bound = _MHA_SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    if bound.arguments["need_weights"]:
        raise NotImplementedError(
            "cplib: nn.MultiheadAttention with need_weights=True computes attention without "
            f"SDPA, which {what}; call it with need_weights=False"
        )


def _refuse_module_documents() -> None:
    # attention_documents gives _ContextParallel modules their documents; a
    # region's calls would run without them (every rank alike: the same code).
    raise NotImplementedError(
        "cplib: cplib.attention_documents(...) gives documents to the SDPA calls of "
        "_ContextParallel modules; this SDPA call runs in a cplib.context_parallel region, "
        "which takes its documents once, on entry: pass position_ids= or cu_seqlens= (and "
        "load_balance=\"per_document\" or \"placement\" as the shards need) to "
        "cplib.context_parallel instead")


class CPDispatchMode(LetsFlexModulesThrough, TorchFunctionMode):
    """While active, every SDPA call runs as context-parallel ring attention
    with ``config``."""

    def __init__(self, config: RingConfig, handle: Any = None, buffers: tuple = ()):
        super().__init__()
        self.config = config
        # The ContextParallelHandle of a cplib.context_parallel region (its
        # mesh and layout: cplib/frontend/sequence.py reads it), None for a
        # module's; the buffers that region holds sharded (a nested one refuses them).
        self.handle, self.buffers = handle, buffers
        # _ContextParallel(FLEX) forwards running inside this dispatch
        # (cplib/flex/cp_mode.py flex_modules_inside): their flex calls, and
        # the ones their ring makes, are theirs; any other would stay within
        # a shard.
        self.flex_modules = 0
        # Whether an attention call routed here may be recomputed in a backward
        # (checkpointed): only then does a backward started here keep the mode.
        self.recomputable = False

    def _note_attention_call(self) -> None:
        """An attention call is routed here: may a backward recompute it?
        Then, in a region, only under this dispatch (recompute_only_under; a
        module's recomputation enters the module's own dispatch again)."""
        if may_be_recomputed():
            self.recomputable = True
            if self.handle is not None:
                recompute_only_under(self, "a cplib.context_parallel region")

    def __torch_function__(self, func: Callable, types_: tuple, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        # A flex op called from a compiled graph was taken over (or refused)
        # when that graph was traced (flex_attention passes its args so).
        if func is _FLEX and not self.flex_modules and not is_graph_call(tuple(args[4])):
            where = ("a cplib.context_parallel region" if self.handle is not None
                     else "a module parallelized with _ContextParallel (SDPA)")
            return refuse_flex_call(self.config.group_name, where, *args[:3])
        if func is _SDPA:
            if self.handle is not None and documents_stack:
                _refuse_module_documents()
            self._note_attention_call()
            return routed_sdpa(self.config, *args, **kwargs)
        if func is MHA:
            _agreed_in(self.config, "multi_head_attention_forward",
                       [a for a in args if isinstance(a, torch.Tensor)],
                       lambda: check_mha_weights(args, kwargs))
        if func in CALLS_SDPA:
            self._note_attention_call()
            return with_inner_sdpa(self, functools.partial(routed_sdpa, self.config), func,
                                   types_, args, kwargs)
        if isinstance(func, HigherOrderOperator) and func is not _FLEX:
            return body_with_mode(self, func, types_, args, kwargs)
        if func in AUTOGRAD_ENTRIES:
            if self.recomputable:
                return autograd_with_mode(self, func, types_, args, kwargs)
            return autograd_past_shard_hooks(func, args, kwargs, call_translating)
        return call_translating(func, args, kwargs)


def active_config() -> RingConfig | None:
    """The configuration of the innermost context-parallel dispatch in effect
    (a ``cplib.context_parallel`` region, or a ``_ContextParallel`` module's
    forward), else None."""
    for mode in reversed(_get_current_function_mode_stack()):
        if isinstance(mode, CPDispatchMode):
            return mode.config
    return None


def max_over_cp_ranks(t: torch.Tensor, config: RingConfig) -> None:
    """``t`` becomes, in place, its elementwise max over every CP rank of
    ``config``: the ring groups and the Ulysses groups together span them."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    for name in (config.group_name, config.ulysses_group):
        if name is not None:
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX,
                                         group=_resolve_process_group(name))


_enabled = [False]  # torch's API toggles the dispatcher process-wide


def _enable_context_parallel_dispatcher() -> None:
    """Lets modules parallelized with ``_ContextParallel`` (SDPA) route their
    attention to the ring op, and the fused SDPA ops of DTensors sharded along
    the sequence (torchtitan's ``apply_cp_to_forward``) too
    (cplib/frontend/dtensor_sdpa.py). This API is experimental, as in torch."""
    _enabled[0] = True
    enable_dtensor_sdpa()


def _disable_context_parallel_dispatcher() -> None:
    """Turns both routings off again; those modules then raise instead of
    computing attention over the local shard only."""
    _enabled[0] = False
    disable_dtensor_sdpa()


def dispatcher_enabled() -> bool:
    return _enabled[0]
