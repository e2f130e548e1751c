/* SPDX-License-Identifier: MIT */
/* The cuda backend's facts for `python -m fastdp info` (fdp_library_facts, fdp_device_facts): the driver's version,
 * each device's name, memory, peer access and where its kernels came from. Only reading free memory touches a GPU. */
#include "backend/cuda/facts.h"
#include "dl/cuda_driver.h"

#include <stdio.h>

void fdp__cuda_library_facts(fdp_library_facts_t *out) {
  const fdp_cu_t *cu;
  int v = 0;
  if (fdp__cu_load(&cu, NULL) != FDP_OK) return;
  if (cu->DriverGetVersion(&v) == CUDA_SUCCESS) out->version = v;
  out->devices = fdp__cu_device_count();
}

/* Free memory needs a context. One PyTorch (or fastdp) already made is used as it is; otherwise the primary
 * context is created just for the query and released again, so that asking costs no lasting GPU memory (but
 * costs the creation: FDP_FREE_IF_ACTIVE is for callers that must not). */
static fdp_result_t mem_info(const fdp_cu_t *cu, int device, CUdevice dev, size_t *free_bytes, size_t *total) {
  CUcontext ctx;
  /* Retain/release keeps an active context alive and drops one made only for this query. */
  FDP_CHECK(fdp__cu_check(cu->DevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain", device));
  fdp_result_t r = fdp__cu_check(cu->CtxPushCurrent(ctx), "cuCtxPushCurrent", device);
  if (r == FDP_OK) {
    CUcontext popped;
    r = fdp__cu_check(cu->MemGetInfo(free_bytes, total), "cuMemGetInfo", device);
    CUresult e = cu->CtxPopCurrent(&popped);
    if (r == FDP_OK) r = fdp__cu_check(e, "cuCtxPopCurrent", device);
  }
  CUresult e = cu->DevicePrimaryCtxRelease(dev);
  if (r == FDP_OK) r = fdp__cu_check(e, "cuDevicePrimaryCtxRelease", device);
  return r;
}

/* Whether the primary context of `dev` is active: cuDevicePrimaryCtxGetState reads it without retaining (creating)
 * the context. */
static int context_active(const fdp_cu_t *cu, CUdevice dev) {
  unsigned int flags = 0;
  int active = 0;
  return cu->DevicePrimaryCtxGetState(dev, &flags, &active) == CUDA_SUCCESS && active != 0;
}

fdp_result_t fdp__cuda_device_facts(int device, fdp_free_read_t free_read, fdp_device_facts_t *out) {
  const fdp_cu_t *cu;
  CUdevice dev;
  size_t total = 0, avail = 0;
  FDP_CHECK(fdp__cu_load(&cu, NULL));
  int count = fdp__cu_device_count();
  if (device < 0 || device >= count)
    return fdp__fail(FDP_INVALID, "CUDA device %d does not exist (%d visible)", device, count);
  FDP_CHECK(fdp__cu_check(cu->DeviceGet(&dev, device), "cuDeviceGet", device));
  out->kernels_source = fdp__cuda_kernels_source(device);
  out->active = context_active(cu, dev);
  FDP_CHECK(fdp__cu_check(cu->DeviceGetName(out->name, (int)sizeof out->name, dev), "cuDeviceGetName", device));
  out->name[sizeof out->name - 1] = '\0';
  FDP_CHECK(fdp__cu_check(cu->DeviceTotalMem(&total, dev), "cuDeviceTotalMem", device));
  out->total_bytes = total;
  if (free_read == FDP_FREE_ALWAYS || (free_read == FDP_FREE_IF_ACTIVE && out->active)) {
    FDP_CHECK(mem_info(cu, device, dev, &avail, &total));
    out->free_bytes = avail;
    out->free_read = 1;
  }
  return FDP_OK;
}

int fdp__cuda_can_access_peer(int device, int peer) {
  const fdp_cu_t *cu;
  CUdevice a, b;
  int can = 0;
  if (fdp__cu_load(&cu, NULL) != FDP_OK) return 0;
  int count = fdp__cu_device_count();
  if (device < 0 || peer < 0 || device >= count || peer >= count || device == peer) return 0;
  if (cu->DeviceGet(&a, device) != CUDA_SUCCESS || cu->DeviceGet(&b, peer) != CUDA_SUCCESS) return 0;
  if (cu->DeviceCanAccessPeer(&can, a, b) != CUDA_SUCCESS) return 0;
  return can;
}
