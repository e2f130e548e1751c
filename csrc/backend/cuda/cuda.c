/* SPDX-License-Identifier: MIT */
/* The cuda backend: strided copies between CUDA tensors on any devices (copy engines where the layout allows,
 * the strided-copy kernel otherwise) and the in-order k-way sum kernel, all through the driver API, ordered on
 * the streams the caller lists. Kernels come from the fatbin embedded at build time when it fits the GPU, else
 * from NVRTC (kernel_image.c), loaded once per device. Copies the copy engines can do never need them. */
#include "backend/cuda/facts.h"
#include "backend/cuda/fence.h"
#include "backend/cuda/kernel_image.h"
#include "backend/cuda/kernels.h"
#include "backend/cuda/layout.h"
#include "core/backend.h"
#include "dl/cuda_driver.h"

#include <assert.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#define THREADS 256
/* Same-device 2D copies narrower than this per row, or with more outer rows than MEMCPY_MAX_LOOP, go to the
 * kernel: the copy engines are slow on short rows, and each cuMemcpy call costs microseconds of CPU. */
#define MEMCPY2D_MIN_ROW 512
#define MEMCPY_MAX_LOOP 64
/* Cross-device copies have no kernel alternative short of staging, so they loop longer before staging. */
#define PEER_MAX_LOOP 1024

_Static_assert(sizeof(fdp_copy_args_t) == 16 + 3 * 8 * FDP_COPY_MAX_DIMS, "kernel ABI: fdp_copy_args_t");
_Static_assert(sizeof(fdp_sum_args_t) == 8 * FDP_SUM_MAX_INPUTS + 24, "kernel ABI: fdp_sum_args_t");

/* ---- kernels module, one per device ---- */

typedef struct module {
  CUmodule mod;
  CUfunction sum[FDP_DTYPE_COUNT];
  CUfunction copy[5]; /* element sizes 1, 2, 4, 8, 16 */
  unsigned int max_blocks;
} module_t;

/* Integer sums wrap, so signed types share the kernel of their unsigned twin (same bits). */
static const char *const k_sum_names[FDP_DTYPE_COUNT] = {
    [FDP_DTYPE_BOOL] = "fdp_sum_bool", [FDP_DTYPE_U8] = "fdp_sum_u8",     [FDP_DTYPE_I8] = "fdp_sum_u8",
    [FDP_DTYPE_I16] = "fdp_sum_u16",   [FDP_DTYPE_I32] = "fdp_sum_u32",   [FDP_DTYPE_I64] = "fdp_sum_u64",
    [FDP_DTYPE_F16] = "fdp_sum_f16",   [FDP_DTYPE_BF16] = "fdp_sum_bf16", [FDP_DTYPE_F32] = "fdp_sum_f32",
    [FDP_DTYPE_F64] = "fdp_sum_f64",
};
static const char *const k_copy_names[5] = {"fdp_copy_1", "fdp_copy_2", "fdp_copy_4", "fdp_copy_8", "fdp_copy_16"};

/* Per device: 0 not loaded yet (or the last try failed transiently: try again), 1 loaded, -1 no image loads on
 * this GPU (g_mod_err says why; only true image errors stick, never OOM or a failed context push). */
static module_t g_mod[FDP_MAX_DEVICES];
static atomic_int g_mod_state[FDP_MAX_DEVICES];
static char g_mod_err[FDP_MAX_DEVICES][1024];
static char g_mod_src[FDP_MAX_DEVICES][160]; /* where the loaded kernels came from, for `python -m fastdp info` */
static pthread_mutex_t g_mod_lock = PTHREAD_MUTEX_INITIALIZER;

/* The driver's verdict that an image does not fit this GPU or driver: deterministic, so worth remembering. Any
 * other failure (out of memory, a lost context...) may pass and is retried by the next call. */
static int image_error(CUresult e) {
  return e == CUDA_ERROR_NO_BINARY_FOR_GPU || e == CUDA_ERROR_INVALID_IMAGE || e == CUDA_ERROR_INVALID_PTX ||
         e == CUDA_ERROR_UNSUPPORTED_PTX_VERSION || e == CUDA_ERROR_JIT_COMPILER_NOT_FOUND ||
         e == CUDA_ERROR_JIT_COMPILATION_DISABLED || e == CUDA_ERROR_INVALID_SOURCE;
}

static fdp_result_t bind_functions(const fdp_cu_t *cu, int dev, module_t *m) {
  CUdevice d = 0;
  int sms = 0;
  fdp_result_t r = FDP_OK;
  for (int t = 0; t < FDP_DTYPE_COUNT && r == FDP_OK; t++)
    if (k_sum_names[t])
      r = fdp__cu_check(cu->ModuleGetFunction(&m->sum[t], m->mod, k_sum_names[t]), k_sum_names[t], dev);
  for (int i = 0; i < 5 && r == FDP_OK; i++)
    r = fdp__cu_check(cu->ModuleGetFunction(&m->copy[i], m->mod, k_copy_names[i]), k_copy_names[i], dev);
  if (r == FDP_OK) r = fdp__cu_check(cu->DeviceGet(&d, dev), "cuDeviceGet", dev);
  if (r == FDP_OK)
    r = fdp__cu_check(cu->DeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, d),
                      "cuDeviceGetAttribute(MULTIPROCESSOR_COUNT)", dev);
  /* Grid-stride kernels: enough blocks to fill every SM several times over, no more. */
  m->max_blocks = (unsigned int)(sms > 0 ? sms * 8 : 1024);
  return r;
}

/* Compute capability of `dev` as major * 10 + minor (90 for sm_90). */
static fdp_result_t device_cc(const fdp_cu_t *cu, int dev, int *cc) {
  CUdevice d = 0;
  int major = 0, minor = 0;
  FDP_CHECK(fdp__cu_check(cu->DeviceGet(&d, dev), "cuDeviceGet", dev));
  FDP_CHECK(fdp__cu_check(cu->DeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, d),
                          "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MAJOR)", dev));
  FDP_CHECK(fdp__cu_check(cu->DeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, d),
                          "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MINOR)", dev));
  *cc = major * 10 + minor;
  return FDP_OK;
}

static const char *const k_origin[] = {
    [FDP_KIMAGE_DISK] = "NVRTC, from the disk cache",
    [FDP_KIMAGE_COMPILED] = "NVRTC, compiled now (cached on disk)",
    [FDP_KIMAGE_MEMORY] = "NVRTC, compiled now (memory only)",
};

