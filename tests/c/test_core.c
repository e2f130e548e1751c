/* SPDX-License-Identifier: MIT */
/* Tests of the fastdp core and its host backend against naive reference loops written here: bucket plans,
 * strided copies, broadcast/scatter/gather, sums of every dtype, device-kind checks and result codes. Built
 * and run under AddressSanitizer and UndefinedBehaviorSanitizer by tests/c/build.py; prints "N passed, M failed".
 * This file is the program: its suites by name, and main. The suites live in core_*.c, one file per group, with
 * what they share in core_harness.c. */
#include "core_harness.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* The suites, runnable by name (libuv's test-list.h): `test_core` runs them all, `test_core NAME...` the named
 * ones, `test_core --list` prints the names, one a line. */
typedef struct suite {
  const char *name;
  void (*fn)(void);
} suite_t;

static const suite_t k_suites[] = {
    {"results", test_results},
    {"checks", test_checks},
    {"backends", test_backends},
    {"route", test_route},
    {"tensor_helpers", test_tensor_helpers},
    {"layout", test_layout},
    {"plan", test_plan},
    {"copy", test_copy},
    {"copy_plan", test_copy_plan},
    {"copy_threaded", test_copy_threaded},
    {"scratch", test_scratch},
    {"broadcast", test_broadcast},
    {"scatter", test_scatter},
    {"gather", test_gather},
    {"half_references", test_half_reference},
    {"reduce", test_reduce},
    {"reduce_threaded", test_reduce_threaded},
    {"rows_plan", test_rows_plan},
    {"devices", test_devices},
    {"torch_shim", test_torch_shim},
    {"kernel_cache", test_kernel_cache},
};
#define NSUITES (sizeof k_suites / sizeof k_suites[0])

static const suite_t *find_suite(const char *name) {
  for (size_t i = 0; i < NSUITES; i++)
    if (strcmp(k_suites[i].name, name) == 0) return &k_suites[i];
  return NULL;
}

static void run_suite(const suite_t *s) {
  int before = n_fail, pass_before = n_pass;
  s->fn();
  printf("  %-18s %5d checks, %d failed\n", s->name, n_pass - pass_before + n_fail - before, n_fail - before);
  fflush(stdout);
}

int main(int argc, char **argv) {
  if (argc == 2 && strcmp(argv[1], "--list") == 0) {
    for (size_t i = 0; i < NSUITES; i++)
      printf("%s\n", k_suites[i].name);
    return 0;
  }
  for (int i = 1; i < argc; i++)
    if (!find_suite(argv[i])) {
      printf("no suite named \"%s\" (test_core --list names them)\n", argv[i]);
      return 2;
    }
  /* Knobs are read once per process: set them before the first call into the core. */
  setenv("FASTDP_HOST_PARALLEL_MIN", "4096", 1);
  setenv("FASTDP_HOST_THREADS", "4", 1);
  unsetenv("FASTDP_DEBUG");
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  if (argc > 1)
    for (int i = 1; i < argc; i++)
      run_suite(find_suite(argv[i]));
  else
    for (size_t i = 0; i < NSUITES; i++)
      run_suite(&k_suites[i]);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  printf("time: %.2f s\n", (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9);
  printf("%d passed, %d failed\n", n_pass, n_fail);
  return n_fail ? 1 : 0;
}
