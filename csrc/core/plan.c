/* SPDX-License-Identifier: MIT */
/* Bucket plans for the coalesced operations: tensors grouped by type, in order, into flat buffers of about
 * bucket_bytes each, with the upstream rule that a bucket closes once it reaches the limit. */
#include "backend.h"

#include <stdlib.h>

typedef struct {
  int key, elem_size, dtype;
  int bucket; /* open bucket of this group, -1 when none */
} group_t;

/* Pass 1 for tensor t: its group (type key, dtype and element size), that group's open bucket (opened here when
 * none is), and the bucket's size so far; the bucket closes once it holds bucket_bytes. Returns the bucket. */
static int assign_bucket(fdp_plan_t *plan, group_t *groups, int *ngroups, size_t *bytes, const fdp_tensor_t *t,
                         int key, size_t bucket_bytes) {
  int g = 0;
  while (g < *ngroups && !(groups[g].key == key && groups[g].dtype == t->dtype && groups[g].elem_size == t->elem_size))
    g++;
  if (g == *ngroups) groups[(*ngroups)++] = (group_t){key, t->elem_size, t->dtype, -1};
  if (groups[g].bucket < 0) {
    int b = plan->nbuckets++;
    plan->buckets[b] = (fdp_bucket_t){t->dtype, t->elem_size, 0, 0, 0};
    groups[g].bucket = b;
  }
  int b = groups[g].bucket;
  plan->buckets[b].numel += fdp_tensor_numel(t);
  plan->buckets[b].count++;
  bytes[b] += (size_t)fdp_tensor_numel(t) * (size_t)t->elem_size;
  if (bytes[b] >= bucket_bytes) groups[g].bucket = -1;
  return b;
}

/* Pass 2: lays members out bucket by bucket, tensors in input order within a bucket. */
static void lay_out(fdp_plan_t *plan, const fdp_tensor_t *tensors, const int *order, int n) {
  int next = 0;
  for (int b = 0; b < plan->nbuckets; b++) {
    plan->buckets[b].first = next;
    next += plan->buckets[b].count;
    plan->buckets[b].count = 0;
    plan->buckets[b].numel = 0;
  }
  for (int i = 0; i < n; i++) {
    fdp_bucket_t *bk = &plan->buckets[order[i]];
    int64_t numel = fdp_tensor_numel(&tensors[i]);
    plan->members[bk->first + bk->count++] = (fdp_member_t){i, bk->numel, numel};
    bk->numel += numel;
  }
  plan->nmembers = n;
}

fdp_result_t fdp_plan_build(const fdp_tensor_t *tensors, const int *type_key, int n, size_t bucket_bytes,
                            fdp_plan_t **out) {
  fdp_plan_t *plan = NULL;
  group_t *groups = NULL;
  int *order = NULL; /* bucket index of each tensor */
  int ngroups = 0;
  *out = NULL;
  if (n < 0 || (n > 0 && !tensors)) return fdp__fail(FDP_INVALID, "plan: bad tensor list (n=%d)", n);
  if (bucket_bytes == 0) return fdp__fail(FDP_INVALID, "buffer_size must be positive, got 0");

  plan = calloc(1, sizeof *plan);
  if (!plan) goto nomem;
  groups = calloc((size_t)n + 1, sizeof *groups);
  order = calloc((size_t)n + 1, sizeof *order);
  plan->buckets = calloc((size_t)n + 1, sizeof *plan->buckets);
  plan->members = calloc((size_t)n + 1, sizeof *plan->members);
  if (!plan || !groups || !order || !plan->buckets || !plan->members) goto nomem;

  /* Pass 1: assign each tensor to a bucket and size the buckets. */
  size_t *bytes = calloc((size_t)n + 1, sizeof *bytes);
  if (!bytes) goto nomem;
  for (int i = 0; i < n; i++)
    order[i] = assign_bucket(plan, groups, &ngroups, bytes, &tensors[i], type_key ? type_key[i] : tensors[i].dtype,
                             bucket_bytes);
  free(bytes);
  lay_out(plan, tensors, order, n);
  free(groups);
  free(order);
  *out = plan;
  return FDP_OK;

nomem:
  free(groups);
  free(order);
  fdp_plan_free(plan);
  return fdp__fail(FDP_NOMEM, "plan: cannot allocate a plan for %d tensors", n);
}

void fdp_plan_free(fdp_plan_t *plan) {
  if (!plan) return;
  free(plan->buckets);
  free(plan->members);
  free(plan);
}
