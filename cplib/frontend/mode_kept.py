"""Calls made from a torch function mode's handler that must still see the
mode (the mode is popped while its handler runs): a functional whose body
calls SDPA (:func:`with_inner_sdpa`), a higher-order op's body
(:func:`body_with_mode`), and autograd (:func:`autograd_with_mode`).

Autograd runs a backward, on the calling thread and on a device's thread
alike, under the function-mode stack it was started with. A backward
started from the handler of cplib's SDPA dispatch (``loss.backward()`` in a
``cplib.context_parallel`` region goes through it) would therefore run
without the dispatch, and a checkpointed block (``torch.utils.checkpoint``:
HF's gradient checkpointing, torchtitan's activation checkpointing)
recomputed in it would call plain SDPA: attention within the shard, wrong
gradients with ``use_reentrant=True``, a CheckpointError without. Both
modes (sdpa_dispatch.py, one_process_sdpa.py) start autograd through
:func:`autograd_with_mode`; the ring's dispatch only once it has routed a
call that :func:`may_be_recomputed` (a mode in the backward costs every
Python-level torch call there a handler).
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
from torch.autograd.graph import _engine_run_backward
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from .sharding import ShardPack

__all__ = ["redispatch", "AUTOGRAD_ENTRIES", "autograd_past_shard_hooks", "autograd_with_mode",
           "body_with_mode", "may_be_recomputed", "with_inner_sdpa", "recompute_only_under"]

# torch >= 2.13 can call a function past one handler, so that the function
# runs with the mode active again; older torch has no such call.
redispatch = getattr(torch.overrides, "redispatch_function", None)

AUTOGRAD_ENTRIES = frozenset({torch.Tensor.backward, torch.autograd.backward,
                              torch.autograd.grad})


def may_be_recomputed() -> bool:
    """Whether a call made now may run again in a backward:
    torch.utils.checkpoint runs its forward without grad (reentrant) or under
    its saved-tensor hooks (not reentrant; a region's own hooks are not
    one). Traced, it may be a function an eager checkpoint calls
    (body_with_mode), whose hooks a trace cannot read: yes."""
    if torch.compiler.is_compiling():
        return True
    if not torch.is_grad_enabled():
        return True
    # A region with buffers keeps its shards' saved tensors under hooks of
    # its own (sharding.keep_shards_for_backward), which recompute nothing.
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is not None and not isinstance(hooks[0], ShardPack)


# Where each autograd entry takes create_graph by position.
_CREATE_GRAPH_AT = {torch.Tensor.backward: 3, torch.autograd.backward: 3, torch.autograd.grad: 4}


def autograd_past_shard_hooks(func: Callable, args: tuple, kwargs: dict,
                              run: Callable[[Callable, tuple, dict], Any]) -> Any:
    """``run(func, args, kwargs)``, a backward (``func`` one of
    ``AUTOGRAD_ENTRIES``), with a region's keep-shards hooks taken off the
    top of the stack meanwhile: a backward that builds no graph saves
    nothing, yet Python saved-tensor hooks in effect cost it host work
    (benchmarks/RESULTS.md, "Host work per call"). With ``create_graph``
    the hooks stay: that backward saves tensors, shards among them."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is None or not isinstance(hooks[0], ShardPack) or torch.compiler.is_compiling():
        return run(func, args, kwargs)
    at = _CREATE_GRAPH_AT[func]
    if kwargs.get("create_graph", len(args) > at and args[at]):
        return run(func, args, kwargs)
    torch._C._autograd._pop_saved_tensors_default_hooks()
    try:
        return run(func, args, kwargs)
    finally:
        torch._C._autograd._push_saved_tensors_default_hooks(*hooks)


_REENTRANT = torch.utils.checkpoint.CheckpointFunction.forward.__code__
# torch.utils.checkpoint's frame that holds the non-reentrant generator
# (``gen``): ``checkpoint`` itself (torch 2.11-2.13), or its ``_checkpoint_impl``
# where it has one (2.15).
_NON_REENTRANT = frozenset(
    inspect.unwrap(f).__code__ for f in (torch.utils.checkpoint.checkpoint,
                                         getattr(torch.utils.checkpoint, "_checkpoint_impl", None))
    if f is not None)


