/* Modules and kernel launches on the simulated driver: any image loads, the functions found in it are fastdp's
 * kernels (fdp_sum_<dtype>, fdp_copy_<bytes>), and a launch checks and records every byte its kernel must read and
 * write, then runs the real kernel over its grid (sim_kernels.cc). */

#include "sim_driver.h"

#include "backend/cuda/kernels.h"
#include "fastdp.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- modules ---- */

typedef enum { K_SUM, K_COPY } kind_t;
typedef struct sim_func {
  uint32_t magic;
  sim_module_t *mod;
  kind_t kind;
  int dtype; /* K_SUM: fdp dtype */
  int es;    /* K_COPY: element bytes */
  char name[32];
} sim_func_t;

/* The bytes of a module image, as the driver reads them: an ELF cubin up to its section headers, a fatbin up to the
 * size its header gives, PTX (or any other text) up to its NUL. */
static size_t image_size(const unsigned char *p) {
  uint64_t u64;
  uint16_t u16a, u16b;
  uint32_t magic;
  if (memcmp(p, "\x7f" "ELF", 4) == 0 && p[4] == 2) { /* 64-bit ELF: e_shoff, e_shentsize, e_shnum */
    memcpy(&u64, p + 0x28, 8);
    memcpy(&u16a, p + 0x3a, 2);
    memcpy(&u16b, p + 0x3c, 2);
    return (size_t)u64 + (size_t)u16a * u16b;
  }
  memcpy(&magic, p, 4);
  if (magic == 0xba55ed50u) { /* fatbin: magic, version, header size (16 bits), then the size of what follows */
    memcpy(&u16a, p + 6, 2);
    memcpy(&u64, p + 8, 8);
    return (size_t)u16a + (size_t)u64;
  }
  return strlen((const char *)p) + 1;
}

CUresult cuModuleLoadData(CUmodule *out, const void *image) {
  ENTER(cuModuleLoadData);
  CUresult err = CUDA_SUCCESS;
  sim_ctx_t *c = sim_need_ctx("cuModuleLoadData", &err);
  if (!c) RETURN(err);
  if (!out || !image) RETURN(CUDA_ERROR_INVALID_VALUE);
  /* The driver reads the whole image during the call (and never after): so does the simulator, so that an image
   * freed under a load is caught (by AddressSanitizer or ThreadSanitizer) rather than silently loaded. */
  size_t n = image_size(image);
  unsigned char *copy = malloc(n);
  if (!copy) RETURN(CUDA_ERROR_OUT_OF_MEMORY);
  memcpy(copy, image, n);
  uint64_t hash = 1469598103934665603ull;
  for (size_t i = 0; i < n; i++)
    hash = (hash ^ copy[i]) * 1099511628211ull;
  free(copy);
  sim_module_t *m = calloc(1, sizeof *m);
  m->image_bytes = n;
  m->image_hash = hash;
  m->magic = MAGIC_MODULE;
  m->ctx = c;
  m->alive = 1;
  sim_track(m);
  g_live_modules++;
  *out = (CUmodule)m;
  RETURN(CUDA_SUCCESS);
}

CUresult cuModuleUnload(CUmodule h) {
  ENTER(cuModuleUnload);
  sim_module_t *m = (sim_module_t *)h;
  if (!sim_valid_obj(m, MAGIC_MODULE) || !m->alive) {
    sim_misuse("cuModuleUnload: %p is not a loaded module", (void *)h);
    RETURN(CUDA_ERROR_INVALID_HANDLE);
  }
  m->alive = 0;
  g_live_modules--;
  RETURN(CUDA_SUCCESS);
}

