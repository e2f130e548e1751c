/* A minimal stand-in for libcuda.so.1, for tests/test_kernel_module.py only: one device of compute capability
 * 9.0 whose "device memory" is host memory, copies done at once, kernels never run. cuModuleLoadData returns,
 * call by call, the results listed in FAKE_MODULE_RESULTS (e.g. "2,209"; then success), and counts its calls. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

int fake_module_loads, fake_launches, fake_pushes, fake_pops;
static char ctx_obj, mod_obj, fn_obj;

#define OK 0
#define STUB(name) \
  CUresult name(void) { return OK; }

CUresult cuInit(unsigned f) { (void)f; return OK; }
CUresult cuDriverGetVersion(int *v) { *v = 13000; return OK; }
CUresult cuGetErrorString(CUresult r, const char **s) {
  *s = r == 2 ? "out of memory" : r == 209 ? "no kernel image is available for execution on the device" : "fake error";
  return OK;
}
CUresult cuGetErrorName(CUresult r, const char **s) {
  *s = r == 2 ? "CUDA_ERROR_OUT_OF_MEMORY" : r == 209 ? "CUDA_ERROR_NO_BINARY_FOR_GPU" : "CUDA_ERROR_FAKE";
  return OK;
}
CUresult cuDeviceGetCount(int *n) { *n = 1; return OK; }
CUresult cuDeviceGet(int *d, int i) { *d = i; return OK; }
CUresult cuDeviceGetName(char *n, int len, int d) { (void)d; strncpy(n, "fake", (size_t)len); return OK; }
CUresult cuDeviceTotalMem_v2(size_t *b, int d) { (void)d; *b = 1 << 30; return OK; }
CUresult cuDeviceGetAttribute(int *v, int attr, int d) {
  (void)d;
  *v = attr == 75 ? 9 : attr == 76 ? 0 : attr == 16 ? 4 : 1;
  return OK;
}
CUresult cuDevicePrimaryCtxRetain(void **c, int d) { (void)d; *c = &ctx_obj; return OK; }
CUresult cuDevicePrimaryCtxRelease_v2(int d) { (void)d; return OK; }
CUresult cuDevicePrimaryCtxGetState(int d, unsigned *f, int *a) { (void)d; *f = 0; *a = 1; return OK; }
CUresult cuCtxPushCurrent_v2(void *c) { (void)c; fake_pushes++; return OK; }
CUresult cuCtxPopCurrent_v2(void **c) { *c = &ctx_obj; fake_pops++; return OK; }
CUresult cuMemcpyAsync(CUdeviceptr d, CUdeviceptr s, size_t n, void *st) {
  (void)st;
  memmove((void *)(uintptr_t)d, (const void *)(uintptr_t)s, n);
  return OK;
}
CUresult cuModuleLoadData(void **m, const void *image) {
  const char *spec = getenv("FAKE_MODULE_RESULTS");
  int call = fake_module_loads++;
  (void)image;
  while (spec && *spec && call > 0) {
    spec = strchr(spec, ',');
    spec = spec ? spec + 1 : NULL;
    call--;
  }
  if (spec && *spec) {
    CUresult r = atoi(spec);
    if (r != OK) return r;
  }
  *m = &mod_obj;
  return OK;
}
CUresult cuModuleUnload(void *m) { (void)m; return OK; }
CUresult cuModuleGetFunction(void **f, void *m, const char *n) { (void)m; (void)n; *f = &fn_obj; return OK; }
CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shmem, void *stream, void **params, void **extra) {
  (void)f, (void)gx, (void)gy, (void)gz, (void)bx, (void)by, (void)bz, (void)shmem, (void)stream, (void)params;
  (void)extra;
  fake_launches++;
  return OK;
}
/* NVRTC itself dlopens libcuda.so.1 and asks for its private export tables; refusing them is what a driver without
 * them does (without this symbol NVRTC crashes). */
CUresult cuGetExportTable(const void **table, const void *id) { (void)id; *table = NULL; return 801; }
/* Entry points the loader binds but these tests never reach. */
STUB(cuDeviceCanAccessPeer) STUB(cuCtxGetCurrent) STUB(cuCtxSetCurrent) STUB(cuCtxSynchronize)
STUB(cuCtxEnablePeerAccess) STUB(cuMemGetInfo_v2) STUB(cuMemAlloc_v2) STUB(cuMemFree_v2) STUB(cuMemcpyHtoDAsync_v2)
STUB(cuMemcpyDtoHAsync_v2) STUB(cuStreamSynchronize) STUB(cuStreamQuery) STUB(cuMemcpyPeerAsync)
STUB(cuMemcpy2DAsync_v2) STUB(cuMemcpy3DPeerAsync) STUB(cuEventCreate) STUB(cuEventRecord) STUB(cuEventDestroy_v2)
STUB(cuEventSynchronize) STUB(cuEventQuery) STUB(cuStreamWaitEvent)
