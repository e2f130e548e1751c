/* SPDX-License-Identifier: MIT */
/* The host backend: CPU memory, each "cpu" entry of a device list an emulated device. Copies are memcpy of the
 * longest contiguous runs, sums are blocked loops the compiler vectorises (float16 and bfloat16 through AVX2/F16C
 * where the CPU has them); both split across threads when a call moves enough bytes to pay for them
 * (FASTDP_HOST_THREADS, FASTDP_HOST_PARALLEL_MIN). */
#include "core/backend.h"

#include <assert.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_THREADS 64

/* ---- a parallel-for over [0, n) in contiguous ranges ---- */

typedef void (*range_fn)(void *ctx, int64_t begin, int64_t end);

typedef struct {
  range_fn fn;
  void *ctx;
  int64_t begin, end;
} range_job_t;

static void *run_range(void *arg) {
  range_job_t *j = arg;
  j->fn(j->ctx, j->begin, j->end);
  return NULL;
}

static int nthreads;
static pthread_once_t nthreads_once = PTHREAD_ONCE_INIT;

static void count_threads(void) {
  int64_t t = fdp_param(FDP_PARAM_HOST_THREADS);
  if (t <= 0) t = sysconf(_SC_NPROCESSORS_ONLN); /* reads /sys: once per process, not per call */
  if (t < 1) t = 1;
  nthreads = t > MAX_THREADS ? MAX_THREADS : (int)t;
}

static int host_threads(void) {
  pthread_once(&nthreads_once, count_threads);
  return nthreads;
}

/* Runs fn over [0, n) on up to host_threads() threads, each taking at least `grain` items. If a thread cannot
 * be started its range runs on the calling thread, so the work is always done. */
static void parallel_for(int64_t n, int64_t grain, range_fn fn, void *ctx) {
  if (grain >= n) {
    if (n > 0) fn(ctx, 0, n);
    return;
  }
  int64_t nt = host_threads();
  if (grain < 1) grain = 1;
  if (nt > n / grain) nt = n / grain;
  if (nt <= 1) {
    if (n > 0) fn(ctx, 0, n);
    return;
  }
  range_job_t jobs[MAX_THREADS];
  pthread_t tids[MAX_THREADS];
  int started[MAX_THREADS];
  for (int64_t i = 0; i < nt; i++)
    jobs[i] = (range_job_t){fn, ctx, n * i / nt, n * (i + 1) / nt};
  for (int64_t i = 1; i < nt; i++)
    started[i] = pthread_create(&tids[i], NULL, run_range, &jobs[i]) == 0;
  run_range(&jobs[0]);
  for (int64_t i = 1; i < nt; i++) {
    if (started[i])
      pthread_join(tids[i], NULL);
    else
      run_range(&jobs[i]);
  }
}

/* ---- strided copies ---- */

/* A copy reduced to its simplest loop nest: rows of `row_bytes` contiguous bytes (or single elements when the
 * innermost dimension is strided), walked over up to FDP_MAX_DIMS outer dimensions. */
typedef struct {
  char *dst;
  const char *src;
  int ndim; /* outer dims */
  int64_t sizes[FDP_MAX_DIMS];
  int64_t dstride[FDP_MAX_DIMS]; /* bytes */
  int64_t sstride[FDP_MAX_DIMS];
  int64_t rows;      /* product of outer sizes */
  int64_t row_len;   /* elements per row */
  int64_t row_dstep; /* bytes between elements of a row */
  int64_t row_sstep;
  int elem_size;
} plan_copy_t;

static void plan_copy(const fdp_copy_t *c, plan_copy_t *p) {
  int64_t sz[FDP_MAX_DIMS], ds[FDP_MAX_DIMS], ss[FDP_MAX_DIMS];
  int n = 0, es = c->src.elem_size;
  for (int i = 0; i < c->src.ndim; i++) {
    if (c->src.sizes[i] == 1) continue;
    sz[n] = c->src.sizes[i];
    ds[n] = c->dst.strides[i] * es;
    ss[n] = c->src.strides[i] * es;
    n++;
  }
  /* Merge a dim into the next inner one when both sides walk it as one longer run. */
  int m = 0;
  for (int i = 0; i < n; i++) {
    if (m > 0 && ds[m - 1] == ds[i] * sz[i] && ss[m - 1] == ss[i] * sz[i]) {
      sz[m - 1] *= sz[i];
      ds[m - 1] = ds[i];
      ss[m - 1] = ss[i];
    } else {
      sz[m] = sz[i];
      ds[m] = ds[i];
      ss[m] = ss[i];
      m++;
    }
  }
  memset(p, 0, sizeof *p);
  p->dst = c->dst.data;
  p->src = c->src.data;
  p->elem_size = es;
  if (m == 0) { /* a single element */
    p->rows = 1;
    p->row_len = 1;
    return;
  }
  p->row_len = sz[m - 1];
  p->row_dstep = ds[m - 1];
  p->row_sstep = ss[m - 1];
  p->ndim = m - 1;
  p->rows = 1;
  for (int i = 0; i < m - 1; i++) {
    p->sizes[i] = sz[i];
    p->dstride[i] = ds[i];
    p->sstride[i] = ss[i];
    p->rows *= sz[i];
  }
}

