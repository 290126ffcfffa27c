"""``cplib.loss.cross_entropy`` (a loss of your own on this rank's logits) and
HF's ``labels=`` loss on the ``_ContextParallel`` module path, a tiny Llama
on 2 gloo ranks against one process: the mean over the ranks of the loss,
and of every parameter gradient, is the one-process value, with labels
shifted across shard borders and ``-100`` falling unevenly on the ranks:

* the helper inside ``cplib.context_parallel`` with head-tail, sequential
  (uneven S) and document-placement (packed documents) layouts;
* the module path (``parallelize_module`` with ``_ContextParallel``, inputs and
  labels sharded by ``_context_parallel_shard``): HF's ``labels=`` loss and the
  helper read the layout the shards carry;
* bad input raises the same ValueError on every rank before any
  collective: labels of another length, labels sharded by cplib in another
  layout. (Labels sharded by cplib outside any region carry their layout:
  their loss covers the whole sequence.)"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from client_cases import batch, check_against, mean_grads, one_process, tiny_llama


def _mesh() -> DeviceMesh:
    return DeviceMesh("cpu", list(range(dist.get_world_size())))


def _own_loss_reference(model, inputs) -> tuple:
    """One process: the plain next-token mean over the valid labels."""
    ref = copy.deepcopy(model)
    logits = ref(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"]).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                           inputs["shift_labels"].reshape(-1), ignore_index=-100)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in ref.named_parameters()}


def _helper_in_region(load_balance, s: int, documents: bool) -> dict:
    import cplib

    inputs = batch(s)
    ids, pos, labels = inputs["input_ids"], inputs["position_ids"], inputs["labels"]
    docs = {}
    if documents:  # packed documents: positions restart at each one
        bounds = [0, 9, s // 2 + 3, s]
        pos = torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])]).expand(2, s)
        inputs["position_ids"] = pos = pos.contiguous()
        docs = {"position_ids": pos.clone()}
    if documents:  # attention within documents in one process too
        import cplib.hf  # noqa: F401
    model = tiny_llama("cplib" if documents else "sdpa")
    want = _own_loss_reference(model, inputs)
    with cplib.context_parallel(_mesh(), buffers=[ids, pos, labels], buffer_seq_dims=[1, 1, 1],
                                load_balance=load_balance, **docs):
        logits = model(input_ids=ids, position_ids=pos).logits
        loss = cplib.loss.cross_entropy(logits, labels)
        loss.backward()
    return check_against(f"helper load_balance={load_balance}", loss, mean_grads(model), want)


def _check_helper_layouts() -> list:
    return [_helper_in_region(True, 64, False), _helper_in_region(False, 67, False),
            _helper_in_region("placement", 65, True)]


def test_helper_in_every_layout_equals_one_process(ranks):
    errors = ranks(2).run(_check_helper_layouts)
    assert errors[0] == errors[1]


def _module_path(own_loss: bool) -> dict:
    import cplib
    import cplib.hf  # noqa: F401  (installs the labels= loss)
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = _mesh()
    inputs = batch()
    model = tiny_llama()
    want = _own_loss_reference(model, inputs) if own_loss else one_process(model, inputs)
    style = cplib._ContextParallel(seq_dim=2,
                                   attention_type=cplib._ContextParallel.AttentionType.SDPA)
    for layer in model.model.layers:
        parallelize_module(layer.self_attn, mesh, style)
    s = inputs["input_ids"].shape[1]
    ids, pos, labels = cplib._context_parallel_shard(
        mesh, [inputs[k] for k in ("input_ids", "position_ids", "labels")], [1, 1, 1],
        cplib._HeadTailLoadBalancer(s, mesh.size(), "cpu"))
    cplib._enable_context_parallel_dispatcher()
    try:
        if own_loss:
            logits = model(input_ids=ids, position_ids=pos).logits
            loss = cplib.loss.cross_entropy(logits, labels)
        else:
            loss = model(input_ids=ids, position_ids=pos, labels=labels).loss
        loss.backward()
    finally:
        cplib._disable_context_parallel_dispatcher()
    return check_against(f"_ContextParallel own_loss={own_loss}", loss, mean_grads(model), want)


def test_module_path_losses_read_the_layout_the_shards_carry(ranks):
    for own_loss in (False, True):
        errors = ranks(2).run(_module_path, own_loss)
        assert errors[0] == errors[1]


def _bad_labels(case: str) -> str:
    import cplib

    mesh = _mesh()
    inputs = batch()
    ids, labels = inputs["input_ids"], inputs["labels"]
    s, n = ids.shape[1], mesh.size()
    logits = torch.randn(2, s // n, 64)
    try:
        if case == "another layout":  # sequential shards in a head-tail region
            (shard,) = cplib.shard(mesh, [labels.clone()], [1])
        with cplib.context_parallel(mesh, buffers=[ids], buffer_seq_dims=[1], load_balance=True):
            if case == "another length":
                cplib.loss.cross_entropy(logits, labels[:, :-1])
            else:
                cplib.loss.cross_entropy(logits, shard)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_bad_labels_raise_on_every_rank(ranks):
    for case, words in (("another length", "labels has 63 positions"),
                        ("another layout", "another layout")):
        errors = ranks(2).run(_bad_labels, case)
        assert errors[0] == errors[1] and words in errors[0], (case, errors)
