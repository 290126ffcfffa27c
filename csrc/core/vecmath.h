/* Branch-free float math that the compiler vectorises inside `omp simd`
 * loops (libm's expf/log1pf are calls it cannot vectorise without
 * -ffast-math, which would also break the -inf handling the merge needs).
 * GCC vectorises them only under -fno-trapping-math (setup.py's C_FP): with
 * trapping math its selects stay branches and the loop stays scalar. */
#ifndef CPLIB_CORE_VECMATH_H
#define CPLIB_CORE_VECMATH_H

#include <stdint.h>

/* x86-64 builds carry AVX-512 and AVX2 copies of the hot loops, picked once
 * at load time (a glibc ifunc), because the default target is only SSE2.
 * Other compilers and C libraries build the portable loop alone. */
#if defined(__x86_64__) && defined(__GLIBC__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(CPLIB_NO_CLONES)
#define CPLIB_CPU_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CPLIB_CPU_CLONES
#endif

/* exp(x) for -87 < x <= 0 within 2 ulp; x <= -87 (where exp is below 2e-38,
 * nothing the merge can resolve), -inf and NaN give 0. Range reduction
 * x = n ln2 + r, |r| <= ln2/2, then a degree-7 Taylor polynomial (truncation
 * error below 1e-8 relative) and 2^n built from its exponent bits. */
static inline float cplib_exp_nonpos_f32(float x) {
  const float xc = x > -87.0f ? x : -87.0f; /* also maps NaN and -inf */
  const float shifter = 12582912.0f;        /* 1.5 * 2^23: adding it rounds to an integer */
  const float n = (xc * 1.44269504088896341f + shifter) - shifter;
  float r = xc - n * 0.693145751953125f;  /* ln2 split in a high part exact in float */
  r = r - n * 1.42860682030941723212e-6f; /* and the low remainder */
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  union {
    int32_t i;
    float f;
  } scale;
  scale.i = ((int32_t)n + 127) << 23; /* n >= -126 after the clamp */
  return x > -87.0f ? p * scale.f : 0.0f;
}

/* log1p(e) for e = 0 or a normal float in (0, 1], within 2 ulp, also in
 * relative terms for tiny e: log1p(e) = 2 atanh(s), s = e / (2 + e) <= 1/3,
 * as an odd series in s whose first omitted term is below 2e-8 relative. */
static inline float cplib_log1p_unit_f32(float e) {
  const float s2 = 2.0f * e / (2.0f + e);
  const float z = 0.25f * s2 * s2;
  float p = 1.0f / 13.0f;
  p = p * z + 1.0f / 11.0f;
  p = p * z + 1.0f / 9.0f;
  p = p * z + 1.0f / 7.0f;
  p = p * z + 1.0f / 5.0f;
  p = p * z + 1.0f / 3.0f;
  return s2 + s2 * (z * p); /* the small correction is added last */
}

#endif