/* Loads the kernels into the current context of `dev`: the build-time fatbin first, NVRTC's image for the
 * device's exact architecture when the fatbin has none that loads. *sticky is set when the failure is the
 * driver refusing every image (then it will not change in this process). */
static fdp_result_t load_module(const fdp_cu_t *cu, int dev, module_t *m, int *sticky) {
  char fatbin_why[320] = "no fatbin (nvcc was not found at build time)";
  CUresult e;
  int cc = 0;
  *sticky = 0;
  if (fdp__kernels_fatbin_size > 0 && fdp_param(FDP_PARAM_DISABLE_FATBIN)) {
    snprintf(fatbin_why, sizeof fatbin_why, "fatbin skipped (FASTDP_DISABLE_FATBIN)");
  } else if (fdp__kernels_fatbin_size > 0) {
    e = cu->ModuleLoadData(&m->mod, fdp__kernels_fatbin);
    if (e == CUDA_SUCCESS) {
      snprintf(g_mod_src[dev], sizeof g_mod_src[dev], "fatbin (built with nvcc)");
      return FDP_OK;
    }
    fdp__cu_check(e, "cuModuleLoadData (fatbin)", dev);
    if (!image_error(e)) return FDP_CUDA;
    snprintf(fatbin_why, sizeof fatbin_why, "%s", fdp_last_error());
  }
  FDP_CHECK(device_cc(cu, dev, &cc));
  fdp_kimage_t img;
  fdp_result_t r = fdp__kimage_get(cc, &img);
  if (r != FDP_OK) {
    char why[700];
    snprintf(why, sizeof why, "%s", fdp_last_error());
    /* No NVRTC or one that cannot target this GPU: unavailable, not failing. A compile error of our own source
     * is as permanent as a refused image; NVRTC running out of memory is not. */
    if (r == FDP_INTERNAL) *sticky = 1;
    return fdp__fail(r == FDP_NOMEM ? FDP_NOMEM : FDP_UNAVAILABLE, "no fastdp kernels for device %d (sm_%d): %s; %s",
                     dev, cc, fatbin_why, why);
  }
  e = cu->ModuleLoadData(&m->mod, img.data);
  fdp__kimage_put(&img); /* the driver has read the image; the facts below are copies */
  if (e != CUDA_SUCCESS) {
    fdp__cu_check(e, img.ptx ? "cuModuleLoadData (NVRTC PTX)" : "cuModuleLoadData (NVRTC cubin)", dev);
    if (!image_error(e)) return FDP_CUDA;
    *sticky = 1;
    char why[600];
    snprintf(why, sizeof why, "%s", fdp_last_error());
    return fdp__fail(FDP_UNAVAILABLE,
                     "no fastdp kernels load on device %d (sm_%d): %s; %s for %s_%d: %s (a driver older than "
                     "NVRTC? update the driver or install the nvidia-cuda-nvrtc that matches it)",
                     dev, cc, fatbin_why, img.ptx ? "PTX" : "cubin", img.ptx ? "compute" : "sm", img.arch, why);
  }
  snprintf(g_mod_src[dev], sizeof g_mod_src[dev], "%s for %s_%d (%.3f s)", k_origin[img.origin],
           img.ptx ? "compute" : "sm", img.arch, img.seconds);
  return FDP_OK;
}

/* The kernels module of `dev`, loaded into its primary context on first use (thread-safe). Only an image the
 * driver refuses is remembered (reported again without retrying until shutdown); every other failure is
 * retried by the next call. FDP_UNAVAILABLE when no kernels exist for this GPU: the caller says what needed
 * them, and the Python layer may fall back to torch. */
static fdp_result_t get_module(const fdp_cu_t *cu, int dev, const module_t **out) {
  if (dev < 0 || dev >= FDP_MAX_DEVICES) return fdp__fail(FDP_INVALID, "CUDA device %d out of range", dev);
  int st = atomic_load_explicit(&g_mod_state[dev], memory_order_acquire);
  if (st == 0) {
    fdp_result_t r = FDP_OK;
    pthread_mutex_lock(&g_mod_lock);
    if (atomic_load_explicit(&g_mod_state[dev], memory_order_relaxed) == 0) {
      module_t m;
      int sticky = 0;
      memset(&m, 0, sizeof m);
      fdp_result_t loaded = FDP_CUDA;
      r = fdp__cu_ctx_push(dev, NULL);
      if (r == FDP_OK) {
        r = load_module(cu, dev, &m, &sticky);
        if (r == FDP_OK) {
          r = bind_functions(cu, dev, &m);
          if (r != FDP_OK) {
            CUresult e = cu->ModuleUnload(m.mod);
            if (e != CUDA_SUCCESS) fdp__log("cuModuleUnload on device %d: CUresult %d", dev, (int)e);
          }
        }
        loaded = r;
        FDP_CHECK_KEEP(fdp__cu_ctx_pop(dev), r);
      }
      /* A module that loaded is kept even when the pop after it failed: it lives in the primary context, not on
       * this thread's stack, and dropping it would leak it. The call still reports the failed pop. */
      if (loaded == FDP_OK) {
        g_mod[dev] = m;
        atomic_store_explicit(&g_mod_state[dev], 1, memory_order_release);
      } else if (sticky) {
        snprintf(g_mod_err[dev], sizeof g_mod_err[dev], "%s", fdp_last_error());
        atomic_store_explicit(&g_mod_state[dev], -1, memory_order_release);
      }
    }
    pthread_mutex_unlock(&g_mod_lock);
    if (r != FDP_OK) return r;
    st = atomic_load_explicit(&g_mod_state[dev], memory_order_acquire);
  }
  if (st < 0) return fdp__fail(FDP_UNAVAILABLE, "%s", g_mod_err[dev]);
  *out = &g_mod[dev];
  return FDP_OK;
}

const char *fdp__cuda_kernels_source(int dev) {
  if (dev < 0 || dev >= FDP_MAX_DEVICES) return "";
  int st = atomic_load_explicit(&g_mod_state[dev], memory_order_acquire);
  return st == 1 ? g_mod_src[dev] : st < 0 ? g_mod_err[dev] : "";
}

