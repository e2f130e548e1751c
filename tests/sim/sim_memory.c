/* Device memory on the simulated driver: each device's fake address range, allocations backed by host pages that
 * end at a guard page, the check of every device access (live memory, of a device the operation may reach, inside
 * its block), and the per-byte shadow memory that keeps each byte's last write and read and reports an access not
 * ordered after a conflicting one (sim_stream.c's clocks) as a race. With the entry points that allocate and free
 * device memory. */

#include "sim_driver.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define GAP 256
#define PAGE 4096
/* Allocations from this size on are poisoned only in their first and last POISON_EDGE bytes (filling them whole
 * would cost real memory): the rest starts zeroed. */
#define HUGE_BYTES (256u << 20)
#define POISON_EDGE (1u << 20)

sim_alloc_t *sim_find_alloc(CUdeviceptr p, int *dev) {
  for (int d = 0; d < g_ndev; d++) {
    device_t *D = &g_dev[d];
    if (p < D->lo || p >= D->hi) continue;
    *dev = d;
    size_t lo = 0, hi = D->nallocs;
    while (lo < hi) { /* last allocation with base <= p */
      size_t mid = (lo + hi) / 2;
      if (D->allocs[mid]->base <= p)
        lo = mid + 1;
      else
        hi = mid;
    }
    return lo ? D->allocs[lo - 1] : NULL;
  }
  *dev = -1;
  return NULL;
}

int sim_in_device_range(const void *host) {
  uintptr_t p = (uintptr_t)host;
  for (int d = 0; d < g_ndev; d++)
    if (p >= g_dev[d].lo && p < g_dev[d].hi) return 1;
  return 0;
}

int sim_ptr_device(CUdeviceptr p) {
  int dev;
  sim_find_alloc(p, &dev);
  return dev;
}

static const char *stream_name(const sim_stream_t *s, char *buf, size_t len) {
  if (s->legacy)
    snprintf(buf, len, "the legacy stream of device %d", s->dev);
  else
    snprintf(buf, len, "stream %d of device %d", s->agent, s->dev);
  return buf;
}

unsigned char *sim_check_range(sim_op_t *op, CUdeviceptr p, size_t n) {
  int dev;
  sim_alloc_t *a = sim_find_alloc(p, &dev);
  if (dev < 0) {
    sim_misuse("%s: 0x%llx is not device memory (a host pointer?)", op->name, (unsigned long long)p);
    return NULL;
  }
  if (a == NULL || p >= a->base + (a->size ? a->size : 1) + GAP / 2 || (a->freed && p < a->base)) {
    sim_misuse("%s: 0x%llx on device %d is outside every allocation", op->name, (unsigned long long)p, dev);
    return NULL;
  }
  if (a->freed) {
    sim_misuse("%s: 0x%llx is in freed memory of device %d (%zu-byte allocation)", op->name, (unsigned long long)p,
               dev, a->size);
    return NULL;
  }
  if (a->cached) {
    sim_misuse("%s: 0x%llx is in a %zu-byte block that the caching allocator holds as free on device %d (used after "
               "it was given back)", op->name, (unsigned long long)p, a->size, dev);
    return NULL;
  }
  size_t usable = a->cache_owned ? a->asked : a->size;
  if (p + n > a->base + usable) {
    sim_misuse("%s: [0x%llx, +%zu) runs past the end of its %zu-byte allocation on device %d", op->name,
               (unsigned long long)p, n, usable, dev);
    return NULL;
  }
  if (dev != op->dev && !op->any_peer) {
    sim_ctx_t *c = op->stream ? op->stream->ctx : NULL;
    if (c == NULL || !c->peer[dev]) {
      sim_misuse("%s on device %d touches memory of device %d without peer access", op->name, op->dev, dev);
      return NULL;
    }
  }
  return a->mem + (p - a->base);
}