static void copy_row(const plan_copy_t *p, char *d, const char *s, int64_t first, int64_t count) {
  int es = p->elem_size;
  if (p->row_dstep == es && p->row_sstep == es) {
    memcpy(d + first * es, s + first * es, (size_t)(count * es));
    return;
  }
  d += first * p->row_dstep;
  s += first * p->row_sstep;
  for (int64_t k = 0; k < count; k++, d += p->row_dstep, s += p->row_sstep)
    memcpy(d, s, (size_t)es);
}

/* Items are rows, except for a single long row, which is split into element ranges. */
static void copy_range(void *ctx, int64_t begin, int64_t end) {
  const plan_copy_t *p = ctx;
  if (p->rows == 1) {
    copy_row(p, p->dst, p->src, begin, end - begin);
    return;
  }
  int64_t idx[FDP_MAX_DIMS];
  int64_t r = begin;
  char *d = p->dst;
  const char *s = p->src;
  for (int i = p->ndim - 1; i >= 0; i--) {
    idx[i] = r % p->sizes[i];
    r /= p->sizes[i];
    d += idx[i] * p->dstride[i];
    s += idx[i] * p->sstride[i];
  }
  for (int64_t row = begin; row < end; row++) {
    copy_row(p, d, s, 0, p->row_len);
    for (int i = p->ndim - 1; i >= 0; i--) { /* odometer step */
      d += p->dstride[i];
      s += p->sstride[i];
      if (++idx[i] < p->sizes[i]) break;
      d -= p->dstride[i] * p->sizes[i];
      s -= p->sstride[i] * p->sizes[i];
      idx[i] = 0;
    }
  }
}

static fdp_result_t host_copy(const fdp_copy_t *copies, int n, const fdp_streams_t *streams) {
  (void)streams;
  int64_t min_bytes = fdp_param(FDP_PARAM_HOST_PARALLEL_MIN), total = 0;
  /* Threads when the whole call moves enough bytes (a scatter's chunks together), each thread then taking at least
   * a quarter of that threshold. */
  for (int i = 0; i < n; i++)
    total += fdp_tensor_numel(&copies[i].src) * copies[i].src.elem_size;
  for (int i = 0; i < n; i++) {
    plan_copy_t p;
    plan_copy(&copies[i], &p);
    int64_t items = p.rows == 1 ? p.row_len : p.rows;
    int64_t bytes = p.rows * p.row_len * p.elem_size;
    int64_t item_bytes = bytes / (items ? items : 1);
    int64_t grain = total < min_bytes ? items : (min_bytes / 4) / (item_bytes ? item_bytes : 1) + 1;
    parallel_for(items, grain, copy_range, &p);
  }
  return FDP_OK;
}

/* ---- sums ---- */

typedef struct {
  const fdp_tensor_t *inputs;
  int n;
  const fdp_tensor_t *out;
} sum_ctx_t;

#define BLOCK 2048

/* IEEE binary16 and bfloat16 to and from float, round to nearest even, as PyTorch converts on the CPU. */
static inline float h2f(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else { /* subnormal: normalise */
      int e = -1;
      do {
        e++;
        man <<= 1;
      } while (!(man & 0x400));
      bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
    }
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

static inline uint16_t f2h(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000;
  uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00 | (ax > 0x7f800000u ? 0x200 | ((ax >> 13) & 0x3ff) : 0));
  if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00); /* rounds to or above 65520: inf */
  if (ax < 0x38800000u) {                                  /* result is subnormal or zero */
    if (ax < 0x33000000u) return (uint16_t)sign;           /* below half the smallest subnormal */
    uint32_t e = ax >> 23, man = (ax & 0x7fffff) | 0x800000;
    uint32_t shift = 126 - e; /* 14..24 */
    uint32_t hman = man >> shift, rem = man & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (hman & 1))) hman++;
    return (uint16_t)(sign | hman);
  }
  uint32_t h = ((ax >> 13) - (112u << 10));
  uint32_t rem = ax & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) h++;
  return (uint16_t)(sign | h);
}

