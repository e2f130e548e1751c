/* The simulated driver's front: cuInit, its version, the names and texts of its errors, and what it reports of
 * each device (count, name, memory, attributes, whether it can reach a peer). The devices themselves are set up
 * from the environment in sim_state.c. */

#include "sim_driver.h"

#include <stdio.h>

CUresult cuInit(unsigned int flags) {
  ENTER(cuInit);
  if (flags != 0) RETURN(CUDA_ERROR_INVALID_VALUE);
  g_inited = 1;
  RETURN(CUDA_SUCCESS);
}

CUresult cuDriverGetVersion(int *v) {
  ENTER(cuDriverGetVersion);
  if (!v) RETURN(CUDA_ERROR_INVALID_VALUE);
  *v = 13000;
  RETURN(CUDA_SUCCESS);
}

/* Private tables of the real driver that other NVIDIA libraries (NVRTC, the runtime) ask for: none here, so that a
 * library loaded beside the simulator sees "not supported" rather than resolving nothing. */
struct CUuuid_st; /* cuda.h's CUuuid; only pointed to here */
CUresult cuGetExportTable(const void **table, const struct CUuuid_st *id) {
  (void)id;
  if (table) *table = NULL;
  return CUDA_ERROR_NOT_SUPPORTED;
}

static const struct {
  int code;
  const char *name, *text;
} k_errs[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_DEINITIALIZED, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_IMAGE, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_NO_BINARY_FOR_GPU, "CUDA_ERROR_NO_BINARY_FOR_GPU", "no kernel image is available for execution"},
    {CUDA_ERROR_INVALID_PTX, "CUDA_ERROR_INVALID_PTX", "a PTX JIT compilation failed"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {CUDA_ERROR_MISALIGNED_ADDRESS, "CUDA_ERROR_MISALIGNED_ADDRESS", "misaligned address"},
    {CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", "too many resources requested"},
    {CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED, "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED",
     "peer access is already enabled"},
    {CUDA_ERROR_PEER_ACCESS_NOT_ENABLED, "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED", "peer access has not been enabled"},
    {CUDA_ERROR_CONTEXT_IS_DESTROYED, "CUDA_ERROR_CONTEXT_IS_DESTROYED", "context is destroyed"},
    {CUDA_ERROR_LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

static int err_index(CUresult r) {
  for (size_t i = 0; i < sizeof k_errs / sizeof k_errs[0]; i++)
    if (k_errs[i].code == (int)r) return (int)i;
  return -1;
}

CUresult cuGetErrorString(CUresult r, const char **s) {
  ENTER(cuGetErrorString);
  int i = err_index(r);
  if (!s) RETURN(CUDA_ERROR_INVALID_VALUE);
  *s = i >= 0 ? k_errs[i].text : NULL;
  RETURN(i >= 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE);
}

CUresult cuGetErrorName(CUresult r, const char **s) {
  ENTER(cuGetErrorName);
  int i = err_index(r);
  if (!s) RETURN(CUDA_ERROR_INVALID_VALUE);
  *s = i >= 0 ? k_errs[i].name : NULL;
  RETURN(i >= 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE);
}

CUresult cuDeviceGetCount(int *n) {
  ENTER(cuDeviceGetCount);
  NEED_INIT(cuDeviceGetCount);
  if (!n) RETURN(CUDA_ERROR_INVALID_VALUE);
  *n = g_ndev;
  RETURN(CUDA_SUCCESS);
}

CUresult cuDeviceGet(CUdevice *dev, int ordinal) {
  ENTER(cuDeviceGet);
  NEED_INIT(cuDeviceGet);
  CHECK_DEV(cuDeviceGet, ordinal);
  *dev = ordinal;
  RETURN(CUDA_SUCCESS);
}

CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
  ENTER(cuDeviceGetName);
  NEED_INIT(cuDeviceGetName);
  CHECK_DEV(cuDeviceGetName, dev);
  if (!name || len <= 0) RETURN(CUDA_ERROR_INVALID_VALUE);
  snprintf(name, (size_t)len, "fastdp simulated GPU %d", dev);
  RETURN(CUDA_SUCCESS);
}

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
  ENTER(cuDeviceTotalMem_v2);
  NEED_INIT(cuDeviceTotalMem_v2);
  CHECK_DEV(cuDeviceTotalMem_v2, dev);
  *bytes = g_mem_total;
  RETURN(CUDA_SUCCESS);
}

CUresult cuDeviceGetAttribute(int *v, CUdevice_attribute attr, CUdevice dev) {
  ENTER(cuDeviceGetAttribute);
  NEED_INIT(cuDeviceGetAttribute);
  CHECK_DEV(cuDeviceGetAttribute, dev);
  switch ((int)attr) {
  case CU_DEVICE_ATTRIBUTE_MAX_PITCH: *v = 2147483647; break;
  case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *v = g_sms; break;
  case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: *v = 1; break;
  case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *v = 9; break;
  case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *v = 0; break;
  default: RETURN(CUDA_ERROR_INVALID_VALUE);
  }
  RETURN(CUDA_SUCCESS);
}

CUresult cuDeviceCanAccessPeer(int *can, CUdevice dev, CUdevice peer) {
  ENTER(cuDeviceCanAccessPeer);
  NEED_INIT(cuDeviceCanAccessPeer);
  CHECK_DEV(cuDeviceCanAccessPeer, dev);
  CHECK_DEV(cuDeviceCanAccessPeer, peer);
  *can = dev != peer && sim_env_ll("SIMGPU_NO_PEER", 0) == 0;
  RETURN(CUDA_SUCCESS);
}
