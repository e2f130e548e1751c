/* SPDX-License-Identifier: MIT */
/* test_gpu_ops on the kernels at their limits (offsets past 2^31, more elements than a grid has threads, a sum of
 * more than 2^31 elements on a real GPU) and on elements at addresses that are not a multiple of their size. */
#include "gpu_ops_harness.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the kernels at their limits ---- */

/* Two rows of `width` bytes 2^31 + 512 bytes apart in `big`, copied to a dense 2 x width byte tensor. */
static void copy_far_rows(CUdeviceptr big, long long stride, int width, const char *what) {
  unsigned char rows[2][512];
  for (int r = 0; r < 2; r++)
    for (int i = 0; i < width; i++)
      rows[r][i] = (unsigned char)(r * 100 + i * 7 + 1);
  push(0);
  for (int r = 0; r < 2; r++)
    dev_call(0, D.HtoD(big + (CUdeviceptr)(r * stride), rows[r], (size_t)width, NULL), "cuMemcpyHtoDAsync");
  dev_call(0, D.StreamSynchronize(NULL), "cuStreamSynchronize");
  pop(0);
  buf_t db = buf_new(0, (size_t)(2 * width));
  int64_t sz[2] = {2, width}, st[2] = {stride, 1}, dst_st[2] = {width, 1};
  fdp_tensor_t src;
  memset(&src, 0, sizeof src);
  src.data = (char *)(uintptr_t)big;
  src.device = 0;
  src.dtype = FDP_DTYPE_U8;
  src.elem_size = 1;
  src.ndim = 2;
  memcpy(src.sizes, sz, sizeof sz);
  memcpy(src.strides, st, sizeof st);
  view_t dv = view(&db, FDP_DTYPE_U8, 1, 2, sz, dst_st, 0);
  for (int r = 0; r < 2; r++)
    memcpy((unsigned char *)db.ref + r * width, rows[r], (size_t)width);
  fdp_streams_t fs = all_streams(g_stream);
  OK(fdp_op_copy(&dv.t, &src, 1, &fs));
  buf_matches(&db, what);
  buf_free(&db);
}

/* Element offsets beyond 2^31 (the strided-copy kernel must index in 64 bits): rows 2^31 + 512 bytes apart in one
 * allocation. Short rows go to the kernel anyway; rows wide enough for the copy engines have a pitch past the
 * driver's maximum (CU_DEVICE_ATTRIBUTE_MAX_PITCH, 2^31 - 1), which the driver refuses: they must go to the kernel
 * too. */
void test_kernel_wide_offsets(void) {
  const long long stride = (1ll << 31) + 512;
  CUdeviceptr big = 0;
  push(0);
  CUresult e = D.MemAlloc(&big, (size_t)stride + 512);
  pop(0);
  if (e != CUDA_SUCCESS) { /* a real GPU with less than 2 GiB free */
    printf("  (skipped: no 2 GiB allocation on device 0)\n");
    return;
  }
  copy_far_rows(big, stride, 3, "copy of 3-byte rows 2^31 + 512 bytes apart");
  copy_far_rows(big, stride, 512, "copy of 512-byte rows 2^31 + 512 bytes apart (a pitch past the driver's maximum)");
  push(0);
  dev_call(0, D.CtxSynchronize(), "cuCtxSynchronize");
  dev_call(0, D.MemFree(big), "cuMemFree");
  pop(0);
  sim_clean("kernel offsets past 2^31");
}

/* A sum of more than 2^31 elements (the kernel must index elements in 64 bits), on a real GPU only: the simulated
 * one runs kernels one thread at a time, and 2^31 of them take minutes. Three 2 GiB byte inputs of 1, 2 and 3. */
