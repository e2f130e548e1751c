"""What ``dp.report()`` is made of: per-step records of a ``fastdp.DataParallel``'s phases, per replica and per step.

A wrapper holds ``_recorder = None`` until the report is enabled (``report=True``, ``dp.enable_report()``) or
``chunk_sizes="auto"`` needs timings; every recording site pays one attribute test while it is None. While it is
on, each multi-device forward opens a :class:`StepRecord` (the last ``steps`` are kept) and every site calls
:meth:`Recorder.record` with a phase, a replica position (None for a whole-step phase), a start and an end:
``time.perf_counter_ns()`` integers, or CUDA events recorded with ``enable_timing=True``, which are resolved only
when the report is read, so nothing in the step waits for a device. Records arriving from outside the forward
(the gradient reduction in backward) belong to the step opened last.
"""

import collections
import contextlib
import threading
import time
import weakref

import torch

from .._platform import devices as _devices
from .._balance import memory as _memory
from .._reduction import reducer as _reducer
from .._step import hooks as _hooks, replicas as _replicas
from ..replicate import is_compiled

__all__ = ["Recorder", "StepRecord", "ReplicaSite", "Resolved", "resolve", "anchors", "parse_steps", "graph_tensors", "nbytes",
           "module_bytes", "DEFAULT_STEPS", "PHASES"]

DEFAULT_STEPS = 20

# The phases the wrapper itself records; a reducer adds "reduce" (one record per bucket) and "wait-reduce".
PHASES = ("scatter", "replicate", "forward", "apply", "gather", "backward", "reduce", "wait-reduce")

_now = time.perf_counter_ns
_thread_cpu = time.thread_time_ns


def _nothing():
    pass


def parse_steps(report, name="report"):
    """The number of steps kept for ``report=`` (True: the default; an int: that many), or None when off."""
    if report is None or report is False:
        return None
    if report is True:
        return DEFAULT_STEPS
    if isinstance(report, bool) or not isinstance(report, int) or report < 1:
        raise ValueError(
            f"{name}={report!r}: expected True (keep the last {DEFAULT_STEPS} steps), False, or a positive int "
            "(how many steps the report keeps)"
        )
    return report


class Recording:
    """Whether a wrapper records its steps, and for whom: the report (``report=``, ``enable_report``: the last
    ``steps`` steps), the time-balanced split (``chunk_sizes="auto"``: a few steps while it measures the replicas'
    times), and a test's out-of-memory injection (run where the replicas run). The wrapper holds one and asks it;
    ``recorder`` is what the next step records into, None when nobody needs a record (nothing recorded, nothing
    paid). The report and the split read the same records (``Recorder.last_timings``), so neither needs the other."""

    def __init__(self, steps):
        self.steps = steps  # the report's: how many steps to keep (None: the report is off)
        self.recorder = None
        self.injection = None

    def fresh(self):
        """A Recording with the same settings and nothing recorded (a copied or unpickled wrapper's)."""
        return Recording(self.steps)

    def set_report_steps(self, steps, timings_wanted):
        self.steps = steps
        self.update(timings_wanted)

    def inject(self, injection, timings_wanted):
        """Runs a test's out-of-memory injection (fastdp._balance.inject) in the replicas from the next step on
        (None: removes it)."""
        self.injection = injection
        self.update(timings_wanted)

    def update(self, timings_wanted):
        """Sets the recorder from what is wanted: the report's, or a small internal one while the split wants replica
        times (`timings_wanted`) or an injection needs the replicas' site; None otherwise."""
        rec = self.recorder
        if self.steps:
            if rec is None or rec.internal:
                rec = Recorder(self.steps)
            else:
                rec.resize(self.steps)
        elif self.injection is not None or timings_wanted:
            if rec is None or not rec.internal:
                rec = Recorder(4, internal=True)
        else:
            rec = None
        if rec is not None:
            rec.inject = self.injection
        self.recorder = rec

    def mark(self):
        """A callable that forgets the steps recorded from now on (those of an attempt that failed and runs again)."""
        rec = self.recorder
        if rec is None:
            return _nothing
        opened = rec.opened()
        return lambda: rec.discard_after(opened)

    def scattered(self, step, rows, scattered_bytes, samplers, timings_wanted):
        """After the scatter: the rows each position got (`rows`), the scatter's range and bytes, and the site that
        runs the replicas (with `samplers` called in each training replica's forward). An internal recorder whose
        split no longer wants timings stops recording from the next step on."""
        rec = step.recorder
        record = rec.open
        for pos, n in rows.items():
            record.rows[pos] = n
        rec.lap("scatter", scattered_bytes)
        if record.training and rec.memory is not None:
            samplers = [rec.memory.sample] + list(samplers)
        step.site = ReplicaSite(rec, record, step.run, rec.inject, samplers if record.training else [])
        if rec.internal and rec.inject is None and not timings_wanted:
            self.recorder = None  # "auto" has settled: the next steps record nothing

    @staticmethod
    def replicated(step, module, kept):
        """After replicate: its range, and the bytes it copied (the module's tensors to every other device)."""
        rec = step.recorder
        key = (id(kept), id(module)) if kept is not None else None
        cached = rec.module_bytes
        if key is None or cached is None or cached[0] != key:
            cached = rec.module_bytes = (key, module_bytes(module))
        rec.lap("replicate", cached[1] * (len(step.replicated) - 1))
        rec.open.apply_at = time.perf_counter_ns()


