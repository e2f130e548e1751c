/* SPDX-License-Identifier: MIT */
/* The only place that loads NCCL: binds the libnccl.so.2 already in the process (PyTorch's), never a second
 * copy next to it, and finds PyTorch's allocator free mutex for the multi-device launch hazard. */
#include "dl/nccl_api.h"
#include "dl/dl_once.h"

#include <dlfcn.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

static fdp_nccl_api_t g_nccl;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static fdp_result_t g_status = FDP_UNAVAILABLE;
static char g_why[768] = "NCCL not loaded";
static pthread_mutex_t *g_free_mutex;

static const struct {
  const char *name;
  size_t offset;
  int optional;
} k_syms[] = {
    {"ncclGetVersion", offsetof(fdp_nccl_api_t, GetVersion), 0},
    {"ncclCommInitAll", offsetof(fdp_nccl_api_t, CommInitAll), 0},
    {"ncclCommDestroy", offsetof(fdp_nccl_api_t, CommDestroy), 0},
    {"ncclCommAbort", offsetof(fdp_nccl_api_t, CommAbort), 1},
    {"ncclCommGetAsyncError", offsetof(fdp_nccl_api_t, CommGetAsyncError), 1},
    {"ncclGetLastError", offsetof(fdp_nccl_api_t, GetLastError), 1},
    {"ncclGroupStart", offsetof(fdp_nccl_api_t, GroupStart), 0},
    {"ncclGroupEnd", offsetof(fdp_nccl_api_t, GroupEnd), 0},
    {"ncclBroadcast", offsetof(fdp_nccl_api_t, Broadcast), 0},
    {"ncclReduce", offsetof(fdp_nccl_api_t, Reduce), 0},
    {"ncclGetErrorString", offsetof(fdp_nccl_api_t, GetErrorString), 0},
};

/* c10::cuda::getFreeMutex() (torch >= 2.0) and its older home c10::cuda::CUDACachingAllocator::getFreeMutex();
 * both take no arguments and return std::mutex *, which a C caller receives as a plain pointer. */
static void find_free_mutex(void) {
  static const char *const names[] = {"_ZN3c104cuda12getFreeMutexEv",
                                      "_ZN3c104cuda20CUDACachingAllocator12getFreeMutexEv"};
  void *h = dlopen("libc10_cuda.so", RTLD_NOW | RTLD_NOLOAD);
  for (size_t i = 0; i < sizeof names / sizeof names[0] && g_free_mutex == NULL; i++) {
    void *sym = h ? dlsym(h, names[i]) : dlsym(RTLD_DEFAULT, names[i]);
    if (sym == NULL) continue;
    void *(*get)(void);
    memcpy(&get, &sym, sizeof sym);
    g_free_mutex = (pthread_mutex_t *)get();
  }
  fdp__log("nccl: PyTorch's CUDA free mutex %s", g_free_mutex ? "found" : "not found (launches run unlocked)");
}

static void bind(void *h);

static void load_once(void) {
  const char *path = fdp_param_str(FDP_PARAM_NCCL_LIBRARY);
  if (path != NULL) { /* FASTDP_NCCL_LIBRARY (tests: the simulated NCCL): exactly that file, nothing else */
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (h == NULL) {
      const char *e = dlerror();
      snprintf(g_why, sizeof g_why, "NCCL (%s, from FASTDP_NCCL_LIBRARY) cannot be loaded: %s", path,
               e ? e : "not found");
      return;
    }
    bind(h);
    return;
  }
  /* Whatever NCCL is already mapped wins: two NCCLs in one process disagree about shared state (and a system
   * one loaded before PyTorch would even be picked up by PyTorch's own NEEDED entry, by soname). */
  void *h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD);
  if (h == NULL) {
    Dl_info info;
    void *sym = dlsym(RTLD_DEFAULT, "ncclGetVersion");
    if (sym && dladdr(sym, &info) && info.dli_fname) h = dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD);
  }
  if (h == NULL) h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
  if (h == NULL) {
    const char *e = dlerror();
    snprintf(g_why, sizeof g_why,
             "NCCL (libnccl.so.2) is not loaded and cannot be found: %s (it comes with PyTorch's CUDA wheels; "
             "import torch first)",
             e ? e : "not found");
    return;
  }
  bind(h);
}

/* Binds every entry point from `h` and checks the version; sets g_status on success. */
static void bind(void *h) {
  for (size_t i = 0; i < sizeof k_syms / sizeof k_syms[0]; i++) {
    void *sym = dlsym(h, k_syms[i].name);
    if (sym == NULL && !k_syms[i].optional) {
      snprintf(g_why, sizeof g_why, "the NCCL library lacks %s (NCCL 2.4 or newer is needed)", k_syms[i].name);
      return; /* never dlclose: the library may be PyTorch's */
    }
    memcpy((char *)&g_nccl + k_syms[i].offset, &sym, sizeof sym);
  }
  Dl_info info;
  void *gv;
  memcpy(&gv, &g_nccl.GetVersion, sizeof gv);
  if (dladdr(gv, &info) && info.dli_fname)
    snprintf(g_nccl.path, sizeof g_nccl.path, "%s", info.dli_fname);
  else
    snprintf(g_nccl.path, sizeof g_nccl.path, "libnccl.so.2");
  int v = 0;
  ncclResult_t r = g_nccl.GetVersion(&v);
  if (r != ncclSuccess || v < 2000) {
    snprintf(g_why, sizeof g_why, "%s: ncclGetVersion failed or reports a version before 2.0 (%d)", g_nccl.path, v);
    return;
  }
  g_nccl.version = v;
  find_free_mutex();
  g_why[0] = '\0';
  g_status = FDP_OK;
}

static const fdp_dl_lib_t k_lib = {
    FDP_PARAM_DISABLE_NCCL, "NCCL", "disabled by FASTDP_DISABLE_NCCL", &g_once, load_once, &g_status, g_why,
};

fdp_result_t fdp__nccl_load(const fdp_nccl_api_t **out, const char **why) {
  FDP_CHECK(fdp__dl_ready(&k_lib, why));
  if (out) *out = &g_nccl;
  return FDP_OK;
}

pthread_mutex_t *fdp__torch_free_mutex(void) {
  return fdp__nccl_load(NULL, NULL) == FDP_OK ? g_free_mutex : NULL;
}
