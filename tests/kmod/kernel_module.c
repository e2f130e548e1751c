/* Drives the cuda backend's kernel-module cache on the simulated GPU (tests/sim; SIMGPU_FAIL makes chosen
 * cuModuleLoadData calls fail): which failures stick, which are retried, and that copies never depend on kernels.
 * One scenario per process (argv[1]); exit status 0 = pass. */
#include "fastdp.h"

#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures;
static unsigned long long a, b, out; /* 64 floats each, device 0's memory in the simulator */

#define EXPECT(cond, ...)                                                                                              \
  do {                                                                                                                 \
    if (!(cond)) {                                                                                                     \
      failures++;                                                                                                      \
      printf("FAIL %s:%d: ", __FILE__, __LINE__);                                                                      \
      printf(__VA_ARGS__);                                                                                             \
      printf("\n");                                                                                                    \
    }                                                                                                                  \
  } while (0)

/* The simulator's controls, from the driver fastdp loaded (FASTDP_CUDA_DRIVER_LIBRARY). */
static void *sim_symbol(const char *name) {
  void *h = dlopen(getenv("FASTDP_CUDA_DRIVER_LIBRARY"), RTLD_NOW | RTLD_NOLOAD);
  void *p = h ? dlsym(h, name) : NULL;
  if (!p) {
    printf("the simulated GPU has no %s\n", name);
    exit(3);
  }
  return p;
}

/* How many times the code under test called `entry` (cuModuleLoadData, cuLaunchKernel). */
static int counter(const char *entry) {
  long long (*calls)(const char *) = (long long (*)(const char *))sim_symbol("simgpu_calls");
  return (int)calls(entry);
}

static fdp_tensor_t dev_tensor(unsigned long long p, int rows, int cols, int transposed) {
  fdp_tensor_t t;
  memset(&t, 0, sizeof t);
  t.data = (char *)(uintptr_t)p;
  t.device = 0;
  t.dtype = FDP_DTYPE_F32;
  t.elem_size = 4;
  t.ndim = 2;
  t.sizes[0] = rows;
  t.sizes[1] = cols;
  t.strides[0] = transposed ? 1 : cols;
  t.strides[1] = transposed ? rows : 1;
  return t;
}

static fdp_result_t flat_copy(void) {
  fdp_tensor_t s = dev_tensor(a, 8, 8, 0), d = dev_tensor(b, 8, 8, 0);
  return fdp_op_copy(&d, &s, 1, NULL);
}

static fdp_result_t strided_copy(void) {
  fdp_tensor_t s = dev_tensor(a, 8, 8, 1), d = dev_tensor(b, 8, 8, 0);
  return fdp_op_copy(&d, &s, 1, NULL);
}

static fdp_result_t sum(void) {
  fdp_tensor_t in[2] = {dev_tensor(a, 8, 8, 0), dev_tensor(b, 8, 8, 0)};
  fdp_tensor_t o = dev_tensor(out, 8, 8, 0);
  return fdp_op_reduce(in, 2, &o, NULL);
}

/* Where device `d`'s kernels came from, as `python -m fastdp info` reads it. */
static const char *source(int d) {
  fdp_device_facts_t f;
  fdp_device_facts(d, FDP_FREE_NEVER, &f);
  return f.kernels_source;
}

static int has(const char *text) {
  return strstr(fdp_last_error(), text) != NULL;
}

/* cuModuleLoadData fails with out-of-memory once: reported as a CUDA error, retried by the next call. */
static void transient(void) {
  EXPECT(flat_copy() == FDP_OK, "flat copy: %s", fdp_last_error());
  EXPECT(counter("cuModuleLoadData") == 0, "a flat copy loaded the kernels");
  EXPECT(sum() == FDP_CUDA && has("out of memory"), "first sum: %s", fdp_last_error());
  EXPECT(flat_copy() == FDP_OK, "copy after a failed kernel load: %s", fdp_last_error());
  EXPECT(sum() == FDP_OK, "second sum: %s", fdp_last_error());
  EXPECT(counter("cuModuleLoadData") == 2 && counter("cuLaunchKernel") == 1, "loads %d launches %d",
         counter("cuModuleLoadData"), counter("cuLaunchKernel"));
  EXPECT(strstr(source(0), "NVRTC") != NULL, "source: %s", source(0));
}

