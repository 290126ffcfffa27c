"""The forward of every transformers model, guarded once (models.py's
``guard_forward``, installed for each model class as models are built:
__init__.py).

Outside context parallelism the guard calls straight through. A forward
given a tensor that ``_context_parallel_shard`` (or ``cplib.shard``) cut,
outside any region, opens the module-path scope of that tensor's layout for
its duration (cplib/frontend/sequence.py): the model's losses, routers and
hybrid layers read the layout there, and nowhere else. Under context
parallelism (a region, or that scope) the guard refuses, on every rank and
before the model computes anything, what cannot run sharded:

* a family classified as refused for the model's attention implementation
  (families.py; a family no one classified is refused too);
* a model that pools one token (pooled.py);
* and, after the forward, a loss the model computed itself from labels
  (own_loss.py).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ...frontend.sequence import (SequenceShards, active_handle, layout_in_scope,
                                  layout_source, sharded_scope, shards_of)
from .families import check_family
from .losses import loss_function_reads
from .own_loss import given_targets, own_loss_refusal, returned_loss, target_slots
from .pooled import pooled_refusal, pools_one_token

__all__ = ["guarded_forward"]


def _sharded_input(args: tuple, kwargs: dict) -> SequenceShards | None:
    for value in (*args, *kwargs.values()):
        shards = shards_of(value)
        if shards is not None:
            return shards
    return None


def _refuse_under_context_parallelism(model: Any, where: str) -> None:
    cls = type(model)
    check_family(cls, getattr(model, "config", None), where)
    if pools_one_token(cls):
        raise pooled_refusal(cls, where)


def _under_context_parallelism(forward: Callable[..., Any], slots: dict[str, int], model: Any,
                               args: tuple, kwargs: dict) -> Any:
    where = layout_source()
    _refuse_under_context_parallelism(model, where)
    cls = type(model)
    given = given_targets(slots, args, kwargs)
    if not given:
        return forward(model, *args, **kwargs)
    asked = loss_function_reads()
    out = forward(model, *args, **kwargs)
    if loss_function_reads() == asked and returned_loss(out):
        raise own_loss_refusal(cls, given[0], where)
    return out


def guarded_forward(forward: Callable[..., Any]) -> Callable[..., Any]:
    slots = target_slots(forward)

    def forward_under_cplib(self: Any, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            # A trace sees a region (its dispatch mode), and refuses what it
            # cannot check (the scope, the shards' layout, the own-loss count).
            if active_handle() is not None:
                _refuse_under_context_parallelism(self, layout_source())
            return forward(self, *args, **kwargs)
        if active_handle() is not None or layout_in_scope() is not None:
            return _under_context_parallelism(forward, slots, self, args, kwargs)
        shards = _sharded_input(args, kwargs)
        if shards is None:
            return forward(self, *args, **kwargs)
        with sharded_scope(shards):
            return _under_context_parallelism(forward, slots, self, args, kwargs)

    return forward_under_cplib
