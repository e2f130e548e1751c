/* SPDX-License-Identifier: MIT */
/* fastdp core: the data movement of data-parallel training (broadcast, reduce, scatter, gather, coalesced
 * buckets) over strided tensor descriptors, dispatched to one backend per device list. Pure C11: no Python,
 * no CUDA headers. Every fallible function returns an fdp_result_t; fdp_last_error() says what failed. */
#ifndef FASTDP_CORE_FASTDP_H
#define FASTDP_CORE_FASTDP_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FDP_MAX_DIMS 16
#define FDP_MAX_DEVICES 64
#define FDP_HOST (-1) /* device ordinal of host memory */

/* One table gives the result enum, its names and its messages. */
#define FDP_RESULT_MAP(X)                                                                                              \
  X(OK, "success")                                                                                                     \
  X(INVALID, "invalid argument")                                                                                       \
  X(DTYPE, "unsupported dtype")                                                                                        \
  X(NOMEM, "out of host memory")                                                                                       \
  X(UNAVAILABLE, "backend not available")                                                                              \
  X(CUDA, "CUDA error")                                                                                                \
  X(NCCL, "NCCL error")                                                                                                \
  X(INTERNAL, "internal error")                                                                                        \
  X(OVERLAP, "overlapping memory")

typedef enum {
#define FDP_X(name, msg) FDP_##name,
  FDP_RESULT_MAP(FDP_X)
#undef FDP_X
      FDP_RESULT_COUNT
} fdp_result_t;

/* Element types the reductions know. Copies only need the element size, so any dtype can be moved. */
#define FDP_DTYPE_MAP(X)                                                                                               \
  X(OTHER, "other", 0)                                                                                                 \
  X(BOOL, "bool", 1)                                                                                                   \
  X(U8, "uint8", 1)                                                                                                    \
  X(I8, "int8", 1)                                                                                                     \
  X(I16, "int16", 2)                                                                                                   \
  X(I32, "int32", 4)                                                                                                   \
  X(I64, "int64", 8)                                                                                                   \
  X(F16, "float16", 2)                                                                                                 \
  X(BF16, "bfloat16", 2)                                                                                               \
  X(F32, "float32", 4)                                                                                                 \
  X(F64, "float64", 8)

typedef enum {
#define FDP_X(name, str, size) FDP_DTYPE_##name,
  FDP_DTYPE_MAP(FDP_X)
#undef FDP_X
      FDP_DTYPE_COUNT
} fdp_dtype_t;

/* A strided view of memory on one device. Sizes and strides are in elements; data is element 0.
 * Descriptors never own memory: the caller keeps it alive until the operation using it completes. */
typedef struct fdp_tensor {
  char *data;
  int device;    /* FDP_HOST or a CUDA ordinal */
  int dtype;     /* fdp_dtype_t */
  int elem_size; /* bytes per element */
  int ndim;
  int64_t sizes[FDP_MAX_DIMS];
  int64_t strides[FDP_MAX_DIMS];
} fdp_tensor_t;

/* The stream each device's work is ordered on (PyTorch's current stream there). Ignored by the host backend.
 * A device that is not listed uses its legacy default stream. */
typedef struct fdp_streams {
  int n;
  int device[FDP_MAX_DEVICES];
  void *stream[FDP_MAX_DEVICES];
} fdp_streams_t;

typedef enum { FDP_BACKEND_HOST = 0, FDP_BACKEND_CUDA = 1, FDP_BACKEND_NCCL = 2, FDP_BACKEND_COUNT } fdp_backend_id_t;

/* ---- errors ---- */

/* Name ("FDP_INVALID") and message of a result code; static strings. */
const char *fdp_result_name(fdp_result_t r);
const char *fdp_result_message(fdp_result_t r);
/* Detail of the last failure on this thread (what failed, with which arguments); valid until the next
 * failing call on the same thread. Never NULL. */
const char *fdp_last_error(void);
/* The CUDA driver's CUresult or NCCL's ncclResult_t behind the last failure on this thread (the one
 * fdp_last_error describes); 0 when that failure was not a library call's. */
int fdp_last_status(void);

/* ---- tensors ---- */

