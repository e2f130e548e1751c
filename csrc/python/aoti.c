/* SPDX-License-Identifier: MIT */
/* Tensor metadata through libtorch's stable C shim (the aoti_torch_* functions AOTInductor models call), resolved
 * at run time from the libtorch that torch itself loaded: no torch headers at build time and no C++ ABI, so one
 * build serves every torch that has the shim, and the Python path of tensors.c serves every other. */
#include "binding.h"

#include <stdio.h>
#include <string.h>

/* Our own prototypes of the shim functions used (torch/csrc/inductor/aoti_torch/c/shim.h documents them): handles
 * are opaque at::Tensor pointers, every call returns 0 on success. */
typedef void *fdp_aten_handle_t;
typedef int32_t (*shim_get_ptr_fn)(fdp_aten_handle_t, void **);
typedef int32_t (*shim_get_i64p_fn)(fdp_aten_handle_t, int64_t **);
typedef int32_t (*shim_get_i64_fn)(fdp_aten_handle_t, int64_t *);
typedef int32_t (*shim_get_i32_fn)(fdp_aten_handle_t, int32_t *);
typedef int32_t (*shim_delete_fn)(fdp_aten_handle_t);
typedef int32_t (*shim_const_fn)(void);
typedef size_t (*shim_elem_size_fn)(int32_t);
typedef int32_t (*shim_reinterpret_fn)(fdp_aten_handle_t, int64_t, const int64_t *, const int64_t *, int64_t,
                                       fdp_aten_handle_t *);

static struct {
  shim_get_ptr_fn data_ptr;
  shim_get_i64_fn dim;
  shim_get_i64p_fn sizes, strides;
  shim_get_i32_fn dtype, device_type, device_index, layout;
  shim_delete_fn delete_tensor;
  shim_elem_size_fn elem_size;     /* optional: dtypes the core does not sum need only their size */
  shim_reinterpret_fn reinterpret; /* optional, with storage_offset: fdp__aoti_views */
  shim_get_i64_fn storage_offset;
  shim_const_fn cpu_code, cuda_code, strided_code; /* what reads the codes below */
  int32_t cpu, cuda, strided;                      /* the shim's codes, read once */
  int8_t fdp_dtype[FDP_SHIM_DTYPES];               /* shim dtype -> fdp_dtype_t; -1: not in the core's table */
  int8_t size_of[FDP_SHIM_DTYPES];                 /* shim dtype -> bytes per element; 0: unknown (Python path) */
  int resolved;
} shim;

static fdp__tensor_path_t g_path = FDP_TENSOR_PATH_PYTHON;
static char g_why[320] = "fastdp._C.set_dtypes() not called yet"; /* why g_path */
static char g_shim_why[256] = "not resolved yet";                 /* why the shim cannot be used */

fdp__tensor_path_t fdp__tensor_path(void) {
  return g_path;
}

const char *fdp__tensor_path_why(void) {
  return g_why;
}

int fdp__set_tensor_path(fdp__tensor_path_t path) {
  if (path == FDP_TENSOR_PATH_AOTI && !shim.resolved) {
    PyErr_Format(PyExc_RuntimeError, "the C shim path cannot be used here: %s", g_shim_why);
    return -1;
  }
  if (path != g_path) snprintf(g_why, sizeof g_why, "chosen by fastdp._C.set_tensor_path()");
  g_path = path;
  return 0;
}

/* The shim functions the path calls, by name: the optional ones first (only some features need them), then the
 * required ones in the order a missing one is reported. */
