/* SPDX-License-Identifier: MIT */
/* fastdp._C: the only C that includes Python.h. Turns tensors into core descriptors through the tensor's public
 * Python API (no PyTorch C++ ABI, so one build serves every torch 2.x), releases the GIL around the core, and
 * turns result codes into exceptions in one place. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "core/fastdp.h"

#include <string.h>

typedef struct {
  PyObject *dtypes;      /* dict: torch.dtype -> fdp_dtype_t */
  PyObject *itemsizes;   /* dict: torch.dtype -> bytes per element, filled on first sight */
  PyObject *tensor_type; /* torch.Tensor */
  PyObject *FastDPError, *CudaError, *NcclError, *BackendUnavailableError;
  /* Interned attribute names: describe() runs for every tensor of every call. */
  PyObject *s_data_ptr, *s_shape, *s_stride, *s_dtype, *s_is_cuda, *s_get_device, *s_device, *s_type, *s_itemsize;
} module_state;

static module_state *get_state(PyObject *module) {
  return (module_state *)PyModule_GetState(module);
}

/* ---- errors ---- */

static PyObject *g_oom_error; /* see set_oom_error below */

static PyObject *raise_result(module_state *st, fdp_result_t r) {
  int status = r == FDP_CUDA || r == FDP_NCCL ? fdp_last_status() : 0; /* the library's code; 0: none */
  PyObject *type;
  switch (r) {
  case FDP_INVALID: type = PyExc_ValueError; break;
  case FDP_DTYPE: type = PyExc_TypeError; break;
  case FDP_NOMEM: type = PyExc_MemoryError; break;
  case FDP_OVERLAP: type = PyExc_RuntimeError; break; /* PyTorch raises RuntimeError for overlapping writes */
  case FDP_UNAVAILABLE: type = st->BackendUnavailableError; break;
  case FDP_CUDA: type = status == FDP_CUDA_OUT_OF_MEMORY && g_oom_error ? g_oom_error : st->CudaError; break;
  case FDP_NCCL: type = st->NcclError; break;
  default: type = st->FastDPError; break;
  }
  PyObject *exc = PyObject_CallFunction(type, "s", fdp_last_error());
  if (!exc) return NULL;
  PyObject *code = PyUnicode_FromString(fdp_result_name(r));
  if (!code || PyObject_SetAttrString(exc, "code", code) < 0) PyErr_Clear();
  Py_XDECREF(code);
  /* .status: the library's own code (CUresult, ncclResult_t), as CuPy's CUDADriverError.status; None otherwise. */
  PyObject *status_obj = status != 0 ? PyLong_FromLong(status) : Py_NewRef(Py_None);
  if (!status_obj || PyObject_SetAttrString(exc, "status", status_obj) < 0) PyErr_Clear();
  Py_XDECREF(status_obj);
  PyErr_SetObject(type, exc);
  Py_DECREF(exc);
  return NULL;
}

/* ---- tensors to descriptors ---- */