/* Prefixes the detail of a get_module failure with what needed the kernels. */
static fdp_result_t needs_kernels(const char *what) {
  char why[1024];
  snprintf(why, sizeof why, "%s", fdp_last_error());
  return fdp__fail(FDP_UNAVAILABLE, "cuda backend: %s, but %s", what, why);
}

static unsigned int grid_for(const module_t *m, int64_t n) {
  int64_t blocks = (n + THREADS - 1) / THREADS;
  return blocks < (int64_t)m->max_blocks ? (unsigned int)blocks : m->max_blocks;
}

/* ---- scratch memory ----
 * NOTE [scratch memory]: staging buffers and partial sums come from the allocator registered with
 * fdp_set_device_allocator (the binding registers PyTorch's caching allocator, so that this memory shows in
 * torch.cuda.memory_* and an allocation that does not fit frees PyTorch's cached blocks and retries) or, with none
 * registered (the C test program, other embedders, a PyTorch without CUDA), from the driver's stream-ordered pool,
 * retried once after a device synchronisation when it is out of memory. Either way a buffer is
 * allocated and freed on one stream, stream-ordered; every use on another stream is fenced back to that stream
 * before the free. Both calls are made with the buffer's device context current (pushed by the caller), so that
 * each buffer lives inside the push that uses it and a failed push can never strand one. */

static pthread_mutex_t g_alloc_lock = PTHREAD_MUTEX_INITIALIZER;
static fdp_allocator_t g_alloc;

void fdp_set_device_allocator(const fdp_allocator_t *allocator) {
  pthread_mutex_lock(&g_alloc_lock);
  if (allocator != NULL && allocator->alloc != NULL && allocator->free != NULL)
    g_alloc = *allocator;
  else
    memset(&g_alloc, 0, sizeof g_alloc);
  pthread_mutex_unlock(&g_alloc_lock);
}

typedef struct scratch {
  CUdeviceptr ptr; /* 0: nothing held */
  void *handle;    /* the registered allocator's handle; unused for the driver pool */
  int hooked;      /* 1: from `via`, 0: from cuMemAllocAsync */
  int dev;
  CUstream stream;
  fdp_allocator_t via;
} scratch_t;

_Static_assert(FDP_CUDA_OUT_OF_MEMORY == CUDA_ERROR_OUT_OF_MEMORY, "fastdp.h's copy of CUDA_ERROR_OUT_OF_MEMORY");

/* `bytes` of device memory on `dev`, usable by work enqueued on `stream` from now on; dev's context is current.
 * Nothing is held on failure. */
static fdp_result_t scratch_alloc(const fdp_cu_t *cu, int dev, CUstream stream, size_t bytes, const char *what,
                                  scratch_t *s) {
  memset(s, 0, sizeof *s);
  s->dev = dev;
  s->stream = stream;
  pthread_mutex_lock(&g_alloc_lock);
  s->via = g_alloc;
  pthread_mutex_unlock(&g_alloc_lock);
  if (s->via.alloc != NULL) {
    char err[256] = "";
    void *ptr = NULL, *handle = NULL;
    int rc = s->via.alloc(s->via.ctx, dev, bytes, (void *)stream, &ptr, &handle, err, sizeof err);
    if (rc != 0) {
      err[sizeof err - 1] = '\0';
      return fdp__fail_status(FDP_CUDA, rc == FDP_ALLOC_OUT_OF_MEMORY ? CUDA_ERROR_OUT_OF_MEMORY : 0,
                              "cuda backend: %s: %zu bytes on device %d could not be allocated: %s", what, bytes,
                              dev, err[0] ? err : "the registered allocator failed");
    }
    s->ptr = (CUdeviceptr)(uintptr_t)ptr;
    s->handle = handle;
    s->hooked = 1;
    return FDP_OK;
  }
  if (cu->MemAllocAsync == NULL || cu->MemFreeAsync == NULL)
    return fdp__fail(FDP_UNAVAILABLE, "cuda backend: %s on device %d needs cuMemAllocAsync (CUDA driver 11.2 or newer)",
                     what, dev);
  CUresult e = cu->MemAllocAsync(&s->ptr, bytes, stream);
  if (e == CUDA_ERROR_OUT_OF_MEMORY) {
    /* Stream-ordered frees (ours and anyone's) complete, and the pool gives back what it caches, at a
     * synchronisation: wait for the device once, then try again. */
    CUresult es = cu->CtxSynchronize();
    if (es == CUDA_SUCCESS)
      e = cu->MemAllocAsync(&s->ptr, bytes, stream);
    else
      fdp__log("cuda scratch: cuCtxSynchronize before retrying an allocation failed (CUresult %d)", (int)es);
  }
  if (e != CUDA_SUCCESS) s->ptr = 0;
  return fdp__cu_check(e, "cuMemAllocAsync (scratch)", dev);
}

/* Gives the memory back, ordered after the work enqueued on its stream so far; a no-op when nothing is held.
 * s->dev's context is current. */
static fdp_result_t scratch_free(const fdp_cu_t *cu, scratch_t *s) {
  fdp_result_t r = FDP_OK;
  if (s->ptr != 0 && s->hooked)
    s->via.free(s->via.ctx, s->dev, (void *)s->stream, s->handle);
  else if (s->ptr != 0) {
    CUresult e = cu->MemFreeAsync(s->ptr, s->stream);
    r = fdp__cu_check(e, "cuMemFreeAsync (scratch)", s->dev);
    if (e != CUDA_SUCCESS) {
      /* cuMemFree takes pool memory too, but (as documented) without waiting for its users: wait first. The
       * failure is still reported. */
      CUresult es = cu->StreamSynchronize(s->stream);
      if (es == CUDA_SUCCESS) es = cu->MemFree(s->ptr);
      if (es != CUDA_SUCCESS) fdp__log("cuda scratch: a buffer on device %d is leaked (CUresult %d)", s->dev, (int)es);
    }
  }
  s->ptr = 0;
  s->handle = NULL;
  return r;
}

/* ---- stream ordering ---- */

/* Makes stream `to` (device to_dev) wait for everything enqueued so far on `from` (device from_dev). The event
 * is destroyed right after the wait is enqueued: legal, the driver defers the release until it completes.
 * `release` (may be NULL), scratch memory of to_dev on `to`, is freed as soon as the wait is enqueued (so behind
 * everything on `from` so far), while to_dev's context is current; it stays held when the wait could not be
 * enqueued. */
