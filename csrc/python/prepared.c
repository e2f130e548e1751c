/* SPDX-License-Identifier: MIT */
/* fastdp._C.PreparedCopy: copies between tensors whose descriptors are read and checked once, when the copy is
 * prepared (fdp_copy_prepare), and run as often as wanted. The kept replicas copy the master into the same buffers every step: the master's tensors
 * cannot have moved while the structure check finds their data pointers and strides unchanged (_C.matches), so
 * their descriptors stay valid and a step pays no per-tensor reading. */
#include "binding.h"

#include <string.h>

typedef struct {
  PyObject_HEAD
  fdp_copy_plan_t *plan; /* the copies, checked once (fdp_copy_prepare) */
  PyObject *keep;        /* the tensors described: alive with the object (their memory too, while none moves) */
} prepared_object;

static module_state *type_state(PyTypeObject *type) {
  return (module_state *)PyType_GetModuleState(type);
}

/* PreparedCopy(dsts, srcs): dsts[i] = srcs[i] each time run() is called. */
static PyObject *prepared_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
  module_state *st = type_state(type);
  fdp__tensor_list_t d = FDP_ARG("dst"), s = FDP_ARG("src");
  if (kwds && PyDict_GET_SIZE(kwds)) {
    PyErr_SetString(PyExc_TypeError, "PreparedCopy(dsts, srcs) takes no keyword arguments");
    return NULL;
  }
  if (!PyArg_ParseTuple(args, "O&O&:PreparedCopy", fdp__tensor_list_converter, &d, fdp__tensor_list_converter, &s))
    return NULL;
  prepared_object *self = NULL;
  if (d.n != s.n || fdp__check_count(d.n) < 0) {
    if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "PreparedCopy: %zd destinations for %zd sources", d.n, s.n);
    goto done;
  }
  fdp_copy_plan_t *plan = NULL;
  fdp_result_t r = fdp_copy_prepare(d.t, s.t, (int)d.n, &plan);
  if (r != FDP_OK) {
    fdp__raise(st, r);
    goto done;
  }
  self = (prepared_object *)type->tp_alloc(type, 0);
  if (!self) {
    fdp_copy_plan_free(plan);
    goto done;
  }
  self->plan = plan;
  self->keep = PyTuple_Pack(2, d.keep, s.keep);
  if (!self->keep) Py_CLEAR(self);
done:
  fdp__tensor_list_clear(&d);
  fdp__tensor_list_clear(&s);
  return (PyObject *)self;
}

/* run(streams=None): the copies, ordered on the listed streams. */
static PyObject *prepared_run(PyObject *op, PyObject *args) {
  prepared_object *self = (prepared_object *)op;
  fdp_streams_t streams = {0};
  if (!PyArg_ParseTuple(args, "|O&:run", fdp__streams_converter, &streams)) return NULL;
  fdp_result_t r;
  Py_BEGIN_ALLOW_THREADS
  r = fdp_copy_run(self->plan, &streams);
  Py_END_ALLOW_THREADS
  return fdp__none_or_raise(type_state(Py_TYPE(op)), r);
}

static int prepared_traverse(PyObject *op, visitproc visit, void *arg) {
  Py_VISIT(((prepared_object *)op)->keep);
  Py_VISIT(Py_TYPE(op));
  return 0;
}

static int prepared_clear(PyObject *op) {
  Py_CLEAR(((prepared_object *)op)->keep);
  return 0;
}

static void prepared_dealloc(PyObject *op) {
  prepared_object *self = (prepared_object *)op;
  PyTypeObject *type = Py_TYPE(op);
  PyObject_GC_UnTrack(op);
  prepared_clear(op);
  fdp_copy_plan_free(self->plan);
  type->tp_free(op);
  Py_DECREF(type);
}

static PyMethodDef prepared_methods[] = {
    {"run", prepared_run, METH_VARARGS, "run(streams=None): dsts[i] = srcs[i], ordered on the listed streams"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot prepared_slots[] = {
    {Py_tp_new, prepared_new},
    {Py_tp_dealloc, prepared_dealloc},
    {Py_tp_traverse, prepared_traverse},
    {Py_tp_clear, prepared_clear},
    {Py_tp_methods, prepared_methods},
    {Py_tp_doc, "PreparedCopy(dsts, srcs): copies between tensors described once; run() performs them. The caller "
                "keeps every tensor where it was (no .data replaced, no storage moved) while it runs them."},
    {0, NULL},
};

static PyType_Spec prepared_spec = {
    .name = "fastdp._C.PreparedCopy",
    .basicsize = sizeof(prepared_object),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = prepared_slots,
};

int fdp__prepared_type_add(PyObject *module) {
  PyObject *type = PyType_FromModuleAndSpec(module, &prepared_spec, NULL);
  if (!type) return -1;
  int r = PyModule_AddObjectRef(module, "PreparedCopy", type);
  Py_DECREF(type);
  return r;
}
