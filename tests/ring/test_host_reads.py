"""Host reads on the GPU path, pinned on CPU (issue 34, section 3).

On a GPU, reading a tensor's values on the host is a device-to-host copy that
waits for every kernel queued before it. The proxies, observable on CPU:

- In cplib's C++, every read of a tensor's values goes through one helper
  (``aten::to_host`` in csrc/torch/common/aten.cpp, and the handshake's values
  hash), which calls ``aten::to(dtype=torch.int64, device="cpu")``: the
  profiler records that call (``aten::to``, dtype_layout overload, dtype
  int64) even when the tensor is already in host memory, so each event is
  one read of values on the host. In Python, ``aten::_local_scalar_dense``
  (``.item()``, ``int(t)``) is one.
- For the Python layer's reads, integer tensors that say they live on a
  GPU (``OnDevice``, a wrapper subclass over CPU values) count every copy
  to the host.

Pinned: ``decode_sdpa`` reads no value on the host (it used to hash q's
values into its handshake and read the positions: four reads per layer per
generated token); a ring with explicit positions and documents reads each
plan input once per fwd+bwd (its backward none: it takes the forward's), and
GPU-resident plan inputs are copied to the host once per batch, not once
per layer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import cplib

INT64 = 4  # torch.int64, as the profiler records a dtype argument


def host_reads(prof) -> int:
    n = 0
    for e in prof.events():
        if e.name in ("aten::_local_scalar_dense", "aten::item"):
            n += 1
        elif e.name == "aten::to" and len(e.input_shapes) == 8 and \
                e.concrete_inputs[1] == INT64:
            n += 1
    return n


def _profiled(step):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True) as prof:
        step()
    return host_reads(prof)


def _decode_reads() -> list[int]:
    rank, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 2, 16, generator=g)      # T = 2 newest tokens, 4 q heads
    k, v = (torch.randn(1, 2, 9, 16, generator=g) for _ in range(2))  # GQA, 9 rows per rank
    pos = torch.arange(9) * n + rank                # interleaved cache positions
    qpos = torch.tensor([9 * n, 9 * n + 1])
    counts = []
    for window in (None, 5):
        def step():
            cplib.decode_sdpa(q, k, v, dist.group.WORLD, q_positions=qpos, kv_positions=pos,
                              window=window)
        step()  # warm-up
        counts.append(_profiled(step))
    return counts


def test_decode_reads_nothing_on_the_host(ranks):
    assert ranks(2).run(_decode_reads) == [[0, 0], [0, 0]]


class OnDevice(torch.Tensor):
    """Integers in CPU memory that say they live on a GPU: every copy to the
    host is counted (a device-to-host read there)."""

    reads = 0

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        t = torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype,
                                                device=torch.device("cuda"))
        t.values = data
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("device") == torch.device("cpu"):
            cls.reads += 1
            return args[0].values.clone()
        raise NotImplementedError(f"OnDevice: {func}")


def test_host_copies_are_made_once_per_tensor_version():
    from cplib.ring.host_copy import host_copy

    OnDevice.reads = 0
    t = OnDevice(torch.arange(6))
    first = host_copy(t)
    assert host_copy(t) is first and OnDevice.reads == 1
    torch.autograd.graph.increment_version(t)  # an in-place change
    assert host_copy(t) is not first and OnDevice.reads == 2
    host = torch.arange(3)
    assert host_copy(host) is host and host_copy(None) is None and OnDevice.reads == 2


def _ring_reads() -> dict:
    """Two layers' fwd+bwd over explicit positions and documents, the plan
    inputs given as GPU-resident integers."""
    rank, n = dist.get_rank(), dist.get_world_size()
    s = 12
    rows = torch.arange(rank, s, n)  # interleaved
    cu = OnDevice(torch.tensor([0, 5, s]))
    qpos, kvpos = OnDevice(rows.clone()), OnDevice(rows.clone())
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(1, 2, rows.numel(), 8, generator=g, requires_grad=True)
    OnDevice.reads = 0
    outs = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True) as fwd:
        for _ in range(2):  # two layers, one batch
            outs.append(cplib.ring_sdpa(x, x, x, dist.group.WORLD, is_causal=True,
                                        cu_seqlens=cu, q_positions=qpos, kv_positions=kvpos)[0])
    device_reads = OnDevice.reads
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True) as bwd:
        sum(o.sum() for o in outs).backward()
    return {"device reads": device_reads, "forward": host_reads(fwd),
            "backward": host_reads(bwd)}


def test_ring_plan_inputs_are_read_once(ranks):
    for r in ranks(2).run(_ring_reads):
        # The three GPU-resident plan inputs reach the host once for both
        # layers (host_copy); then each forward reads their host copies and
        # the gathered positions of every rank once each (4); the backward
        # takes all of it from its forward.
        assert r["device reads"] == 3, r
        assert r["forward"] == 3 + 2 * 4 and r["backward"] == 0, r
