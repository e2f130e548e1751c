/* SPDX-License-Identifier: MIT */
/* fastdp._C, the module: its state, its life (init, traversal, shutdown) and the tables of entry points that the
 * other files of the binding define (ops.c, refresh.c, structure.c, describe.c,
 * facts.c, errors.c, allocator.c, fence.c, prepared.c). */
#include "binding.h"

#include <stdio.h>

/* shutdown(): a no-op while the interpreter finalizes (called from atexit or a __del__): the CUDA runtime may be
 * torn down already and ncclCommDestroy can hang then; the process exit reclaims everything anyway. */
static PyObject *py_shutdown(PyObject *module, PyObject *unused) {
  (void)module;
  (void)unused;
  if (fdp__finalizing()) Py_RETURN_FALSE;
  Py_BEGIN_ALLOW_THREADS
  fdp_shutdown();
  Py_END_ALLOW_THREADS
  Py_RETURN_TRUE;
}

static PyMethodDef fdp__module_methods[] = {
    {"shutdown", py_shutdown, METH_NOARGS,
     "release communicators and device state; False (nothing done) while the interpreter finalizes"},
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
  module_state *st = fdp__state(m);
  if (fdp__dict_tags_init() < 0) return -1;
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
  /* Each file of the binding brings its own entry points. */
  PyMethodDef *const tables[] = {
      fdp__ops_methods,   fdp__refresh_methods,          fdp__structure_methods, fdp__describe_methods,
      fdp__facts_methods, fdp__errors_methods,           fdp__allocator_methods, fdp__fence_methods,
      fdp__edits_methods, fdp__structure_records_methods};
  for (size_t i = 0; i < sizeof tables / sizeof tables[0]; i++)
    if (PyModule_AddFunctions(m, tables[i]) < 0) return -1;
  return fdp__fence_type_add(m) < 0 || fdp__prepared_type_add(m) < 0 ? -1 : fdp__edits_add(m);
}

static int traverse(PyObject *m, visitproc visit, void *arg) {
  module_state *st = fdp__state(m);
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
  module_state *st = fdp__state(m);
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
  fdp__allocator_release();
}

static PyModuleDef_Slot slots[] = {{Py_mod_exec, exec_module}, {0, NULL}};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT,
    "fastdp._C",
    "fastdp's C core binding",
    sizeof(module_state),
    fdp__module_methods,
    slots,
    traverse,
    clear,
    free_module,
};

PyMODINIT_FUNC PyInit__C(void) {
  return PyModuleDef_Init(&moduledef);
}
