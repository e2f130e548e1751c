/* SPDX-License-Identifier: MIT */
/* The kept replicas' per-step refresh (fastdp/_replicas.py): each replica module's __dict__ refilled from its
 * master's, the entries it owns kept, hook dicts mirrored, version counters summed, values rebound. Pure Python
 * objects, no core call. */
#include "binding.h"

#include <string.h>

/* Refills the replica's own hook dict `rd` with the master's `md` entries. Two empty dicts, the common case, cost
 * two size reads; otherwise clear() and update() are called as methods: hook dicts are OrderedDicts, whose order
 * the PyDict_* calls would not maintain. */
static int mirror_dict(PyObject *md, PyObject *rd) {
  if (!md || !rd || md == rd || !PyDict_Check(md) || !PyDict_Check(rd)) return 0;
  if (PyDict_GET_SIZE(md) == 0 && PyDict_GET_SIZE(rd) == 0) return 0;
  PyObject *r = PyObject_CallMethod(rd, "clear", NULL);
  if (!r) return -1;
  Py_DECREF(r);
  r = PyObject_CallMethod(rd, "update", "O", md);
  if (!r) return -1;
  Py_DECREF(r);
  return 0;
}

/* The replica's values of the owned keys (new references, NULL where absent); -1 with nothing held on failure. */
static int save_owned(PyObject *replica, PyObject *owned, Py_ssize_t nowned, PyObject **saved) {
  for (Py_ssize_t k = 0; k < nowned; k++) {
    saved[k] = PyDict_GetItemWithError(replica, PySequence_Fast_GET_ITEM(owned, k));
    if (!saved[k] && PyErr_Occurred()) {
      for (Py_ssize_t q = 0; q < k; q++)
        Py_XDECREF(saved[q]);
      return -1;
    }
    Py_XINCREF(saved[k]);
  }
  return 0;
}

/* Puts owned key k's saved value back into the replica (after refilling it from the master's when mirrored);
 * skipped once `bad` is set. Returns the new `bad`. */
static int restore_owned(PyObject *master, PyObject *replica, PyObject *key, PyObject *saved, int mirrored, int bad) {
  if (!saved || bad) return bad;
  if (mirrored) {
    PyObject *md = PyDict_GetItemWithError(master, key); /* borrowed; the master dict holds it */
    if ((!md && PyErr_Occurred()) || mirror_dict(md, saved) < 0) return 1;
  }
  return PyDict_SetItem(replica, key, saved) < 0;
}

#define OWNED_CACHE 64

/* The owned keys of one refresh() call and their hashes, so that telling whether a dict key is owned costs integer
 * compares (an equal key has an equal hash; only a hash match is compared, by identity, then by ==); and a
 * direct-mapped cache of the answers by key object: every module's __dict__ holds the same interned attribute
 * names, so after the first module each key is one pointer compare. The cache holds references to its keys,
 * released by owned_keys_clear, so that no freed key's address can be taken for another key. */
typedef struct {
  PyObject *owned; /* the PySequence_Fast of keys */
  Py_ssize_t n, nmirrored;
  Py_hash_t hash[32];
  PyObject *cache_key[OWNED_CACHE];
  int cache_index[OWNED_CACHE];
} owned_keys_t;

static void owned_keys_clear(owned_keys_t *ok) {
  for (int i = 0; i < OWNED_CACHE; i++)
    Py_CLEAR(ok->cache_key[i]);
}

/* The index of `key` among the owned keys, -1 when not owned, -2 on error. */
static int owned_index(owned_keys_t *ok, PyObject *key) {
  size_t slot = ((uintptr_t)key >> 4) % OWNED_CACHE;
  if (ok->cache_key[slot] == key) return ok->cache_index[slot];
  Py_hash_t h = PyObject_Hash(key); /* a str caches its hash: no hashing after the first time */
  if (h == -1) return -2;
  int index = -1;
  for (Py_ssize_t k = 0; k < ok->n && index == -1; k++) {
    if (ok->hash[k] != h) continue;
    PyObject *o = PySequence_Fast_GET_ITEM(ok->owned, k);
    int eq = o == key ? 1 : PyObject_RichCompareBool(o, key, Py_EQ);
    if (eq < 0) return -2;
    if (eq) index = (int)k;
  }
  Py_XSETREF(ok->cache_key[slot], Py_NewRef(key));
  ok->cache_index[slot] = index;
  return index;
}

#define REFRESH_MAX_CHANGED 16

