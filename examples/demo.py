"""Train a small Llama-style model with cplib context parallelism and check it
step by step against the same training in a single process.

    torchrun --standalone --nproc-per-node 2 examples/demo.py            # CPU, gloo
    torchrun --standalone --nproc-per-node 2 examples/demo.py --device cuda   # NCCL GPUs

Task (synthetic, long context): each sequence is random filler whose first
eighth is sprinkled with one "secret" token (a different one per sequence);
every position of the last quarter must predict that secret. The answer sits
at least 5/8 of a sequence back, in other ranks' shards: the model can only
learn it through attention across ranks, and the loss can only follow the
reference if that ring attention is exact.

Each step, all ranks train the context-parallel model on their shards of the
batch (``cplib.context_parallel``, head-tail load balanced, gradients summed
over ranks) and rank 0 then trains an identical model on the full sequences.
Rank 0 prints both losses, the CP tokens/s and the peak memory of each rank,
draws both curves to ``examples/out/demo_loss.png`` and exits non-zero if the
curves differ by more than ``--atol + --rtol * |reference|`` at any step.
"""

from __future__ import annotations

import argparse
import copy
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cplib  # noqa: E402
from tiny_llama import TinyLlama  # noqa: E402

SECRETS = 8  # tokens 0..7 are secrets, the rest filler
VOCAB = 64


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seq-len", type=int, default=1024, help="global sequence length")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--rotate", choices=("p2p", "alltoall", "allgather"), default="p2p")
    p.add_argument("--no-load-balance", action="store_true")
    p.add_argument("--atol", type=float, default=2e-3)
    p.add_argument("--rtol", type=float, default=2e-3)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                 "out", "demo_loss.png"))
    return p.parse_args()


def make_batch(step: int, batch: int, seq: int, device: torch.device):
    """Same batch on every rank (seeded by step): ids, positions, labels."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(SECRETS, VOCAB, (batch, seq), generator=g)
    secret = torch.randint(0, SECRETS, (batch,), generator=g)
    # The secret fills about half of the first eighth (the rest is filler).
    header = torch.rand(batch, seq // 8, generator=g) < 0.5
    ids[:, : seq // 8] = torch.where(header, secret[:, None], ids[:, : seq // 8])
    labels = torch.full((batch, seq), -100)
    labels[:, 3 * seq // 4:] = secret[:, None]
    positions = torch.arange(seq).expand(batch, seq)
    return ids.to(device), positions.to(device), labels.to(device)


def loss_sum(model, ids, positions, labels) -> torch.Tensor:
    logits = model(ids, positions)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100,
                           reduction="sum")


class PeakMemory:
    """Peak memory of this process while a step runs: the CUDA allocator's
    peak, or on CPU the resident-set high-water mark (reset per step through
    /proc/self/clear_refs where Linux allows it)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak = 0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                pass  # ru_maxrss below is then the process-lifetime peak
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            now = torch.cuda.max_memory_allocated(self.device)
        else:
            now = _vm_hwm() or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.peak = max(self.peak, now)


def _vm_hwm() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def sum_grads(model: torch.nn.Module) -> None:
    """Sums the parameter gradients over ranks in one collective: each rank
    holds the contribution of its own tokens."""
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def bar(done: int, total: int, width: int = 20) -> str:
    filled = round(width * done / total)
    return "[" + "#" * filled + "-" * (width - filled) + "]"


