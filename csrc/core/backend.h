/* SPDX-License-Identifier: MIT */
/* The contract between the core and its transports: one table of function pointers per backend, plus the
 * core's services to its backends (routing a staging copy, the stream of a device). Not installed, not for
 * bindings. */
#ifndef FASTDP_CORE_BACKEND_H
#define FASTDP_CORE_BACKEND_H

#include "fastdp.h"

#include "base/base.h"

#include <stdarg.h>

/* One pending element-wise copy between two descriptors of one shape. */
typedef struct fdp_copy {
  fdp_tensor_t dst;
  fdp_tensor_t src;
} fdp_copy_t;

/* NOTE [routing]: the core decides once which backend runs an operation, as NCCL's selectTransport asks each
 * transport canConnect: it validates the descriptors, then walks the backends in preference order (nccl, cuda,
 * host) and takes the first whose `can` says yes and which is usable now. A backend never names another; work
 * it hands on (a host-side staging copy in the cuda backend) goes back through the core (fdp__route_copy).
 * Python asks the same question through fdp_route_devices instead of deciding for itself.
 *
 * A transport. The core has validated shapes, dtypes, overlaps and device kinds before any of these is called,
 * and called an op only where `can` said yes: a backend asserts those invariants, it does not re-check them.
 * Every function may be called from several threads at once. */
typedef struct fdp_backend {
  const char *name;
  fdp_backend_id_t id;
  /* Returns 1 when it can run in this process now; otherwise 0 with a reason in *why (static string). */
  int (*usable)(const char **why);
  /* 1 when this backend runs `op` on these validated descriptors, laid out per op as
   *   FDP_OP_COPY       dst0, src0, dst1, src1, ...        (n = 2 x copies)
   *   FDP_OP_BROADCAST  src, dst0, dst1, ...                (n = 1 + destinations, every numel > 0)
   *   FDP_OP_REDUCE     input0, ..., input(n-2), out         (n = inputs + 1, numel > 0)
   * No side effects beyond loading a library; it does not ask `usable` (the core does). */
  int (*can)(fdp_op_t op, const fdp_tensor_t *const *ts, int n);
  /* Performs all copies (in any order; destinations never overlap). NULL when can(FDP_OP_COPY) is always 0. */
  fdp_result_t (*copy)(const fdp_copy_t *copies, int n, const fdp_streams_t *streams);
  /* out = sum of inputs (contiguous, same dtype and numel), accumulated in input order. */
  fdp_result_t (*reduce)(const fdp_tensor_t *inputs, int n, const fdp_tensor_t *out, const fdp_streams_t *streams);
  /* Broadcast of one dense source to dense, same-strided destinations on distinct devices; NULL when
   * can(FDP_OP_BROADCAST) is always 0, and then the core broadcasts with copies. */
  fdp_result_t (*broadcast)(const fdp_tensor_t *src, const fdp_tensor_t *dst, int ndst, const fdp_streams_t *streams);
  /* Releases cached state; may be NULL. */
  void (*shutdown)(void);
  /* Facts for fdp_library_facts; NULL for a backend without a library of its own. */
  void (*library_facts)(fdp_library_facts_t *out);
  /* Facts for fdp_device_facts and fdp_device_can_access_peer, from the backend that owns the GPUs; NULL for the
   * others. */
  fdp_result_t (*device_facts)(int device, fdp_free_read_t free_read, fdp_device_facts_t *out);
  int (*can_access_peer)(int device, int peer);
  /* Fences (fdp_fence_*), from the backend that owns the GPUs, on streams the core has checked (CUDA entries,
   * 1 <= n <= FDP_MAX_DEVICES); NULL for the others. */
  fdp_result_t (*fence_record)(const fdp_streams_t *streams, fdp_fence_t **out);
  fdp_result_t (*fence_wait)(const fdp_fence_t *fence, const fdp_streams_t *waiters);
  fdp_result_t (*fence_query)(const fdp_fence_t *fence, int *done);
  void (*fence_free)(fdp_fence_t *fence);
} fdp_backend_t;

/* The backend of `id`, or NULL when this build has none. */
const fdp_backend_t *fdp__backend(fdp_backend_id_t id);

extern const fdp_backend_t fdp__backend_host;
extern const fdp_backend_t fdp__backend_cuda;
extern const fdp_backend_t fdp__backend_nccl;

/* Runs copies whose descriptors are already valid (a backend's own staging work) on the backend the core picks
 * for them, without validating again. Same contract as fdp_backend_t.copy. */
fdp_result_t fdp__route_copy(const fdp_copy_t *copies, int n, const fdp_streams_t *streams);

/* The stream listed for `device`, or NULL (the legacy default stream). */
void *fdp__stream_for(const fdp_streams_t *streams, int device);

#endif
