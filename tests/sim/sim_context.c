/* Contexts on the simulated driver: each device's primary context, refcounted (its last release destroys it and
 * everything made in it, and a later use of its handle is an error), each thread's own context stack (push, pop,
 * set, get), and peer access, enabled per context towards each peer. */

#include "sim_driver.h"

#include <stdlib.h>

static __thread sim_ctx_t *t_stack[64];
static __thread int t_depth;
/* Whether this thread's retains and releases are the test harness's own, as PyTorch's are (simgpu_client); once a
 * harness says so, the others are the library's. */
static __thread int t_client;
static int g_client_declared;

static sim_ctx_t *current(void) {
  return t_depth > 0 ? t_stack[t_depth - 1] : NULL;
}

/* The current context, alive; NULL after recording why (*err receives the result to return). */
sim_ctx_t *sim_need_ctx(const char *op, CUresult *err) {
  sim_ctx_t *c = current();
  if (c == NULL) {
    sim_misuse("%s: no CUDA context is current on this thread", op);
    *err = CUDA_ERROR_INVALID_CONTEXT;
    return NULL;
  }
  if (!c->alive) {
    sim_misuse("%s: the current context (device %d) was destroyed (primary context released)", op, c->dev);
    *err = CUDA_ERROR_CONTEXT_IS_DESTROYED;
    return NULL;
  }
  return c;
}

void sim_set_current(sim_ctx_t *c) {
  if (t_depth == 0) {
    t_depth = 1;
    g_pushes++;
  }
  t_stack[t_depth - 1] = c;
}

sim_ctx_t *sim_current(void) {
  return current();
}

int sim_valid_ctx(const sim_ctx_t *c) {
  return sim_valid_obj(c, MAGIC_CTX);
}

static void ctx_destroy(sim_ctx_t *c) {
  int dev = c->dev;
  c->alive = 0;
  int comms = sim_nccl_comms_on(c);
  if (comms)
    sim_misuse("the primary context of device %d was destroyed (last release) while %d NCCL communicator(s) still "
               "use it: destroy communicators before releasing the context",
               dev, comms);
  long long live = 0;
  device_t *D = &g_dev[dev];
  for (size_t i = 0; i < D->nallocs; i++)
    if (!D->allocs[i]->freed) {
      sim_alloc_free(D->allocs[i]);
      live++;
    }
  if (live) sim_misuse("the primary context of device %d was destroyed with %lld live allocation(s)", dev, live);
  for (size_t i = 0; i < g_nobjs; i++) {
    uint32_t m = *(uint32_t *)g_objs[i];
    if (m == MAGIC_STREAM) {
      sim_stream_t *s = g_objs[i];
      if (s->ctx == c && s->alive) {
        if (!s->legacy) g_live_streams--;
        sim_stream_kill(s);
      }
    } else if (m == MAGIC_EVENT) {
      sim_event_t *e = g_objs[i];
      if (e->ctx == c && e->alive) {
        e->alive = 0;
        g_live_events--;
      }
    } else if (m == MAGIC_MODULE) {
      sim_module_t *md = g_objs[i];
      if (md->ctx == c && md->alive) {
        md->alive = 0;
        g_live_modules--;
      }
    }
  }
}

/* ---- the driver API ---- */

CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev) {
  ENTER(cuDevicePrimaryCtxRetain);
  NEED_INIT(cuDevicePrimaryCtxRetain);
  CHECK_DEV(cuDevicePrimaryCtxRetain, dev);
  device_t *D = &g_dev[dev];
  if (D->refs == 0) {
    sim_ctx_t *c = calloc(1, sizeof *c);
    c->magic = MAGIC_CTX;
    c->dev = dev;
    c->alive = 1;
    sim_track(c);
    c->null_stream = sim_stream_new(c, 1, 1);
    D->ctx = c;
  }
  D->refs++;
  if (t_client) D->client_refs++;
  *ctx = (CUcontext)D->ctx;
  RETURN(CUDA_SUCCESS);
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
  ENTER(cuDevicePrimaryCtxRelease_v2);
  NEED_INIT(cuDevicePrimaryCtxRelease_v2);
  CHECK_DEV(cuDevicePrimaryCtxRelease_v2, dev);
  device_t *D = &g_dev[dev];
  if (D->refs == 0) {
    sim_misuse("cuDevicePrimaryCtxRelease: device %d's primary context is not retained", dev);
    RETURN(CUDA_ERROR_INVALID_CONTEXT);
  }
  if (t_client && D->client_refs > 0) D->client_refs--;
  if (--D->refs == 0) ctx_destroy(D->ctx);
  RETURN(CUDA_SUCCESS);
}

CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active) {
  ENTER(cuDevicePrimaryCtxGetState);
  NEED_INIT(cuDevicePrimaryCtxGetState);
  CHECK_DEV(cuDevicePrimaryCtxGetState, dev);
  if (flags) *flags = 0;
  if (active) *active = g_dev[dev].refs > 0;
  RETURN(CUDA_SUCCESS);
}

