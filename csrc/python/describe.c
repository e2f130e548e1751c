/* SPDX-License-Identifier: MIT */
/* How tensors are read: the dtype table, the choice between libtorch's C shim and the Python API (aoti.c,
 * tensors.c), and the calls that expose descriptors and result views to Python and its tests. */
#include "binding.h"

#include <string.h>

/* getattr(import(module), name), or NULL with no error set. */
static PyObject *lookup(const char *module, const char *name) {
  PyObject *m = PyImport_ImportModule(module);
  PyObject *v = m ? PyObject_GetAttrString(m, name) : NULL;
  Py_XDECREF(m);
  if (!v) fdp__drop_error(); /* NOTE [no lost interrupt] in binding.h */
  return v;
}

/* The shim path's inputs from the torch already imported; a torch without them leaves the Python path. */
static void init_tensor_path(module_state *st) {
  Py_XSETREF(st->parameter_type, lookup("torch.nn.parameter", "Parameter"));
  PyObject *aoti = lookup("torch._C", "_aoti");
  Py_XSETREF(st->to_handles, aoti ? PyObject_GetAttrString(aoti, "unsafe_alloc_void_ptrs_from_tensors") : NULL);
  fdp__drop_error();
  Py_XSETREF(st->from_handles, aoti ? PyObject_GetAttrString(aoti, "alloc_tensors_by_stealing_from_void_ptrs") : NULL);
  fdp__drop_error();
  Py_XDECREF(aoti);
  PyObject *file = lookup("torch._C", "__file__");
  const char *path = file && PyUnicode_Check(file) ? PyUnicode_AsUTF8(file) : NULL;
  fdp__drop_error();
  fdp__aoti_init(st, path);
  Py_XDECREF(file);
}

static PyObject *py_set_dtypes(PyObject *module, PyObject *args) {
  module_state *st = fdp__state(module);
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
  module_state *st = fdp__state(module);
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

/* views(flat, spec) -> tuple or None: see fdp__aoti_views; spec is any buffer of int64 (array('q'), bytes). */
static PyObject *py_views(PyObject *module, PyObject *args) {
  module_state *st = fdp__state(module);
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

PyMethodDef fdp__describe_methods[] = {
    {"set_dtypes", py_set_dtypes, METH_VARARGS, "set_dtypes({torch.dtype: code}, torch.Tensor)"},
    {"dtype_codes", py_dtype_codes, METH_NOARGS, "{name: code} of the dtypes the core reduces"},
    {"tensor_path", py_tensor_path, METH_NOARGS, "tensor_path() -> (\"aoti\" or \"python\", why)"},
    {"set_tensor_path", py_set_tensor_path, METH_O, "set_tensor_path(\"aoti\" or \"python\") -> previous"},
    {"views", py_views, METH_VARARGS, "views(flat, spec) -> tensors shaped by spec over flat, or None (use torch)"},
    {"describe", py_describe, METH_VARARGS, "describe(tensors) -> [(data, device, dtype, elem_size, sizes, strides)]"},
    {NULL, NULL, 0, NULL},
};