void test_kernel_huge_sum(void) {
  if (sim()) return;
  const size_t n = (1ull << 31) + 4096;
  unsigned char *host = malloc(n);
  CUdeviceptr in[3] = {0, 0, 0}, out = 0;
  int ok = host != NULL;
  push(0);
  for (int i = 0; i < 3 && ok; i++)
    ok = D.MemAlloc(&in[i], n) == CUDA_SUCCESS;
  ok = ok && D.MemAlloc(&out, n) == CUDA_SUCCESS;
  if (!ok) {
    printf("  (skipped: no 8 GiB on device 0 for a sum past 2^31 elements)\n");
  } else {
    for (int i = 0; i < 3; i++) {
      memset(host, i + 1, n);
      dev_call(0, D.HtoD(in[i], host, n, NULL), "cuMemcpyHtoDAsync");
      dev_call(0, D.StreamSynchronize(NULL), "cuStreamSynchronize");
    }
    fdp_tensor_t t[4];
    memset(t, 0, sizeof t);
    for (int i = 0; i < 4; i++) {
      t[i].data = (char *)(uintptr_t)(i < 3 ? in[i] : out);
      t[i].device = 0;
      t[i].dtype = FDP_DTYPE_U8;
      t[i].elem_size = 1;
      t[i].ndim = 1;
      t[i].sizes[0] = (int64_t)n;
      t[i].strides[0] = 1;
    }
    fdp_streams_t fs = all_streams(NULL);
    OK(fdp_op_reduce(t, 3, &t[3], &fs));
    dev_call(0, D.CtxSynchronize(), "cuCtxSynchronize");
    dev_call(0, D.DtoH(host, out, n, NULL), "cuMemcpyDtoHAsync");
    dev_call(0, D.StreamSynchronize(NULL), "cuStreamSynchronize");
    size_t bad = 0;
    while (bad < n && host[bad] == 6)
      bad++;
    CHECKF(bad == n, "sum past 2^31 elements: element %zu is %d, want 6", bad, bad < n ? host[bad] : 6);
  }
  for (int i = 0; i < 3; i++)
    if (in[i]) D.MemFree(in[i]);
  if (out) D.MemFree(out);
  pop(0);
  free(host);
}

/* Sums and strided copies of many times more elements than one grid has threads (the simulated devices have few
 * multiprocessors, so the grid is small): every element is written once, nothing past the end. */
void test_kernel_many_elements(void) {
  int devs[3] = {0, 0, 0};
  reduce_case(FDP_DTYPE_F32, 4, 3, devs, 0, -1, 100003, g_stream, FDP_OK);
  reduce_case(FDP_DTYPE_F16, 2, 3, devs, 0, 1, 65537, NULL, FDP_OK);
  int64_t sz[3] = {3, 77, 301};
  copy_case(0, 0, 2, sz, L_CONTIG, L_TRANSPOSED, g_stream);
  copy_case(0, 0, 8, sz, L_STEP2, L_CONTIG, NULL);
  sim_clean("kernels over many grids");
}

/* ---- elements at addresses that are not a multiple of their size ---- */

/* A view starting `bytes` bytes into a buffer: its elements need not be aligned to their size. */
static view_t view_at_byte(buf_t *b, int es, int nd, const int64_t *sizes, const int64_t *strides, size_t bytes) {
  view_t v = view(b, FDP_DTYPE_OTHER, es, nd, sizes, strides, 0);
  v.t.data += bytes;
  v.ref.data += bytes;
  return v;
}

/* A GPU faults on a wide element at an address that is not a multiple of its width. Copies of misaligned elements
 * move bytes instead (same device, staged across devices, to and from host memory); a sum cannot, so it is refused
 * before any work is enqueued. */