static void race(sim_op_t *op, sim_alloc_t *a, size_t off, uint32_t prev, int write, int prev_write) {
  if (op->raced) return;
  op->raced = 1;
  g_nraces++;
  char b1[64], b2[64] = "?";
  int agent = (int)(prev >> 22);
  for (size_t i = 0; i < g_nobjs; i++) {
    sim_stream_t *s = g_objs[i];
    if (s->magic == MAGIC_STREAM && s->agent == agent) {
      stream_name(s, b2, sizeof b2);
      break;
    }
  }
  sim_misuse("race: %s on %s %s byte %zu of a %zu-byte allocation on device %d, which %s %s (op %u) %s without "
             "ordering (event, stream or host synchronisation)",
             op->name, stream_name(op->stream, b1, sizeof b1), write ? "writes" : "reads", off, a->size, a->dev, b2,
             prev_write ? "wrote" : "read", prev & 0x3fffff, "earlier");
}

static void shadow(sim_op_t *op, sim_alloc_t *a, size_t off, size_t n, int write) {
  if (!g_check_races || op->stream == NULL) return;
  const uint32_t *vc = op->stream->vc;
  uint32_t me = ((uint32_t)op->stream->agent << 22) | (op->stream->vc[op->stream->agent] & 0x3fffff);
  for (size_t i = off; i < off + n; i++) {
    uint32_t w = a->w[i];
    if (w && (w >> 22) != (me >> 22) && (w & 0x3fffff) > vc[w >> 22]) race(op, a, i, w, write, 1);
    if (write) {
      uint32_t r = a->r[i];
      if (r && (r >> 22) != (me >> 22) && (r & 0x3fffff) > vc[r >> 22]) race(op, a, i, r, 1, 0);
      a->w[i] = me;
      a->r[i] = 0;
    } else {
      a->r[i] = me;
    }
  }
}

unsigned char *sim_access(sim_op_t *op, CUdeviceptr p, size_t n, int write) {
  unsigned char *h = sim_check_range(op, p, n);
  if (h == NULL) return NULL;
  int dev;
  sim_alloc_t *a = sim_find_alloc(p, &dev);
  shadow(op, a, (size_t)(p - a->base), n, write);
  return h;
}

/* Device bytes live in host pages followed by an inaccessible guard page. The block ends where the guard begins,
 * less the rounding that keeps its start aligned as device memory is (256 bytes); those few bytes hold a canary.
 * So a kernel that strays past its memory faults at once, or leaves the canary changed (sim_mem_overrun). */
