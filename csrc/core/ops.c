/* SPDX-License-Identifier: MIT */
/* The one engine behind every entry point: validates descriptors once, asks the backends in preference order
 * which one runs the operation (NOTE [routing] in backend.h) and hands the work over. */
#include "backend.h"

#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const fdp_backend_t *const backends[FDP_BACKEND_COUNT] = {
    [FDP_BACKEND_HOST] = &fdp__backend_host,
    [FDP_BACKEND_CUDA] = &fdp__backend_cuda,
    [FDP_BACKEND_NCCL] = &fdp__backend_nccl,
};

static const char *const backend_names[FDP_BACKEND_COUNT] = {"host", "cuda", "nccl"};

const char *fdp_backend_name(fdp_backend_id_t id) {
  return (unsigned)id < FDP_BACKEND_COUNT ? backend_names[id] : "unknown";
}

int fdp_backend_compiled(fdp_backend_id_t id) {
  return (unsigned)id < FDP_BACKEND_COUNT && backends[id];
}

const fdp_backend_t *fdp__backend(fdp_backend_id_t id) {
  return fdp_backend_compiled(id) ? backends[id] : NULL;
}

int fdp_backend_usable(fdp_backend_id_t id, const char **why) {
  const char *dummy;
  if (!why) why = &dummy;
  *why = "";
  if (!fdp_backend_compiled(id)) {
    *why = "not compiled into this build of fastdp (every build has all backends: reinstall fastdp)";
    return 0;
  }
  return backends[id]->usable ? backends[id]->usable(why) : 1;
}

void *fdp__stream_for(const fdp_streams_t *streams, int device) {
  if (!streams) return NULL;
  for (int i = 0; i < streams->n && i < FDP_MAX_DEVICES; i++)
    if (streams->device[i] == device) return streams->stream[i];
  return NULL;
}

/* Backends shut down in reverse order of the table, so that each one's state goes before the state it was built
 * on: NCCL communicators are destroyed while the primary contexts they live in are still retained (the cuda
 * backend's shutdown releases them), and ncclCommDestroy never runs against a context already torn down. */
void fdp_shutdown(void) {
  _Static_assert(FDP_BACKEND_NCCL > FDP_BACKEND_CUDA, "nccl must shut down before cuda");
  for (int i = FDP_BACKEND_COUNT - 1; i >= 0; i--)
    if (backends[i] && backends[i]->shutdown) backends[i]->shutdown();
  fdp_scratch_release();
}

/* ---- validation ---- */

static void shape_str(const fdp_tensor_t *t, char *buf, size_t len) {
  size_t used = (size_t)snprintf(buf, len, "[");
  for (int i = 0; i < t->ndim && used < len; i++)
    used += (size_t)snprintf(buf + used, len - used, i ? ", %lld" : "%lld", (long long)t->sizes[i]);
  if (used < len) snprintf(buf + used, len - used, "]");
}

static fdp_result_t check_tensor(const fdp_tensor_t *t, const char *what, int index) {
  if (t->ndim < 0 || t->ndim > FDP_MAX_DIMS)
    return fdp__fail(FDP_INVALID, "%s %d has %d dimensions; at most %d are supported", what, index, t->ndim,
                     FDP_MAX_DIMS);
  if (t->elem_size <= 0 || t->elem_size > 16)
    return fdp__fail(FDP_INVALID, "%s %d has element size %d", what, index, t->elem_size);
  if (t->device < FDP_HOST || t->device >= FDP_MAX_DEVICES)
    return fdp__fail(FDP_INVALID, "%s %d is on device %d, outside [-1, %d)", what, index, t->device, FDP_MAX_DEVICES);
  int64_t numel = 1;
  for (int i = 0; i < t->ndim; i++) {
    if (t->sizes[i] < 0) return fdp__fail(FDP_INVALID, "%s %d has a negative size", what, index);
    if (t->strides[i] < 0) return fdp__fail(FDP_INVALID, "%s %d has a negative stride along dim %d", what, index, i);
    numel *= t->sizes[i];
  }
  if (numel > 0 && !t->data) return fdp__fail(FDP_INVALID, "%s %d has no data pointer", what, index);
  return FDP_OK;
}

