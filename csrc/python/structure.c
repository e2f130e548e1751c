/* SPDX-License-Identifier: MIT */
/* The structure signature of a module tree, built in C because it runs every step (fastdp._replicas compares it
 * with the one its kept replicas were built from): the same list the Python walk it replaces built, entry for
 * entry, without the interpreter's per-tensor work. */
#include "binding.h"

/* Attribute names, interned once per call: a lookup by an interned str is a pointer compare in the type's dict. */
enum {
  N_PARAMS,
  N_BUFFERS,
  N_MODULES,
  N_DTYPE,
  N_SHAPE,
  N_DEVICE,
  N_REQUIRES_GRAD,
  N_LAYOUT,
  N_DATA_PTR,
  N_STRIDE,
  N_COUNT
};
static const char *const k_names[N_COUNT] = {"_parameters",   "_buffers", "_modules", "dtype",    "shape",
                                             "device",        "requires_grad",        "layout",   "data_ptr",
                                             "stride"};

/* A tensor entry: (key, id, dtype, shape, device, requires_grad, layout, data pointer, strides). The first seven
 * are the structure (a change rebuilds the kept replicas); the last two where the tensor's memory is (a change
 * only remakes what aliases it: NOTE [the master's tensors stay the user's] in fastdp/_replicas.py). */
#define ENTRY_LEN 9
#define ENTRY_STRUCTURE 7

typedef struct {
  PyObject *name[N_COUNT];
  PyObject *todo, *seen, *sig; /* the modules in walk order; their ids (a set); the signature */
  PyObject *device;            /* the last device entered: equal devices share one object (see match_batch) */
} walk_t;

static void walk_clear(walk_t *w) {
  for (int i = 0; i < N_COUNT; i++)
    Py_CLEAR(w->name[i]);
  Py_CLEAR(w->todo);
  Py_CLEAR(w->seen);
  Py_CLEAR(w->sig);
  Py_CLEAR(w->device);
}

/* `v` (a tensor's device, a new reference; NULL after an error), or the last device entered when equal to it. */
static PyObject *shared_device(walk_t *w, PyObject *v) {
  if (!v) return NULL;
  if (w->device && v != w->device) {
    int eq = PyObject_RichCompareBool(v, w->device, Py_EQ);
    if (eq < 0) fdp__drop_error(); /* a comparison that failed only loses the sharing */
    if (eq == 1) {
      Py_SETREF(v, Py_NewRef(w->device));
      return v;
    }
  }
  Py_XSETREF(w->device, Py_NewRef(v));
  return v;
}

/* Appends `entry` (a new reference, NULL after an error) to the signature; -1 on error. */
static int append(walk_t *w, PyObject *entry) {
  if (!entry) return -1;
  int r = PyList_Append(w->sig, entry);
  Py_DECREF(entry);
  return r;
}

/* t.data_ptr() or t.stride() (a new reference); None where the tensor has neither (sparse, a lazy parameter). */
static PyObject *memory_fact(PyObject *t, PyObject *name) {
  PyObject *v = PyObject_CallMethodNoArgs(t, name);
  if (!v) {
    fdp__drop_error(); /* NOTE [no lost interrupt] in binding.h */
    v = Py_NewRef(Py_None);
  }
  return v;
}

/* (key, None) for an empty slot, else the tensor's entry (ENTRY_LEN items); NULL on error. */
static PyObject *tensor_entry(walk_t *w, PyObject *key, PyObject *t) {
  if (t == Py_None) return PyTuple_Pack(2, key, Py_None);
  PyObject *e = PyTuple_New(ENTRY_LEN);
  if (!e) return NULL;
  PyTuple_SET_ITEM(e, 0, Py_NewRef(key));
  PyObject *v = PyLong_FromVoidPtr(t);
  for (int i = 1; v; i++) {
    PyTuple_SET_ITEM(e, i, v);
    if (i == ENTRY_LEN - 1) return e;
    PyObject *name = w->name[N_DTYPE + i - 1]; /* the attribute of entry slot i + 1 */
    if (i + 1 >= ENTRY_STRUCTURE) {
      v = memory_fact(t, name);
      continue;
    }
    v = PyObject_GetAttr(t, name);
    if (N_DTYPE + i - 1 == N_DEVICE) v = shared_device(w, v);
  }
  Py_DECREF(e); /* the slots not filled are NULL, which a tuple's deallocation skips */
  return NULL;
}