/* What refresh_in_place changes, collected (new references) before anything is changed: no dict changes while
 * one is walked. */
typedef struct {
  PyObject *set_key[REFRESH_MAX_CHANGED], *set_value[REFRESH_MAX_CHANGED], *mirror_m[32], *mirror_r[32];
  int nset, nmirror;
} refresh_plan_t;

/* Notes what master key `km` (value `vm`; the replica holds `vr` under the same key) needs: 1 noted, 0 when too
 * many values changed (the full refresh runs), -1 on error. */
static int plan_key(refresh_plan_t *p, owned_keys_t *ok, PyObject *km, PyObject *vm, PyObject *vr) {
  int k = owned_index(ok, km);
  if (k == -2) return -1;
  if (k >= ok->n - ok->nmirrored) { /* a mirrored dict: refilled from the master's */
    p->mirror_m[p->nmirror] = Py_NewRef(vm);
    p->mirror_r[p->nmirror++] = Py_NewRef(vr);
  } else if (k < 0 && vr != vm) { /* not owned, and changed on the master */
    if (p->nset == REFRESH_MAX_CHANGED) return 0;
    p->set_key[p->nset] = Py_NewRef(km);
    p->set_value[p->nset++] = Py_NewRef(vm);
  }
  return 1;
}

/* Walks the master's keys alongside the replica's, which must come in the same order; then the replica's own keys
 * after them must be owned ones only, in increasing order (mirroring needs the master's dict, which is absent:
 * nothing to refill). 1: planned, 0: the full refresh must run, -1: error. */
static int plan_refresh(refresh_plan_t *p, PyObject *master, PyObject *replica, owned_keys_t *ok) {
  Py_ssize_t pm = 0, pr = 0;
  PyObject *km, *vm, *kr, *vr;
  int r = 1;
  while (r == 1 && PyDict_Next(master, &pm, &km, &vm)) {
    if (!PyDict_Next(replica, &pr, &kr, &vr) || kr != km) return 0;
    r = plan_key(p, ok, km, vm, vr);
  }
  for (int last = -1; r == 1 && PyDict_Next(replica, &pr, &kr, &vr);) {
    int k = owned_index(ok, kr);
    r = k == -2 ? -1 : k <= last ? 0 : 1;
    last = k;
  }
  return r;
}

/* Applies the plan when `r` is 1 and releases its references either way; returns the new `r`. */
static int apply_refresh(refresh_plan_t *p, PyObject *replica, int r) {
  for (int i = 0; i < p->nset; i++) {
    if (r == 1 && PyDict_SetItem(replica, p->set_key[i], p->set_value[i]) < 0) r = -1;
    Py_DECREF(p->set_key[i]);
    Py_DECREF(p->set_value[i]);
  }
  for (int i = 0; i < p->nmirror; i++) {
    if (r == 1 && mirror_dict(p->mirror_m[i], p->mirror_r[i]) < 0) r = -1;
    Py_DECREF(p->mirror_m[i]);
    Py_DECREF(p->mirror_r[i]);
  }
  return r;
}

/* refresh_pair's common case, with no table rebuilt: the replica's dict already holds the master's keys in the
 * master's order, then only owned keys the master lacks, in the order of `owned` (what every refresh leaves while
 * the master gains or loses no attribute). Then the outcome of the full refresh is reached by replacing only the
 * values the master changed and refilling the mirrored dicts. Returns 1 when done, 0 when the full refresh must
 * run instead (nothing touched), -1 on error. */
static int refresh_in_place(PyObject *master, PyObject *replica, owned_keys_t *ok) {
  if (PyDict_GET_SIZE(master) > PyDict_GET_SIZE(replica)) return 0;
  refresh_plan_t plan;
  plan.nset = plan.nmirror = 0;
  return apply_refresh(&plan, replica, plan_refresh(&plan, master, replica, ok));
}

/* One pair of refresh(): pairs[i], a (master, replica) tuple of dicts; at most 32 owned keys, the last `nmirrored`
 * of them mirrored. */