static const struct {
  const char *name;
  void *slot;
  int required;
} k_functions[] = {
    {"aoti_torch_dtype_element_size", &shim.elem_size, 0},
    {"aoti_torch__reinterpret_tensor", &shim.reinterpret, 0},
    {"aoti_torch_get_storage_offset", &shim.storage_offset, 0},
    {"aoti_torch_get_data_ptr", &shim.data_ptr, 1},
    {"aoti_torch_get_dim", &shim.dim, 1},
    {"aoti_torch_get_sizes", &shim.sizes, 1},
    {"aoti_torch_get_strides", &shim.strides, 1},
    {"aoti_torch_get_dtype", &shim.dtype, 1},
    {"aoti_torch_get_device_type", &shim.device_type, 1},
    {"aoti_torch_get_device_index", &shim.device_index, 1},
    {"aoti_torch_get_layout", &shim.layout, 1},
    {"aoti_torch_delete_tensor_object", &shim.delete_tensor, 1},
    {"aoti_torch_device_type_cpu", &shim.cpu_code, 1},
    {"aoti_torch_device_type_cuda", &shim.cuda_code, 1},
    {"aoti_torch_layout_strided", &shim.strided_code, 1},
};
#define N_FUNCTIONS (sizeof k_functions / sizeof *k_functions)

/* Every dtype getter of the shim we know of: the element size is asked only for codes these return, because
 * aoti_torch_dtype_element_size throws a C++ exception (which would end the process) for any other number. */
static const char *const shim_dtypes[] = {
    "bool",      "uint8",      "int8",        "int16",         "int32",           "int64",           "float16",
    "bfloat16",  "float32",    "float64",     "uint16",        "uint32",          "uint64",          "complex32",
    "complex64", "complex128", "float8_e5m2", "float8_e4m3fn", "float8_e5m2fnuz", "float8_e4m3fnuz",
};
#define N_SHIM_DTYPES (sizeof shim_dtypes / sizeof *shim_dtypes)

/* Every name the path may use, looked up in one call: k_functions (same index), then the dtype getters
 * aoti_torch_dtype_<name> of shim_dtypes and of the core's dtypes. */
#define N_LOOKUP (N_FUNCTIONS + N_SHIM_DTYPES + FDP_DTYPE_COUNT)
typedef struct lookup {
  int n;
  char names[N_LOOKUP][64];
  const char *name_of[N_LOOKUP];
  void *syms[N_LOOKUP];
} lookup_t;

static void lookup_add(lookup_t *l, const char *prefix, const char *name) {
  snprintf(l->names[l->n], sizeof l->names[0], "%s%s", prefix, name);
  l->name_of[l->n] = l->names[l->n];
  l->n++;
}

static void lookup_fill(lookup_t *l) {
  l->n = 0;
  for (size_t i = 0; i < N_FUNCTIONS; i++)
    lookup_add(l, "", k_functions[i].name);
  for (size_t i = 0; i < N_SHIM_DTYPES; i++)
    lookup_add(l, "aoti_torch_dtype_", shim_dtypes[i]);
  for (int i = 1; i < FDP_DTYPE_COUNT; i++)
    lookup_add(l, "aoti_torch_dtype_", fdp_dtype_name(i));
}

/* The shim's code of aoti_torch_dtype_<name>(), or -1 when this torch has no such getter or the code is large. */
static int32_t shim_dtype(const lookup_t *l, const char *name) {
  char sym_name[64];
  snprintf(sym_name, sizeof sym_name, "aoti_torch_dtype_%s", name);
  shim_const_fn fn = NULL;
  for (int i = (int)N_FUNCTIONS; i < l->n && !fn; i++)
    if (strcmp(l->names[i], sym_name) == 0) memcpy(&fn, &l->syms[i], sizeof l->syms[i]);
  int32_t code = fn ? fn() : -1;
  return code >= 0 && code < FDP_SHIM_DTYPES ? code : -1;
}

static const int8_t fdp_sizes[FDP_DTYPE_COUNT] = {
#define FDP_X(name, str, size) size,
    FDP_DTYPE_MAP(FDP_X)
#undef FDP_X
};

/* The core's dtypes and every element size by the shim's codes, read once. */
static void map_dtypes(const lookup_t *l) {
  memset(shim.fdp_dtype, -1, sizeof shim.fdp_dtype);
  memset(shim.size_of, 0, sizeof shim.size_of);
  for (size_t i = 0; shim.elem_size && i < N_SHIM_DTYPES; i++) {
    int32_t code = shim_dtype(l, shim_dtypes[i]);
    if (code >= 0) shim.size_of[code] = (int8_t)shim.elem_size(code);
  }
  for (int i = 1; i < FDP_DTYPE_COUNT; i++) {
    int32_t code = shim_dtype(l, fdp_dtype_name(i));
    if (code < 0) continue; /* that dtype takes the Python path */
    shim.fdp_dtype[code] = (int8_t)i;
    if (!shim.elem_size) shim.size_of[code] = fdp_sizes[i];
  }
}

