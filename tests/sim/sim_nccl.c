/* The simulated NCCL (libnccl.so.2) over the simulated driver's devices: communicators of N ranks from
 * ncclCommInitAll, groups, broadcast and sum-reduce executed when the group closes, with each rank's accesses
 * checked on its own stream like any other device work. As the real library may, its calls leave another device's
 * context current on the calling thread; group state is per thread, and two threads whose grouped calls interleave
 * on one device are recorded (real NCCL can deadlock there). Asynchronous errors can be injected
 * (simgpu_nccl_break), and a collective or group that fails with an error of the library, the CUDA runtime or a
 * peer leaves its communicators broken the same way; a broken communicator stays broken until it is aborted: it must
 * never carry another collective, and destroying it (which waits for its work) may hang. It also stands in for
 * PyTorch's c10::cuda::getFreeMutex, and checks that the mutex is held around every multi-device group. */

#include "sim.h"

#include "fastdp.h"

#include <pthread.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <stdlib.h>
#include <string.h>

#define MAGIC_COMM 0x434f4d4du
#define MAX_PENDING 1024

typedef struct clique {
  int n;
} clique_t;

struct ncclComm {
  uint32_t magic;
  clique_t *clique;
  int rank, nranks, dev;
  int alive;
  sim_ctx_t *ctx; /* the device's primary context when the communicator was made (NULL: none was alive) */
  ncclResult_t async_error; /* injected by simgpu_nccl_break */
  char last_error[256];
};

typedef struct pending {
  struct ncclComm *comm;
  int reduce;
  const void *send;
  void *recv;
  size_t count;
  ncclDataType_t type;
  int root;
  void *stream;
} pending_t;

static __thread int t_group_depth;
static __thread int t_group_error;
static __thread pending_t t_pending[MAX_PENDING];
static __thread int t_npending;

static struct ncclComm **g_all; /* every communicator made, dead ones included */
static size_t g_nall, g_capall;

/* The thread whose open group holds pending calls on a device (identified by its group-depth variable), or NULL. */
static const int *g_group_owner[SIM_MAX_DEVICES];

/* ---- PyTorch's allocator free mutex ---- */

static pthread_mutex_t g_free_mutex = PTHREAD_MUTEX_INITIALIZER;
static int g_free_mutex_asked;

/* c10::cuda::getFreeMutex() as libc10_cuda.so exports it (a std::mutex is a pthread mutex underneath). */
void *_ZN3c104cuda12getFreeMutexEv(void) {
  sim_lock();
  g_free_mutex_asked = 1;
  sim_unlock();
  return &g_free_mutex;
}

/* A multi-device group must run with the free mutex held by the calling thread, once the caller found it; with
 * SIMGPU_REQUIRE_FREE_MUTEX=1 (the harness made this symbol visible) it must have found it. */
static void check_free_mutex(const char *op, int nranks) {
  if (nranks < 2) return;
  if (!g_free_mutex_asked) {
    const char *req = getenv("SIMGPU_REQUIRE_FREE_MUTEX");
    if (req && *req == '1')
      sim_misuse("%s on %d ranks: the caller never looked up PyTorch's free mutex (c10::cuda::getFreeMutex)", op,
                 nranks);
    return;
  }
  if (g_free_mutex.__data.__owner != (int)syscall(SYS_gettid))
    sim_misuse("%s on %d ranks without PyTorch's free mutex held by the calling thread (a concurrent cudaFree can "
               "deadlock with the collective)", op, nranks);
}

/* As the real library may (it sets the runtime's device per communicator): another device's context is left
 * current on the calling thread, one of `devs` that is not current now. */
static void switch_context(const int *devs, int n) {
  sim_ctx_t *cur = sim_current();
  for (int i = n - 1; i >= 0; i--) {
    sim_ctx_t *c = sim_primary(devs[i]);
    if (c != NULL && c != cur) {
      sim_set_current(c);
      return;
    }
  }
}

static void release_groups(void) {
  for (int d = 0; d < SIM_MAX_DEVICES; d++)
    if (g_group_owner[d] == &t_group_depth) g_group_owner[d] = NULL;
}

#define ENTER(name) SIM_ENTER(ncclResult_t, name)
#define RETURN(v) SIM_RETURN(ncclResult_t, v)

int sim_nccl_comms_on(const sim_ctx_t *ctx) {
  int n = 0;
  for (size_t i = 0; i < g_nall; i++)
    if (g_all[i]->alive && g_all[i]->ctx == ctx) n++;
  return n;
}

