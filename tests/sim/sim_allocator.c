/* A caching allocator as PyTorch's, for the core's registered-allocator route (fdp_set_device_allocator).
 * What matters of PyTorch's CUDA caching allocator: a block belongs to the stream current when it was allocated; given
 * back, it is handed out again at once to the next request on that same stream (stream order makes that safe for
 * work on that stream only), and never to another stream. Blocks here are whole simulated allocations, rounded up to
 * 512 bytes as PyTorch rounds, reused best fit. So the hazards of the route become checks: a block used after it was
 * given back is a misuse (it is poisoned while the allocator holds it); a block used on a second stream without
 * ordering races with its next owner, whose work on the first stream is not ordered after that use (the shadow
 * memory keeps every byte's last accesses across owners); an access past the size asked for is an overrun. The
 * signatures are fdp_allocator_t's (csrc/fastdp.h): alloc and free run with `device`'s primary context current. */

#include "sim_driver.h"

#include <stdio.h>

static sim_stream_t *cache_stream(int device, void *stream, const char *op) {
  sim_ctx_t *c = sim_current();
  if (c == NULL || !c->alive || c != sim_primary(device)) {
    sim_misuse("%s: device %d's primary context is not current", op, device);
    return NULL;
  }
  CUresult err;
  return sim_resolve_stream((CUstream)stream, c, op, &err);
}

/* The next request on the block's stream may use it at once, from any thread: so every use so far, on any stream,
 * must be ordered before this point of that stream (a write of the whole block there, as cuMemFreeAsync's). */
static void cache_give_back(sim_alloc_t *a) {
  sim_op_t op;
  sim_op_begin(&op, a->cache_stream, "the caching allocator's free", a->dev);
  op.any_peer = 1;
  a->asked = a->size;
  sim_access(&op, a->base, a->size, 1);
  a->cached = 1;
}

int simgpu_cache_alloc(void *ctx, int device, size_t bytes, void *stream, void **ptr, void **handle, char *err,
                       size_t err_len) {
  (void)ctx;
  sim_lock();
  int inj = sim_enter(SIM_E_simgpu_cache_alloc);
  if (inj) {
    const char *name = "?";
    cuGetErrorName((CUresult)inj, &name);
    snprintf(err, err_len, "injected failure %s", name);
    sim_unlock();
    return inj == CUDA_ERROR_OUT_OF_MEMORY ? 2 : 1;
  }
  sim_stream_t *s = device >= 0 && device < g_ndev ? cache_stream(device, stream, "simgpu_cache_alloc") : NULL;
  if (s == NULL) {
    snprintf(err, err_len, "no usable stream or context for device %d", device);
    sim_unlock();
    return 1;
  }
  size_t want = bytes ? (bytes + 511) & ~(size_t)511 : 512;
  device_t *D = &g_dev[device];
  sim_alloc_t *best = NULL;
  for (size_t i = 0; i < D->nallocs; i++) {
    sim_alloc_t *a = D->allocs[i];
    if (a->cached && a->cache_stream == s && a->size >= want && (best == NULL || a->size < best->size)) best = a;
  }
  if (best != NULL) {
    /* A real caching allocator hands the block out with whatever its last user left, which may well look like a
     * right answer (zeros, last step's values): poisoned again, it cannot. */
    best->cached = 0;
    sim_poison(best);
    g_cache_reuses++;
  } else {
    CUdeviceptr p;
    CUresult e = sim_alloc_new(device, want, 0, &p);
    if (e != CUDA_SUCCESS) {
      snprintf(err, err_len, "CUDA out of memory: %zu bytes on simulated device %d", want, device);
      sim_unlock();
      return e == CUDA_ERROR_OUT_OF_MEMORY ? 2 : 1;
    }
    best = D->allocs[D->nallocs - 1];
    best->cache_owned = 1;
    best->cache_stream = s;
  }
  best->asked = bytes;
  *ptr = (void *)(uintptr_t)best->base;
  *handle = best;
  sim_unlock();
  return 0;
}

void simgpu_cache_free(void *ctx, int device, void *stream, void *handle) {
  (void)ctx;
  sim_lock();
  sim_setup();
  sim_alloc_t *a = NULL;
  for (int d = 0; d < g_ndev && a == NULL; d++)
    for (size_t i = 0; i < g_dev[d].nallocs; i++)
      if (g_dev[d].allocs[i] == handle) a = handle;
  if (a == NULL || !a->cache_owned || a->freed || a->cached) {
    sim_misuse("simgpu_cache_free: %p is not a block the caching allocator handed out (given back twice?)", handle);
  } else if (a->dev != device) {
    sim_misuse("simgpu_cache_free: a block of device %d given back as device %d's", a->dev, device);
  } else {
    sim_stream_t *s = cache_stream(device, stream, "simgpu_cache_free");
    if (s != NULL && s != a->cache_stream)
      sim_misuse("simgpu_cache_free: a block of stream %d given back on stream %d (a block belongs to the stream it "
                 "was allocated on)", a->cache_stream->agent, s->agent);
    cache_give_back(a);
  }
  sim_unlock();
}

/* As a harness's own stream-ordered free, for a handle held in Python (the block's own stream, whatever is current:
 * PyTorch gives a dying tensor's block back to the stream it was allocated on). */
void simgpu_cache_release(void *handle) {
  sim_lock();
  sim_alloc_t *a = handle;
  if (a != NULL && a->cache_owned && !a->freed && !a->cached)
    cache_give_back(a);
  else
    sim_misuse("simgpu_cache_release: %p is not a block in use", handle);
  sim_unlock();
}

/* Frees every block the caching allocator holds as free (torch.cuda.empty_cache); returns how many. */
int simgpu_cache_trim(void) {
  sim_lock();
  sim_setup();
  int n = 0;
  for (int d = 0; d < g_ndev; d++)
    for (size_t i = 0; i < g_dev[d].nallocs; i++) {
      sim_alloc_t *a = g_dev[d].allocs[i];
      if (a->cache_owned && a->cached && !a->freed) {
        a->cached = 0;
        sim_alloc_free(a);
        n++;
      }
    }
  sim_unlock();
  return n;
}
