"""``dp.report()``: what the last steps of a ``fastdp.DataParallel`` measured, per replica and per phase, with advice
derived from those numbers (docs/report.md).

The wrapper's recorder (fastdp._report.recorder) keeps the raw records; this module turns them into numbers (medians
over the steps kept), reads them out (a text table, HTML for notebooks, a dict, CSV, a Chrome/Perfetto trace, a PNG) and
derives the advice, each line naming the threshold it used.
"""

import collections
import csv
import html
import json
import statistics
from dataclasses import asdict, dataclass, field
from typing import List, Optional

from .._platform import devices as _devices
from .._balance import memory as _memory, split as _split
from . import recorder as _recorder, plot as _report_plot

__all__ = ["Report", "ReplicaStats", "PhaseStats", "Advice", "build", "THRESHOLDS"]

# The advice's thresholds (docs/report.md): each line of advice names the one it used.
THRESHOLDS = {
    "memory": 1.25,  # device 0's peak over the median of the other devices' peaks
    "wait": 0.15,  # the replicas' mean wait for each other, as a share of the step
    "gil": 0.30,  # the replicas' mean time off the CPU during their forward, as a share of the forward
    "reduce": 0.10,  # the reduction left after backward ended, as a share of the step
}

# The phases of the per-phase table, in the order a step runs them ("forward"/"backward": first start to last
# end over the replicas; "apply": the host's whole parallel_apply).
_PHASE_ORDER = ("scatter", "replicate", "forward", "apply", "gather", "backward", "reduce", "wait-reduce")


# ---- the numbers ---------------------------------------------------------------------------------------------


@dataclass
class ReplicaStats:
    """One device_ids position over the steps summarised (medians per step; times in ms, memory in bytes)."""

    position: int
    device: str
    rows: Optional[float]
    forward_ms: Optional[float]
    backward_ms: Optional[float]
    wait_others_ms: Optional[float]  # idle while the busiest replica still runs (from the medians)
    wait_reduce_ms: Optional[float]  # the reduction left after backward ended (the step's, on every replica)
    wait_gil_ms: Optional[float]  # on threads: from the replicas' hand-out to its forward's start, plus the time
    # off the CPU while its forward ran (the GIL, or a core, held by the other replicas' threads)
    peak_bytes: Optional[int]  # the allocator's high over a step (largest over the steps), None where n/a


@dataclass
class PhaseStats:
    """One phase: median time per step (ms) and bytes moved per step."""

    phase: str
    ms: Optional[float]
    bytes: Optional[int]


@dataclass
class Advice:
    """One line of advice: the rule that fired, its text, the measured value and the threshold it was held to."""

    rule: str
    text: str
    value: float
    threshold: float

    def __str__(self):
        return self.text


def _ms(ns):
    return ns / 1e6


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


class _StepNumbers:
    """One resolved step's per-position and per-phase numbers."""

    def __init__(self, r):
        self.r = r
        n = len(r.rows)
        self.forward = [None] * n
        self.backward = [None] * n
        self.gil = [None] * n
        self.span = max((end for _, _, _, end, _, _ in r.ranges), default=0)
        self.phases = {}
        for phase, replica, start, end, nbytes, extra in r.ranges:
            if replica is not None and phase in ("forward", "backward"):
                self._add_replica_time(phase, replica, end - start, extra)
            self._add_to_phase(phase, replica, start, end, nbytes)
        self.ran = [i for i in range(n) if r.rows[i] > 0 and self.forward[i] is not None]
        if not r.threads:
            self.gil = [0 if g is not None else None for g in self.gil]
        self.exposed_reduce = self._exposed_reduce()

    def _add_replica_time(self, phase, replica, duration, extra):
        """Sums one replica's forward or backward range into its time for the step."""
        row = self.forward if phase == "forward" else self.backward
        row[replica] = (row[replica] or 0) + duration
        if phase == "forward":  # on threads: waiting to start, then off the CPU while running
            self.gil[replica] = ((self.gil[replica] or 0) + extra.get("off_cpu_ns", 0)
                                 + extra.get("queued_ns", 0))

    def _add_to_phase(self, phase, replica, start, end, nbytes):
        """Widens the phase's [first start, last end] to the range and adds its bytes, its count and (for the
        host's own ranges, such as the buckets of a reduction) its duration."""
        acc = self.phases.setdefault(phase, [None, None, 0, 0, 0])
        if replica is None and phase not in ("forward", "backward"):
            acc[4] += end - start  # summed durations (buckets of a reduction)
        acc[0] = start if acc[0] is None else min(acc[0], start)
        acc[1] = end if acc[1] is None else max(acc[1], end)
        acc[2] += nbytes
        acc[3] += 1

    def _exposed_reduce(self):
        waits = self.phases.get("wait-reduce")
        if waits is not None:
            return waits[4]
        reduce = self.phases.get("reduce")
        backward = self.phases.get("backward")
        if reduce is None:
            return None
        if backward is None:
            return reduce[4]
        return max(0, reduce[1] - backward[1])

    def complete(self, last):
        """Whether the step is summarised: an evaluation step, a training step whose backward was seen, or one a
        later step followed (its backward ran before it, unmeasured when no submodule holds a trainable
        parameter)."""
        return not self.r.training or "backward" in self.phases or not last


