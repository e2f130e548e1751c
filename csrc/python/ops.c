/* SPDX-License-Identifier: MIT */
/* fastdp._C's operations: each parses its arguments with the converters of tensors.c, calls one core function with
 * the GIL released, and raises the core's result (errors.c). */
#include "binding.h"

#include <string.h>

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
  return fdp__none_or_raise(st, r);
}

/* copy(dsts, srcs, streams=None) */
static PyObject *py_copy(PyObject *module, PyObject *args) {
  module_state *st = fdp__state(module);
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
  return fdp__none_or_raise(st, r);
}

/* broadcast(src, dsts, streams=None) */
static PyObject *py_broadcast(PyObject *module, PyObject *args) {
  module_state *st = fdp__state(module);
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
  return fdp__none_or_raise(st, r);
}

/* reduce(inputs, out, streams=None) */
static PyObject *py_reduce(PyObject *module, PyObject *args) {
  module_state *st = fdp__state(module);
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
  return fdp__none_or_raise(st, r);
}

/* scatter(src, outs, dim, chunk_sizes, streams=None) */
static PyObject *py_scatter(PyObject *module, PyObject *args) {
  module_state *st = fdp__state(module);
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
  return fdp__none_or_raise(st, r);
}

/* gather(inputs, out, dim, streams=None) */
static PyObject *py_gather(PyObject *module, PyObject *args) {
  module_state *st = fdp__state(module);
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
    ret = r == FDP_OK ? plan_to_list(plan) : fdp__raise(st, r);
  }
  fdp_plan_free(plan);
  PyMem_Free(keys);
  return ret;
}

/* plan(tensors, type_keys, bucket_bytes) -> [(numel, [(index, offset, numel), ...]), ...] */
static PyObject *py_plan(PyObject *module, PyObject *args) {
  module_state *st = fdp__state(module);
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
  return fdp__none_or_raise(st, r);
}

/* reduce_many(columns, outs, streams=None): outs[j] = sum of columns[j], one core reduce per column, with the GIL
 * released once for the whole set (the per-bucket gradient reduction of DataParallel). */
static PyObject *py_reduce_many(PyObject *module, PyObject *args) {
  module_state *st = fdp__state(module);
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

PyMethodDef fdp__ops_methods[] = {
    {"copy", py_copy, METH_VARARGS, "copy(dsts, srcs, streams=None): dst[i] = src[i] element-wise"},
    {"broadcast", py_broadcast, METH_VARARGS, "broadcast(src, dsts, streams=None)"},
    {"reduce", py_reduce, METH_VARARGS, "reduce(inputs, out, streams=None): out = sum(inputs) in order"},
    {"scatter", py_scatter, METH_VARARGS, "scatter(src, outs, dim, chunk_sizes, streams=None)"},
    {"gather", py_gather, METH_VARARGS, "gather(inputs, out, dim, streams=None)"},
    {"reduce_many", py_reduce_many, METH_VARARGS, "reduce_many(columns, outs, streams=None)"},
    {"plan", py_plan, METH_VARARGS, "plan(tensors, type_keys, bucket_bytes) -> buckets"},
    {NULL, NULL, 0, NULL},
};