static int same_shape(const fdp_tensor_t *a, const fdp_tensor_t *b) {
  if (a->ndim != b->ndim) return 0;
  for (int i = 0; i < a->ndim; i++)
    if (a->sizes[i] != b->sizes[i]) return 0;
  return 1;
}

static int same_view(const fdp_tensor_t *a, const fdp_tensor_t *b) {
  if (a->data != b->data || a->device != b->device || !same_shape(a, b)) return 0;
  for (int i = 0; i < a->ndim; i++)
    if (a->sizes[i] > 1 && a->strides[i] != b->strides[i]) return 0;
  return 1;
}

/* PyTorch's texts (assert_no_internal_overlap, assert_no_partial_overlap). */
#define FDP__INTERNAL_OVERLAP                                                                                          \
  "unsupported operation: more than one element of the written-to tensor refers to a single memory location. "         \
  "Please clone() the tensor before performing the operation."
#define FDP__PARTIAL_OVERLAP                                                                                           \
  "unsupported operation: some elements of the input tensor and the written-to tensor refer to a single memory "       \
  "location. Please clone() the tensor before performing the operation."

/* One side of a copy in the overlap sweep: its byte range, whether it is written, its copy index. */
typedef struct {
  uintptr_t lo, hi;
  const fdp_tensor_t *t;
  int written, index;
} span_t;

static int by_lo(const void *a, const void *b) {
  const span_t *x = a, *y = b;
  return (x->lo > y->lo) - (x->lo < y->lo);
}

static span_t span_of(const fdp_tensor_t *t, int written, int index) {
  int64_t last = 0;
  for (int i = 0; i < t->ndim; i++)
    last += (t->sizes[i] - 1) * t->strides[i];
  uintptr_t lo = (uintptr_t)t->data;
  return (span_t){lo, lo + (uintptr_t)((last + 1) * t->elem_size), t, written, index};
}

/* The byte ranges of every copy that writes something: destination and source, in copy order. FDP_OVERLAP when
 * a destination holds one element twice. */
static fdp_result_t collect_spans(const fdp_tensor_t *dst, const fdp_tensor_t *src, int n, const char *op,
                                  span_t *spans, int *m) {
  *m = 0;
  for (int i = 0; i < n; i++) {
    if (fdp_tensor_numel(&dst[i]) == 0 || same_view(&dst[i], &src[i])) continue; /* nothing written */
    if (fdp_tensor_internal_overlap(&dst[i]) == 1)
      return fdp__fail(FDP_OVERLAP, FDP__INTERNAL_OVERLAP " (%s: destination %d)", op, i);
    spans[(*m)++] = span_of(&dst[i], 1, i);
    spans[(*m)++] = span_of(&src[i], 0, i);
  }
  return FDP_OK;
}

/* The exact test for two ranges that intersect: FDP_OK, or the overlap failure naming the copies. */
static fdp_result_t check_span_pair(const span_t *s, const span_t *o, const char *op) {
  if (!s->written && !o->written) return FDP_OK;
  if (o->t->device != s->t->device || fdp_tensor_overlap(o->t, s->t) != 1) return FDP_OK;
  if (s->written && o->written)
    return fdp__fail(FDP_OVERLAP, FDP__INTERNAL_OVERLAP " (%s: destinations %d and %d overlap)", op,
                     o->index < s->index ? o->index : s->index, o->index < s->index ? s->index : o->index);
  return fdp__fail(FDP_OVERLAP, FDP__PARTIAL_OVERLAP " (%s: destination %d overlaps source %d)", op,
                   s->written ? s->index : o->index, s->written ? o->index : s->index);
}

/* Refuses copies whose destinations hold one element twice, overlap each other or overlap a source (other than
 * their own identical view, which is no copy at all). A sweep over byte ranges sorted by start compares only
 * ranges that intersect; those get the exact test. Destinations whose overlap a cheap test cannot decide are let
 * through, as PyTorch does. */
