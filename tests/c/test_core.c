/* SPDX-License-Identifier: MIT */
/* Tests of the fastdp core and its host backend against naive reference loops written here: bucket plans,
 * strided copies, broadcast/scatter/gather, sums of every dtype, device-kind checks and result codes. Built
 * and run under AddressSanitizer and UndefinedBehaviorSanitizer by tests/c/build.py; prints "N passed, M failed". */
#include "fastdp.h"
#include "backend/cuda/layout.h" /* the cuda backend's layout math (CUDA-free) */
#include "core/backend.h"        /* the FDP_CHECK forms (internal) */

#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* ---- the harness: every check is counted; a failure is printed and the run goes on ---- */

static int n_pass, n_fail;

static void check_at(int ok, const char *file, int line, const char *expr, const char *fmt, ...) {
  if (ok) {
    n_pass++;
    return;
  }
  n_fail++;
  fprintf(stdout, "FAIL %s:%d: %s", file, line, expr);
  if (fmt) {
    va_list ap;
    va_start(ap, fmt);
    fputs(" -- ", stdout);
    vfprintf(stdout, fmt, ap);
    va_end(ap);
  }
  fputc('\n', stdout);
  fflush(stdout);
}

#define CHECK(cond) check_at(!!(cond), __FILE__, __LINE__, #cond, NULL)
#define CHECKF(cond, ...) check_at(!!(cond), __FILE__, __LINE__, #cond, __VA_ARGS__)

/* A failure known to set a recognisable detail, so that each expected failure can be seen to set its own. */
static char sentinel[1100];

static void prime_error(void) {
  fdp_op_copy(NULL, NULL, -424242, NULL);
  snprintf(sentinel, sizeof sentinel, "%s", fdp_last_error());
}

static void expect_result(fdp_result_t got, fdp_result_t want, const char *call, const char *file, int line) {
  const char *err = fdp_last_error();
  int ok = got == want;
  if (want != FDP_OK) ok = ok && err && err[0] && strcmp(err, sentinel) != 0;
  check_at(ok, file, line, call, "got %s, want %s (last error: \"%s\")", fdp_result_name(got), fdp_result_name(want),
           err ? err : "(null)");
}

