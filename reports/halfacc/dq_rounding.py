"""How much of the ring's dq error can the per-call rounding of gq explain?
fp64 partial dq of each (q rank, kv rank) call of the positions case (chunks layout), each
rounded to the dtype as the kernel returns it, summed in fp32 and rounded: the pure rounding
error of the ring's structure, vs one rounding of the whole dq (the single device's floor)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "../../tests/support"))
os.environ.setdefault("CPLIB_GPU_TESTS_ON_CPU", "1")
import torch
from gpu_cases import make_case, visible, rel_err


def partial_dq(q, k, v, cot, see, keys):
    """fp64 dq from the keys `keys` only, with the global P and delta (as the block backward)."""
    q, k, v, cot = (t.double() for t in (q, k, v, cot))
    g = q.shape[1] // k.shape[1]
    kx, vx = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    sc = q.shape[-1] ** -0.5
    s = (q @ kx.transpose(-1, -2) * sc).masked_fill(~see, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    out = p @ vx
    dp = cot @ vx.transpose(-1, -2)
    delta = (cot * out).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    ds = ds * keys.double()
    return ds @ kx * sc


for dtype in (torch.bfloat16, torch.float16):
    for n in (2, 4):
        s = 20 * n + 3
        docs = [0, 7, 7 + 10 * n, s]
        q_rows = torch.arange(s)
        kept = torch.tensor([p for p in range(s) if p not in docs[:-1]])
        kv_rows = kept[torch.randperm(kept.numel(), generator=torch.Generator().manual_seed(5))]
        see = visible(q_rows, kv_rows, causal=True, window=None, cu_seqlens=docs)
        case = make_case(1, 4, 1, s, kv_rows.numel(), 64, dtype, 50, see)
        live = see.any(-1)
        full = partial_dq(
            case.q, case.k, case.v, case.cot, see, torch.ones(kv_rows.numel(), dtype=bool)
        )
        acc = torch.zeros_like(full, dtype=torch.float32)
        for blk in torch.arange(kv_rows.numel()).tensor_split(n):
            keys = torch.zeros(kv_rows.numel(), dtype=bool)
            keys[blk] = True
            acc += partial_dq(case.q, case.k, case.v, case.cot, see, keys).to(dtype).float()
        w = case.want["dq"][:, :, live]
        ring_floor = rel_err(acc.to(dtype)[:, :, live], w)
        single_floor = rel_err(full.to(dtype)[:, :, live], w)
        single = rel_err(case.single["dq"][:, :, live], w)
        print(
            f"{dtype} n={n}: rounding floor single {single_floor:.3e}, ring {ring_floor:.3e} | "
            f"single-device kernel {single:.3e}; kernel + ring's extra rounding "
            f"{(single**2 + ring_floor**2 - single_floor**2) ** 0.5:.3e} "
            f"= {((single**2 + ring_floor**2 - single_floor**2) ** 0.5) / single:.2f}x"
        )
