"""torchtitan 0.3.0's context-parallel entry points on cplib through
``cplib.patch_torch()`` alone (called before torchtitan is imported), on 2
gloo ranks against one process:

* its Llama 3 (2 layers, dim 64; torchtitan's language models take flex
  attention) with ``apply_cp_to_forward`` and
  ``prepare_context_parallel_input`` (head-tail): the loss as torchtitan's
  trainer reduces it (each rank's token-loss sum over the global count of
  valid tokens, summed over the ranks) and the parameter gradients summed
  over the ranks (its FSDP divides by 1) equal one process's. On CPU the
  test runs torchtitan's compiled calls eagerly
  (``torch.compiler.set_stance("force_eager")``) with torch's "no flex
  backward on CPU" guard lifted, as the flex tests do. The same with
  torchtitan's full and selective activation checkpointing of every block,
  on the all-gather and, its FlexAttention modules parallelized with
  ``_ContextParallel(seq_dim=1, FLEX)``, on the flex ring;
* its ``ScaledDotProductAttention`` module with ``apply_cp_to_forward``,
  which wraps q, k, v as sequence-sharded DTensors and relies on
  ``_enable_context_parallel_dispatcher()`` routing their SDPA (torch's has no
  handler for the CPU kernel; cplib's routes it to its ring): output and q,
  k, v gradients, head-tail with the default rotation and sequential with
  "alltoall"."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from cplib.flex.ring_ops import ring_bytes_received
from harness import assert_close

pytest.importorskip("torchtitan", reason="requirements/clients-nodeps.txt (make build installs it)")

DIM, HEADS, VOCAB, S = 64, 4, 64, 512  # S: head-tail flex masks need 2 * N * 128 | S


def _titan(cplib):
    """torchtitan's CP API, checked to hold cplib's names (patch_torch first)."""
    from torchtitan.distributed.context_parallel import api

    assert api._context_parallel_shard is cplib._context_parallel_shard, \
        "torchtitan was imported before cplib.patch_torch() in this process"
    return api


def _llama3():
    import torchtitan.models.llama3 as l3
    from torchtitan.models.common import (ComplexRoPE, Embedding, Linear, RMSNorm,
                                          compute_ffn_hidden_dim)

    config = l3.Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                        param_init=l3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=l3._NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB,
                              param_init=l3._output_linear_init(DIM)),
        layers=l3._build_llama3_layers(
            n_layers=2, dim=DIM, n_heads=HEADS, n_kv_heads=2,
            hidden_dim=compute_ffn_hidden_dim(DIM, multiple_of=64),
            rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=S, theta=10000.0,
                                    scaling="none"),
            attn_backend="flex"))
    torch.manual_seed(0)
    return config.build()


def _loss(pred: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    from torchtitan.components.loss import cross_entropy_loss

    return cross_entropy_loss(pred, labels) / valid  # torchtitan: local sum / global count


def _llama3_step(checkpointing: str | None = None, ring: bool = False) -> dict:
    """``checkpointing``: torchtitan's activation checkpointing of every
    block ("full" or "selective"), applied after CP as its parallelize does.
    ``ring``: its FlexAttention modules parallelized with
    ``_ContextParallel(seq_dim=1, FLEX)`` (the flex ring) instead of
    ``apply_cp_to_forward`` (the all-gather)."""
    import cplib
    from flex_cases import cpu_flex_grads

    cplib.patch_torch()
    try:
        api = _titan(cplib)
        # torchtitan's compiled calls (create_block_mask, flex_attention) and
        # cplib's mask sharding run eagerly: compiling them for the CPU would
        # take most of a minute here.
        with cpu_flex_grads(), torch.compiler.set_stance("force_eager"):
            model = _llama3()
            ref = copy.deepcopy(model)
            g = torch.Generator().manual_seed(1)
            tokens = torch.randint(0, VOCAB, (1, S + 1), generator=g)
            inputs, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
            labels[0, : S // 3] = -100
            positions = torch.arange(S)[None]
            valid = (labels != -100).sum()
            masks = ref.get_attention_masks(positions=positions)
            want = _loss(ref(inputs, positions, masks), labels, valid)
            want.backward()
            mesh = DeviceMesh("cpu", list(range(dist.get_world_size())))
            inner = [b.attention.inner_attention for b in model.layers.values()]
            if ring:
                for module in inner:
                    parallelize_module(module, mesh, cplib._ContextParallel(
                        seq_dim=1, attention_type=cplib._ContextParallel.AttentionType.FLEX))
            else:
                api.apply_cp_to_forward(inner, mesh)
            if checkpointing is not None:
                from torchtitan.distributed import activation_checkpoint as ac

                policy = {"full": ac.FullAC, "selective": ac.SelectiveAC}[checkpointing]
                policy(policy.Config()).apply(model)
            inputs, labels, extra = api.prepare_context_parallel_input(
                inputs, labels, {"positions": positions, "attention_masks": masks}, mesh,
                torch.device("cpu"), "headtail")
            ring_bytes_received(reset=True)
            loss = _loss(model(inputs, extra["positions"], extra["attention_masks"]), labels,
                         valid)
            loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)  # torchtitan's global_avg_loss: the sum over the ranks
        assert_close(total, want.detach(), atol=2e-5, rtol=0, what="torchtitan loss")
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            grad = p.grad.clone()
            dist.all_reduce(grad)
            assert_close(grad, q.grad, atol=1e-6, rtol=0, what=f"torchtitan grad of {name}")
        return {"loss": abs(total - want).item(), "ring bytes": ring_bytes_received()}
    finally:
        # torchtitan's checkpointing switches dynamo's LRU cache off for the
        # process (its default is on): this rank process runs other tests.
        torch._C._dynamo.eval_frame._set_lru_cache(True)
        cplib.unpatch_torch()


def test_torchtitan_llama3_cp_step_equals_one_process(ranks):
    assert all(r["ring bytes"] == 0 for r in ranks(2).run(_llama3_step)), "not the all-gather"


@pytest.mark.parametrize("checkpointing,ring", [("full", False), ("full", True),
                                                 ("selective", True)])
def test_torchtitan_activation_checkpointing_equals_one_process(ranks, checkpointing, ring):
    """torchtitan's FullAC and SelectiveAC (which saves flex's outputs and
    recomputes the rest, the ring's exchanges included) on its CP Llama 3,
    on the all-gather and on the flex ring: the loss and every gradient
    equal one process's."""
    got = ranks(2).run(_llama3_step, checkpointing, ring)
    assert all((r["ring bytes"] > 0) == ring for r in got), got