static fdp_result_t stream_wait(const fdp_cu_t *cu, int from_dev, CUstream from, int to_dev, CUstream to,
                                scratch_t *release) {
  CUevent ev = NULL;
  fdp_result_t r = FDP_OK;
  FDP_CHECK(fdp__cu_ctx_push(from_dev, NULL));
  FDP_CHECK_GOTO(fdp__cu_check(cu->EventCreate(&ev, CU_EVENT_DISABLE_TIMING), "cuEventCreate", from_dev), r, out);
  FDP_CHECK_GOTO(fdp__cu_check(cu->EventRecord(ev, from), "cuEventRecord", from_dev), r, out);
  /* A stream may wait on another device's event; its own context must be current (NULL = its default). */
  FDP_CHECK_GOTO(fdp__cu_ctx_push(to_dev, NULL), r, out);
  r = fdp__cu_check(cu->StreamWaitEvent(to, ev, 0), "cuStreamWaitEvent", to_dev);
  if (r == FDP_OK && release != NULL) r = scratch_free(cu, release);
  FDP_CHECK_KEEP(fdp__cu_ctx_pop(to_dev), r);
out:
  if (ev != NULL) FDP_CHECK_KEEP(fdp__cu_check(cu->EventDestroy(ev), "cuEventDestroy", from_dev), r);
  FDP_CHECK_KEEP(fdp__cu_ctx_pop(from_dev), r);
  return r;
}

/* Enqueues the strided-copy kernel on `stream`; the context of `dev` must be current. */
static fdp_result_t kernel_copy(const fdp_cu_t *cu, int dev, CUstream stream, fdp_pair_t p) {
  const module_t *m = NULL;
  fdp_result_t r = get_module(cu, dev, &m);
  if (r == FDP_UNAVAILABLE) return needs_kernels("this copy's layout needs the strided-copy kernel");
  if (r != FDP_OK) return r;
  fdp__pair_for_kernel(&p);
  fdp_copy_args_t a;
  memset(&a, 0, sizeof a);
  a.numel = p.numel;
  a.ndim = p.ndim;
  for (int d = 0; d < p.ndim; d++) {
    a.sizes[d] = p.sizes[d];
    a.src_strides[d] = p.ss[d];
    a.dst_strides[d] = p.ds[d];
  }
  void *params[] = {&p.src, &p.dst, &a};
  return fdp__cu_check(cu->LaunchKernel(m->copy[fdp__pair_es_index(p.es)], grid_for(m, p.numel), 1, 1, THREADS, 1, 1, 0,
                                        stream, params, NULL),
                       "cuLaunchKernel(strided copy)", dev);
}

/* ---- copy ---- */

static fdp_result_t copy_same_device(const fdp_cu_t *cu, int dev, CUstream stream, const fdp_pair_t *p) {
  size_t width, height, spitch, dpitch;
  int64_t outer;
  if (fdp__pair_src_flat(p) && fdp__pair_dst_flat(p))
    return fdp__cu_check(cu->MemcpyAsync(p->dst, p->src, (size_t)(p->numel * p->es), stream), "cuMemcpyAsync", dev);
  if (fdp__pair_rows(p, &width, &height, &spitch, &dpitch, &outer) && width >= MEMCPY2D_MIN_ROW &&
      outer <= MEMCPY_MAX_LOOP) {
    int64_t idx[FDP_COPY_MAX_DIMS] = {0};
    for (int64_t it = 0; it < outer; it++) {
      int64_t so, dof;
      fdp__pair_outer_next(p, idx, &so, &dof);
      CUDA_MEMCPY2D c;
      memset(&c, 0, sizeof c);
      c.srcMemoryType = CU_MEMORYTYPE_DEVICE;
      c.srcDevice = p->src + (CUdeviceptr)so;
      c.srcPitch = spitch;
      c.dstMemoryType = CU_MEMORYTYPE_DEVICE;
      c.dstDevice = p->dst + (CUdeviceptr)dof;
      c.dstPitch = dpitch;
      c.WidthInBytes = width;
      c.Height = height;
      FDP_CHECK(fdp__cu_check(cu->Memcpy2DAsync(&c, stream), "cuMemcpy2DAsync", dev));
    }
    return FDP_OK;
  }
  return kernel_copy(cu, dev, stream, *p);
}

/* The destination-side part of a cross-device copy, on the destination's stream with its context current.
 * `src` is the source or its packed staging buffer (then flat). Peer copies name both contexts explicitly
 * (cuMemcpyPeerAsync / cuMemcpy3DPeerAsync): that is the documented cross-context path, and the driver picks
 * P2P or a host bounce itself, whether or not peer access was enabled. cuMemcpy2DAsync with unified addresses
 * would usually work too, but its cross-context behaviour is not documented. */
static fdp_result_t copy_peer_rows(const fdp_cu_t *cu, int ddev, CUstream stream, const fdp_pair_t *p, CUcontext sctx,
                                   CUcontext dctx) {
  size_t width, height, spitch, dpitch;
  int64_t outer;
  if (fdp__pair_src_flat(p) && fdp__pair_dst_flat(p))
    return fdp__cu_check(cu->MemcpyPeerAsync(p->dst, dctx, p->src, sctx, (size_t)(p->numel * p->es), stream),
                         "cuMemcpyPeerAsync", ddev);
  if (!fdp__pair_rows(p, &width, &height, &spitch, &dpitch, &outer))
    return fdp__fail(FDP_INTERNAL, "cuda backend: peer copy of a layout without rows");
  int64_t idx[FDP_COPY_MAX_DIMS] = {0};
  for (int64_t it = 0; it < outer; it++) {
    int64_t so, dof;
    fdp__pair_outer_next(p, idx, &so, &dof);
    CUDA_MEMCPY3D_PEER c;
    memset(&c, 0, sizeof c);
    c.srcMemoryType = CU_MEMORYTYPE_DEVICE;
    c.srcDevice = p->src + (CUdeviceptr)so;
    c.srcContext = sctx;
    c.srcPitch = spitch;
    c.srcHeight = height;
    c.dstMemoryType = CU_MEMORYTYPE_DEVICE;
    c.dstDevice = p->dst + (CUdeviceptr)dof;
    c.dstContext = dctx;
    c.dstPitch = dpitch;
    c.dstHeight = height;
    c.WidthInBytes = width;
    c.Height = height;
    c.Depth = 1;
    FDP_CHECK(fdp__cu_check(cu->Memcpy3DPeerAsync(&c, stream), "cuMemcpy3DPeerAsync", ddev));
  }
  return FDP_OK;
}

