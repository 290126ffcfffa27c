"""accelerate 1.15.0's context parallelism (``ParallelismConfig(cp_size=2)``,
``accelerator.maybe_context_parallel``) on cplib through ``cplib.patch_torch()``
alone, one training step of a tiny Llama on 2 gloo ranks against one process:
the mean over the ranks of the loss, and the gradients after accelerate's own
reduction (DDP's mean), equal the one-process loss and gradients, with HF's
``labels=`` and with Trainer-style ``shift_labels``, under accelerate's default
rotation ("allgather") and "alltoall". (torch's own implementation fails
there on CPU: its DTensor SDPA has no handler for the CPU flash kernel.)"""

from __future__ import annotations

import pytest
import torch

from client_cases import (accelerate_ranks, batch, check_against, cpu_parallelism_accepted,
                          one_process, tiny_llama)

pytest.importorskip("accelerate", reason="requirements/clients.txt (make build installs it)")


def _step(loss_input: str, strategy: str) -> dict:
    import cplib
    from accelerate import Accelerator
    from accelerate.utils import ParallelismConfig, TorchContextParallelConfig

    cplib.patch_torch()  # before Accelerator.prepare(), which imports torch's names
    try:
        with accelerate_ranks():
            inputs = batch()
            model = tiny_llama()
            want = one_process(model, inputs)
            config = ParallelismConfig(
                cp_size=2, cp_handler=TorchContextParallelConfig(cp_comm_strategy=strategy))
            with cpu_parallelism_accepted():
                accelerator = Accelerator(cpu=True, parallelism_config=config)
            model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), 0.0))
            ids, pos = inputs["input_ids"], inputs["position_ids"]
            labels = inputs[loss_input]
            kw = {"labels": labels} if loss_input == "labels" else \
                {"labels": labels, "shift_labels": labels}
            with accelerator.maybe_context_parallel(buffers=[ids, pos, labels],
                                                    buffer_seq_dims=[1, 1, 1],
                                                    no_restore_buffers={ids, pos, labels}):
                loss = model(input_ids=ids, position_ids=pos, use_cache=False, **kw).loss
                accelerator.backward(loss)
            # DDP averaged the gradients over the ranks (the CP ranks here).
            grads = {n.removeprefix("module."): p.grad for n, p in model.named_parameters()}
            return check_against(f"accelerate {loss_input} {strategy}", loss, grads, want)
    finally:
        cplib.unpatch_torch()


@pytest.mark.parametrize("loss_input,strategy", [("labels", "allgather"),
                                                 ("shift_labels", "alltoall")])
def test_accelerate_step_equals_one_process(ranks, loss_input, strategy):
    errors = ranks(2).run(_step, loss_input, strategy)
    assert errors[0] == errors[1]
