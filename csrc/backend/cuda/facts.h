/* SPDX-License-Identifier: MIT */
/* The cuda backend's answers to fdp_library_facts / fdp_device_facts / fdp_device_can_access_peer (facts.c), which
 * its table hands to the core, and where each device's kernels came from (kernel_module.c, which loads them). */
#ifndef FASTDP_BACKEND_CUDA_FACTS_H
#define FASTDP_BACKEND_CUDA_FACTS_H

#include "core/backend.h"

void fdp__cuda_library_facts(fdp_library_facts_t *out);
fdp_result_t fdp__cuda_device_facts(int device, fdp_free_read_t free_read, fdp_device_facts_t *out);
int fdp__cuda_can_access_peer(int device, int peer);

/* Where the kernels of `device` came from ("fatbin ...", "NVRTC, from the disk cache ..."), why none load there,
 * or "" when they were not loaded yet in this process. Valid until fdp_shutdown. */
const char *fdp__cuda_kernels_source(int device);

#endif
