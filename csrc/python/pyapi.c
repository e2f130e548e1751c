/* SPDX-License-Identifier: MIT */
/* Tensor metadata through the tensor's public Python API (data_ptr(), shape, stride(), dtype, device): the path for
 * every torch, and for the objects libtorch's C shim cannot read (aoti.c falls back to it tensor by tensor). */
#include "binding.h"

#include <string.h>

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