/* The next (key, value) of `d` (a dict, or the items list of another mapping) at *pos; 0 when done, -1 on error. */
static int next_item(PyObject *d, Py_ssize_t *pos, PyObject **key, PyObject **value) {
  if (PyDict_CheckExact(d)) return PyDict_Next(d, pos, key, value);
  if (*pos >= PyList_GET_SIZE(d)) return 0;
  PyObject *pair = PyList_GET_ITEM(d, (*pos)++);
  if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
    PyErr_SetString(PyExc_TypeError, "walk: a module's items() must yield (key, value) pairs");
    return -1;
  }
  *key = PyTuple_GET_ITEM(pair, 0);
  *value = PyTuple_GET_ITEM(pair, 1);
  return 1;
}

/* One entry per tensor slot of `d`; -1 on error. The slot's key and tensor are held while their attributes are read
 * (a Python property could change the dict). */
static int tensor_entries(walk_t *w, PyObject *d) {
  Py_ssize_t pos = 0;
  PyObject *key, *t;
  int more;
  while ((more = next_item(d, &pos, &key, &t)) == 1) {
    Py_INCREF(key);
    Py_INCREF(t);
    int r = append(w, tensor_entry(w, key, t));
    Py_DECREF(key);
    Py_DECREF(t);
    if (r < 0) return -1;
  }
  return more;
}

/* (key, id(child)) per child, and each child not seen before queued; -1 on error. */
static int child_entries(walk_t *w, PyObject *d) {
  Py_ssize_t pos = 0;
  PyObject *key, *c;
  int more;
  while ((more = next_item(d, &pos, &key, &c)) == 1) {
    PyObject *id = PyLong_FromVoidPtr(c);
    if (!id || append(w, PyTuple_Pack(2, key, id)) < 0) {
      Py_XDECREF(id);
      return -1;
    }
    int seen = c == Py_None ? 1 : PySet_Contains(w->seen, id);
    if (seen == 0 && (PySet_Add(w->seen, id) < 0 || PyList_Append(w->todo, c) < 0)) seen = -1;
    Py_DECREF(id);
    if (seen < 0) return -1;
  }
  return more;
}

/* Module attribute `name` (a new reference): from the instance __dict__, where nn.Module keeps its parameter,
 * buffer and child dicts, without the generic lookup's search of the class hierarchy first (three per module on
 * every walk); through getattr where the instance has no such entry. */
static PyObject *module_attr(PyObject *m, PyObject *name) {
  PyObject *dict = PyObject_GenericGetDict(m, NULL);
  if (!dict) {
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return NULL;
    PyErr_Clear(); /* no instance dict: getattr answers */
    return PyObject_GetAttr(m, name);
  }
  PyObject *v = PyDict_GetItemWithError(dict, name); /* borrowed */
  Py_XINCREF(v);
  Py_DECREF(dict);
  return v || PyErr_Occurred() ? v : PyObject_GetAttr(m, name);
}

/* A module's _parameters, _buffers and _modules into d[0..3) (new references: a plain dict as it is, any other
 * mapping, such as an OrderedDict, as its items() list, in its own order) and the first two's lengths; -1 on error
 * with nothing held. */
static int module_dicts(PyObject *const *name, PyObject *m, PyObject **d, Py_ssize_t *np, Py_ssize_t *nb) {
  for (int i = 0; i < 3; i++) {
    PyObject *attr = module_attr(m, name[N_PARAMS + i]);
    d[i] = attr && !PyDict_CheckExact(attr) ? PyMapping_Items(attr) : attr;
    if (d[i] != attr) Py_XDECREF(attr);
    if (!d[i]) {
      for (int j = 0; j < i; j++)
        Py_CLEAR(d[j]);
      return -1;
    }
  }
  *np = PyObject_Length(d[0]);
  *nb = PyObject_Length(d[1]);
  if (*np >= 0 && *nb >= 0) return 0;
  for (int i = 0; i < 3; i++)
    Py_CLEAR(d[i]);
  return -1;
}

