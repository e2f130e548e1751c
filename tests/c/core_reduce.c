/* SPDX-License-Identifier: MIT */
/* test_core's suites on sums through the host backend: every dtype against an independent reference (half types
 * through double), in-place sums, large sums split across the worker threads, and the row sums of replicated
 * buckets (fdp_rows_prepare / fdp_rows_run). */
#include "core_harness.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- reductions ---- */

/* Independent half-precision references: exact values through double, rounding by rint (ties to even) on a
 * scaled value. A sum of two halves (or two bfloat16s) rounded once to double and then to the narrow type
 * equals the correctly rounded sum (double has more than 2p + 2 bits). */
static double ref_h2d(uint16_t h) {
  int sign = h >> 15, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  double v = exp == 0x1f ? (man ? NAN : INFINITY) : exp == 0 ? ldexp(man, -24) : ldexp(1024 + man, exp - 25);
  return sign ? -v : v;
}

static uint16_t ref_d2h(double v) {
  if (isnan(v)) return 0x7e00;
  uint16_t sign = signbit(v) ? 0x8000 : 0;
  double a = fabs(v);
  if (isinf(a)) return sign | 0x7c00;
  if (a == 0) return sign;
  int ex;
  frexp(a, &ex); /* a = m * 2^ex, m in [0.5, 1) */
  int q = ex - 11 < -24 ? -24 : ex - 11;
  double r = ldexp(rint(ldexp(a, -q)), q);
  if (r >= 65536.0) return sign | 0x7c00;
  if (r < 0x1p-14) return sign | (uint16_t)ldexp(r, 24);
  frexp(r, &ex);
  return sign | (uint16_t)((ex + 14) << 10) | (uint16_t)(ldexp(r, 11 - ex) - 1024);
}

static double ref_bf2d(uint16_t b) {
  int sign = b >> 15, exp = (b >> 7) & 0xff, man = b & 0x7f;
  double v = exp == 0xff ? (man ? NAN : INFINITY) : exp == 0 ? ldexp(man, -133) : ldexp(128 + man, exp - 134);
  return sign ? -v : v;
}

static uint16_t ref_d2bf(double v) {
  if (isnan(v)) return 0x7fc0;
  uint16_t sign = signbit(v) ? 0x8000 : 0;
  double a = fabs(v);
  if (isinf(a)) return sign | 0x7f80;
  if (a == 0) return sign;
  int ex;
  frexp(a, &ex);
  int q = ex - 8 < -133 ? -133 : ex - 8;
  double r = ldexp(rint(ldexp(a, -q)), q);
  if (r >= 0x1p128) return sign | 0x7f80;
  if (r < 0x1p-126) return sign | (uint16_t)ldexp(r, 133);
  frexp(r, &ex);
  return sign | (uint16_t)((ex + 126) << 7) | (uint16_t)(ldexp(r, 8 - ex) - 128);
}

static int h_isnan(uint16_t h) {
  return (h & 0x7c00) == 0x7c00 && (h & 0x3ff);
}
static int bf_isnan(uint16_t b) {
  return (b & 0x7f80) == 0x7f80 && (b & 0x7f);
}

