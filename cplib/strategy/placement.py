"""The document placement as a candidate (issue 36's
``DocumentPlacementLoadBalancer``: short documents whole on one rank, only
the rows of documents that span ranks exchanged), added through the
registry's hooks: a layout the ring runs (``placement=True``, sharded by
``context_parallel(load_balance="placement")``, ring only) and a source that
yields the ring with each rotation on it where the call has documents and
its layout is still free (or is the placement already). The ring family
costs it as any layout: the ring's own plan for it (cplib/strategy/plan.py)
shows the blocks nobody needs and the rows that travel."""

from __future__ import annotations

from typing import Iterable

from ..attention.names import Layout
from .candidates import ROTATIONS, Candidate, register_candidates
from .plan import register_layout
from .workload import Workload

__all__ = ["PLACEMENT"]

PLACEMENT = str(Layout.PLACEMENT)


def _placement(w: Workload) -> Iterable[Candidate]:
    if w.documents is None or len(w.documents) <= 2 or w.layout not in (None, PLACEMENT):
        return
    for rotate in ROTATIONS:
        yield Candidate("ring", rotate, 1, PLACEMENT)


register_layout(PLACEMENT, PLACEMENT, load_balance=PLACEMENT, ulysses=False)
register_candidates(PLACEMENT, _placement)
