/* SPDX-License-Identifier: MIT */
/* What the files of fastdp._C share: the module state, each file's table of entry points, the one mapping of core
 * results to exceptions (errors.c), the argument converters that turn Python arguments into core descriptors
 * (tensors.c) and the tensor metadata path through libtorch's C shim (aoti.c). Every function here needs the GIL. */
#ifndef FASTDP_PYTHON_BINDING_H
#define FASTDP_PYTHON_BINDING_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "fastdp.h"

typedef struct {
  PyObject *dtypes;         /* dict: torch.dtype -> fdp_dtype_t */
  PyObject *itemsizes;      /* dict: torch.dtype -> bytes per element, filled on first sight */
  PyObject *tensor_type;    /* torch.Tensor */
  PyObject *parameter_type; /* torch.nn.Parameter: a subclass the shim path reads like a plain tensor */
  PyObject *to_handles;     /* torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors, or NULL */
  PyObject *from_handles;   /* torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs, or NULL */
  PyObject *FastDPError, *CudaError, *NcclError, *BackendUnavailableError;
  /* Interned attribute names: the Python path runs them for every tensor of every call. */
  PyObject *s_data_ptr, *s_shape, *s_stride, *s_dtype, *s_is_cuda, *s_get_device, *s_device, *s_type, *s_itemsize;
} module_state;

static inline module_state *fdp__state(PyObject *module) {
  return (module_state *)PyModule_GetState(module);
}

