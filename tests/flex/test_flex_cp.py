"""Flex-attention context parallelism through the all-gather
(``set_rotate_method("allgather")``, torch's prototype path; the flex ring is
test_flex_ring*.py) on 2 gloo ranks (CPU, fp32) against
``torch.compile(flex_attention)`` on the full sequence in one process.

What is compared (atol 2e-6, rtol 1e-5): outputs, lse and the gradients of
q, k and v. torch cannot give all of these from its inductor CPU kernel, which
is forward-only and refuses ``return_lse``; so

* outputs, lse and gradients are compared with both sides compiled by
  ``torch.compile(..., backend="aot_eager", fullgraph=True)``, which runs
  flex's own (dense) implementation. torch's ``flex_attention`` refuses any
  CPU input that requires grad (``flex_attention._validate_device``) although
  that implementation differentiates fine, so these checks lift that one
  guard inside the rank processes (``_cpu_flex_grads``);
* outputs of the inductor (fused, block-sparse CPU template) kernel are
  compared with both sides compiled by inductor, which is also what checks
  that the sharded BlockMask's block lists are used correctly;
* the sharded BlockMask's element mask and its partial/full block lists are
  compared exactly with those derived from the full mask.

Cases. The CP model (an nn.Module whose attention submodule is parallelized
with ``_ContextParallel(seq_dim=2, AttentionType.FLEX)``) always runs under
``torch.compile(fullgraph=True)``, one compiled model per process, so a graph
break fails every case; inputs and BlockMasks are sharded by
``_context_parallel_shard``.

======================  =======================================  ==========================
mask                    CPLIB_QUICK_TESTS=1                      the default run adds
======================  =======================================  ==========================
causal, B=1             S in {512, 2048} x {none, head-tail,     -
                        PTRR}
document, 28 random     B=2, S=512 x {none, head-tail, PTRR}     (B, S) in {(2, 512),
docs, any length                                                 (4, 2048), (8, 512)} x the same
document, 28 random     B=2, S=512 x per-doc head-tail;          (B, S) in the same x
docs, lengths k*2*ws    B=4, S=2048 x all four balancers         all four
sliding-window causal   S=512 x {none, head-tail, PTRR}          -
GQA, 4 q / 2 kv heads   causal S=512 x {none, head-tail}         -
inductor forward        causal S=512 head-tail; document B=2     every balancer of causal
                        S=512 PTRR and per-doc head-tail         S=512, document B=2 S=512,
                                                                 GQA head-tail
compiled mask builder   causal S=512 head-tail                   -
S=128 errors            none, head-tail, PTRR                    -
world sizes 1 / 4       ws=1: causal S=512 x {none, head-tail,   ws=4: the same
                        PTRR}
======================  =======================================  ==========================

Also: torch's pre-hook passes every non-K/V argument through untouched,
the parallelized module gets its own (a sharded mask as its stand-in), and
the compiled CP model is exactly one graph containing cplib's all-gather.
The default run is the flex CP acceptance matrix (every batch size and
length of it, not every pair: about a minute on an idle 2-core machine);
``CPLIB_QUICK_TESTS=1`` runs only the left column.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import parallelize_module
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, create_mask

import cplib
from cplib import (
    _context_parallel_shard,
    _ContextParallel,
    _create_cp_block_mask,
    _HeadTailLoadBalancer,
)
from flex_cases import (FlexAttention, balancer, causal, cp_model, cpu_flex_grads,
                        document_causal, document_lengths, mesh, rotate, sliding_window)
from harness import assert_close

WORLD = 2
FULL = os.environ.get("CPLIB_QUICK_TESTS") != "1"
HEADS, DIM = 2, 16
TOL = dict(atol=2e-6, rtol=1e-5)
ALL_LB = ("none", "head_tail", "per_document_head_tail", "ptrr")


_per_process: dict[str, object] = {}

def _compiled(name: str, backend: str):
    """One compiled function per (role, backend) and process: every case reuses
    dynamo's cache, so equal shapes and masks never compile twice."""
    key = f"{name}/{backend}"
    if key not in _per_process:
        module = cp_model() if name == "cp" else FlexAttention()
        _per_process[key] = torch.compile(module, backend=backend, fullgraph=True, dynamic=False)
    return _per_process[key]


