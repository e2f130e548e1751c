/* SPDX-License-Identifier: MIT */
/* The cuda backend's copies: strided copies between CUDA tensors on any devices, and between host memory and a
 * device, through the driver API, ordered on the streams the caller lists. The copy engines run every layout they
 * can (flat, rows); the strided-copy kernel runs the rest on one device, and cross-device or host copies of other
 * layouts are staged through flat buffers (scratch memory, or host memory for the host side). */
#include "backend/cuda/copy.h"

#include "backend/cuda/kernel_module.h"
#include "backend/cuda/kernels.h"
#include "backend/cuda/layout.h"
#include "backend/cuda/scratch.h"
#include "dl/cuda_driver.h"

#include <assert.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Same-device 2D copies narrower than this per row, or with more outer rows than MEMCPY_MAX_LOOP, go to the
 * kernel: the copy engines are slow on short rows, and each cuMemcpy call costs microseconds of CPU. */
#define MEMCPY2D_MIN_ROW 512
#define MEMCPY_MAX_LOOP 64
/* Cross-device copies have no kernel alternative short of staging, so they loop longer before staging. */
#define PEER_MAX_LOOP 1024

_Static_assert(sizeof(fdp_copy_args_t) == 16 + 3 * 8 * FDP_COPY_MAX_DIMS, "kernel ABI: fdp_copy_args_t");

/* ---- stream ordering ---- */

/* Makes stream `to` (device to_dev) wait for everything enqueued so far on `from` (device from_dev). The event
 * is destroyed right after the wait is enqueued: legal, the driver defers the release until it completes.
 * `release` (may be NULL), scratch memory of to_dev on `to`, is freed as soon as the wait is enqueued (so behind
 * everything on `from` so far), while to_dev's context is current; it stays held when the wait could not be
 * enqueued. */
static fdp_result_t stream_wait(const fdp_cu_t *cu, int from_dev, CUstream from, int to_dev, CUstream to,
                                fdp_cuda_scratch_t *release) {
  CUevent ev = NULL;
  fdp_result_t r = FDP_OK;
  FDP_CHECK(fdp__cu_ctx_push(from_dev, NULL));
  FDP_CHECK_GOTO(fdp__cu_check(cu->EventCreate(&ev, CU_EVENT_DISABLE_TIMING), "cuEventCreate", from_dev), r, out);
  FDP_CHECK_GOTO(fdp__cu_check(cu->EventRecord(ev, from), "cuEventRecord", from_dev), r, out);
  /* A stream may wait on another device's event; its own context must be current (NULL = its default). */
  FDP_CHECK_GOTO(fdp__cu_ctx_push(to_dev, NULL), r, out);
  r = fdp__cu_check(cu->StreamWaitEvent(to, ev, 0), "cuStreamWaitEvent", to_dev);
  if (r == FDP_OK && release != NULL) r = fdp__cuda_scratch_free(cu, release);
  FDP_CHECK_KEEP(fdp__cu_ctx_pop(to_dev), r);
out:
  if (ev != NULL) FDP_CHECK_KEEP(fdp__cu_check(cu->EventDestroy(ev), "cuEventDestroy", from_dev), r);
  FDP_CHECK_KEEP(fdp__cu_ctx_pop(from_dev), r);
  return r;
}

/* Enqueues the strided-copy kernel on `stream`; the context of `dev` must be current. */
static fdp_result_t kernel_copy(const fdp_cu_t *cu, int dev, CUstream stream, fdp_pair_t p) {
  const fdp_kmodule_t *m = NULL;
  fdp_result_t r = fdp__kmodule_get(cu, dev, &m);
  if (r == FDP_UNAVAILABLE) return fdp__kmodule_needed("this copy's layout needs the strided-copy kernel");
  if (r != FDP_OK) return r;
  fdp__pair_for_kernel(&p);
  fdp_copy_args_t a;
  memset(&a, 0, sizeof a);
  a.numel = p.numel;
  a.ndim = p.ndim;
  for (int d = 0; d < p.ndim; d++) {
    a.sizes[d] = p.sizes[d];
    a.src_strides[d] = p.ss[d];
    a.dst_strides[d] = p.ds[d];
  }
  void *params[] = {&p.src, &p.dst, &a};
  return fdp__cu_check(cu->LaunchKernel(m->copy[fdp__pair_es_index(p.es)], fdp__kmodule_grid(m, p.numel), 1, 1,
                                        FDP_KERNEL_THREADS, 1, 1, 0, stream, params, NULL),
                       "cuLaunchKernel(strided copy)", dev);
}