static int int_tuple(PyObject *seq, int64_t *out, int *n, const char *what) {
  if (PyTuple_Check(seq)) { /* torch.Size and stride() results: no copy */
    Py_ssize_t len = PyTuple_GET_SIZE(seq);
    if (len > FDP_MAX_DIMS) {
      PyErr_Format(PyExc_ValueError, "tensors with more than %d dimensions are not supported", FDP_MAX_DIMS);
      return -1;
    }
    for (Py_ssize_t i = 0; i < len; i++) {
      out[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(seq, i));
      if (out[i] == -1 && PyErr_Occurred()) return -1;
    }
    *n = (int)len;
    return 0;
  }
  PyObject *fast = PySequence_Fast(seq, what);
  if (!fast) return -1;
  Py_ssize_t len = PySequence_Fast_GET_SIZE(fast);
  if (len > FDP_MAX_DIMS) {
    Py_DECREF(fast);
    PyErr_Format(PyExc_ValueError, "tensors with more than %d dimensions are not supported", FDP_MAX_DIMS);
    return -1;
  }
  for (Py_ssize_t i = 0; i < len; i++) {
    out[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
    if (out[i] == -1 && PyErr_Occurred()) {
      Py_DECREF(fast);
      return -1;
    }
  }
  *n = (int)len;
  Py_DECREF(fast);
  return 0;
}

static int call_int(PyObject *obj, PyObject *name, long long *out) {
  PyObject *v = PyObject_CallMethodNoArgs(obj, name);
  if (!v) return -1;
  *out = PyLong_AsLongLong(v);
  Py_DECREF(v);
  return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* Bytes per element of a torch.dtype, cached per dtype. */
static int itemsize_of(module_state *st, PyObject *dtype, int *out) {
  PyObject *v = PyDict_GetItemWithError(st->itemsizes, dtype);
  if (!v) {
    if (PyErr_Occurred()) return -1;
    v = PyObject_GetAttr(dtype, st->s_itemsize);
    if (!v || PyDict_SetItem(st->itemsizes, dtype, v) < 0) {
      Py_XDECREF(v);
      return -1;
    }
    Py_DECREF(v);
  }
  *out = (int)PyLong_AsLong(v);
  return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* The device ordinal of a tensor: its CUDA index, or FDP_HOST for a CPU tensor; ValueError for any other device. */
static int tensor_device(module_state *st, PyObject *obj, const char *name, long long *dev) {
  PyObject *flag = PyObject_GetAttr(obj, st->s_is_cuda);
  if (!flag) return -1;
  int is_cuda = PyObject_IsTrue(flag);
  Py_DECREF(flag);
  *dev = FDP_HOST;
  if (is_cuda) return call_int(obj, st->s_get_device, dev);
  PyObject *device = PyObject_GetAttr(obj, st->s_device);
  PyObject *kind = device ? PyObject_GetAttr(device, st->s_type) : NULL;
  Py_XDECREF(device);
  if (!kind) return -1;
  int is_cpu = PyUnicode_Check(kind) && PyUnicode_CompareWithASCIIString(kind, "cpu") == 0;
  if (!is_cpu)
    PyErr_Format(PyExc_ValueError, "%s is on a %S device; fastdp moves CPU and CUDA tensors only", name, kind);
  Py_DECREF(kind);
  return is_cpu ? 0 : -1;
}

/* Sizes, strides and ndim of a tensor into t. */
static int tensor_layout(module_state *st, PyObject *obj, const char *name, fdp_tensor_t *t) {
  PyObject *shape = PyObject_GetAttr(obj, st->s_shape);
  PyObject *stride = shape ? PyObject_CallMethodNoArgs(obj, st->s_stride) : NULL;
  int nd = 0, ns = 0;
  int bad = !stride || int_tuple(shape, t->sizes, &nd, "shape") < 0 || int_tuple(stride, t->strides, &ns, "stride") < 0;
  Py_XDECREF(shape);
  Py_XDECREF(stride);
  if (bad) return -1;
  if (nd != ns) {
    PyErr_Format(PyExc_ValueError, "%s has %d sizes but %d strides", name, nd, ns);
    return -1;
  }
  t->ndim = nd;
  return 0;
}

/* The core's dtype code (FDP_DTYPE_OTHER for a dtype it does not sum) and the element size of a tensor into t. */
static int tensor_dtype(module_state *st, PyObject *obj, fdp_tensor_t *t) {
  PyObject *dtype = PyObject_GetAttr(obj, st->s_dtype);
  if (!dtype) return -1;
  PyObject *code = PyDict_GetItemWithError(st->dtypes, dtype);
  int esz = 0;
  if ((!code && PyErr_Occurred()) || itemsize_of(st, dtype, &esz) < 0) {
    Py_DECREF(dtype);
    return -1;
  }
  Py_DECREF(dtype);
  t->dtype = code ? (int)PyLong_AsLong(code) : FDP_DTYPE_OTHER;
  t->elem_size = esz;
  return 0;
}

/* Fills `t` from a CPU or CUDA torch.Tensor. `what` names the argument in errors, as what[index] for a list
 * element or alone when index is -1 (a single tensor argument). */
static int describe(module_state *st, PyObject *obj, fdp_tensor_t *t, const char *what, Py_ssize_t index) {
  char name[128];
  if (index < 0)
    snprintf(name, sizeof name, "%s", what);
  else
    snprintf(name, sizeof name, "%s[%zd]", what, index);
  memset(t, 0, sizeof *t);
  if (!st->tensor_type) {
    PyErr_SetString(PyExc_RuntimeError, "fastdp._C.set_dtypes() must be called first (import fastdp)");
    return -1;
  }
  int is_tensor = PyObject_IsInstance(obj, st->tensor_type);
  if (is_tensor <= 0) {
    if (is_tensor == 0)
      PyErr_Format(PyExc_TypeError, "%s must be a torch.Tensor, got %s", name, Py_TYPE(obj)->tp_name);
    return -1;
  }
  long long dev, ptr;
  if (tensor_device(st, obj, name, &dev) < 0 || call_int(obj, st->s_data_ptr, &ptr) < 0) return -1;
  if (tensor_layout(st, obj, name, t) < 0 || tensor_dtype(st, obj, t) < 0) return -1;
  t->data = (char *)(intptr_t)ptr;
  t->device = (int)dev;
  return 0;
}

/* A sequence of tensors → a new array of descriptors (PyMem_Free it). *keep receives a tuple holding every
 * tensor described (Py_DECREF it after the operation): the memory the descriptors point to stays alive while
 * the GIL is released, even if the caller's sequence was an iterator or is changed by another thread. */
static fdp_tensor_t *describe_list(module_state *st, PyObject *seq, Py_ssize_t *n, const char *what, PyObject **keep) {
  *keep = NULL;
  if (PyObject_IsInstance(seq, st->tensor_type) > 0 || PyUnicode_Check(seq) || PyBytes_Check(seq)) {
    PyErr_Format(PyExc_TypeError, "%s must be a sequence of tensors, got %s", what, Py_TYPE(seq)->tp_name);
    return NULL;
  }
  PyObject *items = PySequence_Tuple(seq);
  if (!items) {
    if (PyErr_ExceptionMatches(PyExc_TypeError)) {
      PyErr_Clear();
      PyErr_Format(PyExc_TypeError, "%s must be a sequence of tensors, got %s", what, Py_TYPE(seq)->tp_name);
    }
    return NULL;
  }
  Py_ssize_t len = PyTuple_GET_SIZE(items);
  fdp_tensor_t *ts = PyMem_Calloc((size_t)(len ? len : 1), sizeof *ts);
  if (!ts) {
    Py_DECREF(items);
    PyErr_NoMemory();
    return NULL;
  }
  for (Py_ssize_t i = 0; i < len; i++) {
    if (describe(st, PyTuple_GET_ITEM(items, i), &ts[i], what, i) < 0) {
      PyMem_Free(ts);
      Py_DECREF(items);
      return NULL;
    }
  }
  *n = len;
  *keep = items;
  return ts;
}

/* None, or a sequence of (device, stream handle) pairs. */
static int parse_streams(PyObject *obj, fdp_streams_t *s) {
  memset(s, 0, sizeof *s);
  if (!obj || obj == Py_None) return 0;
  PyObject *fast = PySequence_Fast(obj, "streams must be a sequence of (device, handle) pairs");
  if (!fast) return -1;
  Py_ssize_t len = PySequence_Fast_GET_SIZE(fast);
  if (len > FDP_MAX_DEVICES) {
    Py_DECREF(fast);
    PyErr_Format(PyExc_ValueError, "at most %d streams", FDP_MAX_DEVICES);
    return -1;
  }
  for (Py_ssize_t i = 0; i < len; i++) {
    int dev;
    unsigned long long handle;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "iK", &dev, &handle)) {
      Py_DECREF(fast);
      return -1;
    }
    s->device[i] = dev;
    s->stream[i] = (void *)(uintptr_t)handle;
  }
  s->n = (int)len;
  Py_DECREF(fast);
  return 0;
}

static int check_count(Py_ssize_t n) {
  if (n > INT32_MAX / 4) {
    PyErr_SetString(PyExc_ValueError, "too many tensors in one call");
    return -1;
  }
  return 0;
}

/* ---- entry points: parse, release the GIL, call the core ---- */

static PyObject *py_copy(PyObject *module, PyObject *args) {
  module_state *st = get_state(module);
  PyObject *dsts, *srcs, *streams_obj = Py_None;
  if (!PyArg_ParseTuple(args, "OO|O:copy", &dsts, &srcs, &streams_obj)) return NULL;
  fdp_streams_t streams;
  Py_ssize_t nd = 0, ns = 0;
  if (parse_streams(streams_obj, &streams) < 0) return NULL;
  PyObject *keep_d = NULL, *keep_s = NULL;
  fdp_tensor_t *d = describe_list(st, dsts, &nd, "dst", &keep_d);
  fdp_tensor_t *s = d ? describe_list(st, srcs, &ns, "src", &keep_s) : NULL;
  PyObject *ret = NULL;
  if (!s) goto done;
  if (nd != ns || check_count(nd) < 0) {
    if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "copy: %zd destinations for %zd sources", nd, ns);
    goto done;
  }
  fdp_result_t r;
  Py_BEGIN_ALLOW_THREADS
  r = fdp_op_copy(d, s, (int)nd, &streams);
  Py_END_ALLOW_THREADS
  if (r != FDP_OK)
    raise_result(st, r);
  else
    ret = Py_NewRef(Py_None);
done:
  PyMem_Free(d);
  PyMem_Free(s);
  Py_XDECREF(keep_d);
  Py_XDECREF(keep_s);
  return ret;
}

