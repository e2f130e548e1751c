/* SPDX-License-Identifier: MIT */
/* Every core operation through the cuda and nccl backends on CUDA devices, compared bit for bit with a host
 * reference computed here: copies (row copies, strided sources and destinations on both sides, host<->device,
 * peer), broadcast, scatter, gather, reduce (collective and local, 70 inputs with the output aliasing one),
 * coalesced buckets, 8 threads at once, shutdown then reuse. Uses only fastdp.h plus the driver itself (dlopen,
 * as PyTorch would) for memory and streams. On the simulated GPU (FASTDP_CUDA_DRIVER_LIBRARY naming tests/sim's
 * library) it also fails on any misuse or race the simulator recorded, checks that nothing leaked, and
 * `--sweep` makes every driver/NCCL call of every operation fail in turn. Built by tests/c/build.py --gpu-ops;
 * prints "N passed, M failed" and exits nonzero on a failure. */
#include "fastdp.h"
#include "dl/cuda_api.h"
#include "backend/cuda/kernels.h" /* FDP_SUM_MAX_INPUTS: where the passes of a long sum begin */

#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- harness ---- */

/* Relaxed counts: a check that passes must not order one thread's work after another's (ThreadSanitizer would take
 * a shared lock here for synchronisation that fastdp lacks). */
static atomic_int n_pass, n_fail;
static pthread_mutex_t g_report = PTHREAD_MUTEX_INITIALIZER;

static void check_at(int ok, const char *file, int line, const char *expr, const char *fmt, ...) {
  if (ok) {
    atomic_fetch_add_explicit(&n_pass, 1, memory_order_relaxed);
    return;
  }
  pthread_mutex_lock(&g_report);
  {
    atomic_fetch_add_explicit(&n_fail, 1, memory_order_relaxed);
    printf("FAIL %s:%d: %s", file, line, expr);
    if (fmt) {
      va_list ap;
      va_start(ap, fmt);
      fputs(" -- ", stdout);
      vprintf(fmt, ap);
      va_end(ap);
    }
    putchar('\n');
    fflush(stdout);
  }
  pthread_mutex_unlock(&g_report);
}
#define CHECK(c) check_at(!!(c), __FILE__, __LINE__, #c, NULL)
#define CHECKF(c, ...) check_at(!!(c), __FILE__, __LINE__, #c, __VA_ARGS__)
#define OK(call)                                                                                                       \
  do {                                                                                                                 \
    fdp_result_t r_ = (call);                                                                                          \
    CHECKF(r_ == FDP_OK, "%s: %s", fdp_result_name(r_), fdp_last_error());                                             \
  } while (0)

static __thread uint64_t t_rng = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void) {
  uint64_t x = t_rng;
  x ^= x << 13;
  x ^= x >> 7;
  x ^= x << 17;
  return t_rng = x;
}

static void *xmalloc(size_t n) {
  void *p = malloc(n ? n : 1);
  if (!p) {
    printf("out of host memory\n");
    exit(2);
  }
  return p;
}

/* ---- the driver, as a client such as PyTorch uses it ---- */

static struct {
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
} D;

/* The simulator's controls; NULL on a real driver. */
static struct {
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
} S;

static int g_ndev;
static CUcontext g_ctx[FDP_MAX_DEVICES];
static CUstream g_stream[FDP_MAX_DEVICES]; /* one non-blocking stream per device, as PyTorch's streams are */

static int sym(void *h, const char *name, void *slot, int required) {
  void *p = dlsym(h, name);
  if (!p && required) printf("the driver lacks %s\n", name);
  memcpy(slot, &p, sizeof p);
  return p != NULL || !required;
}

/* `free_mutex` 0: as a program without PyTorch, where fastdp finds no free mutex and its own lock alone must keep
 * two threads' grouped NCCL launches apart. */
static int driver_open(int free_mutex) {
  const char *path = getenv("FASTDP_CUDA_DRIVER_LIBRARY");
  /* Global, as PyTorch's libc10_cuda.so is: the simulated library also stands in for its getFreeMutex, which the
   * NCCL loader looks up by name (and then the simulator checks that it is held around multi-device groups). */
  if (path && *path && free_mutex) setenv("SIMGPU_REQUIRE_FREE_MUTEX", "1", 0);
  void *h = dlopen(path && *path ? path : "libcuda.so.1", RTLD_NOW | (free_mutex ? RTLD_GLOBAL : RTLD_LOCAL));
  if (!h) {
    printf("no CUDA driver: %s\n", dlerror());
    return 0;
  }
  int ok = sym(h, "cuInit", &D.Init, 1) & sym(h, "cuDeviceGetCount", &D.DeviceGetCount, 1) &
           sym(h, "cuDevicePrimaryCtxRetain", &D.PrimaryCtxRetain, 1) &
           sym(h, "cuDevicePrimaryCtxRelease_v2", &D.PrimaryCtxRelease, 1) &
           sym(h, "cuCtxPushCurrent_v2", &D.CtxPush, 1) & sym(h, "cuCtxPopCurrent_v2", &D.CtxPop, 1) &
           sym(h, "cuCtxSynchronize", &D.CtxSynchronize, 1) & sym(h, "cuCtxSetCurrent", &D.CtxSetCurrent, 1) &
           sym(h, "cuCtxGetCurrent", &D.CtxGetCurrent, 1) &
           sym(h, "cuMemAlloc_v2", &D.MemAlloc, 1) &
           sym(h, "cuMemFree_v2", &D.MemFree, 1) & sym(h, "cuMemcpyHtoDAsync_v2", &D.HtoD, 1) &
           sym(h, "cuMemcpyDtoHAsync_v2", &D.DtoH, 1) & sym(h, "cuStreamSynchronize", &D.StreamSynchronize, 1) &
           sym(h, "cuStreamCreate", &D.StreamCreate, 1) & sym(h, "cuStreamDestroy_v2", &D.StreamDestroy, 1);
  sym(h, "simgpu_reset", &S.reset, 0);
  sym(h, "simgpu_errors", &S.errors, 0);
  sym(h, "simgpu_fail_at", &S.fail_at, 0);
  sym(h, "simgpu_fail_then", &S.fail_then, 0);
  sym(h, "simgpu_calls", &S.calls, 0);
  sym(h, "simgpu_entry", &S.entry, 0);
  sym(h, "simgpu_stat", &S.stat, 0);
  sym(h, "simgpu_cache_alloc", &S.cache_alloc, 0);
  sym(h, "simgpu_cache_free", &S.cache_free, 0);
  sym(h, "simgpu_cache_trim", &S.cache_trim, 0);
  sym(h, "simgpu_touch", &S.touch, 0);
  sym(h, "simgpu_host_touch", &S.host_touch, 0);
  sym(h, "simgpu_nccl_break", &S.nccl_break, 0);
  sym(h, "simgpu_pause", &S.pause, 0);
  sym(h, "simgpu_client", &S.client, 0);
  if (!ok || D.Init(0) != CUDA_SUCCESS || D.DeviceGetCount(&g_ndev) != CUDA_SUCCESS) return 0;
  if (g_ndev > 8) g_ndev = 8;
  if (S.client) S.client(1);
  for (int d = 0; d < g_ndev; d++) {
    if (D.PrimaryCtxRetain(&g_ctx[d], d) != CUDA_SUCCESS || D.CtxPush(g_ctx[d]) != CUDA_SUCCESS) return 0;
    CUcontext c;
    CUresult r = D.StreamCreate(&g_stream[d], 1 /* CU_STREAM_NON_BLOCKING */);
    D.CtxPop(&c);
    if (r != CUDA_SUCCESS) return 0;
  }
  if (S.client) S.client(0);
  /* PyTorch's thread has its current device's context current (the runtime sets it): so does this one. */
  return D.CtxSetCurrent(g_ctx[0]) == CUDA_SUCCESS;
}

static void driver_close(void) {
  CHECK(D.CtxSetCurrent(NULL) == CUDA_SUCCESS);
  if (S.client) S.client(1);
  for (int d = 0; d < g_ndev; d++) {
    CUcontext c;
    CHECK(D.CtxPush(g_ctx[d]) == CUDA_SUCCESS);
    CHECK(D.StreamDestroy(g_stream[d]) == CUDA_SUCCESS);
    CHECK(D.CtxPop(&c) == CUDA_SUCCESS);
    CHECK(D.PrimaryCtxRelease(d) == CUDA_SUCCESS);
  }
  if (S.client) S.client(0);
}

static int sim(void) {
  return S.errors != NULL;
}

/* Entry points the operations must have reached (the copy paths, kernels, collectives), with their calls. */
static const char *const k_paths[] = {"cuMemcpyAsync",       "cuMemcpy2DAsync_v2",   "cuMemcpy3DPeerAsync",
                                      "cuMemcpyPeerAsync",   "cuMemcpyHtoDAsync_v2", "cuMemcpyDtoHAsync_v2",
                                      "cuLaunchKernel",      "cuMemAllocAsync",      "cuStreamWaitEvent",
                                      "ncclBroadcast",       "ncclReduce",           "ncclGroupStart",
                                      "simgpu_cache_alloc"};
#define NPATHS (sizeof k_paths / sizeof k_paths[0])
static long long g_path_calls[NPATHS];

/* Fails the check when the simulator recorded misuse or races since the last look, printing what. */
static void sim_clean(const char *where) {
  if (!sim()) return;
  char buf[8192];
  long long n = S.errors(buf, sizeof buf);
  CHECKF(n == 0, "%s: the simulated GPU recorded %lld misuse(s)/race(s):\n%s", where, n, buf);
  for (size_t i = 0; i < NPATHS; i++)
    g_path_calls[i] += S.calls(k_paths[i]);
  S.reset();
}

/* ---- buffers: device (or host) memory plus a host mirror holding what it must contain ---- */

typedef struct buf {
  int dev; /* FDP_HOST or an ordinal */
  size_t bytes;
  char *data; /* device address (never dereferenced here) or host memory */
  unsigned char *ref;
} buf_t;

static void dev_call(int dev, CUresult r, const char *what) {
  CHECKF(r == CUDA_SUCCESS, "%s on device %d: CUresult %d", what, dev, (int)r);
}

static void push(int dev) {
  dev_call(dev, D.CtxPush(g_ctx[dev]), "cuCtxPushCurrent");
}
static void pop(int dev) {
  CUcontext c;
  dev_call(dev, D.CtxPop(&c), "cuCtxPopCurrent");
}

/* Writes the mirror to the memory (the legacy stream, then a host synchronisation, as a blocking copy does). */
static void buf_upload(buf_t *b) {
  if (b->dev == FDP_HOST) {
    memcpy(b->data, b->ref, b->bytes);
    return;
  }
  push(b->dev);
  /* After whatever the device was doing with it (fastdp's streams included), as a blocking copy would be. */
  dev_call(b->dev, D.CtxSynchronize(), "cuCtxSynchronize");
  dev_call(b->dev, D.HtoD((CUdeviceptr)(uintptr_t)b->data, b->ref, b->bytes, NULL), "cuMemcpyHtoDAsync");
  dev_call(b->dev, D.StreamSynchronize(NULL), "cuStreamSynchronize");
  pop(b->dev);
}

static buf_t buf_new(int dev, size_t bytes) {
  buf_t b = {dev, bytes, NULL, xmalloc(bytes)};
  for (size_t i = 0; i < bytes; i++)
    b.ref[i] = (unsigned char)(rnd() >> 33);
  if (dev == FDP_HOST) {
    b.data = xmalloc(bytes);
  } else {
    CUdeviceptr p = 0;
    push(dev);
    dev_call(dev, D.MemAlloc(&p, bytes), "cuMemAlloc");
    pop(dev);
    b.data = (char *)(uintptr_t)p;
  }
  buf_upload(&b);
  return b;
}

static void buf_free(buf_t *b) {
  if (b->dev == FDP_HOST) {
    free(b->data);
  } else {
    push(b->dev);
    dev_call(b->dev, D.MemFree((CUdeviceptr)(uintptr_t)b->data), "cuMemFree");
    pop(b->dev);
  }
  free(b->ref);
  memset(b, 0, sizeof *b);
}

/* Reads the memory back (after the device finished everything) and compares it with the mirror. */
static int buf_matches(const buf_t *b, const char *what) {
  unsigned char *got = xmalloc(b->bytes);
  if (b->dev == FDP_HOST) {
    memcpy(got, b->data, b->bytes);
  } else {
    push(b->dev);
    dev_call(b->dev, D.CtxSynchronize(), "cuCtxSynchronize");
    dev_call(b->dev, D.DtoH(got, (CUdeviceptr)(uintptr_t)b->data, b->bytes, NULL), "cuMemcpyDtoHAsync");
    dev_call(b->dev, D.StreamSynchronize(NULL), "cuStreamSynchronize");
    pop(b->dev);
  }
  size_t i = 0;
  while (i < b->bytes && got[i] == b->ref[i])
    i++;
  CHECKF(i == b->bytes, "%s: byte %zu of %zu differs (device %d): got 0x%02x, want 0x%02x", what, i, b->bytes, b->dev,
         i < b->bytes ? got[i] : 0, i < b->bytes ? b->ref[i] : 0);
  free(got);
  return i == b->bytes;
}

