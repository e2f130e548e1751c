/* SPDX-License-Identifier: MIT */
/* test_gpu_ops --sweep and --pairs (simulated GPU only): every operation with every driver/NCCL call it makes failing
 * in turn (and, with --pairs, followed by a failure of a recovery's fallback), checked for an error with a detail, no
 * misuse, nothing leaked, and a next call that succeeds. */
#include "gpu_ops_harness.h"

#include <stdio.h>
#include <string.h>

/* ---- fault injection (simulator only) ---- */

/* One operation of the sweep over prepared buffers; `verify` compares the results with the reference. */
typedef struct sweep_op {
  const char *name;
  void (*setup)(void);
  void (*prepare)(void); /* before each run, before a failure is armed (may be NULL) */
  fdp_result_t (*run)(void);
  void (*verify)(void);
  void (*teardown)(void);
} sweep_op_t;

static buf_t g_b[80];
static view_t g_v[80];
static int g_nb;

static void sw_free(void) {
  for (int i = 0; i < g_nb; i++)
    buf_free(&g_b[i]);
  g_nb = 0;
}

/* kinds: a strided same-device copy (kernel), a padded-row copy across devices, a transposed one (staged),
 * host -> device and device -> host with strided device sides, broadcast, reduce across devices, a local reduce
 * of 40 inputs into one of them, scatter and gather. */
static int g_kind;
static void sw_setup(void) {
  int64_t sz[3] = {2, 6, 140}, a[3], b[3];
  int sl = L_STEP2, dl = L_CONTIG, sdev = 0, ddev = 0;
  switch (g_kind) {
  case 1: sl = L_PADDED, dl = L_PADDED, ddev = 1; break;
  case 2: sl = L_TRANSPOSED, dl = L_STEP2, ddev = 1; break;
  case 3: sl = L_CONTIG, dl = L_TRANSPOSED, sdev = FDP_HOST, ddev = 2; break;
  case 4: sl = L_STEP2, dl = L_PADDED, sdev = 1, ddev = FDP_HOST; break;
  case 5: sl = L_PADDED, dl = L_OUTER; break;    /* rows of 560 bytes: cuMemcpy2DAsync */
  case 6: sl = L_CONTIG, sdev = ddev = 3; break; /* flat: cuMemcpyAsync */
  default: break;
  }
  layout(sl, sz, a);
  layout(dl, sz, b);
  g_nb = 2;
  g_b[0] = buf_new(sdev, span(4, 3, sz, a));
  g_b[1] = buf_new(ddev, span(4, 3, sz, b));
  g_v[0] = view(&g_b[0], FDP_DTYPE_F32, 4, 3, sz, a, 0);
  g_v[1] = view(&g_b[1], FDP_DTYPE_F32, 4, 3, sz, b, 0);
  ref_copy(&g_v[1].ref, &g_v[0].ref);
}
static fdp_result_t sw_copy(void) {
  fdp_streams_t s = all_streams(g_stream);
  return fdp_op_copy(&g_v[1].t, &g_v[0].t, 1, &s);
}
static void sw_verify_last(void) {
  buf_matches(&g_b[g_nb - 1], "result after the injected failure");
}

static void sw_setup_dense(void) {
  int64_t sz[1] = {3000}, st[1] = {1};
  g_nb = g_ndev + 1;
  for (int i = 0; i < g_nb; i++) {
    g_b[i] = buf_new(i < g_ndev ? i : 0, 3000 * 4);
    fill_values(FDP_DTYPE_F32, g_b[i].ref, 3000);
    buf_upload(&g_b[i]);
    g_v[i] = view(&g_b[i], FDP_DTYPE_F32, 4, 1, sz, st, 0);
  }
}
static fdp_result_t sw_broadcast(void) {
  fdp_tensor_t d[FDP_MAX_DEVICES];
  for (int i = 1; i < g_ndev; i++) {
    d[i - 1] = g_v[i].t;
    memcpy(g_b[i].ref, g_b[0].ref, g_b[0].bytes);
  }
  fdp_streams_t s = all_streams(g_stream);
  return fdp_op_broadcast(&g_v[0].t, d, g_ndev - 1, &s);
}
static void sw_verify_bcast(void) {
  for (int i = 1; i < g_ndev; i++)
    buf_matches(&g_b[i], "broadcast after the injected failure");
}
static fdp_result_t sw_reduce(void) {
  fdp_tensor_t in[FDP_MAX_DEVICES];
  memcpy(g_b[g_ndev].ref, g_b[0].ref, g_b[0].bytes);
  for (int i = 0; i < g_ndev; i++) {
    in[i] = g_v[i].t;
    if (i) ref_add(FDP_DTYPE_F32, g_b[g_ndev].ref, g_b[i].ref, 3000);
  }
  fdp_streams_t s = all_streams(g_stream);
  return fdp_op_reduce(in, g_ndev, &g_v[g_ndev].t, &s);
}

