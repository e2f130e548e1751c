/* SPDX-License-Identifier: MIT */
/* Machine facts for `python -m fastdp info`: driver and NCCL versions, devices, memory, peer access. Every
 * fact reads as absent where the driver or NCCL cannot be loaded. Only the free-memory query touches a GPU. */
#include "fastdp.h"
#include "backend.h"

#include <stdio.h>

#include "dl/cuda_driver.h"
#include "dl/nccl_api.h"

int fdp_cuda_driver_version(void) {
  const fdp_cu_t *cu;
  int v = 0;
  if (fdp__cu_load(&cu, NULL) != FDP_OK || cu->DriverGetVersion(&v) != CUDA_SUCCESS) return 0;
  return v;
}

int fdp_nccl_version(void) {
  const fdp_nccl_api_t *api;
  return fdp__nccl_load(&api, NULL) == FDP_OK ? api->version : 0;
}

const char *fdp_nccl_library(void) {
  const fdp_nccl_api_t *api;
  return fdp__nccl_load(&api, NULL) == FDP_OK ? api->path : "";
}

int fdp_cuda_device_count(void) {
  return fdp__cu_device_count();
}

/* Free memory needs a context. One PyTorch (or fastdp) already made is used as it is; otherwise the primary
 * context is created just for the query and released again, so that asking costs no lasting GPU memory (but
 * costs the creation: see fdp_cuda_device_active for callers that must not). */
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

fdp_result_t fdp_cuda_device_info(int device, char *name, size_t name_len, size_t *total_bytes, size_t *free_bytes) {
  const fdp_cu_t *cu;
  CUdevice dev;
  size_t total = 0, avail = 0;
  if (name != NULL && name_len > 0) name[0] = '\0';
  if (total_bytes) *total_bytes = 0;
  if (free_bytes) *free_bytes = 0;
  FDP_CHECK(fdp__cu_load(&cu, NULL));
  int count = fdp__cu_device_count();
  if (device < 0 || device >= count)
    return fdp__fail(FDP_INVALID, "CUDA device %d does not exist (%d visible)", device, count);
  FDP_CHECK(fdp__cu_check(cu->DeviceGet(&dev, device), "cuDeviceGet", device));
  if (name != NULL && name_len > 0) {
    int len = name_len > 1024 ? 1024 : (int)name_len;
    FDP_CHECK(fdp__cu_check(cu->DeviceGetName(name, len, dev), "cuDeviceGetName", device));
    name[name_len - 1] = '\0';
  }
  FDP_CHECK(fdp__cu_check(cu->DeviceTotalMem(&total, dev), "cuDeviceTotalMem", device));
  if (free_bytes != NULL) FDP_CHECK(mem_info(cu, device, dev, &avail, &total));
  if (total_bytes) *total_bytes = total;
  if (free_bytes) *free_bytes = avail;
  return FDP_OK;
}

int fdp_cuda_can_access_peer(int device, int peer) {
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

int fdp_cuda_device_active(int device) {
  const fdp_cu_t *cu;
  CUdevice dev;
  unsigned int flags = 0;
  int active = 0;
  if (fdp__cu_load(&cu, NULL) != FDP_OK || device < 0 || device >= fdp__cu_device_count()) return 0;
  if (cu->DeviceGet(&dev, device) != CUDA_SUCCESS) return 0;
  /* cuDevicePrimaryCtxGetState reads the state without retaining (creating) the context. */
  if (cu->DevicePrimaryCtxGetState(dev, &flags, &active) != CUDA_SUCCESS) return 0;
  return active != 0;
}
