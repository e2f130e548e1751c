/* SPDX-License-Identifier: MIT */
/* The cuda backend's table: strided copies between CUDA tensors on any devices and between host memory and a
 * device (copy.c), the in-order k-way sum on one device (sum.c), all through the driver API on the streams the
 * caller lists, with the fastdp kernels loaded once per device where a layout or a sum needs them
 * (kernel_module.c); machine facts (facts.c) and fences (fence.c). */
#include "backend/cuda/copy.h"
#include "backend/cuda/facts.h"
#include "backend/cuda/fence.h"
#include "backend/cuda/kernel_module.h"
#include "backend/cuda/sum.h"
#include "core/backend.h"
#include "dl/cuda_driver.h"

/* Usable when the driver loads and sees a device. Kernels are not part of it: copies the copy engines can do
 * never need them, and an op that does reports why they are missing (fdp__kmodule_get). */
static int cuda_usable(const char **why) {
  const fdp_cu_t *cu;
  const char *w = NULL;
  if (fdp__cu_load(&cu, &w) != FDP_OK) goto no;
  if (fdp__cu_device_count() < 1) {
    w = "no CUDA device is visible";
    goto no;
  }
  return 1;
no:
  if (why) *why = w;
  return 0;
}

/* Copies with a CUDA side (host memory on the other side too: staged through the host backend via the core), and
 * sums whose inputs all sit on the output's device. Broadcasts are copies here. */
static int cuda_can(fdp_op_t op, const fdp_tensor_t *const *ts, int n) {
  int cuda = 0, local = 1;
  for (int i = 0; i < n; i++) {
    cuda |= ts[i]->device != FDP_HOST;
    local &= ts[i]->device == ts[n - 1]->device;
  }
  switch (op) {
  case FDP_OP_COPY: return cuda;
  case FDP_OP_REDUCE: return cuda && local;
  default: return 0;
  }
}

/* Unloads the kernel modules (after the device finishes what it was given; the caller promised no concurrent
 * calls) and releases the primary contexts retained here. */
static void cuda_shutdown(void) {
  fdp__kmodule_unload_all();
  fdp__cu_ctx_release_all();
}

const fdp_backend_t fdp__backend_cuda = {
    .name = "cuda",
    .id = FDP_BACKEND_CUDA,
    .usable = cuda_usable,
    .can = cuda_can,
    .copy = fdp__cuda_copy,
    .reduce = fdp__cuda_reduce,
    .broadcast = NULL,
    .shutdown = cuda_shutdown,
    .library_facts = fdp__cuda_library_facts,
    .device_facts = fdp__cuda_device_facts,
    .can_access_peer = fdp__cuda_can_access_peer,
    .fence_record = fdp__cuda_fence_record,
    .fence_wait = fdp__cuda_fence_wait,
    .fence_query = fdp__cuda_fence_query,
    .fence_free = fdp__cuda_fence_free,
};