/* Copies between a pair's destination-ordered view and a flat staging buffer `buf` on `dev` with the strided-copy
 * kernel: pack (view → buf) or unpack (buf → view). The context of `dev` must be current. */
static fdp_result_t stage_kernel(const fdp_cu_t *cu, int dev, CUstream stream, const fdp_pair_t *p, CUdeviceptr buf,
                                 int pack) {
  fdp_pair_t q = *p;
  if (pack) {
    fdp__pair_flat_strides(p, q.ds);
    q.dst = buf;
  } else {
    fdp__pair_flat_strides(p, q.ss);
    q.src = buf;
  }
  fdp__pair_merge(&q);
  return kernel_copy(cu, dev, stream, q);
}

/* ---- between two devices ---- */

/* One cross-device copy in flight: the devices, their streams and contexts, and the staging buffers. */
typedef struct peer_copy {
  const fdp_pair_t *p;
  int sdev, ddev;
  CUstream sstream, dstream;
  CUcontext sctx, dctx;
  int staged; /* neither flat nor rows: go through flat staging buffers */
  size_t bytes;
  scratch_t ta;    /* on the source, the packed source (held until the source stream has waited for the copy) */
  scratch_t tb;    /* on the destination, to unpack from (destination stream only) */
  fdp_pair_t flat; /* the transfer itself: between the staging buffers, or the views themselves */
} peer_copy_t;

/* Packs a strided source into ta on the source device, on the source stream. ta is not held on failure
 * unless only the final context pop failed (the caller frees it then). */
static fdp_result_t peer_pack(const fdp_cu_t *cu, peer_copy_t *x) {
  fdp_result_t r = FDP_OK;
  FDP_CHECK(fdp__cu_ctx_push(x->sdev, NULL));
  FDP_CHECK_GOTO(scratch_alloc(cu, x->sdev, x->sstream, x->bytes, "staging for a strided peer copy", &x->ta), r, out);
  FDP_CHECK_GOTO(stage_kernel(cu, x->sdev, x->sstream, x->p, x->ta.ptr, 1), r, fail);
out:
  FDP_CHECK_KEEP(fdp__cu_ctx_pop(x->sdev), r);
  return r;
fail: /* nothing but the pack (ordered on sstream) touched ta */
  FDP_CHECK_KEEP(scratch_free(cu, &x->ta), r);
  goto out;
}

/* On the destination stream, with the destination's context current: the transfer, then the unpack from tb when
 * the destination is strided. tb is freed on that stream after them, whatever happened. */
static fdp_result_t peer_transfer(const fdp_cu_t *cu, peer_copy_t *x) {
  fdp_result_t r = FDP_OK;
  if (x->staged && !fdp__pair_dst_flat(x->p)) {
    FDP_CHECK_GOTO(scratch_alloc(cu, x->ddev, x->dstream, x->bytes, "staging for a strided peer copy", &x->tb), r, out);
    x->flat.dst = x->tb.ptr;
  }
  FDP_CHECK_GOTO(copy_peer_rows(cu, x->ddev, x->dstream, &x->flat, x->sctx, x->dctx), r, out);
  if (x->tb.ptr) FDP_CHECK_GOTO(stage_kernel(cu, x->ddev, x->dstream, x->p, x->tb.ptr, 0), r, out);
out:
  FDP_CHECK_KEEP(scratch_free(cu, &x->tb), r);
  return r;
}

/* The source stream waits for the destination stream (something there may read the source or ta now, even after
 * a failure), and ta is freed behind that wait. When the fence fails, the destination stream is waited for on the
 * host instead: *drained says that worked (nothing reads the source or ta any more); otherwise ta is leaked
 * rather than freed early. */
static fdp_result_t peer_fence_back(const fdp_cu_t *cu, peer_copy_t *x, int *drained) {
  *drained = 0;
  fdp_result_t r = stream_wait(cu, x->ddev, x->dstream, x->sdev, x->sstream, x->ta.ptr ? &x->ta : NULL);
  if (r == FDP_OK) return r;
  fdp_result_t rs = FDP_OK;
  int held = fdp__detail_hold(1); /* the failed fence is what the caller reports */
  FDP_CHECK_GOTO(fdp__cu_ctx_push(x->ddev, NULL), rs, out);
  FDP_CHECK_KEEP(fdp__cu_check(cu->StreamSynchronize(x->dstream), "cuStreamSynchronize", x->ddev), rs);
  FDP_CHECK_IGNORE(fdp__cu_ctx_pop(x->ddev));
out:
  fdp__detail_release(held);
  *drained = rs == FDP_OK;
  if (!*drained)
    fdp__log("cuda copy: device %d may still read device %d's memory after a failed fence", x->ddev, x->sdev);
  return r;
}

/* Frees ta on the source stream once nothing beyond the pack (or only finished work) reads it. */
static void peer_release_unread(const fdp_cu_t *cu, peer_copy_t *x) {
  if (x->ta.ptr && fdp__cu_ctx_push(x->sdev, NULL) == FDP_OK) {
    FDP_CHECK_IGNORE(scratch_free(cu, &x->ta));
    FDP_CHECK_IGNORE(fdp__cu_ctx_pop(x->sdev));
  }
  if (x->ta.ptr) fdp__log("cuda copy: leaking a %zu-byte staging buffer on device %d", x->bytes, x->sdev);
}

/* A copy between two devices, on the destination's stream, fenced both ways against the source's stream:
 * the copy starts after the work already queued there (which produced the source), and the source stream
 * waits for the copy, so PyTorch's allocator cannot hand the source to new work while it is still read.
 * Layouts the copy engines cannot do are staged: packed into a flat buffer on the source device (kernel on
 * the source stream), copied flat, and unpacked on the destination device (kernel); the staging buffers are
 * scratch memory (see NOTE [scratch memory]). Peer access from the destination's context (the one that runs
 * the copy) to the source's is enabled first where the hardware allows, so that the copy goes P2P. */