class StepRecord:
    """One multi-device forward and what followed it (its backward, its reduction), as recorded.

    ``t0``: ``perf_counter_ns`` at the forward's start. ``devices``: the device of each ``device_ids`` position.
    ``rows``: samples per position (0 where a position ran no replica). ``training``: grad enabled and the module
    in training mode. ``records``: ``(phase, replica, start, end, nbytes, extra, host_ns)`` tuples, ``host_ns``
    the host clock when the record was made (it places an event pair whose device has no reference). ``memory``:
    per position, the allocator's high over the step (``None`` where it cannot be measured), filled by the next
    step's start. ``refs``: per CUDA device index, an event recorded at ``t0`` and the host time it was enqueued (not
    when it ran: the device's queue runs behind the host; see :func:`anchors`).
    """

    __slots__ = ("index", "t0", "devices", "rows", "training", "records", "memory", "memory_exact", "refs",
                 "backward_marks", "backward_done", "lap_at", "lap_device",
                 "apply_at")

    def __init__(self, index, devices, training):
        self.index = index
        self.t0 = _now()
        self.devices = devices
        self.rows = [0] * len(devices)
        self.training = training
        self.records = []
        self.memory = self.memory_exact = None
        self.refs = {}
        self.backward_marks = {}  # position -> when backward reached its outputs
        self.backward_done = set()
        self.lap_at = self.lap_device = None  # where the last whole-step phase ended, and on which device
        self.apply_at = 0  # the host clock when the replicas were handed out


