/* SPDX-License-Identifier: MIT */
/* test_core's suite on the cuda backend's layout math (csrc/backend/cuda/layout.c, CUDA-free): every way it
 * simplifies or reshapes a copy moves the same bytes as an element-by-element reference. */
#include "core_harness.h"

#include "backend/cuda/layout.h" /* the cuda backend's layout math (CUDA-free) */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the cuda backend's layout math (csrc/backend/cuda/layout.c) against element-by-element references ---- */

/* What a copy does, byte by byte: for each destination byte (offset from the destination's address) the offset
 * of the source byte it receives (from the source's address); -1 where nothing is written. */
typedef struct bytemap {
  int64_t *src_of;
  int64_t span;
  int64_t stray; /* writes outside the span, or to a byte already written */
} bytemap_t;

static void map_init(bytemap_t *m, int64_t span) {
  m->span = span;
  m->stray = 0;
  m->src_of = xmalloc((size_t)span * sizeof *m->src_of);
  for (int64_t i = 0; i < span; i++)
    m->src_of[i] = -1;
}

static void map_put(bytemap_t *m, int64_t doff, int64_t soff) {
  if (doff < 0 || doff >= m->span || m->src_of[doff] != -1)
    m->stray++;
  else
    m->src_of[doff] = soff;
}

/* The reference: every element of the descriptors, by its multi-index. */
static void map_of_copy(const fdp_copy_t *c, bytemap_t *m) {
  int nd = c->dst.ndim, es = c->dst.elem_size;
  int64_t idx[FDP_MAX_DIMS] = {0}, n = fdp_tensor_numel(&c->dst);
  for (int64_t e = 0; e < n; e++) {
    int64_t so = 0, dof = 0;
    for (int d = 0; d < nd; d++) {
      so += idx[d] * c->src.strides[d];
      dof += idx[d] * c->dst.strides[d];
    }
    for (int b = 0; b < es; b++)
      map_put(m, dof * es + b, so * es + b);
    for (int d = nd - 1; d >= 0 && ++idx[d] == c->dst.sizes[d]; d--)
      idx[d] = 0;
  }
}

/* The same through a pair: its own index space and element size; its addresses relative to the copy's. */
static void map_of_pair(const fdp_pair_t *p, uint64_t src0, uint64_t dst0, bytemap_t *m) {
  int64_t idx[FDP_COPY_MAX_DIMS] = {0}, sbase = (int64_t)(p->src - src0), dbase = (int64_t)(p->dst - dst0);
  for (int64_t e = 0; e < p->numel; e++) {
    int64_t so = sbase, dof = dbase;
    for (int d = 0; d < p->ndim; d++) {
      so += idx[d] * p->ss[d] * p->es;
      dof += idx[d] * p->ds[d] * p->es;
    }
    for (int64_t b = 0; b < p->es; b++)
      map_put(m, dof + b, so + b);
    for (int d = p->ndim - 1; d >= 0 && ++idx[d] == p->sizes[d]; d--)
      idx[d] = 0;
  }
}

/* The same through the copy engines' rows (fdp__pair_rows and fdp__pair_outer_next), as copy.c issues them. */
static void map_of_rows(const fdp_pair_t *p, size_t width, size_t height, size_t spitch, size_t dpitch, int64_t outer,
                        bytemap_t *m) {
  int64_t idx[FDP_COPY_MAX_DIMS] = {0};
  for (int64_t it = 0; it < outer; it++) {
    int64_t so, dof;
    fdp__pair_outer_next(p, idx, &so, &dof);
    for (size_t h = 0; h < height; h++)
      for (size_t w = 0; w < width; w++)
        map_put(m, dof + (int64_t)(h * dpitch + w), so + (int64_t)(h * spitch + w));
  }
}

static int same_map(const bytemap_t *a, const bytemap_t *b) {
  return a->stray == 0 && b->stray == 0 && memcmp(a->src_of, b->src_of, (size_t)a->span * sizeof *a->src_of) == 0;
}

