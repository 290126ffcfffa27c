"""What a context-parallel flex call must satisfy, and what every rank
must agree on before its first collective.

The checks run where the call is taken over (``cp_mode.py``), which is
traced by dynamo (flex_attention itself compiles the call, even eagerly),
so what needs Python's introspection (a score_mod's code, its captured
tensors) is computed by functions dynamo calls at trace time and keeps as
constants (``assume_constant_result``). What must agree across ranks (the
mask's plan, the score_mod, the lengths) travels in the call's handshake,
which raises the same error on every rank, as does an error found here."""

from __future__ import annotations

import functools
import zlib
from types import CodeType
from typing import Any, Callable

import torch

from .call import FlexCall
from .plan import FlexShard

__all__ = ["call_error", "score_mod_fingerprint", "captured_grad_tensors"]


def _walk_callables(fn: Callable | None):
    """``fn`` and the callables found in its closure cells and partial
    arguments, each once, with ``(name, value)`` of what each captures."""
    seen, todo = set(), [fn]
    while todo:
        f = todo.pop()
        if not callable(f) or id(f) in seen:
            continue
        seen.add(id(f))
        items: list[tuple[str, Any]] = []
        if isinstance(f, functools.partial):
            items += [("a partial argument", a) for a in (*f.args, *f.keywords.values())]
            todo.append(f.func)
        code, cells = getattr(f, "__code__", None), getattr(f, "__closure__", None) or ()
        for name, cell in zip(code.co_freevars if code is not None else (), cells):
            try:
                items.append((name, cell.cell_contents))
            except ValueError:  # an empty cell
                pass
        todo += [value for _, value in items if callable(value)]
        yield f, items


def _code_parts(code: CodeType) -> list:
    """A code object's instructions, names and constants (nested code by
    its own parts: a code object's repr holds its address)."""
    consts = [_code_parts(c) if isinstance(c, CodeType) else repr(c) for c in code.co_consts]
    return [code.co_code.hex(), code.co_names, consts]


def _value_part(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype))
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    return type(value).__qualname__


@torch._dynamo.assume_constant_result
def score_mod_fingerprint(fn: Callable | None) -> int:
    """A number that is the same on every rank for the same score_mod: its
    code, the numbers and strings it reads from its globals and closures,
    the shapes and dtypes of the tensors it captures, and the same of the
    functions it captures (0: none)."""
    if fn is None:
        return 0
    parts: list = []
    for f, items in _walk_callables(fn):
        code = getattr(f, "__code__", None)
        if code is None:
            parts.append(type(f).__qualname__)
            continue
        parts.append(_code_parts(code))
        globals_ = getattr(f, "__globals__", {})
        parts.append([(n, _value_part(globals_[n])) for n in code.co_names
                      if n in globals_ and not callable(globals_[n])])
        parts.append([(n, _value_part(v)) for n, v in items if not callable(v)])
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


@torch._dynamo.assume_constant_result
def captured_grad_tensors(fn: Callable | None) -> str:
    """The names of the tensors that require grad among what ``fn``
    captures (followed into the functions it captures), comma-separated."""
    found = [name for _, items in _walk_callables(fn) for name, value in items
             if isinstance(value, torch.Tensor) and value.requires_grad]
    return ", ".join(found)


def call_error(call: FlexCall, shard: FlexShard, ring: bool, group_name: str, world: int,
               rank: int) -> tuple[str, str] | None:
    """``(error class, message)`` when the call cannot run as a
    context-parallel call of ``shard`` (on the ring when ``ring``), else
    None. Returned, not raised: raised in traced code, an error would leave
    as dynamo's own exception and on this rank only (cp_mode.py raises it
    in the call's handshake, on every rank)."""
    q, k, v = call.query, call.key, call.value
    # int(): after a recompile for another length dynamo may trace sizes (and
    # the plan's numbers) as symbols, which a message cannot hold.
    if (shard.world, shard.rank, shard.group_name) != (world, rank, group_name):
        return "ValueError", (
            f"cplib: the block mask was sharded for rank {int(shard.rank)} of "
            f"{int(shard.world)} on group '{shard.group_name}', but this module runs on rank "
            f"{int(rank)} of {int(world)} on group '{group_name}'")
    rows, length = tuple(int(t.shape[2]) for t in (q, k, v)), int(shard.q_len)
    if rows != (length,) * 3:
        return "ValueError", (
            f"cplib: a flex_attention call in a context-parallel module takes this rank's "
            f"shards, {length} rows each (its block mask's queries), but query, key and "
            f"value have {rows[0]}, {rows[1]} and {rows[2]} rows")
    if not ring:
        return None
    if shard.unsupported is not None:
        return "NotImplementedError", f"cplib: {shard.unsupported}"
    if k.dtype != v.dtype:
        return "ValueError", (f"cplib: the flex ring sends key and value in one buffer, so they "
                              f"need one dtype, got {k.dtype} and {v.dtype}")
    if call.output_max:
        return "NotImplementedError", ("cplib: the flex ring returns lse, not max_scores "
                                       "(set_rotate_method('allgather') for max_scores)")
    captured = captured_grad_tensors(call.score_mod)
    if captured:
        return "NotImplementedError", (
            f"cplib: score_mod captures tensors that require grad ({captured}); the flex ring "
            "does not differentiate captured tensors (set_rotate_method('allgather'))")
    return None
