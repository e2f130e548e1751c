/* SPDX-License-Identifier: MIT */
/* fastdp._C's one mapping of core results to exceptions: a result code becomes the exception type of one table,
 * carrying the detail string, the result's name (.code) and the library's own status (.status). */
#include "binding.h"

/* set_oom_error(cls, torch_oom): fastdp's CUDA out-of-memory exception (a CudaError that is also PyTorch's
 * OutOfMemoryError) and PyTorch's own class, which the allocator callback recognises (allocator.c). Process-wide,
 * like the allocator. */
static PyObject *g_oom_error;
static PyObject *g_torch_oom;

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
  if (!value || PyObject_SetAttrString(exc, name, value) < 0) fdp__drop_error();
  Py_XDECREF(value);
}

PyObject *fdp__raise(module_state *st, fdp_result_t r) {
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
PyObject *fdp__none_or_raise(module_state *st, fdp_result_t r) {
  if (r != FDP_OK) return fdp__raise(st, r);
  Py_RETURN_NONE;
}

/* set_oom_error(cls, torch_oom): see g_oom_error above. */
static PyObject *py_set_oom_error(PyObject *module, PyObject *args) {
  PyObject *cls, *torch_oom;
  if (!PyArg_ParseTuple(args, "OO:set_oom_error", &cls, &torch_oom)) return NULL;
  module_state *st = fdp__state(module);
  if (!PyType_Check(cls) || !PyType_Check(torch_oom) || !PyObject_IsSubclass(cls, st->CudaError) ||
      !PyObject_IsSubclass(cls, torch_oom)) {
    PyErr_SetString(PyExc_TypeError, "set_oom_error(cls, torch_oom): cls must subclass both CudaError and torch_oom");
    return NULL;
  }
  Py_XSETREF(g_oom_error, Py_NewRef(cls));
  Py_XSETREF(g_torch_oom, Py_NewRef(torch_oom));
  Py_RETURN_NONE;
}

PyObject *fdp__torch_oom(void) {
  return g_torch_oom;
}

PyMethodDef fdp__errors_methods[] = {
    {"set_oom_error", py_set_oom_error, METH_VARARGS,
     "set_oom_error(cls, torch_oom): the exception raised for CUDA out of memory, and PyTorch's OutOfMemoryError"},
    {NULL, NULL, 0, NULL},
};
