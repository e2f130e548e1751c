/* Streams, events and the clocks that order device work. Each stream carries a vector clock, advanced by every
 * operation enqueued on it; recording an event copies its stream's clock, and waiting on one joins it; the legacy
 * default stream is ordered with every blocking stream of its context. The host has one clock, joined whenever it
 * learns that work completed (a stream, event or context synchronisation). sim_memory.c checks every access
 * against these clocks. */

#include "sim_driver.h"

#include <stdlib.h>
#include <string.h>

sim_stream_t **g_streams; /* live streams, legacy ones included */
size_t g_nstreams;
static size_t g_capstreams;
static int g_agents;
static uint32_t g_host_vc[SIM_MAX_AGENTS];

/* ---- clocks ---- */

static uint32_t *vc_new(void) {
  return calloc(SIM_MAX_AGENTS, sizeof(uint32_t));
}

void sim_vc_join(uint32_t *into, const uint32_t *from) {
  for (int a = 0; a < g_agents; a++)
    if (from[a] > into[a]) into[a] = from[a];
}

sim_stream_t *sim_stream_new(sim_ctx_t *ctx, int legacy, int blocking) {
  sim_stream_t *s = calloc(1, sizeof *s);
  s->magic = MAGIC_STREAM;
  s->ctx = ctx;
  s->dev = ctx->dev;
  s->alive = 1;
  s->legacy = legacy;
  s->blocking = blocking;
  s->vc = vc_new();
  if (g_agents >= SIM_MAX_AGENTS) {
    if (g_check_races) sim_misuse("more than %d streams: race checks are off from here on", SIM_MAX_AGENTS);
    g_check_races = 0;
    s->agent = SIM_MAX_AGENTS - 1;
  } else {
    s->agent = g_agents++;
  }
  /* A new stream starts after everything the host has seen. */
  sim_vc_join(s->vc, g_host_vc);
  sim_track(s);
  if (g_nstreams == g_capstreams) {
    g_capstreams = g_capstreams ? 2 * g_capstreams : 64;
    g_streams = realloc(g_streams, g_capstreams * sizeof *g_streams);
  }
  g_streams[g_nstreams++] = s;
  return s;
}

void sim_stream_kill(sim_stream_t *s) {
  s->alive = 0;
  for (size_t i = 0; i < g_nstreams; i++)
    if (g_streams[i] == s) {
      g_streams[i] = g_streams[--g_nstreams];
      break;
    }
}

/* The legacy default stream is ordered with every blocking stream of its context, both ways (CUDA's legacy
 * semantics); non-blocking streams (PyTorch's) are not. The host clock joins every enqueued operation: work
 * enqueued after the host saw other work complete is ordered after it. */
void sim_op_begin(sim_op_t *op, sim_stream_t *s, const char *name, int dev) {
  memset(op, 0, sizeof *op);
  op->name = name;
  op->stream = s;
  op->dev = dev;
  sim_vc_join(s->vc, g_host_vc);
  if (s->legacy) {
    for (size_t i = 0; i < g_nstreams; i++)
      if (g_streams[i]->ctx == s->ctx && g_streams[i]->blocking && !g_streams[i]->legacy)
        sim_vc_join(s->vc, g_streams[i]->vc);
  } else if (s->blocking && s->ctx->null_stream) {
    sim_vc_join(s->vc, s->ctx->null_stream->vc);
  }
  s->vc[s->agent]++;
}

/* Whether the host knows that the access with shadow epoch `epoch` ((agent << 22) | clock; 0: none) completed. */
int sim_host_has_seen(uint32_t epoch) {
  return epoch == 0 || (epoch & 0x3fffff) <= g_host_vc[epoch >> 22];
}

/* The host learns that everything `vc` covers has completed: copies to host memory among it land now. */
void sim_host_sync(const uint32_t *vc) {
  sim_vc_join(g_host_vc, vc);
  sim_host_retire(g_host_vc);
}

static void host_sync_stream(sim_stream_t *s) {
  sim_host_sync(s->vc);
  if (s->legacy) /* the legacy stream also waits for the blocking streams of its context */
    for (size_t i = 0; i < g_nstreams; i++)
      if (g_streams[i]->ctx == s->ctx && g_streams[i]->blocking) sim_host_sync(g_streams[i]->vc);
}