/* m's instance __dict__ (a new reference), None where it has none; NULL on error. */
static PyObject *instance_dict(PyObject *m) {
  PyObject *dict = PyObject_GenericGetDict(m, NULL);
  if (dict || !PyErr_ExceptionMatches(PyExc_AttributeError)) return dict;
  PyErr_Clear();
  return Py_NewRef(Py_None);
}

/* The id of m's instance __dict__ (a new reference), None where it has none; NULL on error. A module given a new
 * __dict__ keeps the same slot dicts in it (a __setstate__ that assigns the state it got): its plain attributes,
 * which kept replicas mirror from that dict, are then elsewhere. */
static PyObject *dict_id(PyObject *m) {
  PyObject *dict = instance_dict(m);
  if (!dict || dict == Py_None) return dict;
  PyObject *id = PyLong_FromVoidPtr(dict);
  Py_DECREF(dict);
  return id;
}

/* (id, type, number of parameters, number of buffers, id of its __dict__): a module's header entry (new reference),
 * NULL on error. */
static PyObject *header_entry(PyObject *m, Py_ssize_t np, Py_ssize_t nb) {
  PyObject *id = PyLong_FromVoidPtr(m), *cp = PyLong_FromSsize_t(np), *cb = PyLong_FromSsize_t(nb), *di = dict_id(m);
  PyObject *header = id && cp && cb && di ? PyTuple_Pack(5, id, (PyObject *)Py_TYPE(m), cp, cb, di) : NULL;
  Py_XDECREF(id);
  Py_XDECREF(cp);
  Py_XDECREF(cb);
  Py_XDECREF(di);
  return header;
}

/* A module's header, then its entries; -1 on error. */
static int walk_module(walk_t *w, PyObject *m) {
  PyObject *d[3];
  Py_ssize_t np, nb;
  if (module_dicts(w->name, m, d, &np, &nb) < 0) return -1;
  int r = append(w, header_entry(m, np, nb)) < 0 || tensor_entries(w, d[0]) < 0 || tensor_entries(w, d[1]) < 0 ||
                  child_entries(w, d[2]) < 0
              ? -1
              : 0;
  for (int i = 0; i < 3; i++)
    Py_DECREF(d[i]);
  return r;
}

/* walk(root) -> (modules, signature): every distinct module under root, root first, breadth first (children in
 * registration order); and per module a header (id, type, len(_parameters), len(_buffers), id(__dict__)), one
 * entry per parameter and buffer slot ((key, None) when empty, else (key, id, dtype, shape, device, requires_grad,
 * layout, data_ptr, stride)) and one (key, id(child)) per child slot. Any change to these makes kept replicas or bucket
 * layouts stale (a data pointer or strides only what aliases the tensor). */
static PyObject *py_walk(PyObject *module, PyObject *root) {
  (void)module;
  walk_t w = {{NULL}, PyList_New(0), PySet_New(NULL), PyList_New(0), NULL};
  PyObject *ret = NULL, *id = PyLong_FromVoidPtr(root);
  if (!w.todo || !w.seen || !w.sig || !id || PySet_Add(w.seen, id) < 0 || PyList_Append(w.todo, root) < 0) goto done;
  for (int i = 0; i < N_COUNT; i++)
    if (!(w.name[i] = PyUnicode_InternFromString(k_names[i]))) goto done;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(w.todo); i++) /* grows while walked */
    if (walk_module(&w, PyList_GET_ITEM(w.todo, i)) < 0) goto done;
  ret = PyTuple_Pack(2, w.todo, w.sig);
done:
  Py_XDECREF(id);
  walk_clear(&w);
  return ret;
}

/* ---- matching a signature in place: what kept replicas check every step, with nothing built ---- */

typedef struct {
  PyObject *name[N_COUNT];
  PyObject *sig;             /* a list */
  Py_ssize_t at;             /* the next signature entry to compare */
  int moved;                 /* a tensor's data pointer or strides differ from its entry's */
  module_state *st;          /* NULL: every tensor compared through its Python attributes */
  PyObject *batch, *batched; /* tensors whose attributes match_batch compares, and their entries */
  int direct;                /* a tensor was compared through its Python attributes, outside the batch */
  PyObject *device;          /* the last entry device read, and what it is (see entry_device) */
  int device_kind;
} match_t;

