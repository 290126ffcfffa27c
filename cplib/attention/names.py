"""The names of the attention ops' choices, as the native layer defines them
(csrc/torch/ring/ring_call.h, read once through ``cplib_c::ring_choices``):
the rotations, the sequence layouts, the CUDA block backends and the ring
passes. Everything in cplib that names one of them takes it from here: the
layout is one vocabulary, :class:`Layout`, from the load balancers to the C++
op (the public booleans ``load_balanced`` / ``per_document`` /
``placement`` are read into it by :func:`layout_of`)."""

from __future__ import annotations

import enum

from ..comm.native import ops

__all__ = ["ROTATIONS", "LAYOUTS", "BACKENDS", "RING_PASSES", "Layout", "DOCUMENT_LAYOUTS",
           "layout_of", "layout_words"]


def _choices() -> dict[str, tuple[str, ...]]:
    return {key: tuple(names.split(","))
            for key, names in (part.split("=") for part in ops.ring_choices().split(";"))}


_NAMES = _choices()
# How K/V travel: "p2p" (a neighbour exchange of batched send/recv per step),
# "alltoall" (a split all-to-all per step that every rank joins, torch's
# rotation), "allgather" (one gather up front).
ROTATIONS: tuple[str, ...] = _NAMES["rotate"]
LAYOUTS: tuple[str, ...] = _NAMES["layout"]
# The CUDA block kernels: "auto" (chosen as SDPA would), "flash", "efficient", "cudnn".
BACKENDS: tuple[str, ...] = _NAMES["backend"]
# What travels: "kv", "q" (forward only) or "auto" (the one that moves fewer bytes).
RING_PASSES: tuple[str, ...] = _NAMES["ring_pass"]

# Where every rank's rows sit in the global sequence: ``Layout.SEQUENTIAL``
# (rank r holds chunk r of N), ``HEAD_TAIL`` (chunks r and 2N-1-r of 2N),
# ``PER_DOCUMENT`` (those chunks of every document) and ``PLACEMENT`` (the
# document placement); each member is its name ("head_tail", ...).
Layout = enum.StrEnum("Layout", [(name.upper(), name) for name in LAYOUTS], module=__name__)
# The layouts cut by the documents (they need cu_seqlens).
DOCUMENT_LAYOUTS = (Layout.PER_DOCUMENT, Layout.PLACEMENT)
# Each layout in the words of the errors.
_WORDS = {Layout.SEQUENTIAL: "sequential", Layout.HEAD_TAIL: "head-tail",
          Layout.PER_DOCUMENT: "per-document head-tail", Layout.PLACEMENT: "document placement"}


def layout_of(op: str, load_balanced: bool = False, per_document: bool = False,
              placement: bool = False) -> Layout:
    """The layout the public keywords name: ``placement`` or ``per_document``
    (one of them), else head-tail with ``load_balanced``, else sequential."""
    if per_document and placement:
        raise ValueError(f"cplib.{op}: per_document and placement are two layouts; pass one")
    if placement:
        return Layout.PLACEMENT
    if per_document:
        return Layout.PER_DOCUMENT
    return Layout.HEAD_TAIL if load_balanced else Layout.SEQUENTIAL


def layout_words(layout: Layout) -> str:
    """``layout`` as the errors name it ("head-tail", "document placement")."""
    return _WORDS[Layout(layout)]
