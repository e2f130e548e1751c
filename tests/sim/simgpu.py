"""Python side of the simulated GPU: the simgpu_* controls and the driver calls a test needs (ctypes), and
SimTensor, a torch.Tensor subclass that fastdp._C reads as a CUDA tensor living in simulated device memory.

Load it only in a process whose FASTDP_CUDA_DRIVER_LIBRARY / FASTDP_NCCL_LIBRARY name the simulated libraries
(tests/sim/build.py env()): fastdp then loads the very same file, so both see one set of devices."""

import ctypes
import os

import torch

CUDA_SUCCESS = 0
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_LAUNCH_FAILED = 719
CUDA_ERROR_UNKNOWN = 999
NCCL_INTERNAL_ERROR = 3


# An allocation's error message. One type made once: ctypes.create_string_buffer makes a new array type per call,
# which leaves a reference cycle behind (garbage that a test counting it would blame on fastdp).
MESSAGE = ctypes.c_char * 256


class Sim:
    """The simulator and a PyTorch-like client of it: one retained primary context per device while open."""

    def __init__(self, path=None):
        path = path or os.environ["FASTDP_CUDA_DRIVER_LIBRARY"]
        # Global, as PyTorch's libc10_cuda.so is: the library also stands in for its getFreeMutex, which fastdp's
        # NCCL loader looks up by name when it first loads NCCL (after this).
        self.lib = lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        ll, u64, sz, vp, cp = ctypes.c_longlong, ctypes.c_ulonglong, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_char_p
        for name, res, args in [
            ("simgpu_errors", ll, [cp, sz]), ("simgpu_stat", ll, [cp]), ("simgpu_calls", ll, [cp]),
            ("simgpu_fail_at", ctypes.c_int, [cp, ll, ctypes.c_int]), ("simgpu_reset", None, []),
            ("simgpu_peer_enabled", ctypes.c_int, [ctypes.c_int, ctypes.c_int]),
            ("simgpu_alloc", u64, [ctypes.c_int, sz]), ("simgpu_free", ctypes.c_int, [u64]),
            ("simgpu_cache_alloc", ctypes.c_int, [vp, ctypes.c_int, sz, vp, ctypes.POINTER(vp), ctypes.POINTER(vp),
                                                  cp, sz]),
            ("simgpu_cache_release", None, [vp]), ("simgpu_cache_trim", ctypes.c_int, []),
            ("simgpu_read", ctypes.c_int, [vp, u64, sz]), ("simgpu_write", ctypes.c_int, [u64, vp, sz]),
            ("simgpu_peek", ctypes.c_int, [vp, u64, sz]), ("simgpu_poke", ctypes.c_int, [u64, vp, sz]),
            ("simgpu_touch", ctypes.c_int, [vp, ctypes.c_int, u64, sz, ctypes.c_int]),
            ("simgpu_host_touch", None, [vp, sz, ctypes.c_int]),
            ("simgpu_current_context", vp, []), ("simgpu_client", None, [ctypes.c_int]),
            ("cuCtxSetCurrent", ctypes.c_int, [vp]),
            ("cuInit", ctypes.c_int, [ctypes.c_uint]),
            ("cuDeviceGetCount", ctypes.c_int, [ctypes.POINTER(ctypes.c_int)]),
            ("cuDevicePrimaryCtxRetain", ctypes.c_int, [ctypes.POINTER(vp), ctypes.c_int]),
            ("cuDevicePrimaryCtxRelease_v2", ctypes.c_int, [ctypes.c_int]),
            ("cuCtxPushCurrent_v2", ctypes.c_int, [vp]), ("cuCtxPopCurrent_v2", ctypes.c_int, [ctypes.POINTER(vp)]),
            ("cuCtxEnablePeerAccess", ctypes.c_int, [vp, ctypes.c_uint]),
            ("cuStreamCreate", ctypes.c_int, [ctypes.POINTER(vp), ctypes.c_uint]),
            ("cuStreamDestroy_v2", ctypes.c_int, [vp]), ("cuCtxSynchronize", ctypes.c_int, []),
            ("cuStreamSynchronize", ctypes.c_int, [vp]),
            ("cuEventCreate", ctypes.c_int, [ctypes.POINTER(vp), ctypes.c_uint]),
            ("cuEventRecord", ctypes.c_int, [vp, vp]), ("cuEventSynchronize", ctypes.c_int, [vp]),
            ("cuStreamWaitEvent", ctypes.c_int, [vp, vp, ctypes.c_uint]),
        ]:
            fn = getattr(lib, name)
            fn.restype = res
            fn.argtypes = args
        self._check(lib.cuInit(0), "cuInit")
        n = ctypes.c_int()
        self._check(lib.cuDeviceGetCount(ctypes.byref(n)), "cuDeviceGetCount")
        self.ndev = n.value
        self.ctx = []
        self.live = []  # SimTensors not yet released

    @staticmethod
    def _check(r, what):
        if r != CUDA_SUCCESS:
            raise RuntimeError(f"{what} failed in the simulated driver: CUresult {r}")

    # ---- PyTorch's part: contexts, streams ----
    def open(self):
        """Retains every device's primary context, as PyTorch does on first use (the simulator tells these references
        apart from fastdp's own)."""
        self.lib.simgpu_client(1)
        try:
            for d in range(self.ndev):
                c = ctypes.c_void_p()
                self._check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(c), d), "cuDevicePrimaryCtxRetain")
                self.ctx.append(c)
        finally:
            self.lib.simgpu_client(0)
        return self

    def close(self):
        self.lib.simgpu_client(1)
        try:
            for d in range(len(self.ctx)):
                self._check(self.lib.cuDevicePrimaryCtxRelease_v2(d), "cuDevicePrimaryCtxRelease")
        finally:
            self.lib.simgpu_client(0)
        self.ctx = []

    def on(self, dev, fn, *args):
        """Runs a driver call with device dev's context current."""
        self._check(self.lib.cuCtxPushCurrent_v2(self.ctx[dev]), "cuCtxPushCurrent")
        try:
            return fn(*args)
        finally:
            c = ctypes.c_void_p()
            self._check(self.lib.cuCtxPopCurrent_v2(ctypes.byref(c)), "cuCtxPopCurrent")

    def stream(self, dev):
        """A new non-blocking stream on dev (a handle for fastdp's streams argument)."""
        s = ctypes.c_void_p()
        self._check(self.on(dev, self.lib.cuStreamCreate, ctypes.byref(s), 1), "cuStreamCreate")
        return s.value

    def destroy_stream(self, dev, s):
        self._check(self.on(dev, self.lib.cuStreamDestroy_v2, ctypes.c_void_p(s)), "cuStreamDestroy")

    def synchronize(self):
        for d in range(len(self.ctx)):
            self._check(self.on(d, self.lib.cuCtxSynchronize), "cuCtxSynchronize")

    def enable_peer(self, dev, peer):
        """cuCtxEnablePeerAccess from dev to peer, as a client (PyTorch) may already have done."""
        return self.on(dev, self.lib.cuCtxEnablePeerAccess, self.ctx[peer], 0)

    def current_context(self):
        """The thread's current context (not a driver call: injected failures and call counts leave it alone)."""
        return self.lib.simgpu_current_context()

    def set_context(self, ctx):
        """cuCtxSetCurrent(ctx) on this thread (None: unbinds the current one), as a caller repairs its state."""
        self._check(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def touch(self, t, streams, write=True):
        """The caller's own work on tensor t, on its stream for t's device (from `streams`, fastdp's (device, stream)
        list; the legacy stream when none is listed): what produced a source just before an operation, or what uses
        a result or reuses a source just after it. A SimTensor's whole storage; a CPU tensor's bytes as the host's."""
        if isinstance(t, SimTensor):
            stream = dict(streams or []).get(t._dev)
            assert self.lib.simgpu_touch(stream, t._dev, t._base_ptr, t._nbytes, int(write)) == 0, t
        else:
            self.lib.simgpu_host_touch(t.data_ptr(), t.untyped_storage().nbytes(), int(write))

    def call(self, streams, tensors, fn, *args):
        """fn(*args) as a PyTorch program runs it: every tensor written on the caller's stream just before, every
        tensor used again on it just after, and the thread's current context the same after as before."""
        for t in tensors:
            self.touch(t, streams)
        before = self.current_context()
        result = fn(*args)
        after = self.current_context()
        assert after == before, f"{getattr(fn, '__name__', fn)}: the current context changed ({before} -> {after})"
        for t in tensors:
            self.touch(t, streams)
        return result

    # ---- controls ----
    def errors(self):
        buf = ctypes.create_string_buffer(16384)
        n = self.lib.simgpu_errors(buf, len(buf))
        return n, buf.value.decode(errors="replace")

    def assert_clean(self, where=""):
        n, text = self.errors()
        assert n == 0, f"{where}: the simulated GPU recorded {n} misuse(s)/race(s):\n{text}"

    def stat(self, name):
        v = self.lib.simgpu_stat(name.encode())
        assert v >= 0, name
        return v

    def stats(self, names=("allocations", "streams", "events", "pushes", "groups")):
        return {n: self.stat(n) for n in names}

    def calls(self, entry):
        return self.lib.simgpu_calls(entry.encode())

    def fail_at(self, entry, k, code):
        assert self.lib.simgpu_fail_at(entry.encode(), k, code) == 0, entry

    def reset(self):
        self.lib.simgpu_reset()

    def peer_enabled(self, dev, peer):
        return bool(self.lib.simgpu_peer_enabled(dev, peer))

    # ---- scratch memory for the core: PyTorch's route ----
    def caching_allocator(self):
        """What fastdp._native.core registers where torch has CUDA (PyTorch's caching allocator), here the simulated one:
        alloc(device, nbytes, stream) -> an object with data_ptr(); the block goes back to its stream's pool when
        the core drops it, as a dying tensor's does (misuse and races on that route are the simulator's checks)."""
        lib = self.lib

        def alloc(device, nbytes, stream):
            ptr, handle = ctypes.c_void_p(), ctypes.c_void_p()
            err = MESSAGE()
            rc = lib.simgpu_cache_alloc(None, device, nbytes, stream, ctypes.byref(ptr), ctypes.byref(handle), err,
                                        len(err))
            if rc == 2:
                raise torch.OutOfMemoryError(f"CUDA out of memory (simulated caching allocator): {err.value.decode()}")
            if rc != 0:
                raise RuntimeError(f"the simulated caching allocator failed: {err.value.decode()}")
            return _Block(lib, ptr.value, handle.value)

        return alloc

    def trim(self):
        """Frees the blocks the caching allocator holds as free (torch.cuda.empty_cache)."""
        return self.lib.simgpu_cache_trim()

    # ---- memory ----
    def alloc(self, dev, nbytes):
        p = self.lib.simgpu_alloc(dev, max(nbytes, 1))
        assert p, f"simgpu_alloc({dev}, {nbytes}) failed"
        return p

    def free(self, p):
        assert self.lib.simgpu_free(p) == 0

    def release_all(self):
        """Frees every SimTensor still holding memory (after an operation that raised, say)."""
        for t in self.live:
            t.release()
        self.live = []

    def tensor(self, cpu, dev):
        """A SimTensor on dev holding a copy of the CPU tensor `cpu` (same shape and strides)."""
        return SimTensor(self, cpu, dev)

    def empty(self, shape, dtype, dev):
        """A SimTensor on dev with arbitrary (random) contents, for outputs."""
        n = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        raw = torch.randint(0, 256, (n,), dtype=torch.uint8)
        return SimTensor(self, raw.view(dtype).reshape(shape), dev)


class _Block:
    """A block of the simulated caching allocator, held by the core as a tensor of PyTorch's would be."""

    __slots__ = ("lib", "ptr", "handle")

    def __init__(self, lib, ptr, handle):
        self.lib, self.ptr, self.handle = lib, ptr, handle

    def data_ptr(self):
        return self.ptr

    def __del__(self):
        self.lib.simgpu_cache_release(self.handle)


class SimTensor(torch.Tensor):
    """A CUDA tensor as fastdp._C sees it (is_cuda, get_device, data_ptr, shape, stride, dtype, device), whose
    memory is simulated device memory. Its storage mirrors a CPU tensor's: same span, same strides."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, sim, cpu, dev):
        self = torch.Tensor._make_subclass(cls, torch.empty(0))
        base = cpu.as_strided((cpu.untyped_storage().nbytes() // cpu.element_size(),), (1,), 0)
        self._sim, self._dev, self._dtype = sim, dev, cpu.dtype
        self._shape, self._stride, self._offset = tuple(cpu.shape), tuple(cpu.stride()), cpu.storage_offset()
        self._nbytes = base.numel() * cpu.element_size()
        self._base_ptr = sim.alloc(dev, self._nbytes)
        host = base.contiguous()
        sim.lib.simgpu_write(self._base_ptr, host.data_ptr(), self._nbytes)
        sim.live.append(self)
        return self

    def __init__(self, sim, cpu, dev):
        pass

    is_cuda = True
    is_cpu = False

    def get_device(self):
        return self._dev

    @property
    def device(self):
        return torch.device("cuda", self._dev)

    @property
    def dtype(self):
        return self._dtype

    @property
    def shape(self):
        return torch.Size(self._shape)

    def size(self, dim=None):
        return self.shape if dim is None else self._shape[dim]

    def stride(self, dim=None):
        return self._stride if dim is None else self._stride[dim]

    def dim(self):
        return len(self._shape)

    def data_ptr(self):
        return self._base_ptr + self._offset * torch.empty(0, dtype=self._dtype).element_size()

    def cpu(self):
        """The values, read back after the simulated devices finished (as a synchronising .cpu() does)."""
        es = torch.empty(0, dtype=self._dtype).element_size()
        raw = torch.empty(self._nbytes // es, dtype=self._dtype)
        assert self._sim.lib.simgpu_read(raw.data_ptr(), self._base_ptr, self._nbytes) == 0
        return raw.as_strided(self._shape, self._stride, self._offset).clone()

    def release(self):
        if self._base_ptr:
            self._sim.free(self._base_ptr)
            self._base_ptr = 0

    def __repr__(self):
        return f"SimTensor(shape={self._shape}, stride={self._stride}, dtype={self._dtype}, device=cuda:{self._dev})"