/* The reduction's pattern on streams of its own: ordered after the caller's streams, fenced for the consumer and
 * for the host (own streams: a second non-blocking stream per device, made by sw_setup_own). */
static CUstream g_own[FDP_MAX_DEVICES];
static void sw_setup_own(void) {
  sw_setup_dense();
  for (int d = 0; d < g_ndev; d++) {
    push(d);
    dev_call(d, D.StreamCreate(&g_own[d], 1), "cuStreamCreate");
    pop(d);
  }
}
static void sw_free_own(void) {
  for (int d = 0; d < g_ndev; d++) {
    push(d);
    dev_call(d, D.StreamDestroy(g_own[d]), "cuStreamDestroy");
    pop(d);
  }
  sw_free();
}
static fdp_result_t sw_reduce_own(void) {
  fdp_tensor_t in[FDP_MAX_DEVICES];
  memcpy(g_b[g_ndev].ref, g_b[0].ref, g_b[0].bytes);
  for (int i = 0; i < g_ndev; i++) {
    in[i] = g_v[i].t;
    if (i) ref_add(FDP_DTYPE_F32, g_b[g_ndev].ref, g_b[i].ref, 3000);
  }
  fdp_streams_t own = all_streams(g_own), caller = all_streams(g_stream), first = {1, {0}, {(void *)g_stream[0]}};
  fdp_fence_t *deliver = NULL, *release = NULL;
  int done = 0;
  fdp_result_t r = fdp_streams_order(&own, &caller);
  if (r == FDP_OK) r = fdp_op_reduce(in, g_ndev, &g_v[g_ndev].t, &own);
  if (r == FDP_OK) r = fdp_fence_record(&own, &release);
  if (r == FDP_OK) r = fdp_fence_record(&(fdp_streams_t){1, {0}, {(void *)g_own[0]}}, &deliver);
  if (r == FDP_OK) r = fdp_fence_wait(deliver, &first);
  if (r == FDP_OK) r = fdp_fence_query(release, &done);
  fdp_fence_free(deliver);
  fdp_fence_free(release);
  return r;
}

static void sw_setup_local(void) {
  int64_t sz[1] = {300}, st[1] = {1};
  g_nb = 40;
  for (int i = 0; i < g_nb; i++) {
    g_b[i] = buf_new(g_ndev - 1, 300 * 2);
    fill_values(FDP_DTYPE_F16, g_b[i].ref, 300);
    buf_upload(&g_b[i]);
    g_v[i] = view(&g_b[i], FDP_DTYPE_F16, 2, 1, sz, st, 0);
  }
}
/* Out aliases input 35, which the second pass reads: the partial sums go through a stream-ordered buffer. The
 * inputs are rewritten first, since a successful run changes input 35. */
static unsigned char g_orig35[300 * 2];
static void sw_setup_local_save(void) {
  sw_setup_local();
  memcpy(g_orig35, g_b[35].ref, sizeof g_orig35);
}
static void sw_prepare_local(void) {
  memcpy(g_b[35].ref, g_orig35, sizeof g_orig35);
  buf_upload(&g_b[35]);
}
static fdp_result_t sw_local(void) {
  fdp_tensor_t in[40];
  unsigned char acc[300 * 2];
  memcpy(acc, g_b[0].ref, sizeof acc);
  for (int i = 0; i < 40; i++) {
    in[i] = g_v[i].t;
    if (i) ref_add(FDP_DTYPE_F16, acc, g_b[i].ref, 300);
  }
  fdp_streams_t s = all_streams(g_stream);
  fdp_result_t r = fdp_op_reduce(in, 40, &in[35], &s);
  memcpy(g_b[35].ref, acc, sizeof acc);
  return r;
}
static void sw_verify_local(void) {
  buf_matches(&g_b[35], "local reduce after the injected failure");
}

