"""Train the tiny Llama with USP across nodes and check it against one process.

Run one launcher per node (here: two nodes of 2 processes; on real machines
put node 0's address in --rdzv-endpoint and start the same command on every
node, node 0 first or not, with its own --node-rank):

    torchrun --nnodes 2 --nproc-per-node 2 --node-rank 0 --rdzv-backend c10d \\
        --rdzv-endpoint NODE0_HOST:29400 --rdzv-id my-job examples/two_nodes.py
    torchrun --nnodes 2 --nproc-per-node 2 --node-rank 1 --rdzv-backend c10d \\
        --rdzv-endpoint NODE0_HOST:29400 --rdzv-id my-job examples/two_nodes.py

torchrun numbers the ranks node by node (node k holds ranks k*P .. k*P+P-1),
and cplib's Ulysses groups are ``ulysses_degree`` consecutive ranks, so with
``--ulysses-degree`` dividing the processes per node every all-to-all stays
inside a node (NVLink) and only the ring's point-to-point traffic crosses
nodes. The script checks exactly that from the groups it built, then trains
``--steps`` steps under ``cplib.context_parallel(..., ulysses_degree=U)``
(every rank also trains the same model on the full sequences, in one
process) and prints ``two-node verdict: PASS`` when every step's loss agrees.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cplib  # noqa: E402
from cplib.ulysses.usp_layout import usp_groups  # noqa: E402
from tiny_llama import TinyLlama  # noqa: E402

VOCAB = 64


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--ulysses-degree", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--tol", type=float, default=1e-4)
    p.add_argument("--result-dir", help="each rank also writes rank<r>.json here (its node and "
                                        "groups; rank 0: every step's losses and the verdict)")
    return p.parse_args()


def write_result(folder: str | None, rank: int, record: dict) -> None:
    """One file per rank: a reader never depends on how the ranks' printed
    lines interleave in a shared pipe."""
    if folder:
        import json

        path = os.path.join(folder, f"rank{rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)


def node_of_every_rank(device: torch.device) -> list[tuple[str, int]]:
    """(host, node index) of every rank: the launcher's node index (GROUP_RANK)
    tells nodes apart even when they share a host, as in the test."""
    mine = (socket.gethostname(), int(os.environ.get("GROUP_RANK", "0")))
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return [tuple(x) for x in every]


def check_placement(group: dist.ProcessGroup, u: int, nodes: list[tuple[str, int]]) -> str:
    """Every Ulysses group inside one node; the ring groups across nodes."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    groups = usp_groups(group, u)
    lines = []
    for kind, name in (("ulysses", groups.ulysses_group), ("ring", groups.ring_group)):
        if name is None:
            continue
        members = dist.get_process_group_ranks(_resolve_process_group(name))
        where = sorted({nodes[r][1] for r in members})
        lines.append(f"{kind} group {members} on nodes {where}")
        if kind == "ulysses" and len(where) != 1:
            raise SystemExit(f"two-node: the Ulysses group {members} spans nodes {where}: its "
                             "all-to-all would cross the network")
        if kind == "ring" and len({n for _, n in nodes}) > 1 and len(where) < 2:
            raise SystemExit(f"two-node: the ring group {members} stays on node {where}")
    return "; ".join(lines)


def make_batch(step: int, batch: int, seq: int, device: torch.device):
    """Same batch on every rank: ids, positions, next-token labels."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((batch, 1), -100)], dim=1)
    positions = torch.arange(seq).expand(batch, seq)
    return ids.to(device), positions.to(device), labels.to(device)


def loss_sum(model, ids, positions, labels) -> torch.Tensor:
    logits = model(ids, positions)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100,
                           reduction="sum")


def main() -> int:
    args = parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(args.device, local_rank) if args.device == "cuda" else \
        torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=120))
    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (n,), mesh_dim_names=("cp",))
    nodes = node_of_every_rank(device)
    placement = check_placement(mesh["cp"].get_group(), args.ulysses_degree, nodes)
    print(f"rank {rank} (node {nodes[rank][1]}, {nodes[rank][0]}): {placement}", flush=True)
    record = dict(rank=rank, node=nodes[rank][1], host=nodes[rank][0], placement=placement,
                  steps=[])

    torch.manual_seed(0)
    ref = TinyLlama(VOCAB, dim=32, layers=2, heads=4, kv_heads=2, hidden=64).to(device)
    cp_model = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=args.lr)
    opt_cp = torch.optim.AdamW(cp_model.parameters(), lr=args.lr)
    worst = 0.0
    for step in range(args.steps):
        ids, pos, labels = make_batch(step, args.batch, args.seq_len, device)
        tokens = int((labels != -100).sum())
        ref_loss = loss_sum(ref, ids, pos, labels) / tokens
        ref_loss.backward()
        opt_ref.step()
        opt_ref.zero_grad()

        with cplib.context_parallel(mesh["cp"], buffers=[ids, pos, labels],
                                    buffer_seq_dims=[1, 1, 1], load_balance=True,
                                    ulysses_degree=args.ulysses_degree):
            loss = loss_sum(cp_model, ids, pos, labels) / tokens
            loss.backward()
        for p in cp_model.parameters():  # each rank's loss is its shard's share
            dist.all_reduce(p.grad)
        opt_cp.step()
        opt_cp.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        diff = abs(total.item() - ref_loss.item())
        worst = max(worst, diff / max(1.0, abs(ref_loss.item())))
        record["steps"].append(dict(cp=total.item(), one_process=ref_loss.item()))
        if rank == 0:
            print(f"step {step}: loss cp {total.item():.6f} one process {ref_loss.item():.6f}",
                  flush=True)
    ok = worst <= args.tol
    verdict = (f"two-node verdict: {'PASS' if ok else 'FAIL'} ({n} ranks on "
               f"{len({k for _, k in nodes})} nodes, ulysses_degree={args.ulysses_degree}, "
               f"worst relative loss difference {worst:.2e})")
    if rank == 0:
        print(verdict, flush=True)
    write_result(args.result_dir, rank, dict(record, verdict=verdict, worst=worst))
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