static PyObject *py_broadcast(PyObject *module, PyObject *args) {
  module_state *st = get_state(module);
  PyObject *src_obj, *dsts, *streams_obj = Py_None;
  if (!PyArg_ParseTuple(args, "OO|O:broadcast", &src_obj, &dsts, &streams_obj)) return NULL;
  fdp_streams_t streams;
  fdp_tensor_t src;
  Py_ssize_t nd = 0;
  if (parse_streams(streams_obj, &streams) < 0 || describe(st, src_obj, &src, "tensor", -1) < 0) return NULL;
  PyObject *keep;
  fdp_tensor_t *d = describe_list(st, dsts, &nd, "out", &keep);
  if (!d) return NULL;
  PyObject *ret = NULL;
  if (check_count(nd) == 0) {
    fdp_result_t r;
    Py_BEGIN_ALLOW_THREADS
    r = fdp_op_broadcast(&src, d, (int)nd, &streams);
    Py_END_ALLOW_THREADS
    if (r != FDP_OK)
      raise_result(st, r);
    else
      ret = Py_NewRef(Py_None);
  }
  PyMem_Free(d);
  Py_DECREF(keep);
  return ret;
}

static PyObject *py_reduce(PyObject *module, PyObject *args) {
  module_state *st = get_state(module);
  PyObject *ins, *out_obj, *streams_obj = Py_None;
  if (!PyArg_ParseTuple(args, "OO|O:reduce", &ins, &out_obj, &streams_obj)) return NULL;
  fdp_streams_t streams;
  fdp_tensor_t out;
  Py_ssize_t n = 0;
  if (parse_streams(streams_obj, &streams) < 0 || describe(st, out_obj, &out, "out", -1) < 0) return NULL;
  PyObject *keep;
  fdp_tensor_t *in = describe_list(st, ins, &n, "inputs", &keep);
  if (!in) return NULL;
  PyObject *ret = NULL;
  if (check_count(n) == 0) {
    fdp_result_t r;
    Py_BEGIN_ALLOW_THREADS
    r = fdp_op_reduce(in, (int)n, &out, &streams);
    Py_END_ALLOW_THREADS
    if (r != FDP_OK)
      raise_result(st, r);
    else
      ret = Py_NewRef(Py_None);
  }
  PyMem_Free(in);
  Py_DECREF(keep);
  return ret;
}

