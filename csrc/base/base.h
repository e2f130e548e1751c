/* SPDX-License-Identifier: MIT */
/* What every layer of the library shares, and nothing else: the thread's error detail, the checking idiom, the one
 * log line. Loaders, core and backends include it; it includes only the public header. Not installed. */
#ifndef FASTDP_BASE_BASE_H
#define FASTDP_BASE_BASE_H

#include "fastdp.h"

#include <stdarg.h>

/* Sets the thread's error detail (printf format) and returns `r`, so that `return fdp__fail(...)` reads well. */
fdp_result_t fdp__fail(fdp_result_t r, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
/* fdp__fail for a failure of a library call: also records the library's own code (CUresult, ncclResult_t), which
 * fdp_last_status() returns and the binding puts on the exception. */
fdp_result_t fdp__fail_status(fdp_result_t r, int status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

/* Writes one line to stderr when FASTDP_DEBUG is set; the only output fastdp's C code ever makes. */
void fdp__log(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;

/* NOTE [error trail and cleanup]: every fallible call in the core and the backends goes through one of four
 * forms (after NCCL's checks.h), so that a failure's path shows under FASTDP_DEBUG and cleanup reads one way:
 *   FDP_CHECK(call)               returns the call's failure to the caller.
 *   FDP_CHECK_GOTO(call, r, lbl)  stores the call's result in r and jumps to lbl on failure: one `fail:` (or
 *                                 `out:`) label per function runs the cleanup, which ends with `return r`.
 *   FDP_CHECK_KEEP(call, r)       for cleanup: runs the call whatever r holds; r keeps its first failure, and
 *                                 so does the thread's detail string (fdp_last_error); the call's failure is
 *                                 taken only when r was FDP_OK.
 *   FDP_CHECK_IGNORE(call)        for cleanup whose failure changes nothing: logged, neither returned nor
 *                                 written to the detail string.
 * Each failure logs "file:line: call -> FDP_X" when FASTDP_DEBUG is set (fdp__trail). */
void fdp__trail(const char *file, int line, const char *call, fdp_result_t r);
/* While held, fdp__fail keeps the thread's detail string as it is (logging still happens). Returns the previous
 * hold, which fdp__detail_release restores: holds nest. */
int fdp__detail_hold(int hold);
void fdp__detail_release(int previous);

#define FDP_CHECK(call)                                                                                                \
  do {                                                                                                                 \
    fdp_result_t fdp__r = (call);                                                                                      \
    if (fdp__r != FDP_OK) {                                                                                            \
      fdp__trail(__FILE__, __LINE__, #call, fdp__r);                                                                   \
      return fdp__r;                                                                                                   \
    }                                                                                                                  \
  } while (0)

#define FDP_CHECK_GOTO(call, r, label)                                                                                 \
  do {                                                                                                                 \
    (r) = (call);                                                                                                      \
    if ((r) != FDP_OK) {                                                                                               \
      fdp__trail(__FILE__, __LINE__, #call, (r));                                                                      \
      goto label;                                                                                                      \
    }                                                                                                                  \
  } while (0)

#define FDP_CHECK_KEEP(call, r)                                                                                        \
  do {                                                                                                                 \
    int fdp__held = fdp__detail_hold((r) != FDP_OK);                                                                   \
    fdp_result_t fdp__r = (call);                                                                                      \
    fdp__detail_release(fdp__held);                                                                                    \
    if (fdp__r != FDP_OK) {                                                                                            \
      fdp__trail(__FILE__, __LINE__, #call, fdp__r);                                                                   \
      if ((r) == FDP_OK) (r) = fdp__r;                                                                                 \
    }                                                                                                                  \
  } while (0)

#define FDP_CHECK_IGNORE(call)                                                                                         \
  do {                                                                                                                 \
    int fdp__held = fdp__detail_hold(1);                                                                               \
    fdp_result_t fdp__r = (call);                                                                                      \
    fdp__detail_release(fdp__held);                                                                                    \
    if (fdp__r != FDP_OK) fdp__trail(__FILE__, __LINE__, #call, fdp__r);                                               \
  } while (0)

#endif
