/* SPDX-License-Identifier: MIT */
/* test_gpu_ops with threads: 8 threads running operations at once, shutdown then reuse, and (--race) threads racing
 * on the first use of what fastdp makes lazily. */
#include "gpu_ops_harness.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- threads ---- */

static void *thread_body(void *arg) {
  int id = (int)(intptr_t)arg;
  t_rng = 0x1234567ull * (uint64_t)(id + 1);
  CUstream mine[FDP_MAX_DEVICES];
  for (int d = 0; d < g_ndev; d++) {
    push(d);
    dev_call(d, D.StreamCreate(&mine[d], 1), "cuStreamCreate");
    pop(d);
  }
  int a = id % g_ndev, b = (id + 1) % g_ndev;
  for (int it = 0; it < 3; it++) {
    int64_t sz[3] = {3, 20, 200};
    copy_case(a, b, 4, sz, (id + it) % L_COUNT, (id + 2 * it) % L_COUNT, mine);
    int devs[4] = {a, a, a, a};
    reduce_case(FDP_DTYPE_F32, 4, 4, devs, a, -1, 999, mine, FDP_OK);
    if (g_ndev > 1) {
      int all[FDP_MAX_DEVICES];
      for (int d = 0; d < g_ndev; d++)
        all[d] = d;
      reduce_case(FDP_DTYPE_F16, 2, g_ndev, all, 0, -1, 500, mine, FDP_OK);
      /* Broadcasts over device lists that overlap other threads' (other roots, other lengths): the grouped
       * launches of two threads must never interleave on a device they share. */
      int dsts[FDP_MAX_DEVICES], k = 1 + id % (g_ndev - 1);
      for (int j = 0; j < k; j++)
        dsts[j] = (a + 1 + j) % g_ndev;
      bcast_order(a, dsts, k, mine);
    }
  }
  for (int d = 0; d < g_ndev; d++) {
    push(d);
    dev_call(d, D.CtxSynchronize(), "cuCtxSynchronize");
    dev_call(d, D.StreamDestroy(mine[d]), "cuStreamDestroy");
    pop(d);
  }
  return NULL;
}

void test_threads(void) {
  pthread_t th[8];
  for (int i = 0; i < 8; i++)
    CHECK(pthread_create(&th[i], NULL, thread_body, (void *)(intptr_t)i) == 0);
  for (int i = 0; i < 8; i++)
    pthread_join(th[i], NULL);
  sim_clean("8 threads");
}

void test_shutdown_reuse(void) {
  fdp_shutdown();
  test_broadcast();
  int devs[2] = {0, 0};
  reduce_case(FDP_DTYPE_F32, 4, 2, devs, 0, -1, 100, g_stream, FDP_OK);
  fdp_shutdown();
  fdp_shutdown();
  int64_t sz[3] = {2, 4, 130};
  copy_case(0, g_ndev - 1, 4, sz, L_PADDED, L_TRANSPOSED, g_stream);
  sim_clean("shutdown then reuse");
}

/* ---- threads racing on first use (--race) ----
 * What fastdp makes lazily, once per device or device list (retained contexts, peer access, kernel modules and the
 * images they load, communicator sets, the facts read from them), must be made once and be visible to another
 * thread only when complete. Each round starts from nothing (fdp_shutdown), and RACERS threads released together
 * use all of it for the first time at once, while the simulator pauses inside each making call (module loads,
 * context retains, peer enables, communicator set-up) so that the threads overlap there. Results are checked, and
 * after each round's shutdown nothing may be left (a second copy of anything made twice would be). Built with
 * ThreadSanitizer too (tests/c/build.py --tsan), where an object read before it was published is a data race. */

#define RACERS 6
#define RACE_ROUNDS 3
static pthread_barrier_t g_race_start;

/* Where device `dev`'s kernels came from: "" until they are loaded. */
static size_t race_facts(int dev) {
  fdp_device_facts_t f;
  memset(&f, 0, sizeof f);
  CHECKF(fdp_device_facts(dev, FDP_FREE_IF_ACTIVE, &f) == FDP_OK, "device facts %d: %s", dev, fdp_last_error());
  size_t n = 0;
  while (f.kernels_source != NULL && n < 1024 && f.kernels_source[n] != '\0') /* byte by byte: each read is seen */
    n++;
  CHECK(f.kernels_source != NULL && n < 1024);
  return n;
}

/* Reads every device's facts while the other threads load their kernels, taking no lock of fastdp's in between:
 * only how the facts are published may order the reads after the writes. */
static void race_watch_facts(void) {
  for (int round = 0; round < 400; round++) {
    int loaded = 0;
    for (int d = 0; d < g_ndev; d++)
      loaded += race_facts(d) > 0;
    if (loaded == g_ndev) return;
    usleep(250);
  }
}

/* With FASTDP_DISABLE_FATBIN set, kernels come from NVRTC images: one thread drops the images kept in memory while
 * another thread's first module load (paused by the simulator) still reads one. */
