/* SPDX-License-Identifier: MIT */
/* What a forward changed on the kept replicas it ran, found before the next forward reuses them (NOTE [a forward's
 * own edits] in fastdp/_step/replicas.py): the dicts each replica module owns (its parameters, buffers and children:
 * owned_edits, owned_record) and the memory, shape and dtype of the tensors kept across steps (TensorWatch). Both run
 * before every forward, so they cost a few loads per replica module and per kept tensor. */
#include "binding.h"

#include <string.h>

/* ---- the dicts a replica module owns ---- */

/* An entry: (master __dict__, replica __dict__, the replica's _parameters, _buffers and _modules dicts as built, and
 * a copy of that _modules as built). A record: the tags of the replica's __dict__ and of its three owned dicts, as
 * owned_record() last saw them (0 in the first: none yet). The records' head: the count of changes to those dicts
 * when owned_record() last ran (0: none; NOTE [dict tags from 3.12]), the entries' sequence and its length then.
 * owned_record() runs once the step installed its tensors, when no entry holds an edit: while that count stands
 * still, no forward edited any, and owned_edits() answers without reading an entry. */
#define ENTRY_ITEMS 6
#define OWNED_RECORD 4
#define OWNED_HEAD 3

enum { K_PARAMETERS, K_BUFFERS, K_MODULES, K_COUNT };
static const char *const k_owned[K_COUNT] = {"_parameters", "_buffers", "_modules"};

static void names_clear(PyObject **key) {
  for (int k = 0; k < K_COUNT; k++)
    Py_CLEAR(key[k]);
}

/* The owned keys, interned into key[] (cleared first); -1 with an error set. */
static int names_init(PyObject **key) {
  for (int k = 0; k < K_COUNT; k++)
    key[k] = NULL;
  for (int k = 0; k < K_COUNT; k++)
    if (!(key[k] = PyUnicode_InternFromString(k_owned[k]))) return -1;
  return 0;
}

/* Whether `entry` is a tuple of ENTRY_ITEMS whose items from `first` to `last` are dicts; TypeError naming its index
 * when not. The records need only the replica's own dicts (1 to 4), which is all a step with nothing changed reads. */
static int entry_ok(PyObject *entry, Py_ssize_t i, int first, int last) {
  int ok = PyTuple_Check(entry) && PyTuple_GET_SIZE(entry) == ENTRY_ITEMS;
  for (Py_ssize_t k = first; ok && k <= last; k++)
    ok = PyDict_Check(PyTuple_GET_ITEM(entry, k));
  if (!ok) PyErr_Format(PyExc_TypeError, "entries[%zd] must be a tuple of %d dicts", i, ENTRY_ITEMS);
  return ok;
}

/* Whether the replica's __dict__ still holds the owned dicts it was built with: 1, 0, -1 on error. */
static int holds_own_dicts(PyObject *replica, PyObject *const *own, PyObject *const *key) {
  for (int k = 0; k < K_COUNT; k++) {
    PyObject *v = PyDict_GetItemWithError(replica, key[k]);
    if (!v) return PyErr_Occurred() ? -1 : 0;
    if (v != own[k]) return 0;
  }
  return 1;
}

/* Whether dict `mine` holds the keys of dict `ref`, in ref's order, with ref's own value objects (`identical`) or with
 * None exactly where ref has None: 1, 0, -1 on error. */
static int same_items(PyObject *mine, PyObject *ref, int identical) {
  if (!ref || !PyDict_Check(ref) || PyDict_GET_SIZE(mine) != PyDict_GET_SIZE(ref)) return 0;
  Py_ssize_t pm = 0, pr = 0;
  PyObject *km, *vm, *kr, *vr;
  while (PyDict_Next(ref, &pr, &kr, &vr)) {
    if (!PyDict_Next(mine, &pm, &km, &vm)) return 0;
    if (identical ? vm != vr : (vm == Py_None) != (vr == Py_None)) return 0;
    int eq = km == kr ? 1 : PyObject_RichCompareBool(km, kr, Py_EQ);
    if (eq <= 0) return eq;
  }
  return 1;
}

/* Compares the owned dicts with what they were built as: the master's keys (None where the master has None) in the
 * parameter and buffer dicts, the children built in the child dict. 1 the same, 0 not, -1 on error. */
