"""build_support/cxx_functions.py, which layout_check uses for csrc/'s
function lengths, on the C++ that trips a brace counter: lambdas, macros that
open a function, brace initializers, braces inside strings, characters,
comments and preprocessor lines, constructors' initializer lists, operators,
templates, namespaces, classes and extern "C" blocks."""

from __future__ import annotations

from build_support_modules import build_support_module as _module

SOURCE = r'''#include "x.h"
#define OPEN {
#define BLOCK(x) { x; }
// A comment with { an open brace
namespace cplib {
namespace {

constexpr const char* kNames[] = {"a{", "b}"};
const std::vector<int64_t> kSizes{1, 2, 3};
std::array<int, 2> pair = {{1, 2}};
enum class Kind { a, b };

int lambdas(int x) {
  auto f = [&](int y) { return x + y; };
  auto g = [] { return '{'; };
  return f(g());
}

}  // namespace

struct Box {
  Box(int a, int b) : a_{a}, b_(b) {
    touch();
  }
  int get() const { return a_; }
  bool operator()(int x) const {
    return x == a_;
  }
  int a_{0}, b_ = 1;
};

template <class T, class = std::enable_if_t<(sizeof(T) > 1)>>
T strings(T t) {
  const char* s = "}}} /* not a comment */";
  const char* r = R"raw(a { b )raw";
  /* a block comment }
     over lines { */
  return t;
}

extern "C" int c_entry(void) {
  return 0;
}

extern "C" {
int in_block(void) { return 1; }
}

int Box::twice() const noexcept {
  return 2 * a_;
}

}  // namespace cplib

STABLE_TORCH_LIBRARY_IMPL(cplib_c, CPU, m) {
  m.impl("a", CPLIB_BOX(&a));
  m.impl("b", CPLIB_BOX(&b));
}
'''


def test_tricky_source_gives_each_function_with_its_lines():
    cxx = _module("cxx_functions")
    assert cxx.function_lengths(SOURCE) == [
        ("lambdas", 13, 5),
        ("Box", 22, 3),
        ("get", 25, 1),
        ("operator()", 26, 3),
        ("strings", 32, 8),
        ("c_entry", 41, 3),
        ("in_block", 46, 1),
        ("Box::twice", 49, 3),
        ("STABLE_TORCH_LIBRARY_IMPL", 55, 4),
    ]


def test_blank_keeps_lines_and_hides_literals():
    cxx = _module("cxx_functions")
    text = cxx.blank(SOURCE)
    assert text.count("\n") == SOURCE.count("\n")
    assert "raw" not in text and "not a comment" not in text and "#define" not in text
    assert text.count("{") == text.count("}")


def test_layout_check_names_long_files_functions_and_upward_includes(tmp_path):
    lc = _module("layout_check")
    for folder in ("ring", "attention", "common"):
        (tmp_path / "csrc" / "torch" / folder).mkdir(parents=True)
    long_body = "int long_one() {\n" + "  step();\n" * 80 + "}\n"
    (tmp_path / "csrc/torch/ring/long.cpp").write_text(long_body)
    (tmp_path / "csrc/torch/ring/big.h").write_text("int x;\n" * 401)
    (tmp_path / "csrc/torch/attention/up.h").write_text(
        '#include "common/stable.h"\n#include "ring/ring.h"\n#include <vector>\n')
    (tmp_path / "csrc/torch/common/c.h").write_text('#include "cplib/core.h"\n')
    assert lc.native_problems(str(tmp_path)) == [
        "csrc/torch/attention/up.h:2: csrc/torch/attention/ includes ring/ (it may include "
        "only attention, common)",
        "csrc/torch/ring/big.h: 401 lines (at most 400)",
        "csrc/torch/ring/long.cpp:1: long_one is 82 lines (at most 80)",
    ]