static PyObject *py_scatter(PyObject *module, PyObject *args) {
  module_state *st = get_state(module);
  PyObject *src_obj, *outs, *sizes_obj, *streams_obj = Py_None;
  int dim;
  if (!PyArg_ParseTuple(args, "OOiO|O:scatter", &src_obj, &outs, &dim, &sizes_obj, &streams_obj)) return NULL;
  fdp_streams_t streams;
  fdp_tensor_t src;
  Py_ssize_t n = 0;
  if (parse_streams(streams_obj, &streams) < 0 || describe(st, src_obj, &src, "tensor", -1) < 0) return NULL;
  PyObject *keep;
  fdp_tensor_t *o = describe_list(st, outs, &n, "out", &keep);
  if (!o) return NULL;
  PyObject *ret = NULL;
  int64_t *sizes = PyMem_Calloc((size_t)(n ? n : 1), sizeof *sizes);
  PyObject *fast = sizes ? PySequence_Fast(sizes_obj, "chunk_sizes must be a sequence") : NULL;
  if (!fast) goto done;
  if (PySequence_Fast_GET_SIZE(fast) != n || check_count(n) < 0) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "Expected devices and chunk_sizes to be of same length");
    goto done;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    sizes[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
    if (sizes[i] == -1 && PyErr_Occurred()) goto done;
  }
  fdp_result_t r;
  Py_BEGIN_ALLOW_THREADS
  r = fdp_op_scatter(&src, dim, sizes, o, (int)n, &streams);
  Py_END_ALLOW_THREADS
  if (r != FDP_OK)
    raise_result(st, r);
  else
    ret = Py_NewRef(Py_None);