void test_misaligned(void) {
  static const int ess[] = {2, 4, 8, 16};
  int64_t sz[2] = {13, 9}, contig_st[2] = {9, 1}, trans_st[2] = {1, 13};
  static const int pairs[][2] = {{0, 0}, {0, 1}, {FDP_HOST, 1}, {1, FDP_HOST}};
  for (size_t e = 0; e < sizeof ess / sizeof ess[0]; e++)
    for (size_t p = 0; p < sizeof pairs / sizeof pairs[0]; p++)
      for (int layout_kind = 0; layout_kind < 2; layout_kind++) {
        int es = ess[e], sdev = pairs[p][0], ddev = pairs[p][1] < g_ndev ? pairs[p][1] : 0;
        if (sdev >= g_ndev) continue;
        size_t soff = (size_t)(es > 2 ? es / 2 : 1), doff = 1 + (size_t)(es > 4 ? es / 4 : 0);
        buf_t sb = buf_new(sdev, span(es, 2, sz, contig_st) + 2 * (size_t)es);
        buf_t db = buf_new(ddev, span(es, 2, sz, trans_st) + 2 * (size_t)es);
        view_t s = view_at_byte(&sb, es, 2, sz, contig_st, soff);
        view_t d = view_at_byte(&db, es, 2, sz, layout_kind ? trans_st : contig_st, doff);
        fdp_streams_t st = all_streams(g_stream);
        buf_t *both[2] = {&sb, &db};
        caller_before(both, 2, g_stream);
        fdp_result_t r = fdp_op_copy(&d.t, &s.t, 1, &st);
        caller_after(both, 2, g_stream, "misaligned copy");
        CHECKF(r == FDP_OK, "copy %d -> %d of %d-byte elements %zu and %zu bytes into their buffers: %s", sdev, ddev,
               es, soff, doff, fdp_last_error());
        ref_copy(&d.ref, &s.ref);
        char what[128];
        snprintf(what, sizeof what, "copy %d -> %d of misaligned %d-byte elements (%s)", sdev, ddev, es,
                 layout_kind ? "transposed" : "contiguous");
        buf_matches(&db, what);
        buf_free(&sb);
        buf_free(&db);
      }
  /* Rows too short for the copy engines go to the kernel, which copies them in elements of up to 16 bytes where
   * the rows split into such and both addresses are aligned to them: every element offset of each side. */
  for (size_t e = 0; e < 4; e++) {
    int es = 1 << e;
    int64_t rows[2] = {7, 48}, sst[2] = {48 + 16, 1}, dst_st[2] = {48 + 32, 1};
    for (int so = 0; so < 4; so++)
      for (int dof = 0; dof < 4; dof++) {
        buf_t sb = buf_new(0, span(es, 2, rows, sst) + 4 * (size_t)es);
        buf_t db = buf_new(0, span(es, 2, rows, dst_st) + 4 * (size_t)es);
        view_t s = view(&sb, FDP_DTYPE_OTHER, es, 2, rows, sst, so);
        view_t d = view(&db, FDP_DTYPE_OTHER, es, 2, rows, dst_st, dof);
        fdp_streams_t st = all_streams(g_stream);
        CHECKF(fdp_op_copy(&d.t, &s.t, 1, &st) == FDP_OK, "rows of %d-byte elements at offsets %d, %d: %s", es, so, dof,
               fdp_last_error());
        ref_copy(&d.ref, &s.ref);
        buf_matches(&db, "rows copied in widened elements");
        buf_free(&sb);
        buf_free(&db);
      }
  }
  /* Sums: on one device (the kernel) and across devices; an input or the output one element size off by half. */
  static const struct {
    int dtype, es;
  } sums[] = {{FDP_DTYPE_F64, 8}, {FDP_DTYPE_F32, 4}, {FDP_DTYPE_F16, 2}};
  for (size_t t = 0; t < sizeof sums / sizeof sums[0]; t++)
    for (int which = 0; which < 3; which++) {
      int es = sums[t].es, n = g_ndev > 1 ? 2 : 3;
      int64_t count = 50, one[1] = {count}, unit[1] = {1};
      buf_t b[4];
      fdp_tensor_t in[3], out;
      for (int i = 0; i < n + 1; i++) {
        int dev = which == 2 && g_ndev > 1 ? (i < n ? i : 0) : 0;
        b[i] = buf_new(dev, (size_t)(count + 1) * (size_t)es);
        size_t off = (which == 0 && i == 1) || (which != 0 && i == n) ? (size_t)es / 2 : 0;
        fdp_tensor_t v = view_at_byte(&b[i], es, 1, one, unit, off).t;
        v.dtype = sums[t].dtype;
        if (i < n)
          in[i] = v;
        else
          out = v;
      }
      fdp_streams_t st = all_streams(g_stream);
      fdp_result_t r = fdp_op_reduce(in, n, &out, &st);
      CHECKF(r == FDP_INVALID && strstr(fdp_last_error(), "not aligned") != NULL,
             "a sum of %s with a misaligned %s: %s (%s), want FDP_INVALID", fdp_dtype_name(sums[t].dtype),
             which == 0 ? "input" : "output", fdp_result_name(r), fdp_last_error());
      for (int i = 0; i < n + 1; i++)
        CHECK(buf_matches(&b[i], "a refused sum's buffers are untouched"));
      for (int i = 0; i < n + 1; i++)
        buf_free(&b[i]);
    }
  sim_clean("misaligned elements");
}