static void sw_setup_scatter(void) {
  int64_t sz[2] = {8, 30}, st[2];
  contig(2, sz, st);
  g_nb = g_ndev + 1;
  g_b[0] = buf_new(0, 8 * 30 * 8);
  g_v[0] = view(&g_b[0], FDP_DTYPE_F64, 8, 2, sz, st, 0);
  for (int i = 0; i < g_ndev; i++) {
    int64_t csz[2] = {8, 30 / g_ndev + (i < 30 % g_ndev)}, cst[2];
    contig(2, csz, cst);
    g_b[i + 1] = buf_new(i, (size_t)(csz[0] * csz[1] * 8));
    g_v[i + 1] = view(&g_b[i + 1], FDP_DTYPE_F64, 8, 2, csz, cst, 0);
  }
}
static fdp_result_t sw_scatter(void) {
  fdp_tensor_t o[FDP_MAX_DEVICES];
  int64_t ch[FDP_MAX_DEVICES], start = 0;
  for (int i = 0; i < g_ndev; i++) {
    o[i] = g_v[i + 1].t;
    ch[i] = o[i].sizes[1];
    fdp_tensor_t part;
    fdp_tensor_narrow(&g_v[0].ref, 1, start, ch[i], &part);
    ref_copy(&g_v[i + 1].ref, &part);
    start += ch[i];
  }
  fdp_streams_t s = all_streams(g_stream);
  return fdp_op_scatter(&g_v[0].t, 1, ch, o, g_ndev, &s);
}
static void sw_verify_scatter(void) {
  for (int i = 1; i <= g_ndev; i++)
    buf_matches(&g_b[i], "scatter after the injected failure");
}
static fdp_result_t sw_gather(void) {
  fdp_tensor_t in[FDP_MAX_DEVICES];
  int64_t start = 0;
  for (int i = 0; i < g_ndev; i++) {
    in[i] = g_v[i + 1].t;
    fdp_tensor_t part;
    fdp_tensor_narrow(&g_v[0].ref, 1, start, in[i].sizes[1], &part);
    ref_copy(&part, &g_v[i + 1].ref);
    start += in[i].sizes[1];
  }
  fdp_streams_t s = all_streams(g_stream);
  return fdp_op_gather(in, g_ndev, 1, &g_v[0].t, &s);
}
static void sw_verify_gather(void) {
  buf_matches(&g_b[0], "gather after the injected failure");
}

static void sw_setup_k0(void) {
  g_kind = 0;
  sw_setup();
}
static void sw_setup_k1(void) {
  g_kind = 1;
  sw_setup();
}
static void sw_setup_k2(void) {
  g_kind = 2;
  sw_setup();
}
static void sw_setup_k3(void) {
  g_kind = 3;
  sw_setup();
}
static void sw_setup_k4(void) {
  g_kind = 4;
  sw_setup();
}
static void sw_setup_k5(void) {
  g_kind = 5;
  sw_setup();
}
static void sw_setup_k6(void) {
  g_kind = 6;
  sw_setup();
}

static const sweep_op_t k_sweep[] = {
    {"copy (kernel, same device)", sw_setup_k0, NULL, sw_copy, sw_verify_last, sw_free},
    {"copy (rows, same device)", sw_setup_k5, NULL, sw_copy, sw_verify_last, sw_free},
    {"copy (flat, same device)", sw_setup_k6, NULL, sw_copy, sw_verify_last, sw_free},
    {"copy (rows, peer)", sw_setup_k1, NULL, sw_copy, sw_verify_last, sw_free},
    {"copy (staged, peer)", sw_setup_k2, NULL, sw_copy, sw_verify_last, sw_free},
    {"copy (host -> strided device)", sw_setup_k3, NULL, sw_copy, sw_verify_last, sw_free},
    {"copy (strided device -> host)", sw_setup_k4, NULL, sw_copy, sw_verify_last, sw_free},
    {"broadcast (nccl)", sw_setup_dense, NULL, sw_broadcast, sw_verify_bcast, sw_free},
    {"reduce (nccl)", sw_setup_dense, NULL, sw_reduce, sw_verify_last, sw_free},
    {"reduce (nccl) on own streams, fenced", sw_setup_own, NULL, sw_reduce_own, sw_verify_last, sw_free_own},
    {"reduce (local, 40 inputs, out aliases one)", sw_setup_local_save, sw_prepare_local, sw_local, sw_verify_local,
     sw_free},
    {"scatter", sw_setup_scatter, NULL, sw_scatter, sw_verify_scatter, sw_free},
    {"gather", sw_setup_scatter, NULL, sw_gather, sw_verify_gather, sw_free},
};

