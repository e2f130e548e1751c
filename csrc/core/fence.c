/* SPDX-License-Identifier: MIT */
/* Ordering work across streams (fdp_streams_order, fdp_fence_*): the lists are checked here, and the backend that
 * owns the GPUs records and waits on its events. */
#include "backend.h"

/* The backend that owns the GPUs' fences, or NULL with the failure recorded. */
static const fdp_backend_t *fence_owner(void) {
  for (int i = 0; i < FDP_BACKEND_COUNT; i++) {
    const fdp_backend_t *b = fdp__backend((fdp_backend_id_t)i);
    if (b && b->fence_record) {
      const char *why = "";
      if (!b->usable(&why)) {
        fdp__fail(FDP_UNAVAILABLE, "streams cannot be ordered: %s", why);
        return NULL;
      }
      return b;
    }
  }
  fdp__fail(FDP_UNAVAILABLE, "streams cannot be ordered: this build has no CUDA backend");
  return NULL;
}

static fdp_result_t check_streams(const fdp_streams_t *s, const char *what) {
  if (s == NULL || s->n < 1 || s->n > FDP_MAX_DEVICES)
    return fdp__fail(FDP_INVALID, "%s: 1 to %d streams, got %d", what, FDP_MAX_DEVICES, s ? s->n : 0);
  for (int i = 0; i < s->n; i++)
    if (s->device[i] < 0)
      return fdp__fail(FDP_INVALID, "%s: entry %d is on device %d, not a CUDA device", what, i, s->device[i]);
  return FDP_OK;
}

fdp_result_t fdp_streams_order(const fdp_streams_t *waiters, const fdp_streams_t *signals) {
  FDP_CHECK(check_streams(waiters, "order (waiters)"));
  FDP_CHECK(check_streams(signals, "order (signals)"));
  if (waiters->n != signals->n)
    return fdp__fail(FDP_INVALID, "order: %d waiters for %d signals", waiters->n, signals->n);
  const fdp_backend_t *b = fence_owner();
  if (!b) return FDP_UNAVAILABLE;
  for (int i = 0; i < waiters->n; i++) {
    fdp_streams_t signal = {1, {signals->device[i]}, {signals->stream[i]}};
    fdp_streams_t waiter = {1, {waiters->device[i]}, {waiters->stream[i]}};
    fdp_fence_t *fence = NULL;
    FDP_CHECK(b->fence_record(&signal, &fence));
    fdp_result_t r = b->fence_wait(fence, &waiter);
    b->fence_free(fence);
    FDP_CHECK(r);
  }
  return FDP_OK;
}

fdp_result_t fdp_fence_record(const fdp_streams_t *streams, fdp_fence_t **out) {
  if (out == NULL) return fdp__fail(FDP_INVALID, "fence: no place for the result");
  *out = NULL;
  FDP_CHECK(check_streams(streams, "fence"));
  const fdp_backend_t *b = fence_owner();
  return b ? b->fence_record(streams, out) : FDP_UNAVAILABLE;
}

fdp_result_t fdp_fence_wait(const fdp_fence_t *fence, const fdp_streams_t *waiters) {
  if (fence == NULL) return fdp__fail(FDP_INVALID, "fence wait: no fence");
  FDP_CHECK(check_streams(waiters, "fence wait"));
  const fdp_backend_t *b = fence_owner();
  return b ? b->fence_wait(fence, waiters) : FDP_UNAVAILABLE;
}

fdp_result_t fdp_fence_query(const fdp_fence_t *fence, int *done) {
  if (fence == NULL || done == NULL) return fdp__fail(FDP_INVALID, "fence query: no fence or no place for the answer");
  const fdp_backend_t *b = fence_owner();
  return b ? b->fence_query(fence, done) : FDP_UNAVAILABLE;
}

void fdp_fence_free(fdp_fence_t *fence) {
  if (fence == NULL) return;
  for (int i = 0; i < FDP_BACKEND_COUNT; i++) {
    const fdp_backend_t *b = fdp__backend((fdp_backend_id_t)i);
    if (b && b->fence_free) {
      b->fence_free(fence);
      return;
    }
  }
}