static fdp_result_t check_writes(const fdp_tensor_t *dst, const fdp_tensor_t *src, int n, const char *op) {
  span_t *spans = fdp_scratch_alloc((size_t)2 * n * sizeof *spans);
  span_t **active = fdp_scratch_alloc((size_t)2 * n * sizeof *active);
  fdp_result_t r = FDP_OK;
  int m = 0, nactive = 0;
  if (!spans || !active) {
    r = fdp__fail(FDP_NOMEM, "%s: cannot allocate %d overlap records", op, 2 * n);
    goto done;
  }
  FDP_CHECK_GOTO(collect_spans(dst, src, n, op, spans, &m), r, done);
  qsort(spans, (size_t)m, sizeof spans[0], by_lo);
  for (int k = 0; k < m; k++) {
    span_t *s = &spans[k];
    int kept = 0;
    for (int j = 0; j < nactive; j++) {
      if (active[j]->hi <= s->lo) continue; /* ended before s starts: drop it */
      active[kept++] = active[j];
      FDP_CHECK_GOTO(check_span_pair(s, active[j], op), r, done);
    }
    nactive = kept;
    active[nactive++] = s;
  }
done:
  fdp_scratch_free(spans);
  fdp_scratch_free(active);
  return r;
}

/* All descriptors host, or all CUDA; returns the kind through *cuda. */
static fdp_result_t check_kind(const fdp_tensor_t *const *ts, int n, const char *op, int *cuda) {
  int host = 0, dev = 0;
  for (int i = 0; i < n; i++) {
    if (ts[i]->device == FDP_HOST)
      host++;
    else
      dev++;
  }
  if (host && dev)
    return fdp__fail(FDP_INVALID,
                     "%s: CPU and CUDA tensors are mixed in one call; use \"cpu\" entries only or CUDA "
                     "devices only",
                     op);
  *cuda = dev > 0;
  return FDP_OK;
}

/* One copy's descriptors: each valid, and both of one shape and element size. */
static fdp_result_t check_copy(const fdp_tensor_t *dst, const fdp_tensor_t *src, int i) {
  FDP_CHECK(check_tensor(dst, "destination", i));
  FDP_CHECK(check_tensor(src, "source", i));
  if (same_shape(dst, src) && dst->elem_size == src->elem_size) return FDP_OK;
  char a[256], b[256];
  shape_str(dst, a, sizeof a);
  shape_str(src, b, sizeof b);
  return fdp__fail(FDP_INVALID, "copy %d: destination %s (element size %d) does not match source %s (%d)", i, a,
                   dst->elem_size, b, src->elem_size);
}

/* Whether the reductions can sum `dtype`: the named element types; FDP_DTYPE_OTHER tensors are only grouped by
 * element size, which is enough to copy them but not to add them. */
static int dtype_summable(int dtype) {
  return dtype >= 0 && dtype != FDP_DTYPE_OTHER && dtype < FDP_DTYPE_COUNT;
}

/* One reduce input against the output: valid, same dtype and shape, contiguous, not partly the output. */
/* A sum reads and writes whole elements, which a GPU (and C) can do only at addresses that are a multiple of their
 * size. Copies need no such thing (they move bytes where elements are misaligned), and PyTorch never makes a
 * misaligned tensor; memory from elsewhere (DLPack, a C caller) may be. */
static fdp_result_t check_sum_aligned(const fdp_tensor_t *t, const char *what, int i) {
  if (fdp_tensor_numel(t) == 0 || (uintptr_t)t->data % (uintptr_t)t->elem_size == 0) return FDP_OK;
  return fdp__fail(FDP_INVALID, "reduce: %s %d (at %p) is not aligned to its %d-byte elements, which a sum cannot "
                   "read; copy it into aligned memory first", what, i, (void *)t->data, t->elem_size);
}

static fdp_result_t check_reduce_input(const fdp_tensor_t *in, int i, const fdp_tensor_t *out) {
  FDP_CHECK(check_tensor(in, "input", i));
  FDP_CHECK(check_sum_aligned(in, "input", i));
  if (in->dtype != out->dtype || in->elem_size != out->elem_size)
    return fdp__fail(FDP_INVALID, "reduce: input %d is %s but the output is %s", i, fdp_dtype_name(in->dtype),
                     fdp_dtype_name(out->dtype));
  if (!same_shape(in, out)) {
    char a[256], b[256];
    shape_str(in, a, sizeof a);
    shape_str(out, b, sizeof b);
    return fdp__fail(FDP_INVALID, "input %d has invalid size: got %s, but expected %s", i, a, b);
  }
  if (!fdp_tensor_is_contiguous(in)) return fdp__fail(FDP_INVALID, "reduce: input %d must be contiguous", i);
  if (!same_view(in, out) && fdp_tensor_overlap(in, out) == 1)
    return fdp__fail(FDP_OVERLAP, FDP__PARTIAL_OVERLAP " (reduce: the output overlaps input %d)", i);
  return FDP_OK;
}

