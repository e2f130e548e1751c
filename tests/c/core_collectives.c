/* SPDX-License-Identifier: MIT */
/* test_core's suites on broadcast, scatter and gather through the host backend, against reference copies: shapes,
 * dims and layouts, the checks that refuse bad arguments, and sources that are never written. */
#include "core_harness.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

/* ---- broadcast, scatter, gather ---- */

/* Runs fn in a child process and returns 1 when it exited 0 (a crash there does not end this run). */
static int in_child(void (*fn)(void)) {
  fflush(stdout);
  pid_t pid = fork();
  if (pid < 0) return 0;
  if (pid == 0) {
    fn();
    _exit(0);
  }
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return 0;
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

/* A page-aligned buffer that can be made read-only; writes to it then fault. */
static void *ro_alloc(size_t bytes) {
  void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return p == MAP_FAILED ? NULL : p;
}

static void bcast_readonly_child(void) {
  /* The source is read-only; a destination that is the source itself must be skipped, never written (a write
   * would fault). glibc's memcpy(p, p, n) writes nothing either, so this shows no fault, not the skip itself. */
  size_t page = (size_t)sysconf(_SC_PAGESIZE), bytes = 2 * page;
  float *src = ro_alloc(bytes);
  if (!src) _exit(3);
  int64_t n = (int64_t)(bytes / 4);
  for (int64_t i = 0; i < n; i++)
    src[i] = (float)i;
  mprotect(src, bytes, PROT_READ);
  float *other = malloc(bytes);
  fdp_tensor_t s = make_flat(src, FDP_DTYPE_F32, 4, n);
  fdp_tensor_t dsts[3] = {s, make_flat(other, FDP_DTYPE_F32, 4, n), s};
  if (fdp_op_broadcast(&s, dsts, 3, NULL) != FDP_OK) _exit(4);
  if (memcmp(src, other, bytes) != 0) _exit(5);
  free(other);
  munmap(src, bytes);
  _exit(0);
}

void test_broadcast(void) {
  for (int big = 0; big < 2; big++) {
    int64_t sz[] = {big ? 700 : 5, big ? 900 : 6};
    int es = 4;
    layout_t sl = random_layout(2, sz, 0, 2);
    char *sbuf = xmalloc((size_t)sl.span * es);
    fill_random(sbuf, (size_t)sl.span * es);
    fdp_tensor_t src = on(&sl, sbuf, es);
    enum { ND = 4 };
    layout_t dl[ND];
    char *dbuf[ND], *rbuf[ND];
    fdp_tensor_t dst[ND + 1];
    for (int i = 0; i < ND; i++) {
      dl[i] = i == 0 ? contig_layout(2, sz) : random_layout(2, sz, 0, 2);
      size_t bytes = (size_t)dl[i].span * es;
      dbuf[i] = xmalloc(bytes);
      rbuf[i] = xmalloc(bytes);
      fill_random(dbuf[i], bytes);
      memcpy(rbuf[i], dbuf[i], bytes);
      dst[i] = on(&dl[i], dbuf[i], es);
      fdp_tensor_t r = on(&dl[i], rbuf[i], es);
      ref_copy(&r, &src);
    }
    dst[ND] = src; /* the source's own entry */
    EXPECT(fdp_op_broadcast(&src, dst, ND + 1, NULL), FDP_OK);
    for (int i = 0; i < ND; i++) {
      CHECKF(memcmp(dbuf[i], rbuf[i], (size_t)dl[i].span * es) == 0, "broadcast %s, destination %d",
             big ? "large" : "small", i);
      free(dbuf[i]);
      free(rbuf[i]);
    }
    free(sbuf);
  }
  CHECKF(in_child(bcast_readonly_child), "a destination equal to the source was written (or the call failed)");
  {
    float a[6] = {0}, b[6] = {0};
    int64_t s6[] = {6}, s5[] = {5};
    fdp_tensor_t src = make_contig(a, FDP_DTYPE_F32, 4, 1, s6), dst = make_contig(b, FDP_DTYPE_F32, 4, 1, s5);
    EXPECT(fdp_op_broadcast(&src, &dst, 1, NULL), FDP_INVALID);
    EXPECT(fdp_op_broadcast(&src, &dst, 0, NULL), FDP_OK);
    EXPECT(fdp_op_broadcast(&src, &dst, -1, NULL), FDP_INVALID);
    EXPECT(fdp_op_broadcast(NULL, &dst, 1, NULL), FDP_INVALID);
    dst = make_contig(b, FDP_DTYPE_I16, 2, 1, s6);
    EXPECT(fdp_op_broadcast(&src, &dst, 1, NULL), FDP_INVALID);
  }
}

static void scatter_readonly_child(void) {
  /* Output 1 is the very view of the source's chunk 1 and the source is read-only: it must be skipped, never
   * written (as above, this shows that nothing faults). */
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  int64_t rows = 8, cols = (int64_t)(page / 8);
  size_t bytes = (size_t)(rows * cols) * 4;
  float *src = ro_alloc(bytes);
  if (!src) _exit(3);
  for (int64_t i = 0; i < rows * cols; i++)
    src[i] = (float)i;
  mprotect(src, bytes, PROT_READ);
  int64_t sz[] = {rows, cols}, chunks[] = {3, 2, 3};
  fdp_tensor_t s = make_contig(src, FDP_DTYPE_F32, 4, 2, sz), outs[3];
  float *o0 = malloc(bytes), *o2 = malloc(bytes);
  int64_t s0[] = {3, cols};
  outs[0] = make_contig(o0, FDP_DTYPE_F32, 4, 2, s0);
  fdp_tensor_narrow(&s, 0, 3, 2, &outs[1]);
  outs[2] = make_contig(o2, FDP_DTYPE_F32, 4, 2, s0);
  if (fdp_op_scatter(&s, 0, chunks, outs, 3, NULL) != FDP_OK) _exit(4);
  if (memcmp(o0, src, (size_t)(3 * cols) * 4) || memcmp(o2, src + 5 * cols, (size_t)(3 * cols) * 4)) _exit(5);
  free(o0);
  free(o2);
  munmap(src, bytes);
  _exit(0);
}

void test_scatter(void) {
  char msg[1000];
  for (int iter = 0; iter < 120; iter++) {
    int nd = (int)rnd_in(1, 4), es = elem_sizes[rnd_in(0, 4)];
    if (iter >= 100) nd = (int)rnd_in(1, 2); /* a few large ones for the threads */
    int64_t sz[4];
    for (int i = 0; i < nd; i++)
      sz[i] = rnd_in(1, 5);
    int dim = (int)rnd_in(0, nd - 1), n = (int)rnd_in(1, 5);
    if (iter >= 100) sz[dim] = 40000 + rnd_in(0, 999);
    /* Random chunk sizes (zeros included) summing to sz[dim]. */
    int64_t chunks[5], left = sz[dim];
    for (int i = 0; i < n; i++) {
      chunks[i] = i == n - 1 ? left : (rnd() % 3 == 0 ? 0 : rnd_in(0, left));
      left -= chunks[i];
    }
    layout_t sl = random_layout(nd, sz, 1, 2);
    char *sbuf = xmalloc((size_t)sl.span * es);
    fill_random(sbuf, (size_t)sl.span * es);
    fdp_tensor_t src = on(&sl, sbuf, es), outs[5];
    layout_t ol[5];
    char *obuf[5], *rbuf[5];
    int64_t start = 0;
    for (int i = 0; i < n; i++) {
      int64_t csz[4];
      memcpy(csz, sz, sizeof csz);
      csz[dim] = chunks[i];
      ol[i] = random_layout(nd, csz, 0, 2);
      size_t bytes = (size_t)ol[i].span * es;
      obuf[i] = xmalloc(bytes);
      rbuf[i] = xmalloc(bytes);
      fill_random(obuf[i], bytes);
      memcpy(rbuf[i], obuf[i], bytes);
      outs[i] = on(&ol[i], obuf[i], es);
      fdp_tensor_t view = src, r = on(&ol[i], rbuf[i], es);
      view.data += start * src.strides[dim] * es; /* the chunk, narrowed by hand */
      view.sizes[dim] = chunks[i];
      ref_copy(&r, &view);
      start += chunks[i];
    }
    fdp_result_t r = fdp_op_scatter(&src, dim, chunks, outs, n, NULL);
    int ok = r == FDP_OK;
    for (int i = 0; i < n; i++)
      ok = ok && memcmp(obuf[i], rbuf[i], (size_t)ol[i].span * es) == 0;
    snprintf(msg, sizeof msg, "iter %d: nd %d dim %d n %d es %d: %s %s", iter, nd, dim, n, es, fdp_result_name(r),
             r ? fdp_last_error() : "");
    CHECKF(ok, "%s", msg);
    /* Wrong totals: one element short, one too many; a negative chunk; a bad dim. */
    int64_t bad[5];
    memcpy(bad, chunks, sizeof bad);
    bad[n - 1] += 1;
    EXPECT(fdp_op_scatter(&src, dim, bad, outs, n, NULL), FDP_INVALID);
    if (sz[dim] > 0) {
      memcpy(bad, chunks, sizeof bad);
      int k = 0;
      while (bad[k] == 0)
        k++;
      bad[k] -= 1;
      EXPECT(fdp_op_scatter(&src, dim, bad, outs, n, NULL), FDP_INVALID);
      /* the whole message, with the dimension where upstream puts it */
      char want[300];
      snprintf(want, sizeof want,
               "Total size for output tensors along scatter dim %d does not match the source tensor size at dim %d. "
               "Expected %lld, but got total size %lld.",
               dim, dim, (long long)sz[dim], (long long)(sz[dim] - 1));
      CHECKF(strcmp(fdp_last_error(), want) == 0, "got \"%s\", want \"%s\"", fdp_last_error(), want);
    }
    EXPECT(fdp_op_scatter(&src, nd, chunks, outs, n, NULL), FDP_INVALID);
    EXPECT(fdp_op_scatter(&src, -1, chunks, outs, n, NULL), FDP_INVALID);
    for (int i = 0; i < n; i++) {
      free(obuf[i]);
      free(rbuf[i]);
    }
    free(sbuf);
  }
  CHECKF(in_child(scatter_readonly_child), "an output that is the source's own chunk was written (or the call failed)");
  {
    float a[12] = {0}, o[12];
    int64_t s43[] = {4, 3}, s23[] = {2, 3}, s22[] = {2, 2}, neg[] = {-1, 5}, ok2[] = {2, 2};
    fdp_tensor_t src = make_contig(a, FDP_DTYPE_F32, 4, 2, s43);
    fdp_tensor_t outs[2] = {make_contig(o, FDP_DTYPE_F32, 4, 2, s23), make_contig(o + 6, FDP_DTYPE_F32, 4, 2, s22)};
    EXPECT(fdp_op_scatter(&src, 0, ok2, outs, 2, NULL), FDP_INVALID); /* output 1 has the wrong shape */
    EXPECT(fdp_op_scatter(&src, 0, neg, outs, 2, NULL), FDP_INVALID);
    EXPECT(fdp_op_scatter(&src, 0, ok2, outs, 0, NULL), FDP_INVALID);
    EXPECT(fdp_op_scatter(&src, 0, NULL, outs, 2, NULL), FDP_INVALID);
    fdp_tensor_t scalar = make(a, FDP_DTYPE_F32, 4, 0, NULL, NULL);
    EXPECT(fdp_op_scatter(&scalar, 0, ok2, outs, 2, NULL), FDP_INVALID);
  }
}

void test_gather(void) {
  char msg[1000];
  for (int iter = 0; iter < 150; iter++) {
    int nd = iter >= 140 ? 1 + iter % 2 : (int)rnd_in(1, 4), es = elem_sizes[rnd_in(0, 4)];
    int dim = iter % nd, n = (int)rnd_in(1, 4);
    int64_t sz[4];
    for (int i = 0; i < nd; i++)
      sz[i] = rnd_in(1, 4);
    int64_t parts[4], total = 0;
    for (int i = 0; i < n; i++) {
      parts[i] = rnd() % 4 == 0 ? 0 : rnd_in(1, 4);
      if (iter >= 140) parts[i] = 30000 + rnd_in(0, 99); /* large ones for the threads */
      total += parts[i];
    }
    sz[dim] = total;
    layout_t ol = random_layout(nd, sz, 0, 2), il[4];
    char *obuf = xmalloc((size_t)ol.span * es), *rbuf = xmalloc((size_t)ol.span * es), *ibuf[4];
    fill_random(obuf, (size_t)ol.span * es);
    memcpy(rbuf, obuf, (size_t)ol.span * es);
    fdp_tensor_t out = on(&ol, obuf, es), ref = on(&ol, rbuf, es), ins[4];
    int64_t start = 0;
    for (int i = 0; i < n; i++) {
      int64_t isz[4];
      memcpy(isz, sz, sizeof isz);
      isz[dim] = parts[i];
      il[i] = random_layout(nd, isz, 1, 2);
      ibuf[i] = xmalloc((size_t)il[i].span * es);
      fill_random(ibuf[i], (size_t)il[i].span * es);
      ins[i] = on(&il[i], ibuf[i], es);
      fdp_tensor_t slice = ref;
      slice.data += start * ref.strides[dim] * es;
      slice.sizes[dim] = parts[i];
      ref_copy(&slice, &ins[i]);
      start += parts[i];
    }
    fdp_result_t r = fdp_op_gather(ins, n, dim, &out, NULL);
    snprintf(msg, sizeof msg, "iter %d: nd %d dim %d n %d es %d: %s %s", iter, nd, dim, n, es, fdp_result_name(r),
             r ? fdp_last_error() : "");
    CHECKF(r == FDP_OK && memcmp(obuf, rbuf, (size_t)ol.span * es) == 0, "%s", msg);
    /* The inputs must fill the output exactly along dim and match it elsewhere. */
    fdp_tensor_t short_out = out;
    short_out.sizes[dim] += 1;
    EXPECT(fdp_op_gather(ins, n, dim, &short_out, NULL), FDP_INVALID);
    if (total > 0) {
      short_out.sizes[dim] -= 2;
      EXPECT(fdp_op_gather(ins, n, dim, &short_out, NULL), FDP_INVALID);
    }
    EXPECT(fdp_op_gather(ins, n, nd, &out, NULL), FDP_INVALID);
    EXPECT(fdp_op_gather(ins, n, -1, &out, NULL), FDP_INVALID);
    if (nd > 1 && parts[0] > 0) {
      fdp_tensor_t wrong[4];
      memcpy(wrong, ins, sizeof wrong);
      int other = (dim + 1) % nd;
      wrong[0].sizes[other] = sz[other] > 1 ? sz[other] - 1 : 2;
      EXPECT(fdp_op_gather(wrong, n, dim, &out, NULL), FDP_INVALID);
      wrong[0] = ins[0];
      wrong[0].ndim = nd - 1;
      EXPECT(fdp_op_gather(wrong, n, dim < nd - 1 ? dim : 0, &out, NULL), FDP_INVALID);
    }
    for (int i = 0; i < n; i++)
      free(ibuf[i]);
    free(obuf);
    free(rbuf);
  }
  {
    float a[4];
    int64_t s4[] = {4};
    fdp_tensor_t out = make_contig(a, FDP_DTYPE_F32, 4, 1, s4);
    EXPECT(fdp_op_gather(NULL, 1, 0, &out, NULL), FDP_INVALID);
    EXPECT(fdp_op_gather(&out, 0, 0, &out, NULL), FDP_INVALID);
  }
}
