/* SPDX-License-Identifier: MIT */
/* The kernel cache (csrc/backend/cuda/kernel_image.c) never serves an image built from other source, other options
 * or another target: variants that differ in one of them each get their own image, freshly compiled, then from the
 * disk cache in a later "process" (the memory cache dropped), then from memory. NVRTC here is tests/c/fake_nvrtc.c,
 * whose image says what it was built from, so an image served for the wrong variant is seen by its text. */
#include "core_harness.h"

#include "backend/cuda/kernel_image.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct variant {
  const char *what;
  const char *source;
  int cc;
  const char *extra;
} variant_t;

static unsigned long long fnv(const char *s) {
  unsigned long long h = 1469598103934665603ull;
  for (; *s; s++)
    h = (h ^ (unsigned char)*s) * 1099511628211ull;
  return h;
}

/* The image is the one `v` compiles to: its source, its target among its options, and its extra options. */
static void check_served(const variant_t *v, const fdp_kimage_t *img, int pass) {
  char want[1400], target[32];
  snprintf(want, sizeof want, "fake image: source %016llx options %s", fnv(v->source), img->options);
  snprintf(target, sizeof target, "_%d ", v->cc);
  CHECKF(img->data != NULL && strcmp((const char *)img->data, want) == 0, "%s (pass %d): served \"%s\", want \"%s\"",
         v->what, pass, img->data ? (const char *)img->data : "(null)", want);
  CHECKF(strstr(img->options, target) != NULL, "%s (pass %d): options \"%s\" lack the target sm_%d", v->what, pass,
         img->options, v->cc);
  int has_extra = strstr(img->options, "-lineinfo") != NULL;
  CHECKF(has_extra == (v->extra != NULL), "%s (pass %d): options \"%s\"", v->what, pass, img->options);
}

void test_kernel_cache(void) {
  if (getenv("FASTDP_NVRTC_LIBRARY") == NULL || getenv("FASTDP_CACHE_DIR") == NULL) {
    CHECKF(0, "tests/c/build.py sets FASTDP_NVRTC_LIBRARY (the fake NVRTC) and FASTDP_CACHE_DIR for this suite");
    return;
  }
  static const char a[] = "// kernels, variant A\n", b[] = "// kernels, variant B\n";
  const variant_t variants[] = {
      {"source A for sm_90", a, 90, NULL},
      {"source B for sm_90", b, 90, NULL},
      {"source A for sm_90 with -lineinfo", a, 90, "-lineinfo"},
      {"source A for sm_80", a, 80, NULL},
  };
  const int n = (int)(sizeof variants / sizeof variants[0]);
  /* pass 0: each compiled; pass 1: a later process (memory dropped) reads each from disk; pass 2: from memory. */
  static const fdp_kimage_origin_t want_origin[3] = {FDP_KIMAGE_COMPILED, FDP_KIMAGE_DISK, FDP_KIMAGE_DISK};
  for (int pass = 0; pass < 3; pass++) {
    if (pass == 1) fdp__kimage_forget();
    for (int i = 0; i < n; i++) {
      const variant_t *v = &variants[i];
      fdp_kimage_t img;
      memset(&img, 0, sizeof img);
      EXPECT(fdp__kimage_get_for(v->source, strlen(v->source), v->cc, v->extra, &img), FDP_OK);
      CHECKF(img.origin == want_origin[pass], "%s (pass %d): origin %d, want %d (%s)", v->what, pass,
             (int)img.origin, (int)want_origin[pass], img.note);
      check_served(v, &img, pass);
      fdp__kimage_put(&img);
    }
  }
  fdp__kimage_forget();
}
