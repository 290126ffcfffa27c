// Attention sinks (gpt-oss): one learned logit per q head that joins every
// row's softmax denominator and contributes no value. Applied once to the
// merged (out, lse); the block backward run with the sunk (out', lse') is
// then exact for q, k and v (the sinks' own gradient is computed in Python:
// cplib/ring/op.py).
#pragma once

#include "common/stable.h"

// Internal to the extension (torch's stable types are hidden).
#pragma GCC visibility push(hidden)

namespace cplib::attention {

// Attention sinks: a 1-D tensor of one logit per q head, on q's device, in
// q's dtype or float32/float64 (ValueError naming what is wrong).
void check_sinks(const char* op, const Tensor& q, const Tensor& sinks);

// Joins each row's softmax denominator with its head's sink logit, once:
// lse' = logaddexp(lse, s), out *= exp(lse - lse'). `out` (B, H, L, Dv) is
// scaled in place in the accumulator dtype; returns lse' in that dtype.
Tensor apply_sinks(Tensor& out, const Tensor& lse, const Tensor& sinks);

}  // namespace cplib::attention

#pragma GCC visibility pop
