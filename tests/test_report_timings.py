"""``dp.report()``'s numbers on emulated replicas: off by default and its settings checked, a replica's forward or
backward against the sleep injected there, training with it on equal to the bare model, the gradient reduction's
records as a reducer feeds them, CUDA timings from events (the recording fakes of tests/_fake_cuda.py) read without
synchronising a step, and no reference cycles with it on.

References: the bare module on the full batch (float64 within 1e-10).
Timings only against injected sleeps, with generous bounds (never a speed), on one torch thread (conftest's
``one_torch_thread``).
"""

import copy
import gc
import json
import time
import types
import warnings

import pytest
import torch
import torch.nn.functional as F

import fastdp
from fastdp._report import recorder as _recorder

from _fake_cuda import FakeCuda
from _reference import params_close
from _report_cases import SLEEP, data, mlp, sleep_in_forward, train

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---- off by default; bad input ----------------------------------------------------------------------------------


def test_off_by_default_records_nothing_and_says_how_to_turn_it_on():
    dp = fastdp.DataParallel(mlp(), device_ids=["cpu"] * 2)
    train(dp, 2)
    assert dp._recording.recorder is None
    with pytest.raises(RuntimeError, match=r"pass report=True to fastdp.DataParallel \(or call dp.enable_report\(\)\)"):
        dp.report()
    dp.enable_report(steps=3)
    train(dp, 5)
    assert dp.report().steps == 3
    dp.disable_report()
    assert dp._recording.recorder is None


@pytest.mark.parametrize("kwargs, text", [
    ({"report": 0}, "report=0: expected True"),
    ({"report": "yes"}, "report='yes': expected True"),
    ({"oom": "retry"}, "oom='retry': expected None"),
])
def test_bad_settings_name_the_argument(kwargs, text):
    with pytest.raises(ValueError, match=text):
        fastdp.DataParallel(mlp(), device_ids=["cpu"] * 2, **kwargs)


# ---- the numbers against what was injected -----------------------------------------------------------------------


def test_a_sleeping_replica_shows_its_forward_and_the_others_show_the_wait():
    model = mlp()
    sleep_in_forward(model, 2, 4)
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 4, report=True)
    train(dp, 6)
    report = dp.report()
    slow, others = report.replicas[2], [report.replicas[i] for i in (0, 1, 3)]
    assert slow.forward_ms >= SLEEP * 1e3
    assert all(r.forward_ms < slow.forward_ms - SLEEP * 1e3 / 2 for r in others), str(report)
    assert all(r.wait_others_ms >= 0.75 * SLEEP * 1e3 for r in others), str(report)  # idle while it sleeps
    assert slow.wait_others_ms < min(r.wait_others_ms for r in others)
    assert [a.rule for a in report.advice] == ["wait"] and "position 2" in report.advice[0].text
    assert all(r.rows == 6 for r in report.replicas)


def test_a_replica_sleeping_in_backward_shows_its_backward():
    model = mlp()
    calls = [0]

    def slow_backward(module, inputs, output):
        if calls[0] % 3 == 1:  # position 1's first layer: its backward passes here last
            output.register_hook(lambda g: time.sleep(SLEEP))
        calls[0] += 1

    model[0].register_forward_hook(slow_backward)
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 3, report=True)
    train(dp, 5)
    report = dp.report()
    assert report.replicas[1].backward_ms >= SLEEP * 1e3
    assert all(report.replicas[i].backward_ms < report.replicas[1].backward_ms - SLEEP * 1e3 / 2 for i in (0, 2))


def test_training_with_the_report_on_equals_the_bare_model():
    bare = mlp()
    model = copy.deepcopy(bare)
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 3, report=5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(bare.parameters(), lr=0.1)
    train(dp, 4, opt=opt)
    train(bare, 4, opt=ref_opt)
    params_close(model, bare)
    assert dp.report().steps == 4


# ---- the reduction, as a reducer records it ---------------------------------------------------------------------


