/* SPDX-License-Identifier: MIT */
/* What the parts of test_gpu_ops (every operation through the cuda and nccl backends) share: the checks (check.h) and
 * OK, the driver opened as a client such as PyTorch opens it and the simulator's controls, buffers with a host mirror
 * of what they must hold, the caller's accesses around each operation, views (gpu_ops_harness.c), the copy and sum
 * cases other parts reuse, and every part's entry points, which test_gpu_ops.c runs. */
#ifndef FASTDP_TESTS_C_GPU_OPS_HARNESS_H
#define FASTDP_TESTS_C_GPU_OPS_HARNESS_H

#include "check.h"
#include "dl/cuda_api.h"
#include "fastdp.h"

#include <stddef.h>
#include <stdint.h>

/* OK(call): the call returns FDP_OK (else the check fails with the result and its detail). */
#define OK(call)                                                                                                       \
  do {                                                                                                                 \
    fdp_result_t r_ = (call);                                                                                          \
    CHECKF(r_ == FDP_OK, "%s: %s", fdp_result_name(r_), fdp_last_error());                                             \
  } while (0)

/* This thread's random source (xorshift); a thread seeds its own by setting t_rng. */
extern __thread uint64_t t_rng;
uint64_t rnd(void);
/* malloc that ends the run (exit 2) when out of memory; never NULL, even for 0 bytes. */
void *xmalloc(size_t n);

/* ---- the driver, as a client such as PyTorch uses it ---- */

typedef struct driver {
  CUresult (*Init)(unsigned int);
  CUresult (*DeviceGetCount)(int *);
  CUresult (*PrimaryCtxRetain)(CUcontext *, CUdevice);
  CUresult (*PrimaryCtxRelease)(CUdevice);
  CUresult (*CtxPush)(CUcontext);
  CUresult (*CtxPop)(CUcontext *);
  CUresult (*CtxSynchronize)(void);
  CUresult (*CtxSetCurrent)(CUcontext);
  CUresult (*CtxGetCurrent)(CUcontext *);
  CUresult (*MemAlloc)(CUdeviceptr *, size_t);
  CUresult (*MemFree)(CUdeviceptr);
  CUresult (*HtoD)(CUdeviceptr, const void *, size_t, CUstream);
  CUresult (*DtoH)(void *, CUdeviceptr, size_t, CUstream);
  CUresult (*StreamSynchronize)(CUstream);
  CUresult (*StreamCreate)(CUstream *, unsigned int);
  CUresult (*StreamDestroy)(CUstream);
} driver_t;

extern driver_t D;

/* The simulator's controls; NULL on a real driver. */
typedef struct sim {
  void (*reset)(void);
  long long (*errors)(char *, size_t);
  int (*fail_at)(const char *, long long, int);
  int (*fail_then)(const char *, long long, int, const char *, int);
  long long (*calls)(const char *);
  const char *(*entry)(int);
  long long (*stat)(const char *);
  /* The simulated caching allocator (PyTorch's route: SIMGPU_ALLOCATOR=caching registers it with the core). */
  int (*cache_alloc)(void *, int, size_t, void *, void **, void **, char *, size_t);
  void (*cache_free)(void *, int, void *, void *);
  int (*cache_trim)(void);
  /* The caller's own accesses around an operation: device memory on a stream of its choosing, host memory. */
  int (*touch)(void *, int, unsigned long long, size_t, int);
  void (*host_touch)(const void *, size_t, int);
  int (*nccl_break)(int, int);
  int (*pause)(const char *, long long, int);
  /* Tells the simulator which primary-context references are the client's (as PyTorch's), not fastdp's. */
  void (*client)(int);
} sim_t;

extern sim_t S;

extern int g_ndev;                         /* devices used, at most 8 */
extern CUcontext g_ctx[FDP_MAX_DEVICES];   /* each device's primary context, retained as PyTorch retains it */
extern CUstream g_stream[FDP_MAX_DEVICES]; /* one non-blocking stream per device, as PyTorch's streams are */

/* Opens the driver (FASTDP_CUDA_DRIVER_LIBRARY, else libcuda.so.1) with a context and a stream per device, and the
 * caller's current context on device 0; 0 when there is no usable driver or device. `free_mutex` 0: as a program
 * without PyTorch, where fastdp finds no free mutex and its own lock alone must keep two threads' grouped NCCL
 * launches apart. */
int driver_open(int free_mutex);
void driver_close(void);
/* 1 on the simulated GPU (its controls in S are set). */
int sim(void);
/* Fails the check when the simulator recorded misuse or races since the last look, printing what; counts the calls
 * of the paths sim_paths_report lists. */