/* The next signature entry (a new reference) when it is a tuple of `len` items, else NULL (a mismatch, no error
 * set). Held by the caller: a comparison's __eq__ could change the list. */
static PyObject *next_entry(match_t *mt, Py_ssize_t len) {
  if (mt->at >= PyList_GET_SIZE(mt->sig)) return NULL;
  PyObject *e = PyList_GET_ITEM(mt->sig, mt->at++);
  return PyTuple_Check(e) && PyTuple_GET_SIZE(e) == len ? Py_NewRef(e) : NULL;
}

/* 1 when `obj` is the object whose id the signature holds as `id`. */
static int is_id(PyObject *id, PyObject *obj) {
  return PyLong_CheckExact(id) && PyLong_AsVoidPtr(id) == (void *)obj;
}

/* 1 equal, 0 not, -1 error: identity first (dtypes and layouts are singletons), then ==. */
static int same(PyObject *a, PyObject *b) {
  return a == b ? 1 : PyObject_RichCompareBool(a, b, Py_EQ);
}

/* Compares a tensor's attributes with entry e through its Python API: 1 equal, 0 not, -1 error; where the
 * structure is equal, a data pointer or strides other than the entry's set mt->moved. */
static int match_attributes(match_t *mt, PyObject *e, PyObject *t) {
  int eq = 1;
  for (int i = 0; eq == 1 && i < 5; i++) {
    PyObject *v = PyObject_GetAttr(t, mt->name[N_DTYPE + i]);
    eq = v ? same(v, PyTuple_GET_ITEM(e, 2 + i)) : -1;
    Py_XDECREF(v);
  }
  for (int i = ENTRY_STRUCTURE; eq == 1 && !mt->moved && i < ENTRY_LEN; i++) {
    PyObject *v = memory_fact(t, mt->name[N_DTYPE + i - 2]);
    int here = same(v, PyTuple_GET_ITEM(e, i));
    Py_DECREF(v);
    if (here < 0) return -1;
    mt->moved = !here;
  }
  return eq;
}

/* Compares one tensor slot with entry e: 1 equal, 0 not, -1 error. A plain tensor's attributes are compared later,
 * with every other one's, by match_batch. */
static int match_tensor(match_t *mt, PyObject *e, PyObject *key, PyObject *t) {
  int eq = same(PyTuple_GET_ITEM(e, 0), key);
  if (eq != 1 || t == Py_None) return eq == 1 ? PyTuple_GET_ITEM(e, 1) == Py_None : eq;
  if (!is_id(PyTuple_GET_ITEM(e, 1), t)) return 0;
  PyObject *type = (PyObject *)Py_TYPE(t);
  if (!mt->st || (type != mt->st->tensor_type && type != mt->st->parameter_type)) {
    mt->direct = 1;
    return match_attributes(mt, e, t);
  }
  return PyList_Append(mt->batch, t) < 0 || PyList_Append(mt->batched, e) < 0 ? -1 : 1;
}

/* ---- the batch: tensor attributes read through libtorch's C shim ---- */

/* What the shim's codes stand for, learned from tensors read both ways: the torch.dtype of each dtype code, and
 * torch.strided. Strong references to torch's singletons, for the life of the process. */
static PyObject *g_dtype_objects[FDP_SHIM_DTYPES];
static PyObject *g_strided;

enum { DEVICE_UNKNOWN = -3, DEVICE_CPU = FDP_HOST }; /* else a CUDA ordinal */

/* What the entry's device object is (cached for the last one: walk makes equal devices one object). */
static int entry_device(match_t *mt, PyObject *device) {
  if (device == mt->device) return mt->device_kind;
  PyObject *type = PyObject_GetAttrString(device, "type"),
           *index = type ? PyObject_GetAttrString(device, "index") : NULL;
  int kind = DEVICE_UNKNOWN;
  if (type && index && PyUnicode_Check(type)) {
    if (PyUnicode_CompareWithASCIIString(type, "cpu") == 0 && index == Py_None) {
      kind = DEVICE_CPU;
    } else if (PyUnicode_CompareWithASCIIString(type, "cuda") == 0 && PyLong_Check(index)) {
      long i = PyLong_AsLong(index);
      kind = i >= 0 && i < FDP_MAX_DEVICES ? (int)i : DEVICE_UNKNOWN;
    }
  }
  Py_XDECREF(type);
  Py_XDECREF(index);
  fdp__drop_error(); /* an unreadable device is only unknown: the Python path compares that tensor */
  Py_XSETREF(mt->device, Py_NewRef(device));
  mt->device_kind = kind;
  return kind;
}

