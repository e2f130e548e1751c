/* A simulated CUDA driver (libcuda.so.1) over host memory for tests: N devices with primary contexts,
 * per-thread context stacks, streams, events, modules, allocations in fake address ranges, fastdp's kernels run
 * on the host, and a happens-before (vector clock) check of every device access. Misuse is recorded, never
 * fatal; tests read it back through the simgpu_* controls. Work runs eagerly, at enqueue time. */

#include "sim_driver.h"

#include "backend/cuda/kernels.h"
#include "fastdp.h"

#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define RANGE_BYTES (1ull << 36) /* fake address range reserved per device (PROT_NONE: the host cannot touch it) */
#define GAP 256
#define PAGE 4096
#define HUGE_BYTES (256u << 20) /* allocations from this size on start zeroed: filling them would cost real memory */

/* ---- state ---- */

static pthread_mutex_t g_mu = PTHREAD_RECURSIVE_MUTEX_INITIALIZER_NP;
int g_ndev = -1;
int g_inited;
size_t g_mem_total;
int g_check_races = 1;
int g_sms = 2;

device_t g_dev[SIM_MAX_DEVICES];

/* Everything ever created, kept (dead) until the process ends so that a stale handle is recognised. */
void **g_objs;
size_t g_nobjs;
static size_t g_capobjs;

/* counters */
long long g_calls[SIM_E_COUNT];
long long g_fail_at[SIM_E_COUNT]; /* call number that fails (0: none) */
int g_fail_code[SIM_E_COUNT];
long long g_nerrors, g_nraces;
char g_errors[MAX_ERRORS_KEPT][512];
long long g_cache_reuses; /* blocks the simulated caching allocator handed out again */
long long g_live_allocs, g_live_streams, g_live_events, g_live_modules, g_pushes, g_comms, g_groups;
long long g_peer_enables;
static int g_verbose;

/* Every driver entry point by address: with -z defs (build.py), one the simulator does not define fails the link. */
#define SIM_X(name) (void (*)(void)) name,
__attribute__((used)) static void (*const k_driver_entry_points[])(void) = {FDP_CU_ENTRY_POINTS(SIM_DRIVER_ENTRY)};
#undef SIM_X

const char *const k_entry_names[SIM_E_COUNT] = {
#define SIM_X(name) #name,
    SIM_ENTRIES
#undef SIM_X
};

void sim_lock(void) {
  pthread_mutex_lock(&g_mu);
}
void sim_unlock(void) {
  pthread_mutex_unlock(&g_mu);
}

void sim_misuse(const char *fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  if (g_nerrors < MAX_ERRORS_KEPT) snprintf(g_errors[g_nerrors], sizeof g_errors[0], "%s", buf);
  g_nerrors++;
  if (g_verbose) fprintf(stderr, "simgpu: misuse: %s\n", buf);
}

void sim_race(const char *fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  g_nraces++;
  sim_misuse("%s", buf);
}

void sim_track(void *p) {
  if (g_nobjs == g_capobjs) {
    g_capobjs = g_capobjs ? g_capobjs * 2 : 256;
    g_objs = realloc(g_objs, g_capobjs * sizeof *g_objs);
  }
  g_objs[g_nobjs++] = p;
}

long long sim_env_ll(const char *name, long long def) {
  const char *s = getenv(name);
  return s && *s ? strtoll(s, NULL, 0) : def;
}

/* SIMGPU_FAIL="entry:k:code[,entry:k:code...]": the k-th call of entry (from process start) returns code. */
static void parse_fail_env(void) {
  const char *s = getenv("SIMGPU_FAIL");
  if (!s) return;
  char buf[1024];
  snprintf(buf, sizeof buf, "%s", s);
  for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
    char name[128];
    long long k = 0;
    int code = 0;
    if (sscanf(tok, "%127[^:]:%lld:%d", name, &k, &code) != 3) continue;
    for (int e = 0; e < SIM_E_COUNT; e++)
      if (strcmp(k_entry_names[e], name) == 0) {
        g_fail_at[e] = k;
        g_fail_code[e] = code;
      }
  }
}

