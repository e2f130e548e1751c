/* Copies on the simulated driver: flat, host to device, device to host, between peers, 2D, and 3D between peers.
 * Each runs at once, its device bytes checked and recorded on its stream as any access is; the host side of an
 * asynchronous copy is sim_host.c's. */

#include "sim_driver.h"

#include <string.h>

/* Checks a host pointer argument: it must not be a (fake) device address. */
static int host_ok(const void *h, const char *op) {
  if (h == NULL || sim_in_device_range(h)) {
    sim_misuse("%s: host pointer %p is %s", op, h, h ? "device memory" : "NULL");
    return 0;
  }
  return 1;
}

CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream) {
  ENTER(cuMemcpyAsync);
  CUresult err = CUDA_SUCCESS;
  sim_ctx_t *c = sim_need_ctx("cuMemcpyAsync", &err);
  if (!c) RETURN(err);
  sim_stream_t *s = sim_resolve_stream(stream, c, "cuMemcpyAsync", &err);
  if (!s) RETURN(err);
  if (bytes == 0) RETURN(CUDA_SUCCESS);
  sim_op_t op;
  sim_op_begin(&op, s, "cuMemcpyAsync", c->dev);
  op.any_peer = 1; /* unified addressing: the driver copies between any devices */
  if (!sim_check_range(&op, src, bytes) || !sim_check_range(&op, dst, bytes)) RETURN(CUDA_ERROR_INVALID_VALUE);
  unsigned char *sp = sim_access(&op, src, bytes, 0), *dp = sim_access(&op, dst, bytes, 1);
  memmove(dp, sp, bytes);
  RETURN(CUDA_SUCCESS);
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t bytes, CUstream stream) {
  ENTER(cuMemcpyHtoDAsync_v2);
  CUresult err = CUDA_SUCCESS;
  sim_ctx_t *c = sim_need_ctx("cuMemcpyHtoDAsync", &err);
  if (!c) RETURN(err);
  sim_stream_t *s = sim_resolve_stream(stream, c, "cuMemcpyHtoDAsync", &err);
  if (!s) RETURN(err);
  if (bytes == 0) RETURN(CUDA_SUCCESS);
  if (!host_ok(src, "cuMemcpyHtoDAsync")) RETURN(CUDA_ERROR_INVALID_VALUE);
  sim_op_t op;
  sim_op_begin(&op, s, "cuMemcpyHtoDAsync", c->dev);
  unsigned char *dp = sim_access(&op, dst, bytes, 1);
  if (!dp) RETURN(CUDA_ERROR_INVALID_VALUE);
  memcpy(dp, src, bytes);
  sim_host_copy_begin(&op, (void *)(uintptr_t)src, src, bytes, 0); /* the host bytes stay in use until it completes */
  RETURN(CUDA_SUCCESS);
}

CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t bytes, CUstream stream) {
  ENTER(cuMemcpyDtoHAsync_v2);
  CUresult err = CUDA_SUCCESS;
  sim_ctx_t *c = sim_need_ctx("cuMemcpyDtoHAsync", &err);
  if (!c) RETURN(err);
  sim_stream_t *s = sim_resolve_stream(stream, c, "cuMemcpyDtoHAsync", &err);
  if (!s) RETURN(err);
  if (bytes == 0) RETURN(CUDA_SUCCESS);
  if (!host_ok(dst, "cuMemcpyDtoHAsync")) RETURN(CUDA_ERROR_INVALID_VALUE);
  sim_op_t op;
  sim_op_begin(&op, s, "cuMemcpyDtoHAsync", c->dev);
  unsigned char *sp = sim_access(&op, src, bytes, 0);
  if (!sp) RETURN(CUDA_ERROR_INVALID_VALUE);
  sim_host_copy_begin(&op, dst, sp, bytes, 1); /* lands in host memory when the host learns it completed */
  RETURN(CUDA_SUCCESS);
}

static sim_ctx_t *peer_ctx(CUcontext h, const char *op) {
  sim_ctx_t *c = (sim_ctx_t *)h;
  if (!sim_valid_ctx(c) || !c->alive) {
    sim_misuse("%s: %p is not a live context", op, (void *)h);
    return NULL;
  }
  return c;
}

