"""A recording stand-in for torch.cuda's stream, event, device and memory API, so that the shim's CUDA-only branches
run on a machine without a GPU and a test can assert which stream each piece of work was ordered on.

``FakeCuda(ndev).install(monkeypatch)`` replaces the torch.cuda functions the shim calls. Streams and the current
device are per thread, as in PyTorch: a new thread starts on device 0 with every device's default stream current.
Everything that orders work (a stream waiting for another, an event recorded or waited on, a tensor's block
recorded as used on a stream) or stalls the host (any synchronize) is appended to ``log`` as a tuple, in the order
it happened, from every thread. Tensors stay on the host: the tests pair the fake API with host tensors whose
devices the code under test is told are CUDA devices, or (``install_memory``) with host tensors it sees as CUDA
tensors, allocated where it asks torch for CUDA memory.

The fake is strict where torch would silently do the wrong thing: a device index that does not exist, or an
``ExternalStream`` told another device than the one its stream belongs to (torch would make it current on the wrong
device), is recorded in ``misuse``; tests check it stays empty.
"""

import contextlib
import itertools
import threading
import time
import types

import torch

# What a host synchronisation is called in the log: a step in the steady state must record none of these.
HOST_SYNCS = ("device_sync", "stream_sync", "event_sync")


class FakeStream:
    """One stream: a device, a handle (``cuda_stream``) and a name for the log."""

    def __init__(self, cuda, device, name, handle):
        self.cuda = cuda
        self.device = torch.device("cuda", device)
        self.device_index = device
        self.cuda_stream = handle
        self.name = name

    def wait_stream(self, other):
        self.cuda.record("wait", self.name, other.name)

    def wait_event(self, event):
        self.cuda.record("wait_event", self.name, event.name)

    def record_event(self, event=None):
        event = event or FakeEvent(self.cuda)
        event.record(self)
        return event

    def synchronize(self):
        self.cuda.record("stream_sync", self.name)

    def query(self):
        return True

    def __eq__(self, other):
        return isinstance(other, FakeStream) and (other.device, other.cuda_stream) == (self.device, self.cuda_stream)

    def __hash__(self):
        return hash((self.device, self.cuda_stream))

    def __repr__(self):
        return self.name


class FakeEvent:
    _serial = itertools.count(1)

    def __init__(self, cuda, **kwargs):
        self.cuda = cuda
        self.name = f"e{next(self._serial)}"
        self.timing = kwargs.get("enable_timing", False)
        self.at = None  # the host clock when recorded: the fake device runs everything at once

    def record(self, stream=None):
        self.cuda.record("record", self.name, (stream or self.cuda.current_stream()).name)
        self.at = time.perf_counter_ns()

    def elapsed_time(self, end):
        """Milliseconds from this event to ``end``, as torch's (both recorded with enable_timing=True)."""
        if not (self.timing and end.timing) or self.at is None or end.at is None:
            raise RuntimeError("fake elapsed_time: both events must be recorded with enable_timing=True")
        return (end.at - self.at) / 1e6

    def wait(self, stream=None):
        self.cuda.record("wait_event", (stream or self.cuda.current_stream()).name, self.name)

    def synchronize(self):
        self.cuda.record("event_sync", self.name)

    def query(self):
        return True


class FakeFence:
    """fastdp._C.Fence: a fence recorded behind the listed streams; waits on it and host queries are logged. It has
    passed when the fake says fences pass (``fences_done``), or once every device it fences was synchronised after
    it was recorded (a device's queue runs late until then)."""

    _serial = itertools.count(1)

    def __init__(self, cuda, streams):
        self.cuda = cuda
        self.serial = next(self._serial)
        self.name = f"f{self.serial}"
        self.devices = {device for device, _ in streams}
        for device, handle in streams:
            cuda.record("fence", self.name, cuda.stream_of(device, handle).name)

    def wait(self, streams):
        for device, handle in streams:
            self.cuda.record("wait_fence", self.cuda.stream_of(device, handle).name, self.name)

    def done(self):
        self.cuda.record("query", self.name)
        synced = self.cuda.synced_after
        return self.cuda.fences_done or all(synced.get(d, 0) > self.serial for d in self.devices)


