/* The simulated driver's state and bookkeeping: the lock held around every entry point, the devices set up from
 * the environment (SIMGPU_*), call counting and fault injection by entry point, the record of misuse and races
 * that tests read back (sim_controls.c), and the registry of every handle ever made, kept until the process ends
 * so that a stale handle is recognised. */

#include "sim_driver.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define RANGE_BYTES (1ull << 36) /* fake address range reserved per device (PROT_NONE: the host cannot touch it) */

#ifndef SIM_OPAQUE_LOCK
static pthread_mutex_t g_mu = PTHREAD_RECURSIVE_MUTEX_INITIALIZER_NP;
#endif
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
int g_then[SIM_E_COUNT] = {[0 ... SIM_E_COUNT - 1] = -1};
int g_then_code[SIM_E_COUNT];
long long g_pause_us[SIM_E_COUNT];
int g_pause_calls[SIM_E_COUNT];
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

#ifdef SIM_OPAQUE_LOCK
/* The build for ThreadSanitizer runs of the code under test (build.py, for_tsan): the lock is plain atomics in this
 * uninstrumented library, which the sanitizer cannot see. A pthread mutex would be seen, and would order every
 * thread's work after every other's that called the driver before it: synchronisation the code under test must have
 * of its own, and that a real driver does not promise. Recursive, as NCCL's half calls the driver's. */
static _Atomic(const void *) g_owner;
static int g_depth;
static __thread char t_me;

void sim_lock(void) {
  if (atomic_load_explicit(&g_owner, memory_order_relaxed) == &t_me) {
    g_depth++;
    return;
  }
  const void *none = NULL;
  while (!atomic_compare_exchange_weak_explicit(&g_owner, &none, &t_me, memory_order_acquire, memory_order_relaxed)) {
    none = NULL;
    sched_yield();
  }
  g_depth = 1;
}
void sim_unlock(void) {
  if (--g_depth == 0) atomic_store_explicit(&g_owner, NULL, memory_order_release);
}
#else
void sim_lock(void) {
  pthread_mutex_lock(&g_mu);
}
void sim_unlock(void) {
  pthread_mutex_unlock(&g_mu);
}
#endif

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
    if (g_then[e] >= 0) { /* the second failure of a pair: the other entry's next call */
      g_fail_at[g_then[e]] = g_calls[g_then[e]] + 1;
      g_fail_code[g_then[e]] = g_then_code[e];
      g_then[e] = -1;
    }
    return g_fail_code[e];
  }
  return 0;
}

void sim_pause_point(sim_entry_t e) {
  if (g_pause_calls[e] <= 0) return;
  g_pause_calls[e]--;
  long long us = g_pause_us[e];
  sim_unlock();
  usleep((useconds_t)us);
  sim_lock();
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
