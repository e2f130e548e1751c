/* SPDX-License-Identifier: MIT */
/* What test_gpu_ops's parts share: the driver opened as a client such as PyTorch opens it, the simulator's controls,
 * buffers with their host mirrors, the caller's accesses around each operation, and views of the buffers. */
#include "gpu_ops_harness.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

__thread uint64_t t_rng = 0x9e3779b97f4a7c15ull;

uint64_t rnd(void) {
  uint64_t x = t_rng;
  x ^= x << 13;
  x ^= x >> 7;
  x ^= x << 17;
  return t_rng = x;
}

void *xmalloc(size_t n) {
  void *p = malloc(n ? n : 1);
  if (!p) {
    printf("out of host memory\n");
    exit(2);
  }
  return p;
}

/* ---- the driver, as a client such as PyTorch uses it ---- */

driver_t D;

sim_t S;

int g_ndev;
CUcontext g_ctx[FDP_MAX_DEVICES];
CUstream g_stream[FDP_MAX_DEVICES];

static int sym(void *h, const char *name, void *slot, int required) {
  void *p = dlsym(h, name);
  if (!p && required) printf("the driver lacks %s\n", name);
  memcpy(slot, &p, sizeof p);
  return p != NULL || !required;
}

/* `free_mutex` 0: as a program without PyTorch, where fastdp finds no free mutex and its own lock alone must keep
 * two threads' grouped NCCL launches apart. */
int driver_open(int free_mutex) {
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
           sym(h, "cuCtxGetCurrent", &D.CtxGetCurrent, 1) & sym(h, "cuMemAlloc_v2", &D.MemAlloc, 1) &
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

void driver_close(void) {
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

int sim(void) {
  return S.errors != NULL;
}

/* Entry points the operations must have reached (the copy paths, kernels, collectives), with their calls. */
static const char *const k_paths[] = {
    "cuMemcpyAsync",        "cuMemcpy2DAsync_v2", "cuMemcpy3DPeerAsync", "cuMemcpyPeerAsync", "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2", "cuLaunchKernel",     "cuMemAllocAsync",     "cuStreamWaitEvent", "ncclBroadcast",
    "ncclReduce",           "ncclGroupStart",     "simgpu_cache_alloc"};
#define NPATHS (sizeof k_paths / sizeof k_paths[0])
static long long g_path_calls[NPATHS];

/* Fails the check when the simulator recorded misuse or races since the last look, printing what. */
void sim_clean(const char *where) {
  if (!sim()) return;
  char buf[8192];
  long long n = S.errors(buf, sizeof buf);
  CHECKF(n == 0, "%s: the simulated GPU recorded %lld misuse(s)/race(s):\n%s", where, n, buf);
  for (size_t i = 0; i < NPATHS; i++)
    g_path_calls[i] += S.calls(k_paths[i]);
  S.reset();
}

/* Prints the calls of each entry point of k_paths that fastdp's operations made since the start, and fails the check
 * for any they never reached. `caching`: scratch memory came from the registered allocator, not the driver's pool. */
void sim_paths_report(int caching) {
  /* The harness's own copies count too, so count only what fastdp alone issues. */
  for (size_t i = 0; i < NPATHS; i++) {
    if (strcmp(k_paths[i], "cuMemcpyHtoDAsync_v2") == 0 || strcmp(k_paths[i], "cuMemcpyDtoHAsync_v2") == 0) continue;
    int multi = strstr(k_paths[i], "Peer") || strstr(k_paths[i], "nccl") || strstr(k_paths[i], "WaitEvent");
    if (multi && g_ndev < 2) continue; /* one device: no cross-device path exists */
    /* Scratch memory comes from one of the two: the driver's pool, or the registered allocator. */
    if (strcmp(k_paths[i], caching ? "cuMemAllocAsync" : "simgpu_cache_alloc") == 0) continue;
    printf("  %-22s %lld calls\n", k_paths[i], g_path_calls[i]);
    CHECKF(g_path_calls[i] > 0, "no operation reached %s", k_paths[i]);
  }
}

/* ---- buffers: device (or host) memory plus a host mirror holding what it must contain ---- */

void dev_call(int dev, CUresult r, const char *what) {
  CHECKF(r == CUDA_SUCCESS, "%s on device %d: CUresult %d", what, dev, (int)r);
}

void push(int dev) {
  dev_call(dev, D.CtxPush(g_ctx[dev]), "cuCtxPushCurrent");
}
void pop(int dev) {
  CUcontext c;
  dev_call(dev, D.CtxPop(&c), "cuCtxPopCurrent");
}

/* Writes the mirror to the memory (the legacy stream, then a host synchronisation, as a blocking copy does). */
void buf_upload(buf_t *b) {
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

buf_t buf_new(int dev, size_t bytes) {
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

void buf_free(buf_t *b) {
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
int buf_matches(const buf_t *b, const char *what) {
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

__thread CUcontext t_home_ctx;

void caller_touch(const buf_t *b, const CUstream *streams, int write) {
  if (!sim() || b->bytes == 0) return;
  if (b->dev == FDP_HOST) {
    S.host_touch(b->data, b->bytes, write);
    return;
  }
  CHECK(S.touch(streams ? (void *)streams[b->dev] : NULL, b->dev, (unsigned long long)(uintptr_t)b->data, b->bytes,
                write) == 0);
}

void caller_before(buf_t *const *bufs, int n, const CUstream *streams) {
  for (int i = 0; i < n; i++)
    caller_touch(bufs[i], streams, 1);
}

void caller_after(buf_t *const *bufs, int n, const CUstream *streams, const char *what) {
  CUcontext now = NULL;
  CHECK(D.CtxGetCurrent(&now) == CUDA_SUCCESS);
  CHECKF(now == t_home_ctx, "%s: the caller's current context changed (%p before, %p after)", what, (void *)t_home_ctx,
         (void *)now);
  if (now != t_home_ctx) D.CtxSetCurrent(t_home_ctx);
  for (int i = 0; i < n; i++)
    caller_touch(bufs[i], streams, 1);
}

view_t view(buf_t *b, int dtype, int es, int nd, const int64_t *sizes, const int64_t *strides, int64_t off) {
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

int64_t numel(const fdp_tensor_t *t) {
  int64_t n = 1;
  for (int i = 0; i < t->ndim; i++)
    n *= t->sizes[i];
  return n;
}

/* Bytes a view spans from its first element. */
size_t span(int es, int nd, const int64_t *sizes, const int64_t *strides) {
  int64_t last = 0;
  for (int i = 0; i < nd; i++)
    last += (sizes[i] - 1) * strides[i];
  return (size_t)(last + 1) * (size_t)es;
}

void contig(int nd, const int64_t *sizes, int64_t *strides) {
  int64_t s = 1;
  for (int i = nd - 1; i >= 0; i--) {
    strides[i] = s;
    s *= sizes[i];
  }
}

/* The reference copy, element by element over the index space. */
void ref_copy(const fdp_tensor_t *dst, const fdp_tensor_t *src) {
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

fdp_streams_t all_streams(const CUstream *streams) {
  fdp_streams_t s;
  memset(&s, 0, sizeof s);
  for (int d = 0; d < g_ndev; d++) {
    s.device[s.n] = d;
    s.stream[s.n++] = streams ? (void *)streams[d] : NULL;
  }
  return s;
}
