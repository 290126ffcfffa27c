"""Where a context-parallel module's flex call is taken over: a torch
function mode, active during the module's forward, that sees each call of
flex's higher-order op (``torch.ops.higher_order.flex_attention``) and
computes it over the whole sequence, on the flex ring or the all-gather.

Everything the module does around its flex calls runs as written (scales,
gates, biases, several calls, ``return_lse``/``return_aux``): only the
call is replaced, by one that returns what flex returns on one process.
The op is reached while dynamo traces (flex_attention compiles its call
even eagerly, and a compiled flex compiles it with inductor), so the
ring's steps are traced into the same graph and compiled as the module's
call was: a ``torch.compile(flex_attention)`` stays compiled, each step a
fused kernel with its own BlockMask. The graph then runs under this mode
too; its own op calls (their mask_mod a graph module) pass through.

``score_mod`` and ``mask_mod`` see global positions on both paths, with
and without a BlockMask and under every load balancer: the sharded mask's
layout, or without a mask the layout of the last ``_context_parallel_shard``
(``layout``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.attention.flex_attention as fa
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from ..comm.native import call_translating
from .allgather import flex_cp_allgather
from .call import FlexCall, hop_outputs, is_graph_call, parse_hop_call
from .call_checks import call_error, score_mod_fingerprint
from .plan import SHARD_ATTR, FlexShard, dense_shard, positions_mod
from .ring import FlexRingCall, ring_attention
from .ring_ops import ring_begin, ring_end
from .stand_in import real_mask

__all__ = ["FlexCPMode", "LetsFlexModulesThrough", "flex_modules_inside", "refuse_flex_call"]

_HOP = torch.ops.higher_order.flex_attention


class FlexCPMode(TorchFunctionMode):
    """One per context-parallel module; entered around each forward with
    ``ring`` (the flex ring, else the all-gather) and ``layout`` (the
    ``(1|B, S)`` original position of each row of the sharded sequence,
    None: in order) set for that call."""

    def __init__(self, group_name: str, world: int, rank: int) -> None:
        super().__init__()
        self.group_name, self.world, self.rank = group_name, world, rank
        self.ring = True
        self.layout: torch.Tensor | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is _HOP:
            return _cp_call(self, func, args, kwargs or {})
        return call_translating(func, args, kwargs or {})


def _shard_of(mode: FlexCPMode, call: FlexCall):
    """The call's sharded mask (None: no mask), its plan, and an error
    (as call_error's) when its mask is one cplib did not shard."""
    mask = real_mask(call.mask_mod)
    if mask is not None:
        return mask, getattr(mask, SHARD_ATTR), None
    block = call.mask_tuple[-3:-1]
    if call.mask_mod is not fa.noop_mask or any(b != fa._LARGE_SPARSE_BLOCK_SIZE for b in block):
        return None, None, ("ValueError", (
            "cplib: a flex_attention call in a context-parallel module got a BlockMask that "
            "cplib did not shard: pass the module the mask that _context_parallel_shard or "
            "create_cp_block_mask made (eagerly), as an argument"))
    rows, layout = int(call.query.shape[2]), mode.layout
    if layout is not None and int(layout.shape[-1]) != mode.world * rows:
        return None, None, ("ValueError", (
            f"cplib: a flex_attention call without a BlockMask reads its shards in the layout "
            f"of the last _context_parallel_shard, a sequence of {int(layout.shape[-1])}, but "
            f"its {mode.world} shards of {rows} rows make {mode.world * rows}: shard the "
            "call's inputs with _context_parallel_shard"))
    shard = dense_shard(mode.group_name, mode.world, mode.rank, rows, call.query.device, layout)
    return None, shard, None


def _fields(call: FlexCall, shard: FlexShard, mask, ring: bool) -> dict[str, int]:
    """What every rank's call must agree on (besides q, k and v)."""
    qb, kb = shard.block_size
    return {"flex ring (1) or all-gather (0)": int(ring),
            "block_mask is given": int(mask is not None), "block_mask q_len": shard.q_len,
            "block_mask kv_len": shard.kv_len, "block_mask BLOCK_SIZE[0]": qb,
            "block_mask BLOCK_SIZE[1]": kb, "ring plan (hash)": shard.plan_hash,
            "ring steps": len(shard.steps), "score_mod (fingerprint)":
                score_mod_fingerprint(call.score_mod),
            "lse is computed": int(call.output_lse), "max_scores is computed":
                int(call.output_max),
            **{f"{name} requires grad": int(t.requires_grad)
               for name, t in (("query", call.query), ("key", call.key), ("value", call.value))}}


def _cp_call(mode: FlexCPMode, hop, args: tuple, kwargs: dict):
    if is_graph_call(tuple(args[4]) if len(args) > 4 else tuple(kwargs["block_mask"])):
        return hop(*args, **kwargs)
    call = parse_hop_call(args, kwargs)
    mask, shard, error = _shard_of(mode, call)
    if error is None:
        error = call_error(call, shard, mode.ring, mode.group_name, mode.world, mode.rank)
    if error is not None:
        return _raise_in_handshake(call.query, call.key, call.value, error, mode.group_name)
    fields = _fields(call, shard, mask, mode.ring)
    if mode.ring:
        ring = FlexRingCall(shard, call.score_mod, call.scale, call.enable_gqa, call.options)
        out, lse = ring_attention(call.query, call.key, call.value, ring, fields,
                                  mode.group_name)
        return hop_outputs(call, out, lse)
    return _gathered(hop, call, mask, shard, fields, mode.group_name)


# The handshake's error kinds (ErrorKind in csrc/torch/common/errors.h).
_ERROR_KINDS = {"ValueError": 1, "NotImplementedError": 2, "TypeError": 3, "IndexError": 4}


def _raise_in_handshake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        error: tuple[str, str], group_name: str):
    """A call that raises ``error`` on every rank, in its handshake, before
    any exchange (its outputs, never returned, keep the handshake in a graph)."""
    kind, message = error
    token = ring_begin(q.detach(), k.detach(), v.detach(),
                       {f"error: {message}": _ERROR_KINDS.get(kind, 5)}, group_name)
    out = ring_end(q.new_zeros((*q.shape[:3], v.shape[3])), token)
    lse = ring_end(q.new_zeros(q.shape[:3], dtype=torch.float32), token)
    return out, lse, lse.new_empty((0,))


