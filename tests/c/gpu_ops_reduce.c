/* SPDX-License-Identifier: MIT */
/* test_gpu_ops on sums: every dtype across devices (NCCL) and on one device (the k-way sum kernel, in passes, the
 * output aliasing an input), coalesced buckets, and the gradient reduction's pattern on streams of its own, against
 * host references computed independently of fastdp. */
#include "gpu_ops_harness.h"

#include "backend/cuda/kernels.h" /* FDP_SUM_MAX_INPUTS: where the passes of a long sum begin */

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- reductions ---- */

static const struct {
  int dtype, es;
} k_dtypes[] = {{FDP_DTYPE_BOOL, 1}, {FDP_DTYPE_U8, 1},  {FDP_DTYPE_I8, 1},   {FDP_DTYPE_I16, 2}, {FDP_DTYPE_I32, 4},
                {FDP_DTYPE_I64, 8},  {FDP_DTYPE_F16, 2}, {FDP_DTYPE_BF16, 2}, {FDP_DTYPE_F32, 4}, {FDP_DTYPE_F64, 8}};

/* Half types, independently of fastdp: exact values in double, and the nearest representable value found by
 * bisection over the (monotone) positive encodings, ties to the even encoding. */
static double half_value(uint16_t h, int bf) {
  int sign = h >> 15, e, m;
  double v;
  if (bf) {
    e = (h >> 7) & 0xff;
    m = h & 0x7f;
    v = e == 0 ? ldexp(m, -133) : ldexp(128 + m, e - 134);
    if (e == 0xff) v = m ? NAN : INFINITY;
  } else {
    e = (h >> 10) & 0x1f;
    m = h & 0x3ff;
    v = e == 0 ? ldexp(m, -24) : ldexp(1024 + m, e - 25);
    if (e == 0x1f) v = m ? NAN : INFINITY;
  }
  return sign ? -v : v;
}

static uint16_t half_round(double x, int bf) {
  uint16_t inf = bf ? 0x7f80 : 0x7c00, sign = signbit(x) ? 0x8000 : 0;
  double a = fabs(x);
  if (isnan(x)) return bf ? 0x7fc0 : 0x7e00;
  uint16_t lo = 0, hi = inf; /* largest encoding with value <= a */
  while (lo < hi) {
    uint16_t mid = (uint16_t)((lo + hi + 1) / 2);
    if (half_value(mid, bf) <= a)
      lo = mid;
    else
      hi = (uint16_t)(mid - 1);
  }
  if (lo == inf) return sign | inf;
  double below = half_value(lo, bf);
  /* the next value up; past the largest finite one, the rounding boundary is where inf would start */
  double above = lo + 1 == inf ? half_value(lo, bf) + (half_value(lo, bf) - half_value((uint16_t)(lo - 1), bf))
                               : half_value((uint16_t)(lo + 1), bf);
  uint16_t pick = lo;
  if (a - below > above - a || (a - below == above - a && (lo & 1))) pick = (uint16_t)(lo + 1);
  return sign | pick;
}

/* acc = acc + x per element in dtype's arithmetic (half types: float sum rounded, as PyTorch's CPU a + b). */
void ref_add(int dtype, void *acc, const void *x, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    switch (dtype) {
    case FDP_DTYPE_BOOL: ((uint8_t *)acc)[i] = ((uint8_t *)acc)[i] || ((const uint8_t *)x)[i]; break;
    case FDP_DTYPE_U8:
    case FDP_DTYPE_I8: ((uint8_t *)acc)[i] = (uint8_t)(((uint8_t *)acc)[i] + ((const uint8_t *)x)[i]); break;
    case FDP_DTYPE_I16: ((uint16_t *)acc)[i] = (uint16_t)(((uint16_t *)acc)[i] + ((const uint16_t *)x)[i]); break;
    case FDP_DTYPE_I32: ((uint32_t *)acc)[i] += ((const uint32_t *)x)[i]; break;
    case FDP_DTYPE_I64: ((uint64_t *)acc)[i] += ((const uint64_t *)x)[i]; break;
    case FDP_DTYPE_F32: ((float *)acc)[i] += ((const float *)x)[i]; break;
    case FDP_DTYPE_F64: ((double *)acc)[i] += ((const double *)x)[i]; break;
    case FDP_DTYPE_F16:
    case FDP_DTYPE_BF16: {
      int bf = dtype == FDP_DTYPE_BF16;
      uint16_t *o = acc;
      /* the float add: the exact sum (in double) rounded once to float */
      float s = (float)(half_value(o[i], bf) + half_value(((const uint16_t *)x)[i], bf));
      o[i] = half_round((double)s, bf);
      break;
    }
    default: break;
    }
  }
}

