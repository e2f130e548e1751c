/* SPDX-License-Identifier: MIT */
/* The only place that opens libtorch: RTLD_NOLOAD on the copy torch loaded, and dlsym of its C shim's functions
 * (fdp_torch_shim_resolve in fastdp.h, for the binding's shim path). */
#include "base/base.h"

#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

/* The already loaded libtorch_cpu: by soname first, then beside torch's _C module. NULL, with the reason set as the
 * thread's detail, when torch did not load one. */
static void *open_loaded(const char *torch_c_file) {
  void *h = dlopen("libtorch_cpu.so", RTLD_NOLOAD | RTLD_NOW);
  if (!h && torch_c_file) {
    char path[4096];
    const char *slash = strrchr(torch_c_file, '/');
    int len = slash ? (int)(slash - torch_c_file) : 0;
    snprintf(path, sizeof path, "%.*s/lib/libtorch_cpu.so", len, torch_c_file);
    h = dlopen(path, RTLD_NOLOAD | RTLD_NOW);
  }
  if (!h) {
    const char *e = dlerror();
    fdp__fail(FDP_UNAVAILABLE, "libtorch_cpu.so is not loaded in this process (dlopen RTLD_NOLOAD: %s)",
              e ? e : "not found");
  }
  return h;
}

/* The shim function `name`, or NULL when this libtorch lacks it or FASTDP_SHIM_ABSENT lists it. */
static void *find(void *lib, const char *name) {
  const char *absent = fdp_param_str(FDP_PARAM_SHIM_ABSENT);
  size_t n = strlen(name);
  for (const char *p = absent ? strstr(absent, name) : NULL; p != NULL; p = strstr(p + 1, name))
    if ((p == absent || p[-1] == ',') && (p[n] == '\0' || p[n] == ',')) return NULL;
  return dlsym(lib, name);
}

fdp_result_t fdp_torch_shim_resolve(const char *torch_c_file, const char *const *names, int n, void **syms) {
  if (n < 0 || (n > 0 && (names == NULL || syms == NULL)))
    return fdp__fail(FDP_INVALID, "fdp_torch_shim_resolve: %d names, names %p, syms %p", n, (const void *)names,
                     (void *)syms);
  for (int i = 0; i < n; i++)
    syms[i] = NULL;
  void *lib = open_loaded(torch_c_file);
  if (!lib) return FDP_UNAVAILABLE;
  for (int i = 0; i < n; i++)
    syms[i] = names[i] ? find(lib, names[i]) : NULL;
  /* Drops only the reference taken above: torch's own keeps the library and every address found loaded. */
  dlclose(lib);
  return FDP_OK;
}
