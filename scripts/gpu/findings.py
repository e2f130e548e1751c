"""Three questions about the gradient reduction on CUDA devices that only a GPU can answer, each measured against a
reference run in the same process (scripts/gpu_check.sh's memory-across-step, lockstep and report-exposed steps):

  python findings.py memory     # device 0's memory across optimizer.step(): bare model, upstream, fastdp
  python findings.py lockstep   # replica 0's backward with no, one and every other replica slowed
  python findings.py exposed    # dp.report()'s exposed reduction against a timing taken with synchronize()

memory: the reduction's memory goes back to the caching allocator stream-ordered (each gradient it reads recorded as
used by its device's reduction stream), so nothing of it should outlive backward: device 0 should hold what
upstream holds when the optimizer allocates its state, although the host runs ahead of the GPU. Prints device 0's
allocated bytes after backward, the peak across ``optimizer.step()`` (Adam, whose first step allocates its state)
and the bytes after it, for the bare model, ``torch.nn.DataParallel`` and ``fastdp.DataParallel`` with
``device_ids=[0] * replicas``, fastdp once more with the devices synchronised before the step (``Reducer.settle``),
and the bytes only the reduction holds (a host ledger, on trees that still have one).

lockstep: autograd makes a node's canonical stream wait for every replica's gradients of the bucket (from torch 2.8
on across devices; on one device always). The bucket node is made with the reduction's own stream current, so the
waits should land there; were it replica 0's compute stream, replica 0's later kernels would queue behind the slowest
replica at each bucket. Each slowed replica sleeps on its own
stream (``torch.cuda._sleep``, no compute taken) before the backward of a layer of its own: if the waits add up (a
sum of per-bucket maxima) replica 0's backward grows with the number of slowed replicas; if not, with the slowest
one alone (one maximum). With one GPU the replicas after the first run their forward (and so their backward) on
side streams of their own, standing in for devices of their own; with two GPUs or more each replica runs on a device
of its own (as many replicas as GPUs, up to ``--replicas``).

exposed: the report's tail (how far the last bucket's reduction ends past the replicas' backward, from its CUDA
events) over steps run as training runs them (device 0 alone runs the optimizer and starts each step behind the host,
``--lag-ms``; nothing waits for a device within a step), next to steps timed with ``torch.cuda.synchronize()``:
fastdp's backward until every reduction is done, less a backward that leaves no reduction behind (the bare model over
the same chunks; over one chunk where each replica has a GPU of its own). memory and exposed give each replica a GPU
of its own where there are enough (device_ids=[0] * replicas on one).

``--device cpu`` runs the same code on emulated replicas (``device_ids=["cpu"] * replicas``: the host reducer, host
clocks, no allocator figures), a check of this script rather than a measurement. Each prints its table and writes
``findings-<name>.csv`` in ``--out``; exit status 2 without a CUDA device, 1 when a fastdp run failed.
"""

import argparse
import contextlib
import copy
import csv
import gc
import os
import statistics
import sys
import time

import torch
import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import fastdp  # noqa: E402
from fastdp._reduction.cuda import stream_rule  # noqa: E402
from fastdp.bench.phases import synchronize_all  # noqa: E402
from fastdp.bench.report import cell  # noqa: E402
from overlap import model as mlp, spans  # noqa: E402

MB = 2**20

# Per finding and device: sizes that make the effect show on a GPU (gradients of tens of MB; a sleep far above a
# layer's compute; buckets whose sums take measurable time), and small ones for the host's check of the script.
DEFAULTS = {
    "memory": {"cuda": dict(replicas=2, width=2048, layers=4, batch=64, steps=3),
               "cpu": dict(replicas=2, width=64, layers=2, batch=16, steps=2)},
    "lockstep": {"cuda": dict(replicas=5, width=512, layers=8, batch=320, steps=5, delay_ms=2.0),
                 "cpu": dict(replicas=5, width=32, layers=8, batch=20, steps=2, delay_ms=1.0)},
    "exposed": {"cuda": dict(replicas=4, width=2048, layers=8, batch=512, steps=8, lag_ms=20.0),
                "cpu": dict(replicas=2, width=64, layers=4, batch=16, steps=3, lag_ms=0.0)},
}
WARMUP = 2  # steps before any timing: the kept replicas are built, the allocator and the kernels warmed