static int refresh_pair(PyObject *pair, owned_keys_t *ok, Py_ssize_t i) {
  PyObject *saved[32], *owned = ok->owned;
  Py_ssize_t nowned = ok->n, nmirrored = ok->nmirrored;
  if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 || !PyDict_Check(PyTuple_GET_ITEM(pair, 0)) ||
      !PyDict_Check(PyTuple_GET_ITEM(pair, 1))) {
    PyErr_Format(PyExc_TypeError, "refresh: pairs[%zd] must be a (dict, dict) tuple", i);
    return -1;
  }
  PyObject *master = PyTuple_GET_ITEM(pair, 0), *replica = PyTuple_GET_ITEM(pair, 1);
  if (master != replica) {
    int done = refresh_in_place(master, replica, ok);
    if (done != 0) return done < 0 ? -1 : 0;
  }
  if (save_owned(replica, owned, nowned, saved) < 0) return -1;
  PyDict_Clear(replica);
  int bad = PyDict_Update(replica, master) < 0;
  for (Py_ssize_t k = 0; k < nowned; k++) {
    bad = restore_owned(master, replica, PySequence_Fast_GET_ITEM(owned, k), saved[k], k >= nowned - nmirrored, bad);
    Py_XDECREF(saved[k]);
  }
  return bad ? -1 : 0;
}

/* NOTE [refresh records]: a pair whose dicts nobody changed since its last refresh needs no walk. Every dict has a
 * version tag (globally unique, new on every change: CPython's own up to 3.11, a dict watcher's from 3.12, NOTE
 * [dict tags from 3.12] in dicttags.c); refresh() records, per pair, the tags of the master's and the replica's
 * __dict__ and of both sides' mirrored hook dicts (with the hook dicts' addresses), and skips the pair while all of
 * them are the same. A hook dict's address is followed only after its owner's tag matched: the owner then still
 * holds it. A replica's own hook dicts change when a forward registers a hook on its replica, and every registration
 * through torch's API makes a RemovableHandle, which torch counts: while the caller's count says none was made since
 * the pairs' last refresh (`own_settled`), only the masters' hook dicts are read, which is most of what a quiet step
 * on 3.11 would otherwise read. A forward or a hook that edits its module's hook dict in place, without registering,
 * keeps the edit on its replica until the next registration (where the bare model, and upstream's replicas sharing the
 * master's dicts, keep it for good). From 3.12 the watcher behind the tags also counts every change to the dicts
 * refresh records: a set of pairs whose last refresh recorded every pair, with that count where it stands now, is
 * skipped whole, without a read per pair. Without tags (3.12 with every watcher taken) every pair is walked. */

/* The records' head: the count of changes when every pair was last recorded (0: not so), the pairs' sequence and
 * its length then. */
#define HEAD_LEN 3

/* uint64 values per pair in refresh()'s records: both __dict__ tags, then per mirrored key the master's hook dict
 * (address, tag) and the replica's. */
#define RECORD_LEN(nmirrored) (2 + 4 * (nmirrored))

/* Whether the pair's record says nothing changed; with `own_settled`, the replica's own hook dicts are taken as
 * unchanged (the caller knows no hook was registered since: NOTE [refresh records]). */
static int unchanged(PyObject *master, PyObject *replica, const uint64_t *rec, Py_ssize_t nmirrored, int own_settled) {
  if (!FDP_DICT_TAGS || rec[0] == 0 || rec[0] != fdp__dict_tag_counted(master, FDP_TAG_REFRESH) ||
      rec[1] != fdp__dict_tag_counted(replica, FDP_TAG_REFRESH))
    return 0;
  /* per mirrored key, the master's hook dict (k even), then the replica's (k odd) */
  for (Py_ssize_t k = 0; k < 2 * nmirrored; k += own_settled ? 2 : 1) {
    const uint64_t *hook = &rec[2 + 2 * k];
    if (hook[0] && fdp__dict_tag_counted((PyObject *)(uintptr_t)hook[0], FDP_TAG_REFRESH) != hook[1]) return 0;
  }
  return 1;
}

/* Records the pair as it is after its refresh: 0 in rec[0] (walk next time) where a mirrored value is not a dict. */
static int remember(PyObject *master, PyObject *replica, uint64_t *rec, const owned_keys_t *ok) {
  rec[0] = 0;
  for (Py_ssize_t k = 0; k < ok->nmirrored; k++) {
    PyObject *key = PySequence_Fast_GET_ITEM(ok->owned, ok->n - ok->nmirrored + k);
    for (int side = 0; side < 2; side++) {
      PyObject *d = PyDict_GetItemWithError(side ? replica : master, key); /* borrowed */
      if (!d && PyErr_Occurred()) return -1;
      if (d && !PyDict_Check(d)) return 0;
      rec[2 + 4 * k + 2 * side] = (uint64_t)(uintptr_t)d;
      rec[3 + 4 * k + 2 * side] = d ? fdp__dict_tag_counted(d, FDP_TAG_REFRESH) : 0;
    }
  }
  rec[1] = fdp__dict_tag_counted(replica, FDP_TAG_REFRESH);
  rec[0] = fdp__dict_tag_counted(master, FDP_TAG_REFRESH);
  return 0;
}