Setup = collections.namedtuple("Setup", ["device_ids", "split", "criterion", "bucket_bytes"])
Setup.__doc__ = """What the report reads of a wrapper besides its records: its ``device_ids``, its split rule
(``split``, None for torch.chunk's), whether it has a ``criterion``, and its gradient buckets' size in bytes."""


def build(recorder, setup, memory, steps=None):
    """The Report of the recorded steps of `recorder` (the last ``steps`` of them, default all kept), for the wrapper
    described by `setup`; ``memory()`` gives its fastdp.MemoryReport."""
    rec = _report_recorder(recorder)
    _check_steps(steps)
    records = _last_records(rec, steps)
    anchored = _recorder.anchors({d for s in records for d in s.refs})
    resolved = [_recorder.resolve(s, anchored=anchored) for s in records]
    numbers = [_StepNumbers(r) for r in resolved]
    done = [x for i, x in enumerate(numbers) if x.complete(i == len(numbers) - 1)]
    training = [x for x in done if x.r.training]
    used = training or done
    devices = [_device_name(d) for d in setup.device_ids]
    step_ms = _median([_ms(x.span) for x in used])
    report = Report(
        steps=len(used), training=bool(training), devices=devices,
        step_ms=step_ms,
        period_ms=_period_ms(records, used),
        replicas=_replica_stats(used, devices),
        phases=_phase_stats(used),
        memory=memory(),
        ranges=resolved,
        t0s=[s.t0 for s in records],
        median_step=_nearest_the_median(used, step_ms),
    )
    report.notes += _notes(setup.device_ids, len(numbers) - len(done), used, bool(records))
    report.advice = advise(report, setup)
    return report


def _report_recorder(rec):
    """The recorder that ``report=`` (or ``enable_report()``) turned on; the small internal one that
    ``chunk_sizes="auto"`` runs while it measures is not a report's."""
    if rec is None or rec.internal:
        raise RuntimeError(
            "dp.report(): nothing was recorded; pass report=True to fastdp.DataParallel (or call "
            "dp.enable_report()) before the steps you want measured"
        )
    return rec


def _check_steps(steps):
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"dp.report(steps={steps!r}): expected a positive int (how many of the last steps)")


def _last_records(rec, steps):
    """The last ``steps`` recorded steps (all kept when None). A step's memory peaks are read when the next step
    starts; the last step's, not read yet, are read now so that it shows its memory too."""
    records = list(rec.steps)
    if steps is not None:
        records = records[-steps:]
    if records and rec.memory is not None and records[-1] is rec.open and rec.open.memory is None:
        rec.open.memory, rec.open.memory_exact = rec.memory.peek(), list(rec.memory.exact)
    return records


def _period_ms(records, used):
    """Median time from the start of each summarised step to the start of the step after it."""
    summarised = {x.r.index for x in used}
    return _median([_ms(b.t0 - a.t0) for a, b in zip(records, records[1:]) if a.index in summarised])


def _nearest_the_median(used, step_ms):
    """The index of the summarised step whose length is nearest the median (the later one of a tie): the step the
    picture draws, so that it shows a typical step rather than whichever came last."""
    if not used:
        return None
    return min(reversed(used), key=lambda x: abs(_ms(x.span) - step_ms)).r.index