/* ---- on one device ---- */

static fdp_result_t copy_same_device(const fdp_cu_t *cu, int dev, CUstream stream, const fdp_pair_t *p) {
  size_t width, height, spitch, dpitch;
  int64_t outer;
  if (fdp__pair_src_flat(p) && fdp__pair_dst_flat(p))
    return fdp__cu_check(cu->MemcpyAsync(p->dst, p->src, (size_t)(p->numel * p->es), stream), "cuMemcpyAsync", dev);
  if (fdp__pair_rows(p, &width, &height, &spitch, &dpitch, &outer) && width >= MEMCPY2D_MIN_ROW &&
      outer <= MEMCPY_MAX_LOOP) {
    int64_t idx[FDP_COPY_MAX_DIMS] = {0};
    for (int64_t it = 0; it < outer; it++) {
      int64_t so, dof;
      fdp__pair_outer_next(p, idx, &so, &dof);
      CUDA_MEMCPY2D c;
      memset(&c, 0, sizeof c);
      c.srcMemoryType = CU_MEMORYTYPE_DEVICE;
      c.srcDevice = p->src + (CUdeviceptr)so;
      c.srcPitch = spitch;
      c.dstMemoryType = CU_MEMORYTYPE_DEVICE;
      c.dstDevice = p->dst + (CUdeviceptr)dof;
      c.dstPitch = dpitch;
      c.WidthInBytes = width;
      c.Height = height;
      FDP_CHECK(fdp__cu_check(cu->Memcpy2DAsync(&c, stream), "cuMemcpy2DAsync", dev));
    }
    return FDP_OK;
  }
  return kernel_copy(cu, dev, stream, *p);
}

/* The destination-side part of a cross-device copy, on the destination's stream with its context current.
 * `src` is the source or its packed staging buffer (then flat). Peer copies name both contexts explicitly
 * (cuMemcpyPeerAsync / cuMemcpy3DPeerAsync): that is the documented cross-context path, and the driver picks
 * P2P or a host bounce itself, whether or not peer access was enabled. cuMemcpy2DAsync with unified addresses
 * would usually work too, but its cross-context behaviour is not documented. */
static fdp_result_t copy_peer_rows(const fdp_cu_t *cu, int ddev, CUstream stream, const fdp_pair_t *p, CUcontext sctx,
                                   CUcontext dctx) {
  size_t width, height, spitch, dpitch;
  int64_t outer;
  if (fdp__pair_src_flat(p) && fdp__pair_dst_flat(p))
    return fdp__cu_check(cu->MemcpyPeerAsync(p->dst, dctx, p->src, sctx, (size_t)(p->numel * p->es), stream),
                         "cuMemcpyPeerAsync", ddev);
  if (!fdp__pair_rows(p, &width, &height, &spitch, &dpitch, &outer))
    return fdp__fail(FDP_INTERNAL, "cuda backend: peer copy of a layout without rows");
  int64_t idx[FDP_COPY_MAX_DIMS] = {0};
  for (int64_t it = 0; it < outer; it++) {
    int64_t so, dof;
    fdp__pair_outer_next(p, idx, &so, &dof);
    CUDA_MEMCPY3D_PEER c;
    memset(&c, 0, sizeof c);
    c.srcMemoryType = CU_MEMORYTYPE_DEVICE;
    c.srcDevice = p->src + (CUdeviceptr)so;
    c.srcContext = sctx;
    c.srcPitch = spitch;
    c.srcHeight = height;
    c.dstMemoryType = CU_MEMORYTYPE_DEVICE;
    c.dstDevice = p->dst + (CUdeviceptr)dof;
    c.dstContext = dctx;
    c.dstPitch = dpitch;
    c.dstHeight = height;
    c.WidthInBytes = width;
    c.Height = height;
    c.Depth = 1;
    FDP_CHECK(fdp__cu_check(cu->Memcpy3DPeerAsync(&c, stream), "cuMemcpy3DPeerAsync", ddev));
  }
  return FDP_OK;
}

