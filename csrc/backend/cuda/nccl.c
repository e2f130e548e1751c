/* SPDX-License-Identifier: MIT */
/* The nccl backend: broadcast and sum-reduce across distinct CUDA devices of this process, one grouped NCCL
 * launch per call from the calling thread, over communicators cached per ordered device list until shutdown.
 * nccl_can tells the core what NCCL does exactly; everything else the core routes elsewhere. */
#include "core/backend.h"
#include "dl/cuda_driver.h"
#include "dl/nccl_api.h"

#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Communicators of one ordered device list: rank i runs on devs[i]; rank 0 is always the root. */
typedef struct comm_set {
  struct comm_set *next;
  int n;
  int devs[FDP_MAX_DEVICES];
  ncclComm_t comms[FDP_MAX_DEVICES];
} comm_set_t;

/* One lock for the cache and for every launch. Launches must be serialised anyway: two threads interleaving
 * grouped launches on shared devices can queue the kernels of two collectives in opposite orders on two
 * streams, and each then waits forever for its peer; and one NCCL communicator is not thread-safe. */
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static comm_set_t *g_sets;

static void devs_str(const int *devs, int n, char *buf, size_t len) {
  size_t off = 0;
  buf[0] = '\0';
  for (int i = 0; i < n && off + 1 < len; i++) {
    int w = snprintf(buf + off, len - off, "%s%d", i ? ", " : "", devs[i]);
    if (w < 0) break;
    off += (size_t)w;
  }
}

/* NCCL switches the runtime's current device while it works (cudaSetDevice is a cuCtxSetCurrent underneath);
 * the caller's thread, often PyTorch's, gets its own context back. When the current context cannot be read,
 * nothing is restored: cuCtxSetCurrent(NULL) would unbind (pop) the caller's context. So work is never started
 * then (ctx_refuse); only teardown goes ahead. */
typedef struct saved_ctx {
  CUcontext ctx;
  int ok;
  CUresult err;
} saved_ctx_t;

static saved_ctx_t ctx_save(const fdp_cu_t *cu) {
  saved_ctx_t s = {NULL, 0, CUDA_SUCCESS};
  s.err = cu->CtxGetCurrent(&s.ctx);
  s.ok = s.err == CUDA_SUCCESS;
  if (!s.ok) fdp__log("nccl: reading the caller's CUDA context failed (CUresult %d); it is not restored", (int)s.err);
  return s;
}

/* The failure to report when the caller's context could not be saved, before any NCCL call. */
static fdp_result_t ctx_refuse(saved_ctx_t s, const char *op) {
  char what[160];
  snprintf(what, sizeof what, "nccl: %s not started, the caller's CUDA context cannot be read (cuCtxGetCurrent)", op);
  return fdp__cu_check(s.err, what, -1);
}

/* Gives the caller its context back; a failure is the call's to report (the caller's thread is left with another
 * device's context current). */
static fdp_result_t ctx_restore(const fdp_cu_t *cu, saved_ctx_t s) {
  if (!s.ok) return FDP_OK;
  CUresult e = cu->CtxSetCurrent(s.ctx);
  if (e != CUDA_SUCCESS) fdp__log("nccl: restoring the caller's CUDA context failed (CUresult %d)", (int)e);
  return fdp__cu_check(e, "cuCtxSetCurrent (giving the caller its context back after NCCL)", -1);
}

static fdp_result_t nccl_fail(const fdp_nccl_api_t *api, ncclResult_t r, ncclComm_t comm, const char *op,
                              const int *devs, int n) {
  char d[FDP_MAX_DEVICES * 5 + 8];
  devs_str(devs, n, d, sizeof d);
  const char *last = (comm != NULL && api->GetLastError != NULL) ? api->GetLastError(comm) : NULL;
  return fdp__fail_status(FDP_NCCL, (int)r, "%s on devices [%s]: %s%s%s", op, d, api->GetErrorString(r),
                          last && *last ? ": " : "", last && *last ? last : "");
}

static void comms_evict(const fdp_nccl_api_t *api, const fdp_cu_t *cu, comm_set_t *set);

/* Whether a communicator of the set reports an asynchronous error (or cannot say): then none of them can be trusted
 * again. Without ncclCommGetAsyncError (NCCL before 2.4) there is nothing to ask. */