void sim_clean(const char *where);
void sim_paths_report(int caching);

/* ---- buffers: device (or host) memory plus a host mirror holding what it must contain ---- */

typedef struct buf {
  int dev; /* FDP_HOST or an ordinal */
  size_t bytes;
  char *data; /* device address (never dereferenced here) or host memory */
  unsigned char *ref;
} buf_t;

/* Checks a driver call made for the harness itself. */
void dev_call(int dev, CUresult r, const char *what);
void push(int dev);
void pop(int dev);
/* Writes the mirror to the memory (after whatever the device was doing with it, as a blocking copy does). */
void buf_upload(buf_t *b);
/* `bytes` on `dev` (FDP_HOST: host memory), filled with random bytes that the mirror holds too. */
buf_t buf_new(int dev, size_t bytes);
void buf_free(buf_t *b);
/* Reads the memory back (after the device finished everything) and checks it against the mirror. */
int buf_matches(const buf_t *b, const char *what);

/* ---- the caller around each operation (see gpu_ops_harness.c) ---- */

extern __thread CUcontext t_home_ctx; /* what the thread has current between operations */
void caller_touch(const buf_t *b, const CUstream *streams, int write);
void caller_before(buf_t *const *bufs, int n, const CUstream *streams);
void caller_after(buf_t *const *bufs, int n, const CUstream *streams, const char *what);

/* ---- views ---- */

/* A view of a buffer, and the same view of its mirror. */
typedef struct view {
  fdp_tensor_t t, ref;
} view_t;

view_t view(buf_t *b, int dtype, int es, int nd, const int64_t *sizes, const int64_t *strides, int64_t off);
int64_t numel(const fdp_tensor_t *t);
/* Bytes a view spans from its first element. */
size_t span(int es, int nd, const int64_t *sizes, const int64_t *strides);
void contig(int nd, const int64_t *sizes, int64_t *strides);
/* The reference copy, element by element over the index space. */
void ref_copy(const fdp_tensor_t *dst, const fdp_tensor_t *src);
/* Every device with its stream of `streams` (NULL: each device's legacy stream). */
fdp_streams_t all_streams(const CUstream *streams);

/* ---- cases other parts reuse ---- */

/* Layouts of a [a, b, c] tensor of `es`-byte elements: contiguous, rows padded, inner dims transposed, every
 * other element, a padded outer dim (gpu_ops_copy.c). */
enum { L_CONTIG, L_PADDED, L_TRANSPOSED, L_STEP2, L_OUTER, L_COUNT };
void layout(int kind, const int64_t *sz, int64_t *st);
/* One copy of a [a, b, c] tensor from layout sl on sdev to layout dl on ddev, checked against the reference. */
void copy_case(int sdev, int ddev, int es, const int64_t *sz, int sl, int dl, const CUstream *streams);

/* acc = acc + x per element in dtype's arithmetic (half types: float sum rounded, as PyTorch's CPU a + b), written
 * independently of fastdp (gpu_ops_reduce.c). */
void ref_add(int dtype, void *acc, const void *x, int64_t n);
/* Fills a mirror with values of the dtype: bools 0/1, finite halves and floats of modest size. */
void fill_values(int dtype, unsigned char *p, int64_t n);
/* out = sum of `n` inputs of `count` elements, on devs[i] (out on out_dev, or aliasing input `alias` >= 0); the
 * call must return `expect`, and on success match the reference sum. */
void reduce_case(int dtype, int es, int n, const int *devs, int out_dev, int alias, int64_t count,
                 const CUstream *streams, int expect);

/* A dense broadcast from `root` to dsts[0..n) (in that order): NCCL's route (gpu_ops_nccl.c). */
void bcast_order(int root, const int *dsts, int n, const CUstream *streams);

/* ---- the parts (test_gpu_ops.c runs them) ---- */

void test_copies(void); /* gpu_ops_copy.c */
void test_broadcast(void);
void test_scatter_gather(void);
void test_reduce(void); /* gpu_ops_reduce.c */
void test_reduce_passes(void);
void test_coalesced(void);
void test_reduce_on_own_streams(void);
void test_threads(void); /* gpu_ops_threads.c */
void test_shutdown_reuse(void);
void race(void);
void test_kernel_wide_offsets(void); /* gpu_ops_kernels.c */
void test_kernel_huge_sum(void);
void test_kernel_many_elements(void);
void test_misaligned(void);
void test_order(void); /* gpu_ops_nccl.c */
void test_nccl_bytes(void);
void test_nccl_async_error(void);
void sweep(const char *only, int pairs); /* gpu_ops_sweep.c */

#endif
