"""A model of the user's own that holds transformers' hybrid layers, on the
``_ContextParallel`` module path (``parallelize_module`` on its attention,
inputs cut by ``_context_parallel_shard``; no ``cplib.context_parallel``
region): its Gated DeltaNet layer carries the conv's halo and the recurrent
state across the ranks, so the output and every parameter's gradient equal
one process's (2 gloo ranks, head-tail and sequential shards); a layer
cplib cannot carry (Mamba v1) raises NotImplementedError naming it on every
rank; and the same model on whole inputs after the shard call runs as in one
process. Before this, the layer ran on each shard from a zero state."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from harness import assert_close
from hybrid_cases import hybrid_block


def _run(s: int, load_balance: bool) -> int:
    import cplib
    from cplib import _context_parallel_shard, _ContextParallel, _HeadTailLoadBalancer

    n = dist.get_world_size()
    mesh = DeviceMesh("cpu", list(range(n)))
    ref = hybrid_block("qwen3_next", "Qwen3NextGatedDeltaNet")
    model = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(2, s, 32, generator=g), torch.randn(2, s, 32, generator=g)
    want = ref(x)
    (want * w).sum().backward()
    parallelize_module(model.attn, mesh, _ContextParallel(
        seq_dim=2, attention_type=_ContextParallel.AttentionType.SDPA))
    lb = _HeadTailLoadBalancer(s, n, "cpu") if load_balance else None
    local_x, local_w = _context_parallel_shard(mesh, [x, w], [1, 1], lb)
    cplib._enable_context_parallel_dispatcher()
    try:
        out = model(local_x)
        (out * local_w).sum().backward()
    finally:
        cplib._disable_context_parallel_dispatcher()
    what = f"module path S={s} load_balance={load_balance}"
    (got,) = cplib.context_parallel_unshard(mesh, [out.detach()], [1], lb)
    assert_close(got, want.detach(), what=f"{what}: output", atol=2e-5, rtol=1e-5)
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad)  # each rank's gradient of its shard's part of the sum
        assert_close(grad, dict(ref.named_parameters())[name].grad, atol=1e-5, rtol=1e-5,
                     what=f"{what}: gradient of {name}")
    # Whole inputs after the shard call: not a shard, so as in one process.
    with torch.no_grad():
        assert torch.equal(model.mixer(x), ref.mixer(x)), f"{what}: whole input"
    return 1


def _check_exact() -> int:
    return _run(32, True) + _run(32, False)


def test_gated_deltanet_on_the_module_path_equals_one_process(ranks):
    assert ranks(2).run(_check_exact) == [2, 2]


def _refused() -> str:
    from cplib import _context_parallel_shard

    n = dist.get_world_size()
    model = hybrid_block("mamba", "MambaMixer").mixer
    x = torch.randn(1, 16 * n, 32, generator=torch.Generator().manual_seed(2))
    (local,) = _context_parallel_shard(DeviceMesh("cpu", list(range(n))), [x], [1])
    try:
        model(local)
    except NotImplementedError as exc:
        assert "MambaMixer (mamba)" in str(exc), str(exc)
        return "refused"
    return "ran on its shard"


def test_a_layer_cplib_cannot_carry_raises_on_the_module_path(ranks):
    assert ranks(2).run(_refused) == ["refused", "refused"]