/* ---- the caller around each operation ----
 * As a PyTorch program uses fastdp: every buffer of an operation was just written on the caller's stream of its
 * device (the kernel that produced a source, the allocation that handed out a destination), and right after the
 * operation returns the caller works on every buffer again on that stream (reads a result, reuses a source's
 * memory), with no synchronisation in between. Host buffers are read and written by the host right after the
 * call. The simulator records any of these accesses that the operation's own work is not ordered with. The
 * thread's current context must be the one it had before the call. */

static __thread CUcontext t_home_ctx; /* what the thread has current between operations */

static void caller_touch(const buf_t *b, const CUstream *streams, int write) {
  if (!sim() || b->bytes == 0) return;
  if (b->dev == FDP_HOST) {
    S.host_touch(b->data, b->bytes, write);
    return;
  }
  CHECK(S.touch(streams ? (void *)streams[b->dev] : NULL, b->dev, (unsigned long long)(uintptr_t)b->data, b->bytes,
                write) == 0);
}

static void caller_before(buf_t *const *bufs, int n, const CUstream *streams) {
  for (int i = 0; i < n; i++)
    caller_touch(bufs[i], streams, 1);
}

static void caller_after(buf_t *const *bufs, int n, const CUstream *streams, const char *what) {
  CUcontext now = NULL;
  CHECK(D.CtxGetCurrent(&now) == CUDA_SUCCESS);
  CHECKF(now == t_home_ctx, "%s: the caller's current context changed (%p before, %p after)", what,
         (void *)t_home_ctx, (void *)now);
  if (now != t_home_ctx) D.CtxSetCurrent(t_home_ctx);
  for (int i = 0; i < n; i++)
    caller_touch(bufs[i], streams, 1);
}

/* A view of a buffer, and the same view of its mirror. */
typedef struct view {
  fdp_tensor_t t, ref;
} view_t;

static view_t view(buf_t *b, int dtype, int es, int nd, const int64_t *sizes, const int64_t *strides, int64_t off) {
  view_t v;
  memset(&v, 0, sizeof v);
  v.t.device = b->dev;
  v.t.dtype = dtype;
  v.t.elem_size = es;
  v.t.ndim = nd;
  for (int i = 0; i < nd; i++) {
    v.t.sizes[i] = sizes[i];
    v.t.strides[i] = strides[i];
  }
  v.ref = v.t;
  v.t.data = b->data + off * es;
  v.ref.data = (char *)b->ref + off * es;
  v.ref.device = FDP_HOST;
  return v;
}

static int64_t numel(const fdp_tensor_t *t) {
  int64_t n = 1;
  for (int i = 0; i < t->ndim; i++)
    n *= t->sizes[i];
  return n;
}

/* Bytes a view spans from its first element. */
static size_t span(int es, int nd, const int64_t *sizes, const int64_t *strides) {
  int64_t last = 0;
  for (int i = 0; i < nd; i++)
    last += (sizes[i] - 1) * strides[i];
  return (size_t)(last + 1) * (size_t)es;
}

static void contig(int nd, const int64_t *sizes, int64_t *strides) {
  int64_t s = 1;
  for (int i = nd - 1; i >= 0; i--) {
    strides[i] = s;
    s *= sizes[i];
  }
}

/* The reference copy, element by element over the index space. */
static void ref_copy(const fdp_tensor_t *dst, const fdp_tensor_t *src) {
  int nd = src->ndim, es = src->elem_size;
  int64_t n = numel(src), idx[FDP_MAX_DIMS] = {0};
  for (int64_t k = 0; k < n; k++) {
    int64_t d = 0, s = 0;
    for (int i = 0; i < nd; i++) {
      d += idx[i] * dst->strides[i];
      s += idx[i] * src->strides[i];
    }
    memmove(dst->data + d * es, src->data + s * es, (size_t)es);
    for (int i = nd - 1; i >= 0; i--) {
      if (++idx[i] < src->sizes[i]) break;
      idx[i] = 0;
    }
  }
}

static fdp_streams_t all_streams(const CUstream *streams) {
  fdp_streams_t s;
  memset(&s, 0, sizeof s);
  for (int d = 0; d < g_ndev; d++) {
    s.device[s.n] = d;
    s.stream[s.n++] = streams ? (void *)streams[d] : NULL;
  }
  return s;
}

/* ---- copies ---- */

/* Layouts of a [a, b, c] tensor of `es`-byte elements: contiguous, rows padded, inner dims transposed, every
 * other element, a padded outer dim. */
enum { L_CONTIG, L_PADDED, L_TRANSPOSED, L_STEP2, L_OUTER, L_COUNT };
static const char *const k_layouts[L_COUNT] = {"contiguous", "padded rows", "transposed", "step 2", "padded outer"};

static void layout(int kind, const int64_t *sz, int64_t *st) {
  switch (kind) {
  case L_CONTIG: contig(3, sz, st); break;
  case L_PADDED:
    st[2] = 1;
    st[1] = sz[2] + 3;
    st[0] = st[1] * sz[1];
    break;
  case L_TRANSPOSED:
    st[1] = 1;
    st[2] = sz[1];
    st[0] = sz[1] * sz[2];
    break;
  case L_STEP2:
    st[2] = 2;
    st[1] = 2 * sz[2];
    st[0] = st[1] * sz[1];
    break;
  default:
    st[2] = 1;
    st[1] = sz[2];
    st[0] = sz[1] * sz[2] + 5;
    break;
  }
}

static void copy_case(int sdev, int ddev, int es, const int64_t *sz, int sl, int dl, const CUstream *streams) {
  int64_t ss[3], ds[3];
  layout(sl, sz, ss);
  layout(dl, sz, ds);
  buf_t sb = buf_new(sdev, span(es, 3, sz, ss) + 3 * (size_t)es);
  buf_t db = buf_new(ddev, span(es, 3, sz, ds) + 2 * (size_t)es);
  view_t s = view(&sb, FDP_DTYPE_OTHER, es, 3, sz, ss, 1), d = view(&db, FDP_DTYPE_OTHER, es, 3, sz, ds, 2);
  fdp_streams_t st = all_streams(streams);
  buf_t *both[2] = {&sb, &db};
  caller_before(both, 2, streams);
  fdp_result_t r = fdp_op_copy(&d.t, &s.t, 1, &st);
  caller_after(both, 2, streams, "copy");
  CHECKF(r == FDP_OK, "copy %d -> %d, %d-byte elements [%lld,%lld,%lld], %s -> %s: %s", sdev, ddev, es,
         (long long)sz[0], (long long)sz[1], (long long)sz[2], k_layouts[sl], k_layouts[dl], fdp_last_error());
  ref_copy(&d.ref, &s.ref);
  char what[160];
  snprintf(what, sizeof what, "copy %d -> %d, es %d, [%lld,%lld,%lld], %s -> %s", sdev, ddev, es, (long long)sz[0],
           (long long)sz[1], (long long)sz[2], k_layouts[sl], k_layouts[dl]);
  buf_matches(&db, what);
  CHECK(buf_matches(&sb, "copy source unchanged"));
  buf_free(&sb);
  buf_free(&db);
}

static void test_copies(void) {
  static const int64_t shapes[][3] = {{2, 3, 160}, {3, 5, 7}, {1, 1, 1}, {4, 9, 600}};
  static const int ess[] = {1, 2, 4, 8, 16};
  static const int pairs[][2] = {{0, 0}, {0, 1}, {FDP_HOST, 1}, {2, FDP_HOST}, {3, 2}, {FDP_HOST, 0}, {0, FDP_HOST}};
  int ndev = g_ndev;
  for (size_t p = 0; p < sizeof pairs / sizeof pairs[0]; p++) {
    int sdev = pairs[p][0], ddev = pairs[p][1];
    if (sdev >= ndev || ddev >= ndev) continue;
    for (size_t h = 0; h < sizeof shapes / sizeof shapes[0]; h++)
      for (int sl = 0; sl < L_COUNT; sl++)
        for (int dl = 0; dl < L_COUNT; dl++) {
          int es = ess[(h + (size_t)sl + (size_t)dl + p) % 5];
          if (shapes[h][2] == 600 && es > 4) es = 4;
          copy_case(sdev, ddev, es, shapes[h], sl, dl, (sl + dl) % 2 ? g_stream : NULL);
        }
  }
  sim_clean("copies");
}

/* ---- broadcast, scatter, gather ---- */

static void test_broadcast(void) {
  int64_t sz[2] = {37, 41}, st[2], pad[2] = {48, 1};
  contig(2, sz, st);
  for (int src_dev = FDP_HOST; src_dev < 1; src_dev++)
    for (int strided = 0; strided < 2; strided++)
      for (int s = 0; s < 2; s++) {
        buf_t sb = buf_new(src_dev, 37 * 41 * 4);
        view_t sv = view(&sb, FDP_DTYPE_F32, 4, 2, sz, st, 0);
        buf_t db[FDP_MAX_DEVICES];
        fdp_tensor_t dt[FDP_MAX_DEVICES];
        int n = 0;
        for (int d = 0; d < g_ndev; d++) {
          if (d == src_dev) continue;
          db[n] = buf_new(d, 37 * 48 * 4);
          view_t dv = view(&db[n], FDP_DTYPE_F32, 4, 2, sz, strided ? pad : st, 0);
          ref_copy(&dv.ref, &sv.ref);
          dt[n++] = dv.t;
        }
        fdp_streams_t streams = all_streams(s ? g_stream : NULL);
        buf_t *all[FDP_MAX_DEVICES + 1] = {&sb};
        for (int i = 0; i < n; i++)
          all[1 + i] = &db[i];
        caller_before(all, n + 1, s ? g_stream : NULL);
        OK(fdp_op_broadcast(&sv.t, dt, n, &streams));
        caller_after(all, n + 1, s ? g_stream : NULL, "broadcast");
        for (int i = 0; i < n; i++) {
          buf_matches(&db[i], "broadcast destination");
          buf_free(&db[i]);
        }
        buf_free(&sb);
      }
  sim_clean("broadcast");
}

static void test_scatter_gather(void) {
  int64_t sz[2] = {40, 24}, st[2];
  contig(2, sz, st);
  for (int src_dev = FDP_HOST; src_dev < 1; src_dev++)
    for (int dim = 0; dim < 2; dim++) {
      int n = g_ndev;
      buf_t sb = buf_new(src_dev, 40 * 24 * 8);
      view_t sv = view(&sb, FDP_DTYPE_F64, 8, 2, sz, st, 0);
      buf_t ob[FDP_MAX_DEVICES];
      fdp_tensor_t ot[FDP_MAX_DEVICES];
      int64_t chunks[FDP_MAX_DEVICES], start = 0;
      for (int i = 0; i < n; i++) {
        chunks[i] = sz[dim] / n + (i < sz[dim] % n);
        int64_t csz[2] = {sz[0], sz[1]}, cst[2];
        csz[dim] = chunks[i];
        contig(2, csz, cst);
        ob[i] = buf_new(i, (size_t)(csz[0] * csz[1] * 8));
        view_t ov = view(&ob[i], FDP_DTYPE_F64, 8, 2, csz, cst, 0);
        fdp_tensor_t part;
        fdp_tensor_narrow(&sv.ref, dim, start, chunks[i], &part);
        ref_copy(&ov.ref, &part);
        ot[i] = ov.t;
        start += chunks[i];
      }
      fdp_streams_t streams = all_streams(g_stream);
      buf_t *all[FDP_MAX_DEVICES + 1] = {&sb};
      for (int i = 0; i < n; i++)
        all[1 + i] = &ob[i];
      caller_before(all, n + 1, g_stream);
      OK(fdp_op_scatter(&sv.t, dim, chunks, ot, n, &streams));
      caller_after(all, n + 1, g_stream, "scatter");
      for (int i = 0; i < n; i++)
        buf_matches(&ob[i], "scatter output");
      /* And back: gather the chunks (changed) into a fresh output on the source's side. */
      buf_t gb = buf_new(src_dev, 40 * 24 * 8);
      view_t gv = view(&gb, FDP_DTYPE_F64, 8, 2, sz, st, 0);
      start = 0;
      for (int i = 0; i < n; i++) {
        for (size_t k = 0; k < ob[i].bytes; k++)
          ob[i].ref[k] = (unsigned char)rnd();
        buf_upload(&ob[i]);
        fdp_tensor_t part, in = ot[i];
        in.data = (char *)ob[i].ref;
        in.device = FDP_HOST;
        fdp_tensor_narrow(&gv.ref, dim, start, chunks[i], &part);
        ref_copy(&part, &in);
        start += chunks[i];
      }
      all[0] = &gb;
      caller_before(all, n + 1, g_stream);
      OK(fdp_op_gather(ot, n, dim, &gv.t, &streams));
      caller_after(all, n + 1, g_stream, "gather");
      buf_matches(&gb, "gather output");
      for (int i = 0; i < n; i++)
        buf_free(&ob[i]);
      buf_free(&gb);
      buf_free(&sb);
    }
  sim_clean("scatter/gather");
}

