/* SPDX-License-Identifier: MIT */
/* test_gpu_ops on copies: every pair of layouts of a [a, b, c] tensor between one device, two devices and host
 * memory, with every element size; and broadcast, scatter and gather built on them, all against host references. */
#include "gpu_ops_harness.h"

#include <stdio.h>
#include <string.h>

/* ---- copies ---- */

static const char *const k_layouts[L_COUNT] = {"contiguous", "padded rows", "transposed", "step 2", "padded outer"};

void layout(int kind, const int64_t *sz, int64_t *st) {
  switch (kind) {
  case L_CONTIG: contig(3, sz, st); break;
  case L_PADDED:
    st[2] = 1;
    st[1] = sz[2] + 3;
    st[0] = st[1] * sz[1];
    break;
  case L_TRANSPOSED:
    st[1] = 1;
    st[2] = sz[1];
    st[0] = sz[1] * sz[2];
    break;
  case L_STEP2:
    st[2] = 2;
    st[1] = 2 * sz[2];
    st[0] = st[1] * sz[1];
    break;
  default:
    st[2] = 1;
    st[1] = sz[2];
    st[0] = sz[1] * sz[2] + 5;
    break;
  }
}

void copy_case(int sdev, int ddev, int es, const int64_t *sz, int sl, int dl, const CUstream *streams) {
  int64_t ss[3], ds[3];
  layout(sl, sz, ss);
  layout(dl, sz, ds);
  buf_t sb = buf_new(sdev, span(es, 3, sz, ss) + 3 * (size_t)es);
  buf_t db = buf_new(ddev, span(es, 3, sz, ds) + 2 * (size_t)es);
  view_t s = view(&sb, FDP_DTYPE_OTHER, es, 3, sz, ss, 1), d = view(&db, FDP_DTYPE_OTHER, es, 3, sz, ds, 2);
  fdp_streams_t st = all_streams(streams);
  buf_t *both[2] = {&sb, &db};
  caller_before(both, 2, streams);
  fdp_result_t r = fdp_op_copy(&d.t, &s.t, 1, &st);
  caller_after(both, 2, streams, "copy");
  CHECKF(r == FDP_OK, "copy %d -> %d, %d-byte elements [%lld,%lld,%lld], %s -> %s: %s", sdev, ddev, es,
         (long long)sz[0], (long long)sz[1], (long long)sz[2], k_layouts[sl], k_layouts[dl], fdp_last_error());
  ref_copy(&d.ref, &s.ref);
  char what[160];
  snprintf(what, sizeof what, "copy %d -> %d, es %d, [%lld,%lld,%lld], %s -> %s", sdev, ddev, es, (long long)sz[0],
           (long long)sz[1], (long long)sz[2], k_layouts[sl], k_layouts[dl]);
  buf_matches(&db, what);
  CHECK(buf_matches(&sb, "copy source unchanged"));
  buf_free(&sb);
  buf_free(&db);
}

void test_copies(void) {
  static const int64_t shapes[][3] = {{2, 3, 160}, {3, 5, 7}, {1, 1, 1}, {4, 9, 600}};
  static const int ess[] = {1, 2, 4, 8, 16};
  static const int pairs[][2] = {{0, 0}, {0, 1}, {FDP_HOST, 1}, {2, FDP_HOST}, {3, 2}, {FDP_HOST, 0}, {0, FDP_HOST}};
  int ndev = g_ndev;
  for (size_t p = 0; p < sizeof pairs / sizeof pairs[0]; p++) {
    int sdev = pairs[p][0], ddev = pairs[p][1];
    if (sdev >= ndev || ddev >= ndev) continue;
    for (size_t h = 0; h < sizeof shapes / sizeof shapes[0]; h++)
      for (int sl = 0; sl < L_COUNT; sl++)
        for (int dl = 0; dl < L_COUNT; dl++) {
          int es = ess[(h + (size_t)sl + (size_t)dl + p) % 5];
          if (shapes[h][2] == 600 && es > 4) es = 4;
          copy_case(sdev, ddev, es, shapes[h], sl, dl, (sl + dl) % 2 ? g_stream : NULL);
        }
  }
  sim_clean("copies");
}

/* ---- broadcast, scatter, gather ---- */