class Where:
    """Where a measurement runs: one GPU listed ``replicas`` times, one GPU per replica (``distinct``, when there
    are at least two), or emulated replicas on the host."""

    def __init__(self, device, replicas, distinct=False):
        self.cuda = device == "cuda"
        self.device = torch.device("cuda", 0) if self.cuda else torch.device("cpu")
        count = torch.cuda.device_count() if self.cuda else 0
        self.distinct = distinct and count >= 2
        if self.distinct:
            self.ids = list(range(min(replicas, count)))
        else:
            self.ids = [0] * replicas if self.cuda else ["cpu"] * replicas
        self._sync = synchronize_all(self.ids) if self.cuda else None

    def sync(self):
        if self._sync is not None:
            self._sync()

    def describe(self):
        if not self.cuda:
            return f"{len(self.ids)} emulated replicas (a check of the script: host clocks, no allocator figures)"
        name = torch.cuda.get_device_name(0)
        if self.distinct:
            return f"{len(self.ids)} GPUs ({name}...), device_ids={self.ids}"
        return f"one {name}, device_ids=[0] * {len(self.ids)}"

    # device 0's allocator (None on the host)

    def allocated(self):
        return torch.cuda.memory_allocated(0) if self.cuda else None

    def peak(self):
        return torch.cuda.max_memory_allocated(0) if self.cuda else None

    def reset_peak(self):
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(0)


def table(name, columns, rows, out):
    """Prints `rows` (dicts) under `columns` ((key, heading, format) triples; a row's "note" follows them) and
    writes every column to <out>/findings-<name>.csv."""
    cells = [[cell(row.get(key), fmt) for key, _, fmt in columns] for row in rows]
    widths = [max([len(heading)] + [len(c[i]) for c in cells]) + 2 for i, (_, heading, _) in enumerate(columns)]
    print("".join(f"{heading:>{w}}" for (_, heading, _), w in zip(columns, widths)) + "  note")
    for row, line in zip(rows, cells):
        print(("".join(f"{c:>{w}}" for c, w in zip(line, widths)) + f"  {row.get('note', '')}").rstrip())
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"findings-{name}.csv")
    keys = [key for key, _, _ in columns] + ["note"]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore", restval="")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _csv_value(row.get(k)) for k in keys})
    print(f"wrote {path}")
    return path


def _csv_value(v):
    if v is None:
        return ""
    return round(v, 4) if isinstance(v, float) else v


def _mb(nbytes):
    return None if nbytes is None else nbytes / MB


def layer_mb(width):
    """The MB of one Linear(width, width)'s parameters in float32: the bucket cap that gives each layer its own."""
    return (width * width + width) * 4 / MB


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def timed_backward(loss_fn, module, where):
    """loss.backward()'s time (ms) with the devices synchronised before and after: until every reduction is done."""
    module.zero_grad(set_to_none=True)
    loss = loss_fn()
    where.sync()
    t0 = time.perf_counter()
    loss.backward()
    where.sync()
    return (time.perf_counter() - t0) * 1e3


# ---- memory: device 0 across optimizer.step() ------------------------------------------------------------------


def _storages(obj, seen):
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            _storages(item, seen)


def ledger_bytes(wrapped):
    """The bytes only fastdp's reduction keeps alive for its streams: the storages its ledger holds, each once, less
    those the master's gradients use (a bucket's sum is its members' .grad); None for other wrappers."""
    replica_set = getattr(wrapped, "_replica_set", None)
    if replica_set is None:
        return None
    seen = {}
    ledger = getattr(replica_set.reducer, "ledger", None)  # gone where the reduction frees stream-ordered
    for held in ledger.held() if ledger is not None else ():
        _storages(held, seen)
    module = getattr(wrapped, "module", None)
    for p in module.parameters() if module is not None else ():
        if p.grad is not None:
            seen.pop(p.grad.untyped_storage().data_ptr(), None)
    return sum(seen.values())


def kept_bytes(wrapped):
    """The bytes fastdp keeps between steps for its replicas (their parameter buffers and staging, every
    position: with repeated ids all on device 0); None for other wrappers."""
    replica_set = getattr(wrapped, "_replica_set", None)
    if replica_set is None:
        return None
    return sum(buffers + staging for buffers, staging, _ in replica_set.held_bytes().values())