def _with_reduce(after_backward_ms, buckets=3):
    """A step whose reducer reported `buckets` reductions, the last ending `after_backward_ms` after backward."""
    model = mlp(width=64)
    model[0].register_forward_hook(lambda m, i, out: out.register_hook(lambda g: time.sleep(0.005)) and None)
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 2, report=True)
    for s in range(5):
        x, y = data(32, s)
        loss = F.cross_entropy(dp(x), y)
        dp._replica_set.reducer.recorder = None  # only the records below: the real reducer's are another test's
        rec = dp._recording.recorder
        t_fwd = time.perf_counter_ns()
        loss.backward()
        t_end = time.perf_counter_ns()
        for i in range(buckets):  # spread inside backward, the last one running past its end
            a = t_fwd + (t_end - t_fwd) * i // buckets
            rec.record("reduce", None, a, a + (t_end - t_fwd) // buckets, 1000, bucket=i)
        rec.record("reduce", None, t_end, t_end + int(after_backward_ms * 1e6), 500, bucket=buckets)
        time.sleep(after_backward_ms / 1e3)
    return dp, dp.report()


def test_reduce_records_fed_by_a_reducer_reach_the_report_trace_and_advice(tmp_path):
    dp, report = _with_reduce(after_backward_ms=30)
    reduce = next(p for p in report.phases if p.phase == "reduce")
    assert reduce.bytes == 3500
    # What ran past backward's end: not the reduction's whole time (its buckets inside backward are hidden)
    assert all(30 <= r.wait_reduce_ms < 35 for r in report.replicas), str(report)
    advice = [a for a in report.advice if a.rule == "reduce"]
    assert advice and "bucket_cap_mb=12" in advice[0].text, str(report)
    trace = json.load(open(report.trace(tmp_path / "t.json")))
    buckets = [e["args"]["bucket"] for e in trace["traceEvents"] if e["name"] == "reduce"]
    assert sorted(set(buckets)) == [0, 1, 2, 3]


def test_the_reducer_records_each_buckets_reduction():
    """The wrapper's reducer records one range per gradient bucket and step, with the bucket's bytes."""
    dp = fastdp.DataParallel(mlp(width=64), device_ids=["cpu"] * 2, report=True, bucket_cap_mb=1e-6)
    train(dp, 3)
    buckets = dp._replica_set.layout[0]
    assert len(buckets) > 2
    report = dp.report()
    reduce = next(p for p in report.phases if p.phase == "reduce")
    assert reduce.bytes == sum(b.numel * b.itemsize for b in buckets)


def test_a_reduction_hidden_by_backward_draws_no_advice():
    _, report = _with_reduce(after_backward_ms=0.0)
    assert "reduce" in {p.phase for p in report.phases}
    assert [a.rule for a in report.advice if a.rule == "reduce"] == []


def test_wait_reduce_records_are_the_exposed_reduction():
    dp = fastdp.DataParallel(mlp(), device_ids=["cpu"] * 2, report=True)
    for s in range(3):
        x, y = data(16, s)
        loss = F.cross_entropy(dp(x), y)
        loss.backward()
        t = time.perf_counter_ns()
        dp._recording.recorder.record("wait-reduce", None, t, t + 4_000_000)
    assert all(r.wait_reduce_ms == pytest.approx(4.0) for r in dp.report().replicas)


# ---- CUDA timings come from events, read only when the report is --------------------------------------------------


def test_cuda_times_are_events_resolved_without_synchronising_the_step(monkeypatch):
    cuda = FakeCuda(2).install(monkeypatch)
    rec = _recorder.Recorder(4)
    step = rec.begin([0, 1], True)
    start = rec.stamp(1)
    time.sleep(0.003)
    end = rec.stamp(1)
    rec.record("forward", 1, start, end)
    rec.lap("scatter", 10)
    assert cuda.host_syncs() == []
    assert all(isinstance(x, type(start)) for x in (start, end, step.lap_at))
    quick = _recorder.resolve(step, wait=False)  # what "auto" reads inside a step: no waiting
    assert cuda.host_syncs() == []
    forward = next(r for r in quick.ranges if r[0] == "forward")
    assert forward[3] - forward[2] >= 3_000_000
    _recorder.resolve(step)  # reading the report waits for the events: outside the step
    assert cuda.host_syncs()


def test_auto_reads_the_newest_step_whose_events_are_in_and_each_step_once(monkeypatch):
    cuda = FakeCuda(2).install(monkeypatch)
    rec = _recorder.Recorder(4, internal=True)
    steps = []
    for rows in ([3, 3], [2, 4]):
        step = rec.begin([0, 1], True)
        step.rows = rows
        for pos in (0, 1):
            rec.record("forward", pos, rec.stamp(pos), rec.stamp(pos))
        steps.append(step)
    rec.begin([0, 1], True)  # the step now starting
    late = [x for r in steps[1].records for x in (r[2], r[3])]
    for event in late:
        event.query = lambda: False  # the device still runs the newest step
    assert rec.last_timings()[0] == [3, 3]  # the older step, read without waiting
    assert rec.last_timings() is None  # ... and only once
    for event in late:
        del event.query
    assert rec.last_timings()[0] == [2, 4]
    assert cuda.host_syncs() == []


# ---- reference cycles --------------------------------------------------------------------------------------------


def test_no_reference_cycles_with_the_report_on():
    dp = fastdp.DataParallel(mlp(), device_ids=["cpu"] * 2, report=2)  # steps leave the window as they go
    train(dp, 3)
    while gc.collect():
        pass
    gc.disable()
    try:
        train(dp, 3)
        dp.report()
        assert gc.collect() == 0
    finally:
        gc.enable()


def test_recording_leaves_the_kept_replicas_unedited(monkeypatch):
    # The backward mark shadows a parameter for the forward; were it put in the replica's parameter dict, the kept
    # replicas would take it for the forward's own edit and install every tensor again each step. The reference:
    # the same steps with the report off, which edit nothing.
    from fastdp._step import replicas as _replicas

    edits = []
    undo = _replicas._Skeletons.undo_edits
    monkeypatch.setattr(_replicas._Skeletons, "undo_edits", lambda self: edits.append(undo(self)) or edits[-1])
    seen = {}
    for report in (False, True):
        dp = fastdp.DataParallel(mlp(), device_ids=["cpu"] * 3, report=report)
        train(dp, 1)  # the first step finds the replicas as built
        edits.clear()
        train(dp, 4, seed=2)
        seen[report] = sum(edits)
    assert seen == {False: 0, True: 0}
    assert all(r.backward_ms > 0 for r in dp.report().replicas)


class _WeightProperty(torch.nn.Module):
    """A layer whose class reads its weight through a property of that name: an attribute cannot shadow it."""

    def __init__(self):
        super().__init__()
        self._parameters["weight"] = torch.nn.Parameter(torch.randn(3, 8, dtype=torch.float64))

    @property
    def weight(self):
        return self._parameters["weight"]

    def forward(self, x):
        return x @ self.weight.t()


def test_a_class_that_defines_the_parameters_name_still_shows_each_replicas_backward():
    # Its parameter dict holds the mark then; the reference is the plain MLP, whose replicas all show a backward.
    for model in (mlp(), _WeightProperty()):
        dp = fastdp.DataParallel(model, device_ids=["cpu"] * 3, report=True)
        train(dp, 3)
        assert all(r.backward_ms is not None and r.backward_ms > 0 for r in dp.report().replicas)


class _ReturnsItsParameter(torch.nn.Module):
    """A forward that hands out a kept replica tensor as it is (its second parameter: the first is the backward-end
    mark's, a view made in the step), beside an output its layers compute."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 3, dtype=torch.float64)
        self.table = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.float64))

    def forward(self, x):
        return self.lin(x), self.table


def _live_marks():
    gc.collect()
    with warnings.catch_warnings():  # isinstance reads __class__, which some deprecated torch objects warn about
        warnings.simplefilter("ignore")
        return sum(1 for o in gc.get_objects()
                   if isinstance(o, types.FunctionType) and o.__qualname__.endswith("_mark_start.<locals>.started"))


def test_a_kept_tensor_handed_out_gets_no_mark_that_outlives_the_step():
    # Its node lives as long as the kept replicas: a start mark hooked there would stay and run at every later
    # backward, one more per replica and step. The reference: the marks alive after a few steps, which must not
    # grow with more steps; each replica's backward still shows (through the computed output).
    torch.manual_seed(0)
    model = _ReturnsItsParameter()
    bare = copy.deepcopy(model)
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 2, report=3)
    x = torch.randn(6, 8, dtype=torch.float64)
    for _ in range(3):
        out, table = dp(x)
        (out.sum() + table.sum()).backward()
    after_three = _live_marks()
    for _ in range(12):
        out, table = dp(x)
        (out.sum() + table.sum()).backward()
    assert _live_marks() == after_three
    assert all(r.backward_ms is not None and r.backward_ms > 0 for r in dp.report().replicas)
    ref_out, ref_table = bare(x)
    (ref_out.sum() * 15 + ref_table.sum() * 2 * 15).backward()  # 15 steps; the table is gathered from 2 replicas
    for (name, p), q in zip(model.named_parameters(), bare.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-10, msg=name)
