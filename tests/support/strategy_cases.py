"""What the tests of ``strategy="auto"`` on gloo ranks share (its routing at
the ring's entry, tests/ring/test_ring_auto.py; in the front end,
tests/frontend/test_cp_strategy.py; the model itself,
tests/strategy/test_strategy_ranks.py): the mesh, float64 inputs and the
comparison against one process."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import cplib
from harness import assert_close
from ring_cases import global_tensor

TOL = dict(atol=1e-10, rtol=1e-10)
CPU = cplib.AutoStrategy(calibration="cpu")  # no measurement: quick


def world_mesh() -> DeviceMesh:
    return DeviceMesh("cpu", list(range(dist.get_world_size())))


def inputs(b, hq, hkv, s, d, seed) -> list[torch.Tensor]:
    """Global float64 q, k, v and the output's cotangent."""
    return [global_tensor((b, h, s, d), torch.float64, seed + i)
            for i, h in enumerate((hq, hkv, hkv, hq))]


def compare(got, ref, what) -> None:
    """(out, dq, dk, dv) against the reference's (out, lse, dq, dk, dv)."""
    for label, g, w in zip(("out", "dq", "dk", "dv"), got, (ref[0],) + tuple(ref[2:])):
        assert_close(g, w, what=f"{label} [{what}]", **TOL)