class Recorder:
    """The per-wrapper recorder: the last ``steps`` steps, and the interface every recording site calls."""

    def __init__(self, steps=DEFAULT_STEPS, internal=False):
        self.steps = collections.deque(maxlen=steps)
        self.internal = internal  # made for chunk_sizes="auto" only: dropped again once it has settled
        self.open = None  # the step records go to
        self._count = 0
        self.memory = None  # fastdp._balance.memory.PeakWindow over distinct CUDA devices (made by the first step)
        self._memory_known = False
        # A test's out-of-memory injection (fastdp._balance.inject.Injection), run by the replicas' site.
        self.inject = None
        self.module_bytes = None  # (key of the kept replica set, bytes of the module's tensors)
        self.timed = 0  # the newest step whose times chunk_sizes="auto" was given
        self.owners = weakref.WeakKeyDictionary()  # replica -> (submodule, name) of its first trainable parameter

    # ---- the interface the sites (and a gradient reducer) call ----

    def record(self, phase, replica, start, end, nbytes=0, **extra):
        """One measured range. ``phase``: a name (see PHASES). ``replica``: a ``device_ids`` position, or None
        for a whole-step phase. ``start``/``end``: ``time.perf_counter_ns()`` ints, or two CUDA events recorded
        with ``enable_timing=True`` (resolved when the report is read). ``nbytes``: bytes the range moved.
        ``extra``: anything to keep with it (``bucket=3``); shown in the trace."""
        step = self.open
        if step is not None:
            step.records.append((phase, replica, start, end, nbytes, extra, 0 if isinstance(start, int) else _now()))

    def stamp(self, device):
        """A point in time on ``device``: ``perf_counter_ns()`` on the host, an event recorded on the current
        stream of a CUDA device (``device`` an index)."""
        if device == _devices.CPU or device is None:
            return _now()
        event = torch.cuda.Event(enable_timing=True)
        event._fastdp_device = device
        event.record(torch.cuda.current_stream(device))
        return event

    # ---- steps ----

    def begin(self, devices, training):
        """Opens the record of a new step over ``devices`` (one per device_ids position); the step before gets its
        memory high (distinct CUDA devices only: the host, or a GPU listed twice, has no per-replica figure)."""
        if not self._memory_known:
            self._memory_known = True
            if _devices.CPU not in devices and len(set(devices)) == len(devices):
                self.memory = _memory.PeakWindow(devices)
        memory = self.memory
        previous = self.open
        self._count += 1
        step = StepRecord(self._count, devices, training)
        if previous is not None and memory is not None:
            previous.memory = memory.read()
            previous.memory_exact = list(memory.exact)
        for d in devices:
            if d != _devices.CPU and d not in step.refs:
                step.refs[d] = (self.stamp(d), _now())
        step.lap_device = devices[0]
        step.lap_at = self.stamp(devices[0])
        self.open = step
        self.steps.append(step)
        return step

    def lap(self, phase, nbytes=0):
        """Records a whole-step phase of the open step, from where the last one ended to now (on device_ids[0]'s
        current stream for CUDA devices)."""
        step = self.open
        now = self.stamp(step.lap_device)
        self.record(phase, None, step.lap_at, now, nbytes)
        step.lap_at = now

    def sample_memory(self):
        """Notes the allocator's current figures (a step's memory is highest at the end of its forward)."""
        if self.memory is not None:
            self.memory.sample()

    def opened(self):
        """How many steps were opened so far (``discard_after`` forgets those opened after)."""
        return self._count

    def discard_after(self, opened):
        """Forgets the steps opened after ``opened()`` returned `opened` (an attempt that failed and runs again: it
        never ran whole)."""
        while self.steps and self.steps[-1].index > opened:
            self.steps.pop()
        self.open = self.steps[-1] if self.steps else None

    def resize(self, steps):
        """Keeps the last ``steps`` steps from now on."""
        self.steps = collections.deque(self.steps, maxlen=steps)

    def last_timings(self):
        """(rows, busy seconds) per position of the newest finished training step not handed out before, for
        chunk_sizes="auto"; None when there is none. Read without waiting for a device: a step whose CUDA events
        are not all complete yet is passed over (the GPU runs behind the host) and an older one taken."""
        steps = list(self.steps)[:-1]  # the last one is the step now starting
        for step in reversed(steps):
            if step.index <= self.timed or not step.training:
                continue
            done = resolve(step, wait=False)
            if done is None:
                continue
            busy = [0.0] * len(done.rows)
            seen = False
            for phase, replica, start, end, _, _ in done.ranges:
                if replica is not None and phase in ("forward", "backward"):
                    busy[replica] += (end - start) / 1e9
                    seen = True
            if seen:
                self.timed = step.index
                return list(done.rows), busy
        return None


class Resolved:
    """A step's records as plain numbers: ``ranges`` of (phase, replica, start_ns, end_ns, nbytes, extra), times
    from the step's start; the step's ``rows``, ``devices``, ``training``, ``memory``, ``threads``."""

    __slots__ = ("index", "t0", "rows", "devices", "training", "memory", "memory_exact", "threads", "ranges")

    def __init__(self, step, ranges):
        self.t0 = step.t0
        self.index, self.rows, self.devices, self.training = step.index, step.rows, step.devices, step.training
        self.memory, self.memory_exact = step.memory, step.memory_exact
        self.threads = any("thread" in r[5] for r in step.records if r[0] == "forward")
        self.ranges = ranges


def _is_event(x):
    return not isinstance(x, int)


def _ready(x):
    return not _is_event(x) or x.query()


def anchors(devices):
    """Per CUDA device of `devices`, a point that is on the device's clock and the host's alike: (an event, the host
    time it ran). Taken after a synchronisation of the device, so that its queue is empty and the event runs as it is
    recorded; reading a report is the one place that waits for the device anyway (never inside a step)."""
    out = {}
    for d in devices:
        if d == _devices.CPU or d is None or d in out:
            continue
        torch.cuda.synchronize(d)
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(d))
        out[d] = (event, _now())
    return out