done:
  Py_XDECREF(fast);
  PyMem_Free(sizes);
  PyMem_Free(o);
  Py_DECREF(keep);
  return ret;
}

static PyObject *py_gather(PyObject *module, PyObject *args) {
  module_state *st = get_state(module);
  PyObject *ins, *out_obj, *streams_obj = Py_None;
  int dim;
  if (!PyArg_ParseTuple(args, "OOi|O:gather", &ins, &out_obj, &dim, &streams_obj)) return NULL;
  fdp_streams_t streams;
  fdp_tensor_t out;
  Py_ssize_t n = 0;
  if (parse_streams(streams_obj, &streams) < 0 || describe(st, out_obj, &out, "out", -1) < 0) return NULL;
  PyObject *keep;
  fdp_tensor_t *in = describe_list(st, ins, &n, "tensors", &keep);
  if (!in) return NULL;
  PyObject *ret = NULL;
  if (check_count(n) == 0) {
    fdp_result_t r;
    Py_BEGIN_ALLOW_THREADS
    r = fdp_op_gather(in, (int)n, dim, &out, &streams);
    Py_END_ALLOW_THREADS
    if (r != FDP_OK)
      raise_result(st, r);
    else
      ret = Py_NewRef(Py_None);
  }
  PyMem_Free(in);
  Py_DECREF(keep);
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

/* plan(tensors, type_keys, bucket_bytes) -> [(numel, [(index, offset, numel), ...]), ...] */
static PyObject *py_plan(PyObject *module, PyObject *args) {
  module_state *st = get_state(module);
  PyObject *tensors, *keys_obj;
  PyObject *bytes_obj;
  if (!PyArg_ParseTuple(args, "OOO!:plan", &tensors, &keys_obj, &PyLong_Type, &bytes_obj)) return NULL;
  /* Checked, not taken modulo 2**64 as the "K" format would. */
  unsigned long long bucket_bytes = PyLong_AsUnsignedLongLong(bytes_obj);
  if (bucket_bytes == (unsigned long long)-1 && PyErr_Occurred()) {
    PyErr_Format(PyExc_OverflowError, "bucket size %S bytes does not fit in 64 bits; pass at most 2**64 - 1",
                 bytes_obj);
    return NULL;
  }
  Py_ssize_t n = 0;
  PyObject *keep;
  fdp_tensor_t *ts = describe_list(st, tensors, &n, "tensors", &keep);
  if (!ts) return NULL;
  PyObject *ret = NULL;
  fdp_plan_t *plan = NULL;
  int *keys = PyMem_Calloc((size_t)(n ? n : 1), sizeof *keys);
  if (!keys || check_count(n) < 0 || parse_keys(keys_obj, n, keys) < 0) goto done;
  fdp_result_t r = fdp_plan_build(ts, keys, (int)n, (size_t)bucket_bytes, &plan);
  if (r != FDP_OK) {
    raise_result(st, r);
    goto done;
  }
  ret = plan_to_list(plan);
done:
  fdp_plan_free(plan);
  PyMem_Free(keys);
  PyMem_Free(ts);
  Py_DECREF(keep);
  return ret;
}

/* The input columns of reduce_many: per column its descriptors (PyMem_Free), their count, and the tuple keeping
 * the tensors alive. */
typedef struct columns {
  Py_ssize_t n;
  fdp_tensor_t **ins;
  PyObject **keeps;
  Py_ssize_t *counts;
} columns_t;

static void columns_free(columns_t *c) {
  for (Py_ssize_t j = 0; c->ins && j < c->n; j++)
    PyMem_Free(c->ins[j]);
  for (Py_ssize_t j = 0; c->keeps && j < c->n; j++)
    Py_XDECREF(c->keeps[j]);
  PyMem_Free(c->ins);
  PyMem_Free(c->keeps);
  PyMem_Free(c->counts);
}

/* Describes every column of the sequence `cols` (of c->n items); columns_free releases what was made. */
static int columns_describe(module_state *st, PyObject *cols, columns_t *c) {
  size_t n = (size_t)(c->n ? c->n : 1);
  c->ins = PyMem_Calloc(n, sizeof *c->ins);
  c->keeps = PyMem_Calloc(n, sizeof *c->keeps);
  c->counts = PyMem_Calloc(n, sizeof *c->counts);
  if (!c->ins || !c->counts || !c->keeps) {
    PyErr_NoMemory();
    return -1;
  }
  for (Py_ssize_t j = 0; j < c->n; j++) {
    c->ins[j] = describe_list(st, PySequence_Fast_GET_ITEM(cols, j), &c->counts[j], "columns[j]", &c->keeps[j]);
    if (!c->ins[j] || check_count(c->counts[j]) < 0) return -1;
  }
  return 0;
}

/* outs[j] = sum of column j, for every column, stopping at the first failure (no GIL needed). */
static fdp_result_t reduce_columns(const columns_t *c, const fdp_tensor_t *outs, const fdp_streams_t *streams) {
  fdp_result_t r = FDP_OK;
  for (Py_ssize_t j = 0; j < c->n && r == FDP_OK; j++)
    r = fdp_op_reduce(c->ins[j], (int)c->counts[j], &outs[j], streams);
  return r;
}

/* reduce_many(columns, outs, streams=None): outs[j] = sum of columns[j], one core reduce per column, with the GIL
 * released once for the whole set (the per-bucket gradient reduction of DataParallel). */
static PyObject *py_reduce_many(PyObject *module, PyObject *args) {
  module_state *st = get_state(module);
  PyObject *cols_obj, *outs_obj, *streams_obj = Py_None;
  if (!PyArg_ParseTuple(args, "OO|O:reduce_many", &cols_obj, &outs_obj, &streams_obj)) return NULL;
  fdp_streams_t streams;
  if (parse_streams(streams_obj, &streams) < 0) return NULL;
  PyObject *cols = PySequence_Fast(cols_obj, "columns must be a sequence of sequences of tensors");
  if (!cols) return NULL;
  columns_t c = {PySequence_Fast_GET_SIZE(cols), NULL, NULL, NULL};
  Py_ssize_t nout = 0;
  PyObject *ret = NULL;
  PyObject *keep_outs = NULL;
  fdp_tensor_t *outs = describe_list(st, outs_obj, &nout, "outs", &keep_outs);
  if (!outs) goto done;
  if (nout != c.n || check_count(c.n) < 0) {
    if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "reduce_many: %zd outputs for %zd columns", nout, c.n);
    goto done;
  }
  if (columns_describe(st, cols, &c) < 0) goto done;
  fdp_result_t r;
  Py_BEGIN_ALLOW_THREADS
  r = reduce_columns(&c, outs, &streams);
  Py_END_ALLOW_THREADS
  if (r != FDP_OK)
    raise_result(st, r);
  else
    ret = Py_NewRef(Py_None);
done:
  columns_free(&c);
  Py_XDECREF(keep_outs);
  PyMem_Free(outs);
  Py_DECREF(cols);
  return ret;
}

