/* One-rank self-test of fastdp's nccl backend through the real driver and NCCL, for scripts/gpu_check.sh:
 * fastdp's own loaders bind libcuda.so.1 and libnccl.so.2, then the backend's reduce and broadcast run on a
 * communicator of one rank (device 0) -- a path fastdp's ops never take, since they use NCCL only across
 * distinct devices. Results are read back and compared byte for byte with what a one-rank sum and an in-place
 * broadcast must give; what NCCL cannot do exactly its `can` must refuse (NOTE [routing]); after fdp_shutdown a second
 * round proves the communicators are rebuilt. Prints one line per check; exits 0 when all pass. */
#include "core/backend.h"
#include "dl/cuda_driver.h"
#include "dl/nccl_api.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int g_failures;

static void check(int ok, const char *what) {
  printf("%-60s %s\n", what, ok ? "ok" : "FAILED");
  if (!ok) {
    printf("  last error: %s\n", fdp_last_error());
    g_failures++;
  }
}

static int cu_ok(CUresult r, const char *op) {
  if (r == CUDA_SUCCESS) return 1;
  printf("%s failed: CUresult %d\n", op, (int)r);
  g_failures++;
  return 0;
}

static fdp_tensor_t vec(CUdeviceptr p, int dtype, int elem_size, int64_t n) {
  fdp_tensor_t t;
  memset(&t, 0, sizeof t);
  t.data = (char *)(uintptr_t)p;
  t.device = 0;
  t.dtype = dtype;
  t.elem_size = elem_size;
  t.ndim = 1;
  t.sizes[0] = n;
  t.strides[0] = 1;
  return t;
}

/* Reduce (one rank: out = in; when `reduce`) and in-place broadcast of n elements of one dtype on device 0. */
static void round_trip(const fdp_cu_t *cu, int dtype, int elem_size, int64_t n, int reduce, const char *tag) {
  size_t bytes = (size_t)n * (size_t)elem_size;
  unsigned char *pattern = malloc(bytes), *back = malloc(bytes), *zeros = calloc(1, bytes);
  CUdeviceptr in = 0, out = 0;
  char what[128];
  if (!pattern || !back || !zeros) {
    check(0, "host buffers");
    goto free_host;
  }
  for (size_t i = 0; i < bytes; i++) /* no NaN/inf bit patterns matter: the checks compare bytes */
    pattern[i] = (unsigned char)((i * 131u + 7u) >> 1);
  if (fdp__cu_ctx_push(0, NULL) != FDP_OK) {
    check(0, "push the primary context of device 0");
    goto free_host;
  }
  if (!cu_ok(cu->MemAlloc(&in, bytes), "cuMemAlloc") || !cu_ok(cu->MemAlloc(&out, bytes), "cuMemAlloc")) goto pop;
  if (!cu_ok(cu->MemcpyHtoDAsync(in, pattern, bytes, NULL), "cuMemcpyHtoDAsync") ||
      !cu_ok(cu->MemcpyHtoDAsync(out, zeros, bytes, NULL), "cuMemcpyHtoDAsync"))
    goto pop;
  fdp_tensor_t tin = vec(in, dtype, elem_size, n), tout = vec(out, dtype, elem_size, n);

  fdp_result_t r;
  if (reduce) {
    r = fdp__backend_nccl.reduce(&tin, 1, &tout, NULL);
    snprintf(what, sizeof what, "%s: ncclReduce, one rank, %s x %lld", tag, fdp_dtype_name(dtype), (long long)n);
    if (r == FDP_OK && cu_ok(cu->CtxSynchronize(), "cuCtxSynchronize") &&
        cu_ok(cu->MemcpyDtoHAsync(back, out, bytes, NULL), "cuMemcpyDtoHAsync") &&
        cu_ok(cu->CtxSynchronize(), "cuCtxSynchronize"))
      check(memcmp(back, pattern, bytes) == 0, what);
    else
      check(0, what);
  }

  r = fdp__backend_nccl.broadcast(&tin, NULL, 0, NULL);
  snprintf(what, sizeof what, "%s: ncclBroadcast in place, one rank, %s x %lld", tag, fdp_dtype_name(dtype),
           (long long)n);
  if (r == FDP_OK && cu_ok(cu->CtxSynchronize(), "cuCtxSynchronize") &&
      cu_ok(cu->MemcpyDtoHAsync(back, in, bytes, NULL), "cuMemcpyDtoHAsync") &&
      cu_ok(cu->CtxSynchronize(), "cuCtxSynchronize"))
    check(memcmp(back, pattern, bytes) == 0, what);
  else
    check(0, what);
pop:
  if (in) cu_ok(cu->MemFree(in), "cuMemFree");
  if (out) cu_ok(cu->MemFree(out), "cuMemFree");
  if (fdp__cu_ctx_pop(0) != FDP_OK) check(0, "pop the context of device 0");
free_host:
  free(pattern);
  free(back);
  free(zeros);
}