/* A stream handle for work with context `c` current (NULL: its legacy stream). */
sim_stream_t *sim_resolve_stream(CUstream h, sim_ctx_t *c, const char *op, CUresult *err) {
  if (h == NULL || h == (CUstream)(uintptr_t)1) return c->null_stream;
  if (h == (CUstream)(uintptr_t)2) {
    sim_misuse("%s: the per-thread default stream is not simulated", op);
    *err = CUDA_ERROR_NOT_SUPPORTED;
    return NULL;
  }
  sim_stream_t *s = (sim_stream_t *)h;
  if (!sim_valid_obj(s, MAGIC_STREAM)) {
    sim_misuse("%s: %p is not a stream", op, (void *)h);
    *err = CUDA_ERROR_INVALID_HANDLE;
    return NULL;
  }
  if (!s->alive) {
    sim_misuse("%s: stream %d of device %d was destroyed", op, s->agent, s->dev);
    *err = CUDA_ERROR_INVALID_HANDLE;
    return NULL;
  }
  if (s->ctx != c) {
    sim_misuse("%s: stream %d belongs to device %d but device %d's context is current", op, s->agent, s->dev, c->dev);
    *err = CUDA_ERROR_INVALID_HANDLE;
    return NULL;
  }
  return s;
}

sim_stream_t *sim_stream_for_dev(void *h, int dev, const char *what) {
  sim_ctx_t *c = sim_primary(dev);
  if (c == NULL) {
    sim_misuse("%s: device %d has no live primary context", what, dev);
    return NULL;
  }
  CUresult err;
  return sim_resolve_stream((CUstream)h, c, what, &err);
}

/* ---- the driver API ---- */

CUresult cuStreamCreate(CUstream *out, unsigned int flags) {
  ENTER(cuStreamCreate);
  CUresult err = CUDA_SUCCESS;
  sim_ctx_t *c = sim_need_ctx("cuStreamCreate", &err);
  if (!c) RETURN(err);
  if (!out || (flags & ~1u)) RETURN(CUDA_ERROR_INVALID_VALUE);
  *out = (CUstream)sim_stream_new(c, 0, !(flags & 1u)); /* 1 = CU_STREAM_NON_BLOCKING */
  g_live_streams++;
  RETURN(CUDA_SUCCESS);
}

CUresult cuStreamDestroy_v2(CUstream h) {
  ENTER(cuStreamDestroy_v2);
  sim_stream_t *s = (sim_stream_t *)h;
  if (!sim_valid_obj(s, MAGIC_STREAM) || s->legacy) {
    sim_misuse("cuStreamDestroy: %p is not a stream that can be destroyed", (void *)h);
    RETURN(CUDA_ERROR_INVALID_HANDLE);
  }
  if (!s->alive) {
    sim_misuse("cuStreamDestroy: stream %d destroyed twice", s->agent);
    RETURN(CUDA_ERROR_INVALID_HANDLE);
  }
  sim_stream_kill(s);
  g_live_streams--;
  RETURN(CUDA_SUCCESS);
}

/* An injected failure stands for a stream whose work failed: its copies to and from host memory never complete, and
 * their host buffers are the caller's again (holding undefined bytes), as the failure it reports says. */
CUresult cuStreamSynchronize(CUstream stream) {
  sim_lock();
  int inj = sim_enter(SIM_E_cuStreamSynchronize);
  if (inj) {
    sim_ctx_t *c = sim_current();
    sim_stream_t *s = (sim_stream_t *)stream;
    if (stream == NULL && c != NULL) s = c->null_stream;
    if (sim_valid_obj(s, MAGIC_STREAM)) sim_host_abandon(s->agent);
    sim_unlock();
    return (CUresult)inj;
  }
  CUresult err = CUDA_SUCCESS;
  sim_ctx_t *c = sim_need_ctx("cuStreamSynchronize", &err);
  if (!c) RETURN(err);
  sim_stream_t *s = sim_resolve_stream(stream, c, "cuStreamSynchronize", &err);
  if (!s) RETURN(err);
  host_sync_stream(s);
  RETURN(CUDA_SUCCESS);
}

CUresult cuStreamQuery(CUstream stream) {
  ENTER(cuStreamQuery);
  CUresult err = CUDA_SUCCESS;
  sim_ctx_t *c = sim_need_ctx("cuStreamQuery", &err);
  if (!c) RETURN(err);
  sim_stream_t *s = sim_resolve_stream(stream, c, "cuStreamQuery", &err);
  if (!s) RETURN(err);
  host_sync_stream(s); /* work is eager: always complete, and the host now knows it */
  RETURN(CUDA_SUCCESS);
}