const char *fdp_dtype_name(int dtype);
int64_t fdp_tensor_numel(const fdp_tensor_t *t);
/* 1 when the elements occupy one gap-free block in some dimension order (contiguous, channels_last, ...). */
int fdp_tensor_is_dense(const fdp_tensor_t *t);
/* 1 when row-major contiguous. */
int fdp_tensor_is_contiguous(const fdp_tensor_t *t);
/* The view of `t` narrowed to [start, start + length) along dim (already wrapped). */
void fdp_tensor_narrow(const fdp_tensor_t *t, int dim, int64_t start, int64_t length, fdp_tensor_t *out);
/* 1 when two elements of `t` are one memory location (expanded, repeated strides), 0 when none are, -1 when a
 * cheap test cannot tell (interleaved strides). */
int fdp_tensor_internal_overlap(const fdp_tensor_t *t);
/* 1 when `a` and `b` share at least one memory location, 0 when they share none, -1 when a cheap test cannot
 * tell (different, interleaved layouts whose byte ranges intersect). */
int fdp_tensor_overlap(const fdp_tensor_t *a, const fdp_tensor_t *b);

/* ---- backends ---- */

/* Which backends this build contains and which can run now; `why` (may be NULL) receives a static or
 * thread-local explanation when one cannot. Thread-safe. */
int fdp_backend_compiled(fdp_backend_id_t id);
int fdp_backend_usable(fdp_backend_id_t id, const char **why);
const char *fdp_backend_name(fdp_backend_id_t id);

/* The operations the core routes (see NOTE [routing] in backend.h). */
typedef enum { FDP_OP_COPY = 0, FDP_OP_BROADCAST = 1, FDP_OP_REDUCE = 2 } fdp_op_t;
/* The backend the core picks for `op` over one dense, one-dimensional buffer of `dtype` on each of devices[0..n)
 * (FDP_HOST or a CUDA index): broadcast from devices[0] to the others, or reduce from all onto devices[0]. For a
 * broadcast, FDP_BACKEND_CUDA / FDP_BACKEND_HOST mean element-wise copies. Asks the backends exactly what an
 * operation on such buffers would; loads libraries, touches no GPU. Thread-safe. FDP_INVALID for a bad
 * argument, FDP_UNAVAILABLE (detail says why) when no backend can run it. */
fdp_result_t fdp_route_devices(fdp_op_t op, const int *devices, int n, int dtype, fdp_backend_id_t *out);

/* ---- bucket plans (coalesced operations) ---- */

typedef struct fdp_bucket {
  int dtype; /* fdp_dtype_t of every member (or OTHER, grouped by elem_size) */
  int elem_size;
  int64_t numel; /* elements in the flat buffer */
  int first;     /* index into fdp_plan_t.members */
  int count;
} fdp_bucket_t;

typedef struct fdp_member {
  int tensor;     /* index in the input list */
  int64_t offset; /* element offset inside the bucket's flat buffer */
  int64_t numel;
} fdp_member_t;

typedef struct fdp_plan {
  int nbuckets;
  int nmembers;
  fdp_bucket_t *buckets;
  fdp_member_t *members;
} fdp_plan_t;

/* Groups tensors by (dtype, element size), keeping their order within a group, and closes a bucket once it
 * holds at least bucket_bytes (one tensor larger than that is a bucket of its own), as upstream's
 * take_tensors does. `type_key[i]` separates groups beyond the dtype (e.g. dense vs. sparse); may be NULL.
 * On success *out is owned by the caller and released with fdp_plan_free. Errors: FDP_INVALID, FDP_NOMEM. */
fdp_result_t fdp_plan_build(const fdp_tensor_t *tensors, const int *type_key, int n, size_t bucket_bytes,
                            fdp_plan_t **out);
void fdp_plan_free(fdp_plan_t *plan);

/* ---- operations ----
 * Copies (copy, broadcast, scatter, gather) may cross between host and CUDA memory; they are then the cuda
 * backend's work, and FDP_UNAVAILABLE where it cannot run. A reduce takes all-host or all-CUDA tensors only
 * (FDP_INVALID otherwise). Host work is complete when the call returns. CUDA and NCCL work is enqueued on the listed
 * streams and ordered after the work already there; memory may be reused once those streams pass the call's point.
 * Functions are thread-safe; the caller must not write the destinations concurrently. */