static fdp_result_t copy_cross_device(const fdp_cu_t *cu, int sdev, int ddev, const fdp_streams_t *streams,
                                      const fdp_pair_t *p) {
  peer_copy_t x;
  memset(&x, 0, sizeof x);
  x.p = p;
  x.sdev = sdev;
  x.ddev = ddev;
  x.sstream = (CUstream)fdp__stream_for(streams, sdev);
  x.dstream = (CUstream)fdp__stream_for(streams, ddev);
  x.bytes = (size_t)(p->numel * p->es);
  x.flat = *p;
  FDP_CHECK(fdp__cu_ctx_get(sdev, &x.sctx));
  FDP_CHECK(fdp__cu_ctx_get(ddev, &x.dctx));
  FDP_CHECK(fdp__cu_peer_enable(ddev, sdev, NULL));
  size_t width, height, spitch, dpitch;
  int64_t outer = 0;
  int rows = fdp__pair_rows(p, &width, &height, &spitch, &dpitch, &outer) && outer <= PEER_MAX_LOOP;
  x.staged = !(fdp__pair_src_flat(p) && fdp__pair_dst_flat(p)) && !rows;
  fdp_result_t r = FDP_OK;
  if (x.staged && !fdp__pair_src_flat(p)) FDP_CHECK_GOTO(peer_pack(cu, &x), r, unread);
  if (x.staged) {
    x.flat.ndim = 1;
    x.flat.sizes[0] = p->numel;
    x.flat.ss[0] = x.flat.ds[0] = 1;
    x.flat.src = x.ta.ptr ? x.ta.ptr : p->src;
  }
  FDP_CHECK_GOTO(stream_wait(cu, sdev, x.sstream, ddev, x.dstream, NULL), r, unread);
  FDP_CHECK_GOTO(fdp__cu_ctx_push(ddev, NULL), r, unread);
  r = peer_transfer(cu, &x);
  FDP_CHECK_KEEP(fdp__cu_ctx_pop(ddev), r);
  int drained;
  FDP_CHECK_KEEP(peer_fence_back(cu, &x, &drained), r);
  if (drained) goto unread;
  if (x.ta.ptr)
    fdp__log("cuda copy: leaking a %zu-byte staging buffer on device %d after a failed fence", x.bytes, sdev);
  return r;
unread:
  peer_release_unread(cu, &x);
  return r;
}

/* ---- between host memory and one device ---- */

/* A host descriptor over a pair's index space (for the host backend's strided copy). */
static void host_view(fdp_tensor_t *t, uintptr_t addr, const fdp_pair_t *p, const int64_t *strides) {
  memset(t, 0, sizeof *t);
  t->data = (char *)addr;
  t->device = FDP_HOST;
  t->dtype = FDP_DTYPE_OTHER;
  t->elem_size = (int)p->es;
  t->ndim = p->ndim;
  for (int d = 0; d < p->ndim; d++) {
    t->sizes[d] = p->sizes[d];
    t->strides[d] = strides[d];
  }
}

/* One host/device copy in flight: the direction, the device, and where each side's flat bytes live. */
typedef struct host_copy {
  fdp_pair_t p;
  int h2d; /* host to device, else device to host */
  int dev;
  CUstream stream;
  size_t bytes;
  int64_t fs[FDP_COPY_MAX_DIMS]; /* flat strides of the staging buffers */
  int host_flat, dev_flat;       /* that side is flat: no staging buffer */
  void *hbuf;                    /* the flat host bytes: the host view itself or a malloc'ed buffer */
  CUdeviceptr dbuf;              /* the flat device bytes: the device view itself or ds */
  scratch_t ds;
  int undrained;                 /* the stream could not be synchronised: a transfer may still use hbuf */
} host_copy_t;

/* Packs (h2d) the strided host source into hbuf, or unpacks (d2h) hbuf into the strided host destination: host
 * memory on both sides, so the core routes it to the host backend. */
static fdp_result_t host_stage(const host_copy_t *x) {
  fdp_copy_t c;
  if (x->h2d) {
    host_view(&c.dst, (uintptr_t)x->hbuf, &x->p, x->fs);
    host_view(&c.src, (uintptr_t)x->p.src, &x->p, x->p.ss);
  } else {
    host_view(&c.dst, (uintptr_t)x->p.dst, &x->p, x->p.ds);
    host_view(&c.src, (uintptr_t)x->hbuf, &x->p, x->fs);
  }
  return fdp__route_copy(&c, 1, NULL);
}

/* The flat transfer between hbuf and dbuf, on the device's stream. */
static fdp_result_t host_transfer(const fdp_cu_t *cu, const host_copy_t *x) {
  if (x->h2d)
    return fdp__cu_check(cu->MemcpyHtoDAsync(x->dbuf, x->hbuf, x->bytes, x->stream), "cuMemcpyHtoDAsync", x->dev);
  return fdp__cu_check(cu->MemcpyDtoHAsync(x->hbuf, x->dbuf, x->bytes, x->stream), "cuMemcpyDtoHAsync", x->dev);
}

/* The device part, with the device's context current: a strided device side packed (d2h) or unpacked (h2d)
 * through scratch memory around the transfer. Returns with the stream finished, also after a failure: the caller
 * frees the host buffer next, so nothing enqueued may still use it. */
static fdp_result_t host_device_part(const fdp_cu_t *cu, host_copy_t *x) {
  fdp_result_t r = FDP_OK;
  if (!x->dev_flat) {
    FDP_CHECK_GOTO(
        scratch_alloc(cu, x->dev, x->stream, x->bytes, "staging for a strided copy between host and device", &x->ds), r,
        out);
    x->dbuf = x->ds.ptr;
  }
  if (!x->h2d && !x->dev_flat) FDP_CHECK_GOTO(stage_kernel(cu, x->dev, x->stream, &x->p, x->dbuf, 1), r, out);
  FDP_CHECK_GOTO(host_transfer(cu, x), r, out);
  if (x->h2d && !x->dev_flat) FDP_CHECK_GOTO(stage_kernel(cu, x->dev, x->stream, &x->p, x->dbuf, 0), r, out);
out:
  FDP_CHECK_KEEP(scratch_free(cu, &x->ds), r); /* stream-ordered: after the work above */
  CUresult es = cu->StreamSynchronize(x->stream);
  x->undrained = es != CUDA_SUCCESS;
  FDP_CHECK_KEEP(fdp__cu_check(es, "cuStreamSynchronize", x->dev), r);
  return r;
}

