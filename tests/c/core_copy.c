/* SPDX-License-Identifier: MIT */
/* test_core's suites on copies through the host backend: random strided layouts of every element size against a
 * reference copy, prepared copies, large copies split across the worker threads, and the per-thread scratch
 * blocks. */
#include "core_harness.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- copies ---- */

/* Position of the first differing byte, or -1. */
static int64_t first_diff(const void *a, const void *b, size_t bytes) {
  const unsigned char *x = a, *y = b;
  for (size_t i = 0; i < bytes; i++)
    if (x[i] != y[i]) return (int64_t)i;
  return -1;
}

static void shape_text(int nd, const int64_t *sizes, const int64_t *strides, char *buf, size_t len) {
  size_t used = 0;
  buf[0] = 0;
  for (int i = 0; i < nd && used < len; i++)
    used += (size_t)snprintf(buf + used, len - used, "%s%lld:%lld", i ? "," : "", (long long)sizes[i],
                             (long long)strides[i]);
}

/* One copy of `sizes` between two layouts; compares whole destination buffers, gaps included. */
static int copy_case(int es, int nd, const int64_t *sizes, const layout_t *dl, const layout_t *sl, char *msg,
                     size_t msglen) {
  size_t dbytes = (size_t)dl->span * es, sbytes = (size_t)sl->span * es;
  char *sbuf = xmalloc(sbytes), *dbuf = xmalloc(dbytes), *rbuf = xmalloc(dbytes);
  fill_random(sbuf, sbytes);
  fill_random(dbuf, dbytes);
  memcpy(rbuf, dbuf, dbytes);
  fdp_tensor_t src = on(sl, sbuf, es), dst = on(dl, dbuf, es), ref = on(dl, rbuf, es);
  ref_copy(&ref, &src);
  fdp_result_t r = fdp_op_copy(&dst, &src, 1, NULL);
  int64_t at = first_diff(dbuf, rbuf, dbytes);
  int ok = r == FDP_OK && at < 0;
  if (!ok) {
    char a[300], b[300];
    shape_text(nd, sizes, dl->strides, a, sizeof a);
    shape_text(nd, sizes, sl->strides, b, sizeof b);
    snprintf(msg, msglen, "es %d, dst [%s]+%lld, src [%s]+%lld: %s, first wrong byte %lld (%s)", es, a,
             (long long)dl->offset, b, (long long)sl->offset, fdp_result_name(r), (long long)at, fdp_last_error());
  }
  free(sbuf);
  free(dbuf);
  free(rbuf);
  return ok;
}

