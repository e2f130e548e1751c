/* SPDX-License-Identifier: MIT */
/* The cuda backend's sums on one device: the in-order k-way sum kernel over the inputs, in passes of at most
 * FDP_SUM_MAX_INPUTS that keep the order of every add, ordered on the output's stream. Sums across devices are
 * NCCL's (nccl.c). */
#include "backend/cuda/sum.h"

#include "backend/cuda/kernel_module.h"
#include "backend/cuda/kernels.h"
#include "backend/cuda/scratch.h"
#include "dl/cuda_driver.h"

#include <assert.h>
#include <stdint.h>
#include <string.h>

_Static_assert(sizeof(fdp_sum_args_t) == 8 * FDP_SUM_MAX_INPUTS + 24, "kernel ABI: fdp_sum_args_t");

static fdp_result_t launch_sum(const fdp_cu_t *cu, int dev, CUstream stream, const fdp_kmodule_t *m, CUfunction fn,
                               const CUdeviceptr *in, int k, CUdeviceptr out, int64_t n) {
  fdp_sum_args_t a;
  memset(&a, 0, sizeof a);
  for (int j = 0; j < k; j++)
    a.in[j] = (const void *)(uintptr_t)in[j];
  a.out = (void *)(uintptr_t)out;
  a.n = n;
  a.k = k;
  void *params[] = {&a};
  return fdp__cu_check(
      cu->LaunchKernel(fn, fdp__kmodule_grid(m, n), 1, 1, FDP_KERNEL_THREADS, 1, 1, 0, stream, params, NULL),
      "cuLaunchKernel(k-way sum)", dev);
}

/* Passes of at most FDP_SUM_MAX_INPUTS inputs, each carrying the running sum as its first input, keep the
 * order ((a + b) + c) + ... and so the rounding of every intermediate. */
static fdp_result_t sum_passes(const fdp_cu_t *cu, int dev, CUstream stream, const fdp_kmodule_t *m, CUfunction fn,
                               const fdp_tensor_t *inputs, int n, CUdeviceptr out, CUdeviceptr acc, int64_t numel) {
  CUdeviceptr in[FDP_SUM_MAX_INPUTS];
  int k = n < FDP_SUM_MAX_INPUTS ? n : FDP_SUM_MAX_INPUTS;
  for (int j = 0; j < k; j++)
    in[j] = (CUdeviceptr)(uintptr_t)inputs[j].data;
  FDP_CHECK(launch_sum(cu, dev, stream, m, fn, in, k, k == n ? out : acc, numel));
  for (int i = k; i < n;) {
    int more = n - i < FDP_SUM_MAX_INPUTS - 1 ? n - i : FDP_SUM_MAX_INPUTS - 1;
    in[0] = acc;
    for (int j = 0; j < more; j++)
      in[1 + j] = (CUdeviceptr)(uintptr_t)inputs[i + j].data;
    i += more;
    FDP_CHECK(launch_sum(cu, dev, stream, m, fn, in, 1 + more, i == n ? out : acc, numel));
  }
  return FDP_OK;
}

/* What the core established before routing a reduce here (check_reduce_input, cuda_can). */
static void reduce_invariants(const fdp_tensor_t *inputs, int n, const fdp_tensor_t *out) {
  assert(n >= 1 && fdp_tensor_is_contiguous(out));
  assert(fdp__kmodule_has_sum(out->dtype));
  for (int i = 0; i < n; i++)
    assert(inputs[i].device == out->device && inputs[i].dtype == out->dtype &&
           fdp_tensor_numel(&inputs[i]) == fdp_tensor_numel(out) && fdp_tensor_is_contiguous(&inputs[i]));
#ifdef NDEBUG
  (void)inputs, (void)n, (void)out;
#endif
}

fdp_result_t fdp__cuda_reduce(const fdp_tensor_t *inputs, int n, const fdp_tensor_t *out,
                              const fdp_streams_t *streams) {
  reduce_invariants(inputs, n, out);
  int dev = out->device;
  int64_t numel = fdp_tensor_numel(out);
  if (numel == 0) return FDP_OK;

  const fdp_cu_t *cu;
  FDP_CHECK(fdp__cu_load(&cu, NULL));
  CUstream stream = (CUstream)fdp__stream_for(streams, dev);
  CUdeviceptr o = (CUdeviceptr)(uintptr_t)out->data;
  size_t bytes = (size_t)numel * (size_t)out->elem_size;
  fdp_result_t r = FDP_OK;
  if (n == 1) {
    if (inputs[0].data == out->data) return FDP_OK;
    FDP_CHECK(fdp__cu_ctx_push(dev, NULL));
    r = fdp__cu_check(cu->MemcpyAsync(o, (CUdeviceptr)(uintptr_t)inputs[0].data, bytes, stream), "cuMemcpyAsync", dev);
    FDP_CHECK_KEEP(fdp__cu_ctx_pop(dev), r);
    return r;
  }
  /* The running sum lives in out unless out is an input that a later pass still has to read; then in scratch
   * memory (see NOTE [scratch memory]) allocated and freed on this one stream. */
  CUdeviceptr acc = o;
  for (int i = FDP_SUM_MAX_INPUTS; i < n; i++)
    if (inputs[i].data == out->data) acc = 0;
  const fdp_kmodule_t *m = NULL;
  fdp_cuda_scratch_t tmp;
  memset(&tmp, 0, sizeof tmp);
  FDP_CHECK(fdp__cu_ctx_push(dev, NULL));
  r = fdp__kmodule_get(cu, dev, &m);
  if (r == FDP_UNAVAILABLE) r = fdp__kmodule_needed("a sum of several inputs needs the k-way sum kernel");
  if (r != FDP_OK) goto out;
  if (acc == 0) {
    FDP_CHECK_GOTO(
        fdp__cuda_scratch_alloc(cu, dev, stream, bytes, "partial sums of a reduce into one of its inputs", &tmp), r,
        out);
    acc = tmp.ptr;
  }
  FDP_CHECK_GOTO(sum_passes(cu, dev, stream, m, m->sum[out->dtype], inputs, n, o, acc, numel), r, out);
out:
  FDP_CHECK_KEEP(fdp__cuda_scratch_free(cu, &tmp), r);
  FDP_CHECK_KEEP(fdp__cu_ctx_pop(dev), r);
  return r;
}
