"""The package's layout rules (issue 30), from the source (nothing is imported):

* no Python module under cplib/ is over MAX_MODULE_LINES lines;
* no function is over MAX_FUNCTION_LINES lines, its docstring not counted;
* every csrc/torch/ folder has a cplib/ folder of the same name, or README.md's
  "Layout" section names it (``csrc/torch/<name>/``) with the words
  "no Python counterpart" or "no page" on the same line;
* every cplib/ feature folder has its page, docs/<name>.md, linked from README.md;
* every relative link in README.md and docs/*.md names a file that exists and,
  after a ``#``, a heading of that file (GitHub's anchors);
* tests/ mirrors the package: no file over MAX_TEST_FILE_LINES lines, no
  function over MAX_FUNCTION_LINES; every folder is a cplib/ package's name or
  one of TEST_FOLDERS_OF_THEIR_OWN; a GPU test (``cuda``-marked) sits in its
  feature's folder.

    python build_support/layout_check.py   # prints each problem; exit 1 if any
"""

from __future__ import annotations

import ast
import os
import re
import sys

MAX_MODULE_LINES = 350
MAX_FUNCTION_LINES = 80
NO_COUNTERPART = ("no Python counterpart", "no page")
MAX_TEST_FILE_LINES = 400
# tests/ folders that are no cplib/ package, and what they hold.
TEST_FOLDERS_OF_THEIR_OWN = {
    "support": "what several test files share (on sys.path through tests/conftest.py)",
    "package": "the package as a whole: build, layout, import and harness checks",
    "gpu": "the GPU check's own run on the CPU (benchmarks/gpu/)",
}


def _docstring_lines(node: ast.AST) -> int:
    body = getattr(node, "body", [])
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        return body[0].end_lineno - body[0].lineno + 1
    return 0


