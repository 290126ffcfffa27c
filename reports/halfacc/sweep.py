"""The error ratio (ring / single device, vs fp64 truth) of the two failing GPU cases'
CPU bodies over many seeds: how often does each exceed 1.5?"""

import os
import sys
import statistics

sys.path.insert(0, os.path.dirname(__file__))
import torch
from ratios import positions_case, sinks_case

which, seeds = sys.argv[1], int(sys.argv[2])
for dtype in (torch.bfloat16, torch.float16):
    for n in (2, 4):
        rs = {}
        for sh in range(seeds):
            res = (
                positions_case(n, dtype, 1000 * sh)
                if which == "pos"
                else sinks_case(n, dtype, 1000 * sh)
            )
            for k, (e, r) in res.items():
                rs.setdefault(k, []).append(e / r)
        print(
            f"{which} {str(dtype)[6:]} n={n} ({seeds} seeds): "
            + "  ".join(
                f"{k}: median {statistics.median(v):.2f} max {max(v):.2f} "
                f">1.5: {sum(x > 1.5 for x in v)}"
                for k, v in rs.items()
            ),
            flush=True,
        )