def _memory_configs(where):
    """(name, wrap(module), sweep before the step) per configuration; upstream only on CUDA."""
    n = len(where.ids)
    ids = str(where.ids) if where.distinct else f"[0] * {n}" if where.cuda else f'["cpu"] * {n}'
    yield "bare", (lambda m: m), False
    if where.cuda:
        yield f"upstream {ids}", (lambda m: nn.DataParallel(m, device_ids=where.ids)), False
    yield f"fastdp {ids}", (lambda m: fastdp.DataParallel(m, device_ids=where.ids)), False
    yield "fastdp, swept", (lambda m: fastdp.DataParallel(m, device_ids=where.ids)), True


def _memory_steps(name, wrap, sweep, args, where):
    """One configuration's steps from a fresh model (the same one for every configuration): a row per step."""
    gc.collect()
    if where.cuda:
        torch.cuda.empty_cache()
    torch.manual_seed(0)
    module = mlp(args.width, args.layers).to(where.device)
    x = torch.randn(args.batch, args.width, device=where.device)
    start = where.allocated()
    wrapped = wrap(module)
    opt = torch.optim.Adam(module.parameters(), lr=1e-4)
    rows = []
    for step in range(1, args.steps + 1):
        opt.zero_grad(set_to_none=True)
        loss = wrapped(x).pow(2).mean()
        where.reset_peak()
        loss.backward()  # no synchronisation: the host runs ahead of the GPU, as in a training loop
        row = dict(config=name, step=step, start_mb=_mb(start), after_backward_mb=_mb(where.allocated()),
                   backward_peak_mb=_mb(where.peak()), held_after_backward_mb=_mb(ledger_bytes(wrapped)))
        if sweep:  # what the held memory would be with the reduction waited for and released before the step
            where.sync()
            wrapped._replica_set.reducer.settle()
        where.reset_peak()
        opt.step()
        row.update(step_peak_mb=_mb(where.peak()), after_step_mb=_mb(where.allocated()),
                   held_after_step_mb=_mb(ledger_bytes(wrapped)), kept_mb=_mb(kept_bytes(wrapped)))
        rows.append(row)
    where.sync()
    return rows


MEMORY_COLUMNS = [("config", "config", "{}"), ("step", "step", "{}"), ("start_mb", "model MB", "{:.1f}"),
                  ("after_backward_mb", "after bwd", "{:.1f}"), ("backward_peak_mb", "bwd peak", "{:.1f}"),
                  ("held_after_backward_mb", "held bwd", "{:.1f}"), ("step_peak_mb", "step peak", "{:.1f}"),
                  ("after_step_mb", "after step", "{:.1f}"), ("held_after_step_mb", "held step", "{:.1f}"),
                  ("kept_mb", "kept", "{:.1f}")]


def run_memory(args):
    where = Where(args.device, args.replicas, distinct=True)
    print(f"memory across optimizer.step() (Adam): {where.describe()}; {args.layers} x Linear({args.width}, "
          f"{args.width}) ({args.layers * layer_mb(args.width):.1f} MB of gradients per replica), batch {args.batch}, "
          f"{args.steps} steps (step 1 allocates Adam's state); torch {torch.__version__}")
    print("MB on device 0: model = allocated before the first forward (model and batch); after bwd / after step = "
          "allocated then; bwd peak, step peak = the high since the counter was reset just before backward, just "
          "before optimizer.step(); held = what only fastdp's reduction still holds for its streams (a host ledger on "
          "trees that have one, less the .grad storages; none where memory is freed stream-ordered); "
          "kept = the replicas' parameter buffers fastdp keeps between steps (upstream copies them each step). "
          "'fastdp, swept' synchronises the devices (Reducer.settle) before the step.")
    rows, failed = [], False
    for name, wrap, sweep in _memory_configs(where):
        try:
            rows += _memory_steps(name, wrap, sweep, args, where)
        except Exception as e:  # reported in the table; the other configurations still run
            rows.append(dict(config=name, note=f"failed: {type(e).__name__}: {str(e)[:160]}"))
            failed |= name.startswith("fastdp")
            if name.startswith("upstream"):
                print(f"upstream cannot run with device_ids={where.ids}: compare fastdp with the bare model")
    if not where.cuda:
        print("upstream: not run (torch.nn.DataParallel has no CPU replicas)")
    table("memory", MEMORY_COLUMNS, rows, args.out)
    _memory_verdict(rows)
    return 1 if failed else 0


