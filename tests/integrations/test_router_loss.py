"""A tiny Mixtral (2 layers, 4 experts, top 2) with ``output_router_logits``
and ``labels=`` under ``cplib.context_parallel`` on 2 gloo ranks: the router's
load-balancing loss (a product of two means over every token) covers the
whole sequence, so the mean over the ranks of the loss, and of every
parameter gradient, is the one-process value, with head-tail shards and with
uneven sequential ones (the gathered router rows padded and masked). With
``num_items_in_batch`` (Trainer's convention: the caller multiplies by its
number of processes) the sum over the ranks is. Computed per shard (before
cplib's router loss) the mean is off by about 1e-3."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from client_cases import batch, check_against, mean_grads, one_process, tiny_mixtral


def _mixtral(load_balance, s: int, num_items: bool) -> dict:
    import cplib
    import cplib.hf  # noqa: F401  (the causal-LM and router losses)

    n = dist.get_world_size()
    inputs = batch(s)
    ids, pos, labels = inputs["input_ids"], inputs["position_ids"], inputs["labels"]
    model = tiny_mixtral("cplib")  # its SDPA path builds a 4-D mask
    want = one_process(model, inputs)
    kw = {"num_items_in_batch": int((inputs["shift_labels"] != -100).sum())} if num_items else {}
    with cplib.context_parallel(DeviceMesh("cpu", list(range(n))), buffers=[ids, pos, labels],
                                buffer_seq_dims=[1, 1, 1], load_balance=load_balance):
        out = model(input_ids=ids, position_ids=pos, labels=labels, use_cache=False, **kw)
        loss = out.loss * (n if num_items else 1)  # what Trainer backpropagates
        loss.backward()
    assert out.aux_loss is not None
    return check_against(f"Mixtral load_balance={load_balance} num_items={num_items}", loss,
                         mean_grads(model), want)


def _check_all() -> list:
    return [_mixtral(True, 64, False), _mixtral(False, 67, False), _mixtral(True, 64, True)]


def test_router_loss_covers_the_whole_sequence(ranks):
    errors = ranks(2).run(_check_all)
    assert errors[0] == errors[1]
