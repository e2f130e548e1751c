/* Host memory on the simulated GPU: asynchronous copies between host and device memory keep their host side in
 * use until the host learns that they completed (a synchronisation of their stream, event or context), as the
 * real driver allows for pinned memory. The model is the strict one for every host buffer, pageable included:
 *   - a device-to-host copy lands in host memory only at that point, so host code that reads the buffer earlier
 *     reads what was there before (and the bytes arrive later, over whatever it wrote);
 *   - a host-to-device copy reads the host bytes when it is enqueued, and the host must leave them alone until it
 *     completes: a change made before then is recorded as a race when the copy is found complete;
 *   - a test harness's own host access (simgpu_host_touch) while a copy still uses those bytes is a race.
 * Also here: simgpu_touch, a test harness's own device work on a stream of its choosing (the caller's stream). */

#include "sim.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct host_copy {
  unsigned char *host;  /* the host side */
  size_t n;
  unsigned char *bytes; /* d2h: the bytes to deliver; h2d: the bytes the copy read */
  int to_host;
  int agent;            /* the stream that runs it, and its clock at the copy */
  uint32_t clock;
  char what[64];
} host_copy_t;

static host_copy_t *g_copies;
static size_t g_ncopies, g_capcopies;

void sim_host_copy_begin(const sim_op_t *op, void *host, const void *bytes, size_t n, int to_host) {
  if (g_ncopies == g_capcopies) {
    g_capcopies = g_capcopies ? 2 * g_capcopies : 64;
    g_copies = realloc(g_copies, g_capcopies * sizeof *g_copies);
  }
  host_copy_t *c = &g_copies[g_ncopies++];
  memset(c, 0, sizeof *c);
  c->host = host;
  c->n = n;
  c->bytes = malloc(n ? n : 1);
  memcpy(c->bytes, bytes, n);
  c->to_host = to_host;
  c->agent = op->stream->agent;
  c->clock = op->stream->vc[op->stream->agent];
  snprintf(c->what, sizeof c->what, "%s", op->name);
}

/* Completes every copy the host now knows to be finished, in the order they were enqueued. */
void sim_host_retire(const uint32_t *host_vc) {
  size_t kept = 0;
  for (size_t i = 0; i < g_ncopies; i++) {
    host_copy_t *c = &g_copies[i];
    if (host_vc[c->agent] < c->clock) {
      g_copies[kept++] = *c;
      continue;
    }
    if (c->to_host)
      memcpy(c->host, c->bytes, c->n);
    else if (memcmp(c->host, c->bytes, c->n) != 0)
      sim_race("race: host memory [%p, +%zu) changed while %s was still reading it (the host may reuse the source "
               "of an asynchronous copy only after synchronising its stream)", (void *)c->host, c->n, c->what);
    free(c->bytes);
  }
  g_ncopies = kept;
}

/* Drops the copies of a stream whose work failed: they will never complete. */
void sim_host_abandon(int agent) {
  size_t kept = 0;
  for (size_t i = 0; i < g_ncopies; i++) {
    if (g_copies[i].agent == agent)
      free(g_copies[i].bytes);
    else
      g_copies[kept++] = g_copies[i];
  }
  g_ncopies = kept;
}

static int overlaps(const host_copy_t *c, const unsigned char *p, size_t n) {
  return p < c->host + c->n && c->host < p + n;
}

/* A test harness's host access to [p, p + n), right after an operation returned: it must be safe. */
void simgpu_host_touch(const void *p, size_t n, int write) {
  sim_lock();
  for (size_t i = 0; i < g_ncopies; i++) {
    host_copy_t *c = &g_copies[i];
    if (!overlaps(c, p, n) || (!write && !c->to_host)) continue;
    sim_race("race: the host %s [%p, +%zu) while %s still %s it (no synchronisation with its stream)",
             write ? "writes" : "reads", p, n, c->what, c->to_host ? "writes" : "reads");
    break;
  }
  sim_unlock();
}

/* A test harness's own device work: a write (or read) of [p, p + n) on `stream` of device `dev` (NULL: the legacy
 * stream), as the caller's kernel producing a source just before an operation, or consuming a result (or reusing a
 * source) just after it, would be. Checked and recorded like any other access. Returns 0, or -1 after a misuse. */
int simgpu_touch(void *stream, int dev, unsigned long long p, size_t n, int write) {
  sim_lock();
  sim_stream_t *s = sim_stream_for_dev(stream, dev, "simgpu_touch");
  int ok = 0;
  if (s != NULL) {
    sim_op_t op;
    sim_op_begin(&op, s, write ? "the caller's write on its stream" : "the caller's read on its stream", dev);
    ok = sim_access(&op, (CUdeviceptr)p, n, write) != NULL;
  }
  sim_unlock();
  return ok ? 0 : -1;
}
