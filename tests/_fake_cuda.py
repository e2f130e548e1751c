"""A recording stand-in for torch.cuda's stream, event, device and memory API, so that the shim's CUDA-only branches
run on a machine without a GPU and a test can assert which stream each piece of work was ordered on.

``FakeCuda(ndev).install(monkeypatch)`` replaces the torch.cuda functions the shim calls. Streams and the current
device are per thread, as in PyTorch: a new thread starts on device 0 with every device's default stream current.
Everything that orders work (a stream waiting for another, an event recorded or waited on, a tensor's block
recorded as used on a stream) or stalls the host (any synchronize) is appended to ``log`` as a tuple, in the order
it happened, from every thread. Tensors stay on the host: the tests pair the fake API with host tensors whose
devices the code under test is told are CUDA devices, or (``install_memory``) with host tensors it sees as CUDA
tensors, allocated where it asks torch for CUDA memory.

What a real GPU does that a recorder would not show, modelled so that a test fails on it:

- **Queues that run late** (``late``): each stream's device clock runs behind the host's by an amount of its own.
  The host clock is the count of logged calls; work enqueued on a stream has run once the host clock reaches the
  time it was enqueued plus the stream's lag (and never before the work it waits for). An event, a fence or a
  timing is complete only then; a host synchronisation moves the host clock to where the device has run
  everything. With no lag (the default) every queue keeps up with the host.
- **Ordering**: each stream keeps a vector clock of the work ordered before its next item (its own, and what it
  waited for through ``wait_stream``, events, fences or the core's orderings). A read of memory whose last write
  is neither ordered before it nor already run is recorded in ``misuse``.
- **The caching allocator** (``install_memory``): a CUDA allocation is a block of the stream current on its device;
  when the last tensor over it dies the block goes back to that stream's pool and may be handed to the next
  allocation on that stream at once, unless ``record_stream`` named other streams, whose work up to the free must
  then run first. Handing out a block that another stream may still use (not recorded, not ordered before) is
  recorded in ``misuse``. ``allocated``/``peak`` follow the blocks alive. Fresh blocks are poisoned (NaN for
  floating types, a bit pattern for integers), so memory nobody wrote cannot pass for zeros.
- **Autograd's engine on a GPU** (``engine``): a node's canonical stream is the stream current on its first
  output's device when it was made; its backward runs with that stream current, and the incoming gradients are
  ordered before it by the rule of the torch being modelled: "canonical" (torch 2.8 and newer: the canonical stream
  waits for every input's producer stream) or "default" (before: an input on the node's device is waited for by the
  canonical stream, one on another device by that device's default stream, where it is then ready).

The fake is strict where torch would silently do the wrong thing: a device index that does not exist, or an
``ExternalStream`` told another device than the one its stream belongs to (torch would make it current on the wrong
device), is recorded in ``misuse``; tests check it stays empty.
"""

import contextlib
import itertools
import threading
import time
import types
import weakref

import torch
from torch.utils._python_dispatch import _disable_current_modes

from _fake_work import Work

# What a host synchronisation is called in the log: a step in the steady state must record none of these.
HOST_SYNCS = ("device_sync", "stream_sync", "event_sync")

# How far behind the host each stream's queue runs once ``late()`` is called without lags: far enough that nothing
# completes before a host synchronisation, by a different amount per stream.
LATE = 10**6


class Use:
    """One piece of work on a stream: its position in the stream (``count``) and the host time it has run by."""

    __slots__ = ("stream", "count", "tick")

    def __init__(self, stream, count, tick):
        self.stream, self.count, self.tick = stream, count, tick


