/* SPDX-License-Identifier: MIT */
/* The counting checks of the C test programs (check.h): counts without a shared lock, a failure printed whole under
 * one, so that threads checking at once neither lose counts nor interleave their lines. */
#include "check.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>

/* Relaxed counts: a check that passes must not order one thread's work after another's (ThreadSanitizer would take
 * a shared lock here for synchronisation that fastdp lacks). */
atomic_int n_pass, n_fail;
static pthread_mutex_t g_report = PTHREAD_MUTEX_INITIALIZER;

void check_at(int ok, const char *file, int line, const char *expr, const char *fmt, ...) {
  if (ok) {
    atomic_fetch_add_explicit(&n_pass, 1, memory_order_relaxed);
    return;
  }
  pthread_mutex_lock(&g_report);
  {
    atomic_fetch_add_explicit(&n_fail, 1, memory_order_relaxed);
    printf("FAIL %s:%d: %s", file, line, expr);
    if (fmt) {
      va_list ap;
      va_start(ap, fmt);
      fputs(" -- ", stdout);
      vprintf(fmt, ap);
      va_end(ap);
    }
    putchar('\n');
    fflush(stdout);
  }
  pthread_mutex_unlock(&g_report);
}