def function_lengths(source: str, filename: str = "<source>") -> list[tuple[str, int, int]]:
    """(qualified name, first line, lines without the docstring) of every function."""
    out: list[tuple[str, int, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = child.decorator_list[0].lineno if child.decorator_list else child.lineno
                lines = child.end_lineno - first + 1 - _docstring_lines(child)
                out.append((prefix + child.name, child.lineno, lines))
                visit(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source, filename), "")
    return out


def python_files(package_root: str) -> list[str]:
    out = []
    for root, dirs, files in os.walk(package_root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        out += [os.path.join(root, f) for f in sorted(files) if f.endswith(".py")]
    return out


def size_problems(repo: str, package: str = "cplib",
                  max_lines: int = MAX_MODULE_LINES) -> list[str]:
    """Files of ``package`` (a folder of ``repo``) over ``max_lines`` lines,
    functions over MAX_FUNCTION_LINES."""
    problems = []
    for path in python_files(os.path.join(repo, package)):
        rel = os.path.relpath(path, repo)
        with open(path, encoding="utf-8") as fh:
            source = fh.read()
        n = len(source.splitlines())
        if n > max_lines:
            problems.append(f"{rel}: {n} lines (at most {max_lines})")
        for name, line, length in function_lengths(source, rel):
            if length > MAX_FUNCTION_LINES:
                problems.append(f"{rel}:{line}: {name} is {length} lines without its docstring "
                                f"(at most {MAX_FUNCTION_LINES})")
    return problems


def readme_layout(repo: str) -> str:
    """The text of README.md's "Layout" section ('' when there is none)."""
    with open(os.path.join(repo, "README.md"), encoding="utf-8") as fh:
        text = fh.read()
    m = re.search(r"^## Layout[^\n]*\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    return m.group(1) if m else ""


def mirror_problems(repo: str, package: str = "cplib") -> list[str]:
    native = os.path.join(repo, "csrc", "torch")
    layout = readme_layout(repo)
    problems = []
    for name in sorted(os.listdir(native)):
        if not os.path.isdir(os.path.join(native, name)):
            continue
        if os.path.isfile(os.path.join(repo, package, name, "__init__.py")):
            continue
        said = any(f"csrc/torch/{name}/" in line and any(w in line for w in NO_COUNTERPART)
                   for line in layout.splitlines())
        if not said:
            problems.append(f"csrc/torch/{name}/ has no {package}/{name}/ and README.md's Layout "
                            f"section does not say why (\"no Python counterpart\")")
    return problems


def docs_problems(repo: str, package: str = "cplib") -> list[str]:
    with open(os.path.join(repo, "README.md"), encoding="utf-8") as fh:
        readme = fh.read()
    problems = []
    root = os.path.join(repo, package)
    for name in sorted(os.listdir(root)):
        if not os.path.isfile(os.path.join(root, name, "__init__.py")):
            continue
        page = f"docs/{name}.md"
        if not os.path.isfile(os.path.join(repo, page)):
            problems.append(f"{package}/{name}/ has no page {page}")
        elif f"({page})" not in readme and f"({page}#" not in readme:
            problems.append(f"README.md does not link to {page}")
    return problems


def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: str) -> set[str]:
    with open(path, encoding="utf-8") as fh:
        text = re.sub(r"(?ms)^```.*?^```", "", fh.read())  # no headings inside code
    return {anchor(m.group(1)) for m in re.finditer(r"(?m)^#+ (.*)$", text)}


def link_problems(repo: str) -> list[str]:
    docs = os.path.join(repo, "docs")
    pages = [os.path.join(repo, "README.md")] + sorted(
        os.path.join(docs, f) for f in os.listdir(docs) if f.endswith(".md"))
    problems = []
    for page in pages:
        with open(page, encoding="utf-8") as fh:
            text = re.sub(r"(?ms)^```.*?^```", "", fh.read())
        rel = os.path.relpath(page, repo)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # a URL
            path, _, frag = target.partition("#")
            full = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if not os.path.exists(full):
                problems.append(f"{rel}: link to {target}: no such file")
            elif frag and full.endswith(".md") and frag not in _anchors(full):
                problems.append(f"{rel}: link to {target}: no such heading")
    return problems


def _marks_cuda(source: str) -> bool:
    """A module marked as GPU tests (``pytestmark = GPU_MARKS``, or the cuda
    mark on the module or a test)."""
    return re.search(r"^pytestmark\s*=.*GPU_MARKS|\bpytest\.mark\.cuda\b", source, re.M) \
        is not None


def tests_problems(repo: str, package: str = "cplib") -> list[str]:
    """The rules of tests/: file and function sizes, folders that mirror the
    package, GPU tests beside their feature's other tests."""
    tests = os.path.join(repo, "tests")
    packages = {name for name in os.listdir(os.path.join(repo, package))
                if os.path.isfile(os.path.join(repo, package, name, "__init__.py"))}
    problems = size_problems(repo, "tests", MAX_TEST_FILE_LINES)
    for name in sorted(os.listdir(tests)):
        if os.path.isdir(os.path.join(tests, name)) and name != "__pycache__" \
                and name not in packages and name not in TEST_FOLDERS_OF_THEIR_OWN:
            problems.append(f"tests/{name}/ is no {package}/ package's name (tests mirror the "
                            f"package) nor one of {sorted(TEST_FOLDERS_OF_THEIR_OWN)}")
    for path in python_files(tests):
        rel = os.path.relpath(path, repo)
        with open(path, encoding="utf-8") as fh:
            source = fh.read()
        folder = rel.split(os.sep)[1] if rel.count(os.sep) >= 2 else ""
        if os.path.basename(path).startswith("test_") and _marks_cuda(source) \
                and folder not in packages:
            problems.append(f"{rel}: a GPU test outside a feature's folder (put it in "
                            f"tests/<feature>/ beside that feature's other tests)")
    return problems


def main(argv: list[str]) -> int:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    problems = (size_problems(repo) + mirror_problems(repo) + docs_problems(repo)
                + link_problems(repo) + tests_problems(repo))
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
