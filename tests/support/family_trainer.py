"""HF Trainer itself, one step on a family of tests/support/family_cases.py
with ``ParallelismConfig(cp_size=n)`` on ``cplib.patch_torch()``: what the
by-hand step of family_steps.trainer_step stands for, run on a few
families to check that it stands for it (``family_report.py
--real-trainer``), and to measure what a Trainer step costs."""

from __future__ import annotations

import time
from typing import Any

import numpy as np


def _trainer_step(model, inputs: dict, cp_size: int) -> tuple[Any, dict]:
    """client_cases.trainer_step without its check that the model's loss is
    ForCausalLMLoss (Trainer counts the labels of other loss types unshifted,
    in one process as under context parallelism)."""
    from accelerate.utils import ParallelismConfig
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from client_cases import Rows, cpu_parallelism_accepted, scratch_dir

    grads: dict = {}

    class KeepGrads(TrainerCallback):  # after DDP's reduction, before the optimizer
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            grads.update({n.removeprefix("module."): p.grad.clone()
                          for n, p in model.named_parameters() if p.grad is not None})

    args = TrainingArguments(
        output_dir=scratch_dir(), per_device_train_batch_size=inputs["input_ids"].shape[0],
        max_steps=1, learning_rate=0.0, max_grad_norm=0.0, use_cpu=True, report_to=[],
        save_strategy="no", logging_strategy="no", disable_tqdm=True,
        parallelism_config=ParallelismConfig(cp_size=cp_size))
    with cpu_parallelism_accepted():
        trainer = Trainer(model=model, args=args, train_dataset=Rows(inputs),
                          callbacks=[KeepGrads()])
    losses: list = []
    step = trainer.training_step
    trainer.training_step = lambda *a, **kw: losses.append(step(*a, **kw)) or losses[-1]
    trainer.train()
    return losses[0], grads


def _real_trainer_rank(family: str) -> dict[str, Any]:
    """One Trainer step on the family's tiny SDPA model (learning rate 0,
    the gradients after DDP), and Trainer's one-process step
    (family_steps.one_process(train=True))."""
    import torch
    import torch.distributed as dist

    import cplib
    import cplib.hf  # noqa: F401
    import family_cases as fc
    import family_steps
    from client_cases import accelerate_ranks

    batch = family_steps.make_batch(family)
    want = family_steps.one_process(fc.tiny_model(family, "eager"), batch, train=True)
    cplib.patch_torch()
    try:
        with accelerate_ranks():
            model = fc.tiny_model(family, "sdpa")
            start = time.perf_counter()
            loss, grads = _trainer_step(model, {k: batch[k] for k in ("input_ids", "labels")},
                                        dist.get_world_size())
            seconds = time.perf_counter() - start
    finally:
        cplib.unpatch_torch()
    flat = np.concatenate([grads.get(n, torch.zeros_like(p)).reshape(-1).float().numpy()
                           for n, p in model.named_parameters()])
    return {"loss": float(loss), "grads": flat, "seconds": seconds, "want": want}


def real_trainer(families: list[str], world: int) -> dict[str, str]:
    """Per family: HF Trainer's loss and gradient errors against its
    one-process step, and what one step costs."""
    from harness import RankPool

    pool, out = RankPool(world, timeout_s=600), {}
    for family in families:
        try:
            results = pool.run(_real_trainer_rank, family)
        except AssertionError as exc:
            out[family] = f"failed: {str(exc).strip().splitlines()[-1][:300]}"
            pool.close(force=True)
            pool = RankPool(world, timeout_s=600)
            continue
        want = results[0]["want"]
        loss = float(np.mean([r["loss"] for r in results]))
        grad = np.abs(results[0]["grads"] - want["grads"]).max() / np.abs(want["grads"]).max()
        out[family] = (f"loss err {abs(loss - want['loss']) / abs(want['loss']):.1e}, grad err "
                       f"{grad:.1e}, one Trainer step {max(r['seconds'] for r in results):.2f}s "
                       "(Trainer's construction, prepare and the step)")
    pool.close()
    return out