static int same_structure(PyObject *entry, PyObject *const *own, PyObject *const *key) {
  PyObject *master = PyTuple_GET_ITEM(entry, 0);
  int same = holds_own_dicts(PyTuple_GET_ITEM(entry, 1), own, key);
  for (int k = 0; same == 1 && k < K_COUNT; k++) {
    if (k == K_MODULES) {
      same = same_items(own[k], PyTuple_GET_ITEM(entry, ENTRY_ITEMS - 1), 1);
      continue;
    }
    PyObject *theirs = PyDict_GetItemWithError(master, key[k]);
    same = !theirs && PyErr_Occurred() ? -1 : same_items(own[k], theirs, 0);
  }
  return same;
}

/* 1 when the entry's replica changed what it owns since owned_record(), 0 when not, -1 on error. With a record, any
 * change to an owned dict moved its tag, and a __dict__ whose tag moved is asked whether it still holds them (a plain
 * attribute changes it too); without one (the first time, or no tags: NOTE [dict tags from 3.12]) only the
 * structure can be compared: the caller then reinstalls every value itself. */
static int entry_edited(PyObject *entry, Py_ssize_t i, const uint64_t *rec, PyObject *const *key) {
  PyObject *replica = PyTuple_GET_ITEM(entry, 1);
  PyObject *own[K_COUNT] = {PyTuple_GET_ITEM(entry, 2), PyTuple_GET_ITEM(entry, 3), PyTuple_GET_ITEM(entry, 4)};
  int same;
  if (FDP_DICT_TAGS && rec[0]) {
    for (int k = 0; k < K_COUNT; k++)
      if (fdp__dict_tag_counted(own[k], FDP_TAG_OWNED) != rec[1 + k]) return 1;
    same = fdp__dict_tag_counted(replica, FDP_TAG_OWNED) == rec[0] ? 1 : holds_own_dicts(replica, own, key);
  } else {
    same = entry_ok(entry, i, 0, ENTRY_ITEMS - 1) ? same_structure(entry, own, key) : -1;
  }
  return same < 0 ? -1 : !same;
}

/* The `seen` buffer of owned_edits() / owned_record(): NULL with ValueError when it does not hold one record per
 * entry. */
static uint64_t *owned_records_of(Py_buffer *seen, Py_ssize_t n) {
  Py_ssize_t want = (OWNED_HEAD + n * OWNED_RECORD) * (Py_ssize_t)sizeof(uint64_t);
  if (seen->len != want || (uintptr_t)seen->buf % _Alignof(uint64_t)) {
    PyErr_Format(PyExc_ValueError, "seen must be owned_records(%zd): an aligned %zd bytes, got %zd", n, want,
                 seen->len);
    return NULL;
  }
  return seen->buf;
}

/* Appends the index of every entry whose replica changed its owned dicts to `edits`; 0, or -1 with an error set. */
static int find_edits(PyObject *entries, const uint64_t *rec, PyObject *edits) {
  PyObject *key[K_COUNT];
  int rc = names_init(key);
  for (Py_ssize_t i = 0; rc == 0 && i < PySequence_Fast_GET_SIZE(entries); i++) {
    PyObject *entry = PySequence_Fast_GET_ITEM(entries, i);
    int edited = entry_ok(entry, i, 1, OWNED_RECORD) ? entry_edited(entry, i, rec + i * OWNED_RECORD, key) : -1;
    PyObject *index = edited == 1 ? PyLong_FromSsize_t(i) : NULL;
    rc = edited < 0 || (edited == 1 && (!index || PyList_Append(edits, index) < 0)) ? -1 : 0;
    Py_XDECREF(index);
  }
  names_clear(key);
  return rc;
}

/* Records entry i's tags; 0, or -1 with an error set. */
static int record_entry(PyObject *entries, uint64_t *rec, Py_ssize_t i) {
  if (i < 0 || i >= PySequence_Fast_GET_SIZE(entries)) {
    PyErr_Format(PyExc_IndexError, "owned_record: entry index %zd out of range", i);
    return -1;
  }
  PyObject *entry = PySequence_Fast_GET_ITEM(entries, i);
  if (!entry_ok(entry, i, 1, OWNED_RECORD)) return -1;
  uint64_t *r = rec + i * OWNED_RECORD;
  for (int k = 0; k < OWNED_RECORD; k++)
    r[k] = fdp__dict_tag_counted(PyTuple_GET_ITEM(entry, 1 + k), FDP_TAG_OWNED);
  return 0;
}

