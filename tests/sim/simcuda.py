"""CUDA tensors and torch.cuda for a CPU build of torch, on the simulated GPU: the bridge that lets the Python layer's
multi-device paths run through the real C core on the simulated driver, so that a test checks their values.

- ``DevTensor``: a tensor whose Python face says CUDA device d (``is_cuda``, ``device``, ``get_device``,
  ``data_ptr``, ``untyped_storage``) and whose bytes live in simulated device memory, so that fastdp._C reads and
  writes them through the simulated driver. Its TensorImpl is a CPU wrapper, so autograd's engine runs its backward
  on the host.
- ``Bridge.run`` (``__torch_dispatch__``, and a mode for factory calls naming a CUDA device): every aten operation on
  such tensors as the GPU would run it on the current stream of their device. It reads the inputs' bytes (recorded as
  a read on that stream with ``simgpu_touch``, so that a read not ordered after its write is a race), computes on
  the host, writes what changed back, and puts new results in fresh blocks of the simulator's caching allocator
  allocated on that stream (poisoned: memory nobody wrote reads as NaN or -1). Views move no bytes: their shape is
  computed on the meta device over the same memory.
- ``SimCuda``: tests/_fake_cuda.py's torch.cuda whose streams are the simulator's own (``cuStreamCreate``; PyTorch's
  default stream is the legacy stream, handle 0) and whose events, stream waits and synchronisations are the
  simulator's, so the waits the Python layer makes order the simulated work.

Values cross devices only through the C core (and through torch's own cross-device copies, which the bridge runs
as torch would: between both devices' current streams). Load it only in a process whose environment names the
simulated libraries (tests/sim/build.py env())."""

import ctypes
import os
import sys
import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [p for p in (HERE, os.path.dirname(HERE)) if p not in sys.path]

from _fake_cuda import FakeCuda, FakeEvent, FakeStream  # noqa: E402
from simgpu import MESSAGE, Sim  # noqa: E402

# Operations that take only shapes and dtypes from their tensor inputs, and those whose result is fresh memory
# nobody wrote (left poisoned).
_NO_READ = {"empty_like", "new_empty", "new_empty_strided", "zeros_like", "ones_like", "full_like", "new_zeros",
            "new_ones", "new_full", "empty_strided", "fill_", "zero_", "empty", "resize_"}
_UNWRITTEN = {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided"}
# In-place operations that overwrite their destination without reading it.
_OVERWRITE = {"copy_", "fill_", "zero_"}
# The operations CUDA kernels run on tensors of two devices: copies. Every other refuses them ("Expected all tensors
# to be on the same device").
_CROSS_DEVICE = {"copy_", "_to_copy", "_copy_from", "_copy_from_and_resize"}


def _map(fn, x):
    """fn over the leaves of an operation's arguments or results (tuples, lists, dicts of them). Not torch's pytree,
    whose every call leaves a reference cycle behind: garbage that a test counting it would blame on fastdp."""
    if isinstance(x, (tuple, list)):
        return type(x)([_map(fn, v) for v in x])  # torch.return_types too: built from a sequence
    if isinstance(x, dict):
        return {k: _map(fn, v) for k, v in x.items()}
    return fn(x)


def _same_device(func, devs):
    """Raises what a CUDA kernel raises for inputs on two devices. (A host tensor next to a DevTensor passes: the
    contract tests compare results on the device with references on the host.)"""
    devices = sorted({t._storage.device for t in devs})
    if len(devices) > 1:
        raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                           f"cuda:{devices[0]} and cuda:{devices[1]}! ({_name(func)})")


def _validate_outputs(grads, inputs):
    """Autograd's check of what a node's backward returns: each gradient on its input's device (the engine of a CPU
    build sees only host tensors here, and would pass a gradient sent to another replica's device)."""
    for i, (g, want) in enumerate(zip(grads, inputs)):
        if want is None or not isinstance(g, torch.Tensor):
            continue
        got = g.get_device() if isinstance(g, DevTensor) else "cpu"
        if got != want:
            raise RuntimeError(f"Function backward returned an invalid gradient at index {i} - expected device "
                               f"{_device_name(want)} but got {_device_name(got)}")


def _device_name(d):
    return "cpu" if d == "cpu" else f"cuda:{d}"


def _leaves(x):
    out = []
    _map(out.append, x)
    return out