/* ---- routing (NOTE [routing] in backend.h) ---- */

static const fdp_backend_t *const preference[] = {&fdp__backend_nccl, &fdp__backend_cuda, &fdp__backend_host};
enum { NPREF = (int)(sizeof preference / sizeof preference[0]) };

/* A walk over the preference list: the next backend to ask, and the first one that could run the operation but
 * is not usable here (its name and reason make the error when nothing runs it). */
typedef struct {
  int next;
  const fdp_backend_t *unusable;
  const char *why;
} route_t;

/* The next backend in preference order that can run `op` on ts and is usable now; NULL when none is left. */
static const fdp_backend_t *route_next(route_t *rt, fdp_op_t op, const fdp_tensor_t *const *ts, int n) {
  while (rt->next < NPREF) {
    const fdp_backend_t *be = preference[rt->next++];
    const char *why = "";
    if (!be->can(op, ts, n)) continue;
    if (fdp_backend_usable(be->id, &why)) return be;
    if (!rt->unusable) {
      rt->unusable = be;
      rt->why = why;
    }
  }
  return NULL;
}

/* One operation's arguments, whichever backend runs it. */
typedef struct {
  const fdp_copy_t *copies; /* FDP_OP_COPY: `n` copies */
  const fdp_tensor_t *src;  /* FDP_OP_BROADCAST: src to tensors[0..n) */
  const fdp_tensor_t *tensors;
  const fdp_tensor_t *out; /* FDP_OP_REDUCE: tensors[0..n) summed into out */
  int n;
  const fdp_streams_t *streams;
} work_t;

static const char *const op_names[] = {"copy", "broadcast", "reduce"};

/* A backend's `can` said yes, so it has the function (backend.h): asserted, not checked. */
static fdp_result_t run_on(const fdp_backend_t *be, fdp_op_t op, const work_t *w) {
  assert(op != FDP_OP_COPY || be->copy);
  assert(op != FDP_OP_BROADCAST || be->broadcast);
  assert(op != FDP_OP_REDUCE || be->reduce);
  switch (op) {
  case FDP_OP_COPY: return w->n ? be->copy(w->copies, w->n, w->streams) : FDP_OK;
  case FDP_OP_BROADCAST: return be->broadcast(w->src, w->tensors, w->n, w->streams);
  case FDP_OP_REDUCE: return be->reduce(w->tensors, w->n, w->out, w->streams);
  }
  return fdp__fail(FDP_INTERNAL, "route: unknown operation %d", (int)op);
}

enum { NO_DEVICE = FDP_HOST - 1 }; /* route_run's none_device when `none` names no device */

/* Runs the work on the first capable, usable backend; one that declines (FDP_UNAVAILABLE) hands it to the next.
 * When none runs it: FDP_UNAVAILABLE naming the capable backend that is not usable, else `none` (with
 * "or must first be copied to device <none_device>" unless NO_DEVICE): formatted only then, not on every call. */
static fdp_result_t route_run(fdp_op_t op, const fdp_tensor_t *const *ts, int n, const work_t *w, const char *none,
                              int none_device) {
  route_t rt = {0, NULL, ""};
  fdp_result_t r = FDP_OK;
  int ran = 0;
  for (const fdp_backend_t *be; (be = route_next(&rt, op, ts, n)) != NULL; ran = 1) {
    r = run_on(be, op, w);
    if (r != FDP_UNAVAILABLE) return r;
    fdp__log("%s: the %s backend declined (%s); asking the next", op_names[op], be->name, fdp_last_error());
  }
  if (ran) return r;
  if (rt.unusable) return fdp__fail(FDP_UNAVAILABLE, "the %s backend is not usable: %s", rt.unusable->name, rt.why);
  if (none_device == NO_DEVICE) return fdp__fail(FDP_UNAVAILABLE, "%s", none);
  return fdp__fail(FDP_UNAVAILABLE, "%s (or must first be copied to device %d)", none, none_device);
}

