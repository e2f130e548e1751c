/* SPDX-License-Identifier: MIT */
/* The only place that loads the CUDA driver: dlopen of the libcuda.so.1 PyTorch already mapped (or a plain
 * dlopen), explicit versioned symbol names, one cuInit, and a per-device cache of retained primary contexts. */
#include "dl/cuda_driver.h"
#include "dl/dl_once.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

static fdp_cu_t g_cu;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static fdp_result_t g_status = FDP_UNAVAILABLE;
static char g_why[512] = "CUDA driver not loaded";
static int g_count;

static pthread_mutex_t g_ctx_lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic(CUcontext) g_ctx[FDP_MAX_DEVICES];

/* Peer access per ordered pair [device][peer]: 0 not asked yet, 1 enabled, -1 not possible. Lock order: g_peer_lock
 * before g_ctx_lock (enabling retains contexts). */
static pthread_mutex_t g_peer_lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic(signed char) g_peer[FDP_MAX_DEVICES][FDP_MAX_DEVICES];

/* Not named in dl/cuda_api.h: the value of CUDA_ERROR_TOO_MANY_PEERS in cuda.h (a device maps at most 8 peers). */
#define FDP_CU_TOO_MANY_PEERS ((CUresult)711)

/* Where each symbol goes in g_cu (NOTE [driver entry points]). */
static const struct {
  const char *name;
  size_t offset;
  int optional;
} k_syms[] = {
#define FDP_CU_SYMBOL(field, symbol, optional, params) {#symbol, offsetof(fdp_cu_t, field), optional},
    FDP_CU_ENTRY_POINTS(FDP_CU_SYMBOL)
#undef FDP_CU_SYMBOL
};

/* Fills g_cu from the library's symbols; 0 (g_why says which) when a required one is missing. */
static int bind_symbols(void *h) {
  for (size_t i = 0; i < sizeof k_syms / sizeof k_syms[0]; i++) {
    void *sym = dlsym(h, k_syms[i].name);
    if (sym == NULL && !k_syms[i].optional) {
      snprintf(g_why, sizeof g_why, "the CUDA driver lacks %s (driver too old?)", k_syms[i].name);
      return 0;
    }
    memcpy((char *)&g_cu + k_syms[i].offset, &sym, sizeof sym);
  }
  return 1;
}

/* cuInit and the device count; 0 (g_why says why) when either fails. */
static int init_driver(void) {
  CUresult r = g_cu.Init(0);
  if (r != CUDA_SUCCESS) {
    const char *s = NULL, *n = NULL;
    if (g_cu.GetErrorString(r, &s) != CUDA_SUCCESS || s == NULL) s = "unknown error";
    if (g_cu.GetErrorName(r, &n) != CUDA_SUCCESS || n == NULL) n = "?";
    snprintf(g_why, sizeof g_why, "cuInit failed: %s (%s)", s, n);
    return 0;
  }
  int count = 0;
  r = g_cu.DeviceGetCount(&count);
  if (r != CUDA_SUCCESS) {
    snprintf(g_why, sizeof g_why, "cuDeviceGetCount failed (CUresult %d)", (int)r);
    return 0;
  }
  g_count = count;
  return 1;
}

static void load_once(void) {
  /* FASTDP_CUDA_DRIVER_LIBRARY (tests: the simulated GPU) names exactly the file to load, and nothing else is
   * looked up. Otherwise RTLD_NOLOAD first: inside PyTorch the driver is already mapped and we must share that
   * very copy. */
  const char *path = fdp_param_str(FDP_PARAM_CUDA_DRIVER_LIBRARY);
  void *h = path ? dlopen(path, RTLD_NOW | RTLD_LOCAL) : dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (h == NULL && path == NULL) h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (h == NULL) {
    const char *e = dlerror();
    snprintf(g_why, sizeof g_why, "the CUDA driver (%s) cannot be loaded: %s",
             path ? path : "libcuda.so.1", e ? e : "not found");
    return;
  }
  /* On failure the handle stays open: dlclose of a library PyTorch shares is never worth the risk. */
  if (!bind_symbols(h) || !init_driver()) return;
  g_why[0] = '\0';
  g_status = FDP_OK;
}