/* Whether shape entry `shape` (a torch.Size) holds t's sizes; -1 when it is not a tuple of ints. */
static int same_sizes(PyObject *shape, const fdp_tensor_t *t) {
  if (!PyTuple_Check(shape)) return -1;
  if (PyTuple_GET_SIZE(shape) != t->ndim) return 0;
  for (int d = 0; d < t->ndim; d++) {
    long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, d));
    if (v == -1 && PyErr_Occurred()) {
      fdp__drop_error();
      return -1;
    }
    if (v != t->sizes[d]) return 0;
  }
  return 1;
}

/* Whether entry values `ptr` (an int) and `strides` (a tuple of ints) are t's data pointer and strides. */
static int same_memory(PyObject *ptr, PyObject *strides, const fdp_tensor_t *t) {
  if (!PyLong_Check(ptr) || !PyTuple_Check(strides) || PyTuple_GET_SIZE(strides) != t->ndim) return 0;
  int same_ptr = PyLong_AsVoidPtr(ptr) == (void *)t->data;
  for (int d = 0; same_ptr && d < t->ndim; d++)
    same_ptr = PyLong_AsLongLong(PyTuple_GET_ITEM(strides, d)) == t->strides[d];
  if (PyErr_Occurred()) {
    fdp__drop_error();
    return 0;
  }
  return same_ptr;
}

/* Learns the objects of t's dtype code and layout from its Python attributes (once per code). */
static int learn(PyObject *t, int32_t code) {
  if (!g_dtype_objects[code] && !(g_dtype_objects[code] = PyObject_GetAttrString(t, "dtype"))) return -1;
  if (!g_strided && !(g_strided = PyObject_GetAttrString(t, "layout"))) return -1;
  return 0;
}

/* Compares a tensor the shim read (ts, dtype code) with entry e: 1 equal, 0 not, -1 error, 2 undecided (an entry
 * object not known here: the Python path compares it). */
static int match_facts(match_t *mt, PyObject *e, PyObject *t, const fdp_tensor_t *ts, int32_t code) {
  if (learn(t, code) < 0) return -1;
  if (PyTuple_GET_ITEM(e, 2) != g_dtype_objects[code] || PyTuple_GET_ITEM(e, 6) != g_strided) return 2;
  int device = entry_device(mt, PyTuple_GET_ITEM(e, 4)), sizes = same_sizes(PyTuple_GET_ITEM(e, 3), ts);
  if (device == DEVICE_UNKNOWN || sizes < 0) return 2;
  if (device != ts->device || !sizes) return 0;
  PyObject *rg = PyObject_GetAttr(t, mt->name[N_REQUIRES_GRAD]);
  if (!rg) return -1;
  int eq = same(rg, PyTuple_GET_ITEM(e, 5));
  Py_DECREF(rg);
  if (eq == 1 && !mt->moved) mt->moved = !same_memory(PyTuple_GET_ITEM(e, 7), PyTuple_GET_ITEM(e, 8), ts);
  return eq;
}

/* Compares the batched tensors with their entries: 1 equal, 0 not, -1 error. One conversion to handles for all. */
static int match_batch(match_t *mt) {
  Py_ssize_t n = PyList_GET_SIZE(mt->batch);
  if (n == 0) return 1;
  PyObject *items = PyList_AsTuple(mt->batch);
  fdp_tensor_t *ts = fdp_scratch_alloc((size_t)n * sizeof *ts);
  int32_t *codes = fdp_scratch_alloc((size_t)n * sizeof *codes);
  int rc = items && ts && codes ? fdp__aoti_facts(mt->st, items, ts, codes) : -1;
  if (rc < 0 && !PyErr_Occurred()) PyErr_NoMemory();
  int eq = rc < 0 ? -1 : 1;
  for (Py_ssize_t i = 0; eq == 1 && i < n; i++) {
    PyObject *t = PyTuple_GET_ITEM(items, i), *e = PyList_GET_ITEM(mt->batched, i);
    int r = rc == 0 && codes[i] >= 0 && codes[i] < FDP_SHIM_DTYPES ? match_facts(mt, e, t, &ts[i], codes[i]) : 2;
    eq = r == 2 ? match_attributes(mt, e, t) : r;
  }
  Py_XDECREF(items);
  fdp_scratch_free(ts);
  fdp_scratch_free(codes);
  return eq;
}

