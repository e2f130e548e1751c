/* SPDX-License-Identifier: MIT */
/* test_core's suites on how failures are reported: every result code's name and message, the per-thread detail,
 * and the FDP_CHECK forms of backend.h (the first failure kept, every cleanup run). */
#include "core_harness.h"

#include "core/backend.h" /* the FDP_CHECK forms (internal) */

#include <pthread.h>
#include <stdio.h>
#include <string.h>

/* ---- result codes and errors ---- */

static const char *const want_names[] = {
#define X(name, msg) "FDP_" #name,
    FDP_RESULT_MAP(X)
#undef X
};
static const char *const want_messages[] = {
#define X(name, msg) msg,
    FDP_RESULT_MAP(X)
#undef X
};

static void *thread_error_probe(void *arg) {
  const char **out = arg;
  const char *e = fdp_last_error();
  out[0] = e && e[0] == 0 ? "empty" : "not empty";
  fdp_plan_t *plan = NULL;
  fdp_plan_build(NULL, NULL, -3, 16, &plan);
  e = fdp_last_error();
  out[1] = e && e[0] ? "set" : "unset";
  return NULL;
}

/* ---- the FDP_CHECK forms of backend.h (NOTE [error trail and cleanup]) ---- */

static int g_cleanups;

static fdp_result_t step(fdp_result_t r, const char *what) {
  return r == FDP_OK ? FDP_OK : fdp__fail(r, "%s failed", what);
}

static fdp_result_t cleanup_step(fdp_result_t r, const char *what) {
  g_cleanups++;
  return step(r, what);
}

static fdp_result_t uses_check(fdp_result_t first, fdp_result_t second, int *reached) {
  FDP_CHECK(step(first, "first"));
  *reached = 1;
  FDP_CHECK(step(second, "second"));
  return FDP_OK;
}

/* Two steps with GOTO, then two cleanups with KEEP and one with IGNORE, whatever happened. */
static fdp_result_t uses_goto_keep(fdp_result_t a, fdp_result_t b, fdp_result_t c1, fdp_result_t c2, fdp_result_t ign,
                                   int *reached) {
  fdp_result_t r = FDP_OK;
  FDP_CHECK_GOTO(step(a, "step a"), r, out);
  *reached = 1;
  FDP_CHECK_GOTO(step(b, "step b"), r, out);
  *reached = 2;
out:
  FDP_CHECK_KEEP(cleanup_step(c1, "cleanup 1"), r);
  FDP_CHECK_KEEP(cleanup_step(c2, "cleanup 2"), r);
  FDP_CHECK_IGNORE(cleanup_step(ign, "ignored cleanup"));
  return r;
}

void test_checks(void) {
  const fdp_result_t codes[] = {FDP_OK, FDP_INVALID, FDP_CUDA, FDP_NOMEM};
  const int ncodes = (int)(sizeof codes / sizeof codes[0]);
  for (int i = 0; i < ncodes; i++)
    for (int j = 0; j < ncodes; j++) {
      int reached = 0;
      prime_error();
      fdp_result_t r = uses_check(codes[i], codes[j], &reached);
      fdp_result_t want = codes[i] != FDP_OK ? codes[i] : codes[j];
      const char *want_detail = codes[i] != FDP_OK ? "first failed" : codes[j] != FDP_OK ? "second failed" : sentinel;
      CHECKF(r == want && reached == (codes[i] == FDP_OK) && strcmp(fdp_last_error(), want_detail) == 0,
             "FDP_CHECK(%s, %s): %s, reached %d, detail \"%s\"", fdp_result_name(codes[i]), fdp_result_name(codes[j]),
             fdp_result_name(r), reached, fdp_last_error());
    }
  /* Every combination of two steps and three cleanups: the first failure wins, code and detail; every cleanup
   * runs; the ignored one never shows. The reference is the same rule written out as a scan over the calls. */
  for (int m = 0; m < ncodes * ncodes * ncodes * ncodes * ncodes; m++) {
    fdp_result_t c[5];
    for (int k = 0, v = m; k < 5; k++, v /= ncodes)
      c[k] = codes[v % ncodes];
    const char *names[4] = {"step a", "step b", "cleanup 1", "cleanup 2"};
    int ran[4] = {1, c[0] == FDP_OK, 1, 1};
    fdp_result_t want = FDP_OK;
    const char *want_detail = sentinel;
    for (int k = 0; k < 4; k++)
      if (ran[k] && want == FDP_OK && c[k] != FDP_OK) {
        want = c[k];
        want_detail = names[k];
      }
    char detail[sizeof sentinel];
    snprintf(detail, sizeof detail, want == FDP_OK ? "%s" : "%s failed", want_detail);
    int reached = 0;
    g_cleanups = 0;
    prime_error();
    fdp_result_t r = uses_goto_keep(c[0], c[1], c[2], c[3], c[4], &reached);
    int want_reached = c[0] != FDP_OK ? 0 : c[1] != FDP_OK ? 1 : 2;
    CHECKF(r == want && strcmp(fdp_last_error(), detail) == 0 && g_cleanups == 3 && reached == want_reached,
           "GOTO/KEEP/IGNORE with %s %s %s %s %s: %s \"%s\", want %s \"%s\"; %d cleanups, reached %d",
           fdp_result_name(c[0]), fdp_result_name(c[1]), fdp_result_name(c[2]), fdp_result_name(c[3]),
           fdp_result_name(c[4]), fdp_result_name(r), fdp_last_error(), fdp_result_name(want), detail, g_cleanups,
           reached);
  }
  /* The hold is released: a failure after the cleanups sets its detail again. */
  EXPECT(fdp_op_copy(NULL, NULL, -1, NULL), FDP_INVALID);
}

