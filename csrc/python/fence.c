/* SPDX-License-Identifier: MIT */
/* fastdp._C's ordering across streams: order(waiters, signals) and the Fence type over fdp_fence_t (the reduction's
 * own streams wait for the gradients' streams, the consumer's stream waits for the reduction, the host asks when its
 * memory may go). */
#include "binding.h"

typedef struct {
  PyObject_HEAD
  fdp_fence_t *fence;
} fence_object;

static module_state *type_state(PyTypeObject *type) {
  return (module_state *)PyType_GetModuleState(type);
}

/* order(waiters, signals): each waiter stream waits for the work so far on the signal stream of the same index. */
static PyObject *py_order(PyObject *module, PyObject *args) {
  module_state *st = fdp__state(module);
  fdp_streams_t waiters = {0}, signals = {0};
  if (!PyArg_ParseTuple(args, "O&O&:order", fdp__streams_converter, &waiters, fdp__streams_converter, &signals))
    return NULL;
  fdp_result_t r;
  Py_BEGIN_ALLOW_THREADS
  r = fdp_streams_order(&waiters, &signals);
  Py_END_ALLOW_THREADS
  return fdp__none_or_raise(st, r);
}

/* Fence(streams): recorded behind the work enqueued so far on every listed stream. */
static PyObject *fence_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
  module_state *st = type_state(type);
  fdp_streams_t streams = {0};
  if ((kwds && PyDict_GET_SIZE(kwds)) || !PyArg_ParseTuple(args, "O&:Fence", fdp__streams_converter, &streams)) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "Fence(streams) takes no keyword arguments");
    return NULL;
  }
  fdp_fence_t *fence = NULL;
  fdp_result_t r;
  Py_BEGIN_ALLOW_THREADS
  r = fdp_fence_record(&streams, &fence);
  Py_END_ALLOW_THREADS
  if (r != FDP_OK) return fdp__raise(st, r);
  fence_object *self = (fence_object *)type->tp_alloc(type, 0);
  if (!self) {
    fdp_fence_free(fence);
    return NULL;
  }
  self->fence = fence;
  return (PyObject *)self;
}

/* wait(streams): every listed stream waits for the work before the fence. */
static PyObject *fence_wait(PyObject *op, PyObject *arg) {
  fence_object *self = (fence_object *)op;
  module_state *st = type_state(Py_TYPE(op));
  fdp_streams_t waiters = {0};
  if (!fdp__streams_converter(arg, &waiters)) return NULL;
  fdp_result_t r;
  Py_BEGIN_ALLOW_THREADS
  r = fdp_fence_wait(self->fence, &waiters);
  Py_END_ALLOW_THREADS
  return fdp__none_or_raise(st, r);
}

/* done(): whether the work before the fence has completed on every fenced stream (never waits). */
static PyObject *fence_done(PyObject *op, PyObject *unused) {
  (void)unused;
  fence_object *self = (fence_object *)op;
  int done = 0;
  fdp_result_t r = fdp_fence_query(self->fence, &done);
  if (r != FDP_OK) return fdp__raise(type_state(Py_TYPE(op)), r);
  return PyBool_FromLong(done);
}

static void fence_dealloc(PyObject *op) {
  fence_object *self = (fence_object *)op;
  PyTypeObject *type = Py_TYPE(op);
  if (self->fence && !fdp__finalizing()) fdp_fence_free(self->fence); /* at exit the driver may be gone */
  self->fence = NULL;
  type->tp_free(op);
  Py_DECREF(type);
}

static PyMethodDef fence_methods[] = {
    {"wait", fence_wait, METH_O, "wait(streams): each (device, handle) stream waits for the work before the fence"},
    {"done", fence_done, METH_NOARGS, "whether the work before the fence has completed on every fenced stream"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot fence_slots[] = {
    {Py_tp_new, fence_new},
    {Py_tp_dealloc, fence_dealloc},
    {Py_tp_methods, fence_methods},
    {Py_tp_doc, "Fence(streams): the point each (device, handle) CUDA stream has reached (one event each)."},
    {0, NULL},
};

static PyType_Spec fence_spec = {
    .name = "fastdp._C.Fence",
    .basicsize = sizeof(fence_object),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = fence_slots,
};

int fdp__fence_type_add(PyObject *module) {
  PyObject *type = PyType_FromModuleAndSpec(module, &fence_spec, NULL);
  if (!type) return -1;
  int r = PyModule_AddObjectRef(module, "Fence", type);
  Py_DECREF(type);
  return r;
}

PyMethodDef fdp__fence_methods[] = {
    {"order", py_order, METH_VARARGS,
     "order(waiters, signals): each waiter stream waits for the work so far on the signal stream of its index"},
    {NULL, NULL, 0, NULL},
};
