"""USP (Ulysses x ring): ``usp_sdpa`` and the attention it runs inside a
context: Ulysses's all-to-all within groups of U ranks, then ring attention
across them on the ring shards the exchange assembles (the layout is
cplib/ulysses/usp_layout.py's)."""

from __future__ import annotations

import torch

from ..attention.args import backend_arg, check_cu_seqlens, scale_arg, window_arg
from ..attention.names import layout_of, layout_words
from ..comm.handshake import agreed, forward_error
from ..comm.native import GroupLike, group_name_of
from ..ring.args import rotate_arg
from ..ring.op import ring_sdpa
from .args import (_check_local, _check_qkv, _degree, _local_sinks, _rank_in, _to_seq,
                   check_heads, exchange_to_heads)

__all__ = ["usp_sdpa", "usp_attention"]


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


def _check_both_groups(op: str, ulysses_group, ring_group) -> None:
    """ValueError for a missing group: ``usp_groups`` gives None for the ring
    group when the Ulysses degree is the world size, and for the Ulysses
    group when it is 1 (the same on every rank)."""
    missing = (("ulysses_group", ulysses_group, "the Ulysses degree is 1",
                "cplib.ring_sdpa over ring_group"),
               ("ring_group", ring_group, "the Ulysses degree is the world size",
                "cplib.ulysses_sdpa over ulysses_group"))
    for name, group, when, instead in missing:
        if group is None:
            raise ValueError(f"cplib.{op}: {name} is None (usp_groups gives None there when "
                             f"{when}): that is not USP; call {instead}")


def usp_attention(q, k, v, ulysses_group: GroupLike, ring_group: GroupLike, is_causal: bool,
                  load_balanced: bool, scale: float | None, rotate: str, backend: str | None,
                  attn_mask, need_lse: bool, sinks=None, cu_seqlens=None, window=None,
                  seq_len=None, per_document=False):
    """:func:`usp_sdpa`; without ``need_lse`` the lse is not exchanged back
    (None)."""
    op = "usp_sdpa"
    _check_both_groups(op, ulysses_group, ring_group)
    uname, rname = group_name_of(ulysses_group), group_name_of(ring_group)
    if attn_mask is not None:
        from ..attention.key_padding import key_padding_inputs

        # A rejected mask travels as the errors of to_heads() below do.
        try:
            q, k, v, scale, _ = agreed(op, uname, (q, k, v, attn_mask),
                                       lambda: key_padding_inputs(op, attn_mask, q, k, v, scale))
        except Exception as exc:
            if not torch.compiler.is_compiling():
                forward_error(op, rname, exc)
            raise
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
        # different lengths (learned in its one handshake), and so does the
        # ring after it.
        keep = _real_rows(lengths, q.device)
        # Uneven pieces of a layout travel padded to one length; the ring sees
        # exactly its shard.
        padded = (q, k, v) if keep is None else _pad_rows((q, k, v), max(lengths))
        sizes, heads = exchange_to_heads(op, *padded, uname, degree, even and not is_causal)
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


def _piece_lengths(op: str, q, k, uname: str, rname: str, degree: int, ring_degree: int,
                   load_balanced: bool, cu_seqlens, window, seq_len, per_document) -> list[int]:
    """The rows of the U pieces of this rank's ring shard (cplib.ulysses.usp_layout's
    layout), checked against q and k/v (from shapes and arguments alone, so
    every rank fails alike before any exchange)."""
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
        layout = layout_words(layout_of(op, load_balanced, per_document))
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