/* ---- reductions ---- */

static const struct {
  int dtype, es;
} k_dtypes[] = {{FDP_DTYPE_BOOL, 1}, {FDP_DTYPE_U8, 1},  {FDP_DTYPE_I8, 1},   {FDP_DTYPE_I16, 2},
                {FDP_DTYPE_I32, 4},  {FDP_DTYPE_I64, 8}, {FDP_DTYPE_F16, 2},  {FDP_DTYPE_BF16, 2},
                {FDP_DTYPE_F32, 4},  {FDP_DTYPE_F64, 8}};

/* Half types, independently of fastdp: exact values in double, and the nearest representable value found by
 * bisection over the (monotone) positive encodings, ties to the even encoding. */
static double half_value(uint16_t h, int bf) {
  int sign = h >> 15, e, m;
  double v;
  if (bf) {
    e = (h >> 7) & 0xff;
    m = h & 0x7f;
    v = e == 0 ? ldexp(m, -133) : ldexp(128 + m, e - 134);
    if (e == 0xff) v = m ? NAN : INFINITY;
  } else {
    e = (h >> 10) & 0x1f;
    m = h & 0x3ff;
    v = e == 0 ? ldexp(m, -24) : ldexp(1024 + m, e - 25);
    if (e == 0x1f) v = m ? NAN : INFINITY;
  }
  return sign ? -v : v;
}

static uint16_t half_round(double x, int bf) {
  uint16_t inf = bf ? 0x7f80 : 0x7c00, sign = signbit(x) ? 0x8000 : 0;
  double a = fabs(x);
  if (isnan(x)) return bf ? 0x7fc0 : 0x7e00;
  uint16_t lo = 0, hi = inf; /* largest encoding with value <= a */
  while (lo < hi) {
    uint16_t mid = (uint16_t)((lo + hi + 1) / 2);
    if (half_value(mid, bf) <= a)
      lo = mid;
    else
      hi = (uint16_t)(mid - 1);
  }
  if (lo == inf) return sign | inf;
  double below = half_value(lo, bf);
  /* the next value up; past the largest finite one, the rounding boundary is where inf would start */
  double above = lo + 1 == inf ? half_value(lo, bf) + (half_value(lo, bf) - half_value((uint16_t)(lo - 1), bf))
                               : half_value((uint16_t)(lo + 1), bf);
  uint16_t pick = lo;
  if (a - below > above - a || (a - below == above - a && (lo & 1))) pick = (uint16_t)(lo + 1);
  return sign | pick;
}

/* acc = acc + x per element in dtype's arithmetic (half types: float sum rounded, as PyTorch's CPU a + b). */
static void ref_add(int dtype, void *acc, const void *x, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    switch (dtype) {
    case FDP_DTYPE_BOOL: ((uint8_t *)acc)[i] = ((uint8_t *)acc)[i] || ((const uint8_t *)x)[i]; break;
    case FDP_DTYPE_U8:
    case FDP_DTYPE_I8: ((uint8_t *)acc)[i] = (uint8_t)(((uint8_t *)acc)[i] + ((const uint8_t *)x)[i]); break;
    case FDP_DTYPE_I16: ((uint16_t *)acc)[i] = (uint16_t)(((uint16_t *)acc)[i] + ((const uint16_t *)x)[i]); break;
    case FDP_DTYPE_I32: ((uint32_t *)acc)[i] += ((const uint32_t *)x)[i]; break;
    case FDP_DTYPE_I64: ((uint64_t *)acc)[i] += ((const uint64_t *)x)[i]; break;
    case FDP_DTYPE_F32: ((float *)acc)[i] += ((const float *)x)[i]; break;
    case FDP_DTYPE_F64: ((double *)acc)[i] += ((const double *)x)[i]; break;
    case FDP_DTYPE_F16:
    case FDP_DTYPE_BF16: {
      int bf = dtype == FDP_DTYPE_BF16;
      uint16_t *o = acc;
      /* the float add: the exact sum (in double) rounded once to float */
      float s = (float)(half_value(o[i], bf) + half_value(((const uint16_t *)x)[i], bf));
      o[i] = half_round((double)s, bf);
      break;
    }
    default: break;
    }
  }
}

/* Fills a mirror with values of the dtype: bools 0/1, finite halves and floats of modest size. */
static void fill_values(int dtype, unsigned char *p, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    double v = (double)((int64_t)(rnd() % 20001) - 10000) / 1000.0 * (1.0 + (double)(rnd() % 7) / 3.0);
    switch (dtype) {
    case FDP_DTYPE_BOOL: p[i] = (uint8_t)(rnd() & 1); break;
    case FDP_DTYPE_F16: ((uint16_t *)p)[i] = half_round(v, 0); break;
    case FDP_DTYPE_BF16: ((uint16_t *)p)[i] = half_round(v, 1); break;
    case FDP_DTYPE_F32: ((float *)p)[i] = (float)v; break;
    case FDP_DTYPE_F64: ((double *)p)[i] = v; break;
    default: break; /* integers keep their random bits */
    }
  }
}

/* out = sum of `n` inputs of `count` elements, on devs[i] (out on out_dev, or aliasing input `alias` >= 0). */
static void reduce_case(int dtype, int es, int n, const int *devs, int out_dev, int alias, int64_t count,
                        const CUstream *streams, int expect) {
  buf_t *in = xmalloc((size_t)n * sizeof *in);
  fdp_tensor_t *it = xmalloc((size_t)n * sizeof *it);
  int64_t sz[1] = {count}, st[1] = {1};
  for (int i = 0; i < n; i++) {
    in[i] = buf_new(devs[i], (size_t)(count * es));
    fill_values(dtype, in[i].ref, count);
    buf_upload(&in[i]);
    it[i] = view(&in[i], dtype, es, 1, sz, st, 0).t;
  }
  unsigned char *want = xmalloc((size_t)(count * es));
  memcpy(want, in[0].ref, (size_t)(count * es));
  for (int i = 1; i < n; i++)
    ref_add(dtype, want, in[i].ref, count);
  buf_t ob = {0};
  buf_t *outb = alias >= 0 ? &in[alias] : &ob;
  if (alias < 0) ob = buf_new(out_dev, (size_t)(count * es));
  fdp_tensor_t ot = alias >= 0 ? it[alias] : view(&ob, dtype, es, 1, sz, st, 0).t;
  fdp_streams_t s = all_streams(streams);
  buf_t **all = xmalloc((size_t)(n + 1) * sizeof *all);
  for (int i = 0; i < n; i++)
    all[i] = &in[i];
  all[n] = &ob;
  int nall = alias >= 0 ? n : n + 1;
  caller_before(all, nall, streams);
  fdp_result_t r = fdp_op_reduce(it, n, &ot, &s);
  caller_after(all, nall, streams, "reduce");
  free(all);
  CHECKF(r == (fdp_result_t)expect, "reduce of %d %s inputs: %s (%s)", n, fdp_dtype_name(dtype), fdp_result_name(r),
         fdp_last_error());
  if (r == FDP_OK) {
    memcpy(outb->ref, want, (size_t)(count * es));
    char what[96];
    snprintf(what, sizeof what, "reduce of %d %s inputs (alias %d)", n, fdp_dtype_name(dtype), alias);
    buf_matches(outb, what);
  }
  for (int i = 0; i < n; i++)
    buf_free(&in[i]);
  if (alias < 0) buf_free(&ob);
  free(want);
  free(in);
  free(it);
}

static void test_reduce(void) {
  int devs[80];
  for (size_t t = 0; t < sizeof k_dtypes / sizeof k_dtypes[0]; t++) {
    int dt = k_dtypes[t].dtype, es = k_dtypes[t].es;
    /* across devices: NCCL where it has the type; bool and int16 have no NCCL sum and no other path */
    for (int d = 0; d < g_ndev; d++)
      devs[d] = d;
    int nccl = dt != FDP_DTYPE_BOOL && dt != FDP_DTYPE_I16;
    if (g_ndev > 1) {
      reduce_case(dt, es, g_ndev, devs, 0, -1, 1000, g_stream, nccl ? FDP_OK : FDP_UNAVAILABLE);
      if (nccl) reduce_case(dt, es, g_ndev, devs, 0, 0, 333, NULL, FDP_OK);
    }
    /* on one device: 70 inputs, the output aliasing input 45 (a later pass still reads it) or input 0 */
    for (int i = 0; i < 70; i++)
      devs[i] = g_ndev > 1 ? 1 : 0;
    reduce_case(dt, es, 70, devs, devs[0], 45, 257, g_stream, FDP_OK);
    reduce_case(dt, es, 70, devs, devs[0], 0, 100, NULL, FDP_OK);
    reduce_case(dt, es, 3, devs, devs[0], -1, 4097, g_stream, FDP_OK);
    reduce_case(dt, es, 1, devs, devs[0], -1, 10, g_stream, FDP_OK);
  }
  sim_clean("reduce");
}

/* Sums longer than one launch run in passes, each carrying the running sum as its first input: an output that is
 * one of the inputs must come out right wherever it sits (in the first pass, first of a later pass's own inputs,
 * last of a pass, the very last) and however many inputs there are (up to 200: seven passes). float16, so that
 * any change of the order of the adds shows in the rounding. */
static void test_reduce_passes(void) {
  static const int counts[] = {2, 31, 32, 33, 63, 64, 94, 95, 200};
  int devs[200];
  for (int i = 0; i < 200; i++)
    devs[i] = g_ndev - 1;
  for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++) {
    int n = counts[c];
    int aliases[64], na = 0;
    aliases[na++] = -1;
    aliases[na++] = 0;
    aliases[na++] = 1;
    for (int start = FDP_SUM_MAX_INPUTS; start < n; start += FDP_SUM_MAX_INPUTS - 1) {
      if (start > 2 * FDP_SUM_MAX_INPUTS && start + 2 * FDP_SUM_MAX_INPUTS < n) continue; /* the middle passes */
      aliases[na++] = start - 1;
      aliases[na++] = start;
      if (start + 1 < n) aliases[na++] = start + 1;
    }
    aliases[na++] = n - 1;
    for (int a = 0; a < na; a++)
      if (aliases[a] < n)
        reduce_case(FDP_DTYPE_F16, 2, n, devs, devs[0], aliases[a], 37, a % 2 ? g_stream : NULL, FDP_OK);
  }
  sim_clean("sums in passes");
}

/* ---- coalesced: pack into flat buckets, broadcast them, unpack elsewhere; reduce buckets ---- */

