/* SPDX-License-Identifier: MIT */
/* fastdp._C, the module: each operation parses its arguments with the converters of tensors.c (tensors become core
 * descriptors through libtorch's C shim or the tensor's Python API, never PyTorch's C++ ABI), releases the GIL
 * around the core, and turns result codes into exceptions in one place. */
#include "binding.h"


#include <string.h>

static module_state *get_state(PyObject *module) {
  return (module_state *)PyModule_GetState(module);
}

/* ---- errors ---- */

static PyObject *g_oom_error; /* see set_oom_error below */

/* The exception type of a result: one table, as _decimal maps libmpdec's conditions to its signals. */
static PyObject *exception_type(module_state *st, fdp_result_t r, int status) {
  PyObject *const types[FDP_RESULT_COUNT] = {
      [FDP_INVALID] = PyExc_ValueError,
      [FDP_DTYPE] = PyExc_TypeError,
      [FDP_NOMEM] = PyExc_MemoryError,
      [FDP_OVERLAP] = PyExc_RuntimeError, /* PyTorch raises RuntimeError for overlapping writes */
      [FDP_UNAVAILABLE] = st->BackendUnavailableError,
      [FDP_CUDA] = status == FDP_CUDA_OUT_OF_MEMORY && g_oom_error ? g_oom_error : st->CudaError,
      [FDP_NCCL] = st->NcclError,
  };
  return (unsigned)r < FDP_RESULT_COUNT && types[r] ? types[r] : st->FastDPError;
}

/* exc.name = value (a new reference, NULL allowed); a failure here loses only the attribute. */
static void set_attr(PyObject *exc, const char *name, PyObject *value) {
  if (!value || PyObject_SetAttrString(exc, name, value) < 0) PyErr_Clear();
  Py_XDECREF(value);
}

static PyObject *raise_result(module_state *st, fdp_result_t r) {
  int status = r == FDP_CUDA || r == FDP_NCCL ? fdp_last_status() : 0; /* the library's code; 0: none */
  PyObject *type = exception_type(st, r, status);
  PyObject *exc = PyObject_CallFunction(type, "s", fdp_last_error());
  if (!exc) return NULL;
  set_attr(exc, "code", PyUnicode_FromString(fdp_result_name(r)));
  /* .status: the library's own code (CUresult, ncclResult_t), as CuPy's CUDADriverError.status; None otherwise. */
  set_attr(exc, "status", status != 0 ? PyLong_FromLong(status) : Py_NewRef(Py_None));
  PyErr_SetObject(type, exc);
  Py_DECREF(exc);
  return NULL;
}

/* None, or the exception of a failed core call. */
static PyObject *result(module_state *st, fdp_result_t r) {
  if (r != FDP_OK) return raise_result(st, r);
  Py_RETURN_NONE;
}

/* A converter's target for the argument called `name` in errors (fdp__tensor_list_t, fdp__tensor_arg_t). */
#define FDP_ARG(name) {.st = st, .what = name}

/* ---- entry points: parse (converters), release the GIL, call the core, raise ---- */

static PyObject *copy_impl(module_state *st, fdp__tensor_list_t *d, fdp__tensor_list_t *s, fdp_streams_t *streams) {
  if (d->n != s->n || fdp__check_count(d->n) < 0) {
    if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "copy: %zd destinations for %zd sources", d->n, s->n);
    return NULL;
  }
  fdp_result_t r;
  Py_BEGIN_ALLOW_THREADS
  r = fdp_op_copy(d->t, s->t, (int)d->n, streams);
  Py_END_ALLOW_THREADS
  return result(st, r);
}

/* copy(dsts, srcs, streams=None) */
static PyObject *py_copy(PyObject *module, PyObject *args) {
  module_state *st = get_state(module);
  fdp__tensor_list_t d = FDP_ARG("dst"), s = FDP_ARG("src");
  fdp_streams_t streams = {0};
  if (!PyArg_ParseTuple(args, "O&O&|O&:copy", fdp__tensor_list_converter, &d, fdp__tensor_list_converter, &s,
                        fdp__streams_converter, &streams))
    return NULL;
  PyObject *ret = copy_impl(st, &d, &s, &streams);
  fdp__tensor_list_clear(&d);
  fdp__tensor_list_clear(&s);
  return ret;
}

static PyObject *broadcast_impl(module_state *st, fdp_tensor_t *src, fdp__tensor_list_t *d, fdp_streams_t *streams) {
  if (fdp__check_count(d->n) < 0) return NULL;
  fdp_result_t r;
  Py_BEGIN_ALLOW_THREADS
  r = fdp_op_broadcast(src, d->t, (int)d->n, streams);
  Py_END_ALLOW_THREADS
  return result(st, r);
}

/* broadcast(src, dsts, streams=None) */
static PyObject *py_broadcast(PyObject *module, PyObject *args) {
  module_state *st = get_state(module);
  fdp__tensor_arg_t src = FDP_ARG("tensor");
  fdp__tensor_list_t d = FDP_ARG("out");
  fdp_streams_t streams = {0};
  if (!PyArg_ParseTuple(args, "O&O&|O&:broadcast", fdp__tensor_converter, &src, fdp__tensor_list_converter, &d,
                        fdp__streams_converter, &streams))
    return NULL;
  PyObject *ret = broadcast_impl(st, &src.t, &d, &streams);
  fdp__tensor_list_clear(&d);
  return ret;
}

static PyObject *reduce_impl(module_state *st, fdp__tensor_list_t *in, fdp_tensor_t *out, fdp_streams_t *streams) {
  if (fdp__check_count(in->n) < 0) return NULL;
  fdp_result_t r;
  Py_BEGIN_ALLOW_THREADS
  r = fdp_op_reduce(in->t, (int)in->n, out, streams);
  Py_END_ALLOW_THREADS
  return result(st, r);
}

/* reduce(inputs, out, streams=None) */
static PyObject *py_reduce(PyObject *module, PyObject *args) {
  module_state *st = get_state(module);
  fdp__tensor_list_t in = FDP_ARG("inputs");
  fdp__tensor_arg_t out = FDP_ARG("out");
  fdp_streams_t streams = {0};
  if (!PyArg_ParseTuple(args, "O&O&|O&:reduce", fdp__tensor_list_converter, &in, fdp__tensor_converter, &out,
                        fdp__streams_converter, &streams))
    return NULL;
  PyObject *ret = reduce_impl(st, &in, &out.t, &streams);
  fdp__tensor_list_clear(&in);
  return ret;
}

/* chunk_sizes of scatter: a sequence of ints, one per output, into an int64 array (PyMem), released by the cleanup
 * call. The length is checked before the items, as it always was. */
typedef struct {
  const fdp__tensor_list_t *outs; /* in: converted before (positional order) */
  int64_t *v;
  Py_ssize_t n;
} int64_array_t;