static int type_size(ncclDataType_t t, int *fdp_dtype) {
  switch (t) {
  case ncclInt8: *fdp_dtype = FDP_DTYPE_I8; return 1;
  case ncclUint8: *fdp_dtype = FDP_DTYPE_U8; return 1;
  case ncclInt32:
  case ncclUint32: *fdp_dtype = FDP_DTYPE_I32; return 4;
  case ncclInt64:
  case ncclUint64: *fdp_dtype = FDP_DTYPE_I64; return 8;
  case ncclFloat16: *fdp_dtype = FDP_DTYPE_F16; return 2;
  case ncclFloat32: *fdp_dtype = FDP_DTYPE_F32; return 4;
  case ncclFloat64: *fdp_dtype = FDP_DTYPE_F64; return 8;
  case ncclBfloat16: *fdp_dtype = FDP_DTYPE_BF16; return 2;
  default: return 0;
  }
}

ncclResult_t ncclGetVersion(int *v) {
  ENTER(ncclGetVersion);
  if (!v) RETURN(ncclInvalidArgument);
  *v = 23007; /* 2.30.7 */
  RETURN(ncclSuccess);
}

const char *ncclGetErrorString(ncclResult_t r) {
  sim_lock();
  sim_enter(SIM_E_ncclGetErrorString);
  sim_unlock();
  switch (r) {
  case ncclSuccess: return "no error";
  case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
  case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
  case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
  case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
  case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
  case ncclRemoteError: return "remote process exited or there was a network error";
  case ncclInProgress: return "NCCL operation in progress";
  default: return "unknown result code";
  }
}

ncclResult_t ncclCommInitAll(ncclComm_t *comms, int ndev, const int *devlist) {
  ENTER(ncclCommInitAll);
  int n = sim_ndev();
  if (!comms || ndev < 1) {
    sim_misuse("ncclCommInitAll: bad arguments (ndev %d)", ndev);
    RETURN(ncclInvalidArgument);
  }
  for (int i = 0; i < ndev; i++) {
    int d = devlist ? devlist[i] : i;
    int dup = 0;
    for (int j = 0; j < i; j++)
      dup |= (devlist ? devlist[j] : j) == d;
    if (d < 0 || d >= n || dup) {
      sim_misuse("ncclCommInitAll: device %d is invalid or listed twice", d);
      RETURN(ncclInvalidArgument);
    }
  }
  /* The communicators live in the devices' primary contexts: the library must hold each itself (the client, as
   * PyTorch, may let go of its own), or a context dies under its communicators. */
  for (int i = 0; i < ndev; i++) {
    int d = devlist ? devlist[i] : i;
    if (!sim_library_holds(d))
      sim_misuse("ncclCommInitAll: device %d's primary context is not held by the library making the communicator "
                 "(only the client's references, or none): it can be destroyed under the communicator", d);
  }
  clique_t *cl = calloc(1, sizeof *cl);
  cl->n = ndev;
  for (int i = 0; i < ndev; i++) {
    struct ncclComm *c = calloc(1, sizeof *c);
    c->magic = MAGIC_COMM;
    c->clique = cl;
    c->rank = i;
    c->nranks = ndev;
    c->dev = devlist ? devlist[i] : i;
    c->alive = 1;
    c->ctx = sim_primary(c->dev);
    if (g_nall == g_capall) {
      g_capall = g_capall ? 2 * g_capall : 64;
      g_all = realloc(g_all, g_capall * sizeof *g_all);
    }
    g_all[g_nall++] = c;
    comms[i] = c;
    sim_comm_count(1);
  }
  int devs[SIM_MAX_DEVICES];
  for (int i = 0; i < ndev && i < SIM_MAX_DEVICES; i++)
    devs[i] = devlist ? devlist[i] : i;
  switch_context(devs, ndev < SIM_MAX_DEVICES ? ndev : SIM_MAX_DEVICES);
  RETURN(ncclSuccess);
}

static struct ncclComm *live_comm(ncclComm_t c, const char *op) {
  if (c == NULL || c->magic != MAGIC_COMM) {
    sim_misuse("%s: %p is not a communicator", op, (void *)c);
    return NULL;
  }
  if (!c->alive) {
    sim_misuse("%s: the communicator (rank %d, device %d) was destroyed", op, c->rank, c->dev);
    return NULL;
  }
  return c;
}

/* Errors after which a communicator cannot be trusted (its state, or a peer's, is lost): it keeps reporting the error
 * from ncclCommGetAsyncError until it is aborted. A call refused for its arguments breaks nothing. */