/* Fills a mirror with values of the dtype: bools 0/1, finite halves and floats of modest size. */
void fill_values(int dtype, unsigned char *p, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    double v = (double)((int64_t)(rnd() % 20001) - 10000) / 1000.0 * (1.0 + (double)(rnd() % 7) / 3.0);
    switch (dtype) {
    case FDP_DTYPE_BOOL: p[i] = (uint8_t)(rnd() & 1); break;
    case FDP_DTYPE_F16: ((uint16_t *)p)[i] = half_round(v, 0); break;
    case FDP_DTYPE_BF16: ((uint16_t *)p)[i] = half_round(v, 1); break;
    case FDP_DTYPE_F32: ((float *)p)[i] = (float)v; break;
    case FDP_DTYPE_F64: ((double *)p)[i] = v; break;
    default: break; /* integers keep their random bits */
    }
  }
}

/* out = sum of `n` inputs of `count` elements, on devs[i] (out on out_dev, or aliasing input `alias` >= 0). */
void reduce_case(int dtype, int es, int n, const int *devs, int out_dev, int alias, int64_t count,
                 const CUstream *streams, int expect) {
  buf_t *in = xmalloc((size_t)n * sizeof *in);
  fdp_tensor_t *it = xmalloc((size_t)n * sizeof *it);
  int64_t sz[1] = {count}, st[1] = {1};
  for (int i = 0; i < n; i++) {
    in[i] = buf_new(devs[i], (size_t)(count * es));
    fill_values(dtype, in[i].ref, count);
    buf_upload(&in[i]);
    it[i] = view(&in[i], dtype, es, 1, sz, st, 0).t;
  }
  unsigned char *want = xmalloc((size_t)(count * es));
  memcpy(want, in[0].ref, (size_t)(count * es));
  for (int i = 1; i < n; i++)
    ref_add(dtype, want, in[i].ref, count);
  buf_t ob = {0};
  buf_t *outb = alias >= 0 ? &in[alias] : &ob;
  if (alias < 0) ob = buf_new(out_dev, (size_t)(count * es));
  fdp_tensor_t ot = alias >= 0 ? it[alias] : view(&ob, dtype, es, 1, sz, st, 0).t;
  fdp_streams_t s = all_streams(streams);
  buf_t **all = xmalloc((size_t)(n + 1) * sizeof *all);
  for (int i = 0; i < n; i++)
    all[i] = &in[i];
  all[n] = &ob;
  int nall = alias >= 0 ? n : n + 1;
  caller_before(all, nall, streams);
  fdp_result_t r = fdp_op_reduce(it, n, &ot, &s);
  caller_after(all, nall, streams, "reduce");
  free(all);
  CHECKF(r == (fdp_result_t)expect, "reduce of %d %s inputs: %s (%s)", n, fdp_dtype_name(dtype), fdp_result_name(r),
         fdp_last_error());
  if (r == FDP_OK) {
    memcpy(outb->ref, want, (size_t)(count * es));
    char what[96];
    snprintf(what, sizeof what, "reduce of %d %s inputs (alias %d)", n, fdp_dtype_name(dtype), alias);
    buf_matches(outb, what);
  }
  for (int i = 0; i < n; i++)
    buf_free(&in[i]);
  if (alias < 0) buf_free(&ob);
  free(want);
  free(in);
  free(it);
}

