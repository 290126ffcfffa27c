"""The fused (out, lse) merge (cplib_c::merge_partial_, C on CPU) against a
plain copy moving the same number of bytes, one thread each, same run.

    OMP_NUM_THREADS=1 python benchmarks/bench_merge.py
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from common import machine, plot, print_table, timeit, write_json  # noqa: E402

import cplib  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    rows, payload = [], {"rows": []}
    for b, h, l, d, blk_dtype in ((1, 8, 4096, 64, torch.float32),
                                  (1, 8, 4096, 128, torch.float32),
                                  (1, 8, 4096, 64, torch.bfloat16),
                                  (1, 16, 8192, 128, torch.float32)):
        out = torch.randn(b, h, l, d)
        lse = torch.randn(b, h, l)
        blk_out = torch.randn(b, h, l, d).to(blk_dtype)
        blk_lse = torch.randn(b, h, l)
        # merge traffic: read out, lse, blk_out, blk_lse; write out, lse
        traffic = 2 * out.nbytes + 2 * lse.nbytes + blk_out.nbytes + blk_lse.nbytes
        t_merge = timeit(lambda: cplib.merge_partial_(out, lse, blk_out, blk_lse), warmup=3,
                         iters=40)
        src = torch.empty(traffic // 2, dtype=torch.uint8)
        dst = torch.empty_like(src)
        t_copy = timeit(lambda: dst.copy_(src), warmup=3, iters=40)
        gbps_m, gbps_c = traffic / t_merge / 1e9, traffic / t_copy / 1e9
        name = f"{b}x{h}x{l}x{d} {str(blk_dtype).replace('torch.', '')}"
        rows.append((name, traffic / 2**20, gbps_m, gbps_c, gbps_m / gbps_c))
        payload["rows"].append(dict(shape=name, traffic_bytes=traffic, merge_gbps=gbps_m,
                                    copy_gbps=gbps_c, ratio=gbps_m / gbps_c))
    print_table("fused merge vs copy of the same bytes (1 thread)",
                ["shape (blk dtype)", "MiB moved", "merge GB/s", "copy GB/s", "merge/copy"], rows)
    write_json("bench_merge", payload)
    plot("bench_merge", "merge vs copy bandwidth", "case", "GB/s",
         {"merge": (list(range(len(rows))), [r[2] for r in rows]),
          "copy": (list(range(len(rows))), [r[3] for r in rows])}, kind="bar")
    print(machine())


if __name__ == "__main__":
    main()
