"""Ulysses: the all-to-all re-shard op and ulysses_sdpa against the full
computation in one process (fp64 reference): re-shard values, layouts and
round trips; out, lse, dq, dk, dv at world sizes 1, 2, 4, causal and not, GQA
with Hkv = 1, 2 and Hq, odd head dims; the bf16 drift criterion; the bytes
on the wire; opcheck; torch.compile; bad heads raising on every rank; and the
threaded group."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import cplib
from cplib.comm.native import ops
from cplib.ulysses.args import kv_head_repeat
from harness import assert_close
from ring_cases import (case_tensors, fused_sdpa, global_tensor, noncontiguous, reference,
                        shard_seq)

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def _world() -> tuple[int, int, str]:
    return dist.get_rank(), dist.get_world_size(), dist.group.WORLD.group_name


# ---------------------------------------------------------------- the re-shard op


def _check_reshard() -> int:
    rank, n, name = _world()
    count = 0
    for b, h, s_local, d, noncontig in ((2, 4, 3, 5, False), (1, 8, 4, 2, True),
                                        (3, 4, 1, 7, True)):
        full = global_tensor((b, h, s_local * n, d), torch.float64, b + h + d)
        x = shard_seq(full, rank, n, False)
        x = noncontiguous(x) if noncontig else x.contiguous()
        hn = h // n
        heads = ops.ulysses_reshard(x, name, True, 1)
        assert heads.shape == (b, hn, s_local * n, d)
        # sequence-major: the layout the exchange delivers
        assert heads.permute(2, 0, 1, 3).is_contiguous()
        assert torch.equal(heads, full[:, rank * hn:(rank + 1) * hn])
        back = ops.ulysses_reshard(heads, name, False, 1)
        assert back.shape == x.shape and back.permute(1, 0, 2, 3).is_contiguous()
        assert torch.equal(back, x)
        for t in (heads, back):
            assert t.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
        count += 1
    # Fewer heads than ranks: repeated to one head per rank, and back (summed).
    for h in [c for c in (1, 2) if n % c == 0 and c < n]:
        full = global_tensor((2, h, 3 * n, 4), torch.float64, 40 + h)
        x = shard_seq(full, rank, n, False).contiguous()
        rep = n // h
        heads = ops.ulysses_reshard(x, name, True, rep)
        assert torch.equal(heads, full[:, rank // rep:rank // rep + 1])
        summed = ops.ulysses_reshard(heads, name, False, rep)
        assert torch.equal(summed, rep * x)
        count += 1
    return count


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_reshard_values_layouts_and_round_trip(ranks, world_size):
    expected = 3 + {1: 0, 2: 1, 4: 2}[world_size]
    assert ranks(world_size).run(_check_reshard) == [expected] * world_size


# ---------------------------------------------------------------- ulysses_sdpa vs reference


def _run_case(dtype, is_causal, hq, hkv, d, b, s_local, noncontig, scale=None, seed=0) -> None:
    rank, n, name = _world()
    s = s_local * n
    q, k, v, cot, ref = case_tensors(dtype, b, hq, hkv, s, d, seed, is_causal=is_causal,
                                     scale=scale)

    def local(t):
        t = shard_seq(t, rank, n, False)
        return noncontiguous(t) if noncontig else t.clone()

    ql, kl, vl = (local(t).requires_grad_(True) for t in (q, k, v))
    out, lse = cplib.ulysses_sdpa(ql, kl, vl, name if seed % 2 else dist.group.WORLD,
                                  is_causal=is_causal, scale=scale)
    out.backward(shard_seq(cot, rank, n, False))
    what = (f"{dtype} causal={is_causal} hq={hq} hkv={hkv} d={d} b={b} s_local={s_local} "
            f"noncontig={noncontig} scale={scale} n={n}")
    assert out.dtype == dtype and out.shape == ql.shape, what
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32), what
    assert lse.shape == (b, hq, s_local) and lse.is_contiguous(), what
    tol = TOL[dtype]
    for label, got, want in (("out", out, ref[0]), ("lse", lse, ref[1]), ("dq", ql.grad, ref[2]),
                             ("dk", kl.grad, ref[3]), ("dv", vl.grad, ref[4])):
        assert_close(got.double(), shard_seq(want, rank, n, False), atol=tol, rtol=tol,
                     what=f"{label} [{what}]")


def _matrix(world_size: int) -> list[tuple]:
    """Causal and not x (fp64, fp32) x GQA Hkv in (1, 2, Hq), with head dims
    (odd ones included), batch, length and layout varying across cases."""
    dims, cases = [5, 16, 33], []
    for i, (dtype, causal, hkv) in enumerate(itertools.product(
            (torch.float64, torch.float32), (False, True), (1, 2, 4))):
        hq = 8 if i % 4 == 3 else 4
        hkv = hq if hkv == 4 else hkv
        cases.append((dtype, causal, hq, hkv, dims[i % 3], 1 + i % 2, [3, 4, 5][i % 3],
                      i % 3 == 1))
    return cases


def _check_matrix() -> int:
    cases = _matrix(dist.get_world_size())
    for seed, case in enumerate(cases):
        _run_case(*case, seed=seed)
    _run_case(torch.float64, True, 4, 2, 8, 1, 2, False, scale=0.3, seed=99)  # scale honoured
    return len(cases) + 1


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_ulysses_sdpa_matches_full_sequence_reference(ranks, world_size):
    assert ranks(world_size).run(_check_matrix) == [13] * world_size


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    sums = torch.stack([(got.double() - want).pow(2).sum(), want.pow(2).sum()])
    dist.all_reduce(sums)
    return (sums[0] / sums[1]).sqrt().item()


def _check_bf16_drift() -> list[str]:
    rank, n, name = _world()
    report = []
    for causal, hkv in ((True, 4), (False, 2), (True, 1)):
        b, hq, s, d = 2, 4, 32 * n, 32
        q, k, v, cot = (global_tensor((b, h, s, d), torch.bfloat16, 10 + i)
                        for i, h in enumerate((hq, hkv, hkv, hq)))
        ref = reference(q, k, v, cot, is_causal=causal, scale=None)
        qs, ks, vs = (t.clone().requires_grad_(True) for t in (q, k, v))
        single_out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal,
                                                    enable_gqa=True)
        single_out.backward(cot)
        ql, kl, vl = (shard_seq(t, rank, n, False).clone().requires_grad_(True) for t in (q, k, v))
        out, _ = cplib.ulysses_sdpa(ql, kl, vl, name, is_causal=causal)
        out.backward(shard_seq(cot, rank, n, False))
        for label, got, sgl, want in zip(("out", "dq", "dk", "dv"),
                                         (out, ql.grad, kl.grad, vl.grad),
                                         (single_out.detach(), qs.grad, ks.grad, vs.grad),
                                         (ref[0],) + ref[2:]):
            err = _rel_err(got, shard_seq(want, rank, n, False))
            single_err = _rel_err(shard_seq(sgl, rank, n, False), shard_seq(want, rank, n, False))
            report.append(f"{label} causal={causal} hkv={hkv}: ulysses {err:.3e} "
                          f"single {single_err:.3e}")
            assert err <= 1.5 * single_err, report[-1]
    return report


def test_ulysses_sdpa_bf16_error_within_single_device(ranks):
    print("\n".join(ranks(4).run(_check_bf16_drift)[0]))


# ---------------------------------------------------------------- bytes on the wire


def _check_bytes() -> dict:
    rank, n, name = _world()
    b, hq, s_local, d = 2, 4, 6, 8
    got = {}
    for hkv in (1, 2, 4):
        q = torch.randn(b, hq, s_local, d, requires_grad=True)
        k = torch.randn(b, hkv, s_local, d, requires_grad=True)
        v = torch.randn(b, hkv, s_local, d, requires_grad=True)
        dist.barrier()
        ops.ulysses_debug_bytes_sent(True)
        out, _ = cplib.ulysses_sdpa(q, k, v, name, is_causal=True)
        fwd = ops.ulysses_debug_bytes_sent(True)
        out.sum().backward()
        bwd = ops.ulysses_debug_bytes_sent(True)
        shard = b * s_local * d * 4  # one head of one shard, float32
        kv_heads = hkv * kv_head_repeat(hkv, n)  # heads on the wire
        part = (n - 1) / n
        # forward: q, k, v in, out and lse back; backward: grad_out in, dq, dk, dv back
        assert fwd == part * (2 * hq + 2 * kv_heads) * shard + part * b * hq * s_local * 4, fwd
        assert bwd == part * (2 * hq + 2 * kv_heads) * shard, bwd
        got[hkv] = (fwd, bwd)
    return got


@pytest.mark.parametrize("world_size", [2, 4])
def test_ulysses_bytes_match_the_formula(ranks, world_size):
    ranks(world_size).run(_check_bytes)


# ---------------------------------------------------------------- opcheck and compile


def _check_opcheck() -> int:
    rank, n, name = _world()
    count = 0
    for b, h, s_local, d, rep, noncontig in ((2, 4, 3, 5, 1, False), (1, 4, 2, 8, 1, True)):
        x = global_tensor((b, h, s_local, d), torch.float64, count).requires_grad_(True)
        if noncontig:
            x = noncontiguous(x.detach()).requires_grad_(True)
        torch.library.opcheck(ops.ulysses_reshard.default, (x, name, True, rep))
        y = global_tensor((b, h // n, s_local * n, d), torch.float64, 7).requires_grad_(True)
        torch.library.opcheck(ops.ulysses_reshard.default, (y, name, False, rep))
        count += 1
    if n > 1:  # repeated heads, both ways
        x = global_tensor((2, 1, 3, 4), torch.float64, 3).requires_grad_(True)
        torch.library.opcheck(ops.ulysses_reshard.default, (x, name, True, n))
        y = global_tensor((2, 1, 3 * n, 4), torch.float64, 4).requires_grad_(True)
        torch.library.opcheck(ops.ulysses_reshard.default, (y, name, False, n))
        count += 1
    for causal, hq, hkv in ((True, 4, 2), (False, 2, 2)):
        q, k, v = (global_tensor((2, h, 6, 8), torch.float64, i).requires_grad_(True)
                   for i, h in enumerate((hq, hkv, hkv)))
        args = (causal, 0.5, "auto")
        torch.library.opcheck(ops.ulysses_local_sdpa.default, (q, k, v, *args))
        with torch.no_grad():
            out, lse = ops.ulysses_local_sdpa(q, k, v, *args)
        go = torch.randn_like(out)
        torch.library.opcheck(ops.ulysses_local_sdpa_backward.default,
                              (go, q.detach(), k.detach(), v.detach(), out, lse, *args))
        count += 1
    return count


@pytest.mark.parametrize("world_size", [1, 2])
def test_ulysses_opcheck(ranks, world_size):
    assert ranks(world_size).run(_check_opcheck) == [2 + (world_size > 1) + 2] * world_size


def _attend(q, k, v, group_name, causal):
    out, lse = cplib.ulysses_sdpa(q, k, v, group_name, is_causal=causal)
    return out * 2.0, lse


def _check_compile() -> int:
    rank, n, name = _world()
    torch._dynamo.reset()
    count = 0
    for backend, causal, hkv in (("aot_eager", True, 2), ("aot_eager", False, 1),
                                 ("aot_eager", True, 4), ("inductor", True, 2)):
        inputs = [global_tensor((2, h, 4 * n, 8), torch.float32, 30 + i)
                  for i, h in enumerate((4, hkv, hkv))]
        eager = [shard_seq(t, rank, n, False).clone().requires_grad_(True) for t in inputs]
        comp = [t.detach().clone().requires_grad_(True) for t in eager]
        want, want_lse = _attend(*eager, name, causal)
        want.sum().backward()
        fn = torch.compile(_attend, backend=backend, fullgraph=True)
        got, got_lse = fn(*comp, name, causal)
        got.sum().backward()
        what = f"{backend} causal={causal} hkv={hkv}"
        assert_close(got, want, atol=1e-5, rtol=1e-5, what=f"out {what}")
        assert_close(got_lse, want_lse, atol=1e-5, rtol=1e-5, what=f"lse {what}")
        for label, a, e in zip("qkv", comp, eager):
            assert_close(a.grad, e.grad, atol=1e-5, rtol=1e-5, what=f"d{label} {what}")
        count += 1
    return count


def test_ulysses_compile_fullgraph(ranks):
    assert ranks(2).run(_check_compile) == [4, 4]


# ---------------------------------------------------------------- bad input


def _check_bad_heads() -> list[str]:
    rank, n, name = _world()
    messages = []
    for hq, hkv in ((6, 6), (4, 3), (12, 3), (2, 2)):
        q = torch.randn(1, hq, 4, 8)
        k = v = torch.randn(1, hkv, 4, 8)
        try:
            cplib.ulysses_sdpa(q, k, v, name)
        except ValueError as exc:
            messages.append(str(exc))
        else:
            raise AssertionError(f"hq={hq} hkv={hkv} at degree {n} did not raise")
    with pytest.raises(ValueError, match="heads cannot be split over the Ulysses degree 4"):
        ops.ulysses_reshard(torch.randn(1, 6, 2, 4), name, True, 1)
    with pytest.raises(ValueError, match="is_causal needs equal"):
        cplib.ulysses_sdpa(torch.randn(1, 4, 4, 8), torch.randn(1, 4, 3, 8),
                           torch.randn(1, 4, 3, 8), name, is_causal=True)
    # nothing hangs: the group still works afterwards
    out, _ = cplib.ulysses_sdpa(*(torch.randn(1, 4, 2, 8) for _ in range(3)), name)
    assert out.shape == (1, 4, 2, 8)
    return messages


def test_ulysses_bad_heads_raise_on_every_rank(ranks):
    per_rank = ranks(4).run(_check_bad_heads)
    assert all(m == per_rank[0] for m in per_rank)
    assert "6 query heads cannot be split over the Ulysses degree 4" in per_rank[0][0]
    assert "3 heads" in per_rank[0][1]
    assert "3 key/value heads cannot be split over the Ulysses degree 4" in per_rank[0][2]
    assert "2 query heads" in per_rank[0][3]


def _check_mismatched_lengths() -> str:
    """Ranks passing different shard lengths: non-causal attention accepts
    them (joint text+image shards); causal attention raises on every rank,
    check mode or not, and nothing hangs."""
    rank, n, name = _world()
    q = torch.randn(1, 4, 2 + rank, 8)
    out, _ = cplib.ulysses_sdpa(q, q, q, name)
    assert out.shape == q.shape
    with cplib.consistency_checks():
        with pytest.raises(ValueError, match=r"ranks disagree on q\.size\(2\) "
                                             r"\(rank 0: 2, rank 1: 3\)") as info:
            cplib.ulysses_sdpa(q, q, q, name, is_causal=True)
    return str(info.value)


def test_ulysses_check_mode_mismatched_lengths_raise_on_every_rank(ranks):
    messages = ranks(2).run(_check_mismatched_lengths)
    assert messages[0] == messages[1]


# ---------------------------------------------------------------- threaded group


def _check_threaded() -> int:
    _run_case(torch.float64, True, 4, 1, 8, 2, 3, True, seed=5)
    _run_case(torch.float32, False, 4, 4, 16, 1, 4, False, seed=6)
    return 2


@pytest.mark.parametrize("world_size", [2, 4])
def test_ulysses_sdpa_threaded_group(threaded, world_size):
    assert threaded(world_size, _check_threaded) == [2] * world_size


# ---------------------------------------------------------------- CUDA (threaded group)


def _check_cuda(dtype: torch.dtype, backend: str) -> list[str]:
    # Runs in rank threads: kernels are named (fused_sdpa, backend=), never
    # chosen through SDPA's process-global flags.
    rank, n, name = _world()
    dev = torch.device("cuda", 0)
    report = []
    for causal, hkv in ((True, 4), (False, 2), (True, 1)):
        b, hq, s, d = 2, 4, 128 * n, 64
        q, k, v, cot = (global_tensor((b, h, s, d), dtype, 20 + i)
                        for i, h in enumerate((hq, hkv, hkv, hq)))
        ref = reference(q, k, v, cot, is_causal=causal, scale=None)
        qs, ks, vs = (t.to(dev).requires_grad_(True) for t in (q, k, v))
        kx, vx = (t.repeat_interleave(hq // hkv, dim=1) for t in (ks, vs))
        fused_sdpa(qs, kx, vx, is_causal=causal, backend=backend).backward(cot.to(dev))
        ql, kl, vl = (shard_seq(t, rank, n, False).to(dev).requires_grad_(True)
                      for t in (q, k, v))
        out, lse = cplib.ulysses_sdpa(ql, kl, vl, name, is_causal=causal, backend=backend)
        out.backward(shard_seq(cot, rank, n, False).to(dev))
        torch.cuda.synchronize()
        assert torch.allclose(lse.cpu().double(), shard_seq(ref[1], rank, n, False), atol=2e-2)
        single = [qs.grad.cpu(), ks.grad.cpu(), vs.grad.cpu()]
        for label, got, sgl, want in zip(("dq", "dk", "dv"), (ql.grad, kl.grad, vl.grad),
                                         single, ref[2:]):
            err = _rel_err(got.cpu(), shard_seq(want, rank, n, False))
            single_err = _rel_err(shard_seq(sgl, rank, n, False), shard_seq(want, rank, n, False))
            report.append(f"{dtype} {backend} {label} causal={causal} hkv={hkv}: ulysses "
                          f"{err:.3e} single {single_err:.3e}")
            assert err <= 1.5 * single_err, report[-1]
        out_err = _rel_err(out.cpu(), shard_seq(ref[0], rank, n, False))
        assert out_err < 2e-2, (backend, causal, hkv, out_err)
    return report


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("backend", ["flash", "efficient", "cudnn"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ulysses_sdpa_cuda_threaded(threaded, world_size, backend, dtype):
    print("\n".join(threaded(world_size, _check_cuda, dtype, backend)[0]))
