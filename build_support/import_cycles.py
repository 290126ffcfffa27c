"""Import cycles among a package's modules, from their source (no import
runs). Every ``import``/``from ... import`` counts, module-level or inside a
function: a lazy import only hides a cycle until someone moves it. Also the
direction of the arrows between folders: no feature folder (one that mirrors
a csrc/torch/ folder: ring, ulysses, ...) imports the front end.

    python build_support/import_cycles.py cplib   # prints each problem; exit 1 if any
"""

from __future__ import annotations

import ast
import os
import sys


def _module_name(root: str, package: str, path: str) -> str:
    rel = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
    name = f"{package}.{rel}" if rel != "__init__" else package
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def import_graph(root: str, package: str) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (``__init__`` excluded as a
    target: importing the package itself is how submodules get loaded)."""
    paths = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                paths[_module_name(root, package, path)] = path
    graph: dict[str, set[str]] = {name: set() for name in paths}
    for name, path in paths.items():
        is_pkg = path.endswith("__init__.py")
        base = name if is_pkg else name.rpartition(".")[0]
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), path)
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                if node.level:
                    parts = base.split(".")
                    anchor = ".".join(parts[: len(parts) - node.level + 1])
                    mod = f"{anchor}.{mod}" if mod else anchor
                targets = [f"{mod}.{a.name}" for a in node.names] + [mod]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for t in targets:
                if t in paths and t != name and t != package:
                    graph[name].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


FRONT_END = "frontend"


def feature_folders(repo: str) -> list[str]:
    """The csrc/torch/ folders (one per feature of the native side)."""
    native = os.path.join(repo, "csrc", "torch")
    return sorted(d for d in os.listdir(native) if os.path.isdir(os.path.join(native, d)))


def front_end_imports(graph: dict[str, set[str]], package: str,
                      features: list[str]) -> list[tuple[str, str]]:
    """(module, front-end module) for each import of the front end from a
    feature folder: features sit below the front end, never above it."""
    front = f"{package}.{FRONT_END}"
    out = []
    for name, targets in sorted(graph.items()):
        folder = name[len(package) + 1:].split(".")[0] if name.startswith(package + ".") else ""
        if folder in features:
            out += [(name, t) for t in sorted(targets) if t == front or t.startswith(front + ".")]
    return out


def main(argv: list[str]) -> int:
    package = argv[1] if len(argv) > 1 else "cplib"
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    graph = import_graph(os.path.join(repo, package), package)
    found = cycles(graph)
    for c in found:
        print("import cycle: " + " <-> ".join(c))
    upward = front_end_imports(graph, package, feature_folders(repo))
    for mod, target in upward:
        print(f"feature imports the front end: {mod} -> {target}")
    return 1 if found or upward else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
