"""The ring's dq with the backward fed another `out` (for delta = rowsum(dO * O)):
its own (as shipped), the single-device kernel's, or the fp64 truth rounded to the dtype.
Swaps the covered backward op in the autograd closure (experiment only)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "../../tests/support"))
os.environ.setdefault("CPLIB_GPU_TESTS_ON_CPU", "1")
import torch
import torch.distributed as dist
import cplib.ring.op as rop
from gpu_cases import make_case, visible, rel_err, place
from gpu_ring_cases import _ring_rank
from harness import run_threaded

SUB = {}  # rank -> out rows to use, or None
cell = [
    c for c in rop._backward.__closure__ if c.cell_contents is rop.ops.ring_sdpa_backward_covered
][0]
orig = cell.cell_contents


def swapped(agreed, grad_out, q, k, v, out, lse, *args):
    sub = SUB.get(dist.get_rank())
    if sub is not None:
        out = sub.to(out.device, out.dtype)
    return orig(agreed, grad_out, q, k, v, out, lse, *args)


cell.cell_contents = swapped


def chunks(lq, lk):
    def layout(rank, n):
        return torch.arange(lq).tensor_split(n)[rank], torch.arange(lk).tensor_split(n)[rank]

    return layout


for dtype in (torch.bfloat16, torch.float16):
    for n in (2, 4):
        for seed in (50, 1050, 2050):
            s = 20 * n + 3
            docs = [0, 7, 7 + 10 * n, s]
            q_rows = torch.arange(s)
            kept = torch.tensor([p for p in range(s) if p not in docs[:-1]])
            kv_rows = kept[torch.randperm(kept.numel(), generator=torch.Generator().manual_seed(5))]
            see = visible(q_rows, kv_rows, causal=True, window=None, cu_seqlens=docs)
            case = make_case(1, 4, 1, s, kv_rows.numel(), 64, dtype, seed, see)
            live = see.any(-1)
            w = case.want["dq"][:, :, live]
            line = (
                f"{dtype} n={n} seed={seed}: single {rel_err(case.single['dq'][:, :, live], w):.3e}"
            )
            for name, src in (
                ("own out", None),
                ("single's out", case.single["out"]),
                ("truth out rounded", case.want["out"].to(dtype)),
            ):
                SUB.clear()
                if src is not None:
                    for r in range(n):
                        SUB[r] = src[:, :, torch.arange(s).tensor_split(n)[r]]
                per = run_threaded(
                    n,
                    _ring_rank,
                    case,
                    chunks(s, kv_rows.numel()),
                    (q_rows, kv_rows),
                    True,
                    dict(is_causal=True, cu_seqlens=torch.tensor(docs)),
                )
                got = place(per, {"dq": case.want["dq"].shape}, {"dq": "qpos"})["dq"][:, :, live]
                line += f" | ring, {name}: {rel_err(got, w):.3e}"
            print(line, flush=True)