/* Fills the shim's slots from the looked-up symbols; 0, with the first missing required name in g_shim_why, when
 * this torch lacks one. */
static int resolve(const lookup_t *l) {
  for (size_t i = 0; i < N_FUNCTIONS; i++) {
    memcpy(k_functions[i].slot, &l->syms[i], sizeof l->syms[i]);
    if (!l->syms[i] && k_functions[i].required) {
      snprintf(g_shim_why, sizeof g_shim_why, "libtorch has no %s (torch too old for the C shim path)",
               k_functions[i].name);
      return 0;
    }
  }
  shim.cpu = shim.cpu_code();
  shim.cuda = shim.cuda_code();
  shim.strided = shim.strided_code();
  map_dtypes(l);
  return 1;
}

void fdp__aoti_init(module_state *st, const char *torch_c_file) {
  const char *want = fdp_param_str(FDP_PARAM_TENSOR_PATH);
  lookup_t l;
  lookup_fill(&l);
  int found = fdp_torch_shim_resolve(torch_c_file, l.name_of, l.n, l.syms) == FDP_OK;
  if (!found)
    snprintf(g_shim_why, sizeof g_shim_why, "%s", fdp_last_error());
  else if (!st->to_handles)
    snprintf(g_shim_why, sizeof g_shim_why, "torch has no torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors");
  shim.resolved = found && st->to_handles && resolve(&l);
  if (want && strcmp(want, "python") == 0) {
    g_path = FDP_TENSOR_PATH_PYTHON;
    snprintf(g_why, sizeof g_why, "FASTDP_TENSOR_PATH=python");
  } else if (shim.resolved) {
    /* The default because it is the faster one: about 4x less time per tensor (python -m fastdp.bench.tensor_path). */
    g_path = FDP_TENSOR_PATH_AOTI;
    snprintf(g_why, sizeof g_why, "%s",
             "the faster path where libtorch has the shim; FASTDP_TENSOR_PATH=python reads "
             "tensors through their Python API instead");
  } else {
    g_path = FDP_TENSOR_PATH_PYTHON;
    snprintf(g_why, sizeof g_why, "the C shim cannot be used: %s", g_shim_why);
  }
  if (want && *want && strcmp(want, "python") != 0 && strcmp(want, "aoti") != 0)
    snprintf(g_why + strlen(g_why), sizeof g_why - strlen(g_why),
             " (FASTDP_TENSOR_PATH=%.40s ignored: not \"python\" or \"aoti\")", want);
}

/* 1 for objects the shim path reads: exact torch.Tensor and torch.nn.Parameter (a subclass may override data_ptr
 * and friends in Python, which only the Python path honours). */
static int plain_tensors(module_state *st, PyObject *items) {
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(items); i++) {
    PyObject *type = (PyObject *)Py_TYPE(PyTuple_GET_ITEM(items, i));
    if (type != st->tensor_type && type != st->parameter_type) return 0;
  }
  return 1;
}

/* The device of a strided CPU or CUDA tensor into t; 1 for any other layout or device, or a failed shim call. */
static int device_of(fdp_aten_handle_t h, fdp_tensor_t *t) {
  int32_t layout, type, index = 0;
  if (shim.layout(h, &layout) || layout != shim.strided || shim.device_type(h, &type)) return 1;
  if (type == shim.cuda && !shim.device_index(h, &index)) {
    t->device = index;
    return 0;
  }
  t->device = FDP_HOST;
  return type == shim.cpu ? 0 : 1;
}

/* The core's dtype and the element size into t, the shim's dtype code into *code; 1 for a dtype of unknown size or a
 * failed shim call. */