void test_half_reference(void) {
  /* The reference conversions against known IEEE bit patterns, both ways. */
  static const struct {
    double v;
    uint16_t h;
  } h[] = {{1.0, 0x3c00},       {-2.0, 0xc000},          {65504.0, 0x7bff},       {0x1p-24, 0x0001}, {0x1p-14, 0x0400},
           {0x3ffp-24, 0x03ff}, {0.5, 0x3800},           {0.0, 0x0000},           {-0.0, 0x8000},    {INFINITY, 0x7c00},
           {-INFINITY, 0xfc00}, {1.0 + 0x1p-10, 0x3c01}, {0.333251953125, 0x3555}};
  for (size_t i = 0; i < sizeof h / sizeof h[0]; i++) {
    CHECKF(ref_d2h(h[i].v) == h[i].h, "float16(%g) = 0x%04x, want 0x%04x", h[i].v, ref_d2h(h[i].v), h[i].h);
    double back = ref_h2d(h[i].h);
    CHECKF(back == h[i].v && signbit(back) == signbit(h[i].v), "0x%04x -> %g", h[i].h, back);
  }
  CHECK(h_isnan(ref_d2h(NAN)) && isnan(ref_h2d(0x7e00)) && isnan(ref_h2d(0xfc01)));
  CHECK(ref_d2h(65519.99) == 0x7bff && ref_d2h(65520.0) == 0x7c00);                /* the overflow threshold */
  CHECK(ref_d2h(0x1p-25) == 0x0000 && ref_d2h(0x1.0000001p-25) == 0x0001);         /* half the smallest subnormal */
  CHECK(ref_d2h(1.0 + 0x1p-11) == 0x3c00 && ref_d2h(1.0 + 3 * 0x1p-11) == 0x3c02); /* ties to even */
  static const struct {
    double v;
    uint16_t b;
  } bf[] = {{1.0, 0x3f80},      {-1.0, 0xbf80},       {0x1p-133, 0x0001}, {0x1p-126, 0x0080},
            {INFINITY, 0x7f80}, {0x1.fep127, 0x7f7f}, {3.0, 0x4040},      {1.0 + 0x1p-7, 0x3f81}};
  for (size_t i = 0; i < sizeof bf / sizeof bf[0]; i++) {
    CHECKF(ref_d2bf(bf[i].v) == bf[i].b, "bfloat16(%g) = 0x%04x, want 0x%04x", bf[i].v, ref_d2bf(bf[i].v), bf[i].b);
    CHECKF(ref_bf2d(bf[i].b) == bf[i].v, "0x%04x -> %g", bf[i].b, ref_bf2d(bf[i].b));
  }
  CHECK(bf_isnan(ref_d2bf(NAN)) && isnan(ref_bf2d(0x7fc0)));
  CHECK(ref_d2bf(1.0 + 0x1p-8) == 0x3f80 && ref_d2bf(1.0 + 3 * 0x1p-8) == 0x3f82);
  CHECK(ref_d2bf(0x1.ffp127) == 0x7f80); /* halfway to 2^128 rounds to even: inf */
  /* Every half and bfloat16 value survives the round trip. */
  int bad_h = 0, bad_bf = 0;
  for (uint32_t x = 0; x < 0x10000; x++) {
    if (!h_isnan((uint16_t)x)) bad_h += ref_d2h(ref_h2d((uint16_t)x)) != x;
    if (!bf_isnan((uint16_t)x)) bad_bf += ref_d2bf(ref_bf2d((uint16_t)x)) != x;
  }
  CHECKF(bad_h == 0 && bad_bf == 0, "%d half and %d bfloat16 values do not round-trip", bad_h, bad_bf);
}

typedef struct {
  int dtype, es;
} dt_t;

static const dt_t reduce_dtypes[] = {
#define X(name, str, size) {FDP_DTYPE_##name, size},
    FDP_DTYPE_MAP(X)
#undef X
};

/* Input values of each dtype: random bits for the integers, 0/1 for bool, a mix of random bit patterns and
 * values of close magnitude (so that sums round and cancel) for the floats. */
static void fill_inputs(int dtype, void *p, int64_t n) {
  switch (dtype) {
  case FDP_DTYPE_BOOL:
    for (int64_t i = 0; i < n; i++)
      ((uint8_t *)p)[i] = (uint8_t)(rnd() % 3 == 0);
    break;
  case FDP_DTYPE_F16:
    for (int64_t i = 0; i < n; i++)
      ((uint16_t *)p)[i] = rnd() & 1 ? (uint16_t)rnd() : ref_d2h(((double)(int64_t)(rnd() % 20001) - 10000) / 997.0);
    break;
  case FDP_DTYPE_BF16:
    for (int64_t i = 0; i < n; i++)
      ((uint16_t *)p)[i] = rnd() & 1 ? (uint16_t)rnd() : ref_d2bf(((double)(int64_t)(rnd() % 20001) - 10000) / 97.0);
    break;
  case FDP_DTYPE_F32:
    for (int64_t i = 0; i < n; i++) {
      float f;
      if (rnd() % 4 == 0) {
        uint32_t b = (uint32_t)rnd();
        memcpy(&f, &b, 4);
      } else {
        f = (float)(((double)(int64_t)(rnd() % 2000001) - 1000000) / 1234.567);
      }
      ((float *)p)[i] = f;
    }
    break;
  case FDP_DTYPE_F64:
    for (int64_t i = 0; i < n; i++) {
      double d;
      if (rnd() % 4 == 0) {
        uint64_t b = rnd();
        memcpy(&d, &b, 8);
      } else {
        d = ((double)(int64_t)(rnd() % 2000001) - 1000000) / 1234.567 * ldexp(1.0, (int)rnd_in(-30, 30));
      }
      ((double *)p)[i] = d;
    }
    break;
  default: fill_random(p, (size_t)n * (size_t)reduce_dtypes[dtype].es); break;
  }
}

