"""A two-node launch as a user runs it across machines: two torchrun
launchers on this machine (``--nnodes 2 --nproc-per-node 2``, the c10d
rendezvous on 127.0.0.1, node 0 hosting the store) train the tiny Llama with
``ulysses_degree=2`` (examples/two_nodes.py), which checks that every Ulysses
group lies inside one node, that the ring crosses nodes, and every step's
loss against one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from harness import _free_port, cplib_import_root

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _launcher(node_rank: int, port: int, results: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
           "--nproc-per-node", "2", "--node-rank", str(node_rank), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"cplib-two-nodes-{port}",
           "--rdzv-conf", f"is_host={int(node_rank == 0)}", "--local-addr", "127.0.0.1",
           "--max-restarts", "0",
           os.path.join(ROOT, "examples", "two_nodes.py"), "--steps", "3", "--ulysses-degree",
           "2", "--result-dir", results]
    env = dict(os.environ, PYTHONPATH=cplib_import_root() + os.pathsep
               + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)


def test_two_node_launch_ulysses_groups_inside_nodes(tmp_path):
    port = _free_port()
    nodes = [_launcher(0, port, str(tmp_path)), _launcher(1, port, str(tmp_path))]
    outputs = []
    try:
        for p in nodes:
            outputs.append(p.communicate(timeout=240)[0])
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
                p.wait()
    both = "\n".join(f"--- node {i} ---\n{out}" for i, out in enumerate(outputs))
    assert all(p.returncode == 0 for p in nodes), both
    results = {}
    for rank in range(4):
        path = tmp_path / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no result\n{both}"
        results[rank] = json.loads(path.read_text())
    assert results[0]["verdict"].startswith(
        "two-node verdict: PASS (4 ranks on 2 nodes, ulysses_degree=2"), results[0]
    assert len(results[0]["steps"]) == 3
    # every rank reports its groups: Ulysses inside one node, the ring across both
    for rank, r in results.items():
        node = rank // 2
        assert r["node"] == node, r
        ulysses, ring = r["placement"].split(";")
        assert f"on nodes [{node}]" in ulysses, r
        assert "ring group" in ring and "on nodes [0, 1]" in ring, r
        assert r["verdict"].startswith("two-node verdict: PASS"), r
