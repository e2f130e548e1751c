/* SPDX-License-Identifier: MIT */
/* The only place that loads NVRTC: the copy already in the process (PyTorch's, from nvidia-cuda-nvrtc), then
 * FASTDP_NVRTC_LIBRARY, the folders the Python layer names (site-packages' nvidia/cu13/lib, .../cuda_nvrtc/lib)
 * and the system's search path; and the one function that compiles fastdp's kernel source with it. */
#include "dl/nvrtc.h"
#include "dl/dl_once.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Newest first: a newer NVRTC knows more architectures. The folder soname (.so.11.2) is CUDA 11's. */
static const char *const k_sonames[] = {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so.11.2", "libnvrtc.so"};

static fdp_nvrtc_t g_nv;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t g_dirs_lock = PTHREAD_MUTEX_INITIALIZER;
static char *g_dirs;     /* ':'-separated, from fdp__nvrtc_set_dirs */
static int g_load_began; /* under g_dirs_lock: set_dirs is refused after this */
static fdp_result_t g_status = FDP_UNAVAILABLE;
static char g_why[1024] = "NVRTC not loaded";

static const struct {
  const char *name;
  size_t offset;
} k_syms[] = {
    {"nvrtcVersion", offsetof(fdp_nvrtc_t, Version)},
    {"nvrtcGetErrorString", offsetof(fdp_nvrtc_t, GetErrorString)},
    {"nvrtcGetNumSupportedArchs", offsetof(fdp_nvrtc_t, GetNumSupportedArchs)},
    {"nvrtcGetSupportedArchs", offsetof(fdp_nvrtc_t, GetSupportedArchs)},
    {"nvrtcCreateProgram", offsetof(fdp_nvrtc_t, CreateProgram)},
    {"nvrtcDestroyProgram", offsetof(fdp_nvrtc_t, DestroyProgram)},
    {"nvrtcCompileProgram", offsetof(fdp_nvrtc_t, CompileProgram)},
    {"nvrtcGetProgramLogSize", offsetof(fdp_nvrtc_t, GetProgramLogSize)},
    {"nvrtcGetProgramLog", offsetof(fdp_nvrtc_t, GetProgramLog)},
    {"nvrtcGetPTXSize", offsetof(fdp_nvrtc_t, GetPTXSize)},
    {"nvrtcGetPTX", offsetof(fdp_nvrtc_t, GetPTX)},
    {"nvrtcGetCUBINSize", offsetof(fdp_nvrtc_t, GetCUBINSize)},
    {"nvrtcGetCUBIN", offsetof(fdp_nvrtc_t, GetCUBIN)},
};

fdp_result_t fdp__nvrtc_set_dirs(const char *dirs) {
  fdp_result_t r = FDP_OK;
  pthread_mutex_lock(&g_dirs_lock);
  if (g_load_began) {
    r = fdp__fail(FDP_INVALID, "NVRTC search folders must be set before NVRTC is first loaded");
  } else {
    char *copy = dirs ? strdup(dirs) : NULL;
    if (dirs && !copy) {
      r = fdp__fail(FDP_NOMEM, "no memory for the NVRTC search folders");
    } else {
      free(g_dirs);
      g_dirs = copy;
    }
  }
  pthread_mutex_unlock(&g_dirs_lock);
  return r;
}

/* NVRTC opens libnvrtc-builtins.so.<major>.<minor> by name when it compiles; a pip-installed copy sits beside
 * libnvrtc, outside the loader's search path. Mapping it first by full path makes that lookup find it. */
static void preload_builtins(void) {
  char dir[sizeof g_nv.path], file[sizeof g_nv.path + 64];
  snprintf(dir, sizeof dir, "%s", g_nv.path);
  char *slash = strrchr(dir, '/');
  if (slash == NULL) return;
  *slash = '\0';
  snprintf(file, sizeof file, "%s/libnvrtc-builtins.so.%d.%d", dir, g_nv.major, g_nv.minor);
  if (access(file, R_OK) == 0 && dlopen(file, RTLD_NOW | RTLD_GLOBAL) == NULL)
    fdp__log("NVRTC: cannot preload %s: %s", file, dlerror());
}

/* Binds every entry point of handle `h` (opened from `where`); 0 on success. */
static int bind(void *h, const char *where) {
  for (size_t i = 0; i < sizeof k_syms / sizeof k_syms[0]; i++) {
    void *sym = dlsym(h, k_syms[i].name);
    if (sym == NULL) {
      snprintf(g_why, sizeof g_why, "%s lacks %s (NVRTC older than 11.2?)", where, k_syms[i].name);
      return -1;
    }
    memcpy((char *)&g_nv + k_syms[i].offset, &sym, sizeof sym);
  }
  int n = 0;
  int max = (int)(sizeof g_nv.archs / sizeof g_nv.archs[0]);
  if (g_nv.Version(&g_nv.major, &g_nv.minor) != NVRTC_SUCCESS || g_nv.GetNumSupportedArchs(&n) != NVRTC_SUCCESS ||
      n < 1 || n > max || g_nv.GetSupportedArchs(g_nv.archs) != NVRTC_SUCCESS) {
    snprintf(g_why, sizeof g_why, "%s: nvrtcVersion or nvrtcGetSupportedArchs failed", where);
    return -1;
  }
  g_nv.narchs = n;
  Dl_info info;
  const char *file = dladdr((void *)g_nv.Version, &info) && info.dli_fname ? info.dli_fname : where;
  snprintf(g_nv.path, sizeof g_nv.path, "%s", file);
  preload_builtins();
  return 0;
}

static int try_open(const char *name, int flags) {
  void *h = dlopen(name, flags);
  if (h == NULL) return -1;
  if (bind(h, name) == 0) return 0;
  memset(&g_nv, 0, sizeof g_nv);
  dlclose(h);
  return -1;
}

/* The Python layer's folders, each with every soname; 0 when one loaded. */
static int try_dirs(const char *dirs) {
  const char *p = dirs;
  while (p && *p) {
    const char *end = strchr(p, ':');
    size_t len = end ? (size_t)(end - p) : strlen(p);
    for (size_t i = 0; len > 0 && i < sizeof k_sonames / sizeof k_sonames[0]; i++) {
      char file[1200];
      snprintf(file, sizeof file, "%.*s/%s", (int)len, p, k_sonames[i]);
      if (access(file, R_OK) == 0 && try_open(file, RTLD_NOW | RTLD_LOCAL) == 0) return 0;
    }
    p = end ? end + 1 : NULL;
  }
  return -1;
}

static void load_once(void) {
  pthread_mutex_lock(&g_dirs_lock);
  g_load_began = 1;
  pthread_mutex_unlock(&g_dirs_lock);
  const char *forced = fdp_param_str(FDP_PARAM_NVRTC_LIBRARY);
  size_t n = sizeof k_sonames / sizeof k_sonames[0];
  int ok = -1;
  if (forced) {
    ok = try_open(forced, RTLD_NOW | RTLD_LOCAL);
    if (ok != 0) {
      const char *e = dlerror();
      if (e) snprintf(g_why, sizeof g_why, "FASTDP_NVRTC_LIBRARY=%s cannot be loaded: %s", forced, e);
      return; /* asked for by name: never silently another one */
    }
  }
  for (size_t i = 0; i < n && ok != 0; i++) /* the copy PyTorch already mapped */
    ok = try_open(k_sonames[i], RTLD_NOW | RTLD_NOLOAD);
  if (ok != 0) ok = try_dirs(g_dirs);
  for (size_t i = 0; i < n && ok != 0; i++)
    ok = try_open(k_sonames[i], RTLD_NOW | RTLD_LOCAL);
  if (ok != 0) {
    if (strcmp(g_why, "NVRTC not loaded") == 0)
      snprintf(g_why, sizeof g_why,
               "NVRTC (libnvrtc.so.13/.12/.11.2) was not found: pip install nvidia-cuda-nvrtc (the package "
               "PyTorch's CUDA wheels use), or name the library with FASTDP_NVRTC_LIBRARY");
    return;
  }
  g_why[0] = '\0';
  g_status = FDP_OK;
}

static const fdp_dl_lib_t k_lib = {
    FDP_PARAM_DISABLE_NVRTC, "NVRTC", "disabled by FASTDP_DISABLE_NVRTC", &g_once, load_once, &g_status, g_why,
};

fdp_result_t fdp__nvrtc_load(const fdp_nvrtc_t **out, const char **why) {
  FDP_CHECK(fdp__dl_ready(&k_lib, why));
  if (out) *out = &g_nv;
  return FDP_OK;
}

/* sm_<cc> when NVRTC knows it; else the newest architecture below it, as PTX; 0 when cc is older than all. */
static int pick_arch(const fdp_nvrtc_t *nv, int cc, int *ptx) {
  int best = 0;
  for (int i = 0; i < nv->narchs; i++) {
    if (nv->archs[i] == cc) {
      *ptx = 0;
      return cc;
    }
    if (nv->archs[i] < cc && nv->archs[i] > best) best = nv->archs[i];
  }
  *ptx = 1;
  return best;
}

static fdp_result_t nvrtc_fail(const fdp_nvrtc_t *nv, nvrtcResult e, const char *what, int arch) {
  const char *s = nv->GetErrorString ? nv->GetErrorString(e) : NULL;
  return fdp__fail(e == NVRTC_ERROR_OUT_OF_MEMORY ? FDP_NOMEM : FDP_INTERNAL, "NVRTC %d.%d: %s for sm_%d: %s (%d)",
                   nv->major, nv->minor, what, arch, s ? s : "?", (int)e);
}

/* The compile log of a failed compilation, in the detail (it names the line that failed). */
static fdp_result_t compile_fail(const fdp_nvrtc_t *nv, nvrtcProgram prog, nvrtcResult e, int arch) {
  size_t n = 0;
  char *log = NULL;
  if (nv->GetProgramLogSize(prog, &n) == NVRTC_SUCCESS && n > 0 && (log = malloc(n + 1)) != NULL &&
      nv->GetProgramLog(prog, log) == NVRTC_SUCCESS) {
    log[n] = '\0';
    fdp_result_t r = fdp__fail(e == NVRTC_ERROR_OUT_OF_MEMORY ? FDP_NOMEM : FDP_INTERNAL,
                               "NVRTC %d.%d cannot compile fastdp's kernels for sm_%d: %.700s", nv->major, nv->minor,
                               arch, log);
    free(log);
    return r;
  }
  free(log);
  return nvrtc_fail(nv, e, "nvrtcCompileProgram", arch);
}

/* Appends the space-separated options of `words` to plan's text and argv. */
static fdp_result_t add_options(fdp_nvrtc_plan_t *plan, const char *words) {
  size_t used = strlen(plan->text);
  int n = snprintf(plan->text + used, sizeof plan->text - used, "%s%s", used ? " " : "", words);
  if (n < 0 || (size_t)n >= sizeof plan->text - used)
    return fdp__fail(FDP_INVALID, "NVRTC options too long: %s", words);
  memcpy(plan->words, plan->text, sizeof plan->words);
  plan->argc = 0;
  for (char *save = NULL, *w = strtok_r(plan->words, " ", &save); w; w = strtok_r(NULL, " ", &save)) {
    if (plan->argc == FDP_NVRTC_MAX_OPTIONS)
      return fdp__fail(FDP_INVALID, "more than %d NVRTC options: %s", FDP_NVRTC_MAX_OPTIONS, plan->text);
    plan->argv[plan->argc++] = w;
  }
  return FDP_OK;
}

fdp_result_t fdp__nvrtc_plan(int cc, const char *extra, fdp_nvrtc_plan_t *plan) {
  const fdp_nvrtc_t *nv;
  FDP_CHECK(fdp__nvrtc_load(&nv, NULL));
  memset(plan, 0, sizeof *plan);
  plan->arch = pick_arch(nv, cc, &plan->ptx);
  if (plan->arch == 0)
    return fdp__fail(FDP_UNAVAILABLE,
                     "NVRTC %d.%d cannot compile for sm_%d (its oldest architecture is sm_%d): install an older "
                     "nvidia-cuda-nvrtc (e.g. nvidia-cuda-nvrtc-cu12) or a fastdp build whose fatbin covers sm_%d",
                     nv->major, nv->minor, cc, nv->archs[0], cc);
  char target[64];
  snprintf(target, sizeof target, "--gpu-architecture=%s_%d --std=c++14", plan->ptx ? "compute" : "sm", plan->arch);
  FDP_CHECK(add_options(plan, target));
  if (extra && *extra) FDP_CHECK(add_options(plan, extra));
  return FDP_OK;
}

fdp_result_t fdp__nvrtc_compile(const char *source, const fdp_nvrtc_plan_t *plan, unsigned char **image,
                                size_t *size) {
  const fdp_nvrtc_t *nv;
  FDP_CHECK(fdp__nvrtc_load(&nv, NULL));
  int arch = plan->arch;
  nvrtcProgram prog = NULL;
  nvrtcResult e = nv->CreateProgram(&prog, source, "fastdp_kernels.cu", 0, NULL, NULL);
  if (e != NVRTC_SUCCESS) return nvrtc_fail(nv, e, "nvrtcCreateProgram", arch);
  fdp_result_t r = FDP_OK;
  size_t n = 0;
  unsigned char *buf = NULL;
  e = nv->CompileProgram(prog, plan->argc, plan->argv);
  if (e != NVRTC_SUCCESS) {
    r = compile_fail(nv, prog, e, arch);
    goto done;
  }
  e = plan->ptx ? nv->GetPTXSize(prog, &n) : nv->GetCUBINSize(prog, &n);
  if (e != NVRTC_SUCCESS || n == 0) {
    r = e != NVRTC_SUCCESS ? nvrtc_fail(nv, e, "reading the image size", arch)
                           : fdp__fail(FDP_INTERNAL, "NVRTC produced an empty image for sm_%d", arch);
    goto done;
  }
  buf = malloc(n + 1);
  if (buf == NULL) {
    r = fdp__fail(FDP_NOMEM, "no host memory for a %zu-byte kernel image", n);
    goto done;
  }
  e = plan->ptx ? nv->GetPTX(prog, (char *)buf) : nv->GetCUBIN(prog, (char *)buf);
  if (e != NVRTC_SUCCESS) {
    r = nvrtc_fail(nv, e, "reading the image", arch);
    free(buf);
    buf = NULL;
    goto done;
  }
  buf[n] = '\0';
  *image = buf;
  *size = n;
done:
  e = nv->DestroyProgram(&prog);
  if (e != NVRTC_SUCCESS) fdp__log("nvrtcDestroyProgram: %d", (int)e);
  return r;
}