static int comms_broken(const fdp_nccl_api_t *api, const comm_set_t *set) {
  if (api->CommGetAsyncError == NULL) return 0;
  for (int i = 0; i < set->n; i++) {
    ncclResult_t st = ncclSuccess;
    if (api->CommGetAsyncError(set->comms[i], &st) != ncclSuccess || (st != ncclSuccess && st != ncclInProgress))
      return 1;
  }
  return 0;
}

/* Finds or builds the communicators of `devs` (rank i on devs[i]: each order is a set of its own); called with
 * g_lock held. A cached set that reported an asynchronous error since its last use is aborted and rebuilt. */
static fdp_result_t comms_get(const fdp_nccl_api_t *api, const fdp_cu_t *cu, const int *devs, int n, comm_set_t **out) {
  for (comm_set_t *s = g_sets; s != NULL; s = s->next) {
    if (s->n == n && memcmp(s->devs, devs, (size_t)n * sizeof *devs) == 0) {
      if (comms_broken(api, s)) {
        comms_evict(api, cu, s);
        break;
      }
      *out = s;
      return FDP_OK;
    }
  }
  /* Communicators live in the devices' primary contexts: fastdp holds its own reference to each (released by the
   * cuda backend's shutdown, which fdp_shutdown runs after destroying the communicators), so that they outlive
   * the communicators even when every other user lets go. */
  for (int i = 0; i < n; i++)
    FDP_CHECK(fdp__cu_ctx_get(devs[i], NULL));
  comm_set_t *s = calloc(1, sizeof *s);
  if (s == NULL) return fdp__fail(FDP_NOMEM, "nccl: cannot allocate a communicator set");
  s->n = n;
  memcpy(s->devs, devs, (size_t)n * sizeof *devs);
  saved_ctx_t saved = ctx_save(cu);
  if (!saved.ok) {
    free(s);
    return ctx_refuse(saved, "ncclCommInitAll");
  }
  ncclResult_t r = api->CommInitAll(s->comms, n, s->devs);
  fdp_result_t restored = ctx_restore(cu, saved);
  if (r != ncclSuccess) { /* the first failure is the one to report */
    fdp_result_t res = nccl_fail(api, r, NULL, "ncclCommInitAll", devs, n);
    free(s);
    return res;
  }
  {
    char d[FDP_MAX_DEVICES * 5 + 8];
    devs_str(devs, n, d, sizeof d);
    fdp__log("nccl: communicators built for devices [%s]", d);
  }
  s->next = g_sets; /* cached even when the context could not be given back: the communicators are sound */
  g_sets = s;
  *out = s;
  return restored;
}

/* Ends every communicator of a set and frees it: aborted when the set is broken (a communicator that reported an
 * asynchronous error stays broken until aborted, and destroying it waits for work that will never finish), else
 * destroyed. Without ncclCommAbort a broken set is leaked instead. Teardown goes on past failures, which are logged. */
static void comms_end(const fdp_nccl_api_t *api, const fdp_cu_t *cu, comm_set_t *set, int broken) {
  if (broken && api->CommAbort == NULL) {
    fdp__log("nccl: ncclCommAbort missing; leaking failed communicators");
  } else {
    saved_ctx_t saved = ctx_save(cu);
    for (int i = 0; i < set->n; i++) {
      ncclResult_t r = broken ? api->CommAbort(set->comms[i]) : api->CommDestroy(set->comms[i]);
      if (r != ncclSuccess)
        fdp__log("nccl: %s on device %d: %s", broken ? "ncclCommAbort" : "ncclCommDestroy", set->devs[i],
                 api->GetErrorString(r));
    }
    FDP_CHECK_IGNORE(ctx_restore(cu, saved)); /* teardown goes on regardless */
  }
  free(set);
}

/* Drops a set whose communicators reported an asynchronous error; they cannot be trusted again. Called with
 * g_lock held. */
static void comms_evict(const fdp_nccl_api_t *api, const fdp_cu_t *cu, comm_set_t *set) {
  for (comm_set_t **p = &g_sets; *p != NULL; p = &(*p)->next) {
    if (*p != set) continue;
    *p = set->next;
    comms_end(api, cu, set, 1);
    return;
  }
}