def _memory_verdict(rows):
    """Device 0's peak across each optimizer.step(), per configuration, and how far each is above upstream's."""
    peaks = {}
    for row in rows:
        if row.get("step_peak_mb") is not None:
            peaks.setdefault(row["config"], []).append(row["step_peak_mb"])
    upstream = next((v for k, v in peaks.items() if k.startswith("upstream")), None)
    for name, values in peaks.items():
        text = ", ".join(f"{v:.1f}" for v in values)
        if upstream is not None and len(upstream) == len(values):
            text += " (against upstream: " + ", ".join(f"{v - u:+.1f}" for v, u in zip(values, upstream)) + ")"
        print(f"device 0's peak MB across optimizer.step(), per step: {name}: {text}")


# ---- lockstep: replica 0's backward against slowed replicas ------------------------------------------------------


class _Plan:
    """What the lockstep model reads while it runs: each replica module's position (noted by the wrapper's
    parallel_apply), the layer each slowed replica sleeps before, the side stream of each replica after the first
    (one GPU), the delay itself, and the marks each replica's backward leaves (events, or host clock readings)."""

    def __init__(self):
        self.index, self.slow, self.side, self.marks = {}, {}, {}, {}
        self.cuda = False
        self.delay = None

    def stamp(self):
        if not self.cuda:
            return time.perf_counter_ns()
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # on the current stream: the node's, which autograd makes current while it runs
        return event

    def elapsed_ms(self, replica):
        start, end = self.marks.get((replica, "start")), self.marks.get((replica, "end"))
        if start is None or end is None:
            return None
        return start.elapsed_time(end) if self.cuda else (end - start) / 1e6


PLAN = _Plan()


class _Mark(torch.autograd.Function):
    """Identity; its backward notes when the gradient passes (the replica's backward starts at its output and
    ends at its input)."""

    @staticmethod
    def forward(ctx, x, key):
        ctx.key = key
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        PLAN.marks[ctx.key] = PLAN.stamp()
        return grad, None


class _Slow(torch.autograd.Function):
    """Identity; its backward delays the rest of this replica's backward on its own stream."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        PLAN.delay()
        return grad


class Lockstep(nn.Module):
    """``layers`` x (Linear, Tanh), looked up by replica: marked at both ends, slowed where the plan says, and run
    on the replica's side stream when it has one."""

    def __init__(self, width, layers):
        super().__init__()
        self.body = mlp(width, layers)

    def forward(self, x):
        r = PLAN.index.get(id(self), 0)
        side = PLAN.side.get(r)
        caller = torch.cuda.current_stream() if side is not None else None
        if side is not None:
            side.wait_stream(caller)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            h = _Mark.apply(x, (r, "end"))
            for i, layer in enumerate(self.body):
                h = layer(h)
                if PLAN.slow.get(r) == i:
                    h = _Slow.apply(h)
            h = _Mark.apply(h, (r, "start"))
        if side is not None:
            caller.wait_stream(side)
            h.record_stream(caller)
        return h


class _Noting(fastdp.DataParallel):
    """fastdp.DataParallel that notes which replica module runs at which position, for the model to find itself."""

    def parallel_apply(self, replicas, inputs, kwargs):
        PLAN.index = {id(m): r for r, m in enumerate(replicas)}
        return super().parallel_apply(replicas, inputs, kwargs)