static int int64_array_converter(PyObject *obj, void *out) {
  int64_array_t *a = out;
  if (obj == NULL) {
    PyMem_Free(a->v);
    a->v = NULL;
    return 0;
  }
  PyObject *fast = PySequence_Fast(obj, "chunk_sizes must be a sequence");
  if (!fast) return 0;
  a->n = PySequence_Fast_GET_SIZE(fast);
  int ok = a->n == a->outs->n && fdp__check_count(a->n) == 0;
  if (!ok && !PyErr_Occurred())
    PyErr_SetString(PyExc_ValueError, "Expected devices and chunk_sizes to be of same length");
  a->v = ok ? PyMem_Calloc((size_t)(a->n ? a->n : 1), sizeof *a->v) : NULL;
  if (ok && !a->v) {
    ok = 0;
    PyErr_NoMemory();
  }
  for (Py_ssize_t i = 0; ok && i < a->n; i++) {
    a->v[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
    ok = !(a->v[i] == -1 && PyErr_Occurred());
  }
  Py_DECREF(fast);
  if (!ok) int64_array_converter(NULL, a);
  return ok ? Py_CLEANUP_SUPPORTED : 0;
}

static PyObject *scatter_impl(module_state *st, fdp_tensor_t *src, fdp__tensor_list_t *o, int dim, int64_array_t *sz,
                              fdp_streams_t *streams) {
  fdp_result_t r;
  Py_BEGIN_ALLOW_THREADS
  r = fdp_op_scatter(src, dim, sz->v, o->t, (int)o->n, streams);
  Py_END_ALLOW_THREADS
  return result(st, r);
}

/* scatter(src, outs, dim, chunk_sizes, streams=None) */
static PyObject *py_scatter(PyObject *module, PyObject *args) {
  module_state *st = get_state(module);
  fdp__tensor_arg_t src = FDP_ARG("tensor");
  fdp__tensor_list_t o = FDP_ARG("out");
  int64_array_t sizes = {&o, NULL, 0};
  fdp_streams_t streams = {0};
  int dim;
  if (!PyArg_ParseTuple(args, "O&O&iO&|O&:scatter", fdp__tensor_converter, &src, fdp__tensor_list_converter, &o, &dim,
                        int64_array_converter, &sizes, fdp__streams_converter, &streams))
    return NULL;
  PyObject *ret = scatter_impl(st, &src.t, &o, dim, &sizes, &streams);
  int64_array_converter(NULL, &sizes);
  fdp__tensor_list_clear(&o);
  return ret;
}

static PyObject *gather_impl(module_state *st, fdp__tensor_list_t *in, int dim, fdp_tensor_t *out,
                             fdp_streams_t *streams) {
  if (fdp__check_count(in->n) < 0) return NULL;
  fdp_result_t r;
  Py_BEGIN_ALLOW_THREADS
  r = fdp_op_gather(in->t, (int)in->n, dim, out, streams);
  Py_END_ALLOW_THREADS
  return result(st, r);
}

/* gather(inputs, out, dim, streams=None) */
static PyObject *py_gather(PyObject *module, PyObject *args) {
  module_state *st = get_state(module);
  fdp__tensor_list_t in = FDP_ARG("tensors");
  fdp__tensor_arg_t out = FDP_ARG("out");
  fdp_streams_t streams = {0};
  int dim;
  if (!PyArg_ParseTuple(args, "O&O&i|O&:gather", fdp__tensor_list_converter, &in, fdp__tensor_converter, &out, &dim,
                        fdp__streams_converter, &streams))
    return NULL;
  PyObject *ret = gather_impl(st, &in, dim, &out.t, &streams);
  fdp__tensor_list_clear(&in);
  return ret;
}

/* One int type key per tensor from a sequence of n. */
static int parse_keys(PyObject *keys_obj, Py_ssize_t n, int *keys) {
  PyObject *fast = PySequence_Fast(keys_obj, "type_keys must be a sequence");
  if (!fast) return -1;
  int rc = 0;
  if (PySequence_Fast_GET_SIZE(fast) != n) {
    PyErr_SetString(PyExc_ValueError, "plan: one type key per tensor");
    rc = -1;
  }
  for (Py_ssize_t i = 0; rc == 0 && i < n; i++) {
    keys[i] = (int)PyLong_AsLong(PySequence_Fast_GET_ITEM(fast, i));
    if (keys[i] == -1 && PyErr_Occurred()) rc = -1;
  }
  Py_DECREF(fast);
  return rc;
}

/* A bucket's members as [(index, offset, numel), ...]. */
static PyObject *bucket_members(const fdp_plan_t *plan, const fdp_bucket_t *bk) {
  PyObject *members = PyList_New(bk->count);
  for (int m = 0; members && m < bk->count; m++) {
    const fdp_member_t *mb = &plan->members[bk->first + m];
    PyObject *item = Py_BuildValue("(iLL)", mb->tensor, (long long)mb->offset, (long long)mb->numel);
    if (!item)
      Py_CLEAR(members);
    else
      PyList_SET_ITEM(members, m, item);
  }
  return members;
}

/* The plan as [(numel, [(index, offset, numel), ...]), ...]. */
static PyObject *plan_to_list(const fdp_plan_t *plan) {
  PyObject *ret = PyList_New(plan->nbuckets);
  for (int b = 0; ret && b < plan->nbuckets; b++) {
    const fdp_bucket_t *bk = &plan->buckets[b];
    PyObject *members = bucket_members(plan, bk);
    PyObject *entry = members ? Py_BuildValue("(LN)", (long long)bk->numel, members) : NULL;
    if (!entry)
      Py_CLEAR(ret);
    else
      PyList_SET_ITEM(ret, b, entry);
  }
  return ret;
}

static PyObject *plan_impl(module_state *st, fdp__tensor_list_t *ts, PyObject *keys_obj, PyObject *bytes_obj) {
  /* Checked, not taken modulo 2**64 as the "K" format would. */
  unsigned long long bucket_bytes = PyLong_AsUnsignedLongLong(bytes_obj);
  if (bucket_bytes == (unsigned long long)-1 && PyErr_Occurred()) {
    PyErr_Format(PyExc_OverflowError, "bucket size %S bytes does not fit in 64 bits; pass at most 2**64 - 1",
                 bytes_obj);
    return NULL;
  }
  PyObject *ret = NULL;
  fdp_plan_t *plan = NULL;
  int *keys = PyMem_Calloc((size_t)(ts->n ? ts->n : 1), sizeof *keys);
  if (!keys) PyErr_NoMemory();
  if (keys && fdp__check_count(ts->n) == 0 && parse_keys(keys_obj, ts->n, keys) == 0) {
    fdp_result_t r = fdp_plan_build(ts->t, keys, (int)ts->n, (size_t)bucket_bytes, &plan);
    ret = r == FDP_OK ? plan_to_list(plan) : raise_result(st, r);
  }
  fdp_plan_free(plan);
  PyMem_Free(keys);
  return ret;
}

/* plan(tensors, type_keys, bucket_bytes) -> [(numel, [(index, offset, numel), ...]), ...] */
static PyObject *py_plan(PyObject *module, PyObject *args) {
  module_state *st = get_state(module);
  fdp__tensor_list_t ts = FDP_ARG("tensors");
  PyObject *keys_obj, *bytes_obj;
  if (!PyArg_ParseTuple(args, "O&OO!:plan", fdp__tensor_list_converter, &ts, &keys_obj, &PyLong_Type, &bytes_obj))
    return NULL;
  PyObject *ret = plan_impl(st, &ts, keys_obj, bytes_obj);
  fdp__tensor_list_clear(&ts);
  return ret;
}

/* The input columns of reduce_many: the sequence (PySequence_Fast), then one described list per column. */
typedef struct {
  PyObject *fast;
  fdp__tensor_list_t *lists; /* PyMem; made by columns_describe */
} columns_t;

/* "O&" converter: the outer sequence only, so that outs are checked before any column, as they always were. */
static int columns_converter(PyObject *obj, void *out) {
  columns_t *c = out;
  if (obj == NULL) {
    for (Py_ssize_t j = 0; c->lists && j < PySequence_Fast_GET_SIZE(c->fast); j++)
      fdp__tensor_list_clear(&c->lists[j]);
    PyMem_Free(c->lists);
    c->lists = NULL;
    Py_CLEAR(c->fast);
    return 0;
  }
  c->fast = PySequence_Fast(obj, "columns must be a sequence of sequences of tensors");
  return c->fast ? Py_CLEANUP_SUPPORTED : 0;
}

/* Describes every column; columns_converter(NULL, c) releases what was made. */
static int columns_describe(module_state *st, columns_t *c) {
  Py_ssize_t n = PySequence_Fast_GET_SIZE(c->fast);
  c->lists = PyMem_Calloc((size_t)(n ? n : 1), sizeof *c->lists);
  if (!c->lists) {
    PyErr_NoMemory();
    return -1;
  }
  for (Py_ssize_t j = 0; j < n; j++) {
    c->lists[j] = (fdp__tensor_list_t)FDP_ARG("columns[j]");
    if (!fdp__tensor_list_converter(PySequence_Fast_GET_ITEM(c->fast, j), &c->lists[j]) ||
        fdp__check_count(c->lists[j].n) < 0)
      return -1;
  }
  return 0;
}

/* outs[j] = sum of column j, for every column, stopping at the first failure (no GIL needed). */
static fdp_result_t reduce_columns(const fdp__tensor_list_t *cols, Py_ssize_t n, const fdp_tensor_t *outs,
                                   const fdp_streams_t *streams) {
  fdp_result_t r = FDP_OK;
  for (Py_ssize_t j = 0; j < n && r == FDP_OK; j++)
    r = fdp_op_reduce(cols[j].t, (int)cols[j].n, &outs[j], streams);
  return r;
}

static PyObject *reduce_many_impl(module_state *st, columns_t *c, fdp__tensor_list_t *outs, fdp_streams_t *streams) {
  Py_ssize_t n = PySequence_Fast_GET_SIZE(c->fast);
  if (outs->n != n || fdp__check_count(n) < 0) {
    if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "reduce_many: %zd outputs for %zd columns", outs->n, n);
    return NULL;
  }
  if (columns_describe(st, c) < 0) return NULL;
  fdp_result_t r;
  Py_BEGIN_ALLOW_THREADS
  r = reduce_columns(c->lists, n, outs->t, streams);
  Py_END_ALLOW_THREADS
  return result(st, r);
}