def _name(func):
    return func._schema.name.split("::")[-1]


class Storage:
    """A block of simulated device memory held as a PyTorch storage is: allocated on the stream current on its device,
    given back to that stream when the last tensor over it dies (after the streams ``record_stream`` named)."""

    def __init__(self, bridge, device, nbytes):
        self.device, self._nbytes, self._ptr, self.recorded = device, nbytes, 0, set()
        self.stream = self.written_on = bridge.cuda.current_stream(device)
        if nbytes == 0:  # as PyTorch's: an empty storage has no memory
            return
        self._ptr, handle = bridge.allocate(device, nbytes, self.stream.cuda_stream)
        weakref.finalize(self, bridge.release, device, nbytes, handle, self.recorded).atexit = False

    def data_ptr(self):
        return self._ptr

    def nbytes(self):
        return self._nbytes


class DevTensor(torch.Tensor):
    """A tensor of simulated CUDA device ``storage.device`` (see the module's comment)."""

    __torch_function__ = torch._C._disabled_torch_function_impl
    bridge = None

    @staticmethod
    def __new__(cls, storage, meta):
        t = torch.Tensor._make_wrapper_subclass(cls, meta.shape, strides=meta.stride(),
                                                storage_offset=meta.storage_offset(), dtype=meta.dtype, device="cpu")
        t._storage, t._meta = storage, meta
        torch._C._set_conj(t, meta.is_conj())  # a conjugate or negative view is one by a bit, as on any device
        torch._C._set_neg(t, meta.is_neg())
        return t

    def __init__(self, storage, meta):
        pass

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return cls.bridge.run(func, args, kwargs or {})

    is_cuda = True
    is_cpu = False

    @property
    def device(self):
        return torch.device("cuda", self._storage.device)

    def get_device(self):
        return self._storage.device

    def data_ptr(self):
        return self._storage.data_ptr() + self._meta.storage_offset() * self._meta.element_size() \
            if self._storage.data_ptr() else 0

    def cpu(self, memory_format=torch.preserve_format):
        """The values on the host (torch's own .cpu() would see a CPU wrapper and return it), read on the current
        stream of the device, as a synchronising copy to pageable memory does."""
        return self.bridge.host_copy(self)

    def untyped_storage(self):
        return self._storage

    def to(self, *args, **kwargs):
        """As torch's: the tensor itself where nothing changes (torch's own would see a CPU wrapper and copy)."""
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        same = device is not None and device.type == "cuda" and device.index in (None, self.get_device())
        if same and dtype in (None, self.dtype) and not kwargs.get("copy") and memory_format is None:
            return self
        return super().to(*args, **kwargs)

    def __deepcopy__(self, memo):
        """A copy in fresh memory of the same device (torch's own would copy the wrapper's empty storage)."""
        if id(self) not in memo:
            with torch.no_grad():
                new = self.clone()
            new.requires_grad_(self.requires_grad)
            if getattr(self, "_is_param", False):  # as nn.Parameter's deepcopy: the gradient stays behind
                new._is_param = True
            elif self.grad is not None:
                new.grad = self.grad.__deepcopy__(memo)
            memo[id(self)] = new
        return memo[id(self)]

    def span(self):
        """(address, bytes) of the memory this view's elements cover, first to last."""
        if self.numel() == 0 or not self._storage.data_ptr():
            return self.data_ptr(), 0
        extent = 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride()))
        return self.data_ptr(), extent * self.element_size()

    def __repr__(self):
        return f"DevTensor(shape={tuple(self.shape)}, stride={self.stride()}, dtype={self.dtype}, " \
               f"device=cuda:{self._storage.device})"


class _Mode(TorchDispatchMode):
    """Factory calls naming a CUDA device (torch.empty(..., device="cuda:1")) have no tensor to dispatch on."""

    def __init__(self, bridge):
        super().__init__()
        self.bridge = bridge

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.bridge.run(func, args, kwargs or {})