/* Compares one child slot with entry e: 1 equal, 0 not, -1 error. */
static int match_child(PyObject *e, PyObject *key, PyObject *c) {
  return is_id(PyTuple_GET_ITEM(e, 1), c) ? same(PyTuple_GET_ITEM(e, 0), key) : 0;
}

/* Compares one slot with the next entry: 1 equal, 0 not, -1 error. Entry, key and value are held meanwhile. */
static int match_slot(match_t *mt, PyObject *key, PyObject *v, int child) {
  PyObject *e = next_entry(mt, child ? 2 : v == Py_None ? 2 : ENTRY_LEN);
  if (!e) return 0;
  Py_INCREF(key);
  Py_INCREF(v);
  int eq = child ? match_child(e, key, v) : match_tensor(mt, e, key, v);
  Py_DECREF(key);
  Py_DECREF(v);
  Py_DECREF(e);
  return eq;
}

/* Compares the slots of one dict attribute: 1 equal, 0 not, -1 error. */
static int match_slots(match_t *mt, PyObject *d, int children) {
  Py_ssize_t pos = 0;
  PyObject *key, *v;
  int more, eq = 1;
  while (eq == 1 && (more = next_item(d, &pos, &key, &v)) == 1)
    eq = match_slot(mt, key, v, children);
  return eq == 1 ? (more < 0 ? -1 : 1) : eq;
}

/* 1 when header entry `h` (NULL: none) names module m with these counts, 0 when not, -1 on error. */
static int match_header(PyObject *h, PyObject *m, Py_ssize_t np, Py_ssize_t nb) {
  if (!h || !is_id(PyTuple_GET_ITEM(h, 0), m) || PyTuple_GET_ITEM(h, 1) != (PyObject *)Py_TYPE(m)) return 0;
  int eq = PyLong_AsSsize_t(PyTuple_GET_ITEM(h, 2)) == np && PyLong_AsSsize_t(PyTuple_GET_ITEM(h, 3)) == nb;
  if (eq == 1 && !PyErr_Occurred()) {
    PyObject *dict = instance_dict(m), *recorded = PyTuple_GET_ITEM(h, 4);
    if (dict) /* held by m: compared as the id the walk took */
      eq = dict == Py_None ? recorded == Py_None : is_id(recorded, dict);
    Py_XDECREF(dict);
  }
  return PyErr_Occurred() ? -1 : eq;
}

/* Compares one module's header and slots: 1 equal, 0 not, -1 error. */
static int match_module(match_t *mt, PyObject *m) {
  PyObject *d[3];
  Py_ssize_t np, nb;
  if (module_dicts(mt->name, m, d, &np, &nb) < 0) return -1;
  PyObject *h = next_entry(mt, 5);
  int eq = match_header(h, m, np, nb);
  Py_XDECREF(h);
  for (int i = 0; eq == 1 && i < 3; i++)
    eq = match_slots(mt, d[i], i == 2);
  for (int i = 0; i < 3; i++)
    Py_DECREF(d[i]);
  return eq;
}

/* The attribute names, interned into name[] (set to NULL first); -1 with an error set. */
static int intern_names(PyObject **name) {
  for (int i = 0; i < N_COUNT; i++)
    name[i] = NULL;
  for (int i = 0; i < N_COUNT; i++)
    if (!(name[i] = PyUnicode_InternFromString(k_names[i]))) return -1;
  return 0;
}

/* Compares every module of `modules` where it stands in the walk order, then the batch: 1, 0 or -1 (error). */
static int match_modules(match_t *mt, PyObject *modules) {
  int eq = 1;
  /* a list that changes while compared (a slot's __eq__ could) is read by index, with its size checked again */
  for (Py_ssize_t i = 0; eq == 1 && i < PyList_GET_SIZE(modules); i++) {
    PyObject *m = Py_NewRef(PyList_GET_ITEM(modules, i));
    eq = match_module(mt, m);
    Py_DECREF(m);
  }
  return eq == 1 ? match_batch(mt) : eq;
}

