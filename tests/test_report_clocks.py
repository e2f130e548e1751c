"""The report's clocks across devices: CUDA events placed on the host's clock by when they ran, not by when they were
enqueued, so that the numbers that compare two devices (the reduction left after backward, the trace's positions,
a step's span) hold while each device's queue runs behind the host by its own amount.

The fake device here (``LateQueues``, on tests/_fake_cuda.py's recorder of torch.cuda calls) runs every event a set
time after the host enqueued it, per stream, and the test changes those lags as a real device's would change: device
0 starts a step far behind (it alone ran the optimizer), then catches up while the others' backward runs. A
synchronisation empties a device's queue: the next event there runs at once.

References: the device times the fake gave each event (what a profiler of the device would show), within 1 ms.
"""

import json
import time

import pytest
import torch

from fastdp._report import recorder as _recorder, report as _report

from _fake_cuda import FakeCuda, FakeEvent

pytestmark = pytest.mark.sim  # the CUDA path on the recording fake (tests/_fake_cuda.py), as the other fake-CUDA tests

MS = 1_000_000


class LateEvent(FakeEvent):
    """An event that runs (``at``: the device's clock, which the fake makes the host's) when its stream's queue
    reaches it: at the time the test planned for it (``LateQueues.plan``), else its stream's lag after it was
    recorded; never before the work queued before it on its stream (a stream runs in order), and at once on a device
    whose queue a synchronisation emptied."""

    def record(self, stream=None):
        super().record(stream)
        stream = stream or self.cuda.current_stream()
        cuda, d = self.cuda, stream.device_index
        if d in cuda.drained:
            cuda.drained.discard(d)
        elif cuda.planned:
            self.at = max(self.at, cuda.origin + int(cuda.planned.pop(0) * MS))  # never before it was enqueued
        else:
            self.at += cuda.lag_ns(stream)
        self.at = max(self.at, cuda.last.get(stream.name, 0))
        cuda.last[stream.name] = self.at
        cuda.device_last[d] = max(self.at, cuda.device_last.get(d, 0))


class LateQueues(FakeCuda):
    """Fake devices whose streams run behind the host: ``lag_ms[name]`` for a stream of that name, else
    ``lag_ms[device]``; or at the device times ``plan`` lists, one per event recorded from then on. A
    synchronisation of a device returns once everything queued there has run."""

    def __init__(self, ndev):
        super().__init__(ndev)
        self.lag_ms = {}
        self.drained = set()
        self.planned, self.origin = [], 0
        self.last, self.device_last = {}, {}  # per stream name and per device: when its last event runs

    def plan(self, *ms):
        """The next events run these many ms after this call, in the order they are recorded (on any device)."""
        self.planned, self.origin = list(ms), time.perf_counter_ns()

    def lag_ns(self, stream):
        return int(self.lag_ms.get(stream.name, self.lag_ms.get(stream.device_index, 0)) * MS)

    def Event(self, **kwargs):
        return LateEvent(self, **kwargs)

    def synchronize(self, device=None):
        super().synchronize(device)
        d = self._index(device)
        wait = self.device_last.get(d, 0) - time.perf_counter_ns()
        if wait > 0:
            time.sleep(wait / 1e9)  # the host waits for the device's queue to run out
        self.drained.add(d)


def _step(rec, cuda, reduce_stream, tail_ms):
    """One training step over devices 0 and 1, recorded as the wrapper's sites record it, on this timeline of the
    devices (ms from the step's start): device 0 begins 40 ms behind the host (it alone ran the optimizer), device 1
    2 ms behind. The gather waits for device 1's forward; device 1's backward, which starts after the loss on device 0,
    is the slowest; the reduction on device 0's own stream waits for it and ends `tail_ms` after it. Returns the device
    times, from the step's start, of what the test compares."""
    cuda.plan(40, 2, 40,  # the step's references on devices 0 and 1, and where its first phase starts (device 0)
              41,  # the scatter's end
              41, 45, 3, 12,  # each replica's forward
              46,  # the gather's end: device 1's forward has ended long before, on its clock
              46, 50, 47, 70,  # each replica's backward
              70, 70 + tail_ms)  # the last bucket's sum
    step = rec.begin([0, 1], True)
    step.rows = [4, 4]
    rec.lap("scatter", 64)
    stamps = {}
    for pos in (0, 1):
        stamps["forward", pos] = (rec.stamp(pos), rec.stamp(pos))
        rec.record("forward", pos, *stamps["forward", pos])
    rec.lap("gather", 64)
    for pos in (0, 1):
        stamps["backward", pos] = (rec.stamp(pos), rec.stamp(pos))
        rec.record("backward", pos, *stamps["backward", pos])
    with cuda.stream(reduce_stream):
        stamps["reduce", None] = (rec.stamp(0), rec.stamp(0))
        rec.record("reduce", None, *stamps["reduce", None], 1000, bucket=0)
    assert not cuda.planned
    return {k: ((a.at - step.t0) / MS, (b.at - step.t0) / MS) for k, (a, b) in stamps.items()}