/* Copies between a pair's destination-ordered view and a flat staging buffer `buf` on `dev` with the strided-copy
 * kernel: pack (view → buf) or unpack (buf → view). The context of `dev` must be current. */
static fdp_result_t stage_kernel(const fdp_cu_t *cu, int dev, CUstream stream, const fdp_pair_t *p, CUdeviceptr buf,
                                 int pack) {
  fdp_pair_t q = *p;
  if (pack) {
    fdp__pair_flat_strides(p, q.ds);
    q.dst = buf;
  } else {
    fdp__pair_flat_strides(p, q.ss);
    q.src = buf;
  }
  fdp__pair_merge(&q);
  return kernel_copy(cu, dev, stream, q);
}

/* ---- between two devices ---- */

/* One cross-device copy in flight: the devices, their streams and contexts, and the staging buffers. */
typedef struct peer_copy {
  const fdp_pair_t *p;
  int sdev, ddev;
  CUstream sstream, dstream;
  CUcontext sctx, dctx;
  int staged; /* neither flat nor rows: go through flat staging buffers */
  size_t bytes;
  fdp_cuda_scratch_t ta; /* on the source, the packed source (held until the source stream has waited for the copy) */
  fdp_cuda_scratch_t tb; /* on the destination, to unpack from (destination stream only) */
  fdp_pair_t flat;       /* the transfer itself: between the staging buffers, or the views themselves */
} peer_copy_t;

/* Packs a strided source into ta on the source device, on the source stream. ta is not held on failure
 * unless only the final context pop failed (the caller frees it then). */
static fdp_result_t peer_pack(const fdp_cu_t *cu, peer_copy_t *x) {
  fdp_result_t r = FDP_OK;
  FDP_CHECK(fdp__cu_ctx_push(x->sdev, NULL));
  FDP_CHECK_GOTO(fdp__cuda_scratch_alloc(cu, x->sdev, x->sstream, x->bytes, "staging for a strided peer copy", &x->ta),
                 r, out);
  FDP_CHECK_GOTO(stage_kernel(cu, x->sdev, x->sstream, x->p, x->ta.ptr, 1), r, fail);
out:
  FDP_CHECK_KEEP(fdp__cu_ctx_pop(x->sdev), r);
  return r;
fail: /* nothing but the pack (ordered on sstream) touched ta */
  FDP_CHECK_KEEP(fdp__cuda_scratch_free(cu, &x->ta), r);
  goto out;
}

/* On the destination stream, with the destination's context current: the transfer, then the unpack from tb when
 * the destination is strided. tb is freed on that stream after them, whatever happened. */
static fdp_result_t peer_transfer(const fdp_cu_t *cu, peer_copy_t *x) {
  fdp_result_t r = FDP_OK;
  if (x->staged && !fdp__pair_dst_flat(x->p)) {
    FDP_CHECK_GOTO(
        fdp__cuda_scratch_alloc(cu, x->ddev, x->dstream, x->bytes, "staging for a strided peer copy", &x->tb), r, out);
    x->flat.dst = x->tb.ptr;
  }
  FDP_CHECK_GOTO(copy_peer_rows(cu, x->ddev, x->dstream, &x->flat, x->sctx, x->dctx), r, out);
  if (x->tb.ptr) FDP_CHECK_GOTO(stage_kernel(cu, x->ddev, x->dstream, x->p, x->tb.ptr, 0), r, out);
out:
  FDP_CHECK_KEEP(fdp__cuda_scratch_free(cu, &x->tb), r);
  return r;
}

/* The source stream waits for the destination stream (something there may read the source or ta now, even after
 * a failure), and ta is freed behind that wait. When the fence fails, the destination stream is waited for on the
 * host instead: *drained says that worked (nothing reads the source or ta any more); otherwise ta is leaked
 * rather than freed early. */