/* Records the entries at `indices` (a sequence of ints; None: every entry); 0, or -1 with an error set. */
static int record_entries(PyObject *entries, uint64_t *rec, PyObject *indices) {
  if (!FDP_DICT_TAGS) return 0;
  if (indices == Py_None) {
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(entries); i++)
      if (record_entry(entries, rec, i) < 0) return -1;
    return 0;
  }
  PyObject *fast = PySequence_Fast(indices, "indices must be a sequence of ints or None");
  int rc = fast ? 0 : -1;
  for (Py_ssize_t j = 0; rc == 0 && j < PySequence_Fast_GET_SIZE(fast); j++) {
    Py_ssize_t i = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(fast, j));
    rc = i == -1 && PyErr_Occurred() ? -1 : record_entry(entries, rec, i);
  }
  Py_XDECREF(fast);
  return rc;
}

/* The edits of `entries` (the sequence `obj`) into `edits`: none without a read where the head says nothing
 * changed since the last record; 0, or -1 with an error set. */
static int edits_since_record(PyObject *obj, PyObject *entries, const uint64_t *head, PyObject *edits) {
  if (head[0] && head[0] == fdp__counted_changes(FDP_TAG_OWNED) && head[1] == (uint64_t)(uintptr_t)obj &&
      head[2] == (uint64_t)PySequence_Fast_GET_SIZE(entries))
    return 0;
  return find_edits(entries, head + OWNED_HEAD, edits);
}

/* Records the entries at `indices` and the head (the count of changes now); 0, or -1 with an error set. */
static int record_with_head(PyObject *obj, PyObject *entries, uint64_t *head, PyObject *indices) {
  if (record_entries(entries, head + OWNED_HEAD, indices) < 0) return -1;
  head[0] = FDP_DICT_TAGS ? fdp__counted_changes(FDP_TAG_OWNED) : 0;
  head[1] = (uint64_t)(uintptr_t)obj;
  head[2] = (uint64_t)PySequence_Fast_GET_SIZE(entries);
  return 0;
}

/* owned_edits(entries, seen) -> the indices of the entries whose replica changed its owned dicts since they were
 * recorded (a list, empty when none); owned_record(entries, seen, indices=None) -> None: records the entries at
 * `indices` (all by default) as they are now, after the step installed its tensors into them. */
static PyObject *owned_call(PyObject *args, const char *format, int find) {
  PyObject *obj, *indices = Py_None;
  Py_buffer seen = {0};
  if (!PyArg_ParseTuple(args, format, &obj, &seen, &indices)) return NULL;
  PyObject *entries = PySequence_Fast(obj, "entries must be a sequence of tuples");
  PyObject *edits = entries && find ? PyList_New(0) : NULL;
  uint64_t *head = entries && (edits || !find) ? owned_records_of(&seen, PySequence_Fast_GET_SIZE(entries)) : NULL;
  PyObject *ret = NULL;
  if (head && find && edits_since_record(obj, entries, head, edits) == 0) ret = Py_NewRef(edits);
  if (head && !find && record_with_head(obj, entries, head, indices) == 0) ret = Py_NewRef(Py_None);
  Py_XDECREF(edits);
  Py_XDECREF(entries);
  PyBuffer_Release(&seen);
  return ret;
}

static PyObject *py_owned_edits(PyObject *module, PyObject *args) {
  (void)module;
  return owned_call(args, "Ow*:owned_edits", 1);
}

static PyObject *py_owned_record(PyObject *module, PyObject *args) {
  (void)module;
  return owned_call(args, "Ow*|O:owned_record", 0);
}

/* owned_records(n) -> the zeroed `seen` buffer for n entries (the caller keeps it with the entries). */
static PyObject *py_owned_records(PyObject *module, PyObject *arg) {
  (void)module;
  Py_ssize_t n = PyLong_AsSsize_t(arg);
  if (n == -1 && PyErr_Occurred()) return NULL;
  if (n < 0 || n > PY_SSIZE_T_MAX / (OWNED_RECORD * (Py_ssize_t)sizeof(uint64_t)) - OWNED_HEAD) {
    PyErr_Format(PyExc_ValueError, "owned_records: bad count %zd", n);
    return NULL;
  }
  PyObject *buf = PyByteArray_FromStringAndSize(NULL, (OWNED_HEAD + n * OWNED_RECORD) * (Py_ssize_t)sizeof(uint64_t));
  if (buf) memset(PyByteArray_AS_STRING(buf), 0, (size_t)PyByteArray_GET_SIZE(buf));
  return buf;
}