class Bridge:
    """The simulator (``sim``), its torch.cuda (``cuda``) and the tensor operations on its memory."""

    def __init__(self, sim):
        self.sim, self.lib = sim, sim.lib
        self.cuda = SimCuda(sim)
        self.mode = _Mode(self)
        DevTensor.bridge = self

    # ---- memory ----
    def allocate(self, device, nbytes, stream):
        ptr, handle = ctypes.c_void_p(), ctypes.c_void_p()
        err = MESSAGE()
        rc = self.sim.on(device, self.lib.simgpu_cache_alloc, None, device, nbytes, stream, ctypes.byref(ptr),
                         ctypes.byref(handle), err, len(err))
        if rc == 2:
            raise torch.OutOfMemoryError(f"CUDA out of memory (simulated caching allocator): {err.value.decode()}")
        assert rc == 0, err.value.decode()
        self.cuda.allocate(device, nbytes)  # what torch.cuda.memory_allocated and the peak count
        return ptr.value, handle.value

    def release(self, device, nbytes, handle, recorded):
        """A dying storage's block goes back to its stream; PyTorch's allocator first waits (on the host, querying
        events) until the streams record_stream named have run their work up to this point."""
        for stream in recorded:
            event = self.cuda.Event()
            event.record(stream)
            self.sim._check(self.lib.cuEventSynchronize(event.handle), "cuEventSynchronize")
        self.lib.simgpu_cache_release(handle)
        self.cuda.allocate(device, -nbytes)

    def tensor(self, cpu, device):
        """A DevTensor on ``device`` with the values, shape and strides of host tensor ``cpu``, written on the current
        stream there (what made it, as far as the code under test knows)."""
        storage = cpu.untyped_storage()
        dev = Storage(self, device, storage.nbytes())
        meta = self._meta_over(dev, cpu.dtype, cpu.shape, cpu.stride(), cpu.storage_offset())
        if dev.data_ptr():
            self._poke(dev, dev.data_ptr(), storage.data_ptr(), storage.nbytes())
        return DevTensor(dev, meta)

    @staticmethod
    def _meta_over(storage, dtype, shape, stride, offset):
        size = torch.empty(0, dtype=dtype).element_size()
        base = torch.empty(max(storage.nbytes() // size, 0), dtype=dtype, device="meta")
        return base.as_strided(shape, stride, offset)

    def _touch(self, device, address, nbytes, write):
        stream = self.cuda.current_stream(device).cuda_stream or None
        assert self.lib.simgpu_touch(stream, device, address, nbytes, int(write)) == 0, (device, address, nbytes)

    def _poke(self, storage, address, host, nbytes):
        """Device work writing ``nbytes`` at ``address`` of ``storage`` on the current stream of its device."""
        device = storage.device
        storage.written_on = self.cuda.current_stream(device)
        if nbytes:
            self._touch(device, address, nbytes, True)
            assert self.lib.simgpu_poke(address, host, nbytes) == 0

    def _fetch(self, t, raws, read):
        """t's values on the host, over a copy of its storage's bytes shared by every argument on that storage."""
        storage = t._storage
        raw = raws.get(id(storage))
        if raw is None:
            raw = raws[id(storage)] = torch.empty(storage.nbytes(), dtype=torch.uint8)
            if storage.nbytes():
                assert self.lib.simgpu_peek(raw.data_ptr(), storage.data_ptr(), storage.nbytes()) == 0, t
        address, nbytes = t.span()
        if read and nbytes:
            self._touch(storage.device, address, nbytes, False)
        size = t.element_size()
        typed = raw[: raw.numel() // size * size].view(t.dtype)
        view = typed.as_strided(t.shape, t.stride(), t.storage_offset())
        if t.is_conj():
            view = view.conj()
        return torch._neg_view(view) if t.is_neg() else view

    def host_copy(self, t):
        """t's values as a host tensor (same strides), read on the current stream of its device."""
        return self._fetch(t, {}, read=True).clone(memory_format=torch.preserve_format)

    def _store(self, t, raws):
        address, nbytes = t.span()
        if nbytes:
            raw = raws[id(t._storage)]
            self._poke(t._storage, address, raw.data_ptr() + (address - t._storage.data_ptr()), nbytes)

    def _place(self, o, device, written):
        """A result computed on the host, as fresh memory of ``device`` (its values written there unless the
        operation leaves them unwritten)."""
        storage = o.untyped_storage()
        dev = Storage(self, device, storage.nbytes())
        meta = self._meta_over(dev, o.dtype, o.shape, o.stride(), o.storage_offset())
        if written and dev.data_ptr():
            self._poke(dev, dev.data_ptr(), storage.data_ptr(), storage.nbytes())
        return DevTensor(dev, meta)

    # ---- operations ----
    def _target(self, kwargs, devs):
        """The device index of new results; None for host results."""
        device = kwargs.get("device")
        if device is not None:
            device = torch.device(device)
            if device.type != "cuda":
                return None
            return self.cuda.current_device() if device.index is None else device.index
        return devs[0]._storage.device if devs else None

    def run(self, func, args, kwargs):
        flat = _leaves((args, kwargs))
        devs = [t for t in flat if isinstance(t, DevTensor)]
        target = self._target(kwargs, devs)
        if not devs and target is None:
            return func(*args, **kwargs)
        if _name(func) not in _CROSS_DEVICE:
            _same_device(func, devs)
        if func.is_view and _name(func) == "to":
            # Under inference mode aten::to reaches here whole (elsewhere it is decomposed before): it may return its
            # input (a view) or a copy on another device, which only its decomposition, run through the bridge, says.
            with _Mode(self):
                return func.decompose(*args, **kwargs)
        if func.is_view:
            return self._view(func, args, kwargs, devs)
        return self._compute(func, args, kwargs, target)

    @staticmethod
    def _view(func, args, kwargs, devs):
        margs, mkwargs = _map(lambda x: x._meta if isinstance(x, DevTensor) else x, (args, kwargs))
        out = func(*margs, **mkwargs)
        storage = devs[0]._storage
        return _map(lambda m: DevTensor(storage, m) if isinstance(m, torch.Tensor) else m, out)

    def _compute(self, func, args, kwargs, target):
        name = _name(func)
        schema = func._schema
        written = {id(args[i] if i < len(args) else kwargs.get(a.name)) for i, a in enumerate(schema.arguments)
                   if a.alias_info is not None and a.alias_info.is_write}
        raws, host = {}, {}

        def fetch(x):
            if not isinstance(x, DevTensor):
                return x
            if id(x) not in host:
                overwritten = id(x) in written and name in _OVERWRITE
                host[id(x)] = (x, self._fetch(x, raws, read=name not in _NO_READ and not overwritten))
            return host[id(x)][1]

        hargs, hkwargs = _map(fetch, (args, kwargs))
        if target is not None and "device" in hkwargs:
            hkwargs["device"] = torch.device("cpu")
        before = {key: raw.clone() for key, raw in raws.items()}
        out = func(*hargs, **hkwargs)
        # What the schema says the operation writes, and what it wrote without saying so (native_batch_norm's running
        # statistics).
        changed = {key for key, raw in raws.items() if not torch.equal(raw, before[key])}
        for key, (d, _) in host.items():
            if key in written or id(d._storage) in changed:
                self._store(d, raws)
        back = {id(h): d for d, h in host.values()}

        def result(o):
            if not isinstance(o, torch.Tensor):
                return o
            if id(o) in back:  # an in-place operation returns its argument
                return back[id(o)]
            return o if target is None else self._place(o, target, name not in _UNWRITTEN)

        return _map(result, out)

    def module(self, m, device=0):
        """m moved to ``device`` (its parameters and buffers replaced, as the run's conversion setting makes them),
        with a parameter or buffer that several submodules share (tied weights) still one: the conversion gives each
        submodule its own copy, which a real CUDA move, writing ``.data`` in place, never does."""
        owners = {}
        for sub in m.modules():
            for store in (sub._parameters, sub._buffers):
                for key, t in store.items():
                    if t is not None:
                        owners.setdefault(id(t), []).append((store, key))
        m.to(torch.device("cuda", device))
        for (store, key), *others in owners.values():
            for other, other_key in others:
                other[other_key] = store[key]
        return m

    # ---- the run ----
    def install(self, monkeypatch):
        """torch.cuda, CUDA device entries and factory calls for one test (or a whole run); returns self."""
        from fastdp._platform import devices as _devices
        from fastdp._reduction import reducer as _reducer
        from fastdp._step import functions as _functions, replicas as _replicas

        self.cuda.install(monkeypatch)
        real_run = threading.Thread.run

        def run(thread):  # the dispatch mode is per thread: replica workers need it too
            with _Mode(self):
                real_run(thread)

        monkeypatch.setattr(threading.Thread, "run", run)
        for node in (_reducer.BucketNode, _functions.Scatter, _functions.Gather):  # gradients from several devices
            self.cuda.engine(monkeypatch, node)
        # A DevTensor's storage is a Python object that views share, not a C storage whose use count libtorch keeps:
        # the kept replicas' pools tell a free entry by weak references, as on a torch without that count.
        monkeypatch.setattr(_replicas, "_use_count", None)
        self._overwrite = torch.__future__.get_overwrite_module_params_on_conversion()
        torch.__future__.set_overwrite_module_params_on_conversion(True)  # module.to(cuda): parameters on devices
        monkeypatch.setattr(_devices, "_require_cuda", lambda d, what: d)
        self.mode.__enter__()
        return self

    def leave(self):
        self.mode.__exit__(None, None, None)
        torch.__future__.set_overwrite_module_params_on_conversion(self._overwrite)


class SimStream(FakeStream):
    """A stream of the simulator (handle 0: the device's legacy stream, PyTorch's default stream): the fake's
    bookkeeping, and every wait and synchronisation made in the simulator too."""

    def wait_stream(self, other):
        super().wait_stream(other)
        event = self.cuda.Event()
        event.record(other)
        event.wait(self)

    def record_event(self, event=None):
        event = event or self.cuda.Event()
        event.record(self)
        return event

    def synchronize(self):
        super().synchronize()
        sim = self.cuda.sim
        sim._check(sim.on(self.device_index, sim.lib.cuStreamSynchronize, self.cuda_stream or None),
                   "cuStreamSynchronize")


class SimEvent(FakeEvent):
    """An event of the simulator, made on the device of the stream it is first recorded on."""

    def __init__(self, cuda, **kwargs):
        super().__init__(cuda, **kwargs)
        self.handle, self.device = None, None

    def record(self, stream=None):
        stream = stream or self.cuda.current_stream()
        super().record(stream)
        sim = self.cuda.sim
        if self.device != stream.device_index:
            handle = ctypes.c_void_p()
            sim._check(sim.on(stream.device_index, sim.lib.cuEventCreate, ctypes.byref(handle), 0), "cuEventCreate")
            self.handle, self.device = handle.value, stream.device_index
        sim._check(sim.on(self.device, sim.lib.cuEventRecord, self.handle, stream.cuda_stream or None),
                   "cuEventRecord")

    def wait(self, stream=None):
        stream = stream or self.cuda.current_stream()
        super().wait(stream)
        if self.handle is not None:  # waiting for an event never recorded waits for nothing
            sim = self.cuda.sim
            sim._check(sim.on(stream.device_index, sim.lib.cuStreamWaitEvent, stream.cuda_stream or None,
                              self.handle, 0), "cuStreamWaitEvent")

    def synchronize(self):
        super().synchronize()
        if self.handle is not None:
            self.cuda.sim._check(self.cuda.sim.lib.cuEventSynchronize(self.handle), "cuEventSynchronize")


class SimCuda(FakeCuda):
    """tests/_fake_cuda.py's torch.cuda over the simulator's devices, streams and events. The core's own orderings
    (fastdp._C.order, Fence) stay the core's: they reach the simulated driver themselves."""

    def __init__(self, sim):
        self.sim = sim
        self._rng = {}
        super().__init__(sim.ndev)
        self._streams = []
        self.defaults = [SimStream(self, d, f"default@{d}", 0) for d in range(sim.ndev)]

    def stream_on(self, device, name):
        s = SimStream(self, device, name, self.sim.stream(device))
        self.by_handle[s.cuda_stream] = s
        return s

    def ExternalStream(self, stream_ptr, device=None):
        d = self._index(device)
        s = self.defaults[d] if stream_ptr == 0 else self.by_handle.get(stream_ptr)
        if s is None:
            s = self.by_handle[stream_ptr] = SimStream(self, d, f"external{stream_ptr:#x}", stream_ptr)
        if s.device_index != d:
            self.misuse.append(f"ExternalStream({s.name}, device={d}): that stream belongs to device {s.device_index}")
        return s

    def Event(self, **kwargs):
        return SimEvent(self, **kwargs)

    def synchronize(self, device=None):
        super().synchronize(device)
        self.sim._check(self.sim.on(self._index(device), self.sim.lib.cuCtxSynchronize), "cuCtxSynchronize")

    def get_rng_state(self, device="cuda"):
        """A device's random generator state. Random operations on simulated devices draw from the host's generator
        (the bridge computes them there), so this state stands for nothing but itself: what was set is returned."""
        return self._rng.get(self._index(device), torch.zeros(16, dtype=torch.uint8)).clone()

    def set_rng_state(self, state, device="cuda"):
        self._rng[self._index(device)] = state.clone()

    def record_stream(self, t, stream):
        self.record("record_stream", t.data_ptr(), stream.name)
        if isinstance(t, DevTensor) and stream != t._storage.stream:
            t._storage.recorded.add(stream)

    def engine(self, monkeypatch, function):
        """Autograd's engine on a GPU for ``function``'s nodes (torch 2.8 and newer, the torch this runs): a node's
        canonical stream is the stream current on its first output's device when it was made; before its backward
        runs there, that stream waits (a simulator event) for the stream that produced each incoming gradient (the
        last to write it); each gradient it hands on to a node of another stream is waited for there and recorded
        as used by that stream. The engine of a CPU build sees host tensors and makes none of these waits; and the
        gradients it materialises for outputs that got none are zeros on the host, where a GPU's engine makes them on
        the output's device: they are moved there. What the backward returns is checked as the engine checks it:
        each gradient on its input's device."""
        cuda, forward, backward = self, function.forward, function.backward

        def made(ctx, *args):
            # The nodes that will consume this node's gradients: made on the stream current on their device now.
            ctx.sim_consumers = [cuda.current_stream(a.get_device()) if isinstance(a, DevTensor) else None
                                 for a in args]
            ctx.sim_inputs = [a.get_device() if isinstance(a, DevTensor) else "cpu" if isinstance(a, torch.Tensor)
                              else None for a in args]
            out = forward(ctx, *args)
            outs = out if isinstance(out, tuple) else (out,)
            ctx.sim_devices = [t.get_device() if isinstance(t, DevTensor) else None for t in outs]
            first = next((d for d in ctx.sim_devices if d is not None), None)
            ctx.sim_canonical = None if first is None else cuda.current_stream(first)
            return out

        def run(ctx, *grads):
            canonical = ctx.sim_canonical
            if canonical is None:
                return backward(ctx, *grads)
            grads = tuple(g.to(torch.device("cuda", d)) if d is not None and isinstance(g, torch.Tensor)
                          and not isinstance(g, DevTensor) else g for g, d in zip(grads, ctx.sim_devices))
            for producer in {g._storage.written_on for g in grads if isinstance(g, DevTensor)}:
                if producer != canonical:
                    event = cuda.Event()
                    event.record(producer)
                    event.wait(canonical)
            st = cuda._state()
            before = st.streams, st.device
            st.streams, st.device = {canonical.device_index: canonical}, canonical.device_index  # a device thread
            try:
                results = backward(ctx, *grads)
            finally:
                st.streams, st.device = before
            handed = results if isinstance(results, tuple) else (results,)
            _validate_outputs(handed, ctx.sim_inputs)
            for g, consumer in zip(handed, ctx.sim_consumers):
                if isinstance(g, DevTensor) and consumer is not None and consumer != canonical:
                    # The consumer's stream waits for this node's canonical stream, and the gradient's memory
                    # counts as used by the consumer (the engine's record_stream).
                    event = cuda.Event()
                    event.record(canonical)
                    event.wait(consumer)
                    cuda.record_stream(g, consumer)
            return results

        monkeypatch.setattr(function, "forward", staticmethod(made))
        monkeypatch.setattr(function, "backward", staticmethod(run))
        return self

    def install(self, monkeypatch):
        from fastdp._reduction import cuda as _rcuda

        for name in self._API + ("get_rng_state", "set_rng_state"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: None)  # factory calls naming cuda reach the mode
        monkeypatch.setattr(torch.cuda, "empty_cache", self.sim.trim)
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, stream: self.record_stream(t, stream))
        monkeypatch.setattr(torch.Tensor, "cuda", lambda t, device=None, non_blocking=False, **kw: t.to(
            torch.device("cuda", self._index(device)), non_blocking=non_blocking))
        real_tensor = torch.tensor

        def tensor(data, *, device=None, **kw):  # torch.tensor refuses a CUDA device before any dispatch
            t = real_tensor(data, **kw)
            if device is None or torch.device(device).type != "cuda":
                return t
            return t.to(torch.device("cuda", self._index(device)))  # "cuda" alone: the current device

        monkeypatch.setattr(torch, "tensor", tensor)
        monkeypatch.setattr(_rcuda, "_OWN_STREAMS", {})  # the reduction's streams are the simulator's
        return self