static const struct {
  const char *name;
  kind_t kind;
  int dtype, es;
} k_kernels[] = {
    {"fdp_sum_bool", K_SUM, FDP_DTYPE_BOOL, 1}, {"fdp_sum_u8", K_SUM, FDP_DTYPE_U8, 1},
    {"fdp_sum_u16", K_SUM, FDP_DTYPE_I16, 2},   {"fdp_sum_u32", K_SUM, FDP_DTYPE_I32, 4},
    {"fdp_sum_u64", K_SUM, FDP_DTYPE_I64, 8},   {"fdp_sum_f16", K_SUM, FDP_DTYPE_F16, 2},
    {"fdp_sum_bf16", K_SUM, FDP_DTYPE_BF16, 2}, {"fdp_sum_f32", K_SUM, FDP_DTYPE_F32, 4},
    {"fdp_sum_f64", K_SUM, FDP_DTYPE_F64, 8},   {"fdp_copy_1", K_COPY, 0, 1},
    {"fdp_copy_2", K_COPY, 0, 2},               {"fdp_copy_4", K_COPY, 0, 4},
    {"fdp_copy_8", K_COPY, 0, 8},               {"fdp_copy_16", K_COPY, 0, 16},
};

CUresult cuModuleGetFunction(CUfunction *out, CUmodule h, const char *name) {
  ENTER(cuModuleGetFunction);
  sim_module_t *m = (sim_module_t *)h;
  if (!sim_valid_obj(m, MAGIC_MODULE) || !m->alive) {
    sim_misuse("cuModuleGetFunction: %p is not a loaded module", (void *)h);
    RETURN(CUDA_ERROR_INVALID_HANDLE);
  }
  if (!out || !name) RETURN(CUDA_ERROR_INVALID_VALUE);
  for (size_t i = 0; i < sizeof k_kernels / sizeof k_kernels[0]; i++) {
    if (strcmp(k_kernels[i].name, name) != 0) continue;
    sim_func_t *f = calloc(1, sizeof *f);
    f->magic = MAGIC_FUNC;
    f->mod = m;
    f->kind = k_kernels[i].kind;
    f->dtype = k_kernels[i].dtype;
    f->es = k_kernels[i].es;
    snprintf(f->name, sizeof f->name, "%s", name);
    sim_track(f);
    *out = (CUfunction)f;
    RETURN(CUDA_SUCCESS);
  }
  RETURN(CUDA_ERROR_NOT_FOUND);
}

/* ---- kernels ---- */

static const int k_dtype_size[FDP_DTYPE_COUNT] = {
    [FDP_DTYPE_BOOL] = 1, [FDP_DTYPE_U8] = 1,   [FDP_DTYPE_I8] = 1,   [FDP_DTYPE_I16] = 2, [FDP_DTYPE_I32] = 4,
    [FDP_DTYPE_I64] = 8,  [FDP_DTYPE_F16] = 2,  [FDP_DTYPE_BF16] = 2, [FDP_DTYPE_F32] = 4, [FDP_DTYPE_F64] = 8,
};

/* One launch of a real kernel (sim_kernels.cc) over its grid, with host addresses for its pointers. A fault outside
 * every allocation, a misaligned access, or a write past the end of `written` (its canary), is the launch's
 * failure. */
static CUresult run_real(sim_op_t *op, const sim_func_t *f, const unsigned int grid[3], const unsigned int block[3],
                         fdp_sum_args_t *sum, const void *src, void *dst, const fdp_copy_args_t *copy,
                         CUdeviceptr written) {
  void *fault = NULL;
  int ran = sim_kernel_run(f->name, grid, block, sum, src, dst, copy, &fault);
  if (ran == -2) {
    sim_misuse("%s: the kernel accessed an element at an address that is not a multiple of its size (instruction %p)",
               op->name, fault);
    return CUDA_ERROR_MISALIGNED_ADDRESS;
  }
  if (ran != 0) {
    sim_misuse("%s: the kernel accessed %p, outside its memory (an index past the end, or one that overflowed)",
               op->name, fault);
    return CUDA_ERROR_ILLEGAL_ADDRESS;
  }
  int dev;
  sim_alloc_t *a = sim_find_alloc(written, &dev);
  if (a != NULL && sim_mem_overrun(a)) {
    sim_misuse("%s: the kernel wrote past the end of its %zu-byte output allocation on device %d", op->name, a->size,
               dev);
    memset(a->mem + a->size, CANARY, ((a->size + DEVICE_ALIGN - 1) & ~(size_t)(DEVICE_ALIGN - 1)) - a->size);
    return CUDA_ERROR_ILLEGAL_ADDRESS;
  }
  return CUDA_SUCCESS;
}

