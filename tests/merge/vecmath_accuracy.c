/* Sweeps cplib's vectorisable exp/log1p (csrc/core/vecmath.h) against libm
 * in double and prints the worst error in float ulps of each; the Python
 * test compiles and runs this and checks the bounds the header promises. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "vecmath.h"

static double ulp_err(float got, double want) {
  if (want == 0.0) return got == 0.0f ? 0.0 : INFINITY;
  double ulp = ldexp(1.0, ilogb((float)want) - 23);
  if (ulp < ldexp(1.0, -149)) ulp = ldexp(1.0, -149); /* subnormal spacing */
  return fabs((double)got - want) / ulp;
}

int main(void) {
  double worst_exp = 0.0, worst_log = 0.0;
  /* every float in (-87, 0] is too many; a stride of 97 bit patterns still
   * covers every exponent and every residue of the range reduction */
  for (unsigned bits = 0x80000000u; bits < 0xc2ae0000u; bits += 97u) {
    float x;
    memcpy(&x, &bits, sizeof x);
    const double e = ulp_err(cplib_exp_nonpos_f32(x), exp((double)x));
    if (e > worst_exp) worst_exp = e;
  }
  /* e comes from the exp above, so it is 0 or a normal float */
  for (unsigned bits = 0x00800000u; bits <= 0x3f800000u; bits += 61u) {
    float e;
    memcpy(&e, &bits, sizeof e);
    const double err = ulp_err(cplib_log1p_unit_f32(e), log1p((double)e));
    if (err > worst_log) worst_log = err;
  }
  const float inf = INFINITY;
  const int edges_ok = cplib_exp_nonpos_f32(-inf) == 0.0f && cplib_exp_nonpos_f32(-100.0f) == 0.0f &&
                       cplib_exp_nonpos_f32(0.0f) == 1.0f && cplib_log1p_unit_f32(0.0f) == 0.0f &&
                       cplib_exp_nonpos_f32(NAN) == 0.0f;
  printf("exp_ulp %.3f log1p_ulp %.3f edges_ok %d\n", worst_exp, worst_log, edges_ok);
  return 0;
}