class FakeStream:
    """One stream: a device, a handle (``cuda_stream``), a name for the log, and its queue: ``lag`` (how far its
    device clock runs behind the host), ``tail`` (the host time by which the work enqueued so far has run),
    ``count`` (items enqueued) and ``vc`` (per stream, how many of its items are ordered before this stream's next)."""

    def __init__(self, cuda, device, name, handle):
        self.cuda = cuda
        self.device = torch.device("cuda", device)
        self.device_index = device
        self.cuda_stream = handle
        self.name = name
        self.lag = cuda.lag_for(self)
        self.tail = 0
        self.count = 0
        self.vc = {}

    def wait_stream(self, other):
        self.cuda.record("wait", self.name, other.name)
        self.cuda.order_after(self, other.vc, other.tail)

    def wait_event(self, event):
        self.cuda.record("wait_event", self.name, event.name)
        self.cuda.order_after(self, event.vc, event.tick)

    def record_event(self, event=None):
        event = event or FakeEvent(self.cuda)
        event.record(self)
        return event

    def synchronize(self):
        self.cuda.record("stream_sync", self.name)
        self.cuda.run_until(self.tail)

    def query(self):
        return self.cuda.now >= self.tail

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
        self.at = None  # the host clock when recorded (what a timing between two events reads)
        self.tick, self.vc = 0, {}  # when the stream reaches it, and the work ordered before it

    def record(self, stream=None):
        stream = stream or self.cuda.current_stream()
        self.cuda.record("record", self.name, stream.name)
        self.tick, self.vc = self.cuda.mark(stream)
        self.at = time.perf_counter_ns()

    def elapsed_time(self, end):
        """Milliseconds from this event to ``end``, as torch's (both recorded with enable_timing=True, and both
        reached by their streams: torch raises for an event still pending)."""
        if not (self.timing and end.timing) or self.at is None or end.at is None:
            raise RuntimeError("fake elapsed_time: both events must be recorded with enable_timing=True")
        if not (self.query() and end.query()):
            raise RuntimeError("fake elapsed_time: an event has not completed yet (CUDA error: device not ready)")
        return (end.at - self.at) / 1e6

    def wait(self, stream=None):
        stream = stream or self.cuda.current_stream()
        self.cuda.record("wait_event", stream.name, self.name)
        self.cuda.order_after(stream, self.vc, self.tick)

    def synchronize(self):
        self.cuda.record("event_sync", self.name)
        self.cuda.run_until(self.tick)

    def query(self):
        return self.cuda.now >= self.tick


class FakeFence:
    """fastdp._C.Fence: a fence recorded behind the listed streams; waits on it and host queries are logged. It has
    passed once every fenced stream's queue has run the work enqueued before it."""

    _serial = itertools.count(1)

    def __init__(self, cuda, streams):
        self.cuda = cuda
        self.serial = next(self._serial)
        self.name = f"f{self.serial}"
        self.marks = []
        for device, handle in streams:
            stream = cuda.stream_of(device, handle)
            cuda.record("fence", self.name, stream.name)
            self.marks.append(cuda.mark(stream))

    def wait(self, streams):
        for device, handle in streams:
            stream = self.cuda.stream_of(device, handle)
            self.cuda.record("wait_fence", stream.name, self.name)
            for tick, vc in self.marks:
                self.cuda.order_after(stream, vc, tick)

    def done(self):
        self.cuda.record("query", self.name)
        return all(self.cuda.now >= tick for tick, _ in self.marks)


class Block:
    """A block of the modelled caching allocator: its device, the stream it was allocated on (whose pool it goes
    back to), its size, the work that used it, the streams ``record_stream`` named, and its last write."""

    __slots__ = ("device", "stream", "nbytes", "uses", "recorded", "written", "ready")

    def __init__(self, device, stream, nbytes):
        self.device, self.stream, self.nbytes = device, stream, nbytes
        self.uses, self.recorded, self.written, self.ready = [], set(), None, 0


def _poison(t):
    """Fills a fresh block with what a real one may hold: NaN for floating types, a bit pattern for integers."""
    with torch.no_grad():
        if t.dtype.is_floating_point or t.dtype.is_complex:
            t.fill_(float("nan"))
        elif t.dtype == torch.bool:
            t.fill_(True)
        elif t.numel():
            t.view(-1).fill_(-0x5B if t.dtype.is_signed else 0xA5)