def _notes(device_ids, unfinished, used, recorded):
    """What the reader should know about the numbers: what was not measured, and why."""
    notes = []
    if len(device_ids) == 1:
        notes.append("one device: the module runs directly, with nothing to balance; nothing is recorded")
    elif not recorded:
        notes.append("nothing recorded yet: no forward of this wrapper has run since recording was turned on "
                     "(report=True, dp.enable_report()); run training steps (forward and backward), then call "
                     "dp.report()")
    if unfinished:
        notes.append("the last training step is left out: its backward has not run yet (call dp.report() after "
                     "loss.backward() to include it)")
    if used and _devices.CPU in device_ids:
        notes.append(EMULATED_NOTE)
    elif used and not any(x.r.memory for x in used):
        notes.append("peak memory: n/a (a GPU listed more than once has one allocator for all its replicas)")
    return notes


# Emulated replicas run one after another, where GPUs run side by side: what the table's waits and the picture's
# timeline mean then.
EMULATED_NOTE = ("emulated 'cpu' replicas take turns in this process: each starts when the one before ends (as the "
                 "picture shows), and they share the host's memory (peak memory: n/a); 'wait: others' is the wait "
                 "each would have side by side, as GPUs run them")


def _device_name(d):
    return "cpu" if d == _devices.CPU else f"cuda:{d}"


def _replica_stats(used, devices):
    """Per position: medians over the steps. The wait for the others is taken from the medians (the busiest
    replica's median forward plus backward, less this one's): a persistent imbalance, where a step disturbed by
    the machine (another process, a garbage collection) would make every replica of that step look as if it
    waited."""
    out = [_position_stats(pos, device, used) for pos, device in enumerate(devices)]
    _set_wait_for_others(out)
    return out


def _position_stats(pos, device, used):
    """One position's medians over the steps it ran in (its wait for the others is set afterwards, from every
    position's medians)."""
    ran = [x for x in used if pos in x.ran]
    peaks = [x.r.memory[pos] for x in used if x.r.memory]
    return ReplicaStats(
        position=pos, device=device,
        rows=_median([x.r.rows[pos] for x in used]) if used else None,
        forward_ms=_median_ms(x.forward[pos] for x in ran),
        backward_ms=_median_ms(x.backward[pos] for x in ran),
        wait_others_ms=None,
        wait_reduce_ms=_median_ms(x.exposed_reduce for x in ran),
        wait_gil_ms=_median_ms(x.gil[pos] for x in ran),
        peak_bytes=max(peaks) if peaks else None,
    )


def _median_ms(durations_ns):
    """The median in ms of the durations measured (None: not measured in that step)."""
    return _median([_ms(ns) for ns in durations_ns if ns is not None])


def _busy_ms(replica):
    """A replica's median forward plus backward: the time the others wait for when it is the slowest."""
    return (replica.forward_ms or 0) + (replica.backward_ms or 0)


def _set_wait_for_others(out):
    """Each replica that ran waits for the busiest one: the difference of their busy times (none with a single
    replica running)."""
    busy = {r.position: _busy_ms(r) for r in out if r.forward_ms is not None}
    if len(busy) > 1:
        most = max(busy.values())
        for r in out:
            if r.position in busy:
                r.wait_others_ms = most - busy[r.position]


def _phase_stats(used):
    out = []
    for phase in _PHASE_ORDER:
        have = [x.phases[phase] for x in used if phase in x.phases]
        if not have:
            continue
        summed = phase in ("reduce", "wait-reduce")
        times = [_ms(a[4] if summed else a[1] - a[0]) for a in have]
        out.append(PhaseStats(phase, _median(times), int(_median([a[2] for a in have]))))
    return out


# ---- advice ----------------------------------------------------------------------------------------------------


def advise(report, setup):
    """The lines of advice the report's numbers support, each naming its threshold; empty when nothing stands out.
    `setup`: the wrapper's :data:`Setup`."""
    split, criterion = setup.split, setup.criterion
    step = report.step_ms
    rows = [r for r in report.replicas if r.forward_ms is not None]
    found = [_memory_advice(report, split, criterion)]
    if step and len(rows) > 1:  # the replicas can only wait for each other when more than one ran
        found += [_wait_advice(step, rows, split), _gil_advice(rows, len(setup.device_ids))]
    found.append(_reduce_advice(step, rows, setup.bucket_bytes))
    return [a for a in found if a is not None]