void test_reduce(void) {
  int devs[80];
  for (size_t t = 0; t < sizeof k_dtypes / sizeof k_dtypes[0]; t++) {
    int dt = k_dtypes[t].dtype, es = k_dtypes[t].es;
    /* across devices: NCCL where it has the type; bool and int16 have no NCCL sum and no other path */
    for (int d = 0; d < g_ndev; d++)
      devs[d] = d;
    int nccl = dt != FDP_DTYPE_BOOL && dt != FDP_DTYPE_I16;
    if (g_ndev > 1) {
      reduce_case(dt, es, g_ndev, devs, 0, -1, 1000, g_stream, nccl ? FDP_OK : FDP_UNAVAILABLE);
      if (nccl) reduce_case(dt, es, g_ndev, devs, 0, 0, 333, NULL, FDP_OK);
    }
    /* on one device: 70 inputs, the output aliasing input 45 (a later pass still reads it) or input 0 */
    for (int i = 0; i < 70; i++)
      devs[i] = g_ndev > 1 ? 1 : 0;
    reduce_case(dt, es, 70, devs, devs[0], 45, 257, g_stream, FDP_OK);
    reduce_case(dt, es, 70, devs, devs[0], 0, 100, NULL, FDP_OK);
    reduce_case(dt, es, 3, devs, devs[0], -1, 4097, g_stream, FDP_OK);
    reduce_case(dt, es, 1, devs, devs[0], -1, 10, g_stream, FDP_OK);
  }
  sim_clean("reduce");
}

/* Sums longer than one launch run in passes, each carrying the running sum as its first input: an output that is
 * one of the inputs must come out right wherever it sits (in the first pass, first of a later pass's own inputs,
 * last of a pass, the very last) and however many inputs there are (up to 200: seven passes). float16, so that
 * any change of the order of the adds shows in the rounding. */
void test_reduce_passes(void) {
  static const int counts[] = {2, 31, 32, 33, 63, 64, 94, 95, 200};
  int devs[200];
  for (int i = 0; i < 200; i++)
    devs[i] = g_ndev - 1;
  for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++) {
    int n = counts[c];
    int aliases[64], na = 0;
    aliases[na++] = -1;
    aliases[na++] = 0;
    aliases[na++] = 1;
    for (int start = FDP_SUM_MAX_INPUTS; start < n; start += FDP_SUM_MAX_INPUTS - 1) {
      if (start > 2 * FDP_SUM_MAX_INPUTS && start + 2 * FDP_SUM_MAX_INPUTS < n) continue; /* the middle passes */
      aliases[na++] = start - 1;
      aliases[na++] = start;
      if (start + 1 < n) aliases[na++] = start + 1;
    }
    aliases[na++] = n - 1;
    for (int a = 0; a < na; a++)
      if (aliases[a] < n)
        reduce_case(FDP_DTYPE_F16, 2, n, devs, devs[0], aliases[a], 37, a % 2 ? g_stream : NULL, FDP_OK);
  }
  sim_clean("sums in passes");
}

/* ---- coalesced: pack into flat buckets, broadcast them, unpack elsewhere; reduce buckets ---- */