/* One pair of refresh(): pairs[i], a (master, replica) tuple of dicts; at most 32 owned keys. */
static int refresh_pair(PyObject *pair, PyObject *owned, Py_ssize_t nowned, Py_ssize_t i) {
  PyObject *saved[32];
  if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 || !PyDict_Check(PyTuple_GET_ITEM(pair, 0)) ||
      !PyDict_Check(PyTuple_GET_ITEM(pair, 1))) {
    PyErr_Format(PyExc_TypeError, "refresh: pairs[%zd] must be a (dict, dict) tuple", i);
    return -1;
  }
  PyObject *master = PyTuple_GET_ITEM(pair, 0), *replica = PyTuple_GET_ITEM(pair, 1);
  for (Py_ssize_t k = 0; k < nowned; k++) {
    saved[k] = PyDict_GetItemWithError(replica, PySequence_Fast_GET_ITEM(owned, k));
    if (!saved[k] && PyErr_Occurred()) {
      for (Py_ssize_t q = 0; q < k; q++)
        Py_XDECREF(saved[q]);
      return -1;
    }
    Py_XINCREF(saved[k]);
  }
  PyDict_Clear(replica);
  int bad = PyDict_Update(replica, master) < 0;
  for (Py_ssize_t k = 0; k < nowned; k++) {
    if (saved[k] && !bad) bad = PyDict_SetItem(replica, PySequence_Fast_GET_ITEM(owned, k), saved[k]) < 0;
    Py_XDECREF(saved[k]);
  }
  return bad ? -1 : 0;
}

