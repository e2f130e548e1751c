/* SPDX-License-Identifier: MIT */
/* Tensors to core descriptors: the "O&" converters every operation parses its arguments with, and the Python path
 * that reads a tensor through its public Python API (the fallback to the C shim path of aoti.c). */
#include "binding.h"

#include <string.h>

/* ---- the Python path ---- */

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

/* See binding.h. */
int fdp__describe_python(module_state *st, PyObject *obj, fdp_tensor_t *t, const char *what, Py_ssize_t index) {
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
    if (is_tensor == 0) PyErr_Format(PyExc_TypeError, "%s must be a torch.Tensor, got %s", name, Py_TYPE(obj)->tp_name);
    return -1;
  }
  long long dev, ptr;
  if (tensor_device(st, obj, name, &dev) < 0 || call_int(obj, st->s_data_ptr, &ptr) < 0) return -1;
  if (tensor_layout(st, obj, name, t) < 0 || tensor_dtype(st, obj, t) < 0) return -1;
  t->data = (char *)(intptr_t)ptr;
  t->device = (int)dev;
  return 0;
}

/* ---- converters ---- */

int fdp__check_count(Py_ssize_t n) {
  if (n > INT32_MAX / 4) {
    PyErr_SetString(PyExc_ValueError, "too many tensors in one call");
    return -1;
  }
  return 0;
}

int fdp__describe_items(module_state *st, PyObject *items, fdp_tensor_t *ts, const char *what, int single) {
  if (fdp__tensor_path() == FDP_TENSOR_PATH_AOTI) {
    int rc = fdp__aoti_describe(st, items, ts, what, single);
    if (rc <= 0) return rc;
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(items); i++)
    if (fdp__describe_python(st, PyTuple_GET_ITEM(items, i), &ts[i], what, single ? -1 : i) < 0) return -1;
  return 0;
}

/* The tensors of a sequence argument as a new tuple; a TypeError naming the argument for anything else (a lone
 * tensor, a string, a non-iterable). */
static PyObject *tensor_tuple(module_state *st, PyObject *seq, const char *what) {
  if (!st->tensor_type) {
    PyErr_SetString(PyExc_RuntimeError, "fastdp._C.set_dtypes() must be called first (import fastdp)");
    return NULL;
  }
  if (PyObject_IsInstance(seq, st->tensor_type) > 0 || PyUnicode_Check(seq) || PyBytes_Check(seq)) {
    PyErr_Format(PyExc_TypeError, "%s must be a sequence of tensors, got %s", what, Py_TYPE(seq)->tp_name);
    return NULL;
  }
  PyObject *items = PySequence_Tuple(seq);
  if (!items && PyErr_ExceptionMatches(PyExc_TypeError)) {
    PyErr_Clear();
    PyErr_Format(PyExc_TypeError, "%s must be a sequence of tensors, got %s", what, Py_TYPE(seq)->tp_name);
  }
  return items;
}

void fdp__tensor_list_clear(fdp__tensor_list_t *list) {
  fdp_scratch_free(list->t);
  list->t = NULL;
  list->n = 0;
  Py_CLEAR(list->keep);
}

/* "O&" converter: a sequence of tensors into list->t / list->n, the tensors kept in list->keep. */
int fdp__tensor_list_converter(PyObject *obj, void *out) {
  fdp__tensor_list_t *list = out;
  if (obj == NULL) { /* a later argument failed: release what the successful conversion made */
    fdp__tensor_list_clear(list);
    return 0;
  }
  PyObject *items = tensor_tuple(list->st, obj, list->what);
  if (!items) return 0;
  Py_ssize_t len = PyTuple_GET_SIZE(items);
  list->t = fdp_scratch_alloc((size_t)(len ? len : 1) * sizeof *list->t); /* every entry is filled below */
  list->keep = items;
  if (!list->t) PyErr_NoMemory();
  if (!list->t || fdp__describe_items(list->st, items, list->t, list->what, 0) < 0) {
    fdp__tensor_list_clear(list);
    return 0;
  }
  list->n = len;
  return Py_CLEANUP_SUPPORTED;
}

/* "O&" converter: one tensor argument, through the path in use. Nothing to release: the descriptor borrows the
 * argument, which the argument tuple keeps alive. */
int fdp__tensor_converter(PyObject *obj, void *out) {
  fdp__tensor_arg_t *arg = out;
  if (obj == NULL) return 0;
  if (fdp__tensor_path() == FDP_TENSOR_PATH_PYTHON)
    return fdp__describe_python(arg->st, obj, &arg->t, arg->what, -1) == 0;
  PyObject *one = PyTuple_Pack(1, obj);
  int rc = one ? fdp__describe_items(arg->st, one, &arg->t, arg->what, 1) : -1;
  Py_XDECREF(one);
  return rc == 0;
}

int fdp__streams_converter(PyObject *obj, void *out) {
  fdp_streams_t *s = out;
  if (obj == Py_None) return 1;
  PyObject *fast = PySequence_Fast(obj, "streams must be a sequence of (device, handle) pairs");
  if (!fast) return 0;
  Py_ssize_t len = PySequence_Fast_GET_SIZE(fast);
  int ok = len <= FDP_MAX_DEVICES;
  if (!ok) PyErr_Format(PyExc_ValueError, "at most %d streams", FDP_MAX_DEVICES);
  for (Py_ssize_t i = 0; ok && i < len; i++) {
    int dev;
    unsigned long long handle;
    PyObject *pair = PySequence_Fast_GET_ITEM(fast, i);
    if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) { /* PyArg_ParseTuple would not name the entry */
      if (PyTuple_Check(pair))
        PyErr_Format(PyExc_TypeError, "streams[%zd] must be a (device, handle) tuple, got a tuple of %zd items", i,
                     PyTuple_GET_SIZE(pair));
      else
        PyErr_Format(PyExc_TypeError, "streams[%zd] must be a (device, handle) tuple, got %s", i,
                     Py_TYPE(pair)->tp_name);
      ok = 0;
      break;
    }
    ok = PyArg_ParseTuple(pair, "iK", &dev, &handle);
    if (!ok) break;
    s->device[i] = dev;
    s->stream[i] = (void *)(uintptr_t)handle;
  }
  s->n = ok ? (int)len : 0;
  Py_DECREF(fast);
  return ok;
}