static inline float bf2f(uint16_t b) {
  uint32_t bits = (uint32_t)b << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

static inline uint16_t f2bf(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40); /* quiet NaN */
  x += 0x7fff + ((x >> 16) & 1);
  return (uint16_t)(x >> 16);
}

/* Integer and bool sums, and half-type sums where no vector loop ran: out = inputs[0], then each later input added
 * in turn, a block at a time so that the block of out stays in the L1 cache. */
#define SUM_LOOP(T, OP)                                                                                                \
  do {                                                                                                                 \
    T *o = (T *)c->out->data;                                                                                          \
    for (int64_t b0 = begin; b0 < end; b0 += BLOCK) {                                                                  \
      int64_t b1 = b0 + BLOCK < end ? b0 + BLOCK : end;                                                                \
      const T *a = (const T *)c->inputs[0].data;                                                                       \
      if (o != a) memcpy(o + b0, a + b0, (size_t)(b1 - b0) * sizeof(T));                                               \
      for (int k = 1; k < c->n; k++) {                                                                                 \
        const T *x = (const T *)c->inputs[k].data;                                                                     \
        for (int64_t i = b0; i < b1; i++)                                                                              \
          OP;                                                                                                          \
      }                                                                                                                \
    }                                                                                                                  \
  } while (0)

/* float and double sums in input order, ((a + b) + c) + d element for element, with fewer passes over each block:
 * the first pass adds two inputs (or one, in place), each later pass two more. Separate loops for the in-place
 * case keep every `restrict` true: out overlaps no input but inputs[0], and that one only as the same view
 * (fdp_op_reduce refuses partial overlaps, host_reduce any other input at out's address). */
#define REAL_SUM(NAME, T)                                                                                              \
  static void NAME##_first(T *restrict o, const T *restrict a, const T *restrict b, int64_t len) {                     \
    for (int64_t i = 0; i < len; i++)                                                                                  \
      o[i] = a[i] + b[i];                                                                                              \
  }                                                                                                                    \
  static void NAME##_add1(T *restrict o, const T *restrict x, int64_t len) {                                           \
    for (int64_t i = 0; i < len; i++)                                                                                  \
      o[i] += x[i];                                                                                                    \
  }                                                                                                                    \
  static void NAME##_add2(T *restrict o, const T *restrict x, const T *restrict y, int64_t len) {                      \
    for (int64_t i = 0; i < len; i++)                                                                                  \
      o[i] = (o[i] + x[i]) + y[i];                                                                                     \
  }                                                                                                                    \
  static void NAME(const sum_ctx_t *c, int64_t begin, int64_t end) {                                                   \
    T *o = (T *)c->out->data;                                                                                          \
    const fdp_tensor_t *in = c->inputs;                                                                                \
    const T *a = (const T *)in[0].data;                                                                                \
    if (c->n == 1) {                                                                                                   \
      if (o != a) memcpy(o + begin, a + begin, (size_t)(end - begin) * sizeof(T));                                     \
      return;                                                                                                          \
    }                                                                                                                  \
    for (int64_t b0 = begin; b0 < end; b0 += BLOCK) {                                                                  \
      int64_t len = (b0 + BLOCK < end ? b0 + BLOCK : end) - b0;                                                        \
      const T *b = (const T *)in[1].data + b0;                                                                         \
      if (o == a)                                                                                                      \
        NAME##_add1(o + b0, b, len);                                                                                   \
      else                                                                                                             \
        NAME##_first(o + b0, a + b0, b, len);                                                                          \
      int k = 2;                                                                                                       \
      for (; k + 1 < c->n; k += 2)                                                                                     \
        NAME##_add2(o + b0, (const T *)in[k].data + b0, (const T *)in[k + 1].data + b0, len);                          \
      if (k < c->n) NAME##_add1(o + b0, (const T *)in[k].data + b0, len);                                              \
    }                                                                                                                  \
  }

