"""``cplib.patch_torch()``: every name the pinned clients (accelerate 1.15.0,
transformers 5.23.0, torchtitan 0.3.0) import from torch's context-parallel
modules is cplib's after it, read from the clients' own installed source (so
a client release that imports one more name fails here), and
``cplib.unpatch_torch()`` puts back exactly what was there."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os

import pytest

CLIENTS = ("accelerate", "transformers", "torchtitan")
CP_MODULE_PREFIXES = ("torch.distributed.tensor.experimental",
                      "torch.distributed._tensor.experimental")  # the old alias
# What the clients take from torch.distributed.tensor.experimental itself that
# is not context parallelism (DTensor helpers).
NOT_CONTEXT_PARALLEL = {"local_map", "register_sharding", "implicit_replication"}


def _package_dir(name: str) -> str:
    spec = importlib.util.find_spec(name)
    if spec is None:
        pytest.skip(f"{name} is not installed (requirements/clients.txt; `make build` installs it)")
    return spec.submodule_search_locations[0]


def _cp_imports(path: str) -> tuple[set[tuple[str, str]], list[str]]:
    """(module, name) of every `from <torch CP module> import name` in the
    file, and the `import <torch CP module>` statements (attribute access the
    test cannot follow)."""
    with open(path, encoding="utf-8") as fh:
        source = fh.read()
    if "tensor.experimental" not in source:
        return set(), []
    names, plain = set(), []
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.ImportFrom) and node.module and \
                node.module.startswith(CP_MODULE_PREFIXES):
            module = node.module.replace("torch.distributed._tensor.", "torch.distributed.tensor.")
            for alias in node.names:
                if not (module == CP_MODULE_PREFIXES[0] and alias.name in NOT_CONTEXT_PARALLEL):
                    names.add((module, alias.name))
        elif isinstance(node, ast.Import):
            plain += [f"{path}:{node.lineno}: import {a.name}" for a in node.names
                      if a.name.startswith(CP_MODULE_PREFIXES)]
    return names, plain


def clients_cp_imports() -> dict[tuple[str, str], list[str]]:
    """(module, name) -> the client files that import it."""
    found: dict[tuple[str, str], list[str]] = {}
    plain: list[str] = []
    for client in CLIENTS:
        root = _package_dir(client)
        for dirpath, _, files in os.walk(root):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    names, imports = _cp_imports(path)
                    plain += imports
                    for key in names:
                        found.setdefault(key, []).append(os.path.relpath(path, root))
    assert not plain, f"clients import torch's CP modules as modules: {plain}"
    return found


def test_patch_torch_covers_every_name_the_clients_import():
    import cplib

    imported = clients_cp_imports()
    exp = "torch.distributed.tensor.experimental"
    # The reader finds what the issue found by hand (accelerate's prepare(),
    # torchtitan's CP API).
    for key in [(exp, "context_parallel"), (f"{exp}._attention", "set_rotate_method"),
                (f"{exp}._attention", "_context_parallel_shard"),
                (f"{exp}._context_parallel._attention", "flex_cp_allgather")]:
        assert key in imported, (key, sorted(imported))
    originals = {key: getattr(importlib.import_module(key[0]), key[1], None) for key in imported}
    cplib.patch_torch()
    try:
        missed = [f"{m}.{n} (imported by {imported[(m, n)][:2]})" for m, n in imported
                  if getattr(importlib.import_module(m), n, None)
                  is not getattr(cplib, n, object())]
    finally:
        cplib.unpatch_torch()
    assert not missed, f"cplib.patch_torch() does not cover: {missed}"
    for key, obj in originals.items():
        assert getattr(importlib.import_module(key[0]), key[1], None) is obj, key


def _snapshot() -> dict[str, dict[str, object]]:
    from cplib.integrations.torch_names import PATCHED_MODULES

    out = {}
    for name in PATCHED_MODULES:
        try:
            out[name] = dict(vars(importlib.import_module(name)))
        except ImportError:
            continue
    return out


def test_patch_torch_is_idempotent_and_unpatch_restores_exactly():
    import cplib
    from cplib.integrations.torch_names import PATCHED_MODULES

    before = _snapshot()
    assert "torch.distributed.tensor.experimental._attention" in before
    try:
        cplib.patch_torch()
        cplib.patch_torch()  # idempotent: the second call changes nothing
        for module, names in PATCHED_MODULES.items():
            if module in before:
                mod = importlib.import_module(module)
                for n in names:
                    assert getattr(mod, n) is getattr(cplib, n), (module, n)
        from torch.distributed.tensor.experimental._attention import set_rotate_method
        assert set_rotate_method is cplib.set_rotate_method
    finally:
        cplib.unpatch_torch()
        cplib.unpatch_torch()  # and so is the inverse
    after = _snapshot()
    assert after.keys() == before.keys()
    for module, attrs in before.items():
        assert after[module].keys() == attrs.keys(), module
        changed = [n for n, obj in attrs.items() if after[module][n] is not obj]
        assert not changed, (module, changed)


def test_a_module_that_imported_torchs_names_first_is_named():
    import sys
    import types
    import warnings

    import cplib
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    early = types.ModuleType("early_client")
    early.set_rotate_method = set_rotate_method  # `from ... import` before the switch
    sys.modules["early_client"] = early
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cplib.patch_torch()
        assert any("early_client.set_rotate_method" in str(w.message) for w in caught), \
            [str(w.message) for w in caught]
    finally:
        cplib.unpatch_torch()
        del sys.modules["early_client"]