static void test_coalesced(void) {
  enum { N = 7 };
  static const int64_t counts[N] = {10, 300, 1, 77, 4096, 5, 64};
  static const int dtypes[N] = {FDP_DTYPE_F32, FDP_DTYPE_F16, FDP_DTYPE_I64, FDP_DTYPE_F32, FDP_DTYPE_F32,
                                FDP_DTYPE_F16, FDP_DTYPE_I64};
  static const int ess[N] = {4, 2, 8, 4, 4, 2, 8};
  buf_t tb[N];
  fdp_tensor_t tt[N];
  for (int i = 0; i < N; i++) {
    int64_t sz[1] = {counts[i]}, st[1] = {1};
    tb[i] = buf_new(0, (size_t)(counts[i] * ess[i]));
    tt[i] = view(&tb[i], dtypes[i], ess[i], 1, sz, st, 0).t;
  }
  fdp_plan_t *plan = NULL;
  OK(fdp_plan_build(tt, NULL, N, 2048, &plan));
  fdp_streams_t streams = all_streams(g_stream);
  for (int b = 0; plan && b < plan->nbuckets; b++) {
    const fdp_bucket_t *bk = &plan->buckets[b];
    int64_t sz[1] = {bk->numel}, st[1] = {1};
    buf_t flat[FDP_MAX_DEVICES];
    fdp_tensor_t ft[FDP_MAX_DEVICES];
    for (int d = 0; d < g_ndev; d++) {
      flat[d] = buf_new(d, (size_t)(bk->numel * bk->elem_size));
      ft[d] = view(&flat[d], bk->dtype, bk->elem_size, 1, sz, st, 0).t;
    }
    /* pack on device 0 */
    fdp_tensor_t dsts[N], srcs[N];
    for (int m = 0; m < bk->count; m++) {
      const fdp_member_t *mb = &plan->members[bk->first + m];
      int64_t msz[1] = {mb->numel};
      view_t v = view(&flat[0], bk->dtype, bk->elem_size, 1, msz, st, mb->offset);
      dsts[m] = v.t;
      srcs[m] = tt[mb->tensor];
      memcpy(v.ref.data, tb[mb->tensor].ref, (size_t)(mb->numel * bk->elem_size));
    }
    OK(fdp_op_copy(dsts, srcs, bk->count, &streams));
    buf_matches(&flat[0], "packed bucket");
    /* broadcast the bucket to every other device */
    OK(fdp_op_broadcast(&ft[0], &ft[1], g_ndev - 1, &streams));
    for (int d = 1; d < g_ndev; d++) {
      memcpy(flat[d].ref, flat[0].ref, flat[0].bytes);
      buf_matches(&flat[d], "broadcast bucket");
    }
    /* unpack on the last device into fresh tensors */
    int last = g_ndev - 1;
    buf_t ub[N];
    for (int m = 0; m < bk->count; m++) {
      const fdp_member_t *mb = &plan->members[bk->first + m];
      int64_t msz[1] = {mb->numel};
      ub[m] = buf_new(last, (size_t)(mb->numel * bk->elem_size));
      dsts[m] = view(&ub[m], bk->dtype, bk->elem_size, 1, msz, st, 0).t;
      srcs[m] = view(&flat[last], bk->dtype, bk->elem_size, 1, msz, st, mb->offset).t;
      memcpy(ub[m].ref, tb[mb->tensor].ref, ub[m].bytes);
    }
    OK(fdp_op_copy(dsts, srcs, bk->count, &streams));
    for (int m = 0; m < bk->count; m++) {
      buf_matches(&ub[m], "unpacked member");
      buf_free(&ub[m]);
    }
    for (int d = 0; d < g_ndev; d++)
      buf_free(&flat[d]);
  }
  fdp_plan_free(plan);
  for (int i = 0; i < N; i++)
    buf_free(&tb[i]);
  sim_clean("coalesced");
}

/* ---- threads ---- */

static void bcast_order(int root, const int *dsts, int n, const CUstream *streams);

static void *thread_body(void *arg) {
  int id = (int)(intptr_t)arg;
  t_rng = 0x1234567ull * (uint64_t)(id + 1);
  CUstream mine[FDP_MAX_DEVICES];
  for (int d = 0; d < g_ndev; d++) {
    push(d);
    dev_call(d, D.StreamCreate(&mine[d], 1), "cuStreamCreate");
    pop(d);
  }
  int a = id % g_ndev, b = (id + 1) % g_ndev;
  for (int it = 0; it < 3; it++) {
    int64_t sz[3] = {3, 20, 200};
    copy_case(a, b, 4, sz, (id + it) % L_COUNT, (id + 2 * it) % L_COUNT, mine);
    int devs[4] = {a, a, a, a};
    reduce_case(FDP_DTYPE_F32, 4, 4, devs, a, -1, 999, mine, FDP_OK);
    if (g_ndev > 1) {
      int all[FDP_MAX_DEVICES];
      for (int d = 0; d < g_ndev; d++)
        all[d] = d;
      reduce_case(FDP_DTYPE_F16, 2, g_ndev, all, 0, -1, 500, mine, FDP_OK);
      /* Broadcasts over device lists that overlap other threads' (other roots, other lengths): the grouped
       * launches of two threads must never interleave on a device they share. */
      int dsts[FDP_MAX_DEVICES], k = 1 + id % (g_ndev - 1);
      for (int j = 0; j < k; j++)
        dsts[j] = (a + 1 + j) % g_ndev;
      bcast_order(a, dsts, k, mine);
    }
  }
  for (int d = 0; d < g_ndev; d++) {
    push(d);
    dev_call(d, D.CtxSynchronize(), "cuCtxSynchronize");
    dev_call(d, D.StreamDestroy(mine[d]), "cuStreamDestroy");
    pop(d);
  }
  return NULL;
}

static void test_threads(void) {
  pthread_t th[8];
  for (int i = 0; i < 8; i++)
    CHECK(pthread_create(&th[i], NULL, thread_body, (void *)(intptr_t)i) == 0);
  for (int i = 0; i < 8; i++)
    pthread_join(th[i], NULL);
  sim_clean("8 threads");
}

static void test_shutdown_reuse(void) {
  fdp_shutdown();
  test_broadcast();
  int devs[2] = {0, 0};
  reduce_case(FDP_DTYPE_F32, 4, 2, devs, 0, -1, 100, g_stream, FDP_OK);
  fdp_shutdown();
  fdp_shutdown();
  int64_t sz[3] = {2, 4, 130};
  copy_case(0, g_ndev - 1, 4, sz, L_PADDED, L_TRANSPOSED, g_stream);
  sim_clean("shutdown then reuse");
}

/* ---- the kernels at their limits ---- */

/* Element offsets beyond 2^31 (the strided-copy kernel must index in 64 bits): two rows 2^31 + 8 bytes apart in one
 * allocation, copied to a dense 2 x 3 byte tensor. */
static void test_kernel_wide_offsets(void) {
  const long long stride = (1ll << 31) + 8;
  CUdeviceptr big = 0;
  push(0);
  CUresult e = D.MemAlloc(&big, (size_t)stride + 64);
  if (e != CUDA_SUCCESS) { /* a real GPU with less than 2 GiB free */
    pop(0);
    printf("  (skipped: no 2 GiB allocation on device 0)\n");
    return;
  }
  unsigned char rows[2][3] = {{1, 2, 3}, {4, 5, 6}};
  for (int r = 0; r < 2; r++)
    dev_call(0, D.HtoD(big + (CUdeviceptr)(r * stride), rows[r], 3, NULL), "cuMemcpyHtoDAsync");
  dev_call(0, D.StreamSynchronize(NULL), "cuStreamSynchronize");
  pop(0);
  buf_t db = buf_new(0, 6);
  int64_t sz[2] = {2, 3}, st[2] = {stride, 1}, dst_st[2] = {3, 1};
  fdp_tensor_t src;
  memset(&src, 0, sizeof src);
  src.data = (char *)(uintptr_t)big;
  src.device = 0;
  src.dtype = FDP_DTYPE_U8;
  src.elem_size = 1;
  src.ndim = 2;
  memcpy(src.sizes, sz, sizeof sz);
  memcpy(src.strides, st, sizeof st);
  view_t dv = view(&db, FDP_DTYPE_U8, 1, 2, sz, dst_st, 0);
  memcpy(db.ref, rows, 6);
  fdp_streams_t fs = all_streams(g_stream);
  OK(fdp_op_copy(&dv.t, &src, 1, &fs));
  buf_matches(&db, "copy of rows 2^31 + 8 bytes apart");
  buf_free(&db);
  push(0);
  dev_call(0, D.CtxSynchronize(), "cuCtxSynchronize");
  dev_call(0, D.MemFree(big), "cuMemFree");
  pop(0);
  sim_clean("kernel offsets past 2^31");
}

/* A sum of more than 2^31 elements (the kernel must index elements in 64 bits), on a real GPU only: the simulated
 * one runs kernels one thread at a time, and 2^31 of them take minutes. Three 2 GiB byte inputs of 1, 2 and 3. */
static void test_kernel_huge_sum(void) {
  if (sim()) return;
  const size_t n = (1ull << 31) + 4096;
  unsigned char *host = malloc(n);
  CUdeviceptr in[3] = {0, 0, 0}, out = 0;
  int ok = host != NULL;
  push(0);
  for (int i = 0; i < 3 && ok; i++)
    ok = D.MemAlloc(&in[i], n) == CUDA_SUCCESS;
  ok = ok && D.MemAlloc(&out, n) == CUDA_SUCCESS;
  if (!ok) {
    printf("  (skipped: no 8 GiB on device 0 for a sum past 2^31 elements)\n");
  } else {
    for (int i = 0; i < 3; i++) {
      memset(host, i + 1, n);
      dev_call(0, D.HtoD(in[i], host, n, NULL), "cuMemcpyHtoDAsync");
      dev_call(0, D.StreamSynchronize(NULL), "cuStreamSynchronize");
    }
    fdp_tensor_t t[4];
    memset(t, 0, sizeof t);
    for (int i = 0; i < 4; i++) {
      t[i].data = (char *)(uintptr_t)(i < 3 ? in[i] : out);
      t[i].device = 0;
      t[i].dtype = FDP_DTYPE_U8;
      t[i].elem_size = 1;
      t[i].ndim = 1;
      t[i].sizes[0] = (int64_t)n;
      t[i].strides[0] = 1;
    }
    fdp_streams_t fs = all_streams(NULL);
    OK(fdp_op_reduce(t, 3, &t[3], &fs));
    dev_call(0, D.CtxSynchronize(), "cuCtxSynchronize");
    dev_call(0, D.DtoH(host, out, n, NULL), "cuMemcpyDtoHAsync");
    dev_call(0, D.StreamSynchronize(NULL), "cuStreamSynchronize");
    size_t bad = 0;
    while (bad < n && host[bad] == 6)
      bad++;
    CHECKF(bad == n, "sum past 2^31 elements: element %zu is %d, want 6", bad, bad < n ? host[bad] : 6);
  }
  for (int i = 0; i < 3; i++)
    if (in[i]) D.MemFree(in[i]);
  if (out) D.MemFree(out);
  pop(0);
  free(host);
}

/* Sums and strided copies of many times more elements than one grid has threads (the simulated devices have few
 * multiprocessors, so the grid is small): every element is written once, nothing past the end. */
static void test_kernel_many_elements(void) {
  int devs[3] = {0, 0, 0};
  reduce_case(FDP_DTYPE_F32, 4, 3, devs, 0, -1, 100003, g_stream, FDP_OK);
  reduce_case(FDP_DTYPE_F16, 2, 3, devs, 0, 1, 65537, NULL, FDP_OK);
  int64_t sz[3] = {3, 77, 301};
  copy_case(0, 0, 2, sz, L_CONTIG, L_TRANSPOSED, g_stream);
  copy_case(0, 0, 8, sz, L_STEP2, L_CONTIG, NULL);
  sim_clean("kernels over many grids");
}

/* ---- elements at addresses that are not a multiple of their size ---- */

/* A view starting `bytes` bytes into a buffer: its elements need not be aligned to their size. */
static view_t view_at_byte(buf_t *b, int es, int nd, const int64_t *sizes, const int64_t *strides, size_t bytes) {
  view_t v = view(b, FDP_DTYPE_OTHER, es, nd, sizes, strides, 0);
  v.t.data += bytes;
  v.ref.data += bytes;
  return v;
}

/* A GPU faults on a wide element at an address that is not a multiple of its width. Copies of misaligned elements
 * move bytes instead (same device, staged across devices, to and from host memory); a sum cannot, so it is refused
 * before any work is enqueued. */
