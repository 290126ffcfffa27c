"""build_support/'s modules for the tests that check the build and the layout."""

from __future__ import annotations

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build_support_module(name: str):
    """build_support/<name>.py, loaded by its path: putting the repository
    root on sys.path would make every later test (and its rank processes)
    import the source tree's cplib instead of the one under test."""
    spec = importlib.util.spec_from_file_location(
        f"cplib_build_support_{name}", os.path.join(ROOT, "build_support", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
