"""Rows of a sharded sequence moved to the ranks that read them, with their
gradients sent back to the owners.

A sequence of ``seq_len`` tokens is cut over the ranks of a group; each
rank holds some rows (``RowLayout.positions[r]``: their global positions in
its local order; head-tail shards are not contiguous). A rank that needs
rows of the others gets them one of two ways:

* **gather**: every rank sends its whole shard to every other rank (an
  all-gather, as an all-to-all: gloo's all-gather cannot have two in
  flight, cplib/comm/collectives.py) and reads the rows it needs out of
  the whole sequence. Backward: the gradient of every row goes back to its
  owner, which sums what each rank sends (a reduce-scatter);
* **fetch**: every rank asks each owner for the rows it needs (their local
  row numbers, int64) and receives those rows only. Backward: it sends their
  gradients back, which the owner adds into those rows.

:func:`plan_rows` picks the one that moves fewer bytes: every rank's counts
of wanted rows per owner are gathered (one small all-gather of integers),
so each rank computes the same choice from the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm.native import ops

__all__ = ["RowLayout", "RowsPlan", "all_rows", "plan_rows", "take_rows"]

_INDEX_BYTES = 8  # a fetch request: one int64 row number per wanted row


@dataclass(frozen=True)
class RowLayout:
    """Which rank holds which rows: ``positions[r]`` are the global positions
    of rank r's rows, in its local order; ``group_name`` None for one
    process."""

    positions: tuple[torch.Tensor, ...]
    rank: int
    group_name: str | None
    seq_len: int

    @property
    def world(self) -> int:
        return len(self.positions)

    def owners(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(owner rank, row on the owner) of every global position."""
        owner = torch.empty(self.seq_len, dtype=torch.long)
        row = torch.empty(self.seq_len, dtype=torch.long)
        for r, pos in enumerate(self.positions):
            owner[pos] = r
            row[pos] = torch.arange(pos.numel())
        return owner, row


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
              group_name: str) -> torch.Tensor:
    """One all-to-all of ``x``'s rows (dim 0)."""
    out = ops.c10d_all_to_all(x.contiguous(), out_splits, in_splits, group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


def _gather_counts(counts: list[int], layout: RowLayout, device: torch.device) -> torch.Tensor:
    """Every rank's ``counts`` as a (world, world) matrix, the same on every rank."""
    mine = torch.tensor(counts, dtype=torch.long, device=device)
    n = layout.world
    out = _exchange(mine.repeat(n), [n] * n, [n] * n, layout.group_name)
    return out.view(n, n).cpu()


@dataclass(frozen=True)
class RowsPlan:
    """How rows reach this rank: ``strategy`` ("gather", "fetch" or "local"
    for one process), the bytes of rows this rank receives (``received``;
    a fetch adds ``requests``, the int64 row numbers asked of it) and what
    the other way would have received in all (``other``), ``wanted[o]`` the
    global positions it reads from rank o (its own included)."""

    strategy: str
    received: int
    other: int
    wanted: tuple[torch.Tensor, ...]
    asked: tuple[int, ...]  # rows each rank asks of this one (fetch)
    requests: int = 0


def plan_rows(needed: torch.Tensor, layout: RowLayout, row_bytes: int,
              strategy: str = "auto") -> RowsPlan:
    """The plan for reading the rows at global positions ``needed`` (1-D),
    each ``row_bytes`` bytes; ``strategy`` "gather", "fetch", or "auto" (the
    one whose largest receipt over the ranks is smaller: the slowest rank
    sets the time). Collective (one all-gather of ``world`` integers) unless
    one process or a forced "gather"."""
    if strategy not in ("auto", "gather", "fetch"):
        raise ValueError(f"cplib.sparse: strategy must be 'auto', 'gather' or 'fetch', got "
                         f"{strategy!r}")
    owner, _ = layout.owners()
    owner = owner.to(needed.device)
    wanted = tuple(needed[owner[needed] == r] for r in range(layout.world))
    if layout.world == 1 or layout.group_name is None:
        return RowsPlan("local", 0, 0, wanted, (0,))
    me = layout.rank
    lengths = [p.numel() for p in layout.positions]
    gather = [(layout.seq_len - n) * row_bytes for n in lengths]
    if strategy == "gather":
        return RowsPlan("gather", gather[me], 0, wanted, ())
    counts = [0 if r == me else int(w.numel()) for r, w in enumerate(wanted)]
    matrix = _gather_counts(counts, layout, needed.device)
    rows = [int(matrix[r].sum()) * row_bytes for r in range(layout.world)]
    requests = [int(matrix[:, r].sum()) * _INDEX_BYTES for r in range(layout.world)]
    fetch = [a + b for a, b in zip(rows, requests)]
    if strategy == "auto":
        strategy = "fetch" if max(fetch) < max(gather) else "gather"
    asked = tuple(int(matrix[r, me]) for r in range(layout.world))
    if strategy == "gather":
        return RowsPlan("gather", gather[me], fetch[me], wanted, asked)
    return RowsPlan("fetch", rows[me], gather[me], wanted, asked, requests[me])


class _AllRows(torch.autograd.Function):
    """(B, L_r, C) local rows -> (B, S, C) in global order; backward: each
    row's gradient summed on its owner."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layout: RowLayout) -> torch.Tensor:
        ctx.layout = layout
        n, lengths = layout.world, [p.numel() for p in layout.positions]
        rows = x.transpose(0, 1)  # (L_r, B, C): the rows travel on dim 0
        got = _exchange(torch.cat([rows] * n), lengths, [rows.shape[0]] * n, layout.group_name)
        order = torch.cat(layout.positions).to(x.device)
        out = x.new_empty((layout.seq_len, *rows.shape[1:]))
        out[order] = got
        return out.transpose(0, 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        layout = ctx.layout
        n, mine = layout.world, layout.positions[layout.rank].numel()
        rows = grad.transpose(0, 1)
        order = torch.cat(layout.positions).to(grad.device)
        lengths = [p.numel() for p in layout.positions]
        got = _exchange(rows[order], [mine] * n, lengths, layout.group_name)
        return got.view(n, mine, *rows.shape[1:]).sum(0).transpose(0, 1), None


def all_rows(x: torch.Tensor, layout: RowLayout) -> torch.Tensor:
    """Every rank's rows of ``x`` (B, L_r, C), as (B, S, C) in global order
    (differentiable: each row's gradient returns to its owner)."""
    if layout.world == 1 or layout.group_name is None:
        out = x.new_empty((x.shape[0], layout.seq_len, *x.shape[2:]))
        out[:, layout.positions[0].to(x.device)] = x
        return out
    return _AllRows.apply(x, layout)


class _FetchRows(torch.autograd.Function):
    """The rows ``plan.wanted`` of every other rank, fetched: (B, sum, C) in
    rank order of their owners; backward: their gradients added into the
    owners' rows."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layout: RowLayout, plan: RowsPlan) -> torch.Tensor:
        _, row_of = layout.owners()
        me = layout.rank
        asks = [torch.empty(0, dtype=torch.long) if r == me else row_of[w.cpu()]
                for r, w in enumerate(plan.wanted)]
        sizes = [a.numel() for a in asks]
        requests = _exchange(torch.cat(asks).to(x.device), list(plan.asked), sizes,
                             layout.group_name)
        rows = x.transpose(0, 1)
        got = _exchange(rows[requests], sizes, list(plan.asked), layout.group_name)
        ctx.save_for_backward(requests)
        ctx.layout, ctx.plan, ctx.sizes, ctx.length = layout, plan, sizes, rows.shape[0]
        return got.transpose(0, 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (requests,) = ctx.saved_tensors
        rows = grad.transpose(0, 1)
        back = _exchange(rows, list(ctx.plan.asked), ctx.sizes, ctx.layout.group_name)
        out = rows.new_zeros((ctx.length, *rows.shape[1:]))
        out.index_add_(0, requests, back)
        return out.transpose(0, 1), None, None


def take_rows(x: torch.Tensor, needed: torch.Tensor, layout: RowLayout,
              plan: RowsPlan) -> torch.Tensor:
    """The rows of global positions ``needed`` (1-D, sorted) as (B, len,
    C), differentiable in this rank's ``x`` (B, L_r, C): by ``plan`` (from
    :func:`plan_rows` with the same ``needed``)."""
    if plan.strategy in ("gather", "local"):
        return all_rows(x, layout)[:, needed]
    _, row_of = layout.owners()
    row_of = row_of.to(x.device)
    me = layout.rank
    own = x[:, row_of[plan.wanted[me]]]
    fetched = _FetchRows.apply(x, layout, plan)
    # Fetched rows arrive owner by owner; put every row where ``needed`` has it.
    parts = [own if r == me else None for r in range(layout.world)]
    start = 0
    for r, w in enumerate(plan.wanted):
        if r != me:
            parts[r] = fetched[:, start:start + w.numel()]
            start += w.numel()
    rows = torch.cat(parts, 1)
    order = torch.cat(plan.wanted).argsort()
    return rows[:, order]
