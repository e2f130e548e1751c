/* SPDX-License-Identifier: MIT */
/* A stand-in for libnvrtc for the kernel cache suite (core_kernel_cache.c): the entry points fastdp binds, with
 * NVRTC's signatures, where compiling writes down what was asked for (a hash of the source and every option) as
 * the image. So the suite can tell which source, options and target an image it is served was built from, on a
 * machine without NVRTC. Built by tests/c/build.py as a shared library that FASTDP_NVRTC_LIBRARY names. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int nvrtcResult;
typedef struct program {
  unsigned long long source_hash;
  char image[1024];
} program_t;
typedef program_t *nvrtcProgram;

static const int k_archs[] = {75, 80, 86, 89, 90, 100, 120};

nvrtcResult nvrtcVersion(int *major, int *minor) {
  *major = 13;
  *minor = 0;
  return 0;
}

const char *nvrtcGetErrorString(nvrtcResult r) {
  return r == 0 ? "NVRTC_SUCCESS" : "fake NVRTC error";
}

nvrtcResult nvrtcGetNumSupportedArchs(int *n) {
  *n = (int)(sizeof k_archs / sizeof k_archs[0]);
  return 0;
}

nvrtcResult nvrtcGetSupportedArchs(int *archs) {
  memcpy(archs, k_archs, sizeof k_archs);
  return 0;
}

/* FNV-1a, as the suite computes it for the source it passed. */
unsigned long long fake_nvrtc_hash(const char *s) {
  unsigned long long h = 1469598103934665603ull;
  for (; *s; s++)
    h = (h ^ (unsigned char)*s) * 1099511628211ull;
  return h;
}

nvrtcResult nvrtcCreateProgram(nvrtcProgram *prog, const char *src, const char *name, int nheaders,
                               const char *const *headers, const char *const *include_names) {
  (void)name, (void)nheaders, (void)headers, (void)include_names;
  program_t *p = calloc(1, sizeof *p);
  if (p == NULL) return 1;
  p->source_hash = fake_nvrtc_hash(src);
  *prog = p;
  return 0;
}

nvrtcResult nvrtcDestroyProgram(nvrtcProgram *prog) {
  free(*prog);
  *prog = NULL;
  return 0;
}

nvrtcResult nvrtcCompileProgram(nvrtcProgram p, int nopts, const char *const *opts) {
  size_t n = (size_t)snprintf(p->image, sizeof p->image, "fake image: source %016llx options", p->source_hash);
  for (int i = 0; i < nopts && n < sizeof p->image; i++)
    n += (size_t)snprintf(p->image + n, sizeof p->image - n, " %s", opts[i]);
  return 0;
}

nvrtcResult nvrtcGetProgramLogSize(nvrtcProgram p, size_t *size) {
  (void)p;
  *size = 1;
  return 0;
}

nvrtcResult nvrtcGetProgramLog(nvrtcProgram p, char *log) {
  (void)p;
  log[0] = '\0';
  return 0;
}

nvrtcResult nvrtcGetPTXSize(nvrtcProgram p, size_t *size) {
  *size = strlen(p->image) + 1;
  return 0;
}

nvrtcResult nvrtcGetPTX(nvrtcProgram p, char *out) {
  memcpy(out, p->image, strlen(p->image) + 1);
  return 0;
}

nvrtcResult nvrtcGetCUBINSize(nvrtcProgram p, size_t *size) {
  return nvrtcGetPTXSize(p, size);
}

nvrtcResult nvrtcGetCUBIN(nvrtcProgram p, char *out) {
  return nvrtcGetPTX(p, out);
}