/* One rank's part of a collective. */
typedef struct rank_op {
  const void *send;
  void *recv;
  void *stream;
} rank_op_t;

/* One NCCL group holding the collective on every rank; the group is closed even after a failed call inside it.
 * The context current on entry is the caller's to save and restore. */
static fdp_result_t group_enqueue(const fdp_nccl_api_t *api, const comm_set_t *set, const int *devs, int n,
                                  const rank_op_t *ops, size_t count, ncclDataType_t type, int reduce) {
  const char *op = reduce ? "ncclReduce" : "ncclBroadcast";
  ncclResult_t r = api->GroupStart();
  if (r != ncclSuccess) return nccl_fail(api, r, NULL, "ncclGroupStart", devs, n);
  ncclResult_t first = ncclSuccess;
  ncclComm_t bad = NULL;
  for (int i = 0; i < n && first == ncclSuccess; i++) {
    ncclResult_t e = reduce
                         ? api->Reduce(ops[i].send, ops[i].recv, count, type, ncclSum, 0, set->comms[i], ops[i].stream)
                         : api->Broadcast(ops[i].send, ops[i].recv, count, type, 0, set->comms[i], ops[i].stream);
    if (e != ncclSuccess) {
      first = e;
      bad = set->comms[i];
    }
  }
  r = api->GroupEnd();
  if (first != ncclSuccess) return nccl_fail(api, first, bad, op, devs, n);
  if (r != ncclSuccess && r != ncclInProgress) return nccl_fail(api, r, set->comms[0], op, devs, n);
  return FDP_OK;
}

/* After a failed collective: evicts the communicators when one of them reports an asynchronous error (or cannot
 * say), so that the next call builds fresh ones. g_lock is held. */
static void evict_if_broken(const fdp_nccl_api_t *api, const fdp_cu_t *cu, comm_set_t *set) {
  if (comms_broken(api, set)) comms_evict(api, cu, set);
}

/* Launches one collective on every rank of `devs` inside one NCCL group, holding g_lock (and PyTorch's free
 * mutex when several devices are involved). `reduce` selects ncclReduce(sum) over ncclBroadcast. */
static fdp_result_t launch(const int *devs, int n, const rank_op_t *ops, size_t count, ncclDataType_t type,
                           int reduce) {
  const fdp_nccl_api_t *api;
  const fdp_cu_t *cu;
  comm_set_t *set = NULL;
  FDP_CHECK(fdp__cu_load(&cu, NULL));
  FDP_CHECK(fdp__nccl_load(&api, NULL));
  pthread_mutex_lock(&g_lock);
  fdp_result_t res = comms_get(api, cu, devs, n, &set);
  if (res == FDP_OK) {
    pthread_mutex_t *free_mutex = n > 1 ? fdp__torch_free_mutex() : NULL;
    if (free_mutex) pthread_mutex_lock(free_mutex);
    saved_ctx_t saved = ctx_save(cu);
    res = saved.ok ? group_enqueue(api, set, devs, n, ops, count, type, reduce)
                   : ctx_refuse(saved, reduce ? "ncclReduce" : "ncclBroadcast");
    FDP_CHECK_KEEP(ctx_restore(cu, saved), res);
    if (free_mutex) pthread_mutex_unlock(free_mutex);
    if (res != FDP_OK) evict_if_broken(api, cu, set);
  }
  pthread_mutex_unlock(&g_lock);
  return res;
}

/* The NCCL type of a dtype, or 0 when NCCL has none (bfloat16 needs NCCL 2.10). */
static int nccl_type(int dtype, int version, ncclDataType_t *t) {
  switch (dtype) {
  case FDP_DTYPE_U8: *t = ncclUint8; return 1;
  case FDP_DTYPE_I8: *t = ncclInt8; return 1;
  case FDP_DTYPE_I32: *t = ncclInt32; return 1;
  case FDP_DTYPE_I64: *t = ncclInt64; return 1;
  case FDP_DTYPE_F16: *t = ncclFloat16; return 1;
  case FDP_DTYPE_BF16: *t = ncclBfloat16; return version >= 21000;
  case FDP_DTYPE_F32: *t = ncclFloat32; return 1;
  case FDP_DTYPE_F64: *t = ncclFloat64; return 1;
  default: return 0;
  }
}

