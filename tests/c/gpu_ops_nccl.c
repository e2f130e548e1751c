/* SPDX-License-Identifier: MIT */
/* test_gpu_ops on NCCL's side: rank order that is not device order, types NCCL has no name for (broadcast as
 * bytes), and a communicator set that reports an asynchronous error. */
#include "gpu_ops_harness.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- rank order is not device order ---- */

/* A broadcast from `root` to `dsts` (in that order), dense: NCCL's route. */
void bcast_order(int root, const int *dsts, int n, const CUstream *streams) {
  int64_t sz[1] = {777}, st[1] = {1};
  buf_t sb = buf_new(root, 777 * 4), db[FDP_MAX_DEVICES];
  view_t sv = view(&sb, FDP_DTYPE_F32, 4, 1, sz, st, 0);
  fdp_tensor_t dt[FDP_MAX_DEVICES];
  buf_t *all[FDP_MAX_DEVICES + 1] = {&sb};
  for (int i = 0; i < n; i++) {
    db[i] = buf_new(dsts[i], 777 * 4);
    memcpy(db[i].ref, sb.ref, sb.bytes);
    dt[i] = view(&db[i], FDP_DTYPE_F32, 4, 1, sz, st, 0).t;
    all[1 + i] = &db[i];
  }
  fdp_streams_t fs = all_streams(streams);
  caller_before(all, n + 1, streams);
  OK(fdp_op_broadcast(&sv.t, dt, n, &fs));
  caller_after(all, n + 1, streams, "broadcast in device order");
  for (int i = 0; i < n; i++) {
    buf_matches(&db[i], "broadcast, devices not in ascending order");
    buf_free(&db[i]);
  }
  buf_free(&sb);
}

/* Roots other than device 0, device lists not ascending, and one set of devices in two orders: each order is its
 * own communicator set (rank i runs on the i-th device listed), so the second order builds new communicators. */
void test_order(void) {
  if (g_ndev < 3) return;
  int desc[FDP_MAX_DEVICES], rot[FDP_MAX_DEVICES], k = 0;
  for (int d = g_ndev - 1; d >= 1; d--)
    desc[k++] = d;
  long long comms = sim() ? S.stat("comms") : 0;
  bcast_order(0, desc, k, g_stream);
  k = 0;
  for (int i = 1; i < g_ndev; i++)
    desc[k++] = i; /* the same set, ascending now */
  bcast_order(0, desc, k, NULL);
  if (sim()) CHECKF(S.stat("comms") - comms == 2 * g_ndev, "two orders of one device set share communicators");
  k = 0;
  for (int d = g_ndev - 1; d >= 0; d--)
    if (d != 2) rot[k++] = d;
  bcast_order(2, rot, k, g_stream); /* root: device 2 */
  /* reduce into the last device from inputs listed out of order */
  int devs[FDP_MAX_DEVICES];
  for (int i = 0; i < g_ndev; i++)
    devs[i] = (i * 3 + 1) % g_ndev;
  int distinct = 1;
  for (int i = 0; i < g_ndev; i++)
    for (int j = 0; j < i; j++)
      distinct &= devs[i] != devs[j];
  if (!distinct)
    for (int i = 0; i < g_ndev; i++)
      devs[i] = g_ndev - 1 - i;
  /* integers: NCCL's summation order across ranks is its own, so the sum is checked where the order cannot matter */
  reduce_case(FDP_DTYPE_I32, 4, g_ndev, devs, g_ndev - 1, -1, 999, g_stream, FDP_OK);
  reduce_case(FDP_DTYPE_I64, 8, g_ndev, devs, devs[2], 2, 500, NULL, FDP_OK);
  sim_clean("rank order");
}

/* Types NCCL has no name for (bool, int16, complex) are broadcast as their bytes: a count of bytes, not of
 * elements, or only the first part of each buffer would arrive. */
