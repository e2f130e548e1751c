/* SPDX-License-Identifier: MIT */
/* Result codes, their names and messages (from FDP_RESULT_MAP), and the thread-local detail string that says
 * what the last failing call on this thread was doing. */
#include "base/base.h"

#include <stdio.h>
#include <string.h>

static _Thread_local char last_error[1024];
static _Thread_local int detail_held; /* see NOTE [error trail and cleanup] in backend.h */
static _Thread_local int last_status; /* the library's own code of the failure whose detail is kept (0: none) */

static const char *const names[] = {
#define FDP_X(name, msg) "FDP_" #name,
    FDP_RESULT_MAP(FDP_X)
#undef FDP_X
};

static const char *const messages[] = {
#define FDP_X(name, msg) msg,
    FDP_RESULT_MAP(FDP_X)
#undef FDP_X
};

const char *fdp_result_name(fdp_result_t r) {
  return (unsigned)r < FDP_RESULT_COUNT ? names[r] : "FDP_UNKNOWN";
}

const char *fdp_result_message(fdp_result_t r) {
  return (unsigned)r < FDP_RESULT_COUNT ? messages[r] : "unknown result";
}

const char *fdp_last_error(void) {
  return last_error;
}

static fdp_result_t vfail(fdp_result_t r, int status, const char *fmt, va_list ap) {
  if (detail_held) {
    char line[sizeof last_error];
    vsnprintf(line, sizeof line, fmt, ap);
    fdp__log("%s (during cleanup, after an earlier failure): %s", fdp_result_name(r), line);
  } else {
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    last_status = status;
    fdp__log("%s: %s", fdp_result_name(r), last_error);
  }
  return r;
}

fdp_result_t fdp__fail(fdp_result_t r, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vfail(r, 0, fmt, ap);
  va_end(ap);
  return r;
}

fdp_result_t fdp__fail_status(fdp_result_t r, int status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vfail(r, status, fmt, ap);
  va_end(ap);
  return r;
}

int fdp_last_status(void) {
  return last_status;
}

void fdp__trail(const char *file, int line, const char *call, fdp_result_t r) {
  fdp__log("%s:%d: %s -> %s", file, line, call, fdp_result_name(r));
}

int fdp__detail_hold(int hold) {
  int previous = detail_held;
  detail_held = previous || hold;
  return previous;
}

void fdp__detail_release(int previous) {
  detail_held = previous;
}

void fdp__log(const char *fmt, ...) {
  if (!fdp_param(FDP_PARAM_DEBUG)) return;
  char line[1200];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  fprintf(stderr, "[fastdp] %s\n", line);
}
