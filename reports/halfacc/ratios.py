"""Err / single-device err per quantity for the two failing GPU cases (their
bodies; CUDA where visible, else the CPU)."""

import os
import sys

os.environ.setdefault("CPLIB_GPU_TESTS_ON_CPU", "1")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "../../tests/support"))
import torch
import gpu_cases
from gpu_cases import make_case, visible, square, rel_err, place
from gpu_ring_cases import head_tail, _ring_rank
from harness import run_threaded


def errs(case, n, layout, positions=None, **kw):
    per_rank = run_threaded(n, _ring_rank, case, layout, positions, True, kw)
    names = ["out", "dq", "dk", "dv"] + (["dsinks"] if case.sinks is not None else [])
    rows = dict(out="qpos", dq="qpos", dk="kvpos", dv="kvpos")
    got = place(per_rank, {nm: case.want[nm].shape for nm in names}, rows)
    live = case.see.any(-1) if case.sinks is None else torch.ones(case.see.shape[0], dtype=bool)
    res = {}
    for nm in names:
        g, w, s = got[nm], case.want[nm], case.single[nm]
        if nm in ("out", "dq"):
            g, w, s = (t[:, :, live] for t in (g, w, s))
        res[nm] = (rel_err(g, w), rel_err(s, w))
    return res


def chunks(lq, lk):
    def layout(rank, n):
        return torch.arange(lq).tensor_split(n)[rank], torch.arange(lk).tensor_split(n)[rank]

    return layout


def positions_case(n, dtype, seed_shift=0, window=None, i=0):
    s = 20 * n + 3
    docs = [0, 7, 7 + 10 * n, s]
    q_rows = torch.arange(s)
    kept = torch.tensor([p for p in range(s) if p not in docs[:-1]])
    kv_rows = kept[torch.randperm(kept.numel(), generator=torch.Generator().manual_seed(5))]
    see = visible(q_rows, kv_rows, causal=True, window=window, cu_seqlens=docs)
    case = make_case(1, 4, 1, s, kv_rows.numel(), 64, dtype, 50 + i + seed_shift, see)
    if gpu_cases.DEVICE.type == "cuda" and seed_shift == 0:  # which kernel the reference ran
        dev = gpu_cases.DEVICE
        q, k = case.q.to(dev), case.k.to(dev).repeat_interleave(4, 1)
        try:
            choice = torch._fused_sdp_choice(q, k, k, attn_mask=see.to(dev))
        except Exception as exc:  # a private helper: report, do not stop the figures
            choice = f"unknown ({exc})"
        print(f"single-device SDPA backend for the mask: {choice} (torch.nn.attention.SDPBackend)")
    return errs(
        case,
        n,
        chunks(s, kv_rows.numel()),
        positions=(q_rows, kv_rows),
        is_causal=True,
        window=window,
        cu_seqlens=torch.tensor(docs),
    )


def sinks_case(n, dtype, seed_shift=0):
    s = 32 * n
    dv, mask, kw = 32, dict(causal=False), dict(rotate="alltoall")
    case = make_case(
        1,
        8,
        2,
        s,
        s,
        64,
        dtype,
        30 + seed_shift,
        square(s, **mask),
        dv=dv,
        sinks=True,
        causal_hint=False,
        sink_rows=[head_tail(s, False)(r, n)[0] for r in range(n)],
    )
    return errs(case, n, head_tail(s, False), **kw)


def show(tag, res):
    print(
        tag, "  ".join(f"{k}: {e:.3e}/{r:.3e}={e / r:.2f}" for k, (e, r) in res.items()), flush=True
    )


if __name__ == "__main__":
    which = sys.argv[1]
    seeds = range(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
    for dtype in (torch.bfloat16, torch.float16):
        for n in (2, 4):
            for sh in seeds:
                if which == "pos":
                    show(f"pos {dtype} n={n} seed+{sh}", positions_case(n, dtype, 1000 * sh))
                else:
                    show(f"sinks {dtype} n={n} seed+{sh}", sinks_case(n, dtype, 1000 * sh))
