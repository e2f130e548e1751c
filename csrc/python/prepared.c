/* SPDX-License-Identifier: MIT */
/* fastdp._C.PreparedCopy: copies between tensors whose descriptors are read and checked once, when the copy is
 * prepared (fdp_copy_prepare), and run as often as wanted. The kept replicas copy the master into the same buffers every step: the master's tensors
 * cannot have moved while the structure check finds their data pointers and strides unchanged (_C.matches), so
 * their descriptors stay valid and a step pays no per-tensor reading.
 * fastdp._C.PreparedSum: a host bucket's sum across replicas whose members' shapes, dtype and offsets are checked
 * once (fdp_rows_prepare); a step reads of each gradient only what can change (its data pointer) and checks that
 * it still has its member's layout. */
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

/* ---- fastdp._C.PreparedSum: a host bucket's sum across replicas, laid out once (fdp_rows_prepare) ---- */

typedef struct {
  PyObject_HEAD
  fdp_rows_plan_t *plan; /* the members' shapes, dtype and offsets, checked once */
  Py_ssize_t k, nrep;
} rows_object;

/* PreparedSum(members, nrep): `members` are k tensors shaped, typed and placed as the bucket's members (their data
 * is never read). */
static PyObject *rows_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
  module_state *st = type_state(type);
  fdp__tensor_list_t m = FDP_ARG("members");
  int nrep;
  if (kwds && PyDict_GET_SIZE(kwds)) {
    PyErr_SetString(PyExc_TypeError, "PreparedSum(members, nrep) takes no keyword arguments");
    return NULL;
  }
  if (!PyArg_ParseTuple(args, "O&i:PreparedSum", fdp__tensor_list_converter, &m, &nrep)) return NULL;
  rows_object *self = NULL;
  fdp_rows_plan_t *plan = NULL;
  fdp_result_t r = fdp__check_count(m.n) < 0 ? FDP_OK : fdp_rows_prepare(m.t, (int)m.n, nrep, &plan);
  if (!PyErr_Occurred() && r != FDP_OK) fdp__raise(st, r);
  if (plan && !(self = (rows_object *)type->tp_alloc(type, 0))) fdp_rows_plan_free(plan);
  if (self) {
    self->plan = plan;
    self->k = m.n;
    self->nrep = nrep;
  }
  fdp__tensor_list_clear(&m);
  return (PyObject *)self;
}

/* Whether a step's tensor may stand for item i's member of the plan `ctx` (fdp__aoti_data's question). */
static int rows_fits(const void *ctx, Py_ssize_t i, const fdp_tensor_t *t) {
  const rows_object *self = ctx;
  return fdp_rows_member_fits(self->plan, (int)(i % self->k), t);
}

/* run(grads, out) -> bool: member j's sum over the replicas into `out` at its offset, `grads` replica-major (k per
 * replica). False, with nothing written, where a gradient is missing, is not a plain dense host tensor shaped,
 * strided and typed as its member, or tensors are read through their Python API: the caller's general path sums
 * them then, with its own checks and errors. */
static PyObject *rows_run(PyObject *op, PyObject *args) {
  rows_object *self = (rows_object *)op;
  module_state *st = type_state(Py_TYPE(op));
  PyObject *grads;
  fdp__tensor_arg_t out = FDP_ARG("out");
  if (!PyArg_ParseTuple(args, "OO&:run", &grads, fdp__tensor_converter, &out)) return NULL;
  if (fdp__tensor_path() != FDP_TENSOR_PATH_AOTI) Py_RETURN_FALSE;
  PyObject *items = PySequence_Tuple(grads), *ret = NULL;
  if (!items) return NULL;
  Py_ssize_t n = PyTuple_GET_SIZE(items);
  char **ptrs = NULL;
  if (n != self->k * self->nrep) {
    PyErr_Format(PyExc_ValueError, "PreparedSum.run: %zd gradients for %zd members on %zd replicas", n, self->k,
                 self->nrep);
  } else if (!(ptrs = fdp_scratch_alloc((size_t)n * sizeof *ptrs))) {
    PyErr_NoMemory();
  } else {
    int rc = fdp__aoti_data(st, items, rows_fits, self, ptrs);
    if (rc == 1) {
      ret = Py_NewRef(Py_False);
    } else if (rc == 0) {
      fdp_result_t r;
      Py_BEGIN_ALLOW_THREADS
      r = fdp_rows_run(self->plan, ptrs, &out.t);
      Py_END_ALLOW_THREADS
      ret = r == FDP_OK ? Py_NewRef(Py_True) : fdp__raise(st, r);
    }
  }
  fdp_scratch_free(ptrs);
  Py_DECREF(items); /* kept until here: the gradients' memory stays alive while the GIL is released */
  return ret;
}

static PyObject *rows_numel(PyObject *op, void *closure) {
  (void)closure;
  return PyLong_FromLongLong(fdp_rows_numel(((rows_object *)op)->plan));
}

static void rows_dealloc(PyObject *op) {
  PyTypeObject *type = Py_TYPE(op);
  fdp_rows_plan_free(((rows_object *)op)->plan);
  type->tp_free(op);
  Py_DECREF(type);
}

static PyMethodDef rows_methods[] = {
    {"run", rows_run, METH_VARARGS, "run(grads, out) -> bool: each member's sum over the replicas into out"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef rows_getset[] = {
    {"numel", rows_numel, NULL, "the members' elements, back to back in the output", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot rows_slots[] = {
    {Py_tp_new, rows_new},
    {Py_tp_dealloc, rows_dealloc},
    {Py_tp_methods, rows_methods},
    {Py_tp_getset, rows_getset},
    {Py_tp_doc, "PreparedSum(members, nrep): a host bucket's sum across nrep replicas, its members' shapes and dtype "
                "checked once; run(grads, out) reads only what a step can change."},
    {0, NULL},
};

static PyType_Spec rows_spec = {
    .name = "fastdp._C.PreparedSum",
    .basicsize = sizeof(rows_object),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = rows_slots,
};

static int add_type(PyObject *module, PyType_Spec *spec, const char *name) {
  PyObject *type = PyType_FromModuleAndSpec(module, spec, NULL);
  if (!type) return -1;
  int r = PyModule_AddObjectRef(module, name, type);
  Py_DECREF(type);
  return r;
}

int fdp__prepared_type_add(PyObject *module) {
  return add_type(module, &prepared_spec, "PreparedCopy") < 0 ? -1 : add_type(module, &rows_spec, "PreparedSum");
}