/* Copies already validated, on the backend routed for all of their descriptors (`all`: dst0, src0, ...). */
static fdp_result_t copy_routed(const fdp_copy_t *copies, int k, const fdp_tensor_t *const *all, int nall,
                                const fdp_streams_t *streams) {
  work_t w = {.copies = copies, .n = k, .streams = streams};
  return route_run(FDP_OP_COPY, all, nall, &w, "copy: no backend moves these tensors", NO_DEVICE);
}

fdp_result_t fdp__route_copy(const fdp_copy_t *copies, int n, const fdp_streams_t *streams) {
  if (n <= 0) return FDP_OK;
  const fdp_tensor_t **all = fdp_scratch_alloc((size_t)2 * n * sizeof *all);
  if (!all) return fdp__fail(FDP_NOMEM, "copy: cannot allocate %d descriptor pointers", 2 * n);
  for (int i = 0; i < n; i++) {
    all[2 * i] = &copies[i].dst;
    all[2 * i + 1] = &copies[i].src;
  }
  fdp_result_t r = copy_routed(copies, n, all, 2 * n, streams);
  fdp_scratch_free(all);
  return r;
}

static const int dtype_size[FDP_DTYPE_COUNT] = {
#define FDP_X(name, str, size) [FDP_DTYPE_##name] = size,
    FDP_DTYPE_MAP(FDP_X)
#undef FDP_X
};

/* The backend a broadcast from ts[0] to ts[1..n) runs on: the collective one, else the one that copies. */
static const fdp_backend_t *route_broadcast(const fdp_tensor_t *const *ts, int n, route_t *rt) {
  const fdp_backend_t *be = route_next(rt, FDP_OP_BROADCAST, ts, n);
  if (be) return be;
  const fdp_tensor_t *pairs[2 * FDP_MAX_DEVICES];
  int m = 0;
  for (int i = n > 1 ? 1 : 0; i < n; i++) {
    pairs[m++] = ts[i];
    pairs[m++] = ts[0];
  }
  *rt = (route_t){0, NULL, ""};
  return route_next(rt, FDP_OP_COPY, pairs, m);
}

/* One-element flat buffers of `dtype`, one on each of devices[0..n), then one more on devices[0]; nothing reads
 * them, they only sit at distinct addresses. */
static fdp_result_t flat_buffers(const int *devices, int n, int dtype, fdp_tensor_t *t, const fdp_tensor_t **ts) {
  for (int i = 0; i <= n; i++) {
    int dev = devices[i < n ? i : 0];
    if (dev < FDP_HOST || dev >= FDP_MAX_DEVICES)
      return fdp__fail(FDP_INVALID, "route: device %d is outside [-1, %d)", dev, FDP_MAX_DEVICES);
    t[i] = (fdp_tensor_t){.data = (char *)(uintptr_t)(64 * (i + 1)),
                          .device = dev,
                          .dtype = dtype,
                          .elem_size = dtype_size[dtype],
                          .ndim = 1,
                          .sizes = {1},
                          .strides = {1}};
    ts[i] = &t[i];
  }
  return FDP_OK;
}

fdp_result_t fdp_route_devices(fdp_op_t op, const int *devices, int n, int dtype, fdp_backend_id_t *out) {
  if (!devices || !out || n < 1 || n > FDP_MAX_DEVICES || dtype < 0 || dtype >= FDP_DTYPE_COUNT ||
      (op != FDP_OP_BROADCAST && op != FDP_OP_REDUCE))
    return fdp__fail(FDP_INVALID, "route: bad arguments (op %d, %d devices, dtype %d)", (int)op, n, dtype);
  fdp_tensor_t t[FDP_MAX_DEVICES + 1];
  const fdp_tensor_t *ts[FDP_MAX_DEVICES + 1];
  FDP_CHECK(flat_buffers(devices, n, dtype, t, ts));
  route_t rt = {0, NULL, ""};
  const fdp_backend_t *be = op == FDP_OP_BROADCAST ? route_broadcast(ts, n, &rt) : route_next(&rt, op, ts, n + 1);
  if (be) {
    *out = be->id;
    return FDP_OK;
  }
  if (rt.unusable) return fdp__fail(FDP_UNAVAILABLE, "the %s backend is not usable: %s", rt.unusable->name, rt.why);
  return fdp__fail(FDP_UNAVAILABLE, "route: no backend can %s between these devices",
                   op == FDP_OP_BROADCAST ? "broadcast" : "reduce");
}

