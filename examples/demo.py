"""A first look at cplib on local CPU ranks: each rank holds a slice of a long
sequence, all-gathers the keys/values through cplib's native op, and checks
that the gradient of its slice comes back through the reduce-scatter.

    torchrun --standalone --nproc-per-node 2 examples/demo.py
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import cplib


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    seq, heads, dim = 64 * world, 4, 16
    torch.manual_seed(0)
    k_full = torch.randn(1, heads, seq, dim)
    v_full = torch.randn(1, heads // 2, seq, dim)  # GQA: fewer value heads
    k = k_full.chunk(world, 2)[rank].clone().requires_grad_(True)
    v = v_full.chunk(world, 2)[rank].clone().requires_grad_(True)

    gk, gv = cplib.flex_cp_allgather(k, v, 2, dist.group.WORLD)
    ok = torch.equal(gk.detach(), k_full) and torch.equal(gv.detach(), v_full)
    (gk.sum() + 2 * gv.sum()).backward()
    grads_ok = torch.allclose(k.grad, torch.full_like(k, world)) and torch.allclose(
        v.grad, torch.full_like(v, 2 * world))
    print(f"rank {rank}/{world}: local k {tuple(k.shape)} -> gathered {tuple(gk.shape)}; "
          f"values {'match' if ok else 'DIFFER'}; grads {'match' if grads_ok else 'DIFFER'}",
          flush=True)
    dist.barrier()
    if rank == 0:
        print("demo verdict:", "PASS" if ok and grads_ok else "FAIL")
    dist.destroy_process_group()
    if not (ok and grads_ok):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
