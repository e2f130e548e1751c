/* SPDX-License-Identifier: MIT */
/* The CUDA driver API as fastdp uses it: one table of entry points resolved once from the libcuda.so.1 that
 * PyTorch already loaded (or loaded here), CUresult → fdp_result_t conversion, and the primary context of each
 * device. Nothing here links against CUDA or needs its headers. */
#ifndef FASTDP_DL_CUDA_DRIVER_H
#define FASTDP_DL_CUDA_DRIVER_H

#include "base/base.h"

#include "dl/cuda_api.h"

/* The entry points, one pointer per line of FDP_CU_ENTRY_POINTS (NOTE [driver entry points] in dl/cuda_api.h). */
typedef struct fdp_cu {
#define FDP_CU_FIELD(field, symbol, optional, params) CUresult(*field) params;
  FDP_CU_ENTRY_POINTS(FDP_CU_FIELD)
#undef FDP_CU_FIELD
} fdp_cu_t;

/* Loads the driver and calls cuInit(0) once per process (thread-safe). On success *out points to the static
 * table (valid for the process lifetime). FDP_UNAVAILABLE when FASTDP_DISABLE_CUDA is set, the library or a
 * symbol is missing, or cuInit fails; the detail, and *why if given (a static string), say which. */
fdp_result_t fdp__cu_load(const fdp_cu_t **out, const char **why);

/* Turns a failed CUresult into fdp__fail(FDP_CUDA, "<op> on device <device>: <string> (<name>)"); returns
 * FDP_OK for CUDA_SUCCESS. `device` < 0 omits the device. */
fdp_result_t fdp__cu_check(CUresult r, const char *op, int device);

/* Number of devices the driver sees (0 when it cannot load). */
int fdp__cu_device_count(void);

/* Makes the primary context of `device` (retained once per process and cached; the one PyTorch uses) current
 * on this thread by pushing it; *ctx (may be NULL) receives it. Every successful push must be matched by
 * fdp__cu_ctx_pop on the same thread. Errors: FDP_INVALID (bad ordinal), FDP_UNAVAILABLE, FDP_CUDA. */
fdp_result_t fdp__cu_ctx_push(int device, CUcontext *ctx);
fdp_result_t fdp__cu_ctx_pop(int device);

/* The cached primary context of `device`, retaining it on first use, without making it current. */
fdp_result_t fdp__cu_ctx_get(int device, CUcontext *ctx);

/* Lets the primary context of `device` access the memory of `peer` (cuCtxEnablePeerAccess), once per ordered pair,
 * where cuDeviceCanAccessPeer allows it, so that copies between them go over P2P instead of being staged through
 * host memory by the driver. Thread-safe; the answer is cached until fdp__cu_ctx_release_all. *enabled (may be
 * NULL) is 1 when access is on: CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED (PyTorch or NCCL enabled it first) counts
 * as on, a pair the hardware cannot do or CUDA_ERROR_TOO_MANY_PEERS as off, neither is an error (copies still
 * work, staged). Any other failure returns FDP_CUDA, caches nothing, and leaves the context stack as it was. */
fdp_result_t fdp__cu_peer_enable(int device, int peer, int *enabled);

/* Releases the primary contexts retained by fdp__cu_ctx_push/get (PyTorch keeps its own references) and forgets
 * which peer accesses were enabled (a context that is destroyed takes them along). Call only when no fastdp work
 * is being enqueued; the next push retains again. */
void fdp__cu_ctx_release_all(void);

#endif
