"""One registry of every attribute cplib replaces in another library
(cplib/patch_registry.py): each replacement is recorded with its
owner and original, and uninstalling puts back the very object that was
there, for every switch (``import cplib.hf``, ``cplib.patch_torch()``, a
context-parallel start, the dispatcher, the DTensor conv) and every model
family built meanwhile. Before, only torch's names and the losses could be
undone: ``unpatch_torch()`` left transformers patched once a region had run."""

from __future__ import annotations

import importlib
import sys
import types

import pytest
import torch

from cplib import patch_registry as registry


def test_replace_records_the_original_and_restore_puts_it_back():
    class Base:
        def f(self):
            return "base"

    class Child(Base):
        pass

    module = types.ModuleType("lib")
    module.g = len
    table = {"k": 1}
    seen = []
    registry.replace("test", Child, "f", lambda f: seen.append(f) or (lambda self: "wrapped"))
    registry.replace("test", module, "g", lambda g: abs)
    registry.replace("test", table, "k", lambda _: 2)
    registry.replace("test", table, "new", lambda _: 3)
    assert seen == [Base.__dict__["f"]]  # made from what the class resolves (inherited)
    assert registry.replace("test", module, "g", lambda g: max) is abs  # once
    assert Child().f() == "wrapped" and module.g is abs and table == {"k": 2, "new": 3}
    assert registry.original(Child, "f") is registry.MISSING  # Child held none of its own
    assert registry.restore("test") == 4 and registry.restore("test") == 0
    assert "f" not in vars(Child) and Child().f() == "base"
    assert module.g is len and table == {"k": 1}


def _modules_and_classes() -> list:
    """What cplib may patch: torch's context-parallel modules, DTensor's
    handler table, transformers' model modules imported now, their classes
    and transformers' own classes cplib reaches."""
    from torch.distributed.tensor import DTensor
    from transformers import masking_utils
    from transformers.modeling_utils import AttentionInterface, PreTrainedModel
    from transformers.masking_utils import AttentionMaskInterface

    from cplib.integrations.torch_names import PATCHED_MODULES

    targets = [importlib.import_module(m) for m in PATCHED_MODULES if _importable(m)]
    targets += [DTensor._op_dispatcher._custom_op_handlers, masking_utils, AttentionInterface,
                PreTrainedModel, AttentionInterface._global_mapping,
                AttentionMaskInterface._global_mapping]
    for name, module in list(sys.modules.items()):
        if name.startswith("transformers.models.") and module is not None:
            targets.append(module)
            targets += [c for c in vars(module).values()
                        if isinstance(c, type) and c.__module__ == name]
    return targets


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
        return True
    except ImportError:
        return False


def _contents(target) -> dict:
    return dict(target) if isinstance(target, dict) else dict(vars(target))


def _install_everything() -> None:
    """Every switch, and a model of several kinds built after it (each build
    reaches its family's module and classes)."""
    import cplib
    import cplib.hf
    from client_cases import tiny_llama, tiny_mixtral
    from hybrid_cases import tiny_model

    cplib.hf.install()
    cplib.patch_torch()
    cplib._enable_context_parallel_dispatcher()
    cplib.enable_dtensor_conv()
    tiny_llama(), tiny_mixtral(), tiny_model("qwen3_next", attn_implementation="sdpa")
    import transformers as tf

    tf.LlamaForSequenceClassification(tiny_llama().config)  # a pooled head


def test_uninstall_puts_back_every_original_object():
    pytest.importorskip("transformers", reason="requirements-dev.txt pins it (make build)")
    import cplib
    import cplib.hf
    from cplib.integrations import uninstall

    for family in ("llama", "mixtral", "qwen3_next"):  # their modules exist before the snapshot
        importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    cplib._disable_context_parallel_dispatcher()
    uninstall()
    before = {id(t): (t, _contents(t)) for t in _modules_and_classes()}
    try:
        _install_everything()
        installed = registry.patches()
        owners = {p.owner for p in installed}
        assert owners == {"torch", "transformers", "cplib.hf", "dtensor_sdpa", "dtensor_conv"}, \
            owners
        assert len(installed) > 40, len(installed)
        unknown = [p for p in installed if id(p.target) not in before]
        assert not unknown, [(p.target, p.name) for p in unknown[:5]]
        cplib._disable_context_parallel_dispatcher()
        uninstall()
        assert registry.patches() == []
        for p in installed:
            target, held = before[id(p.target)]
            now = _contents(target)
            assert (p.name in now) == (p.name in held), (target, p.name)
            if p.name in held:
                assert now[p.name] is held[p.name], (target, p.name)
    finally:
        cplib._disable_context_parallel_dispatcher()
        uninstall()
        cplib.hf.install()  # as the rest of this process found it: `import cplib.hf` ran
    assert torch.distributed.tensor.experimental.context_parallel is not cplib.context_parallel
