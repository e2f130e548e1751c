/* Internals shared by the two halves of the simulated GPU (the driver: the files sim_driver.h lists, sim_nccl.c:
 * NCCL), host memory (sim_host.c) and the kernels (sim_kernels.cc), which are linked into one shared object so that
 * all see the same devices, memory, streams and clocks. Not a public header: tests reach the simulator only through
 * the driver/NCCL entry points and the simgpu_* controls. */
#ifndef FASTDP_SIM_H
#define FASTDP_SIM_H

#include "dl/cuda_api.h"
#include "dl/nccl_api.h"
#include "backend/cuda/kernels.h"

#include <stddef.h>
#include <stdint.h>

#define SIM_MAX_DEVICES 16
#define SIM_MAX_AGENTS 1024 /* streams ever created (each context's legacy stream included) */

/* Every entry point, in one list: call counting and fault injection are indexed by it. The driver's are fastdp's own
 * list (FDP_CU_ENTRY_POINTS, NOTE [driver entry points] in dl/cuda_api.h), so an entry point the loader learns is
 * one here too, declared below with its real parameters: the library is linked with -z defs, so one that is not
 * defined, or defined with other parameters, fails the build. Then the simulator's own, NCCL's and the allocator's.
 * Used as `#define SIM_X(name) ...` followed by SIM_ENTRIES. */
#define SIM_DRIVER_ENTRY(field, symbol, optional, params) SIM_X(symbol)
#define SIM_OTHER_ENTRIES(X)                                                                                           \
  X(cuStreamCreate) X(cuStreamDestroy_v2) X(ncclGetVersion) X(ncclCommInitAll) X(ncclCommDestroy) X(ncclCommAbort)   \
  X(ncclCommGetAsyncError) X(ncclGetLastError) X(ncclGroupStart) X(ncclGroupEnd) X(ncclBroadcast) X(ncclReduce)     \
  X(ncclGetErrorString) X(simgpu_cache_alloc)
#define SIM_ENTRIES FDP_CU_ENTRY_POINTS(SIM_DRIVER_ENTRY) SIM_OTHER_ENTRIES(SIM_X)

#define SIM_DECLARE_DRIVER_ENTRY(field, symbol, optional, params) CUresult symbol params;
FDP_CU_ENTRY_POINTS(SIM_DECLARE_DRIVER_ENTRY)
#undef SIM_DECLARE_DRIVER_ENTRY

typedef enum {
#define SIM_X(name) SIM_E_##name,
  SIM_ENTRIES
#undef SIM_X
      SIM_E_COUNT
} sim_entry_t;

typedef struct sim_ctx sim_ctx_t;

typedef struct sim_stream {
  uint32_t magic;
  int dev;
  sim_ctx_t *ctx;
  int alive;
  int legacy;   /* the context's NULL stream */
  int blocking; /* created without CU_STREAM_NON_BLOCKING: synchronises with the legacy stream */
  int agent;
  uint32_t *vc; /* vector clock over agents */
} sim_stream_t;

struct sim_ctx {
  uint32_t magic;
  int dev;
  int alive;
  sim_stream_t *null_stream;
  int peer[SIM_MAX_DEVICES]; /* peer access enabled to that device */
};

/* An access to device memory by one operation on one stream, for checking and recording. */
typedef struct sim_op {
  const char *name; /* e.g. "cuLaunchKernel(fdp_sum_f32)" */
  sim_stream_t *stream;
  int dev;       /* device whose engines run it: its memory is local, other devices need peer access */
  int any_peer;  /* copies through the copy engines may touch any device (peer copies) */
  int raced;     /* one race report per operation */
} sim_op_t;

/* Lock held around every entry point (recursive: NCCL calls into the driver half). */
void sim_lock(void);
void sim_unlock(void);
/* Counts a call; returns the injected result (nonzero) when this call is chosen to fail. Lock held. */
int sim_enter(sim_entry_t e);
/* Where a call of `e` was asked to pause (simgpu_pause): sleeps with the lock released, so that other threads run
 * meanwhile (a wide window for a race between threads). Lock held (once) on entry and on return. */
