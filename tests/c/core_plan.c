/* SPDX-License-Identifier: MIT */
/* test_core's suite on bucket plans (fdp_plan_build) against a naive reference of the bucketing rule. */
#include "core_harness.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

void test_plan(void) {
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
