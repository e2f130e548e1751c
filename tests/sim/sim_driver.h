/* The simulated CUDA driver's own internals, shared by the files that make it up (sim.h is what the driver shares
 * with NCCL, host memory and the kernels): its state, the kinds of its handles, and the helpers more than one of
 * its files uses. Not a public header. Declared hidden: the library exports the entry points and the simgpu_*
 * controls only, so a short name here is never bound to another library's symbol of the same name. */
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
#define DEVICE_ALIGN 256
#define CANARY 0x5a

/* ---- state ---- */

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
  unsigned char *mem; /* the bytes, ending just before a guard page (see mem_new) */
  void *map;          /* the host mapping holding them */
  size_t maplen;
  uint32_t *w, *r; /* per-byte epochs of the last write and the last read: (agent << 22) | clock */
} sim_alloc_t;

typedef struct device {
  CUdeviceptr lo, hi, next; /* reserved range and bump pointer (addresses are never reused) */
  size_t used;
  int refs; /* primary context retains */
  sim_ctx_t *ctx; /* the current primary context (possibly dead) */
  sim_alloc_t **allocs; /* sorted by base */
  size_t nallocs, cap;
} device_t;

extern device_t g_dev[SIM_MAX_DEVICES];

/* Everything ever created, kept (dead) until the process ends so that a stale handle is recognised. */
extern void **g_objs;
extern size_t g_nobjs;

extern sim_stream_t **g_streams; /* live streams, legacy ones included */
extern size_t g_nstreams;

typedef struct sim_event {
  uint32_t magic;
  sim_ctx_t *ctx;
  int alive;
  int recorded;
  uint32_t *vc;
} sim_event_t;

typedef struct sim_module {
  uint32_t magic;
  sim_ctx_t *ctx;
  int alive;
} sim_module_t;

/* counters */
extern long long g_calls[SIM_E_COUNT];
extern long long g_fail_at[SIM_E_COUNT]; /* call number that fails (0: none) */
extern int g_fail_code[SIM_E_COUNT];
extern long long g_nerrors, g_nraces;
extern char g_errors[MAX_ERRORS_KEPT][512];
extern long long g_cache_reuses; /* blocks the simulated caching allocator handed out again */
extern long long g_live_allocs, g_live_streams, g_live_events, g_live_modules, g_pushes, g_comms, g_groups;
extern long long g_peer_enables;

extern const char *const k_entry_names[SIM_E_COUNT];

/* Sets the simulator up from the environment on first use (SIMGPU_*). */
void sim_setup(void);
long long sim_env_ll(const char *name, long long def);
/* Keeps a new handle for the rest of the process (g_objs). */
void sim_track(void *p);
/* Whether p is a handle of the kind `magic` (alive or dead). */
int sim_valid_obj(const void *p, uint32_t magic);

/* ---- streams and clocks ---- */

sim_stream_t *sim_stream_new(sim_ctx_t *ctx, int legacy, int blocking);
void sim_stream_kill(sim_stream_t *s);
/* The host learns that everything `vc` covers has completed. */
void sim_host_sync(const uint32_t *vc);
/* A stream handle for work with context `c` current (NULL: its legacy stream); NULL after a misuse (*err). */
sim_stream_t *sim_resolve_stream(CUstream h, sim_ctx_t *c, const char *op, CUresult *err);

/* ---- memory ---- */

/* The allocation holding p, or the last one before it (NULL: none); *dev: the device whose range holds p, or -1. */
sim_alloc_t *sim_find_alloc(CUdeviceptr p, int *dev);
int sim_in_device_range(const void *host);
int sim_mem_overrun(const sim_alloc_t *a);
CUresult sim_alloc_new(int dev, size_t bytes, int async, CUdeviceptr *out);
void sim_alloc_free(sim_alloc_t *a);
/* The live allocation that starts at p, for a free; NULL after a misuse (*err). */
sim_alloc_t *sim_alloc_to_free(CUdeviceptr p, const char *op, CUresult *err);

/* ---- contexts ---- */

sim_ctx_t *sim_need_ctx(const char *op, CUresult *err);
int sim_valid_ctx(const sim_ctx_t *c);

/* ---- the driver API ---- */

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
