/* SPDX-License-Identifier: MIT */
/* The cuda backend's scratch memory: staging buffers for strided copies and partial sums of long reductions, held
 * only for the call that needs them, from the allocator the binding registers (PyTorch's) or the driver's pool. */
#include "backend/cuda/scratch.h"

#include <pthread.h>
#include <stdint.h>
#include <string.h>

/* NOTE [scratch memory]: staging buffers and partial sums come from the allocator registered with
 * fdp_set_device_allocator (the binding registers PyTorch's caching allocator, so that this memory shows in
 * torch.cuda.memory_* and an allocation that does not fit frees PyTorch's cached blocks and retries) or, with none
 * registered (the C test program, other embedders, a PyTorch without CUDA), from the driver's stream-ordered pool,
 * retried once after a device synchronisation when it is out of memory. Either way a buffer is
 * allocated and freed on one stream, stream-ordered; every use on another stream is fenced back to that stream
 * before the free. Both calls are made with the buffer's device context current (pushed by the caller), so that
 * each buffer lives inside the push that uses it and a failed push can never strand one. */

static pthread_mutex_t g_alloc_lock = PTHREAD_MUTEX_INITIALIZER;
static fdp_allocator_t g_alloc;

void fdp_set_device_allocator(const fdp_allocator_t *allocator) {
  pthread_mutex_lock(&g_alloc_lock);
  if (allocator != NULL && allocator->alloc != NULL && allocator->free != NULL)
    g_alloc = *allocator;
  else
    memset(&g_alloc, 0, sizeof g_alloc);
  pthread_mutex_unlock(&g_alloc_lock);
}

_Static_assert(FDP_CUDA_OUT_OF_MEMORY == CUDA_ERROR_OUT_OF_MEMORY, "fastdp.h's copy of CUDA_ERROR_OUT_OF_MEMORY");

fdp_result_t fdp__cuda_scratch_alloc(const fdp_cu_t *cu, int dev, CUstream stream, size_t bytes, const char *what,
                                     fdp_cuda_scratch_t *s) {
  memset(s, 0, sizeof *s);
  s->dev = dev;
  s->stream = stream;
  pthread_mutex_lock(&g_alloc_lock);
  s->via = g_alloc;
  pthread_mutex_unlock(&g_alloc_lock);
  if (s->via.alloc != NULL) {
    char err[256] = "";
    void *ptr = NULL, *handle = NULL;
    int rc = s->via.alloc(s->via.ctx, dev, bytes, (void *)stream, &ptr, &handle, err, sizeof err);
    if (rc != 0) {
      err[sizeof err - 1] = '\0';
      return fdp__fail_status(FDP_CUDA, rc == FDP_ALLOC_OUT_OF_MEMORY ? CUDA_ERROR_OUT_OF_MEMORY : 0,
                              "cuda backend: %s: %zu bytes on device %d could not be allocated: %s", what, bytes, dev,
                              err[0] ? err : "the registered allocator failed");
    }
    s->ptr = (CUdeviceptr)(uintptr_t)ptr;
    s->handle = handle;
    s->hooked = 1;
    return FDP_OK;
  }
  if (cu->MemAllocAsync == NULL || cu->MemFreeAsync == NULL)
    return fdp__fail(FDP_UNAVAILABLE, "cuda backend: %s on device %d needs cuMemAllocAsync (CUDA driver 11.2 or newer)",
                     what, dev);
  CUresult e = cu->MemAllocAsync(&s->ptr, bytes, stream);
  if (e == CUDA_ERROR_OUT_OF_MEMORY) {
    /* Stream-ordered frees (ours and anyone's) complete, and the pool gives back what it caches, at a
     * synchronisation: wait for the device once, then try again. */
    CUresult es = cu->CtxSynchronize();
    if (es == CUDA_SUCCESS)
      e = cu->MemAllocAsync(&s->ptr, bytes, stream);
    else
      fdp__log("cuda scratch: cuCtxSynchronize before retrying an allocation failed (CUresult %d)", (int)es);
  }
  if (e != CUDA_SUCCESS) s->ptr = 0;
  return fdp__cu_check(e, "cuMemAllocAsync (scratch)", dev);
}

fdp_result_t fdp__cuda_scratch_free(const fdp_cu_t *cu, fdp_cuda_scratch_t *s) {
  fdp_result_t r = FDP_OK;
  if (s->ptr != 0 && s->hooked)
    s->via.free(s->via.ctx, s->dev, (void *)s->stream, s->handle);
  else if (s->ptr != 0) {
    CUresult e = cu->MemFreeAsync(s->ptr, s->stream);
    r = fdp__cu_check(e, "cuMemFreeAsync (scratch)", s->dev);
    if (e != CUDA_SUCCESS) {
      /* cuMemFree takes pool memory too, but (as documented) without waiting for its users: wait first. The
       * failure is still reported. */
      CUresult es = cu->StreamSynchronize(s->stream);
      if (es == CUDA_SUCCESS) es = cu->MemFree(s->ptr);
      if (es != CUDA_SUCCESS) fdp__log("cuda scratch: a buffer on device %d is leaked (CUresult %d)", s->dev, (int)es);
    }
  }
  s->ptr = 0;
  s->handle = NULL;
  return r;
}
