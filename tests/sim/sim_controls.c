/* Controls for tests (ctypes / dlsym): the misuse record, call counts and planned failures, live counts by name,
 * the calling thread's context, peer access, and test-harness memory. The other controls are kept with what they
 * control: simgpu_touch and simgpu_host_touch (sim_host.c), simgpu_nccl_break (sim_nccl.c), and the caching
 * allocator's simgpu_cache_* (sim_allocator.c). */

#include "sim_driver.h"

#include <stdio.h>
#include <string.h>

/* Clears the recorded misuse, the call counters and planned failures; the simulated state stays. */
void simgpu_reset(void) {
  sim_lock();
  sim_setup();
  g_nerrors = g_nraces = 0;
  memset(g_calls, 0, sizeof g_calls);
  memset(g_fail_at, 0, sizeof g_fail_at);
  for (int e = 0; e < SIM_E_COUNT; e++)
    g_then[e] = -1;
  memset(g_pause_calls, 0, sizeof g_pause_calls);
  sim_unlock();
}

/* Misuse recorded since the last reset (races included); the first messages go to buf, one per line. */
long long simgpu_errors(char *buf, size_t len) {
  sim_lock();
  if (buf && len) {
    size_t off = 0;
    buf[0] = '\0';
    for (long long i = 0; i < g_nerrors && i < MAX_ERRORS_KEPT && off + 1 < len; i++) {
      int w = snprintf(buf + off, len - off, "%s\n", g_errors[i]);
      if (w < 0) break;
      off += (size_t)w;
    }
  }
  long long n = g_nerrors;
  sim_unlock();
  return n;
}

/* The `k`-th call of `entry` from now on (k >= 1) returns `code` instead of running. -1: unknown entry. */
int simgpu_fail_at(const char *entry, long long k, int code) {
  sim_lock();
  sim_setup();
  int found = -1;
  for (int e = 0; e < SIM_E_COUNT; e++)
    if (strcmp(k_entry_names[e], entry) == 0) {
      g_fail_at[e] = k > 0 ? g_calls[e] + k : 0;
      g_fail_code[e] = code;
      found = 0;
    }
  sim_unlock();
  return found;
}

/* Two failures in a row: the `k`-th call of `first` from now on returns `code`, and then the next call of `then`
 * after it returns `then_code` (a recovery that fails too: a fence, then the host wait that replaces it). -1:
 * unknown entry. */
int simgpu_fail_then(const char *first, long long k, int code, const char *then, int then_code) {
  int t = -1;
  sim_lock();
  sim_setup();
  for (int e = 0; e < SIM_E_COUNT; e++)
    if (strcmp(k_entry_names[e], then) == 0) t = e;
  int found = t >= 0 ? simgpu_fail_at(first, k, code) : -1;
  if (found == 0)
    for (int e = 0; e < SIM_E_COUNT; e++)
      if (strcmp(k_entry_names[e], first) == 0) {
        g_then[e] = t;
        g_then_code[e] = then_code;
      }
  sim_unlock();
  return found;
}

/* The next `calls` calls of `entry` pause `usec` microseconds after they are counted, with the simulator's lock
 * released: threads racing on a first use then overlap inside it, as they may on a real machine. -1: unknown entry. */
int simgpu_pause(const char *entry, long long usec, int calls) {
  int found = -1;
  sim_lock();
  sim_setup();
  for (int e = 0; e < SIM_E_COUNT; e++)
    if (strcmp(k_entry_names[e], entry) == 0) {
      g_pause_us[e] = usec;
      g_pause_calls[e] = calls;
      found = 0;
    }
  sim_unlock();
  return found;
}

/* Calls of `entry` since the last reset (-1: unknown). */
long long simgpu_calls(const char *entry) {
  long long n = -1;
  sim_lock();
  for (int e = 0; e < SIM_E_COUNT; e++)
    if (strcmp(k_entry_names[e], entry) == 0) n = g_calls[e];
  sim_unlock();
  return n;
}

/* Name of entry point i (NULL past the end), to enumerate them. */
const char *simgpu_entry(int i) {
  return i >= 0 && i < SIM_E_COUNT ? k_entry_names[i] : NULL;
}

/* One counter by name: allocations, streams, events, modules, pushes (context-stack depth over all threads),
 * retains (primary context references), contexts (live primary contexts), comms, groups (open NCCL groups),
 * peer_enables, races, errors. -1 for an unknown name. */
