/* SPDX-License-Identifier: MIT */
/* NOTE [structure records]: the kept replicas' structure check (matches() in structure.c) compares, every step, every
 * module's slots with the signature its walk made, then every tensor's facts. A module's slots are what its
 * _parameters, _buffers and _modules dicts hold, found in its instance __dict__: while its type is the same, and
 * those four dicts are the same objects with the version tags they had when the check last found everything equal,
 * the slots hold the same objects in the same order, and only the tensors' facts, which no dict tag sees (`.data`
 * replaced, requires_grad set), need reading again. So a check that finds everything equal records, per module, its
 * type and the four dicts with their tags, and keeps the tensors it compared and their entries; the next check
 * compares the records, and where every module is as recorded it compares the kept tensors' facts only. From 3.12 the
 * dict watcher also counts the recorded dicts' changes: while that count stands still no tag is read, and only each
 * module's type and instance dict are compared (a class assigned to __class__, or a new __dict__, changes no dict).
 * The record is taken before the comparison it vouches for: a change made while the comparison runs (by a finalizer
 * or a garbage collector's callback, which can run at any allocation) moves a tag or the count past what was recorded,
 * and the next check compares everything again. A walk whose comparison read some tensor outside the batch (a tensor
 * subclass, the Python tensor path) is never recorded, and is marked so that its checks take no snapshot either.
 * Only plain dicts are recorded (an OrderedDict can reorder with no change its tag shows), and nothing is recorded
 * where there are no tags. */
#include "binding.h"

#include <string.h>

enum { HEAD_MODULES, HEAD_NMODULES, HEAD_SIG, HEAD_NSIG, HEAD_COUNTED, HEAD_LEN };
/* Per module: its type, then (dict, tag) for its __dict__, _parameters, _buffers and _modules. */
enum { REC_TYPE, REC_DICTS, REC_LEN = REC_DICTS + 2 * 4 };
enum { RECORDS_BUFFER, RECORDS_TENSORS, RECORDS_ENTRIES, RECORDS_LEN };

static const char *const k_slot_dicts[3] = {"_parameters", "_buffers", "_modules"};

/* structure_records() -> the empty records matches() keeps for one (modules, signature) pair: made again with each
 * walk, never read by the caller. */
static PyObject *py_structure_records(PyObject *module, PyObject *unused) {
  (void)module;
  (void)unused;
  PyObject *records = PyList_New(RECORDS_LEN);
  for (Py_ssize_t i = 0; records && i < RECORDS_LEN; i++)
    PyList_SET_ITEM(records, i, Py_NewRef(Py_None));
  return records;
}

int fdp__structure_records_check(PyObject *records) {
  return PyList_CheckExact(records) && PyList_GET_SIZE(records) == RECORDS_LEN;
}

/* The record buffer of `records` when it was made for these modules and signature, else NULL (no error). */
static uint64_t *buffer_for(PyObject *records, PyObject *modules, PyObject *sig) {
  PyObject *buf = PyList_GET_ITEM(records, RECORDS_BUFFER);
  Py_ssize_t n = PyList_GET_SIZE(modules);
  if (!PyByteArray_CheckExact(buf) || PyByteArray_GET_SIZE(buf) != (HEAD_LEN + n * REC_LEN) * 8) return NULL;
  uint64_t *r = (uint64_t *)(void *)PyByteArray_AS_STRING(buf);
  if ((uintptr_t)r % _Alignof(uint64_t) != 0) return NULL;
  if (r[HEAD_MODULES] != (uint64_t)(uintptr_t)modules || r[HEAD_NMODULES] != (uint64_t)n ||
      r[HEAD_SIG] != (uint64_t)(uintptr_t)sig || r[HEAD_NSIG] != (uint64_t)PyList_GET_SIZE(sig))
    return NULL;
  return r;
}

/* 1 when module m's type and instance __dict__ are those of `rec` and (unless `still`: no recorded dict changed since)
 * the four dicts carry their recorded tags; 0 otherwise. */
static int module_as_recorded(PyObject *m, const uint64_t *rec, int still) {
  if ((uint64_t)(uintptr_t)Py_TYPE(m) != rec[REC_TYPE]) return 0;
  PyObject *dict = PyObject_GenericGetDict(m, NULL);
  if (!dict) {
    PyErr_Clear(); /* no instance dict: the full comparison says what that means */
    return 0;
  }
  int same = (uint64_t)(uintptr_t)dict == rec[REC_DICTS]; /* held by m: compared after the reference goes */
  Py_DECREF(dict);
  /* The other three are read only once __dict__ is known unchanged: it still holds them, so they are alive. */
  for (int k = 0; same && !still && k < 4; k++)
    same = fdp__dict_tag((PyObject *)(uintptr_t)rec[REC_DICTS + 2 * k]) == rec[REC_DICTS + 2 * k + 1];
  return same;
}