/* reduce_many(columns, outs, streams=None): outs[j] = sum of columns[j], one core reduce per column, with the GIL
 * released once for the whole set (the per-bucket gradient reduction of DataParallel). */
static PyObject *py_reduce_many(PyObject *module, PyObject *args) {
  module_state *st = get_state(module);
  columns_t c = {NULL, NULL};
  fdp__tensor_list_t outs = FDP_ARG("outs");
  fdp_streams_t streams = {0};
  if (!PyArg_ParseTuple(args, "O&O&|O&:reduce_many", columns_converter, &c, fdp__tensor_list_converter, &outs,
                        fdp__streams_converter, &streams))
    return NULL;
  PyObject *ret = reduce_many_impl(st, &c, &outs, &streams);
  columns_converter(NULL, &c);
  fdp__tensor_list_clear(&outs);
  return ret;
}

/* Whether reduce_rows can sum these: host tensors of out's dtype, contiguous, each replica's member j the shape of
 * replica 0's, the members fitting in `out` (1-D, contiguous) back to back. */
static int rows_fit(const fdp_tensor_t *g, Py_ssize_t k, Py_ssize_t nrep, const fdp_tensor_t *out) {
  if (out->device != FDP_HOST || out->ndim != 1 || !fdp_tensor_is_contiguous(out) || out->dtype < 0 ||
      out->dtype == FDP_DTYPE_OTHER || out->dtype >= FDP_DTYPE_COUNT)
    return 0;
  int64_t total = 0;
  for (Py_ssize_t i = 0; i < k * nrep; i++) {
    const fdp_tensor_t *t = &g[i], *first = &g[i % k];
    if (t->device != FDP_HOST || t->dtype != out->dtype || t->elem_size != out->elem_size ||
        !fdp_tensor_is_contiguous(t) || t->ndim != first->ndim ||
        memcmp(t->sizes, first->sizes, (size_t)t->ndim * sizeof *t->sizes) != 0)
      return 0;
    if (i < k) total += fdp_tensor_numel(t);
  }
  return total <= out->sizes[0];
}

/* out[offset_j ...] = sum over replicas of member j, for every member (no GIL needed). */
static fdp_result_t reduce_rows_impl(const fdp_tensor_t *g, Py_ssize_t k, Py_ssize_t nrep, const fdp_tensor_t *out) {
  fdp_tensor_t in[FDP_MAX_DEVICES];
  fdp_result_t r = FDP_OK;
  char *at = out->data;
  for (Py_ssize_t j = 0; j < k && r == FDP_OK; j++) {
    for (Py_ssize_t q = 0; q < nrep; q++)
      in[q] = g[q * k + j];
    fdp_tensor_t o = in[0]; /* member j's shape, contiguous, at its place in out */
    o.data = at;
    for (int d = o.ndim - 1; d >= 0; d--)
      o.strides[d] = d == o.ndim - 1 ? 1 : o.strides[d + 1] * o.sizes[d + 1];
    r = fdp_op_reduce(in, (int)nrep, &o, NULL);
    at += fdp_tensor_numel(&o) * o.elem_size;
  }
  return r;
}

/* reduce_rows(grads, k, out) -> bool: `grads` replica-major (k tensors per replica), member j's sum over the replicas
 * written into `out` (a flat 1-D buffer) at the members' offsets back to back: the packed reduction of host
 * replicas without packing each replica first. False, with nothing written, where the gradients are not all dense
 * host tensors of out's dtype with matching shapes (None, sparse, strided, another dtype), or where tensors are read
 * through their Python API (slower than torch's packing): the caller takes its other paths then. */
static PyObject *py_reduce_rows(PyObject *module, PyObject *args) {
  module_state *st = get_state(module);
  PyObject *grads;
  fdp__tensor_arg_t out = FDP_ARG("out");
  Py_ssize_t k;
  if (!PyArg_ParseTuple(args, "OnO&:reduce_rows", &grads, &k, fdp__tensor_converter, &out)) return NULL;
  if (fdp__tensor_path() != FDP_TENSOR_PATH_AOTI) Py_RETURN_FALSE;
  PyObject *items = PySequence_Tuple(grads), *ret = NULL;
  if (!items) return NULL;
  Py_ssize_t n = PyTuple_GET_SIZE(items), nrep = k > 0 ? n / k : 0;
  fdp_tensor_t *g = NULL;
  int rc = -1;
  if (k <= 0 || n % k != 0 || nrep < 1 || nrep > FDP_MAX_DEVICES)
    PyErr_Format(PyExc_ValueError, "reduce_rows: %zd gradients are not 1 to %d rows of k=%zd", n, FDP_MAX_DEVICES, k);
  else if (!(g = fdp_scratch_alloc((size_t)n * sizeof *g)))
    PyErr_NoMemory();
  else
    rc = fdp__aoti_try_describe(st, items, g);
  if (rc == 1 || (rc == 0 && !rows_fit(g, k, nrep, &out.t))) {
    ret = Py_NewRef(Py_False);
  } else if (rc == 0) {
    fdp_result_t r;
    Py_BEGIN_ALLOW_THREADS
    r = reduce_rows_impl(g, k, nrep, &out.t);
    Py_END_ALLOW_THREADS
    ret = r == FDP_OK ? Py_NewRef(Py_True) : raise_result(st, r);
  }
  fdp_scratch_free(g);
  Py_DECREF(items); /* kept until here: the gradients' memory stays alive while the GIL is released */
  return ret;
}

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

