"""The simulated driver holds fastdp to the real driver's own rules: launch geometry against the device's limits and
the kernel's __launch_bounds__, every field of a copy descriptor the driver refuses or reads, and fresh memory that
nobody wrote (poisoned with NaN). Each rule is tested here on the simulator itself, with ctypes, so that a rule the
simulator stops enforcing fails here; fastdp's own launches and descriptors meet them in tests/test_sim.py (the C
program) and tests/test_sim_python.py, which fail on any misuse the simulator records."""

import ctypes
import importlib.util
import os
import struct

import pytest

pytestmark = pytest.mark.sim

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CUDA_SUCCESS, CUDA_ERROR_INVALID_VALUE = 0, 1
HOST, DEVICE, ARRAY, UNIFIED = 1, 2, 3, 4
SUM_ARGS_BYTES = 8 * 32 + 24  # fdp_sum_args_t: in[32], out, n, k, pad (csrc/backend/cuda/kernels.h)


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_simbuild = _load("fastdp_sim_build", os.path.join(HERE, "sim", "build.py"))
vp, sz, u64, ci = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_ulonglong, ctypes.c_int


class Memcpy2D(ctypes.Structure):
    _fields_ = [("srcXInBytes", sz), ("srcY", sz), ("srcMemoryType", ci), ("srcHost", vp), ("srcDevice", u64),
                ("srcArray", vp), ("srcPitch", sz), ("dstXInBytes", sz), ("dstY", sz), ("dstMemoryType", ci),
                ("dstHost", vp), ("dstDevice", u64), ("dstArray", vp), ("dstPitch", sz), ("WidthInBytes", sz),
                ("Height", sz)]


class Memcpy3DPeer(ctypes.Structure):
    _fields_ = [("srcXInBytes", sz), ("srcY", sz), ("srcZ", sz), ("srcLOD", sz), ("srcMemoryType", ci),
                ("srcHost", vp), ("srcDevice", u64), ("srcArray", vp), ("srcContext", vp), ("srcPitch", sz),
                ("srcHeight", sz), ("dstXInBytes", sz), ("dstY", sz), ("dstZ", sz), ("dstLOD", sz),
                ("dstMemoryType", ci), ("dstHost", vp), ("dstDevice", u64), ("dstArray", vp), ("dstContext", vp),
                ("dstPitch", sz), ("dstHeight", sz), ("WidthInBytes", sz), ("Height", sz), ("Depth", sz)]


class Driver:
    """The simulated libcuda through ctypes, with device 0's primary context current."""

    def __init__(self):
        if _simbuild.compiler() is None or _simbuild.cxx_compiler() is None:
            pytest.skip("no C and C++ compiler: the simulated GPU cannot be built")
        self.lib = lib = ctypes.CDLL(_simbuild.build()["cuda"])
        P = ctypes.POINTER
        for name, args in [
            ("cuInit", [ctypes.c_uint]), ("cuDevicePrimaryCtxRetain", [P(vp), ci]),
            ("cuCtxPushCurrent_v2", [vp]), ("cuCtxPopCurrent_v2", [P(vp)]),
            ("cuModuleLoadData", [P(vp), ctypes.c_char_p]), ("cuModuleGetFunction", [P(vp), vp, ctypes.c_char_p]),
            ("cuLaunchKernel", [vp] + [ctypes.c_uint] * 7 + [vp, P(vp), P(vp)]),
            ("cuMemAlloc_v2", [P(u64), sz]), ("cuMemAllocAsync", [P(u64), sz, vp]), ("cuMemFree_v2", [u64]),
            ("cuMemFreeAsync", [u64, vp]), ("cuStreamSynchronize", [vp]), ("cuCtxSynchronize", []),
            ("cuMemcpy2DAsync_v2", [P(Memcpy2D), vp]), ("cuMemcpy3DPeerAsync", [P(Memcpy3DPeer), vp]),
            ("simgpu_errors", [ctypes.c_char_p, sz]), ("simgpu_reset", []),
            ("simgpu_alloc", [ci, sz]), ("simgpu_free", [u64]), ("simgpu_read", [vp, u64, sz]),
            ("simgpu_write", [u64, vp, sz]),
            ("simgpu_cache_alloc", [vp, ci, sz, vp, P(vp), P(vp), ctypes.c_char_p, sz]),
            ("simgpu_cache_free", [vp, ci, vp, vp]),
        ]:
            getattr(lib, name).argtypes = args
        lib.simgpu_errors.restype = ctypes.c_longlong
        lib.simgpu_alloc.restype = u64
        assert lib.cuInit(0) == CUDA_SUCCESS
        self.ctx = vp()
        assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), 0) == CUDA_SUCCESS
        assert lib.cuCtxPushCurrent_v2(self.ctx) == CUDA_SUCCESS
        self.allocs = []

    def close(self):
        for p in self.allocs:
            self.lib.simgpu_free(p)
        popped = vp()
        self.lib.cuCtxPopCurrent_v2(ctypes.byref(popped))

    def errors(self):
        buf = ctypes.create_string_buffer(1 << 14)
        n = self.lib.simgpu_errors(buf, len(buf))
        self.lib.simgpu_reset()
        return n, buf.value.decode(errors="replace")

    def alloc(self, data):
        p = self.lib.simgpu_alloc(0, len(data))
        assert p
        self.allocs.append(p)
        self.lib.simgpu_write(p, data, len(data))
        return p

    def read(self, p, n):
        out = ctypes.create_string_buffer(n)
        assert self.lib.simgpu_read(out, p, n) == 0
        return out.raw

    def function(self, name):
        mod, fn = vp(), vp()
        assert self.lib.cuModuleLoadData(ctypes.byref(mod), b"// any image the simulator can read\0") == 0
        assert self.lib.cuModuleGetFunction(ctypes.byref(fn), mod, name.encode()) == CUDA_SUCCESS
        return fn


