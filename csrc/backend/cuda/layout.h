/* SPDX-License-Identifier: MIT */
/* The cuda backend's layout math: a copy between two strided views as one index space with two stride lists,
 * simplified for the copy engines (flat, rows) or reshaped for the strided-copy kernel. Pure arithmetic on
 * addresses, no CUDA: tests/c/core_layout.c checks it against element-by-element references on any machine. */
#ifndef FASTDP_BACKEND_CUDA_LAYOUT_H
#define FASTDP_BACKEND_CUDA_LAYOUT_H

#include "backend/cuda/kernels.h"
#include "core/backend.h"

#include <stddef.h>
#include <stdint.h>

/* CU_DEVICE_ATTRIBUTE_MAX_PITCH on every GPU PyTorch supports; larger pitches take the kernel path. */
#define FDP_PAIR_MAX_PITCH INT32_MAX

/* One copy as two strided views over one index space; dims outermost first, strides in elements of es bytes.
 * Dims may be permuted and merged freely because both views are permuted alike. src and dst are addresses
 * (device or host); nothing here reads them. */
typedef struct fdp_pair {
  int ndim;
  int64_t es;
  int64_t numel;
  int64_t sizes[FDP_COPY_MAX_DIMS];
  int64_t ss[FDP_COPY_MAX_DIMS];
  int64_t ds[FDP_COPY_MAX_DIMS];
  uint64_t src, dst;
} fdp_pair_t;

/* Builds the pair of a copy (same ndim and element size on both sides): size-1 dims dropped, dims ordered by
 * destination stride (then source stride), largest first, so that the destination is written in address order,
 * then merged. numel 0 when the copy is empty. */
void fdp__pair_build(const fdp_copy_t *c, fdp_pair_t *p);
/* Merges each dim into its outer neighbour where both views step over it contiguously; at least one dim stays. */
void fdp__pair_merge(fdp_pair_t *p);
/* 1 when the innermost dim is contiguous on both sides. */
int fdp__pair_inner_contiguous(const fdp_pair_t *p);
/* 1 when the source (destination) is one contiguous run. */
int fdp__pair_src_flat(const fdp_pair_t *p);
int fdp__pair_dst_flat(const fdp_pair_t *p);
/* Rows for the copy engines: the innermost dim contiguous on both sides, the next one as the row pitch, and
 * *outer calls over the remaining dims. Pitches must hold a whole row (no zero or overlapping strides) and stay
 * within FDP_PAIR_MAX_PITCH. Returns 0 (outputs untouched) when the layout has no such rows. */
int fdp__pair_rows(const fdp_pair_t *p, size_t *width, size_t *height, size_t *spitch, size_t *dpitch, int64_t *outer);
/* Byte offsets of outer iteration `idx` (an odometer over dims [0, ndim - 2), zeroed before the first call),
 * then advances it. */
void fdp__pair_outer_next(const fdp_pair_t *p, int64_t *idx, int64_t *soff, int64_t *doff);
/* Reshapes a pair for the kernel: wider elements where the rows allow (fewer, larger accesses), or single bytes
 * where the element size is not 1/2/4/8/16 or an address is not aligned to it. Afterwards es is one of those and
 * both addresses are aligned to it. */
void fdp__pair_for_kernel(fdp_pair_t *p);
/* Index of the copy kernel for element size es (1, 2, 4, 8, 16 → 0..4). */
int fdp__pair_es_index(int64_t es);
/* Row-major contiguous strides for the pair's sizes: the layout of a staging buffer. */
void fdp__pair_flat_strides(const fdp_pair_t *p, int64_t *strides);

#endif