/* The reference sum, element by element in input order. */
static void ref_sum(int dtype, void *const *in, int n, void *out, int64_t numel) {
  for (int64_t i = 0; i < numel; i++) {
    switch (dtype) {
#define INT_SUM(UT)                                                                                                    \
  {                                                                                                                    \
    UT acc = ((const UT *)in[0])[i];                                                                                   \
    for (int k = 1; k < n; k++)                                                                                        \
      acc = (UT)(acc + ((const UT *)in[k])[i]);                                                                        \
    ((UT *)out)[i] = acc;                                                                                              \
  }                                                                                                                    \
  break
    case FDP_DTYPE_U8:
    case FDP_DTYPE_I8: INT_SUM(uint8_t);
    case FDP_DTYPE_I16: INT_SUM(uint16_t);
    case FDP_DTYPE_I32: INT_SUM(uint32_t);
    case FDP_DTYPE_I64: INT_SUM(uint64_t);
#undef INT_SUM
    case FDP_DTYPE_BOOL: {
      int acc = 0;
      for (int k = 0; k < n; k++)
        acc = acc || ((const uint8_t *)in[k])[i];
      ((uint8_t *)out)[i] = (uint8_t)acc;
      break;
    }
    case FDP_DTYPE_F32: {
      float acc = ((const float *)in[0])[i];
      for (int k = 1; k < n; k++)
        acc = acc + ((const float *)in[k])[i];
      ((float *)out)[i] = acc;
      break;
    }
    case FDP_DTYPE_F64: {
      double acc = ((const double *)in[0])[i];
      for (int k = 1; k < n; k++)
        acc = acc + ((const double *)in[k])[i];
      ((double *)out)[i] = acc;
      break;
    }
    case FDP_DTYPE_F16: {
      uint16_t acc = ((const uint16_t *)in[0])[i];
      for (int k = 1; k < n; k++)
        acc = ref_d2h(ref_h2d(acc) + ref_h2d(((const uint16_t *)in[k])[i]));
      ((uint16_t *)out)[i] = acc;
      break;
    }
    case FDP_DTYPE_BF16: {
      uint16_t acc = ((const uint16_t *)in[0])[i];
      for (int k = 1; k < n; k++)
        acc = ref_d2bf(ref_bf2d(acc) + ref_bf2d(((const uint16_t *)in[k])[i]));
      ((uint16_t *)out)[i] = acc;
      break;
    }
    default: break;
    }
  }
}

/* Bit-exact, except that any NaN matches any NaN. Returns the first mismatching index or -1. */
static int64_t sum_mismatch(int dtype, const void *got, const void *want, int64_t numel) {
  for (int64_t i = 0; i < numel; i++) {
    switch (dtype) {
    case FDP_DTYPE_F16: {
      uint16_t a = ((const uint16_t *)got)[i], b = ((const uint16_t *)want)[i];
      if (h_isnan(b) ? !h_isnan(a) : a != b) return i;
      break;
    }
    case FDP_DTYPE_BF16: {
      uint16_t a = ((const uint16_t *)got)[i], b = ((const uint16_t *)want)[i];
      if (bf_isnan(b) ? !bf_isnan(a) : a != b) return i;
      break;
    }
    case FDP_DTYPE_F32: {
      float a = ((const float *)got)[i], b = ((const float *)want)[i];
      if (isnan(b) ? !isnan(a) : memcmp(&a, &b, 4) != 0) return i;
      break;
    }
    case FDP_DTYPE_F64: {
      double a = ((const double *)got)[i], b = ((const double *)want)[i];
      if (isnan(b) ? !isnan(a) : memcmp(&a, &b, 8) != 0) return i;
      break;
    }
    default: {
      int es = reduce_dtypes[dtype].es;
      if (memcmp((const char *)got + i * es, (const char *)want + i * es, (size_t)es) != 0) return i;
    }
    }
  }
  return -1;
}

