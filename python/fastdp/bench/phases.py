"""Training steps of the bare model, torch.nn.DataParallel and fastdp.DataParallel, side by side in one process.

Every configuration trains the same module on the same batch (forward, loss, backward, SGD step). Steps/s come
from an un-instrumented pass; the per-step split comes from a second, instrumented pass that times the wrappers'
overridable methods, the gradient reduction and hooks on the module (see ``Split``). Runs are interleaved over
the configurations, round after round (the starting configuration rotates), and medians are reported: on the CPU
the median of every timed step (steps are synchronous, so a preempted step is one outlier), on a GPU the median
over rounds of each round's mean step (steps are queued, so only whole blocks are timed).

How the split is approximated:
- scatter / replicate / gather: wall time of the wrapper's method (timed wrappers set on the instance, so the
  class, and with it fastdp's one-device short path, is the one users run; a method not called reports n/a);
- replica forward: the union of the intervals during which at least one replica was inside the module's forward
  (a forward pre-hook and a forward hook on the master module, which every replica shares); what else
  ``parallel_apply`` spends (thread hand-off, joins) is reported as "apply other";
- replica backward: the wall time of ``loss.backward()`` minus the time spent in gradient-reduction calls, so it
  also holds the backward of the wrapper's own nodes (the gather's scatter of the output gradient, autograd
  scheduling across devices);
- reduction: time inside ``torch.nn.parallel.comm.reduce_add_coalesced`` (upstream) or, for fastdp, the
  backward thread's time in each bucket's reduction (``fastdp._reduction.reducer.start``, which starts it, and
  ``fastdp._reduction.reducer.deliver``, which waits for it; ``fastdp._replicas.reduce_bucket`` in trees from before the
  reduction ran while backward goes on) and in ``fastdp.comm.reduce_add_coalesced``, outermost calls only, looked up as
  module attributes at call time; a reduction that overlaps the replicas' backward (on a GPU, or on the host reducer
  thread) is counted at its host (launch) cost and the wait for it, unless ``--split`` serialises it;
- overhead: step time minus replica forward and backward minus loss and optimizer (the same work as the bare
  model's), all from the instrumented pass.
On a GPU these are host-side times unless ``--split`` synchronises the devices around every timed region, which
perturbs the steady state (it removes overlap); steps/s never come from the synchronised pass.
"""

import contextlib
import importlib
import statistics
import threading
import time

import torch
from torch import nn

import fastdp


COLUMNS = [
    "model", "config", "wrapper", "device_ids", "replicas", "batch", "steps_per_s", "samples_per_s",
    "ratio_to_bare", "step_ms", "scatter_ms", "replicate_ms", "replica_fwd_ms", "apply_other_ms", "gather_ms",
    "replica_bwd_ms", "reduction_ms", "loss_optim_ms", "other_ms", "replica_compute_ms", "overhead_ms",
    "split_step_ms", "split_synced", "peak_mem", "rounds", "steps", "error",
]


# What a time is measured with: elapsed time, or the CPU time of this process (every thread of it: the host reducer
# thread's sums too), which another process's load on a shared machine leaves alone. Host work only, on a GPU.
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


class Split:
    """Phase times of one instrumented run: seconds summed per phase, forward intervals, call counts; `clock`: what
    they are measured with (one of CLOCKS)."""

    def __init__(self, sync, clock=time.perf_counter):
        self.sync = sync
        self.clock = clock
        self.lock = threading.Lock()
        self.local = threading.local()
        self.reset()

    def reset(self):
        self.phases = {}
        self.calls = {}
        self.intervals = []
        self.fwd_open = {}

    def timed(self, phase, fn, *args, **kwargs):
        active = getattr(self.local, "active", None)
        if active is None:
            active = self.local.active = set()
        if phase in active:  # Nested call of the same phase (e.g. reduce_bucket calling comm): count once.
            return fn(*args, **kwargs)
        active.add(phase)
        try:
            if self.sync:
                self.sync()
            t0 = self.clock()
            out = fn(*args, **kwargs)
            if self.sync:
                self.sync()
            dt = self.clock() - t0
        finally:
            active.discard(phase)
        with self.lock:
            self.phases[phase] = self.phases.get(phase, 0.0) + dt
            self.calls[phase] = self.calls.get(phase, 0) + 1
        return out

    # Forward hooks on the master module; replicas share the hook dicts, so these run in every replica's thread.

    def pre_hook(self, module, args):
        self.fwd_open[threading.get_ident()] = self.clock()

    def post_hook(self, module, args, output):
        if self.sync:
            self.sync()
        t1 = self.clock()
        t0 = self.fwd_open.pop(threading.get_ident(), None)
        if t0 is not None:
            with self.lock:
                self.intervals.append((t0, t1))

    def forward_union(self):
        total, end = 0.0, None
        for t0, t1 in sorted(self.intervals):
            if end is None or t0 > end:
                total += t1 - t0
                end = t1
            elif t1 > end:
                total += t1 - end
                end = t1
        return total


class _Probe:
    """The split being recorded, or None; read by the timed wrapper subclasses."""

    split = None


_PHASES = ("scatter", "replicate", "parallel_apply", "gather")


