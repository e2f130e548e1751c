/* SPDX-License-Identifier: MIT */
/* What fastdp can do here, for `python -m fastdp info` and the shim's routing: backends, the driver, NCCL and each
 * device (asked of the core, which asks the backends), the kernels' NVRTC and cache, and the route of an
 * operation. */
#include "binding.h"

#include <string.h>

/* usable(name) -> (bool, why): whether a backend can run now, from the core's own check, which loads libraries
 * and counts devices but touches no GPU (unlike info(), which lists every device). */
static PyObject *py_usable(PyObject *module, PyObject *arg) {
  (void)module;
  const char *name = PyUnicode_Check(arg) ? PyUnicode_AsUTF8(arg) : NULL;
  if (!name) {
    if (!PyErr_Occurred())
      PyErr_Format(PyExc_TypeError, "usable: expected a backend name, got %s", Py_TYPE(arg)->tp_name);
    return NULL;
  }
  for (int i = 0; i < FDP_BACKEND_COUNT; i++) {
    if (strcmp(name, fdp_backend_name((fdp_backend_id_t)i)) != 0) continue;
    const char *why = "";
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = fdp_backend_usable((fdp_backend_id_t)i, &why);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(Os)", ok ? Py_True : Py_False, ok ? "" : why);
  }
  PyErr_Format(PyExc_ValueError, "usable: unknown backend %R (expected \"host\", \"cuda\" or \"nccl\")", arg);
  return NULL;
}

/* info(memory=False): free memory is read only on devices whose primary context is already active (PyTorch or
 * fastdp used them), unless memory=True, which creates a context on every other device for the query (seconds and
 * hundreds of MB per GPU while it lives; fails under exclusive-process mode). free_bytes is None where not read. */
/* {name: {"compiled", "usable", "why"}} for every backend. */
static PyObject *backends_info(void) {
  PyObject *backends = PyDict_New();
  for (int i = 0; backends && i < FDP_BACKEND_COUNT; i++) {
    const char *why = "";
    int usable;
    Py_BEGIN_ALLOW_THREADS
    usable = fdp_backend_usable((fdp_backend_id_t)i, &why);
    Py_END_ALLOW_THREADS
    PyObject *v =
        Py_BuildValue("{s:O,s:O,s:s}", "compiled", fdp_backend_compiled((fdp_backend_id_t)i) ? Py_True : Py_False,
                      "usable", usable ? Py_True : Py_False, "why", why);
    if (!v || PyDict_SetItemString(backends, fdp_backend_name((fdp_backend_id_t)i), v) < 0) Py_CLEAR(backends);
    Py_XDECREF(v);
  }
  return backends;
}

/* One device's entry of info(): index, name, memory, peer access from it, and the error of the query. */
static PyObject *device_info(int d, int ndev, int memory) {
  fdp_device_facts_t f;
  fdp_result_t r;
  Py_BEGIN_ALLOW_THREADS
  r = fdp_device_facts(d, memory ? FDP_FREE_ALWAYS : FDP_FREE_IF_ACTIVE, &f);
  Py_END_ALLOW_THREADS
  PyObject *peers = PyList_New(ndev);
  for (int p = 0; peers && p < ndev; p++)
    PyList_SET_ITEM(peers, p, PyBool_FromLong(p == d || fdp_device_can_access_peer(d, p)));
  PyObject *free_obj =
      peers ? (f.free_read && r == FDP_OK ? PyLong_FromUnsignedLongLong(f.free_bytes) : Py_NewRef(Py_None)) : NULL;
  PyObject *v = free_obj ? Py_BuildValue("{s:i,s:s,s:K,s:N,s:N,s:s}", "index", d, "name", f.name, "total_bytes",
                                         (unsigned long long)f.total_bytes, "free_bytes", free_obj, "peer_access",
                                         peers, "error", r == FDP_OK ? "" : fdp_last_error())
                         : NULL;
  if (!free_obj) Py_XDECREF(peers);
  return v;
}

static PyObject *py_info(PyObject *module, PyObject *args, PyObject *kwargs) {
  (void)module;
  static char *kwlist[] = {"memory", NULL};
  int memory = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|p:info", kwlist, &memory)) return NULL;
  PyObject *backends = backends_info();
  if (!backends) return NULL;
  fdp_library_facts_t cuda, nccl;
  Py_BEGIN_ALLOW_THREADS
  fdp_library_facts(FDP_BACKEND_CUDA, &cuda);
  fdp_library_facts(FDP_BACKEND_NCCL, &nccl);
  Py_END_ALLOW_THREADS
  PyObject *devices = PyList_New(0);
  for (int d = 0; devices && d < cuda.devices; d++) {
    PyObject *v = device_info(d, cuda.devices, memory);
    if (!v || PyList_Append(devices, v) < 0) Py_CLEAR(devices);
    Py_XDECREF(v);
  }
  if (!devices) {
    Py_DECREF(backends);
    return NULL;
  }
  return Py_BuildValue("{s:N,s:i,s:i,s:s,s:N}", "backends", backends, "cuda_driver_version", cuda.version,
                       "nccl_version", nccl.version, "nccl_library", nccl.library, "devices", devices);
}

/* ---- kernels: NVRTC and its cache ---- */