/* dst[i] = src for every i. Shapes must match; strides may differ. A destination with the very address and
 * strides of src is skipped (the source entry of a broadcast). NCCL when every tensor is dense, same-strided,
 * on distinct devices and of an NCCL dtype (bytes otherwise); device copies or host memcpy otherwise. */
fdp_result_t fdp_op_broadcast(const fdp_tensor_t *src, const fdp_tensor_t *dst, int ndst, const fdp_streams_t *streams);

/* out = inputs[0] + inputs[1] + ... in that order, per element. Inputs and out must be contiguous, of one
 * shape and dtype, and aligned to their element size (FDP_INVALID otherwise); out may alias no input except by
 * being one of them exactly. */
fdp_result_t fdp_op_reduce(const fdp_tensor_t *inputs, int n, const fdp_tensor_t *out, const fdp_streams_t *streams);

/* Sums of many members over host replicas without packing them, prepared once per bucket (a bucket's members keep
 * their shapes and dtype from step to step): fdp_rows_prepare checks the k members' descriptors (host, one summable
 * dtype; their data and strides are not read) and lays them out back to back; fdp_rows_member_fits says whether a step's tensor `t` may stand for member j
 * (host, the member's dtype and shape, contiguous); fdp_rows_run then takes only the data pointers, inputs[q * k + j]
 * for replica q's member j (k * nrep of them, each of a tensor the caller found fitting), and writes member j's sum
 * over the replicas, in replica order, into the 1-D contiguous host tensor `out` at its offset (fdp_rows_numel
 * elements in all). An input that overlaps the output is refused (FDP_INVALID). Runs on the calling thread. On
 * success *out is the caller's, released with fdp_rows_plan_free. */
typedef struct fdp_rows_plan fdp_rows_plan_t;
fdp_result_t fdp_rows_prepare(const fdp_tensor_t *members, int k, int nrep, fdp_rows_plan_t **out);
int fdp_rows_member_fits(const fdp_rows_plan_t *plan, int j, const fdp_tensor_t *t);
fdp_result_t fdp_rows_run(const fdp_rows_plan_t *plan, char *const *inputs, const fdp_tensor_t *out);
int64_t fdp_rows_numel(const fdp_rows_plan_t *plan);
void fdp_rows_plan_free(fdp_rows_plan_t *plan);

/* outs[i] = src narrowed along dim to the i-th chunk, chunk i holding sizes[i] elements along dim. An output
 * that already is that view (same address and strides) is skipped. */
fdp_result_t fdp_op_scatter(const fdp_tensor_t *src, int dim, const int64_t *chunk_sizes, const fdp_tensor_t *outs,
                            int n, const fdp_streams_t *streams);

/* out narrowed along dim to the i-th slice = inputs[i], slices in order. */
fdp_result_t fdp_op_gather(const fdp_tensor_t *inputs, int n, int dim, const fdp_tensor_t *out,
                           const fdp_streams_t *streams);

/* Element-wise copies dst[i] = src[i]; each pair has one shape. Used to pack tensors into flat buckets. */
fdp_result_t fdp_op_copy(const fdp_tensor_t *dst, const fdp_tensor_t *src, int n, const fdp_streams_t *streams);

/* ---- ordering work across streams ----
 * Work that runs on streams of its own (the gradient reduction while backward runs) waits for the streams where its
 * inputs are produced, and the streams that use its outputs wait for it; the host asks when it has completed, to
 * release the memory it used. CUDA streams only: FDP_INVALID for a host entry, FDP_UNAVAILABLE without a usable
 * driver. Nothing here blocks the host. Thread-safe. */

/* For each i, waiters' i-th stream waits for the work enqueued so far on signals' i-th stream (any device: one event
 * is recorded on the signal stream and waited on by the waiter). Both lists have the same length. */
fdp_result_t fdp_streams_order(const fdp_streams_t *waiters, const fdp_streams_t *signals);

/* A fence: the point each of a list of streams has reached when it was recorded (one event per stream). */
typedef struct fdp_fence fdp_fence_t;
/* Records a fence behind the work enqueued so far on every listed stream. On success *out is the caller's, released
 * with fdp_fence_free. */