/* Fills x for copy c: its pair, direction, device, stream and which sides are flat (no buffers yet). */
static void host_copy_init(const fdp_copy_t *c, const fdp_streams_t *streams, host_copy_t *x) {
  memset(x, 0, sizeof *x);
  fdp__pair_build(c, &x->p);
  x->h2d = c->src.device == FDP_HOST;
  x->dev = x->h2d ? c->dst.device : c->src.device;
  x->stream = (CUstream)fdp__stream_for(streams, x->dev);
  x->bytes = (size_t)(x->p.numel * x->p.es);
  fdp__pair_flat_strides(&x->p, x->fs);
  x->host_flat = x->h2d ? fdp__pair_src_flat(&x->p) : fdp__pair_dst_flat(&x->p);
  x->dev_flat = x->h2d ? fdp__pair_dst_flat(&x->p) : fdp__pair_src_flat(&x->p);
  x->dbuf = x->dev_flat ? (x->h2d ? x->p.dst : x->p.src) : 0;
}

/* Between host memory and one device, on that device's stream. The transfer itself is one flat
 * cuMemcpyHtoDAsync / cuMemcpyDtoHAsync; a strided host side is packed or unpacked on the host (a malloc'ed
 * buffer), a strided device side through a scratch buffer (see NOTE [scratch memory]) and the copy kernel. The
 * stream is synchronised before returning: host memory is complete (and reusable) when the call returns, as with
 * upstream's blocking copies to and from the CPU, whether or not the host memory is pinned. */
static fdp_result_t copy_host_device(const fdp_cu_t *cu, const fdp_copy_t *c, const fdp_streams_t *streams) {
  host_copy_t x;
  host_copy_init(c, streams, &x);
  if (x.p.numel == 0) return FDP_OK;
  x.hbuf = x.host_flat ? (void *)(uintptr_t)(x.h2d ? x.p.src : x.p.dst) : malloc(x.bytes);
  if (!x.hbuf) return fdp__fail(FDP_NOMEM, "cuda backend: no host memory for a %zu-byte staging buffer", x.bytes);
  fdp_result_t r = FDP_OK;
  if (x.h2d && !x.host_flat) FDP_CHECK_GOTO(host_stage(&x), r, out);
  FDP_CHECK_GOTO(fdp__cu_ctx_push(x.dev, NULL), r, out);
  r = host_device_part(cu, &x);
  FDP_CHECK_KEEP(fdp__cu_ctx_pop(x.dev), r);
  if (r == FDP_OK && !x.h2d && !x.host_flat) r = host_stage(&x);
out:
  if (!x.host_flat && !x.undrained)
    free(x.hbuf);
  else if (!x.host_flat)
    fdp__log("cuda copy: leaking a %zu-byte host staging buffer that a transfer may still use", x.bytes);
  return r;
}

static fdp_result_t cuda_copy(const fdp_copy_t *copies, int n, const fdp_streams_t *streams) {
  const fdp_cu_t *cu;
  FDP_CHECK(fdp__cu_load(&cu, NULL));
  for (int i = 0; i < n; i++) {
    const fdp_copy_t *c = &copies[i];
    int sdev = c->src.device, ddev = c->dst.device;
    assert(c->src.ndim == c->dst.ndim && c->src.elem_size == c->dst.elem_size && c->dst.elem_size > 0);
    if (sdev == FDP_HOST && ddev == FDP_HOST)
      return fdp__fail(FDP_INTERNAL, "cuda backend: copy %d is host to host", i);
    if (sdev == FDP_HOST || ddev == FDP_HOST) {
      FDP_CHECK(copy_host_device(cu, c, streams));
      continue;
    }
    fdp_pair_t p;
    fdp__pair_build(c, &p);
    if (p.numel == 0) continue;
    fdp_result_t r;
    if (sdev == ddev) {
      CUstream stream = (CUstream)fdp__stream_for(streams, ddev);
      FDP_CHECK(fdp__cu_ctx_push(ddev, NULL));
      r = copy_same_device(cu, ddev, stream, &p);
      FDP_CHECK_KEEP(fdp__cu_ctx_pop(ddev), r);
    } else {
      r = copy_cross_device(cu, sdev, ddev, streams, &p);
    }
    if (r != FDP_OK) return r;
  }
  return FDP_OK;
}

/* ---- reduce ---- */

static fdp_result_t launch_sum(const fdp_cu_t *cu, int dev, CUstream stream, const module_t *m, CUfunction fn,
                               const CUdeviceptr *in, int k, CUdeviceptr out, int64_t n) {
  fdp_sum_args_t a;
  memset(&a, 0, sizeof a);
  for (int j = 0; j < k; j++)
    a.in[j] = (const void *)(uintptr_t)in[j];
  a.out = (void *)(uintptr_t)out;
  a.n = n;
  a.k = k;
  void *params[] = {&a};
  return fdp__cu_check(cu->LaunchKernel(fn, grid_for(m, n), 1, 1, THREADS, 1, 1, 0, stream, params, NULL),
                       "cuLaunchKernel(k-way sum)", dev);
}

/* Passes of at most FDP_SUM_MAX_INPUTS inputs, each carrying the running sum as its first input, keep the
 * order ((a + b) + c) + ... and so the rounding of every intermediate. */
static fdp_result_t sum_passes(const fdp_cu_t *cu, int dev, CUstream stream, const module_t *m, CUfunction fn,
                               const fdp_tensor_t *inputs, int n, CUdeviceptr out, CUdeviceptr acc, int64_t numel) {
  CUdeviceptr in[FDP_SUM_MAX_INPUTS];
  int k = n < FDP_SUM_MAX_INPUTS ? n : FDP_SUM_MAX_INPUTS;
  for (int j = 0; j < k; j++)
    in[j] = (CUdeviceptr)(uintptr_t)inputs[j].data;
  FDP_CHECK(launch_sum(cu, dev, stream, m, fn, in, k, k == n ? out : acc, numel));
  for (int i = k; i < n;) {
    int more = n - i < FDP_SUM_MAX_INPUTS - 1 ? n - i : FDP_SUM_MAX_INPUTS - 1;
    in[0] = acc;
    for (int j = 0; j < more; j++)
      in[1 + j] = (CUdeviceptr)(uintptr_t)inputs[i + j].data;
    i += more;
    FDP_CHECK(launch_sum(cu, dev, stream, m, fn, in, 1 + more, i == n ? out : acc, numel));
  }
  return FDP_OK;
}