/* One reduction of n random inputs of numel elements; in_place sums into inputs[0]. */
static void reduce_case(int dtype, int n, int64_t numel, int in_place) {
  int es = reduce_dtypes[dtype].es;
  size_t bytes = (size_t)numel * (size_t)es;
  void *in[5], *ref = xmalloc(bytes), *out = xmalloc(bytes);
  fdp_tensor_t ts[5];
  int64_t sz[2] = {numel > 7 ? 7 : 1, numel > 7 ? numel / 7 : numel};
  int nd = numel > 7 && numel % 7 == 0 ? 2 : 1;
  if (nd == 1) sz[0] = numel;
  for (int k = 0; k < n; k++) {
    in[k] = xmalloc(bytes);
    fill_inputs(dtype, in[k], numel);
    ts[k] = make_contig(in[k], dtype, es, nd, sz);
  }
  ref_sum(dtype, in, n, ref, numel);
  fill_random(out, bytes);
  fdp_tensor_t o = make_contig(in_place ? in[0] : out, dtype, es, nd, sz);
  fdp_result_t r = fdp_op_reduce(ts, n, &o, NULL);
  int64_t at = r == FDP_OK ? sum_mismatch(dtype, o.data, ref, numel) : -2;
  char extra[160] = "";
  if (at >= 0) {
    uint64_t g = 0, w = 0;
    memcpy(&g, o.data + at * es, (size_t)(es > 8 ? 8 : es));
    memcpy(&w, (char *)ref + at * es, (size_t)(es > 8 ? 8 : es));
    snprintf(extra, sizeof extra, "element %lld: got 0x%llx, want 0x%llx", (long long)at, (unsigned long long)g,
             (unsigned long long)w);
  }
  CHECKF(at == -1, "reduce %s, n %d, numel %lld%s: %s %s %s", fdp_dtype_name(dtype), n, (long long)numel,
         in_place ? " (in place)" : "", fdp_result_name(r), r ? fdp_last_error() : "", extra);
  for (int k = 0; k < n; k++)
    free(in[k]);
  free(ref);
  free(out);
}

/* Sums of chosen values through the backend, against the reference (rounding at the edges of each type). The
 * values repeat over 70 elements, so that each is summed both by the vector loops (blocks of 32) and in the tail. */
#define EDGE_NUMEL 70
static void reduce_values(int dtype, const uint16_t *va, const uint16_t *vb, const uint16_t *vc, int64_t nvalues) {
  uint16_t a[EDGE_NUMEL], b[EDGE_NUMEL], c[EDGE_NUMEL], out[EDGE_NUMEL], ref[EDGE_NUMEL];
  const int64_t numel = EDGE_NUMEL;
  for (int64_t i = 0; i < numel; i++) {
    a[i] = va[i % nvalues];
    b[i] = vb[i % nvalues];
    c[i] = vc[i % nvalues];
  }
  void *in[3] = {a, b, c};
  fdp_tensor_t ts[3] = {make_flat(a, dtype, 2, numel), make_flat(b, dtype, 2, numel), make_flat(c, dtype, 2, numel)};
  fdp_tensor_t o = make_flat(out, dtype, 2, numel);
  for (int n = 1; n <= 3; n++) {
    ref_sum(dtype, in, n, ref, numel);
    fdp_result_t r = fdp_op_reduce(ts, n, &o, NULL);
    int64_t at = r == FDP_OK ? sum_mismatch(dtype, out, ref, numel) : -2;
    CHECKF(at == -1, "%s edge values, n %d: %s, element %lld: 0x%04x+0x%04x+0x%04x = 0x%04x, want 0x%04x",
           fdp_dtype_name(dtype), n, fdp_result_name(r), (long long)at, at >= 0 ? a[at] : 0, at >= 0 ? b[at] : 0,
           at >= 0 ? c[at] : 0, at >= 0 ? out[at] : 0, at >= 0 ? ref[at] : 0);
  }
}
#undef EDGE_NUMEL