/* The device of a pointer that must be live device memory of context `c`. */
static int ptr_on(sim_op_t *op, CUdeviceptr p, const sim_ctx_t *c, const char *side) {
  int dev;
  sim_find_alloc(p, &dev);
  if (dev != c->dev) {
    sim_misuse("%s: the %s pointer 0x%llx is not memory of device %d, whose context was named", op->name, side,
               (unsigned long long)p, c->dev);
    return 0;
  }
  return 1;
}

/* A peer copy runs in the current context `c`; where the hardware has a peer path, that context must have peer
 * access enabled towards the other device (the direction matters: enabling it the other way round leaves this copy
 * to the driver's staging through host memory, a silent slow path). */
static void peer_direction(const sim_op_t *op, const sim_ctx_t *c, const sim_ctx_t *sc, const sim_ctx_t *dc) {
  int other = sc->dev != c->dev ? sc->dev : dc->dev;
  if (other == c->dev || sim_env_ll("SIMGPU_NO_PEER", 0) != 0 || c->peer[other]) return;
  sim_misuse("%s on device %d reaches device %d's memory without peer access enabled from device %d to device %d",
             op->name, c->dev, other, c->dev, other);
}

CUresult cuMemcpyPeerAsync(CUdeviceptr dst, CUcontext dctx, CUdeviceptr src, CUcontext sctx, size_t bytes,
                           CUstream stream) {
  ENTER(cuMemcpyPeerAsync);
  CUresult err = CUDA_SUCCESS;
  sim_ctx_t *c = sim_need_ctx("cuMemcpyPeerAsync", &err);
  if (!c) RETURN(err);
  sim_stream_t *s = sim_resolve_stream(stream, c, "cuMemcpyPeerAsync", &err);
  if (!s) RETURN(err);
  sim_ctx_t *dc = peer_ctx(dctx, "cuMemcpyPeerAsync"), *sc = peer_ctx(sctx, "cuMemcpyPeerAsync");
  if (!dc || !sc) RETURN(CUDA_ERROR_INVALID_CONTEXT);
  if (bytes == 0) RETURN(CUDA_SUCCESS);
  sim_op_t op;
  sim_op_begin(&op, s, "cuMemcpyPeerAsync", c->dev);
  op.any_peer = 1;
  if (!ptr_on(&op, dst, dc, "destination") || !ptr_on(&op, src, sc, "source") || !sim_check_range(&op, src, bytes) ||
      !sim_check_range(&op, dst, bytes))
    RETURN(CUDA_ERROR_INVALID_VALUE);
  peer_direction(&op, c, sc, dc);
  unsigned char *sp = sim_access(&op, src, bytes, 0), *dp = sim_access(&op, dst, bytes, 1);
  memmove(dp, sp, bytes);
  RETURN(CUDA_SUCCESS);
}

/* One side of a 2D/3D copy: host or device, with its base address. */
typedef struct side {
  int host;
  uintptr_t addr;
  size_t pitch, row_stride_rows; /* pitch in bytes; rows per slice (3D) */
} side_t;

static int side_of(sim_op_t *op, CUmemorytype t, const void *h, CUdeviceptr d, const char *what, side_t *out) {
  if (t == CU_MEMORYTYPE_HOST) {
    if (!host_ok(h, op->name)) return 0;
    out->host = 1;
    out->addr = (uintptr_t)h;
    return 1;
  }
  if (t == CU_MEMORYTYPE_DEVICE || t == CU_MEMORYTYPE_UNIFIED) {
    int dev;
    sim_find_alloc(d, &dev);
    out->host = dev < 0 && t == CU_MEMORYTYPE_UNIFIED;
    out->addr = (uintptr_t)d;
    return 1;
  }
  sim_misuse("%s: %s memory type %d is not simulated", op->name, what, (int)t);
  return 0;
}