def slowed_layers(busy, most, layers):
    """Per slowed replica (1..busy), the Linear it sleeps before in backward (its index in the Sequential of
    Linear/Tanh pairs): a different layer each, spread over the model from the top, the same for a replica
    whatever the count."""
    spacing = max(1, layers // max(1, most))
    return {k: 2 * (layers - 1 - (k - 1) * spacing) for k in range(1, busy + 1)}


def _calibrate_delay(delay_ms, where):
    """The delay as a callable: torch.cuda._sleep for about `delay_ms` on the current stream (its cycles per ms
    measured with events), or a host sleep; and the ms one takes."""
    if not where.cuda:
        return (lambda: time.sleep(delay_ms / 1e3)), delay_ms
    probe = 10**6
    cycles = max(1, int(probe * delay_ms / statistics.median(_sleep_ms(probe) for _ in range(3))))
    return (lambda: torch.cuda._sleep(cycles)), _sleep_ms(cycles)


def _sleep_ms(cycles):
    """How long torch.cuda._sleep(cycles) keeps the current stream busy, from events around it."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _lockstep_row(dp, x, busy, args, where):
    """Medians over the steps with `busy` replicas slowed: replica 0's backward, the slowest other's, the whole
    backward (host clock around it, the devices synchronised)."""
    n = len(where.ids)
    PLAN.slow = slowed_layers(busy, n - 1, args.layers)
    got = []
    for i in range(WARMUP + args.steps):
        PLAN.marks = {}
        whole = timed_backward(lambda: dp(x).pow(2).mean(), dp.module, where)
        if i >= WARMUP:
            others = [PLAN.elapsed_ms(r) for r in range(1, n)]
            got.append((PLAN.elapsed_ms(0), max((o for o in others if o is not None), default=None), whole))
    r0, other, whole = (_median(column) for column in zip(*got))
    return dict(busy=busy, layers=",".join(str(i // 2) for i in PLAN.slow.values()) or "-", replica0_ms=r0,
                slowest_other_ms=other, backward_ms=whole)


LOCKSTEP_COLUMNS = [("busy", "slowed", "{}"), ("layers", "at layers", "{}"), ("replica0_ms", "replica 0", "{:.3f}"),
                    ("slowest_other_ms", "slowest other", "{:.3f}"), ("backward_ms", "backward", "{:.3f}"),
                    ("one_maximum_ms", "if one max", "{:.3f}"), ("sum_of_maxima_ms", "if sum", "{:.3f}")]


def run_lockstep(args):
    where = Where(args.device, args.replicas, distinct=True)
    n = len(where.ids)
    if args.layers < n - 1:
        print(f"--layers {args.layers}: each of the {n - 1} slowed replicas needs a layer of its own")
        return 2
    PLAN.cuda = where.cuda
    PLAN.delay, delay_ms = _calibrate_delay(args.delay_ms, where)
    PLAN.side = ({r: torch.cuda.Stream(device=0) for r in range(1, n)} if where.cuda and not where.distinct
                 else {})
    torch.manual_seed(0)
    dp = _Noting(Lockstep(args.width, args.layers).to(where.device), device_ids=where.ids,
                 bucket_cap_mb=layer_mb(args.width))
    x = torch.randn(args.batch, args.width, device=where.device, requires_grad=True)
    _lockstep_intro(args, where, delay_ms)
    rows = [_lockstep_row(dp, x, busy, args, where) for busy in sorted({0, 1, n - 1})]
    base = rows[0]["replica0_ms"]
    for row in rows:
        if base is not None:
            row["one_maximum_ms"] = base + (delay_ms if row["busy"] else 0)
            row["sum_of_maxima_ms"] = base + row["busy"] * delay_ms
    table("lockstep", LOCKSTEP_COLUMNS, rows, args.out)
    _lockstep_verdict(rows)
    return 0


def _lockstep_intro(args, where, delay_ms):
    n = len(where.ids)
    print(f"replica 0's backward in lock-step: {where.describe()}; {args.layers} x Linear({args.width}, "
          f"{args.width}), one bucket per layer, batch {args.batch}, median of {args.steps} steps; torch "
          f"{torch.__version__} (cross-device stream rule: {stream_rule(torch.__version__)}); a slowed replica "
          f"sleeps {delay_ms:.2f} ms on its own stream before one layer's backward, a different layer each")
    if where.cuda and not where.distinct:
        print(f"one GPU: replicas 1-{n - 1} run on side streams of their own (replica 0 on the caller's stream, "
              "where the bucket nodes run), standing in for GPUs of their own; on one device autograd makes the "
              "node's stream wait for theirs under every torch version, as torch 2.8 and newer do across devices. "
              "The sleeps take no compute, so the streams overlap as separate GPUs would; every replica's backward "
              "is launched from autograd's one thread for the device (on separate GPUs, one thread each).")
    print("ms: replica 0 / slowest other = from the gradient reaching a replica's output to its input's gradient "
          "(events on its stream); backward = loss.backward() with the devices synchronised around it; "
          "if one max / if sum = replica 0's backward with none slowed, plus one delay / plus one per slowed replica")


def _lockstep_verdict(rows):
    one, most = rows[1] if len(rows) > 1 else None, rows[-1]
    if one is None or most is one or not one.get("replica0_ms") or most.get("replica0_ms") is None:
        return
    measured = most["replica0_ms"] / one["replica0_ms"]
    summed = most["sum_of_maxima_ms"] / one["sum_of_maxima_ms"]
    print(f"replica 0's backward with {most['busy']} slowed replicas over 1: {measured:.2f} (one maximum predicts "
          f"1.00, a sum of per-bucket maxima {summed:.2f})")


# ---- exposed: the report's reduction tail against synchronize() -------------------------------------------------


def _report_tails(report):
    """Per recorded step: (how far the last bucket's reduction ends past the last replica's backward, the
    buckets' summed reduction time), in ms, from the report's ranges."""
    out = []
    for backward_end, buckets in spans(report):
        if buckets:
            out.append((max(0.0, max(e for _, _, e, _ in buckets) - backward_end),
                        sum(e - s for _, s, e, _ in buckets)))
        else:
            out.append((None, None))
    return out


EXPOSED_COLUMNS = [("step", "step", "{}"), ("report_exposed_ms", "report tail", "{:.3f}"),
                   ("report_reduce_ms", "report reduce", "{:.3f}"), ("fastdp_backward_ms", "fastdp bwd", "{:.3f}"),
                   ("reference_backward_ms", "ref bwd", "{:.3f}"), ("direct_tail_ms", "synced tail", "{:.3f}"),
                   ("difference_ms", "report - synced", "{:.3f}")]


class _Training:
    """Steps as a training loop runs them, with the report on: forward, backward, ``optimizer.step()`` (on device 0
    alone, as DataParallel's master) and then `lag_ms` more of device 0's time (a heavier optimizer, a metric), and
    nothing that waits for a device within a step. The host waits only for the previous step's backward to have
    ended on device 0 (as a loop that logs the last loss does), so that each step starts with device 0 that far
    behind the host and the other devices not: the case where an event's enqueue time is not when it ran."""

    def __init__(self, dp, module, x, where, lag_ms):
        self.dp, self.module, self.x, self.where = dp, module, x, where
        self.opt = torch.optim.SGD(module.parameters(), lr=1e-9)
        self.lag, self.lag_ms = (_calibrate_delay(lag_ms, where) if where.cuda and lag_ms else (None, 0.0))
        self.ended = None

    def step(self):
        if self.ended is not None:
            self.ended.synchronize()
        self.module.zero_grad(set_to_none=True)
        self.dp(self.x).pow(2).mean().backward()
        if self.where.cuda:
            self.ended = torch.cuda.Event()
            self.ended.record()
        self.opt.step()
        if self.lag is not None:
            self.lag()


def _reference(module, x, where):
    """The backward that leaves no reduction behind, for the synchronised timing: the bare model over the same chunks,
    one after another as replicas on one device run (device_ids=[0] * n), or over one chunk where each replica has a
    device of its own and they run side by side."""
    bare = copy.deepcopy(module)
    chunks = x.chunk(len(where.ids))  # the wrapper's split: torch.chunk's
    if where.distinct:
        return bare, lambda: bare(chunks[0]).pow(2).mean()
    return bare, lambda: torch.cat([bare(c) for c in chunks]).pow(2).mean()


def run_exposed(args):
    where = Where(args.device, args.replicas, distinct=True)
    torch.manual_seed(0)
    module = mlp(args.width, args.layers).to(where.device)
    dp = fastdp.DataParallel(module, device_ids=where.ids, bucket_cap_mb=layer_mb(args.width))
    x = torch.randn(args.batch, args.width, device=where.device)
    bare, theirs = _reference(module, x, where)
    training = _Training(dp, module, x, where, args.lag_ms)

    def ours():
        return dp(x).pow(2).mean()

    for _ in range(WARMUP):
        training.step()
        timed_backward(ours, module, where)
        timed_backward(theirs, bare, where)
    where.sync()
    dp.enable_report(steps=args.steps)
    for _ in range(args.steps):  # the report's steps: as in training, nothing waits for a device
        training.step()
    report = dp.report()
    dp.disable_report()
    timed = []
    for step in range(args.steps):  # the reference: alternated, so that neither side always runs first
        pair = [(ours, module), (theirs, bare)] if step % 2 == 0 else [(theirs, bare), (ours, module)]
        got = {fn: timed_backward(fn, m, where) for fn, m in pair}
        timed.append((got[ours], got[theirs]))
    _exposed_intro(args, where, training.lag_ms)
    rows = _exposed_rows(_report_tails(report)[-len(timed):], timed)
    table("exposed", EXPOSED_COLUMNS, rows, args.out)
    r0 = report.replicas[0]
    phases = {p.phase: p.ms for p in report.phases}
    print(f"dp.report() over the training steps: wait: reduce {cell(r0.wait_reduce_ms, '{:.3f}')} ms, reduce (summed "
          f"over buckets) {cell(phases.get('reduce'), '{:.3f}')} ms, backward {cell(phases.get('backward'), '{:.3f}')}"
          f" ms, step {cell(report.step_ms, '{:.3f}')} ms; advice: {[a.rule for a in report.advice] or 'none'}")
    median = rows[-1]
    if median.get("difference_ms") is not None:
        print(f"the report's exposed reduction against synchronize(): {median['report_exposed_ms']:.3f} ms against "
              f"{median['direct_tail_ms']:.3f} ms (medians; report - synced {median['difference_ms']:+.3f} ms)")
    return 0


def _exposed_rows(tails, timed):
    rows = []
    reference = _median([b for _, b in timed])
    for step, ((tail, reduce), (f, b)) in enumerate(zip(tails, timed), start=1):
        direct = f - reference
        rows.append(dict(step=step, report_exposed_ms=tail, report_reduce_ms=reduce, fastdp_backward_ms=f,
                         reference_backward_ms=b, direct_tail_ms=direct,
                         difference_ms=None if tail is None else tail - direct))
    medians = {k: _median([r[k] for r in rows]) for k, _, _ in EXPOSED_COLUMNS[1:]}
    rows.append(dict(step="median", **medians))
    return rows


def _exposed_intro(args, where, lag_ms):
    print(f"the report's exposed reduction against synchronize(): {where.describe()}; {args.layers} x "
          f"Linear({args.width}, {args.width}), one bucket per layer, batch {args.batch}, {args.steps} steps; torch "
          f"{torch.__version__}")
    print(f"the report's steps run as a training loop: SGD on device 0 and {lag_ms:.1f} ms more of device 0's time "
          "after each, nothing waited for within a step, so each step starts with device 0 behind the host and the "
          "others not" + ("" if where.distinct or not where.cuda else
                          " (one GPU: every replica shares its clock, so only a GPU per replica can show a skew "
                          "between devices' clocks; here the check is that the two timings agree)"))
    print("ms: report tail = the last bucket's reduction end past the last replica's backward end, report reduce = "
          "the buckets' reductions summed (both from the report's ranges of that step); fastdp bwd / ref bwd = "
          "loss.backward() with the devices synchronised around it, in steps of their own after the report's (ref: "
          "the bare model over the same chunks one after another, or over one chunk with a GPU per replica); synced "
          "tail = fastdp bwd less the median ref bwd")


# ---- command line ------------------------------------------------------------------------------------------------


COMMANDS = {"memory": run_memory, "lockstep": run_lockstep, "exposed": run_exposed}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=sorted(COMMANDS))
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: emulated replicas (a check of this script, not a measurement)")
    for name in ("replicas", "width", "layers", "batch", "steps"):
        p.add_argument(f"--{name}", type=int, help="default: the finding's, per device (DEFAULTS)")
    p.add_argument("--delay-ms", type=float, help="lockstep: how long a slowed replica sleeps")
    p.add_argument("--lag-ms", type=float, help="exposed: how far behind the host device 0 starts each step")
    p.add_argument("--out", default=".", help="folder for findings-<name>.csv")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    for key, value in DEFAULTS[args.what][args.device].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return COMMANDS[args.what](args)


if __name__ == "__main__":
    sys.exit(main())
