/* SPDX-License-Identifier: MIT */
/* The counting checks of the C test programs (test_core, test_gpu_ops): every check is counted, a failure is printed
 * with its place and what was seen, and the run goes on; each program ends with "N passed, M failed". Safe from any
 * thread (check.c). */
#ifndef FASTDP_TESTS_C_CHECK_H
#define FASTDP_TESTS_C_CHECK_H

#include <stdatomic.h>

/* Checks passed and failed so far, all threads together. */
extern atomic_int n_pass, n_fail;

/* Counts one check; when !ok, prints "FAIL file:line: expr" and, with fmt, " -- " and the formatted text. */
void check_at(int ok, const char *file, int line, const char *expr, const char *fmt, ...);

#define CHECK(c) check_at(!!(c), __FILE__, __LINE__, #c, NULL)
#define CHECKF(c, ...) check_at(!!(c), __FILE__, __LINE__, #c, __VA_ARGS__)

#endif
