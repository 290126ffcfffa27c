// The ATen ops the native layer needs beyond torch::stable's, one typed
// wrapper each (through the stable dispatcher call), and the small tensor
// helpers the op files share (the fused attention kernels are in
// attention/kernels.h). Ops whose schema takes a Scalar are reached through
// Tensor overloads: the stable dispatcher call cannot pass a Scalar.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "common/stable.h"

// Internal to the extension (torch's stable types are hidden).
#pragma GCC visibility push(hidden)

namespace cplib::aten {

// Grad mode off for the life of the guard: the ops below run inside a
// kernel, yet each goes through the dispatcher from the top, autograd
// included (the ATen ABI had AutoDispatchBelowADInplaceOrView for that).
// Without it, the kernels' outputs would record graphs over the op's inputs
// and in-place or out= calls on them would raise.
class NoGradGuard {
 public:
  NoGradGuard();
  ~NoGradGuard();
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool prev_;
};

// What at::TensorOptions carried for the ring: a dtype and a device.
struct Opts {
  ScalarType dtype;
  Device device;
  Opts dtype_(ScalarType d) const { return {d, device}; }
};
Opts opts_of(const Tensor& t);

int64_t numel_of(const std::vector<int64_t>& sizes);
std::vector<int64_t> sizes_of(const Tensor& t);
int64_t nbytes(const Tensor& t);

Tensor empty(const std::vector<int64_t>& sizes, const Opts& o);
Tensor zeros(const std::vector<int64_t>& sizes, const Opts& o);
Tensor full(const std::vector<int64_t>& sizes, double value, const Opts& o);
Tensor empty_strided(const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides,
                     const Opts& o);
// A 1-D int64 tensor of `values` on `device` (sent to a GPU without
// waiting for it).
Tensor from_host(const std::vector<int64_t>& values, const Device& device);
// `t` on `device`: itself when there, else copied without waiting for the GPU.
Tensor on_device(const Tensor& t, const Device& device);
// The values of an integer tensor as int64, read on the host: for a tensor
// on the GPU a device-to-host copy that waits for it (keep these out of
// per-step and per-token paths; every cplib read of a tensor's values goes
// through here or the handshake's values hash).
std::vector<int64_t> to_host(const Tensor& t);

Tensor narrow(const Tensor& t, int64_t dim, int64_t start, int64_t len);

// Views made without the dispatcher (torch's _reinterpret_tensor shim): no
// ATen call, no autograd view tracking, no shared version counter. The hot
// loops of the ring take their per-step views this way; use them only for
// views that stay inside an op (never return one). Bounds are checked here.
// `t` with `sizes` and `strides`, starting `offset` elements past its first.
Tensor reinterpret(const Tensor& t, const std::vector<int64_t>& sizes,
                   const std::vector<int64_t>& strides, int64_t offset);
// Rows [start, start + len) of dim `dim` (narrow's view; `t` itself when that
// is all of them).
Tensor rows(const Tensor& t, int64_t dim, int64_t start, int64_t len);
// The contiguous `sizes`-shaped part of a contiguous buffer that starts
// `offset` elements in (one tensor of several packed in one buffer).
Tensor carve(const Tensor& buf, const std::vector<int64_t>& sizes, int64_t offset);
// Strides of a contiguous tensor of `sizes`.
std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& sizes);
Tensor view(const Tensor& t, const std::vector<int64_t>& sizes);
Tensor flat(const Tensor& t);  // view(-1)
Tensor expand(const Tensor& t, const std::vector<int64_t>& sizes);
Tensor permute(const Tensor& t, const std::vector<int64_t>& dims);
Tensor movedim(const Tensor& t, int64_t source, int64_t destination);
Tensor reshape(const Tensor& t, const std::vector<int64_t>& sizes);
Tensor repeat(const Tensor& t, const std::vector<int64_t>& reps);
Tensor to(const Tensor& t, ScalarType dtype);
Tensor to(const Tensor& t, const Device& device);
Tensor contiguous(const Tensor& t);
void copy_(const Tensor& dst, const Tensor& src);
void zero_(const Tensor& t);
void fill_(const Tensor& t, double value);

// a + b (out of place), and a += b (in place).
Tensor add(const Tensor& a, const Tensor& b);
void add_(const Tensor& a, const Tensor& b);
void mul_(const Tensor& a, const Tensor& b);
Tensor subtract(const Tensor& a, const Tensor& b);
Tensor exp(const Tensor& t);
Tensor logaddexp(const Tensor& a, const Tensor& b);
Tensor sum_dim(const Tensor& t, int64_t dim, ScalarType dtype);
void sum_dim_out(const Tensor& out, const Tensor& t, int64_t dim, ScalarType dtype);
// t with the rows where `mask` is true set to `value` (out of place; no read
// of `value` back to the host, unlike ATen's masked_fill with a tensor value).
Tensor masked_fill(const Tensor& t, const Tensor& mask, double value);
Tensor ge(const Tensor& a, const Tensor& b);
Tensor le(const Tensor& a, const Tensor& b);
Tensor eq(const Tensor& a, const Tensor& b);
Tensor logical_and(const Tensor& a, const Tensor& b);
Tensor logical_not(const Tensor& t);
Tensor any_dim(const Tensor& t, int64_t dim);
// where(cond, a, b) with a and b scalars, in `o`'s dtype and device.
Tensor where_scalars(const Tensor& cond, double a, double b, const Opts& o);
// Zero-pads the last dim of a (B, H, L, D) tensor to `d`.
Tensor pad_last(const Tensor& t, int64_t d);

}  // namespace cplib::aten

#pragma GCC visibility pop
