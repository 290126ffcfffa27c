"""Import cycles among a package's modules, from their source (no import
runs), and the direction of every import between the package's folders.
Every ``import``/``from ... import`` counts, module-level or inside a
function: a lazy import only hides a cycle, or an arrow that runs up, until
someone moves it.

The folders' order is README.md's layer list (the lines under "arrows run
down this list, never up"): a module imports its own folder and the folders
of the lines below its own, never a line above it nor another folder of its
own line. A folder or top-level module missing from the list is a problem
too (a new one is placed when it is added). The package's ``__init__`` sits
above every line (it loads them all), and importing the package itself (how
a submodule gets loaded) is no arrow.

    python build_support/import_cycles.py cplib   # prints each problem; exit 1 if any
"""

from __future__ import annotations

import ast
import os
import re
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


LIST_MARK = "arrows run down this list, never up"


def layer_order(readme: str) -> list[list[str]]:
    """README.md's layer list, top first: each line's folders (``ring``) or
    top-level modules (``loss`` for ``loss.py``). The list is the indented
    block under the line that carries ``LIST_MARK``; a line of the list is
    indented by two spaces and names its entries before a run of spaces, a
    continuation is indented further."""
    with open(readme, encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    start = next((i for i, line in enumerate(lines) if LIST_MARK in line), None)
    if start is None:
        raise ValueError(f"{readme}: no line says {LIST_MARK!r}")
    layers = []
    for line in lines[start + 1:]:
        if not line.startswith(" "):
            break
        m = re.match(r"^  (\S.*?)(\s{2,}|$)", line)
        if m:
            names = [n.strip() for n in m.group(1).split(",")]
            layers.append([n[:-1] if n.endswith("/") else n[:-3] if n.endswith(".py") else n
                           for n in names])
    if not layers:
        raise ValueError(f"{readme}: the layer list under {LIST_MARK!r} is empty")
    return layers


def _unit(package: str, module: str) -> str | None:
    """The folder (or top-level module) of ``module``; None for the package's ``__init__``."""
    parts = module.split(".")
    return parts[1] if parts[0] == package and len(parts) > 1 else None


def layer_problems(graph: dict[str, set[str]], package: str,
                   layers: list[list[str]]) -> list[str]:
    """Each import that runs up the list or across one line, and each folder
    or top-level module the list does not place."""
    level = {name: i for i, line in enumerate(layers) for name in line}
    out = []
    for unit in sorted({_unit(package, m) for m in graph} - {None} - set(level)):
        out.append(f"{package}/{unit} is not in README.md's layer list: place it")
    for name, targets in sorted(graph.items()):
        mine = _unit(package, name)
        if mine is None or mine not in level:
            continue
        by_unit: dict[str, list[str]] = {}  # one report per folder a module reaches
        for t in sorted(targets):
            by_unit.setdefault(_unit(package, t), []).append(t)
        for theirs, reached in sorted(by_unit.items(), key=lambda kv: kv[1]):
            if theirs is None or theirs == mine or theirs not in level:
                continue
            if level[theirs] < level[mine]:
                out.append(f"import runs up the layer list: {name} -> {', '.join(reached)}")
            elif level[theirs] == level[mine]:
                out.append(f"import across one line of the layer list: {name} -> "
                           f"{', '.join(reached)}")
    return out


def main(argv: list[str]) -> int:
    package = argv[1] if len(argv) > 1 else "cplib"
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    graph = import_graph(os.path.join(repo, package), package)
    found = cycles(graph)
    for c in found:
        print("import cycle: " + " <-> ".join(c))
    problems = layer_problems(graph, package, layer_order(os.path.join(repo, "README.md")))
    for problem in problems:
        print(problem)
    return 1 if found or problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
