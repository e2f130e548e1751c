/* SPDX-License-Identifier: MIT */
/* The cuda backend's scratch memory (scratch.c): staging buffers and partial sums, from the allocator registered
 * with fdp_set_device_allocator or from the driver's stream-ordered pool, allocated and freed on one stream (NOTE
 * [scratch memory] in scratch.c). */
#ifndef FASTDP_BACKEND_CUDA_SCRATCH_H
#define FASTDP_BACKEND_CUDA_SCRATCH_H

#include "core/backend.h"
#include "dl/cuda_driver.h"

#include <stddef.h>

typedef struct fdp_cuda_scratch {
  CUdeviceptr ptr; /* 0: nothing held */
  void *handle;    /* the registered allocator's handle; unused for the driver pool */
  int hooked;      /* 1: from `via`, 0: from cuMemAllocAsync */
  int dev;
  CUstream stream;
  fdp_allocator_t via;
} fdp_cuda_scratch_t;

/* `bytes` of device memory on `dev`, usable by work enqueued on `stream` from now on; dev's context is current.
 * `what` says what the memory is for, in the detail of a failure. Nothing is held on failure. */
fdp_result_t fdp__cuda_scratch_alloc(const fdp_cu_t *cu, int dev, CUstream stream, size_t bytes, const char *what,
                                     fdp_cuda_scratch_t *s);
/* Gives the memory back, ordered after the work enqueued on its stream so far; a no-op when nothing is held.
 * s->dev's context is current. */
fdp_result_t fdp__cuda_scratch_free(const fdp_cu_t *cu, fdp_cuda_scratch_t *s);

#endif
