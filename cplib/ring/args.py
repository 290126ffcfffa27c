"""The ring's own argument checks, in Python before dispatch (the same
checks, in the same order, as csrc/torch/ring/ring_args.cpp): the rotation's
name and the layout of the global sequence (its length, the documents, each
rank's rows). The checks every attention feature shares are in
cplib/attention/args.py."""

from __future__ import annotations

from ..attention.args import check_cu_seqlens, group_rank, is_fake
from ..attention.layout import local_length
from ..attention.names import DOCUMENT_LAYOUTS, ROTATIONS, Layout, layout_words
from ..comm.native import group_size

__all__ = ["check_extras", "rotate_arg"]


def check_extras(op: str, q, k, call) -> None:
    # In the order of check_extras in csrc/torch/ring/ring_args.cpp.
    group_name, cu_seqlens, seq_len, layout = (call.group_name, call.cu_seqlens, call.seq_len,
                                               call.layout)
    n = group_size(group_name)
    lq, lk = q.shape[2], k.shape[2]
    sq, sk = lq * n, lk * n
    if seq_len is not None:
        if seq_len < n:
            raise ValueError(f"cplib.{op}: seq_len={seq_len} is shorter than the world size {n} "
                             "(every rank needs a token)")
        sq = sk = seq_len
    if (cu_seqlens is not None or call.window is not None) and sq != sk:
        raise ValueError(f"cplib.{op}: cu_seqlens and window need q and k/v of one global "
                         f"length, got q {sq} and kv {sk}")
    documented = layout in DOCUMENT_LAYOUTS
    if documented and (cu_seqlens is None or seq_len is None):
        what = ("per_document=True (head-tail inside every document)"
                if layout == Layout.PER_DOCUMENT
                else "placement=True (documents placed across the ranks)")
        raise ValueError(f"cplib.{op}: {what} needs cu_seqlens and seq_len")
    if cu_seqlens is not None:
        check_cu_seqlens(op, cu_seqlens, sq)
    rank = group_rank(group_name)
    if seq_len is not None and rank is not None:
        docs = None
        if layout == Layout.PER_DOCUMENT:
            docs = None if is_fake(cu_seqlens) else cu_seqlens.tolist()
        if layout != Layout.PER_DOCUMENT or docs is not None:
            # The placement gives every rank its sequential share of tokens.
            want = local_length(seq_len, n, rank, layout == Layout.HEAD_TAIL, docs)
            if lq != want or lk != want:
                raise ValueError(f"cplib.{op}: seq_len={seq_len} over {n} ranks "
                                 f"({layout_words(layout)} layout) gives rank {rank} {want} "
                                 f"rows, but q has {lq} and k/v {lk}")
    window = call.window
    if window is not None:
        w = list(window)
        if len(w) != 2:
            raise ValueError(f"cplib.{op}: window must be (left, right), got {w}")
        if w[0] < 0 or w[1] < 0:
            raise ValueError(f"cplib.{op}: window={w} must be non-negative (None for no limit)")


def rotate_arg(op: str, rotate) -> str:
    if not isinstance(rotate, str) or rotate not in ROTATIONS:
        raise ValueError(f"cplib.{op}: rotate={rotate!r} is not one of {list(ROTATIONS)}")
    return rotate