void test_copy(void) {
  char msg[1000];
  for (size_t e = 0; e < sizeof elem_sizes / sizeof elem_sizes[0]; e++) {
    int es = elem_sizes[e];
    /* Random shapes of 0..6 dims (sizes 0..4, mostly non-zero) in random layouts on both sides. */
    int failures = 0;
    for (int iter = 0; iter < 400; iter++) {
      int nd = (int)rnd_in(0, 6);
      int64_t sizes[6];
      for (int i = 0; i < nd; i++)
        sizes[i] = rnd() % 12 == 0 ? 0 : rnd_in(1, 4);
      layout_t sl = random_layout(nd, sizes, 1, 3), dl = random_layout(nd, sizes, 0, 2);
      if (!copy_case(es, nd, sizes, &dl, &sl, msg, sizeof msg) && failures++ < 5) CHECKF(0, "%s", msg);
    }
    CHECKF(failures == 0, "es %d: %d random copies wrong", es, failures);

    /* Named shapes: 0-d, empty, size-1 dims, a transpose, step slices, a 6-d permutation. */
    {
      layout_t l = contig_layout(0, NULL);
      CHECKF(copy_case(es, 0, NULL, &l, &l, msg, sizeof msg), "0-d: %s", msg);
    }
    {
      int64_t sz[] = {3, 0, 2};
      layout_t l = contig_layout(3, sz);
      layout_t t = random_layout(3, sz, 0, 2);
      CHECKF(copy_case(es, 3, sz, &t, &l, msg, sizeof msg), "empty: %s", msg);
    }
    {
      int64_t sz[] = {1, 5, 1, 3};
      layout_t d = contig_layout(4, sz), s = contig_layout(4, sz);
      s.strides[0] = 999; /* strides of size-1 dims are arbitrary */
      s.strides[2] = 12345;
      s.span = 15;
      d.strides[1] = 7;
      d.span = 4 * 7 + 3;
      CHECKF(copy_case(es, 4, sz, &d, &s, msg, sizeof msg), "size-1 dims: %s", msg);
    }
    {
      int64_t sz[] = {7, 9};
      layout_t s = contig_layout(2, sz), d = contig_layout(2, sz);
      d.strides[0] = 1; /* dst is the transpose of a [9, 7] buffer */
      d.strides[1] = 7;
      CHECKF(copy_case(es, 2, sz, &d, &s, msg, sizeof msg), "transpose: %s", msg);
    }
    {
      int64_t sz[] = {5, 4};
      layout_t s = contig_layout(2, sz), d = contig_layout(2, sz);
      s.strides[0] = 24; /* x[1::2, 2::3] of a [10, 12] buffer */
      s.strides[1] = 3;
      s.offset = 12 + 2;
      s.span = 120;
      CHECKF(copy_case(es, 2, sz, &d, &s, msg, sizeof msg), "step slice: %s", msg);
      CHECKF(copy_case(es, 2, sz, &s, &d, msg, sizeof msg), "into a step slice: %s", msg);
    }
    {
      int64_t sz[] = {2, 3, 1, 4, 2, 3};
      layout_t s = contig_layout(6, sz), d = random_layout(6, sz, 0, 1);
      CHECKF(copy_case(es, 6, sz, &d, &s, msg, sizeof msg), "6-d permutation: %s", msg);
      d = random_layout(6, sz, 0, 2);
      s = random_layout(6, sz, 1, 2);
      CHECKF(copy_case(es, 6, sz, &d, &s, msg, sizeof msg), "6-d strided: %s", msg);
    }
  }

  /* Several pairs in one call, and a pair that is its own source (skipped). */
  {
    int64_t sz[] = {6, 5};
    float a[30], b[30], c[40], d[40], ref_c[40];
    fill_random(a, sizeof a);
    fill_random(b, sizeof b);
    fill_random(c, sizeof c);
    memcpy(d, c, sizeof d);
    memcpy(ref_c, c, sizeof c);
    int64_t tst[] = {1, 6};
    fdp_tensor_t srcs[3] = {make_contig(a, FDP_DTYPE_F32, 4, 2, sz), make_contig(b, FDP_DTYPE_F32, 4, 2, sz),
                            make_contig(a, FDP_DTYPE_F32, 4, 2, sz)};
    fdp_tensor_t dsts[3] = {make(c, FDP_DTYPE_F32, 4, 2, sz, tst), make_contig(d, FDP_DTYPE_F32, 4, 2, sz),
                            make_contig(a, FDP_DTYPE_F32, 4, 2, sz)};
    fdp_tensor_t rc = make(ref_c, FDP_DTYPE_F32, 4, 2, sz, tst);
    ref_copy(&rc, &srcs[0]);
    float a_before[30];
    memcpy(a_before, a, sizeof a);
    EXPECT(fdp_op_copy(dsts, srcs, 3, NULL), FDP_OK);
    CHECK(memcmp(c, ref_c, sizeof c) == 0);
    CHECK(memcmp(d, b, sizeof b) == 0);
    CHECK(memcmp(a, a_before, sizeof a) == 0);
  }

  /* Mismatches and bad descriptors. */
  {
    char buf[256] = {0}, out[256] = {0};
    int64_t s23[] = {2, 3}, s32[] = {3, 2}, s6[] = {6}, s231[] = {2, 3, 1};
    fdp_tensor_t src = make_contig(buf, FDP_DTYPE_F32, 4, 2, s23);
    fdp_tensor_t dst = make_contig(out, FDP_DTYPE_F32, 4, 2, s32);
    EXPECT(fdp_op_copy(&dst, &src, 1, NULL), FDP_INVALID);
    dst = make_contig(out, FDP_DTYPE_F32, 4, 1, s6);
    EXPECT(fdp_op_copy(&dst, &src, 1, NULL), FDP_INVALID);
    dst = make_contig(out, FDP_DTYPE_F32, 4, 3, s231);
    EXPECT(fdp_op_copy(&dst, &src, 1, NULL), FDP_INVALID);
    dst = make_contig(out, FDP_DTYPE_I16, 2, 2, s23);
    EXPECT(fdp_op_copy(&dst, &src, 1, NULL), FDP_INVALID);
    dst = make_contig(out, FDP_DTYPE_F64, 8, 2, s23);
    EXPECT(fdp_op_copy(&dst, &src, 1, NULL), FDP_INVALID);
    CHECKF(memcmp(out, (char[256]){0}, 256) == 0, "a rejected copy wrote its destination");
    dst = make_contig(out, FDP_DTYPE_F32, 4, 2, s23);
    EXPECT(fdp_op_copy(&dst, &src, 1, NULL), FDP_OK);
    EXPECT(fdp_op_copy(&dst, &src, 0, NULL), FDP_OK);
    EXPECT(fdp_op_copy(&dst, &src, -1, NULL), FDP_INVALID);
    EXPECT(fdp_op_copy(NULL, &src, 1, NULL), FDP_INVALID);
    fdp_tensor_t bad = src;
    bad.strides[1] = -1;
    EXPECT(fdp_op_copy(&dst, &bad, 1, NULL), FDP_INVALID);
    bad = src;
    bad.sizes[0] = -2;
    EXPECT(fdp_op_copy(&bad, &bad, 1, NULL), FDP_INVALID);
    bad = src;
    bad.elem_size = 0;
    EXPECT(fdp_op_copy(&bad, &bad, 1, NULL), FDP_INVALID);
    bad.elem_size = 17;
    EXPECT(fdp_op_copy(&bad, &bad, 1, NULL), FDP_INVALID);
    bad = src;
    bad.ndim = FDP_MAX_DIMS + 1;
    EXPECT(fdp_op_copy(&bad, &bad, 1, NULL), FDP_INVALID);
    bad = src;
    bad.data = NULL;
    EXPECT(fdp_op_copy(&dst, &bad, 1, NULL), FDP_INVALID);
    bad = src;
    bad.device = FDP_MAX_DEVICES;
    EXPECT(fdp_op_copy(&dst, &bad, 1, NULL), FDP_INVALID);
    bad.device = -2;
    EXPECT(fdp_op_copy(&dst, &bad, 1, NULL), FDP_INVALID);
    /* An empty tensor may have no data pointer. */
    int64_t s0[] = {0, 3};
    fdp_tensor_t e1 = make_contig(NULL, FDP_DTYPE_F32, 4, 2, s0), e2 = make_contig(NULL, FDP_DTYPE_F32, 4, 2, s0);
    EXPECT(fdp_op_copy(&e1, &e2, 1, NULL), FDP_OK);
  }
}

