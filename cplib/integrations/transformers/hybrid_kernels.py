"""What each of transformers' sequence-mixing kernel functions does under
``cplib.context_parallel`` (its role in cplib/integrations/transformers/hybrid_families.py): the
user's kernel, with cplib's exchange around it (cplib/hybrid/). Arguments are
read by the names of transformers' torch versions of these functions, which
its layers call them with."""

from __future__ import annotations

import inspect
from typing import Any, Callable

from ...hybrid.choice import DeltaShape, choose_exchange
from ...hybrid.conv import causal_conv_by_halo
from ...hybrid.delta_rule import delta_rule_by_heads, delta_rule_by_state
from ...hybrid.layout import SequenceLayout
from ...hybrid.ssd import ssd_by_state

__all__ = ["HANDLERS"]

# Packed sequences reach the kernels as these; under CP they are refused.
_PACKED = ("cu_seqlens", "seq_idx", "cu_seq_lens_q")


# The leading arguments of transformers' torch versions, as its layers pass them.
_CONV = inspect.signature(lambda hidden_states, weight, bias=None, activation=None, **kwargs: 0)
_DELTA = inspect.signature(lambda query, key, value, g, beta, **kwargs: 0)
_SSD = inspect.signature(lambda hidden_states, dt, A, B, C, chunk_size, **kwargs: 0)


def _arguments(form: inspect.Signature, name: str, what: str, args: tuple, kwargs: dict,
               carried: str | None = None) -> tuple[dict, dict]:
    """(named arguments of ``form``, the rest as keywords): only what was given,
    checked: no packed sequences, no state carried in under ``carried``."""
    bound = form.bind(*args, **kwargs).arguments
    rest = dict(bound.pop("kwargs", {}))
    packed = [k for k in _PACKED if rest.get(k) is not None]
    if packed:
        raise NotImplementedError(
            f"cplib: {what} under cplib.context_parallel: {name} got {packed[0]}= (packed "
            "sequences): not supported under context parallelism; pass one sequence per row "
            "(documents in position_ids are fine: the recurrence runs over the packed row as "
            "in one process)")
    for k in _PACKED:
        rest.pop(k, None)
    if carried is not None and rest.pop(carried, None) is not None:
        raise NotImplementedError(f"cplib: {what} under cplib.context_parallel: {name} with "
                                  f"{carried}= (a cache continuation) is not supported")
    return bound, rest


def _conv(original, name: str, layout: SequenceLayout, what: str, args, kwargs):
    a, rest = _arguments(_CONV, name, what, args, kwargs)
    if a.get("activation") is not None:
        rest["activation"] = a["activation"]
    return causal_conv_by_halo(original, layout, a["hidden_states"], a["weight"], a.get("bias"),
                               rest)


def _delta(original, name: str, layout: SequenceLayout, what: str, args, kwargs):
    a, rest = _arguments(_DELTA, name, what, args, kwargs, "initial_state")
    want_final = bool(rest.pop("output_final_state", False))
    q, k, v, g, beta = (a[n] for n in ("query", "key", "value", "g", "beta"))
    shape = DeltaShape(q.shape[0], k.shape[2], v.shape[2], k.shape[3], v.shape[3],
                       g.shape[3] if g.dim() == 4 else 1, v.element_size(), g.element_size())
    way = choose_exchange(layout, shape, q.device.type, need_state=want_final)
    if way == "heads":
        return delta_rule_by_heads(original, layout, q, k, v, g, beta, rest), None
    return delta_rule_by_state(original, layout, q, k, v, g, beta, want_final, rest)


def _ssd(original, name: str, layout: SequenceLayout, what: str, args, kwargs):
    a, rest = _arguments(_SSD, name, what, args, kwargs, "initial_states")
    want_final = bool(rest.get("return_final_states", False))
    y, final = ssd_by_state(original, layout, a["hidden_states"], a["dt"], a["A"], a["B"],
                            a["C"], a["chunk_size"], rest)
    return (y, final) if want_final else y


def _unfused(original, name, layout, what, args, kwargs):
    # None is what the torch fallback returns: the layer then takes its
    # unfused path, whose conv and scan calls get their exchanges.
    return None


def _decode(original, name: str, layout, what: str, args, kwargs):
    raise NotImplementedError(
        f"cplib: {what} under cplib.context_parallel: {name} is a one-token decode step from "
        "a cache, which context parallelism does not shard; decode outside the context")


HANDLERS: dict[str, Callable[..., Any]] = {"conv": _conv, "delta": _delta, "ssd": _ssd,
                                           "unfused": _unfused, "decode": _decode}