static void test_misaligned(void) {
  static const int ess[] = {2, 4, 8, 16};
  int64_t sz[2] = {13, 9}, contig_st[2] = {9, 1}, trans_st[2] = {1, 13};
  static const int pairs[][2] = {{0, 0}, {0, 1}, {FDP_HOST, 1}, {1, FDP_HOST}};
  for (size_t e = 0; e < sizeof ess / sizeof ess[0]; e++)
    for (size_t p = 0; p < sizeof pairs / sizeof pairs[0]; p++)
      for (int layout_kind = 0; layout_kind < 2; layout_kind++) {
        int es = ess[e], sdev = pairs[p][0], ddev = pairs[p][1] < g_ndev ? pairs[p][1] : 0;
        if (sdev >= g_ndev) continue;
        size_t soff = (size_t)(es > 2 ? es / 2 : 1), doff = 1 + (size_t)(es > 4 ? es / 4 : 0);
        buf_t sb = buf_new(sdev, span(es, 2, sz, contig_st) + 2 * (size_t)es);
        buf_t db = buf_new(ddev, span(es, 2, sz, trans_st) + 2 * (size_t)es);
        view_t s = view_at_byte(&sb, es, 2, sz, contig_st, soff);
        view_t d = view_at_byte(&db, es, 2, sz, layout_kind ? trans_st : contig_st, doff);
        fdp_streams_t st = all_streams(g_stream);
        buf_t *both[2] = {&sb, &db};
        caller_before(both, 2, g_stream);
        fdp_result_t r = fdp_op_copy(&d.t, &s.t, 1, &st);
        caller_after(both, 2, g_stream, "misaligned copy");
        CHECKF(r == FDP_OK, "copy %d -> %d of %d-byte elements %zu and %zu bytes into their buffers: %s", sdev, ddev,
               es, soff, doff, fdp_last_error());
        ref_copy(&d.ref, &s.ref);
        char what[128];
        snprintf(what, sizeof what, "copy %d -> %d of misaligned %d-byte elements (%s)", sdev, ddev, es,
                 layout_kind ? "transposed" : "contiguous");
        buf_matches(&db, what);
        buf_free(&sb);
        buf_free(&db);
      }
  /* Rows too short for the copy engines go to the kernel, which copies them in elements of up to 16 bytes where
   * the rows split into such and both addresses are aligned to them: every element offset of each side. */
  for (size_t e = 0; e < 4; e++) {
    int es = 1 << e;
    int64_t rows[2] = {7, 48}, sst[2] = {48 + 16, 1}, dst_st[2] = {48 + 32, 1};
    for (int so = 0; so < 4; so++)
      for (int dof = 0; dof < 4; dof++) {
        buf_t sb = buf_new(0, span(es, 2, rows, sst) + 4 * (size_t)es);
        buf_t db = buf_new(0, span(es, 2, rows, dst_st) + 4 * (size_t)es);
        view_t s = view(&sb, FDP_DTYPE_OTHER, es, 2, rows, sst, so);
        view_t d = view(&db, FDP_DTYPE_OTHER, es, 2, rows, dst_st, dof);
        fdp_streams_t st = all_streams(g_stream);
        CHECKF(fdp_op_copy(&d.t, &s.t, 1, &st) == FDP_OK, "rows of %d-byte elements at offsets %d, %d: %s", es, so, dof,
               fdp_last_error());
        ref_copy(&d.ref, &s.ref);
        buf_matches(&db, "rows copied in widened elements");
        buf_free(&sb);
        buf_free(&db);
      }
  }
  /* Sums: on one device (the kernel) and across devices; an input or the output one element size off by half. */
  static const struct {
    int dtype, es;
  } sums[] = {{FDP_DTYPE_F64, 8}, {FDP_DTYPE_F32, 4}, {FDP_DTYPE_F16, 2}};
  for (size_t t = 0; t < sizeof sums / sizeof sums[0]; t++)
    for (int which = 0; which < 3; which++) {
      int es = sums[t].es, n = g_ndev > 1 ? 2 : 3;
      int64_t count = 50, one[1] = {count}, unit[1] = {1};
      buf_t b[4];
      fdp_tensor_t in[3], out;
      for (int i = 0; i < n + 1; i++) {
        int dev = which == 2 && g_ndev > 1 ? (i < n ? i : 0) : 0;
        b[i] = buf_new(dev, (size_t)(count + 1) * (size_t)es);
        size_t off = (which == 0 && i == 1) || (which != 0 && i == n) ? (size_t)es / 2 : 0;
        fdp_tensor_t v = view_at_byte(&b[i], es, 1, one, unit, off).t;
        v.dtype = sums[t].dtype;
        if (i < n)
          in[i] = v;
        else
          out = v;
      }
      fdp_streams_t st = all_streams(g_stream);
      fdp_result_t r = fdp_op_reduce(in, n, &out, &st);
      CHECKF(r == FDP_INVALID && strstr(fdp_last_error(), "not aligned") != NULL,
             "a sum of %s with a misaligned %s: %s (%s), want FDP_INVALID", fdp_dtype_name(sums[t].dtype),
             which == 0 ? "input" : "output", fdp_result_name(r), fdp_last_error());
      for (int i = 0; i < n + 1; i++)
        CHECK(buf_matches(&b[i], "a refused sum's buffers are untouched"));
      for (int i = 0; i < n + 1; i++)
        buf_free(&b[i]);
    }
  sim_clean("misaligned elements");
}

/* ---- rank order is not device order ---- */

/* A broadcast from `root` to `dsts` (in that order), dense: NCCL's route. */
static void bcast_order(int root, const int *dsts, int n, const CUstream *streams) {
  int64_t sz[1] = {777}, st[1] = {1};
  buf_t sb = buf_new(root, 777 * 4), db[FDP_MAX_DEVICES];
  view_t sv = view(&sb, FDP_DTYPE_F32, 4, 1, sz, st, 0);
  fdp_tensor_t dt[FDP_MAX_DEVICES];
  buf_t *all[FDP_MAX_DEVICES + 1] = {&sb};
  for (int i = 0; i < n; i++) {
    db[i] = buf_new(dsts[i], 777 * 4);
    memcpy(db[i].ref, sb.ref, sb.bytes);
    dt[i] = view(&db[i], FDP_DTYPE_F32, 4, 1, sz, st, 0).t;
    all[1 + i] = &db[i];
  }
  fdp_streams_t fs = all_streams(streams);
  caller_before(all, n + 1, streams);
  OK(fdp_op_broadcast(&sv.t, dt, n, &fs));
  caller_after(all, n + 1, streams, "broadcast in device order");
  for (int i = 0; i < n; i++) {
    buf_matches(&db[i], "broadcast, devices not in ascending order");
    buf_free(&db[i]);
  }
  buf_free(&sb);
}

/* Roots other than device 0, device lists not ascending, and one set of devices in two orders: each order is its
 * own communicator set (rank i runs on the i-th device listed), so the second order builds new communicators. */
static void test_order(void) {
  if (g_ndev < 3) return;
  int desc[FDP_MAX_DEVICES], rot[FDP_MAX_DEVICES], k = 0;
  for (int d = g_ndev - 1; d >= 1; d--)
    desc[k++] = d;
  long long comms = sim() ? S.stat("comms") : 0;
  bcast_order(0, desc, k, g_stream);
  k = 0;
  for (int i = 1; i < g_ndev; i++)
    desc[k++] = i; /* the same set, ascending now */
  bcast_order(0, desc, k, NULL);
  if (sim()) CHECKF(S.stat("comms") - comms == 2 * g_ndev, "two orders of one device set share communicators");
  k = 0;
  for (int d = g_ndev - 1; d >= 0; d--)
    if (d != 2) rot[k++] = d;
  bcast_order(2, rot, k, g_stream); /* root: device 2 */
  /* reduce into the last device from inputs listed out of order */
  int devs[FDP_MAX_DEVICES];
  for (int i = 0; i < g_ndev; i++)
    devs[i] = (i * 3 + 1) % g_ndev;
  int distinct = 1;
  for (int i = 0; i < g_ndev; i++)
    for (int j = 0; j < i; j++)
      distinct &= devs[i] != devs[j];
  if (!distinct)
    for (int i = 0; i < g_ndev; i++)
      devs[i] = g_ndev - 1 - i;
  /* integers: NCCL's summation order across ranks is its own, so the sum is checked where the order cannot matter */
  reduce_case(FDP_DTYPE_I32, 4, g_ndev, devs, g_ndev - 1, -1, 999, g_stream, FDP_OK);
  reduce_case(FDP_DTYPE_I64, 8, g_ndev, devs, devs[2], 2, 500, NULL, FDP_OK);
  sim_clean("rank order");
}

/* Types NCCL has no name for (bool, int16, complex) are broadcast as their bytes: a count of bytes, not of
 * elements, or only the first part of each buffer would arrive. */
static void test_nccl_bytes(void) {
  if (g_ndev < 2 || !fdp_backend_usable(FDP_BACKEND_NCCL, NULL) || getenv("FASTDP_DISABLE_NCCL")) return;
  static const struct {
    int dtype, es;
    const char *what;
  } types[] = {{FDP_DTYPE_BOOL, 1, "bool"},
               {FDP_DTYPE_I16, 2, "int16"},
               {FDP_DTYPE_OTHER, 8, "complex64"},
               {FDP_DTYPE_OTHER, 16, "complex128"}};
  for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
    int64_t sz[2] = {7, 33}, st[2] = {33, 1};
    int es = types[t].es, n = g_ndev - 1;
    buf_t sb = buf_new(0, 7 * 33 * (size_t)es), db[FDP_MAX_DEVICES];
    view_t sv = view(&sb, types[t].dtype, es, 2, sz, st, 0);
    fdp_tensor_t dt[FDP_MAX_DEVICES];
    buf_t *all[FDP_MAX_DEVICES + 1] = {&sb};
    for (int i = 0; i < n; i++) {
      db[i] = buf_new(1 + i, sb.bytes);
      memcpy(db[i].ref, sb.ref, sb.bytes);
      dt[i] = view(&db[i], types[t].dtype, es, 2, sz, st, 0).t;
      all[1 + i] = &db[i];
    }
    long long before = sim() ? S.calls("ncclBroadcast") : 0;
    fdp_streams_t fs = all_streams(g_stream);
    caller_before(all, n + 1, g_stream);
    OK(fdp_op_broadcast(&sv.t, dt, n, &fs));
    caller_after(all, n + 1, g_stream, "broadcast as bytes");
    if (sim())
      CHECKF(S.calls("ncclBroadcast") - before == g_ndev, "a %s broadcast did not go through NCCL", types[t].what);
    for (int i = 0; i < n; i++) {
      char what[64];
      snprintf(what, sizeof what, "%s broadcast through NCCL as bytes", types[t].what);
      buf_matches(&db[i], what);
      buf_free(&db[i]);
    }
    buf_free(&sb);
  }
  sim_clean("NCCL broadcasts of types it has no name for");
}

/* A communicator that reports an asynchronous error (its peer died, a network failed) is never used again: the
 * next collective on those devices runs on new communicators. It stays broken until it is aborted, so shutting
 * down aborts it too (destroying it waits for work that never finishes). */
static void test_nccl_async_error(void) {
  if (!sim() || g_ndev < 2 || !fdp_backend_usable(FDP_BACKEND_NCCL, NULL) || getenv("FASTDP_DISABLE_NCCL")) return;
  int dsts[FDP_MAX_DEVICES];
  for (int i = 1; i < g_ndev; i++)
    dsts[i - 1] = i;
  bcast_order(0, dsts, g_ndev - 1, g_stream);
  sim_clean("before the asynchronous error");
  CHECK(S.nccl_break(1, 6 /* ncclRemoteError */) >= 1);
  long long aborts = S.calls("ncclCommAbort"), comms = S.stat("comms");
  bcast_order(0, dsts, g_ndev - 1, g_stream);
  CHECKF(S.calls("ncclCommAbort") - aborts == g_ndev, "the broken communicators were not aborted");
  CHECKF(S.stat("comms") == comms, "communicators: %lld before, %lld after a rebuild", comms, S.stat("comms"));
  sim_clean("after the asynchronous error");
  CHECK(S.nccl_break(2 % g_ndev, 3 /* ncclInternalError */) >= 1);
  aborts = S.calls("ncclCommAbort");
  fdp_shutdown();
  CHECKF(S.calls("ncclCommAbort") - aborts >= g_ndev, "shutdown did not abort the broken communicators");
  CHECKF(S.stat("comms") == 0, "%lld communicators live after shutdown", S.stat("comms"));
  sim_clean("shutdown with a broken communicator set");
}

/* ---- threads racing on first use (--race) ----
 * What fastdp makes lazily, once per device or device list (retained contexts, peer access, kernel modules and the
 * images they load, communicator sets, the facts read from them), must be made once and be visible to another
 * thread only when complete. Each round starts from nothing (fdp_shutdown), and RACERS threads released together
 * use all of it for the first time at once, while the simulator pauses inside each making call (module loads,
 * context retains, peer enables, communicator set-up) so that the threads overlap there. Results are checked, and
 * after each round's shutdown nothing may be left (a second copy of anything made twice would be). Built with
 * ThreadSanitizer too (tests/c/build.py --tsan), where an object read before it was published is a data race. */

#define RACERS 6
#define RACE_ROUNDS 3
static pthread_barrier_t g_race_start;

/* Where device `dev`'s kernels came from: "" until they are loaded. */
static size_t race_facts(int dev) {
  fdp_device_facts_t f;
  memset(&f, 0, sizeof f);
  CHECKF(fdp_device_facts(dev, FDP_FREE_IF_ACTIVE, &f) == FDP_OK, "device facts %d: %s", dev, fdp_last_error());
  size_t n = 0;
  while (f.kernels_source != NULL && n < 1024 && f.kernels_source[n] != '\0') /* byte by byte: each read is seen */
    n++;
  CHECK(f.kernels_source != NULL && n < 1024);
  return n;
}

/* Reads every device's facts while the other threads load their kernels, taking no lock of fastdp's in between:
 * only how the facts are published may order the reads after the writes. */
static void race_watch_facts(void) {
  for (int round = 0; round < 400; round++) {
    int loaded = 0;
    for (int d = 0; d < g_ndev; d++)
      loaded += race_facts(d) > 0;
    if (loaded == g_ndev) return;
    usleep(250);
  }
}