/* Copies `height` rows of `width` bytes per slice, `depth` slices. */
static CUresult rows_copy(sim_op_t *op, side_t *s, side_t *d, size_t width, size_t height, size_t depth) {
  if (width == 0 || height == 0 || depth == 0) return CUDA_SUCCESS;
  if ((s->pitch < width && height > 1) || (d->pitch < width && height > 1)) {
    sim_misuse("%s: pitch smaller than the row width", op->name);
    return CUDA_ERROR_INVALID_VALUE;
  }
  /* Validate every row first so that a bad copy changes nothing. */
  for (int pass = 0; pass < 2; pass++) {
    for (size_t z = 0; z < depth; z++)
      for (size_t y = 0; y < height; y++) {
        uintptr_t so = s->addr + (z * s->row_stride_rows + y) * s->pitch;
        uintptr_t dof = d->addr + (z * d->row_stride_rows + y) * d->pitch;
        unsigned char *sp = (unsigned char *)so, *dp = (unsigned char *)dof;
        if (!s->host) sp = pass ? sim_access(op, so, width, 0) : sim_check_range(op, so, width);
        if (!d->host) dp = pass ? sim_access(op, dof, width, 1) : sim_check_range(op, dof, width);
        if (!sp || !dp) return CUDA_ERROR_INVALID_VALUE;
        if (pass) memmove(dp, sp, width);
      }
  }
  return CUDA_SUCCESS;
}

/* NOTE [copy descriptors]: the fields of CUDA_MEMCPY2D / CUDA_MEMCPY3D_PEER that the driver refuses or reads,
 * checked as the driver does (CUDA_ERROR_INVALID_VALUE, recorded as misuse): each side's memory type is one the
 * driver knows (a zero is a field left unset), each pitch at least the row width and at most the device's
 * CU_DEVICE_ATTRIBUTE_MAX_PITCH, the levels of detail zero (arrays only). An extent of zero rows, bytes or slices
 * copies nothing on a real GPU: fastdp never asks for an empty copy, so such a descriptor is a field left unset
 * and is recorded (nothing is copied). The 3D copy's slice heights must hold Height rows; the simulator asks it at
 * any depth, stricter than the driver (which reads them from two slices on), so that a height left unset is seen
 * on the one-slice copies fastdp makes. Every offset (srcXInBytes, srcY, srcZ and the destination's) is applied. */
#define MAX_PITCH 2147483647u

static int memtype_ok(const sim_op_t *op, CUmemorytype t, const char *side) {
  if (t == CU_MEMORYTYPE_HOST || t == CU_MEMORYTYPE_DEVICE || t == CU_MEMORYTYPE_UNIFIED) return 1;
  if (t == CU_MEMORYTYPE_ARRAY)
    sim_misuse("%s: the %s is a CUDA array, which the simulator does not have", op->name, side);
  else
    sim_misuse("%s: the %s memory type is %d, not one the driver knows (a field left unset?)", op->name, side, (int)t);
  return 0;
}

static int pitch_ok(const sim_op_t *op, size_t pitch, size_t width, const char *side) {
  if (pitch >= width && pitch <= MAX_PITCH) return 1;
  sim_misuse("%s: the %s pitch %zu is %s", op->name, side, pitch,
             pitch < width ? "smaller than WidthInBytes" : "larger than the device's maximum pitch (2^31-1)");
  return 0;
}

static int extent_ok(const sim_op_t *op, size_t width, size_t height, size_t depth) {
  if (width > 0 && height > 0 && depth > 0) return 1;
  sim_misuse("%s: an empty extent (WidthInBytes %zu, Height %zu, Depth %zu): a field left unset?", op->name, width,
             height, depth);
  return 0;
}

static int memcpy2d_ok(const sim_op_t *op, const CUDA_MEMCPY2D *p) {
  return memtype_ok(op, p->srcMemoryType, "source") && memtype_ok(op, p->dstMemoryType, "destination") &&
         pitch_ok(op, p->srcPitch, p->WidthInBytes, "source") && pitch_ok(op, p->dstPitch, p->WidthInBytes, "destination");
}

static int memcpy3d_peer_ok(const sim_op_t *op, const CUDA_MEMCPY3D_PEER *p) {
  if (!memtype_ok(op, p->srcMemoryType, "source") || !memtype_ok(op, p->dstMemoryType, "destination") ||
      !pitch_ok(op, p->srcPitch, p->WidthInBytes, "source") || !pitch_ok(op, p->dstPitch, p->WidthInBytes, "destination"))
    return 0;
  if (p->srcLOD != 0 || p->dstLOD != 0) {
    sim_misuse("%s: srcLOD %zu / dstLOD %zu must be 0", op->name, p->srcLOD, p->dstLOD);
    return 0;
  }
  if (p->srcHeight < p->Height || p->dstHeight < p->Height) {
    sim_misuse("%s: srcHeight %zu / dstHeight %zu hold fewer than the %zu rows copied per slice", op->name,
               p->srcHeight, p->dstHeight, p->Height);
    return 0;
  }
  return 1;
}