static fdp_result_t peer_fence_back(const fdp_cu_t *cu, peer_copy_t *x, int *drained) {
  *drained = 0;
  fdp_result_t r = stream_wait(cu, x->ddev, x->dstream, x->sdev, x->sstream, x->ta.ptr ? &x->ta : NULL);
  if (r == FDP_OK) return r;
  fdp_result_t rs = FDP_OK;
  int held = fdp__detail_hold(1); /* the failed fence is what the caller reports */
  FDP_CHECK_GOTO(fdp__cu_ctx_push(x->ddev, NULL), rs, out);
  FDP_CHECK_KEEP(fdp__cu_check(cu->StreamSynchronize(x->dstream), "cuStreamSynchronize", x->ddev), rs);
  FDP_CHECK_IGNORE(fdp__cu_ctx_pop(x->ddev));
out:
  fdp__detail_release(held);
  *drained = rs == FDP_OK;
  if (!*drained)
    fdp__log("cuda copy: device %d may still read device %d's memory after a failed fence", x->ddev, x->sdev);
  return r;
}

/* Frees ta on the source stream once nothing beyond the pack (or only finished work) reads it. */
static void peer_release_unread(const fdp_cu_t *cu, peer_copy_t *x) {
  if (x->ta.ptr && fdp__cu_ctx_push(x->sdev, NULL) == FDP_OK) {
    FDP_CHECK_IGNORE(fdp__cuda_scratch_free(cu, &x->ta));
    FDP_CHECK_IGNORE(fdp__cu_ctx_pop(x->sdev));
  }
  if (x->ta.ptr) fdp__log("cuda copy: leaking a %zu-byte staging buffer on device %d", x->bytes, x->sdev);
}

/* A copy between two devices, on the destination's stream, fenced both ways against the source's stream:
 * the copy starts after the work already queued there (which produced the source), and the source stream
 * waits for the copy, so PyTorch's allocator cannot hand the source to new work while it is still read.
 * Layouts the copy engines cannot do are staged: packed into a flat buffer on the source device (kernel on
 * the source stream), copied flat, and unpacked on the destination device (kernel); the staging buffers are
 * scratch memory (see NOTE [scratch memory]). Peer access from the destination's context (the one that runs
 * the copy) to the source's is enabled first where the hardware allows, so that the copy goes P2P. */
static fdp_result_t copy_cross_device(const fdp_cu_t *cu, int sdev, int ddev, const fdp_streams_t *streams,
                                      const fdp_pair_t *p) {
  peer_copy_t x;
  memset(&x, 0, sizeof x);
  x.p = p;
  x.sdev = sdev;
  x.ddev = ddev;
  x.sstream = (CUstream)fdp__stream_for(streams, sdev);
  x.dstream = (CUstream)fdp__stream_for(streams, ddev);
  x.bytes = (size_t)(p->numel * p->es);
  x.flat = *p;
  FDP_CHECK(fdp__cu_ctx_get(sdev, &x.sctx));
  FDP_CHECK(fdp__cu_ctx_get(ddev, &x.dctx));
  FDP_CHECK(fdp__cu_peer_enable(ddev, sdev, NULL));
  size_t width, height, spitch, dpitch;
  int64_t outer = 0;
  int rows = fdp__pair_rows(p, &width, &height, &spitch, &dpitch, &outer) && outer <= PEER_MAX_LOOP;
  x.staged = !(fdp__pair_src_flat(p) && fdp__pair_dst_flat(p)) && !rows;
  fdp_result_t r = FDP_OK;
  if (x.staged && !fdp__pair_src_flat(p)) FDP_CHECK_GOTO(peer_pack(cu, &x), r, unread);
  if (x.staged) {
    x.flat.ndim = 1;
    x.flat.sizes[0] = p->numel;
    x.flat.ss[0] = x.flat.ds[0] = 1;
    x.flat.src = x.ta.ptr ? x.ta.ptr : p->src;
  }
  FDP_CHECK_GOTO(stream_wait(cu, sdev, x.sstream, ddev, x.dstream, NULL), r, unread);
  FDP_CHECK_GOTO(fdp__cu_ctx_push(ddev, NULL), r, unread);
  r = peer_transfer(cu, &x);
  FDP_CHECK_KEEP(fdp__cu_ctx_pop(ddev), r);
  int drained;
  FDP_CHECK_KEEP(peer_fence_back(cu, &x, &drained), r);
  if (drained) goto unread;
  if (x.ta.ptr)
    fdp__log("cuda copy: leaking a %zu-byte staging buffer on device %d after a failed fence", x.bytes, sdev);
  return r;
unread:
  peer_release_unread(cu, &x);
  return r;
}