def _gathered(hop, call: FlexCall, mask, shard: FlexShard, fields: dict[str, int],
              group_name: str):
    """The call on the all-gathered keys and values, its score_mod on global
    positions (the mask's mask_mod already is)."""
    q, k, v = call.query, call.key, call.value
    token = ring_begin(q.detach(), k.detach(), v.detach(), fields, group_name)
    # A copy of k after the handshake: the gather comes after it in any graph.
    k_full, v_full = flex_cp_allgather(ring_end(k, token), v, 2, group_name)
    score_mod = fa._identity if call.score_mod is None else positions_mod(
        call.score_mod, shard.q_positions, shard.positions, score=True)
    mask_tuple = (mask if mask is not None else fa._create_empty_block_mask(q, k_full)).as_tuple()
    return hop(q, k_full, v_full, score_mod, mask_tuple, call.scale, call.kernel_options)


def refuse_flex_call(group_name: str, where: str, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor):
    """A flex call under cplib's SDPA dispatch (``where``) that no
    ``_ContextParallel(FLEX)`` module takes over: it would attend within this
    rank's shard, so it raises NotImplementedError on every rank, in a
    handshake over ``group_name``. (Raised while dynamo traces the call,
    which flex does even eagerly, an exception would come out as dynamo's
    own error; the handshake raises it when the graph runs, as itself.)"""
    return _raise_in_handshake(q, k, v, ("NotImplementedError", (
        f"cplib: a flex_attention call in {where} would attend within this rank's shard of "
        "the sequence (cplib routes SDPA calls there, not flex's): parallelize the module "
        "that calls it with _ContextParallel(attention_type=FLEX), whose flex calls run over "
        "the whole sequence, or call scaled_dot_product_attention")), group_name)


class LetsFlexModulesThrough:
    """A torch function mode (cplib's SDPA dispatch, a layer above) that
    refuses flex calls (refuse_flex_call) except while a
    ``_ContextParallel(FLEX)`` forward runs inside it: ``flex_modules``
    counts those."""

    flex_modules: int = 0


@contextlib.contextmanager
def flex_modules_inside() -> Iterator[None]:
    """Around a ``_ContextParallel(FLEX)`` module's forward (hook.py): the
    modes it runs inside let flex calls through meanwhile (its FlexCPMode
    takes them over first, and hands its ring's own calls on to them).
    Dynamo traces this too (a whole model compiled): the marks then hold
    while the graph is traced."""
    modes = [m for m in _get_current_function_mode_stack()
             if isinstance(m, LetsFlexModulesThrough)]
    for mode in modes:
        mode.flex_modules += 1
    try:
        yield
    finally:
        for mode in modes:
            mode.flex_modules -= 1