static int breaks_comm(ncclResult_t r) {
  return r == ncclUnhandledCudaError || r == ncclSystemError || r == ncclInternalError || r == ncclRemoteError;
}

static void break_comm(struct ncclComm *c, ncclResult_t r) {
  if (c != NULL && c->magic == MAGIC_COMM && c->alive && breaks_comm(r) && c->async_error == ncclSuccess)
    c->async_error = r;
}

static ncclResult_t comm_end(ncclComm_t comm, const char *op, int check_ctx) {
  struct ncclComm *c = live_comm(comm, op);
  if (!c) return ncclInvalidArgument;
  if (check_ctx && c->ctx != NULL && sim_primary(c->dev) != c->ctx) {
    sim_misuse("%s: device %d's primary context was released before its communicator was destroyed", op, c->dev);
  }
  for (int i = 0; i < t_npending; i++)
    if (t_pending[i].comm == c) sim_misuse("%s: the communicator has a collective pending in an open group", op);
  c->alive = 0;
  sim_comm_count(-1);
  switch_context(&c->dev, 1);
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  ENTER(ncclCommDestroy);
  if (comm != NULL && comm->magic == MAGIC_COMM && comm->alive && comm->async_error != ncclSuccess)
    sim_misuse("ncclCommDestroy on a communicator (rank %d, device %d) that reported asynchronous error %d: destroying "
               "waits for work that will never finish (real NCCL can hang); abort it", comm->rank, comm->dev,
               (int)comm->async_error);
  RETURN(comm_end(comm, "ncclCommDestroy", 1));
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  ENTER(ncclCommAbort);
  RETURN(comm_end(comm, "ncclCommAbort", 1));
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *state) {
  ENTER(ncclCommGetAsyncError);
  if (!live_comm(comm, "ncclCommGetAsyncError") || !state) RETURN(ncclInvalidArgument);
  *state = comm->async_error;
  RETURN(ncclSuccess);
}

const char *ncclGetLastError(ncclComm_t comm) {
  sim_lock();
  sim_enter(SIM_E_ncclGetLastError);
  const char *s = comm && comm->magic == MAGIC_COMM ? comm->last_error : "";
  sim_unlock();
  return s;
}

ncclResult_t ncclGroupStart(void) {
  ENTER(ncclGroupStart);
  if (t_group_depth++ == 0) {
    t_group_error = ncclSuccess;
    sim_group_count(1);
  }
  RETURN(ncclSuccess);
}

/* Runs collective j of a clique: ops[r] is rank r's call. */
static ncclResult_t execute(pending_t **ops, int n) {
  pending_t *p0 = ops[0];
  int dt = 0, es = type_size(p0->type, &dt);
  size_t bytes = p0->count * (size_t)es;
  for (int r = 0; r < n; r++) {
    if (ops[r]->reduce != p0->reduce || ops[r]->count != p0->count || ops[r]->type != p0->type ||
        ops[r]->root != p0->root) {
      sim_misuse("%s: the ranks' calls disagree (operation, count, type or root)",
                 p0->reduce ? "ncclReduce" : "ncclBroadcast");
      return ncclInvalidUsage;
    }
  }
  int root = p0->root;
  const char *name = p0->reduce ? "ncclReduce" : "ncclBroadcast";
  sim_stream_t *st[SIM_MAX_DEVICES];
  sim_op_t op[SIM_MAX_DEVICES];
  for (int r = 0; r < n; r++) {
    if (ops[r]->comm->ctx != NULL && sim_primary(ops[r]->comm->dev) != ops[r]->comm->ctx) {
      sim_misuse("%s: rank %d's device %d context was released after the communicator was made", name, r,
                 ops[r]->comm->dev);
      return ncclUnhandledCudaError;
    }
    st[r] = sim_stream_for_dev(ops[r]->stream, ops[r]->comm->dev, name);
    if (!st[r]) return ncclUnhandledCudaError;
    int need_send = p0->reduce || r == root, need_recv = !p0->reduce || r == root, d = ops[r]->comm->dev;
    if ((need_send && sim_ptr_device((CUdeviceptr)(uintptr_t)ops[r]->send) != d) ||
        (need_recv && sim_ptr_device((CUdeviceptr)(uintptr_t)ops[r]->recv) != d)) {
      sim_misuse("%s: rank %d runs on device %d but its buffer is not that device's memory", name, r, d);
      return ncclInvalidArgument;
    }
  }
  check_free_mutex(name, n);
  if (bytes == 0) return ncclSuccess;
  for (int r = 0; r < n; r++) {
    sim_op_begin(&op[r], st[r], name, ops[r]->comm->dev);
    int need_send = p0->reduce || r == root, need_recv = !p0->reduce || r == root;
    if ((need_send && !sim_check_range(&op[r], (CUdeviceptr)(uintptr_t)ops[r]->send, bytes)) ||
        (need_recv && !sim_check_range(&op[r], (CUdeviceptr)(uintptr_t)ops[r]->recv, bytes)))
      return ncclInvalidArgument;
  }
  if (!p0->reduce) {
    unsigned char *src = sim_access(&op[root], (CUdeviceptr)(uintptr_t)ops[root]->send, bytes, 0);
    unsigned char *tmp = malloc(bytes);
    if (!tmp) return ncclSystemError;
    memcpy(tmp, src, bytes);
    for (int r = 0; r < n; r++) {
      if (r != root) sim_vc_join(st[r]->vc, st[root]->vc); /* data flows from the root */
      if (r == root && ops[r]->recv == ops[r]->send) continue;
      memcpy(sim_access(&op[r], (CUdeviceptr)(uintptr_t)ops[r]->recv, bytes, 1), tmp, bytes);
    }
    free(tmp);
    return ncclSuccess;
  }
  /* Sum in rank order, rounding after every add. */
  unsigned char *acc = malloc(bytes);
  if (!acc) return ncclSystemError;
  for (int r = 0; r < n; r++) {
    unsigned char *h = sim_access(&op[r], (CUdeviceptr)(uintptr_t)ops[r]->send, bytes, 0);
    if (r == 0)
      memcpy(acc, h, bytes);
    else
      sim_add(dt, acc, h, (int64_t)p0->count);
  }
  for (int r = 0; r < n; r++)
    if (r != root) sim_vc_join(st[root]->vc, st[r]->vc);
  memcpy(sim_access(&op[root], (CUdeviceptr)(uintptr_t)ops[root]->recv, bytes, 1), acc, bytes);
  free(acc);
  return ncclSuccess;
}