void sim_pause_point(sim_entry_t e);
/* The start and end of an entry point returning `rtype` (CUresult or ncclResult_t): the lock is taken, and an
 * injected failure returns its code before the call does anything; SIM_RETURN releases the lock. */
#define SIM_ENTER(rtype, name)                                                                                         \
  sim_lock();                                                                                                          \
  do {                                                                                                                 \
    int inj_ = sim_enter(SIM_E_##name);                                                                                \
    if (inj_) {                                                                                                        \
      sim_unlock();                                                                                                    \
      return (rtype)inj_;                                                                                              \
    }                                                                                                                  \
    sim_pause_point(SIM_E_##name);                                                                                     \
  } while (0)
#define SIM_RETURN(rtype, v)                                                                                           \
  do {                                                                                                                 \
    rtype rv_ = (v);                                                                                                   \
    sim_unlock();                                                                                                      \
    return rv_;                                                                                                        \
  } while (0)
/* Records a misuse (an error the test fails on). Lock held. */
void sim_misuse(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
int sim_ndev(void);
/* The live primary context of `dev`, or NULL. */
sim_ctx_t *sim_primary(int dev);
/* Whether someone besides the test harness (simgpu_client) holds a reference to `dev`'s primary context: the
 * library under test, once a harness has declared its own references; anyone, before. */
int sim_library_holds(int dev);
/* Resolves a stream handle for work on device `dev` (NULL: its legacy stream); NULL after a misuse. */
sim_stream_t *sim_stream_for_dev(void *h, int dev, const char *what);
/* Starts an operation on a stream: joins the host clock and the legacy-stream rules, advances the clock. */
void sim_op_begin(sim_op_t *op, sim_stream_t *s, const char *name, int dev);
/* Checks [p, p + n) (live device memory, allowed device) and records the access; returns the host bytes
 * backing it, or NULL after a misuse. */
unsigned char *sim_access(sim_op_t *op, CUdeviceptr p, size_t n, int write);
/* Validates without recording (used before executing). */
unsigned char *sim_check_range(sim_op_t *op, CUdeviceptr p, size_t n);
void sim_vc_join(uint32_t *into, const uint32_t *from);
void sim_comm_count(int delta);
void sim_group_count(int delta);
/* Live communicators on device `dev` whose context is `ctx` (for the context-destruction check). */
int sim_nccl_comms_on(const sim_ctx_t *ctx);
/* Host-side element arithmetic shared by kernels and NCCL (sim_arith.c): dst[i] = dst[i] + src[i] for `type`. */
void sim_add(int fdp_dtype, void *acc, const void *x, int64_t n);
/* Records a race (counted as one, and as misuse). Lock held. */
void sim_race(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* The calling thread's current context (NULL: none), and replacing it as cuCtxSetCurrent does. */
sim_ctx_t *sim_current(void);
void sim_set_current(sim_ctx_t *c);
/* The device whose address range holds p, or -1. */
int sim_ptr_device(CUdeviceptr p);
/* Host memory (sim_host.c): an asynchronous copy with host side `host` of n bytes, run by `op`; `bytes` are the
 * bytes it delivers to the host (to_host) or read from it. The host side is in use until the host clock covers the
 * copy; sim_host_retire (called whenever the host clock advances) completes what it covers. */
void sim_host_copy_begin(const sim_op_t *op, void *host, const void *bytes, size_t n, int to_host);
void sim_host_retire(const uint32_t *host_vc);
/* Drops the pending host copies of the stream with this agent (its work failed). */
void sim_host_abandon(int agent);
/* The real kernels (sim_kernels.cc): runs kernel `name` over the grid, its pointers already host addresses;
 * 0, -1 when it faulted (*fault: the address), or -2 when it made a misaligned access (*fault: the instruction). */
int sim_kernel_run(const char *name, const unsigned int grid[3], const unsigned int block[3], fdp_sum_args_t *sum,
                   const void *src, void *dst, const fdp_copy_args_t *copy, void **fault);
/* The PTX conversions on the host, for the kernels. */
float sim_half_to_float(unsigned short h);
unsigned short sim_float_to_half(float f);
unsigned short sim_float_to_bf16(float f);

#endif
