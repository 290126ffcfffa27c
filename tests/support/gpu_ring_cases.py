"""The ring's GPU tests' runner (tests/ring/test_gpu_ring_*.py and
test_gpu_backend_choice.py): ``cplib.ring_sdpa`` on N threaded ranks sharing DEVICE, each rank's
rows given by a layout, the results placed back into global tensors and
judged against the case's truth (tests/support/gpu_cases.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gpu_cases import DEVICE, Case, judge, local_rows, place, ranks, sync, world

def _ring_rank(case: Case, layout, positions, grads: bool, kw: dict) -> dict:
    import cplib

    rank, n = world()
    qpos, kvpos = layout(rank, n)
    ql, kl, vl = (local_rows(t, p, grads) for t, p in ((case.q, qpos), (case.k, kvpos),
                                                       (case.v, kvpos)))
    kw = dict(kw)
    if positions is not None:
        kw.update(q_positions=positions[0][qpos].to(DEVICE),
                  kv_positions=positions[1][kvpos].to(DEVICE))
    snk = None
    if case.sinks is not None:
        snk = case.sinks.to(DEVICE, copy=True).requires_grad_(grads)
        kw["sinks"] = snk
    with torch.set_grad_enabled(grads):
        out, lse = cplib.ring_sdpa(ql, kl, vl, dist.group.WORLD, scale=case.scale, **kw)
    res = dict(qpos=qpos, kvpos=kvpos, out=out.detach().cpu(), lse=lse.detach().cpu())
    if grads:
        out.backward(local_rows(case.cot, qpos, False))
        res.update(dq=ql.grad.cpu(), dk=kl.grad.cpu(), dv=vl.grad.cpu())
        if snk is not None:
            res["dsinks"] = snk.grad.cpu()
    sync()
    return res


def run_ring(case: Case, n: int, layout, *, positions=None, grads: bool = True,
             **kw) -> list[str]:
    """cplib.ring_sdpa on ``n`` threaded ranks whose rows ``layout(rank, n)``
    gives as (q indices, kv indices) into the case's global rows;
    ``positions``: (global position of every q row, of every kv row), passed
    to the op as q_positions/kv_positions. Returns the failures against the
    truth."""
    per_rank = ranks(n, _ring_rank, case, layout, positions, grads, kw)
    names = ["out", "lse"] + (["dq", "dk", "dv"] if grads else [])
    if grads and case.sinks is not None:
        names.append("dsinks")
    shapes = {nm: case.want[nm].shape for nm in names}
    rows = dict(out="qpos", lse="qpos", dq="qpos", dk="kvpos", dv="kvpos")
    got = place(per_rank, shapes, rows)
    return judge(case, got, names, what=f"n={n} {kw}")


def head_tail(s: int, lb: bool, documents=None):
    """The layout of cplib's shards (any length; head-tail; per document)."""
    from cplib.attention.layout import shard_positions

    def layout(rank, n):
        pos = shard_positions(s, n, rank, lb, documents=documents)
        return pos, pos
    return layout