/* With FASTDP_DISABLE_FATBIN set, kernels come from NVRTC images: one thread drops the images kept in memory while
 * another thread's first module load (paused by the simulator) still reads one. */
static void race_forget_images(void) {
  if (!getenv("FASTDP_DISABLE_FATBIN")) return;
  for (int spin = 0; spin < 2000 && S.calls("cuModuleLoadData") < 2; spin++) /* device 0's, then another's */
    usleep(500);
  fdp_kernels_image_info_t info;
  CHECKF(fdp_kernels_image(90, 1, &info) == FDP_OK, "kernel image: %s", fdp_last_error());
}

static void *race_body(void *arg) {
  int id = (int)(intptr_t)arg;
  t_rng = 0x9e3779b97f4a7c15ull * (uint64_t)(id + 7);
  CUstream mine[FDP_MAX_DEVICES];
  for (int d = 0; d < g_ndev; d++) {
    push(d);
    dev_call(d, D.StreamCreate(&mine[d], 1), "cuStreamCreate");
    pop(d);
  }
  int a = id % g_ndev, b = (id + 1) % g_ndev;
  int64_t sz[3] = {2, 9, 70};
  int devs[3] = {a, a, a}, first[3] = {0, 0, 0};
  pthread_barrier_wait(&g_race_start);
  /* First, thread 0 loads device 0's kernels, and threads 1 and 2 use them right after they are published, without
   * taking the lock the loading thread held: only the publication itself may order their reads after the load's
   * writes. (They wait on the simulator's count of functions looked up, which orders nothing in fastdp.) */
  if (id < 3 && sim()) {
    if (id > 0) {
      for (int spin = 0; spin < 4000 && S.calls("cuModuleGetFunction") < 14; spin++)
        usleep(250);
      usleep(3000);
    }
    reduce_case(FDP_DTYPE_F32, 4, 3, first, 0, -1, 333, mine, FDP_OK);
  }
  pthread_barrier_wait(&g_race_start);
  if (id == RACERS - 1) race_forget_images();
  if (id == RACERS - 2) race_watch_facts();
  /* Each thread its own order, so that every kind of first use meets every other. */
  for (int step = 0; step < 4; step++) {
    switch ((step + id) % 4) {
    case 0: reduce_case(FDP_DTYPE_F32, 4, 3, devs, a, -1, 777, mine, FDP_OK); break; /* kernels on a */
    case 1: copy_case(a, b, 4, sz, L_TRANSPOSED, L_STEP2, mine); break;              /* contexts, peers, kernels */
    case 2: race_facts(a); break;
    default:
      if (g_ndev > 1 && fdp_backend_usable(FDP_BACKEND_NCCL, NULL) && !getenv("FASTDP_DISABLE_NCCL")) {
        /* Device lists that overlap other threads' (other roots, other lengths), several times, so that grouped
         * launches of threads meet on the devices they share. */
        int dsts[FDP_MAX_DEVICES], k = 1 + id % (g_ndev - 1);
        for (int j = 0; j < k; j++)
          dsts[j] = (a + 1 + j) % g_ndev;
        for (int rep = 0; rep < 4; rep++)
          bcast_order(a, dsts, k, mine);
      }
      break;
    }
  }
  for (int d = 0; d < g_ndev; d++) {
    push(d);
    dev_call(d, D.CtxSynchronize(), "cuCtxSynchronize");
    dev_call(d, D.StreamDestroy(mine[d]), "cuStreamDestroy");
    pop(d);
  }
  return NULL;
}

static void race(void) {
  for (int round = 0; round < RACE_ROUNDS; round++) {
    fdp_shutdown();
    if (sim()) {
      sim_clean("before a race");
      S.pause("cuModuleLoadData", 20000, RACERS);
      S.pause("cuDevicePrimaryCtxRetain", 2000, 4 * RACERS);
      S.pause("cuCtxEnablePeerAccess", 2000, 4 * RACERS);
      S.pause("ncclCommInitAll", 5000, RACERS);
    }
    CHECK(pthread_barrier_init(&g_race_start, NULL, RACERS) == 0);
    pthread_t th[RACERS];
    for (int i = 0; i < RACERS; i++)
      CHECK(pthread_create(&th[i], NULL, race_body, (void *)(intptr_t)i) == 0);
    for (int i = 0; i < RACERS; i++)
      pthread_join(th[i], NULL);
    pthread_barrier_destroy(&g_race_start);
    sim_clean("threads racing on first use");
    fdp_shutdown();
    if (sim()) {
      /* Only the client's own references are left; anything made twice and kept once would be too. */
      CHECKF(S.stat("retains") == g_ndev, "after a race and shutdown: %lld context references, the client holds %d",
             S.stat("retains"), g_ndev);
      CHECKF(S.stat("modules") == 0 && S.stat("comms") == 0, "after a race and shutdown: %lld modules, %lld comms",
             S.stat("modules"), S.stat("comms"));
    }
  }
  printf("race: %d rounds of %d threads on first use%s\n", RACE_ROUNDS, RACERS,
         getenv("FASTDP_DISABLE_FATBIN") ? " (NVRTC images, one dropped during a load)" : "");
}

/* ---- fault injection (simulator only) ---- */

/* One operation of the sweep over prepared buffers; `verify` compares the results with the reference. */
typedef struct sweep_op {
  const char *name;
  void (*setup)(void);
  void (*prepare)(void); /* before each run, before a failure is armed (may be NULL) */
  fdp_result_t (*run)(void);
  void (*verify)(void);
  void (*teardown)(void);
} sweep_op_t;

/* ---- the gradient reduction on streams of its own (fastdp._reducer, NOTE [reduction streams]) ----
 * The inputs are produced on the caller's streams; autograd makes device 0's stream (the bucket node's canonical
 * one) wait for all of them; fastdp makes each of its own streams wait for that stream, sums there, and the consumer
 * (device 0's stream again) waits for a fence behind its own stream of device 0; the host releases the inputs (the
 * caller may reuse their memory) only once a fence behind every own stream reports done. `skip` drops one of
 * fastdp's orderings (0..n-1: an own stream's wait, n: the consumer's, n + 1: the host's query): the simulator must
 * report a race for each. Returns the races recorded (0 on a real driver, where nothing is checked). */
static long long own_streams_case(int n, const int *devs, int skip) {
  int64_t count = 777, sz[1] = {count}, st[1] = {1};
  int es = 4;
  buf_t in[8], out = buf_new(devs[0], (size_t)(count * es));
  fdp_tensor_t it[8];
  CUstream own[FDP_MAX_DEVICES] = {0};
  fdp_streams_t own_all = {0}, caller = {0}, canonical = {1, {devs[0]}, {(void *)g_stream[devs[0]]}};
  for (int i = 0; i < n; i++) {
    in[i] = buf_new(devs[i], (size_t)(count * es));
    fill_values(FDP_DTYPE_F32, in[i].ref, count);
    buf_upload(&in[i]);
    it[i] = view(&in[i], FDP_DTYPE_F32, es, 1, sz, st, 0).t;
    int d = devs[i];
    if (own[d] == NULL) {
      push(d);
      dev_call(d, D.StreamCreate(&own[d], 1), "cuStreamCreate");
      pop(d);
      own_all.device[own_all.n] = d;
      own_all.stream[own_all.n++] = (void *)own[d];
      caller.device[caller.n] = d;
      caller.stream[caller.n++] = (void *)g_stream[d];
    }
  }
  fdp_tensor_t ot = view(&out, FDP_DTYPE_F32, es, 1, sz, st, 0).t;
  buf_t *all[9];
  for (int i = 0; i < n; i++)
    all[i] = &in[i];
  all[n] = &out;
  caller_before(all, n + 1, g_stream); /* the gradients produced, the output handed out, on the caller's streams */
  for (int k = 0; k < caller.n; k++) { /* autograd: the canonical stream waits for every input's producer */
    fdp_streams_t one = {1, {caller.device[k]}, {caller.stream[k]}};
    OK(fdp_streams_order(&canonical, &one));
  }
  for (int k = 0; k < own_all.n; k++) { /* fastdp: each own stream waits for the canonical one */
    fdp_streams_t waiter = {1, {own_all.device[k]}, {own_all.stream[k]}};
    if (skip != k) OK(fdp_streams_order(&waiter, &canonical));
  }
  OK(fdp_op_reduce(it, n, &ot, &own_all));
  fdp_fence_t *deliver = NULL, *release = NULL;
  fdp_streams_t first = {1, {own_all.device[0]}, {own_all.stream[0]}};
  OK(fdp_fence_record(&first, &deliver));
  OK(fdp_fence_record(&own_all, &release));
  if (skip != own_all.n) OK(fdp_fence_wait(deliver, &canonical)); /* the delivery: the consumer waits */
  caller_touch(&out, g_stream, 0);                                  /* and reads the sum */
  int done = 0;
  if (skip != own_all.n + 1) OK(fdp_fence_query(release, &done)); /* later, the host releases the inputs */
  CHECK(done || skip == own_all.n + 1);
  for (int i = 0; i < n; i++)
    caller_touch(&in[i], g_stream, 1); /* the caller reuses the inputs' memory */
  fdp_fence_free(deliver);
  fdp_fence_free(release);
  unsigned char *want = out.ref;
  memcpy(want, in[0].ref, (size_t)(count * es));
  for (int i = 1; i < n; i++)
    ref_add(FDP_DTYPE_F32, want, in[i].ref, count);
  buf_matches(&out, "reduce on own streams");
  long long races = 0;
  if (sim()) {
    char text[4096];
    races = S.errors(text, sizeof text);
    S.reset();
  }
  for (int k = 0; k < own_all.n; k++) {
    push(own_all.device[k]);
    dev_call(own_all.device[k], D.StreamDestroy(own[own_all.device[k]]), "cuStreamDestroy");
    pop(own_all.device[k]);
  }
  for (int i = 0; i < n; i++)
    buf_free(&in[i]);
  buf_free(&out);
  return races;
}

static void test_reduce_on_own_streams(void) {
  int spread[8], same[3] = {0, 0, 0};
  for (int d = 0; d < g_ndev; d++)
    spread[d] = d;
  const int *cases[2] = {spread, same};
  int counts[2] = {g_ndev, 3};
  for (int c = 0; c < 2; c++) {
    if (counts[c] < 2) continue;
    int own_n = c == 0 ? g_ndev : 1;
    CHECKF(own_streams_case(counts[c], cases[c], -1) == 0, "reduce on own streams (%d inputs): races recorded",
           counts[c]);
    /* (On one device the consumer's stream is every input's producer: its wait orders their reuse too, so the host's
     * query adds nothing there.) */
    for (int skip = 0; sim() && skip <= own_n + (c == 0); skip++)
      CHECKF(own_streams_case(counts[c], cases[c], skip) > 0,
             "reduce on own streams (%d inputs) without ordering %d: no race recorded", counts[c], skip);
  }
  sim_clean("reduce on own streams");
}

static buf_t g_b[80];
static view_t g_v[80];
static int g_nb;

static void sw_free(void) {
  for (int i = 0; i < g_nb; i++)
    buf_free(&g_b[i]);
  g_nb = 0;
}

/* kinds: a strided same-device copy (kernel), a padded-row copy across devices, a transposed one (staged),
 * host -> device and device -> host with strided device sides, broadcast, reduce across devices, a local reduce
 * of 40 inputs into one of them, scatter and gather. */
static int g_kind;
static void sw_setup(void) {
  int64_t sz[3] = {2, 6, 140}, a[3], b[3];
  int sl = L_STEP2, dl = L_CONTIG, sdev = 0, ddev = 0;
  switch (g_kind) {
  case 1: sl = L_PADDED, dl = L_PADDED, ddev = 1; break;
  case 2: sl = L_TRANSPOSED, dl = L_STEP2, ddev = 1; break;
  case 3: sl = L_CONTIG, dl = L_TRANSPOSED, sdev = FDP_HOST, ddev = 2; break;
  case 4: sl = L_STEP2, dl = L_PADDED, sdev = 1, ddev = FDP_HOST; break;
  case 5: sl = L_PADDED, dl = L_OUTER; break; /* rows of 560 bytes: cuMemcpy2DAsync */
  case 6: sl = L_CONTIG, sdev = ddev = 3; break; /* flat: cuMemcpyAsync */
  default: break;
  }
  layout(sl, sz, a);
  layout(dl, sz, b);
  g_nb = 2;
  g_b[0] = buf_new(sdev, span(4, 3, sz, a));
  g_b[1] = buf_new(ddev, span(4, 3, sz, b));
  g_v[0] = view(&g_b[0], FDP_DTYPE_F32, 4, 3, sz, a, 0);
  g_v[1] = view(&g_b[1], FDP_DTYPE_F32, 4, 3, sz, b, 0);
  ref_copy(&g_v[1].ref, &g_v[0].ref);
}
static fdp_result_t sw_copy(void) {
  fdp_streams_t s = all_streams(g_stream);
  return fdp_op_copy(&g_v[1].t, &g_v[0].t, 1, &s);
}
static void sw_verify_last(void) {
  buf_matches(&g_b[g_nb - 1], "result after the injected failure");
}

