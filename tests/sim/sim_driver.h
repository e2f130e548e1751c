/* The simulated CUDA driver (libcuda.so.1) over host memory for tests: N devices with primary contexts, per-thread
 * context stacks, streams, events, modules, allocations in fake address ranges, fastdp's kernels run on the host, and
 * a happens-before (vector clock) check of every device access. Misuse is recorded, never fatal; tests read it back
 * through the simgpu_* controls. Work runs eagerly, at enqueue time. Its files, by what they simulate:
 *   sim_state.c      the lock, devices set up from the environment, call counting and fault injection, the misuse
 *                    record, and the registry of every handle;
 *   sim_device.c     cuInit, the version, error names, and what each device reports;
 *   sim_context.c    primary contexts, each thread's context stack, peer access;
 *   sim_stream.c     streams, events, and the vector clocks that order device work;
 *   sim_memory.c     device memory: address ranges, allocations, the check of every access, shadow memory and races;
 *   sim_copy.c       copies;
 *   sim_launch.c     modules and kernel launches;
 *   sim_arith.c      element arithmetic (half and bfloat16, the rounded sum);
 *   sim_controls.c   the simgpu_* controls for tests;
 *   sim_allocator.c  a caching allocator as PyTorch's.
 * This header holds the driver's own internals, shared by those files (sim.h is what the driver shares with NCCL,
 * host memory and the kernels). Not a public header. Declared hidden: the library exports the entry points and the
 * simgpu_* controls only, so a short name here is never bound to another library's symbol of the same name. */
#ifndef FASTDP_SIM_DRIVER_H
#define FASTDP_SIM_DRIVER_H

#include "sim.h"

#include <stddef.h>
#include <stdint.h>

#pragma GCC visibility push(hidden)

/* The first word of every handle, telling its kind (sim_valid_obj). */
#define MAGIC_CTX 0x43545831u
#define MAGIC_STREAM 0x5354524du
#define MAGIC_EVENT 0x45564e54u
#define MAGIC_MODULE 0x4d4f444cu
#define MAGIC_FUNC 0x46554e43u
#define MAX_ERRORS_KEPT 64
/* Device memory starts aligned to DEVICE_ALIGN; the bytes between a block's end and its guard page hold CANARY. */
#define DEVICE_ALIGN 256
#define CANARY 0x5a
/* What fresh device memory holds until something writes it: all bits set is a NaN in every floating type (half,
 * bfloat16, float, double) and -1 in every integer type, so memory nobody wrote never passes for zeros and a NaN
 * spreads through every sum that reads it. */
#define POISON 0xff

/* ---- state (sim_state.c) ---- */

extern int g_ndev;
extern int g_inited;
extern size_t g_mem_total;
extern int g_check_races;
extern int g_sms;

typedef struct sim_alloc {
  CUdeviceptr base;
  size_t size;
  int dev;
  int freed;
  int async;
  /* Blocks of the simulated caching allocator (simgpu_cache_alloc): owned by it, the stream they belong to, whether
   * it holds them as free now, and the size the current owner asked for (accesses past it are overruns). */
  int cache_owned, cached;
  sim_stream_t *cache_stream;
  size_t asked;
  unsigned char *mem; /* the bytes, ending just before a guard page (see mem_new in sim_memory.c) */
  void *map;          /* the host mapping holding them */
  size_t maplen;
  uint32_t *w, *r; /* per-byte epochs of the last write and the last read: (agent << 22) | clock */
} sim_alloc_t;

typedef struct device {
  CUdeviceptr lo, hi, next; /* reserved range and bump pointer (addresses are never reused) */
  size_t used;
  int refs;        /* primary context retains */
  int client_refs; /* those of them the test harness made as PyTorch would (simgpu_client) */
  sim_ctx_t *ctx; /* the current primary context (possibly dead) */
  sim_alloc_t **allocs; /* sorted by base */
  size_t nallocs, cap;
} device_t;

extern device_t g_dev[SIM_MAX_DEVICES];

/* Everything ever created, kept (dead) until the process ends so that a stale handle is recognised. */
extern void **g_objs;
extern size_t g_nobjs;

