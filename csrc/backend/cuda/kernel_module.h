/* SPDX-License-Identifier: MIT */
/* The cuda backend's kernels module, one per device: the fastdp kernels (build-time fatbin, else NVRTC's image of
 * kernel_image.c) loaded into the device's primary context on first use, their functions bound by name, and the
 * launch geometry every kernel of the backend uses (kernel_module.c). */
#ifndef FASTDP_BACKEND_CUDA_KERNEL_MODULE_H
#define FASTDP_BACKEND_CUDA_KERNEL_MODULE_H

#include "core/backend.h"
#include "dl/cuda_driver.h"

#include <stdint.h>

/* Threads per block of every launch: the kernels are grid-stride loops, so any grid covers any size. */
#define FDP_KERNEL_THREADS 256

typedef struct fdp_kmodule {
  CUmodule mod;
  CUfunction sum[FDP_DTYPE_COUNT];
  CUfunction copy[5]; /* element sizes 1, 2, 4, 8, 16 */
  unsigned int max_blocks;
} fdp_kmodule_t;

/* The kernels module of `dev`, loaded into its primary context on first use (thread-safe); *out stays valid until
 * fdp__kmodule_unload_all. Only an image the driver refuses is remembered (reported again without retrying until
 * shutdown); every other failure is retried by the next call. FDP_UNAVAILABLE when no kernels exist for this GPU:
 * the caller says what needed them (fdp__kmodule_needed), and the Python layer may fall back to torch. */
fdp_result_t fdp__kmodule_get(const fdp_cu_t *cu, int dev, const fdp_kmodule_t **out);
/* Prefixes the detail of a fdp__kmodule_get failure with what needed the kernels; returns FDP_UNAVAILABLE. */
fdp_result_t fdp__kmodule_needed(const char *what);
/* The blocks of a launch over n elements: enough for one element per thread, at most m's max_blocks. */
unsigned int fdp__kmodule_grid(const fdp_kmodule_t *m, int64_t n);
/* 1 when the module has a sum kernel for `dtype` (what the core checked before routing a sum here). */
int fdp__kmodule_has_sum(int dtype);
/* Unloads every device's module (after the device finishes what it was given; the caller promised no concurrent
 * calls); the next fdp__kmodule_get loads it again. */
void fdp__kmodule_unload_all(void);

#endif
