/* SPDX-License-Identifier: MIT */
/* Tensors to core descriptors: the "O&" converters every operation parses its arguments with, and the one choice
 * between the two ways a tensor is read, libtorch's C shim (aoti.c) and its Python API (pyapi.c). */
#include "binding.h"

#include <string.h>

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