static const fdp_dl_lib_t k_lib = {
    FDP_PARAM_DISABLE_CUDA, "CUDA", "disabled by FASTDP_DISABLE_CUDA", &g_once, load_once, &g_status, g_why,
};

fdp_result_t fdp__cu_load(const fdp_cu_t **out, const char **why) {
  FDP_CHECK(fdp__dl_ready(&k_lib, why));
  if (out) *out = &g_cu;
  return FDP_OK;
}

fdp_result_t fdp__cu_check(CUresult r, const char *op, int device) {
  if (r == CUDA_SUCCESS) return FDP_OK;
  const char *s = NULL, *n = NULL;
  if (g_cu.GetErrorString == NULL || g_cu.GetErrorString(r, &s) != CUDA_SUCCESS || s == NULL) s = "unknown error";
  if (g_cu.GetErrorName == NULL || g_cu.GetErrorName(r, &n) != CUDA_SUCCESS || n == NULL) n = "?";
  if (device >= 0)
    return fdp__fail_status(FDP_CUDA, (int)r, "%s on device %d: %s (%s, CUresult %d)", op, device, s, n, (int)r);
  return fdp__fail_status(FDP_CUDA, (int)r, "%s: %s (%s, CUresult %d)", op, s, n, (int)r);
}

int fdp__cu_device_count(void) {
  if (fdp__cu_load(NULL, NULL) != FDP_OK) return 0;
  return g_count;
}

fdp_result_t fdp__cu_ctx_get(int device, CUcontext *ctx) {
  FDP_CHECK(fdp__cu_load(NULL, NULL));
  if (device < 0 || device >= g_count || device >= FDP_MAX_DEVICES)
    return fdp__fail(FDP_INVALID, "CUDA device %d does not exist (%d visible)", device, g_count);
  CUcontext c = atomic_load_explicit(&g_ctx[device], memory_order_acquire);
  if (c != NULL) {
    if (ctx) *ctx = c;
    return FDP_OK;
  }
  fdp_result_t res = FDP_OK;
  pthread_mutex_lock(&g_ctx_lock);
  c = atomic_load_explicit(&g_ctx[device], memory_order_relaxed);
  if (c == NULL) {
    CUdevice dev;
    res = fdp__cu_check(g_cu.DeviceGet(&dev, device), "cuDeviceGet", device);
    if (res == FDP_OK) res = fdp__cu_check(g_cu.DevicePrimaryCtxRetain(&c, dev), "cuDevicePrimaryCtxRetain", device);
    if (res == FDP_OK) atomic_store_explicit(&g_ctx[device], c, memory_order_release);
  }
  pthread_mutex_unlock(&g_ctx_lock);
  if (res == FDP_OK && ctx) *ctx = c;
  return res;
}

fdp_result_t fdp__cu_ctx_push(int device, CUcontext *ctx) {
  CUcontext c = NULL;
  FDP_CHECK(fdp__cu_ctx_get(device, &c));
  FDP_CHECK(fdp__cu_check(g_cu.CtxPushCurrent(c), "cuCtxPushCurrent", device));
  if (ctx) *ctx = c;
  return FDP_OK;
}

fdp_result_t fdp__cu_ctx_pop(int device) {
  CUcontext c;
  return fdp__cu_check(g_cu.CtxPopCurrent(&c), "cuCtxPopCurrent", device);
}