def plot(path: str, cp: list[float], ref: list[float], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = range(1, len(cp) + 1)
    ax.plot(steps, ref, label="single process (full sequence)", linewidth=3, alpha=0.5)
    ax.plot(steps, cp, "--", label="cplib context parallel", linewidth=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (answer tokens)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    args = parse_args()
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device, backend = torch.device("cuda", local), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(1)  # one core per rank
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("cp",))
    balance = not args.no_load_balance
    unit = 2 * world if balance else world
    if args.seq_len % unit:
        raise SystemExit(f"--seq-len {args.seq_len} must be divisible by {unit}")

    torch.manual_seed(0)
    model = TinyLlama(VOCAB, dim=args.dim, layers=args.layers).to(device)
    ref_model = copy.deepcopy(model) if rank == 0 else None
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=args.lr) if ref_model else None
    answers = args.batch * (args.seq_len - 3 * args.seq_len // 4)
    tokens = args.batch * args.seq_len
    mem = PeakMemory(device)
    cp_losses: list[float] = []
    ref_losses: list[float] = []
    rates: list[float] = []
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"cplib demo: {args.layers}-layer Llama-style model ({n_params / 1e3:.0f}k params), "
              f"{args.batch} x {args.seq_len} tokens per step, {world} {device.type} ranks "
              f"({backend}), rotate={args.rotate}, load_balance={balance}", flush=True)
        print(f"task: at every position of the last 1/4, recall the secret token sprinkled over "
              f"the first 1/8 ({args.seq_len * 5 // 8}+ tokens back)", flush=True)

    for step in range(args.steps):
        ids, positions, labels = make_batch(step, args.batch, args.seq_len, device)
        # --- context-parallel step on every rank (timed, memory measured)
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with mem:
            bufs = [ids.clone(), positions.clone(), labels.clone()]
            with cplib.context_parallel(mesh, buffers=bufs, buffer_seq_dims=[1, 1, 1],
                                        no_restore_buffers=set(bufs), rotate_method=args.rotate,
                                        load_balance=balance):
                local = loss_sum(model, *bufs)
                (local / answers).backward()
            sum_grads(model)
            opt.step()
            opt.zero_grad(set_to_none=True)
            total = local.detach().reshape(1)
            dist.all_reduce(total)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        rates.append(tokens / dt)
        cp_losses.append(total.item() / answers)
        # --- the single-process reference on rank 0, full sequences
        if rank == 0:
            ref = loss_sum(ref_model, ids, positions, labels) / answers
            ref.backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            ref_losses.append(ref.item())
            diff = abs(cp_losses[-1] - ref_losses[-1])
            print(f"step {step + 1:3d}/{args.steps} {bar(step + 1, args.steps)} "
                  f"loss cp {cp_losses[-1]:.5f}  ref {ref_losses[-1]:.5f}  |diff| {diff:.1e}  "
                  f"{rates[-1]:,.0f} tok/s", flush=True)

    peaks = [None] * world
    dist.all_gather_object(peaks, mem.peak)
    ok = True
    if rank == 0:
        tol = [args.atol + args.rtol * abs(r) for r in ref_losses]
        worst = max(range(args.steps), key=lambda i: abs(cp_losses[i] - ref_losses[i]) / tol[i])
        ok = all(abs(c - r) <= t for c, r, t in zip(cp_losses, ref_losses, tol))
        steady = rates[1:] or rates
        print(f"throughput: {sum(steady) / len(steady):,.0f} tokens/s (CP step, mean after "
              f"step 1)", flush=True)
        for r, peak in enumerate(peaks):
            kind = "allocator peak" if device.type == "cuda" else "peak RSS"
            print(f"rank {r}: {kind} {peak / 2**20:,.0f} MiB during CP steps", flush=True)
        plot(args.out, cp_losses, ref_losses,
             f"cplib CP on {world} {device.type} ranks vs single process")
        print(f"loss curves: {os.path.relpath(args.out)}", flush=True)
        max_diff = abs(cp_losses[worst] - ref_losses[worst])
        verdict = "PASS" if ok else "FAIL"
        print(f"demo verdict: {verdict}: CP loss {'tracks' if ok else 'DIVERGES from'} the "
              f"single-process loss (max |diff| {max_diff:.1e} at step {worst + 1}, tolerance "
              f"{args.atol:g} + {args.rtol:g}*|loss|); loss {ref_losses[0]:.3f} -> "
              f"{ref_losses[-1]:.3f}", flush=True)
    flag = torch.tensor([0 if ok else 1], device=device)  # NCCL needs device tensors
    dist.broadcast(flag, src=0)
    dist.destroy_process_group()
    return int(flag.item())


if __name__ == "__main__":
    sys.exit(main())
