/* SPDX-License-Identifier: MIT */
/* Fences on CUDA streams: one event per fenced stream, recorded, waited on by other streams (any device) and queried
 * by the host. Each call makes the primary context of the device it acts on current, and leaves the caller's as it
 * was. */
#include "backend/cuda/fence.h"
#include "dl/cuda_driver.h"

#include <stdlib.h>

struct fdp_fence {
  int n;
  int device[FDP_MAX_DEVICES];
  CUevent event[FDP_MAX_DEVICES];
};

/* Destroys one event. An event belongs to its context whichever is current, so it is destroyed even where that
 * context cannot be pushed (the push only keeps the thread's stack as the driver expects). A failure is only logged:
 * the driver keeps an event until the work before it completes, and nothing else can be done with it. */
static void destroy_event(const fdp_cu_t *cu, int device, CUevent ev) {
  int pushed = fdp__cu_ctx_push(device, NULL) == FDP_OK;
  CUresult e = cu->EventDestroy(ev);
  if (e != CUDA_SUCCESS) fdp__log("cuda fence: cuEventDestroy on device %d failed (CUresult %d)", device, (int)e);
  if (pushed && fdp__cu_ctx_pop(device) != FDP_OK) fdp__log("cuda fence: the caller's context was not restored");
}

/* Destroys the first `n` events of f, then f. */
static void destroy(const fdp_cu_t *cu, fdp_fence_t *f, int n) {
  int held = fdp__detail_hold(1); /* a failure here never replaces the one the caller reports */
  for (int i = 0; i < n; i++)
    destroy_event(cu, f->device[i], f->event[i]);
  fdp__detail_release(held);
  free(f);
}

/* Creates and records the event of one fenced stream, with the device's context pushed for both calls; on any
 * failure (the pop included) no event is left behind. */
static fdp_result_t record_one(const fdp_cu_t *cu, int device, CUstream stream, CUevent *out) {
  CUevent ev = NULL;
  fdp_result_t r = FDP_OK;
  FDP_CHECK(fdp__cu_ctx_push(device, NULL));
  r = fdp__cu_check(cu->EventCreate(&ev, CU_EVENT_DISABLE_TIMING), "cuEventCreate", device);
  if (r == FDP_OK) r = fdp__cu_check(cu->EventRecord(ev, stream), "cuEventRecord", device);
  FDP_CHECK_KEEP(fdp__cu_ctx_pop(device), r);
  if (r != FDP_OK && ev != NULL) {
    int held = fdp__detail_hold(1);
    destroy_event(cu, device, ev);
    fdp__detail_release(held);
    ev = NULL;
  }
  *out = ev;
  return r;
}

fdp_result_t fdp__cuda_fence_record(const fdp_streams_t *streams, fdp_fence_t **out) {
  const fdp_cu_t *cu;
  FDP_CHECK(fdp__cu_load(&cu, NULL));
  fdp_fence_t *f = calloc(1, sizeof *f);
  if (f == NULL) return fdp__fail(FDP_NOMEM, "fence: out of host memory");
  for (int i = 0; i < streams->n; i++) {
    fdp_result_t r = record_one(cu, streams->device[i], (CUstream)streams->stream[i], &f->event[i]);
    if (r != FDP_OK) {
      destroy(cu, f, i); /* the failed record is what the caller reports */
      return r;
    }
    f->device[i] = streams->device[i];
    f->n = i + 1;
  }
  *out = f;
  return FDP_OK;
}

fdp_result_t fdp__cuda_fence_wait(const fdp_fence_t *fence, const fdp_streams_t *waiters) {
  const fdp_cu_t *cu;
  FDP_CHECK(fdp__cu_load(&cu, NULL));
  for (int w = 0; w < waiters->n; w++) {
    int dev = waiters->device[w];
    /* A stream may wait on another device's event; the waiting stream's context must be current. */
    FDP_CHECK(fdp__cu_ctx_push(dev, NULL));
    fdp_result_t r = FDP_OK;
    for (int i = 0; i < fence->n && r == FDP_OK; i++)
      r = fdp__cu_check(cu->StreamWaitEvent((CUstream)waiters->stream[w], fence->event[i], 0), "cuStreamWaitEvent",
                        dev);
    FDP_CHECK_KEEP(fdp__cu_ctx_pop(dev), r);
    FDP_CHECK(r);
  }
  return FDP_OK;
}

fdp_result_t fdp__cuda_fence_query(const fdp_fence_t *fence, int *done) {
  const fdp_cu_t *cu;
  FDP_CHECK(fdp__cu_load(&cu, NULL));
  *done = 1;
  for (int i = 0; i < fence->n && *done; i++) {
    FDP_CHECK(fdp__cu_ctx_push(fence->device[i], NULL));
    CUresult e = cu->EventQuery(fence->event[i]);
    fdp_result_t r = e == CUDA_ERROR_NOT_READY ? FDP_OK : fdp__cu_check(e, "cuEventQuery", fence->device[i]);
    if (e == CUDA_ERROR_NOT_READY) *done = 0;
    FDP_CHECK_KEEP(fdp__cu_ctx_pop(fence->device[i]), r);
    if (r != FDP_OK) {
      *done = 0;
      return r;
    }
  }
  return FDP_OK;
}

void fdp__cuda_fence_free(fdp_fence_t *fence) {
  const fdp_cu_t *cu;
  if (fdp__cu_load(&cu, NULL) != FDP_OK) {
    free(fence); /* no driver: the events cannot exist */
    return;
  }
  destroy(cu, fence, fence->n);
}
