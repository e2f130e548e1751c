/* SPDX-License-Identifier: MIT */
/* The ABI between the cuda backend (C, host) and the kernels in the cuda/ folder (nvcc, device): kernel
 * names, parameter layouts, and the embedded source and fatbin that cuda/build_kernels.py generates. Included by
 * both sides (nvcc, and NVRTC through the embedded source, which has no other header), so it stays plain C with
 * fixed-size fields. */
#ifndef FASTDP_BACKEND_CUDA_KERNELS_H
#define FASTDP_BACKEND_CUDA_KERNELS_H

#ifndef __CUDACC_RTC__ /* NVRTC compiles without host headers */
#include <stddef.h>
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Inputs one k-way sum launch takes; longer lists run in passes that keep the input order. */
#define FDP_SUM_MAX_INPUTS 32

/* Dimensions of a strided copy: FDP_MAX_DIMS, plus one when an element is split into bytes. */
#define FDP_COPY_MAX_DIMS 17

/* fdp_sum_<dtype>(fdp_sum_args_t): out[i] = ((in[0][i] + in[1][i]) + ...) + in[k-1][i], rounding to the
 * element type after every add. out may be exactly one of the inputs (each element is read before written). */
typedef struct fdp_sum_args {
  const void *in[FDP_SUM_MAX_INPUTS];
  void *out;
  long long n; /* elements */
  int k;       /* inputs used, 1..FDP_SUM_MAX_INPUTS */
  int pad;
} fdp_sum_args_t;

/* fdp_copy_<bytes>(const void *src, void *dst, fdp_copy_args_t): element-wise strided copy of elements of
 * 1, 2, 4, 8 or 16 bytes; dims are outermost first, strides in elements, every pointer aligned to the size. */
typedef struct fdp_copy_args {
  long long numel;
  int ndim;
  int pad;
  long long sizes[FDP_COPY_MAX_DIMS];
  long long src_strides[FDP_COPY_MAX_DIMS];
  long long dst_strides[FDP_COPY_MAX_DIMS];
} fdp_copy_args_t;

#ifndef __CUDACC__ /* host side only: defined in the fdp_kernels_blob.c that cuda/build_kernels.py generates */
/* The fatbin holding every kernel (SASS for the build's architectures plus PTX); size 0 when nvcc was missing
 * at build time. */
extern const unsigned char fdp__kernels_fatbin[];
extern const size_t fdp__kernels_fatbin_size;
/* The kernels' CUDA source as one self-contained text (this header inlined), NUL-terminated, for NVRTC. */
extern const char fdp__kernels_source[];
extern const size_t fdp__kernels_source_size;
#endif

#ifdef __cplusplus
}
#endif
#endif