/* What the core established before routing a reduce here (check_reduce_input, cuda_can). */
static void reduce_invariants(const fdp_tensor_t *inputs, int n, const fdp_tensor_t *out) {
  assert(n >= 1 && fdp_tensor_is_contiguous(out));
  assert(out->dtype >= 0 && out->dtype < FDP_DTYPE_COUNT && k_sum_names[out->dtype] != NULL);
  for (int i = 0; i < n; i++)
    assert(inputs[i].device == out->device && inputs[i].dtype == out->dtype &&
           fdp_tensor_numel(&inputs[i]) == fdp_tensor_numel(out) && fdp_tensor_is_contiguous(&inputs[i]));
#ifdef NDEBUG
  (void)inputs, (void)n, (void)out;
#endif
}

static fdp_result_t cuda_reduce(const fdp_tensor_t *inputs, int n, const fdp_tensor_t *out,
                                const fdp_streams_t *streams) {
  reduce_invariants(inputs, n, out);
  int dev = out->device;
  int64_t numel = fdp_tensor_numel(out);
  if (numel == 0) return FDP_OK;

  const fdp_cu_t *cu;
  FDP_CHECK(fdp__cu_load(&cu, NULL));
  CUstream stream = (CUstream)fdp__stream_for(streams, dev);
  CUdeviceptr o = (CUdeviceptr)(uintptr_t)out->data;
  size_t bytes = (size_t)numel * (size_t)out->elem_size;
  fdp_result_t r = FDP_OK;
  if (n == 1) {
    if (inputs[0].data == out->data) return FDP_OK;
    FDP_CHECK(fdp__cu_ctx_push(dev, NULL));
    r = fdp__cu_check(cu->MemcpyAsync(o, (CUdeviceptr)(uintptr_t)inputs[0].data, bytes, stream), "cuMemcpyAsync", dev);
    FDP_CHECK_KEEP(fdp__cu_ctx_pop(dev), r);
    return r;
  }
  /* The running sum lives in out unless out is an input that a later pass still has to read; then in scratch
   * memory (see NOTE [scratch memory]) allocated and freed on this one stream. */
  CUdeviceptr acc = o;
  for (int i = FDP_SUM_MAX_INPUTS; i < n; i++)
    if (inputs[i].data == out->data) acc = 0;
  const module_t *m = NULL;
  scratch_t tmp;
  memset(&tmp, 0, sizeof tmp);
  FDP_CHECK(fdp__cu_ctx_push(dev, NULL));
  r = get_module(cu, dev, &m);
  if (r == FDP_UNAVAILABLE) r = needs_kernels("a sum of several inputs needs the k-way sum kernel");
  if (r != FDP_OK) goto out;
  if (acc == 0) {
    FDP_CHECK_GOTO(scratch_alloc(cu, dev, stream, bytes, "partial sums of a reduce into one of its inputs", &tmp), r,
                   out);
    acc = tmp.ptr;
  }
  FDP_CHECK_GOTO(sum_passes(cu, dev, stream, m, m->sum[out->dtype], inputs, n, o, acc, numel), r, out);
out:
  FDP_CHECK_KEEP(scratch_free(cu, &tmp), r);
  FDP_CHECK_KEEP(fdp__cu_ctx_pop(dev), r);
  return r;
}

/* ---- backend ---- */

/* Usable when the driver loads and sees a device. Kernels are not part of it: copies the copy engines can do
 * never need them, and an op that does reports why they are missing (get_module). */
static int cuda_usable(const char **why) {
  const fdp_cu_t *cu;
  const char *w = NULL;
  if (fdp__cu_load(&cu, &w) != FDP_OK) goto no;
  if (fdp__cu_device_count() < 1) {
    w = "no CUDA device is visible";
    goto no;
  }
  return 1;
no:
  if (why) *why = w;
  return 0;
}

/* Copies with a CUDA side (host memory on the other side too: staged through the host backend via the core), and
 * sums whose inputs all sit on the output's device. Broadcasts are copies here. */
static int cuda_can(fdp_op_t op, const fdp_tensor_t *const *ts, int n) {
  int cuda = 0, local = 1;
  for (int i = 0; i < n; i++) {
    cuda |= ts[i]->device != FDP_HOST;
    local &= ts[i]->device == ts[n - 1]->device;
  }
  switch (op) {
  case FDP_OP_COPY: return cuda;
  case FDP_OP_REDUCE: return cuda && local;
  default: return 0;
  }
}

/* Unloads the kernel modules (after the device finishes what it was given; the caller promised no concurrent
 * calls) and releases the primary contexts retained here. */
static void cuda_shutdown(void) {
  const fdp_cu_t *cu = NULL;
  pthread_mutex_lock(&g_mod_lock);
  for (int d = 0; d < FDP_MAX_DEVICES; d++) {
    int st = atomic_load(&g_mod_state[d]);
    if (st == 1 && (cu != NULL || fdp__cu_load(&cu, NULL) == FDP_OK) && fdp__cu_ctx_push(d, NULL) == FDP_OK) {
      CUresult e = cu->CtxSynchronize();
      if (e == CUDA_SUCCESS) e = cu->ModuleUnload(g_mod[d].mod);
      if (e != CUDA_SUCCESS) fdp__log("cuda shutdown: unloading the kernels on device %d: CUresult %d", d, (int)e);
      FDP_CHECK_IGNORE(fdp__cu_ctx_pop(d));
    }
    memset(&g_mod[d], 0, sizeof g_mod[d]);
    g_mod_src[d][0] = g_mod_err[d][0] = '\0';
    atomic_store(&g_mod_state[d], 0);
  }
  pthread_mutex_unlock(&g_mod_lock);
  fdp__cu_ctx_release_all();
}

const fdp_backend_t fdp__backend_cuda = {
    .name = "cuda",
    .id = FDP_BACKEND_CUDA,
    .usable = cuda_usable,
    .can = cuda_can,
    .copy = cuda_copy,
    .reduce = cuda_reduce,
    .broadcast = NULL,
    .shutdown = cuda_shutdown,
    .library_facts = fdp__cuda_library_facts,
    .device_facts = fdp__cuda_device_facts,
    .can_access_peer = fdp__cuda_can_access_peer,
    .fence_record = fdp__cuda_fence_record,
    .fence_wait = fdp__cuda_fence_wait,
    .fence_query = fdp__cuda_fence_query,
    .fence_free = fdp__cuda_fence_free,
};