/* The optional `seen` argument of refresh(): NULL when absent; ValueError when it does not hold one record per pair. */
static uint64_t *records(Py_buffer *seen, Py_ssize_t npairs, Py_ssize_t nmirrored) {
  if (!seen->obj) return NULL;
  Py_ssize_t want = (HEAD_LEN + npairs * RECORD_LEN(nmirrored)) * (Py_ssize_t)sizeof(uint64_t);
  if (seen->len != want || (uintptr_t)seen->buf % _Alignof(uint64_t) != 0) {
    PyErr_Format(PyExc_ValueError, "refresh: seen must be refresh_records(%zd, %zd): an aligned %zd bytes, got %zd",
                 npairs, nmirrored, want, seen->len);
    return NULL;
  }
  return seen->buf;
}

/* refresh_records(npairs, nmirrored) -> the zeroed `seen` buffer refresh() wants for that many pairs: the caller
 * keeps it with the pairs and never needs the record layout. */
static PyObject *py_refresh_records(PyObject *module, PyObject *args) {
  (void)module;
  Py_ssize_t npairs, nmirrored;
  if (!PyArg_ParseTuple(args, "nn:refresh_records", &npairs, &nmirrored)) return NULL;
  if (npairs < 0 || nmirrored < 0 || nmirrored > 32 ||
      npairs > PY_SSIZE_T_MAX / (RECORD_LEN(32) * (Py_ssize_t)sizeof(uint64_t))) {
    PyErr_Format(PyExc_ValueError, "refresh_records: bad counts (%zd pairs, %zd mirrored)", npairs, nmirrored);
    return NULL;
  }
  PyObject *buf =
      PyByteArray_FromStringAndSize(NULL, (HEAD_LEN + npairs * RECORD_LEN(nmirrored)) * (Py_ssize_t)sizeof(uint64_t));
  if (buf) memset(PyByteArray_AS_STRING(buf), 0, (size_t)PyByteArray_GET_SIZE(buf));
  return buf;
}

/* Checks `owned` and `nmirrored` and hashes the owned keys into ok (zeroed by the caller); -1 with an error set. */
static int owned_keys_init(owned_keys_t *ok, PyObject *owned, Py_ssize_t nmirrored) {
  Py_ssize_t nowned = PySequence_Fast_GET_SIZE(owned);
  if (nowned > 32) {
    PyErr_SetString(PyExc_ValueError, "refresh: at most 32 owned keys");
    return -1;
  }
  if (nmirrored < 0 || nmirrored > nowned) {
    PyErr_Format(PyExc_ValueError, "refresh: nmirrored must be between 0 and len(owned) (%zd), got %zd", nowned,
                 nmirrored);
    return -1;
  }
  ok->owned = owned;
  ok->n = nowned;
  ok->nmirrored = nmirrored;
  for (Py_ssize_t k = 0; k < nowned; k++)
    if ((ok->hash[k] = PyObject_Hash(PySequence_Fast_GET_ITEM(owned, k))) == -1) return -1;
  return 0;
}

/* Whether pairs[i] may be skipped: a (dict, dict) pair its record says is unchanged. */
static int skippable(PyObject *pair, const uint64_t *r, Py_ssize_t nmirrored, int own_settled) {
  return r && PyTuple_Check(pair) && PyTuple_GET_SIZE(pair) == 2 && PyDict_Check(PyTuple_GET_ITEM(pair, 0)) &&
         PyDict_Check(PyTuple_GET_ITEM(pair, 1)) &&
         unchanged(PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1), r, nmirrored, own_settled);
}

/* Refreshes every pair not skipped; the pairs walked, or -1 with an error set. *recorded: whether every pair ends
 * with a complete record. */
static Py_ssize_t refresh_pairs(PyObject *pairs, owned_keys_t *ok, uint64_t *rec, int own_settled, int *recorded) {
  Py_ssize_t walked = 0;
  *recorded = rec != NULL && FDP_DICT_TAGS;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(pairs); i++) {
    PyObject *pair = PySequence_Fast_GET_ITEM(pairs, i);
    uint64_t *r = rec ? rec + i * RECORD_LEN(ok->nmirrored) : NULL;
    if (skippable(pair, r, ok->nmirrored, own_settled)) continue;
    if (r) r[0] = 0; /* walked again next time unless this walk completes */
    walked++;
    if (refresh_pair(pair, ok, i) < 0) return -1;
    if (r && FDP_DICT_TAGS && remember(PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1), r, ok) < 0) return -1;
    if (r && !r[0]) *recorded = 0;
  }
  return walked;
}