void test_broadcast(void) {
  int64_t sz[2] = {37, 41}, st[2], pad[2] = {48, 1};
  contig(2, sz, st);
  for (int src_dev = FDP_HOST; src_dev < 1; src_dev++)
    for (int strided = 0; strided < 2; strided++)
      for (int s = 0; s < 2; s++) {
        buf_t sb = buf_new(src_dev, 37 * 41 * 4);
        view_t sv = view(&sb, FDP_DTYPE_F32, 4, 2, sz, st, 0);
        buf_t db[FDP_MAX_DEVICES];
        fdp_tensor_t dt[FDP_MAX_DEVICES];
        int n = 0;
        for (int d = 0; d < g_ndev; d++) {
          if (d == src_dev) continue;
          db[n] = buf_new(d, 37 * 48 * 4);
          view_t dv = view(&db[n], FDP_DTYPE_F32, 4, 2, sz, strided ? pad : st, 0);
          ref_copy(&dv.ref, &sv.ref);
          dt[n++] = dv.t;
        }
        fdp_streams_t streams = all_streams(s ? g_stream : NULL);
        buf_t *all[FDP_MAX_DEVICES + 1] = {&sb};
        for (int i = 0; i < n; i++)
          all[1 + i] = &db[i];
        caller_before(all, n + 1, s ? g_stream : NULL);
        OK(fdp_op_broadcast(&sv.t, dt, n, &streams));
        caller_after(all, n + 1, s ? g_stream : NULL, "broadcast");
        for (int i = 0; i < n; i++) {
          buf_matches(&db[i], "broadcast destination");
          buf_free(&db[i]);
        }
        buf_free(&sb);
      }
  sim_clean("broadcast");
}

void test_scatter_gather(void) {
  int64_t sz[2] = {40, 24}, st[2];
  contig(2, sz, st);
  for (int src_dev = FDP_HOST; src_dev < 1; src_dev++)
    for (int dim = 0; dim < 2; dim++) {
      int n = g_ndev;
      buf_t sb = buf_new(src_dev, 40 * 24 * 8);
      view_t sv = view(&sb, FDP_DTYPE_F64, 8, 2, sz, st, 0);
      buf_t ob[FDP_MAX_DEVICES];
      fdp_tensor_t ot[FDP_MAX_DEVICES];
      int64_t chunks[FDP_MAX_DEVICES], start = 0;
      for (int i = 0; i < n; i++) {
        chunks[i] = sz[dim] / n + (i < sz[dim] % n);
        int64_t csz[2] = {sz[0], sz[1]}, cst[2];
        csz[dim] = chunks[i];
        contig(2, csz, cst);
        ob[i] = buf_new(i, (size_t)(csz[0] * csz[1] * 8));
        view_t ov = view(&ob[i], FDP_DTYPE_F64, 8, 2, csz, cst, 0);
        fdp_tensor_t part;
        fdp_tensor_narrow(&sv.ref, dim, start, chunks[i], &part);
        ref_copy(&ov.ref, &part);
        ot[i] = ov.t;
        start += chunks[i];
      }
      fdp_streams_t streams = all_streams(g_stream);
      buf_t *all[FDP_MAX_DEVICES + 1] = {&sb};
      for (int i = 0; i < n; i++)
        all[1 + i] = &ob[i];
      caller_before(all, n + 1, g_stream);
      OK(fdp_op_scatter(&sv.t, dim, chunks, ot, n, &streams));
      caller_after(all, n + 1, g_stream, "scatter");
      for (int i = 0; i < n; i++)
        buf_matches(&ob[i], "scatter output");
      /* And back: gather the chunks (changed) into a fresh output on the source's side. */
      buf_t gb = buf_new(src_dev, 40 * 24 * 8);
      view_t gv = view(&gb, FDP_DTYPE_F64, 8, 2, sz, st, 0);
      start = 0;
      for (int i = 0; i < n; i++) {
        for (size_t k = 0; k < ob[i].bytes; k++)
          ob[i].ref[k] = (unsigned char)rnd();
        buf_upload(&ob[i]);
        fdp_tensor_t part, in = ot[i];
        in.data = (char *)ob[i].ref;
        in.device = FDP_HOST;
        fdp_tensor_narrow(&gv.ref, dim, start, chunks[i], &part);
        ref_copy(&part, &in);
        start += chunks[i];
      }
      all[0] = &gb;
      caller_before(all, n + 1, g_stream);
      OK(fdp_op_gather(ot, n, dim, &gv.t, &streams));
      caller_after(all, n + 1, g_stream, "gather");
      buf_matches(&gb, "gather output");
      for (int i = 0; i < n; i++)
        buf_free(&ob[i]);
      buf_free(&gb);
      buf_free(&sb);
    }
  sim_clean("scatter/gather");
}