/* Sums NCCL cannot do exactly are refused by the backend's `can`, so that the core never routes them there; a
 * float32 sum of the same layout is accepted. Descriptors only (two inputs on devices 0 and 1, output on 0): `can`
 * reads no memory. */
static void refuses(int dtype, int elem_size, const char *why) {
  char what[128];
  fdp_tensor_t in0 = vec(64, dtype, elem_size, 16), in1 = vec(128, dtype, elem_size, 16),
               out = vec(192, dtype, elem_size, 16);
  in1.device = 1;
  const fdp_tensor_t *ts[3] = {&in0, &in1, &out};
  snprintf(what, sizeof what, "reduce of %s refused (%s)", fdp_dtype_name(dtype), why);
  check(!fdp__backend_nccl.can(FDP_OP_REDUCE, ts, 3), what);
  in0.dtype = in1.dtype = out.dtype = FDP_DTYPE_F32;
  in0.elem_size = in1.elem_size = out.elem_size = 4;
  snprintf(what, sizeof what, "reduce of float32, same layout, accepted");
  check(fdp__backend_nccl.can(FDP_OP_REDUCE, ts, 3), what);
}

int main(void) {
  const fdp_cu_t *cu = NULL;
  const fdp_nccl_api_t *nccl = NULL;
  const char *why = NULL;
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (fdp__cu_load(&cu, &why) != FDP_OK) {
    printf("the CUDA driver does not load: %s\n", why ? why : fdp_last_error());
    return 2;
  }
  if (fdp__nccl_load(&nccl, &why) != FDP_OK) {
    printf("NCCL does not load: %s\n", why ? why : fdp_last_error());
    return 2;
  }
  fdp_library_facts_t driver;
  fdp_library_facts(FDP_BACKEND_CUDA, &driver);
  printf("driver %d, %d device(s); NCCL %d from %s\n", driver.version, driver.devices, nccl->version, nccl->path);
  check(fdp_backend_usable(FDP_BACKEND_NCCL, &why), "nccl backend usable");
  if (fdp__cu_device_count() < 1) return 2;

  round_trip(cu, FDP_DTYPE_F32, 4, (1 << 20) + 3, 1, "round 1");
  round_trip(cu, FDP_DTYPE_F16, 2, 4097, 1, "round 1");
  if (nccl->version >= 21000) round_trip(cu, FDP_DTYPE_BF16, 2, 4097, 1, "round 1");
  round_trip(cu, FDP_DTYPE_I64, 8, 1001, 1, "round 1");
  round_trip(cu, FDP_DTYPE_U8, 1, 1001, 1, "round 1");
  round_trip(cu, FDP_DTYPE_I16, 2, 999, 0, "round 1"); /* a broadcast moves bytes: int16 travels as uint8 */
  refuses(FDP_DTYPE_BOOL, 1, "a bool sum is a logical or");
  refuses(FDP_DTYPE_I16, 2, "NCCL has no int16");

  fdp_shutdown(); /* destroys the communicator; the next call builds a new one */
  round_trip(cu, FDP_DTYPE_F32, 4, 12345, 1, "after fdp_shutdown");
  fdp_shutdown();

  printf("nccl self-test: %s (%d failure%s)\n", g_failures ? "FAILED" : "ok", g_failures, g_failures == 1 ? "" : "s");
  return g_failures ? 1 : 0;
}
