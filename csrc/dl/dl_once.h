/* SPDX-License-Identifier: MIT */
/* The common front of the run-time loaders (cuda_driver.c, nccl_loader.c, nvrtc.c): the knob that disables a
 * library, its one load per process, and the reason it is unavailable. */
#ifndef FASTDP_DL_ONCE_H
#define FASTDP_DL_ONCE_H

#include "base/base.h"

#include <pthread.h>

/* One loader's static state, described once (a static const in each loader). */
typedef struct fdp_dl_lib {
  fdp_param_t disable;        /* FASTDP_DISABLE_* knob: when set, nothing is loaded */
  const char *name;           /* "CUDA", "NCCL", "NVRTC" */
  const char *disabled;       /* "disabled by FASTDP_DISABLE_...": the reason then */
  pthread_once_t *once;       /* runs `load` once per process */
  void (*load)(void);         /* sets *status, and `reason` on failure */
  const fdp_result_t *status; /* FDP_OK once loaded */
  const char *reason;         /* why not loaded; written once inside `load`, never afterwards */
} fdp_dl_lib_t;

/* FDP_OK once the library is loaded; otherwise FDP_UNAVAILABLE with the detail set and *why (when not NULL)
 * pointing at the static reason. */
fdp_result_t fdp__dl_ready(const fdp_dl_lib_t *lib, const char **why);

#endif