/* Compares modules and signature as mt holds them, through the records where every module is as they hold (mt's
 * batch then the recorded one), else module by module, recording what is found equal: 1, 0 or -1 (error). */
static int match_with_records(match_t *mt, PyObject *modules, PyObject *records) {
  PyObject *tensors, *entries;
  if (fdp__structure_recorded(records, modules, mt->sig, &tensors, &entries) == 1) {
    mt->batch = Py_NewRef(tensors);
    mt->batched = Py_NewRef(entries);
    mt->at = PyList_GET_SIZE(mt->sig);
    return match_batch(mt);
  }
  PyObject *snapshot = mt->st ? fdp__structure_snapshot(records, modules, mt->sig) : Py_NewRef(Py_None);
  if (!snapshot) return -1;
  int eq = -1;
  if ((mt->batch = PyList_New(0)) && (mt->batched = PyList_New(0))) eq = match_modules(mt, modules);
  /* Recorded only where the batch holds every tensor: the others' facts are read during the walk the records skip. */
  if (eq == 1 && mt->at == PyList_GET_SIZE(mt->sig) &&
      fdp__structure_keep(records, snapshot, mt->batch, mt->batched, !mt->moved && !mt->direct) < 0)
    eq = -1;
  Py_DECREF(snapshot);
  return eq;
}

/* matches(modules, signature, records=None) -> 0, 1 or 2: whether walk(modules[0]) would give (modules, signature)
 * now, compared in place: 0 when the structure differs, 1 when all is equal, 2 when only some tensor's data pointer
 * or strides do (its memory moved: `.data` replaced, a storage moved to shared memory). The modules are not walked
 * again: while every child slot holds the child it held, the breadth-first order over them is the one `modules`
 * recorded, so each module is compared where it stands in it. `records` (structure_records(), made with the walk)
 * lets a check whose modules are all as recorded compare the tensors' facts only (NOTE [structure records]). */
static PyObject *py_matches(PyObject *module, PyObject *args) {
  PyObject *modules, *sig, *records = Py_None;
  if (!PyArg_ParseTuple(args, "O!O!|O:matches", &PyList_Type, &modules, &PyList_Type, &sig, &records)) return NULL;
  if (records != Py_None && !fdp__structure_records_check(records)) {
    PyErr_SetString(PyExc_TypeError, "matches: records must be None or what structure_records() made");
    return NULL;
  }
  module_state *st = PyModule_GetState(module);
  int shim = st && st->tensor_type && fdp__tensor_path() == FDP_TENSOR_PATH_AOTI;
  match_t mt = {{NULL}, sig, 0, 0, shim ? st : NULL, NULL, NULL, 0, NULL, DEVICE_UNKNOWN};
  int eq = intern_names(mt.name) == 0 ? match_with_records(&mt, modules, records == Py_None ? NULL : records) : -1;
  for (int i = 0; i < N_COUNT; i++)
    Py_XDECREF(mt.name[i]);
  Py_XDECREF(mt.batch);
  Py_XDECREF(mt.batched);
  Py_XDECREF(mt.device);
  if (eq < 0) return NULL;
  return PyLong_FromLong(eq == 1 && mt.at == PyList_GET_SIZE(sig) ? 1 + mt.moved : 0);
}

/* ---- upstream's device check: every parameter and buffer on device_ids[0], without the interpreter's loop ---- */

typedef struct {
  PyObject *name[N_COUNT];
  PyObject *is_cpu;        /* the attribute read on the host (a flag, no device object made) */
  PyObject *device;        /* the device compared elsewhere */
  PyObject *todo, *seen;   /* the modules after the root in walk order; their ids and the root's (made when the
                              root has a child) */
  PyObject *root;          /* id(root) */
} device_walk_t;

/* 1 when slot value t (None counts as there) is on the walk's device, 0 when not, -1 on error. */
static int slot_on_device(device_walk_t *w, PyObject *t) {
  if (t == Py_None) return 1;
  PyObject *v = PyObject_GetAttr(t, w->is_cpu ? w->is_cpu : w->name[N_DEVICE]);
  int on = !v ? -1 : w->is_cpu ? PyObject_IsTrue(v) : same(v, w->device);
  Py_XDECREF(v);
  return on;
}

