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