fdp_result_t fdp_fence_record(const fdp_streams_t *streams, fdp_fence_t **out);
/* Every listed stream waits for the work before the fence, on every fenced stream. */
fdp_result_t fdp_fence_wait(const fdp_fence_t *fence, const fdp_streams_t *waiters);
/* *done = 1 when the work before the fence has completed on every fenced stream, 0 when some is still running. */
fdp_result_t fdp_fence_query(const fdp_fence_t *fence, int *done);
/* Releases the fence (the driver keeps its events until the work before them completes); NULL is ignored. */
void fdp_fence_free(fdp_fence_t *fence);

/* A copy checked once and run as often as wanted (the kept replicas copy the master into the same buffers every
 * step): fdp_copy_prepare validates the pairs as fdp_op_copy does and keeps copies of the descriptors; fdp_copy_run
 * performs them, ordered on the listed streams. The caller keeps the memory where it was described (no tensor
 * moved or freed) while it runs the plan. On success *out is the caller's, released with fdp_copy_plan_free. */
typedef struct fdp_copy_plan fdp_copy_plan_t;
fdp_result_t fdp_copy_prepare(const fdp_tensor_t *dst, const fdp_tensor_t *src, int n, fdp_copy_plan_t **out);
fdp_result_t fdp_copy_run(const fdp_copy_plan_t *plan, const fdp_streams_t *streams);
void fdp_copy_plan_free(fdp_copy_plan_t *plan);

/* ---- machine facts (python -m fastdp info) ----
 * What a backend knows of its library and its devices, asked through the backend table. Every fact reads as absent
 * (0, "") where a library cannot be loaded; nothing here touches a GPU unless asked to read free memory. */
typedef struct fdp_library_facts {
  int version;         /* the library's: the CUDA driver's (e.g. 13000) for cuda, NCCL's (e.g. 22703) for nccl */
  const char *library; /* the file in use, "" when none or not known; valid for the process lifetime */
  int devices;         /* the devices it sees */
} fdp_library_facts_t;

/* Fills *out; zeros for a backend without a library (host). Loads the library if needed. Thread-safe. */
void fdp_library_facts(fdp_backend_id_t id, fdp_library_facts_t *out);

/* How fdp_device_facts treats free memory, which needs the device's primary context: */
typedef enum {
  FDP_FREE_NEVER = 0,     /* not read */
  FDP_FREE_IF_ACTIVE = 1, /* read where the context is active already (PyTorch or fastdp made it): costs nothing */
  FDP_FREE_ALWAYS = 2     /* read everywhere, creating the context for the query where it is not active: a second or
                             so and hundreds of MB while it lives, and an error under exclusive-process mode when
                             another process holds the GPU */
} fdp_free_read_t;

typedef struct fdp_device_facts {
  char name[256];
  size_t total_bytes;
  size_t free_bytes; /* valid when free_read */
  int free_read;
  int active;                 /* the primary context was active before the query */
  const char *kernels_source; /* where its kernels came from ("fatbin ...", "NVRTC, from the disk cache ..."),
                                 why none load there, or "" when not loaded yet; valid until fdp_shutdown */
} fdp_device_facts_t;

/* One GPU's facts (out is filled as far as the queries went). Errors: FDP_UNAVAILABLE (no driver), FDP_INVALID
 * (no such device), FDP_CUDA. Thread-safe. */
fdp_result_t fdp_device_facts(int device, fdp_free_read_t free_read, fdp_device_facts_t *out);
/* 1 when the hardware lets `device` access `peer`'s memory directly; 0 otherwise or when unknown. */
int fdp_device_can_access_peer(int device, int peer);