CUresult cuCtxPushCurrent_v2(CUcontext ctx) {
  ENTER(cuCtxPushCurrent_v2);
  sim_ctx_t *c = (sim_ctx_t *)ctx;
  if (!sim_valid_ctx(c)) {
    sim_misuse("cuCtxPushCurrent: %p is not a context", (void *)ctx);
    RETURN(CUDA_ERROR_INVALID_CONTEXT);
  }
  if (!c->alive) {
    sim_misuse("cuCtxPushCurrent: device %d's context was destroyed (a stale primary context handle)", c->dev);
    RETURN(CUDA_ERROR_CONTEXT_IS_DESTROYED);
  }
  if (t_depth == 64) {
    sim_misuse("cuCtxPushCurrent: context stack deeper than 64 (unbalanced push/pop?)");
    RETURN(CUDA_ERROR_INVALID_VALUE);
  }
  t_stack[t_depth++] = c;
  g_pushes++;
  RETURN(CUDA_SUCCESS);
}

/* An injected failure still pops: the real driver fails a pop only when it has no stack to pop (or is torn down),
 * so a caller cannot retry a failed pop without popping its own caller's context. The error is still reported. */
CUresult cuCtxPopCurrent_v2(CUcontext *ctx) {
  sim_lock();
  int inj = sim_enter(SIM_E_cuCtxPopCurrent_v2);
  if (inj && t_depth > 0) {
    t_depth--;
    g_pushes--;
  }
  if (inj) {
    sim_unlock();
    return (CUresult)inj;
  }
  if (t_depth == 0) {
    sim_misuse("cuCtxPopCurrent: the context stack is empty (unbalanced push/pop)");
    RETURN(CUDA_ERROR_INVALID_CONTEXT);
  }
  sim_ctx_t *c = t_stack[--t_depth];
  g_pushes--;
  if (ctx) *ctx = (CUcontext)c;
  RETURN(CUDA_SUCCESS);
}

CUresult cuCtxGetCurrent(CUcontext *ctx) {
  ENTER(cuCtxGetCurrent);
  if (!ctx) RETURN(CUDA_ERROR_INVALID_VALUE);
  *ctx = (CUcontext)sim_current();
  RETURN(CUDA_SUCCESS);
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
  ENTER(cuCtxSetCurrent);
  sim_ctx_t *c = (sim_ctx_t *)ctx;
  if (c == NULL) { /* pops the top, or nothing */
    if (t_depth > 0) {
      t_depth--;
      g_pushes--;
    }
    RETURN(CUDA_SUCCESS);
  }
  if (!sim_valid_ctx(c)) {
    sim_misuse("cuCtxSetCurrent: %p is not a context", (void *)ctx);
    RETURN(CUDA_ERROR_INVALID_CONTEXT);
  }
  if (!c->alive) {
    sim_misuse("cuCtxSetCurrent: device %d's context was destroyed", c->dev);
    RETURN(CUDA_ERROR_CONTEXT_IS_DESTROYED);
  }
  if (t_depth == 0) {
    t_depth = 1;
    g_pushes++;
  }
  t_stack[t_depth - 1] = c;
  RETURN(CUDA_SUCCESS);
}

CUresult cuCtxSynchronize(void) {
  ENTER(cuCtxSynchronize);
  CUresult err = CUDA_SUCCESS;
  sim_ctx_t *c = sim_need_ctx("cuCtxSynchronize", &err);
  if (!c) RETURN(err);
  for (size_t i = 0; i < g_nstreams; i++)
    if (g_streams[i]->ctx == c) sim_host_sync(g_streams[i]->vc);
  RETURN(CUDA_SUCCESS);
}

CUresult cuCtxEnablePeerAccess(CUcontext peer, unsigned int flags) {
  ENTER(cuCtxEnablePeerAccess);
  CUresult err = CUDA_SUCCESS;
  sim_ctx_t *c = sim_need_ctx("cuCtxEnablePeerAccess", &err);
  if (!c) RETURN(err);
  sim_ctx_t *p = (sim_ctx_t *)peer;
  if (flags != 0 || !sim_valid_ctx(p) || !p->alive) {
    sim_misuse("cuCtxEnablePeerAccess: bad flags or a dead/invalid peer context");
    RETURN(!sim_valid_ctx(p) || !p->alive ? CUDA_ERROR_INVALID_CONTEXT : CUDA_ERROR_INVALID_VALUE);
  }
  if (p->dev == c->dev) {
    sim_misuse("cuCtxEnablePeerAccess: device %d with itself", c->dev);
    RETURN(CUDA_ERROR_INVALID_DEVICE);
  }
  if (c->peer[p->dev]) RETURN(CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED); /* legal; callers tolerate it */
  c->peer[p->dev] = 1;
  g_peer_enables++;
  RETURN(CUDA_SUCCESS);
}

/* ---- who holds a primary context ---- */

/* The calling thread's retains and releases from now on are (on = 1) or are not (0) the test harness's own, made
 * as PyTorch makes its: what the library retains is then told apart from them. */
void simgpu_client(int on) {
  sim_lock();
  t_client = on != 0;
  g_client_declared = 1;
  sim_unlock();
}

int sim_library_holds(int dev) {
  if (dev < 0 || dev >= g_ndev) return 0;
  const device_t *D = &g_dev[dev];
  return D->refs > (g_client_declared ? D->client_refs : 0);
}
