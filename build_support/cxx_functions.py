"""Function lengths of C, C++ and CUDA source, for build_support/layout_check.py.

No compiler and no parser: comments, string and character literals and
preprocessor lines are blanked (newlines kept, so line numbers hold), then
braces are matched. A ``{`` opened at file scope, in a namespace, in an
``extern "C"`` block or in a class body starts a function body when the text
before it (its head, back to the previous ``;``, ``{`` or ``}`` at that level)
has a parameter list and no ``=`` before it: functions, member functions,
operators, constructors (with their initializer lists), macros that expand
to a function (``STABLE_TORCH_LIBRARY_IMPL(cplib_c, CPU, m) {``). Brace
initializers (``x = {...}``, ``kNames{"a", "b"}``) and enums are skipped;
namespaces and class bodies are entered. A function's length runs from the
first line of its head (``template <...>`` included, the comment above it
not) to the line of its closing brace; lambdas and local classes count in
the function that holds them.
"""

from __future__ import annotations

import re

# The head of a scope whose body holds declarations, not statements.
# (Blanking keeps a literal's length: extern "C" reads as extern " ".)
_SCOPE = re.compile(r"^(?:namespace\b|extern\s*\"\s*\"\s*$|(?:class|struct|union)\b)")
_ENUM = re.compile(r"^(?:typedef\s+)?enum\b")
# An operator's name, up to its parameter list: operator(), operator<<, operator bool.
_OPERATOR = re.compile(r"\boperator\s*(?:\(\s*\)|\[\s*\]|[^\s\w(]+|\w[\w\s:*&]*?)\s*(?=\()")
_ACCESS = re.compile(r"^\s*(?:(?:public|private|protected)\s*:(?!:)\s*)*")
_CHAR_PREFIXES = ("L", "u", "U", "u8")


def blank(source: str) -> str:
    """`source` with comments, literals and preprocessor lines replaced by
    spaces (a literal keeps its quotes and its length: ``"C"`` reads ``" "``),
    newlines kept."""
    out = []
    i, n = 0, len(source)
    line_start = True
    while i < n:
        c = source[i]
        if line_start and c == "#":
            j = i
            while j < n and (source[j] != "\n" or source[j - 1] == "\\"):
                j += 1
            out.append(_spaces(source[i:j]))
            i = j
            continue
        if c == "\n":
            line_start = True
            out.append(c)
            i += 1
            continue
        if not c.isspace():
            line_start = False
        if source.startswith("//", i):
            j = source.find("\n", i)
            j = n if j < 0 else j
            out.append(_spaces(source[i:j]))
            i = j
        elif source.startswith("/*", i):
            j = source.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(_spaces(source[i:j]))
            i = j
        elif c == '"' or (c == "'" and _is_char_literal(source, i)):
            j = _literal_end(source, i)
            out.append(c + _spaces(source[i + 1:j - 1]) + c)
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _spaces(text: str) -> str:
    return re.sub(r"[^\n]", " ", text)


def _is_char_literal(source: str, i: int) -> bool:
    """A quote that opens a character literal, not a digit separator (1'000)."""
    m = re.search(r"(\w+)$", source[max(0, i - 8):i])
    return m is None or m.group(1) in _CHAR_PREFIXES


def _literal_end(source: str, i: int) -> int:
    """The index past the literal opened by the quote at i (raw strings too)."""
    quote = source[i]
    raw = re.search(r"(?:^|[^\w])(?:u8|u|U|L)?R$", source[max(0, i - 3):i])
    if quote == '"' and raw:
        m = re.match(r'"([^(\s]*)\(', source[i:])
        if m:
            end = source.find(")" + m.group(1) + '"', i)
            return len(source) if end < 0 else end + len(m.group(1)) + 2
    j = i + 1
    while j < len(source) and source[j] != quote:
        if source[j] == "\n":  # an unterminated literal: stop at the line's end
            return j
        j += 2 if source[j] == "\\" else 1
    return min(j + 1, len(source))