/* ---- device scratch memory ----
 * The cuda backend needs short-lived device buffers: staging for strided copies that the copy engines cannot do,
 * partial sums of reductions whose output is also a later input. By default they come from the CUDA driver's
 * stream-ordered pool (cuMemAllocAsync / cuMemFreeAsync). A framework with its own caching allocator registers it
 * here instead (the Python binding registers PyTorch's), so that this memory is counted by the framework
 * (torch.cuda.memory_allocated and friends) and competes for the same cached blocks: an allocation that does not
 * fit first frees the framework's unused cached blocks and retries, as every PyTorch allocation does.
 *
 * alloc(ctx, device, bytes, stream, &ptr, &handle, err, err_len): returns 0 with *ptr, device memory of `device`
 *   usable by work enqueued on `stream` from now on (stream-ordered, like cuMemAllocAsync on that stream), and an
 *   opaque *handle for free; or nonzero with a NUL-terminated reason in err: FDP_ALLOC_OUT_OF_MEMORY when the
 *   allocator is out of memory (the failure then reports CUDA_ERROR_OUT_OF_MEMORY as its status), 1 otherwise.
 * free(ctx, device, stream, handle): gives the memory back ordered after the work already enqueued on `stream`,
 *   the stream it was allocated on (like cuMemFreeAsync). Never fails.
 * Both are called with the primary context of `device` current (pushed by fastdp: an allocator that switches
 * devices must restore it, as PyTorch's device guards do) and without any fastdp lock held, from whatever thread
 * runs the operation. Register (or unregister with NULL) only while no operation runs; the table is copied.
 */
#define FDP_ALLOC_OUT_OF_MEMORY 2
/* CUresult CUDA_ERROR_OUT_OF_MEMORY, as fdp_last_status() reports it (this header has no CUDA declarations). */
#define FDP_CUDA_OUT_OF_MEMORY 2

typedef struct fdp_allocator {
  int (*alloc)(void *ctx, int device, size_t bytes, void *stream, void **ptr, void **handle, char *err,
               size_t err_len);
  void (*free)(void *ctx, int device, void *stream, void *handle);
  void *ctx;
} fdp_allocator_t;

void fdp_set_device_allocator(const fdp_allocator_t *allocator);

/* ---- kernels: build-time fatbin, NVRTC and its disk cache (python -m fastdp info, tests) ---- */
typedef struct fdp_kernels_facts {
  size_t fatbin_bytes;      /* 0: built without nvcc (NVRTC is then the only source) */
  size_t source_bytes;      /* the embedded kernel source NVRTC compiles */
  int nvrtc_major;          /* 0 when NVRTC cannot be loaded (nvrtc_why says why) */
  int nvrtc_minor;
  char nvrtc_library[1024]; /* the file NVRTC was loaded from */
  char nvrtc_why[512];
  char cache_dir[1024];     /* the disk cache folder; "" when kernels are kept in memory only */
} fdp_kernels_facts_t;

/* Fills *out; loads NVRTC if needed (no GPU involved). Thread-safe. */
void fdp_kernels_facts(fdp_kernels_facts_t *out);

/* ':'-separated folders where NVRTC is looked for (after the copy already in the process and
 * FASTDP_NVRTC_LIBRARY); only before NVRTC is first used, else FDP_INVALID. */
fdp_result_t fdp_nvrtc_search_dirs(const char *dirs);

/* The NVRTC image for architecture `cc` (major * 10 + minor) as the cuda backend would get it: memory, disk
 * cache or compilation. `forget` first drops the images this process keeps in memory (tests: an image another
 * thread is loading stays alive until that load is done). Thread-safe; needs no GPU. Errors: FDP_INVALID (cc), FDP_UNAVAILABLE (no NVRTC, or it
 * cannot target cc), FDP_NOMEM, FDP_INTERNAL (compilation failed; the detail holds NVRTC's log). */
typedef struct fdp_kernels_image_info {
  size_t bytes;
  int arch;   /* the architecture compiled for */
  int ptx;    /* 1: PTX for compute_<arch>; 0: cubin for sm_<arch> */
  int origin; /* 0 disk cache, 1 compiled now and cached, 2 compiled now, memory only */
  double seconds;
  char file[1024];
  char note[256];
  char options[256]; /* every option NVRTC compiled it with, space-separated */
} fdp_kernels_image_info_t;
fdp_result_t fdp_kernels_image(int cc, int forget, fdp_kernels_image_info_t *out);

/* ---- libtorch's stable C shim ----
 * The Python binding reads tensors through libtorch's C shim (the aoti_torch_* functions AOTInductor models call),
 * found at run time in the libtorch that torch itself loaded: never a second copy, never torch's C++ ABI, no torch
 * headers at build time. */