REAL_SUM(sum_f32, float)
REAL_SUM(sum_f64, double)

/* float16 and bfloat16 with AVX2 and F16C, where the CPU has them: eight elements at a time, each input converted
 * to float, added, and rounded back to the narrow type after every addition (the same steps, with the same
 * results, as the scalar loop). Each returns the first index it left for the scalar loop. */
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>
#define HAVE_X86_HALF 1

static int x86_half_ok;
static pthread_once_t x86_half_once = PTHREAD_ONCE_INIT;

static void x86_half_probe(void) {
  __builtin_cpu_init();
  x86_half_ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
}

/* Four vectors of eight elements at a time: the four conversion chains are independent, so they overlap. */
__attribute__((target("avx2,f16c"))) static int64_t sum_f16_x86(const sum_ctx_t *c, int64_t begin, int64_t end) {
  uint16_t *o = (uint16_t *)c->out->data;
  int64_t i = begin;
  for (; i + 32 <= end; i += 32) {
    const __m128i *a = (const __m128i *)((const uint16_t *)c->inputs[0].data + i);
    __m128i h0 = _mm_loadu_si128(a), h1 = _mm_loadu_si128(a + 1), h2 = _mm_loadu_si128(a + 2),
            h3 = _mm_loadu_si128(a + 3);
    for (int k = 1; k < c->n; k++) {
      const __m128i *x = (const __m128i *)((const uint16_t *)c->inputs[k].data + i);
#define F16_ADD(h, j)                                                                                                  \
  h = _mm256_cvtps_ph(_mm256_add_ps(_mm256_cvtph_ps(h), _mm256_cvtph_ps(_mm_loadu_si128(x + j))),                       \
                      _MM_FROUND_TO_NEAREST_INT)
      F16_ADD(h0, 0);
      F16_ADD(h1, 1);
      F16_ADD(h2, 2);
      F16_ADD(h3, 3);
#undef F16_ADD
    }
    __m128i *out = (__m128i *)(o + i);
    _mm_storeu_si128(out, h0);
    _mm_storeu_si128(out + 1, h1);
    _mm_storeu_si128(out + 2, h2);
    _mm_storeu_si128(out + 3, h3);
  }
  return i;
}

/* bfloat16 as bf2f and f2bf convert it, kept in float registers: a shift up to load; rounding to the nearest
 * bfloat16 (adding 0x7fff plus the lowest kept bit, then clearing the low half; a NaN made quiet instead) gives
 * the float that f2bf's result widens to, and a shift down packs it for the store. */
__attribute__((target("avx2"))) static inline __m256 bf16x8_load(const uint16_t *p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

__attribute__((target("avx2"))) static inline __m256 bf16x8_round(__m256 f) {
  const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
  __m256i x = _mm256_castps_si256(f);
  __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), lsb), high);
  __m256i quiet = _mm256_or_si256(_mm256_and_si256(x, high), _mm256_set1_epi32(0x00400000));
  return _mm256_castsi256_ps(_mm256_blendv_epi8(rounded, quiet, nan));
}

__attribute__((target("avx2"))) static inline void bf16x8_store(uint16_t *p, __m256 f) {
  __m256i v = _mm256_srli_epi32(_mm256_castps_si256(f), 16); /* each below 0x10000: packs without saturating */
  __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(v, v), 0xd8); /* quadwords 0 and 2: elements 0-7 */
  _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
}

__attribute__((target("avx2"))) static int64_t sum_bf16_x86(const sum_ctx_t *c, int64_t begin, int64_t end) {
  uint16_t *o = (uint16_t *)c->out->data;
  int64_t i = begin;
  for (; i + 32 <= end; i += 32) {
    const uint16_t *a = (const uint16_t *)c->inputs[0].data + i;
    __m256 f0 = bf16x8_load(a), f1 = bf16x8_load(a + 8), f2 = bf16x8_load(a + 16), f3 = bf16x8_load(a + 24);
    for (int k = 1; k < c->n; k++) {
      const uint16_t *x = (const uint16_t *)c->inputs[k].data + i;
      f0 = bf16x8_round(_mm256_add_ps(f0, bf16x8_load(x)));
      f1 = bf16x8_round(_mm256_add_ps(f1, bf16x8_load(x + 8)));
      f2 = bf16x8_round(_mm256_add_ps(f2, bf16x8_load(x + 16)));
      f3 = bf16x8_round(_mm256_add_ps(f3, bf16x8_load(x + 24)));
    }
    bf16x8_store(o + i, f0);
    bf16x8_store(o + i + 8, f1);
    bf16x8_store(o + i + 16, f2);
    bf16x8_store(o + i + 24, f3);
  }
  return i;
}
#endif