/* Every image is refused: unavailable, remembered (not retried) until shutdown; copies unaffected. */
static void sticky(void) {
  EXPECT(sum() == FDP_UNAVAILABLE && has("no fastdp kernels load on device 0"), "first sum: %s", fdp_last_error());
  EXPECT(sum() == FDP_UNAVAILABLE, "second sum: %s", fdp_last_error());
  EXPECT(counter("cuModuleLoadData") == 1, "refused image retried: %d loads", counter("cuModuleLoadData"));
  EXPECT(flat_copy() == FDP_OK, "flat copy: %s", fdp_last_error());
  EXPECT(strided_copy() == FDP_UNAVAILABLE && has("strided-copy kernel"), "strided copy: %s", fdp_last_error());
  EXPECT(strstr(source(0), "no fastdp kernels") != NULL, "source: %s", source(0));
  fdp_shutdown();
  /* Shutdown forgets the verdict: the next call loads again (only the first load was made to fail). */
  EXPECT(sum() == FDP_OK && counter("cuModuleLoadData") == 2, "after shutdown: %s, %d loads", fdp_last_error(),
         counter("cuModuleLoadData"));
}

/* No fatbin and NVRTC disabled: unavailable, never sticky, no load attempted; copies unaffected. */
static void no_kernels(void) {
  EXPECT(sum() == FDP_UNAVAILABLE && has("FASTDP_DISABLE_NVRTC"), "sum: %s", fdp_last_error());
  EXPECT(counter("cuModuleLoadData") == 0, "loads %d", counter("cuModuleLoadData"));
  EXPECT(flat_copy() == FDP_OK, "flat copy: %s", fdp_last_error());
  EXPECT(strided_copy() == FDP_UNAVAILABLE && has("strided-copy kernel"), "strided copy: %s", fdp_last_error());
}

/* With a fatbin: refused (image error) → NVRTC; out of memory → reported, no NVRTC, retried; else used. */
static void fatbin_refused(void) {
  EXPECT(sum() == FDP_OK, "sum: %s", fdp_last_error());
  EXPECT(counter("cuModuleLoadData") == 2, "loads %d", counter("cuModuleLoadData"));
  EXPECT(strstr(source(0), "NVRTC") != NULL, "source: %s", source(0));
}

static void fatbin_transient(void) {
  EXPECT(sum() == FDP_CUDA && has("out of memory"), "first sum: %s", fdp_last_error());
  EXPECT(counter("cuModuleLoadData") == 1, "loads %d", counter("cuModuleLoadData"));
  EXPECT(sum() == FDP_OK, "second sum: %s", fdp_last_error());
  EXPECT(strstr(source(0), "fatbin") == source(0), "source: %s",
         source(0));
}

int main(int argc, char **argv) {
  static const struct {
    const char *name;
    void (*run)(void);
  } scenarios[] = {{"transient", transient},     {"sticky", sticky},
                   {"no_kernels", no_kernels},   {"fatbin_refused", fatbin_refused},
                   {"fatbin_transient", fatbin_transient}};
  const char *dirs = getenv("NVRTC_DIRS");
  if (dirs && fdp_nvrtc_search_dirs(dirs) != FDP_OK) return 3;
  /* Loading the driver (fastdp's first look at the devices) maps the simulator; device 0's primary context is
   * retained here, as PyTorch holds it, so that the tensors' memory can be made in it. */
  if (!fdp_backend_usable(FDP_BACKEND_CUDA, NULL)) return 3;
  void *ctx = NULL;
  int (*retain)(void **, int) = (int (*)(void **, int))sim_symbol("cuDevicePrimaryCtxRetain");
  if (retain(&ctx, 0) != 0) return 3;
  unsigned long long (*alloc)(int, size_t) = (unsigned long long (*)(int, size_t))sim_symbol("simgpu_alloc");
  a = alloc(0, 64 * sizeof(float));
  b = alloc(0, 64 * sizeof(float));
  out = alloc(0, 64 * sizeof(float));
  for (size_t i = 0; argc > 1 && i < sizeof scenarios / sizeof scenarios[0]; i++) {
    if (strcmp(argv[1], scenarios[i].name) != 0) continue;
    scenarios[i].run();
    char misuse[4096] = "";
    long long (*errors)(char *, size_t) = (long long (*)(char *, size_t))sim_symbol("simgpu_errors");
    EXPECT(errors(misuse, sizeof misuse) == 0, "the simulated GPU recorded misuse: %s", misuse);
    printf("%s: %s\n", argv[1], failures ? "FAILED" : "ok");
    return failures ? 1 : 0;
  }
  printf("unknown scenario\n");
  return 2;
}