/* ---- TensorWatch: tensors kept across steps, and whether their memory, shape or dtype changed ---- */

typedef struct {
  PyObject_HEAD
  PyObject *tensors;  /* tuple: the tensors watched */
  void **handles;     /* one held shim handle per tensor, or NULL: the Python path reads them */
  fdp_tensor_t *seen; /* each tensor as it was when watched */
  int32_t *codes;     /* its shim dtype code then (-1 when the Python path read it) */
  signed char *grads; /* its requires_grad then, for leaves; NULL when not watched */
  Py_ssize_t n;
} watch_object;

static module_state *type_state(PyTypeObject *type) {
  return (module_state *)PyType_GetModuleState(type);
}

/* Tensor i as it is now, through its held handle or its Python API; 0, or -1 with an error set. */
static int read_now(watch_object *w, module_state *st, Py_ssize_t i, fdp_tensor_t *t, int32_t *code) {
  *code = -1;
  if (w->handles && fdp__aoti_read(w->handles[i], t, code) == 0) return 0;
  *code = -1;
  return fdp__describe_python(st, PyTuple_GET_ITEM(w->tensors, i), t, "tensors", i);
}

/* The tensor's requires_grad as 0 or 1, -1 with an error set. */
static int requires_grad(PyObject *t) {
  PyObject *v = PyObject_GetAttrString(t, "requires_grad");
  int r = v ? PyObject_IsTrue(v) : -1;
  Py_XDECREF(v);
  return r;
}

static int same_tensor(const fdp_tensor_t *a, const fdp_tensor_t *b) {
  if (a->data != b->data || a->device != b->device || a->dtype != b->dtype || a->elem_size != b->elem_size ||
      a->ndim != b->ndim)
    return 0;
  for (int d = 0; d < a->ndim; d++)
    if (a->sizes[d] != b->sizes[d] || a->strides[d] != b->strides[d]) return 0;
  return 1;
}

/* 1 when tensor i changed since it was watched, 0 when not, -1 on error. A tensor that cannot be read any more
 * (turned into a kind the core does not describe) has changed. */
static int moved_one(watch_object *w, module_state *st, Py_ssize_t i) {
  fdp_tensor_t now;
  int32_t code;
  if (read_now(w, st, i, &now, &code) < 0) {
    fdp__drop_error(); /* NOTE [no lost interrupt] in binding.h */
    return 1;
  }
  if (!same_tensor(&now, &w->seen[i]) || code != w->codes[i]) return 1;
  if (!w->grads) return 0;
  int grad = requires_grad(PyTuple_GET_ITEM(w->tensors, i));
  return grad < 0 ? -1 : grad != w->grads[i];
}

/* moved() -> the indices of the tensors whose memory, shape, strides or dtype (or, for leaves, requires_grad) changed
 * since the watch was made, or None when none did. */
static PyObject *watch_moved(PyObject *op, PyObject *unused) {
  (void)unused;
  watch_object *w = (watch_object *)op;
  module_state *st = type_state(Py_TYPE(op));
  PyObject *found = NULL;
  for (Py_ssize_t i = 0; i < w->n; i++) {
    int moved = moved_one(w, st, i);
    PyObject *index = moved == 1 ? PyLong_FromSsize_t(i) : NULL;
    if (moved == 1 && !found) found = PyList_New(0);
    if (moved < 0 || (moved == 1 && (!index || !found || PyList_Append(found, index) < 0))) {
      Py_XDECREF(index);
      Py_XDECREF(found);
      return NULL;
    }
    Py_XDECREF(index);
  }
  return found ? found : Py_NewRef(Py_None);
}

/* Notes every tensor as it is now; -1 with an error set. */
static int watch_fill(watch_object *w, module_state *st) {
  for (Py_ssize_t i = 0; i < w->n; i++) {
    if (read_now(w, st, i, &w->seen[i], &w->codes[i]) < 0) return -1;
    int grad = w->grads ? requires_grad(PyTuple_GET_ITEM(w->tensors, i)) : 0;
    if (grad < 0) return -1;
    if (w->grads) w->grads[i] = (signed char)grad;
  }
  return 0;
}

static int watch_traverse(PyObject *op, visitproc visit, void *arg) {
  Py_VISIT(((watch_object *)op)->tensors);
  Py_VISIT(Py_TYPE(op));
  return 0;
}