/* refresh(pairs, owned): for each (master_dict, replica_dict), makes the replica's __dict__ a fresh shallow copy of
 * the master's, as Module._replicate_for_data_parallel would, except for the keys in `owned`, which keep the
 * replica's own values (its parameter, buffer and child dicts). Persistent replicas thus see every attribute,
 * hook dict and training flag the master has now. */
static PyObject *py_refresh(PyObject *module, PyObject *args) {
  (void)module;
  PyObject *pairs_obj, *owned_obj;
  if (!PyArg_ParseTuple(args, "OO:refresh", &pairs_obj, &owned_obj)) return NULL;
  PyObject *pairs = PySequence_Fast(pairs_obj, "pairs must be a sequence of (dict, dict)");
  PyObject *owned = pairs ? PySequence_Fast(owned_obj, "owned must be a sequence of keys") : NULL;
  if (!owned) {
    Py_XDECREF(pairs);
    return NULL;
  }
  Py_ssize_t nowned = PySequence_Fast_GET_SIZE(owned);
  PyObject *ret = NULL;
  if (nowned > 32) {
    PyErr_SetString(PyExc_ValueError, "refresh: at most 32 owned keys");
    goto done;
  }
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(pairs); i++)
    if (refresh_pair(PySequence_Fast_GET_ITEM(pairs, i), owned, nowned, i) < 0) goto done;
  ret = Py_NewRef(Py_None);
done:
  Py_DECREF(pairs);
  Py_DECREF(owned);
  return ret;
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