def _strip_template(h: str) -> str:
    """`h` without a leading ``template <...>`` (nested brackets matched)."""
    m = re.match(r"template\s*<", h)
    if not m:
        return h
    depth = 0
    for i in range(m.end() - 1, len(h)):
        depth += {"<": 1, ">": -1}.get(h[i], 0)
        if depth == 0:
            return h[i + 1:].lstrip()
    return h


def _params_paren(h: str) -> int:
    """The index of the '(' that opens the parameter list, or -1."""
    m = _OPERATOR.search(h)
    if m:
        return m.end()
    angle = 0
    for i, c in enumerate(h):
        if c == "<":
            angle += 1
        elif c == ">" and angle:
            angle -= 1
        elif c == "(" and not angle:
            return i
    return -1


def _kind(head: str) -> str:
    """What a brace opened after `head` starts: "scope", "function" or "other"."""
    h = _strip_template(" ".join(head.split()))
    paren = _params_paren(h)
    before = _OPERATOR.sub("", h[:paren] if paren >= 0 else h)
    if "=" in before or _ENUM.match(h):
        return "other"
    if _SCOPE.match(h):
        return "scope"
    return "function" if paren >= 0 else "other"


def _name(head: str) -> str:
    h = _strip_template(" ".join(head.split()))
    before = h[:_params_paren(h)].rstrip()
    m = re.search(r"(?:\w+\s*::\s*)*(?:operator\b.*|~?\w+)$", before)
    return re.sub(r"\s+", "", m.group(0)) if m else before[-40:]


def _in_initializer_list(head: str, text: str, i: int) -> bool:
    """A brace of a constructor's member initializer (``: a_{1}, b_{x} {``)."""
    h = " ".join(head.split())
    paren = _params_paren(h)
    if paren < 0:
        return False
    depth, close = 0, len(h)
    for j in range(paren, len(h)):
        depth += {"(": 1, ")": -1}.get(h[j], 0)
        if depth == 0:
            close = j
            break
    if not re.match(r"\s*(?:noexcept\s*)?:(?!:)", h[close + 1:]):
        return False
    before = text[:i].rstrip()
    return bool(before) and (before[-1].isalnum() or before[-1] in "_>")


def function_lengths(source: str) -> list[tuple[str, int, int]]:
    """(name, first line, lines) of every function defined in `source`."""
    text = blank(source)
    out: list[tuple[str, int, int]] = []
    stack: list[tuple[str, int, str]] = []  # (kind, first line, name) of open braces
    head_start = 0
    depth_of_body = None  # index in `stack` of the function body being skipped
    for i, c in enumerate(text):
        if c == "{":
            if depth_of_body is not None:
                stack.append(("inner", 0, ""))
                continue
            head = text[head_start:i]
            if _in_initializer_list(head, text, i):
                stack.append(("init", 0, ""))
                continue
            kind = _kind(head) if head.strip() else "other"
            first = text.count("\n", 0, head_start + _ACCESS.match(head).end()) + 1
            stack.append((kind, first, _name(head) if kind == "function" else ""))
            if kind == "function":
                depth_of_body = len(stack) - 1
            elif kind == "other":
                depth_of_body = len(stack) - 1
            else:
                head_start = i + 1
        elif c == "}":
            if not stack:
                head_start = i + 1
                continue
            kind, first, name = stack.pop()
            if kind == "init":
                continue
            if depth_of_body is not None and len(stack) == depth_of_body:
                depth_of_body = None
                if kind == "function":
                    out.append((name, first, text.count("\n", 0, i) + 1 - first + 1))
                head_start = i + 1
            elif depth_of_body is None:
                head_start = i + 1
        elif c == ";" and depth_of_body is None and not _open_init(stack):
            head_start = i + 1
    return out


def _open_init(stack: list[tuple[str, int, str]]) -> bool:
    return bool(stack) and stack[-1][0] == "init"
