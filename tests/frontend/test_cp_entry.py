"""The front end's entry, on two gloo ranks (issue 34, section 3):

- ``context_parallel`` and ``_ContextParallel`` register their group (its
  CPU side group, on NCCL) before the first handshake: no "call
  cplib.register_group" warning for a group they register themselves. An
  NCCL group is played by a fresh gloo group that cplib is told takes no CPU
  tensors.
- An error of the runtime class agreed through the handshake reaches the
  user as ``RuntimeError: <message>``, the class named once (it read
  "RuntimeError: RuntimeError: cplib._ContextParallel: ...").
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

import cplib
from cplib.comm import native as _native


def _sdpa_style():
    return cplib._ContextParallel(seq_dim=2,
                                  attention_type=cplib._ContextParallel.AttentionType.SDPA)


def _nccl_like_mesh() -> tuple[DeviceMesh, object]:
    """A mesh over a fresh group that cplib takes for NCCL; and the undo."""
    group = dist.new_group(list(range(dist.get_world_size())))
    real = _native.carries_host_tensors
    sides = dict(_native.side_groups)
    _native.carries_host_tensors = lambda pg: pg.group_name != group.group_name and real(pg)

    def undo():
        # These ranks' processes are shared with other tests: no side group
        # made here outlives the test.
        _native.carries_host_tensors = real
        _native.side_groups.clear()
        _native.side_groups.update(sides)
        _native.forget_routes()
    return DeviceMesh.from_group(group, "cpu"), undo


def _warnings_on_entry() -> list[str]:
    """The "call cplib.register_group" warnings (and any error) of entering
    ``context_parallel`` and of a ``_ContextParallel`` module's forward."""
    messages = []
    for entry in ("context_parallel", "_ContextParallel"):
        mesh, undo = _nccl_like_mesh()
        q = torch.randn(1, 2, 8, 4)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                _enter(entry, mesh, q, messages)
        finally:
            undo()
        messages += [f"{entry}: {w.message}" for w in caught if "register_group" in str(w.message)]
    return messages


def _enter(entry: str, mesh, q, messages: list) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    try:
        if entry == "context_parallel":
            with cplib.context_parallel(mesh, buffers=[q], buffer_seq_dims=[2]):
                F.scaled_dot_product_attention(q, q, q, is_causal=True)
        else:
            attn = parallelize_module(Attention(), mesh, _sdpa_style())
            cplib._enable_context_parallel_dispatcher()
            try:
                attn(q, q, q)
            finally:
                cplib._disable_context_parallel_dispatcher()
    except Exception as exc:  # noqa: BLE001  (reported with the warnings)
        messages.append(f"{entry} raised {type(exc).__name__}: {exc}")


def test_no_register_group_warning_for_groups_cplib_registers(ranks):
    assert ranks(2).run(_warnings_on_entry) == [[], []]


def _runtime_error_message() -> str:
    from torch.distributed.tensor.parallel import parallelize_module

    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v)

    attn = parallelize_module(Attention(), DeviceMesh.from_group(dist.group.WORLD, "cpu"),
                              _sdpa_style())
    q = torch.randn(1, 2, 8, 4)
    cplib._disable_context_parallel_dispatcher()
    try:
        attn(q, q, q)
    except RuntimeError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_a_runtime_error_names_its_class_once(ranks):
    want = ("RuntimeError: cplib._ContextParallel: invalid input on every rank (rank 0's error): "
            "cplib: this module was parallelized with _ContextParallel but the context parallel "
            "dispatcher is off; call cplib._enable_context_parallel_dispatcher() first")
    assert ranks(2).run(_runtime_error_message) == [want, want]


def _nested(outer_balance: bool, inner_balance: bool, outer_s: int, inner_s: int) -> str:
    import cplib

    mesh = DeviceMesh("cpu", list(range(dist.get_world_size())))
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(1, 2, outer_s, 8, generator=g), torch.randn(1, 2, inner_s, 8, generator=g)
    with cplib.context_parallel(mesh, buffers=[x], buffer_seq_dims=[2],
                                load_balance=outer_balance) as outer:
        try:
            with cplib.context_parallel(mesh, buffers=[y], buffer_seq_dims=[2],
                                        load_balance=inner_balance):
                out = F.scaled_dot_product_attention(x, x, x, is_causal=True)
        except NotImplementedError as exc:
            return "refused" if "nested in another" in str(exc) else str(exc)
        (got,) = outer.unshard([out], [2])
    want = F.scaled_dot_product_attention(x, x, x, is_causal=True)  # x whole again
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    return "exact"


def test_nested_regions_run_in_one_layout_or_refuse(ranks):
    """Before, attention on the outer region's head-tail shards inside an
    inner sequential region ran in the inner layout: off by 0.852."""
    assert ranks(2).run(_nested, True, False, 32, 32) == ["refused"] * 2
    assert ranks(2).run(_nested, False, True, 32, 32) == ["refused"] * 2
    assert ranks(2).run(_nested, True, True, 32, 16) == ["exact"] * 2  # one layout, any length
    assert ranks(2).run(_nested, True, True, 32, 17) == ["refused"] * 2  # an odd inner length
