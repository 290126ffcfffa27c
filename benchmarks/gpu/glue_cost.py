"""Host cost per call of the routes the CUDA glue takes to ATen's attention
kernels, measured on META tensors (no GPU, no kernel work: what is left is
the dispatch and conversion the glue adds):

  probe-fwd <backend>   cplib_c._cuda_glue_probe, forward only: one block
                        forward through attention/block_cuda.cpp (flash:
                        _flash_attention_forward with transposed views;
                        efficient: the ATen op; cudnn: the Python op
                        cplib_c::_cudnn_attention calling the ATen op)
  python aten flash / efficient   the ATen op alone, from Python (its meta
                        kernel: what the probe row pays beyond the glue)
  python fn cudnn       cplib.comm.cuda_attention._cudnn_attention called as a
                        plain function (the ATen op, no cplib dispatch)
  python op cudnn       torch.ops.cplib_c._cudnn_attention: the same behind
                        the dispatcher; the difference is the Python op's
                        round trip, the price the cuDNN route pays per block
  trivial python op/fn  a Python op returning its input, through the
                        dispatcher / as a plain function: the round trip
The meta kernels of these ATen ops are themselves Python (torch's meta
registrations), so the absolute figures overstate a GPU's host cost; the
differences are the routes'.

    python benchmarks/gpu/glue_cost.py [--calls 2000]
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

import cplib  # noqa: F401  (registers the ops)


def per_call_us(fn, calls: int) -> float:
    for _ in range(50):
        fn()
    best = float("inf")
    # This process's CPU time (other work on a shared machine does not count),
    # best of 7 repeats.
    for _ in range(7):
        t0 = time.process_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.process_time() - t0) / calls)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    calls = parser.parse_args().calls
    q = torch.empty(1, 16, 2048, 128, device="meta", dtype=torch.bfloat16)
    probe = torch.ops.cplib_c._cuda_glue_probe
    rows = [(f"probe-fwd {name}", lambda name=name: probe(q, q, q, name, True, False, False))
            for name in ("flash", "efficient", "cudnn")]
    from cplib.comm.cuda_attention import _cudnn_attention
    qt = q.transpose(1, 2)
    rows += [
        ("python aten flash", lambda: torch.ops.aten._flash_attention_forward.default(
            qt, qt, qt, None, None, 2048, 2048, 0.0, True, False)),
        ("python aten efficient", lambda: torch.ops.aten._scaled_dot_product_efficient_attention
         .default(q, q, q, None, True, 0.0, True)),
        ("python fn cudnn", lambda: _cudnn_attention(q, q, q, True, None)),
        ("python op cudnn", lambda: torch.ops.cplib_c._cudnn_attention(q, q, q, True, None)),
    ]
    print(f"glue_cost: {platform.machine()}, torch {torch.__version__}, meta tensors "
          f"(1, 16, 2048, 128) bf16, process CPU time, best of 7 x {calls} calls")
    # The round trip alone: a Python op whose body returns its (meta) input,
    # through the dispatcher and called as a plain function.
    lib = torch.library.Library("cplib_glue_cost", "DEF")
    lib.define("ident(Tensor x) -> Tensor")

    def ident(x: torch.Tensor) -> torch.Tensor:
        return x
    lib.impl("ident", ident, "CompositeExplicitAutograd")
    rows += [("trivial python fn", lambda: ident(q)),
             ("trivial python op", lambda: torch.ops.cplib_glue_cost.ident.default(q))]
    us = {name: per_call_us(fn, calls) for name, fn in rows}
    for name, value in us.items():
        print(f"{name:<22} {value:8.1f} us/call")
    print(f"{'python op round trip':<22} {us['trivial python op'] - us['trivial python fn']:8.1f} "
          "us/call (trivial python op - trivial python fn)")


if __name__ == "__main__":
    main()