void test_coalesced(void) {
  enum { N = 7 };
  static const int64_t counts[N] = {10, 300, 1, 77, 4096, 5, 64};
  static const int dtypes[N] = {FDP_DTYPE_F32, FDP_DTYPE_F16, FDP_DTYPE_I64, FDP_DTYPE_F32,
                                FDP_DTYPE_F32, FDP_DTYPE_F16, FDP_DTYPE_I64};
  static const int ess[N] = {4, 2, 8, 4, 4, 2, 8};
  buf_t tb[N];
  fdp_tensor_t tt[N];
  for (int i = 0; i < N; i++) {
    int64_t sz[1] = {counts[i]}, st[1] = {1};
    tb[i] = buf_new(0, (size_t)(counts[i] * ess[i]));
    tt[i] = view(&tb[i], dtypes[i], ess[i], 1, sz, st, 0).t;
  }
  fdp_plan_t *plan = NULL;
  OK(fdp_plan_build(tt, NULL, N, 2048, &plan));
  fdp_streams_t streams = all_streams(g_stream);
  for (int b = 0; plan && b < plan->nbuckets; b++) {
    const fdp_bucket_t *bk = &plan->buckets[b];
    int64_t sz[1] = {bk->numel}, st[1] = {1};
    buf_t flat[FDP_MAX_DEVICES];
    fdp_tensor_t ft[FDP_MAX_DEVICES];
    for (int d = 0; d < g_ndev; d++) {
      flat[d] = buf_new(d, (size_t)(bk->numel * bk->elem_size));
      ft[d] = view(&flat[d], bk->dtype, bk->elem_size, 1, sz, st, 0).t;
    }
    /* pack on device 0 */
    fdp_tensor_t dsts[N], srcs[N];
    for (int m = 0; m < bk->count; m++) {
      const fdp_member_t *mb = &plan->members[bk->first + m];
      int64_t msz[1] = {mb->numel};
      view_t v = view(&flat[0], bk->dtype, bk->elem_size, 1, msz, st, mb->offset);
      dsts[m] = v.t;
      srcs[m] = tt[mb->tensor];
      memcpy(v.ref.data, tb[mb->tensor].ref, (size_t)(mb->numel * bk->elem_size));
    }
    OK(fdp_op_copy(dsts, srcs, bk->count, &streams));
    buf_matches(&flat[0], "packed bucket");
    /* broadcast the bucket to every other device */
    OK(fdp_op_broadcast(&ft[0], &ft[1], g_ndev - 1, &streams));
    for (int d = 1; d < g_ndev; d++) {
      memcpy(flat[d].ref, flat[0].ref, flat[0].bytes);
      buf_matches(&flat[d], "broadcast bucket");
    }
    /* unpack on the last device into fresh tensors */
    int last = g_ndev - 1;
    buf_t ub[N];
    for (int m = 0; m < bk->count; m++) {
      const fdp_member_t *mb = &plan->members[bk->first + m];
      int64_t msz[1] = {mb->numel};
      ub[m] = buf_new(last, (size_t)(mb->numel * bk->elem_size));
      dsts[m] = view(&ub[m], bk->dtype, bk->elem_size, 1, msz, st, 0).t;
      srcs[m] = view(&flat[last], bk->dtype, bk->elem_size, 1, msz, st, mb->offset).t;
      memcpy(ub[m].ref, tb[mb->tensor].ref, ub[m].bytes);
    }
    OK(fdp_op_copy(dsts, srcs, bk->count, &streams));
    for (int m = 0; m < bk->count; m++) {
      buf_matches(&ub[m], "unpacked member");
      buf_free(&ub[m]);
    }
    for (int d = 0; d < g_ndev; d++)
      buf_free(&flat[d]);
  }
  fdp_plan_free(plan);
  for (int i = 0; i < N; i++)
    buf_free(&tb[i]);
  sim_clean("coalesced");
}

/* ---- the gradient reduction on streams of its own (fastdp._reducer, NOTE [reduction streams]) ----
 * The inputs are produced on the caller's streams; autograd makes device 0's stream (the bucket node's canonical
 * one) wait for all of them; fastdp makes each of its own streams wait for that stream, sums there, and the consumer
 * (device 0's stream again) waits for a fence behind its own stream of device 0; the host releases the inputs (the
 * caller may reuse their memory) only once a fence behind every own stream reports done. `skip` drops one of
 * fastdp's orderings (0..n-1: an own stream's wait, n: the consumer's, n + 1: the host's query): the simulator must
 * report a race for each. Returns the races recorded (0 on a real driver, where nothing is checked). */