static void race_forget_images(void) {
  if (!getenv("FASTDP_DISABLE_FATBIN")) return;
  for (int spin = 0; spin < 2000 && S.calls("cuModuleLoadData") < 2; spin++) /* device 0's, then another's */
    usleep(500);
  fdp_kernels_image_info_t info;
  CHECKF(fdp_kernels_image(90, 1, &info) == FDP_OK, "kernel image: %s", fdp_last_error());
}

static void *race_body(void *arg) {
  int id = (int)(intptr_t)arg;
  t_rng = 0x9e3779b97f4a7c15ull * (uint64_t)(id + 7);
  CUstream mine[FDP_MAX_DEVICES];
  for (int d = 0; d < g_ndev; d++) {
    push(d);
    dev_call(d, D.StreamCreate(&mine[d], 1), "cuStreamCreate");
    pop(d);
  }
  int a = id % g_ndev, b = (id + 1) % g_ndev;
  int64_t sz[3] = {2, 9, 70};
  int devs[3] = {a, a, a}, first[3] = {0, 0, 0};
  pthread_barrier_wait(&g_race_start);
  /* First, thread 0 loads device 0's kernels, and threads 1 and 2 use them right after they are published, without
   * taking the lock the loading thread held: only the publication itself may order their reads after the load's
   * writes. (They wait on the simulator's count of functions looked up, which orders nothing in fastdp.) */
  if (id < 3 && sim()) {
    if (id > 0) {
      for (int spin = 0; spin < 4000 && S.calls("cuModuleGetFunction") < 14; spin++)
        usleep(250);
      usleep(3000);
    }
    reduce_case(FDP_DTYPE_F32, 4, 3, first, 0, -1, 333, mine, FDP_OK);
  }
  pthread_barrier_wait(&g_race_start);
  if (id == RACERS - 1) race_forget_images();
  if (id == RACERS - 2) race_watch_facts();
  /* Each thread its own order, so that every kind of first use meets every other. */
  for (int step = 0; step < 4; step++) {
    switch ((step + id) % 4) {
    case 0: reduce_case(FDP_DTYPE_F32, 4, 3, devs, a, -1, 777, mine, FDP_OK); break; /* kernels on a */
    case 1: copy_case(a, b, 4, sz, L_TRANSPOSED, L_STEP2, mine); break;              /* contexts, peers, kernels */
    case 2: race_facts(a); break;
    default:
      if (g_ndev > 1 && fdp_backend_usable(FDP_BACKEND_NCCL, NULL) && !getenv("FASTDP_DISABLE_NCCL")) {
        /* Device lists that overlap other threads' (other roots, other lengths), several times, so that grouped
         * launches of threads meet on the devices they share. */
        int dsts[FDP_MAX_DEVICES], k = 1 + id % (g_ndev - 1);
        for (int j = 0; j < k; j++)
          dsts[j] = (a + 1 + j) % g_ndev;
        for (int rep = 0; rep < 4; rep++)
          bcast_order(a, dsts, k, mine);
      }
      break;
    }
  }
  for (int d = 0; d < g_ndev; d++) {
    push(d);
    dev_call(d, D.CtxSynchronize(), "cuCtxSynchronize");
    dev_call(d, D.StreamDestroy(mine[d]), "cuStreamDestroy");
    pop(d);
  }
  return NULL;
}

void race(void) {
  for (int round = 0; round < RACE_ROUNDS; round++) {
    fdp_shutdown();
    if (sim()) {
      sim_clean("before a race");
      S.pause("cuModuleLoadData", 20000, RACERS);
      S.pause("cuDevicePrimaryCtxRetain", 2000, 4 * RACERS);
      S.pause("cuCtxEnablePeerAccess", 2000, 4 * RACERS);
      S.pause("ncclCommInitAll", 5000, RACERS);
    }
    CHECK(pthread_barrier_init(&g_race_start, NULL, RACERS) == 0);
    pthread_t th[RACERS];
    for (int i = 0; i < RACERS; i++)
      CHECK(pthread_create(&th[i], NULL, race_body, (void *)(intptr_t)i) == 0);
    for (int i = 0; i < RACERS; i++)
      pthread_join(th[i], NULL);
    pthread_barrier_destroy(&g_race_start);
    sim_clean("threads racing on first use");
    fdp_shutdown();
    if (sim()) {
      /* Only the client's own references are left; anything made twice and kept once would be too. */
      CHECKF(S.stat("retains") == g_ndev, "after a race and shutdown: %lld context references, the client holds %d",
             S.stat("retains"), g_ndev);
      CHECKF(S.stat("modules") == 0 && S.stat("comms") == 0, "after a race and shutdown: %lld modules, %lld comms",
             S.stat("modules"), S.stat("comms"));
    }
  }
  printf("race: %d rounds of %d threads on first use%s\n", RACE_ROUNDS, RACERS,
         getenv("FASTDP_DISABLE_FATBIN") ? " (NVRTC images, one dropped during a load)" : "");
}
