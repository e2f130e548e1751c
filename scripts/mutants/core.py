"""GPU-path mutants of the C core: the cuda backend (streams, contexts, peer copies, host copies, scratch memory,
alignment, sums in passes, recoveries that fail too), the NCCL backend and loader (counts, contexts, concurrency,
sticky errors), lazily made per-device state and its publication between threads, the driver loader, and the
kernels in cuda/. Each is one realistic bug; scripts/mutants.py plants them one at a time."""

COPIES = "csrc/backend/cuda/copy.c"
SUMS = "csrc/backend/cuda/sum.c"
SCRATCH = "csrc/backend/cuda/scratch.c"
MODULES = "csrc/backend/cuda/kernel_module.c"
NCCL = "csrc/backend/cuda/nccl.c"
NCCL_LOADER = "csrc/dl/nccl_loader.c"
DRIVER = "csrc/dl/cuda_driver.c"
SUM = "cuda/sum.cu"
COPY = "cuda/copy.cu"
LAYOUT = "csrc/backend/cuda/layout.c"
OPS = "csrc/core/ops.c"
IMAGES = "csrc/backend/cuda/kernel_image.c"
MODULE_H = "csrc/backend/cuda/kernel_module.h"
NVRTC = "csrc/dl/nvrtc.c"

MUTANTS = [
    # ---- stream ordering ----
    dict(name="peer-copy-no-wait", file=COPIES,
         find="  FDP_CHECK_GOTO(stream_wait(cu, sdev, x.sstream, ddev, x.dstream, NULL), r, unread);\n",
         replace="",
         what="a cross-device copy starts without waiting for the source stream"),
    dict(name="peer-copy-no-fence-back", file=COPIES,
         find="  fdp_result_t r = stream_wait(cu, x->ddev, x->dstream, x->sdev, x->sstream, x->ta.ptr ? &x->ta : NULL);",
         replace="  fdp_result_t r = FDP_OK;\n  *drained = 1;",
         what="the source stream never waits for a cross-device copy that reads its memory"),
    dict(name="event-not-recorded", file=COPIES,
         find='  FDP_CHECK_GOTO(fdp__cu_check(cu->EventRecord(ev, from), "cuEventRecord", from_dev), r, out);\n',
         replace="",
         what="stream_wait waits on an event that was never recorded"),
    dict(name="wait-on-legacy-stream", file=COPIES,
         find='  r = fdp__cu_check(cu->StreamWaitEvent(to, ev, 0), "cuStreamWaitEvent", to_dev);',
         replace='  r = fdp__cu_check(cu->StreamWaitEvent(NULL, ev, 0), "cuStreamWaitEvent", to_dev);',
         what="the wait is enqueued on the legacy stream instead of the stream that needs it"),
    dict(name="same-device-copy-legacy-stream", file=COPIES,
         find="      CUstream stream = (CUstream)fdp__stream_for(streams, ddev);",
         replace="      CUstream stream = NULL;",
         what="a same-device copy runs on the legacy stream, not the caller's"),
    dict(name="reduce-legacy-stream", file=SUMS,
         find="  CUstream stream = (CUstream)fdp__stream_for(streams, dev);\n  CUdeviceptr o =",
         replace="  CUstream stream = NULL;\n  CUdeviceptr o =",
         what="a single-device sum runs on the legacy stream, not the caller's"),
    dict(name="host-copy-legacy-stream", file=COPIES,
         find="  x->stream = (CUstream)fdp__stream_for(streams, x->dev);",
         replace="  x->stream = NULL;",
         what="a host<->device copy runs on the legacy stream, not the caller's"),
    dict(name="scratch-freed-on-legacy-stream", file=SCRATCH,
         find="    CUresult e = cu->MemFreeAsync(s->ptr, s->stream);",
         replace="    CUresult e = cu->MemFreeAsync(s->ptr, NULL);",
         what="pool scratch memory is freed on the legacy stream, not after its users"),
    dict(name="scratch-given-back-on-other-stream", file=SCRATCH,
         find="    s->via.free(s->via.ctx, s->dev, (void *)s->stream, s->handle);",
         replace="    s->via.free(s->via.ctx, s->dev, NULL, s->handle);",
         what="scratch from PyTorch's allocator is given back on another stream than its own"),
    # ---- host memory ----
    dict(name="host-copy-no-sync", file=COPIES,
         find="  CUresult es = cu->StreamSynchronize(x->stream);",
         replace="  CUresult es = CUDA_SUCCESS;",
         what="a host<->device copy returns before its stream finished (host buffer reused or read too early)"),
    dict(name="host-copy-syncs-legacy-stream", file=COPIES,
         find="  CUresult es = cu->StreamSynchronize(x->stream);",
         replace="  CUresult es = cu->StreamSynchronize(NULL);",
         what="the host waits for the legacy stream, which does not cover the caller's non-blocking stream"),
    # ---- contexts and peer access ----
    dict(name="peer-access-wrong-direction", file=COPIES,
         find="  FDP_CHECK(fdp__cu_peer_enable(ddev, sdev, NULL));",
         replace="  FDP_CHECK(fdp__cu_peer_enable(sdev, ddev, NULL));",
         what="peer access is enabled from the source to the destination, the copy runs the other way"),
    dict(name="peer-access-not-enabled", file=COPIES,
         find="  FDP_CHECK(fdp__cu_peer_enable(ddev, sdev, NULL));\n",
         replace="",
         what="cross-device copies never enable peer access"),
    dict(name="peer-copy-wrong-context", file=COPIES,
         find="  FDP_CHECK_GOTO(fdp__cu_ctx_push(ddev, NULL), r, unread);\n  r = peer_transfer(cu, &x);",
         replace="  FDP_CHECK_GOTO(fdp__cu_ctx_push(sdev, NULL), r, unread);\n  r = peer_transfer(cu, &x);",
         what="the transfer is enqueued with the source's context current instead of the destination's"),
    dict(name="stream-wait-pop-missing", file=COPIES,
         find="  if (r == FDP_OK && release != NULL) r = fdp__cuda_scratch_free(cu, release);\n"
              "  FDP_CHECK_KEEP(fdp__cu_ctx_pop(to_dev), r);\n",
         replace="  if (r == FDP_OK && release != NULL) r = fdp__cuda_scratch_free(cu, release);\n",
         what="stream_wait leaves the waiting device's context pushed on the caller's thread"),
    dict(name="peer-enable-in-peer-context", file=DRIVER,
         find="  FDP_CHECK(fdp__cu_ctx_push(device, NULL)); /* the context that gains access must be current */",
         replace="  FDP_CHECK(fdp__cu_ctx_push(peer, NULL)); /* the context that gains access must be current */",
         what="peer access is requested with the peer's own context current"),
    # ---- copies and sums ----
    dict(name="rows-pitch-swapped", file=COPIES,
         find="      c.srcPitch = spitch;\n      c.dstMemoryType = CU_MEMORYTYPE_DEVICE;",
         replace="      c.srcPitch = dpitch;\n      c.dstMemoryType = CU_MEMORYTYPE_DEVICE;",
         what="a same-device 2D copy uses the destination's pitch for the source"),
    dict(name="staged-unpack-skipped", file=COPIES,
         find="  if (x->tb.ptr) FDP_CHECK_GOTO(stage_kernel(cu, x->ddev, x->dstream, x->p, x->tb.ptr, 0), r, out);\n",
         replace="",
         what="a staged cross-device copy into a strided destination never unpacks"),
    dict(name="partial-sums-in-aliased-output", file=SUMS,
         find="    if (inputs[i].data == out->data) acc = 0;",
         replace="    if (inputs[i].data == out->data) acc = o;",
         what="partial sums are kept in an output that a later pass still reads as an input"),
    dict(name="grid-rounds-down", file=MODULES,
         find="  int64_t blocks = (n + FDP_KERNEL_THREADS - 1) / FDP_KERNEL_THREADS;",
         replace="  int64_t blocks = n / FDP_KERNEL_THREADS;",
         what="the grid size rounds down (no block at all for fewer than 256 elements)"),
    # ---- NCCL ----
    dict(name="nccl-context-not-restored", file=NCCL,
         find="    FDP_CHECK_KEEP(ctx_restore(cu, saved), res);",
         replace="    (void)saved;",
         what="the caller's context is not restored after a grouped NCCL launch"),
    dict(name="nccl-init-context-not-restored", file=NCCL,
         find="  fdp_result_t restored = ctx_restore(cu, saved);",
         replace="  fdp_result_t restored = FDP_OK;\n  (void)saved;",
         what="the caller's context is not restored after ncclCommInitAll"),
    dict(name="comm-cache-keyed-by-set", file=NCCL,
         find="    if (s->n == n && memcmp(s->devs, devs, (size_t)n * sizeof *devs) == 0) {",
         replace="    int same = s->n == n;\n"
                 "    for (int i = 0; same && i < n; i++) {\n"
                 "      int found = 0;\n"
                 "      for (int j = 0; j < n; j++)\n"
                 "        found |= s->devs[j] == devs[i];\n"
                 "      same = found;\n"
                 "    }\n"
                 "    if (same) {",
         what="the communicator cache is keyed by the set of devices, not their order"),
    dict(name="reduce-wrong-root", file=NCCL,
         find="ops[i].recv, count, type, ncclSum, 0, set->comms[i], ops[i].stream)",
         replace="ops[i].recv, count, type, ncclSum, n - 1, set->comms[i], ops[i].stream)",
         what="ncclReduce names the last rank as root instead of the output's device"),
    dict(name="broadcast-wrong-root", file=NCCL,
         find="api->Broadcast(ops[i].send, ops[i].recv, count, type, 0, set->comms[i], ops[i].stream)",
         replace="api->Broadcast(ops[i].send, ops[i].recv, count, type, 1, set->comms[i], ops[i].stream)",
         what="ncclBroadcast names rank 1 as root instead of the source's device"),
    dict(name="free-mutex-not-held", file=NCCL,
         find="    pthread_mutex_t *free_mutex = n > 1 ? fdp__torch_free_mutex() : NULL;",
         replace="    pthread_mutex_t *free_mutex = NULL;",
         what="grouped launches run without PyTorch's allocator free mutex"),
    dict(name="free-mutex-not-looked-up", file=NCCL_LOADER,
         find="  find_free_mutex();\n",
         replace="",
         what="the NCCL loader never looks up PyTorch's free mutex"),
    dict(name="group-end-skipped-on-error", file=NCCL,
         find="  r = api->GroupEnd();\n  if (first != ncclSuccess) return nccl_fail(api, first, bad, op, devs, n);",
         replace="  if (first != ncclSuccess) return nccl_fail(api, first, bad, op, devs, n);\n  r = api->GroupEnd();",
         what="a failed call inside a group returns without ncclGroupEnd"),
    dict(name="broken-comm-reused", file=NCCL,
         find="      if (comms_broken(api, s)) {\n        comms_evict(api, cu, s);\n        break;\n      }\n",
         replace="",
         what="a cached communicator set is reused after it reported an asynchronous error"),
    dict(name="broken-comm-not-aborted", file=NCCL,
         find="      ncclResult_t r = broken ? api->CommAbort(set->comms[i]) : api->CommDestroy(set->comms[i]);",
         replace="      ncclResult_t r = broken ? ncclSuccess : api->CommDestroy(set->comms[i]);",
         what="an evicted communicator set is dropped without ncclCommAbort"),
    dict(name="bf16-as-fp16", file=NCCL,
         find="  case FDP_DTYPE_BF16: *t = ncclBfloat16; return version >= 21000;",
         replace="  case FDP_DTYPE_BF16: *t = ncclFloat16; return version >= 21000;",
         what="bfloat16 is reduced by NCCL as float16"),
    # ---- kernels ----
    dict(name="sum-not-grid-stride", file=SUM,
         find="i < a.n; i += step) {",
         replace="i < a.n; i += a.n) {",
         what="the sum kernel handles one element per thread (no grid-stride loop)"),
    dict(name="sum-tail-overrun", file=SUM,
         find="i < a.n; i += step) {",
         replace="i <= a.n; i += step) {",
         what="the sum kernel writes one element past the end"),
    dict(name="sum-int32-index", file=SUM,
         find="  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < a.n; i += step) {",
         replace="  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < a.n; i += step) {",
         what="the sum kernel's element index is a 32-bit int"),
    dict(name="copy-not-grid-stride", file=COPY,
         find="i < a.numel; i += step) {",
         replace="i < a.numel; i += a.numel) {",
         what="the strided-copy kernel handles one element per thread (no grid-stride loop)"),
    dict(name="copy-int32-offsets", file=COPY,
         find="    long long rest = i, so = 0, dof = 0;",
         replace="    long long rest = i;\n    int so = 0, dof = 0;",
         what="the strided-copy kernel computes element offsets in 32 bits"),
    dict(name="copy-dims-reversed", file=COPY,
         find="    for (int d = last; d > 0; d--) {",
         replace="    for (int d = 1; d <= last; d++) {",
         what="the strided-copy kernel peels index digits outermost first"),
    # ---- alignment: wide elements at misaligned addresses fault on a GPU ----
    dict(name="kernel-copy-misaligned-elements", file=LAYOUT,
         find="  if (!es_ok || p->src % (uint64_t)p->es != 0 || p->dst % (uint64_t)p->es != 0) split_bytes(p);",
         replace="  if (!es_ok) split_bytes(p);",
         what="the strided-copy kernel copies elements at addresses not aligned to their size whole, not as bytes"),
    dict(name="sum-misaligned-accepted", file=OPS,
         find="  FDP_CHECK(check_sum_aligned(in, \"input\", i));\n",
         replace="",
         what="a sum of inputs not aligned to their element size is launched (the kernel faults)"),
    dict(name="copy-8-reads-16", file=COPY,
         find="  copy_body(static_cast<const unsigned long long *>(s), static_cast<unsigned long long *>(d), a);",
         replace="  copy_body(static_cast<const uint4 *>(s), static_cast<uint4 *>(d), a);",
         what="the 8-byte copy kernel moves 16-byte vectors (8-byte aligned addresses are not 16-byte aligned)"),
    # ---- NCCL: counts, contexts, concurrency, sticky errors ----
    dict(name="nccl-bytes-counted-as-elements", file=NCCL,
         find="    count *= (size_t)src->elem_size;\n",
         replace="",
         what="a type NCCL lacks is broadcast as bytes with a count of elements"),
    dict(name="comms-context-not-held", file=NCCL,
         find="  for (int i = 0; i < n; i++)\n    FDP_CHECK(fdp__cu_ctx_get(devs[i], NULL));\n  comm_set_t *s",
         replace="  comm_set_t *s",
         what="communicators are made without fastdp holding each device's primary context"),
    dict(name="nccl-lock-per-root", file=NCCL,
         find=('  pthread_mutex_lock(&g_lock);\n'
               '  fdp_result_t res = comms_get(api, cu, devs, n, &set);\n'
               '  if (res == FDP_OK) {\n'
               '    pthread_mutex_t *free_mutex = n > 1 ? fdp__torch_free_mutex() : NULL;\n'
               '    if (free_mutex) pthread_mutex_lock(free_mutex);\n'
               '    saved_ctx_t saved = ctx_save(cu);\n'
               '    res = saved.ok ? group_enqueue(api, set, devs, n, ops, count, type, reduce)\n'
               '                   : ctx_refuse(saved, reduce ? "ncclReduce" : "ncclBroadcast");\n'
               '    FDP_CHECK_KEEP(ctx_restore(cu, saved), res);\n'
               '    if (free_mutex) pthread_mutex_unlock(free_mutex);\n'
               '    if (res != FDP_OK) evict_if_broken(api, cu, set);\n'
               '  }\n'
               '  pthread_mutex_unlock(&g_lock);\n'
               '  return res;'),
         replace=('  static pthread_mutex_t per_root[FDP_MAX_DEVICES] = {[0 ... FDP_MAX_DEVICES - 1] = PTHREAD_MUTEX_INITIALIZER};\n'
                  '  pthread_mutex_lock(&g_lock);\n'
                  '  fdp_result_t res = comms_get(api, cu, devs, n, &set);\n'
                  '  pthread_mutex_unlock(&g_lock);\n'
                  '  if (res == FDP_OK) {\n'
                  '    pthread_mutex_lock(&per_root[devs[0]]);\n'
                  '    pthread_mutex_t *free_mutex = n > 1 ? fdp__torch_free_mutex() : NULL;\n'
                  '    if (free_mutex) pthread_mutex_lock(free_mutex);\n'
                  '    saved_ctx_t saved = ctx_save(cu);\n'
                  '    res = saved.ok ? group_enqueue(api, set, devs, n, ops, count, type, reduce)\n'
                  '                   : ctx_refuse(saved, reduce ? "ncclReduce" : "ncclBroadcast");\n'
                  '    FDP_CHECK_KEEP(ctx_restore(cu, saved), res);\n'
                  '    if (free_mutex) pthread_mutex_unlock(free_mutex);\n'
                  '    pthread_mutex_unlock(&per_root[devs[0]]);\n'
                  '    if (res != FDP_OK) {\n'
                  '      pthread_mutex_lock(&g_lock);\n'
                  '      evict_if_broken(api, cu, set);\n'
                  '      pthread_mutex_unlock(&g_lock);\n'
                  '    }\n'
                  '  }\n'
                  '  return res;'),
         what="grouped NCCL launches are serialised per root device, not across device lists sharing devices"),
    dict(name="shutdown-destroys-broken-comms", file=NCCL,
         find="      comms_end(api, cu, s, comms_broken(api, s));",
         replace="      comms_end(api, cu, s, 0);",
         what="shutdown destroys communicators that reported an asynchronous error (can hang) instead of aborting"),
    dict(name="evict-destroys-broken-comms", file=NCCL,
         find="    comms_end(api, cu, set, 1);",
         replace="    comms_end(api, cu, set, 0);",
         what="an evicted broken communicator set is destroyed, not aborted"),
    dict(name="async-error-only-remote", file=NCCL,
         find="(st != ncclSuccess && st != ncclInProgress)",
         replace="(st == ncclRemoteError)",
         what="only a remote error counts as breaking a communicator (an internal or CUDA error does too)"),
    # ---- publication between threads ----
    dict(name="module-published-before-written", file=MODULES,
         find="        g_mod[dev] = m;\n        atomic_store_explicit(&g_mod_state[dev], 1, memory_order_release);",
         replace="        atomic_store_explicit(&g_mod_state[dev], 1, memory_order_release);\n        g_mod[dev] = m;",
         what="a device's kernel module is marked loaded before its functions are stored"),
    dict(name="module-read-relaxed", file=MODULES,
         find="  int st = atomic_load_explicit(&g_mod_state[dev], memory_order_acquire);\n  if (st == 0) {",
         replace="  int st = atomic_load_explicit(&g_mod_state[dev], memory_order_relaxed);\n  if (st == 0) {",
         what="the kernel module's fast path reads the loaded flag without acquire ordering"),
    dict(name="module-loaded-twice", file=MODULES,
         find="    if (atomic_load_explicit(&g_mod_state[dev], memory_order_relaxed) == 0) {",
         replace="    if (1) {",
         what="a thread that waited for another's module load loads the module again"),
    dict(name="facts-read-unpublished", file=MODULES,
         find="  return st == 1 ? g_mod_src[dev] : st < 0 ? g_mod_err[dev] : \"\";",
         replace="  (void)st;\n  return g_mod_src[dev];",
         what="the kernels' source fact is read while another thread may still be writing it"),
    dict(name="image-forget-frees-held", file=IMAGES,
         find="    fdp__kimage_put(&g_images[i]);",
         replace="    free(((shared_bytes_t *)g_images[i].shared)->data);",
         what="forgetting the kernel images frees one another thread's module load is still reading"),
    # ---- sums in passes ----
    dict(name="alias-scan-off-by-one", file=SUMS,
         find="  for (int i = FDP_SUM_MAX_INPUTS; i < n; i++)\n    if (inputs[i].data == out->data) acc = 0;",
         replace="  for (int i = FDP_SUM_MAX_INPUTS + 1; i < n; i++)\n    if (inputs[i].data == out->data) acc = 0;",
         what="an output that is the first input of the second pass keeps the running sum (overwritten early)"),
    dict(name="alias-scan-second-pass-only", file=SUMS,
         find="  for (int i = FDP_SUM_MAX_INPUTS; i < n; i++)\n    if (inputs[i].data == out->data) acc = 0;",
         replace="  for (int i = FDP_SUM_MAX_INPUTS; i < n && i < 2 * FDP_SUM_MAX_INPUTS; i++)\n"
                 "    if (inputs[i].data == out->data) acc = 0;",
         what="an output that is an input of the third pass or later keeps the running sum"),
    # ---- two failures in a row ----
    dict(name="fence-fail-frees-staging", file=COPIES,
         find="  *drained = rs == FDP_OK;",
         replace="  *drained = 1;",
         what="after a failed fence and a failed host wait, the staging buffer is freed under the copy reading it"),
    dict(name="free-fallback-after-failed-wait", file=SCRATCH,
         find="      if (es == CUDA_SUCCESS) es = cu->MemFree(s->ptr);",
         replace="      es = cu->MemFree(s->ptr);",
         what="after a failed cuMemFreeAsync and a failed wait, the buffer is freed with cuMemFree anyway"),
    dict(name="free-fallback-without-wait", file=SCRATCH,
         find="      CUresult es = cu->StreamSynchronize(s->stream);\n      if (es == CUDA_SUCCESS) es = cu->MemFree(s->ptr);",
         replace="      CUresult es = cu->MemFree(s->ptr);",
         what="after a failed cuMemFreeAsync the buffer is freed with cuMemFree without waiting for its users"),
    # ---- the driver's and NVRTC's own rules (launch geometry, copy descriptors, options, the kernel cache's key,
    # memory nobody wrote) ----
    dict(name="launch-block-over-bound", file=MODULE_H,
         find="#define FDP_KERNEL_THREADS 256",
         replace="#define FDP_KERNEL_THREADS 512",
         what="launches use blocks of 512 threads, beyond the kernels' __launch_bounds__(256): the driver refuses"),
    dict(name="memcpy3d-depth-unset", file=COPIES,
         find="    c.Depth = 1;\n",
         replace="",
         what="the 3D peer copy's Depth is left 0 by the memset: the driver copies nothing"),
    dict(name="memcpy2d-dst-pitch-unset", file=COPIES,
         find="      c.dstPitch = dpitch;\n",
         replace="",
         what="the 2D copy's destination pitch is left 0, below the row width: the driver refuses it"),
    dict(name="memcpy3d-slice-height-unset", file=COPIES,
         find="    c.srcHeight = height;\n",
         replace="",
         what="the 3D peer copy's source slice height is left 0"),
    dict(name="nvrtc-arch-option-typo", file=NVRTC,
         find='"--gpu-architecture=%s_%d --std=c++14"',
         replace='"--gpu-architecture=%s%d --std=c++14"',
         what="the target option reads sm90, which NVRTC rejects: no kernels on any GPU without the fatbin"),
    dict(name="kernel-key-drops-options", file=IMAGES,
         find="  unsigned long long opt = fnv1a(rc->plan.text, strlen(rc->plan.text));",
         replace="  unsigned long long opt = 0;",
         what="the kernel cache's key leaves out the options and target: an image built for others is served"),
    dict(name="kernel-key-drops-source", file=IMAGES,
         find="  unsigned long long src = fnv1a(rc->source, rc->source_size);",
         replace="  unsigned long long src = 0;",
         what="the kernel cache's key leaves out the source: an image of older kernels is served"),
    dict(name="sum-last-pass-unwritten", file=SUMS,
         find="    FDP_CHECK(launch_sum(cu, dev, stream, m, fn, in, 1 + more, i == n ? out : acc, numel));",
         replace="    FDP_CHECK(launch_sum(cu, dev, stream, m, fn, in, 1 + more, acc, numel));",
         what="a sum of more than 32 inputs leaves its last pass in scratch: the output is never written"),
    dict(name="rows-pitch-past-max", file=LAYOUT,
         find="  if (sp < w || dp < w || sp > FDP_PAIR_MAX_PITCH || dp > FDP_PAIR_MAX_PITCH) return 0;",
         replace="  if (sp < w || dp < w) return 0;",
         what="rows with a pitch past the driver's maximum go to cuMemcpy2DAsync, which refuses them"),
]
