"""The GPU benchmark's dry run on the CPU (`bench_ring_gpu.py --device cpu
--smoke`): every path a GPU run takes to say where the time goes, on what
the CPU runs. The profiler's split of one step of every rank (attention,
other, the collectives' copies, idle), each rank's own kernel time and the
bytes it sent, T_blocks from the ring's own plan, the projection to N GPUs,
their table, goals and PNG; and the attribution of a backward that runs on
another thread (the autograd engine's device thread on CUDA) to the rank
that built its graph."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPU_DIR = os.path.join(REPO, "benchmarks", "gpu")


def _modules():
    sys.path.insert(0, GPU_DIR)
    try:
        import ring_profile
        import ring_report
        return ring_profile, ring_report
    finally:
        sys.path.remove(GPU_DIR)


def test_smoke_run_says_where_the_time_goes(tmp_path):
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    run = subprocess.run([sys.executable, "-P", os.path.join(REPO, "benchmarks",
                                                             "bench_ring_gpu.py"),
                          "--device", "cpu", "--smoke", "--warmup", "0", "--iters", "1",
                          "--out", str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    payload = json.loads((tmp_path / "bench_ring_gpu.json").read_text())
    assert payload["complete"] and payload["problems"]["profile"] == [], payload["problems"]
    assert len(payload["rows"]) == 5
    for row in payload["rows"]:
        n = row["n"]
        # T_blocks: the plan's calls of every rank, each timed
        blocks = row["blocks"]["cpu"]
        assert blocks["calls"] > 0 and len(blocks["per_rank_s"]) == n
        assert all(t > 0 for t in blocks["per_rank_s"]), blocks
        # every ring variant profiled, cplib's and torch's
        assert {k.split("/")[0] for k in row["profile"]} == {"cplib", "torch"}, row["profile"]
        assert len(row["profile"]) == len(row["cplib_ms"]) + len(row["torch_ms"])
        for key, p in row["profile"].items():
            parts = p["attention_s"], p["other_s"], p["comm_s"], p["idle_s"]
            assert all(x >= 0 for x in parts) and p["attention_s"] > 0, (key, p)
            assert p["busy_s"] + p["idle_s"] == pytest.approx(p["wall_s"], rel=1e-6), (key, p)
            assert len(p["per_rank"]) == n and all(r["attention_s"] > 0 for r in p["per_rank"])
            # a rank sends at least its k/v once (float32 here)
            kv = 2 * row["hkv"] * row["s"] // n * 16 * 4
            assert all(b >= kv // 2 for b in p["sent_bytes"]), (key, p["sent_bytes"])
            proj = row["projection"][key]
            assert proj["link_gbps"] > 0 and proj["serial_ms"] >= proj["overlap_ms"] > 0
    assert "### where the time goes" in run.stdout, run.stdout
    assert "ring kernel time (all ranks) / full <= 1.05 at S=32768 N=4 causal" in run.stdout
    assert (tmp_path / "bench_ring_gpu.png").stat().st_size > 10_000
    _, ring_report = _modules()
    verdict = ring_report.verdict(str(tmp_path / "bench_ring_gpu.json"))
    assert verdict[0].startswith("PASS: "), verdict


def test_a_backward_on_another_thread_counts_for_the_rank_that_built_it():
    """Without the threaded group's switch (autograd's multithreading off),
    a CUDA backward runs on the engine's device thread: its kernels belong to
    the rank whose thread made the graph (the autograd op's fwd_thread)."""
    ring_profile, _ = _modules()
    q = torch.randn(1, 2, 32, 8, requires_grad=True)
    prof = ring_profile.start_profiler(torch.device("cpu"))
    with torch.profiler.record_function(f"{ring_profile.MARK}0"):
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        seen = []

        def backward():
            seen.append(threading.get_ident())
            out.sum().backward()
        t = threading.Thread(target=backward)
        t.start()
        t.join()
    prof.__exit__(None, None, None)
    assert seen and seen[0] != threading.get_ident()
    events = prof.events()
    mark = next(e for e in events if e.name == f"{ring_profile.MARK}0")
    backward_ops = [e for e in events if e.name.endswith("_for_cpu_backward")]
    assert backward_ops and all(e.thread != mark.thread for e in backward_ops)

    def leaves(e):
        return [e] if not e.cpu_children else [x for c in e.cpu_children for x in leaves(c)]
    backward_s = sum(x.time_range.end - x.time_range.start
                     for e in backward_ops for x in leaves(e)) * 1e-6
    split = ring_profile.split(events, "cpu", 1)
    # the backward's attention kernels are counted for rank 0, none is left unattributed
    assert 0 < backward_s < split["attention_s"], split
    assert split["per_rank"][0]["attention_s"] == pytest.approx(split["attention_s"]), split


def test_kernels_are_classified_by_the_ops_that_launched_them():
    ring_profile, _ = _modules()
    c = ring_profile.classify
    assert c(["aten::copy_", "_c10d_functional::all_to_all_single", "cplib_c::ring_sdpa"]) \
        == "comm"
    assert c(["aten::fill_", "aten::_efficient_attention_forward", "cplib_c::ring_sdpa"]) \
        == "attention"
    assert c(["cplib_c::_cudnn_attention"]) == "attention"
    assert c(["aten::_to_copy", "aten::to", "cplib_c::ring_sdpa_backward_covered"]) == "other"
