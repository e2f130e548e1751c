/* SPDX-License-Identifier: MIT */
/* What test_core's suites share: EXPECT's fresh-detail check, a seeded random source (one sequence for the whole
 * run), host tensor descriptors, random strided layouts and the reference copy. */
#include "core_harness.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A failure known to set a recognisable detail, so that each expected failure can be seen to set its own. */
char sentinel[1100];

void prime_error(void) {
  fdp_op_copy(NULL, NULL, -424242, NULL);
  snprintf(sentinel, sizeof sentinel, "%s", fdp_last_error());
}

void expect_result(fdp_result_t got, fdp_result_t want, const char *call, const char *file, int line) {
  const char *err = fdp_last_error();
  int ok = got == want;
  if (want != FDP_OK) ok = ok && err && err[0] && strcmp(err, sentinel) != 0;
  check_at(ok, file, line, call, "got %s, want %s (last error: \"%s\")", fdp_result_name(got), fdp_result_name(want),
           err ? err : "(null)");
}

/* ---- helpers ---- */

const int elem_sizes[5] = {1, 2, 4, 8, 16};

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

uint64_t rnd(void) {
  uint64_t x = rng_state;
  x ^= x << 13;
  x ^= x >> 7;
  x ^= x << 17;
  return rng_state = x;
}

int64_t rnd_in(int64_t lo, int64_t hi) {
  return lo + (int64_t)(rnd() % (uint64_t)(hi - lo + 1));
}

void fill_random(void *p, size_t bytes) {
  unsigned char *c = p;
  for (size_t i = 0; i < bytes; i++)
    c[i] = (unsigned char)(rnd() >> 29);
}

void *xmalloc(size_t bytes) {
  void *p = malloc(bytes ? bytes : 1);
  if (!p) {
    fprintf(stdout, "test: out of memory allocating %zu bytes\n", bytes);
    exit(2);
  }
  return p;
}

fdp_tensor_t make(void *data, int dtype, int es, int nd, const int64_t *sizes, const int64_t *strides) {
  fdp_tensor_t t;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.device = FDP_HOST;
  t.dtype = dtype;
  t.elem_size = es;
  t.ndim = nd;
  for (int i = 0; i < nd; i++) {
    t.sizes[i] = sizes[i];
    t.strides[i] = strides[i];
  }
  return t;
}

fdp_tensor_t make_contig(void *data, int dtype, int es, int nd, const int64_t *sizes) {
  int64_t st[FDP_MAX_DIMS], run = 1;
  for (int i = nd - 1; i >= 0; i--) {
    st[i] = run;
    run *= sizes[i];
  }
  return make(data, dtype, es, nd, sizes, st);
}

fdp_tensor_t make_flat(void *data, int dtype, int es, int64_t numel) {
  return make_contig(data, dtype, es, 1, &numel);
}

int64_t numel_of(int nd, const int64_t *sizes) {
  int64_t n = 1;
  for (int i = 0; i < nd; i++)
    n *= sizes[i];
  return n;
}

/* A random strided layout over `sizes`: dims in a random memory order, each with a step of 1..3 (or, for
 * sources, sometimes 0: an expanded dim), starting `offset` elements into the buffer. */
layout_t random_layout(int nd, const int64_t *sizes, int allow_expand, int max_step) {
  layout_t l;
  int perm[FDP_MAX_DIMS];
  memset(&l, 0, sizeof l);
  l.nd = nd;
  for (int i = 0; i < nd; i++) {
    l.sizes[i] = sizes[i];
    perm[i] = i;
  }
  for (int i = nd - 1; i > 0; i--) {
    int j = (int)rnd_in(0, i), tmp = perm[i];
    perm[i] = perm[j];
    perm[j] = tmp;
  }
  int64_t run = 1;
  for (int k = nd - 1; k >= 0; k--) {
    int d = perm[k];
    int64_t step = rnd_in(1, max_step);
    if (allow_expand && rnd() % 5 == 0) {
      l.strides[d] = 0;
      continue;
    }
    l.strides[d] = run * step;
    run *= (sizes[d] > 0 ? sizes[d] : 1) * step;
  }
  l.offset = rnd_in(0, 3);
  int64_t last = 0;
  for (int i = 0; i < nd; i++)
    if (sizes[i] > 0) last += (sizes[i] - 1) * l.strides[i];
  l.span = l.offset + last + 1;
  return l;
}

layout_t contig_layout(int nd, const int64_t *sizes) {
  layout_t l;
  memset(&l, 0, sizeof l);
  l.nd = nd;
  int64_t run = 1;
  for (int i = nd - 1; i >= 0; i--) {
    l.sizes[i] = sizes[i];
    l.strides[i] = run;
    run *= sizes[i];
  }
  l.span = run > 0 ? run : 1;
  return l;
}

fdp_tensor_t on(const layout_t *l, void *buf, int es) {
  return make((char *)buf + l->offset * es, FDP_DTYPE_OTHER, es, l->nd, l->sizes, l->strides);
}

/* The reference copy: one element at a time over the index space, row-major. */
void ref_copy(const fdp_tensor_t *dst, const fdp_tensor_t *src) {
  int nd = src->ndim, es = src->elem_size;
  int64_t n = numel_of(nd, src->sizes), idx[FDP_MAX_DIMS] = {0};
  for (int64_t k = 0; k < n; k++) {
    int64_t d = 0, s = 0;
    for (int i = 0; i < nd; i++) {
      d += idx[i] * dst->strides[i];
      s += idx[i] * src->strides[i];
    }
    memcpy(dst->data + d * es, src->data + s * es, (size_t)es);
    for (int i = nd - 1; i >= 0; i--) {
      if (++idx[i] < src->sizes[i]) break;
      idx[i] = 0;
    }
  }
}
