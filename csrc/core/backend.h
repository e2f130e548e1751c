/* SPDX-License-Identifier: MIT */
/* The contract between the core and its transports: one table of function pointers per backend, plus the
 * internal helpers (errors, knobs, logging) that core and backends share. Not installed, not for bindings. */
#ifndef FASTDP_CORE_BACKEND_H
#define FASTDP_CORE_BACKEND_H

#include "fastdp.h"

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
} fdp_backend_t;

extern const fdp_backend_t fdp__backend_host;
extern const fdp_backend_t fdp__backend_cuda;
extern const fdp_backend_t fdp__backend_nccl;

/* Sets the thread's error detail (printf format) and returns `r`, so that `return fdp__fail(...)` reads well. */
fdp_result_t fdp__fail(fdp_result_t r, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
/* fdp__fail for a failure of a library call: also records the library's own code (CUresult, ncclResult_t), which
 * fdp_last_status() returns and the binding puts on the exception. */
fdp_result_t fdp__fail_status(fdp_result_t r, int status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

/* Temporary arrays of one call (scratch.c). fdp__scratch_alloc is malloc (uninitialised; NULL when out of memory),
 * but blocks of 64 KiB and more given back with fdp__scratch_free are kept, up to 4 per thread, and handed out again,
 * so that calls with thousands of tensors reuse warm pages. A block may be freed on any thread (it joins that
 * thread's kept ones); a thread's kept blocks are freed when it exits, or by fdp__scratch_release on it. */
void *fdp__scratch_alloc(size_t bytes);
void fdp__scratch_free(void *p);
void fdp__scratch_release(void);

/* Writes one line to stderr when FASTDP_DEBUG is set; the only output fastdp's C code ever makes. */
void fdp__log(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;

/* Environment knobs, declared once in param.c with their defaults. */
typedef enum {
  FDP_PARAM_DEBUG,               /* FASTDP_DEBUG: log to stderr */
  FDP_PARAM_HOST_THREADS,        /* FASTDP_HOST_THREADS: worker threads for host copies and sums (0: cores) */
  FDP_PARAM_HOST_PARALLEL_MIN,   /* FASTDP_HOST_PARALLEL_MIN: bytes below which host work stays on one thread */
  FDP_PARAM_DISABLE_NCCL,        /* FASTDP_DISABLE_NCCL: never pick the nccl backend */
  FDP_PARAM_DISABLE_CUDA,        /* FASTDP_DISABLE_CUDA: do not load the CUDA driver */
  FDP_PARAM_CUDA_DRIVER_LIBRARY, /* FASTDP_CUDA_DRIVER_LIBRARY (string): load exactly this file as the driver */
  FDP_PARAM_NCCL_LIBRARY,        /* FASTDP_NCCL_LIBRARY (string): load exactly this file as NCCL */
  FDP_PARAM_DISABLE_NVRTC,       /* FASTDP_DISABLE_NVRTC: never compile kernels at run time */
  FDP_PARAM_DISABLE_FATBIN,      /* FASTDP_DISABLE_FATBIN: ignore the build-time fatbin (NVRTC only) */
  FDP_PARAM_KERNEL_CACHE,        /* FASTDP_KERNEL_CACHE: 0 keeps NVRTC output in memory only (no disk cache) */
  FDP_PARAM_STRICT,              /* FASTDP_STRICT: the Python layer raises instead of falling back to torch */
  FDP_PARAM_CACHE_DIR,           /* FASTDP_CACHE_DIR (string): kernel cache folder (default ~/.cache/fastdp/kernels) */
  FDP_PARAM_NVRTC_LIBRARY,       /* FASTDP_NVRTC_LIBRARY (string): the libnvrtc.so to load, tried first */
  FDP_PARAM_TENSOR_PATH,         /* FASTDP_TENSOR_PATH (string): "python" reads tensors through their Python API */
  FDP_PARAM_SHIM_ABSENT,         /* FASTDP_SHIM_ABSENT (string): C-shim entry points to treat as missing */
  FDP_PARAM_COUNT
} fdp_param_t;

/* Integer value of a knob (its default when unset or unparsable; 0 for string knobs). */
int64_t fdp__param(fdp_param_t p);
/* Value of a string knob; NULL when unset or empty (valid for the process lifetime). */
const char *fdp__param_str(fdp_param_t p);
const char *fdp__param_name(fdp_param_t p);

/* Runs copies whose descriptors are already valid (a backend's own staging work) on the backend the core picks
 * for them, without validating again. Same contract as fdp_backend_t.copy. */
fdp_result_t fdp__route_copy(const fdp_copy_t *copies, int n, const fdp_streams_t *streams);

/* The stream listed for `device`, or NULL (the legacy default stream). */
void *fdp__stream_for(const fdp_streams_t *streams, int device);

/* NOTE [error trail and cleanup]: every fallible call in the core and the backends goes through one of four
 * forms (after NCCL's checks.h), so that a failure's path shows under FASTDP_DEBUG and cleanup reads one way:
 *   FDP_CHECK(call)               returns the call's failure to the caller.
 *   FDP_CHECK_GOTO(call, r, lbl)  stores the call's result in r and jumps to lbl on failure: one `fail:` (or
 *                                 `out:`) label per function runs the cleanup, which ends with `return r`.
 *   FDP_CHECK_KEEP(call, r)       for cleanup: runs the call whatever r holds; r keeps its first failure, and
 *                                 so does the thread's detail string (fdp_last_error); the call's failure is
 *                                 taken only when r was FDP_OK.
 *   FDP_CHECK_IGNORE(call)        for cleanup whose failure changes nothing: logged, neither returned nor
 *                                 written to the detail string.
 * Each failure logs "file:line: call -> FDP_X" when FASTDP_DEBUG is set (fdp__trail). */
void fdp__trail(const char *file, int line, const char *call, fdp_result_t r);
/* While held, fdp__fail keeps the thread's detail string as it is (logging still happens). Returns the previous
 * hold, which fdp__detail_release restores: holds nest. */
int fdp__detail_hold(int hold);
void fdp__detail_release(int previous);

#define FDP_CHECK(call)                                                                                                \
  do {                                                                                                                 \
    fdp_result_t fdp__r = (call);                                                                                      \
    if (fdp__r != FDP_OK) {                                                                                            \
      fdp__trail(__FILE__, __LINE__, #call, fdp__r);                                                                   \
      return fdp__r;                                                                                                   \
    }                                                                                                                  \
  } while (0)

#define FDP_CHECK_GOTO(call, r, label)                                                                                 \
  do {                                                                                                                 \
    (r) = (call);                                                                                                      \
    if ((r) != FDP_OK) {                                                                                               \
      fdp__trail(__FILE__, __LINE__, #call, (r));                                                                      \
      goto label;                                                                                                      \
    }                                                                                                                  \
  } while (0)

#define FDP_CHECK_KEEP(call, r)                                                                                        \
  do {                                                                                                                 \
    int fdp__held = fdp__detail_hold((r) != FDP_OK);                                                                   \
    fdp_result_t fdp__r = (call);                                                                                      \
    fdp__detail_release(fdp__held);                                                                                    \
    if (fdp__r != FDP_OK) {                                                                                            \
      fdp__trail(__FILE__, __LINE__, #call, fdp__r);                                                                   \
      if ((r) == FDP_OK) (r) = fdp__r;                                                                                 \
    }                                                                                                                  \
  } while (0)

#define FDP_CHECK_IGNORE(call)                                                                                         \
  do {                                                                                                                 \
    int fdp__held = fdp__detail_hold(1);                                                                               \
    fdp_result_t fdp__r = (call);                                                                                      \
    fdp__detail_release(fdp__held);                                                                                    \
    if (fdp__r != FDP_OK) fdp__trail(__FILE__, __LINE__, #call, fdp__r);                                               \
  } while (0)

#endif