static PyObject *py_kernels_info(PyObject *module, PyObject *unused) {
  (void)module;
  (void)unused;
  fdp_kernels_facts_t f;
  fdp_library_facts_t cuda;
  Py_BEGIN_ALLOW_THREADS
  fdp_kernels_facts(&f);
  fdp_library_facts(FDP_BACKEND_CUDA, &cuda);
  Py_END_ALLOW_THREADS
  PyObject *devices = PyList_New(cuda.devices);
  for (int d = 0; devices && d < cuda.devices; d++) {
    fdp_device_facts_t dev;
    fdp_device_facts(d, FDP_FREE_NEVER, &dev); /* a failed query leaves the source as far as it was read */
    PyObject *v = PyUnicode_FromString(dev.kernels_source);
    if (!v)
      Py_CLEAR(devices);
    else
      PyList_SET_ITEM(devices, d, v);
  }
  if (!devices) return NULL;
  return Py_BuildValue("{s:n,s:n,s:(ii),s:s,s:s,s:s,s:N}", "fatbin_bytes", (Py_ssize_t)f.fatbin_bytes, "source_bytes",
                       (Py_ssize_t)f.source_bytes, "nvrtc_version", f.nvrtc_major, f.nvrtc_minor, "nvrtc_library",
                       f.nvrtc_library, "nvrtc_why", f.nvrtc_why, "cache_dir", f.cache_dir, "devices", devices);
}

static PyObject *py_nvrtc_search_dirs(PyObject *module, PyObject *args) {
  const char *dirs;
  if (!PyArg_ParseTuple(args, "s:nvrtc_search_dirs", &dirs)) return NULL;
  fdp_result_t r = fdp_nvrtc_search_dirs(dirs);
  if (r != FDP_OK) return fdp__raise(fdp__state(module), r);
  Py_RETURN_NONE;
}

static PyObject *py_kernels_image(PyObject *module, PyObject *args) {
  int cc, forget = 0;
  if (!PyArg_ParseTuple(args, "i|p:kernels_image", &cc, &forget)) return NULL;
  fdp_kernels_image_info_t info;
  fdp_result_t r;
  Py_BEGIN_ALLOW_THREADS
  r = fdp_kernels_image(cc, forget, &info);
  Py_END_ALLOW_THREADS
  if (r != FDP_OK) return fdp__raise(fdp__state(module), r);
  static const char *const origins[] = {"disk", "compiled", "memory"};
  return Py_BuildValue("{s:n,s:s,s:i,s:s,s:d,s:s,s:s,s:s}", "bytes", (Py_ssize_t)info.bytes, "target",
                       info.ptx ? "ptx" : "cubin", "arch", info.arch, "origin", origins[info.origin], "seconds",
                       info.seconds, "file", info.file, "note", info.note, "options", info.options);
}

/* ---- route: which backend the core picks ---- */

/* route(op, devices, dtype=uint8 code) -> "nccl" | "cuda" | "host": the backend the core runs `op` ("broadcast"
 * from devices[0], "reduce" onto devices[0]) on for one flat buffer per device (ints; -1 is the host). */
static PyObject *py_route(PyObject *module, PyObject *args) {
  const char *name;
  PyObject *seq;
  int dtype = FDP_DTYPE_U8, devs[FDP_MAX_DEVICES];
  if (!PyArg_ParseTuple(args, "sO|i:route", &name, &seq, &dtype)) return NULL;
  fdp_op_t op = strcmp(name, "broadcast") == 0 ? FDP_OP_BROADCAST : FDP_OP_REDUCE;
  if (op == FDP_OP_REDUCE && strcmp(name, "reduce") != 0)
    return PyErr_Format(PyExc_ValueError, "route: unknown operation %R (expected \"broadcast\" or \"reduce\")",
                        PyTuple_GET_ITEM(args, 0));
  PyObject *fast = PySequence_Fast(seq, "route: devices must be a sequence of ints");
  if (!fast) return NULL;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  for (Py_ssize_t i = 0; i < n && i < FDP_MAX_DEVICES; i++) {
    long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(fast, i));
    devs[i] = v < FDP_HOST || v >= FDP_MAX_DEVICES ? FDP_MAX_DEVICES : (int)v; /* out of range: the core says so */
  }
  Py_DECREF(fast);
  if (PyErr_Occurred()) return NULL;
  fdp_backend_id_t id = FDP_BACKEND_HOST;
  fdp_result_t r;
  Py_BEGIN_ALLOW_THREADS
  r = fdp_route_devices(op, devs, n > FDP_MAX_DEVICES ? FDP_MAX_DEVICES + 1 : (int)n, dtype, &id);
  Py_END_ALLOW_THREADS
  if (r != FDP_OK) return fdp__raise(fdp__state(module), r);
  return PyUnicode_FromString(fdp_backend_name(id));
}

PyMethodDef fdp__facts_methods[] = {
    {"info", (PyCFunction)(void (*)(void))py_info, METH_VARARGS | METH_KEYWORDS,
     "info(memory=False): backends, driver and NCCL versions, devices (free memory only where asked or active)"},
    {"usable", py_usable, METH_O, "usable(name) -> (bool, why): whether a backend can run now; touches no GPU"},
    {"kernels_info", py_kernels_info, METH_NOARGS, "fatbin size, NVRTC library and version, cache folder, sources"},
    {"nvrtc_search_dirs", py_nvrtc_search_dirs, METH_VARARGS, "nvrtc_search_dirs('dir1:dir2'): before first use"},
    {"kernels_image", py_kernels_image, METH_VARARGS,
     "kernels_image(cc, forget=False) -> dict: the NVRTC image for sm_<cc> (memory, disk cache or compiled)"},
    {"route", py_route, METH_VARARGS, "route(op, devices, dtype=uint8) -> backend name the core picks"},
    {NULL, NULL, 0, NULL},
};
