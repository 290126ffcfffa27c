"""Where the handshake runs and how often (issue 29, step 2): its record
travels in host memory (over the group itself when it takes CPU tensors,
else over the CPU side group cplib.register_group makes), so a CUDA call
never waits for the GPU; and a fwd+bwd through autograd makes one handshake,
while a direct call of cplib_c::ring_sdpa_backward still makes its own.

No GPU is needed: an NCCL group is played by a gloo group that cplib is told
takes no CPU tensors, and the route (the group and the device of the buffer
the handshake chooses) is read back from the C++ side."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
import torch.distributed as dist

import cplib
from cplib.comm import native as _native
from cplib.comm.native import ops


def _route(group: dist.ProcessGroup) -> tuple[str, str]:
    via, device = ops.handshake_debug_route(group.group_name)
    return via, device


def _gloo_routes() -> list:
    world = dist.group.WORLD
    twin = dist.new_group(list(range(dist.get_world_size())))
    cplib.register_group(twin)  # takes CPU tensors: nothing to make
    cplib.ring_sdpa(torch.randn(1, 2, 4, 8), *[torch.randn(1, 2, 4, 8)] * 2, twin)
    return [_route(world), _route(twin), world.group_name]


def test_gloo_groups_handshake_on_the_host(ranks):
    for world, twin, world_name in ranks(2).run(_gloo_routes):
        assert world == (world_name, "cpu")
        # A second group over the same ranks meets the first one's handshakes.
        assert twin == (world_name, "cpu")


def _device_only(monkeypatch_targets, pgs):
    """Makes cplib treat ``pgs`` as groups that take no CPU tensors (NCCL);
    returns the function that undoes it."""
    real = _native.carries_host_tensors
    names = {pg.group_name for pg in pgs}

    def fake(pg):
        return False if pg.group_name in names else real(pg)

    for module in monkeypatch_targets:
        module.carries_host_tensors = fake

    def undo():
        for module in monkeypatch_targets:
            module.carries_host_tensors = real
        _native.forget_routes()
    return undo


def _nccl_like_routes() -> dict:
    n = dist.get_world_size()
    nccl, nccl_twin = dist.new_group(list(range(n))), dist.new_group(list(range(n)))
    undo = _device_only((_native,), (nccl, nccl_twin))
    out = {}
    try:
        _native.forget_routes()
        # No side group yet: the fallback, a GPU buffer, and a warning naming the cure.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _native.group_name_of(nccl)
        out["fallback"] = _route(nccl)
        out["warning"] = " ".join(str(w.message) for w in caught)
        # register_group makes one side group for the ranks; both groups use it.
        cplib.register_group(nccl)
        cplib.register_group(nccl_twin)  # the same ranks: no second group
        side = _native.side_group(tuple(range(n)))
        out["side"] = side.group_name
        out["side_backend"] = dist.get_backend(side)
        out["route"], out["twin_route"] = _route(nccl), _route(nccl_twin)
        # A real fwd+bwd on the group handshakes over the side group and computes.
        q = torch.randn(1, 2, 8, 4, requires_grad=True)
        ops.handshake_debug_count(True)
        out_, _ = cplib.ring_sdpa(q, q, q, nccl, is_causal=True)
        out_.sum().backward()
        out["count"] = ops.handshake_debug_count(False)
        # Ranks that pass different group objects still meet, and are told so.
        try:
            cplib.ring_sdpa(q.detach(), q.detach(), q.detach(),
                            nccl if dist.get_rank() == 0 else nccl_twin)
            out["mixed"] = ""
        except ValueError as exc:
            out["mixed"] = str(exc)
        # cplib keeps the side group's name, not the group: destroying it
        # frees it and joins its gloo workers (a group alive at interpreter
        # exit can abort it: tests/comm/test_exit_clean.py).
        gc.disable()
        try:
            freed = weakref.ref(side)
            dist.destroy_process_group(side)
            del side
            out["side_freed"] = freed() is None
        finally:
            gc.enable()
    finally:
        undo()
    return out


def test_device_only_group_handshakes_on_its_cpu_side_group(ranks):
    results = ranks(2).run(_nccl_like_routes)
    for r in results:
        via, device = r["fallback"]
        assert device == "cuda", r  # the documented fallback: a device buffer
        assert "cplib.register_group(group)" in r["warning"], r["warning"]
        assert r["side_backend"] == "gloo"
        assert r["route"] == (r["side"], "cpu"), r
        assert r["twin_route"] == (r["side"], "cpu"), r
        assert r["count"] == 1, r
        assert "different process groups" in r["mixed"], r["mixed"]
        assert r["side_freed"], "the side group outlived destroy_process_group()"
    assert results[0]["mixed"] == results[1]["mixed"]


def test_register_group_rejects_what_is_no_group():
    with pytest.raises(ValueError, match="cplib.register_group: expected a process group"):
        cplib.register_group(3)


# ---------------------------------------------------------------- one per fwd+bwd


def _handshakes_per_step(length_of_rank) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(rank)
    length = length_of_rank[rank]
    q, k, v = (torch.randn(1, 2, length, 8, requires_grad=True) for _ in range(3))
    causal = len(set(length_of_rank)) == 1
    ops.handshake_debug_count(True)
    out, lse = cplib.ring_sdpa(q, k, v, dist.group.WORLD, is_causal=causal)
    grad = torch.randn_like(out)
    out.backward(grad)
    through_autograd = ops.handshake_debug_count(True)
    # The public backward op, called directly, handshakes itself.
    dq, dk, dv = ops.ring_sdpa_backward(grad, q.detach(), k.detach(), v.detach(), out.detach(),
                                        lse, dist.group.WORLD.group_name, causal)
    direct = ops.handshake_debug_count(True)
    for mine, theirs in ((q.grad, dq), (k.grad, dk), (v.grad, dv)):
        torch.testing.assert_close(mine, theirs, atol=0, rtol=0)
    return {"autograd": through_autograd, "direct": direct}


@pytest.mark.parametrize("lengths", [(8, 8), (8, 6)], ids=["causal", "uneven-noncausal"])
def test_one_handshake_per_forward_and_backward(ranks, lengths):
    # Uneven non-causal shards: the backward takes the lengths its forward's
    # handshake learned (no all-gather of its own) and gives the same
    # gradients as the handshaking backward op.
    for r in ranks(2).run(_handshakes_per_step, lengths):
        assert r == {"autograd": 1, "direct": 1}, r


def _no_handshake_when_off() -> int:
    q = torch.randn(1, 2, 8, 4, requires_grad=True)
    ops.handshake_debug_count(True)
    with cplib.consistency_checks(False):
        out, _ = cplib.ring_sdpa(q, q, q, dist.group.WORLD, is_causal=True)
        out.sum().backward()
    return ops.handshake_debug_count(False)


def test_switched_off_makes_none(ranks):
    assert ranks(2).run(_no_handshake_when_off) == [0, 0]


def _handshakes_of_other_ops() -> dict:
    rank, world = dist.get_rank(), dist.group.WORLD
    torch.manual_seed(rank)
    counts = {}

    def count(step):
        ops.handshake_debug_count(True)
        step()
        return ops.handshake_debug_count(True)

    q, k, v = (torch.randn(1, 4, 8, 8, requires_grad=True) for _ in range(3))

    def ulysses():
        out, _ = cplib.ulysses_sdpa(q, k, v, world, is_causal=True)
        out.sum().backward()

    def flex():
        gk, gv = cplib.flex_cp_allgather(k, v, 2, world)
        (gk.sum() + gv.sum()).backward()

    x = torch.randn(1, 3, 8, 8, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, requires_grad=True)

    def conv():
        cplib.tp_conv(x, w, padding=1).sum().backward()

    for name, step in (("ulysses", ulysses), ("flex", flex), ("tp_conv", conv)):
        counts[name] = count(step)
    # The public backward ops, called directly, still handshake.
    counts["flex direct backward"] = count(lambda: ops.flex_cp_allgather_backward(
        torch.ones(1, 4, 16, 8), torch.ones(1, 4, 16, 8), 2, world.group_name))
    return counts


def test_one_handshake_per_forward_and_backward_of_other_ops(ranks):
    for r in ranks(2).run(_handshakes_of_other_ops):
        assert r == {"ulysses": 1, "flex": 1, "tp_conv": 1, "flex direct backward": 1}, r


def _ulysses_and_usp_handshakes() -> dict:
    """Handshake collectives of one fwd+bwd of Ulysses (4 ranks) and USP (2
    Ulysses x 2 ring ranks), causal and not, with equal and uneven lengths
    (non-causal joint streams: 8 and 6 rows within each Ulysses group)."""
    from cplib.ulysses.usp_layout import usp_groups

    rank, world = dist.get_rank(), dist.group.WORLD
    groups = usp_groups(world, 2)
    counts = {}
    for causal, uneven in ((True, False), (False, False), (False, True)):
        length = 6 if uneven and rank % 2 else 8
        torch.manual_seed(rank)
        q, k, v = (torch.randn(1, 4, length, 8, requires_grad=True) for _ in range(3))
        for name, run in (("ulysses", lambda: cplib.ulysses_sdpa(q, k, v, world,
                                                                 is_causal=causal)),
                          ("usp", lambda: cplib.usp_sdpa(q, k, v, groups.ulysses_group,
                                                         groups.ring_group, is_causal=causal))):
            ops.handshake_debug_count(True)
            out, _ = run()
            out.sum().backward()
            key = f"{name} {'causal' if causal else 'full'}{' uneven' if uneven else ''}"
            counts[key] = ops.handshake_debug_count(True)
    return counts


def test_one_handshake_per_group_per_forward_and_backward_of_ulysses_and_usp(ranks):
    # Ulysses: one, in its group (its non-causal calls used to make two: the
    # lengths' handshake and the exchange's). USP: one in its Ulysses group,
    # one in its ring group.
    for r in ranks(4).run(_ulysses_and_usp_handshakes):
        assert r == {"ulysses causal": 1, "usp causal": 2, "ulysses full": 1, "usp full": 2,
                     "ulysses full uneven": 1, "usp full uneven": 2}, r
