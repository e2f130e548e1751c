/* SPDX-License-Identifier: MIT */
/* PyTorch's caching allocator as the core's device scratch memory (fdp_set_device_allocator). */
#include "binding.h"

#include <stdio.h>

/* ---- device scratch memory from PyTorch (see fdp_set_device_allocator) ----
 * The registered Python callable alloc(device, nbytes, stream_handle) returns a uint8 CUDA tensor of nbytes made by
 * PyTorch's caching allocator with that stream current; the tensor itself is the handle, dropped when the core
 * frees the memory, which returns the block to PyTorch's pool of that stream (stream-ordered, as the core needs).
 * The core calls in with the GIL released, no fastdp lock held and the device's primary context current (the one
 * PyTorch uses there, so its device guard has nothing to switch); taking the GIL here cannot deadlock. One
 * allocator per process, as in the core: a static, not module state. */
static PyObject *g_alloc_fn;
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
  int interrupted = exc && PyErr_GivenExceptionMatches(exc, PyExc_KeyboardInterrupt);
  Py_XDECREF(str);
  Py_XDECREF(exc);
  PyErr_Clear();
  if (interrupted) PyErr_SetInterrupt(); /* the failure reaches the core as text; Ctrl-C reaches the caller too */
}

static int scratch_alloc_cb(void *ctx, int device, size_t bytes, void *stream, void **ptr, void **handle, char *err,
                            size_t err_len) {
  (void)ctx;
  if (fdp__finalizing()) {
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
    if (fdp__torch_oom() != NULL && PyErr_ExceptionMatches(fdp__torch_oom())) rc = FDP_ALLOC_OUT_OF_MEMORY;
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
  if (fdp__finalizing()) return; /* leaked on purpose: PyTorch's allocator may be gone */
  PyGILState_STATE gil = PyGILState_Ensure();
  Py_DECREF((PyObject *)handle);
  PyGILState_Release(gil);
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

void fdp__allocator_release(void) {
  if (g_alloc_fn != NULL) { /* the core must not call into a module that is gone */
    fdp_set_device_allocator(NULL);
    Py_CLEAR(g_alloc_fn);
  }
}

PyMethodDef fdp__allocator_methods[] = {
    {"set_device_allocator", py_set_device_allocator, METH_O,
     "set_device_allocator(alloc or None): alloc(device, nbytes, stream) -> uint8 CUDA tensor for core scratch"},
    {NULL, NULL, 0, NULL},
};