/* Looks up the shim functions names[0..n) in the libtorch_cpu this process already loaded (by soname first, then
 * beside torch's _C module; torch_c_file: that module's file, may be NULL). syms[i] becomes the address of names[i],
 * or NULL when this libtorch lacks it or FASTDP_SHIM_ABSENT lists it (what a torch without it gets). The addresses
 * stay valid as long as torch keeps libtorch loaded, i.e. for the process: the library is never loaded or kept by
 * this call. Thread-safe. Errors: FDP_UNAVAILABLE (every syms[i] NULL) when torch loaded no libtorch_cpu (a static or
 * differently named build), FDP_INVALID for a bad argument. */
fdp_result_t fdp_torch_shim_resolve(const char *torch_c_file, const char *const *names, int n, void **syms);

/* ---- environment knobs ----
 * Each FASTDP_* variable is declared once, with its default, in base/param.c and read once per process. */
typedef enum {
  FDP_PARAM_DEBUG,               /* FASTDP_DEBUG: log to stderr */
  FDP_PARAM_HOST_THREADS,        /* FASTDP_HOST_THREADS: worker threads for host copies and sums (0: cores) */
  FDP_PARAM_HOST_PARALLEL_MIN,   /* FASTDP_HOST_PARALLEL_MIN: bytes below which host work stays on one thread */
  FDP_PARAM_DISABLE_NCCL,        /* FASTDP_DISABLE_NCCL: never pick the nccl backend */
  FDP_PARAM_DISABLE_CUDA,        /* FASTDP_DISABLE_CUDA: do not load the CUDA driver */
  FDP_PARAM_CUDA_DRIVER_LIBRARY, /* FASTDP_CUDA_DRIVER_LIBRARY (string): load exactly this file as the driver */
  FDP_PARAM_NCCL_LIBRARY,        /* FASTDP_NCCL_LIBRARY (string): load exactly this file as NCCL */
  FDP_PARAM_DISABLE_NVRTC,       /* FASTDP_DISABLE_NVRTC: never compile kernels at run time */
  FDP_PARAM_DISABLE_FATBIN,      /* FASTDP_DISABLE_FATBIN: ignore the build-time fatbin (NVRTC only) */
  FDP_PARAM_KERNEL_CACHE,        /* FASTDP_KERNEL_CACHE: 0 keeps NVRTC output in memory only (no disk cache) */
  FDP_PARAM_STRICT,              /* FASTDP_STRICT: raise instead of falling back to torch (read by fastdp/_fallback.py) */
  FDP_PARAM_CACHE_DIR,           /* FASTDP_CACHE_DIR (string): kernel cache folder (default ~/.cache/fastdp/kernels) */
  FDP_PARAM_NVRTC_LIBRARY,       /* FASTDP_NVRTC_LIBRARY (string): the libnvrtc.so to load, tried first */
  FDP_PARAM_TENSOR_PATH,         /* FASTDP_TENSOR_PATH (string): "python" reads tensors through their Python API */
  FDP_PARAM_SHIM_ABSENT,         /* FASTDP_SHIM_ABSENT (string): C-shim entry points to treat as missing */
  FDP_PARAM_COUNT
} fdp_param_t;

/* Integer value of a knob (its default when unset or unparsable; 0 for string knobs). */
int64_t fdp_param(fdp_param_t p);
/* Value of a string knob; NULL when unset or empty (valid for the process lifetime). */
const char *fdp_param_str(fdp_param_t p);
const char *fdp_param_name(fdp_param_t p);

/* ---- per-thread scratch ----
 * Temporary arrays of one call (base/scratch.c), for the library and its bindings' descriptor arrays.
 * fdp_scratch_alloc is malloc (uninitialised; NULL when out of memory), but blocks of 64 KiB and more given back
 * with fdp_scratch_free are kept, up to 4 per thread, and handed out again, so that calls with thousands of tensors
 * reuse warm pages. A block may be freed on any thread (it joins that
 * thread's kept ones); a thread's kept blocks are freed when it exits, or by fdp_scratch_release on it. */
void *fdp_scratch_alloc(size_t bytes);
void fdp_scratch_free(void *p);
void fdp_scratch_release(void);

/* Releases cached communicators and device state. Not safe concurrently with other calls; the next call
 * rebuilds what it needs. */
void fdp_shutdown(void);

#ifdef __cplusplus
}
#endif
#endif