/* A layout with 0..2 elements of padding after each dim (in a random memory order): odd pitches, which
 * multiplicative steps never make, so that widening must look at every stride. */
static layout_t padded_layout(int nd, const int64_t *sizes) {
  layout_t l = contig_layout(nd, sizes);
  int perm[FDP_MAX_DIMS];
  for (int i = 0; i < nd; i++)
    perm[i] = i;
  for (int i = nd - 1; i > 0; i--) {
    int j = (int)rnd_in(0, i), tmp = perm[i];
    perm[i] = perm[j];
    perm[j] = tmp;
  }
  int64_t run = 1, last = 0;
  for (int k = nd - 1; k >= 0; k--) {
    l.strides[perm[k]] = run;
    run = run * sizes[perm[k]] + rnd_in(0, 2);
  }
  for (int i = 0; i < nd; i++)
    if (sizes[i] > 0) last += (sizes[i] - 1) * l.strides[i];
  l.offset = rnd_in(0, 3);
  l.span = l.offset + last + 1;
  return l;
}

/* One random copy: its pair, the pair for the kernel, and (where the layout has them) the rows all move every
 * byte exactly as the descriptors say. Returns 0 and fills msg on a difference. */
static int layout_case(int iter, char *msg, size_t msglen) {
  static const int sizes_es[] = {1, 2, 3, 4, 6, 8, 12, 16};
  int es = sizes_es[rnd_in(0, 7)], nd = (int)rnd_in(0, 5);
  int64_t sz[FDP_MAX_DIMS];
  for (int d = 0; d < nd; d++)
    sz[d] = rnd_in(1, 4) == 4 ? 1 : rnd_in(1, 5);
  if (iter % 50 == 49 && nd > 0) sz[0] = 0; /* an empty copy */
  layout_t sl = random_layout(nd, sz, 1, 2), dl = random_layout(nd, sz, 0, 2);
  if (rnd() % 3 == 0) dl = rnd() % 2 ? contig_layout(nd, sz) : padded_layout(nd, sz);
  if (rnd() % 3 == 0) sl = rnd() % 2 ? contig_layout(nd, sz) : padded_layout(nd, sz);
  /* Addresses (never read): aligned to 16, or off by a few bytes, so that widening and byte splitting both run. */
  uint64_t src0 = 0x10000 + (uint64_t)(rnd() % 4 == 0 ? rnd_in(1, 15) : 0);
  uint64_t dst0 = 0x90000 + (uint64_t)(rnd() % 4 == 0 ? rnd_in(1, 15) : 0);
  fdp_copy_t c;
  c.src = make((void *)(uintptr_t)(src0 + (uint64_t)(sl.offset * es)), FDP_DTYPE_OTHER, es, nd, sz, sl.strides);
  c.dst = make((void *)(uintptr_t)(dst0 + (uint64_t)(dl.offset * es)), FDP_DTYPE_OTHER, es, nd, sz, dl.strides);
  /* Offsets are from the descriptors' own addresses. */
  uint64_t sdata = (uint64_t)(uintptr_t)c.src.data, ddata = (uint64_t)(uintptr_t)c.dst.data;
  bytemap_t ref, got, kern, rows;
  map_init(&ref, dl.span * es);
  map_of_copy(&c, &ref);
  fdp_pair_t p;
  fdp__pair_build(&c, &p);
  int ok = p.numel == fdp_tensor_numel(&c.dst) && p.ndim >= 1 && p.ndim <= FDP_MAX_DIMS;
  map_init(&got, ref.span);
  if (p.numel > 0) map_of_pair(&p, sdata, ddata, &got);
  ok = ok && same_map(&ref, &got);
  /* The staging layout: flat strides over the pair's sizes, row-major. */
  int64_t fs[FDP_COPY_MAX_DIMS];
  fdp__pair_flat_strides(&p, fs);
  int64_t run = 1;
  for (int d = p.ndim - 1; d >= 0; d--) {
    ok = ok && fs[d] == run;
    run *= p.sizes[d];
  }
  fdp_pair_t k = p;
  fdp__pair_for_kernel(&k);
  map_init(&kern, ref.span);
  if (p.numel > 0) map_of_pair(&k, sdata, ddata, &kern);
  int kes_ok = k.es == 1 || k.es == 2 || k.es == 4 || k.es == 8 || k.es == 16;
  ok = ok && same_map(&ref, &kern) && kes_ok && k.src % (uint64_t)k.es == 0 && k.dst % (uint64_t)k.es == 0 &&
       k.ndim <= FDP_COPY_MAX_DIMS && (1 << fdp__pair_es_index(k.es)) == k.es;
  size_t width = 0, height = 0, spitch = 0, dpitch = 0;
  int64_t outer = 0;
  int has_rows = p.numel > 0 && fdp__pair_rows(&p, &width, &height, &spitch, &dpitch, &outer);
  map_init(&rows, ref.span);
  if (has_rows) {
    map_of_rows(&p, width, height, spitch, dpitch, outer, &rows);
    ok = ok && same_map(&ref, &rows) && spitch >= width && dpitch >= width;
  }
  /* The flat tests say what they claim: one contiguous run on that side. */
  ok = ok && (!fdp__pair_src_flat(&p) || (p.ndim == 1 && p.ss[0] == 1));
  ok = ok && (!fdp__pair_dst_flat(&p) || (p.ndim == 1 && p.ds[0] == 1));
  snprintf(msg, msglen, "iter %d: es %d nd %d, pair ndim %d numel %lld, kernel es %lld ndim %d, rows %d", iter, es, nd,
           p.ndim, (long long)p.numel, (long long)k.es, k.ndim, has_rows);
  free(ref.src_of);
  free(got.src_of);
  free(kern.src_of);
  free(rows.src_of);
  return ok;
}