class FakeCuda:
    """``ndev`` fake CUDA devices. ``stream_on(d, name)`` makes a named non-default stream; ``capturing`` is what
    ``is_current_stream_capturing`` answers; ``allocated[d]`` what ``memory_allocated(d)`` answers; ``props[d]`` what
    ``get_device_properties(d)`` answers."""

    def __init__(self, ndev=2):
        self.ndev = ndev
        self.log = []
        self.misuse = []
        self.memory = {}  # storage address -> the fake device holding it (install_memory)
        self._kept = []  # those storages, alive, so that no address is reused during the test
        self.props = [types.SimpleNamespace(name=f"Fake GPU {d}", total_memory=80 << 30, multi_processor_count=132)
                      for d in range(ndev)]
        self._lock = threading.Lock()
        self._tls = threading.local()
        self._handles = itertools.count(0x1000, 0x10)
        self.defaults = [FakeStream(self, d, f"default@{d}", 0) for d in range(ndev)]
        self.by_handle = {}
        self.capturing = False
        self.allocated = [0] * ndev
        self.peak = [0] * ndev
        self.peers = set((a, b) for a in range(ndev) for b in range(ndev) if a != b)
        self.fences_done = True  # what a fence's host query answers (False: the devices' queues run late)
        self.synced_after = {}  # device -> the fence serial its last synchronize() reached

    # ---- the log ----
    def record(self, *entry):
        with self._lock:
            self.log.append(entry)

    def entries(self, kind):
        return [e for e in self.log if e[0] == kind]

    def host_syncs(self):
        return [e for e in self.log if e[0] in HOST_SYNCS]

    # ---- per-thread state ----
    def _state(self):
        st = self._tls
        if not hasattr(st, "streams"):
            st.streams, st.device = {}, 0
        return st

    def _index(self, device):
        if device is None:
            return self._state().device
        if isinstance(device, FakeStream):
            return device.device_index
        if isinstance(device, int):
            index = device
        else:
            device = torch.device(device)
            if device.type != "cuda":
                self.misuse.append(f"a {device} device where a CUDA device was expected")
            index = self._state().device if device.index is None else device.index
        if not 0 <= index < self.ndev:
            self.misuse.append(f"CUDA device {index} does not exist ({self.ndev} fake devices)")
            index = 0
        return index

    def stream_of(self, device, handle):
        """The stream a (device, handle) pair of the core's stream lists names (handle 0: the default stream)."""
        return self.defaults[device] if handle == 0 else self.by_handle[handle]

    def order(self, waiters, signals):
        """fastdp._C.order: each waiter stream waits for its signal stream."""
        for (wd, wh), (sd, sh) in zip(waiters, signals):
            self.record("wait", self.stream_of(wd, wh).name, self.stream_of(sd, sh).name)

    def stream_on(self, device, name):
        s = FakeStream(self, device, name, next(self._handles))
        self.by_handle[s.cuda_stream] = s
        return s

    # ---- torch.cuda's API ----
    def current_stream(self, device=None):
        d = self._index(device)
        return self._state().streams.get(d, self.defaults[d])

    def default_stream(self, device=None):
        return self.defaults[self._index(device)]

    def set_stream(self, stream):
        st = self._state()
        st.streams[stream.device_index] = stream
        st.device = stream.device_index

    @contextlib.contextmanager
    def stream(self, stream):
        if stream is None:
            yield
            return
        st = self._state()
        d = stream.device_index
        before, device = st.streams.get(d), st.device
        st.streams[d], st.device = stream, d
        try:
            yield
        finally:
            if before is None:
                st.streams.pop(d, None)
            else:
                st.streams[d] = before
            st.device = device

    @contextlib.contextmanager
    def device(self, device):
        st = self._state()
        before = st.device
        st.device = self._index(device)
        try:
            yield
        finally:
            st.device = before

    def current_device(self):
        return self._state().device

    def set_device(self, device):
        self._state().device = self._index(device)
        self.record("set_device", self._state().device)

    def Stream(self, device=None, priority=0, **kwargs):
        return self.stream_on(self._index(device), f"new{len(self.by_handle)}@{self._index(device)}")

    def ExternalStream(self, stream_ptr, device=None):
        """The stream with that handle. 0 is the legacy default stream, PyTorch's default stream of the device. A
        stream told another device than its own is what torch would make of it: a stream of the wrong device."""
        d = self._index(device)
        s = self.defaults[d] if stream_ptr == 0 else self.by_handle.get(stream_ptr)
        if s is None:
            s = FakeStream(self, d, f"external{stream_ptr:#x}", stream_ptr)
            self.by_handle[stream_ptr] = s
        if s.device_index != d:
            self.misuse.append(f"ExternalStream({s.name}, device={d}): that stream belongs to device {s.device_index}")
            s = FakeStream(self, d, f"{s.name}-as-device-{d}", stream_ptr)
        return s

    def Event(self, **kwargs):
        return FakeEvent(self, **kwargs)

    def synchronize(self, device=None):
        index = self._index(device)
        self.record("device_sync", index)
        self.synced_after[index] = next(FakeFence._serial)  # every fence recorded before now has passed there

    def get_device_properties(self, device=None):
        return self.props[self._index(device)]

    def get_device_name(self, device=None):
        return self.props[self._index(device)].name

    def is_current_stream_capturing(self):
        return self.capturing

    def can_device_access_peer(self, device, peer):
        return (self._index(device), self._index(peer)) in self.peers

    def memory_allocated(self, device=None):
        return self.allocated[self._index(device)]

    def max_memory_allocated(self, device=None):
        return self.peak[self._index(device)]

    def memory_stats_as_nested_dict(self, device=None):
        d = self._index(device)
        self.record("memory_stats", d)
        return {"allocated_bytes": {"all": {"current": self.allocated[d], "peak": self.peak[d]}}}

    def allocate(self, device, nbytes):
        """What the caching allocator's counters do for an allocation (negative: a free) on ``device``."""
        self.allocated[device] += nbytes
        self.peak[device] = max(self.peak[device], self.allocated[device])

    def reset_peak_memory_stats(self, device=None):
        d = self._index(device)
        self.record("reset_peak", d)
        self.peak[d] = self.allocated[d]

    def is_available(self):
        return True

    def device_count(self):
        return self.ndev

    _API = ("current_stream", "default_stream", "set_stream", "stream", "device", "current_device", "set_device",
            "Stream", "ExternalStream", "Event", "synchronize", "is_current_stream_capturing",
            "can_device_access_peer", "memory_allocated", "max_memory_allocated", "reset_peak_memory_stats",
            "memory_stats_as_nested_dict",
            "is_available", "device_count", "get_device_properties", "get_device_name")

    def install(self, monkeypatch):
        """Puts this fake in place of torch.cuda's API for one test, and records ``Tensor.record_stream``."""
        for name in self._API:
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        cuda = self
        monkeypatch.setattr(torch.Tensor, "record_stream",
                            lambda t, stream: cuda.record("record_stream", t.data_ptr(), stream.name))
        # The core's orderings across streams (fastdp._platform.streams.order, Fence) are the driver's work: recorded too.
        from fastdp import _C
        from fastdp._reduction import cuda as _rcuda

        monkeypatch.setattr(_C, "order", self.order)
        monkeypatch.setattr(_C, "Fence", lambda streams: FakeFence(cuda, streams))
        monkeypatch.setattr(_rcuda, "_OWN_STREAMS", {})  # the reduction's streams are this fake's
        return self

    # ---- tensors in fake device memory ----
    def device_of(self, t):
        """The fake CUDA device whose memory holds t's storage, or None."""
        if t.numel() == 0 and t.untyped_storage().nbytes() == 0:
            return None
        return self.memory.get(t.untyped_storage().data_ptr())

    def tensor(self, t, device):
        """Host tensor t, seen by the code under test as a tensor of CUDA device ``device`` (with install_memory)."""
        assert t.untyped_storage().nbytes() > 0, "an empty storage has no address to tell it by"
        self.memory[t.untyped_storage().data_ptr()] = device
        self._kept.append(t)
        return t

    def install_memory(self, monkeypatch):
        """Makes the tensors of ``tensor`` look like CUDA tensors (``is_cuda``, ``device``, ``get_device``), and
        torch.empty / torch.empty_like with a CUDA device allocate such tensors on the host."""
        cuda, base = self, torch._C.TensorBase
        real_device, real_is_cuda, real_is_cpu = base.device.__get__, base.is_cuda.__get__, base.is_cpu.__get__
        real_get_device, real_empty, real_empty_like = base.get_device, torch.empty, torch.empty_like

        def device(t):
            d = cuda.device_of(t)
            return real_device(t) if d is None else torch.device("cuda", d)

        monkeypatch.setattr(torch.Tensor, "device", property(device))
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: cuda.device_of(t) is not None or real_is_cuda(t)))
        monkeypatch.setattr(torch.Tensor, "is_cpu", property(lambda t: cuda.device_of(t) is None and real_is_cpu(t)))
        monkeypatch.setattr(torch.Tensor, "get_device",
                            lambda t: real_get_device(t) if cuda.device_of(t) is None else cuda.device_of(t))

        def where(device):
            if device is None or isinstance(device, int):
                return device
            device = torch.device(device)
            return None if device.type == "cpu" else cuda._index(device)

        def empty(*size, device=None, **kw):
            d = where(device)
            t = real_empty(*size, **kw)
            return t if d is None else cuda.tensor(t, d)

        def empty_like(t, *, device=None, **kw):
            d = where(device) if device is not None else cuda.device_of(t)
            out = real_empty_like(t, **kw)
            return out if d is None else cuda.tensor(out, d)

        monkeypatch.setattr(torch, "empty", empty)
        monkeypatch.setattr(torch, "empty_like", empty_like)
        return self