/* Refreshes the pairs with the records `seen` (NULL: none): skipped whole where the head says no counted dict
 * changed since every pair was recorded (NOTE [refresh records]); the pairs walked, or -1 with an error set. */
static Py_ssize_t refresh_recorded(PyObject *pairs_obj, PyObject *pairs, owned_keys_t *ok, uint64_t *seen,
                                   int own_settled) {
  uint64_t *head = seen, *rec = seen ? seen + HEAD_LEN : NULL;
  uint64_t id = (uint64_t)(uintptr_t)pairs_obj, n = (uint64_t)PySequence_Fast_GET_SIZE(pairs);
  uint64_t before = fdp__counted_changes(FDP_TAG_REFRESH);
  if (head && head[0] && head[0] == before && head[1] == id && head[2] == n) return 0;
  int recorded;
  Py_ssize_t walked = refresh_pairs(pairs, ok, rec, own_settled, &recorded);
  if (head) {
    /* A change during this pass (its own writes, or a finalizer's) leaves the head unset: the next refresh reads
     * every pair's tags again. */
    int still = walked >= 0 && recorded && before && fdp__counted_changes(FDP_TAG_REFRESH) == before;
    head[0] = still ? before : 0;
    head[1] = id;
    head[2] = n;
  }
  return walked;
}

/* refresh(pairs, owned, nmirrored=0, seen=None, own_settled=False) -> pairs walked: for each (master_dict,
 * replica_dict), makes the replica's __dict__ a fresh shallow copy of the master's, as
 * Module._replicate_for_data_parallel would, except for the keys in `owned`, which keep the replica's own values (its
 * parameter, buffer and child dicts). The last `nmirrored` owned keys name the replica's own hook dicts: they keep
 * their objects, refilled with the master's entries, so a hook a replica registers during forward never lands on the
 * master and is gone at the next refresh. Persistent replicas thus see every attribute, hook and training flag the
 * master has now. `seen`, the buffer refresh_records() made for these pairs, lets unchanged pairs be skipped (NOTE
 * [refresh records]); `own_settled`, that no hook was registered since these pairs' last refresh, lets it skip reading
 * the replicas' own hook dicts. */
static PyObject *py_refresh(PyObject *module, PyObject *args) {
  (void)module;
  PyObject *pairs_obj, *owned_obj;
  Py_ssize_t nmirrored = 0;
  Py_buffer seen = {0};
  int own_settled = 0;
  if (!PyArg_ParseTuple(args, "OO|nw*p:refresh", &pairs_obj, &owned_obj, &nmirrored, &seen, &own_settled)) return NULL;
  PyObject *pairs = PySequence_Fast(pairs_obj, "pairs must be a sequence of (dict, dict)");
  PyObject *owned = pairs ? PySequence_Fast(owned_obj, "owned must be a sequence of keys") : NULL;
  PyObject *ret = NULL;
  owned_keys_t ok = {NULL, 0, 0, {0}, {NULL}, {0}};
  if (owned && owned_keys_init(&ok, owned, nmirrored) == 0) {
    uint64_t *rec = records(&seen, PySequence_Fast_GET_SIZE(pairs), nmirrored);
    Py_ssize_t walked = rec || !PyErr_Occurred() ? refresh_recorded(pairs_obj, pairs, &ok, rec, own_settled) : -1;
    ret = walked < 0 ? NULL : PyLong_FromSsize_t(walked);
  }
  owned_keys_clear(&ok);
  if (seen.obj) PyBuffer_Release(&seen);
  Py_XDECREF(pairs);
  Py_XDECREF(owned);
  return ret;
}

/* version_sum(tensors) -> sum of their _version counters: whether any of them was written in place since the last
 * call, in one pass (kept replica tensors, NOTE [kept replica tensors] in fastdp/_replicas.py). */
