"""Ulysses attention (DeepSpeed-Ulysses): an all-to-all trades each rank's
sequence shard for a head shard, every rank runs ordinary attention over the
whole sequence on its heads, and a second all-to-all trades back.

Fake kernels and autograd of the ``cplib_c::ulysses_*`` ops
(csrc/torch/ulysses/) and the Python entry points ``ulysses_reshard`` and
``ulysses_sdpa``; ``usp_sdpa`` composes Ulysses with the ring (USP).
"""

from __future__ import annotations


import torch

from ..comm.handshake import agreed, can_handshake, forward_error, handshake
from ..comm.native import GroupLike, group_name_of, group_size, ops, reject_real_in_fake
from ..ring.op import (_acc_dtype, _check, _group_rank, attention_autograd, backend_arg,
                    check_inputs, check_sinks, ring_sdpa, rotate_arg, scale_arg)

__all__ = ["ulysses_reshard", "ulysses_sdpa", "usp_sdpa", "kv_head_repeat", "check_heads",
           "ulysses_attention", "usp_attention"]


# ---------------------------------------------------------------- layout rules


def check_heads(op: str, hq: int, hkv: int, degree: int) -> None:
    """ValueError (from shapes alone, so on every rank alike) unless ``hq``
    query heads and ``hkv`` key/value heads can be split over ``degree``
    Ulysses ranks."""
    if degree < 1:
        raise ValueError(f"cplib.{op}: the Ulysses degree must be >= 1, got {degree}")
    if hkv < 1 or hq % hkv:
        raise ValueError(f"cplib.{op}: q has {hq} heads, which is not a multiple of k/v's "
                         f"{hkv} heads")
    if hq % degree:
        raise ValueError(f"cplib.{op}: {hq} query heads cannot be split over the Ulysses "
                         f"degree {degree} (the head count must be a multiple of it)")
    if hkv % degree and degree % hkv:
        raise ValueError(f"cplib.{op}: {hkv} key/value heads cannot be split over the Ulysses "
                         f"degree {degree} (the degree must divide the head count or be a "
                         "multiple of it)")


def kv_head_repeat(hkv: int, degree: int) -> int:
    """How often each K/V head is repeated for the exchange: 1 when the heads
    split evenly, else up to one head per rank (never up to q's heads)."""
    return 1 if hkv % degree == 0 else degree // hkv


@torch.compiler.assume_constant_result
def _degree(group_name: str) -> int:
    # The group's size, a constant of any compiled region (dynamo cannot trace
    # the name lookup itself).
    return group_size(group_name)


def _strides(sizes: tuple[int, ...], order: tuple[int, ...]) -> tuple[int, ...]:
    """Strides of a dense tensor of ``sizes`` whose memory runs over dims ``order``
    (outermost first)."""
    strides = [0] * len(sizes)
    stride = 1
    for d in reversed(order):
        strides[d] = stride
        stride *= sizes[d]
    return tuple(strides)


_SEQ_MAJOR = (2, 0, 1, 3)   # (S, B, H, D)
_HEAD_MAJOR = (1, 0, 2, 3)  # (H, B, S, D)
_BSHD = (0, 2, 1, 3)        # (B, S, H, D)


# ---------------------------------------------------------------- reshard op