long long simgpu_stat(const char *name) {
  long long v = -1;
  sim_lock();
  sim_setup();
  if (strcmp(name, "allocations") == 0) v = g_live_allocs;
  else if (strcmp(name, "streams") == 0) v = g_live_streams;
  else if (strcmp(name, "events") == 0) v = g_live_events;
  else if (strcmp(name, "modules") == 0) v = g_live_modules;
  else if (strcmp(name, "pushes") == 0) v = g_pushes;
  else if (strcmp(name, "comms") == 0) v = g_comms;
  else if (strcmp(name, "groups") == 0) v = g_groups;
  else if (strcmp(name, "peer_enables") == 0) v = g_peer_enables;
  else if (strcmp(name, "races") == 0) v = g_nraces;
  else if (strcmp(name, "errors") == 0) v = g_nerrors;
  else if (strcmp(name, "cache_reuses") == 0) v = g_cache_reuses;
  else if (strcmp(name, "retains") == 0 || strcmp(name, "contexts") == 0) {
    v = 0;
    for (int d = 0; d < g_ndev; d++)
      v += strcmp(name, "retains") == 0 ? g_dev[d].refs : g_dev[d].refs > 0;
  }
  sim_unlock();
  return v;
}

/* The calling thread's current context, as cuCtxGetCurrent would say, for a harness (never counted or failed). */
void *simgpu_current_context(void) {
  sim_lock();
  void *c = sim_current();
  sim_unlock();
  return c;
}

/* 1 when device `dev`'s current primary context has peer access to `peer` enabled. */
int simgpu_peer_enabled(int dev, int peer) {
  sim_lock();
  sim_ctx_t *c = sim_primary(dev);
  int v = c && peer >= 0 && peer < SIM_MAX_DEVICES && c->peer[peer];
  sim_unlock();
  return v;
}

/* Test-harness memory, as PyTorch's allocator would hand out (device `dev`'s primary context must be alive). */
unsigned long long simgpu_alloc(int dev, size_t bytes) {
  CUdeviceptr p = 0;
  sim_lock();
  sim_setup();
  if (sim_primary(dev) == NULL || sim_alloc_new(dev, bytes, 0, &p) != CUDA_SUCCESS) p = 0;
  sim_unlock();
  return p;
}

int simgpu_free(unsigned long long p) {
  sim_lock();
  CUresult err = CUDA_SUCCESS;
  sim_alloc_t *a = sim_alloc_to_free((CUdeviceptr)p, "simgpu_free", &err);
  if (a) {
    for (size_t i = 0; i < g_nstreams; i++)
      if (g_streams[i]->dev == a->dev) sim_host_sync(g_streams[i]->vc);
    sim_alloc_free(a);
  }
  sim_unlock();
  return a ? 0 : -1;
}

/* Host access to device memory as after a device synchronisation (the host waits for every stream first). */
static int backdoor(unsigned long long p, void *host, size_t n, int write) {
  sim_lock();
  int dev;
  sim_alloc_t *a = sim_find_alloc((CUdeviceptr)p, &dev);
  int ok = a && !a->freed && p + n <= a->base + a->size;
  if (ok) {
    for (size_t i = 0; i < g_nstreams; i++)
      if (g_streams[i]->dev == a->dev) sim_host_sync(g_streams[i]->vc);
    if (write) {
      memcpy(a->mem + (p - a->base), host, n);
      memset(a->w + (p - a->base), 0, n * sizeof(uint32_t));
      memset(a->r + (p - a->base), 0, n * sizeof(uint32_t));
    } else {
      memcpy(host, a->mem + (p - a->base), n);
    }
  } else {
    sim_misuse("simgpu_%s: 0x%llx +%zu is not live device memory", write ? "write" : "read", p, n);
  }
  sim_unlock();
  return ok ? 0 : -1;
}

/* The bytes themselves, for a harness that computes a device operation on the host (tests/sim/simcuda.py): no host
 * synchronisation and no shadow memory touched, so the ordering of that work is what the harness records with
 * simgpu_touch on the stream it stands for, and a missing wait stays a race. Refused for memory not in use (freed,
 * or a block the caching allocator holds), as a kernel's access would be. */
static int raw(unsigned long long p, void *host, size_t n, int write) {
  sim_lock();
  int dev;
  sim_alloc_t *a = sim_find_alloc((CUdeviceptr)p, &dev);
  int ok = a && !a->freed && !a->cached && p + n <= a->base + a->size;
  if (ok && write)
    memcpy(a->mem + (p - a->base), host, n);
  else if (ok)
    memcpy(host, a->mem + (p - a->base), n);
  else
    sim_misuse("simgpu_%s: 0x%llx +%zu is not device memory in use", write ? "poke" : "peek", p, n);
  sim_unlock();
  return ok ? 0 : -1;
}

int simgpu_peek(void *dst, unsigned long long src, size_t n) {
  return raw(src, dst, n, 0);
}
int simgpu_poke(unsigned long long dst, const void *src, size_t n) {
  return raw(dst, (void *)src, n, 1);
}

int simgpu_read(void *dst, unsigned long long src, size_t n) {
  return backdoor(src, dst, n, 0);
}
int simgpu_write(unsigned long long dst, const void *src, size_t n) {
  return backdoor(dst, (void *)src, n, 1);
}