def _memory_advice(report, split, criterion):
    """GPU 0 holds much more than the others (it gathers the outputs and holds the master copy)."""
    peaks = _memory.distinct_peaks((r.device, r.peak_bytes) for r in report.replicas)
    if len(peaks) < 2:
        return None
    others = statistics.median(peaks[1:])
    ratio = peaks[0] / others if others else None
    limit = THRESHOLDS["memory"]
    if ratio is not None and ratio >= limit:
        fix = _memory_fix(split, criterion)
        return Advice("memory", f"GPU 0 holds {ratio:.1f}x the median memory of the others (advice threshold: "
                                f"{limit}x): use {fix}", ratio, limit)
    return None


def _memory_fix(split, criterion):
    """The settings that take memory off GPU 0, of those the wrapper does not use yet."""
    fixes = []
    if not criterion:
        fixes.append("criterion= (the loss on each replica: outputs never gathered on GPU 0)")
    if not isinstance(split, _split.AutoSplit):
        fixes.append('chunk_sizes="auto" (fewer rows on GPU 0 until it fits)')
    return " or ".join(fixes) if fixes else "a smaller share for device 0 (chunk_sizes= with a float)"


def _wait_advice(step, rows, split):
    """The replicas spend much of the step waiting for the slowest one."""
    waits = [r.wait_others_ms for r in rows if r.wait_others_ms is not None]
    share = statistics.mean(waits) / step if waits else 0
    limit = THRESHOLDS["wait"]
    if share >= limit:
        slow = max(rows, key=_busy_ms)
        fix = _balance_fix(split, slow)
        return Advice("wait", f"replicas wait {share:.0%} of the step for each other (advice threshold: "
                              f"{limit:.0%}; the slowest: {slow.device} at position {slow.position}): {fix}",
                      share, limit)
    return None


def _balance_fix(split, slow):
    """What evens out the replicas' times, given how far ``chunk_sizes="auto"`` (if used) has got."""
    if not isinstance(split, _split.AutoSplit):
        return 'chunk_sizes="auto" balances time (moves rows away from the slowest replica)'
    if not split.settled:
        return 'chunk_sizes="auto" is still measuring; it moves rows away from the slowest replica'
    if split.weights and split.weights[slow.position] <= 1.01 * split.min_weight * max(split.weights):
        # Already down to its least weight: more rows taken away would not help.
        return (f'chunk_sizes="auto" gives it the fewest rows it may (min_weight={split.min_weight:g}) and it '
                "is still the slowest: its time does not shrink with its rows; leave its device out of "
                "device_ids, or give it 0 rows with chunk_sizes=[...]")
    return f'chunk_sizes="auto" {split.time_reason}; a fixed chunk_sizes=[...] list can go further'


def _gil_advice(rows, ndev):
    """The replicas' threads spend much of the forward waiting for the GIL: processes would not."""
    gil = [r.wait_gil_ms / r.forward_ms for r in rows if r.wait_gil_ms and r.forward_ms]
    share = statistics.mean(gil) if gil else 0
    limit = THRESHOLDS["gil"]
    if share >= limit:
        return Advice("gil", f"the forward is bound by Python (the GIL): replicas spend {share:.0%} of it "
                             f"off the CPU waiting for each other's threads (advice threshold: {limit:.0%}); "
                             "run this same script on DDP, one process per GPU: "
                             f"torchrun --nproc_per_node {ndev} your_script.py", share, limit)
    return None


def _reduce_advice(step, rows, bucket_bytes):
    """The gradient reduction goes on long after backward ended: smaller buckets start it earlier."""
    reduce_wait = _median([r.wait_reduce_ms for r in rows])
    if not (step and reduce_wait):
        return None
    share = reduce_wait / step
    limit = THRESHOLDS["reduce"]
    if share >= limit:
        mb = bucket_bytes / 2**20
        return Advice("reduce", f"the reduction is not hidden by backward: {reduce_wait:.2f} ms, {share:.0%} "
                                f"of the step, after backward ended (advice threshold: {limit:.0%}): try "
                                f"bucket_cap_mb={max(1, round(mb / 2))} (now {mb:g}), so it starts earlier",
                      share, limit)
    return None