/* EXPECT(call, FDP_X): the call returns FDP_X; a failure must also leave a fresh, non-empty detail. */
#define EXPECT(call, want)                                                                                             \
  do {                                                                                                                 \
    prime_error();                                                                                                     \
    fdp_result_t r_ = (call);                                                                                          \
    expect_result(r_, (want), #call, __FILE__, __LINE__);                                                              \
  } while (0)

/* ---- helpers ---- */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint64_t rnd(void) {
  uint64_t x = rng_state;
  x ^= x << 13;
  x ^= x >> 7;
  x ^= x << 17;
  return rng_state = x;
}

static int64_t rnd_in(int64_t lo, int64_t hi) {
  return lo + (int64_t)(rnd() % (uint64_t)(hi - lo + 1));
}

static void fill_random(void *p, size_t bytes) {
  unsigned char *c = p;
  for (size_t i = 0; i < bytes; i++)
    c[i] = (unsigned char)(rnd() >> 29);
}

static void *xmalloc(size_t bytes) {
  void *p = malloc(bytes ? bytes : 1);
  if (!p) {
    fprintf(stdout, "test: out of memory allocating %zu bytes\n", bytes);
    exit(2);
  }
  return p;
}

static fdp_tensor_t make(void *data, int dtype, int es, int nd, const int64_t *sizes, const int64_t *strides) {
  fdp_tensor_t t;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.device = FDP_HOST;
  t.dtype = dtype;
  t.elem_size = es;
  t.ndim = nd;
  for (int i = 0; i < nd; i++) {
    t.sizes[i] = sizes[i];
    t.strides[i] = strides[i];
  }
  return t;
}

static fdp_tensor_t make_contig(void *data, int dtype, int es, int nd, const int64_t *sizes) {
  int64_t st[FDP_MAX_DIMS], run = 1;
  for (int i = nd - 1; i >= 0; i--) {
    st[i] = run;
    run *= sizes[i];
  }
  return make(data, dtype, es, nd, sizes, st);
}

static fdp_tensor_t make_flat(void *data, int dtype, int es, int64_t numel) {
  return make_contig(data, dtype, es, 1, &numel);
}

static int64_t numel_of(int nd, const int64_t *sizes) {
  int64_t n = 1;
  for (int i = 0; i < nd; i++)
    n *= sizes[i];
  return n;
}

/* A random strided layout over `sizes`: dims in a random memory order, each with a step of 1..3 (or, for
 * sources, sometimes 0: an expanded dim), starting `offset` elements into the buffer. */
typedef struct {
  int nd;
  int64_t sizes[FDP_MAX_DIMS], strides[FDP_MAX_DIMS];
  int64_t offset, span; /* span: elements the buffer must hold */
} layout_t;

static layout_t random_layout(int nd, const int64_t *sizes, int allow_expand, int max_step) {
  layout_t l;
  int perm[FDP_MAX_DIMS];
  memset(&l, 0, sizeof l);
  l.nd = nd;
  for (int i = 0; i < nd; i++) {
    l.sizes[i] = sizes[i];
    perm[i] = i;
  }
  for (int i = nd - 1; i > 0; i--) {
    int j = (int)rnd_in(0, i), tmp = perm[i];
    perm[i] = perm[j];
    perm[j] = tmp;
  }
  int64_t run = 1;
  for (int k = nd - 1; k >= 0; k--) {
    int d = perm[k];
    int64_t step = rnd_in(1, max_step);
    if (allow_expand && rnd() % 5 == 0) {
      l.strides[d] = 0;
      continue;
    }
    l.strides[d] = run * step;
    run *= (sizes[d] > 0 ? sizes[d] : 1) * step;
  }
  l.offset = rnd_in(0, 3);
  int64_t last = 0;
  for (int i = 0; i < nd; i++)
    if (sizes[i] > 0) last += (sizes[i] - 1) * l.strides[i];
  l.span = l.offset + last + 1;
  return l;
}

static layout_t contig_layout(int nd, const int64_t *sizes) {
  layout_t l;
  memset(&l, 0, sizeof l);
  l.nd = nd;
  int64_t run = 1;
  for (int i = nd - 1; i >= 0; i--) {
    l.sizes[i] = sizes[i];
    l.strides[i] = run;
    run *= sizes[i];
  }
  l.span = run > 0 ? run : 1;
  return l;
}

static fdp_tensor_t on(const layout_t *l, void *buf, int es) {
  return make((char *)buf + l->offset * es, FDP_DTYPE_OTHER, es, l->nd, l->sizes, l->strides);
}

/* The reference copy: one element at a time over the index space, row-major. */
static void ref_copy(const fdp_tensor_t *dst, const fdp_tensor_t *src) {
  int nd = src->ndim, es = src->elem_size;
  int64_t n = numel_of(nd, src->sizes), idx[FDP_MAX_DIMS] = {0};
  for (int64_t k = 0; k < n; k++) {
    int64_t d = 0, s = 0;
    for (int i = 0; i < nd; i++) {
      d += idx[i] * dst->strides[i];
      s += idx[i] * src->strides[i];
    }
    memcpy(dst->data + d * es, src->data + s * es, (size_t)es);
    for (int i = nd - 1; i >= 0; i--) {
      if (++idx[i] < src->sizes[i]) break;
      idx[i] = 0;
    }
  }
}

/* Position of the first differing byte, or -1. */
static int64_t first_diff(const void *a, const void *b, size_t bytes) {
  const unsigned char *x = a, *y = b;
  for (size_t i = 0; i < bytes; i++)
    if (x[i] != y[i]) return (int64_t)i;
  return -1;
}

static void shape_text(int nd, const int64_t *sizes, const int64_t *strides, char *buf, size_t len) {
  size_t used = 0;
  buf[0] = 0;
  for (int i = 0; i < nd && used < len; i++)
    used += (size_t)snprintf(buf + used, len - used, "%s%lld:%lld", i ? "," : "", (long long)sizes[i],
                             (long long)strides[i]);
}

/* Runs fn in a child process and returns 1 when it exited 0 (a crash there does not end this run). */
static int in_child(void (*fn)(void)) {
  fflush(stdout);
  pid_t pid = fork();
  if (pid < 0) return 0;
  if (pid == 0) {
    fn();
    _exit(0);
  }
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return 0;
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

/* A page-aligned buffer that can be made read-only; writes to it then fault. */
static void *ro_alloc(size_t bytes) {
  void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return p == MAP_FAILED ? NULL : p;
}

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

static void test_checks(void) {
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

/* ---- the cuda backend's layout math (csrc/backend/cuda/layout.c) against element-by-element references ---- */

/* What a copy does, byte by byte: for each destination byte (offset from the destination's address) the offset
 * of the source byte it receives (from the source's address); -1 where nothing is written. */
typedef struct bytemap {
  int64_t *src_of;
  int64_t span;
  int64_t stray; /* writes outside the span, or to a byte already written */
} bytemap_t;

static void map_init(bytemap_t *m, int64_t span) {
  m->span = span;
  m->stray = 0;
  m->src_of = xmalloc((size_t)span * sizeof *m->src_of);
  for (int64_t i = 0; i < span; i++)
    m->src_of[i] = -1;
}

static void map_put(bytemap_t *m, int64_t doff, int64_t soff) {
  if (doff < 0 || doff >= m->span || m->src_of[doff] != -1)
    m->stray++;
  else
    m->src_of[doff] = soff;
}

/* The reference: every element of the descriptors, by its multi-index. */
static void map_of_copy(const fdp_copy_t *c, bytemap_t *m) {
  int nd = c->dst.ndim, es = c->dst.elem_size;
  int64_t idx[FDP_MAX_DIMS] = {0}, n = fdp_tensor_numel(&c->dst);
  for (int64_t e = 0; e < n; e++) {
    int64_t so = 0, dof = 0;
    for (int d = 0; d < nd; d++) {
      so += idx[d] * c->src.strides[d];
      dof += idx[d] * c->dst.strides[d];
    }
    for (int b = 0; b < es; b++)
      map_put(m, dof * es + b, so * es + b);
    for (int d = nd - 1; d >= 0 && ++idx[d] == c->dst.sizes[d]; d--)
      idx[d] = 0;
  }
}

/* The same through a pair: its own index space and element size; its addresses relative to the copy's. */
static void map_of_pair(const fdp_pair_t *p, uint64_t src0, uint64_t dst0, bytemap_t *m) {
  int64_t idx[FDP_COPY_MAX_DIMS] = {0}, sbase = (int64_t)(p->src - src0), dbase = (int64_t)(p->dst - dst0);
  for (int64_t e = 0; e < p->numel; e++) {
    int64_t so = sbase, dof = dbase;
    for (int d = 0; d < p->ndim; d++) {
      so += idx[d] * p->ss[d] * p->es;
      dof += idx[d] * p->ds[d] * p->es;
    }
    for (int64_t b = 0; b < p->es; b++)
      map_put(m, dof + b, so + b);
    for (int d = p->ndim - 1; d >= 0 && ++idx[d] == p->sizes[d]; d--)
      idx[d] = 0;
  }
}

/* The same through the copy engines' rows (fdp__pair_rows and fdp__pair_outer_next), as copy.c issues them. */
static void map_of_rows(const fdp_pair_t *p, size_t width, size_t height, size_t spitch, size_t dpitch, int64_t outer,
                        bytemap_t *m) {
  int64_t idx[FDP_COPY_MAX_DIMS] = {0};
  for (int64_t it = 0; it < outer; it++) {
    int64_t so, dof;
    fdp__pair_outer_next(p, idx, &so, &dof);
    for (size_t h = 0; h < height; h++)
      for (size_t w = 0; w < width; w++)
        map_put(m, dof + (int64_t)(h * dpitch + w), so + (int64_t)(h * spitch + w));
  }
}

static int same_map(const bytemap_t *a, const bytemap_t *b) {
  return a->stray == 0 && b->stray == 0 && memcmp(a->src_of, b->src_of, (size_t)a->span * sizeof *a->src_of) == 0;
}

/* A layout with 0..2 elements of padding after each dim (in a random memory order): odd pitches, which
 * multiplicative steps never make, so that widening must look at every stride. */
static layout_t padded_layout(int nd, const int64_t *sizes) {
  layout_t l = contig_layout(nd, sizes);
  int perm[FDP_MAX_DIMS];
  for (int i = 0; i < nd; i++)
    perm[i] = i;
  for (int i = nd - 1; i > 0; i--) {
    int j = (int)rnd_in(0, i), tmp = perm[i];
    perm[i] = perm[j];
    perm[j] = tmp;
  }
  int64_t run = 1, last = 0;
  for (int k = nd - 1; k >= 0; k--) {
    l.strides[perm[k]] = run;
    run = run * sizes[perm[k]] + rnd_in(0, 2);
  }
  for (int i = 0; i < nd; i++)
    if (sizes[i] > 0) last += (sizes[i] - 1) * l.strides[i];
  l.offset = rnd_in(0, 3);
  l.span = l.offset + last + 1;
  return l;
}

/* One random copy: its pair, the pair for the kernel, and (where the layout has them) the rows all move every
 * byte exactly as the descriptors say. Returns 0 and fills msg on a difference. */
static int layout_case(int iter, char *msg, size_t msglen) {
  static const int sizes_es[] = {1, 2, 3, 4, 6, 8, 12, 16};
  int es = sizes_es[rnd_in(0, 7)], nd = (int)rnd_in(0, 5);
  int64_t sz[FDP_MAX_DIMS];
  for (int d = 0; d < nd; d++)
    sz[d] = rnd_in(1, 4) == 4 ? 1 : rnd_in(1, 5);
  if (iter % 50 == 49 && nd > 0) sz[0] = 0; /* an empty copy */
  layout_t sl = random_layout(nd, sz, 1, 2), dl = random_layout(nd, sz, 0, 2);
  if (rnd() % 3 == 0) dl = rnd() % 2 ? contig_layout(nd, sz) : padded_layout(nd, sz);
  if (rnd() % 3 == 0) sl = rnd() % 2 ? contig_layout(nd, sz) : padded_layout(nd, sz);
  /* Addresses (never read): aligned to 16, or off by a few bytes, so that widening and byte splitting both run. */
  uint64_t src0 = 0x10000 + (uint64_t)(rnd() % 4 == 0 ? rnd_in(1, 15) : 0);
  uint64_t dst0 = 0x90000 + (uint64_t)(rnd() % 4 == 0 ? rnd_in(1, 15) : 0);
  fdp_copy_t c;
  c.src = make((void *)(uintptr_t)(src0 + (uint64_t)(sl.offset * es)), FDP_DTYPE_OTHER, es, nd, sz, sl.strides);
  c.dst = make((void *)(uintptr_t)(dst0 + (uint64_t)(dl.offset * es)), FDP_DTYPE_OTHER, es, nd, sz, dl.strides);
  /* Offsets are from the descriptors' own addresses. */
  uint64_t sdata = (uint64_t)(uintptr_t)c.src.data, ddata = (uint64_t)(uintptr_t)c.dst.data;
  bytemap_t ref, got, kern, rows;
  map_init(&ref, dl.span * es);
  map_of_copy(&c, &ref);
  fdp_pair_t p;
  fdp__pair_build(&c, &p);
  int ok = p.numel == fdp_tensor_numel(&c.dst) && p.ndim >= 1 && p.ndim <= FDP_MAX_DIMS;
  map_init(&got, ref.span);
  if (p.numel > 0) map_of_pair(&p, sdata, ddata, &got);
  ok = ok && same_map(&ref, &got);
  /* The staging layout: flat strides over the pair's sizes, row-major. */
  int64_t fs[FDP_COPY_MAX_DIMS];
  fdp__pair_flat_strides(&p, fs);
  int64_t run = 1;
  for (int d = p.ndim - 1; d >= 0; d--) {
    ok = ok && fs[d] == run;
    run *= p.sizes[d];
  }
  fdp_pair_t k = p;
  fdp__pair_for_kernel(&k);
  map_init(&kern, ref.span);
  if (p.numel > 0) map_of_pair(&k, sdata, ddata, &kern);
  int kes_ok = k.es == 1 || k.es == 2 || k.es == 4 || k.es == 8 || k.es == 16;
  ok = ok && same_map(&ref, &kern) && kes_ok && k.src % (uint64_t)k.es == 0 && k.dst % (uint64_t)k.es == 0 &&
       k.ndim <= FDP_COPY_MAX_DIMS && (1 << fdp__pair_es_index(k.es)) == k.es;
  size_t width = 0, height = 0, spitch = 0, dpitch = 0;
  int64_t outer = 0;
  int has_rows = p.numel > 0 && fdp__pair_rows(&p, &width, &height, &spitch, &dpitch, &outer);
  map_init(&rows, ref.span);
  if (has_rows) {
    map_of_rows(&p, width, height, spitch, dpitch, outer, &rows);
    ok = ok && same_map(&ref, &rows) && spitch >= width && dpitch >= width;
  }
  /* The flat tests say what they claim: one contiguous run on that side. */
  ok = ok && (!fdp__pair_src_flat(&p) || (p.ndim == 1 && p.ss[0] == 1));
  ok = ok && (!fdp__pair_dst_flat(&p) || (p.ndim == 1 && p.ds[0] == 1));
  snprintf(msg, msglen, "iter %d: es %d nd %d, pair ndim %d numel %lld, kernel es %lld ndim %d, rows %d", iter, es, nd,
           p.ndim, (long long)p.numel, (long long)k.es, k.ndim, has_rows);
  free(ref.src_of);
  free(got.src_of);
  free(kern.src_of);
  free(rows.src_of);
  return ok;
}

static void test_layout(void) {
  char msg[300];
  int failures = 0, with_rows = 0, widened = 0, split = 0;
  for (int iter = 0; iter < 3000; iter++) {
    if (!layout_case(iter, msg, sizeof msg) && failures++ < 5) CHECKF(0, "%s", msg);
    with_rows += strstr(msg, "rows 1") != NULL;
  }
  CHECKF(failures == 0, "%d random layouts mapped differently from their descriptors", failures);
  /* The random cases reach each path: rows, wider elements and single bytes. */
  for (int iter = 0; iter < 200; iter++) {
    int64_t sz[2] = {rnd_in(2, 6), 4 * rnd_in(1, 4)}, st[2] = {sz[1] + 4 * rnd_in(0, 2), 1};
    fdp_copy_t c;
    c.src = make((void *)(uintptr_t)0x10000, FDP_DTYPE_OTHER, 4, 2, sz, st);
    c.dst = make((void *)(uintptr_t)(0x90000 + (uint64_t)(iter % 2) * 2), FDP_DTYPE_OTHER, 4, 2, sz, st);
    fdp_pair_t p;
    fdp__pair_build(&c, &p);
    fdp__pair_for_kernel(&p);
    widened += p.es > 4;
    split += p.es == 1;
  }
  CHECKF(with_rows > 0 && widened > 0 && split > 0, "paths reached: rows %d, widened %d, bytes %d", with_rows, widened,
         split);
  /* Pitches past CU_DEVICE_ATTRIBUTE_MAX_PITCH have no rows. */
  fdp_pair_t big;
  memset(&big, 0, sizeof big);
  big.ndim = 2;
  big.es = 1;
  big.sizes[0] = 2;
  big.sizes[1] = 8;
  big.ss[0] = (int64_t)FDP_PAIR_MAX_PITCH + 1;
  big.ds[0] = 8;
  big.ss[1] = big.ds[1] = 1;
  big.numel = 16;
  size_t w, h, sp, dp;
  int64_t o;
  CHECK(!fdp__pair_rows(&big, &w, &h, &sp, &dp, &o));
  big.ss[0] = FDP_PAIR_MAX_PITCH;
  CHECK(fdp__pair_rows(&big, &w, &h, &sp, &dp, &o) && sp == (size_t)FDP_PAIR_MAX_PITCH && w == 8 && h == 2 && o == 1);
}

static void test_results(void) {
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

/* ---- backends ---- */

static void test_backends(void) {
  const char *why = "untouched";
  CHECK(fdp_backend_compiled(FDP_BACKEND_HOST) == 1);
  CHECK(fdp_backend_usable(FDP_BACKEND_HOST, &why) == 1);
  CHECK(why != NULL);
  CHECK(fdp_backend_usable(FDP_BACKEND_HOST, NULL) == 1);
  fdp_backend_id_t gpu[] = {FDP_BACKEND_CUDA, FDP_BACKEND_NCCL};
  for (int i = 0; i < 2; i++) {
    why = NULL;
    CHECKF(fdp_backend_compiled(gpu[i]) == 1, "%s", fdp_backend_name(gpu[i])); /* always built; no driver here */
    CHECKF(fdp_backend_usable(gpu[i], &why) == 0, "%s", fdp_backend_name(gpu[i]));
    CHECKF(why && why[0], "%s: empty reason", fdp_backend_name(gpu[i]));
    CHECK(fdp_backend_usable(gpu[i], NULL) == 0);
  }
  CHECK(strcmp(fdp_backend_name(FDP_BACKEND_HOST), "host") == 0);
  CHECK(strcmp(fdp_backend_name(FDP_BACKEND_CUDA), "cuda") == 0);
  CHECK(strcmp(fdp_backend_name(FDP_BACKEND_NCCL), "nccl") == 0);
  CHECK(fdp_backend_name(FDP_BACKEND_COUNT) != NULL);
  CHECK(fdp_backend_compiled(FDP_BACKEND_COUNT) == 0);
  why = NULL;
  CHECK(fdp_backend_usable(FDP_BACKEND_COUNT, &why) == 0 && why && why[0]);
}

/* The route on a CPU-only machine: host buffers go to the host backend; CUDA buffers have no usable backend, and
 * the error names the one that could run them; bad arguments are refused. */
static void test_route(void) {
  int host[3] = {FDP_HOST, FDP_HOST, FDP_HOST}, cuda[2] = {0, 1}, bad[2] = {FDP_HOST, FDP_MAX_DEVICES};
  fdp_backend_id_t id = FDP_BACKEND_COUNT;
  EXPECT(fdp_route_devices(FDP_OP_BROADCAST, host, 3, FDP_DTYPE_F32, &id), FDP_OK);
  CHECK(id == FDP_BACKEND_HOST);
  id = FDP_BACKEND_COUNT;
  EXPECT(fdp_route_devices(FDP_OP_REDUCE, host, 2, FDP_DTYPE_BF16, &id), FDP_OK);
  CHECK(id == FDP_BACKEND_HOST);
  EXPECT(fdp_route_devices(FDP_OP_BROADCAST, host, 1, FDP_DTYPE_U8, &id), FDP_OK);
  CHECK(id == FDP_BACKEND_HOST);
  EXPECT(fdp_route_devices(FDP_OP_BROADCAST, cuda, 2, FDP_DTYPE_F32, &id), FDP_UNAVAILABLE);
  CHECKF(strstr(fdp_last_error(), "backend is not usable"), "%s", fdp_last_error());
  EXPECT(fdp_route_devices(FDP_OP_REDUCE, cuda, 2, FDP_DTYPE_F32, &id), FDP_UNAVAILABLE);
  EXPECT(fdp_route_devices(FDP_OP_COPY, host, 2, FDP_DTYPE_F32, &id), FDP_INVALID);
  EXPECT(fdp_route_devices(FDP_OP_BROADCAST, host, 0, FDP_DTYPE_F32, &id), FDP_INVALID);
  EXPECT(fdp_route_devices(FDP_OP_BROADCAST, host, FDP_MAX_DEVICES + 1, FDP_DTYPE_F32, &id), FDP_INVALID);
  EXPECT(fdp_route_devices(FDP_OP_BROADCAST, host, 2, FDP_DTYPE_COUNT, &id), FDP_INVALID);
  EXPECT(fdp_route_devices(FDP_OP_BROADCAST, bad, 2, FDP_DTYPE_F32, &id), FDP_INVALID);
  EXPECT(fdp_route_devices(FDP_OP_BROADCAST, NULL, 2, FDP_DTYPE_F32, &id), FDP_INVALID);
  EXPECT(fdp_route_devices(FDP_OP_BROADCAST, host, 2, FDP_DTYPE_F32, NULL), FDP_INVALID);
}

/* ---- tensor helpers ---- */

static void test_tensor_helpers(void) {
  char buf[64];
  int64_t s23[] = {2, 3}, c23[] = {3, 1}, t23[] = {1, 2}, g23[] = {4, 1}, s0[] = {2, 0, 3}, st0[] = {7, 9, 11};
  fdp_tensor_t c = make(buf, FDP_DTYPE_F32, 4, 2, s23, c23), t = make(buf, FDP_DTYPE_F32, 4, 2, s23, t23),
               g = make(buf, FDP_DTYPE_F32, 4, 2, s23, g23), z = make(buf, FDP_DTYPE_F32, 4, 3, s0, st0),
               scalar = make(buf, FDP_DTYPE_F32, 4, 0, NULL, NULL);
  CHECK(fdp_tensor_numel(&c) == 6 && fdp_tensor_numel(&z) == 0 && fdp_tensor_numel(&scalar) == 1);
  CHECK(fdp_tensor_is_contiguous(&c) && fdp_tensor_is_dense(&c));
  CHECK(!fdp_tensor_is_contiguous(&t) && fdp_tensor_is_dense(&t));
  CHECK(!fdp_tensor_is_contiguous(&g) && !fdp_tensor_is_dense(&g));
  /* An empty tensor is contiguous whatever its strides (as in PyTorch), wherever its zero-size dim is. */
  CHECKF(fdp_tensor_is_contiguous(&z) && fdp_tensor_is_dense(&z), "empty [2, 0, 3] with strides [7, 9, 11]");
  CHECK(fdp_tensor_is_contiguous(&scalar) && fdp_tensor_is_dense(&scalar));
  fdp_tensor_t n;
  fdp_tensor_narrow(&c, 1, 1, 2, &n);
  CHECK(n.data == buf + 4 && n.sizes[1] == 2 && n.sizes[0] == 2 && n.strides[0] == 3 && n.strides[1] == 1);
  fdp_tensor_narrow(&t, 0, 1, 1, &n);
  CHECK(n.data == buf + 4 && n.sizes[0] == 1 && n.sizes[1] == 3);
}

/* ---- bucket plans ---- */

/* The rule, naively: per (type key, dtype, element size) group one open bucket; a tensor joins its group's open
 * bucket (opening one if none) and the bucket closes once it holds at least limit bytes. Buckets are listed in
 * the order they were opened. */
typedef struct {
  int nb;
  int bucket_of[64];
  int members[64][64];
  int count[64];
} ref_plan_t;

static void ref_plan(const fdp_tensor_t *ts, const int *keys, int n, size_t limit, ref_plan_t *p) {
  int gkey[64], gdtype[64], ges[64], gopen[64], ng = 0;
  size_t bytes[64];
  memset(p, 0, sizeof *p);
  for (int i = 0; i < n; i++) {
    int key = keys ? keys[i] : 0, g;
    for (g = 0; g < ng; g++)
      if (gkey[g] == key && gdtype[g] == ts[i].dtype && ges[g] == ts[i].elem_size) break;
    if (g == ng) {
      gkey[ng] = key;
      gdtype[ng] = ts[i].dtype;
      ges[ng] = ts[i].elem_size;
      gopen[ng] = -1;
      ng++;
    }
    if (gopen[g] < 0) {
      gopen[g] = p->nb;
      bytes[p->nb] = 0;
      p->nb++;
    }
    int b = gopen[g];
    p->members[b][p->count[b]++] = i;
    p->bucket_of[i] = b;
    bytes[b] += (size_t)fdp_tensor_numel(&ts[i]) * (size_t)ts[i].elem_size;
    if (bytes[b] >= limit) gopen[g] = -1;
  }
}

/* Compares a plan with the reference; returns a description of the first difference or NULL. */
static const char *plan_differs(const fdp_plan_t *pl, const fdp_tensor_t *ts, int n, const ref_plan_t *ref) {
  static char why[256];
  if (pl->nmembers != n) return "member count";
  if (pl->nbuckets != ref->nb) {
    snprintf(why, sizeof why, "%d buckets, reference %d", pl->nbuckets, ref->nb);
    return why;
  }
  /* Bucket order is not part of the contract: match buckets by their first tensor. */
  int seen_member[64] = {0};
  for (int b = 0; b < pl->nbuckets; b++) {
    const fdp_bucket_t *bk = &pl->buckets[b];
    if (bk->count <= 0 || bk->first < 0 || bk->first + bk->count > pl->nmembers) return "bucket member range";
    const fdp_member_t *m = &pl->members[bk->first];
    int rb = ref->bucket_of[m[0].tensor];
    if (ref->count[rb] != bk->count) {
      snprintf(why, sizeof why, "bucket %d holds %d tensors, reference %d", b, bk->count, ref->count[rb]);
      return why;
    }
    int64_t off = 0;
    for (int k = 0; k < bk->count; k++) {
      int t = m[k].tensor;
      if (t != ref->members[rb][k]) {
        snprintf(why, sizeof why, "bucket %d member %d is tensor %d, reference %d", b, k, t, ref->members[rb][k]);
        return why;
      }
      if (seen_member[bk->first + k]++) return "a member slot used twice";
      if (m[k].offset != off || m[k].numel != fdp_tensor_numel(&ts[t])) {
        snprintf(why, sizeof why, "bucket %d member %d: offset %lld numel %lld, reference %lld %lld", b, k,
                 (long long)m[k].offset, (long long)m[k].numel, (long long)off, (long long)fdp_tensor_numel(&ts[t]));
        return why;
      }
      if (ts[t].dtype != bk->dtype || ts[t].elem_size != bk->elem_size) {
        snprintf(why, sizeof why, "bucket %d (dtype %d, %d bytes) holds tensor %d (dtype %d, %d bytes)", b, bk->dtype,
                 bk->elem_size, t, ts[t].dtype, ts[t].elem_size);
        return why;
      }
      off += m[k].numel;
    }
    if (bk->numel != off) return "bucket numel is not the sum of its members";
  }
  return NULL;
}

static void test_plan(void) {
  static const int dtypes[][2] = {{FDP_DTYPE_F32, 4}, {FDP_DTYPE_F16, 2},    {FDP_DTYPE_I64, 8},
                                  {FDP_DTYPE_I32, 4}, {FDP_DTYPE_OTHER, 16}, {FDP_DTYPE_OTHER, 4}};
  static const size_t limits[] = {1, 7, 64, 100, 1000, 1 << 20, (size_t)-1};
  fdp_tensor_t ts[64];
  int keys[64];
  char dummy[16];
  for (int iter = 0; iter < 300; iter++) {
    int n = (int)rnd_in(0, 40);
    for (int i = 0; i < n; i++) {
      int d = (int)rnd_in(0, 5);
      int nd = (int)rnd_in(0, 3);
      int64_t sizes[3];
      for (int k = 0; k < nd; k++)
        sizes[k] = rnd_in(0, 6);
      ts[i] = make_contig(dummy, dtypes[d][0], dtypes[d][1], nd, sizes);
      /* Keys as the binding makes them (one per dtype) plus a dense/sparse bit. */
      keys[i] = d * 2 + (int)(rnd() & 1);
    }
    size_t limit = limits[rnd_in(0, 6)];
    int use_keys = (int)(rnd() & 1);
    fdp_plan_t *pl = NULL;
    fdp_result_t r = fdp_plan_build(ts, use_keys ? keys : NULL, n, limit, &pl);
    CHECKF(r == FDP_OK && pl, "iter %d: %s %s", iter, fdp_result_name(r), fdp_last_error());
    if (r != FDP_OK || !pl) continue;
    ref_plan_t ref;
    ref_plan(ts, use_keys ? keys : NULL, n, limit, &ref);
    const char *why = plan_differs(pl, ts, n, &ref);
    CHECKF(why == NULL, "iter %d (n=%d, limit %zu, keys %d): %s", iter, n, limit, use_keys, why);
    fdp_plan_free(pl);
  }

  /* Limit 1 byte: every tensor is a bucket of its own (a 0-d tensor is one element)... */
  {
    int64_t s4 = 4, s0 = 0;
    ts[0] = make_contig(dummy, FDP_DTYPE_F32, 4, 1, &s4);
    ts[1] = make_contig(dummy, FDP_DTYPE_F32, 4, 1, &s4);
    ts[2] = make_contig(dummy, FDP_DTYPE_F32, 4, 0, NULL);
    ts[3] = make_contig(dummy, FDP_DTYPE_F32, 4, 1, &s4);
    fdp_plan_t *pl = NULL;
    EXPECT(fdp_plan_build(ts, NULL, 4, 1, &pl), FDP_OK);
    CHECK(pl && pl->nbuckets == 4);
    for (int b = 0; pl && b < pl->nbuckets && b < 4; b++)
      CHECK(pl->buckets[b].count == 1);
    fdp_plan_free(pl);
    /* ...but an empty tensor (0 bytes) does not reach the limit, so it shares the next tensor's bucket. */
    ts[0] = make_contig(dummy, FDP_DTYPE_F32, 4, 1, &s0);
    pl = NULL;
    EXPECT(fdp_plan_build(ts, NULL, 2, 1, &pl), FDP_OK);
    CHECK(pl && pl->nbuckets == 1 && pl->buckets[0].count == 2 && pl->buckets[0].numel == 4);
    fdp_plan_free(pl);
  }
  /* A tensor bigger than the limit closes the bucket it joins; arriving with no bucket open, it is a bucket of
   * its own; the tensor after it starts a new one. */
  {
    int64_t small = 2, big = 100;
    ts[0] = make_contig(dummy, FDP_DTYPE_F32, 4, 1, &small); /* 8 bytes */
    ts[1] = make_contig(dummy, FDP_DTYPE_F32, 4, 1, &big);   /* 400 bytes: closes bucket 0 (8 + 400 >= 64) */
    ts[2] = make_contig(dummy, FDP_DTYPE_F32, 4, 1, &big);   /* alone */
    ts[3] = make_contig(dummy, FDP_DTYPE_F32, 4, 1, &small);
    ts[4] = make_contig(dummy, FDP_DTYPE_F32, 4, 1, &small);
    fdp_plan_t *pl = NULL;
    EXPECT(fdp_plan_build(ts, NULL, 5, 64, &pl), FDP_OK);
    ref_plan_t ref;
    ref_plan(ts, NULL, 5, 64, &ref);
    CHECK(ref.nb == 3 && ref.count[0] == 2 && ref.count[1] == 1 && ref.count[2] == 2);
    const char *why = pl ? plan_differs(pl, ts, 5, &ref) : "no plan";
    CHECKF(why == NULL, "%s", why);
    fdp_plan_free(pl);
  }
  /* Groups interleave but each keeps its order; offsets run within each bucket. */
  {
    int64_t s3 = 3, s5 = 5;
    ts[0] = make_contig(dummy, FDP_DTYPE_F32, 4, 1, &s3);
    ts[1] = make_contig(dummy, FDP_DTYPE_F16, 2, 1, &s5);
    ts[2] = make_contig(dummy, FDP_DTYPE_F32, 4, 1, &s5);
    ts[3] = make_contig(dummy, FDP_DTYPE_F16, 2, 1, &s3);
    ts[4] = make_contig(dummy, FDP_DTYPE_I32, 4, 1, &s3);
    fdp_plan_t *pl = NULL;
    EXPECT(fdp_plan_build(ts, NULL, 5, 1 << 20, &pl), FDP_OK);
    CHECK(pl && pl->nbuckets == 3);
    int found = 0;
    for (int b = 0; pl && b < pl->nbuckets; b++) {
      const fdp_bucket_t *bk = &pl->buckets[b];
      const fdp_member_t *m = &pl->members[bk->first];
      if (bk->dtype == FDP_DTYPE_F32)
        found += bk->count == 2 && m[0].tensor == 0 && m[1].tensor == 2 && m[0].offset == 0 && m[1].offset == 3 &&
                 bk->numel == 8;
      if (bk->dtype == FDP_DTYPE_F16)
        found += bk->count == 2 && m[0].tensor == 1 && m[1].tensor == 3 && m[1].offset == 5 && bk->numel == 8;
      if (bk->dtype == FDP_DTYPE_I32) found += bk->count == 1 && m[0].tensor == 4 && bk->numel == 3;
    }
    CHECK(found == 3);
    fdp_plan_free(pl);
  }
  /* type_key separates groups beyond the dtype: a dtype change still splits groups under one key, and the
   * same dtype under two keys makes two groups. */
  {
    int64_t s3 = 3;
    ts[0] = make_contig(dummy, FDP_DTYPE_F32, 4, 1, &s3);
    ts[1] = make_contig(dummy, FDP_DTYPE_I32, 4, 1, &s3);
    ts[2] = make_contig(dummy, FDP_DTYPE_F32, 4, 1, &s3);
    int same_key[3] = {0, 0, 0}, two_keys[3] = {0, 1, 1};
    fdp_plan_t *pl = NULL;
    EXPECT(fdp_plan_build(ts, same_key, 3, 1 << 20, &pl), FDP_OK);
    ref_plan_t ref;
    ref_plan(ts, same_key, 3, 1 << 20, &ref);
    const char *why = pl ? plan_differs(pl, ts, 3, &ref) : "no plan";
    CHECKF(why == NULL, "float32 and int32 under one type_key: %s", why);
    fdp_plan_free(pl);
    ts[1] = make_contig(dummy, FDP_DTYPE_F32, 4, 1, &s3);
    pl = NULL;
    EXPECT(fdp_plan_build(ts, two_keys, 3, 1 << 20, &pl), FDP_OK);
    ref_plan(ts, two_keys, 3, 1 << 20, &ref);
    why = pl ? plan_differs(pl, ts, 3, &ref) : "no plan";
    CHECKF(why == NULL && pl->nbuckets == 2, "%s", why);
    fdp_plan_free(pl);
    /* OTHER dtypes group by element size. */
    ts[0] = make_contig(dummy, FDP_DTYPE_OTHER, 16, 1, &s3);
    ts[1] = make_contig(dummy, FDP_DTYPE_OTHER, 8, 1, &s3);
    ts[2] = make_contig(dummy, FDP_DTYPE_OTHER, 16, 1, &s3);
    pl = NULL;
    EXPECT(fdp_plan_build(ts, NULL, 3, 1 << 20, &pl), FDP_OK);
    ref_plan(ts, NULL, 3, 1 << 20, &ref);
    why = pl ? plan_differs(pl, ts, 3, &ref) : "no plan";
    CHECKF(why == NULL && pl->nbuckets == 2, "%s", why);
    fdp_plan_free(pl);
  }
  /* Empty list, bad arguments. */
  {
    static fdp_plan_t untouched;
    fdp_plan_t *pl = &untouched;
    EXPECT(fdp_plan_build(NULL, NULL, 0, 16, &pl), FDP_OK);
    CHECK(pl && pl->nbuckets == 0 && pl->nmembers == 0);
    fdp_plan_free(pl);
    fdp_plan_free(NULL);
    pl = &untouched;
    EXPECT(fdp_plan_build(ts, NULL, -1, 16, &pl), FDP_INVALID);
    CHECK(pl == NULL);
    pl = &untouched;
    EXPECT(fdp_plan_build(ts, NULL, 3, 0, &pl), FDP_INVALID);
    CHECK(pl == NULL);
    EXPECT(fdp_plan_build(NULL, NULL, 2, 16, &pl), FDP_INVALID);
    EXPECT(fdp_plan_build(ts, NULL, -100, 0, &pl), FDP_INVALID);
  }
}

/* ---- copies ---- */

static const int elem_sizes[] = {1, 2, 4, 8, 16};

/* One copy of `sizes` between two layouts; compares whole destination buffers, gaps included. */
static int copy_case(int es, int nd, const int64_t *sizes, const layout_t *dl, const layout_t *sl, char *msg,
                     size_t msglen) {
  size_t dbytes = (size_t)dl->span * es, sbytes = (size_t)sl->span * es;
  char *sbuf = xmalloc(sbytes), *dbuf = xmalloc(dbytes), *rbuf = xmalloc(dbytes);
  fill_random(sbuf, sbytes);
  fill_random(dbuf, dbytes);
  memcpy(rbuf, dbuf, dbytes);
  fdp_tensor_t src = on(sl, sbuf, es), dst = on(dl, dbuf, es), ref = on(dl, rbuf, es);
  ref_copy(&ref, &src);
  fdp_result_t r = fdp_op_copy(&dst, &src, 1, NULL);
  int64_t at = first_diff(dbuf, rbuf, dbytes);
  int ok = r == FDP_OK && at < 0;
  if (!ok) {
    char a[300], b[300];
    shape_text(nd, sizes, dl->strides, a, sizeof a);
    shape_text(nd, sizes, sl->strides, b, sizeof b);
    snprintf(msg, msglen, "es %d, dst [%s]+%lld, src [%s]+%lld: %s, first wrong byte %lld (%s)", es, a,
             (long long)dl->offset, b, (long long)sl->offset, fdp_result_name(r), (long long)at, fdp_last_error());
  }
  free(sbuf);
  free(dbuf);
  free(rbuf);
  return ok;
}

static void test_copy(void) {
  char msg[1000];
  for (size_t e = 0; e < sizeof elem_sizes / sizeof elem_sizes[0]; e++) {
    int es = elem_sizes[e];
    /* Random shapes of 0..6 dims (sizes 0..4, mostly non-zero) in random layouts on both sides. */
    int failures = 0;
    for (int iter = 0; iter < 400; iter++) {
      int nd = (int)rnd_in(0, 6);
      int64_t sizes[6];
      for (int i = 0; i < nd; i++)
        sizes[i] = rnd() % 12 == 0 ? 0 : rnd_in(1, 4);
      layout_t sl = random_layout(nd, sizes, 1, 3), dl = random_layout(nd, sizes, 0, 2);
      if (!copy_case(es, nd, sizes, &dl, &sl, msg, sizeof msg) && failures++ < 5) CHECKF(0, "%s", msg);
    }
    CHECKF(failures == 0, "es %d: %d random copies wrong", es, failures);

    /* Named shapes: 0-d, empty, size-1 dims, a transpose, step slices, a 6-d permutation. */
    {
      layout_t l = contig_layout(0, NULL);
      CHECKF(copy_case(es, 0, NULL, &l, &l, msg, sizeof msg), "0-d: %s", msg);
    }
    {
      int64_t sz[] = {3, 0, 2};
      layout_t l = contig_layout(3, sz);
      layout_t t = random_layout(3, sz, 0, 2);
      CHECKF(copy_case(es, 3, sz, &t, &l, msg, sizeof msg), "empty: %s", msg);
    }
    {
      int64_t sz[] = {1, 5, 1, 3};
      layout_t d = contig_layout(4, sz), s = contig_layout(4, sz);
      s.strides[0] = 999; /* strides of size-1 dims are arbitrary */
      s.strides[2] = 12345;
      s.span = 15;
      d.strides[1] = 7;
      d.span = 4 * 7 + 3;
      CHECKF(copy_case(es, 4, sz, &d, &s, msg, sizeof msg), "size-1 dims: %s", msg);
    }
    {
      int64_t sz[] = {7, 9};
      layout_t s = contig_layout(2, sz), d = contig_layout(2, sz);
      d.strides[0] = 1; /* dst is the transpose of a [9, 7] buffer */
      d.strides[1] = 7;
      CHECKF(copy_case(es, 2, sz, &d, &s, msg, sizeof msg), "transpose: %s", msg);
    }
    {
      int64_t sz[] = {5, 4};
      layout_t s = contig_layout(2, sz), d = contig_layout(2, sz);
      s.strides[0] = 24; /* x[1::2, 2::3] of a [10, 12] buffer */
      s.strides[1] = 3;
      s.offset = 12 + 2;
      s.span = 120;
      CHECKF(copy_case(es, 2, sz, &d, &s, msg, sizeof msg), "step slice: %s", msg);
      CHECKF(copy_case(es, 2, sz, &s, &d, msg, sizeof msg), "into a step slice: %s", msg);
    }
    {
      int64_t sz[] = {2, 3, 1, 4, 2, 3};
      layout_t s = contig_layout(6, sz), d = random_layout(6, sz, 0, 1);
      CHECKF(copy_case(es, 6, sz, &d, &s, msg, sizeof msg), "6-d permutation: %s", msg);
      d = random_layout(6, sz, 0, 2);
      s = random_layout(6, sz, 1, 2);
      CHECKF(copy_case(es, 6, sz, &d, &s, msg, sizeof msg), "6-d strided: %s", msg);
    }
  }

  /* Several pairs in one call, and a pair that is its own source (skipped). */
  {
    int64_t sz[] = {6, 5};
    float a[30], b[30], c[40], d[40], ref_c[40];
    fill_random(a, sizeof a);
    fill_random(b, sizeof b);
    fill_random(c, sizeof c);
    memcpy(d, c, sizeof d);
    memcpy(ref_c, c, sizeof c);
    int64_t tst[] = {1, 6};
    fdp_tensor_t srcs[3] = {make_contig(a, FDP_DTYPE_F32, 4, 2, sz), make_contig(b, FDP_DTYPE_F32, 4, 2, sz),
                            make_contig(a, FDP_DTYPE_F32, 4, 2, sz)};
    fdp_tensor_t dsts[3] = {make(c, FDP_DTYPE_F32, 4, 2, sz, tst), make_contig(d, FDP_DTYPE_F32, 4, 2, sz),
                            make_contig(a, FDP_DTYPE_F32, 4, 2, sz)};
    fdp_tensor_t rc = make(ref_c, FDP_DTYPE_F32, 4, 2, sz, tst);
    ref_copy(&rc, &srcs[0]);
    float a_before[30];
    memcpy(a_before, a, sizeof a);
    EXPECT(fdp_op_copy(dsts, srcs, 3, NULL), FDP_OK);
    CHECK(memcmp(c, ref_c, sizeof c) == 0);
    CHECK(memcmp(d, b, sizeof b) == 0);
    CHECK(memcmp(a, a_before, sizeof a) == 0);
  }

  /* Mismatches and bad descriptors. */
  {
    char buf[256] = {0}, out[256] = {0};
    int64_t s23[] = {2, 3}, s32[] = {3, 2}, s6[] = {6}, s231[] = {2, 3, 1};
    fdp_tensor_t src = make_contig(buf, FDP_DTYPE_F32, 4, 2, s23);
    fdp_tensor_t dst = make_contig(out, FDP_DTYPE_F32, 4, 2, s32);
    EXPECT(fdp_op_copy(&dst, &src, 1, NULL), FDP_INVALID);
    dst = make_contig(out, FDP_DTYPE_F32, 4, 1, s6);
    EXPECT(fdp_op_copy(&dst, &src, 1, NULL), FDP_INVALID);
    dst = make_contig(out, FDP_DTYPE_F32, 4, 3, s231);
    EXPECT(fdp_op_copy(&dst, &src, 1, NULL), FDP_INVALID);
    dst = make_contig(out, FDP_DTYPE_I16, 2, 2, s23);
    EXPECT(fdp_op_copy(&dst, &src, 1, NULL), FDP_INVALID);
    dst = make_contig(out, FDP_DTYPE_F64, 8, 2, s23);
    EXPECT(fdp_op_copy(&dst, &src, 1, NULL), FDP_INVALID);
    CHECKF(memcmp(out, (char[256]){0}, 256) == 0, "a rejected copy wrote its destination");
    dst = make_contig(out, FDP_DTYPE_F32, 4, 2, s23);
    EXPECT(fdp_op_copy(&dst, &src, 1, NULL), FDP_OK);
    EXPECT(fdp_op_copy(&dst, &src, 0, NULL), FDP_OK);
    EXPECT(fdp_op_copy(&dst, &src, -1, NULL), FDP_INVALID);
    EXPECT(fdp_op_copy(NULL, &src, 1, NULL), FDP_INVALID);
    fdp_tensor_t bad = src;
    bad.strides[1] = -1;
    EXPECT(fdp_op_copy(&dst, &bad, 1, NULL), FDP_INVALID);
    bad = src;
    bad.sizes[0] = -2;
    EXPECT(fdp_op_copy(&bad, &bad, 1, NULL), FDP_INVALID);
    bad = src;
    bad.elem_size = 0;
    EXPECT(fdp_op_copy(&bad, &bad, 1, NULL), FDP_INVALID);
    bad.elem_size = 17;
    EXPECT(fdp_op_copy(&bad, &bad, 1, NULL), FDP_INVALID);
    bad = src;
    bad.ndim = FDP_MAX_DIMS + 1;
    EXPECT(fdp_op_copy(&bad, &bad, 1, NULL), FDP_INVALID);
    bad = src;
    bad.data = NULL;
    EXPECT(fdp_op_copy(&dst, &bad, 1, NULL), FDP_INVALID);
    bad = src;
    bad.device = FDP_MAX_DEVICES;
    EXPECT(fdp_op_copy(&dst, &bad, 1, NULL), FDP_INVALID);
    bad.device = -2;
    EXPECT(fdp_op_copy(&dst, &bad, 1, NULL), FDP_INVALID);
    /* An empty tensor may have no data pointer. */
    int64_t s0[] = {0, 3};
    fdp_tensor_t e1 = make_contig(NULL, FDP_DTYPE_F32, 4, 2, s0), e2 = make_contig(NULL, FDP_DTYPE_F32, 4, 2, s0);
    EXPECT(fdp_op_copy(&e1, &e2, 1, NULL), FDP_OK);
  }
}

/* Large copies, split across the worker threads (FASTDP_HOST_PARALLEL_MIN=4096, FASTDP_HOST_THREADS=4). */
/* A prepared copy: checked once (overlapping destinations refused as fdp_op_copy refuses them), then run as often as
 * wanted, each run reading the sources as they are then. */
static void test_copy_plan(void) {
  enum { N = 5, K = 7 };
  float src[N][K], flat[N * K];
  fdp_tensor_t d[N], s[N];
  for (int i = 0; i < N; i++) {
    d[i] = make_flat(flat + i * K, FDP_DTYPE_F32, 4, K);
    s[i] = make_flat(src[i], FDP_DTYPE_F32, 4, K);
  }
  fdp_copy_plan_t *plan = NULL;
  CHECK(fdp_copy_prepare(d, s, N, &plan) == FDP_OK && plan != NULL);
  for (int run = 0; run < 3; run++) {
    for (int i = 0; i < N; i++)
      for (int j = 0; j < K; j++)
        src[i][j] = (float)(run * 100 + i * K + j);
    CHECK(fdp_copy_run(plan, NULL) == FDP_OK);
    int same = 1;
    for (int i = 0; i < N; i++)
      for (int j = 0; j < K; j++)
        same &= flat[i * K + j] == src[i][j];
    CHECKF(same, "run %d: the destinations do not hold the sources as they are now", run);
  }
  fdp_copy_plan_free(plan);
  fdp_copy_plan_free(NULL);
  d[3] = make_flat(flat + 2 * K + 1, FDP_DTYPE_F32, 4, K); /* overlaps destination 2 */
  plan = (fdp_copy_plan_t *)&plan;
  CHECK(fdp_copy_prepare(d, s, N, &plan) == FDP_OVERLAP && plan == NULL);
  CHECK(fdp_copy_prepare(d, s, -1, &plan) == FDP_INVALID);
  CHECK(fdp_copy_prepare(d, s, 0, &plan) == FDP_OK && fdp_copy_run(plan, NULL) == FDP_OK);
  fdp_copy_plan_free(plan);
  CHECK(fdp_copy_run(NULL, NULL) == FDP_INVALID);
}

static void test_copy_threaded(void) {
  char msg[1000];
  struct {
    int es, nd;
    int64_t sizes[6];
    int kind; /* 0 contiguous, 1 transpose, 2 random strided both sides, 3 inner-strided source */
  } cases[] = {
      {1, 1, {4 << 20}, 0},           {4, 2, {1024, 1024}, 1},   {16, 2, {700, 300}, 1},  {2, 2, {512, 2048}, 3},
      {8, 6, {8, 8, 8, 8, 8, 16}, 2}, {4, 3, {3, 1, 600000}, 3}, {1, 2, {1500, 1501}, 2},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    int nd = cases[i].nd;
    const int64_t *sz = cases[i].sizes;
    layout_t s = contig_layout(nd, sz), d = contig_layout(nd, sz);
    if (cases[i].kind == 1) {
      d.strides[0] = 1;
      d.strides[1] = sz[0];
    } else if (cases[i].kind == 2) {
      s = random_layout(nd, sz, 0, 1);
      d = random_layout(nd, sz, 0, 2);
    } else if (cases[i].kind == 3) {
      s.strides[nd - 1] = 2;
      for (int k = nd - 2; k >= 0; k--)
        s.strides[k] = s.strides[k + 1] * (sz[k + 1] > 1 ? sz[k + 1] : 1);
      s.span = 2 * numel_of(nd, sz);
      d = random_layout(nd, sz, 0, 1);
    }
    CHECKF(copy_case(cases[i].es, nd, sz, &d, &s, msg, sizeof msg), "threaded case %zu: %s", i, msg);
  }
}

/* ---- scratch blocks ---- */

static void *scratch_thread(void *arg) {
  size_t bytes = (size_t)(uintptr_t)arg;
  char *p = fdp_scratch_alloc(bytes);
  if (p) memset(p, 0x5a, bytes);
  fdp_scratch_free(p); /* kept by this thread, freed when it exits (ASan reports a leak otherwise) */
  return p;
}

static void test_scratch(void) {
  const size_t big = 200 * 1024, small = 1024;
  fdp_scratch_release();
  char *a = fdp_scratch_alloc(big);
  CHECK(a != NULL && (uintptr_t)a % _Alignof(max_align_t) == 0);
  memset(a, 1, big);
  fdp_scratch_free(a);
  char *b = fdp_scratch_alloc(big / 2); /* a kept block large enough is handed out again */
  CHECK(b == a);
  char *c = fdp_scratch_alloc(big); /* the kept one is taken: a new block */
  CHECK(c != NULL && c != b);
  fdp_scratch_free(b);
  fdp_scratch_free(c);
  char *d = fdp_scratch_alloc(big); /* the smallest block that fits: either, both have room for big */
  CHECK(d == a || d == c);
  fdp_scratch_free(d);
  char *blocks[6];
  for (int i = 0; i < 6; i++) { /* more blocks than are kept: the extra ones are freed, none lost (ASan) */
    blocks[i] = fdp_scratch_alloc(big * (size_t)(i + 1));
    CHECK(blocks[i] != NULL);
    if (blocks[i]) memset(blocks[i], i, big * (size_t)(i + 1));
  }
  for (int i = 0; i < 6; i++)
    fdp_scratch_free(blocks[i]);
  char *e = fdp_scratch_alloc(big * 6); /* the largest ones were kept */
  CHECK(e == blocks[5]);
  fdp_scratch_free(e);
  char *s1 = fdp_scratch_alloc(small);
  memset(s1, 2, small);
  fdp_scratch_free(s1); /* small blocks go back to malloc */
  fdp_scratch_free(NULL);
  CHECK(fdp_scratch_alloc(SIZE_MAX) == NULL);
  pthread_t th;
  void *ret = NULL;
  CHECK(pthread_create(&th, NULL, scratch_thread, (void *)(uintptr_t)big) == 0 && pthread_join(th, &ret) == 0);
  CHECK(ret != NULL);
  fdp_scratch_release();
}

/* ---- broadcast, scatter, gather ---- */

static void bcast_readonly_child(void) {
  /* The source is read-only; a destination that is the source itself must be skipped, never written (a write
   * would fault). glibc's memcpy(p, p, n) writes nothing either, so this shows no fault, not the skip itself. */
  size_t page = (size_t)sysconf(_SC_PAGESIZE), bytes = 2 * page;
  float *src = ro_alloc(bytes);
  if (!src) _exit(3);
  int64_t n = (int64_t)(bytes / 4);
  for (int64_t i = 0; i < n; i++)
    src[i] = (float)i;
  mprotect(src, bytes, PROT_READ);
  float *other = malloc(bytes);
  fdp_tensor_t s = make_flat(src, FDP_DTYPE_F32, 4, n);
  fdp_tensor_t dsts[3] = {s, make_flat(other, FDP_DTYPE_F32, 4, n), s};
  if (fdp_op_broadcast(&s, dsts, 3, NULL) != FDP_OK) _exit(4);
  if (memcmp(src, other, bytes) != 0) _exit(5);
  free(other);
  munmap(src, bytes);
  _exit(0);
}

static void test_broadcast(void) {
  for (int big = 0; big < 2; big++) {
    int64_t sz[] = {big ? 700 : 5, big ? 900 : 6};
    int es = 4;
    layout_t sl = random_layout(2, sz, 0, 2);
    char *sbuf = xmalloc((size_t)sl.span * es);
    fill_random(sbuf, (size_t)sl.span * es);
    fdp_tensor_t src = on(&sl, sbuf, es);
    enum { ND = 4 };
    layout_t dl[ND];
    char *dbuf[ND], *rbuf[ND];
    fdp_tensor_t dst[ND + 1];
    for (int i = 0; i < ND; i++) {
      dl[i] = i == 0 ? contig_layout(2, sz) : random_layout(2, sz, 0, 2);
      size_t bytes = (size_t)dl[i].span * es;
      dbuf[i] = xmalloc(bytes);
      rbuf[i] = xmalloc(bytes);
      fill_random(dbuf[i], bytes);
      memcpy(rbuf[i], dbuf[i], bytes);
      dst[i] = on(&dl[i], dbuf[i], es);
      fdp_tensor_t r = on(&dl[i], rbuf[i], es);
      ref_copy(&r, &src);
    }
    dst[ND] = src; /* the source's own entry */
    EXPECT(fdp_op_broadcast(&src, dst, ND + 1, NULL), FDP_OK);
    for (int i = 0; i < ND; i++) {
      CHECKF(memcmp(dbuf[i], rbuf[i], (size_t)dl[i].span * es) == 0, "broadcast %s, destination %d",
             big ? "large" : "small", i);
      free(dbuf[i]);
      free(rbuf[i]);
    }
    free(sbuf);
  }
  CHECKF(in_child(bcast_readonly_child), "a destination equal to the source was written (or the call failed)");
  {
    float a[6] = {0}, b[6] = {0};
    int64_t s6[] = {6}, s5[] = {5};
    fdp_tensor_t src = make_contig(a, FDP_DTYPE_F32, 4, 1, s6), dst = make_contig(b, FDP_DTYPE_F32, 4, 1, s5);
    EXPECT(fdp_op_broadcast(&src, &dst, 1, NULL), FDP_INVALID);
    EXPECT(fdp_op_broadcast(&src, &dst, 0, NULL), FDP_OK);
    EXPECT(fdp_op_broadcast(&src, &dst, -1, NULL), FDP_INVALID);
    EXPECT(fdp_op_broadcast(NULL, &dst, 1, NULL), FDP_INVALID);
    dst = make_contig(b, FDP_DTYPE_I16, 2, 1, s6);
    EXPECT(fdp_op_broadcast(&src, &dst, 1, NULL), FDP_INVALID);
  }
}

static void scatter_readonly_child(void) {
  /* Output 1 is the very view of the source's chunk 1 and the source is read-only: it must be skipped, never
   * written (as above, this shows that nothing faults). */
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  int64_t rows = 8, cols = (int64_t)(page / 8);
  size_t bytes = (size_t)(rows * cols) * 4;
  float *src = ro_alloc(bytes);
  if (!src) _exit(3);
  for (int64_t i = 0; i < rows * cols; i++)
    src[i] = (float)i;
  mprotect(src, bytes, PROT_READ);
  int64_t sz[] = {rows, cols}, chunks[] = {3, 2, 3};
  fdp_tensor_t s = make_contig(src, FDP_DTYPE_F32, 4, 2, sz), outs[3];
  float *o0 = malloc(bytes), *o2 = malloc(bytes);
  int64_t s0[] = {3, cols};
  outs[0] = make_contig(o0, FDP_DTYPE_F32, 4, 2, s0);
  fdp_tensor_narrow(&s, 0, 3, 2, &outs[1]);
  outs[2] = make_contig(o2, FDP_DTYPE_F32, 4, 2, s0);
  if (fdp_op_scatter(&s, 0, chunks, outs, 3, NULL) != FDP_OK) _exit(4);
  if (memcmp(o0, src, (size_t)(3 * cols) * 4) || memcmp(o2, src + 5 * cols, (size_t)(3 * cols) * 4)) _exit(5);
  free(o0);
  free(o2);
  munmap(src, bytes);
  _exit(0);
}

static void test_scatter(void) {
  char msg[1000];
  for (int iter = 0; iter < 120; iter++) {
    int nd = (int)rnd_in(1, 4), es = elem_sizes[rnd_in(0, 4)];
    if (iter >= 100) nd = (int)rnd_in(1, 2); /* a few large ones for the threads */
    int64_t sz[4];
    for (int i = 0; i < nd; i++)
      sz[i] = rnd_in(1, 5);
    int dim = (int)rnd_in(0, nd - 1), n = (int)rnd_in(1, 5);
    if (iter >= 100) sz[dim] = 40000 + rnd_in(0, 999);
    /* Random chunk sizes (zeros included) summing to sz[dim]. */
    int64_t chunks[5], left = sz[dim];
    for (int i = 0; i < n; i++) {
      chunks[i] = i == n - 1 ? left : (rnd() % 3 == 0 ? 0 : rnd_in(0, left));
      left -= chunks[i];
    }
    layout_t sl = random_layout(nd, sz, 1, 2);
    char *sbuf = xmalloc((size_t)sl.span * es);
    fill_random(sbuf, (size_t)sl.span * es);
    fdp_tensor_t src = on(&sl, sbuf, es), outs[5];
    layout_t ol[5];
    char *obuf[5], *rbuf[5];
    int64_t start = 0;
    for (int i = 0; i < n; i++) {
      int64_t csz[4];
      memcpy(csz, sz, sizeof csz);
      csz[dim] = chunks[i];
      ol[i] = random_layout(nd, csz, 0, 2);
      size_t bytes = (size_t)ol[i].span * es;
      obuf[i] = xmalloc(bytes);
      rbuf[i] = xmalloc(bytes);
      fill_random(obuf[i], bytes);
      memcpy(rbuf[i], obuf[i], bytes);
      outs[i] = on(&ol[i], obuf[i], es);
      fdp_tensor_t view = src, r = on(&ol[i], rbuf[i], es);
      view.data += start * src.strides[dim] * es; /* the chunk, narrowed by hand */
      view.sizes[dim] = chunks[i];
      ref_copy(&r, &view);
      start += chunks[i];
    }
    fdp_result_t r = fdp_op_scatter(&src, dim, chunks, outs, n, NULL);
    int ok = r == FDP_OK;
    for (int i = 0; i < n; i++)
      ok = ok && memcmp(obuf[i], rbuf[i], (size_t)ol[i].span * es) == 0;
    snprintf(msg, sizeof msg, "iter %d: nd %d dim %d n %d es %d: %s %s", iter, nd, dim, n, es, fdp_result_name(r),
             r ? fdp_last_error() : "");
    CHECKF(ok, "%s", msg);
    /* Wrong totals: one element short, one too many; a negative chunk; a bad dim. */
    int64_t bad[5];
    memcpy(bad, chunks, sizeof bad);
    bad[n - 1] += 1;
    EXPECT(fdp_op_scatter(&src, dim, bad, outs, n, NULL), FDP_INVALID);
    if (sz[dim] > 0) {
      memcpy(bad, chunks, sizeof bad);
      int k = 0;
      while (bad[k] == 0)
        k++;
      bad[k] -= 1;
      EXPECT(fdp_op_scatter(&src, dim, bad, outs, n, NULL), FDP_INVALID);
      /* the whole message, with the dimension where upstream puts it */
      char want[300];
      snprintf(want, sizeof want,
               "Total size for output tensors along scatter dim %d does not match the source tensor size at dim %d. "
               "Expected %lld, but got total size %lld.",
               dim, dim, (long long)sz[dim], (long long)(sz[dim] - 1));
      CHECKF(strcmp(fdp_last_error(), want) == 0, "got \"%s\", want \"%s\"", fdp_last_error(), want);
    }
    EXPECT(fdp_op_scatter(&src, nd, chunks, outs, n, NULL), FDP_INVALID);
    EXPECT(fdp_op_scatter(&src, -1, chunks, outs, n, NULL), FDP_INVALID);
    for (int i = 0; i < n; i++) {
      free(obuf[i]);
      free(rbuf[i]);
    }
    free(sbuf);
  }
  CHECKF(in_child(scatter_readonly_child), "an output that is the source's own chunk was written (or the call failed)");
  {
    float a[12] = {0}, o[12];
    int64_t s43[] = {4, 3}, s23[] = {2, 3}, s22[] = {2, 2}, neg[] = {-1, 5}, ok2[] = {2, 2};
    fdp_tensor_t src = make_contig(a, FDP_DTYPE_F32, 4, 2, s43);
    fdp_tensor_t outs[2] = {make_contig(o, FDP_DTYPE_F32, 4, 2, s23), make_contig(o + 6, FDP_DTYPE_F32, 4, 2, s22)};
    EXPECT(fdp_op_scatter(&src, 0, ok2, outs, 2, NULL), FDP_INVALID); /* output 1 has the wrong shape */
    EXPECT(fdp_op_scatter(&src, 0, neg, outs, 2, NULL), FDP_INVALID);
    EXPECT(fdp_op_scatter(&src, 0, ok2, outs, 0, NULL), FDP_INVALID);
    EXPECT(fdp_op_scatter(&src, 0, NULL, outs, 2, NULL), FDP_INVALID);
    fdp_tensor_t scalar = make(a, FDP_DTYPE_F32, 4, 0, NULL, NULL);
    EXPECT(fdp_op_scatter(&scalar, 0, ok2, outs, 2, NULL), FDP_INVALID);
  }
}

static void test_gather(void) {
  char msg[1000];
  for (int iter = 0; iter < 150; iter++) {
    int nd = iter >= 140 ? 1 + iter % 2 : (int)rnd_in(1, 4), es = elem_sizes[rnd_in(0, 4)];
    int dim = iter % nd, n = (int)rnd_in(1, 4);
    int64_t sz[4];
    for (int i = 0; i < nd; i++)
      sz[i] = rnd_in(1, 4);
    int64_t parts[4], total = 0;
    for (int i = 0; i < n; i++) {
      parts[i] = rnd() % 4 == 0 ? 0 : rnd_in(1, 4);
      if (iter >= 140) parts[i] = 30000 + rnd_in(0, 99); /* large ones for the threads */
      total += parts[i];
    }
    sz[dim] = total;
    layout_t ol = random_layout(nd, sz, 0, 2), il[4];
    char *obuf = xmalloc((size_t)ol.span * es), *rbuf = xmalloc((size_t)ol.span * es), *ibuf[4];
    fill_random(obuf, (size_t)ol.span * es);
    memcpy(rbuf, obuf, (size_t)ol.span * es);
    fdp_tensor_t out = on(&ol, obuf, es), ref = on(&ol, rbuf, es), ins[4];
    int64_t start = 0;
    for (int i = 0; i < n; i++) {
      int64_t isz[4];
      memcpy(isz, sz, sizeof isz);
      isz[dim] = parts[i];
      il[i] = random_layout(nd, isz, 1, 2);
      ibuf[i] = xmalloc((size_t)il[i].span * es);
      fill_random(ibuf[i], (size_t)il[i].span * es);
      ins[i] = on(&il[i], ibuf[i], es);
      fdp_tensor_t slice = ref;
      slice.data += start * ref.strides[dim] * es;
      slice.sizes[dim] = parts[i];
      ref_copy(&slice, &ins[i]);
      start += parts[i];
    }
    fdp_result_t r = fdp_op_gather(ins, n, dim, &out, NULL);
    snprintf(msg, sizeof msg, "iter %d: nd %d dim %d n %d es %d: %s %s", iter, nd, dim, n, es, fdp_result_name(r),
             r ? fdp_last_error() : "");
    CHECKF(r == FDP_OK && memcmp(obuf, rbuf, (size_t)ol.span * es) == 0, "%s", msg);
    /* The inputs must fill the output exactly along dim and match it elsewhere. */
    fdp_tensor_t short_out = out;
    short_out.sizes[dim] += 1;
    EXPECT(fdp_op_gather(ins, n, dim, &short_out, NULL), FDP_INVALID);
    if (total > 0) {
      short_out.sizes[dim] -= 2;
      EXPECT(fdp_op_gather(ins, n, dim, &short_out, NULL), FDP_INVALID);
    }
    EXPECT(fdp_op_gather(ins, n, nd, &out, NULL), FDP_INVALID);
    EXPECT(fdp_op_gather(ins, n, -1, &out, NULL), FDP_INVALID);
    if (nd > 1 && parts[0] > 0) {
      fdp_tensor_t wrong[4];
      memcpy(wrong, ins, sizeof wrong);
      int other = (dim + 1) % nd;
      wrong[0].sizes[other] = sz[other] > 1 ? sz[other] - 1 : 2;
      EXPECT(fdp_op_gather(wrong, n, dim, &out, NULL), FDP_INVALID);
      wrong[0] = ins[0];
      wrong[0].ndim = nd - 1;
      EXPECT(fdp_op_gather(wrong, n, dim < nd - 1 ? dim : 0, &out, NULL), FDP_INVALID);
    }
    for (int i = 0; i < n; i++)
      free(ibuf[i]);
    free(obuf);
    free(rbuf);
  }
  {
    float a[4];
    int64_t s4[] = {4};
    fdp_tensor_t out = make_contig(a, FDP_DTYPE_F32, 4, 1, s4);
    EXPECT(fdp_op_gather(NULL, 1, 0, &out, NULL), FDP_INVALID);
    EXPECT(fdp_op_gather(&out, 0, 0, &out, NULL), FDP_INVALID);
  }
}

/* ---- reductions ---- */

/* Independent half-precision references: exact values through double, rounding by rint (ties to even) on a
 * scaled value. A sum of two halves (or two bfloat16s) rounded once to double and then to the narrow type
 * equals the correctly rounded sum (double has more than 2p + 2 bits). */
static double ref_h2d(uint16_t h) {
  int sign = h >> 15, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  double v = exp == 0x1f ? (man ? NAN : INFINITY) : exp == 0 ? ldexp(man, -24) : ldexp(1024 + man, exp - 25);
  return sign ? -v : v;
}

static uint16_t ref_d2h(double v) {
  if (isnan(v)) return 0x7e00;
  uint16_t sign = signbit(v) ? 0x8000 : 0;
  double a = fabs(v);
  if (isinf(a)) return sign | 0x7c00;
  if (a == 0) return sign;
  int ex;
  frexp(a, &ex); /* a = m * 2^ex, m in [0.5, 1) */
  int q = ex - 11 < -24 ? -24 : ex - 11;
  double r = ldexp(rint(ldexp(a, -q)), q);
  if (r >= 65536.0) return sign | 0x7c00;
  if (r < 0x1p-14) return sign | (uint16_t)ldexp(r, 24);
  frexp(r, &ex);
  return sign | (uint16_t)((ex + 14) << 10) | (uint16_t)(ldexp(r, 11 - ex) - 1024);
}

static double ref_bf2d(uint16_t b) {
  int sign = b >> 15, exp = (b >> 7) & 0xff, man = b & 0x7f;
  double v = exp == 0xff ? (man ? NAN : INFINITY) : exp == 0 ? ldexp(man, -133) : ldexp(128 + man, exp - 134);
  return sign ? -v : v;
}

static uint16_t ref_d2bf(double v) {
  if (isnan(v)) return 0x7fc0;
  uint16_t sign = signbit(v) ? 0x8000 : 0;
  double a = fabs(v);
  if (isinf(a)) return sign | 0x7f80;
  if (a == 0) return sign;
  int ex;
  frexp(a, &ex);
  int q = ex - 8 < -133 ? -133 : ex - 8;
  double r = ldexp(rint(ldexp(a, -q)), q);
  if (r >= 0x1p128) return sign | 0x7f80;
  if (r < 0x1p-126) return sign | (uint16_t)ldexp(r, 133);
  frexp(r, &ex);
  return sign | (uint16_t)((ex + 126) << 7) | (uint16_t)(ldexp(r, 8 - ex) - 128);
}

static int h_isnan(uint16_t h) {
  return (h & 0x7c00) == 0x7c00 && (h & 0x3ff);
}
static int bf_isnan(uint16_t b) {
  return (b & 0x7f80) == 0x7f80 && (b & 0x7f);
}

static void test_half_reference(void) {
  /* The reference conversions against known IEEE bit patterns, both ways. */
  static const struct {
    double v;
    uint16_t h;
  } h[] = {{1.0, 0x3c00},       {-2.0, 0xc000},          {65504.0, 0x7bff},       {0x1p-24, 0x0001}, {0x1p-14, 0x0400},
           {0x3ffp-24, 0x03ff}, {0.5, 0x3800},           {0.0, 0x0000},           {-0.0, 0x8000},    {INFINITY, 0x7c00},
           {-INFINITY, 0xfc00}, {1.0 + 0x1p-10, 0x3c01}, {0.333251953125, 0x3555}};
  for (size_t i = 0; i < sizeof h / sizeof h[0]; i++) {
    CHECKF(ref_d2h(h[i].v) == h[i].h, "float16(%g) = 0x%04x, want 0x%04x", h[i].v, ref_d2h(h[i].v), h[i].h);
    double back = ref_h2d(h[i].h);
    CHECKF(back == h[i].v && signbit(back) == signbit(h[i].v), "0x%04x -> %g", h[i].h, back);
  }
  CHECK(h_isnan(ref_d2h(NAN)) && isnan(ref_h2d(0x7e00)) && isnan(ref_h2d(0xfc01)));
  CHECK(ref_d2h(65519.99) == 0x7bff && ref_d2h(65520.0) == 0x7c00);                /* the overflow threshold */
  CHECK(ref_d2h(0x1p-25) == 0x0000 && ref_d2h(0x1.0000001p-25) == 0x0001);         /* half the smallest subnormal */
  CHECK(ref_d2h(1.0 + 0x1p-11) == 0x3c00 && ref_d2h(1.0 + 3 * 0x1p-11) == 0x3c02); /* ties to even */
  static const struct {
    double v;
    uint16_t b;
  } bf[] = {{1.0, 0x3f80},      {-1.0, 0xbf80},       {0x1p-133, 0x0001}, {0x1p-126, 0x0080},
            {INFINITY, 0x7f80}, {0x1.fep127, 0x7f7f}, {3.0, 0x4040},      {1.0 + 0x1p-7, 0x3f81}};
  for (size_t i = 0; i < sizeof bf / sizeof bf[0]; i++) {
    CHECKF(ref_d2bf(bf[i].v) == bf[i].b, "bfloat16(%g) = 0x%04x, want 0x%04x", bf[i].v, ref_d2bf(bf[i].v), bf[i].b);
    CHECKF(ref_bf2d(bf[i].b) == bf[i].v, "0x%04x -> %g", bf[i].b, ref_bf2d(bf[i].b));
  }
  CHECK(bf_isnan(ref_d2bf(NAN)) && isnan(ref_bf2d(0x7fc0)));
  CHECK(ref_d2bf(1.0 + 0x1p-8) == 0x3f80 && ref_d2bf(1.0 + 3 * 0x1p-8) == 0x3f82);
  CHECK(ref_d2bf(0x1.ffp127) == 0x7f80); /* halfway to 2^128 rounds to even: inf */
  /* Every half and bfloat16 value survives the round trip. */
  int bad_h = 0, bad_bf = 0;
  for (uint32_t x = 0; x < 0x10000; x++) {
    if (!h_isnan((uint16_t)x)) bad_h += ref_d2h(ref_h2d((uint16_t)x)) != x;
    if (!bf_isnan((uint16_t)x)) bad_bf += ref_d2bf(ref_bf2d((uint16_t)x)) != x;
  }
  CHECKF(bad_h == 0 && bad_bf == 0, "%d half and %d bfloat16 values do not round-trip", bad_h, bad_bf);
}

typedef struct {
  int dtype, es;
} dt_t;

static const dt_t reduce_dtypes[] = {
#define X(name, str, size) {FDP_DTYPE_##name, size},
    FDP_DTYPE_MAP(X)
#undef X
};

/* Input values of each dtype: random bits for the integers, 0/1 for bool, a mix of random bit patterns and
 * values of close magnitude (so that sums round and cancel) for the floats. */
static void fill_inputs(int dtype, void *p, int64_t n) {
  switch (dtype) {
  case FDP_DTYPE_BOOL:
    for (int64_t i = 0; i < n; i++)
      ((uint8_t *)p)[i] = (uint8_t)(rnd() % 3 == 0);
    break;
  case FDP_DTYPE_F16:
    for (int64_t i = 0; i < n; i++)
      ((uint16_t *)p)[i] = rnd() & 1 ? (uint16_t)rnd() : ref_d2h(((double)(int64_t)(rnd() % 20001) - 10000) / 997.0);
    break;
  case FDP_DTYPE_BF16:
    for (int64_t i = 0; i < n; i++)
      ((uint16_t *)p)[i] = rnd() & 1 ? (uint16_t)rnd() : ref_d2bf(((double)(int64_t)(rnd() % 20001) - 10000) / 97.0);
    break;
  case FDP_DTYPE_F32:
    for (int64_t i = 0; i < n; i++) {
      float f;
      if (rnd() % 4 == 0) {
        uint32_t b = (uint32_t)rnd();
        memcpy(&f, &b, 4);
      } else {
        f = (float)(((double)(int64_t)(rnd() % 2000001) - 1000000) / 1234.567);
      }
      ((float *)p)[i] = f;
    }
    break;
  case FDP_DTYPE_F64:
    for (int64_t i = 0; i < n; i++) {
      double d;
      if (rnd() % 4 == 0) {
        uint64_t b = rnd();
        memcpy(&d, &b, 8);
      } else {
        d = ((double)(int64_t)(rnd() % 2000001) - 1000000) / 1234.567 * ldexp(1.0, (int)rnd_in(-30, 30));
      }
      ((double *)p)[i] = d;
    }
    break;
  default: fill_random(p, (size_t)n * (size_t)reduce_dtypes[dtype].es); break;
  }
}

/* The reference sum, element by element in input order. */
static void ref_sum(int dtype, void *const *in, int n, void *out, int64_t numel) {
  for (int64_t i = 0; i < numel; i++) {
    switch (dtype) {
#define INT_SUM(UT)                                                                                                    \
  {                                                                                                                    \
    UT acc = ((const UT *)in[0])[i];                                                                                   \
    for (int k = 1; k < n; k++)                                                                                        \
      acc = (UT)(acc + ((const UT *)in[k])[i]);                                                                        \
    ((UT *)out)[i] = acc;                                                                                              \
  }                                                                                                                    \
  break
    case FDP_DTYPE_U8:
    case FDP_DTYPE_I8: INT_SUM(uint8_t);
    case FDP_DTYPE_I16: INT_SUM(uint16_t);
    case FDP_DTYPE_I32: INT_SUM(uint32_t);
    case FDP_DTYPE_I64: INT_SUM(uint64_t);
#undef INT_SUM
    case FDP_DTYPE_BOOL: {
      int acc = 0;
      for (int k = 0; k < n; k++)
        acc = acc || ((const uint8_t *)in[k])[i];
      ((uint8_t *)out)[i] = (uint8_t)acc;
      break;
    }
    case FDP_DTYPE_F32: {
      float acc = ((const float *)in[0])[i];
      for (int k = 1; k < n; k++)
        acc = acc + ((const float *)in[k])[i];
      ((float *)out)[i] = acc;
      break;
    }
    case FDP_DTYPE_F64: {
      double acc = ((const double *)in[0])[i];
      for (int k = 1; k < n; k++)
        acc = acc + ((const double *)in[k])[i];
      ((double *)out)[i] = acc;
      break;
    }
    case FDP_DTYPE_F16: {
      uint16_t acc = ((const uint16_t *)in[0])[i];
      for (int k = 1; k < n; k++)
        acc = ref_d2h(ref_h2d(acc) + ref_h2d(((const uint16_t *)in[k])[i]));
      ((uint16_t *)out)[i] = acc;
      break;
    }
    case FDP_DTYPE_BF16: {
      uint16_t acc = ((const uint16_t *)in[0])[i];
      for (int k = 1; k < n; k++)
        acc = ref_d2bf(ref_bf2d(acc) + ref_bf2d(((const uint16_t *)in[k])[i]));
      ((uint16_t *)out)[i] = acc;
      break;
    }
    default: break;
    }
  }
}

/* Bit-exact, except that any NaN matches any NaN. Returns the first mismatching index or -1. */
static int64_t sum_mismatch(int dtype, const void *got, const void *want, int64_t numel) {
  for (int64_t i = 0; i < numel; i++) {
    switch (dtype) {
    case FDP_DTYPE_F16: {
      uint16_t a = ((const uint16_t *)got)[i], b = ((const uint16_t *)want)[i];
      if (h_isnan(b) ? !h_isnan(a) : a != b) return i;
      break;
    }
    case FDP_DTYPE_BF16: {
      uint16_t a = ((const uint16_t *)got)[i], b = ((const uint16_t *)want)[i];
      if (bf_isnan(b) ? !bf_isnan(a) : a != b) return i;
      break;
    }
    case FDP_DTYPE_F32: {
      float a = ((const float *)got)[i], b = ((const float *)want)[i];
      if (isnan(b) ? !isnan(a) : memcmp(&a, &b, 4) != 0) return i;
      break;
    }
    case FDP_DTYPE_F64: {
      double a = ((const double *)got)[i], b = ((const double *)want)[i];
      if (isnan(b) ? !isnan(a) : memcmp(&a, &b, 8) != 0) return i;
      break;
    }
    default: {
      int es = reduce_dtypes[dtype].es;
      if (memcmp((const char *)got + i * es, (const char *)want + i * es, (size_t)es) != 0) return i;
    }
    }
  }
  return -1;
}

/* One reduction of n random inputs of numel elements; in_place sums into inputs[0]. */
static void reduce_case(int dtype, int n, int64_t numel, int in_place) {
  int es = reduce_dtypes[dtype].es;
  size_t bytes = (size_t)numel * (size_t)es;
  void *in[5], *ref = xmalloc(bytes), *out = xmalloc(bytes);
  fdp_tensor_t ts[5];
  int64_t sz[2] = {numel > 7 ? 7 : 1, numel > 7 ? numel / 7 : numel};
  int nd = numel > 7 && numel % 7 == 0 ? 2 : 1;
  if (nd == 1) sz[0] = numel;
  for (int k = 0; k < n; k++) {
    in[k] = xmalloc(bytes);
    fill_inputs(dtype, in[k], numel);
    ts[k] = make_contig(in[k], dtype, es, nd, sz);
  }
  ref_sum(dtype, in, n, ref, numel);
  fill_random(out, bytes);
  fdp_tensor_t o = make_contig(in_place ? in[0] : out, dtype, es, nd, sz);
  fdp_result_t r = fdp_op_reduce(ts, n, &o, NULL);
  int64_t at = r == FDP_OK ? sum_mismatch(dtype, o.data, ref, numel) : -2;
  char extra[160] = "";
  if (at >= 0) {
    uint64_t g = 0, w = 0;
    memcpy(&g, o.data + at * es, (size_t)(es > 8 ? 8 : es));
    memcpy(&w, (char *)ref + at * es, (size_t)(es > 8 ? 8 : es));
    snprintf(extra, sizeof extra, "element %lld: got 0x%llx, want 0x%llx", (long long)at, (unsigned long long)g,
             (unsigned long long)w);
  }
  CHECKF(at == -1, "reduce %s, n %d, numel %lld%s: %s %s %s", fdp_dtype_name(dtype), n, (long long)numel,
         in_place ? " (in place)" : "", fdp_result_name(r), r ? fdp_last_error() : "", extra);
  for (int k = 0; k < n; k++)
    free(in[k]);
  free(ref);
  free(out);
}

/* Sums of chosen values through the backend, against the reference (rounding at the edges of each type). The
 * values repeat over 70 elements, so that each is summed both by the vector loops (blocks of 32) and in the tail. */
#define EDGE_NUMEL 70
static void reduce_values(int dtype, const uint16_t *va, const uint16_t *vb, const uint16_t *vc, int64_t nvalues) {
  uint16_t a[EDGE_NUMEL], b[EDGE_NUMEL], c[EDGE_NUMEL], out[EDGE_NUMEL], ref[EDGE_NUMEL];
  const int64_t numel = EDGE_NUMEL;
  for (int64_t i = 0; i < numel; i++) {
    a[i] = va[i % nvalues];
    b[i] = vb[i % nvalues];
    c[i] = vc[i % nvalues];
  }
  void *in[3] = {a, b, c};
  fdp_tensor_t ts[3] = {make_flat(a, dtype, 2, numel), make_flat(b, dtype, 2, numel), make_flat(c, dtype, 2, numel)};
  fdp_tensor_t o = make_flat(out, dtype, 2, numel);
  for (int n = 1; n <= 3; n++) {
    ref_sum(dtype, in, n, ref, numel);
    fdp_result_t r = fdp_op_reduce(ts, n, &o, NULL);
    int64_t at = r == FDP_OK ? sum_mismatch(dtype, out, ref, numel) : -2;
    CHECKF(at == -1, "%s edge values, n %d: %s, element %lld: 0x%04x+0x%04x+0x%04x = 0x%04x, want 0x%04x",
           fdp_dtype_name(dtype), n, fdp_result_name(r), (long long)at, at >= 0 ? a[at] : 0, at >= 0 ? b[at] : 0,
           at >= 0 ? c[at] : 0, at >= 0 ? out[at] : 0, at >= 0 ? ref[at] : 0);
  }
}
#undef EDGE_NUMEL

static void test_reduce(void) {
  static const int64_t numels[] = {1, 2, 7, 1000, 5003};
  for (int d = 0; d < FDP_DTYPE_COUNT; d++) {
    if (reduce_dtypes[d].dtype == FDP_DTYPE_OTHER) continue;
    for (int n = 1; n <= 5; n++)
      for (size_t s = 0; s < sizeof numels / sizeof numels[0]; s++)
        reduce_case(d, n, numels[s], 0);
    reduce_case(d, 3, 4096, 1);
    reduce_case(d, 1, 100, 1);
  }
  /* float16 and bfloat16 at their edges: overflow to inf, ties, subnormals, signed zeros, inf - inf, NaN. */
  {
    static const uint16_t a[] = {0x3c00, 0x7bff, 0x7bff, 0x0001, 0x0001, 0x7c00, 0x7c00,
                                 0x7e00, 0x8000, 0x3c00, 0x03ff, 0xfbff, 0x3c00, 0x0000};
    static const uint16_t b[] = {0x3c00, 0x4c00, 0x4800, 0x0001, 0x8001, 0x3c00, 0xfc00,
                                 0x3c00, 0x8000, 0x1400, 0x0001, 0xcc00, 0x1000, 0x8000};
    static const uint16_t c[] = {0x3c00, 0x0000, 0x0000, 0x03fe, 0x0000, 0x0000, 0x0000,
                                 0x0000, 0x8000, 0x1400, 0x0000, 0x0000, 0x1000, 0x8000};
    reduce_values(FDP_DTYPE_F16, a, b, c, (int64_t)(sizeof a / sizeof a[0]));
    /* A few sums typed out, as a check on the reference itself. */
    uint16_t r1 = ref_d2h(ref_h2d(0x3c00) + ref_h2d(0x3c00)), r2 = ref_d2h(ref_h2d(0x7bff) + ref_h2d(0x4c00)),
             r3 = ref_d2h(ref_h2d(0x7bff) + ref_h2d(0x4800)), r4 = ref_d2h(ref_h2d(0x0001) + ref_h2d(0x8001));
    CHECK(r1 == 0x4000 && r2 == 0x7c00 && r3 == 0x7bff && r4 == 0x0000);
    static const uint16_t ba[] = {0x3f80, 0x7f7f, 0x0001, 0x7f80, 0x7fc0, 0x3f80, 0x8000, 0x4040};
    static const uint16_t bb[] = {0x3f80, 0x7f7f, 0x8001, 0xff80, 0x3f80, 0x3b80, 0x8000, 0xc040};
    static const uint16_t bc[] = {0x3f80, 0x0000, 0x0001, 0x0000, 0x0000, 0x3b80, 0x8000, 0x8000};
    reduce_values(FDP_DTYPE_BF16, ba, bb, bc, (int64_t)(sizeof ba / sizeof ba[0]));
  }
  /* Bad calls. */
  {
    float a[12] = {0}, b[12] = {0}, c[24] = {0};
    int64_t s34[] = {3, 4}, s43[] = {4, 3}, s12[] = {12}, s35[] = {3, 5};
    fdp_tensor_t ins[3] = {make_contig(a, FDP_DTYPE_F32, 4, 2, s34), make_contig(b, FDP_DTYPE_F32, 4, 2, s34),
                           make_contig(c, FDP_DTYPE_F32, 4, 2, s34)};
    fdp_tensor_t out = make_contig(c + 12, FDP_DTYPE_F32, 4, 2, s34);
    EXPECT(fdp_op_reduce(ins, 3, &out, NULL), FDP_OK);
    EXPECT(fdp_op_reduce(ins, 0, &out, NULL), FDP_INVALID);
    EXPECT(fdp_op_reduce(NULL, 2, &out, NULL), FDP_INVALID);
    EXPECT(fdp_op_reduce(ins, 2, NULL, NULL), FDP_INVALID);
    /* Output aliasing a non-first input. */
    EXPECT(fdp_op_reduce(ins, 3, &ins[1], NULL), FDP_INVALID);
    EXPECT(fdp_op_reduce(ins, 3, &ins[2], NULL), FDP_INVALID);
    /* Non-contiguous input or output. */
    int64_t tst[] = {1, 3};
    fdp_tensor_t t = make(c, FDP_DTYPE_F32, 4, 2, s34, tst);
    fdp_tensor_t tmp[2] = {ins[0], t};
    EXPECT(fdp_op_reduce(tmp, 2, &out, NULL), FDP_INVALID);
    EXPECT(fdp_op_reduce(ins, 2, &t, NULL), FDP_INVALID);
    int64_t gst[] = {8, 2};
    fdp_tensor_t g = make(c, FDP_DTYPE_F32, 4, 2, s34, gst);
    tmp[1] = g;
    EXPECT(fdp_op_reduce(tmp, 2, &out, NULL), FDP_INVALID);
    /* Mismatched dtype, element size, element count, shape. */
    tmp[1] = ins[1];
    tmp[1].dtype = FDP_DTYPE_I32;
    EXPECT(fdp_op_reduce(tmp, 2, &out, NULL), FDP_INVALID);
    tmp[1] = ins[1];
    tmp[1].elem_size = 2;
    EXPECT(fdp_op_reduce(tmp, 2, &out, NULL), FDP_INVALID);
    tmp[1] = make_contig(b, FDP_DTYPE_F32, 4, 2, s35);
    float big[15];
    tmp[1].data = (char *)big;
    EXPECT(fdp_op_reduce(tmp, 2, &out, NULL), FDP_INVALID);
    /* Same element count, other shape: "of one shape" (upstream: "input 1 has invalid size"). */
    tmp[1] = make_contig(b, FDP_DTYPE_F32, 4, 2, s43);
    EXPECT(fdp_op_reduce(tmp, 2, &out, NULL), FDP_INVALID);
    tmp[1] = make_contig(b, FDP_DTYPE_F32, 4, 1, s12);
    EXPECT(fdp_op_reduce(tmp, 2, &out, NULL), FDP_INVALID);
    /* OTHER (and out-of-range) dtypes are not summed. */
    fdp_tensor_t o_in[2] = {ins[0], ins[1]}, o_out = out;
    o_in[0].dtype = o_in[1].dtype = o_out.dtype = FDP_DTYPE_OTHER;
    EXPECT(fdp_op_reduce(o_in, 2, &o_out, NULL), FDP_DTYPE);
    o_in[0].dtype = o_in[1].dtype = o_out.dtype = FDP_DTYPE_COUNT;
    EXPECT(fdp_op_reduce(o_in, 2, &o_out, NULL), FDP_DTYPE);
    o_in[0].dtype = o_in[1].dtype = o_out.dtype = -1;
    EXPECT(fdp_op_reduce(o_in, 2, &o_out, NULL), FDP_DTYPE);
    /* An empty sum succeeds and touches nothing. */
    int64_t s0[] = {0, 4};
    fdp_tensor_t e[2] = {make_contig(NULL, FDP_DTYPE_F32, 4, 2, s0), make_contig(NULL, FDP_DTYPE_F32, 4, 2, s0)};
    EXPECT(fdp_op_reduce(e, 2, &e[0], NULL), FDP_OK);
  }
}

/* Large sums, split across the worker threads; in place too. */
/* fdp_op_reduce_rows against sums written out here: 3 replicas of 2 members (a 2 x 3 matrix and a 4-vector), each
 * member's sum at its offset in one flat output; then every layout it must refuse, with nothing written. */
static void test_reduce_rows(void) {
  enum { K = 2, R = 3, M0 = 6, M1 = 4 };
  double g[R][M0 + M1], out[M0 + M1 + 2];
  fdp_tensor_t in[R * K];
  static const int64_t mat[] = {2, 3};
  for (int q = 0; q < R; q++) {
    for (int e = 0; e < M0 + M1; e++)
      g[q][e] = (q + 1) * 0.5 + e * 0.25;
    in[q * K] = make_contig(g[q], FDP_DTYPE_F64, 8, 2, mat);
    in[q * K + 1] = make_flat(g[q] + M0, FDP_DTYPE_F64, 8, M1);
  }
  for (int e = 0; e < M0 + M1 + 2; e++)
    out[e] = -1.0;
  fdp_tensor_t o = make_flat(out, FDP_DTYPE_F64, 8, M0 + M1 + 2);
  CHECK(fdp_reduce_rows_fit(in, K, R, &o));
  EXPECT(fdp_op_reduce_rows(in, K, R, &o), FDP_OK);
  for (int e = 0; e < M0 + M1; e++)
    CHECKF(out[e] == (g[0][e] + g[1][e]) + g[2][e], "element %d: %g", e, out[e]);
  CHECK(out[M0 + M1] == -1.0 && out[M0 + M1 + 1] == -1.0);
  /* Refused: a member shaped unlike replica 0's, another dtype, a strided member, an output too short, a 2-D
   * output, nonsense counts. */
  fdp_tensor_t bad[R * K];
  for (int variant = 0; variant < 6; variant++) {
    memcpy(bad, in, sizeof bad);
    fdp_tensor_t ob = o;
    int k = K, r = R;
    if (variant == 0) bad[K + 1] = make_flat(g[1] + M0, FDP_DTYPE_F64, 8, M1 - 1);
    if (variant == 1) bad[1].dtype = FDP_DTYPE_F32, bad[1].elem_size = 4;
    if (variant == 2) bad[2 * K].strides[0] = 1, bad[2 * K].strides[1] = 2;
    if (variant == 3) ob = make_flat(out, FDP_DTYPE_F64, 8, M0 + M1 - 1);
    if (variant == 4) ob = make_contig(out, FDP_DTYPE_F64, 8, 2, mat);
    if (variant == 5) k = 0, r = FDP_MAX_DEVICES + 1;
    for (int e = 0; e < M0 + M1 + 2; e++)
      out[e] = -1.0;
    CHECKF(!fdp_reduce_rows_fit(bad, k, r, &ob), "variant %d fits", variant);
    EXPECT(fdp_op_reduce_rows(bad, k, r, &ob), FDP_INVALID);
    CHECKF(out[0] == -1.0, "variant %d wrote the output", variant);
  }
}

static void test_reduce_threaded(void) {
  for (int d = 0; d < FDP_DTYPE_COUNT; d++) {
    if (reduce_dtypes[d].dtype == FDP_DTYPE_OTHER) continue;
    int64_t numel = ((int64_t)3 << 20) / reduce_dtypes[d].es + 5; /* about 3 MB per buffer */
    reduce_case(d, 3, numel, 0);
    reduce_case(d, 4, numel + 2048, 1);
  }
  reduce_case(FDP_DTYPE_F32, 5, (int64_t)(1 << 20) + 1, 0);
  reduce_case(FDP_DTYPE_F16, 2, (int64_t)(2 << 20) + 3, 1);
}

/* ---- device kinds: CUDA descriptors without CUDA ---- */

static void test_devices(void) {
  float a[12] = {0}, b[12] = {0}, c[12] = {0};
  int64_t s12[] = {12};
  fdp_tensor_t h[3] = {make_contig(a, FDP_DTYPE_F32, 4, 1, s12), make_contig(b, FDP_DTYPE_F32, 4, 1, s12),
                       make_contig(c, FDP_DTYPE_F32, 4, 1, s12)};
  fdp_tensor_t g[3];
  for (int i = 0; i < 3; i++) {
    g[i] = h[i]; /* real host memory behind CUDA-labelled descriptors: a wrong copy cannot crash, only show */
    g[i].device = i == 2 ? 1 : 0;
  }
  /* A sum over host and CUDA descriptors: FDP_INVALID. */
  fdp_tensor_t mix[2] = {h[0], g[1]};
  EXPECT(fdp_op_reduce(mix, 2, &h[2], NULL), FDP_INVALID);
  EXPECT(fdp_op_reduce(h, 2, &g[2], NULL), FDP_INVALID);
  /* Any copy touching CUDA, no CUDA compiled: FDP_UNAVAILABLE, never a crash. Copies may cross between host
   * and CUDA memory, so a host-to-CUDA copy is unavailable here rather than invalid. */
  a[0] = 1.0f;
  EXPECT(fdp_op_copy(&g[0], &h[1], 1, NULL), FDP_UNAVAILABLE);
  EXPECT(fdp_op_copy(&h[0], &g[1], 1, NULL), FDP_UNAVAILABLE);
  EXPECT(fdp_op_broadcast(&h[0], &g[1], 1, NULL), FDP_UNAVAILABLE);
  EXPECT(fdp_op_copy(&g[1], &g[0], 1, NULL), FDP_UNAVAILABLE);
  CHECKF(b[0] == 0.0f, "a CUDA copy without CUDA wrote memory");
  EXPECT(fdp_op_broadcast(&g[0], &g[1], 2, NULL), FDP_UNAVAILABLE);
  fdp_tensor_t same_dev[2] = {g[0], g[1]};
  EXPECT(fdp_op_reduce(same_dev, 2, &g[0], NULL), FDP_UNAVAILABLE);
  fdp_tensor_t multi[2] = {g[0], g[2]};
  EXPECT(fdp_op_reduce(multi, 2, &g[1], NULL), FDP_UNAVAILABLE);
  int64_t chunks[] = {6, 6}, s6[] = {6};
  fdp_tensor_t halves[2] = {make_contig(b, FDP_DTYPE_F32, 4, 1, s6), make_contig(c, FDP_DTYPE_F32, 4, 1, s6)};
  halves[0].device = 0;
  halves[1].device = 1;
  EXPECT(fdp_op_scatter(&g[0], 0, chunks, halves, 2, NULL), FDP_UNAVAILABLE);
  EXPECT(fdp_op_gather(halves, 2, 0, &g[0], NULL), FDP_UNAVAILABLE);
  EXPECT(fdp_op_scatter(&h[0], 0, chunks, halves, 2, NULL), FDP_UNAVAILABLE);
  EXPECT(fdp_op_gather(halves, 2, 0, &h[0], NULL), FDP_UNAVAILABLE);
  CHECKF(a[1] == 0.0f && b[0] == 0.0f && c[0] == 0.0f, "a refused call wrote memory");
  /* The process stays usable. */
  EXPECT(fdp_op_copy(&h[1], &h[0], 1, NULL), FDP_OK);
  CHECK(b[0] == 1.0f);
  fdp_shutdown();
  EXPECT(fdp_op_copy(&h[2], &h[0], 1, NULL), FDP_OK);
  CHECK(c[0] == 1.0f);

  /* Machine facts read as absent without a CUDA driver. */
  fdp_library_facts_t lib = {.version = 7, .library = "junk", .devices = 7};
  fdp_library_facts(FDP_BACKEND_CUDA, &lib);
  CHECK(lib.version == 0 && lib.library != NULL && lib.library[0] == 0 && lib.devices == 0);
  lib.version = 7;
  fdp_library_facts(FDP_BACKEND_NCCL, &lib);
  CHECK(lib.version == 0 && lib.library != NULL && lib.library[0] == 0 && lib.devices == 0);
  fdp_library_facts(FDP_BACKEND_HOST, &lib);
  CHECK(lib.version == 0 && lib.library[0] == 0 && lib.devices == 0);
  CHECK(fdp_device_can_access_peer(0, 1) == 0);
  fdp_device_facts_t dev;
  memset(&dev, 0x5a, sizeof dev);
  EXPECT(fdp_device_facts(0, FDP_FREE_ALWAYS, &dev), FDP_UNAVAILABLE);
  CHECK(dev.name[0] == 0 && dev.total_bytes == 0 && dev.free_read == 0 && dev.kernels_source[0] == 0);
  EXPECT(fdp_device_facts(0, (fdp_free_read_t)3, &dev), FDP_INVALID);
}

/* ---- libtorch's C shim: this program loads no libtorch ---- */

static void test_torch_shim(void) {
  const char *names[2] = {"aoti_torch_get_data_ptr", NULL};
  void *syms[2] = {&syms, &syms};
  EXPECT(fdp_torch_shim_resolve(NULL, names, 2, syms), FDP_UNAVAILABLE);
  CHECK(syms[0] == NULL && syms[1] == NULL);
  CHECKF(strstr(fdp_last_error(), "libtorch_cpu.so is not loaded"), "%s", fdp_last_error());
  syms[0] = &syms;
  EXPECT(fdp_torch_shim_resolve("/nowhere/torch/_C.so", names, 1, syms), FDP_UNAVAILABLE);
  CHECK(syms[0] == NULL);
  EXPECT(fdp_torch_shim_resolve(NULL, NULL, 1, syms), FDP_INVALID);
  EXPECT(fdp_torch_shim_resolve(NULL, names, 1, NULL), FDP_INVALID);
  EXPECT(fdp_torch_shim_resolve(NULL, names, -1, syms), FDP_INVALID);
}

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
    {"reduce_rows", test_reduce_rows},
    {"devices", test_devices},
    {"torch_shim", test_torch_shim},
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
