/* SPDX-License-Identifier: MIT */
/* Every FASTDP_* environment knob, declared once with its default, read once per process. */
#include "base/base.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

static const struct {
  const char *name;
  int64_t def;
  int is_str; /* a string (folder or file name), read by fdp_param_str; fdp_param gives 0 */
} table[FDP_PARAM_COUNT] = {
    [FDP_PARAM_DEBUG] = {"FASTDP_DEBUG", 0},
    [FDP_PARAM_HOST_THREADS] = {"FASTDP_HOST_THREADS", 0},
    /* Threads are started per call: below 16 MiB per call that costs more than they gain (docs/benchmarks.md). */
    [FDP_PARAM_HOST_PARALLEL_MIN] = {"FASTDP_HOST_PARALLEL_MIN", 16 << 20},
    [FDP_PARAM_DISABLE_NCCL] = {"FASTDP_DISABLE_NCCL", 0},
    [FDP_PARAM_DISABLE_CUDA] = {"FASTDP_DISABLE_CUDA", 0},
    [FDP_PARAM_CUDA_DRIVER_LIBRARY] = {"FASTDP_CUDA_DRIVER_LIBRARY", 0, 1},
    [FDP_PARAM_NCCL_LIBRARY] = {"FASTDP_NCCL_LIBRARY", 0, 1},
    [FDP_PARAM_DISABLE_NVRTC] = {"FASTDP_DISABLE_NVRTC", 0},
    [FDP_PARAM_DISABLE_FATBIN] = {"FASTDP_DISABLE_FATBIN", 0},
    [FDP_PARAM_KERNEL_CACHE] = {"FASTDP_KERNEL_CACHE", 1},
    [FDP_PARAM_STRICT] = {"FASTDP_STRICT", 0},
    [FDP_PARAM_CACHE_DIR] = {"FASTDP_CACHE_DIR", 0, 1},
    [FDP_PARAM_NVRTC_LIBRARY] = {"FASTDP_NVRTC_LIBRARY", 0, 1},
    [FDP_PARAM_TENSOR_PATH] = {"FASTDP_TENSOR_PATH", 0, 1},
    /* Comma-separated aoti_torch_* names the binding treats as absent: how a torch without them behaves, on any
     * torch (the tests hide each entry point in turn). */
    [FDP_PARAM_SHIM_ABSENT] = {"FASTDP_SHIM_ABSENT", 0, 1},
};

static int64_t values[FDP_PARAM_COUNT];
static char *strings[FDP_PARAM_COUNT]; /* copies, so later setenv calls cannot pull them away; never freed */
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void load(void) {
  for (int i = 0; i < FDP_PARAM_COUNT; i++) {
    const char *s = getenv(table[i].name);
    if (table[i].is_str) {
      strings[i] = s && *s ? strdup(s) : NULL;
      values[i] = 0;
      continue;
    }
    char *end = NULL;
    long long v = s && *s ? strtoll(s, &end, 0) : 0;
    /* An unparsable value keeps the default rather than failing every call. */
    values[i] = (s && *s && end && *end == '\0') ? (int64_t)v : table[i].def;
  }
}

int64_t fdp_param(fdp_param_t p) {
  pthread_once(&once, load);
  return (unsigned)p < FDP_PARAM_COUNT ? values[p] : 0;
}

const char *fdp_param_str(fdp_param_t p) {
  pthread_once(&once, load);
  return (unsigned)p < FDP_PARAM_COUNT ? strings[p] : NULL;
}

const char *fdp_param_name(fdp_param_t p) {
  return (unsigned)p < FDP_PARAM_COUNT ? table[p].name : "?";
}
