/* SPDX-License-Identifier: MIT */
/* The cuda backend's fences (fence.c), which its table hands to the core for fdp_fence_* and fdp_streams_order. */
#ifndef FASTDP_BACKEND_CUDA_FENCE_H
#define FASTDP_BACKEND_CUDA_FENCE_H

#include "core/backend.h"

fdp_result_t fdp__cuda_fence_record(const fdp_streams_t *streams, fdp_fence_t **out);
fdp_result_t fdp__cuda_fence_wait(const fdp_fence_t *fence, const fdp_streams_t *waiters);
fdp_result_t fdp__cuda_fence_query(const fdp_fence_t *fence, int *done);
void fdp__cuda_fence_free(fdp_fence_t *fence);

#endif
