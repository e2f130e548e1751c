/* SPDX-License-Identifier: MIT */
/* Descriptor arithmetic: element counts, density, narrowing, dtype names. No memory is touched here. */
#include "backend.h"

#include <stdlib.h>

static const char *const dtype_names[] = {
#define FDP_X(name, str, size) str,
    FDP_DTYPE_MAP(FDP_X)
#undef FDP_X
};

const char *fdp_dtype_name(int dtype) {
  return (unsigned)dtype < FDP_DTYPE_COUNT ? dtype_names[dtype] : "unknown";
}

int64_t fdp_tensor_numel(const fdp_tensor_t *t) {
  int64_t n = 1;
  for (int i = 0; i < t->ndim; i++)
    n *= t->sizes[i];
  return n;
}

int fdp_tensor_is_contiguous(const fdp_tensor_t *t) {
  if (fdp_tensor_numel(t) == 0) return 1; /* as PyTorch: strides of an empty tensor do not matter */
  int64_t expect = 1;
  for (int i = t->ndim - 1; i >= 0; i--) {
    if (t->sizes[i] == 1) continue;
    if (t->strides[i] != expect) return 0;
    expect *= t->sizes[i];
  }
  return 1;
}

static int by_stride(const void *a, const void *b) {
  const int64_t *x = a, *y = b;
  return (x[0] > y[0]) - (x[0] < y[0]);
}

int fdp_tensor_is_dense(const fdp_tensor_t *t) {
  int64_t dims[FDP_MAX_DIMS][2];
  int n = 0;
  for (int i = 0; i < t->ndim; i++) {
    if (t->sizes[i] == 0) return 1;
    if (t->sizes[i] == 1) continue;
    dims[n][0] = t->strides[i];
    dims[n][1] = t->sizes[i];
    n++;
  }
  qsort(dims, (size_t)n, sizeof dims[0], by_stride);
  int64_t expect = 1;
  for (int i = 0; i < n; i++) {
    if (dims[i][0] != expect) return 0;
    expect *= dims[i][1];
  }
  return 1;
}

void fdp_tensor_narrow(const fdp_tensor_t *t, int dim, int64_t start, int64_t length, fdp_tensor_t *out) {
  *out = *t;
  out->data = t->data + start * t->strides[dim] * t->elem_size;
  out->sizes[dim] = length;
}

/* ---- overlap: which elements of two descriptors (or of one) share memory ---- */

/* Byte interval [lo, hi) that holds every element of a non-empty tensor (strides are non-negative). */
static void byte_span(const fdp_tensor_t *t, uintptr_t *lo, uintptr_t *hi) {
  int64_t last = 0;
  for (int i = 0; i < t->ndim; i++)
    last += (t->sizes[i] - 1) * t->strides[i];
  *lo = (uintptr_t)t->data;
  *hi = *lo + (uintptr_t)((last + 1) * t->elem_size);
}

/* One dimension of an element grid: stride and the larger of the two sizes compared along it. */
typedef struct {
  int64_t stride, size_a, size_b, below; /* below: largest |offset| reachable by the dimensions under it */
} grid_dim;

static int by_grid_stride(const void *a, const void *b) {
  const grid_dim *x = a, *y = b;
  return (x->stride > y->stride) - (x->stride < y->stride);
}

/* Whether d = sum of delta_k * stride_k for some delta_k in [-(size_b - 1), size_a - 1], dims [0, k] only.
 * The dims are nested (each stride exceeds what the dims under it reach), so at most two deltas fit per
 * level: the search visits at most 2^ndim nodes. */
static int grid_reaches(const grid_dim *dims, int k, int64_t d) {
  if (k < 0) return d == 0;
  const grid_dim *g = &dims[k];
  int64_t s = g->stride, r = g->below;
  /* delta in [ceil((d - r) / s), floor((d + r) / s)] */
  int64_t num_lo = d - r, num_hi = d + r;
  int64_t lo = num_lo >= 0 ? (num_lo + s - 1) / s : -((-num_lo) / s);
  int64_t hi = num_hi >= 0 ? num_hi / s : -((-num_hi + s - 1) / s);
  if (lo < -(g->size_b - 1)) lo = -(g->size_b - 1);
  if (hi > g->size_a - 1) hi = g->size_a - 1;
  for (int64_t delta = lo; delta <= hi; delta++)
    if (grid_reaches(dims, k - 1, d - delta * s)) return 1;
  return 0;
}