/* ---- operations ---- */

/* The n pairs checked in order (the first bad pair is the one reported), every descriptor listed in `all` for the
 * router, and in `copies` only the pairs that move bytes: a destination that is the source's own view, or an empty
 * one, has nothing to copy. */
static fdp_result_t collect_copies(const fdp_tensor_t *dst, const fdp_tensor_t *src, int n, const fdp_tensor_t **all,
                                   fdp_copy_t *copies, int *k) {
  *k = 0;
  for (int i = 0; i < n; i++) {
    FDP_CHECK(check_copy(&dst[i], &src[i], i));
    all[2 * i] = &dst[i];
    all[2 * i + 1] = &src[i];
    if (!same_view(&dst[i], &src[i]) && fdp_tensor_numel(&src[i]) > 0) copies[(*k)++] = (fdp_copy_t){dst[i], src[i]};
  }
  return FDP_OK;
}

fdp_result_t fdp_op_copy(const fdp_tensor_t *dst, const fdp_tensor_t *src, int n, const fdp_streams_t *streams) {
  if (n < 0 || (n > 0 && (!dst || !src))) return fdp__fail(FDP_INVALID, "copy: bad tensor lists (n=%d)", n);
  if (n == 0) return FDP_OK;
  fdp_copy_t *copies = fdp_scratch_alloc((size_t)n * sizeof *copies);
  const fdp_tensor_t **all = fdp_scratch_alloc((size_t)2 * n * sizeof *all);
  fdp_result_t r = FDP_OK;
  int k = 0;
  if (!copies || !all) {
    r = fdp__fail(FDP_NOMEM, "copy: cannot allocate %d copy records", n);
    goto done;
  }
  FDP_CHECK_GOTO(collect_copies(dst, src, n, all, copies, &k), r, done);
  FDP_CHECK_GOTO(check_writes(dst, src, n, "copy"), r, done);
  r = copy_routed(copies, k, all, 2 * n, streams);
done:
  fdp_scratch_free(copies);
  fdp_scratch_free(all);
  return r;
}

struct fdp_copy_plan {
  fdp_copy_t *copies; /* k records: the pairs that move bytes */
  int k;
  const fdp_tensor_t **all; /* the 2n descriptors the router looks at, pointing into dst/src below */
  int nall;
  fdp_tensor_t *dst, *src;
};

void fdp_copy_plan_free(fdp_copy_plan_t *plan) {
  if (!plan) return;
  free(plan->copies);
  free(plan->all);
  free(plan->dst);
  free(plan->src);
  free(plan);
}

/* A plan keeps its own copies of the descriptors, so the caller's lists may go as soon as it is made. Every array
 * holds at least one entry: an empty plan is still a real allocation, never read as running out of memory. */
static fdp_result_t copy_plan_alloc(const fdp_tensor_t *dst, const fdp_tensor_t *src, int n, fdp_copy_plan_t **out) {
  fdp_copy_plan_t *p = calloc(1, sizeof *p);
  size_t m = (size_t)(n ? n : 1);
  if (p) {
    p->copies = malloc(m * sizeof *p->copies);
    p->all = malloc(2 * m * sizeof *p->all);
    p->dst = malloc(m * sizeof *p->dst);
    p->src = malloc(m * sizeof *p->src);
  }
  if (!p || !p->copies || !p->all || !p->dst || !p->src) {
    fdp_copy_plan_free(p);
    return fdp__fail(FDP_NOMEM, "copy: cannot allocate a plan of %d copies", n);
  }
  if (n) {
    memcpy(p->dst, dst, (size_t)n * sizeof *dst);
    memcpy(p->src, src, (size_t)n * sizeof *src);
  }
  *out = p;
  return FDP_OK;
}