static unsigned char *mem_new(size_t bytes, void **map, size_t *maplen) {
  size_t span = (bytes + DEVICE_ALIGN - 1) & ~(size_t)(DEVICE_ALIGN - 1);
  size_t pages = (span + PAGE - 1) & ~(size_t)(PAGE - 1);
  *maplen = pages + PAGE;
  unsigned char *m = mmap(NULL, *maplen, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return NULL;
  if (mprotect(m + pages, PAGE, PROT_NONE) != 0) {
    munmap(m, *maplen);
    return NULL;
  }
  *map = m;
  unsigned char *mem = m + pages - span;
  memset(mem + bytes, CANARY, span - bytes);
  return mem;
}

void sim_poison(sim_alloc_t *a) {
  if (a->size < HUGE_BYTES) {
    memset(a->mem, POISON, a->size);
    return;
  }
  memset(a->mem, POISON, POISON_EDGE);
  memset(a->mem + a->size - POISON_EDGE, POISON, POISON_EDGE);
}

/* Whether anything wrote past the end of allocation `a` (into its canary). */
int sim_mem_overrun(const sim_alloc_t *a) {
  size_t span = (a->size + DEVICE_ALIGN - 1) & ~(size_t)(DEVICE_ALIGN - 1);
  for (size_t i = a->size; i < span; i++)
    if (a->mem[i] != CANARY) return 1;
  return 0;
}

/* Zeroed per-byte shadow arrays; big ones straight from the kernel, so that untouched parts cost nothing. */
static uint32_t *shadow_new(size_t n) {
  if (n * sizeof(uint32_t) < (1u << 20)) return calloc(n, sizeof(uint32_t));
  void *p = mmap(NULL, n * sizeof(uint32_t), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  return p == MAP_FAILED ? NULL : p;
}

static void shadow_free(uint32_t *p, size_t n) {
  if (p == NULL) return;
  if (n * sizeof(uint32_t) < (1u << 20))
    free(p);
  else
    munmap(p, n * sizeof(uint32_t));
}

void sim_alloc_free(sim_alloc_t *a) {
  a->freed = 1;
  g_dev[a->dev].used -= a->size;
  if (a->map) munmap(a->map, a->maplen);
  shadow_free(a->w, a->size);
  shadow_free(a->r, a->size);
  a->mem = NULL;
  a->map = NULL;
  a->w = a->r = NULL;
  g_live_allocs--;
}

CUresult sim_alloc_new(int dev, size_t bytes, int async, CUdeviceptr *out) {
  device_t *D = &g_dev[dev];
  if (bytes == 0) return CUDA_ERROR_INVALID_VALUE;
  if (D->used + bytes > g_mem_total || D->next + bytes + GAP > D->hi) return CUDA_ERROR_OUT_OF_MEMORY;
  sim_alloc_t *a = calloc(1, sizeof *a);
  if (!a) return CUDA_ERROR_OUT_OF_MEMORY;
  a->mem = mem_new(bytes, &a->map, &a->maplen);
  a->w = shadow_new(bytes);
  a->r = shadow_new(bytes);
  if (!a->mem || !a->w || !a->r) {
    if (a->map) munmap(a->map, a->maplen);
    shadow_free(a->w, bytes);
    shadow_free(a->r, bytes);
    free(a);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  a->base = D->next;
  a->size = bytes;
  sim_poison(a);
  a->dev = dev;
  a->async = async;
  D->next = (D->next + bytes + GAP + 255) & ~(CUdeviceptr)255;
  D->used += bytes;
  if (D->nallocs == D->cap) {
    D->cap = D->cap ? 2 * D->cap : 64;
    D->allocs = realloc(D->allocs, D->cap * sizeof *D->allocs);
  }
  D->allocs[D->nallocs++] = a;
  g_live_allocs++;
  *out = a->base;
  return CUDA_SUCCESS;
}

/* ---- the driver API ---- */

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
  ENTER(cuMemGetInfo_v2);
  CUresult err = CUDA_SUCCESS;
  sim_ctx_t *c = sim_need_ctx("cuMemGetInfo", &err);
  if (!c) RETURN(err);
  *free_bytes = g_mem_total - g_dev[c->dev].used;
  *total = g_mem_total;
  RETURN(CUDA_SUCCESS);
}

CUresult cuMemAlloc_v2(CUdeviceptr *ptr, size_t bytes) {
  ENTER(cuMemAlloc_v2);
  CUresult err = CUDA_SUCCESS;
  sim_ctx_t *c = sim_need_ctx("cuMemAlloc", &err);
  if (!c) RETURN(err);
  if (!ptr) RETURN(CUDA_ERROR_INVALID_VALUE);
  RETURN(sim_alloc_new(c->dev, bytes, 0, ptr));
}

sim_alloc_t *sim_alloc_to_free(CUdeviceptr p, const char *op, CUresult *err) {
  int dev;
  sim_alloc_t *a = sim_find_alloc(p, &dev);
  if (a == NULL || a->base != p) {
    sim_misuse("%s: 0x%llx is not the start of a device allocation", op, (unsigned long long)p);
    *err = CUDA_ERROR_INVALID_VALUE;
    return NULL;
  }
  if (a->cache_owned) {
    sim_misuse("%s: 0x%llx belongs to the caching allocator (give it back with its free)", op, (unsigned long long)p);
    *err = CUDA_ERROR_INVALID_VALUE;
    return NULL;
  }
  if (a->freed) {
    sim_misuse("%s: 0x%llx was already freed (double free)", op, (unsigned long long)p);
    *err = CUDA_ERROR_INVALID_VALUE;
    return NULL;
  }
  return a;
}

/* A free at host time of memory whose last accesses the host has not seen complete is a race with them. */
static void free_after_host_saw(const sim_alloc_t *a) {
  if (!g_check_races) return;
  for (size_t i = 0; i < a->size; i++) {
    uint32_t e = !sim_host_has_seen(a->w[i]) ? a->w[i] : !sim_host_has_seen(a->r[i]) ? a->r[i] : 0;
    if (e == 0) continue;
    sim_race("race: cuMemFree of a %zu-byte stream-ordered allocation on device %d while byte %zu may still be %s "
             "by work on stream agent %u (op %u) that the host never saw finish: cuMemFree does not wait for it "
             "(synchronise first, or free it with cuMemFreeAsync on its stream)", a->size, a->dev, i,
             e == a->w[i] ? "written" : "read", e >> 22, e & 0x3fffff);
    return;
  }
}

CUresult cuMemFree_v2(CUdeviceptr p) {
  ENTER(cuMemFree_v2);
  CUresult err = CUDA_SUCCESS;
  sim_ctx_t *c = sim_need_ctx("cuMemFree", &err);
  if (!c) RETURN(err);
  sim_alloc_t *a = sim_alloc_to_free(p, "cuMemFree", &err);
  if (!a) RETURN(err);
  if (a->async) {
    /* Memory from the stream-ordered pool: cuMemFree does not wait for the work that uses it (the driver's
     * documentation says so), so the host must already know that all of it finished. */
    free_after_host_saw(a);
  } else {
    /* cuMemFree waits for the device to finish (as cudaFree does): the host then knows all of its work is done. */
    for (size_t i = 0; i < g_nstreams; i++)
      if (g_streams[i]->dev == a->dev) sim_host_sync(g_streams[i]->vc);
  }
  sim_alloc_free(a);
  RETURN(CUDA_SUCCESS);
}

CUresult cuMemAllocAsync(CUdeviceptr *ptr, size_t bytes, CUstream stream) {
  ENTER(cuMemAllocAsync);
  CUresult err = CUDA_SUCCESS;
  sim_ctx_t *c = sim_need_ctx("cuMemAllocAsync", &err);
  if (!c) RETURN(err);
  sim_stream_t *s = sim_resolve_stream(stream, c, "cuMemAllocAsync", &err);
  if (!s) RETURN(err);
  if (!ptr) RETURN(CUDA_ERROR_INVALID_VALUE);
  CUresult r = sim_alloc_new(c->dev, bytes, 1, ptr);
  if (r == CUDA_SUCCESS) {
    /* Stream-ordered: the memory exists from this point of `stream` on; other streams must be ordered after. */
    sim_op_t op;
    sim_op_begin(&op, s, "cuMemAllocAsync", c->dev);
    sim_access(&op, *ptr, bytes, 1);
  }
  RETURN(r);
}

CUresult cuMemFreeAsync(CUdeviceptr p, CUstream stream) {
  ENTER(cuMemFreeAsync);
  CUresult err = CUDA_SUCCESS;
  sim_ctx_t *c = sim_need_ctx("cuMemFreeAsync", &err);
  if (!c) RETURN(err);
  sim_stream_t *s = sim_resolve_stream(stream, c, "cuMemFreeAsync", &err);
  if (!s) RETURN(err);
  sim_alloc_t *a = sim_alloc_to_free(p, "cuMemFreeAsync", &err);
  if (!a) RETURN(err);
  /* The free is a write of the whole block on `stream`: every earlier use must be ordered before it. */
  sim_op_t op;
  sim_op_begin(&op, s, "cuMemFreeAsync", a->dev);
  op.any_peer = 1;
  sim_access(&op, p, a->size, 1);
  sim_alloc_free(a);
  RETURN(CUDA_SUCCESS);
}