def _origins(step, anchored):
    """Per CUDA device of the step, the host time (ns from the step's start) at which its reference event ran.

    A device runs its queue behind the host, by a different amount per device (device 0, which also runs the
    optimizer, is often the furthest behind), so the host time at which the reference was enqueued is not when it
    ran. With `anchored` (:func:`anchors`, taken later on an empty queue) the reference is placed by the device's
    own clock, counted back from the anchor: every device's events then share the host's clock, and a device 0 that
    runs late shows late. The reference never ran before it was enqueued. Without anchors (the auto split, reading
    inside a step, needs durations only) the enqueue time stands in."""
    origins = {}
    for d, (ref, enqueued) in step.refs.items():
        at = enqueued
        anchor = anchored.get(d) if anchored else None
        if anchor is not None:
            at = max(enqueued, anchor[1] - int(ref.elapsed_time(anchor[0]) * 1e6))
        origins[d] = at - step.t0
    return origins


def resolve(step, wait=True, anchored=None):
    """The step's records with every time in ns from its start. CUDA events are read here: with ``wait`` each
    is waited for (reading a report), else None is returned while any is not complete (inside a step).
    `anchored`: :func:`anchors` of the step's devices, which put every device's events on the host's clock."""
    records = list(step.records)
    events = [x for r in records for x in (r[2], r[3]) if _is_event(x)]
    events += [ev for ev, _ in step.refs.values()]
    if not wait and not all(_ready(x) for x in events):
        return None
    if wait:
        for ev in events:
            ev.synchronize()
    origins = _origins(step, anchored)
    ranges = []
    for phase, replica, start, end, nbytes, extra, host in records:
        if not _is_event(start):
            ranges.append((phase, replica, start - step.t0, end - step.t0, nbytes, extra))
            continue
        device = getattr(start, "_fastdp_device", None)
        if device in origins:
            ref = step.refs[device][0]
            a = origins[device] + ref.elapsed_time(start) * 1e6
            b = origins[device] + ref.elapsed_time(end) * 1e6
        else:  # an event pair of unknown device: placed to end when it was recorded
            b = host - step.t0
            a = b - start.elapsed_time(end) * 1e6
        ranges.append((phase, replica, int(a), int(b), nbytes, extra))
    return Resolved(step, ranges)


# ---- the replicas' site: forward and backward per replica ----------------------------------------------------


class ReplicaSite:
    """What parallel_apply's workers call instead of ``module(*args, **kwargs)`` while a step records (or a test
    injects an out-of-memory error, fastdp._balance.rescue): times each replica's forward where it runs (its thread, its
    device's current stream) and marks its backward. ``positions``: the device_ids position of each replica.
    ``samplers``: called when backward reaches the first replica's outputs (memory is sampled then)."""

    __slots__ = ("recorder", "step", "positions", "inject", "samplers", "profiling", "threads")

    def __init__(self, recorder, step, positions, inject=None, samplers=()):
        self.recorder, self.step, self.positions, self.inject = recorder, step, positions, inject
        self.samplers = samplers
        self.profiling = recorder is not None and _profiling()
        self.threads = False  # set by parallel_apply: whether the replicas run on threads

    def __call__(self, index, module, args, kwargs, device):
        position = self.positions[index]
        inject = self.inject
        if inject is None and self.recorder is not None:  # a recording step without a test's injection
            return self._timed(position, module, args, kwargs, device)
        with contextlib.nullcontext() if inject is None else inject.forward(position, args, kwargs):
            if self.recorder is None:
                out = module(*args, **kwargs)
            else:
                out = self._timed(position, module, args, kwargs, device)
        if inject is not None:
            inject.backward(position, args, kwargs, out)
        return out

    def _timed(self, position, module, args, kwargs, device):
        rec = self.recorder
        marked = self._mark_end(position, device, module) if torch.is_grad_enabled() else None
        threads = self.threads
        cpu, wall = _thread_cpu() if threads else 0, _now()
        start = rec.stamp(device)
        try:
            if self.profiling:
                with torch.autograd.profiler.record_function(f"fastdp.forward[{position}]"):
                    out = module(*args, **kwargs)
            else:
                out = module(*args, **kwargs)
        finally:
            if marked is not None:
                marked()  # the parameter shows through again
        end = rec.stamp(device)
        wall_ns = _now() - wall
        if threads:
            rec.record("forward", position, start, end, 0, off_cpu_ns=max(0, wall_ns - (_thread_cpu() - cpu)),
                       queued_ns=max(0, wall - self.step.apply_at), thread=threading.get_ident())
        else:
            rec.record("forward", position, start, end)
        if torch.is_grad_enabled():
            self._mark_start(position, device, out)
        return out

    def _mark_start(self, position, device, output):
        """Backward starts for a replica when the gradient reaches any of its outputs (a pre-hook on their
        nodes); the first replica to start samples memory (the output device holds the gathered outputs and their
        gradient then)."""
        outs = graph_tensors(output, [])
        rec, step, samplers = self.recorder, self.step, self.samplers
        marks = step.backward_marks

        def started(grad_outputs):
            if position not in marks:
                if not marks:
                    for sample in samplers:
                        sample()
                marks[position] = rec.stamp(device)
            return None

        for t in outs:
            _hooks.on_node(t.grad_fn, started, pre=True)

    def _mark_end(self, position, device, module):
        """Backward ends for a replica when its first trainable parameter (registration order) has its
        gradient: in a network that uses its layers in the order it registers them, the last its backward
        computes. For this forward that parameter is shadowed, in its module, by a view of itself: autograd runs the
        view's node once the parameter's gradient is complete (every use of it in this forward), and a post-hook
        on that node records ("backward", position). The gradient passes unchanged; the forward's end calls the
        returned callable, which puts the parameter back (None: nothing marked). The view stands in for the
        parameter as the kept replicas allow a forward's stand-in (fastdp._step.replicas.stand_in), so that the next
        step does not take it for the forward's own edit."""
        found = _first_parameter(module, self.recorder.owners)
        if found is None:
            return None
        owner, name = found
        param = owner._parameters.get(name)
        if param is None or not param.requires_grad:
            return None
        marked = param.view_as(param)

        def ended(grad_inputs, grad_outputs):
            self.ended(position, device)

        _hooks.on_node(marked.grad_fn, ended)
        return _replicas.stand_in(owner, name, marked)

    def ended(self, position, device):
        step = self.step
        start = step.backward_marks.get(position)
        if start is not None and position not in step.backward_done:
            step.backward_done.add(position)
            self.recorder.record("backward", position, start, self.recorder.stamp(device))