static void sw_setup_dense(void) {
  int64_t sz[1] = {3000}, st[1] = {1};
  g_nb = g_ndev + 1;
  for (int i = 0; i < g_nb; i++) {
    g_b[i] = buf_new(i < g_ndev ? i : 0, 3000 * 4);
    fill_values(FDP_DTYPE_F32, g_b[i].ref, 3000);
    buf_upload(&g_b[i]);
    g_v[i] = view(&g_b[i], FDP_DTYPE_F32, 4, 1, sz, st, 0);
  }
}
static fdp_result_t sw_broadcast(void) {
  fdp_tensor_t d[FDP_MAX_DEVICES];
  for (int i = 1; i < g_ndev; i++) {
    d[i - 1] = g_v[i].t;
    memcpy(g_b[i].ref, g_b[0].ref, g_b[0].bytes);
  }
  fdp_streams_t s = all_streams(g_stream);
  return fdp_op_broadcast(&g_v[0].t, d, g_ndev - 1, &s);
}
static void sw_verify_bcast(void) {
  for (int i = 1; i < g_ndev; i++)
    buf_matches(&g_b[i], "broadcast after the injected failure");
}
static fdp_result_t sw_reduce(void) {
  fdp_tensor_t in[FDP_MAX_DEVICES];
  memcpy(g_b[g_ndev].ref, g_b[0].ref, g_b[0].bytes);
  for (int i = 0; i < g_ndev; i++) {
    in[i] = g_v[i].t;
    if (i) ref_add(FDP_DTYPE_F32, g_b[g_ndev].ref, g_b[i].ref, 3000);
  }
  fdp_streams_t s = all_streams(g_stream);
  return fdp_op_reduce(in, g_ndev, &g_v[g_ndev].t, &s);
}

/* The reduction's pattern on streams of its own: ordered after the caller's streams, fenced for the consumer and
 * for the host (own streams: a second non-blocking stream per device, made by sw_setup_own). */
static CUstream g_own[FDP_MAX_DEVICES];
static void sw_setup_own(void) {
  sw_setup_dense();
  for (int d = 0; d < g_ndev; d++) {
    push(d);
    dev_call(d, D.StreamCreate(&g_own[d], 1), "cuStreamCreate");
    pop(d);
  }
}
static void sw_free_own(void) {
  for (int d = 0; d < g_ndev; d++) {
    push(d);
    dev_call(d, D.StreamDestroy(g_own[d]), "cuStreamDestroy");
    pop(d);
  }
  sw_free();
}
static fdp_result_t sw_reduce_own(void) {
  fdp_tensor_t in[FDP_MAX_DEVICES];
  memcpy(g_b[g_ndev].ref, g_b[0].ref, g_b[0].bytes);
  for (int i = 0; i < g_ndev; i++) {
    in[i] = g_v[i].t;
    if (i) ref_add(FDP_DTYPE_F32, g_b[g_ndev].ref, g_b[i].ref, 3000);
  }
  fdp_streams_t own = all_streams(g_own), caller = all_streams(g_stream), first = {1, {0}, {(void *)g_stream[0]}};
  fdp_fence_t *deliver = NULL, *release = NULL;
  int done = 0;
  fdp_result_t r = fdp_streams_order(&own, &caller);
  if (r == FDP_OK) r = fdp_op_reduce(in, g_ndev, &g_v[g_ndev].t, &own);
  if (r == FDP_OK) r = fdp_fence_record(&own, &release);
  if (r == FDP_OK) r = fdp_fence_record(&(fdp_streams_t){1, {0}, {(void *)g_own[0]}}, &deliver);
  if (r == FDP_OK) r = fdp_fence_wait(deliver, &first);
  if (r == FDP_OK) r = fdp_fence_query(release, &done);
  fdp_fence_free(deliver);
  fdp_fence_free(release);
  return r;
}

static void sw_setup_local(void) {
  int64_t sz[1] = {300}, st[1] = {1};
  g_nb = 40;
  for (int i = 0; i < g_nb; i++) {
    g_b[i] = buf_new(g_ndev - 1, 300 * 2);
    fill_values(FDP_DTYPE_F16, g_b[i].ref, 300);
    buf_upload(&g_b[i]);
    g_v[i] = view(&g_b[i], FDP_DTYPE_F16, 2, 1, sz, st, 0);
  }
}
/* Out aliases input 35, which the second pass reads: the partial sums go through a stream-ordered buffer. The
 * inputs are rewritten first, since a successful run changes input 35. */
static unsigned char g_orig35[300 * 2];
static void sw_setup_local_save(void) {
  sw_setup_local();
  memcpy(g_orig35, g_b[35].ref, sizeof g_orig35);
}
static void sw_prepare_local(void) {
  memcpy(g_b[35].ref, g_orig35, sizeof g_orig35);
  buf_upload(&g_b[35]);
}
static fdp_result_t sw_local(void) {
  fdp_tensor_t in[40];
  unsigned char acc[300 * 2];
  memcpy(acc, g_b[0].ref, sizeof acc);
  for (int i = 0; i < 40; i++) {
    in[i] = g_v[i].t;
    if (i) ref_add(FDP_DTYPE_F16, acc, g_b[i].ref, 300);
  }
  fdp_streams_t s = all_streams(g_stream);
  fdp_result_t r = fdp_op_reduce(in, 40, &in[35], &s);
  memcpy(g_b[35].ref, acc, sizeof acc);
  return r;
}
static void sw_verify_local(void) {
  buf_matches(&g_b[35], "local reduce after the injected failure");
}

static void sw_setup_scatter(void) {
  int64_t sz[2] = {8, 30}, st[2];
  contig(2, sz, st);
  g_nb = g_ndev + 1;
  g_b[0] = buf_new(0, 8 * 30 * 8);
  g_v[0] = view(&g_b[0], FDP_DTYPE_F64, 8, 2, sz, st, 0);
  for (int i = 0; i < g_ndev; i++) {
    int64_t csz[2] = {8, 30 / g_ndev + (i < 30 % g_ndev)}, cst[2];
    contig(2, csz, cst);
    g_b[i + 1] = buf_new(i, (size_t)(csz[0] * csz[1] * 8));
    g_v[i + 1] = view(&g_b[i + 1], FDP_DTYPE_F64, 8, 2, csz, cst, 0);
  }
}
static fdp_result_t sw_scatter(void) {
  fdp_tensor_t o[FDP_MAX_DEVICES];
  int64_t ch[FDP_MAX_DEVICES], start = 0;
  for (int i = 0; i < g_ndev; i++) {
    o[i] = g_v[i + 1].t;
    ch[i] = o[i].sizes[1];
    fdp_tensor_t part;
    fdp_tensor_narrow(&g_v[0].ref, 1, start, ch[i], &part);
    ref_copy(&g_v[i + 1].ref, &part);
    start += ch[i];
  }
  fdp_streams_t s = all_streams(g_stream);
  return fdp_op_scatter(&g_v[0].t, 1, ch, o, g_ndev, &s);
}
static void sw_verify_scatter(void) {
  for (int i = 1; i <= g_ndev; i++)
    buf_matches(&g_b[i], "scatter after the injected failure");
}
static fdp_result_t sw_gather(void) {
  fdp_tensor_t in[FDP_MAX_DEVICES];
  int64_t start = 0;
  for (int i = 0; i < g_ndev; i++) {
    in[i] = g_v[i + 1].t;
    fdp_tensor_t part;
    fdp_tensor_narrow(&g_v[0].ref, 1, start, in[i].sizes[1], &part);
    ref_copy(&part, &g_v[i + 1].ref);
    start += in[i].sizes[1];
  }
  fdp_streams_t s = all_streams(g_stream);
  return fdp_op_gather(in, g_ndev, 1, &g_v[0].t, &s);
}
static void sw_verify_gather(void) {
  buf_matches(&g_b[0], "gather after the injected failure");
}

static void sw_setup_k0(void) { g_kind = 0; sw_setup(); }
static void sw_setup_k1(void) { g_kind = 1; sw_setup(); }
static void sw_setup_k2(void) { g_kind = 2; sw_setup(); }
static void sw_setup_k3(void) { g_kind = 3; sw_setup(); }
static void sw_setup_k4(void) { g_kind = 4; sw_setup(); }
static void sw_setup_k5(void) { g_kind = 5; sw_setup(); }
static void sw_setup_k6(void) { g_kind = 6; sw_setup(); }

static const sweep_op_t k_sweep[] = {
    {"copy (kernel, same device)", sw_setup_k0, NULL, sw_copy, sw_verify_last, sw_free},
    {"copy (rows, same device)", sw_setup_k5, NULL, sw_copy, sw_verify_last, sw_free},
    {"copy (flat, same device)", sw_setup_k6, NULL, sw_copy, sw_verify_last, sw_free},
    {"copy (rows, peer)", sw_setup_k1, NULL, sw_copy, sw_verify_last, sw_free},
    {"copy (staged, peer)", sw_setup_k2, NULL, sw_copy, sw_verify_last, sw_free},
    {"copy (host -> strided device)", sw_setup_k3, NULL, sw_copy, sw_verify_last, sw_free},
    {"copy (strided device -> host)", sw_setup_k4, NULL, sw_copy, sw_verify_last, sw_free},
    {"broadcast (nccl)", sw_setup_dense, NULL, sw_broadcast, sw_verify_bcast, sw_free},
    {"reduce (nccl)", sw_setup_dense, NULL, sw_reduce, sw_verify_last, sw_free},
    {"reduce (nccl) on own streams, fenced", sw_setup_own, NULL, sw_reduce_own, sw_verify_last, sw_free_own},
    {"reduce (local, 40 inputs, out aliases one)", sw_setup_local_save, sw_prepare_local, sw_local, sw_verify_local,
     sw_free},
    {"scatter", sw_setup_scatter, NULL, sw_scatter, sw_verify_scatter, sw_free},
    {"gather", sw_setup_scatter, NULL, sw_gather, sw_verify_gather, sw_free},
};

static int fault_code(const char *entry) {
  if (strncmp(entry, "nccl", 4) == 0) return 3; /* ncclInternalError */
  if (strstr(entry, "Alloc") || strcmp(entry, "cuModuleLoadData") == 0) return CUDA_ERROR_OUT_OF_MEMORY;
  if (strcmp(entry, "cuLaunchKernel") == 0) return CUDA_ERROR_LAUNCH_FAILED;
  return CUDA_ERROR_UNKNOWN;
}

/* 1 when a failure of `entry` may leave one object of kind `stat` alive (the one it was destroying). */
static int destroys(const char *entry, const char *stat) {
  return (strcmp(stat, "events") == 0 && strcmp(entry, "cuEventDestroy_v2") == 0) ||
         (strcmp(stat, "allocations") == 0 && strncmp(entry, "cuMemFree", 9) == 0) ||
         (strcmp(stat, "modules") == 0 && strcmp(entry, "cuModuleUnload") == 0) ||
         (strcmp(stat, "comms") == 0 && strncmp(entry, "ncclComm", 8) == 0) ||
         (strcmp(stat, "pushes") == 0 && strcmp(entry, "cuCtxPopCurrent_v2") == 0);
}

/* Live after a failed call: nothing more than before it. Cached until shutdown: nothing more after it. */
static const char *const k_counted[] = {"allocations", "streams", "events", "pushes", "groups"};
#define NCOUNTED (sizeof k_counted / sizeof k_counted[0])
static const char *const k_cached[] = {"modules", "comms"};
#define NCACHED (sizeof k_cached / sizeof k_cached[0])

/* One run of `op` with call `k` of `entry` failing (and, when `then` is not NULL, the next call of `then` after that
 * too), from a cold start: a CUDA/NCCL error with a detail (or success where the failed call is one fastdp may shrug
 * off), no misuse, nothing leaked, and the next call succeeds with the right result. After two failures in a row a
 * buffer that work may still use must leak rather than be freed under it (the simulator sees such a free as a race):
 * with a failed host wait, context push (the wait needs it) or free as the second, live allocations may grow, never
 * otherwise. */