static int fault_code(const char *entry) {
  if (strncmp(entry, "nccl", 4) == 0) return 3; /* ncclInternalError */
  if (strstr(entry, "Alloc") || strcmp(entry, "cuModuleLoadData") == 0) return CUDA_ERROR_OUT_OF_MEMORY;
  if (strcmp(entry, "cuLaunchKernel") == 0) return CUDA_ERROR_LAUNCH_FAILED;
  return CUDA_ERROR_UNKNOWN;
}

/* 1 when a failure of `entry` may leave one object of kind `stat` alive (the one it was destroying). */
static int destroys(const char *entry, const char *stat) {
  return (strcmp(stat, "events") == 0 && strcmp(entry, "cuEventDestroy_v2") == 0) ||
         (strcmp(stat, "allocations") == 0 && strncmp(entry, "cuMemFree", 9) == 0) ||
         (strcmp(stat, "modules") == 0 && strcmp(entry, "cuModuleUnload") == 0) ||
         (strcmp(stat, "comms") == 0 && strncmp(entry, "ncclComm", 8) == 0) ||
         (strcmp(stat, "pushes") == 0 && strcmp(entry, "cuCtxPopCurrent_v2") == 0);
}

/* Live after a failed call: nothing more than before it. Cached until shutdown: nothing more after it. */
static const char *const k_counted[] = {"allocations", "streams", "events", "pushes", "groups"};
#define NCOUNTED (sizeof k_counted / sizeof k_counted[0])
static const char *const k_cached[] = {"modules", "comms"};
#define NCACHED (sizeof k_cached / sizeof k_cached[0])

/* One run of `op` with call `k` of `entry` failing (and, when `then` is not NULL, the next call of `then` after that
 * too), from a cold start: a CUDA/NCCL error with a detail (or success where the failed call is one fastdp may shrug
 * off), no misuse, nothing leaked, and the next call succeeds with the right result. After two failures in a row a
 * buffer that work may still use must leak rather than be freed under it (the simulator sees such a free as a race):
 * with a failed host wait, context push (the wait needs it) or free as the second, live allocations may grow, never
 * otherwise. */
