/* SPDX-License-Identifier: MIT */
/* NVRTC, the CUDA run-time compiler, as fastdp uses it: the library found and loaded at run time (the copy
 * PyTorch's CUDA wheels bring as nvidia-cuda-nvrtc, or the system's), and one compile call that turns the
 * embedded kernel source into an image for one GPU architecture. Needs no GPU and no CUDA headers. */
#ifndef FASTDP_DL_NVRTC_H
#define FASTDP_DL_NVRTC_H

#include "base/base.h"

#include <stddef.h>

#ifndef __NVRTC_H__ /* values and signatures as in the toolkit's nvrtc.h (stable since CUDA 11.2) */
typedef enum {
  NVRTC_SUCCESS = 0,
  NVRTC_ERROR_OUT_OF_MEMORY = 1,
  NVRTC_ERROR_INVALID_OPTION = 5,
  NVRTC_ERROR_COMPILATION = 6
} nvrtcResult;
typedef struct _nvrtcProgram *nvrtcProgram;
#endif

typedef struct fdp_nvrtc {
  nvrtcResult (*Version)(int *major, int *minor);
  const char *(*GetErrorString)(nvrtcResult r);
  nvrtcResult (*GetNumSupportedArchs)(int *n);
  nvrtcResult (*GetSupportedArchs)(int *archs);
  nvrtcResult (*CreateProgram)(nvrtcProgram *prog, const char *src, const char *name, int nheaders,
                               const char *const *headers, const char *const *include_names);
  nvrtcResult (*DestroyProgram)(nvrtcProgram *prog);
  nvrtcResult (*CompileProgram)(nvrtcProgram prog, int nopts, const char *const *opts);
  nvrtcResult (*GetProgramLogSize)(nvrtcProgram prog, size_t *size);
  nvrtcResult (*GetProgramLog)(nvrtcProgram prog, char *log);
  nvrtcResult (*GetPTXSize)(nvrtcProgram prog, size_t *size);
  nvrtcResult (*GetPTX)(nvrtcProgram prog, char *ptx);
  nvrtcResult (*GetCUBINSize)(nvrtcProgram prog, size_t *size);
  nvrtcResult (*GetCUBIN)(nvrtcProgram prog, char *cubin);
  int major, minor;     /* nvrtcVersion */
  int archs[64], narchs; /* real architectures it compiles for (e.g. 75, 80, 90), ascending */
  char path[1024];       /* the file the library was loaded from */
} fdp_nvrtc_t;

/* Folders to search after the libraries already in the process and FASTDP_NVRTC_LIBRARY, before the system's
 * search path: `dirs` is a ':'-separated list (copied), e.g. site-packages' nvidia/cu13/lib given by the
 * Python layer. Takes effect only before the first fdp__nvrtc_load; later calls return FDP_INVALID. */
fdp_result_t fdp__nvrtc_set_dirs(const char *dirs);

/* Loads NVRTC once per process (thread-safe). On success *out is the static table (process lifetime).
 * FDP_UNAVAILABLE when FASTDP_DISABLE_NVRTC is set or no usable library is found; *why (static) says which. */
fdp_result_t fdp__nvrtc_load(const fdp_nvrtc_t **out, const char **why);

/* What one compilation is: the target NVRTC compiles for and every option passed to it. Its text is part of the
 * kernel cache's key (kernel_image.c), so that an image is never served for other options or another target. */
#define FDP_NVRTC_MAX_OPTIONS 8
typedef struct fdp_nvrtc_plan {
  int arch;                                 /* the architecture compiled for */
  int ptx;                                  /* 1: PTX for compute_<arch>; 0: a cubin for sm_<arch> */
  int argc;                                 /* options in argv */
  const char *argv[FDP_NVRTC_MAX_OPTIONS]; /* each points into words */
  char text[256];                           /* the options, space-separated, as passed */
  char words[256];                          /* the same, NUL-separated */
} fdp_nvrtc_plan_t;

/* The plan for GPU architecture `cc` (major * 10 + minor, e.g. 90): a cubin when NVRTC knows sm_<cc>, else PTX of
 * the newest virtual architecture at or below it (the driver compiles that for a GPU newer than NVRTC); fastdp's
 * options, then `extra` (space-separated, NULL for none: what fastdp itself compiles with). Loads NVRTC.
 * Errors: FDP_UNAVAILABLE (no NVRTC, or `cc` older than every architecture it knows), FDP_INVALID (extra too long
 * or too many options). */
fdp_result_t fdp__nvrtc_plan(int cc, const char *extra, fdp_nvrtc_plan_t *plan);

/* Compiles `source` as `plan` says. *image is malloc'ed and owned by the caller, NUL-terminated after *size bytes
 * (PTX is loaded as a string). Thread-safe. Errors: FDP_UNAVAILABLE (no NVRTC), FDP_NOMEM, and FDP_INTERNAL for
 * a compile failure (the detail holds NVRTC's log). */
fdp_result_t fdp__nvrtc_compile(const char *source, const fdp_nvrtc_plan_t *plan, unsigned char **image,
                                size_t *size);

#endif