void test_nccl_bytes(void) {
  if (g_ndev < 2 || !fdp_backend_usable(FDP_BACKEND_NCCL, NULL) || getenv("FASTDP_DISABLE_NCCL")) return;
  static const struct {
    int dtype, es;
    const char *what;
  } types[] = {{FDP_DTYPE_BOOL, 1, "bool"},
               {FDP_DTYPE_I16, 2, "int16"},
               {FDP_DTYPE_OTHER, 8, "complex64"},
               {FDP_DTYPE_OTHER, 16, "complex128"}};
  for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
    int64_t sz[2] = {7, 33}, st[2] = {33, 1};
    int es = types[t].es, n = g_ndev - 1;
    buf_t sb = buf_new(0, 7 * 33 * (size_t)es), db[FDP_MAX_DEVICES];
    view_t sv = view(&sb, types[t].dtype, es, 2, sz, st, 0);
    fdp_tensor_t dt[FDP_MAX_DEVICES];
    buf_t *all[FDP_MAX_DEVICES + 1] = {&sb};
    for (int i = 0; i < n; i++) {
      db[i] = buf_new(1 + i, sb.bytes);
      memcpy(db[i].ref, sb.ref, sb.bytes);
      dt[i] = view(&db[i], types[t].dtype, es, 2, sz, st, 0).t;
      all[1 + i] = &db[i];
    }
    long long before = sim() ? S.calls("ncclBroadcast") : 0;
    fdp_streams_t fs = all_streams(g_stream);
    caller_before(all, n + 1, g_stream);
    OK(fdp_op_broadcast(&sv.t, dt, n, &fs));
    caller_after(all, n + 1, g_stream, "broadcast as bytes");
    if (sim())
      CHECKF(S.calls("ncclBroadcast") - before == g_ndev, "a %s broadcast did not go through NCCL", types[t].what);
    for (int i = 0; i < n; i++) {
      char what[64];
      snprintf(what, sizeof what, "%s broadcast through NCCL as bytes", types[t].what);
      buf_matches(&db[i], what);
      buf_free(&db[i]);
    }
    buf_free(&sb);
  }
  sim_clean("NCCL broadcasts of types it has no name for");
}

/* A communicator that reports an asynchronous error (its peer died, a network failed) is never used again: the
 * next collective on those devices runs on new communicators. It stays broken until it is aborted, so shutting
 * down aborts it too (destroying it waits for work that never finishes). */
void test_nccl_async_error(void) {
  if (!sim() || g_ndev < 2 || !fdp_backend_usable(FDP_BACKEND_NCCL, NULL) || getenv("FASTDP_DISABLE_NCCL")) return;
  int dsts[FDP_MAX_DEVICES];
  for (int i = 1; i < g_ndev; i++)
    dsts[i - 1] = i;
  bcast_order(0, dsts, g_ndev - 1, g_stream);
  sim_clean("before the asynchronous error");
  CHECK(S.nccl_break(1, 6 /* ncclRemoteError */) >= 1);
  long long aborts = S.calls("ncclCommAbort"), comms = S.stat("comms");
  bcast_order(0, dsts, g_ndev - 1, g_stream);
  CHECKF(S.calls("ncclCommAbort") - aborts == g_ndev, "the broken communicators were not aborted");
  CHECKF(S.stat("comms") == comms, "communicators: %lld before, %lld after a rebuild", comms, S.stat("comms"));
  sim_clean("after the asynchronous error");
  CHECK(S.nccl_break(2 % g_ndev, 3 /* ncclInternalError */) >= 1);
  aborts = S.calls("ncclCommAbort");
  fdp_shutdown();
  CHECKF(S.calls("ncclCommAbort") - aborts >= g_ndev, "shutdown did not abort the broken communicators");
  CHECKF(S.stat("comms") == 0, "%lld communicators live after shutdown", S.stat("comms"));
  sim_clean("shutdown with a broken communicator set");
}