CUresult cuEventCreate(CUevent *out, unsigned int flags) {
  ENTER(cuEventCreate);
  CUresult err = CUDA_SUCCESS;
  sim_ctx_t *c = sim_need_ctx("cuEventCreate", &err);
  if (!c) RETURN(err);
  if (!out || (flags & ~7u)) RETURN(CUDA_ERROR_INVALID_VALUE);
  sim_event_t *e = calloc(1, sizeof *e);
  e->magic = MAGIC_EVENT;
  e->ctx = c;
  e->alive = 1;
  sim_track(e);
  g_live_events++;
  *out = (CUevent)e;
  RETURN(CUDA_SUCCESS);
}

static sim_event_t *live_event(CUevent h, const char *op, CUresult *err) {
  sim_event_t *e = (sim_event_t *)h;
  if (!sim_valid_obj(e, MAGIC_EVENT)) {
    sim_misuse("%s: %p is not an event", op, (void *)h);
    *err = CUDA_ERROR_INVALID_HANDLE;
    return NULL;
  }
  if (!e->alive) {
    sim_misuse("%s: the event was destroyed", op);
    *err = CUDA_ERROR_INVALID_HANDLE;
    return NULL;
  }
  return e;
}

CUresult cuEventRecord(CUevent ev, CUstream stream) {
  ENTER(cuEventRecord);
  CUresult err = CUDA_SUCCESS;
  sim_event_t *e = live_event(ev, "cuEventRecord", &err);
  if (!e) RETURN(err);
  sim_ctx_t *c = sim_need_ctx("cuEventRecord", &err);
  if (!c) RETURN(err);
  if (e->ctx != c) {
    sim_misuse("cuEventRecord: the event belongs to device %d but device %d's context is current", e->ctx->dev, c->dev);
    RETURN(CUDA_ERROR_INVALID_HANDLE);
  }
  sim_stream_t *s = sim_resolve_stream(stream, c, "cuEventRecord", &err);
  if (!s) RETURN(err);
  sim_op_t op;
  sim_op_begin(&op, s, "cuEventRecord", c->dev);
  if (!e->vc) e->vc = vc_new();
  memcpy(e->vc, s->vc, sizeof(uint32_t) * SIM_MAX_AGENTS);
  e->recorded = 1;
  RETURN(CUDA_SUCCESS);
}

CUresult cuEventDestroy_v2(CUevent ev) {
  ENTER(cuEventDestroy_v2);
  CUresult err = CUDA_SUCCESS;
  sim_event_t *e = live_event(ev, "cuEventDestroy", &err);
  if (!e) RETURN(err);
  e->alive = 0;
  free(e->vc);
  e->vc = NULL;
  g_live_events--;
  RETURN(CUDA_SUCCESS);
}

CUresult cuEventSynchronize(CUevent ev) {
  ENTER(cuEventSynchronize);
  CUresult err = CUDA_SUCCESS;
  sim_event_t *e = live_event(ev, "cuEventSynchronize", &err);
  if (!e) RETURN(err);
  if (e->recorded) sim_host_sync(e->vc);
  RETURN(CUDA_SUCCESS);
}

CUresult cuEventQuery(CUevent ev) {
  ENTER(cuEventQuery);
  CUresult err = CUDA_SUCCESS;
  sim_event_t *e = live_event(ev, "cuEventQuery", &err);
  if (!e) RETURN(err);
  if (e->recorded) sim_host_sync(e->vc);
  RETURN(CUDA_SUCCESS);
}

CUresult cuStreamWaitEvent(CUstream stream, CUevent ev, unsigned int flags) {
  ENTER(cuStreamWaitEvent);
  CUresult err = CUDA_SUCCESS;
  sim_event_t *e = live_event(ev, "cuStreamWaitEvent", &err);
  if (!e) RETURN(err);
  sim_ctx_t *c = sim_need_ctx("cuStreamWaitEvent", &err);
  if (!c) RETURN(err);
  sim_stream_t *s = sim_resolve_stream(stream, c, "cuStreamWaitEvent", &err);
  if (!s) RETURN(err);
  if (flags != 0) RETURN(CUDA_ERROR_INVALID_VALUE);
  if (e->recorded) {
    sim_op_t op;
    sim_op_begin(&op, s, "cuStreamWaitEvent", c->dev);
    sim_vc_join(s->vc, e->vc);
  }
  RETURN(CUDA_SUCCESS);
}
