/* SPDX-License-Identifier: MIT */
/* Every core operation through the cuda and nccl backends on CUDA devices, compared bit for bit with a host
 * reference computed here: copies (row copies, strided sources and destinations on both sides, host<->device,
 * peer), broadcast, scatter, gather, reduce (collective and local, 70 inputs with the output aliasing one),
 * coalesced buckets, 8 threads at once, shutdown then reuse. Uses only fastdp.h plus the driver itself (dlopen,
 * as PyTorch would) for memory and streams. On the simulated GPU (FASTDP_CUDA_DRIVER_LIBRARY naming tests/sim's
 * library) it also fails on any misuse or race the simulator recorded, checks that nothing leaked, and
 * `--sweep` makes every driver/NCCL call of every operation fail in turn. Built by tests/c/build.py --gpu-ops;
 * prints "N passed, M failed" and exits nonzero on a failure. This file is the program: which parts run for which
 * flags, and main; the parts live in gpu_ops_*.c, with what they share in gpu_ops_harness.c. */
#include "gpu_ops_harness.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Nothing fastdp made is left. After pairs of failures, a communicator whose abort failed stays behind by
 * necessity (pairs = 1 skips communicators). */
static void leak_check(int pairs) {
  if (!sim()) return;
  static const char *const names[] = {"allocations", "streams", "events", "modules",
                                      "pushes",      "retains", "comms",  "groups"};
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
    if (pairs && strcmp(names[i], "comms") == 0) continue;
    long long v = S.stat(names[i]);
    CHECKF(v == 0, "after shutdown and release, %lld %s are still live", v, names[i]);
  }
}

/* The route the core picks, and that operations then take: NCCL for one buffer on each of several devices (when
 * it loads), the cuda backend for repeated ids and single-device sums, the host backend for host buffers. */
static void test_route(void) {
  fdp_backend_id_t id = FDP_BACKEND_COUNT;
  int same[2] = {0, 0}, host[2] = {FDP_HOST, FDP_HOST}, spread[FDP_MAX_DEVICES];
  for (int d = 0; d < g_ndev; d++)
    spread[d] = g_ndev - 1 - d; /* any order: the root is whichever comes first */
  OK(fdp_route_devices(FDP_OP_BROADCAST, same, 2, FDP_DTYPE_F32, &id));
  CHECK(id == FDP_BACKEND_CUDA);
  OK(fdp_route_devices(FDP_OP_REDUCE, same, 2, FDP_DTYPE_F32, &id));
  CHECK(id == FDP_BACKEND_CUDA);
  OK(fdp_route_devices(FDP_OP_BROADCAST, host, 2, FDP_DTYPE_F32, &id));
  CHECK(id == FDP_BACKEND_HOST);
  OK(fdp_route_devices(FDP_OP_BROADCAST, spread, 1, FDP_DTYPE_F32, &id));
  CHECK(id == FDP_BACKEND_CUDA);
  if (g_ndev < 2 || !fdp_backend_usable(FDP_BACKEND_NCCL, NULL) || getenv("FASTDP_DISABLE_NCCL")) return;
  OK(fdp_route_devices(FDP_OP_BROADCAST, spread, g_ndev, FDP_DTYPE_BOOL, &id)); /* bytes: any dtype */
  CHECK(id == FDP_BACKEND_NCCL);
  OK(fdp_route_devices(FDP_OP_REDUCE, spread, g_ndev, FDP_DTYPE_F32, &id));
  CHECK(id == FDP_BACKEND_NCCL);
  /* ncclSum is no logical or, and NCCL has no int16: sums of those across devices have no backend */
  CHECK(fdp_route_devices(FDP_OP_REDUCE, spread, g_ndev, FDP_DTYPE_BOOL, &id) == FDP_UNAVAILABLE);
  CHECK(fdp_route_devices(FDP_OP_REDUCE, spread, g_ndev, FDP_DTYPE_I16, &id) == FDP_UNAVAILABLE);
}

int main(int argc, char **argv) {
  int do_sweep = 0, pairs = 0, do_race = 0;
  const char *only = NULL;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--sweep") == 0) do_sweep = 1;
    if (strcmp(argv[i], "--pairs") == 0) do_sweep = pairs = 1;
    if (strcmp(argv[i], "--race") == 0) do_race = 1;
    if (strcmp(argv[i], "--only") == 0 && i + 1 < argc) only = argv[++i];
  }
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (!driver_open(!do_race) || g_ndev < 1) {
    printf("skipped: no usable CUDA driver or device\n");
    return 77;
  }
  t_home_ctx = g_ctx[0];
  printf("%d device(s), %s\n", g_ndev, sim() ? "simulated GPU (misuse and race checks on)" : "real driver");
  const char *route = getenv("SIMGPU_ALLOCATOR");
  int caching = route != NULL && strcmp(route, "caching") == 0;
  if (caching) {
    /* Scratch memory from a caching allocator, as every PyTorch user's process has it (the binding registers
     * PyTorch's), instead of the driver's pool. */
    if (!sim() || S.cache_alloc == NULL) {
      printf("skipped: SIMGPU_ALLOCATOR=caching needs the simulated GPU\n");
      return 77;
    }
    fdp_allocator_t cache = {S.cache_alloc, S.cache_free, NULL};
    fdp_set_device_allocator(&cache);
  }
  printf("scratch memory: %s\n", caching ? "the simulated caching allocator (registered)" : "the driver's pool");
  const char *why = NULL;
  CHECKF(fdp_backend_usable(FDP_BACKEND_CUDA, &why), "the cuda backend is not usable: %s", why ? why : "");
  if (sim()) S.reset();
  if (do_race) {
    race();
  } else if (do_sweep) {
    if (!sim())
      printf("skipped: the fault-injection sweep needs the simulated GPU\n");
    else
      sweep(only, pairs);
  } else {
    test_copies();
    test_broadcast();
    test_scatter_gather();
    test_reduce();
    test_reduce_on_own_streams();
    test_reduce_passes();
    test_coalesced();
    test_threads();
    test_shutdown_reuse();
    test_order();
    test_nccl_bytes();
    test_kernel_many_elements();
    test_misaligned();
    test_kernel_wide_offsets();
    test_kernel_huge_sum();
    test_nccl_async_error();
    test_route();
    if (sim()) {
      sim_clean("end");
      sim_paths_report(caching);
    }
  }
  fdp_shutdown();
  if (caching) {
    fdp_set_device_allocator(NULL);
    S.cache_trim(); /* the blocks it holds as free go back before the contexts do (torch.cuda.empty_cache) */
  }
  if (do_sweep && sim()) {
    /* A failed free or destroy may leave its object behind by necessity; those go with the contexts. */
    sim_clean("sweep");
    driver_close();
    S.reset();
  } else {
    driver_close();
    sim_clean("shutdown");
  }
  leak_check(pairs);
  printf("%d passed, %d failed\n", n_pass, n_fail);
  return n_fail ? 1 : 0;
}