# ---- the report and its readings -------------------------------------------------------------------------------


def _fmt_ms(v):
    return "-" if v is None else f"{v:.2f} ms"


_fmt_bytes = _memory.format_bytes


@dataclass
class Report:
    """What ``dp.report()`` returns: per replica, per phase, memory and advice over the last steps recorded.

    ``steps``: how many steps the medians cover (training steps when there were any). ``step_ms``: median time
    from a forward's start to the last thing recorded for it (its backward, its reduction). ``period_ms``: median
    time from one forward's start to the next (includes the loss, the optimizer and data loading). ``replicas``:
    one :class:`ReplicaStats` per device_ids position. ``phases``: :class:`PhaseStats`. ``memory``: the
    ``fastdp.memory_report`` at the time of the report (what holds each device's memory). ``advice``: the lines
    of :class:`Advice` that fired. ``notes``: what the numbers do not show, and why (nothing recorded yet, a step
    left out, emulated replicas taking turns). ``median_step``: the index of the summarised step whose length is
    nearest ``step_ms``, the one ``plot`` draws (None when no step is summarised).
    """

    steps: int
    training: bool
    devices: List[str]
    step_ms: Optional[float]
    period_ms: Optional[float]
    replicas: List[ReplicaStats]
    phases: List[PhaseStats]
    memory: object
    ranges: list = field(repr=False, default_factory=list)
    t0s: list = field(repr=False, default_factory=list)
    advice: List[Advice] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    median_step: Optional[int] = None

    @property
    def emulated(self):
        """Whether the replicas are emulated on the host ('cpu' devices): they take turns, where GPUs run side by
        side."""
        return bool(self.devices) and all(d == "cpu" for d in self.devices)

    # -- plain text and notebooks --

    def _tables(self):
        head = ("#", "device", "rows", "forward", "backward", "wait: others", "wait: reduce", "wait: GIL",
                "peak memory")
        rows = [head]
        for r in self.replicas:
            rows.append((str(r.position), r.device, "-" if r.rows is None else f"{r.rows:g}", _fmt_ms(r.forward_ms),
                         _fmt_ms(r.backward_ms), _fmt_ms(r.wait_others_ms), _fmt_ms(r.wait_reduce_ms),
                         _fmt_ms(r.wait_gil_ms), "n/a" if r.peak_bytes is None else _fmt_bytes(r.peak_bytes)))
        phases = [("phase", "time / step", "bytes / step")]
        for p in self.phases:
            phases.append((p.phase, _fmt_ms(p.ms), _fmt_bytes(p.bytes) if p.bytes else "-"))
        return rows, phases

    def covers(self):
        """Which steps the numbers are: "medians over 12 training steps", or "1 training step"."""
        kind = "training" if self.training else "evaluation"
        if self.steps == 1:
            return f"1 {kind} step"
        return f"medians over {self.steps} {kind} steps"

    def headline(self):
        """The report's first line: which steps the numbers cover, and how long a step takes."""
        n = len(self.devices)
        replicas = f"{n} {'emulated ' if self.emulated else ''}replica{'' if n == 1 else 's'}"
        if not self.steps:
            return f"fastdp report on {replicas}: no step to summarise yet"
        text = f"fastdp report, {self.covers()}, on {replicas}"
        if self.step_ms is not None:
            end = "backward end" if self.training else "gather end"
            text += f": a step takes {self.step_ms:.2f} ms (forward start to {end})"
        if self.period_ms is not None:
            text += f", one starts every {self.period_ms:.2f} ms"
        return text

    def _sections(self):
        """The report's parts in reading order, for the text and the HTML alike: (caption, table rows or None, lines
        of text, whether those lines are preformatted). The notes follow the replicas' table they explain; the
        advice comes last."""
        parts = []
        if self.steps:
            rows, phases = self._tables()
            parts += [(f"per replica ({self.covers()}):", rows, self.notes, False),
                      (f"per phase ({self.covers()}):", phases, [], False)]
        else:
            parts.append((None, None, self.notes, False))
        parts.append(("memory now, by what holds it (fastdp.memory_report):", None, str(self.memory).splitlines(),
                      True))
        if self.advice:
            parts.append(("advice:", None, [f"  - {a.text}" for a in self.advice], False))
        elif self.steps:
            parts.append(("advice: none (no rule's threshold was reached; docs/report.md lists them)", None, [], False))
        else:
            parts.append(("advice: none yet (no step measured)", None, [], False))
        return parts

    def __str__(self):
        lines = [self.headline()]
        for caption, table, text, _ in self._sections():
            lines += [""] + ([caption] if caption else []) + (_aligned(table) if table else []) + text
        return "\n".join(lines)

    def _repr_html_(self):
        def table(rs):
            head = "".join(f"<th>{html.escape(c)}</th>" for c in rs[0])
            body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rs[1:])
            return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

        out = [f"<p><b>{html.escape(self.headline())}</b></p>"]
        for caption, rows, text, preformatted in self._sections():
            out.append(f"<p>{html.escape(caption)}</p>" if caption else "")
            out.append(table(rows) if rows else "")
            if preformatted:
                out.append(f"<pre>{html.escape(chr(10).join(text))}</pre>")
            else:
                out += [f"<p><i>{html.escape(line)}</i></p>" for line in text]
        return "<div>" + "".join(out) + "</div>"

    # -- numbers --

    def to_dict(self):
        """Every number of the report as plain Python values (and each recorded range, per step)."""
        return {
            "steps": self.steps, "training": self.training, "devices": list(self.devices),
            "step_ms": self.step_ms, "period_ms": self.period_ms,
            "replicas": [asdict(r) for r in self.replicas],
            "phases": [asdict(p) for p in self.phases],
            "memory": [asdict(d) for d in self.memory.devices],
            "advice": [asdict(a) for a in self.advice],
            "notes": list(self.notes), "median_step": self.median_step,
            "ranges": [{"step": r.index, "training": r.training, "phase": phase, "replica": replica,
                        "start_ms": _ms(start), "end_ms": _ms(end), "bytes": nbytes,
                        **{k: v for k, v in extra.items() if isinstance(v, (int, float, str))}}
                       for r in self.ranges for phase, replica, start, end, nbytes, extra in r.ranges],
        }

    def to_csv(self, path):
        """Writes every recorded range, one per line (step, training, phase, replica, device, rows, start_ms,
        end_ms, ms, bytes), times from each step's start; returns ``path``."""
        columns = ("step", "training", "phase", "replica", "device", "rows", "start_ms", "end_ms", "ms", "bytes")
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(columns)
            for r in self.ranges:
                for phase, replica, start, end, nbytes, _ in r.ranges:
                    device = "" if replica is None else self.devices[replica]
                    rows = "" if replica is None else r.rows[replica]
                    writer.writerow((r.index, int(r.training), phase, "" if replica is None else replica, device,
                                     rows, round(_ms(start), 4), round(_ms(end), 4), round(_ms(end - start), 4),
                                     nbytes))
        return path

    # -- pictures --

    def trace(self, path):
        """Writes a Chrome/Perfetto trace (JSON: open it in ui.perfetto.dev or chrome://tracing): one track per
        replica and one for the whole step, a range per phase; returns ``path``."""
        events = [{"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "fastdp.DataParallel"}},
                  {"name": "thread_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "step"}}]
        for pos, device in enumerate(self.devices):
            events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": pos + 1,
                           "args": {"name": f"replica {pos} ({device})"}})
        origin = self.t0s[0] if self.t0s else 0
        for r, t0 in zip(self.ranges, self.t0s):
            base = (t0 - origin) / 1e3
            for phase, replica, start, end, nbytes, extra in r.ranges:
                args = {"step": r.index, "bytes": nbytes}
                if replica is not None:
                    args["rows"] = r.rows[replica]
                args.update({k: v for k, v in extra.items() if isinstance(v, (int, float, str)) and k != "thread"})
                events.append({"name": phase, "cat": "fastdp", "ph": "X", "pid": 1,
                               "tid": 0 if replica is None else replica + 1, "ts": base + start / 1e3,
                               "dur": max(0.0, (end - start) / 1e3), "args": args})
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
        return path

    def plot(self, path):
        """Draws the report as a PNG: the last step's timeline per replica (a bar per phase) and each device's
        memory by what holds it. Needs matplotlib (``pip install 'fastdp[plot]'``); returns ``path``."""
        return _report_plot.draw(self, path)


def _aligned(rows):
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
