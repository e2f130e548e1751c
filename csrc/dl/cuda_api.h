/* SPDX-License-Identifier: MIT */
/* The part of the CUDA driver API (cuda.h) that fastdp uses: types, enum values and parameter structs, written
 * here so that the build needs no CUDA toolkit. Values and layouts are the driver's ABI (stable across CUDA 11,
 * 12 and 13); tests/test_cuda_api_header.py compares them with the toolkit's cuda.h wherever one is installed. */
#ifndef FASTDP_DL_CUDA_API_H
#define FASTDP_DL_CUDA_API_H

#include <stddef.h>

#ifndef __cuda_cuda_h__ /* a translation unit that also includes the toolkit's cuda.h uses its declarations */

typedef unsigned long long CUdeviceptr;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUarray_st *CUarray;
typedef struct CUevent_st *CUevent;
typedef struct CUstream_st *CUstream;

/* Only the codes fastdp names; the driver may return any other value, which is passed through as an int. */
typedef enum cudaError_enum {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_INVALID_VALUE = 1,
  CUDA_ERROR_OUT_OF_MEMORY = 2,
  CUDA_ERROR_NOT_INITIALIZED = 3,
  CUDA_ERROR_DEINITIALIZED = 4,
  CUDA_ERROR_STUB_LIBRARY = 34,
  CUDA_ERROR_DEVICE_UNAVAILABLE = 46,
  CUDA_ERROR_NO_DEVICE = 100,
  CUDA_ERROR_INVALID_DEVICE = 101,
  CUDA_ERROR_INVALID_IMAGE = 200,
  CUDA_ERROR_INVALID_CONTEXT = 201,
  CUDA_ERROR_NO_BINARY_FOR_GPU = 209,
  CUDA_ERROR_PEER_ACCESS_UNSUPPORTED = 217,
  CUDA_ERROR_INVALID_PTX = 218,
  CUDA_ERROR_JIT_COMPILER_NOT_FOUND = 221,
  CUDA_ERROR_UNSUPPORTED_PTX_VERSION = 222,
  CUDA_ERROR_JIT_COMPILATION_DISABLED = 223,
  CUDA_ERROR_INVALID_SOURCE = 300,
  CUDA_ERROR_INVALID_HANDLE = 400,
  CUDA_ERROR_ILLEGAL_STATE = 401,
  CUDA_ERROR_NOT_FOUND = 500,
  CUDA_ERROR_NOT_READY = 600,
  CUDA_ERROR_ILLEGAL_ADDRESS = 700,
  CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES = 701,
  CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704,
  CUDA_ERROR_PEER_ACCESS_NOT_ENABLED = 705,
  CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE = 708,
  CUDA_ERROR_CONTEXT_IS_DESTROYED = 709,
  CUDA_ERROR_MISALIGNED_ADDRESS = 716,
  CUDA_ERROR_LAUNCH_FAILED = 719,
  CUDA_ERROR_NOT_PERMITTED = 800,
  CUDA_ERROR_NOT_SUPPORTED = 801,
  CUDA_ERROR_SYSTEM_DRIVER_MISMATCH = 803,
  CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE = 804,
  CUDA_ERROR_UNKNOWN = 999
} CUresult;

typedef enum CUdevice_attribute_enum {
  CU_DEVICE_ATTRIBUTE_MAX_PITCH = 11,
  CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16,
  CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING = 41,
  CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75,
  CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76
} CUdevice_attribute;

typedef enum CUevent_flags_enum {
  CU_EVENT_DEFAULT = 0x0,
  CU_EVENT_BLOCKING_SYNC = 0x1,
  CU_EVENT_DISABLE_TIMING = 0x2
} CUevent_flags;

typedef enum CUmemorytype_enum {
  CU_MEMORYTYPE_HOST = 0x01,
  CU_MEMORYTYPE_DEVICE = 0x02,
  CU_MEMORYTYPE_ARRAY = 0x03,
  CU_MEMORYTYPE_UNIFIED = 0x04
} CUmemorytype;

