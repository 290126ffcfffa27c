"""No context-parallel effect outside its scope (DESIGN.md section 15): after
every kind of CP call (a region's training step, the module path's
``_context_parallel_shard`` and parallelized forward, a direct op), a
one-process forward of a model is bitwise the forward before them, and a
rank that evaluates a batch of its own alone never communicates.

Before (2 gloo ranks, ``921d057``): the layout ``_context_parallel_shard``
recorded was matched by length afterwards, so a rank evaluating its own
16-token batch after a step sharded a 32-token batch got another loss
(Llama 4.1706 -> 4.2994 on rank 0), gathered labels across ranks (a rank
evaluating alone blocked there), and hybrid layers took rank 0's state
from an unrelated sequence. Each model here: a Llama (its loss), a Mixtral
(its router loss) and a Qwen3-Next (its Gated DeltaNet layer).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from client_cases import VOCAB, tiny_llama, tiny_mixtral
from hybrid_cases import tiny_model


def _models() -> dict:
    import cplib.hf  # noqa: F401  (the integration installed, as after any switch)

    return {"llama": tiny_llama(), "mixtral": tiny_mixtral(),
            "qwen3_next": tiny_model("qwen3_next", attn_implementation="sdpa")}


def _own_batch(s: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + dist.get_rank())  # another batch on every rank
    ids = torch.randint(0, VOCAB, (1, s), generator=g)
    return {"input_ids": ids, "labels": ids.clone(),
            "position_ids": torch.arange(s).unsqueeze(0)}


def _evaluate(model, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        out = model(**inputs, use_cache=False)
    return out.logits, out.loss


def _cp_calls(model, mesh: DeviceMesh) -> None:
    """A region's training step, the module path's, and a direct op, each on
    a 32-token batch (a 16-token batch is a shard's length)."""
    import cplib

    g = torch.Generator().manual_seed(5)  # the same batch on every rank
    ids = torch.randint(0, VOCAB, (1, 32), generator=g)
    inputs = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(32)[None]}
    with cplib.context_parallel(mesh, buffers=list(inputs.values()), buffer_seq_dims=[1] * 3):
        model(**inputs, use_cache=False).loss.backward()
    parallel = copy.deepcopy(model)
    style = cplib._ContextParallel(seq_dim=2,
                                   attention_type=cplib._ContextParallel.AttentionType.SDPA)
    for layer in parallel.model.layers:
        attn = getattr(layer, "self_attn", None)
        if attn is not None:
            parallelize_module(attn, mesh, style)
    local = cplib._context_parallel_shard(mesh, list(inputs.values()), [1] * 3,
                                          cplib._HeadTailLoadBalancer(32, mesh.size(), "cpu"))
    cplib._enable_context_parallel_dispatcher()
    try:
        parallel(**dict(zip(inputs, local)), use_cache=False).loss.backward()
    finally:
        cplib._disable_context_parallel_dispatcher()
    q = torch.randn(1, 2, 16, 8, generator=g)
    cplib.ring_sdpa(q, q, q, mesh.get_group().group_name, is_causal=True)
    model.zero_grad()


def _scope() -> list[str]:
    mesh = DeviceMesh("cpu", list(range(dist.get_world_size())))
    done = []
    for name, model in _models().items():
        model.eval()
        mine = _own_batch(16)
        before = _evaluate(model, mine)
        _cp_calls(model, mesh)
        # Rank 0 evaluates alone: a collective there would wait for rank 1 forever.
        if dist.get_rank() == 0:
            after = _evaluate(model, mine)
            assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1]), \
                (name, before[1].item(), after[1].item())
        dist.barrier()
        done.append(name)
    return done


def test_a_one_process_forward_after_cp_calls_is_bitwise_the_one_before(ranks):
    assert ranks(2).run(_scope) == [["llama", "mixtral", "qwen3_next"]] * 2


def test_a_model_compiles_in_one_graph_with_the_integration_installed():
    """Every model's forward is guarded (forward_guard.py): outside context
    parallelism the guard reads nothing a trace cannot, so
    ``torch.compile(fullgraph=True)`` holds the model in one graph (before
    the guard's scope lookup broke it)."""
    import cplib.hf  # noqa: F401  (the integration installed)

    model = tiny_llama().eval()
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = torch.compile(model, backend="eager", fullgraph=True)(input_ids=ids).logits
    torch.testing.assert_close(got, want)