/* While the interpreter finalizes (atexit, a __del__), the CUDA runtime and PyTorch's allocator may be gone. */
static inline int fdp__finalizing(void) {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

/* The roles whose dicts' changes are counted: refresh's pairs (refresh.c), the replicas' owned dicts (edits.c), the
 * master modules' dicts the structure check records (structure_records.c). */
enum { FDP_TAG_REFRESH, FDP_TAG_OWNED, FDP_TAG_STRUCTURE, FDP_TAG_ROLES };
/* A dict's version tag: globally unique, new on every change (PEP 509's, up to CPython 3.11; from 3.12 given by a
 * dict watcher, NOTE [dict tags from 3.12] in dicttags.c). FDP_DICT_TAGS is false where there are none (3.12 with
 * every watcher taken): fdp__dict_tag then returns 0 and callers compare contents (NOTE [refresh records]). */
#if PY_VERSION_HEX < 0x030C0000
#define FDP_DICT_TAGS 1
static inline uint64_t fdp__dict_tag(PyObject *d) {
  return ((PyDictObject *)d)->ma_version_tag;
}
/* No count of changes up to 3.11: 0, never a count a record holds. */
static inline uint64_t fdp__dict_tag_counted(PyObject *d, int role) {
  (void)role;
  return fdp__dict_tag(d);
}
static inline uint64_t fdp__counted_changes(int role) {
  (void)role;
  return 0;
}
#else
extern int fdp__dict_watcher;
#define FDP_DICT_TAGS (fdp__dict_watcher >= 0)
uint64_t fdp__dict_tag(PyObject *d);
uint64_t fdp__dict_tag_counted(PyObject *d, int role); /* the tag, and d's changes counted in `role` from now on */
uint64_t fdp__counted_changes(int role);               /* the changes counted in `role` so far */
#endif
int fdp__dict_tags_init(void); /* at module exec, before DICT_TAGS is published */

/* The structure check's records (NOTE [structure records] in structure_records.c). fdp__structure_recorded: 1 when
 * every module of `modules` is as `records` (made for modules and sig) holds, with the tensors last compared and
 * their entries in *tensors and *entries (borrowed); 0 when everything must be compared. fdp__structure_snapshot:
 * the record of `modules` as they are now, taken before a comparison (Py_None where nothing can be recorded), NULL
 * with an error set. fdp__structure_keep: after a comparison that found modules and sig equal, keeps the snapshot with
 * its tensors and entries (lists), or, where not `recordable` (a tensor compared outside the batch), marks the
 * records so that no snapshot is taken for them again; -1 with an error set. */
int fdp__structure_records_check(PyObject *records); /* whether `records` is what structure_records() makes */
int fdp__structure_recorded(PyObject *records, PyObject *modules, PyObject *sig, PyObject **tensors,
                            PyObject **entries);
PyObject *fdp__structure_snapshot(PyObject *records, PyObject *modules, PyObject *sig);
int fdp__structure_keep(PyObject *records, PyObject *snapshot, PyObject *tensors, PyObject *entries, int recordable);

/* NOTE [no lost interrupt]: where the binding drops an error (a fact it can do without), the failed call may have run
 * Python code (a property, a tensor subclass's __torch_function__, an import), and Ctrl-C is raised as
 * KeyboardInterrupt in whatever Python code the main thread runs next: dropping it would lose the interrupt. So the
 * error is dropped and an interrupt re-armed (PyErr_SetInterrupt, as a new SIGINT would), and the interpreter raises
 * it to the caller at its next check. */
static inline void fdp__drop_error(void) {
  int interrupted = PyErr_ExceptionMatches(PyExc_KeyboardInterrupt);
  PyErr_Clear();
  if (interrupted) PyErr_SetInterrupt();
}

/* ---- entry points: each file's table, added to the module by module.c ---- */
extern PyMethodDef fdp__ops_methods[];       /* ops.c: copy, broadcast, reduce, scatter, gather, plan, ... */
extern PyMethodDef fdp__refresh_methods[];   /* refresh.c: the kept replicas' per-step refresh */
extern PyMethodDef fdp__structure_methods[]; /* structure.c: walk, matches */
extern PyMethodDef fdp__describe_methods[];  /* describe.c: the tensor path, descriptors, result views */
extern PyMethodDef fdp__facts_methods[];     /* facts.c: info, usable, kernels, route */
extern PyMethodDef fdp__errors_methods[];    /* errors.c: set_oom_error */
extern PyMethodDef fdp__allocator_methods[]; /* allocator.c: set_device_allocator */
extern PyMethodDef fdp__fence_methods[];     /* fence.c: order */
extern PyMethodDef fdp__edits_methods[];     /* edits.c: what a forward changed on the kept replicas */
/* structure_records.c: the structure check's records */
extern PyMethodDef fdp__structure_records_methods[];
/* fence.c, prepared.c, edits.c: add the Fence, PreparedCopy and TensorWatch types (and edits.c its DICT_TAGS flag) to
 * the module; -1 with an error set. */
int fdp__fence_type_add(PyObject *module);
int fdp__prepared_type_add(PyObject *module);
int fdp__edits_add(PyObject *module);

/* ---- errors (errors.c): the one way a core result becomes an exception ----
 * Failures of the binding's own argument checks raise TypeError / ValueError naming the argument, as the
 * converters do; every core result goes through these. */
PyObject *fdp__raise(module_state *st, fdp_result_t r); /* always NULL, with the exception of r set */
PyObject *fdp__none_or_raise(module_state *st, fdp_result_t r);
PyObject *fdp__torch_oom(void); /* PyTorch's OutOfMemoryError class, once set_oom_error was called; else NULL */

/* Unregisters PyTorch's allocator from the core (allocator.c): the module is going away. */
void fdp__allocator_release(void);

/* A converter's target for the argument called `name` in errors (fdp__tensor_list_t, fdp__tensor_arg_t). */
#define FDP_ARG(name) {.st = st, .what = name}

/* ---- argument converters (PyArg_ParseTuple "O&") ----
 * The caller fills `st` and `what` (the argument's name in error messages) before parsing. The list and column
 * converters return Py_CLEANUP_SUPPORTED: when a later argument fails, Python calls them again with NULL and they
 * release what they made; after a successful parse the caller releases it with the matching _clear function. */

typedef struct {
  module_state *st;
  const char *what;
  fdp_tensor_t *t; /* n descriptors (PyMem) */
  Py_ssize_t n;
  PyObject *keep; /* tuple of the tensors described: their memory stays alive while the GIL is released */
} fdp__tensor_list_t;

typedef struct {
  module_state *st;
  const char *what;
  fdp_tensor_t t; /* borrows the argument, which the argument tuple keeps alive */
} fdp__tensor_arg_t;

int fdp__tensor_list_converter(PyObject *obj, void *out);
void fdp__tensor_list_clear(fdp__tensor_list_t *list);
int fdp__tensor_converter(PyObject *obj, void *out);
/* None or a sequence of (device, stream handle) pairs into an fdp_streams_t the caller zeroed. */
int fdp__streams_converter(PyObject *obj, void *out);
/* ValueError when n tensors are too many for the core's int counts. */
int fdp__check_count(Py_ssize_t n);

/* Fills `t` from a CPU or CUDA torch.Tensor through its Python API (pyapi.c: a leaf, which the shim path falls back
 * to). `what` names the argument in errors, as
 * what[index] for a list element or alone when index is -1. */
int fdp__describe_python(module_state *st, PyObject *obj, fdp_tensor_t *t, const char *what, Py_ssize_t index);
/* Fills ts[0..n) from the tuple `items` through the path in use (see fdp__tensor_path): the one place that chooses.
 * Errors name what[i], or what alone when `single` (a 1-tuple holding one tensor argument). */
int fdp__describe_items(module_state *st, PyObject *items, fdp_tensor_t *ts, const char *what, int single);

/* ---- the shim path (aoti.c) ---- */

typedef enum { FDP_TENSOR_PATH_PYTHON = 0, FDP_TENSOR_PATH_AOTI = 1 } fdp__tensor_path_t;

#define FDP_SHIM_DTYPES 64 /* c10::ScalarType values are small; a larger one goes to the Python path */

/* Resolves the aoti_torch_* functions from the libtorch that torch's _C module loaded (torch_c_file: that module's
 * file) and picks the path FASTDP_TENSOR_PATH asks for, or the default. Never raises; a shim that cannot be used
 * leaves the Python path in use, with the reason in fdp__tensor_path_why. */
void fdp__aoti_init(module_state *st, const char *torch_c_file);
fdp__tensor_path_t fdp__tensor_path(void);
const char *fdp__tensor_path_why(void);
/* Switches the path (tests, benchmarks); -1 with a RuntimeError when the shim was not resolved. */
int fdp__set_tensor_path(fdp__tensor_path_t path);
/* Describes the tuple `items` through the shim. 1: the list holds objects the shim path leaves to the Python path
 * (non-tensors, tensor subclasses), nothing done; 0: done; -1: a Python error is set. Tensors the shim cannot read
 * as plain strided CPU/CUDA memory (sparse, meta, unknown dtype) go to fdp__describe_python one by one, so both
 * paths raise the same errors. */
int fdp__aoti_describe(module_state *st, PyObject *items, fdp_tensor_t *ts, const char *what, int single);
/* As fdp__aoti_describe, but 1 (nothing raised) as soon as one item is not a tensor the shim reads as plain strided
 * CPU/CUDA memory (None, a subclass, sparse, meta): for callers with a fallback of their own. */
int fdp__aoti_try_describe(module_state *st, PyObject *items, fdp_tensor_t *ts);
/* For the tuple `items` of exact torch.Tensor / Parameter objects: each one's descriptor into ts[i] and the shim's
 * dtype code (c10::ScalarType) into codes[i], -1 where the shim cannot read it as plain strided CPU/CUDA memory.
 * 0 done, 1 nothing done (the Python path is in use, or an item is of another type), -1 with an error set. */
int fdp__aoti_facts(module_state *st, PyObject *items, fdp_tensor_t *ts, int32_t *codes);
/* Whether descriptor `t` of item i is what the caller expects (fdp__aoti_data). */
typedef int (*fdp__fits_fn)(const void *ctx, Py_ssize_t i, const fdp_tensor_t *t);
/* The data pointer of every item of the tuple `items` into ptrs, each tensor read through the shim one descriptor at
 * a time and handed to `fits` (nothing of it is kept but the pointer): 0 when every item is a plain strided CPU/CUDA
 * tensor that fits; 1 (nothing raised) when one is not, or the shim path is not in use; -1 with an error set. */
int fdp__aoti_data(module_state *st, PyObject *items, fdp__fits_fn fits, const void *ctx, char **ptrs);
/* Handles of the tensors of the tuple `items` (exact torch.Tensor / Parameter objects) kept past this call, so that
 * the same tensors are read again later with no conversion (fdp__aoti_read): a handle holds its tensor's TensorImpl,
 * whose storage, sizes and strides it reads as they are then. 0 done, 1 nothing done (the Python path is in use, or
 * an item is of another type), -1 with an error set. The caller deletes them with fdp__aoti_release. */
int fdp__aoti_hold(module_state *st, PyObject *items, void **handles);
/* What tells one held handle's tensor from another: its data pointer, sizes and strides into t (the rest of t zeroed)
 * and its shim dtype code into *code; 1 when the shim failed to read them, else 0. */
int fdp__aoti_read(void *handle, fdp_tensor_t *t, int32_t *code);
void fdp__aoti_release(void **handles, Py_ssize_t n);
/* A new tuple of tensors over the memory of `flat` (a dense 1-D tensor at storage offset 0): for each entry of `spec`
 * (n int64 values: ndim, then ndim sizes, per entry), a contiguous tensor of those sizes, the entries back to back
 * from element 0. They share flat's storage (each holds a reference to it) but are not autograd views of it: each
 * has its own version counter, so they suit results nobody differentiates through (reduced gradients). None (a new
 * reference) when the shim path is not in use or cannot make them (no aoti_torch__reinterpret_tensor, a flat that is
 * not plain, dense, 1-D at offset 0): the caller makes views with torch instead. NULL with ValueError for a spec that
 * is malformed or needs more elements than flat has. */
PyObject *fdp__aoti_views(module_state *st, PyObject *flat, const int64_t *spec, Py_ssize_t n);

#endif
