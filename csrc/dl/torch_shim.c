/* SPDX-License-Identifier: MIT */
/* The only place that opens libtorch: RTLD_NOLOAD on the copy torch loaded, and dlsym of its C shim's functions. */
#include "dl/torch_shim.h"

#include "base/base.h"

#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

void *fdp__torch_shim_open(const char *torch_c_file, char *why, size_t why_len) {
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
    snprintf(why, why_len, "libtorch_cpu.so is not loaded in this process (dlopen RTLD_NOLOAD: %s)",
             e ? e : "not found");
  }
  return h;
}

void *fdp__torch_shim_sym(void *lib, const char *name) {
  const char *absent = fdp_param_str(FDP_PARAM_SHIM_ABSENT);
  size_t n = strlen(name);
  for (const char *p = absent ? strstr(absent, name) : NULL; p != NULL; p = strstr(p + 1, name))
    if ((p == absent || p[-1] == ',') && (p[n] == '\0' || p[n] == ',')) return NULL;
  return dlsym(lib, name);
}

void fdp__torch_shim_close(void *lib) {
  if (lib) dlclose(lib);
}