def _first_parameter(module, cache):
    """(submodule, name) of a replica's first trainable parameter in registration order, or None; through the
    callables fastdp pairs a replica with (the per-replica loss's, SyncBatchNorm's). None for a torch.compile
    module: its backward is then not measured."""
    for _ in range(4):
        if isinstance(module, torch.nn.Module):
            break
        module = getattr(module, "replica", None) or getattr(module, "fn", None)
    else:
        return None
    if not isinstance(module, torch.nn.Module) or is_compiled(module):
        return None  # a compiled replica's guards would see a new tensor each step and compile again
    found = cache.get(module, False)  # kept replicas live across steps: looked up once
    if found is False:
        found = cache[module] = _find_first_parameter(module)
    return found


def _find_first_parameter(module):
    for name, p in module.named_parameters():
        if p.requires_grad:
            path, _, leaf = name.rpartition(".")
            return module.get_submodule(path) if path else module, leaf
    return None



def _profiling():
    """Whether a torch profiler records (the phases then show in its trace as record_function ranges)."""
    flag = getattr(torch.autograd.profiler, "_is_profiler_enabled", False)
    query = getattr(getattr(torch._C, "_autograd", None), "_profiler_enabled", None)
    return bool(flag) or (query is not None and query())


def graph_tensors(obj, out, depth=0):
    """The tensors of a replica's output that carry a graph its forward made (in tensors, lists, tuples, dicts and
    dict-like outputs such as transformers' ModelOutput), at most 16. A kept replica tensor handed out as it is (a
    module returning its parameter) carries a node that outlives the step: a hook for this step is not put there."""
    if len(out) >= 16 or depth > 4:
        return out
    if isinstance(obj, torch.Tensor):
        node = obj.grad_fn
        if node is not None and not _reducer.kept_node(node):
            out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            graph_tensors(x, out, depth + 1)
    elif isinstance(obj, dict):
        for x in obj.values():
            graph_tensors(x, out, depth + 1)
    return out


def nbytes(obj, depth=0):
    """Bytes of the tensors in a (nested) input or output."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if depth > 6:
        return 0
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(x, depth + 1) for x in obj)
    if isinstance(obj, dict):
        return sum(nbytes(x, depth + 1) for x in obj.values())
    return 0


def module_bytes(module):
    """Bytes of a module's parameters and buffers: what replicating it copies to each other device."""
    return sum(t.numel() * t.element_size() for t in module.parameters()) + sum(
        t.numel() * t.element_size() for t in module.buffers())