#ifndef NDEBUG /* only the assertions below ask */
static int listed(const int *devs, int n, int dev) {
  for (int i = 0; i < n; i++)
    if (devs[i] == dev) return 1;
  return 0;
}
#endif

static fdp_result_t nccl_broadcast(const fdp_tensor_t *src, const fdp_tensor_t *dst, int ndst,
                                   const fdp_streams_t *streams) {
  const fdp_nccl_api_t *api;
  FDP_CHECK(fdp__nccl_load(&api, NULL));
  assert(ndst + 1 <= FDP_MAX_DEVICES && src->device >= 0 && fdp_tensor_is_dense(src)); /* nccl_can */
  int devs[FDP_MAX_DEVICES];
  rank_op_t ops[FDP_MAX_DEVICES];
  int n = 0;
  /* The root broadcasts in place: its buffer is the source, so no extra copy happens on its device. */
  devs[n] = src->device;
  ops[n++] = (rank_op_t){src->data, src->data, fdp__stream_for(streams, src->device)};
  for (int i = 0; i < ndst; i++) {
    assert(dst[i].device >= 0 && !listed(devs, n, dst[i].device));
    devs[n] = dst[i].device;
    ops[n++] = (rank_op_t){dst[i].data, dst[i].data, fdp__stream_for(streams, dst[i].device)};
  }
  /* A broadcast moves bytes, so types NCCL lacks (bool, int16, complex, ...) travel as uint8. Dense tensors
   * with one set of strides have one byte image starting at element 0. */
  ncclDataType_t type;
  size_t count = (size_t)fdp_tensor_numel(src);
  if (!nccl_type(src->dtype, api->version, &type)) {
    type = ncclUint8;
    count *= (size_t)src->elem_size;
  }
  return launch(devs, n, ops, count, type, 0);
}

/* The first input on the output's device (it becomes rank 0); -1 when none is. */
static int find_root(const fdp_tensor_t *const *inputs, int n, const fdp_tensor_t *out) {
  for (int i = 0; i < n; i++)
    if (inputs[i]->device == out->device) return i;
  return -1;
}

static fdp_result_t nccl_reduce(const fdp_tensor_t *inputs, int n, const fdp_tensor_t *out,
                                const fdp_streams_t *streams) {
  const fdp_nccl_api_t *api;
  FDP_CHECK(fdp__nccl_load(&api, NULL));
  ncclDataType_t type = ncclUint8;
  int typed = nccl_type(out->dtype, api->version, &type), root = 0;
  while (root < n && inputs[root].device != out->device)
    root++;
  /* nccl_can: a type NCCL sums, at most one input per device, one of them on the output's device */
  assert(typed && out->dtype != FDP_DTYPE_BOOL && root < n);
  (void)typed;
  int devs[FDP_MAX_DEVICES];
  rank_op_t ops[FDP_MAX_DEVICES];
  int k = 0;
  /* Rank 0 (the root) is the output's device: its input is the send buffer there and out receives. */
  devs[k] = out->device;
  ops[k++] = (rank_op_t){inputs[root].data, out->data, fdp__stream_for(streams, out->device)};
  for (int i = 0; i < n; i++) {
    if (i == root) continue;
    assert(k < FDP_MAX_DEVICES && !listed(devs, k, inputs[i].device));
    devs[k] = inputs[i].device;
    ops[k++] = (rank_op_t){inputs[i].data, NULL, fdp__stream_for(streams, inputs[i].device)};
  }
  return launch(devs, k, ops, (size_t)fdp_tensor_numel(out), type, 1);
}

/* ---- what NCCL runs (NOTE [routing] in backend.h) ---- */

static int same_layout(const fdp_tensor_t *a, const fdp_tensor_t *b) {
  if (a->ndim != b->ndim || a->elem_size != b->elem_size) return 0;
  for (int k = 0; k < a->ndim; k++)
    if (a->sizes[k] != b->sizes[k] || (a->sizes[k] > 1 && a->strides[k] != b->strides[k])) return 0;
  return 1;
}

