/* SPDX-License-Identifier: MIT */
/* See dl_once.h. */
#include "dl/dl_once.h"

fdp_result_t fdp__dl_ready(const fdp_dl_lib_t *lib, const char **why) {
  if (fdp_param(lib->disable)) {
    if (why) *why = lib->disabled;
    return fdp__fail(FDP_UNAVAILABLE, "%s is %s", lib->name, lib->disabled);
  }
  pthread_once(lib->once, lib->load);
  if (*lib->status != FDP_OK) {
    if (why) *why = lib->reason;
    return fdp__fail(FDP_UNAVAILABLE, "%s", lib->reason);
  }
  return FDP_OK;
}