/* Matches the pending calls clique by clique, rank by rank, and runs them. */
static ncclResult_t flush(void) {
  ncclResult_t res = ncclSuccess;
  int done[MAX_PENDING] = {0};
  for (int i = 0; i < t_npending; i++) {
    if (done[i]) continue;
    clique_t *cl = t_pending[i].comm->clique;
    /* The k-th call of each rank of this clique form the k-th collective. */
    for (;;) {
      pending_t *ops[SIM_MAX_DEVICES] = {0};
      int found = 0;
      for (int j = i; j < t_npending; j++) {
        if (done[j] || t_pending[j].comm->clique != cl || ops[t_pending[j].comm->rank]) continue;
        ops[t_pending[j].comm->rank] = &t_pending[j];
        done[j] = 1;
        found++;
      }
      if (found == 0) break;
      if (found != cl->n) {
        sim_misuse("%s: %d of %d ranks called it; real NCCL would hang",
                   t_pending[i].reduce ? "ncclReduce" : "ncclBroadcast", found, cl->n);
        res = ncclInvalidUsage;
        continue;
      }
      ncclResult_t r = execute(ops, cl->n);
      if (r != ncclSuccess && res == ncclSuccess) res = r;
    }
  }
  t_npending = 0;
  return res;
}

/* An injected failure of ncclGroupEnd still closes the group and drops its calls, as NCCL's does. */
ncclResult_t ncclGroupEnd(void) {
  sim_lock();
  int inj = sim_enter(SIM_E_ncclGroupEnd);
  if (t_group_depth == 0) {
    if (!inj) sim_misuse("ncclGroupEnd without ncclGroupStart");
    RETURN(inj ? (ncclResult_t)inj : ncclInvalidUsage);
  }
  if (--t_group_depth > 0) RETURN(inj ? (ncclResult_t)inj : ncclSuccess);
  sim_group_count(-1);
  release_groups();
  int devs[MAX_PENDING];
  int ndevs = 0;
  ncclResult_t failed = inj ? (ncclResult_t)inj : (ncclResult_t)t_group_error;
  for (int i = 0; i < t_npending; i++) {
    devs[ndevs++] = t_pending[i].comm->dev;
    break_comm(t_pending[i].comm, failed);
  }
  if (failed != ncclSuccess) { /* a call inside failed: the whole group is dropped */
    t_npending = 0;
    switch_context(devs, ndevs);
    RETURN(failed);
  }
  ncclResult_t r = flush();
  switch_context(devs, ndevs);
  RETURN(r);
}