/* NOTE [refresh records]: a pair whose dicts nobody changed since its last refresh needs no walk. CPython up to 3.11
 * gives every dict a version tag (PEP 509: globally unique, new on every change); refresh() records, per pair, the
 * tags of the master's and the replica's __dict__ and of both sides' mirrored hook dicts (with the hook dicts'
 * addresses), and skips the pair while all of them are the same. A hook dict's address is followed only after its
 * owner's tag matched: the owner then still holds it. From 3.12 the tag is deprecated (PEP 699), and every pair is
 * walked. */
#if PY_VERSION_HEX < 0x030C0000
#define FDP_DICT_TAGS 1
static uint64_t dict_tag(PyObject *d) {
  return ((PyDictObject *)d)->ma_version_tag;
}
#else
#define FDP_DICT_TAGS 0
static uint64_t dict_tag(PyObject *d) {
  (void)d;
  return 0;
}
#endif

/* uint64 values per pair in refresh()'s records: both __dict__ tags, then per mirrored key the master's hook dict
 * (address, tag) and the replica's. */
#define RECORD_LEN(nmirrored) (2 + 4 * (nmirrored))

/* Whether the pair's record says nothing changed. */
static int unchanged(PyObject *master, PyObject *replica, const uint64_t *rec, Py_ssize_t nmirrored) {
  if (!FDP_DICT_TAGS || rec[0] == 0 || rec[0] != dict_tag(master) || rec[1] != dict_tag(replica)) return 0;
  for (Py_ssize_t k = 0; k < 2 * nmirrored; k++) {
    const uint64_t *hook = &rec[2 + 2 * k];
    if (hook[0] && dict_tag((PyObject *)(uintptr_t)hook[0]) != hook[1]) return 0;
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
      rec[3 + 4 * k + 2 * side] = d ? dict_tag(d) : 0;
    }
  }
  rec[1] = dict_tag(replica);
  rec[0] = dict_tag(master);
  return 0;
}

/* The optional `seen` argument of refresh(): NULL when absent; ValueError when it does not hold one record per pair. */
static uint64_t *records(Py_buffer *seen, Py_ssize_t npairs, Py_ssize_t nmirrored) {
  if (!seen->obj) return NULL;
  Py_ssize_t want = npairs * RECORD_LEN(nmirrored) * (Py_ssize_t)sizeof(uint64_t);
  if (seen->len != want || (uintptr_t)seen->buf % _Alignof(uint64_t) != 0) {
    PyErr_Format(PyExc_ValueError, "refresh: seen must be an aligned buffer of %zd bytes (%d uint64 per pair), got %zd",
                 want, (int)RECORD_LEN(nmirrored), seen->len);
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
  PyObject *buf = PyByteArray_FromStringAndSize(NULL, npairs * RECORD_LEN(nmirrored) * (Py_ssize_t)sizeof(uint64_t));
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
static int skippable(PyObject *pair, const uint64_t *r, Py_ssize_t nmirrored) {
  return r && PyTuple_Check(pair) && PyTuple_GET_SIZE(pair) == 2 && PyDict_Check(PyTuple_GET_ITEM(pair, 0)) &&
         PyDict_Check(PyTuple_GET_ITEM(pair, 1)) &&
         unchanged(PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1), r, nmirrored);
}

/* Refreshes every pair not skipped; the pairs walked, or -1 with an error set. */
static Py_ssize_t refresh_pairs(PyObject *pairs, owned_keys_t *ok, uint64_t *rec) {
  Py_ssize_t walked = 0;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(pairs); i++) {
    PyObject *pair = PySequence_Fast_GET_ITEM(pairs, i);
    uint64_t *r = rec ? rec + i * RECORD_LEN(ok->nmirrored) : NULL;
    if (skippable(pair, r, ok->nmirrored)) continue;
    if (r) r[0] = 0; /* walked again next time unless this walk completes */
    walked++;
    if (refresh_pair(pair, ok, i) < 0) return -1;
    if (r && FDP_DICT_TAGS && remember(PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1), r, ok) < 0) return -1;
  }
  return walked;
}

/* refresh(pairs, owned, nmirrored=0, seen=None) -> pairs walked: for each (master_dict, replica_dict), makes the
 * replica's __dict__ a fresh shallow copy of the master's, as Module._replicate_for_data_parallel would, except for the
 * keys in `owned`, which keep the replica's own values (its parameter, buffer and child dicts). The last `nmirrored`
 * owned keys name the replica's own hook dicts: they keep their objects, refilled with the master's entries, so a
 * hook a replica registers during forward never lands on the master and is gone at the next refresh. Persistent
 * replicas thus see every attribute, hook and training flag the master has now. `seen`, the buffer
 * refresh_records() made for these pairs, lets unchanged pairs be skipped (NOTE [refresh records]). */
