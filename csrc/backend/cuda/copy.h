/* SPDX-License-Identifier: MIT */
/* The cuda backend's copies (copy.c), which its table hands to the core for fdp_op_copy and the operations made of
 * copies (broadcast, scatter, gather, prepared copies). */
#ifndef FASTDP_BACKEND_CUDA_COPY_H
#define FASTDP_BACKEND_CUDA_COPY_H

#include "core/backend.h"

/* Copies with a CUDA side, each on the streams `streams` lists (NOTE [routing] in core/backend.h says what the core
 * checked first). */
fdp_result_t fdp__cuda_copy(const fdp_copy_t *copies, int n, const fdp_streams_t *streams);

#endif
