"""One family of tests/support/family_cases.py under each switch, as tasks
of a rank pool: ``ranks(n).run(run_part, family, part)`` for each part of
``PARTS`` (issue 53, item 2).

Each rank returns what it saw and never raises: the loss and the flattened
parameter gradients of every run that finished, the exception of every run
that did not (its type, message, whose code raised it, where).
tests/support/family_report.py merges the ranks and classifies. The runs
(family_steps.py computes each):

- ``reference`` (rank 0): eager attention in one process, eval mode: the
  loss and gradients every switch is held to; and whether the family is
  causal (the last token must not move earlier logits).
- ``sdpa/<layout>``: built with ``attn_implementation="sdpa"``, inside
  ``cplib.context_parallel`` (switch a); ``cplib/<layout>``: built with
  ``"cplib"`` after ``import cplib.hf`` (switch b). Layouts: sequential
  (``load_balance=False``) and head-tail (``True``). ``input_ids``,
  ``position_ids`` and ``labels`` are the region's buffers; the loss is the
  model's own ``labels=`` loss (a text model without LM head: a fixed
  projection and ``cplib.loss.cross_entropy``).
- ``cplib_outside`` (last rank): ``"cplib"`` in one process, no region
  (switch b'), held to ``reference``.
- ``trainer`` (switch c): HF Trainer's training step on ``cplib.patch_torch()``
  with ``ParallelismConfig(cp_size=n)``, by hand: accelerate's ``prepare()``
  hooks on the model (and their refusal of windowed and hybrid layers), its
  rotation (``"allgather"``), torch's ``context_parallel`` name (cplib's after
  the patch) with Trainer's buffers (``input_ids, labels, shift_labels,
  position_ids``), ``num_items_in_batch`` counted as Trainer counts it,
  Trainer's ``* num_processes``, train mode; the gradients' mean over the
  ranks is DDP's. Held to ``reference_train`` (last rank: Trainer's step
  without context parallelism, eager). It leaves out Trainer's object
  (arguments, data loader, DDP wrapper, optimizer): 1.6 s a step against
  0.1 s; family_report.py's ``--real-trainer`` runs Trainer itself on some
  families against the same references.

Every CP run gets a fresh process group (``dist.new_group``) after a
barrier on a side group, so a rank that fails inside a collective leaves
its peer blocked in that group, never in the next run's. cplib's own
handshake does not time out with the group, so a rank that raises outside
cplib while its peer is in a cplib op blocks the peer until the pool's task
timeout: the report then calls the part ``hang`` and names where each rank
waited (``hang_dump_path``).
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

import family_cases as fc
from pool_groups import keep_group
import family_steps as fs

SWITCHES = ("sdpa", "cplib", "cplib_outside", "trainer")
# A rank blocked in a collective its peer never joins gives up after this.
RUN_GROUP_TIMEOUT_S = float(os.environ.get("CPLIB_FAMILY_GROUP_TIMEOUT", "20"))
_side_group = None


def _agree(value: Any = None) -> list[Any]:
    """Every rank's ``value``, on a side group: a barrier before the next
    run's group is made (a long timeout: a peer may still be waiting out
    RUN_GROUP_TIMEOUT_S in the last run), and how ranks decide together
    whether to run a follow-up."""
    global _side_group
    if _side_group is None:  # every run of this pooled rank reuses it
        _side_group = keep_group(dist.new_group(backend="gloo",
                                                timeout=datetime.timedelta(seconds=600)))
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value, group=_side_group)
    return values


def _weights_sum(model) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def _names(family: str, model) -> set[str]:
    """What a refusal may name: the family, its classes, its layers' classes."""
    names = {family.split(":")[0], type(fc.tiny_config(family)).__name__}
    names.add(fc.model_class(family).__name__)
    if model is not None:
        names |= {type(m).__name__ for m in model.modules()}
    return {n for n in names if len(n) >= 4 and n not in ("Linear", "Embedding", "ModuleList")}


_OWNERS = (("/cplib/", "cplib"), ("/accelerate/", "accelerate"), ("/transformers/", "transformers"))


def owned_path(path: str) -> str:
    """A file of cplib, accelerate or transformers from its package on
    (wherever it is installed)."""
    starts = [path.rfind(key) for key, _ in _OWNERS if key in path]
    return path[min(starts) + 1:] if starts else path


def _failure(exc: BaseException, stage: str, names: set[str]) -> dict[str, Any]:
    """An exception as the report reads it: its type and message, the
    innermost frame in cplib, accelerate or transformers (where to look for
    the cause, and ``by``: whose code raised it), the names it mentions."""
    msg = str(exc)
    where, by, stack = "", "", []
    for f in reversed(traceback.extract_tb(exc.__traceback__)):
        owner = next((o for key, o in _OWNERS if key in f.filename), None)
        if owner is not None:
            frame = f"{owned_path(f.filename)}:{f.lineno} {f.name}"
            where, by = (where, by) if where else (frame, owner)
            stack.append(frame)
    timed_out = "Timed out" in msg or ("timeout" in msg.lower() and "gloo" in msg.lower())
    return {"ok": False, "stage": stage, "type": type(exc).__name__, "message": msg[:800],
            "where": where, "by": by, "timeout": timed_out, "stack": stack[:6],
            "named": sorted(n for n in names if n in msg)}