/* Large copies, split across the worker threads (FASTDP_HOST_PARALLEL_MIN=4096, FASTDP_HOST_THREADS=4). */
/* A prepared copy: checked once (overlapping destinations refused as fdp_op_copy refuses them), then run as often as
 * wanted, each run reading the sources as they are then. */
void test_copy_plan(void) {
  enum { N = 5, K = 7 };
  float src[N][K], flat[N * K];
  fdp_tensor_t d[N], s[N];
  for (int i = 0; i < N; i++) {
    d[i] = make_flat(flat + i * K, FDP_DTYPE_F32, 4, K);
    s[i] = make_flat(src[i], FDP_DTYPE_F32, 4, K);
  }
  fdp_copy_plan_t *plan = NULL;
  CHECK(fdp_copy_prepare(d, s, N, &plan) == FDP_OK && plan != NULL);
  for (int run = 0; run < 3; run++) {
    for (int i = 0; i < N; i++)
      for (int j = 0; j < K; j++)
        src[i][j] = (float)(run * 100 + i * K + j);
    CHECK(fdp_copy_run(plan, NULL) == FDP_OK);
    int same = 1;
    for (int i = 0; i < N; i++)
      for (int j = 0; j < K; j++)
        same &= flat[i * K + j] == src[i][j];
    CHECKF(same, "run %d: the destinations do not hold the sources as they are now", run);
  }
  fdp_copy_plan_free(plan);
  fdp_copy_plan_free(NULL);
  d[3] = make_flat(flat + 2 * K + 1, FDP_DTYPE_F32, 4, K); /* overlaps destination 2 */
  plan = (fdp_copy_plan_t *)&plan;
  CHECK(fdp_copy_prepare(d, s, N, &plan) == FDP_OVERLAP && plan == NULL);
  CHECK(fdp_copy_prepare(d, s, -1, &plan) == FDP_INVALID);
  CHECK(fdp_copy_prepare(d, s, 0, &plan) == FDP_OK && fdp_copy_run(plan, NULL) == FDP_OK);
  fdp_copy_plan_free(plan);
  CHECK(fdp_copy_run(NULL, NULL) == FDP_INVALID);
}

