/* SPDX-License-Identifier: MIT */
/* The cuda backend's layout math (layout.h): building, merging and reshaping the index space of one strided
 * copy. No CUDA calls and no memory reads, only arithmetic on sizes, strides and addresses. */
#include "backend/cuda/layout.h"

#include <string.h>

void fdp__pair_merge(fdp_pair_t *p) {
  int n = 0;
  for (int d = 0; d < p->ndim; d++) {
    if (p->sizes[d] == 1) continue;
    if (n > 0 && p->ss[n - 1] == p->ss[d] * p->sizes[d] && p->ds[n - 1] == p->ds[d] * p->sizes[d]) {
      p->sizes[n - 1] *= p->sizes[d];
      p->ss[n - 1] = p->ss[d];
      p->ds[n - 1] = p->ds[d];
      continue;
    }
    p->sizes[n] = p->sizes[d];
    p->ss[n] = p->ss[d];
    p->ds[n] = p->ds[d];
    n++;
  }
  if (n == 0) { /* a single element */
    p->sizes[0] = 1;
    p->ss[0] = p->ds[0] = 1;
    n = 1;
  }
  p->ndim = n;
}

void fdp__pair_build(const fdp_copy_t *c, fdp_pair_t *p) {
  memset(p, 0, sizeof *p);
  p->es = c->dst.elem_size;
  p->src = (uint64_t)(uintptr_t)c->src.data;
  p->dst = (uint64_t)(uintptr_t)c->dst.data;
  p->numel = 1;
  for (int d = 0; d < c->dst.ndim; d++) {
    p->numel *= c->dst.sizes[d];
    if (c->dst.sizes[d] == 1) continue;
    int i = p->ndim++;
    while (i > 0 && (p->ds[i - 1] < c->dst.strides[d] ||
                     (p->ds[i - 1] == c->dst.strides[d] && p->ss[i - 1] < c->src.strides[d]))) {
      p->sizes[i] = p->sizes[i - 1];
      p->ss[i] = p->ss[i - 1];
      p->ds[i] = p->ds[i - 1];
      i--;
    }
    p->sizes[i] = c->dst.sizes[d];
    p->ss[i] = c->src.strides[d];
    p->ds[i] = c->dst.strides[d];
  }
  fdp__pair_merge(p);
}

int fdp__pair_inner_contiguous(const fdp_pair_t *p) {
  return p->ss[p->ndim - 1] == 1 && p->ds[p->ndim - 1] == 1;
}

int fdp__pair_src_flat(const fdp_pair_t *p) {
  return p->ndim == 1 && p->ss[0] == 1;
}

int fdp__pair_dst_flat(const fdp_pair_t *p) {
  return p->ndim == 1 && p->ds[0] == 1;
}

int fdp__pair_rows(const fdp_pair_t *p, size_t *width, size_t *height, size_t *spitch, size_t *dpitch, int64_t *outer) {
  if (p->ndim < 2 || !fdp__pair_inner_contiguous(p)) return 0;
  int64_t w = p->sizes[p->ndim - 1] * p->es;
  int64_t sp = p->ss[p->ndim - 2] * p->es, dp = p->ds[p->ndim - 2] * p->es;
  if (sp < w || dp < w || sp > FDP_PAIR_MAX_PITCH || dp > FDP_PAIR_MAX_PITCH) return 0;
  int64_t o = 1;
  for (int d = 0; d < p->ndim - 2; d++)
    o *= p->sizes[d];
  *width = (size_t)w;
  *height = (size_t)p->sizes[p->ndim - 2];
  *spitch = (size_t)sp;
  *dpitch = (size_t)dp;
  *outer = o;
  return 1;
}

void fdp__pair_outer_next(const fdp_pair_t *p, int64_t *idx, int64_t *soff, int64_t *doff) {
  int nouter = p->ndim - 2;
  *soff = *doff = 0;
  for (int d = 0; d < nouter; d++) {
    *soff += idx[d] * p->ss[d] * p->es;
    *doff += idx[d] * p->ds[d] * p->es;
  }
  for (int d = nouter - 1; d >= 0; d--) {
    if (++idx[d] < p->sizes[d]) break;
    idx[d] = 0;
  }
}

/* 1 when elements of e bytes (a multiple of es) can replace the current ones: the inner run splits into whole
 * wide elements, every outer stride steps over whole ones, and both addresses are aligned to e. */
static int can_widen(const fdp_pair_t *p, int64_t e) {
  int last = p->ndim - 1;
  int64_t k = e / p->es;
  if (e % p->es != 0 || p->sizes[last] % k != 0 || p->src % (uint64_t)e != 0 || p->dst % (uint64_t)e != 0) return 0;
  for (int d = 0; d < last; d++)
    if (p->ss[d] % k != 0 || p->ds[d] % k != 0) return 0;
  return 1;
}

/* Wider elements where the rows allow: the widest of 16, 8, 4, 2 bytes that fits. */
static void widen(fdp_pair_t *p) {
  if (!fdp__pair_inner_contiguous(p)) return;
  int last = p->ndim - 1;
  for (int64_t e = 16; e > p->es; e /= 2) {
    if (!can_widen(p, e)) continue;
    int64_t k = e / p->es;
    p->sizes[last] /= k;
    for (int d = 0; d < last; d++) {
      p->ss[d] /= k;
      p->ds[d] /= k;
    }
    p->numel /= k;
    p->es = e;
    return;
  }
}

/* Single bytes: one more, innermost dim over the bytes of an element. */
static void split_bytes(fdp_pair_t *p) {
  for (int d = 0; d < p->ndim; d++) {
    p->ss[d] *= p->es;
    p->ds[d] *= p->es;
  }
  p->sizes[p->ndim] = p->es;
  p->ss[p->ndim] = p->ds[p->ndim] = 1;
  p->ndim++;
  p->numel *= p->es;
  p->es = 1;
  fdp__pair_merge(p);
}

void fdp__pair_for_kernel(fdp_pair_t *p) {
  widen(p);
  int es_ok = p->es == 1 || p->es == 2 || p->es == 4 || p->es == 8 || p->es == 16;
  if (!es_ok || p->src % (uint64_t)p->es != 0 || p->dst % (uint64_t)p->es != 0) split_bytes(p);
}

int fdp__pair_es_index(int64_t es) {
  return es == 1 ? 0 : es == 2 ? 1 : es == 4 ? 2 : es == 8 ? 3 : 4;
}

void fdp__pair_flat_strides(const fdp_pair_t *p, int64_t *strides) {
  int64_t s = 1;
  for (int d = p->ndim - 1; d >= 0; d--) {
    strides[d] = s;
    s *= p->sizes[d];
  }
}