static PyObject *py_refresh(PyObject *module, PyObject *args) {
  (void)module;
  PyObject *pairs_obj, *owned_obj;
  Py_ssize_t nmirrored = 0;
  Py_buffer seen = {0};
  if (!PyArg_ParseTuple(args, "OO|nw*:refresh", &pairs_obj, &owned_obj, &nmirrored, &seen)) return NULL;
  PyObject *pairs = PySequence_Fast(pairs_obj, "pairs must be a sequence of (dict, dict)");
  PyObject *owned = pairs ? PySequence_Fast(owned_obj, "owned must be a sequence of keys") : NULL;
  PyObject *ret = NULL;
  owned_keys_t ok = {NULL, 0, 0, {0}, {NULL}, {0}};
  if (owned && owned_keys_init(&ok, owned, nmirrored) == 0) {
    uint64_t *rec = records(&seen, PySequence_Fast_GET_SIZE(pairs), nmirrored);
    Py_ssize_t walked = rec || !PyErr_Occurred() ? refresh_pairs(pairs, &ok, rec) : -1;
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

/* getattr(import(module), name), or NULL with no error set. */
static PyObject *lookup(const char *module, const char *name) {
  PyObject *m = PyImport_ImportModule(module);
  PyObject *v = m ? PyObject_GetAttrString(m, name) : NULL;
  Py_XDECREF(m);
  if (!v) PyErr_Clear();
  return v;
}

/* The shim path's inputs from the torch already imported; a torch without them leaves the Python path. */
static void init_tensor_path(module_state *st) {
  Py_XSETREF(st->parameter_type, lookup("torch.nn.parameter", "Parameter"));
  PyObject *aoti = lookup("torch._C", "_aoti");
  Py_XSETREF(st->to_handles, aoti ? PyObject_GetAttrString(aoti, "unsafe_alloc_void_ptrs_from_tensors") : NULL);
  PyErr_Clear();
  Py_XSETREF(st->from_handles, aoti ? PyObject_GetAttrString(aoti, "alloc_tensors_by_stealing_from_void_ptrs") : NULL);
  PyErr_Clear();
  Py_XDECREF(aoti);
  PyObject *file = lookup("torch._C", "__file__");
  const char *path = file && PyUnicode_Check(file) ? PyUnicode_AsUTF8(file) : NULL;
  PyErr_Clear();
  fdp__aoti_init(st, path);
  Py_XDECREF(file);
}

static PyObject *py_set_dtypes(PyObject *module, PyObject *args) {
  module_state *st = get_state(module);
  PyObject *dtypes, *tensor_type;
  if (!PyArg_ParseTuple(args, "O!O!:set_dtypes", &PyDict_Type, &dtypes, &PyType_Type, &tensor_type)) return NULL;
  Py_XSETREF(st->dtypes, Py_NewRef(dtypes));
  Py_XSETREF(st->tensor_type, Py_NewRef(tensor_type));
  init_tensor_path(st);
  Py_RETURN_NONE;
}

static const char *const path_names[] = {[FDP_TENSOR_PATH_PYTHON] = "python", [FDP_TENSOR_PATH_AOTI] = "aoti"};

/* tensor_path() -> (name, why): how tensors become descriptors, "aoti" (libtorch's C shim) or "python". */
static PyObject *py_tensor_path(PyObject *module, PyObject *unused) {
  (void)module;
  (void)unused;
  return Py_BuildValue("(ss)", path_names[fdp__tensor_path()], fdp__tensor_path_why());
}

/* set_tensor_path(name) -> previous name: switches the path for the whole process (tests and benchmarks). */
static PyObject *py_set_tensor_path(PyObject *module, PyObject *arg) {
  (void)module;
  const char *name = PyUnicode_Check(arg) ? PyUnicode_AsUTF8(arg) : NULL;
  fdp__tensor_path_t previous = fdp__tensor_path();
  for (int p = 0; name && p < (int)(sizeof path_names / sizeof *path_names); p++)
    if (strcmp(name, path_names[p]) == 0)
      return fdp__set_tensor_path((fdp__tensor_path_t)p) < 0 ? NULL : PyUnicode_FromString(path_names[previous]);
  if (!PyErr_Occurred())
    PyErr_Format(PyExc_ValueError, "set_tensor_path: expected \"aoti\" or \"python\", got %R", arg);
  return NULL;
}

/* One descriptor as (data, device, dtype, elem_size, sizes, strides). */
static PyObject *descriptor_tuple(const fdp_tensor_t *t) {
  PyObject *sizes = PyTuple_New(t->ndim), *strides = PyTuple_New(t->ndim);
  for (int d = 0; sizes && strides && d < t->ndim; d++) {
    PyTuple_SET_ITEM(sizes, d, PyLong_FromLongLong(t->sizes[d]));
    PyTuple_SET_ITEM(strides, d, PyLong_FromLongLong(t->strides[d]));
  }
  if (!sizes || !strides) {
    Py_XDECREF(sizes);
    Py_XDECREF(strides);
    return NULL;
  }
  return Py_BuildValue("(KiiiNN)", (unsigned long long)(uintptr_t)t->data, t->device, t->dtype, t->elem_size, sizes,
                       strides);
}

/* describe(tensors) -> [(data, device, dtype, elem_size, sizes, strides)]: the descriptors the core would get. */
static PyObject *py_describe(PyObject *module, PyObject *args) {
  module_state *st = get_state(module);
  fdp__tensor_list_t ts = FDP_ARG("tensors");
  if (!PyArg_ParseTuple(args, "O&:describe", fdp__tensor_list_converter, &ts)) return NULL;
  PyObject *ret = PyList_New(ts.n);
  for (Py_ssize_t i = 0; ret && i < ts.n; i++) {
    PyObject *v = descriptor_tuple(&ts.t[i]);
    if (!v)
      Py_CLEAR(ret);
    else
      PyList_SET_ITEM(ret, i, v);
  }
  fdp__tensor_list_clear(&ts);
  return ret;
}

/* views(flat, spec) -> list or None: see fdp__aoti_views; spec is any buffer of int64 (array('q'), bytes). */
static PyObject *py_views(PyObject *module, PyObject *args) {
  module_state *st = get_state(module);
  PyObject *flat;
  Py_buffer spec;
  if (!PyArg_ParseTuple(args, "Oy*:views", &flat, &spec)) return NULL;
  PyObject *ret = NULL;
  int64_t *copy = NULL; /* a buffer not aligned for int64 (a slice of bytes) is read from an aligned copy */
  if (spec.len % (Py_ssize_t)sizeof(int64_t) != 0)
    PyErr_Format(PyExc_ValueError, "views: spec must hold int64 values, got %zd bytes", spec.len);
  else if ((uintptr_t)spec.buf % _Alignof(int64_t) != 0 && !(copy = PyMem_Malloc((size_t)spec.len)))
    PyErr_NoMemory();
  else
    ret = fdp__aoti_views(st, flat, copy ? memcpy(copy, spec.buf, (size_t)spec.len) : spec.buf,
                          spec.len / (Py_ssize_t)sizeof(int64_t));
  PyMem_Free(copy);
  PyBuffer_Release(&spec);
  return ret;
}

static PyObject *py_dtype_codes(PyObject *module, PyObject *unused) {
  (void)module;
  (void)unused;
  PyObject *d = PyDict_New();
  for (int i = 0; d && i < FDP_DTYPE_COUNT; i++) {
    PyObject *v = PyLong_FromLong(i);
    if (!v || PyDict_SetItemString(d, fdp_dtype_name(i), v) < 0) Py_CLEAR(d);
    Py_XDECREF(v);
  }
  return d;
}

/* usable(name) -> (bool, why): whether a backend can run now, from the core's own check, which loads libraries
 * and counts devices but touches no GPU (unlike info(), which lists every device). */
static PyObject *py_usable(PyObject *module, PyObject *arg) {
  (void)module;
  const char *name = PyUnicode_Check(arg) ? PyUnicode_AsUTF8(arg) : NULL;
  if (!name) {
    if (!PyErr_Occurred())
      PyErr_Format(PyExc_TypeError, "usable: expected a backend name, got %s", Py_TYPE(arg)->tp_name);
    return NULL;
  }
  for (int i = 0; i < FDP_BACKEND_COUNT; i++) {
    if (strcmp(name, fdp_backend_name((fdp_backend_id_t)i)) != 0) continue;
    const char *why = "";
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = fdp_backend_usable((fdp_backend_id_t)i, &why);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(Os)", ok ? Py_True : Py_False, ok ? "" : why);
  }
  PyErr_Format(PyExc_ValueError, "usable: unknown backend %R (expected \"host\", \"cuda\" or \"nccl\")", arg);
  return NULL;
}

/* info(memory=False): free memory is read only on devices whose primary context is already active (PyTorch or
 * fastdp used them), unless memory=True, which creates a context on every other device for the query (seconds and
 * hundreds of MB per GPU while it lives; fails under exclusive-process mode). free_bytes is None where not read. */
/* {name: {"compiled", "usable", "why"}} for every backend. */
static PyObject *backends_info(void) {
  PyObject *backends = PyDict_New();
  for (int i = 0; backends && i < FDP_BACKEND_COUNT; i++) {
    const char *why = "";
    int usable;
    Py_BEGIN_ALLOW_THREADS
    usable = fdp_backend_usable((fdp_backend_id_t)i, &why);
    Py_END_ALLOW_THREADS
    PyObject *v =
        Py_BuildValue("{s:O,s:O,s:s}", "compiled", fdp_backend_compiled((fdp_backend_id_t)i) ? Py_True : Py_False,
                      "usable", usable ? Py_True : Py_False, "why", why);
    if (!v || PyDict_SetItemString(backends, fdp_backend_name((fdp_backend_id_t)i), v) < 0) Py_CLEAR(backends);
    Py_XDECREF(v);
  }
  return backends;
}

/* One device's entry of info(): index, name, memory, peer access from it, and the error of the query. */
static PyObject *device_info(int d, int ndev, int memory) {
  fdp_device_facts_t f;
  fdp_result_t r;
  Py_BEGIN_ALLOW_THREADS
  r = fdp_device_facts(d, memory ? FDP_FREE_ALWAYS : FDP_FREE_IF_ACTIVE, &f);
  Py_END_ALLOW_THREADS
  PyObject *peers = PyList_New(ndev);
  for (int p = 0; peers && p < ndev; p++)
    PyList_SET_ITEM(peers, p, PyBool_FromLong(p == d || fdp_device_can_access_peer(d, p)));
  PyObject *free_obj =
      peers ? (f.free_read && r == FDP_OK ? PyLong_FromUnsignedLongLong(f.free_bytes) : Py_NewRef(Py_None)) : NULL;
  PyObject *v = free_obj ? Py_BuildValue("{s:i,s:s,s:K,s:N,s:N,s:s}", "index", d, "name", f.name, "total_bytes",
                                         (unsigned long long)f.total_bytes, "free_bytes", free_obj, "peer_access",
                                         peers, "error", r == FDP_OK ? "" : fdp_last_error())
                         : NULL;
  if (!free_obj) Py_XDECREF(peers);
  return v;
}

static PyObject *py_info(PyObject *module, PyObject *args, PyObject *kwargs) {
  (void)module;
  static char *kwlist[] = {"memory", NULL};
  int memory = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|p:info", kwlist, &memory)) return NULL;
  PyObject *backends = backends_info();
  if (!backends) return NULL;
  fdp_library_facts_t cuda, nccl;
  Py_BEGIN_ALLOW_THREADS
  fdp_library_facts(FDP_BACKEND_CUDA, &cuda);
  fdp_library_facts(FDP_BACKEND_NCCL, &nccl);
  Py_END_ALLOW_THREADS
  PyObject *devices = PyList_New(0);
  for (int d = 0; devices && d < cuda.devices; d++) {
    PyObject *v = device_info(d, cuda.devices, memory);
    if (!v || PyList_Append(devices, v) < 0) Py_CLEAR(devices);
    Py_XDECREF(v);
  }
  if (!devices) {
    Py_DECREF(backends);
    return NULL;
  }
  return Py_BuildValue("{s:N,s:i,s:i,s:s,s:N}", "backends", backends, "cuda_driver_version", cuda.version,
                       "nccl_version", nccl.version, "nccl_library", nccl.library, "devices", devices);
}

static int is_finalizing(void) {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

/* shutdown(): a no-op while the interpreter finalizes (called from atexit or a __del__): the CUDA runtime may be
 * torn down already and ncclCommDestroy can hang then; the process exit reclaims everything anyway. */
static PyObject *py_shutdown(PyObject *module, PyObject *unused) {
  (void)module;
  (void)unused;
  if (is_finalizing()) Py_RETURN_FALSE;
  Py_BEGIN_ALLOW_THREADS
  fdp_shutdown();
  Py_END_ALLOW_THREADS
  Py_RETURN_TRUE;
}

/* ---- device scratch memory from PyTorch (see fdp_set_device_allocator) ----
 * The registered Python callable alloc(device, nbytes, stream_handle) returns a uint8 CUDA tensor of nbytes made by
 * PyTorch's caching allocator with that stream current; the tensor itself is the handle, dropped when the core
 * frees the memory, which returns the block to PyTorch's pool of that stream (stream-ordered, as the core needs).
 * The core calls in with the GIL released, no fastdp lock held and the device's primary context current (the one
 * PyTorch uses there, so its device guard has nothing to switch); taking the GIL here cannot deadlock. One
 * allocator per process, as in the core: a static, not module state. */
static PyObject *g_alloc_fn;
/* set_oom_error(cls, torch_oom): fastdp's CUDA out-of-memory exception (a CudaError that is also PyTorch's
 * OutOfMemoryError) and PyTorch's own class, which the allocator callback recognises. Process-wide, like the
 * allocator. */
static PyObject *g_torch_oom;

static void exception_text(char *err, size_t len) {
#if PY_VERSION_HEX >= 0x030C0000
  PyObject *exc = PyErr_GetRaisedException();
#else
  PyObject *type, *exc, *tb;
  PyErr_Fetch(&type, &exc, &tb);
  PyErr_NormalizeException(&type, &exc, &tb);
  Py_XDECREF(type);
  Py_XDECREF(tb);
#endif
  PyObject *str = exc ? PyObject_Str(exc) : NULL;
  const char *text = str ? PyUnicode_AsUTF8(str) : NULL;
  snprintf(err, len, "%s%s%s", exc ? Py_TYPE(exc)->tp_name : "error", text ? ": " : "", text ? text : "");
  Py_XDECREF(str);
  Py_XDECREF(exc);
  PyErr_Clear();
}

static int scratch_alloc_cb(void *ctx, int device, size_t bytes, void *stream, void **ptr, void **handle, char *err,
                            size_t err_len) {
  (void)ctx;
  if (is_finalizing()) {
    snprintf(err, err_len, "the Python interpreter is shutting down");
    return 1;
  }
  PyGILState_STATE gil = PyGILState_Ensure();
  int rc = 1;
  PyObject *t = NULL, *p = NULL;
  if (g_alloc_fn == NULL) {
    snprintf(err, err_len, "no allocator registered");
    goto out;
  }
  t = PyObject_CallFunction(g_alloc_fn, "inK", device, (Py_ssize_t)bytes, (unsigned long long)(uintptr_t)stream);
  p = t ? PyObject_CallMethod(t, "data_ptr", NULL) : NULL;
  if (p != NULL) {
    unsigned long long v = PyLong_AsUnsignedLongLong(p);
    if (!PyErr_Occurred()) {
      *ptr = (void *)(uintptr_t)v;
      *handle = t;
      t = NULL;
      rc = 0;
    }
  }
  if (rc != 0) {
    if (g_torch_oom != NULL && PyErr_ExceptionMatches(g_torch_oom)) rc = FDP_ALLOC_OUT_OF_MEMORY;
    exception_text(err, err_len);
  }
out:
  Py_XDECREF(p);
  Py_XDECREF(t);
  PyGILState_Release(gil);
  return rc;
}

static void scratch_free_cb(void *ctx, int device, void *stream, void *handle) {
  (void)ctx;
  (void)device;
  (void)stream; /* the tensor was allocated with this very stream current: dropping it is stream-ordered */
  if (is_finalizing()) return; /* leaked on purpose: PyTorch's allocator may be gone */
  PyGILState_STATE gil = PyGILState_Ensure();
  Py_DECREF((PyObject *)handle);
  PyGILState_Release(gil);
}

/* set_oom_error(cls, torch_oom): see g_torch_oom above. */
static PyObject *py_set_oom_error(PyObject *module, PyObject *args) {
  PyObject *cls, *torch_oom;
  if (!PyArg_ParseTuple(args, "OO:set_oom_error", &cls, &torch_oom)) return NULL;
  module_state *st = get_state(module);
  if (!PyType_Check(cls) || !PyType_Check(torch_oom) || !PyObject_IsSubclass(cls, st->CudaError) ||
      !PyObject_IsSubclass(cls, torch_oom)) {
    PyErr_SetString(PyExc_TypeError, "set_oom_error(cls, torch_oom): cls must subclass both CudaError and torch_oom");
    return NULL;
  }
  Py_XSETREF(g_oom_error, Py_NewRef(cls));
  Py_XSETREF(g_torch_oom, Py_NewRef(torch_oom));
  Py_RETURN_NONE;
}

/* set_device_allocator(alloc or None): see the note above. */
static PyObject *py_set_device_allocator(PyObject *module, PyObject *fn) {
  (void)module;
  if (fn != Py_None && !PyCallable_Check(fn)) {
    PyErr_Format(PyExc_TypeError, "set_device_allocator: expected a callable or None, got %s", Py_TYPE(fn)->tp_name);
    return NULL;
  }
  static const fdp_allocator_t table = {scratch_alloc_cb, scratch_free_cb, NULL};
  fdp_set_device_allocator(fn == Py_None ? NULL : &table);
  Py_XSETREF(g_alloc_fn, fn == Py_None ? NULL : Py_NewRef(fn));
  Py_RETURN_NONE;
}

/* ---- kernels: NVRTC and its cache ---- */

static PyObject *py_kernels_info(PyObject *module, PyObject *unused) {
  (void)module;
  (void)unused;
  fdp_kernels_facts_t f;
  fdp_library_facts_t cuda;
  Py_BEGIN_ALLOW_THREADS
  fdp_kernels_facts(&f);
  fdp_library_facts(FDP_BACKEND_CUDA, &cuda);
  Py_END_ALLOW_THREADS
  PyObject *devices = PyList_New(cuda.devices);
  for (int d = 0; devices && d < cuda.devices; d++) {
    fdp_device_facts_t dev;
    fdp_device_facts(d, FDP_FREE_NEVER, &dev); /* a failed query leaves the source as far as it was read */
    PyObject *v = PyUnicode_FromString(dev.kernels_source);
    if (!v)
      Py_CLEAR(devices);
    else
      PyList_SET_ITEM(devices, d, v);
  }
  if (!devices) return NULL;
  return Py_BuildValue("{s:n,s:n,s:(ii),s:s,s:s,s:s,s:N}", "fatbin_bytes", (Py_ssize_t)f.fatbin_bytes, "source_bytes",
                       (Py_ssize_t)f.source_bytes, "nvrtc_version", f.nvrtc_major, f.nvrtc_minor, "nvrtc_library",
                       f.nvrtc_library, "nvrtc_why", f.nvrtc_why, "cache_dir", f.cache_dir, "devices", devices);
}

static PyObject *py_nvrtc_search_dirs(PyObject *module, PyObject *args) {
  const char *dirs;
  if (!PyArg_ParseTuple(args, "s:nvrtc_search_dirs", &dirs)) return NULL;
  fdp_result_t r = fdp_nvrtc_search_dirs(dirs);
  if (r != FDP_OK) return raise_result(get_state(module), r);
  Py_RETURN_NONE;
}

static PyObject *py_kernels_image(PyObject *module, PyObject *args) {
  int cc, forget = 0;
  if (!PyArg_ParseTuple(args, "i|p:kernels_image", &cc, &forget)) return NULL;
  fdp_kernels_image_info_t info;
  fdp_result_t r;
  Py_BEGIN_ALLOW_THREADS
  r = fdp_kernels_image(cc, forget, &info);
  Py_END_ALLOW_THREADS
  if (r != FDP_OK) return raise_result(get_state(module), r);
  static const char *const origins[] = {"disk", "compiled", "memory"};
  return Py_BuildValue("{s:n,s:s,s:i,s:s,s:d,s:s,s:s}", "bytes", (Py_ssize_t)info.bytes, "target",
                       info.ptx ? "ptx" : "cubin", "arch", info.arch, "origin", origins[info.origin], "seconds",
                       info.seconds, "file", info.file, "note", info.note);
}

/* ---- route: which backend the core picks ---- */

/* route(op, devices, dtype=uint8 code) -> "nccl" | "cuda" | "host": the backend the core runs `op` ("broadcast"
 * from devices[0], "reduce" onto devices[0]) on for one flat buffer per device (ints; -1 is the host). */
static PyObject *py_route(PyObject *module, PyObject *args) {
  const char *name;
  PyObject *seq;
  int dtype = FDP_DTYPE_U8, devs[FDP_MAX_DEVICES];
  if (!PyArg_ParseTuple(args, "sO|i:route", &name, &seq, &dtype)) return NULL;
  fdp_op_t op = strcmp(name, "broadcast") == 0 ? FDP_OP_BROADCAST : FDP_OP_REDUCE;
  if (op == FDP_OP_REDUCE && strcmp(name, "reduce") != 0)
    return PyErr_Format(PyExc_ValueError, "route: unknown operation %R (expected \"broadcast\" or \"reduce\")",
                        PyTuple_GET_ITEM(args, 0));
  PyObject *fast = PySequence_Fast(seq, "route: devices must be a sequence of ints");
  if (!fast) return NULL;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  for (Py_ssize_t i = 0; i < n && i < FDP_MAX_DEVICES; i++) {
    long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(fast, i));
    devs[i] = v < FDP_HOST || v >= FDP_MAX_DEVICES ? FDP_MAX_DEVICES : (int)v; /* out of range: the core says so */
  }
  Py_DECREF(fast);
  if (PyErr_Occurred()) return NULL;
  fdp_backend_id_t id = FDP_BACKEND_HOST;
  fdp_result_t r;
  Py_BEGIN_ALLOW_THREADS
  r = fdp_route_devices(op, devs, n > FDP_MAX_DEVICES ? FDP_MAX_DEVICES + 1 : (int)n, dtype, &id);
  Py_END_ALLOW_THREADS
  if (r != FDP_OK) return raise_result(get_state(module), r);
  return PyUnicode_FromString(fdp_backend_name(id));
}

static PyMethodDef methods[] = {
    {"copy", py_copy, METH_VARARGS, "copy(dsts, srcs, streams=None): dst[i] = src[i] element-wise"},
    {"broadcast", py_broadcast, METH_VARARGS, "broadcast(src, dsts, streams=None)"},
    {"reduce", py_reduce, METH_VARARGS, "reduce(inputs, out, streams=None): out = sum(inputs) in order"},
    {"scatter", py_scatter, METH_VARARGS, "scatter(src, outs, dim, chunk_sizes, streams=None)"},
    {"gather", py_gather, METH_VARARGS, "gather(inputs, out, dim, streams=None)"},
    {"reduce_many", py_reduce_many, METH_VARARGS, "reduce_many(columns, outs, streams=None)"},
    {"reduce_rows", py_reduce_rows, METH_VARARGS,
     "reduce_rows(grads, k, out) -> bool: per-member sums into a flat out"},
    {"refresh", py_refresh, METH_VARARGS,
     "refresh(pairs, owned, nmirrored=0, seen=None) -> pairs walked: replica __dict__ = master's, owned kept"},
    {"refresh_records", py_refresh_records, METH_VARARGS,
     "refresh_records(npairs, nmirrored) -> the zeroed seen buffer of refresh()"},
    {"version_sum", py_version_sum, METH_O, "version_sum(tensors) -> sum of their _version counters"},
    {"clear_hooks", py_clear_hooks, METH_O, "clear_hooks(tensors) -> how many _backward_hooks dicts were emptied"},
    {"rebind", py_rebind, METH_VARARGS, "rebind(containers, keys, values): containers[i][keys[i]] = values[i]"},
    {"walk", fdp__py_walk, METH_O, "walk(root) -> (modules, structure signature)"},
    {"matches", fdp__py_matches, METH_VARARGS, "matches(modules, signature) -> whether walk(modules[0]) gives both"},
    {"plan", py_plan, METH_VARARGS, "plan(tensors, type_keys, bucket_bytes) -> buckets"},
    {"set_dtypes", py_set_dtypes, METH_VARARGS, "set_dtypes({torch.dtype: code}, torch.Tensor)"},
    {"dtype_codes", py_dtype_codes, METH_NOARGS, "{name: code} of the dtypes the core reduces"},
    {"tensor_path", py_tensor_path, METH_NOARGS, "tensor_path() -> (\"aoti\" or \"python\", why)"},
    {"set_tensor_path", py_set_tensor_path, METH_O, "set_tensor_path(\"aoti\" or \"python\") -> previous"},
    {"views", py_views, METH_VARARGS, "views(flat, spec) -> tensors shaped by spec over flat, or None (use torch)"},
    {"describe", py_describe, METH_VARARGS, "describe(tensors) -> [(data, device, dtype, elem_size, sizes, strides)]"},
    {"info", (PyCFunction)(void (*)(void))py_info, METH_VARARGS | METH_KEYWORDS,
     "info(memory=False): backends, driver and NCCL versions, devices (free memory only where asked or active)"},
    {"usable", py_usable, METH_O, "usable(name) -> (bool, why): whether a backend can run now; touches no GPU"},
    {"shutdown", py_shutdown, METH_NOARGS,
     "release communicators and device state; False (nothing done) while the interpreter finalizes"},
    {"set_oom_error", py_set_oom_error, METH_VARARGS,
     "set_oom_error(cls, torch_oom): the exception raised for CUDA out of memory, and PyTorch's OutOfMemoryError"},
    {"set_device_allocator", py_set_device_allocator, METH_O,
     "set_device_allocator(alloc or None): alloc(device, nbytes, stream) -> uint8 CUDA tensor for core scratch"},
    {"kernels_info", py_kernels_info, METH_NOARGS, "fatbin size, NVRTC library and version, cache folder, sources"},
    {"nvrtc_search_dirs", py_nvrtc_search_dirs, METH_VARARGS, "nvrtc_search_dirs('dir1:dir2'): before first use"},
    {"kernels_image", py_kernels_image, METH_VARARGS,
     "kernels_image(cc, forget=False) -> dict: the NVRTC image for sm_<cc> (memory, disk cache or compiled)"},
    {"route", py_route, METH_VARARGS, "route(op, devices, dtype=uint8) -> backend name the core picks"},
    {NULL, NULL, 0, NULL},
};

static int add_error(PyObject *m, PyObject **slot, const char *name, PyObject *base, const char *doc) {
  char full[128];
  snprintf(full, sizeof full, "fastdp.%s", name);
  *slot = PyErr_NewExceptionWithDoc(full, doc, base, NULL);
  if (!*slot) return -1;
  return PyModule_AddObjectRef(m, name, *slot);
}

static int exec_module(PyObject *m) {
  module_state *st = get_state(m);
  st->itemsizes = PyDict_New();
  if (!st->itemsizes) return -1;
#define FDP_INTERN(name)                                                                                               \
  if (!(st->s_##name = PyUnicode_InternFromString(#name))) return -1;
  FDP_INTERN(data_ptr)
  FDP_INTERN(shape)
  FDP_INTERN(stride)
  FDP_INTERN(dtype)
  FDP_INTERN(is_cuda)
  FDP_INTERN(get_device)
  FDP_INTERN(device)
  FDP_INTERN(type)
  FDP_INTERN(itemsize)
#undef FDP_INTERN
  if (add_error(m, &st->FastDPError, "FastDPError", PyExc_RuntimeError,
                "A CUDA, NCCL or internal failure in fastdp's core; .code names the result.") < 0 ||
      add_error(m, &st->CudaError, "CudaError", st->FastDPError, "A CUDA driver call failed.") < 0 ||
      add_error(m, &st->NcclError, "NcclError", st->FastDPError, "An NCCL call failed.") < 0 ||
      add_error(m, &st->BackendUnavailableError, "BackendUnavailableError", st->FastDPError,
                "The backend an operation needs is not compiled or cannot run here.") < 0)
    return -1;
  return 0;
}

static int traverse(PyObject *m, visitproc visit, void *arg) {
  module_state *st = get_state(m);
  Py_VISIT(st->dtypes);
  Py_VISIT(st->itemsizes);
  Py_VISIT(st->tensor_type);
  Py_VISIT(st->parameter_type);
  Py_VISIT(st->to_handles);
  Py_VISIT(st->from_handles);
  Py_VISIT(st->FastDPError);
  Py_VISIT(st->CudaError);
  Py_VISIT(st->NcclError);
  Py_VISIT(st->BackendUnavailableError);
  return 0;
}

static int clear(PyObject *m) {
  module_state *st = get_state(m);
  Py_CLEAR(st->dtypes);
  Py_CLEAR(st->itemsizes);
  Py_CLEAR(st->tensor_type);
  Py_CLEAR(st->parameter_type);
  Py_CLEAR(st->to_handles);
  Py_CLEAR(st->from_handles);
  Py_CLEAR(st->s_data_ptr);
  Py_CLEAR(st->s_shape);
  Py_CLEAR(st->s_stride);
  Py_CLEAR(st->s_dtype);
  Py_CLEAR(st->s_is_cuda);
  Py_CLEAR(st->s_get_device);
  Py_CLEAR(st->s_device);
  Py_CLEAR(st->s_type);
  Py_CLEAR(st->s_itemsize);
  Py_CLEAR(st->FastDPError);
  Py_CLEAR(st->CudaError);
  Py_CLEAR(st->NcclError);
  Py_CLEAR(st->BackendUnavailableError);
  return 0;
}

static void free_module(void *m) {
  clear((PyObject *)m);
  if (g_alloc_fn != NULL) { /* the core must not call into a module that is gone */
    fdp_set_device_allocator(NULL);
    Py_CLEAR(g_alloc_fn);
  }
}

static PyModuleDef_Slot slots[] = {{Py_mod_exec, exec_module}, {0, NULL}};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT,
    "fastdp._C",
    "fastdp's C core binding",
    sizeof(module_state),
    methods,
    slots,
    traverse,
    clear,
    free_module,
};

PyMODINIT_FUNC PyInit__C(void) {
  return PyModuleDef_Init(&moduledef);
}