static PyObject *py_set_dtypes(PyObject *module, PyObject *args) {
  module_state *st = get_state(module);
  PyObject *dtypes, *tensor_type;
  if (!PyArg_ParseTuple(args, "O!O!:set_dtypes", &PyDict_Type, &dtypes, &PyType_Type, &tensor_type)) return NULL;
  Py_XSETREF(st->dtypes, Py_NewRef(dtypes));
  Py_XSETREF(st->tensor_type, Py_NewRef(tensor_type));
  Py_RETURN_NONE;
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
  char name[256] = "";
  size_t total = 0, free_b = 0;
  int read_free = 0;
  fdp_result_t r;
  Py_BEGIN_ALLOW_THREADS
  read_free = memory || fdp_cuda_device_active(d);
  r = fdp_cuda_device_info(d, name, sizeof name, &total, read_free ? &free_b : NULL);
  Py_END_ALLOW_THREADS
  PyObject *peers = PyList_New(ndev);
  for (int p = 0; peers && p < ndev; p++)
    PyList_SET_ITEM(peers, p, PyBool_FromLong(p == d || fdp_cuda_can_access_peer(d, p)));
  PyObject *free_obj =
      peers ? (read_free && r == FDP_OK ? PyLong_FromUnsignedLongLong(free_b) : Py_NewRef(Py_None)) : NULL;
  PyObject *v = free_obj ? Py_BuildValue("{s:i,s:s,s:K,s:N,s:N,s:s}", "index", d, "name", name, "total_bytes",
                                         (unsigned long long)total, "free_bytes", free_obj, "peer_access", peers,
                                         "error", r == FDP_OK ? "" : fdp_last_error())
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
  int ndev;
  Py_BEGIN_ALLOW_THREADS
  ndev = fdp_cuda_device_count();
  Py_END_ALLOW_THREADS
  PyObject *devices = PyList_New(0);
  for (int d = 0; devices && d < ndev; d++) {
    PyObject *v = device_info(d, ndev, memory);
    if (!v || PyList_Append(devices, v) < 0) Py_CLEAR(devices);
    Py_XDECREF(v);
  }
  if (!devices) {
    Py_DECREF(backends);
    return NULL;
  }
  return Py_BuildValue("{s:N,s:i,s:i,s:s,s:N}", "backends", backends, "cuda_driver_version", fdp_cuda_driver_version(),
                       "nccl_version", fdp_nccl_version(), "nccl_library", fdp_nccl_library(), "devices", devices);
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
    PyErr_SetString(PyExc_TypeError,
                    "set_oom_error(cls, torch_oom): cls must subclass both CudaError and torch_oom");
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
  int ndev;
  Py_BEGIN_ALLOW_THREADS
  fdp_kernels_facts(&f);
  ndev = fdp_cuda_device_count();
  Py_END_ALLOW_THREADS
  PyObject *devices = PyList_New(ndev);
  for (int d = 0; devices && d < ndev; d++) {
    PyObject *v = PyUnicode_FromString(fdp_cuda_kernels_source(d));
    if (!v) Py_CLEAR(devices);
    else PyList_SET_ITEM(devices, d, v);
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

/* ---- route (engineer "route", issue 14): which backend the core picks; kept apart for the merge ---- */

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
    {"refresh", py_refresh, METH_VARARGS, "refresh(pairs, owned): replica __dict__ = master's, owned keys kept"},
    {"rebind", py_rebind, METH_VARARGS, "rebind(containers, keys, values): containers[i][keys[i]] = values[i]"},
    {"plan", py_plan, METH_VARARGS, "plan(tensors, type_keys, bucket_bytes) -> buckets"},
    {"set_dtypes", py_set_dtypes, METH_VARARGS, "set_dtypes({torch.dtype: code}, torch.Tensor)"},
    {"dtype_codes", py_dtype_codes, METH_NOARGS, "{name: code} of the dtypes the core reduces"},
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
    /* route (issue 14) */
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