def _recomputation_holder() -> tuple[Any, str] | None:
    """(object, attribute) holding the function that the innermost
    ``torch.utils.checkpoint`` running now will call again in the backward:
    the reentrant one's ``ctx.run_function``, the other's frame's
    ``recompute_fn``; None outside a checkpoint (read from the Python stack:
    torch keeps no other handle on it)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is _REENTRANT:
            return frame.f_locals.get("ctx"), "run_function"
        if frame.f_code in _NON_REENTRANT:
            gen = frame.f_locals.get("gen")
            held = None if gen is None or gen.gi_frame is None else \
                gen.gi_frame.f_locals.get("new_frame")
            if held is not None:
                return held, "recompute_fn"
        frame = frame.f_back
    return None


def recompute_only_under(mode: TorchFunctionMode, what: str) -> None:
    """Makes the checkpoint whose forward routes an attention call through
    ``mode`` now refuse to recompute it anywhere but under ``mode``: a
    backward started after the region exits would recompute attention
    without it, on this rank's shard alone (silently wrong, reentrant or
    not). Raised on every rank alike, where the recomputation starts."""
    if torch.compiler.is_compiling():
        return  # the compiled checkpoint's body runs eagerly under the mode (body_with_mode)
    found = _recomputation_holder()
    if found is None or found[0] is None:
        return
    holder, name = found
    fn = getattr(holder, name)
    if getattr(fn, "__cplib_mode__", None) is mode:
        return

    def recompute(*args: Any, **kwargs: Any) -> Any:
        if not any(m is mode for m in _get_current_function_mode_stack()):
            raise NotImplementedError(
                f"cplib: a checkpointed block's attention ran under {what}, and this backward "
                "recomputes it after the region exited, where it would run on this rank's "
                "shard alone; call backward() inside the region (accelerate, Trainer and "
                "torchtitan do)")
        return fn(*args, **kwargs)

    recompute.__cplib_mode__ = mode  # type: ignore[attr-defined]
    setattr(holder, name, recompute)


def _as_tuple(x: Any) -> tuple:
    return (x,) if isinstance(x, (torch.Tensor, torch.autograd.graph.GradientEdge)) else tuple(x)


def _run_backward(tensors: Any, grads: Any, retain_graph: bool | None, create_graph: bool,
                  inputs: Any, allow_unused: bool, accumulate: bool) -> tuple:
    """What torch.autograd.backward and .grad run once past their
    ``__torch_function__`` check (torch < 2.13: that check would call the
    handler again)."""
    tensors = _as_tuple(tensors)
    grads = _make_grads(tensors, _tensor_or_tensors_to_tuple(grads, len(tensors)),
                        is_grads_batched=False)
    return _engine_run_backward(tensors, grads,
                                create_graph if retain_graph is None else retain_graph,
                                create_graph, () if inputs is None else _as_tuple(inputs),
                                allow_unused, accumulate_grad=accumulate)


def _tensor_backward(self: torch.Tensor, gradient: Any = None, retain_graph: bool | None = None,
                     create_graph: bool = False, inputs: Any = None) -> None:
    _run_backward(self, gradient, retain_graph, create_graph, inputs, True, True)


def _autograd_backward(tensors: Any, grad_tensors: Any = None, retain_graph: bool | None = None,
                       create_graph: bool = False, grad_variables: Any = None,
                       inputs: Any = None) -> None:
    _run_backward(tensors, grad_tensors, retain_graph, create_graph, inputs, True, True)


def _autograd_grad(outputs: Any, inputs: Any, grad_outputs: Any = None,
                   retain_graph: bool | None = None, create_graph: bool = False,
                   only_inputs: bool = True, allow_unused: bool | None = None,
                   is_grads_batched: bool = False, materialize_grads: bool = False) -> tuple:
    if is_grads_batched:
        raise NotImplementedError(
            "cplib: torch.autograd.grad(is_grads_batched=True) under cplib's SDPA dispatch "
            f"needs torch >= 2.13 (this is {torch.__version__}) to keep the dispatch in the "
            "backward")
    inputs = _as_tuple(inputs)
    result = _run_backward(outputs, grad_outputs, retain_graph, create_graph, inputs,
                           materialize_grads if allow_unused is None else allow_unused, False)
    if materialize_grads:  # as torch.autograd.grad fills them
        result = tuple(torch.zeros_like(i, requires_grad=True) if g is None else g
                       for g, i in zip(result, inputs))
    return result


_PAST_THE_CHECK: dict[Callable, Callable] = {
    torch.Tensor.backward: _tensor_backward,
    torch.autograd.backward: _autograd_backward,
    torch.autograd.grad: _autograd_grad,
}


def _redispatched_with(mode: TorchFunctionMode, func: Callable, types_: tuple, args: tuple,
                       kwargs: dict) -> Any:
    """``func`` past ``mode``'s handler, with ``mode`` active again (torch >= 2.13)."""
    with mode:
        return redispatch(func, types_, args, kwargs)