static void sweep_trial(const sweep_op_t *op, const char *entry, long long k, const char *then) {
  char what[160];
  if (then)
    snprintf(what, sizeof what, "%s, call %lld of %s failing, then %s", op->name, k, entry, then);
  else
    snprintf(what, sizeof what, "%s, call %lld of %s failing", op->name, k, entry);
  fdp_shutdown();
  if (op->prepare) op->prepare();
  long long base[NCOUNTED], cbase[NCACHED];
  for (size_t c = 0; c < NCOUNTED; c++)
    base[c] = S.stat(k_counted[c]);
  for (size_t c = 0; c < NCACHED; c++)
    cbase[c] = S.stat(k_cached[c]);
  S.reset();
  if (then)
    S.fail_then(entry, k, fault_code(entry), then, fault_code(then));
  else
    S.fail_at(entry, k, fault_code(entry));
  fdp_result_t r = op->run();
  int fired = S.calls(entry) >= k;
  S.fail_at(entry, 0, 0); /* nothing left armed for the harness's own calls */
  if (then) S.fail_at(then, 0, 0);
  CHECKF(r == FDP_OK || r == FDP_CUDA || r == FDP_NCCL, "%s: %s (%s), want FDP_CUDA/FDP_NCCL", what,
         fdp_result_name(r), fdp_last_error());
  if ((r == FDP_CUDA || r == FDP_NCCL) && !then) {
    /* The detail names what failed: the injected CUresult's name, or NCCL's string for its code. */
    const char *want = strncmp(entry, "nccl", 4) == 0                    ? "internal error"
                       : fault_code(entry) == CUDA_ERROR_OUT_OF_MEMORY ? "CUDA_ERROR_OUT_OF_MEMORY"
                       : fault_code(entry) == CUDA_ERROR_LAUNCH_FAILED ? "CUDA_ERROR_LAUNCH_FAILED"
                                                                       : "CUDA_ERROR_UNKNOWN";
    CHECKF(strstr(fdp_last_error(), want) != NULL, "%s: the detail \"%s\" does not say %s", what, fdp_last_error(),
           want);
  }
  char buf[4096];
  long long nerr = S.errors(buf, sizeof buf);
  CHECKF(nerr == 0, "%s: %lld misuse(s):\n%s", what, nerr, buf);
  int may_leak = then && (strcmp(then, "cuStreamSynchronize") == 0 || strcmp(then, "cuCtxPushCurrent_v2") == 0 ||
                          strncmp(then, "cuMemFree", 9) == 0);
  for (size_t c = 0; c < NCOUNTED; c++) {
    long long now = S.stat(k_counted[c]);
    /* a failed destroy may leave that very object behind */
    if (destroys(entry, k_counted[c]) && now == base[c] + 1) now = base[c];
    if (then && destroys(then, k_counted[c]) && now == base[c] + 1) now = base[c];
    if (may_leak && strcmp(k_counted[c], "allocations") == 0 && now > base[c]) now = base[c];
    CHECKF(now == base[c], "%s (%s): %lld %s live before, %lld after", what, fired ? "fired" : "never reached",
           base[c], k_counted[c], now);
  }
  if (op->prepare) op->prepare();
  S.reset();
  fdp_result_t r2 = op->run();
  CHECKF(r2 == FDP_OK, "%s: the next call fails too: %s (%s)", what, fdp_result_name(r2), fdp_last_error());
  if (r2 == FDP_OK) op->verify();
  nerr = S.errors(buf, sizeof buf);
  CHECKF(nerr == 0, "%s: the next call: %lld misuse(s):\n%s", what, nerr, buf);
  /* What fastdp caches (kernel modules, communicators) goes at shutdown. */
  fdp_shutdown();
  for (size_t c = 0; c < NCACHED; c++) {
    long long now = S.stat(k_cached[c]);
    if (destroys(entry, k_cached[c]) && now == cbase[c] + 1) now = cbase[c];
    if (then && destroys(then, k_cached[c]) && now == cbase[c] + 1) now = cbase[c];
    CHECKF(now == cbase[c], "%s: %lld %s live after shutdown before, %lld after", what, cbase[c], k_cached[c], now);
  }
  S.reset();
}

/* Recoveries and what they fall back on when they fail too: a fence replaced by a host wait, a stream-ordered free
 * by a wait and a plain free, a context pushed for the wait, a broken communicator set aborted. */
static const char *const k_then[] = {"cuStreamSynchronize", "cuCtxPushCurrent_v2", "cuMemFree_v2", "ncclCommAbort"};
#define NTHEN (sizeof k_then / sizeof k_then[0])

/* Every operation, with every driver/NCCL call it makes failing in turn (from a cold start: fdp_shutdown first, so
 * context retains, module loads and communicator set-up are part of it), checked by sweep_trial. `only` (may be
 * NULL) limits it to one entry point; `pairs` makes each of those failures followed by a failure of the next call
 * of each entry of k_then. */
static void sweep(const char *only, int pairs) {
  for (size_t o = 0; o < sizeof k_sweep / sizeof k_sweep[0]; o++) {
    const sweep_op_t *op = &k_sweep[o];
    op->setup();
    fdp_shutdown();
    if (op->prepare) op->prepare();
    S.reset();
    OK(op->run());
    long long calls[128] = {0};
    int nentries = 0;
    for (int e = 0; S.entry(e); e++, nentries++)
      calls[e] = S.calls(S.entry(e));
    op->verify();
    sim_clean(op->name);
    int trials = 0, failed_before = n_fail;
    for (int e = 0; e < nentries && n_fail - failed_before <= 20; e++) {
      const char *name = S.entry(e);
      if (only && strcmp(only, name) != 0) continue;
      for (long long k = 1; k <= calls[e] && n_fail - failed_before <= 20; k++) {
        for (size_t t = 0; t < (pairs ? NTHEN : 1); t++) {
          sweep_trial(op, name, k, pairs ? k_then[t] : NULL);
          trials++;
        }
      }
    }
    printf("sweep: %s: %d injected failures%s\n", op->name, trials, pairs ? " (each followed by another)" : "");
    fflush(stdout);
    op->teardown();
    sim_clean(op->name);
  }
}

/* ---- main ---- */

/* Nothing fastdp made is left. After pairs of failures, a communicator whose abort failed stays behind by
 * necessity (pairs = 1 skips communicators). */
static void leak_check(int pairs) {
  if (!sim()) return;
  static const char *const names[] = {"allocations", "streams", "events",  "modules",
                                      "pushes",      "retains", "comms",   "groups"};
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
    if (pairs && strcmp(names[i], "comms") == 0) continue;
    long long v = S.stat(names[i]);
    CHECKF(v == 0, "after shutdown and release, %lld %s are still live", v, names[i]);
  }
}

/* The route the core picks, and that operations then take: NCCL for one buffer on each of several devices (when
 * it loads), the cuda backend for repeated ids and single-device sums, the host backend for host buffers. */
static void test_route(void) {
  fdp_backend_id_t id = FDP_BACKEND_COUNT;
  int same[2] = {0, 0}, host[2] = {FDP_HOST, FDP_HOST}, spread[FDP_MAX_DEVICES];
  for (int d = 0; d < g_ndev; d++)
    spread[d] = g_ndev - 1 - d; /* any order: the root is whichever comes first */
  OK(fdp_route_devices(FDP_OP_BROADCAST, same, 2, FDP_DTYPE_F32, &id));
  CHECK(id == FDP_BACKEND_CUDA);
  OK(fdp_route_devices(FDP_OP_REDUCE, same, 2, FDP_DTYPE_F32, &id));
  CHECK(id == FDP_BACKEND_CUDA);
  OK(fdp_route_devices(FDP_OP_BROADCAST, host, 2, FDP_DTYPE_F32, &id));
  CHECK(id == FDP_BACKEND_HOST);
  OK(fdp_route_devices(FDP_OP_BROADCAST, spread, 1, FDP_DTYPE_F32, &id));
  CHECK(id == FDP_BACKEND_CUDA);
  if (g_ndev < 2 || !fdp_backend_usable(FDP_BACKEND_NCCL, NULL) || getenv("FASTDP_DISABLE_NCCL")) return;
  OK(fdp_route_devices(FDP_OP_BROADCAST, spread, g_ndev, FDP_DTYPE_BOOL, &id)); /* bytes: any dtype */
  CHECK(id == FDP_BACKEND_NCCL);
  OK(fdp_route_devices(FDP_OP_REDUCE, spread, g_ndev, FDP_DTYPE_F32, &id));
  CHECK(id == FDP_BACKEND_NCCL);
  /* ncclSum is no logical or, and NCCL has no int16: sums of those across devices have no backend */
  CHECK(fdp_route_devices(FDP_OP_REDUCE, spread, g_ndev, FDP_DTYPE_BOOL, &id) == FDP_UNAVAILABLE);
  CHECK(fdp_route_devices(FDP_OP_REDUCE, spread, g_ndev, FDP_DTYPE_I16, &id) == FDP_UNAVAILABLE);
}

int main(int argc, char **argv) {
  int do_sweep = 0, pairs = 0, do_race = 0;
  const char *only = NULL;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--sweep") == 0) do_sweep = 1;
    if (strcmp(argv[i], "--pairs") == 0) do_sweep = pairs = 1;
    if (strcmp(argv[i], "--race") == 0) do_race = 1;
    if (strcmp(argv[i], "--only") == 0 && i + 1 < argc) only = argv[++i];
  }
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (!driver_open(!do_race) || g_ndev < 1) {
    printf("skipped: no usable CUDA driver or device\n");
    return 77;
  }
  t_home_ctx = g_ctx[0];
  printf("%d device(s), %s\n", g_ndev, sim() ? "simulated GPU (misuse and race checks on)" : "real driver");
  const char *route = getenv("SIMGPU_ALLOCATOR");
  int caching = route != NULL && strcmp(route, "caching") == 0;
  if (caching) {
    /* Scratch memory from a caching allocator, as every PyTorch user's process has it (the binding registers
     * PyTorch's), instead of the driver's pool. */
    if (!sim() || S.cache_alloc == NULL) {
      printf("skipped: SIMGPU_ALLOCATOR=caching needs the simulated GPU\n");
      return 77;
    }
    fdp_allocator_t cache = {S.cache_alloc, S.cache_free, NULL};
    fdp_set_device_allocator(&cache);
  }
  printf("scratch memory: %s\n", caching ? "the simulated caching allocator (registered)" : "the driver's pool");
  const char *why = NULL;
  CHECKF(fdp_backend_usable(FDP_BACKEND_CUDA, &why), "the cuda backend is not usable: %s", why ? why : "");
  if (sim()) S.reset();
  if (do_race) {
    race();
  } else if (do_sweep) {
    if (!sim())
      printf("skipped: the fault-injection sweep needs the simulated GPU\n");
    else
      sweep(only, pairs);
  } else {
    test_copies();
    test_broadcast();
    test_scatter_gather();
    test_reduce();
    test_reduce_on_own_streams();
    test_reduce_passes();
    test_coalesced();
    test_threads();
    test_shutdown_reuse();
    test_order();
    test_nccl_bytes();
    test_kernel_many_elements();
    test_misaligned();
    test_kernel_wide_offsets();
    test_kernel_huge_sum();
    test_nccl_async_error();
    test_route();
    if (sim()) {
      sim_clean("end");
      /* The harness's own copies count too, so count only what fastdp alone issues. */
      for (size_t i = 0; i < NPATHS; i++) {
        if (strcmp(k_paths[i], "cuMemcpyHtoDAsync_v2") == 0 || strcmp(k_paths[i], "cuMemcpyDtoHAsync_v2") == 0)
          continue;
        int multi = strstr(k_paths[i], "Peer") || strstr(k_paths[i], "nccl") || strstr(k_paths[i], "WaitEvent");
        if (multi && g_ndev < 2) continue; /* one device: no cross-device path exists */
        /* Scratch memory comes from one of the two: the driver's pool, or the registered allocator. */
        if (strcmp(k_paths[i], caching ? "cuMemAllocAsync" : "simgpu_cache_alloc") == 0) continue;
        printf("  %-22s %lld calls\n", k_paths[i], g_path_calls[i]);
        CHECKF(g_path_calls[i] > 0, "no operation reached %s", k_paths[i]);
      }
    }
  }
  fdp_shutdown();
  if (caching) {
    fdp_set_device_allocator(NULL);
    S.cache_trim(); /* the blocks it holds as free go back before the contexts do (torch.cuda.empty_cache) */
  }
  if (do_sweep && sim()) {
    /* A failed free or destroy may leave its object behind by necessity; those go with the contexts. */
    sim_clean("sweep");
    driver_close();
    S.reset();
  } else {
    driver_close();
    sim_clean("shutdown");
  }
  leak_check(pairs);
  printf("%d passed, %d failed\n", n_pass, n_fail);
  return n_fail ? 1 : 0;
}