static int dtype_of(fdp_aten_handle_t h, fdp_tensor_t *t, int32_t *code) {
  int32_t dtype;
  if (shim.dtype(h, &dtype) || dtype < 0 || dtype >= FDP_SHIM_DTYPES || !shim.size_of[dtype]) return 1;
  *code = dtype;
  t->dtype = shim.fdp_dtype[dtype] >= 0 ? shim.fdp_dtype[dtype] : FDP_DTYPE_OTHER;
  t->elem_size = shim.size_of[dtype];
  return 0;
}

/* Fills t from one handle. 1: the tensor is not plain strided CPU/CUDA memory of a known element size, or the shim
 * failed: the Python path describes it (and raises its usual error). */
static int from_handle(fdp_aten_handle_t h, fdp_tensor_t *t, int32_t *code) {
  int64_t ndim, *sizes, *strides;
  void *data;
  memset(t, 0, sizeof *t);
  if (device_of(h, t) || dtype_of(h, t, code) || shim.dim(h, &ndim) || ndim > FDP_MAX_DIMS || shim.data_ptr(h, &data) ||
      shim.sizes(h, &sizes) || shim.strides(h, &strides))
    return 1;
  t->data = data;
  t->ndim = (int)ndim;
  if (ndim > 0) { /* a 0-dim tensor's arrays may be NULL */
    memcpy(t->sizes, sizes, (size_t)ndim * sizeof *sizes);
    memcpy(t->strides, strides, (size_t)ndim * sizeof *strides);
  }
  return 0;
}

/* The pointer a converted handle carries: pybind11 returns void* as a capsule (unnamed today; any name is accepted;
 * a valid capsule raises nothing, so an error already set by an earlier tensor survives). NULL for anything else:
 * that tensor takes the Python path. */
static fdp_aten_handle_t handle_of(PyObject *obj) {
  return PyCapsule_CheckExact(obj) ? PyCapsule_GetPointer(obj, PyCapsule_GetName(obj)) : NULL;
}

/* One call converts the tuple `items` into a list of new at::Tensor references (capsules without a destructor),
 * one per item; NULL with a Python error when torch returned anything else. */
static PyObject *handle_list(module_state *st, PyObject *items) {
  PyObject *handles = PyObject_CallOneArg(st->to_handles, items);
  if (handles && (!PyList_Check(handles) || PyList_GET_SIZE(handles) != PyTuple_GET_SIZE(items))) {
    Py_DECREF(handles);
    PyErr_SetString(PyExc_RuntimeError, "torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors returned no handle list; "
                                        "set FASTDP_TENSOR_PATH=python");
    return NULL;
  }
  return handles;
}

/* Items converted to handles per call of each_handle. A chunk's tuple, torch's vector of it and its handle list
 * stay small requests, served from the allocator's small bins, and the handles one chunk frees are those the next
 * chunk gets back. One list of thousands of tensors is a large request, and glibc answers a large request by first
 * merging every small chunk the process freed since the last one: each step's thousands of freed handles, and the
 * freed graph of the backward with them, merged inside the step's sum. */
#define HANDLE_CHUNK 60

typedef int (*visit_fn)(void *ctx, Py_ssize_t i, fdp_aten_handle_t h);

/* visit(ctx, i, h) for each item i of the tuple `items`, h its handle (NULL where torch gave no capsule), converted
 * HANDLE_CHUNK items per call. Every handle is deleted after its visit, or each call would leak a TensorImpl reference
 * per tensor; once a visit returns nonzero, the rest are deleted unvisited and that value is returned. -1 with a
 * Python error when a conversion failed. */
static int each_handle(module_state *st, PyObject *items, visit_fn visit, void *ctx) {
  Py_ssize_t n = PyTuple_GET_SIZE(items);
  int rc = 0;
  for (Py_ssize_t at = 0; rc == 0 && at < n; at += HANDLE_CHUNK) {
    PyObject *chunk = n <= HANDLE_CHUNK ? Py_NewRef(items) : PyTuple_GetSlice(items, at, at + HANDLE_CHUNK);
    PyObject *handles = chunk ? handle_list(st, chunk) : NULL;
    Py_XDECREF(chunk);
    if (!handles) return -1;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(handles); i++) {
      fdp_aten_handle_t h = handle_of(PyList_GET_ITEM(handles, i));
      if (rc == 0) rc = visit(ctx, at + i, h);
      if (h) shim.delete_tensor(h);
    }
    Py_DECREF(handles);
  }
  return rc;
}