def _randn(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ checks


def _blocks_to_dense(num_blocks: torch.Tensor, indices: torch.Tensor,
                     num_cols: int) -> torch.Tensor:
    """A BlockMask's (num_blocks, indices) lists as a dense (..., rows, num_cols)
    bool map: each row's first num_blocks indices are its blocks. Written here
    because torch's private helper for it changed signature between releases."""
    valid = torch.arange(indices.shape[-1]) < num_blocks.unsqueeze(-1)
    cols = torch.where(valid, indices.long(), num_cols)  # invalid entries go to a spare column
    dense = torch.zeros(*indices.shape[:-1], num_cols + 1, dtype=torch.bool)
    return dense.scatter_(-1, cols, True)[..., :num_cols]


def _check_mask_structure(cp_mask, mask_mod, B: int, S: int, idx: torch.Tensor | None) -> None:
    """The sharded mask equals the full mask with rows/columns rearranged and
    this rank's rows kept, element by element and block list by block list."""
    rank, n = dist.get_rank(), dist.get_world_size()
    full = create_mask(mask_mod, B, 1, S, S, device="cpu")[:, 0]  # (B, S, S)
    if idx is not None:
        rows = idx.expand(B, S)
        full = torch.gather(full, 1, rows.unsqueeze(-1).expand(B, S, S))
        full = torch.gather(full, 2, rows.unsqueeze(1).expand(B, S, S))
    want = full[:, rank * S // n:(rank + 1) * S // n]
    got = create_mask(cp_mask.mask_mod, B, 1, S // n, S, device="cpu")[:, 0]
    assert torch.equal(got, want), "sharded mask_mod disagrees with the rearranged full mask"
    qb, kb = cp_mask.BLOCK_SIZE
    blocks = want.view(B, S // n // qb, qb, S // kb, kb)
    any_b, all_b = blocks.any(4).any(2), blocks.all(4).all(2)
    partial = _blocks_to_dense(cp_mask.kv_num_blocks, cp_mask.kv_indices, S // kb)[:, 0]
    fullb = _blocks_to_dense(cp_mask.full_kv_num_blocks, cp_mask.full_kv_indices, S // kb)[:, 0]
    assert torch.equal(fullb, all_b), "full-block list of the sharded mask is wrong"
    assert torch.equal(partial, any_b & ~all_b), "partial-block list of the sharded mask is wrong"


def _reference(q, k, v, block_mask, gqa: bool, cot_out, cot_lse):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out, aux = _compiled("full", "aot_eager")(q, k, v, block_mask=block_mask, enable_gqa=gqa,
                                               return_aux=AuxRequest(lse=True))
    torch.autograd.backward([out, aux.lse], [cot_out, cot_lse])
    return [t.detach() for t in (out, aux.lse, q.grad, k.grad, v.grad)]


def _case_name(mask_kind: str, B: int, S: int, lb: str, heads: tuple[int, int]) -> str:
    return f"{mask_kind} B={B} S={S} lb={lb} heads={heads[0]}/{heads[1]}"


def _check_config(mask_kind: str, B: int, S: int, balancers: tuple[str, ...],
                  inductor: tuple[str, ...] = (), heads: tuple[int, int] = (HEADS, HEADS),
                  compiled_mask_builder: tuple[str, ...] = ()) -> list[str]:
    """Runs every balancer of one (mask, B, S) on this rank; returns what it checked."""
    torch.manual_seed(0)
    cp_mesh = mesh()
    lengths = None
    if mask_kind == "causal":
        mask_mod = causal
    elif mask_kind == "sliding_window":
        mask_mod = sliding_window(S // 5)
    else:  # document: arbitrary lengths, or multiples of 2 * world for per-document head-tail
        unit = 2 * dist.get_world_size() if mask_kind == "document_chunked" else 1
        lengths = document_lengths(B, S, 28, unit, seed=S + B + unit)
        mask_mod = document_causal(lengths)
    q_heads, kv_heads = heads
    gqa = q_heads != kv_heads
    q = _randn((B, q_heads, S, DIM), 1)
    k, v = _randn((B, kv_heads, S, DIM), 2), _randn((B, kv_heads, S, DIM), 3)
    cot_out, cot_lse = _randn((B, q_heads, S, DIM), 4), _randn((B, q_heads, S), 5)
    full_mask = create_block_mask(mask_mod, B, 1, S, S, device="cpu")
    done = []
    with cpu_flex_grads(), rotate("allgather"):
        ref = _reference(q, k, v, full_mask, gqa, cot_out, cot_lse)
        for kind in balancers:
            lb = balancer(kind, S, full_mask, lengths)
            # The compiled mask builder is slow to compile on CPU: a few cases use it,
            # the rest run it eagerly.
            stance = "default" if kind in compiled_mask_builder else "force_eager"
            with torch.compiler.set_stance(stance):
                *inputs, cp_mask = _context_parallel_shard(
                    cp_mesh, [q, k, v, cot_out, cot_lse, full_mask], [2, 2, 2, 2, 2, 0], lb)
            lq, lk, lv, l_cot_out, l_cot_lse = inputs
            _check_mask_structure(cp_mask, mask_mod, B, S,
                                  lb._generate_indices() if lb is not None else None)
            for t in (lq, lk, lv):
                t.requires_grad_(True)
            out, aux = _compiled("cp", "aot_eager")(lq, lk, lv, block_mask=cp_mask,
                                                     enable_gqa=gqa,
                                                     return_aux=AuxRequest(lse=True))
            torch.autograd.backward([out, aux.lse], [l_cot_out, l_cot_lse])
            want = cplib.shard(cp_mesh, ref, [2] * len(ref), lb)
            what = _case_name(mask_kind, B, S, kind, heads)
            for name, got, exp in zip(("out", "lse", "dq", "dk", "dv"),
                                      (out, aux.lse, lq.grad, lk.grad, lv.grad), want):
                assert_close(got.detach(), exp, what=f"{what}: {name}", **TOL)
            done.append(what)
            if kind in inductor:
                ref_out = _compiled("full", "inductor")(q, k, v, block_mask=full_mask,
                                                        enable_gqa=gqa)
                got = _compiled("cp", "inductor")(*(t.detach() for t in (lq, lk, lv)),
                                                  block_mask=cp_mask, enable_gqa=gqa)
                exp, = cplib.shard(cp_mesh, [ref_out], [2], lb)
                assert_close(got, exp, what=f"{what}: inductor out", **TOL)
                done.append(what + " inductor")
    return done


def _check_small_sequence_errors(kinds: tuple[str, ...]) -> list[str]:
    """S=128 at world size 2 leaves one 128-block per mask: refused with
    torch's messages, before anything is communicated. As in torch,
    ``_context_parallel_shard`` asks the balancer first (so PTRR reports its
    own limit), ``_create_cp_block_mask`` checks Q_LEN first."""
    cp_mesh = mesh()
    full_mask = create_block_mask(causal, 1, 1, 128, 128, device="cpu")
    msgs = []
    for kind in kinds:
        # PTRR's exact wording is checked by test_small_sequence_ptrr_message.
        pattern = "divisible by group_size" if kind == "ptrr" else "Q_LEN 128 is not divisible"
        lb = balancer(kind, 128, full_mask, None)
        with pytest.raises(NotImplementedError, match="Q_LEN 128 is not divisible"):
            _create_cp_block_mask(causal, 1, 1, 128, 128, cp_mesh, lb)
        with pytest.raises(NotImplementedError, match=pattern) as info:
            _context_parallel_shard(cp_mesh, [torch.zeros(1, 1, 128, 4), full_mask], [2, 0], lb)
        msgs.append(str(info.value))
    return msgs


def _check_block_size_and_bad_input() -> int:
    """The block size is a parameter (here the mask's own 64-blocks make S=128
    shardable); bad arguments are ValueErrors naming the value."""
    cp_mesh = mesh()
    small = create_block_mask(causal, 1, 1, 128, 128, device="cpu", BLOCK_SIZE=64)
    for kind in ("none", "head_tail", "ptrr"):
        lb = balancer(kind, 128, small, None)
        with torch.compiler.set_stance("force_eager"):
            cp_mask, = _context_parallel_shard(cp_mesh, [small], [0], lb)
            direct = _create_cp_block_mask(causal, 1, 1, 128, 128, cp_mesh, lb, block_size=64)
        for m in (cp_mask, direct):
            assert m.BLOCK_SIZE == (64, 64) and m.seq_lengths == (64, 128)
            _check_mask_structure(m, causal, 1, 128,
                                  lb._generate_indices() if lb is not None else None)
    with torch.compiler.set_stance("force_eager"):
        rect = _create_cp_block_mask(causal, 1, 1, 256, 256, cp_mesh, block_size=(64, 32))
    assert rect.BLOCK_SIZE == (64, 32) and rect.seq_lengths == (128, 256)
    for bad in (0, (64,), (64, -1), "64"):
        with pytest.raises(ValueError, match="block_size"):
            _create_cp_block_mask(causal, 1, 1, 256, 256, cp_mesh, block_size=bad)
    with pytest.raises(ValueError, match=r"shape \(1, 512\).*\(1, 256\)"):
        _create_cp_block_mask(causal, 1, 1, 256, 256, cp_mesh, _HeadTailLoadBalancer(512, 2, "cpu"))
    with pytest.raises(ValueError, match=r"KV_LEN \(512\) must equal Q_LEN \(256\)"):
        _create_cp_block_mask(causal, 1, 1, 256, 512, cp_mesh, _HeadTailLoadBalancer(256, 2, "cpu"))
    return 1


# ------------------------------------------------------------------ tests

# (mask, B, S, balancers, those also run with inductor, those sharded by the
# compiled create_block_mask)
CAUSAL_CASES = [
    ("causal", 1, 512, ("none", "head_tail", "ptrr"),
     ("none", "head_tail", "ptrr") if FULL else ("head_tail",), ("head_tail",)),
    ("causal", 1, 2048, ("none", "head_tail", "ptrr"), (), ()),
]
DOC_CASES = (
    [(kind, B, S, lbs, lbs if (B, S) == (2, 512) else (), ())
     for B, S in ((2, 512), (4, 2048), (8, 512))
     for kind, lbs in (("document", ("none", "head_tail", "ptrr")), ("document_chunked", ALL_LB))]
    if FULL else
    [("document", 2, 512, ("none", "head_tail", "ptrr"), ("ptrr",), ()),
     ("document_chunked", 2, 512, ("per_document_head_tail",), ("per_document_head_tail",), ()),
     ("document_chunked", 4, 2048, ALL_LB, (), ())]
)


def _run(pool, mask_kind, B, S, lbs, inductor=(), compiled=(), heads=(HEADS, HEADS)) -> None:
    done = pool.run(_check_config, mask_kind, B, S, lbs, inductor, heads, compiled)
    world = len(done)
    want = []
    for lb in lbs:
        want.append(_case_name(mask_kind, B, S, lb, heads))
        if lb in inductor:
            want.append(want[-1] + " inductor")
    assert done == [want] * world


@pytest.mark.parametrize("case", CAUSAL_CASES + DOC_CASES, ids=lambda c: f"{c[0]}-B{c[1]}-S{c[2]}")
def test_flex_cp_matches_full_sequence(ranks, case):
    _run(ranks(WORLD), *case)


def test_flex_cp_sliding_window_and_gqa(ranks):
    pool = ranks(WORLD)
    _run(pool, "sliding_window", 1, 512, ("none", "head_tail", "ptrr"))
    gqa_inductor = ("head_tail",) if FULL else ()
    _run(pool, "causal", 1, 512, ("none", "head_tail"), gqa_inductor, heads=(4, 2))  # 2 KV groups


@pytest.mark.parametrize("world_size", [1, 4] if FULL else [1])
def test_flex_cp_other_world_sizes(ranks, world_size):
    """World size 2 is the point; 1 (and 4 unless CPLIB_QUICK_TESTS=1: four
    more rank processes cost about a minute here) run one causal case each."""
    _run(ranks(world_size), "causal", 1, 512, ("none", "head_tail", "ptrr"))


def test_small_sequence_raises_not_implemented(ranks):
    msgs = ranks(WORLD).run(_check_small_sequence_errors, ("none", "head_tail", "ptrr"))
    assert msgs[0] == msgs[1] and len(msgs[0]) == 3


def test_small_sequence_ptrr_message(ranks):
    msg, = ranks(WORLD).run(_check_small_sequence_errors, ("ptrr",))[0]
    assert "must be divisible by group_size" in msg, msg


def test_block_size_parameter_and_bad_input(ranks):
    assert ranks(WORLD).run(_check_block_size_and_bad_input) == [1, 1]


def _check_hook_arguments() -> int:
    """torch's pre-hook (``flex_input_fn``): q/k/v positionally or by
    keyword; every other argument passes as the very same object; K/V come
    back gathered and unexpanded (GQA). The parallelized module itself gets
    its arguments as given, but for a sharded BlockMask, whose stand-in
    (holding the mask) it gets for the call."""
    from cplib.flex.stand_in import real_mask

    rank, n = dist.get_rank(), dist.get_world_size()

    class Probe(nn.Module):
        def forward(self, *args, **kwargs):
            return args, kwargs

    style = _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX)
    probe = parallelize_module(Probe(), mesh(), style)
    q = _randn((1, 4, 8, 4), 1)
    k_full, v_full = _randn((1, 2, 8 * n, 4), 2), _randn((1, 2, 8 * n, 6), 3)
    k, v = k_full.chunk(n, 2)[rank], v_full.chunk(n, 2)[rank]
    mask = create_block_mask(causal, 1, 1, 8 * n, 8 * n, device="cpu", BLOCK_SIZE=8)
    score_mod, scale = (lambda s, b, h, qi, ki: s), 0.5
    opts, aux = {"BACKEND": "AUTO"}, AuxRequest(lse=True)
    rest = (score_mod, mask, scale, True, False, opts)
    calls = [
        ((q, k, v, *rest), {"return_aux": aux}),
        ((q,), {"key": k, "value": v, "score_mod": score_mod, "block_mask": mask,
                "enable_gqa": True, "return_aux": aux}),
        ((), {"query": q, "key": k, "value": v, "scale": scale, "return_lse": False}),
        ((q, k), {"value": v, "kernel_options": opts}),
    ]
    for args, kwargs in calls:
        got_args, got_kwargs = style.flex_input_fn(None, args, kwargs, mesh())
        assert len(got_args) == len(args) and set(got_kwargs) == set(kwargs)
        get = lambda i, name: got_args[i] if i < len(args) else got_kwargs[name]
        assert get(0, "query") is q
        assert torch.equal(get(1, "key"), k_full) and torch.equal(get(2, "value"), v_full)
        for i, a in enumerate(args[3:], start=3):
            assert got_args[i] is a, f"positional argument {i} was replaced"
        for name, a in kwargs.items():
            if name not in ("query", "key", "value"):
                assert got_kwargs[name] is a, f"keyword {name} was replaced"
    for bad, name in (((q, k), "value"), ((q, None, v), "key")):
        with pytest.raises(ValueError, match=f"`{name}`"):
            style.flex_input_fn(None, bad, {}, mesh())
    with torch.compiler.set_stance("force_eager"):
        sharded, = _context_parallel_shard(mesh(), [mask], [0])
    got_args, got_kwargs = probe(q, k, v, sharded, scale=scale, masks={"a": [sharded]})
    assert all(a is b for a, b in zip(got_args[:3], (q, k, v))) and got_kwargs["scale"] is scale
    for stand_in in (got_args[3], got_kwargs["masks"]["a"][0]):
        assert real_mask(stand_in.mask_mod) is sharded, "the module got the sharded mask itself"
    with pytest.raises(ValueError, match="cplib did not shard"):
        probe(q, k, v, mask)
    return len(calls)


def test_hook_passes_arguments_through(ranks):
    assert ranks(WORLD).run(_check_hook_arguments) == [4, 4]


def _check_fullgraph_no_graph_break() -> int:
    """The CP module compiles to exactly one graph holding cplib's all-gather."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(cp_model(), backend=counter, fullgraph=True)
    S = 512
    full_mask = create_block_mask(causal, 1, 1, S, S, device="cpu")
    lb = _HeadTailLoadBalancer(S, WORLD, "cpu")
    tensors = [_randn((1, HEADS, S, DIM), seed) for seed in (1, 2, 3)]
    with torch.compiler.set_stance("force_eager"):
        q, k, v, mask = _context_parallel_shard(mesh(), [*tensors, full_mask], [2, 2, 2, 0], lb)
    with cpu_flex_grads(), rotate("allgather"):
        q.requires_grad_(True)
        out, aux = compiled(q, k, v, block_mask=mask, return_aux=AuxRequest(lse=True))
        (out.sum() + aux.lse.sum()).backward()
    assert counter.frame_count == 1, f"{counter.frame_count} graphs: a graph break"
    targets = {node.target for node in counter.graphs[0].graph.nodes}
    gather = torch.ops.cplib_c.flex_cp_allgather
    assert gather in targets or gather.default in targets, "cplib's all-gather is not in the graph"
    return counter.frame_count


def test_compiled_cp_module_has_no_graph_break(ranks):
    assert ranks(WORLD).run(_check_fullgraph_no_graph_break) == [1, 1]
