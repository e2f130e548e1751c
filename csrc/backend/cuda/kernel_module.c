/* SPDX-License-Identifier: MIT */
/* The cuda backend's kernels, one module per device: the fatbin embedded at build time when it fits the GPU, else
 * NVRTC's image for the device's architecture (kernel_image.c), loaded once into the device's primary context and
 * published to every thread; then each kernel bound by name, and where the kernels came from kept for
 * `python -m fastdp info`. Copies the copy engines can do never need them. */
#include "backend/cuda/kernel_module.h"

#include "backend/cuda/facts.h"
#include "backend/cuda/kernel_image.h"
#include "backend/cuda/kernels.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

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
static fdp_kmodule_t g_mod[FDP_MAX_DEVICES];
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

static fdp_result_t bind_functions(const fdp_cu_t *cu, int dev, fdp_kmodule_t *m) {
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
static fdp_result_t load_module(const fdp_cu_t *cu, int dev, fdp_kmodule_t *m, int *sticky) {
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

/* See kernel_module.h. */
fdp_result_t fdp__kmodule_get(const fdp_cu_t *cu, int dev, const fdp_kmodule_t **out) {
  if (dev < 0 || dev >= FDP_MAX_DEVICES) return fdp__fail(FDP_INVALID, "CUDA device %d out of range", dev);
  int st = atomic_load_explicit(&g_mod_state[dev], memory_order_acquire);
  if (st == 0) {
    fdp_result_t r = FDP_OK;
    pthread_mutex_lock(&g_mod_lock);
    if (atomic_load_explicit(&g_mod_state[dev], memory_order_relaxed) == 0) {
      fdp_kmodule_t m;
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

fdp_result_t fdp__kmodule_needed(const char *what) {
  char why[1024];
  snprintf(why, sizeof why, "%s", fdp_last_error());
  return fdp__fail(FDP_UNAVAILABLE, "cuda backend: %s, but %s", what, why);
}

unsigned int fdp__kmodule_grid(const fdp_kmodule_t *m, int64_t n) {
  int64_t blocks = (n + FDP_KERNEL_THREADS - 1) / FDP_KERNEL_THREADS;
  return blocks < (int64_t)m->max_blocks ? (unsigned int)blocks : m->max_blocks;
}

int fdp__kmodule_has_sum(int dtype) {
  return dtype >= 0 && dtype < FDP_DTYPE_COUNT && k_sum_names[dtype] != NULL;
}

void fdp__kmodule_unload_all(void) {
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
}