void test_copy_threaded(void) {
  char msg[1000];
  struct {
    int es, nd;
    int64_t sizes[6];
    int kind; /* 0 contiguous, 1 transpose, 2 random strided both sides, 3 inner-strided source */
  } cases[] = {
      {1, 1, {4 << 20}, 0},           {4, 2, {1024, 1024}, 1},   {16, 2, {700, 300}, 1},  {2, 2, {512, 2048}, 3},
      {8, 6, {8, 8, 8, 8, 8, 16}, 2}, {4, 3, {3, 1, 600000}, 3}, {1, 2, {1500, 1501}, 2},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    int nd = cases[i].nd;
    const int64_t *sz = cases[i].sizes;
    layout_t s = contig_layout(nd, sz), d = contig_layout(nd, sz);
    if (cases[i].kind == 1) {
      d.strides[0] = 1;
      d.strides[1] = sz[0];
    } else if (cases[i].kind == 2) {
      s = random_layout(nd, sz, 0, 1);
      d = random_layout(nd, sz, 0, 2);
    } else if (cases[i].kind == 3) {
      s.strides[nd - 1] = 2;
      for (int k = nd - 2; k >= 0; k--)
        s.strides[k] = s.strides[k + 1] * (sz[k + 1] > 1 ? sz[k + 1] : 1);
      s.span = 2 * numel_of(nd, sz);
      d = random_layout(nd, sz, 0, 1);
    }
    CHECKF(copy_case(cases[i].es, nd, sz, &d, &s, msg, sizeof msg), "threaded case %zu: %s", i, msg);
  }
}

/* ---- scratch blocks ---- */

static void *scratch_thread(void *arg) {
  size_t bytes = (size_t)(uintptr_t)arg;
  char *p = fdp_scratch_alloc(bytes);
  if (p) memset(p, 0x5a, bytes);
  fdp_scratch_free(p); /* kept by this thread, freed when it exits (ASan reports a leak otherwise) */
  return p;
}

void test_scratch(void) {
  const size_t big = 200 * 1024, small = 1024;
  fdp_scratch_release();
  char *a = fdp_scratch_alloc(big);
  CHECK(a != NULL && (uintptr_t)a % _Alignof(max_align_t) == 0);
  memset(a, 1, big);
  fdp_scratch_free(a);
  char *b = fdp_scratch_alloc(big / 2); /* a kept block large enough is handed out again */
  CHECK(b == a);
  char *c = fdp_scratch_alloc(big); /* the kept one is taken: a new block */
  CHECK(c != NULL && c != b);
  fdp_scratch_free(b);
  fdp_scratch_free(c);
  char *d = fdp_scratch_alloc(big); /* the smallest block that fits: either, both have room for big */
  CHECK(d == a || d == c);
  fdp_scratch_free(d);
  char *blocks[6];
  for (int i = 0; i < 6; i++) { /* more blocks than are kept: the extra ones are freed, none lost (ASan) */
    blocks[i] = fdp_scratch_alloc(big * (size_t)(i + 1));
    CHECK(blocks[i] != NULL);
    if (blocks[i]) memset(blocks[i], i, big * (size_t)(i + 1));
  }
  for (int i = 0; i < 6; i++)
    fdp_scratch_free(blocks[i]);
  char *e = fdp_scratch_alloc(big * 6); /* the largest ones were kept */
  CHECK(e == blocks[5]);
  fdp_scratch_free(e);
  char *s1 = fdp_scratch_alloc(small);
  memset(s1, 2, small);
  fdp_scratch_free(s1); /* small blocks go back to malloc */
  fdp_scratch_free(NULL);
  CHECK(fdp_scratch_alloc(SIZE_MAX) == NULL);
  pthread_t th;
  void *ret = NULL;
  CHECK(pthread_create(&th, NULL, scratch_thread, (void *)(uintptr_t)big) == 0 && pthread_join(th, &ret) == 0);
  CHECK(ret != NULL);
  fdp_scratch_release();
}