void test_reduce(void) {
  static const int64_t numels[] = {1, 2, 7, 1000, 5003};
  for (int d = 0; d < FDP_DTYPE_COUNT; d++) {
    if (reduce_dtypes[d].dtype == FDP_DTYPE_OTHER) continue;
    for (int n = 1; n <= 5; n++)
      for (size_t s = 0; s < sizeof numels / sizeof numels[0]; s++)
        reduce_case(d, n, numels[s], 0);
    reduce_case(d, 3, 4096, 1);
    reduce_case(d, 1, 100, 1);
  }
  /* float16 and bfloat16 at their edges: overflow to inf, ties, subnormals, signed zeros, inf - inf, NaN. */
  {
    static const uint16_t a[] = {0x3c00, 0x7bff, 0x7bff, 0x0001, 0x0001, 0x7c00, 0x7c00,
                                 0x7e00, 0x8000, 0x3c00, 0x03ff, 0xfbff, 0x3c00, 0x0000};
    static const uint16_t b[] = {0x3c00, 0x4c00, 0x4800, 0x0001, 0x8001, 0x3c00, 0xfc00,
                                 0x3c00, 0x8000, 0x1400, 0x0001, 0xcc00, 0x1000, 0x8000};
    static const uint16_t c[] = {0x3c00, 0x0000, 0x0000, 0x03fe, 0x0000, 0x0000, 0x0000,
                                 0x0000, 0x8000, 0x1400, 0x0000, 0x0000, 0x1000, 0x8000};
    reduce_values(FDP_DTYPE_F16, a, b, c, (int64_t)(sizeof a / sizeof a[0]));
    /* A few sums typed out, as a check on the reference itself. */
    uint16_t r1 = ref_d2h(ref_h2d(0x3c00) + ref_h2d(0x3c00)), r2 = ref_d2h(ref_h2d(0x7bff) + ref_h2d(0x4c00)),
             r3 = ref_d2h(ref_h2d(0x7bff) + ref_h2d(0x4800)), r4 = ref_d2h(ref_h2d(0x0001) + ref_h2d(0x8001));
    CHECK(r1 == 0x4000 && r2 == 0x7c00 && r3 == 0x7bff && r4 == 0x0000);
    static const uint16_t ba[] = {0x3f80, 0x7f7f, 0x0001, 0x7f80, 0x7fc0, 0x3f80, 0x8000, 0x4040};
    static const uint16_t bb[] = {0x3f80, 0x7f7f, 0x8001, 0xff80, 0x3f80, 0x3b80, 0x8000, 0xc040};
    static const uint16_t bc[] = {0x3f80, 0x0000, 0x0001, 0x0000, 0x0000, 0x3b80, 0x8000, 0x8000};
    reduce_values(FDP_DTYPE_BF16, ba, bb, bc, (int64_t)(sizeof ba / sizeof ba[0]));
  }
  /* Bad calls. */
  {
    float a[12] = {0}, b[12] = {0}, c[24] = {0};
    int64_t s34[] = {3, 4}, s43[] = {4, 3}, s12[] = {12}, s35[] = {3, 5};
    fdp_tensor_t ins[3] = {make_contig(a, FDP_DTYPE_F32, 4, 2, s34), make_contig(b, FDP_DTYPE_F32, 4, 2, s34),
                           make_contig(c, FDP_DTYPE_F32, 4, 2, s34)};
    fdp_tensor_t out = make_contig(c + 12, FDP_DTYPE_F32, 4, 2, s34);
    EXPECT(fdp_op_reduce(ins, 3, &out, NULL), FDP_OK);
    EXPECT(fdp_op_reduce(ins, 0, &out, NULL), FDP_INVALID);
    EXPECT(fdp_op_reduce(NULL, 2, &out, NULL), FDP_INVALID);
    EXPECT(fdp_op_reduce(ins, 2, NULL, NULL), FDP_INVALID);
    /* Output aliasing a non-first input. */
    EXPECT(fdp_op_reduce(ins, 3, &ins[1], NULL), FDP_INVALID);
    EXPECT(fdp_op_reduce(ins, 3, &ins[2], NULL), FDP_INVALID);
    /* Non-contiguous input or output. */
    int64_t tst[] = {1, 3};
    fdp_tensor_t t = make(c, FDP_DTYPE_F32, 4, 2, s34, tst);
    fdp_tensor_t tmp[2] = {ins[0], t};
    EXPECT(fdp_op_reduce(tmp, 2, &out, NULL), FDP_INVALID);
    EXPECT(fdp_op_reduce(ins, 2, &t, NULL), FDP_INVALID);
    int64_t gst[] = {8, 2};
    fdp_tensor_t g = make(c, FDP_DTYPE_F32, 4, 2, s34, gst);
    tmp[1] = g;
    EXPECT(fdp_op_reduce(tmp, 2, &out, NULL), FDP_INVALID);
    /* Mismatched dtype, element size, element count, shape. */
    tmp[1] = ins[1];
    tmp[1].dtype = FDP_DTYPE_I32;
    EXPECT(fdp_op_reduce(tmp, 2, &out, NULL), FDP_INVALID);
    tmp[1] = ins[1];
    tmp[1].elem_size = 2;
    EXPECT(fdp_op_reduce(tmp, 2, &out, NULL), FDP_INVALID);
    tmp[1] = make_contig(b, FDP_DTYPE_F32, 4, 2, s35);
    float big[15];
    tmp[1].data = (char *)big;
    EXPECT(fdp_op_reduce(tmp, 2, &out, NULL), FDP_INVALID);
    /* Same element count, other shape: "of one shape" (upstream: "input 1 has invalid size"). */
    tmp[1] = make_contig(b, FDP_DTYPE_F32, 4, 2, s43);
    EXPECT(fdp_op_reduce(tmp, 2, &out, NULL), FDP_INVALID);
    tmp[1] = make_contig(b, FDP_DTYPE_F32, 4, 1, s12);
    EXPECT(fdp_op_reduce(tmp, 2, &out, NULL), FDP_INVALID);
    /* OTHER (and out-of-range) dtypes are not summed. */
    fdp_tensor_t o_in[2] = {ins[0], ins[1]}, o_out = out;
    o_in[0].dtype = o_in[1].dtype = o_out.dtype = FDP_DTYPE_OTHER;
    EXPECT(fdp_op_reduce(o_in, 2, &o_out, NULL), FDP_DTYPE);
    o_in[0].dtype = o_in[1].dtype = o_out.dtype = FDP_DTYPE_COUNT;
    EXPECT(fdp_op_reduce(o_in, 2, &o_out, NULL), FDP_DTYPE);
    o_in[0].dtype = o_in[1].dtype = o_out.dtype = -1;
    EXPECT(fdp_op_reduce(o_in, 2, &o_out, NULL), FDP_DTYPE);
    /* An empty sum succeeds and touches nothing. */
    int64_t s0[] = {0, 4};
    fdp_tensor_t e[2] = {make_contig(NULL, FDP_DTYPE_F32, 4, 2, s0), make_contig(NULL, FDP_DTYPE_F32, 4, 2, s0)};
    EXPECT(fdp_op_reduce(e, 2, &e[0], NULL), FDP_OK);
  }
}