/* counters */
extern long long g_calls[SIM_E_COUNT];
extern long long g_fail_at[SIM_E_COUNT]; /* call number that fails (0: none) */
extern int g_fail_code[SIM_E_COUNT];
/* When entry e's planned failure fires, entry g_then[e] (-1: none) fails at its next call with g_then_code[e]. */
extern int g_then[SIM_E_COUNT];
extern int g_then_code[SIM_E_COUNT];
/* The next g_pause_calls[e] calls of entry e pause g_pause_us[e] microseconds (simgpu_pause). */
extern long long g_pause_us[SIM_E_COUNT];
extern int g_pause_calls[SIM_E_COUNT];
extern long long g_nerrors, g_nraces;
extern char g_errors[MAX_ERRORS_KEPT][512];
extern long long g_cache_reuses; /* blocks the simulated caching allocator handed out again */
extern long long g_live_allocs, g_live_streams, g_live_events, g_live_modules, g_pushes, g_comms, g_groups;
extern long long g_peer_enables;

/* Entry point names, indexed by sim_entry_t. */
extern const char *const k_entry_names[SIM_E_COUNT];

/* Sets the simulator up from the environment (SIMGPU_*) on first use. */
void sim_setup(void);
/* An integer environment variable, `def` when unset or empty. */
long long sim_env_ll(const char *name, long long def);
/* Keeps a new handle for the rest of the process (g_objs). */
void sim_track(void *p);
/* Whether p is a handle of kind `magic`, alive or dead. */
int sim_valid_obj(const void *p, uint32_t magic);

/* ---- contexts (sim_context.c) ---- */

/* The current context, alive; NULL after recording why (*err receives the result to return). */
sim_ctx_t *sim_need_ctx(const char *op, CUresult *err);
int sim_valid_ctx(const sim_ctx_t *c);

/* ---- streams and clocks (sim_stream.c) ---- */

extern sim_stream_t **g_streams; /* live streams, legacy ones included */
extern size_t g_nstreams;

typedef struct sim_event {
  uint32_t magic;
  sim_ctx_t *ctx;
  int alive;
  int recorded;
  uint32_t *vc;
} sim_event_t;

/* A new stream of context `ctx` (legacy: its NULL stream), starting after everything the host has seen. */
sim_stream_t *sim_stream_new(sim_ctx_t *ctx, int legacy, int blocking);
void sim_stream_kill(sim_stream_t *s);
/* The host learns that everything `vc` covers has completed: copies to host memory among it land now. */
void sim_host_sync(const uint32_t *vc);
/* Whether the host knows that the access with shadow epoch `epoch` ((agent << 22) | clock; 0: none) completed. */
int sim_host_has_seen(uint32_t epoch);
/* A stream handle for work with context `c` current (NULL: its legacy stream); NULL after a misuse (*err). */
sim_stream_t *sim_resolve_stream(CUstream h, sim_ctx_t *c, const char *op, CUresult *err);

/* ---- modules (sim_launch.c) ---- */

typedef struct sim_module {
  uint32_t magic;
  sim_ctx_t *ctx;
  int alive;
  size_t image_bytes;  /* what cuModuleLoadData read of its image */
  uint64_t image_hash; /* and a hash of those bytes */
} sim_module_t;

/* ---- memory (sim_memory.c) ---- */

/* The allocation that may hold p: the last one with base <= p on the device whose range holds p (NULL: none; the
 * caller checks its end); *dev: that device, or -1. */
sim_alloc_t *sim_find_alloc(CUdeviceptr p, int *dev);
/* Whether a pointer lies in a device's fake address range (device memory passed as host memory). */
int sim_in_device_range(const void *host);
/* Whether anything wrote past the end of allocation `a` (into its canary). */
int sim_mem_overrun(const sim_alloc_t *a);
/* Fills a block with POISON, as fresh memory (the head and tail only of a huge one). */
void sim_poison(sim_alloc_t *a);
CUresult sim_alloc_new(int dev, size_t bytes, int async, CUdeviceptr *out);
void sim_alloc_free(sim_alloc_t *a);
/* The allocation a free of p releases; NULL after a misuse (not the start of one, the caching allocator's, freed). */
sim_alloc_t *sim_alloc_to_free(CUdeviceptr p, const char *op, CUresult *err);

/* ---- the driver API: the start and end of every entry point ---- */

#define ENTER(name) SIM_ENTER(CUresult, name)
#define RETURN(v) SIM_RETURN(CUresult, v)
#define NEED_INIT(name)                                                                                                \
  if (!g_inited) {                                                                                                     \
    sim_misuse("%s before cuInit", #name);                                                                             \
    RETURN(CUDA_ERROR_NOT_INITIALIZED);                                                                                \
  }
#define CHECK_DEV(name, d)                                                                                             \
  if ((d) < 0 || (d) >= g_ndev) {                                                                                      \
    sim_misuse("%s: device %d does not exist", #name, (int)(d));                                                       \
    RETURN(CUDA_ERROR_INVALID_DEVICE);                                                                                 \
  }

#pragma GCC visibility pop

#endif