static void sweep_trial(const sweep_op_t *op, const char *entry, long long k, const char *then) {
  char what[160];
  if (then)
    snprintf(what, sizeof what, "%s, call %lld of %s failing, then %s", op->name, k, entry, then);
  else
    snprintf(what, sizeof what, "%s, call %lld of %s failing", op->name, k, entry);
  fdp_shutdown();
  if (op->prepare) op->prepare();
  long long base[NCOUNTED], cbase[NCACHED];
  for (size_t c = 0; c < NCOUNTED; c++)
    base[c] = S.stat(k_counted[c]);
  for (size_t c = 0; c < NCACHED; c++)
    cbase[c] = S.stat(k_cached[c]);
  S.reset();
  if (then)
    S.fail_then(entry, k, fault_code(entry), then, fault_code(then));
  else
    S.fail_at(entry, k, fault_code(entry));
  fdp_result_t r = op->run();
  int fired = S.calls(entry) >= k;
  S.fail_at(entry, 0, 0); /* nothing left armed for the harness's own calls */
  if (then) S.fail_at(then, 0, 0);
  CHECKF(r == FDP_OK || r == FDP_CUDA || r == FDP_NCCL, "%s: %s (%s), want FDP_CUDA/FDP_NCCL", what, fdp_result_name(r),
         fdp_last_error());
  if ((r == FDP_CUDA || r == FDP_NCCL) && !then) {
    /* The detail names what failed: the injected CUresult's name, or NCCL's string for its code. */
    const char *want = strncmp(entry, "nccl", 4) == 0                  ? "internal error"
                       : fault_code(entry) == CUDA_ERROR_OUT_OF_MEMORY ? "CUDA_ERROR_OUT_OF_MEMORY"
                       : fault_code(entry) == CUDA_ERROR_LAUNCH_FAILED ? "CUDA_ERROR_LAUNCH_FAILED"
                                                                       : "CUDA_ERROR_UNKNOWN";
    CHECKF(strstr(fdp_last_error(), want) != NULL, "%s: the detail \"%s\" does not say %s", what, fdp_last_error(),
           want);
  }
  char buf[4096];
  long long nerr = S.errors(buf, sizeof buf);
  CHECKF(nerr == 0, "%s: %lld misuse(s):\n%s", what, nerr, buf);
  int may_leak = then && (strcmp(then, "cuStreamSynchronize") == 0 || strcmp(then, "cuCtxPushCurrent_v2") == 0 ||
                          strncmp(then, "cuMemFree", 9) == 0);
  for (size_t c = 0; c < NCOUNTED; c++) {
    long long now = S.stat(k_counted[c]);
    /* a failed destroy may leave that very object behind */
    if (destroys(entry, k_counted[c]) && now == base[c] + 1) now = base[c];
    if (then && destroys(then, k_counted[c]) && now == base[c] + 1) now = base[c];
    if (may_leak && strcmp(k_counted[c], "allocations") == 0 && now > base[c]) now = base[c];
    CHECKF(now == base[c], "%s (%s): %lld %s live before, %lld after", what, fired ? "fired" : "never reached", base[c],
           k_counted[c], now);
  }
  if (op->prepare) op->prepare();
  S.reset();
  fdp_result_t r2 = op->run();
  CHECKF(r2 == FDP_OK, "%s: the next call fails too: %s (%s)", what, fdp_result_name(r2), fdp_last_error());
  if (r2 == FDP_OK) op->verify();
  nerr = S.errors(buf, sizeof buf);
  CHECKF(nerr == 0, "%s: the next call: %lld misuse(s):\n%s", what, nerr, buf);
  /* What fastdp caches (kernel modules, communicators) goes at shutdown. */
  fdp_shutdown();
  for (size_t c = 0; c < NCACHED; c++) {
    long long now = S.stat(k_cached[c]);
    if (destroys(entry, k_cached[c]) && now == cbase[c] + 1) now = cbase[c];
    if (then && destroys(then, k_cached[c]) && now == cbase[c] + 1) now = cbase[c];
    CHECKF(now == cbase[c], "%s: %lld %s live after shutdown before, %lld after", what, cbase[c], k_cached[c], now);
  }
  S.reset();
}

/* Recoveries and what they fall back on when they fail too: a fence replaced by a host wait, a stream-ordered free
 * by a wait and a plain free, a context pushed for the wait, a broken communicator set aborted. */
static const char *const k_then[] = {"cuStreamSynchronize", "cuCtxPushCurrent_v2", "cuMemFree_v2", "ncclCommAbort"};
#define NTHEN (sizeof k_then / sizeof k_then[0])

/* Every operation, with every driver/NCCL call it makes failing in turn (from a cold start: fdp_shutdown first, so
 * context retains, module loads and communicator set-up are part of it), checked by sweep_trial. `only` (may be
 * NULL) limits it to one entry point; `pairs` makes each of those failures followed by a failure of the next call
 * of each entry of k_then. */
void sweep(const char *only, int pairs) {
  for (size_t o = 0; o < sizeof k_sweep / sizeof k_sweep[0]; o++) {
    const sweep_op_t *op = &k_sweep[o];
    op->setup();
    fdp_shutdown();
    if (op->prepare) op->prepare();
    S.reset();
    OK(op->run());
    long long calls[128] = {0};
    int nentries = 0;
    for (int e = 0; S.entry(e); e++, nentries++)
      calls[e] = S.calls(S.entry(e));
    op->verify();
    sim_clean(op->name);
    int trials = 0, failed_before = n_fail;
    for (int e = 0; e < nentries && n_fail - failed_before <= 20; e++) {
      const char *name = S.entry(e);
      if (only && strcmp(only, name) != 0) continue;
      for (long long k = 1; k <= calls[e] && n_fail - failed_before <= 20; k++) {
        for (size_t t = 0; t < (pairs ? NTHEN : 1); t++) {
          sweep_trial(op, name, k, pairs ? k_then[t] : NULL);
          trials++;
        }
      }
    }
    printf("sweep: %s: %d injected failures%s\n", op->name, trials, pairs ? " (each followed by another)" : "");
    fflush(stdout);
    op->teardown();
    sim_clean(op->name);
  }
}