def _reshard_shape(op: str, x: torch.Tensor, n: int, to_heads: bool, repeat: int,
                   lengths=None, rank: int | None = None) -> tuple:
    # Mirrors check() in csrc/torch/ulysses/ulysses_reshard.cpp.
    direction = "seq -> heads" if to_heads else "heads -> seq"
    if x.dim() != 4:
        raise ValueError(f"cplib.{op} ({direction}): expected a (B, H, S, D) tensor, got shape "
                         f"{tuple(x.shape)}")
    if x.device.type not in ("cpu", "cuda", "meta"):
        raise ValueError(f"cplib.{op} ({direction}): unsupported device {x.device}")
    if repeat < 1:
        raise ValueError(f"cplib.{op} ({direction}): head_repeat={repeat} must be >= 1")
    b, h, s, d = x.shape
    if lengths is not None:
        lengths = list(lengths)
        if len(lengths) != n:
            raise ValueError(f"cplib.{op} ({direction}): lengths has {len(lengths)} entries for "
                             f"{n} ranks")
        if any(length <= 0 for length in lengths):
            raise ValueError(f"cplib.{op} ({direction}): lengths must be positive, got "
                             f"{lengths}")
        if not to_heads and sum(lengths) != s:
            raise ValueError(f"cplib.{op} ({direction}): lengths sum to {sum(lengths)} but the "
                             f"sequence has {s} rows")
    if to_heads:
        if (h * repeat) % n:
            rep = f" (repeated {repeat}x)" if repeat > 1 else ""
            raise ValueError(f"cplib.{op} ({direction}): {h} heads{rep} cannot be split over "
                             f"the Ulysses degree {n}")
        if repeat != 1 and h * repeat != n:
            raise ValueError(f"cplib.{op} ({direction}): head_repeat={repeat} must bring the "
                             f"{h} heads to exactly the Ulysses degree {n}")
        if lengths is not None and rank is not None and lengths[rank] != s:
            raise ValueError(f"cplib.{op} ({direction}): lengths[{rank}] = {lengths[rank]} but "
                             f"this rank holds {s} rows")
        total = s * n if lengths is None else sum(lengths)
        return (b, h * repeat // n, total, d), _SEQ_MAJOR
    if lengths is None and s % n:
        raise ValueError(f"cplib.{op} ({direction}): sequence length {s} cannot be split over "
                         f"the Ulysses degree {n}")
    if repeat != 1 and (h != 1 or n % repeat):
        raise ValueError(f"cplib.{op} ({direction}): head_repeat={repeat} needs one head per "
                         f"rank (got {h}) and to divide the Ulysses degree {n}")
    local = s // n if lengths is None else lengths[rank]
    return (b, h * n // repeat, local, d), _HEAD_MAJOR


@torch.library.register_fake("cplib_c::ulysses_reshard")
def _reshard_fake(x, group_name, to_heads, head_repeat, lengths=None):
    reject_real_in_fake("ulysses_reshard", x)
    sizes, order = _reshard_shape("ulysses_reshard", x, group_size(group_name), to_heads,
                                  head_repeat, lengths, _group_rank(group_name))
    return x.new_empty_strided(sizes, _strides(sizes, order))


def _reshard_setup(ctx, inputs, output):
    _, ctx.group_name, ctx.to_heads, ctx.head_repeat, *rest = inputs
    ctx.lengths = rest[0] if rest else None


def _reshard_backward(ctx, grad):
    # The adjoint of an exchange is the exchange back; with repeated heads the
    # way back sums the copies of each head.
    return ops.ulysses_reshard(grad, ctx.group_name, not ctx.to_heads, ctx.head_repeat,
                               ctx.lengths), None, None, None, None


torch.library.register_autograd("cplib_c::ulysses_reshard", _reshard_backward,
                                setup_context=_reshard_setup)


@torch.library.register_fake("cplib_c::ulysses_reshard_qkv")
def _reshard_qkv_fake(q, k, v, group_name, to_heads, kv_head_repeat, lengths=None):
    n, rank = group_size(group_name), _group_rank(group_name)
    out = []
    for x, repeat in ((q, 1), (k, kv_head_repeat), (v, kv_head_repeat)):
        sizes, order = _reshard_shape("ulysses_reshard_qkv", x, n, to_heads, repeat, lengths,
                                      rank)
        out.append(x.new_empty_strided(sizes, _strides(sizes, order)))
    return tuple(out)


def _reshard_qkv_setup(ctx, inputs, output):
    _, _, _, ctx.group_name, ctx.to_heads, ctx.repeat, *rest = inputs
    ctx.lengths = rest[0] if rest else None
    ctx.outputs = [(o.shape, o.dtype, o.device) for o in output]


def _reshard_qkv_backward(ctx, gq, gk, gv):
    # An output without a gradient still takes part in the exchange back.
    grads = [torch.zeros(shape, dtype=dtype, device=device) if g is None else g
             for g, (shape, dtype, device) in zip((gq, gk, gv), ctx.outputs)]
    dq, dk, dv = ops.ulysses_reshard_qkv(*grads, ctx.group_name, not ctx.to_heads, ctx.repeat,
                                         ctx.lengths)
    return dq, dk, dv, None, None, None, None


torch.library.register_autograd("cplib_c::ulysses_reshard_qkv", _reshard_qkv_backward,
                                setup_context=_reshard_qkv_setup)


def ulysses_reshard(x: torch.Tensor, group: GroupLike, *, to_heads: bool,
                    head_repeat: int = 1, lengths: list[int] | None = None) -> torch.Tensor:
    """Re-shards ``x`` over ``group`` (N ranks), differentiably.

    ``to_heads=True``: ``x`` (B, H, S/N, D) is this rank's sequence shard (rank
    order); returns (B, H*head_repeat/N, S, D), this rank's heads over the
    whole sequence. ``to_heads=False`` is the inverse (with ``head_repeat > 1``
    it sums the repeated copies of each head). ``head_repeat > 1`` only brings
    fewer heads than ranks to one head per rank (H*head_repeat == N).
    The result is a fresh tensor in the order the exchange delivers it:
    sequence-major strides for ``to_heads``, head-major otherwise.
    ``lengths`` (every rank's sequence length, rank order) lets the ranks
    hold different lengths; S is then their sum.
    """
    name = group_name_of(group)

    def check():
        check_inputs("ulysses_reshard", x=x)
        if isinstance(head_repeat, bool) or not isinstance(head_repeat, int):
            raise ValueError(f"cplib.ulysses_reshard: head_repeat must be an int, got "
                             f"{head_repeat!r}")
        return None if lengths is None else [int(n) for n in lengths]

    sizes = agreed("ulysses_reshard", name, (x,), check)
    return ops.ulysses_reshard(x, name, bool(to_heads), head_repeat, sizes)


# ---------------------------------------------------------------- local attention op


def _check_local(op: str, q, k, v, is_causal, scale, backend) -> None:
    # ring_sdpa's checks minus the ring's (rotation, load balance, group).
    _check(op, q, k, v, None, is_causal, False, scale, backend, 0)


@torch.library.register_fake("cplib_c::ulysses_local_sdpa")
def _local_fake(q, k, v, is_causal, scale, backend, sinks=None):
    reject_real_in_fake("ulysses_local_sdpa", q, k, v, sinks)
    _check_local("ulysses_local_sdpa", q, k, v, is_causal, scale, backend)
    check_sinks("ulysses_local_sdpa", q, sinks)
    b, h, s, _ = q.shape
    sizes = (b, h, s, v.shape[3])
    out = q.new_empty_strided(sizes, _strides(sizes, _SEQ_MAJOR))
    lse = q.new_empty((b, h, s), dtype=_acc_dtype(q.dtype))
    return out, lse


@torch.library.register_fake("cplib_c::ulysses_local_sdpa_backward")
def _local_backward_fake(grad_out, q, k, v, out, lse, is_causal, scale, backend):
    reject_real_in_fake("ulysses_local_sdpa_backward", grad_out, q, k, v, out, lse)
    _check_local("ulysses_local_sdpa_backward", q, k, v, is_causal, scale, backend)
    return tuple(t.new_empty_strided(t.shape, _strides(tuple(t.shape), _BSHD)) for t in (q, k, v))


_local_setup, _local_backward = attention_autograd(ops.ulysses_local_sdpa_backward,
                                                   ops.ulysses_local_sdpa)
torch.library.register_autograd("cplib_c::ulysses_local_sdpa", _local_backward,
                                setup_context=_local_setup)


# ---------------------------------------------------------------- entry points


def _check_qkv(op: str, q, k, v) -> None:
    check_inputs(op, q=q, k=k, v=v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"cplib.{op}: expected q, k, v of shape (B, H, S_local, D); {name} "
                             f"is {shape}")


_self: dict[int, str] = {}


@torch.compiler.assume_constant_result
def _self_group() -> str:
    """A group of this process alone (made once, by this process only): the
    ring of one that runs pure Ulysses's masked attention."""
    import torch.distributed as dist

    me = dist.get_rank()
    if me not in _self:
        _self[me] = dist.new_group([me], use_local_synchronization=True).group_name
    return _self[me]


def uneven_lengths(op: str, q: torch.Tensor, name: str, degree: int,
                   is_causal: bool) -> list[int] | None:
    """Every rank's local length when they differ (non-causal joint text+image
    shards), else None. Learned in a handshake, so that a rank whose own
    checks failed meets the others there; causal calls skip it (a causal mask
    needs global positions: their reshard's handshake names differing
    lengths). While compiling, the lengths are taken to be equal (a traced
    graph cannot depend on exchanged values)."""
    if degree == 1 or is_causal or torch.compiler.is_compiling():
        return None
    from torch._subclasses.fake_tensor import is_fake
    if q.device.type == "meta" or is_fake(q):
        return None
    if can_handshake(name):
        table = handshake(name, op, fields={"local lengths (learned)": 0},
                          lengths=[q.shape[2]])
        lengths = [row[0] for row in table]
    else:
        lengths = list(ops.gather_local_lengths([q.shape[2]], name, q.device))
    return None if len(set(lengths)) == 1 else lengths


def _to_heads(q, k, v, group_name: str, degree: int, lengths=None):
    # One op for the three exchanges, all in flight at once.
    return ops.ulysses_reshard_qkv(q, k, v, group_name, True, kv_head_repeat(k.shape[1], degree),
                                   lengths)


@torch.compiler.assume_constant_result
def _rank_in(group_name: str) -> int:
    # This process's rank in the group, a constant of any compiled region.
    return _group_rank(group_name)


def _local_sinks(op: str, q, sinks, group_name: str, degree: int):
    """The sinks of this rank's heads after the exchange to heads (rank r of
    the Ulysses group holds q heads [r Hq/U, (r+1) Hq/U)); differentiable."""
    if sinks is None:
        return None
    check_sinks(op, q, sinks)
    h = q.shape[1] // degree
    return sinks.narrow(0, _rank_in(group_name) * h, h)


def _to_seq(out_h, lse_h, group_name: str, lengths=None, need_lse: bool = True):
    out = ops.ulysses_reshard(out_h, group_name, False, 1, lengths)
    if not need_lse:  # SDPA inside a context discards it: one exchange fewer
        return out, None
    # lse as ring_sdpa returns it: contiguous (B, H, S_local), not differentiable.
    lse = ops.ulysses_reshard(lse_h.unsqueeze(-1), group_name, False, 1, lengths).squeeze(-1)
    return out, lse.contiguous()


def ulysses_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: GroupLike,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    backend: str | None = None,
    sinks: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    window: int | tuple[int | None, int | None] | None = None,
    seq_len: int | None = None,
    attn_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ulysses attention of the local sequence shards ``q`` (B, Hq, S/N, D) and
    ``k``/``v`` (B, Hkv, S/N, D), in rank order, over ``group`` (a ProcessGroup
    or its name, N ranks).

    Returns ``(out, lse)`` as :func:`cplib.ring_sdpa` does: ``out`` (B, Hq, S/N,
    D_v) in q's dtype, ``lse`` (B, Hq, S/N) contiguous, float32 (float64 for
    float64 inputs). Differentiable in q, k and v (not through ``lse``).
    Hq must be a multiple of N; K/V heads either split over N or, when fewer
    than N, are repeated to one head per rank (never to Hq). Heads that cannot
    be split raise ValueError before any communication. v's head dim may
    differ from q/k's (MLA); ``sinks`` (Hq,) as in :func:`cplib.ring_sdpa`.

    ``cu_seqlens``, ``window`` and ``seq_len`` (any S >= N: rank r holds
    ``chunk_range(S, N, r)``) mean what they mean for
    :func:`cplib.ring_sdpa`; the attention over the whole sequence is then
    the ring's masked kernel on a ring of one rank.

    ``attn_mask``: a key-padding mask of this rank's keys (see
    :func:`cplib.ring_sdpa`), exchanged with the keys. Ranks may hold
    different lengths when not causal (learned in a handshake).
    """
    return ulysses_attention(q, k, v, group, is_causal, scale, backend, attn_mask, True, sinks,
                             cu_seqlens, window, seq_len)


def ulysses_attention(q, k, v, group: GroupLike, is_causal: bool, scale: float | None,
                      backend: str | None, attn_mask, need_lse: bool, sinks=None,
                      cu_seqlens=None, window=None, seq_len=None):
    """:func:`ulysses_sdpa`; without ``need_lse`` the lse is not exchanged
    back (None)."""
    op = "ulysses_sdpa"
    if attn_mask is not None:
        from ..ring.key_padding import key_padding_inputs

        q, k, v, scale, _ = key_padding_inputs(op, attn_mask, q, k, v, scale)
    if cu_seqlens is not None or window is not None or seq_len is not None:
        return usp_attention(q, k, v, group, _self_group(), is_causal, False, scale, "p2p",
                             backend, None, need_lse, sinks, cu_seqlens, window, seq_len)
    name = group_name_of(group)

    def args():
        _check_qkv(op, q, k, v)
        degree = _degree(name)
        check_heads(op, q.shape[1], k.shape[1], degree)
        scale_ = scale_arg(op, scale)
        code = backend_arg(op, backend)
        _check_local(op, q, k, v, is_causal, scale_, code)
        return degree, scale_, code, _local_sinks(op, q, sinks, name, degree)

    degree, scale, code, local_sinks = agreed(op, name, (q, k, v), args)
    lengths = uneven_lengths(op, q, name, degree, is_causal)
    qh, kh, vh = _to_heads(q, k, v, name, degree, lengths)
    out_h, lse_h = ops.ulysses_local_sdpa(qh, kh, vh, bool(is_causal), scale, code, local_sinks)
    return _to_seq(out_h, lse_h, name, lengths, need_lse)


@torch.compiler.assume_constant_result
def _shared_ranks(uname: str, rname: str) -> int:
    """How many ranks the two groups share (-1: groups torch cannot list); a
    constant of any compiled region, like _degree."""
    try:
        c10d = torch.distributed.distributed_c10d
        ur, rr = (c10d.get_process_group_ranks(c10d._resolve_process_group(name))
                  for name in (uname, rname))
    except Exception:  # the ops check what they can
        return -1
    return len(set(ur) & set(rr))


def _check_usp_groups(op: str, uname: str, rname: str) -> None:
    """The Ulysses and ring groups of one rank meet in that rank only (they
    span the U x R grid); the same group twice would attend each shard twice."""
    shared = _shared_ranks(uname, rname)
    if shared == -1 and uname == rname and _degree(uname) > 1:
        shared = _degree(uname)
    if shared > 1:
        raise ValueError(f"cplib.{op}: ulysses_group '{uname}' and ring_group '{rname}' share "
                         f"{shared} ranks; they must meet in this rank only (the two dimensions "
                         "of a U x R grid, see cplib.usp_groups)")


def usp_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ulysses_group: GroupLike,
    ring_group: GroupLike,
    *,
    is_causal: bool = False,
    load_balanced: bool = False,
    scale: float | None = None,
    rotate: str = "p2p",
    backend: str | None = None,
    sinks: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    window: int | tuple[int | None, int | None] | None = None,
    seq_len: int | None = None,
    per_document: bool = False,
    attn_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """USP: Ulysses over ``ulysses_group`` (U ranks) around ring attention over
    ``ring_group`` (R ranks). The shards are this rank's part of the layout
    that :mod:`cplib.ulysses.usp_layout` defines: the ring shard of this rank's Ulysses group
    (head-tail over the R ring positions with ``load_balanced``), cut into U
    pieces in Ulysses-rank order. Same returns and errors as
    :func:`ulysses_sdpa`, plus ring_sdpa's (``rotate``, ``load_balanced``);
    ``sinks`` and MLA head dims as in :func:`ulysses_sdpa`.

    ``cu_seqlens``, ``window``, ``seq_len`` and ``per_document`` mean what they
    mean for :func:`cplib.ring_sdpa`, in global positions; the ring sees the
    ring shards the Ulysses exchange assembles, so it skips the same empty
    blocks. With ``seq_len`` (any S >= N) or ``per_document`` the pieces of a
    ring shard may differ by a row (``cplib.usp_load_balancer``); they travel
    padded to one length and the padding never reaches the attention.
    ``attn_mask`` as in :func:`ulysses_sdpa`; without a mask, documents or
    windows the ranks may hold different lengths when not causal."""
    return usp_attention(q, k, v, ulysses_group, ring_group, is_causal, load_balanced, scale,
                         rotate, backend, attn_mask, True, sinks, cu_seqlens, window, seq_len,
                         per_document)


def usp_attention(q, k, v, ulysses_group: GroupLike, ring_group: GroupLike, is_causal: bool,
                  load_balanced: bool, scale: float | None, rotate: str, backend: str | None,
                  attn_mask, need_lse: bool, sinks=None, cu_seqlens=None, window=None,
                  seq_len=None, per_document=False):
    """:func:`usp_sdpa`; without ``need_lse`` the lse is not exchanged back
    (None)."""
    op = "usp_sdpa"
    if attn_mask is not None:
        from ..ring.key_padding import key_padding_inputs

        q, k, v, scale, _ = key_padding_inputs(op, attn_mask, q, k, v, scale)
    uname, rname = group_name_of(ulysses_group), group_name_of(ring_group)
    masked = dict(cu_seqlens=cu_seqlens, window=window, seq_len=seq_len,
                  per_document=bool(per_document))
    even = cu_seqlens is None and window is None and seq_len is None and not per_document

    def args():
        _check_qkv(op, q, k, v)
        degree = _degree(uname)
        check_heads(op, q.shape[1], k.shape[1], degree)
        rotate_arg(op, rotate)
        scale_ = scale_arg(op, scale)
        code = backend_arg(op, backend)
        _check_local(op, q, k, v, is_causal, scale_, code)
        ring_degree = _degree(rname)  # ValueError for an unknown ring group, before any exchange
        _check_usp_groups(op, uname, rname)
        if even:
            if load_balanced and (q.shape[2] * degree) % 2:
                raise ValueError(f"cplib.{op}: load_balanced needs an even ring shard, got "
                                 f"{q.shape[2]} x {degree} rows")
            lengths = [q.shape[2]] * degree
        else:
            lengths = _piece_lengths(op, q, k, uname, rname, degree, ring_degree, load_balanced,
                                     **masked)
        return degree, scale_, lengths, _local_sinks(op, q, sinks, uname, degree)

    def to_heads():
        degree, scale_, lengths, local_sinks = agreed(op, uname, (q, k, v), args)
        # Joint streams (no layout): the exchange itself takes ranks of
        # different lengths, and so does the ring after it.
        sizes = uneven_lengths(op, q, uname, degree, is_causal) if even else None
        keep = _real_rows(lengths, q.device)
        # Uneven pieces of a layout travel padded to one length; the ring sees
        # exactly its shard.
        padded = (q, k, v) if keep is None else _pad_rows((q, k, v), max(lengths))
        heads = _to_heads(*padded, uname, degree, sizes)
        if keep is not None:
            heads = tuple(t.index_select(2, keep) for t in heads)
        return scale_, degree, lengths, sizes, keep, local_sinks, heads

    if torch.compiler.is_compiling():
        scale, degree, lengths, sizes, keep, local_sinks, (qh, kh, vh) = to_heads()
    else:
        # Errors travel in the Ulysses group's handshake and then in the ring
        # group's, where the other Ulysses groups' ranks wait for this one.
        try:
            scale, degree, lengths, sizes, keep, local_sinks, (qh, kh, vh) = to_heads()
        except Exception as exc:
            forward_error(op, rname, exc)
            raise
    mine = q.shape[2]
    out_h, lse_h = ring_sdpa(qh, kh, vh, rname, is_causal=is_causal, load_balanced=load_balanced,
                             scale=scale, rotate=rotate, backend=backend, sinks=local_sinks,
                             **masked)
    if keep is not None:
        rows = max(lengths) * degree
        out_h = out_h.new_zeros(out_h.shape[:2] + (rows, out_h.shape[3])).index_copy(
            2, keep, out_h)
        lse_h = lse_h.new_zeros(lse_h.shape[:2] + (rows,)).index_copy(2, keep, lse_h)
    out, lse = _to_seq(out_h, lse_h, uname, sizes, need_lse)
    if out.shape[2] != mine:
        out = out.narrow(2, 0, mine)
        lse = None if lse is None else lse.narrow(2, 0, mine).contiguous()
    return out, lse


# ---------------------------------------------------------------- uneven pieces (USP layout)


def _piece_lengths(op: str, q, k, uname: str, rname: str, degree: int, ring_degree: int,
                   load_balanced: bool, cu_seqlens, window, seq_len, per_document) -> list[int]:
    """The rows of the U pieces of this rank's ring shard (cplib.ulysses.usp_layout's
    layout), checked against q and k/v (from shapes and arguments alone, so
    every rank fails alike before any exchange)."""
    from ..ring.op import check_cu_seqlens, window_arg
    from .usp_layout import usp_piece_lengths

    n = degree * ring_degree
    total = q.shape[2] * n if seq_len is None else int(seq_len)
    if total < n:
        raise ValueError(f"cplib.{op}: seq_len={seq_len} is shorter than the world size {n} "
                         "(every rank needs a token)")
    if per_document and (cu_seqlens is None or seq_len is None):
        raise ValueError(f"cplib.{op}: per_document=True (head-tail inside every document) "
                         "needs cu_seqlens and seq_len")
    if cu_seqlens is not None and not torch.compiler.is_compiling():
        check_cu_seqlens(op, cu_seqlens, total)  # traced: the ring's fake kernel checks it
    window_arg(window)
    docs = _documents(cu_seqlens) if per_document else None
    lengths = usp_piece_lengths(total, ring_degree, degree, _rank_in(rname),
                                bool(load_balanced or per_document), docs)
    mine = lengths[_rank_in(uname)]
    if q.shape[2] != mine or k.shape[2] != mine or min(lengths) < 1:
        layout = ("per-document head-tail" if per_document
                  else "head-tail" if load_balanced else "sequential")
        raise ValueError(f"cplib.{op}: seq_len={total} over {ring_degree} ring positions x "
                         f"{degree} Ulysses ranks ({layout} layout) gives this Ulysses group "
                         f"pieces of {lengths} rows, but q has {q.shape[2]} and k/v "
                         f"{k.shape[2]}")
    return lengths


@torch.compiler.assume_constant_result
def _documents(cu_seqlens: torch.Tensor) -> list[int]:
    # The document boundaries, a constant of any compiled region (the layout
    # depends on them, as the shapes do).
    return cu_seqlens.tolist()


def _pad_rows(ts, rows: int):
    return tuple(t if t.shape[2] == rows else
                 torch.cat([t, t.new_zeros(t.shape[:2] + (rows - t.shape[2], t.shape[3]))], 2)
                 for t in ts)


def _real_rows(lengths: list[int], device) -> torch.Tensor | None:
    """Rows of the exchanged (padded) ring shard that hold tokens, or None
    when no piece was padded."""
    rows = max(lengths)
    if all(n == rows for n in lengths):
        return None
    return torch.cat([torch.arange(j * rows, j * rows + n, device=device)
                      for j, n in enumerate(lengths)])