void sim_setup(void) {
  if (g_ndev >= 0) return;
  g_ndev = (int)sim_env_ll("SIMGPU_DEVICES", 4);
  if (g_ndev < 0) g_ndev = 0;
  if (g_ndev > SIM_MAX_DEVICES) g_ndev = SIM_MAX_DEVICES;
  g_mem_total = (size_t)sim_env_ll("SIMGPU_MEM_MB", 4096) << 20;
  g_check_races = sim_env_ll("SIMGPU_RACES", 1) != 0;
  g_sms = (int)sim_env_ll("SIMGPU_SMS", 2);
  if (g_sms < 1) g_sms = 1;
  g_verbose = sim_env_ll("SIMGPU_VERBOSE", 0) != 0;
  for (int d = 0; d < g_ndev; d++) {
    void *p = mmap(NULL, RANGE_BYTES, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      g_ndev = d;
      break;
    }
    g_dev[d].lo = (CUdeviceptr)(uintptr_t)p;
    g_dev[d].hi = g_dev[d].lo + RANGE_BYTES;
    g_dev[d].next = g_dev[d].lo + 4096;
  }
  parse_fail_env();
}

int sim_enter(sim_entry_t e) {
  sim_setup();
  long long n = ++g_calls[e];
  if (g_fail_at[e] != 0 && n == g_fail_at[e]) {
    g_fail_at[e] = 0;
    if (g_verbose)
      fprintf(stderr, "simgpu: injected failure %d in %s (call %lld)\n", g_fail_code[e], k_entry_names[e], n);
    return g_fail_code[e];
  }
  return 0;
}

int sim_ndev(void) {
  sim_setup();
  return g_ndev;
}

sim_ctx_t *sim_primary(int dev) {
  if (dev < 0 || dev >= g_ndev) return NULL;
  sim_ctx_t *c = g_dev[dev].ctx;
  return c && c->alive ? c : NULL;
}

void sim_comm_count(int delta) {
  g_comms += delta;
}
void sim_group_count(int delta) {
  g_groups += delta;
}

/* ---- memory ---- */

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
  if (bytes < HUGE_BYTES) memset(a->mem, 0xa5, bytes); /* uninitialised device memory is never accidentally zero */
  a->base = D->next;
  a->size = bytes;
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

int sim_ptr_device(CUdeviceptr p) {
  int dev;
  sim_find_alloc(p, &dev);
  return dev;
}

/* Handles are never freed (dead objects stay until the process ends), so a handle this library returned can
 * always be read; the magic tells its kind and `alive` whether it may still be used. */
int sim_valid_obj(const void *p, uint32_t magic) {
  return p != NULL && *(const uint32_t *)p == magic;
}

/* ---- the driver API ---- */

CUresult cuInit(unsigned int flags) {
  ENTER(cuInit);
  if (flags != 0) RETURN(CUDA_ERROR_INVALID_VALUE);
  g_inited = 1;
  RETURN(CUDA_SUCCESS);
}

CUresult cuDriverGetVersion(int *v) {
  ENTER(cuDriverGetVersion);
  if (!v) RETURN(CUDA_ERROR_INVALID_VALUE);
  *v = 13000;
  RETURN(CUDA_SUCCESS);
}

/* Private tables of the real driver that other NVIDIA libraries (NVRTC, the runtime) ask for: none here, so that a
 * library loaded beside the simulator sees "not supported" rather than resolving nothing. */
struct CUuuid_st; /* cuda.h's CUuuid; only pointed to here */
CUresult cuGetExportTable(const void **table, const struct CUuuid_st *id) {
  (void)id;
  if (table) *table = NULL;
  return CUDA_ERROR_NOT_SUPPORTED;
}