fdp_result_t fdp_copy_prepare(const fdp_tensor_t *dst, const fdp_tensor_t *src, int n, fdp_copy_plan_t **out) {
  if (!out || n < 0 || (n > 0 && (!dst || !src))) return fdp__fail(FDP_INVALID, "copy: bad tensor lists (n=%d)", n);
  *out = NULL;
  fdp_copy_plan_t *p = NULL;
  FDP_CHECK(copy_plan_alloc(dst, src, n, &p));
  fdp_result_t r = FDP_OK;
  if (n) { /* an empty plan has no pairs to check and runs as a no-op */
    FDP_CHECK_GOTO(collect_copies(p->dst, p->src, n, p->all, p->copies, &p->k), r, fail);
    FDP_CHECK_GOTO(check_writes(p->dst, p->src, n, "copy"), r, fail);
  }
  p->nall = 2 * n;
  *out = p;
  return FDP_OK;
fail:
  fdp_copy_plan_free(p);
  return r;
}

fdp_result_t fdp_copy_run(const fdp_copy_plan_t *plan, const fdp_streams_t *streams) {
  if (!plan) return fdp__fail(FDP_INVALID, "copy: no plan");
  if (plan->k == 0) return FDP_OK;
  return copy_routed(plan->copies, plan->k, plan->all, plan->nall, streams);
}

/* Broadcast destinations checked, and the collective backend that takes the broadcast, or NULL for copies. */
static fdp_result_t broadcast_route(const fdp_tensor_t *src, const fdp_tensor_t *dst, int ndst,
                                    const fdp_backend_t **out) {
  *out = NULL;
  const fdp_tensor_t *all[FDP_MAX_DEVICES];
  int n = 0, collective = ndst + 1 <= FDP_MAX_DEVICES && fdp_tensor_numel(src) > 0;
  all[n++] = src;
  for (int i = 0; i < ndst; i++) {
    FDP_CHECK(check_tensor(&dst[i], "destination", i));
    if (collective) all[n++] = &dst[i];
  }
  route_t rt = {0, NULL, ""};
  if (collective) *out = route_next(&rt, FDP_OP_BROADCAST, all, n);
  return FDP_OK;
}

fdp_result_t fdp_op_broadcast(const fdp_tensor_t *src, const fdp_tensor_t *dst, int ndst,
                              const fdp_streams_t *streams) {
  if (!src || ndst < 0 || (ndst > 0 && !dst)) return fdp__fail(FDP_INVALID, "broadcast: bad arguments");
  if (ndst == 0) return FDP_OK;
  FDP_CHECK(check_tensor(src, "source", 0));
  const fdp_backend_t *be;
  FDP_CHECK(broadcast_route(src, dst, ndst, &be));
  if (be) {
    fdp_result_t r = be->broadcast(src, dst, ndst, streams);
    if (r != FDP_UNAVAILABLE) return r;
    fdp__log("broadcast: the %s backend declined (%s); using copies", be->name, fdp_last_error());
  }
  fdp_tensor_t *srcs = malloc((size_t)ndst * sizeof *srcs);
  if (!srcs) return fdp__fail(FDP_NOMEM, "broadcast: cannot allocate %d descriptors", ndst);
  for (int i = 0; i < ndst; i++)
    srcs[i] = *src;
  fdp_result_t r = fdp_op_copy(dst, srcs, ndst, streams);
  free(srcs);
  return r;
}

fdp_result_t fdp_op_reduce(const fdp_tensor_t *inputs, int n, const fdp_tensor_t *out, const fdp_streams_t *streams) {
  if (n <= 0 || !inputs || !out) return fdp__fail(FDP_INVALID, "reduce: expected at least one input");
  if (n > FDP_MAX_DEVICES * 16) return fdp__fail(FDP_INVALID, "reduce: too many inputs (%d)", n);
  const fdp_tensor_t *all[FDP_MAX_DEVICES * 16 + 1];
  FDP_CHECK(check_tensor(out, "output", 0));
  if (!fdp_tensor_is_contiguous(out)) return fdp__fail(FDP_INVALID, "reduce: the output must be contiguous");
  FDP_CHECK(check_sum_aligned(out, "output", 0));
  for (int i = 0; i < n; i++) {
    FDP_CHECK(check_reduce_input(&inputs[i], i, out));
    all[i] = &inputs[i];
  }
  if (!dtype_summable(out->dtype))
    return fdp__fail(FDP_DTYPE, "reduce: dtype not supported (supported: bool, uint8, int8, int16, int32, "
                                "int64, float16, bfloat16, float32, float64)");
  all[n] = out;
  int cuda = 0;
  FDP_CHECK(check_kind(all, n + 1, "reduce", &cuda));
  if (fdp_tensor_numel(out) == 0) return FDP_OK;
  work_t w = {.tensors = inputs, .out = out, .n = n, .streams = streams};
  return route_run(FDP_OP_REDUCE, all, n + 1, &w, "reduce: inputs on several CUDA devices need NCCL", out->device);
}

