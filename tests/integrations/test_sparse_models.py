"""Sparse-attention models under context parallelism
(cplib/integrations/transformers/sparse/): tiny DeepSeek-V3.2 and Mistral
Large 4 (tests/support/family_cases.py: 8 keys kept of 32) on 4 gloo ranks,
sequential and head-tail, on ``"sdpa"`` in a ``cplib.context_parallel``
region and on ``"cplib"``, with the latents gathered and fetched, and
left-padded batches: the ranks' mean loss (HF's ``labels=`` loss, or
``cplib.loss.cross_entropy`` for a text model) within 2e-5 relative of one
eager process, their mean gradients within 1e-5 of the largest (what
tests/integrations/test_every_family.py holds every family to on 2 ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import family_cases as fc
import family_steps as fs

LOSS_TOL, GRAD_TOL = 2e-5, 1e-5
PAD = 3  # left padding of the second batch row


def _batch(family: str, padded: bool) -> dict[str, torch.Tensor]:
    batch = fs.make_batch(family)
    if padded:
        batch = {k: v.repeat(2, 1) for k, v in batch.items()}
        mask = torch.ones_like(batch["input_ids"])
        mask[1, :PAD] = 0
        batch["attention_mask"] = mask
        for name in ("labels", "ids_labels"):
            batch[name][1, :PAD] = -100
    return batch


def _extra(batch: dict) -> dict:
    return {"attention_mask": batch["attention_mask"]} if "attention_mask" in batch else {}


def _one_process(family: str, padded: bool) -> tuple[float, torch.Tensor]:
    model = fc.tiny_model(family, "eager")
    batch = _batch(family, padded)
    loss = fs.loss_of(model, batch, _extra(batch))
    loss.backward()
    return float(loss), torch.from_numpy(fs.flat_grads(model))


def _under_cp(family: str, switch: str, head_tail: bool, exchange: str, padded: bool):
    import cplib
    import cplib.hf  # noqa: F401  (attn_implementation="cplib")
    from cplib.integrations.transformers.sparse import set_exchange
    from torch.distributed.device_mesh import DeviceMesh

    model = fc.tiny_model(family, switch)
    batch = _batch(family, padded)
    names = ["input_ids", "position_ids", "labels", "ids_labels"] + \
        (["attention_mask"] if padded else [])
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    set_exchange(exchange)
    try:
        with cplib.context_parallel(mesh, buffers=[batch[n] for n in names],
                                    buffer_seq_dims=[1] * len(names), load_balance=head_tail):
            loss = fs.loss_of(model, batch, _extra(batch))
            loss.backward()
    finally:
        set_exchange("auto")
    grads = torch.from_numpy(fs.flat_grads(model)).double()
    out = torch.stack([loss.detach().double()])
    dist.all_reduce(out)
    dist.all_reduce(grads)
    n = dist.get_world_size()
    return float(out[0]) / n, grads / n


def _cases(family: str, padded: bool) -> list[tuple[str, float, float]]:
    want_loss, want_grads = _one_process(family, padded)
    out = []
    for switch in ("sdpa", "cplib"):
        for head_tail in (False, True):
            for exchange in (("gather", "fetch") if not padded else ("auto",)):
                loss, grads = _under_cp(family, switch, head_tail, exchange, padded)
                what = f"{family} {switch} head_tail={head_tail} {exchange} padded={padded}"
                err = float((grads - want_grads.double()).abs().max() /
                            want_grads.double().abs().max())
                out.append((what, abs(loss - want_loss) / abs(want_loss), err))
    return out


@pytest.mark.parametrize("family,padded", [("deepseek_v32", False), ("deepseek_v32", True),
                                           ("mistral_large4:text", False)])
def test_sparse_models_under_cp_are_one_process(ranks, family, padded):
    problems = [f"{what}: loss {loss:.3g}, grad {grad:.3g}"
                for what, loss, grad in ranks(4).run(_cases, family, padded)[0]
                if not (loss <= LOSS_TOL and grad <= GRAD_TOL)]
    assert not problems, "\n".join(problems)