/* cuMemcpy2DAsync_v2's parameters (CUDA_MEMCPY2D_v2 in cuda.h). */
typedef struct CUDA_MEMCPY2D_st {
  size_t srcXInBytes;
  size_t srcY;
  CUmemorytype srcMemoryType;
  const void *srcHost;
  CUdeviceptr srcDevice;
  CUarray srcArray;
  size_t srcPitch;
  size_t dstXInBytes;
  size_t dstY;
  CUmemorytype dstMemoryType;
  void *dstHost;
  CUdeviceptr dstDevice;
  CUarray dstArray;
  size_t dstPitch;
  size_t WidthInBytes;
  size_t Height;
} CUDA_MEMCPY2D;

/* cuMemcpy3DPeerAsync's parameters (CUDA_MEMCPY3D_PEER_v1 in cuda.h). */
typedef struct CUDA_MEMCPY3D_PEER_st {
  size_t srcXInBytes;
  size_t srcY;
  size_t srcZ;
  size_t srcLOD;
  CUmemorytype srcMemoryType;
  const void *srcHost;
  CUdeviceptr srcDevice;
  CUarray srcArray;
  CUcontext srcContext;
  size_t srcPitch;
  size_t srcHeight;
  size_t dstXInBytes;
  size_t dstY;
  size_t dstZ;
  size_t dstLOD;
  CUmemorytype dstMemoryType;
  void *dstHost;
  CUdeviceptr dstDevice;
  CUarray dstArray;
  CUcontext dstContext;
  size_t dstPitch;
  size_t dstHeight;
  size_t WidthInBytes;
  size_t Height;
  size_t Depth;
} CUDA_MEMCPY3D_PEER;

#endif /* __cuda_cuda_h__ */

/* NOTE [driver entry points]: every driver entry point fastdp calls, declared once here and derived everywhere else
 * (the loader's table and its symbol list in dl/cuda_driver.*, the simulated driver in tests/sim, the check against
 * the toolkit's cuda.h in tests/test_cuda_api_header.py). Adding a call is one line:
 *   X(field, symbol, optional, (parameters))
 * `field` names the pointer in fdp_cu_t; `symbol` is the explicit versioned name dlsym binds (cuda.h maps e.g.
 * cuMemGetInfo to cuMemGetInfo_v2 by macro, and an unversioned dlsym would bind the legacy ABI with 32-bit sizes);
 * `optional` is 1 when a missing symbol only loses a feature: stream-ordered allocation (driver >= 11.2) is used
 * only to stage strided cross-device copies. Every entry point returns CUresult. */