typedef struct {
  fdp_tensor_t *ts;
  int32_t *codes;
} read_ctx_t;

static int read_one(void *ctx, Py_ssize_t i, fdp_aten_handle_t h) {
  read_ctx_t *r = ctx;
  int32_t code = -1;
  if (!h || from_handle(h, &r->ts[i], &code)) {
    code = -1;
    r->ts[i].elem_size = 0;
  }
  if (r->codes) r->codes[i] = code;
  return 0;
}

/* Reads every tensor of `items` through the shim into ts[i], and its shim dtype code into codes[i] when codes is
 * not NULL. A tensor the shim cannot read (not plain strided CPU/CUDA memory of a known element size, or the shim
 * failed) is marked by ts[i].elem_size == 0 (no readable tensor has that) and codes[i] == -1. 1 when the tuple holds
 * objects the shim path never reads (subclasses), -1 with an error when the conversion itself failed, else 0. */
static int read_handles(module_state *st, PyObject *items, fdp_tensor_t *ts, int32_t *codes) {
  if (!plain_tensors(st, items)) return 1;
  read_ctx_t r = {ts, codes};
  return each_handle(st, items, read_one, &r);
}

int fdp__aoti_describe(module_state *st, PyObject *items, fdp_tensor_t *ts, const char *what, int single) {
  int rc = read_handles(st, items, ts, NULL);
  /* A tensor the shim could not read goes through the Python path, which raises its usual error for bad ones. */
  for (Py_ssize_t i = 0; rc == 0 && i < PyTuple_GET_SIZE(items); i++)
    if (ts[i].elem_size == 0 && fdp__describe_python(st, PyTuple_GET_ITEM(items, i), &ts[i], what, single ? -1 : i) < 0)
      rc = -1;
  return rc;
}

int fdp__aoti_try_describe(module_state *st, PyObject *items, fdp_tensor_t *ts) {
  int rc = read_handles(st, items, ts, NULL);
  for (Py_ssize_t i = 0; rc == 0 && i < PyTuple_GET_SIZE(items); i++)
    if (ts[i].elem_size == 0) rc = 1;
  return rc;
}

typedef struct {
  fdp__fits_fn fits;
  const void *ctx;
  char **ptrs;
} data_ctx_t;

static int data_one(void *ctx, Py_ssize_t i, fdp_aten_handle_t h) {
  data_ctx_t *d = ctx;
  fdp_tensor_t t; /* one descriptor at a time: only the pointer is kept */
  int32_t code;
  if (!h || from_handle(h, &t, &code) || !d->fits(d->ctx, i, &t)) return 1;
  d->ptrs[i] = t.data;
  return 0;
}

int fdp__aoti_data(module_state *st, PyObject *items, fdp__fits_fn fits, const void *ctx, char **ptrs) {
  if (g_path != FDP_TENSOR_PATH_AOTI || !plain_tensors(st, items)) return 1;
  data_ctx_t d = {fits, ctx, ptrs};
  return each_handle(st, items, data_one, &d);
}

int fdp__aoti_facts(module_state *st, PyObject *items, fdp_tensor_t *ts, int32_t *codes) {
  if (g_path != FDP_TENSOR_PATH_AOTI) return 1;
  return read_handles(st, items, ts, codes);
}

void fdp__aoti_release(void **handles, Py_ssize_t n) {
  for (Py_ssize_t i = 0; i < n; i++)
    if (handles[i]) shim.delete_tensor(handles[i]);
}

int fdp__aoti_hold(module_state *st, PyObject *items, void **handles) {
  if (g_path != FDP_TENSOR_PATH_AOTI || !plain_tensors(st, items)) return 1;
  PyObject *list = handle_list(st, items);
  if (!list) return -1;
  Py_ssize_t n = PyTuple_GET_SIZE(items);
  int rc = 0;
  for (Py_ssize_t i = 0; i < n; i++) {
    handles[i] = handle_of(PyList_GET_ITEM(list, i));
    if (!handles[i]) rc = 1;
  }
  Py_DECREF(list);
  if (rc) fdp__aoti_release(handles, n); /* not every item became a handle: the Python path reads these tensors */
  return rc;
}