/* Asks the driver once for the ordered pair; called with g_peer_lock held. *state receives 1 or -1 on success. */
static fdp_result_t peer_enable_locked(int device, int peer, int *state) {
  CUdevice a, b;
  int can = 0;
  CUcontext peer_ctx, popped;
  FDP_CHECK(fdp__cu_check(g_cu.DeviceGet(&a, device), "cuDeviceGet", device));
  FDP_CHECK(fdp__cu_check(g_cu.DeviceGet(&b, peer), "cuDeviceGet", peer));
  FDP_CHECK(fdp__cu_check(g_cu.DeviceCanAccessPeer(&can, a, b), "cuDeviceCanAccessPeer", device));
  if (!can) {
    *state = -1;
    return FDP_OK;
  }
  FDP_CHECK(fdp__cu_ctx_get(peer, &peer_ctx));
  FDP_CHECK(fdp__cu_ctx_push(device, NULL)); /* the context that gains access must be current */
  CUresult e = g_cu.CtxEnablePeerAccess(peer_ctx, 0);
  CUresult ep = g_cu.CtxPopCurrent(&popped);
  fdp_result_t r = FDP_OK;
  if (e == CUDA_SUCCESS || e == CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED) {
    *state = 1;
  } else if (e == FDP_CU_TOO_MANY_PEERS || e == CUDA_ERROR_PEER_ACCESS_UNSUPPORTED) {
    fdp__log("peer access %d -> %d not enabled (CUresult %d); copies between them are staged", device, peer, (int)e);
    *state = -1;
  } else {
    r = fdp__cu_check(e, "cuCtxEnablePeerAccess", device);
  }
  /* A failed pop after a successful enable caches nothing: the next call gets ALREADY_ENABLED, which is fine. */
  return r != FDP_OK ? r : fdp__cu_check(ep, "cuCtxPopCurrent", device);
}

fdp_result_t fdp__cu_peer_enable(int device, int peer, int *enabled) {
  int dummy;
  if (enabled == NULL) enabled = &dummy;
  *enabled = 0;
  FDP_CHECK(fdp__cu_load(NULL, NULL));
  if (device < 0 || peer < 0 || device >= g_count || peer >= g_count || device >= FDP_MAX_DEVICES ||
      peer >= FDP_MAX_DEVICES)
    return fdp__fail(FDP_INVALID, "peer access between CUDA devices %d and %d: no such pair (%d visible)", device,
                     peer, g_count);
  if (device == peer) {
    *enabled = 1;
    return FDP_OK;
  }
  int st = atomic_load_explicit(&g_peer[device][peer], memory_order_acquire);
  fdp_result_t r = FDP_OK;
  if (st == 0) {
    pthread_mutex_lock(&g_peer_lock);
    st = atomic_load_explicit(&g_peer[device][peer], memory_order_relaxed);
    if (st == 0) {
      r = peer_enable_locked(device, peer, &st);
      if (r == FDP_OK) atomic_store_explicit(&g_peer[device][peer], (signed char)st, memory_order_release);
    }
    pthread_mutex_unlock(&g_peer_lock);
  }
  *enabled = r == FDP_OK && st > 0;
  return r;
}

void fdp__cu_ctx_release_all(void) {
  if (g_status != FDP_OK) return;
  pthread_mutex_lock(&g_peer_lock);
  for (int d = 0; d < FDP_MAX_DEVICES; d++)
    for (int p = 0; p < FDP_MAX_DEVICES; p++)
      atomic_store_explicit(&g_peer[d][p], 0, memory_order_relaxed);
  pthread_mutex_unlock(&g_peer_lock);
  pthread_mutex_lock(&g_ctx_lock);
  for (int d = 0; d < FDP_MAX_DEVICES; d++) {
    CUcontext c = atomic_exchange(&g_ctx[d], NULL);
    if (c == NULL) continue;
    CUdevice dev;
    CUresult r = g_cu.DeviceGet(&dev, d);
    if (r == CUDA_SUCCESS) r = g_cu.DevicePrimaryCtxRelease(dev);
    if (r != CUDA_SUCCESS) fdp__log("releasing the primary context of device %d: CUresult %d", d, (int)r);
  }
  pthread_mutex_unlock(&g_ctx_lock);
}