def autograd_with_mode(mode: TorchFunctionMode, func: Callable, types_: tuple, args: tuple,
                       kwargs: dict) -> Any:
    """``func`` (one of ``AUTOGRAD_ENTRIES``), called from ``mode``'s handler,
    with ``mode`` in the stack that its backward runs under."""
    if redispatch is not None:
        return _redispatched_with(mode, func, types_, args, kwargs)
    with mode:
        return _PAST_THE_CHECK[func](*args, **kwargs)


# What fullgraph=True reports when it meets such an op (dynamo's error quotes it).
_EAGER_BODY = ("cplib: a higher-order op (such as torch.utils.checkpoint) inside a "
               "context_parallel region or an attention_window block runs eagerly, so that "
               "the attention in its body goes through cplib; torch.compile(fullgraph=True) "
               "cannot hold it in one graph: compile without fullgraph=True, or compile the "
               "function inside the checkpoint instead")


def body_with_mode(mode: TorchFunctionMode, func: Callable, types_: tuple, args: tuple,
                   kwargs: dict) -> Any:
    """A higher-order op (``func``: a ``torch.utils.checkpoint`` that dynamo
    traces, ...) called from ``mode``'s handler, its body run with ``mode``
    active. Left to itself, dynamo traced a checkpointed layer's attention in
    a compiled model as torch's SDPA on the shard, silently. It cannot trace
    the body with the mode either (the op inside comes back to this handler),
    so a graph break runs the user's call eagerly, under the mode: the
    checkpointed layer leaves the graph, the functions it calls compile
    anew; under ``fullgraph=True`` the break raises. An eager call on torch
    < 2.13 (no redispatch) runs as before, the mode popped."""
    if torch.compiler.is_compiling():
        torch._dynamo.graph_break(msg=_EAGER_BODY)
    if redispatch is None:
        return func(*args, **kwargs)
    return _redispatched_with(mode, func, types_, args, kwargs)


def with_inner_sdpa(mode: TorchFunctionMode, sdpa: Callable, func: Callable, types_: tuple,
                    args: tuple, kwargs: dict) -> Any:
    """``func`` (a functional whose body calls SDPA: ``CALLS_SDPA``), called
    from ``mode``'s handler, with its inner SDPA call going to ``sdpa``."""
    if redispatch is not None:  # torch >= 2.13: run it with the mode still active
        return _redispatched_with(mode, func, types_, args, kwargs)
    # torch < 2.13: functions in torch.nn.functional call SDPA through the
    # module global, so patching it for this call routes their inner call.
    saved = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = sdpa
    try:
        return func(*args, **kwargs)
    finally:
        F.scaled_dot_product_attention = saved