void test_results(void) {
  const char *e = fdp_last_error();
  CHECK(e != NULL);
  CHECKF(e && e[0] == 0, "before any failure: \"%s\"", e ? e : "");
  CHECK(FDP_RESULT_COUNT == (int)(sizeof want_names / sizeof want_names[0]));
  for (int r = 0; r < FDP_RESULT_COUNT; r++) {
    const char *n = fdp_result_name((fdp_result_t)r), *m = fdp_result_message((fdp_result_t)r);
    CHECKF(n && strcmp(n, want_names[r]) == 0, "code %d: %s", r, n ? n : "(null)");
    CHECKF(m && m[0] && strcmp(m, want_messages[r]) == 0, "code %d: %s", r, m ? m : "(null)");
    for (int q = 0; q < r; q++) {
      CHECKF(strcmp(fdp_result_name((fdp_result_t)q), n) != 0, "codes %d and %d share a name", q, r);
      CHECKF(strcmp(fdp_result_message((fdp_result_t)q), m) != 0, "codes %d and %d share a message", q, r);
    }
  }
  CHECK(strcmp(fdp_result_name(FDP_OK), "FDP_OK") == 0);
  CHECK(strcmp(fdp_result_name(FDP_INVALID), "FDP_INVALID") == 0);
  CHECK(FDP_OK == 0);
  int bad[] = {FDP_RESULT_COUNT, FDP_RESULT_COUNT + 7, -1, 1 << 30};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    const char *n = fdp_result_name((fdp_result_t)bad[i]), *m = fdp_result_message((fdp_result_t)bad[i]);
    CHECKF(n && n[0] && m && m[0], "out-of-range code %d", bad[i]);
  }
  /* The detail is per thread: a failure on another thread neither shows here nor overwrites ours. */
  EXPECT(fdp_op_copy(NULL, NULL, -5, NULL), FDP_INVALID);
  char mine[1100];
  snprintf(mine, sizeof mine, "%s", fdp_last_error());
  const char *probe[2] = {NULL, NULL};
  pthread_t tid;
  CHECK(pthread_create(&tid, NULL, thread_error_probe, probe) == 0 && pthread_join(tid, NULL) == 0);
  CHECKF(probe[0] && strcmp(probe[0], "empty") == 0, "a new thread starts with an empty detail");
  CHECKF(probe[1] && strcmp(probe[1], "set") == 0, "a failure on a thread sets its detail");
  CHECKF(strcmp(fdp_last_error(), mine) == 0, "another thread's failure changed ours: \"%s\"", fdp_last_error());
  /* dtype names come from the same map as the enum. */
  static const char *const dnames[] = {
#define X(name, str, size) str,
      FDP_DTYPE_MAP(X)
#undef X
  };
  for (int d = 0; d < FDP_DTYPE_COUNT; d++)
    CHECKF(strcmp(fdp_dtype_name(d), dnames[d]) == 0, "dtype %d", d);
  CHECK(fdp_dtype_name(-1) != NULL && fdp_dtype_name(FDP_DTYPE_COUNT) != NULL);
}