/* An injected failure of a collective inside a group fails the group too, as a real failed call would, and leaves
 * its communicator broken when the error is one that loses its state. */
#define ENTER_COLLECTIVE(name)                                                                                         \
  sim_lock();                                                                                                          \
  do {                                                                                                                 \
    int inj_ = sim_enter(SIM_E_##name);                                                                                \
    if (inj_) {                                                                                                        \
      break_comm(comm, (ncclResult_t)inj_);                                                                            \
      if (t_group_depth > 0) t_group_error = inj_;                                                                     \
      sim_unlock();                                                                                                    \
      return (ncclResult_t)inj_;                                                                                       \
    }                                                                                                                  \
  } while (0)

/* Returns from a collective, then pauses inside the open group for half a millisecond, so that a group left open
 * to other threads' calls does get interleaved in the tests. */
#define YIELD_RETURN(v)                                                                                                \
  do {                                                                                                                 \
    ncclResult_t rv_ = (v);                                                                                            \
    int in_group_ = t_group_depth > 0;                                                                                 \
    sim_unlock();                                                                                                      \
    if (in_group_) usleep(500);                                                                                        \
    return rv_;                                                                                                        \
  } while (0)

static ncclResult_t post(pending_t p, const char *op) {
  struct ncclComm *c = live_comm(p.comm, op);
  int dt;
  ncclResult_t r = ncclSuccess;
  if (!c)
    r = ncclInvalidArgument;
  else if (!type_size(p.type, &dt) || p.root < 0 || p.root >= c->nranks) {
    sim_misuse("%s: bad datatype %d or root %d", op, (int)p.type, p.root);
    r = ncclInvalidArgument;
  } else if (t_npending == MAX_PENDING) {
    sim_misuse("%s: more than %d calls in one group", op, MAX_PENDING);
    r = ncclInvalidUsage;
  }
  if (r == ncclSuccess && c->async_error != ncclSuccess) {
    sim_misuse("%s on a communicator (rank %d, device %d) that reported asynchronous error %d: it must be aborted and "
               "rebuilt, never used again", op, c->rank, c->dev, (int)c->async_error);
    r = c->async_error;
  }
  if (r != ncclSuccess) {
    if (c) snprintf(c->last_error, sizeof c->last_error, "%s: invalid arguments", op);
    if (t_group_depth > 0) t_group_error = r;
    return r;
  }
  if (t_group_depth > 0) {
    const int *owner = g_group_owner[c->dev];
    if (owner != NULL && owner != &t_group_depth)
      sim_misuse("%s: grouped NCCL calls of two threads interleave on device %d (one lock must cover each whole "
                 "group, or the collectives can deadlock)", op, c->dev);
    g_group_owner[c->dev] = &t_group_depth;
    check_free_mutex(op, c->nranks);
  }
  t_pending[t_npending++] = p;
  if (t_group_depth > 0) return ncclSuccess;
  if (c->nranks > 1) sim_misuse("%s outside a group on a %d-rank communicator from one thread", op, c->nranks);
  return c->nranks > 1 ? ncclSuccess : flush();
}

ncclResult_t ncclBroadcast(const void *send, void *recv, size_t count, ncclDataType_t type, int root, ncclComm_t comm,
                           void *stream) {
  ENTER_COLLECTIVE(ncclBroadcast);
  YIELD_RETURN(post((pending_t){comm, 0, send, recv, count, type, root, stream}, "ncclBroadcast"));
}

ncclResult_t ncclReduce(const void *send, void *recv, size_t count, ncclDataType_t type, ncclRedOp_t op, int root,
                        ncclComm_t comm, void *stream) {
  ENTER_COLLECTIVE(ncclReduce);
  if (op != ncclSum) {
    sim_misuse("ncclReduce: only ncclSum is simulated");
    RETURN(ncclInvalidArgument);
  }
  YIELD_RETURN(post((pending_t){comm, 1, send, recv, count, type, root, stream}, "ncclReduce"));
}

/* Makes every live communicator on device `dev` (-1: on every device) report asynchronous error `code` from now on,
 * as a communicator whose peer failed does. Returns how many. */
int simgpu_nccl_break(int dev, int code) {
  sim_lock();
  int n = 0;
  for (size_t i = 0; i < g_nall; i++)
    if (g_all[i]->alive && (dev < 0 || g_all[i]->dev == dev)) {
      g_all[i]->async_error = (ncclResult_t)code;
      n++;
    }
  sim_unlock();
  return n;
}