/* Sorts the dims of size > 1 by stride and fills `below`; 0 when they are not nested (a dim's stride does not
 * exceed what the dims under it reach), which the exact search needs. */
static int nest(grid_dim *dims, int n) {
  qsort(dims, (size_t)n, sizeof dims[0], by_grid_stride);
  int64_t reach = 0;
  for (int i = 0; i < n; i++) {
    if (dims[i].stride <= reach) return 0;
    dims[i].below = reach;
    int64_t size = dims[i].size_a > dims[i].size_b ? dims[i].size_a : dims[i].size_b;
    reach += (size - 1) * dims[i].stride;
  }
  return 1;
}

int fdp_tensor_internal_overlap(const fdp_tensor_t *t) {
  if (fdp_tensor_numel(t) <= 1) return 0;
  grid_dim dims[FDP_MAX_DIMS];
  int n = 0;
  for (int i = 0; i < t->ndim; i++) {
    if (t->sizes[i] == 1) continue;
    if (t->strides[i] == 0) return 1; /* expanded: every index along it is the same element */
    dims[n++] = (grid_dim){t->strides[i], t->sizes[i], t->sizes[i], 0};
  }
  if (nest(dims, n)) return 0;
  for (int i = 0; i + 1 < n; i++)
    if (dims[i].stride == dims[i + 1].stride) return 1; /* (1, 0) and (0, 1) are one element */
  return -1;
}

/* The dims of two views of one ndim as one grid (dims of size 1 on both sides dropped; a size-1 dim takes the
 * other view's stride). 0 when a stride differs or is 0: then no cheap exact test exists. */
static int shared_grid(const fdp_tensor_t *a, const fdp_tensor_t *b, grid_dim *dims, int *n) {
  *n = 0;
  for (int i = 0; i < a->ndim; i++) {
    if (a->sizes[i] == 1 && b->sizes[i] == 1) continue;
    int64_t sa = a->sizes[i] == 1 ? b->strides[i] : a->strides[i];
    int64_t sb = b->sizes[i] == 1 ? a->strides[i] : b->strides[i];
    if (sa != sb || sa == 0) return 0;
    dims[(*n)++] = (grid_dim){sa, a->sizes[i], b->sizes[i], 0};
  }
  return 1;
}

int fdp_tensor_overlap(const fdp_tensor_t *a, const fdp_tensor_t *b) {
  if (a->device != b->device || fdp_tensor_numel(a) == 0 || fdp_tensor_numel(b) == 0) return 0;
  uintptr_t alo, ahi, blo, bhi;
  byte_span(a, &alo, &ahi);
  byte_span(b, &blo, &bhi);
  if (ahi <= blo || bhi <= alo) return 0;
  if (fdp_tensor_is_dense(a) && fdp_tensor_is_dense(b)) return 1; /* gap-free blocks that intersect */
  /* Interleaved views of one layout (columns of a matrix, a tensor narrowed along an inner dim): equal strides
   * and element-aligned offsets let an exact search decide. Other layouts cannot be told cheaply. */
  if (a->ndim != b->ndim || a->elem_size != b->elem_size) return -1;
  int64_t off = blo >= alo ? (int64_t)(blo - alo) : -(int64_t)(alo - blo);
  if (off % a->elem_size) return -1;
  grid_dim dims[FDP_MAX_DIMS];
  int n = 0;
  if (!shared_grid(a, b, dims, &n) || !nest(dims, n)) return -1;
  /* b's element j sits at off + j.s; a's element i at i.s: they meet when off = (i - j).s. */
  return grid_reaches(dims, n - 1, off / a->elem_size);
}