/* A GPU faults on an element of `es` bytes at an address that is not a multiple of es. Each kernel indexes the
 * pointers it is given in whole elements, so checking them at the launch covers every access it makes (the
 * kernels' own accesses are checked too: see sim_kernels.cc). */
static int aligned(sim_op_t *op, const char *what, CUdeviceptr p, int es) {
  if (p % (CUdeviceptr)es == 0) return 1;
  sim_misuse("%s: %s (0x%llx) is not aligned to its %d-byte elements (misaligned address)", op->name, what,
             (unsigned long long)p, es);
  return 0;
}

/* fdp_sum_<dtype>: its inputs and output checked and recorded as accessed in full, then the kernel itself runs. */
static CUresult run_sum(sim_op_t *op, const sim_func_t *f, void **params, const unsigned int grid[3],
                        const unsigned int block[3]) {
  if (!params || !params[0]) return CUDA_ERROR_INVALID_VALUE;
  fdp_sum_args_t a;
  memcpy(&a, params[0], sizeof a);
  int es = k_dtype_size[f->dtype];
  if (a.k < 1 || a.k > FDP_SUM_MAX_INPUTS || a.n < 0) {
    sim_misuse("%s: k=%d n=%lld out of range", op->name, a.k, a.n);
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (a.n == 0) return CUDA_SUCCESS;
  size_t bytes = (size_t)a.n * (size_t)es;
  CUdeviceptr out = (CUdeviceptr)(uintptr_t)a.out;
  if (!aligned(op, "the output", out, es)) return CUDA_ERROR_MISALIGNED_ADDRESS;
  for (int j = 0; j < a.k; j++) {
    CUdeviceptr in = (CUdeviceptr)(uintptr_t)a.in[j];
    char what[32];
    snprintf(what, sizeof what, "input %d", j);
    if (!aligned(op, what, in, es)) return CUDA_ERROR_MISALIGNED_ADDRESS;
    if (!sim_check_range(op, in, bytes)) return CUDA_ERROR_ILLEGAL_ADDRESS;
    if (in != out && in < out + bytes && out < in + bytes) {
      sim_misuse("%s: the output partially overlaps input %d", op->name, j);
      return CUDA_ERROR_ILLEGAL_ADDRESS;
    }
  }
  if (!sim_check_range(op, out, bytes)) return CUDA_ERROR_ILLEGAL_ADDRESS;
  fdp_sum_args_t host = a;
  for (int j = 0; j < a.k; j++)
    host.in[j] = sim_access(op, (CUdeviceptr)(uintptr_t)a.in[j], bytes, 0);
  host.out = sim_access(op, out, bytes, 1);
  return run_real(op, f, grid, block, &host, NULL, NULL, NULL, out);
}

/* The byte extent [lo, hi) a strided view covers. */
static void extent(const fdp_copy_args_t *a, const long long *strides, int es, size_t *hi) {
  long long last = 0;
  for (int d = 0; d < a->ndim; d++)
    last += (a->sizes[d] - 1) * strides[d];
  *hi = (size_t)(last + 1) * (size_t)es;
}

/* fdp_copy_<bytes>: every element it must read and write checked and recorded, then the kernel itself runs. */
static CUresult run_copy(sim_op_t *op, const sim_func_t *f, void **params, const unsigned int grid[3],
                         const unsigned int block[3]) {
  if (!params || !params[0] || !params[1] || !params[2]) return CUDA_ERROR_INVALID_VALUE;
  CUdeviceptr src, dst;
  fdp_copy_args_t a;
  memcpy(&src, params[0], sizeof src);
  memcpy(&dst, params[1], sizeof dst);
  memcpy(&a, params[2], sizeof a);
  int es = f->es;
  long long numel = 1;
  if (a.ndim < 1 || a.ndim > FDP_COPY_MAX_DIMS) {
    sim_misuse("%s: ndim %d", op->name, a.ndim);
    return CUDA_ERROR_INVALID_VALUE;
  }
  for (int d = 0; d < a.ndim; d++) {
    if (a.sizes[d] < 0 || a.src_strides[d] < 0 || a.dst_strides[d] < 0) {
      sim_misuse("%s: negative size or stride", op->name);
      return CUDA_ERROR_INVALID_VALUE;
    }
    numel *= a.sizes[d];
  }
  if (numel != a.numel) {
    sim_misuse("%s: numel %lld but the sizes give %lld", op->name, a.numel, numel);
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (numel == 0) return CUDA_SUCCESS;
  if (!aligned(op, "the source", src, es) || !aligned(op, "the destination", dst, es))
    return CUDA_ERROR_MISALIGNED_ADDRESS;
  size_t shi, dhi;
  extent(&a, a.src_strides, es, &shi);
  extent(&a, a.dst_strides, es, &dhi);
  const unsigned char *hs = sim_check_range(op, src, shi);
  unsigned char *hd = sim_check_range(op, dst, dhi);
  if (!hs || !hd) return CUDA_ERROR_ILLEGAL_ADDRESS;
  long long idx[FDP_COPY_MAX_DIMS] = {0};
  for (long long i = 0; i < numel; i++) {
    long long so = 0, dof = 0;
    for (int d = 0; d < a.ndim; d++) {
      so += idx[d] * a.src_strides[d];
      dof += idx[d] * a.dst_strides[d];
    }
    sim_access(op, src + (CUdeviceptr)(so * es), (size_t)es, 0);
    sim_access(op, dst + (CUdeviceptr)(dof * es), (size_t)es, 1);
    for (int d = a.ndim - 1; d >= 0; d--) {
      if (++idx[d] < a.sizes[d]) break;
      idx[d] = 0;
    }
  }
  return run_real(op, f, grid, block, NULL, hs, hd, &a, dst);
}

CUresult cuLaunchKernel(CUfunction fn, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                        unsigned int by, unsigned int bz, unsigned int shmem, CUstream stream, void **params,
                        void **extra) {
  ENTER(cuLaunchKernel);
  CUresult err = CUDA_SUCCESS;
  sim_ctx_t *c = sim_need_ctx("cuLaunchKernel", &err);
  if (!c) RETURN(err);
  sim_func_t *f = (sim_func_t *)fn;
  if (!sim_valid_obj(f, MAGIC_FUNC) || !f->mod->alive) {
    sim_misuse("cuLaunchKernel: %p is not a function of a loaded module", (void *)fn);
    RETURN(CUDA_ERROR_INVALID_HANDLE);
  }
  if (f->mod->ctx != c) {
    sim_misuse("cuLaunchKernel(%s): the function was loaded on device %d but device %d's context is current", f->name,
               f->mod->ctx->dev, c->dev);
    RETURN(CUDA_ERROR_INVALID_HANDLE);
  }
  sim_stream_t *s = sim_resolve_stream(stream, c, "cuLaunchKernel", &err);
  if (!s) RETURN(err);
  if (gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0 || (unsigned long long)bx * by * bz > 1024 ||
      gy > 65535 || gz > 65535 || shmem > 48 * 1024 || extra != NULL) {
    sim_misuse("cuLaunchKernel(%s): bad launch configuration", f->name);
    RETURN(CUDA_ERROR_INVALID_VALUE);
  }
  char name[64];
  snprintf(name, sizeof name, "cuLaunchKernel(%s)", f->name);
  sim_op_t op;
  sim_op_begin(&op, s, name, c->dev);
  const unsigned int grid[3] = {gx, gy, gz}, block[3] = {bx, by, bz};
  RETURN(f->kind == K_SUM ? run_sum(&op, f, params, grid, block) : run_copy(&op, f, params, grid, block));
}