/* Whether every tensor slot of `d` is on the device: 1, 0 or -1 (error). */
static int slots_on_device(device_walk_t *w, PyObject *d) {
  Py_ssize_t pos = 0;
  PyObject *key, *t;
  int more, on = 1;
  while (on == 1 && (more = next_item(d, &pos, &key, &t)) == 1) {
    Py_INCREF(t);
    on = slot_on_device(w, t);
    Py_DECREF(t);
  }
  return on == 1 ? (more < 0 ? -1 : 1) : on;
}

/* Queues the children of `d` not seen before; -1 on error. */
static int queue_children(device_walk_t *w, PyObject *d) {
  Py_ssize_t pos = 0;
  PyObject *key, *c;
  int more;
  while ((more = next_item(d, &pos, &key, &c)) == 1) {
    if (c == Py_None) continue;
    if (!w->todo && (!(w->todo = PyList_New(0)) || !(w->seen = PySet_New(NULL)) || PySet_Add(w->seen, w->root) < 0))
      return -1;
    PyObject *id = PyLong_FromVoidPtr(c);
    int seen = id ? PySet_Contains(w->seen, id) : -1;
    if (seen == 0 && (PySet_Add(w->seen, id) < 0 || PyList_Append(w->todo, c) < 0)) seen = -1;
    Py_XDECREF(id);
    if (seen < 0) return -1;
  }
  return more;
}

/* One module's slots on the device (1, 0, -1), its children queued. */
static int module_on_device(device_walk_t *w, PyObject *m) {
  PyObject *d[3];
  Py_ssize_t np, nb;
  if (module_dicts(w->name, m, d, &np, &nb) < 0) return -1;
  int on = slots_on_device(w, d[0]);
  if (on == 1) on = slots_on_device(w, d[1]);
  if (on == 1 && queue_children(w, d[2]) < 0) on = -1;
  for (int i = 0; i < 3; i++)
    Py_DECREF(d[i]);
  return on;
}

/* on_device(root, device, host) -> bool: whether every parameter and buffer of every distinct module under root
 * is on `device` (`host`: read as each tensor's is_cpu flag). False also where a slot cannot be read (an error is
 * dropped): the caller's upstream-ordered walk then names the tensor, or raises what reading it raises. */
static PyObject *py_on_device(PyObject *module, PyObject *args) {
  (void)module;
  PyObject *root, *device;
  int host;
  if (!PyArg_ParseTuple(args, "OOp:on_device", &root, &device, &host)) return NULL;
  /* The names are interned once for the life of the process: a forward asks this every time. */
  static PyObject *names[N_COUNT], *is_cpu;
  if (!is_cpu && (intern_names(names) < 0 || !(is_cpu = PyUnicode_InternFromString("is_cpu")))) return NULL;
  device_walk_t w = {{NULL}, host ? is_cpu : NULL, device, NULL, NULL, PyLong_FromVoidPtr(root)};
  memcpy(w.name, names, sizeof names);
  int on = w.root ? module_on_device(&w, root) : -1;
  for (Py_ssize_t i = 0; on == 1 && w.todo && i < PyList_GET_SIZE(w.todo); i++) /* grows while walked */
    on = module_on_device(&w, PyList_GET_ITEM(w.todo, i));
  Py_XDECREF(w.todo);
  Py_XDECREF(w.seen);
  Py_XDECREF(w.root);
  if (on < 0) {
    if (PyErr_ExceptionMatches(PyExc_MemoryError)) return NULL;
    fdp__drop_error(); /* NOTE [no lost interrupt] in binding.h */
  }
  return PyBool_FromLong(on == 1);
}

PyMethodDef fdp__structure_methods[] = {
    {"walk", py_walk, METH_O, "walk(root) -> (modules, structure signature)"},
    {"on_device", py_on_device, METH_VARARGS,
     "on_device(root, device, host) -> bool: every parameter and buffer under root on device"},
    {"matches", py_matches, METH_VARARGS,
     "matches(modules, signature, records=None) -> 0 (the structure differs), 1 (equal), 2 (only some tensor's "
     "memory moved)"},
    {NULL, NULL, 0, NULL},
};
