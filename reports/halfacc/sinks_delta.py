"""Does delta from the fp32 merged ring output (before its rounding) give a better dsinks?
Emulates the ring's forward of the failing sinks case (non-causal, sequential blocks) on the CPU
kernel: per-block out in the dtype + fp32 lse, merged in fp32 with the sinks, then rounded."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "../../tests/support"))
os.environ.setdefault("CPLIB_GPU_TESTS_ON_CPU", "1")
import torch
from gpu_cases import make_case, square, rel_err


def run(n, dtype, seed):
    s = 32 * n
    case = make_case(
        1,
        8,
        2,
        s,
        s,
        64,
        dtype,
        seed,
        square(s, causal=False),
        dv=32,
        sinks=True,
        causal_hint=False,
        sink_rows=[torch.arange(s).tensor_split(n)[r] for r in range(n)],
    )
    q, k, v = case.q, case.k.repeat_interleave(4, 1), case.v.repeat_interleave(4, 1)
    v = torch.nn.functional.pad(v, (0, 32))
    outs, lses = [], []
    for kb, vb in zip(k.tensor_split(n, 2), v.tensor_split(n, 2)):
        o, l = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, kb, vb, 0.0, False)[:2]
        outs.append(o[..., :32].float())
        lses.append(l.float())
    lse = torch.logsumexp(
        torch.stack(lses + [case.sinks.float().view(1, -1, 1).expand_as(lses[0])]), 0
    )
    o32 = sum(torch.exp(l - lse).unsqueeze(-1) * o for o, l in zip(outs, lses))
    o16 = o32.to(dtype)

    def dsinks(o):
        per_row = -(
            (case.cot.double() * o.double()).sum(-1)
            * torch.exp(case.sinks.double().view(1, -1, 1) - lse.double())
        )
        return torch.stack(
            [
                per_row[:, :, r].sum((0, 2)).to(dtype).double()
                for r in torch.arange(s).tensor_split(n)
            ]
        )

    w, single = case.want, case.single
    out = [rel_err(t, w["out"]) for t in (o32, o16, single["out"])]
    ds = [rel_err(t, w["dsinks"]) for t in (dsinks(o32), dsinks(o16), single["dsinks"])]
    print(
        f"{dtype} n={n} seed={seed}: out err o32 {out[0]:.3e} o_dtype {out[1]:.3e} "
        f"single {out[2]:.3e} | dsinks o32 {ds[0]:.3e} o_dtype {ds[1]:.3e} single {ds[2]:.3e}"
    )


def floors(n, dtype, seed):
    s = 32 * n
    case = make_case(
        1,
        8,
        2,
        s,
        s,
        64,
        dtype,
        seed,
        square(s, causal=False),
        dv=32,
        sinks=True,
        causal_hint=False,
        sink_rows=[torch.arange(s).tensor_split(n)[r] for r in range(n)],
    )
    w = case.want["dsinks"]
    return rel_err(w.to(dtype), w), rel_err(case.single["dsinks"], w)


def tail(seeds: int = 25) -> None:
    """How often each delta's dsinks error exceeds 1.5x the single device's, over seeds."""
    import io
    import contextlib
    import re

    for dtype in (torch.bfloat16, torch.float16):
        for n in (2, 4):
            r16, r32 = [], []
            for k in range(seeds):
                buf = io.StringIO()
                with contextlib.redirect_stdout(buf):
                    run(n, dtype, 30 + 1000 * k)
                o32, o16, single = map(
                    float,
                    re.findall(r"dsinks o32 (\S+) o_dtype (\S+) single (\S+)", buf.getvalue())[0],
                )
                r16.append(o16 / single)
                r32.append(o32 / single)
            print(
                f"{dtype} n={n} ({seeds} seeds): delta from the output in the dtype: median "
                f"{sorted(r16)[seeds // 2]:.2f}, >1.5 in {sum(r > 1.5 for r in r16)}; "
                "from the fp32 "
                f"merge: median {sorted(r32)[seeds // 2]:.2f}, >1.5 in {sum(r > 1.5 for r in r32)}"
            )


if __name__ == "__main__" and sys.argv[1:] == ["tail"]:
    tail()
elif __name__ == "__main__":
    for dtype in (torch.bfloat16, torch.float16):
        for n in (2, 4):
            for seed in (30, 1030, 2030, 3030):
                run(n, dtype, seed)
    for dtype in (torch.bfloat16, torch.float16):
        for n in (2, 4):
            fl = [floors(n, dtype, 30 + 1000 * k) for k in range(12)]
            print(
                f"{dtype} n={n}: dsinks rounding floor / single-device error, 12 seeds: "
                + " ".join(f"{a / b:.2f}" for a, b in fl)
            )
