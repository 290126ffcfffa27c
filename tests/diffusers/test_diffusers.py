"""diffusers' diffusion transformers under cplib, tiny configs built from
config (no download), fp32, against the same model on the full sequence in
one process: Flux through buffers (text and image tokens of different
lengths, joint shards of different lengths), QwenImage through
``modules=[model]`` (its ``_cp_plan`` applied with diffusers' hooks), buffers
that differ across ranks, and backward() after the context exits."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

import cplib
from harness import assert_close
from model_cases import _compare_grads

pytest.importorskip("diffusers")  # a pinned test dependency (requirements-dev.txt)

TOL = dict(atol=2e-5, rtol=2e-4)
HEADS, HEAD_DIM = 4, 16


def _mesh() -> DeviceMesh:
    return DeviceMesh("cpu", list(range(dist.get_world_size())))


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------- Flux


def _flux():
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1, in_channels=8, num_layers=1, num_single_layers=1,
        attention_head_dim=HEAD_DIM, num_attention_heads=HEADS, joint_attention_dim=12,
        pooled_projection_dim=8, axes_dims_rope=(4, 6, 6))


def _flux_inputs(text: int, side: int = 8) -> dict[str, torch.Tensor]:
    img = side * side
    img_ids = torch.zeros(img, 3)
    img_ids[:, 1] = torch.arange(side).repeat_interleave(side)
    img_ids[:, 2] = torch.arange(side).repeat(side)
    txt_ids = torch.zeros(text, 3)
    txt_ids[:, 0] = torch.arange(text)  # distinct text positions: sharding must keep them
    return dict(hidden_states=torch.randn(1, img, 8, generator=_g(1)),
                encoder_hidden_states=torch.randn(1, text, 12, generator=_g(2)),
                pooled_projections=torch.randn(1, 8, generator=_g(3)),
                timestep=torch.tensor([0.5]), img_ids=img_ids, txt_ids=txt_ids)


def _check_flux() -> int:
    mesh, n = _mesh(), dist.get_world_size()
    ref_model = _flux()
    checks = 0
    for text in (16, 33):
        inputs = _flux_inputs(text)
        cot = torch.randn(1, inputs["hidden_states"].shape[1], 8, generator=_g(4))
        ref_model.zero_grad()
        ref = ref_model(**inputs).sample
        (ref * cot).sum().backward()
        for u in sorted({1, 2, n}):
            model = copy.deepcopy(ref_model)
            model.zero_grad()
            kw = {k: v.clone() for k, v in inputs.items()}
            c = cot.clone()
            names = ["hidden_states", "encoder_hidden_states", "img_ids", "txt_ids"]
            with cplib.context_parallel(mesh, buffers=[kw[k] for k in names] + [c],
                                        buffer_seq_dims=[1, 1, 0, 0, 1],
                                        ulysses_degree=u) as cp:
                out = model(**kw).sample
                (out * c).sum().backward()
                (full,) = cp.unshard([out.detach()], [1])
            what = f"flux text={text} ulysses_degree={u} of {n}"
            assert_close(full, ref.detach(), what=f"{what}: output", **TOL)
            _compare_grads(model, ref_model, what)
            checks += 1
    return checks


@pytest.mark.parametrize("world_size", [2, 4])
def test_flux_through_buffers(ranks, world_size):
    # text 16 and 33 (joint shards of different lengths), ring, Ulysses, USP
    want = 2 * len({1, 2, world_size})
    assert ranks(world_size).run(_check_flux) == [want] * world_size


# -------------------------------------------------------------- QwenImage


def _qwen_image():
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    return QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2,
        attention_head_dim=HEAD_DIM, num_attention_heads=HEADS, joint_attention_dim=12,
        axes_dims_rope=(4, 6, 6))


def _qwen_inputs(text: int, padded: int | None) -> dict:
    inputs = dict(hidden_states=torch.randn(1, 8 * 8, 16, generator=_g(5)),
                  encoder_hidden_states=torch.randn(1, text, 12, generator=_g(6)),
                  timestep=torch.tensor([0.5]), img_shapes=[(1, 8, 8)])
    if padded is not None:  # the last `padded` text tokens are padding
        mask = torch.ones(1, text, dtype=torch.long)
        mask[:, text - padded:] = 0
        inputs["encoder_hidden_states_mask"] = mask
    return inputs


def _module_state(model: nn.Module) -> list:
    """Everything a context could leave behind on a module tree: instance
    attributes (hooks, bound forwards) and parameters/buffers."""
    return [(name, sorted(m.__dict__), {k: id(v) for k, v in m.__dict__.items()
                                        if not k.startswith("_") or k == "_diffusers_hook"})
            for name, m in model.named_modules()]


def _check_qwen_image(padded_cases: tuple) -> int:
    mesh, n = _mesh(), dist.get_world_size()
    model = _qwen_image()
    before = _module_state(model)
    params = {k: v.clone() for k, v in model.state_dict().items()}
    checks = 0
    with torch.no_grad():
        for text, padded in padded_cases:
            inputs = _qwen_inputs(text, padded)
            ref = model(**inputs).sample
            for u in sorted({1, n}):
                with cplib.context_parallel(mesh, modules=[model], ulysses_degree=u):
                    out = model(**inputs).sample  # the plan's proj_out hook gathers it
                what = f"qwen-image text={text} padded={padded} ulysses_degree={u} of {n}"
                assert_close(out, ref, what=f"{what}: output", **TOL)
                checks += 1
            # Exactly as before: no hooks, no attributes, same parameters and output.
            assert _module_state(model) == before
            assert all(torch.equal(v, params[k]) for k, v in model.state_dict().items())
            assert torch.equal(model(**inputs).sample, ref)
    return checks


@pytest.mark.parametrize("world_size", [2, 4])
def test_qwen_image_through_modules(ranks, world_size):
    # text 12 over 4 ranks is even; 13 gives joint shards of different lengths;
    # with a text padding mask (its last 4 tokens), a key-padding mask per shard
    cases = ((12, None), (13, None), (13, 4))
    assert ranks(world_size).run(_check_qwen_image, cases) == [2 * len(cases)] * world_size


# ----------------------------------------------- buffers that differ, backward after exit


def _check_buffers_differ() -> int:
    mesh, rank = _mesh(), dist.get_rank()
    raised = 0
    for shapes in (lambda r: [(1, 8 + r, 4)], lambda r: [(1, 8, 4)] * (1 + r % 2)):
        bufs = [torch.zeros(s) for s in shapes(rank)]
        with pytest.raises(ValueError, match=r"cplib\.context_parallel: ranks disagree on "):
            with cplib.context_parallel(mesh, buffers=bufs, buffer_seq_dims=[1] * len(bufs)):
                pass
        raised += 1
        assert all(tuple(b.shape) == s for b, s in zip(bufs, shapes(rank)))  # untouched
    # The process group still works: no rank was left inside a collective.
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size()
    return raised


def test_buffers_differing_across_ranks_raise_on_every_rank(ranks):
    assert ranks(2).run(_check_buffers_differ) == [2, 2]


def _check_backward_after_exit() -> int:
    mesh, n = _mesh(), dist.get_world_size()
    ref_model = _flux()
    inputs = _flux_inputs(33)
    cot = torch.randn(1, 64, 8, generator=_g(4))
    (ref_model(**inputs).sample * cot).sum().backward()
    model = copy.deepcopy(ref_model)
    model.zero_grad()
    kw = {k: v.clone() for k, v in inputs.items()}
    names = ["hidden_states", "encoder_hidden_states", "img_ids", "txt_ids"]
    with cplib.context_parallel(mesh, buffers=[kw[k] for k in names] + [cot],
                                buffer_seq_dims=[1, 1, 0, 0, 1]):
        loss = (model(**kw).sample * cot).sum()
    assert kw["hidden_states"].shape == inputs["hidden_states"].shape  # restored
    loss.backward()  # after exit: autograd saved the shards, not the restored buffers
    return _compare_grads(model, ref_model, f"flux backward after exit over {n} ranks")


def test_backward_after_exit(ranks):
    counts = ranks(2).run(_check_backward_after_exit)
    assert counts[0] == counts[1] > 0
