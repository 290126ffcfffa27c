"""What transformers' mask function for a layer says, as cplib reads it.

transformers builds every mask from a *mask function* (causal, a sliding
window, chunks, padding, packed documents, and compositions of them with
``and_masks``/``or_masks``; a model may add its own: image tokens that see
each other, a prefix). ``attn_implementation="cplib"`` builds no mask: its
attention derives causal, windows and documents from the layer's call and
the positions. So a mask function with a part cplib does not know (the
model's own) would be dropped: under context parallelism that raises,
naming the family and the part; in one process ``cplib_mask`` hands the
layer eager's mask instead, which the attention then takes as it is.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["unknown_part"]

# The parts cplib's attention carries itself: causal or not from the layer,
# windows and chunks from the layer's sliding_window (the families whose
# layers pass none are refused: family_verdicts.py), padding from the 2-D
# mask, packed documents from the positions.
_KNOWN = frozenset({"causal_mask_function", "bidirectional_mask_function",
                    "sliding_window_overlay", "sliding_window_bidirectional_overlay",
                    "chunked_overlay", "padding_mask_function", "packed_sequence_mask_function"})


def _parts(fn: Callable) -> list[Callable]:
    """The functions ``fn`` composes (and_masks, or_masks, offsets), itself
    where it composes none."""
    code, closure = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in closure))) \
        if code is not None and closure else {}
    if isinstance(cells.get("mask_functions"), tuple):
        return [p for f in cells["mask_functions"] for p in _parts(f)]
    if callable(cells.get("mask_function")):
        return _parts(cells["mask_function"])
    return [fn]


def unknown_part(mask_function: Any) -> str | None:
    """The name of a part of ``mask_function`` that cplib does not carry
    (None: it carries every part, or there is no mask function)."""
    if mask_function is None:
        return None
    for part in _parts(mask_function):
        name = getattr(part, "__qualname__", repr(part)).split(".<locals>")[0]
        if name not in _KNOWN:
            return name
    return None
