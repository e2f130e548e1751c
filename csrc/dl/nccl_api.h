/* SPDX-License-Identifier: MIT */
/* The part of the NCCL 2 C API fastdp calls, declared here because the build never needs nccl.h, and the loader
 * that binds it at run time to the libnccl.so.2 PyTorch already loaded. */
#ifndef FASTDP_DL_NCCL_API_H
#define FASTDP_DL_NCCL_API_H

#include "base/base.h"

#include <pthread.h>
#include <stddef.h>

#ifndef NCCL_H_ /* values and layouts as in NCCL 2's public nccl.h (ABI-stable since 2.0) */
typedef struct ncclComm *ncclComm_t;
typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7
} ncclResult_t;
typedef enum {
  ncclInt8 = 0,
  ncclChar = 0,
  ncclUint8 = 1,
  ncclInt32 = 2,
  ncclUint32 = 3,
  ncclInt64 = 4,
  ncclUint64 = 5,
  ncclFloat16 = 6,
  ncclFloat32 = 7,
  ncclFloat64 = 8,
  ncclBfloat16 = 9 /* NCCL >= 2.10 */
} ncclDataType_t;
typedef enum { ncclSum = 0 } ncclRedOp_t;
#endif

/* Entry points without the "nccl" prefix; streams are cudaStream_t (== CUstream), passed as void *. The
 * optional ones are NULL when the library predates them. */
typedef struct fdp_nccl_api {
  ncclResult_t (*GetVersion)(int *version);
  ncclResult_t (*CommInitAll)(ncclComm_t *comms, int ndev, const int *devlist);
  ncclResult_t (*CommDestroy)(ncclComm_t comm);
  ncclResult_t (*CommAbort)(ncclComm_t comm);                              /* optional */
  ncclResult_t (*CommGetAsyncError)(ncclComm_t comm, ncclResult_t *state); /* optional */
  const char *(*GetLastError)(ncclComm_t comm);                            /* optional (2.13) */
  ncclResult_t (*GroupStart)(void);
  ncclResult_t (*GroupEnd)(void);
  ncclResult_t (*Broadcast)(const void *send, void *recv, size_t count, ncclDataType_t type, int root, ncclComm_t comm,
                            void *stream);
  ncclResult_t (*Reduce)(const void *send, void *recv, size_t count, ncclDataType_t type, ncclRedOp_t op, int root,
                         ncclComm_t comm, void *stream);
  const char *(*GetErrorString)(ncclResult_t r);
  int version;    /* e.g. 22703 (major*10000 + minor*100 + patch from 2.9 on; major*1000 + ... before) */
  char path[512]; /* file the symbols came from, for `python -m fastdp info` */
} fdp_nccl_api_t;

/* Binds NCCL once per process (thread-safe). A libnccl.so.2 already in the process (PyTorch's) is used and no
 * other is ever loaded next to it; only when none is loaded is "libnccl.so.2" dlopened by the usual search.
 * On success *out points to the static table. FDP_UNAVAILABLE (detail; *why, if given, a static string) when
 * FASTDP_DISABLE_NCCL is set or no usable NCCL 2 exists. */
fdp_result_t fdp__nccl_load(const fdp_nccl_api_t **out, const char **why);

/* PyTorch's CUDA caching-allocator "free mutex" (c10::cuda::getFreeMutex()), or NULL when libc10_cuda is not
 * loaded or does not export it. The allocator holds it around cudaFree; holding it while NCCL kernels are
 * launched on several devices from one thread keeps a concurrent cudaFree (which waits for the device) from
 * slipping between those launches and deadlocking against a kernel that waits for its peers. std::mutex is a
 * bare pthread_mutex_t in both libstdc++ and libc++ on Linux, so pthread_mutex_lock/unlock are its lock/unlock. */
pthread_mutex_t *fdp__torch_free_mutex(void);

#endif