def timed(model):
    """`model` with its overridable methods reporting their time to ``_Probe.split``.

    The timed methods are set on the instance, not in a subclass: the class stays the one users run. On one device
    fastdp's ``scatter`` is left as it is: its short path (the module on the inputs as they are) is taken only while
    no override of it is set, as upstream would call one. A method the wrapper does not call (no scatter on that
    short path) reports nothing.
    """
    one_device = isinstance(model, fastdp.DataParallel) and len(model.device_ids) == 1
    for phase in _PHASES:
        if phase == "scatter" and one_device:
            continue
        bound = getattr(type(model), phase).__get__(model)

        def timed(*args, _phase=phase, _bound=bound, **kwargs):
            return _call(_phase, _bound, args, kwargs)

        model.__dict__[phase] = timed
    return model


def _call(phase, fn, args, kwargs):
    split = _Probe.split
    if split is None:
        return fn(*args, **kwargs)
    return split.timed(phase, fn, *args, **kwargs)


def _reduction_targets(wrapper):
    """(module, attribute) pairs whose calls are the gradient reduction of ``wrapper``'s kind."""
    if wrapper == "upstream":
        return [(torch.nn.parallel.comm, "reduce_add_coalesced")]
    if wrapper == "fastdp":
        targets = []
        # This tree's reducer, then where trees before it kept the same calls (compared against this one).
        for module_name, names in (("fastdp._reduction.reducer", ("start", "deliver")),
                                   ("fastdp._reducer", ("start", "deliver")), ("fastdp._replicas", ("reduce_bucket",))):
            try:
                mod = importlib.import_module(module_name)
            except ImportError:
                continue
            targets += [(mod, name) for name in names if getattr(mod, name, None) is not None]
        targets.append((fastdp.comm, "reduce_add_coalesced"))
        return targets
    return []


@contextlib.contextmanager
def instrumented(split, module, wrapper):
    """Installs the reduction wrappers and forward hooks for one instrumented run, and removes them after."""
    saved = []
    handles = [module.register_forward_pre_hook(split.pre_hook), module.register_forward_hook(split.post_hook)]
    try:
        for mod, name in _reduction_targets(wrapper):
            original = getattr(mod, name)

            def timed_reduction(*args, _original=original, **kwargs):
                return split.timed("reduction", _original, *args, **kwargs)

            setattr(mod, name, timed_reduction)
            saved.append((mod, name, original))
        _Probe.split = split
        yield
    finally:
        _Probe.split = None
        for mod, name, original in reversed(saved):
            setattr(mod, name, original)
        for h in handles:
            h.remove()


def synchronize_all(devices):
    """Waits for every one of the CUDA ``devices``: a timing of work spread over several GPUs ends only when the
    last of them is done (torch.cuda.synchronize() alone waits for the current device)."""
    devices = sorted(set(devices))
    return lambda: [torch.cuda.synchronize(d) for d in devices]


def reset_peaks(devices):
    for d in sorted(set(devices)):
        torch.cuda.reset_peak_memory_stats(d)


def device_sync(kind, configs):
    if kind != "cuda":
        return None
    return synchronize_all({d for c in configs if c.device_ids for d in c.device_ids} | {0})


def train_step(model, x, y, opt):
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()


def timed_step(model, x, y, opt, split, loss=nn.functional.cross_entropy):
    t0 = split.clock()
    split.timed("optimizer", opt.zero_grad, set_to_none=True)
    out = split.timed("forward", model, x)
    loss = split.timed("loss", loss, out, y)
    split.timed("backward", loss.backward)
    split.timed("optimizer", opt.step)
    if split.sync:
        split.sync()
    return split.clock() - t0


def peak_reset(kind, config):
    if kind == "cuda":
        reset_peaks(config.device_ids or [0])
    else:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # Resets the process's RSS high-water mark (Linux).
        except OSError:
            pass


def peak_read(kind, config):
    """Peak memory in MiB: per device on a GPU, the process's RSS high-water mark on the CPU, or None."""
    if kind == "cuda":
        return {f"cuda:{d}": torch.cuda.max_memory_allocated(d) / 2**20 for d in sorted(set(config.device_ids or [0]))}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return {"host RSS": int(line.split()[1]) / 1024}
    except OSError:
        pass
    return None


def summarise(phase_rounds, step_rounds):
    """Median over rounds of each phase's per-step mean (ms), with the derived replica compute and overhead."""
    med = {k: 1e3 * statistics.median(v) for k, v in phase_rounds.items()}
    g = med.get
    fwd = g("replica_fwd", 0.0)
    applied = "parallel_apply" in med
    apply_other = max(0.0, g("parallel_apply", 0.0) - fwd) if applied else 0.0
    reduction = g("reduction")
    bwd = g("backward", 0.0) - (reduction or 0.0)
    loss_optim = g("loss", 0.0) + g("optimizer", 0.0)
    step = 1e3 * statistics.median(step_rounds)
    inside_forward = g("scatter", 0.0) + g("replicate", 0.0) + g("gather", 0.0) + (
        g("parallel_apply", 0.0) if applied else fwd)
    other = max(0.0, step - loss_optim - g("backward", 0.0) - inside_forward)
    return {
        "scatter_ms": g("scatter"), "replicate_ms": g("replicate"), "replica_fwd_ms": fwd,
        "apply_other_ms": apply_other if applied else None, "gather_ms": g("gather"), "replica_bwd_ms": bwd,
        "reduction_ms": reduction, "loss_optim_ms": loss_optim, "other_ms": other,
        "replica_compute_ms": fwd + bwd, "overhead_ms": max(0.0, step - fwd - bwd - loss_optim),
        "split_step_ms": step,
    }