/* Every tensor on a CUDA device of its own. */
static int distinct_cuda(const fdp_tensor_t *const *ts, int n) {
  for (int i = 0; i < n; i++) {
    if (ts[i]->device < 0) return 0;
    for (int j = i + 1; j < n; j++)
      if (ts[i]->device == ts[j]->device) return 0;
  }
  return 1;
}

/* One dense, non-empty source and destinations of its layout (a byte image each), one buffer per device. */
static int can_broadcast(const fdp_tensor_t *const *ts, int n) {
  if (!fdp_tensor_is_dense(ts[0]) || fdp_tensor_numel(ts[0]) == 0 || !distinct_cuda(ts, n)) return 0;
  for (int i = 1; i < n; i++)
    if (!same_layout(ts[i], ts[0])) return 0;
  return 1;
}

/* Inputs spread over devices, one per device, one on the output's device, in a type ncclSum adds as the core
 * does (bool sums are a logical or; bfloat16 needs NCCL 2.10). When NCCL does not load, the type question is
 * left to `usable`, which says why. */
static int can_reduce(const fdp_tensor_t *const *inputs, int n, const fdp_tensor_t *out) {
  const fdp_nccl_api_t *api;
  ncclDataType_t type;
  if (out->device < 0 || !distinct_cuda(inputs, n) || find_root(inputs, n, out) < 0 || n < 2) return 0;
  if (out->dtype == FDP_DTYPE_BOOL) return 0;
  return fdp__nccl_load(&api, NULL) != FDP_OK || nccl_type(out->dtype, api->version, &type);
}

static int nccl_can(fdp_op_t op, const fdp_tensor_t *const *ts, int n) {
  if (fdp_param(FDP_PARAM_DISABLE_NCCL) || n < 2 || n > FDP_MAX_DEVICES + (op == FDP_OP_REDUCE)) return 0;
  if (op == FDP_OP_BROADCAST) return can_broadcast(ts, n);
  if (op == FDP_OP_REDUCE) return can_reduce(ts, n - 1, ts[n - 1]);
  return 0;
}

/* Loads the libraries and counts devices: no context is created or retained anywhere, so asking is cheap and
 * leaves every GPU untouched (fastdp.comm asks before its first collective). */
static int nccl_usable(const char **why) {
  const char *w = NULL;
  if (fdp__cu_load(NULL, &w) != FDP_OK || fdp__nccl_load(NULL, &w) != FDP_OK) goto no;
  if (fdp__cu_device_count() < 1) {
    w = "no CUDA device is visible";
    goto no;
  }
  return 1;
no:
  if (why) *why = w;
  return 0;
}

/* Ends every cached communicator: destroyed, or aborted where its set reported an asynchronous error since its last
 * use. Explicit only (fdp_shutdown, which runs it before the cuda backend releases the primary contexts the
 * communicators live in), never from atexit or a destructor: at interpreter exit the CUDA runtime may already be
 * torn down and ncclCommDestroy can hang (the binding refuses to shut down then). */
static void nccl_shutdown(void) {
  pthread_mutex_lock(&g_lock);
  comm_set_t *s = g_sets;
  g_sets = NULL;
  const fdp_nccl_api_t *api = NULL;
  const fdp_cu_t *cu = NULL;
  if (s != NULL && (fdp__nccl_load(&api, NULL) != FDP_OK || fdp__cu_load(&cu, NULL) != FDP_OK)) api = NULL;
  while (s != NULL) {
    comm_set_t *next = s->next;
    if (api != NULL)
      comms_end(api, cu, s, comms_broken(api, s));
    else
      free(s);
    s = next;
  }
  pthread_mutex_unlock(&g_lock);
}

static void nccl_library_facts(fdp_library_facts_t *out) {
  const fdp_nccl_api_t *api;
  if (fdp__nccl_load(&api, NULL) != FDP_OK) return;
  out->version = api->version;
  out->library = api->path;
  out->devices = fdp__cu_device_count();
}

const fdp_backend_t fdp__backend_nccl = {
    .name = "nccl",
    .id = FDP_BACKEND_NCCL,
    .usable = nccl_usable,
    .can = nccl_can,
    .copy = NULL,
    .reduce = nccl_reduce,
    .broadcast = nccl_broadcast,
    .shutdown = nccl_shutdown,
    .library_facts = nccl_library_facts,
};