int fdp__aoti_read(void *handle, fdp_tensor_t *t, int32_t *code) {
  int64_t ndim, *sizes, *strides;
  void *data;
  memset(t, 0, sizeof *t);
  if (shim.data_ptr(handle, &data) || shim.dim(handle, &ndim) || ndim < 0 || ndim > FDP_MAX_DIMS ||
      shim.sizes(handle, &sizes) || shim.strides(handle, &strides) || shim.dtype(handle, code))
    return 1;
  t->data = data;
  t->ndim = (int)ndim;
  if (ndim > 0) {
    memcpy(t->sizes, sizes, (size_t)ndim * sizeof *sizes);
    memcpy(t->strides, strides, (size_t)ndim * sizeof *strides);
  }
  return 0;
}

/* ---- views of a flat buffer ---- */

/* The handle of `flat` when it is a plain, dense, 1-D CPU or CUDA tensor at storage offset 0 (its element count into
 * *numel); NULL with no error set when the Python path should make the views instead, NULL with an error set when
 * the conversion itself failed. The caller deletes the handle. */
static fdp_aten_handle_t flat_handle(module_state *st, PyObject *flat, int64_t *numel) {
  PyObject *one = PyTuple_Pack(1, flat);
  if (!one) return NULL;
  fdp_aten_handle_t h = NULL;
  if (plain_tensors(st, one)) {
    PyObject *handles = PyObject_CallOneArg(st->to_handles, one);
    if (handles && PyList_Check(handles) && PyList_GET_SIZE(handles) == 1) h = handle_of(PyList_GET_ITEM(handles, 0));
    Py_XDECREF(handles);
  }
  Py_DECREF(one);
  fdp_tensor_t t;
  int64_t offset = -1;
  int32_t code;
  if (h && (from_handle(h, &t, &code) || shim.storage_offset(h, &offset) || offset != 0 || t.ndim != 1 ||
            (t.sizes[0] > 1 && t.strides[0] != 1))) {
    shim.delete_tensor(h);
    return NULL;
  }
  if (h) *numel = t.sizes[0];
  return h;
}

/* Deletes the handles the capsules of `caps` carry (views made, then not handed to torch). */
static void delete_handles(PyObject *caps) {
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(caps); i++) {
    fdp_aten_handle_t h = handle_of(PyList_GET_ITEM(caps, i));
    if (h) shim.delete_tensor(h);
  }
}

/* Where make_views is in the spec: its index, and the next view's element offset into the buffer. */
typedef struct {
  Py_ssize_t i;
  int64_t offset;
} spec_pos_t;

/* The next views of `h` (numel elements), at most HANDLE_CHUNK of them, from spec entry p->i on (ndim, sizes...),
 * contiguous and back to back, as capsules appended to `caps`. -1 with an error set for a malformed spec, a spec
 * longer than the buffer, or a failed shim call. */
