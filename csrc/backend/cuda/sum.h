/* SPDX-License-Identifier: MIT */
/* The cuda backend's sums (sum.c), which its table hands to the core for fdp_op_reduce on one device. */
#ifndef FASTDP_BACKEND_CUDA_SUM_H
#define FASTDP_BACKEND_CUDA_SUM_H

#include "core/backend.h"

/* out = ((inputs[0] + inputs[1]) + ...) + inputs[n-1] on out's device, on its stream of `streams` (NOTE [routing]
 * in core/backend.h says what the core checked first). */
fdp_result_t fdp__cuda_reduce(const fdp_tensor_t *inputs, int n, const fdp_tensor_t *out, const fdp_streams_t *streams);

#endif