#define FDP_CU_ENTRY_POINTS(X)                                                                                         \
  X(Init, cuInit, 0, (unsigned int flags))                                                                             \
  X(DriverGetVersion, cuDriverGetVersion, 0, (int *version))                                                           \
  X(GetErrorString, cuGetErrorString, 0, (CUresult r, const char **str))                                               \
  X(GetErrorName, cuGetErrorName, 0, (CUresult r, const char **str))                                                   \
  X(DeviceGetCount, cuDeviceGetCount, 0, (int *count))                                                                 \
  X(DeviceGet, cuDeviceGet, 0, (CUdevice *dev, int ordinal))                                                           \
  X(DeviceGetName, cuDeviceGetName, 0, (char *name, int len, CUdevice dev))                                            \
  X(DeviceTotalMem, cuDeviceTotalMem_v2, 0, (size_t *bytes, CUdevice dev))                                             \
  X(DeviceGetAttribute, cuDeviceGetAttribute, 0, (int *value, CUdevice_attribute attr, CUdevice dev))                  \
  X(DeviceCanAccessPeer, cuDeviceCanAccessPeer, 0, (int *can, CUdevice dev, CUdevice peer))                            \
  X(DevicePrimaryCtxRetain, cuDevicePrimaryCtxRetain, 0, (CUcontext *ctx, CUdevice dev))                               \
  X(DevicePrimaryCtxRelease, cuDevicePrimaryCtxRelease_v2, 0, (CUdevice dev))                                          \
  X(DevicePrimaryCtxGetState, cuDevicePrimaryCtxGetState, 0, (CUdevice dev, unsigned int *flags, int *active))         \
  X(CtxPushCurrent, cuCtxPushCurrent_v2, 0, (CUcontext ctx))                                                           \
  X(CtxPopCurrent, cuCtxPopCurrent_v2, 0, (CUcontext *ctx))                                                            \
  X(CtxGetCurrent, cuCtxGetCurrent, 0, (CUcontext *ctx))                                                               \
  X(CtxSetCurrent, cuCtxSetCurrent, 0, (CUcontext ctx))                                                                \
  X(CtxSynchronize, cuCtxSynchronize, 0, (void))                                                                       \
  X(CtxEnablePeerAccess, cuCtxEnablePeerAccess, 0, (CUcontext peer, unsigned int flags))                               \
  X(MemGetInfo, cuMemGetInfo_v2, 0, (size_t *free_bytes, size_t *total_bytes))                                         \
  X(MemAlloc, cuMemAlloc_v2, 0, (CUdeviceptr *ptr, size_t bytes))                                                      \
  X(MemFree, cuMemFree_v2, 0, (CUdeviceptr ptr))                                                                       \
  X(MemAllocAsync, cuMemAllocAsync, 1, (CUdeviceptr *ptr, size_t bytes, CUstream stream))                              \
  X(MemFreeAsync, cuMemFreeAsync, 1, (CUdeviceptr ptr, CUstream stream))                                               \
  X(MemcpyAsync, cuMemcpyAsync, 0, (CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream))                  \
  X(MemcpyHtoDAsync, cuMemcpyHtoDAsync_v2, 0, (CUdeviceptr dst, const void *src, size_t bytes, CUstream stream))       \
  X(MemcpyDtoHAsync, cuMemcpyDtoHAsync_v2, 0, (void *dst, CUdeviceptr src, size_t bytes, CUstream stream))             \
  X(StreamSynchronize, cuStreamSynchronize, 0, (CUstream stream))                                                      \
  X(StreamQuery, cuStreamQuery, 0, (CUstream stream))                                                                  \
  X(MemcpyPeerAsync, cuMemcpyPeerAsync, 0, (CUdeviceptr dst, CUcontext dst_ctx, CUdeviceptr src,                       \
    CUcontext src_ctx, size_t bytes, CUstream stream))                                                                 \
  X(Memcpy2DAsync, cuMemcpy2DAsync_v2, 0, (const CUDA_MEMCPY2D *p, CUstream stream))                                   \
  X(Memcpy3DPeerAsync, cuMemcpy3DPeerAsync, 0, (const CUDA_MEMCPY3D_PEER *p, CUstream stream))                         \
  X(EventCreate, cuEventCreate, 0, (CUevent *ev, unsigned int flags))                                                  \
  X(EventRecord, cuEventRecord, 0, (CUevent ev, CUstream stream))                                                      \
  X(EventDestroy, cuEventDestroy_v2, 0, (CUevent ev))                                                                  \
  X(EventSynchronize, cuEventSynchronize, 0, (CUevent ev))                                                             \
  X(EventQuery, cuEventQuery, 0, (CUevent ev))                                                                         \
  X(StreamWaitEvent, cuStreamWaitEvent, 0, (CUstream stream, CUevent ev, unsigned int flags))                          \
  X(ModuleLoadData, cuModuleLoadData, 0, (CUmodule *mod, const void *image))                                           \
  X(ModuleUnload, cuModuleUnload, 0, (CUmodule mod))                                                                   \
  X(ModuleGetFunction, cuModuleGetFunction, 0, (CUfunction *fn, CUmodule mod, const char *name))                       \
  X(LaunchKernel, cuLaunchKernel, 0, (CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,                 \
    unsigned int bx, unsigned int by, unsigned int bz, unsigned int shmem, CUstream stream, void **params,             \
    void **extra))

#endif