def _run(family: str, attn: str, body: Callable[[Any], dict[str, Any]],
         seen: dict | None = None) -> dict[str, Any]:
    """Builds the family with ``attn`` and runs ``body(model)``; records the
    outcome, the stage it failed in and the time (and ``seen``, what the
    body noted before it failed)."""
    start = time.perf_counter()
    model = None
    seen = {} if seen is None else seen
    try:
        model = fc.tiny_model(family, attn)
    except BaseException as exc:  # a refusal at build is an outcome, not an error
        out = _failure(exc, "build", _names(family, None) if _catalog_ok(family) else set())
    else:
        try:
            out = {"ok": True, "weights": _weights_sum(model), **body(model)}
        except BaseException as exc:
            out = _failure(exc, "run", _names(family, model))
    out["seconds"] = round(time.perf_counter() - start, 4)
    return {**seen, **out}


def _catalog_ok(family: str) -> bool:
    try:
        fc.model_class(family)
        return True
    except Exception:
        return False


def _cp_run(family: str, attn: str, make_body: Callable[[Any], Callable[[Any], dict]]) -> dict:
    """A run under context parallelism on a fresh group of every rank."""
    from torch.distributed.device_mesh import DeviceMesh

    from harness import _restore_process_state

    _agree()
    group = dist.new_group(backend="gloo",
                           timeout=datetime.timedelta(seconds=RUN_GROUP_TIMEOUT_S))
    mesh = DeviceMesh.from_group(group, "cpu")
    out = _run(family, attn, make_body(mesh))
    _restore_process_state()
    del mesh
    if out["ok"]:  # a group a failed collective left behind is not torn down (it may block)
        dist.destroy_process_group(group)
    return out


_OWN_LOSS = "computes its loss from labels= itself"
PARTS = ("one_process", "sdpa", "cplib", "trainer")


def run_part(family: str, part: str, switches: tuple[str, ...] = SWITCHES,
             helper: bool = False, layouts: tuple[str, ...] | None = None) -> dict[str, Any]:
    """One task of ``family`` on every rank: ``{"runs": {run: outcome}}``.
    ``one_process``: rank 0 the eager reference (and whether the family is
    causal), the last rank ``cplib_outside`` and Trainer's one-process step;
    ``sdpa`` / ``cplib``: the region's runs in ``layouts`` (None: every one); ``trainer``:
    the Trainer step. A region run refused for the model's own loss (cplib
    cannot shard a loss the model computes itself) runs again with
    ``cplib.loss.cross_entropy`` on its logits (``<run>+helper_loss``):
    whether its attention is exact; ``helper``: every run but Trainer's with
    that loss (for a family whose own loss fails in one process). Until it
    returns, the rank's stack goes
    to ``hang_dump_path()`` after ``HANG_DUMP_S``: what a task that does not
    finish was waiting in."""
    import cplib.hf  # noqa: F401  (attn_implementation="cplib")

    rank, n = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    runs: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    start = time.perf_counter()
    with open(hang_dump_path(), "w") as dump:
        faulthandler.dump_traceback_later(HANG_DUMP_S, exit=False, file=dump)
        try:
            trainer = "trainer" in switches and _catalog_ok(family) and \
                fc.trains_with_labels(family)
            if part == "one_process":
                _one_process_part(family, switches, trainer, runs, helper)
            elif part in ("sdpa", "cplib"):
                _region_part(family, part, runs, helper,
                             tuple(fs.LAYOUTS) if layouts is None else layouts)
            elif part == "trainer" and trainer:
                runs["trainer"] = _cp_run(family, "sdpa", fs.trainer_like(family))
            elif part == "trainer":
                skipped["trainer"] = "no LM head: Trainer trains the family's " \
                    "ForConditionalGeneration"
        finally:
            faulthandler.cancel_dump_traceback_later()
    return {"family": family, "rank": rank, "runs": runs, "skipped": skipped,
            "seconds": round(time.perf_counter() - start, 3), "world": n}


def _one(family: str, **kw: Any) -> Callable[[Any], dict]:
    """A one-process run of ``family`` (family_steps.one_process)."""
    return lambda model: fs.one_process(model, fs.make_batch(family), **kw)


def _one_process_part(family: str, switches: tuple[str, ...], trainer: bool,
                      runs: dict[str, dict], helper: bool) -> None:
    rank, n = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        probe: dict[str, Any] = {}
        runs["reference"] = _run(family, "eager", _one(family, probe=probe, helper=helper), probe)
    if rank == n - 1:
        if "cplib_outside" in switches:
            runs["cplib_outside"] = _run(family, "cplib", _one(family, helper=helper))
        if trainer:
            runs["reference_train"] = _run(family, "eager", _one(family, train=True))


def _region_part(family: str, switch: str, runs: dict[str, dict], helper: bool,
                 layouts: tuple[str, ...]) -> None:
    for layout in layouts:
        name = f"{switch}/{layout}"
        runs[name] = _cp_run(family, switch, fs.in_region(family, layout, helper))
        own_loss = not helper and not runs[name]["ok"] and _OWN_LOSS in runs[name]["message"]
        if all(_agree(own_loss)):
            if dist.get_rank() == 0 and "reference_helper" not in runs:
                runs["reference_helper"] = _run(family, "eager", _one(family, helper=True))
            runs[name + "+helper_loss"] = _cp_run(family, switch,
                                                  fs.in_region(family, layout, helper=True))


HANG_DUMP_S = float(os.environ.get("CPLIB_FAMILY_HANG_DUMP", "45"))


def hang_dump_path(pid: int | None = None) -> str:
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"cplib-family-{pid or os.getpid()}.txt")
