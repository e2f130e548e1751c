/* SPDX-License-Identifier: MIT */
/* Kernel images compiled at run time: NVRTC's output for one GPU architecture, made once per process and kept
 * on disk across processes (keyed by the kernel source, the options and target, NVRTC's version and the
 * architecture). Needs no GPU. */
#ifndef FASTDP_BACKEND_CUDA_KERNEL_IMAGE_H
#define FASTDP_BACKEND_CUDA_KERNEL_IMAGE_H

#include "core/backend.h"

#include <stddef.h>

typedef enum {
  FDP_KIMAGE_DISK,     /* read from the disk cache */
  FDP_KIMAGE_COMPILED, /* compiled by NVRTC in this process, and written to the disk cache */
  FDP_KIMAGE_MEMORY    /* compiled by NVRTC in this process, kept in memory only (see note) */
} fdp_kimage_origin_t;

typedef struct fdp_kimage {
  const unsigned char *data; /* shared; valid until fdp__kimage_put releases this copy; NUL after size bytes */
  size_t size;
  int arch;                   /* the architecture compiled for */
  int ptx;                    /* 1: PTX for compute_<arch> (the driver finishes it); 0: a cubin for sm_<arch> */
  fdp_kimage_origin_t origin; /* how this process first got it */
  double seconds;             /* what getting it first cost (disk read or compilation) */
  char options[256];          /* every option NVRTC compiled it with, space-separated */
  char file[1024];            /* the cache file ("" when memory only) */
  char note[256];             /* why memory only, or why a cache entry was rebuilt ("" otherwise) */
  void *shared;               /* the reference that keeps `data` alive (kernel_image.c's) */
} fdp_kimage_t;

/* The image for GPU architecture `cc` (major * 10 + minor): from this process's memory, else from the disk
 * cache, else compiled with NVRTC and stored. A missing, corrupt or stale cache entry is rebuilt; an
 * unwritable cache folder keeps the image in memory only. Thread-safe (one compilation per architecture).
 * On success *out holds a reference to the image's bytes, which the caller gives back with fdp__kimage_put once it
 * is done reading them (a driver's module load): fdp__kimage_forget never frees bytes a caller still holds.
 * Errors are fdp__nvrtc_compile's; a failure is not remembered (the next call tries again). */
fdp_result_t fdp__kimage_get(int cc, fdp_kimage_t *out);

/* The same for any source and options beyond fastdp's own (`extra`, space-separated, NULL for none): the image
 * built from exactly these, never one built from other source, options or target. */
fdp_result_t fdp__kimage_get_for(const char *source, size_t source_size, int cc, const char *extra,
                                 fdp_kimage_t *out);

/* Gives back the reference fdp__kimage_get handed out with *img (its data is not to be read after); a no-op for an
 * image that holds none. Thread-safe. */
void fdp__kimage_put(fdp_kimage_t *img);

/* The disk cache folder in use ("" when caching is off or no folder can be named); `buf` receives it. */
const char *fdp__kimage_cache_dir(char *buf, size_t len);

/* Forgets the images kept in memory (for tests that measure the disk cache within one process); an image a caller
 * still holds stays alive until it is put. */
void fdp__kimage_forget(void);

#endif