static PyObject *py_version_sum(PyObject *module, PyObject *arg) {
  (void)module;
  PyObject *fast = PySequence_Fast(arg, "version_sum: expected a sequence of tensors");
  if (!fast) return NULL;
  PyObject *name = PyUnicode_InternFromString("_version");
  unsigned long long sum = 0;
  int ok = name != NULL;
  for (Py_ssize_t i = 0; ok && i < PySequence_Fast_GET_SIZE(fast); i++) {
    PyObject *v = PyObject_GetAttr(PySequence_Fast_GET_ITEM(fast, i), name);
    unsigned long long n = v ? PyLong_AsUnsignedLongLongMask(v) : 0;
    ok = v && !PyErr_Occurred();
    Py_XDECREF(v);
    sum += n; /* wraps: only equality with the last sum is asked */
  }
  Py_XDECREF(name);
  Py_DECREF(fast);
  return ok ? PyLong_FromUnsignedLongLong(sum) : NULL;
}

/* clear_hooks(tensors) -> how many were cleared: empties each tensor's _backward_hooks dict (the hooks a forward
 * registered on a kept replica tensor), in one pass; tensors without hooks cost one attribute read. */
static PyObject *py_clear_hooks(PyObject *module, PyObject *arg) {
  (void)module;
  PyObject *fast = PySequence_Fast(arg, "clear_hooks: expected a sequence of tensors");
  if (!fast) return NULL;
  PyObject *name = PyUnicode_InternFromString("_backward_hooks");
  Py_ssize_t cleared = 0;
  int ok = name != NULL;
  for (Py_ssize_t i = 0; ok && i < PySequence_Fast_GET_SIZE(fast); i++) {
    PyObject *hooks = PyObject_GetAttr(PySequence_Fast_GET_ITEM(fast, i), name);
    ok = hooks != NULL;
    if (ok && hooks != Py_None && PyObject_IsTrue(hooks) == 1) { /* an OrderedDict: cleared through its method */
      PyObject *r = PyObject_CallMethod(hooks, "clear", NULL);
      ok = r != NULL;
      Py_XDECREF(r);
      cleared++;
    }
    if (ok && PyErr_Occurred()) ok = 0;
    Py_XDECREF(hooks);
  }
  Py_XDECREF(name);
  Py_DECREF(fast);
  return ok ? PyLong_FromSsize_t(cleared) : NULL;
}

/* rebind(containers, keys, values): containers[i][keys[i]] = values[i] for every i — the per-step installation
 * of fresh parameter and buffer tensors into persistent replicas. */
static PyObject *py_rebind(PyObject *module, PyObject *args) {
  (void)module;
  PyObject *c_obj, *k_obj, *v_obj;
  if (!PyArg_ParseTuple(args, "OOO:rebind", &c_obj, &k_obj, &v_obj)) return NULL;
  PyObject *c = PySequence_Fast(c_obj, "containers must be a sequence");
  PyObject *k = c ? PySequence_Fast(k_obj, "keys must be a sequence") : NULL;
  PyObject *v = k ? PySequence_Fast(v_obj, "values must be a sequence") : NULL;
  PyObject *ret = NULL;
  if (!v) goto done;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(c);
  if (PySequence_Fast_GET_SIZE(k) != n || PySequence_Fast_GET_SIZE(v) != n) {
    PyErr_SetString(PyExc_ValueError, "rebind: containers, keys and values must have one length");
    goto done;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *target = PySequence_Fast_GET_ITEM(c, i), *key = PySequence_Fast_GET_ITEM(k, i);
    PyObject *value = PySequence_Fast_GET_ITEM(v, i);
    int rc = PyDict_CheckExact(target) ? PyDict_SetItem(target, key, value) : PyObject_SetItem(target, key, value);
    if (rc < 0) goto done;
  }
  ret = Py_NewRef(Py_None);
done:
  Py_XDECREF(c);
  Py_XDECREF(k);
  Py_XDECREF(v);
  return ret;
}

PyMethodDef fdp__refresh_methods[] = {
    {"refresh", py_refresh, METH_VARARGS,
     "refresh(pairs, owned, nmirrored=0, seen=None) -> pairs walked: replica __dict__ = master's, owned kept"},
    {"refresh_records", py_refresh_records, METH_VARARGS,
     "refresh_records(npairs, nmirrored) -> the zeroed seen buffer of refresh()"},
    {"version_sum", py_version_sum, METH_O, "version_sum(tensors) -> sum of their _version counters"},
    {"clear_hooks", py_clear_hooks, METH_O, "clear_hooks(tensors) -> how many _backward_hooks dicts were emptied"},
    {"rebind", py_rebind, METH_VARARGS, "rebind(containers, keys, values): containers[i][keys[i]] = values[i]"},
    {NULL, NULL, 0, NULL},
};