/* fdp_rows_prepare / fdp_rows_run against sums written out here: the plan of 3 replicas of 2 members (a 2 x 3 matrix
 * and a 4-vector) takes only data pointers and writes each member's sum at its offset; fdp_rows_member_fits refuses
 * a step's tensor of another shape, dtype or strides, or off the host; and the run refuses an output that does not
 * fit and an input that overlaps it, with nothing written. */
void test_rows_plan(void) {
  enum { K = 2, R = 3, M0 = 6, M1 = 4 };
  double g[R][M0 + M1], out[M0 + M1 + 2];
  static const int64_t mat[] = {2, 3};
  fdp_tensor_t members[K] = {make_contig(NULL, FDP_DTYPE_F64, 8, 2, mat), make_flat(NULL, FDP_DTYPE_F64, 8, M1)};
  fdp_rows_plan_t *plan = NULL;
  EXPECT(fdp_rows_prepare(members, K, R, &plan), FDP_OK);
  CHECK(plan && fdp_rows_numel(plan) == M0 + M1);
  char *ptrs[R * K];
  for (int q = 0; q < R; q++) {
    for (int e = 0; e < M0 + M1; e++)
      g[q][e] = (q + 1) * 0.5 + e * 0.25;
    fdp_tensor_t t0 = make_contig(g[q], FDP_DTYPE_F64, 8, 2, mat), t1 = make_flat(g[q] + M0, FDP_DTYPE_F64, 8, M1);
    CHECK(fdp_rows_member_fits(plan, 0, &t0) && fdp_rows_member_fits(plan, 1, &t1));
    ptrs[q * K] = t0.data;
    ptrs[q * K + 1] = t1.data;
  }
  for (int e = 0; e < M0 + M1 + 2; e++)
    out[e] = -1.0;
  fdp_tensor_t o = make_flat(out, FDP_DTYPE_F64, 8, M0 + M1 + 2);
  EXPECT(fdp_rows_run(plan, ptrs, &o), FDP_OK);
  for (int e = 0; e < M0 + M1; e++)
    CHECKF(out[e] == (g[0][e] + g[1][e]) + g[2][e], "element %d: %g", e, out[e]);
  CHECK(out[M0 + M1] == -1.0 && out[M0 + M1 + 1] == -1.0);
  /* Tensors that may not stand for member 0: another shape, dtype, strides (transposed), device; a bad index. */
  for (int variant = 0; variant < 5; variant++) {
    fdp_tensor_t t = make_contig(g[0], FDP_DTYPE_F64, 8, 2, mat);
    int j = 0;
    if (variant == 0) t.sizes[1] = 2;
    if (variant == 1) t.dtype = FDP_DTYPE_F32, t.elem_size = 4;
    if (variant == 2) t.strides[0] = 1, t.strides[1] = 2;
    if (variant == 3) t.device = 0;
    if (variant == 4) j = K;
    CHECKF(!fdp_rows_member_fits(plan, j, &t), "variant %d fits", variant);
  }
  /* A size-1 dimension's stride does not matter. */
  static const int64_t row[] = {1, 4};
  fdp_tensor_t rm = make_contig(NULL, FDP_DTYPE_F64, 8, 2, row), rt = make_contig(g[0], FDP_DTYPE_F64, 8, 2, row);
  fdp_rows_plan_t *rp = NULL;
  EXPECT(fdp_rows_prepare(&rm, 1, 1, &rp), FDP_OK);
  rt.strides[0] = 99;
  CHECK(fdp_rows_member_fits(rp, 0, &rt));
  fdp_rows_plan_free(rp);
  /* Refused runs: an output too short, 2-D, of another dtype; an input inside the output; nothing written. */
  for (int variant = 0; variant < 4; variant++) {
    fdp_tensor_t ob = o;
    char *bad[R * K];
    memcpy(bad, ptrs, sizeof bad);
    if (variant == 0) ob = make_flat(out, FDP_DTYPE_F64, 8, M0 + M1 - 1);
    if (variant == 1) ob = make_contig(out, FDP_DTYPE_F64, 8, 2, mat);
    if (variant == 2) ob.dtype = FDP_DTYPE_I64;
    if (variant == 3) bad[K + 1] = (char *)(out + 2);
    for (int e = 0; e < M0 + M1 + 2; e++)
      out[e] = -1.0;
    EXPECT(fdp_rows_run(plan, bad, &ob), FDP_INVALID);
    CHECKF(out[0] == -1.0, "variant %d wrote the output", variant);
  }
  fdp_rows_plan_free(plan);
  /* Plans it cannot make: no members, too many replicas, a dtype it cannot sum, mixed dtypes, a device member. */
  fdp_tensor_t other = members[1];
  other.dtype = FDP_DTYPE_OTHER;
  fdp_tensor_t mixed[2] = {members[0], members[1]};
  mixed[1].dtype = FDP_DTYPE_F32, mixed[1].elem_size = 4;
  fdp_tensor_t dev = members[1];
  dev.device = 0;
  EXPECT(fdp_rows_prepare(members, 0, R, &plan), FDP_INVALID);
  EXPECT(fdp_rows_prepare(members, K, FDP_MAX_DEVICES + 1, &plan), FDP_INVALID);
  EXPECT(fdp_rows_prepare(&other, 1, R, &plan), FDP_INVALID);
  EXPECT(fdp_rows_prepare(mixed, 2, R, &plan), FDP_INVALID);
  EXPECT(fdp_rows_prepare(&dev, 1, R, &plan), FDP_INVALID);
  CHECK(plan == NULL);
}

/* Large sums, split across the worker threads; in place too. */
void test_reduce_threaded(void) {
  for (int d = 0; d < FDP_DTYPE_COUNT; d++) {
    if (reduce_dtypes[d].dtype == FDP_DTYPE_OTHER) continue;
    int64_t numel = ((int64_t)3 << 20) / reduce_dtypes[d].es + 5; /* about 3 MB per buffer */
    reduce_case(d, 3, numel, 0);
    reduce_case(d, 4, numel + 2048, 1);
  }
  reduce_case(FDP_DTYPE_F32, 5, (int64_t)(1 << 20) + 1, 0);
  reduce_case(FDP_DTYPE_F16, 2, (int64_t)(2 << 20) + 3, 1);
}
