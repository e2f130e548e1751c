/* SPDX-License-Identifier: MIT */
/* The libtorch that torch itself loaded, opened only to resolve the symbols of its stable C shim (aoti_torch_*):
 * never a second copy, never torch's C++ ABI. The binding's shim path (python/aoti.c) is its only user. */
#ifndef FASTDP_DL_TORCH_SHIM_H
#define FASTDP_DL_TORCH_SHIM_H

#include <stddef.h>

/* The already loaded libtorch_cpu: by soname first, then beside torch's _C module (torch_c_file: that module's
 * file, may be NULL). NULL, with the reason in why[0..why_len), when torch did not load one (a static or
 * differently named build). Close it with fdp__torch_shim_close once every symbol is resolved. */
void *fdp__torch_shim_open(const char *torch_c_file, char *why, size_t why_len);
/* The shim function `name`, or NULL when this libtorch lacks it or FASTDP_SHIM_ABSENT lists it (what a torch
 * without it gets). */
void *fdp__torch_shim_sym(void *lib, const char *name);
/* Drops the reference fdp__torch_shim_open took; torch's own keeps the library and its symbols loaded. */
void fdp__torch_shim_close(void *lib);

#endif
