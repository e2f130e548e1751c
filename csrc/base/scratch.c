/* SPDX-License-Identifier: MIT */
/* Large temporary arrays (the descriptor lists of a call that moves thousands of tensors) kept per thread between
 * calls. Freed, such a block sits at the top of the heap, and glibc hands the top back to the system past its trim
 * threshold, so every call faulted the same pages in again, which cost more than the copy itself
 * (docs/benchmarks.md). */
#include "base/base.h"

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#define SCRATCH_MIN ((size_t)64 * 1024) /* smaller blocks come and go through malloc */
#define SCRATCH_KEEP 4                  /* blocks kept per thread */

/* Each block starts with its capacity; the caller's memory follows, aligned for any type. */
typedef union {
  size_t cap;
  max_align_t align;
} header_t;

typedef struct {
  header_t *block[SCRATCH_KEEP];
} kept_t;

static pthread_key_t g_key;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static int g_key_ok;

static void release_kept(void *p) {
  kept_t *k = p;
  for (int i = 0; k && i < SCRATCH_KEEP; i++)
    free(k->block[i]);
  free(k);
}

static void make_key(void) {
  g_key_ok = pthread_key_create(&g_key, release_kept) == 0;
}

/* This thread's kept blocks, made on first use; NULL when they cannot be (then nothing is kept). */
static kept_t *kept(int make) {
  pthread_once(&g_once, make_key);
  if (!g_key_ok) return NULL;
  kept_t *k = pthread_getspecific(g_key);
  if (!k && make && (k = calloc(1, sizeof *k)) != NULL && pthread_setspecific(g_key, k) != 0) {
    free(k);
    k = NULL;
  }
  return k;
}

void *fdp_scratch_alloc(size_t bytes) {
  if (bytes > SIZE_MAX - sizeof(header_t)) return NULL;
  kept_t *k = bytes >= SCRATCH_MIN ? kept(0) : NULL;
  int best = -1;
  for (int i = 0; k && i < SCRATCH_KEEP; i++)
    if (k->block[i] && k->block[i]->cap >= bytes && (best < 0 || k->block[i]->cap < k->block[best]->cap)) best = i;
  header_t *h = NULL;
  if (best >= 0) {
    h = k->block[best];
    k->block[best] = NULL;
  } else if ((h = malloc(sizeof *h + bytes)) != NULL) {
    h->cap = bytes;
  }
  return h ? h + 1 : NULL;
}

void fdp_scratch_free(void *p) {
  if (!p) return;
  header_t *h = (header_t *)p - 1;
  kept_t *k = h->cap >= SCRATCH_MIN ? kept(1) : NULL;
  int slot = -1; /* an empty slot, else the smallest block when smaller than this one */
  for (int i = 0; k && i < SCRATCH_KEEP; i++) {
    if (!k->block[i]) {
      slot = i;
      break;
    }
    if (k->block[i]->cap < h->cap && (slot < 0 || k->block[i]->cap < k->block[slot]->cap)) slot = i;
  }
  if (slot < 0) {
    free(h);
    return;
  }
  free(k->block[slot]);
  k->block[slot] = h;
}

void fdp_scratch_release(void) {
  kept_t *k = kept(0);
  for (int i = 0; k && i < SCRATCH_KEEP; i++) {
    free(k->block[i]);
    k->block[i] = NULL;
  }
}