/* The first element of [begin, end) the scalar loops still have to sum: past what the vector loops did. */
static int64_t sum_vector_head(const sum_ctx_t *c, int64_t begin, int64_t end) {
#ifdef HAVE_X86_HALF
  if (c->n > 1 && (c->out->dtype == FDP_DTYPE_F16 || c->out->dtype == FDP_DTYPE_BF16)) {
    pthread_once(&x86_half_once, x86_half_probe);
    if (x86_half_ok) return c->out->dtype == FDP_DTYPE_F16 ? sum_f16_x86(c, begin, end) : sum_bf16_x86(c, begin, end);
  }
#else
  (void)c;
  (void)end;
#endif
  return begin;
}

static void sum_range(void *ctx, int64_t begin, int64_t end) {
  const sum_ctx_t *c = ctx;
  begin = sum_vector_head(c, begin, end);
  switch (c->out->dtype) {
  case FDP_DTYPE_F32: sum_f32(c, begin, end); break;
  case FDP_DTYPE_F64: sum_f64(c, begin, end); break;
  /* Integers wrap, as PyTorch's do; unsigned arithmetic keeps that defined. */
  case FDP_DTYPE_I64: SUM_LOOP(uint64_t, o[i] += x[i]); break;
  case FDP_DTYPE_I32: SUM_LOOP(uint32_t, o[i] += x[i]); break;
  case FDP_DTYPE_I16: SUM_LOOP(uint16_t, o[i] = (uint16_t)(o[i] + x[i])); break;
  case FDP_DTYPE_I8:
  case FDP_DTYPE_U8: SUM_LOOP(uint8_t, o[i] = (uint8_t)(o[i] + x[i])); break;
  case FDP_DTYPE_BOOL: SUM_LOOP(uint8_t, o[i] = (uint8_t)((o[i] | x[i]) != 0)); break;
  /* Half types round after every addition, so the sum equals PyTorch's a + b + c element for element. */
  case FDP_DTYPE_F16: SUM_LOOP(uint16_t, o[i] = f2h(h2f(o[i]) + h2f(x[i]))); break;
  case FDP_DTYPE_BF16: SUM_LOOP(uint16_t, o[i] = f2bf(bf2f(o[i]) + bf2f(x[i]))); break;
  default: break;
  }
}

static fdp_result_t host_reduce(const fdp_tensor_t *inputs, int n, const fdp_tensor_t *out,
                                const fdp_streams_t *streams) {
  (void)streams;
  assert(out->dtype != FDP_DTYPE_OTHER && out->dtype >= 0 && out->dtype < FDP_DTYPE_COUNT); /* fdp_op_reduce */
  /* The output may be one of the inputs only as inputs[0] (summed in place); anywhere else it would be
   * overwritten before being read. */
  for (int k = 1; k < n; k++)
    if (inputs[k].data == out->data)
      return fdp__fail(FDP_INVALID, "reduce: the output may alias only the first input, not input %d", k);
  sum_ctx_t c = {inputs, n, out};
  int64_t numel = fdp_tensor_numel(out);
  int64_t bytes = numel * out->elem_size * (n + 1);
  int64_t min_bytes = fdp_param(FDP_PARAM_HOST_PARALLEL_MIN);
  int64_t grain = bytes < min_bytes ? numel : BLOCK * 4;
  parallel_for(numel, grain, sum_range, &c);
  return FDP_OK;
}

/* Everything in host memory: copies and sums (a broadcast is copies). */
static int host_can(fdp_op_t op, const fdp_tensor_t *const *ts, int n) {
  if (op == FDP_OP_BROADCAST) return 0;
  for (int i = 0; i < n; i++)
    if (ts[i]->device != FDP_HOST) return 0;
  return 1;
}

static int host_usable(const char **why) {
  *why = "";
  return 1;
}

const fdp_backend_t fdp__backend_host = {
    .name = "host",
    .id = FDP_BACKEND_HOST,
    .usable = host_usable,
    .can = host_can,
    .copy = host_copy,
    .reduce = host_reduce,
    .broadcast = NULL,
    .shutdown = NULL,
};