class FakeCuda:
    """``ndev`` fake CUDA devices. ``stream_on(d, name)`` makes a named non-default stream; ``capturing`` is what
    ``is_current_stream_capturing`` answers; ``allocated[d]`` what ``memory_allocated(d)`` answers; ``props[d]`` what
    ``get_device_properties(d)`` answers."""

    def __init__(self, ndev=2):
        self.ndev = ndev
        self.log = []
        self.misuse = []
        self.memory = {}  # storage address -> the fake device holding it (install_memory)
        self._kept = []  # the storages a test made with ``tensor``, alive, so that no address is reused
        self.blocks = {}  # storage address -> its Block (allocations the code under test made, install_memory)
        self.pool = []  # freed blocks, until an allocation on their stream takes them again
        self.props = [types.SimpleNamespace(name=f"Fake GPU {d}", total_memory=80 << 30, multi_processor_count=132)
                      for d in range(ndev)]
        self._lock = threading.RLock()
        self._tls = threading.local()
        self._handles = itertools.count(0x1000, 0x10)
        self.now = 0  # the host clock: one tick per logged call
        self._late = 0  # the lag of the first stream; each later one lags more (late)
        self._streams = []
        self.defaults = [FakeStream(self, d, f"default@{d}", 0) for d in range(ndev)]
        self.by_handle = {}
        self.capturing = False
        self.allocated = [0] * ndev
        self.peak = [0] * ndev
        self.peers = set((a, b) for a in range(ndev) for b in range(ndev) if a != b)

    # ---- the log ----
    def record(self, *entry):
        with self._lock:
            self.log.append(entry)
            self.now += 1

    def entries(self, kind):
        return [e for e in self.log if e[0] == kind]

    def host_syncs(self):
        return [e for e in self.log if e[0] in HOST_SYNCS]

    # ---- the devices' clocks and the order of work ----
    def lag_for(self, stream):
        """A new stream's lag: each stream runs behind the host by an amount of its own."""
        self._streams.append(stream)
        return self._late and self._late + 997 * len(self._streams)

    def late(self, base=LATE):
        """From now on every queue runs behind the host (0: they keep up again, with what was enqueued run)."""
        self._late = base
        for k, s in enumerate(self._streams, 1):
            s.lag = base and base + 997 * k
        if not base:
            self.run_until(max(s.tail for s in self._streams))

    @property
    def fences_done(self):
        return self._late == 0

    @fences_done.setter
    def fences_done(self, done):
        self.late(0 if done else LATE)

    def run_until(self, tick):
        """The host waited until its clock reached ``tick``: the devices ran everything due by then."""
        with self._lock:
            self.now = max(self.now, tick)

    def mark(self, stream):
        """A point in ``stream``'s queue (an event, a fence): (when the stream reaches it, what is ordered before)."""
        with self._lock:
            stream.tail = max(stream.tail, self.now + stream.lag)
            return stream.tail, dict(stream.vc)

    def enqueue(self, stream):
        """One piece of work on ``stream``: the Use that names it."""
        with self._lock:
            stream.count += 1
            stream.vc[stream] = stream.count
            stream.tail = max(stream.tail, self.now + stream.lag)
            return Use(stream, stream.count, stream.tail)

    def order_after(self, stream, vc, tick):
        """``stream``'s later work waits for the work `vc` names (which has run by ``tick``)."""
        with self._lock:
            for s, n in vc.items():
                if stream.vc.get(s, 0) < n:
                    stream.vc[s] = n
            stream.tail = max(stream.tail, tick)

    def ordered_before(self, stream, use):
        """Whether the work `use` names is over before anything enqueued on ``stream`` now: the same queue, a wait
        that reaches it, or it has run already."""
        return use.stream == stream or stream.vc.get(use.stream, 0) >= use.count or use.tick <= self.now

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
            waiter, signal = self.stream_of(wd, wh), self.stream_of(sd, sh)
            self.record("wait", waiter.name, signal.name)
            self.order_after(waiter, signal.vc, signal.tail)

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
        self.run_until(max(s.tail for s in self._streams if s.device_index == index))

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
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, stream: self.record_stream(t, stream))
        # The core's orderings across streams (fastdp._platform.streams.order, Fence) are the driver's work: recorded too.
        from fastdp import _C
        from fastdp._reduction import cuda as _rcuda

        cuda = self
        monkeypatch.setattr(_C, "order", self.order)
        monkeypatch.setattr(_C, "Fence", lambda streams: FakeFence(cuda, streams))
        monkeypatch.setattr(_rcuda, "_OWN_STREAMS", {})  # the reduction's streams are this fake's
        return self

    def record_stream(self, t, stream):
        """Tensor.record_stream: the allocator will not hand out t's block again before ``stream``'s work enqueued
        up to the free has run."""
        self.record("record_stream", t.data_ptr(), stream.name)
        block = self.block_of(t)
        if block is not None and stream != block.stream:
            block.recorded.add(stream)

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

    def block_of(self, t):
        if not isinstance(t, torch.Tensor) or t.untyped_storage().nbytes() == 0:
            return None
        return self.blocks.get(t.untyped_storage().data_ptr())

    def _register(self, t, device, stream):
        """t's storage as a block of ``device`` allocated on ``stream``, counted until the storage dies."""
        storage = t.untyped_storage()
        address, nbytes = storage.data_ptr(), storage.nbytes()
        block = Block(device, stream, nbytes)
        with self._lock:
            self.blocks[address] = block
            self.memory[address] = device
            self.allocate(device, nbytes)
        weakref.finalize(storage, self._free, address, block)
        return block

    def _free(self, address, block):
        """The block's last tensor died: its stream's pool gets it back, once the recorded streams' work has run."""
        with self._lock:
            if self.blocks.get(address) is block:
                del self.blocks[address]
                self.memory.pop(address, None)
            self.allocate(block.device, -block.nbytes)
            block.ready = max((self.mark(s)[0] for s in block.recorded), default=0)
            self.pool.append(block)

    def _reuse(self, device, stream, nbytes):
        """The caching allocator hands the smallest free block of ``stream`` that fits, once its recorded streams
        are done; a use of it by another stream not ordered before this allocation is a misuse."""
        with self._lock:
            fits = [b for b in self.pool if b.device == device and b.stream == stream and b.nbytes >= nbytes
                    and b.ready <= self.now]
            if not fits:
                return
            block = min(fits, key=lambda b: b.nbytes)
            self.pool.remove(block)
        for use in block.uses:
            if use.stream not in block.recorded and not self.ordered_before(stream, use):
                self.misuse.append(f"a block of {block.nbytes} bytes freed to {stream}'s pool was handed out again "
                                   f"while {use.stream} may still use it (no record_stream, no wait)")
                return

    def allocated_on(self, t, device):
        """t, made on the host for an allocation the code under test asked of ``device``: a fresh block of the
        stream current there (perhaps one just freed), poisoned."""
        stream = self.current_stream(device)
        self._reuse(device, stream, t.untyped_storage().nbytes())
        self._register(t, device, stream)
        if self.poison:
            with _disable_current_modes():  # stale content, not work on a stream
                _poison(t)
        return t

    def adopt(self, t, device, stream):
        """t, made elsewhere (autograd, on the producer's stream): a block of ``device`` written on ``stream``."""
        if isinstance(t, torch.Tensor) and self.block_of(t) is None and t.untyped_storage().nbytes():
            block = self._register(t, device, stream)
            block.written = self.enqueue(stream)
            block.uses.append(block.written)
        return t

    def use(self, t, stream=None, write=False):
        """Work on ``stream`` (the current stream of t's device) reads t (or writes it). A read of memory whose last
        write is neither ordered before it nor run yet is a misuse."""
        block = self.block_of(t)
        if block is None:
            return
        stream = stream or self.current_stream(block.device)
        last = block.written
        if not write and last is not None and not self.ordered_before(stream, last):
            self.misuse.append(f"{stream} reads a block of device {block.device} before {last.stream}'s write to "
                               "it is ordered before (no wait for it)")
        use = self.enqueue(stream)
        block.uses.append(use)
        if write:
            block.written = use

    poison = True

    def install_memory(self, monkeypatch, poison=True, work=False):
        """Makes the tensors of ``tensor`` look like CUDA tensors (``is_cuda``, ``device``, ``get_device``), and
        torch.empty / empty_like / zeros / zeros_like with a CUDA device allocate such tensors on the host, as blocks
        of the modelled caching allocator (poisoned unless ``poison`` is False). With ``work``, every torch operation
        on such blocks is noted as the GPU would run it (``Work``) until the test ends."""
        cuda, base = self, torch._C.TensorBase
        self.poison = poison
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
            return cuda._index(device) if device.type == "cuda" else None

        def empty(*size, device=None, **kw):
            d = where(device)
            t = real_empty(*size, **kw)
            return t if d is None or t.untyped_storage().nbytes() == 0 else cuda.allocated_on(t, d)

        def empty_like(t, *, device=None, **kw):
            d = where(device) if device is not None else cuda.device_of(t)
            out = real_empty_like(t, **kw)
            return out if d is None or out.untyped_storage().nbytes() == 0 else cuda.allocated_on(out, d)

        def zeros(*size, device=None, **kw):
            t = empty(*size, device=device, **kw)
            with torch.no_grad():
                t.zero_()
            if cuda.block_of(t) is not None:
                cuda.use(t, write=True)
            return t

        def zeros_like(t, *, device=None, **kw):
            out = empty_like(t, device=device, **kw)
            with torch.no_grad():
                out.zero_()
            if cuda.block_of(out) is not None:
                cuda.use(out, write=True)
            return out

        monkeypatch.setattr(torch, "empty", empty)
        monkeypatch.setattr(torch, "empty_like", empty_like)
        monkeypatch.setattr(torch, "zeros", zeros)
        monkeypatch.setattr(torch, "zeros_like", zeros_like)
        if work:
            mode = Work(self)
            mode.__enter__()
            self._work = mode  # left by ``leave`` (the test's teardown calls it)
        return self

    def leave(self):
        """Leaves the operation tracking ``install_memory(work=True)`` entered."""
        mode = getattr(self, "_work", None)
        if mode is not None:
            self._work = None
            mode.__exit__(None, None, None)

    # ---- autograd's engine on a GPU ----
    def engine(self, monkeypatch, function, rule, producers, input_devices, canonical_device=0):
        """Runs ``function``'s nodes (an autograd.Function) as autograd's engine does on a GPU, by ``rule``
        ("canonical": torch 2.8 and newer; "default": before). ``producers[d]``: the stream where the gradients of
        device d are made (the backward of the replica's forward, on the stream its forward ran on);
        ``input_devices(ctx, n)``: the device of each of the node's n incoming gradients. Each gradient arrives as
        a block of its device written on its producer's stream; the waits the rule adds are logged."""
        assert rule in ("canonical", "default"), rule
        cuda, forward, backward = self, function.forward, function.backward

        def made(ctx, *args):
            ctx.fake_canonical = cuda.current_stream(canonical_device)  # the first output's InputMetadata
            return forward(ctx, *args)

        def run(ctx, *grads):
            canonical = ctx.fake_canonical
            for g, d in zip(grads, input_devices(ctx, len(grads))):
                if g is None:
                    continue
                producer = producers[d]
                cuda.adopt(g, d, producer)
                waiter = canonical if rule == "canonical" or d == canonical.device_index else cuda.defaults[d]
                if waiter != producer:  # the engine's event on the producer's stream, waited for
                    event = FakeEvent(cuda)
                    event.name = f"ready@{producer.name}"
                    event.tick, event.vc = cuda.mark(producer)
                    event.wait(waiter)
            st = cuda._state()
            before = st.streams, st.device
            st.streams, st.device = {canonical.device_index: canonical}, canonical.device_index  # a device thread
            try:
                return backward(ctx, *grads)
            finally:
                st.streams, st.device = before

        monkeypatch.setattr(function, "forward", staticmethod(made))
        monkeypatch.setattr(function, "backward", staticmethod(run))
        return self