CUresult cuMemcpy2DAsync_v2(const CUDA_MEMCPY2D *p, CUstream stream) {
  ENTER(cuMemcpy2DAsync_v2);
  CUresult err = CUDA_SUCCESS;
  sim_ctx_t *c = sim_need_ctx("cuMemcpy2DAsync", &err);
  if (!c) RETURN(err);
  sim_stream_t *s = sim_resolve_stream(stream, c, "cuMemcpy2DAsync", &err);
  if (!s) RETURN(err);
  if (!p) RETURN(CUDA_ERROR_INVALID_VALUE);
  sim_op_t op;
  sim_op_begin(&op, s, "cuMemcpy2DAsync", c->dev);
  if (!memcpy2d_ok(&op, p)) RETURN(CUDA_ERROR_INVALID_VALUE);
  if (!extent_ok(&op, p->WidthInBytes, p->Height, 1)) RETURN(CUDA_SUCCESS);
  /* Only the current context's device: cross-context 2D copies are not documented (peer copies go through
   * cuMemcpy3DPeerAsync). */
  side_t a = {0}, b = {0};
  if (!side_of(&op, p->srcMemoryType, p->srcHost, p->srcDevice, "source", &a) ||
      !side_of(&op, p->dstMemoryType, p->dstHost, p->dstDevice, "destination", &b))
    RETURN(CUDA_ERROR_INVALID_VALUE);
  a.addr += p->srcY * p->srcPitch + p->srcXInBytes;
  b.addr += p->dstY * p->dstPitch + p->dstXInBytes;
  a.pitch = p->srcPitch;
  b.pitch = p->dstPitch;
  RETURN(rows_copy(&op, &a, &b, p->WidthInBytes, p->Height, 1));
}

CUresult cuMemcpy3DPeerAsync(const CUDA_MEMCPY3D_PEER *p, CUstream stream) {
  ENTER(cuMemcpy3DPeerAsync);
  CUresult err = CUDA_SUCCESS;
  sim_ctx_t *c = sim_need_ctx("cuMemcpy3DPeerAsync", &err);
  if (!c) RETURN(err);
  sim_stream_t *s = sim_resolve_stream(stream, c, "cuMemcpy3DPeerAsync", &err);
  if (!s) RETURN(err);
  if (!p) RETURN(CUDA_ERROR_INVALID_VALUE);
  sim_ctx_t *dc = peer_ctx(p->dstContext, "cuMemcpy3DPeerAsync"), *sc = peer_ctx(p->srcContext, "cuMemcpy3DPeerAsync");
  if (!dc || !sc) RETURN(CUDA_ERROR_INVALID_CONTEXT);
  sim_op_t op;
  sim_op_begin(&op, s, "cuMemcpy3DPeerAsync", c->dev);
  op.any_peer = 1;
  if (!memcpy3d_peer_ok(&op, p)) RETURN(CUDA_ERROR_INVALID_VALUE);
  if (p->srcMemoryType != CU_MEMORYTYPE_DEVICE || p->dstMemoryType != CU_MEMORYTYPE_DEVICE) {
    sim_misuse("cuMemcpy3DPeerAsync: only device memory on both sides is simulated");
    RETURN(CUDA_ERROR_INVALID_VALUE);
  }
  if (!extent_ok(&op, p->WidthInBytes, p->Height, p->Depth)) RETURN(CUDA_SUCCESS);
  if (!ptr_on(&op, p->srcDevice, sc, "source") || !ptr_on(&op, p->dstDevice, dc, "destination"))
    RETURN(CUDA_ERROR_INVALID_VALUE);
  peer_direction(&op, c, sc, dc);
  side_t a = {0, (uintptr_t)p->srcDevice + (p->srcZ * p->srcHeight + p->srcY) * p->srcPitch + p->srcXInBytes,
              p->srcPitch, p->srcHeight};
  side_t b = {0, (uintptr_t)p->dstDevice + (p->dstZ * p->dstHeight + p->dstY) * p->dstPitch + p->dstXInBytes,
              p->dstPitch, p->dstHeight};
  RETURN(rows_copy(&op, &a, &b, p->WidthInBytes, p->Height, p->Depth));
}
