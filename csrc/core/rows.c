/* SPDX-License-Identifier: MIT */
/* A host bucket's sum across replicas, prepared once: the kept replicas' gradient buckets sum the same members,
 * shaped the same way, every step, so the members' shapes, dtype and offsets in the flat output are checked when the
 * plan is made, and a step hands over only each gradient's data pointer (after the caller has found the gradient
 * shaped as the plan's member, fdp_rows_member_fits). The sums are the host backend's, one per member, straight
 * from the gradients into the output: nothing is packed first. */
#include "backend.h"

#include <stdlib.h>
#include <string.h>

struct fdp_rows_plan {
  int k, nrep;
  int64_t total;         /* the members' elements, back to back in the output */
  fdp_tensor_t *members; /* k contiguous descriptors (data NULL): member j's shape, dtype and element size */
  int64_t *offsets;      /* k element offsets into the output */
  int64_t *bytes;        /* k byte counts */
};

void fdp_rows_plan_free(fdp_rows_plan_t *plan) {
  if (!plan) return;
  free(plan->members);
  free(plan->offsets);
  free(plan->bytes);
  free(plan);
}

/* The descriptor `t` made contiguous in place (its sizes kept, its strides row-major), data cleared. */
static void make_contiguous(fdp_tensor_t *t) {
  t->data = NULL;
  for (int d = t->ndim - 1; d >= 0; d--)
    t->strides[d] = d == t->ndim - 1 ? 1 : t->strides[d + 1] * t->sizes[d + 1];
}

/* Whether member `t` can be planned: host memory of a summable dtype, the first member's dtype, a sane shape. */
static int member_plannable(const fdp_tensor_t *t, const fdp_tensor_t *first) {
  if (t->device != FDP_HOST || t->dtype < 0 || t->dtype == FDP_DTYPE_OTHER || t->dtype >= FDP_DTYPE_COUNT ||
      t->dtype != first->dtype || t->elem_size != first->elem_size || t->elem_size <= 0 || t->ndim < 0 ||
      t->ndim > FDP_MAX_DIMS)
    return 0;
  for (int d = 0; d < t->ndim; d++)
    if (t->sizes[d] < 0) return 0;
  return 1;
}

fdp_result_t fdp_rows_prepare(const fdp_tensor_t *members, int k, int nrep, fdp_rows_plan_t **out) {
  if (!out || !members || k <= 0 || nrep < 1 || nrep > FDP_MAX_DEVICES || (int64_t)k * nrep > INT32_MAX)
    return fdp__fail(FDP_INVALID, "rows: bad plan (k=%d members, %d replicas)", k, nrep);
  *out = NULL;
  fdp_rows_plan_t *p = calloc(1, sizeof *p);
  if (p) {
    p->members = malloc((size_t)k * sizeof *p->members);
    p->offsets = malloc((size_t)k * sizeof *p->offsets);
    p->bytes = malloc((size_t)k * sizeof *p->bytes);
  }
  if (!p || !p->members || !p->offsets || !p->bytes) {
    fdp_rows_plan_free(p);
    return fdp__fail(FDP_NOMEM, "rows: cannot allocate a plan of %d members", k);
  }
  p->k = k;
  p->nrep = nrep;
  for (int j = 0; j < k; j++) {
    if (!member_plannable(&members[j], &members[0])) {
      fdp_rows_plan_free(p);
      return fdp__fail(FDP_INVALID, "rows: member %d is not a host tensor of the bucket's summable dtype", j);
    }
    p->members[j] = members[j];
    make_contiguous(&p->members[j]);
    int64_t numel = fdp_tensor_numel(&p->members[j]);
    p->offsets[j] = p->total;
    p->bytes[j] = numel * members[j].elem_size;
    p->total += numel;
  }
  *out = p;
  return FDP_OK;
}

int fdp_rows_member_fits(const fdp_rows_plan_t *plan, int j, const fdp_tensor_t *t) {
  if (!plan || !t || j < 0 || j >= plan->k) return 0;
  const fdp_tensor_t *m = &plan->members[j];
  if (t->device != FDP_HOST || t->dtype != m->dtype || t->elem_size != m->elem_size || t->ndim != m->ndim) return 0;
  for (int d = 0; d < m->ndim; d++) /* a size-1 dimension's stride says nothing: contiguous whatever it is */
    if (t->sizes[d] != m->sizes[d] || (m->sizes[d] != 1 && t->strides[d] != m->strides[d])) return 0;
  return 1;
}

/* Whether the byte ranges [a, a + na) and [b, b + nb) share a byte. */
static int ranges_overlap(const char *a, int64_t na, const char *b, int64_t nb) {
  return na > 0 && nb > 0 && a < b + nb && b < a + na;
}

/* The output: one dense 1-D host buffer of the plan's dtype, long enough. */
static fdp_result_t check_rows_output(const fdp_rows_plan_t *plan, const fdp_tensor_t *out) {
  const fdp_tensor_t *m = &plan->members[0];
  if (!out || out->device != FDP_HOST || out->ndim != 1 || out->dtype != m->dtype || out->elem_size != m->elem_size ||
      (out->sizes[0] > 1 && out->strides[0] != 1) || out->sizes[0] < plan->total || (!out->data && plan->total))
    return fdp__fail(FDP_INVALID, "rows: the output is not a dense 1-D host tensor of the bucket's dtype with %lld "
                                  "elements",
                     (long long)plan->total);
  return FDP_OK;
}

/* Every input present, aligned to its elements, and clear of the output (a sum would overwrite what it reads). */
static fdp_result_t check_rows_inputs(const fdp_rows_plan_t *plan, char *const *inputs, const fdp_tensor_t *out) {
  int64_t out_bytes = plan->total * out->elem_size;
  for (int i = 0; i < plan->k * plan->nrep; i++) {
    int64_t bytes = plan->bytes[i % plan->k];
    if (bytes == 0) continue;
    if (!inputs[i] || (uintptr_t)inputs[i] % (uintptr_t)out->elem_size != 0)
      return fdp__fail(FDP_INVALID, "rows: input %d is missing or not aligned to its %d-byte elements", i,
                       out->elem_size);
    if (ranges_overlap(inputs[i], bytes, out->data, out_bytes))
      return fdp__fail(FDP_INVALID, "rows: input %d overlaps the output", i);
  }
  return FDP_OK;
}

fdp_result_t fdp_rows_run(const fdp_rows_plan_t *plan, char *const *inputs, const fdp_tensor_t *out) {
  if (!plan || !inputs) return fdp__fail(FDP_INVALID, "rows: no plan or no inputs");
  FDP_CHECK(check_rows_output(plan, out));
  FDP_CHECK(check_rows_inputs(plan, inputs, out));
  fdp_tensor_t in[FDP_MAX_DEVICES];
  for (int j = 0; j < plan->k; j++) {
    if (plan->bytes[j] == 0) continue;
    for (int q = 0; q < plan->nrep; q++) {
      in[q] = plan->members[j];
      in[q].data = inputs[q * plan->k + j];
    }
    fdp_tensor_t slice = plan->members[j]; /* member j's shape, contiguous, at its place in out */
    slice.data = out->data + plan->offsets[j] * out->elem_size;
    FDP_CHECK(fdp__backend_host.reduce(in, plan->nrep, &slice, NULL));
  }
  return FDP_OK;
}

int64_t fdp_rows_numel(const fdp_rows_plan_t *plan) {
  return plan ? plan->total : 0;
}
