/* bf16 / fp16 <-> fp32 conversions for the C core (no compiler extensions needed). */
#ifndef CPLIB_CORE_HALF_H
#define CPLIB_CORE_HALF_H

#include <stdint.h>
#include <string.h>

static inline float cplib_bf16_to_f32(uint16_t h) {
  uint32_t bits = (uint32_t)h << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

static inline float cplib_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1fu) {
    bits = sign | 0x7f800000u | (man << 13); /* inf / nan */
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign; /* signed zero */
  } else {
    /* subnormal: renormalise */
    int e = -1;
    do {
      e++;
      man <<= 1;
    } while ((man & 0x400u) == 0);
    bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

#endif
