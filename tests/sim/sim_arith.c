/* Element arithmetic on the host, rounded after every add as PyTorch's a + b + c: the sums of the simulated
 * NCCL's reductions, and the half and bfloat16 conversions that the real kernels' PTX does on a GPU. */

#include "sim.h"

#include "fastdp.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

static float h2f(uint16_t h) {
  int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  float v;
  if (e == 0x1f)
    v = m ? NAN : INFINITY;
  else if (e == 0)
    v = ldexpf((float)m, -24);
  else
    v = ldexpf((float)(m | 0x400), e - 25);
  return (h & 0x8000) ? -v : v;
}

static uint16_t f2h(float f) {
  uint16_t sign = signbit(f) ? 0x8000 : 0;
  if (isnan(f)) return (uint16_t)(sign | 0x7e00);
  float a = fabsf(f);
  if (a >= 65520.0f) return (uint16_t)(sign | 0x7c00);
  if (a < ldexpf(1.0f, -14)) return (uint16_t)(sign | (uint16_t)rintf(a * 16777216.0f)); /* subnormal, exact scale */
  int k;
  frexpf(a, &k); /* a = m * 2^k, m in [0.5, 1): exponent k - 1 */
  int e = k - 1;
  float q = rintf(ldexpf(a, 10 - e)); /* 1024..2048, ties to even */
  if (q >= 2048.0f) {
    q = 1024.0f;
    e++;
  }
  if (e > 15) return (uint16_t)(sign | 0x7c00);
  return (uint16_t)(sign | ((e + 15) << 10) | ((int)q - 1024));
}

static float bf2f(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static uint16_t f2bf(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if (isnan(f)) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

/* The PTX conversions of the real kernels, on the host (kernel_host.h). */
float sim_half_to_float(unsigned short h) {
  return h2f(h);
}
unsigned short sim_float_to_half(float f) {
  return f2h(f);
}
unsigned short sim_float_to_bf16(float f) {
  return f2bf(f);
}

void sim_add(int dtype, void *acc, const void *x, int64_t n) {
  switch (dtype) {
#define ADD(T, EXPR)                                                                                                   \
  {                                                                                                                    \
    T *o = acc;                                                                                                        \
    const T *v = x;                                                                                                    \
    for (int64_t i = 0; i < n; i++)                                                                                    \
      o[i] = EXPR;                                                                                                     \
  }                                                                                                                    \
  break
  case FDP_DTYPE_BOOL: ADD(uint8_t, (uint8_t)((o[i] | v[i]) != 0));
  case FDP_DTYPE_U8:
  case FDP_DTYPE_I8: ADD(uint8_t, (uint8_t)(o[i] + v[i]));
  case FDP_DTYPE_I16: ADD(uint16_t, (uint16_t)(o[i] + v[i]));
  case FDP_DTYPE_I32: ADD(uint32_t, o[i] + v[i]);
  case FDP_DTYPE_I64: ADD(uint64_t, o[i] + v[i]);
  case FDP_DTYPE_F16: ADD(uint16_t, f2h(h2f(o[i]) + h2f(v[i])));
  case FDP_DTYPE_BF16: ADD(uint16_t, f2bf(bf2f(o[i]) + bf2f(v[i])));
  case FDP_DTYPE_F32: ADD(float, o[i] + v[i]);
  case FDP_DTYPE_F64: ADD(double, o[i] + v[i]);
#undef ADD
  default: break;
  }
}