static int make_views(fdp_aten_handle_t h, int64_t numel, const int64_t *spec, Py_ssize_t n, spec_pos_t *p,
                      PyObject *caps) {
  for (int made = 0; p->i < n && made < HANDLE_CHUNK; made++) {
    Py_ssize_t i = p->i;
    int64_t ndim = spec[i++], strides[FDP_MAX_DIMS], count = 1;
    if (ndim < 0 || ndim > FDP_MAX_DIMS || ndim > n - i) {
      PyErr_Format(PyExc_ValueError, "views: spec entry at %zd has %lld dimensions (0..%d, within the spec)", i - 1,
                   (long long)ndim, FDP_MAX_DIMS);
      return -1;
    }
    const int64_t *sizes = spec + i;
    for (int64_t d = ndim - 1; d >= 0; d--) {
      if (sizes[d] < 0 || (sizes[d] > 0 && count > INT64_MAX / sizes[d])) {
        PyErr_Format(PyExc_ValueError, "views: spec entry at %zd has a bad size %lld", i - 1, (long long)sizes[d]);
        return -1;
      }
      strides[d] = count;
      count *= sizes[d];
    }
    if (count > numel - p->offset) {
      PyErr_Format(PyExc_ValueError, "views: the spec needs more than the buffer's %lld elements", (long long)numel);
      return -1;
    }
    fdp_aten_handle_t view = NULL;
    if (shim.reinterpret(h, ndim, sizes, strides, p->offset, &view) || !view) {
      PyErr_SetString(PyExc_RuntimeError,
                      "views: aoti_torch__reinterpret_tensor failed; set FASTDP_TENSOR_PATH=python");
      return -1;
    }
    PyObject *cap = PyCapsule_New(view, NULL, NULL);
    if (!cap || PyList_Append(caps, cap) < 0) {
      Py_XDECREF(cap);
      shim.delete_tensor(view);
      return -1;
    }
    Py_DECREF(cap);
    p->i = i + (Py_ssize_t)ndim;
    p->offset += count;
  }
  return 0;
}

/* The number of entries of a spec (counted up to the first malformed one, which make_views reports). */
static Py_ssize_t spec_entries(const int64_t *spec, Py_ssize_t n) {
  Py_ssize_t count = 0;
  for (Py_ssize_t i = 0; i < n && spec[i] >= 0 && spec[i] <= FDP_MAX_DIMS && spec[i] <= n - i - 1; i += 1 + spec[i])
    count++;
  return count;
}

/* Tensors over the view handles of `caps` into views[at...], converted in one call (torch takes over every handle of
 * a list it converts; a failure before that leaves them to us). -1 with an error set. */
static int take_views(module_state *st, PyObject *caps, PyObject *views, Py_ssize_t at) {
  PyObject *made = PyObject_CallOneArg(st->from_handles, caps);
  if (!made) {
    delete_handles(caps);
    return -1;
  }
  Py_ssize_t n = PyList_GET_SIZE(caps);
  if (!PyList_Check(made) || PyList_GET_SIZE(made) != n || at + n > PyTuple_GET_SIZE(views)) {
    Py_DECREF(made);
    PyErr_SetString(PyExc_RuntimeError, "torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs returned no tensor "
                                        "list; set FASTDP_TENSOR_PATH=python");
    return -1;
  }
  for (Py_ssize_t i = 0; i < n; i++)
    PyTuple_SET_ITEM(views, at + i, Py_NewRef(PyList_GET_ITEM(made, i)));
  Py_DECREF(made);
  return 0;
}

/* Every view of `h` the spec names into `views` (a tuple of their number), HANDLE_CHUNK per conversion, for the
 * reason each_handle gives. -1 with an error set. */
static int views_in_chunks(module_state *st, fdp_aten_handle_t h, int64_t numel, const int64_t *spec, Py_ssize_t n,
                           PyObject *views) {
  spec_pos_t pos = {0, 0};
  Py_ssize_t done = 0;
  while (pos.i < n) {
    PyObject *caps = PyList_New(0);
    if (!caps) return -1;
    int rc = make_views(h, numel, spec, n, &pos, caps);
    if (rc < 0)
      delete_handles(caps);
    else
      rc = take_views(st, caps, views, done);
    done += PyList_GET_SIZE(caps);
    Py_DECREF(caps);
    if (rc < 0) return -1;
  }
  return 0;
}

/* See binding.h. */
PyObject *fdp__aoti_views(module_state *st, PyObject *flat, const int64_t *spec, Py_ssize_t n) {
  if (g_path != FDP_TENSOR_PATH_AOTI || !shim.reinterpret || !shim.storage_offset || !st->from_handles) Py_RETURN_NONE;
  int64_t numel = 0;
  fdp_aten_handle_t h = flat_handle(st, flat, &numel);
  if (!h) return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
  PyObject *views = PyTuple_New(spec_entries(spec, n));
  if (views && views_in_chunks(st, h, numel, spec, n, views) < 0) Py_CLEAR(views);
  shim.delete_tensor(h); /* each view holds its own reference to the storage */
  return views;
}