static fdp_result_t check_dim(const fdp_tensor_t *t, int dim, const char *op) {
  if (dim < 0 || dim >= t->ndim)
    return fdp__fail(FDP_INVALID, "%s: dim %d out of range for a %d-dimensional tensor", op, dim, t->ndim);
  return FDP_OK;
}

fdp_result_t fdp_op_scatter(const fdp_tensor_t *src, int dim, const int64_t *chunk_sizes, const fdp_tensor_t *outs,
                            int n, const fdp_streams_t *streams) {
  if (!src || n <= 0 || !outs || !chunk_sizes)
    return fdp__fail(FDP_INVALID, "Expected at least one device to scatter to");
  FDP_CHECK(check_tensor(src, "source", 0));
  FDP_CHECK(check_dim(src, dim, "scatter"));
  fdp_tensor_t *views = malloc((size_t)n * sizeof *views);
  if (!views) return fdp__fail(FDP_NOMEM, "scatter: cannot allocate %d descriptors", n);
  /* The total first, so that chunks too long and too short both get upstream's text (torch/csrc/cuda/comm.cpp),
   * which comm.scatter raises as it comes: this check is the core's, for every caller. */
  int64_t total = 0, start = 0;
  fdp_result_t r = FDP_OK;
  for (int i = 0; i < n; i++) {
    if (chunk_sizes[i] < 0) {
      r = fdp__fail(FDP_INVALID, "scatter: chunk %d has a negative size (%lld)", i, (long long)chunk_sizes[i]);
      goto done;
    }
    total = chunk_sizes[i] > INT64_MAX - total ? INT64_MAX : total + chunk_sizes[i]; /* no overflow */
  }
  if (total != src->sizes[dim]) {
    r = fdp__fail(FDP_INVALID,
                  "Total size for output tensors along scatter dim %d does not match the source tensor size at dim %d. "
                  "Expected %lld, but got total size %lld.",
                  dim, dim, (long long)src->sizes[dim], (long long)total);
    goto done;
  }
  for (int i = 0; i < n; i++) {
    fdp_tensor_narrow(src, dim, start, chunk_sizes[i], &views[i]);
    start += chunk_sizes[i];
  }
  r = fdp_op_copy(outs, views, n, streams);
done:
  free(views);
  return r;
}

fdp_result_t fdp_op_gather(const fdp_tensor_t *inputs, int n, int dim, const fdp_tensor_t *out,
                           const fdp_streams_t *streams) {
  if (!inputs || n <= 0 || !out) return fdp__fail(FDP_INVALID, "Expected at least one tensor to gather from");
  FDP_CHECK(check_tensor(out, "output", 0));
  FDP_CHECK(check_dim(out, dim, "gather"));
  fdp_tensor_t *views = malloc((size_t)n * sizeof *views);
  if (!views) return fdp__fail(FDP_NOMEM, "gather: cannot allocate %d descriptors", n);
  int64_t start = 0;
  fdp_result_t r = FDP_OK;
  for (int i = 0; i < n; i++) {
    if (inputs[i].ndim != out->ndim) {
      r = fdp__fail(FDP_INVALID, "Expected all input tensors to have the same number of dimensions as the output");
      goto done;
    }
    if (inputs[i].sizes[dim] < 0 || start + inputs[i].sizes[dim] > out->sizes[dim]) {
      r = fdp__fail(FDP_INVALID, "gather: input %d does not fit in the output along dim %d", i, dim);
      goto done;
    }
    fdp_tensor_narrow(out, dim, start, inputs[i].sizes[dim], &views[i]);
    start += inputs[i].sizes[dim];
  }
  if (start != out->sizes[dim]) {
    r = fdp__fail(FDP_INVALID, "gather: inputs fill %lld of the output's %lld elements along dim %d", (long long)start,
                  (long long)out->sizes[dim], dim);
    goto done;
  }
  r = fdp_op_copy(views, inputs, n, streams);
done:
  free(views);
  return r;
}