static int watch_clear(PyObject *op) {
  Py_CLEAR(((watch_object *)op)->tensors);
  return 0;
}

static void watch_dealloc(PyObject *op) {
  watch_object *w = (watch_object *)op;
  PyTypeObject *type = Py_TYPE(op);
  PyObject_GC_UnTrack(op);
  if (w->handles) fdp__aoti_release(w->handles, w->n);
  PyMem_Free(w->handles);
  PyMem_Free(w->seen);
  PyMem_Free(w->codes);
  PyMem_Free(w->grads);
  watch_clear(op);
  type->tp_free(op);
  Py_DECREF(type);
}

/* The arrays of a watch over n tensors, and their handles where the shim reads them; -1 with an error set. */
static int watch_alloc(watch_object *w, module_state *st, int leaves) {
  size_t n = (size_t)w->n + 1; /* never a zero-byte request */
  w->handles = PyMem_Calloc(n, sizeof *w->handles);
  w->seen = PyMem_Calloc(n, sizeof *w->seen);
  w->codes = PyMem_Calloc(n, sizeof *w->codes);
  w->grads = leaves ? PyMem_Calloc(n, 1) : NULL;
  if (!w->handles || !w->seen || !w->codes || (leaves && !w->grads)) {
    PyErr_NoMemory();
    return -1;
  }
  int held = fdp__aoti_hold(st, w->tensors, w->handles);
  if (held != 0) { /* nothing held: the Python path reads them */
    PyMem_Free(w->handles);
    w->handles = NULL;
  }
  return held < 0 ? -1 : 0;
}

/* TensorWatch(tensors, leaves=False): notes each tensor's memory, shape, strides and dtype (and, for leaves, whether
 * it requires grad) to tell later whether something changed them in place (``.data`` rebound, ``set_``, ``resize_``,
 * ``t_``...) or moved their storage. */
static PyObject *watch_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"tensors", "leaves", NULL};
  PyObject *seq;
  int leaves = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|p:TensorWatch", kwlist, &seq, &leaves)) return NULL;
  PyObject *items = PySequence_Tuple(seq);
  if (!items) return NULL;
  watch_object *w = (watch_object *)type->tp_alloc(type, 0);
  if (!w) {
    Py_DECREF(items);
    return NULL;
  }
  w->tensors = items;
  w->n = PyTuple_GET_SIZE(items);
  module_state *st = type_state(type);
  if (watch_alloc(w, st, leaves) < 0 || watch_fill(w, st) < 0) Py_CLEAR(w);
  return (PyObject *)w;
}

static PyMethodDef watch_methods[] = {
    {"moved", watch_moved, METH_NOARGS, "moved() -> indices of the tensors changed since watched, or None"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot watch_slots[] = {
    {Py_tp_new, watch_new},
    {Py_tp_dealloc, watch_dealloc},
    {Py_tp_traverse, watch_traverse},
    {Py_tp_clear, watch_clear},
    {Py_tp_methods, watch_methods},
    {Py_tp_doc, "TensorWatch(tensors, leaves=False): notes each tensor's memory, shape, strides and dtype (and for "
                "leaves requires_grad); moved() names the tensors changed since."},
    {0, NULL},
};

static PyType_Spec watch_spec = {
    .name = "fastdp._C.TensorWatch",
    .basicsize = sizeof(watch_object),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = watch_slots,
};

int fdp__edits_add(PyObject *module) {
  PyObject *type = PyType_FromModuleAndSpec(module, &watch_spec, NULL);
  if (!type) return -1;
  int r = PyModule_AddObjectRef(module, "TensorWatch", type);
  Py_DECREF(type);
  return r < 0 ? -1 : PyModule_AddIntConstant(module, "DICT_TAGS", FDP_DICT_TAGS);
}

PyMethodDef fdp__edits_methods[] = {
    {"owned_edits", py_owned_edits, METH_VARARGS,
     "owned_edits(entries, seen) -> indices of the entries whose replica changed its parameter, buffer or child dict"},
    {"owned_record", py_owned_record, METH_VARARGS,
     "owned_record(entries, seen, indices=None): records the owned dicts of the entries at indices (all) as they are"},
    {"owned_records", py_owned_records, METH_O, "owned_records(n) -> the zeroed seen buffer for n entries"},
    {NULL, NULL, 0, NULL},
};