static long long own_streams_case(int n, const int *devs, int skip) {
  int64_t count = 777, sz[1] = {count}, st[1] = {1};
  int es = 4;
  buf_t in[8], out = buf_new(devs[0], (size_t)(count * es));
  fdp_tensor_t it[8];
  CUstream own[FDP_MAX_DEVICES] = {0};
  fdp_streams_t own_all = {0}, caller = {0}, canonical = {1, {devs[0]}, {(void *)g_stream[devs[0]]}};
  for (int i = 0; i < n; i++) {
    in[i] = buf_new(devs[i], (size_t)(count * es));
    fill_values(FDP_DTYPE_F32, in[i].ref, count);
    buf_upload(&in[i]);
    it[i] = view(&in[i], FDP_DTYPE_F32, es, 1, sz, st, 0).t;
    int d = devs[i];
    if (own[d] == NULL) {
      push(d);
      dev_call(d, D.StreamCreate(&own[d], 1), "cuStreamCreate");
      pop(d);
      own_all.device[own_all.n] = d;
      own_all.stream[own_all.n++] = (void *)own[d];
      caller.device[caller.n] = d;
      caller.stream[caller.n++] = (void *)g_stream[d];
    }
  }
  fdp_tensor_t ot = view(&out, FDP_DTYPE_F32, es, 1, sz, st, 0).t;
  buf_t *all[9];
  for (int i = 0; i < n; i++)
    all[i] = &in[i];
  all[n] = &out;
  caller_before(all, n + 1, g_stream); /* the gradients produced, the output handed out, on the caller's streams */
  for (int k = 0; k < caller.n; k++) { /* autograd: the canonical stream waits for every input's producer */
    fdp_streams_t one = {1, {caller.device[k]}, {caller.stream[k]}};
    OK(fdp_streams_order(&canonical, &one));
  }
  for (int k = 0; k < own_all.n; k++) { /* fastdp: each own stream waits for the canonical one */
    fdp_streams_t waiter = {1, {own_all.device[k]}, {own_all.stream[k]}};
    if (skip != k) OK(fdp_streams_order(&waiter, &canonical));
  }
  OK(fdp_op_reduce(it, n, &ot, &own_all));
  fdp_fence_t *deliver = NULL, *release = NULL;
  fdp_streams_t first = {1, {own_all.device[0]}, {own_all.stream[0]}};
  OK(fdp_fence_record(&first, &deliver));
  OK(fdp_fence_record(&own_all, &release));
  if (skip != own_all.n) OK(fdp_fence_wait(deliver, &canonical)); /* the delivery: the consumer waits */
  caller_touch(&out, g_stream, 0);                                /* and reads the sum */
  int done = 0;
  if (skip != own_all.n + 1) OK(fdp_fence_query(release, &done)); /* later, the host releases the inputs */
  CHECK(done || skip == own_all.n + 1);
  for (int i = 0; i < n; i++)
    caller_touch(&in[i], g_stream, 1); /* the caller reuses the inputs' memory */
  fdp_fence_free(deliver);
  fdp_fence_free(release);
  unsigned char *want = out.ref;
  memcpy(want, in[0].ref, (size_t)(count * es));
  for (int i = 1; i < n; i++)
    ref_add(FDP_DTYPE_F32, want, in[i].ref, count);
  buf_matches(&out, "reduce on own streams");
  long long races = 0;
  if (sim()) {
    char text[4096];
    races = S.errors(text, sizeof text);
    S.reset();
  }
  for (int k = 0; k < own_all.n; k++) {
    push(own_all.device[k]);
    dev_call(own_all.device[k], D.StreamDestroy(own[own_all.device[k]]), "cuStreamDestroy");
    pop(own_all.device[k]);
  }
  for (int i = 0; i < n; i++)
    buf_free(&in[i]);
  buf_free(&out);
  return races;
}

void test_reduce_on_own_streams(void) {
  int spread[8], same[3] = {0, 0, 0};
  for (int d = 0; d < g_ndev; d++)
    spread[d] = d;
  const int *cases[2] = {spread, same};
  int counts[2] = {g_ndev, 3};
  for (int c = 0; c < 2; c++) {
    if (counts[c] < 2) continue;
    int own_n = c == 0 ? g_ndev : 1;
    CHECKF(own_streams_case(counts[c], cases[c], -1) == 0, "reduce on own streams (%d inputs): races recorded",
           counts[c]);
    /* (On one device the consumer's stream is every input's producer: its wait orders their reuse too, so the host's
     * query adds nothing there.) */
    for (int skip = 0; sim() && skip <= own_n + (c == 0); skip++)
      CHECKF(own_streams_case(counts[c], cases[c], skip) > 0,
             "reduce on own streams (%d inputs) without ordering %d: no race recorded", counts[c], skip);
  }
  sim_clean("reduce on own streams");
}
