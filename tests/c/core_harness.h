/* SPDX-License-Identifier: MIT */
/* What the suites of test_core (the core and the host backend, no GPU) share: the checks (check.h) and EXPECT, the
 * random source, host tensor descriptors and layouts, the reference copy (core_harness.c), and each suite's entry
 * point, which test_core.c lists by name. */
#ifndef FASTDP_TESTS_C_CORE_HARNESS_H
#define FASTDP_TESTS_C_CORE_HARNESS_H

#include "check.h"
#include "fastdp.h"

#include <stddef.h>
#include <stdint.h>

/* ---- EXPECT: a result, and a fresh detail for a failure ---- */

/* The detail of a failure primed before each EXPECT, so that each expected failure can be seen to set its own. */
extern char sentinel[1100];
void prime_error(void);
void expect_result(fdp_result_t got, fdp_result_t want, const char *call, const char *file, int line);

/* EXPECT(call, FDP_X): the call returns FDP_X; a failure must also leave a fresh, non-empty detail. */
#define EXPECT(call, want)                                                                                             \
  do {                                                                                                                 \
    prime_error();                                                                                                     \
    fdp_result_t r_ = (call);                                                                                          \
    expect_result(r_, (want), #call, __FILE__, __LINE__);                                                              \
  } while (0)

/* ---- helpers ---- */

/* Every element size a copy kernel has (1, 2, 4, 8, 16 bytes). */
extern const int elem_sizes[5];

/* One seeded sequence for the whole run (xorshift), so that a run of every suite is the same run each time. */
uint64_t rnd(void);
int64_t rnd_in(int64_t lo, int64_t hi);
void fill_random(void *p, size_t bytes);
/* malloc that ends the run (exit 2) when out of memory; never NULL, even for 0 bytes. */
void *xmalloc(size_t bytes);

/* Host descriptors: given strides, row-major, or flat. */
fdp_tensor_t make(void *data, int dtype, int es, int nd, const int64_t *sizes, const int64_t *strides);
fdp_tensor_t make_contig(void *data, int dtype, int es, int nd, const int64_t *sizes);
fdp_tensor_t make_flat(void *data, int dtype, int es, int64_t numel);
int64_t numel_of(int nd, const int64_t *sizes);

/* A strided layout of `sizes` in a buffer: strides in elements, starting `offset` elements in. */
typedef struct {
  int nd;
  int64_t sizes[FDP_MAX_DIMS], strides[FDP_MAX_DIMS];
  int64_t offset, span; /* span: elements the buffer must hold */
} layout_t;

layout_t random_layout(int nd, const int64_t *sizes, int allow_expand, int max_step);
layout_t contig_layout(int nd, const int64_t *sizes);
/* The descriptor of layout l over buf (an FDP_DTYPE_OTHER host tensor of es-byte elements). */
fdp_tensor_t on(const layout_t *l, void *buf, int es);
/* The reference copy: one element at a time over the index space, row-major. */
void ref_copy(const fdp_tensor_t *dst, const fdp_tensor_t *src);

/* ---- the suites (test_core.c lists them by name) ---- */

void test_results(void); /* core_errors.c */
void test_checks(void);
void test_backends(void); /* core_backends.c */
void test_route(void);
void test_tensor_helpers(void);
void test_devices(void);
void test_torch_shim(void);
void test_kernel_cache(void); /* core_kernel_cache.c */
void test_layout(void); /* core_layout.c */
void test_plan(void);   /* core_plan.c */
void test_copy(void);   /* core_copy.c */
void test_copy_plan(void);
void test_copy_threaded(void);
void test_scratch(void);
void test_broadcast(void); /* core_collectives.c */
void test_scatter(void);
void test_gather(void);
void test_half_reference(void); /* core_reduce.c */
void test_reduce(void);
void test_reduce_threaded(void);
void test_rows_plan(void);

#endif