def _sdpa_module(balancer: str | None, rotation: str) -> int:
    import cplib

    cplib.patch_torch()
    try:
        api = _titan(cplib)
        from torchtitan.models.common.attention import ScaledDotProductAttention

        n = dist.get_world_size()
        mesh = DeviceMesh("cpu", list(range(n)))
        torch.manual_seed(0)
        q, k, v = (torch.randn(2, 64, HEADS, 16, requires_grad=True) for _ in range(3))
        module = ScaledDotProductAttention(ScaledDotProductAttention.Config())
        want = module(q, k, v)  # (B, L, N, H), causal
        want.backward(torch.ones_like(want))
        api.apply_cp_to_forward([module], mesh)
        cplib.set_rotate_method(rotation)
        (lq, lk, lv, lw), _ = api.cp_shard(mesh, (q.detach(), k.detach(), v.detach(), want),
                                           None, balancer)
        (gq, gk, gv), _ = api.cp_shard(mesh, (q.grad, k.grad, v.grad), None, balancer)
        for t in (lq, lk, lv):
            t.requires_grad_()
        out = module(lq, lk, lv)
        out.backward(torch.ones_like(out))
        what = f"torchtitan SDPA {balancer} {rotation}"
        assert_close(out, lw, atol=1e-5, rtol=1e-5, what=f"{what}: out")
        for name, got, expected in (("q", lq, gq), ("k", lk, gk), ("v", lv, gv)):
            assert_close(got.grad, expected, atol=1e-5, rtol=1e-5, what=f"{what}: d{name}")
        return 1
    finally:
        cplib._disable_context_parallel_dispatcher()
        cplib.unpatch_torch()


@pytest.mark.parametrize("balancer,rotation", [("headtail", "p2p"), (None, "alltoall")])
def test_torchtitan_sdpa_module_on_dtensors_equals_one_process(ranks, balancer, rotation):
    assert ranks(2).run(_sdpa_module, balancer, rotation) == [1, 1]