/* ---- between host memory and one device ---- */

/* A host descriptor over a pair's index space (for the host backend's strided copy). */
static void host_view(fdp_tensor_t *t, uintptr_t addr, const fdp_pair_t *p, const int64_t *strides) {
  memset(t, 0, sizeof *t);
  t->data = (char *)addr;
  t->device = FDP_HOST;
  t->dtype = FDP_DTYPE_OTHER;
  t->elem_size = (int)p->es;
  t->ndim = p->ndim;
  for (int d = 0; d < p->ndim; d++) {
    t->sizes[d] = p->sizes[d];
    t->strides[d] = strides[d];
  }
}

/* One host/device copy in flight: the direction, the device, and where each side's flat bytes live. */
typedef struct host_copy {
  fdp_pair_t p;
  int h2d; /* host to device, else device to host */
  int dev;
  CUstream stream;
  size_t bytes;
  int64_t fs[FDP_COPY_MAX_DIMS]; /* flat strides of the staging buffers */
  int host_flat, dev_flat;       /* that side is flat: no staging buffer */
  void *hbuf;                    /* the flat host bytes: the host view itself or a malloc'ed buffer */
  CUdeviceptr dbuf;              /* the flat device bytes: the device view itself or ds */
  fdp_cuda_scratch_t ds;
  int undrained; /* the stream could not be synchronised: a transfer may still use hbuf */
} host_copy_t;

/* Packs (h2d) the strided host source into hbuf, or unpacks (d2h) hbuf into the strided host destination: host
 * memory on both sides, so the core routes it to the host backend. */
static fdp_result_t host_stage(const host_copy_t *x) {
  fdp_copy_t c;
  if (x->h2d) {
    host_view(&c.dst, (uintptr_t)x->hbuf, &x->p, x->fs);
    host_view(&c.src, (uintptr_t)x->p.src, &x->p, x->p.ss);
  } else {
    host_view(&c.dst, (uintptr_t)x->p.dst, &x->p, x->p.ds);
    host_view(&c.src, (uintptr_t)x->hbuf, &x->p, x->fs);
  }
  return fdp__route_copy(&c, 1, NULL);
}

/* The flat transfer between hbuf and dbuf, on the device's stream. */
static fdp_result_t host_transfer(const fdp_cu_t *cu, const host_copy_t *x) {
  if (x->h2d)
    return fdp__cu_check(cu->MemcpyHtoDAsync(x->dbuf, x->hbuf, x->bytes, x->stream), "cuMemcpyHtoDAsync", x->dev);
  return fdp__cu_check(cu->MemcpyDtoHAsync(x->hbuf, x->dbuf, x->bytes, x->stream), "cuMemcpyDtoHAsync", x->dev);
}

/* The device part, with the device's context current: a strided device side packed (d2h) or unpacked (h2d)
 * through scratch memory around the transfer. Returns with the stream finished, also after a failure: the caller
 * frees the host buffer next, so nothing enqueued may still use it. */
static fdp_result_t host_device_part(const fdp_cu_t *cu, host_copy_t *x) {
  fdp_result_t r = FDP_OK;
  if (!x->dev_flat) {
    FDP_CHECK_GOTO(fdp__cuda_scratch_alloc(cu, x->dev, x->stream, x->bytes,
                                           "staging for a strided copy between host and device", &x->ds),
                   r, out);
    x->dbuf = x->ds.ptr;
  }
  if (!x->h2d && !x->dev_flat) FDP_CHECK_GOTO(stage_kernel(cu, x->dev, x->stream, &x->p, x->dbuf, 1), r, out);
  FDP_CHECK_GOTO(host_transfer(cu, x), r, out);
  if (x->h2d && !x->dev_flat) FDP_CHECK_GOTO(stage_kernel(cu, x->dev, x->stream, &x->p, x->dbuf, 0), r, out);
out:
  FDP_CHECK_KEEP(fdp__cuda_scratch_free(cu, &x->ds), r); /* stream-ordered: after the work above */
  CUresult es = cu->StreamSynchronize(x->stream);
  x->undrained = es != CUDA_SUCCESS;
  FDP_CHECK_KEEP(fdp__cu_check(es, "cuStreamSynchronize", x->dev), r);
  return r;
}