int fdp__structure_recorded(PyObject *records, PyObject *modules, PyObject *sig, PyObject **tensors,
                            PyObject **entries) {
  uint64_t *r = records && FDP_DICT_TAGS ? buffer_for(records, modules, sig) : NULL;
  if (!r) return 0;
  uint64_t counted = fdp__counted_changes(FDP_TAG_STRUCTURE);
  int still = counted && r[HEAD_COUNTED] == counted;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(modules); i++)
    if (!module_as_recorded(PyList_GET_ITEM(modules, i), r + HEAD_LEN + i * REC_LEN, still)) return 0;
  *tensors = PyList_GET_ITEM(records, RECORDS_TENSORS);
  *entries = PyList_GET_ITEM(records, RECORDS_ENTRIES);
  return PyList_CheckExact(*tensors) && PyList_CheckExact(*entries) ? 1 : 0;
}

/* Module m's record into rec: 0 when one of its dicts is not a plain dict with a tag (nothing to record), -1 on
 * error. */
static int record_module(PyObject *m, uint64_t *rec, PyObject *const *names) {
  PyObject *dict = PyObject_GenericGetDict(m, NULL);
  if (!dict) {
    PyErr_Clear();
    return 0;
  }
  int ok = PyDict_CheckExact(dict);
  PyObject *d[4] = {dict, NULL, NULL, NULL};
  for (int k = 1; ok == 1 && k < 4; k++) {
    d[k] = PyDict_GetItemWithError(dict, names[k - 1]); /* borrowed: dict holds it */
    if (!d[k] && PyErr_Occurred())
      ok = -1;
    else if (!d[k] || !PyDict_CheckExact(d[k]))
      ok = 0;
  }
  rec[REC_TYPE] = (uint64_t)(uintptr_t)Py_TYPE(m);
  for (int k = 0; ok == 1 && k < 4; k++) {
    rec[REC_DICTS + 2 * k] = (uint64_t)(uintptr_t)d[k];
    rec[REC_DICTS + 2 * k + 1] = fdp__dict_tag_counted(d[k], FDP_TAG_STRUCTURE);
    if (!rec[REC_DICTS + 2 * k + 1]) ok = 0;
  }
  Py_DECREF(dict);
  return ok;
}

/* A new record buffer of `modules` against `sig`, its count of recorded dicts' changes read once every dict is
 * counted (Py_None when some module cannot be recorded), NULL with an error set. */
static PyObject *record_buffer(PyObject *modules, PyObject *sig) {
  static PyObject *names[3];
  for (int k = 0; k < 3; k++)
    if (!names[k] && !(names[k] = PyUnicode_InternFromString(k_slot_dicts[k]))) return NULL;
  Py_ssize_t n = PyList_GET_SIZE(modules);
  if (n > (PY_SSIZE_T_MAX / 8 - HEAD_LEN) / REC_LEN) return Py_NewRef(Py_None);
  PyObject *buf = PyByteArray_FromStringAndSize(NULL, (HEAD_LEN + n * REC_LEN) * 8);
  if (!buf) return NULL;
  uint64_t *r = (uint64_t *)(void *)PyByteArray_AS_STRING(buf);
  int ok = (uintptr_t)r % _Alignof(uint64_t) == 0;
  for (Py_ssize_t i = 0; ok == 1 && i < n; i++)
    ok = record_module(PyList_GET_ITEM(modules, i), r + HEAD_LEN + i * REC_LEN, names);
  if (ok != 1) {
    Py_DECREF(buf);
    return ok < 0 ? NULL : Py_NewRef(Py_None);
  }
  r[HEAD_MODULES] = (uint64_t)(uintptr_t)modules;
  r[HEAD_NMODULES] = (uint64_t)n;
  r[HEAD_SIG] = (uint64_t)(uintptr_t)sig;
  r[HEAD_NSIG] = (uint64_t)PyList_GET_SIZE(sig);
  r[HEAD_COUNTED] = fdp__counted_changes(FDP_TAG_STRUCTURE);
  return buf;
}

PyObject *fdp__structure_snapshot(PyObject *records, PyObject *modules, PyObject *sig) {
  if (!records || !FDP_DICT_TAGS || PyList_GET_ITEM(records, RECORDS_BUFFER) == Py_False) return Py_NewRef(Py_None);
  return record_buffer(modules, sig);
}

int fdp__structure_keep(PyObject *records, PyObject *snapshot, PyObject *tensors, PyObject *entries, int recordable) {
  if (!records) return 0;
  /* What is kept replaces what was: no snapshot leaves no records, so the next check compares everything. */
  int none = snapshot == Py_None || !recordable;
  PyObject *kept[RECORDS_LEN] = {recordable ? snapshot : Py_False, none ? Py_None : tensors, none ? Py_None : entries};
  int rc = 0;
  for (Py_ssize_t i = 0; i < RECORDS_LEN; i++)
    if (PyList_SetItem(records, i, Py_NewRef(kept[i])) < 0) rc = -1;
  return rc;
}

PyMethodDef fdp__structure_records_methods[] = {
    {"structure_records", py_structure_records, METH_NOARGS,
     "structure_records() -> the records matches() keeps for one (modules, signature) pair"},
    {NULL, NULL, 0, NULL},
};
