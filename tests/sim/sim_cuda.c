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