/* Fills x for copy c: its pair, direction, device, stream and which sides are flat (no buffers yet). */
static void host_copy_init(const fdp_copy_t *c, const fdp_streams_t *streams, host_copy_t *x) {
  memset(x, 0, sizeof *x);
  fdp__pair_build(c, &x->p);
  x->h2d = c->src.device == FDP_HOST;
  x->dev = x->h2d ? c->dst.device : c->src.device;
  x->stream = (CUstream)fdp__stream_for(streams, x->dev);
  x->bytes = (size_t)(x->p.numel * x->p.es);
  fdp__pair_flat_strides(&x->p, x->fs);
  x->host_flat = x->h2d ? fdp__pair_src_flat(&x->p) : fdp__pair_dst_flat(&x->p);
  x->dev_flat = x->h2d ? fdp__pair_dst_flat(&x->p) : fdp__pair_src_flat(&x->p);
  x->dbuf = x->dev_flat ? (x->h2d ? x->p.dst : x->p.src) : 0;
}

/* Between host memory and one device, on that device's stream. The transfer itself is one flat
 * cuMemcpyHtoDAsync / cuMemcpyDtoHAsync; a strided host side is packed or unpacked on the host (a malloc'ed
 * buffer), a strided device side through a scratch buffer (see NOTE [scratch memory]) and the copy kernel. The
 * stream is synchronised before returning: host memory is complete (and reusable) when the call returns, as with
 * upstream's blocking copies to and from the CPU, whether or not the host memory is pinned. */
static fdp_result_t copy_host_device(const fdp_cu_t *cu, const fdp_copy_t *c, const fdp_streams_t *streams) {
  host_copy_t x;
  host_copy_init(c, streams, &x);
  if (x.p.numel == 0) return FDP_OK;
  x.hbuf = x.host_flat ? (void *)(uintptr_t)(x.h2d ? x.p.src : x.p.dst) : malloc(x.bytes);
  if (!x.hbuf) return fdp__fail(FDP_NOMEM, "cuda backend: no host memory for a %zu-byte staging buffer", x.bytes);
  fdp_result_t r = FDP_OK;
  if (x.h2d && !x.host_flat) FDP_CHECK_GOTO(host_stage(&x), r, out);
  FDP_CHECK_GOTO(fdp__cu_ctx_push(x.dev, NULL), r, out);
  r = host_device_part(cu, &x);
  FDP_CHECK_KEEP(fdp__cu_ctx_pop(x.dev), r);
  if (r == FDP_OK && !x.h2d && !x.host_flat) r = host_stage(&x);
out:
  if (!x.host_flat && !x.undrained)
    free(x.hbuf);
  else if (!x.host_flat)
    fdp__log("cuda copy: leaking a %zu-byte host staging buffer that a transfer may still use", x.bytes);
  return r;
}

fdp_result_t fdp__cuda_copy(const fdp_copy_t *copies, int n, const fdp_streams_t *streams) {
  const fdp_cu_t *cu;
  FDP_CHECK(fdp__cu_load(&cu, NULL));
  for (int i = 0; i < n; i++) {
    const fdp_copy_t *c = &copies[i];
    int sdev = c->src.device, ddev = c->dst.device;
    assert(c->src.ndim == c->dst.ndim && c->src.elem_size == c->dst.elem_size && c->dst.elem_size > 0);
    if (sdev == FDP_HOST && ddev == FDP_HOST)
      return fdp__fail(FDP_INTERNAL, "cuda backend: copy %d is host to host", i);
    if (sdev == FDP_HOST || ddev == FDP_HOST) {
      FDP_CHECK(copy_host_device(cu, c, streams));
      continue;
    }
    fdp_pair_t p;
    fdp__pair_build(c, &p);
    if (p.numel == 0) continue;
    fdp_result_t r;
    if (sdev == ddev) {
      CUstream stream = (CUstream)fdp__stream_for(streams, ddev);
      FDP_CHECK(fdp__cu_ctx_push(ddev, NULL));
      r = copy_same_device(cu, ddev, stream, &p);
      FDP_CHECK_KEEP(fdp__cu_ctx_pop(ddev), r);
    } else {
      r = copy_cross_device(cu, sdev, ddev, streams, &p);
    }
    if (r != FDP_OK) return r;
  }
  return FDP_OK;
}