void test_layout(void) {
  char msg[300];
  int failures = 0, with_rows = 0, widened = 0, split = 0;
  for (int iter = 0; iter < 3000; iter++) {
    if (!layout_case(iter, msg, sizeof msg) && failures++ < 5) CHECKF(0, "%s", msg);
    with_rows += strstr(msg, "rows 1") != NULL;
  }
  CHECKF(failures == 0, "%d random layouts mapped differently from their descriptors", failures);
  /* The random cases reach each path: rows, wider elements and single bytes. */
  for (int iter = 0; iter < 200; iter++) {
    int64_t sz[2] = {rnd_in(2, 6), 4 * rnd_in(1, 4)}, st[2] = {sz[1] + 4 * rnd_in(0, 2), 1};
    fdp_copy_t c;
    c.src = make((void *)(uintptr_t)0x10000, FDP_DTYPE_OTHER, 4, 2, sz, st);
    c.dst = make((void *)(uintptr_t)(0x90000 + (uint64_t)(iter % 2) * 2), FDP_DTYPE_OTHER, 4, 2, sz, st);
    fdp_pair_t p;
    fdp__pair_build(&c, &p);
    fdp__pair_for_kernel(&p);
    widened += p.es > 4;
    split += p.es == 1;
  }
  CHECKF(with_rows > 0 && widened > 0 && split > 0, "paths reached: rows %d, widened %d, bytes %d", with_rows, widened,
         split);
  /* Pitches past CU_DEVICE_ATTRIBUTE_MAX_PITCH have no rows. */
  fdp_pair_t big;
  memset(&big, 0, sizeof big);
  big.ndim = 2;
  big.es = 1;
  big.sizes[0] = 2;
  big.sizes[1] = 8;
  big.ss[0] = (int64_t)FDP_PAIR_MAX_PITCH + 1;
  big.ds[0] = 8;
  big.ss[1] = big.ds[1] = 1;
  big.numel = 16;
  size_t w, h, sp, dp;
  int64_t o;
  CHECK(!fdp__pair_rows(&big, &w, &h, &sp, &dp, &o));
  big.ss[0] = FDP_PAIR_MAX_PITCH;
  CHECK(fdp__pair_rows(&big, &w, &h, &sp, &dp, &o) && sp == (size_t)FDP_PAIR_MAX_PITCH && w == 8 && h == 2 && o == 1);
}