@pytest.fixture
def drv():
    d = Driver()
    d.errors()
    yield d
    d.close()


def _sum_params(drv):
    """kernelParams for an fdp_sum_<dtype> launch over 0 elements: the launch runs nothing once it is accepted."""
    args = ctypes.create_string_buffer(SUM_ARGS_BYTES)
    struct.pack_into("<i", args, 8 * 32 + 16, 1)  # k = 1, n = 0
    return args, (vp * 1)(ctypes.cast(args, vp))


# (grid, block, dynamic shared bytes, what the misuse says); the kernels' bound is 256 (cuda/sum.cu).
REFUSED = {
    "block-over-launch-bound": ((1, 1, 1), (257, 1, 1), 0, "__launch_bounds__"),
    "block-over-bound-in-y": ((1, 1, 1), (128, 4, 1), 0, "__launch_bounds__"),
    "block-x-over-device": ((1, 1, 1), (1025, 1, 1), 0, "device's limits"),
    "block-z-over-device": ((1, 1, 1), (1, 1, 65), 0, "device's limits"),
    "block-product-over-device": ((1, 1, 1), (64, 32, 1), 0, "device's limits"),
    "grid-x-over-device": ((2 ** 31, 1, 1), (256, 1, 1), 0, "grid exceeds"),
    "grid-y-over-device": ((1, 65536, 1), (256, 1, 1), 0, "grid exceeds"),
    "grid-z-over-device": ((1, 1, 65536), (256, 1, 1), 0, "grid exceeds"),
    "zero-grid": ((0, 1, 1), (256, 1, 1), 0, "dimension is 0"),
    "zero-block": ((1, 1, 1), (256, 0, 1), 0, "dimension is 0"),
    "shared-over-function-limit": ((1, 1, 1), (256, 1, 1), 48 * 1024 + 1, "shared memory"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_launch_geometry_the_driver_refuses(drv, case):
    grid, block, shmem, words = REFUSED[case]
    fn = drv.function("fdp_sum_f32")
    _, params = _sum_params(drv)
    r = drv.lib.cuLaunchKernel(fn, *grid, *block, shmem, None, params, None)
    n, text = drv.errors()
    assert r == CUDA_ERROR_INVALID_VALUE, f"{case}: the driver refuses this launch, the simulator returned {r}"
    assert n == 1 and words in text, text


@pytest.mark.parametrize("name", ["fdp_sum_f32", "fdp_copy_16"])
def test_launch_within_every_limit_runs(drv, name):
    fn = drv.function(name)
    if name.startswith("fdp_sum"):
        keep, params = _sum_params(drv)
    else:  # fdp_copy_<es>(src, dst, fdp_copy_args_t) over 0 elements
        src, dst, args = u64(0), u64(0), ctypes.create_string_buffer(16 + 3 * 8 * 17)
        struct.pack_into("<qi", args, 0, 0, 1)
        keep, params = (src, dst, args), (vp * 3)(ctypes.cast(ctypes.byref(src), vp),
                                                  ctypes.cast(ctypes.byref(dst), vp), ctypes.cast(args, vp))
    for grid, block, shmem in [((1, 1, 1), (256, 1, 1), 0), ((2 ** 31 - 1, 65535, 65535), (32, 8, 1), 48 * 1024),
                               ((1, 1, 1), (1, 1, 1), 0)]:
        assert drv.lib.cuLaunchKernel(fn, *grid, *block, shmem, None, params, None) == CUDA_SUCCESS
    assert drv.errors() == (0, "")
    del keep


def test_launch_bounds_are_read_from_the_kernel_sources():
    """The simulator's bounds come from cuda/*.cu, one per kernel name fastdp binds, so a bound changed there (or a
    launcher changed to exceed it) is enforced without touching the simulator."""
    import re

    bounds = _simbuild.launch_bounds()
    table = open(os.path.join(ROOT, "csrc", "backend", "cuda", "kernel_module.c")).read()
    names = set(re.findall(r'"(fdp_(?:sum|copy)_\w+)"', table))
    for name in names:
        match = [t for n, prefix, t in bounds if (name.startswith(n) if prefix else name == n)]
        assert len(match) == 1, f"{name}: {match} bounds found in cuda/*.cu"


# ---- copy descriptors ----

W, H, PITCH = 16, 3, 32  # a 16-byte wide, 3-row window of a 32-byte pitched buffer, at an offset


def _rows_2d(drv):
    src = drv.alloc(bytes(range(256)) * 2)
    dst = drv.alloc(b"\0" * 512)
    c = Memcpy2D(srcXInBytes=4, srcY=2, srcMemoryType=DEVICE, srcDevice=src, srcPitch=PITCH, dstXInBytes=8, dstY=1,
                 dstMemoryType=DEVICE, dstDevice=dst, dstPitch=PITCH, WidthInBytes=W, Height=H)
    return c, src, dst


def _expected(src_bytes, sx, sy, sz_, dx, dy, dz, height_rows=H, n=512):
    out = bytearray(n)
    for y in range(H):
        s = (sz_ * height_rows + sy + y) * PITCH + sx
        d = (dz * height_rows + dy + y) * PITCH + dx
        out[d:d + W] = src_bytes[s:s + W]
    return bytes(out)


def test_2d_copy_reads_every_offset(drv):
    c, src, dst = _rows_2d(drv)
    assert drv.lib.cuMemcpy2DAsync_v2(ctypes.byref(c), None) == CUDA_SUCCESS
    assert drv.errors() == (0, "")
    assert drv.read(dst, 512) == _expected(bytes(range(256)) * 2, 4, 2, 0, 8, 1, 0)


def test_3d_peer_copy_reads_every_offset(drv):
    src = drv.alloc(bytes(range(256)) * 2)
    dst = drv.alloc(b"\0" * 512)
    c = Memcpy3DPeer(srcXInBytes=4, srcY=1, srcZ=1, srcMemoryType=DEVICE, srcDevice=src, srcContext=drv.ctx,
                     srcPitch=PITCH, srcHeight=5, dstXInBytes=8, dstY=0, dstZ=1, dstMemoryType=DEVICE, dstDevice=dst,
                     dstContext=drv.ctx, dstPitch=PITCH, dstHeight=5, WidthInBytes=W, Height=H, Depth=1)
    assert drv.lib.cuMemcpy3DPeerAsync(ctypes.byref(c), None) == CUDA_SUCCESS
    assert drv.errors() == (0, "")
    assert drv.read(dst, 512) == _expected(bytes(range(256)) * 2, 4, 1, 1, 8, 0, 1, height_rows=5)


# Each: one field of a good descriptor spoiled as fastdp's code might (left unset by the memset, or wrong), and
# whether the driver refuses it (CUDA_ERROR_INVALID_VALUE) or copies nothing (an empty extent).
BAD_2D = {
    "src-memory-type-unset": ("srcMemoryType", 0, CUDA_ERROR_INVALID_VALUE),
    "dst-memory-type-unset": ("dstMemoryType", 0, CUDA_ERROR_INVALID_VALUE),
    "dst-array": ("dstMemoryType", ARRAY, CUDA_ERROR_INVALID_VALUE),
    "src-pitch-below-width": ("srcPitch", W - 1, CUDA_ERROR_INVALID_VALUE),
    "dst-pitch-unset": ("dstPitch", 0, CUDA_ERROR_INVALID_VALUE),
    "pitch-over-device-max": ("srcPitch", 2 ** 31, CUDA_ERROR_INVALID_VALUE),
    "width-unset": ("WidthInBytes", 0, CUDA_SUCCESS),
    "height-unset": ("Height", 0, CUDA_SUCCESS),
}
BAD_3D = dict(BAD_2D, **{
    "depth-unset": ("Depth", 0, CUDA_SUCCESS),
    "src-height-unset": ("srcHeight", 0, CUDA_ERROR_INVALID_VALUE),
    "dst-height-below-rows": ("dstHeight", H - 1, CUDA_ERROR_INVALID_VALUE),
    "src-lod": ("srcLOD", 1, CUDA_ERROR_INVALID_VALUE),
    "dst-lod": ("dstLOD", 1, CUDA_ERROR_INVALID_VALUE),
    "src-context-unset": ("srcContext", None, 201),  # CUDA_ERROR_INVALID_CONTEXT
})
del BAD_3D["dst-array"]  # the simulator refuses any host or array side of a peer copy anyway


@pytest.mark.parametrize("case", sorted(BAD_2D))
def test_2d_descriptor_field_the_driver_refuses_or_reads(drv, case):
    field, value, code = BAD_2D[case]
    c, _, dst = _rows_2d(drv)
    setattr(c, field, value)
    r = drv.lib.cuMemcpy2DAsync_v2(ctypes.byref(c), None)
    n, text = drv.errors()
    assert (r, n >= 1) == (code, True), f"{case}: CUresult {r}, misuse {text!r}"
    assert drv.read(dst, 512) == b"\0" * 512, "a refused or empty copy writes nothing"


@pytest.mark.parametrize("case", sorted(BAD_3D))
def test_3d_peer_descriptor_field_the_driver_refuses_or_reads(drv, case):
    field, value, code = BAD_3D[case]
    src = drv.alloc(bytes(range(256)) * 2)
    dst = drv.alloc(b"\0" * 512)
    c = Memcpy3DPeer(srcMemoryType=DEVICE, srcDevice=src, srcContext=drv.ctx, srcPitch=PITCH, srcHeight=H,
                     dstMemoryType=DEVICE, dstDevice=dst, dstContext=drv.ctx, dstPitch=PITCH, dstHeight=H,
                     WidthInBytes=W, Height=H, Depth=1)
    setattr(c, field, value)
    r = drv.lib.cuMemcpy3DPeerAsync(ctypes.byref(c), None)
    n, text = drv.errors()
    assert (r, n >= 1) == (code, True), f"{case}: CUresult {r}, misuse {text!r}"
    assert drv.read(dst, 512) == b"\0" * 512, "a refused or empty copy writes nothing"


# ---- fresh memory ----

def _all_nan(raw):
    import math

    checks = [("<e", 2), ("<f", 4), ("<d", 8)]
    for fmt, n in checks:
        assert all(math.isnan(v) for (v,) in struct.iter_unpack(fmt, raw[: len(raw) // n * n])), fmt
    bf16 = [struct.unpack("<f", b"\0\0" + raw[i:i + 2])[0] for i in range(0, len(raw) - 1, 2)]
    assert all(math.isnan(v) for v in bf16), "bfloat16"


def test_fresh_memory_is_nan_on_every_route(drv):
    """cuMemAlloc, the stream-ordered pool and the caching allocator (a fresh block and one handed out again after
    its user wrote zeros into it): memory nobody wrote reads as NaN in every floating type, never as zeros."""
    n = 1000
    p = u64()
    assert drv.lib.cuMemAlloc_v2(ctypes.byref(p), n) == CUDA_SUCCESS
    _all_nan(drv.read(p.value, n))
    assert drv.lib.cuMemFree_v2(p) == CUDA_SUCCESS
    assert drv.lib.cuMemAllocAsync(ctypes.byref(p), n, None) == CUDA_SUCCESS
    assert drv.lib.cuStreamSynchronize(None) == CUDA_SUCCESS
    _all_nan(drv.read(p.value, n))
    assert drv.lib.cuMemFreeAsync(p, None) == CUDA_SUCCESS
    assert drv.lib.cuStreamSynchronize(None) == CUDA_SUCCESS
    ptr, handle, err = vp(), vp(), ctypes.create_string_buffer(256)
    assert drv.lib.simgpu_cache_alloc(None, 0, n, None, ctypes.byref(ptr), ctypes.byref(handle), err, 256) == 0
    _all_nan(drv.read(ptr.value, n))
    zeros = (ctypes.c_char * n)()
    drv.lib.simgpu_write(ptr.value, zeros, n)
    drv.lib.simgpu_cache_free(None, 0, None, handle)
    again, handle2 = vp(), vp()
    assert drv.lib.simgpu_cache_alloc(None, 0, n, None, ctypes.byref(again), ctypes.byref(handle2), err, 256) == 0
    assert again.value == ptr.value, "the block is handed out again on its stream"
    _all_nan(drv.read(again.value, n))
    drv.lib.simgpu_cache_free(None, 0, None, handle2)
    assert drv.errors() == (0, "")