static const struct {
  int code;
  const char *name, *text;
} k_errs[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_DEINITIALIZED, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_IMAGE, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_NO_BINARY_FOR_GPU, "CUDA_ERROR_NO_BINARY_FOR_GPU", "no kernel image is available for execution"},
    {CUDA_ERROR_INVALID_PTX, "CUDA_ERROR_INVALID_PTX", "a PTX JIT compilation failed"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", "too many resources requested"},
    {CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED, "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED",
     "peer access is already enabled"},
    {CUDA_ERROR_PEER_ACCESS_NOT_ENABLED, "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED", "peer access has not been enabled"},
    {CUDA_ERROR_CONTEXT_IS_DESTROYED, "CUDA_ERROR_CONTEXT_IS_DESTROYED", "context is destroyed"},
    {CUDA_ERROR_LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

static int err_index(CUresult r) {
  for (size_t i = 0; i < sizeof k_errs / sizeof k_errs[0]; i++)
    if (k_errs[i].code == (int)r) return (int)i;
  return -1;
}

CUresult cuGetErrorString(CUresult r, const char **s) {
  ENTER(cuGetErrorString);
  int i = err_index(r);
  if (!s) RETURN(CUDA_ERROR_INVALID_VALUE);
  *s = i >= 0 ? k_errs[i].text : NULL;
  RETURN(i >= 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE);
}

CUresult cuGetErrorName(CUresult r, const char **s) {
  ENTER(cuGetErrorName);
  int i = err_index(r);
  if (!s) RETURN(CUDA_ERROR_INVALID_VALUE);
  *s = i >= 0 ? k_errs[i].name : NULL;
  RETURN(i >= 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE);
}

CUresult cuDeviceGetCount(int *n) {
  ENTER(cuDeviceGetCount);
  NEED_INIT(cuDeviceGetCount);
  if (!n) RETURN(CUDA_ERROR_INVALID_VALUE);
  *n = g_ndev;
  RETURN(CUDA_SUCCESS);
}

CUresult cuDeviceGet(CUdevice *dev, int ordinal) {
  ENTER(cuDeviceGet);
  NEED_INIT(cuDeviceGet);
  CHECK_DEV(cuDeviceGet, ordinal);
  *dev = ordinal;
  RETURN(CUDA_SUCCESS);
}

CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
  ENTER(cuDeviceGetName);
  NEED_INIT(cuDeviceGetName);
  CHECK_DEV(cuDeviceGetName, dev);
  if (!name || len <= 0) RETURN(CUDA_ERROR_INVALID_VALUE);
  snprintf(name, (size_t)len, "fastdp simulated GPU %d", dev);
  RETURN(CUDA_SUCCESS);
}

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
  ENTER(cuDeviceTotalMem_v2);
  NEED_INIT(cuDeviceTotalMem_v2);
  CHECK_DEV(cuDeviceTotalMem_v2, dev);
  *bytes = g_mem_total;
  RETURN(CUDA_SUCCESS);
}

CUresult cuDeviceGetAttribute(int *v, CUdevice_attribute attr, CUdevice dev) {
  ENTER(cuDeviceGetAttribute);
  NEED_INIT(cuDeviceGetAttribute);
  CHECK_DEV(cuDeviceGetAttribute, dev);
  switch ((int)attr) {
  case CU_DEVICE_ATTRIBUTE_MAX_PITCH: *v = 2147483647; break;
  case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *v = g_sms; break;
  case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: *v = 1; break;
  case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *v = 9; break;
  case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *v = 0; break;
  default: RETURN(CUDA_ERROR_INVALID_VALUE);
  }
  RETURN(CUDA_SUCCESS);
}

CUresult cuDeviceCanAccessPeer(int *can, CUdevice dev, CUdevice peer) {
  ENTER(cuDeviceCanAccessPeer);
  NEED_INIT(cuDeviceCanAccessPeer);
  CHECK_DEV(cuDeviceCanAccessPeer, dev);
  CHECK_DEV(cuDeviceCanAccessPeer, peer);
  *can = dev != peer && sim_env_ll("SIMGPU_NO_PEER", 0) == 0;
  RETURN(CUDA_SUCCESS);
}

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

CUresult cuMemFree_v2(CUdeviceptr p) {
  ENTER(cuMemFree_v2);
  CUresult err = CUDA_SUCCESS;
  sim_ctx_t *c = sim_need_ctx("cuMemFree", &err);
  if (!c) RETURN(err);
  sim_alloc_t *a = sim_alloc_to_free(p, "cuMemFree", &err);
  if (!a) RETURN(err);
  /* cuMemFree waits for the device to finish (as cudaFree does): the host then knows all of its work is done. */
  for (size_t i = 0; i < g_nstreams; i++)
    if (g_streams[i]->dev == a->dev) sim_host_sync(g_streams[i]->vc);
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