def _read(rec):
    """The report's numbers without its memory table (the fake has no model to take one of)."""
    setup = _report.Setup([0, 1], None, False, 25 << 20)
    return _report.build(rec, setup, lambda: None)


@pytest.fixture
def late(monkeypatch):
    cuda = LateQueues(2)
    cuda.install(monkeypatch)
    return cuda


def test_the_reduction_left_after_backward_is_read_on_the_devices_clocks(late):
    rec = _recorder.Recorder(4)
    reduce_stream = late.stream_on(0, "reduce@0")
    truths = [_step(rec, late, reduce_stream, tail_ms=25) for _ in range(3)]
    assert late.host_syncs() == []  # the steps themselves never wait for a device
    report = _read(rec)
    exposed = [t["reduce", None][1] - t["backward", 1][1] for t in truths]
    assert all(e == pytest.approx(25, abs=1) for e in exposed)
    for r in report.replicas:
        assert r.wait_reduce_ms == pytest.approx(25, abs=1), str(report.replicas)
    advice = [a for a in report.advice if a.rule == "reduce"]
    assert advice, "a 25 ms reduction after backward, most of the step, draws the advice"


def test_trace_positions_and_spans_follow_the_devices_clocks(late, tmp_path):
    rec = _recorder.Recorder(4)
    reduce_stream = late.stream_on(0, "reduce@0")
    truth = _step(rec, late, reduce_stream, tail_ms=10)
    report = _read(rec)
    ranges = {(p, rep): (a / MS, b / MS) for p, rep, a, b, _, _ in report.ranges[0].ranges}
    for key in truth:
        assert ranges[key] == pytest.approx(truth[key], abs=1), key
    # The gather waited for device 1's forward: it ends after it in the trace, as on the devices.
    assert ranges[("gather", None)][1] >= ranges[("forward", 1)][1]
    assert report.step_ms == pytest.approx(truth["reduce", None][1], abs=1)
    trace = json.load(open(report.trace(tmp_path / "t.json")))
    ends = {(e["name"], e["tid"]): (e["ts"] + e["dur"]) / 1e3 for e in trace["traceEvents"] if e["ph"] == "X"}
    assert ends[("reduce", 0)] - ends[("backward", 2)] == pytest.approx(10, abs=1)


def test_durations_on_one_device_are_unchanged_by_its_lag(late):
    """What pairs two events of one device (a replica's forward) is right whatever the device's lag."""
    rec = _recorder.Recorder(4)
    late.lag_ms.update({0: 30, 1: 7})
    step = rec.begin([0, 1], True)
    step.rows = [1, 1]
    pairs = []
    for pos in (0, 1):
        a = rec.stamp(pos)
        time.sleep(0.003)
        late.lag_ms[pos] += 5  # the queue falls further behind while the replica runs: 5 ms more on the device
        b = rec.stamp(pos)
        pairs.append((b.at - a.at) / MS)
        rec.record("forward", pos, a, b)
    resolved = _recorder.resolve(step, anchored=_recorder.anchors([0, 1]))
    got = {rep: (b - a) / MS for p, rep, a, b, _, _ in resolved.ranges if p == "forward"}
    assert got[0] == pytest.approx(pairs[0], abs=0.01) and got[1] == pytest.approx(pairs[1], abs=0.01)
    assert all(p >= 8 for p in pairs)
