"""``dp.report()`` on emulated replicas: its numbers against what was injected (sleeps in a replica's forward or
backward), its readings (table, dict, CSV, trace, PNG), the advice on constructed cases, the gradient reduction's
records as a reducer feeds them, ``chunk_sizes="auto"``'s time phase and its memory window, and the out-of-memory
rescue (``oom="rebalance"``, ``fastdp.inject_oom``).

References: the bare module on the full batch (float64 within 1e-10); timings only against injected sleeps, with
generous bounds (never a speed).
"""

import copy
import csv
import gc
import json
import statistics
import sys
import time
import weakref
import importlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fastdp
from fastdp._balance import memory as _memory
from fastdp._report import recorder as _recorder, report as _report

from _fake_cuda import FakeCuda

pa = importlib.import_module("fastdp.parallel_apply")

SLEEP = 0.02
TOL = 1e-10


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Timings are read against injected sleeps: one torch thread, so a loaded machine's OpenMP pool waiting for
    a core does not make every replica look slow."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def mlp(seed=0, width=32):
    torch.manual_seed(seed)
    layers = [nn.Linear(8, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 3)]
    return nn.Sequential(*layers).double()


def data(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)


def sleep_in_forward(model, position, replicas, seconds=SLEEP):
    """Emulated replicas run one after another in the calling thread: the k-th call of a step is position k."""
    calls = [0]

    def hook(module, inputs, output):
        if calls[0] % replicas == position:
            time.sleep(seconds)
        calls[0] += 1

    return model[0].register_forward_hook(hook)


def train(dp, steps, n=24, seed=1, opt=None):
    for s in range(steps):
        x, y = data(n, seed + s)
        if opt is not None:
            opt.zero_grad()
        F.cross_entropy(dp(x), y).backward()
        if opt is not None:
            opt.step()


def params_close(a, b, tol=TOL):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=tol, msg=name)


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


# ---- the readings ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def measured():
    model = mlp()
    sleep_in_forward(model, 1, 3, seconds=0.005)
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 3, report=True)
    train(dp, 4)
    with torch.no_grad():
        dp(data(6)[0])  # an evaluation step: recorded, not summarised while training steps exist
    return dp, dp.report()


def test_text_and_html_show_every_replica_and_phase(measured):
    _, report = measured
    text, page = str(report), report._repr_html_()
    for r in report.replicas:
        assert f"{r.position}  " in text or f"{r.position} " in text
    for phase in ("scatter", "replicate", "forward", "gather", "backward"):
        assert phase in text and f"<td>{phase}</td>" in page
    assert "wait: others" in text and "peak memory" in text and "memory (now):" in text


def test_csv_and_dict_hold_the_same_ranges_as_the_summary(measured, tmp_path):
    _, report = measured
    path = report.to_csv(tmp_path / "report.csv")
    rows = list(csv.DictReader(open(path)))
    d = report.to_dict()
    assert len(rows) == len(d["ranges"]) == sum(len(r.ranges) for r in report.ranges)
    training = {int(r["step"]) for r in rows if r["training"] == "1"}
    for rep in report.replicas:
        per_step = {}
        for r in rows:
            if r["phase"] == "forward" and r["replica"] == str(rep.position) and int(r["step"]) in training:
                per_step[r["step"]] = per_step.get(r["step"], 0) + float(r["ms"])
        assert rep.forward_ms == pytest.approx(statistics.median(per_step.values()), abs=1e-3)
    assert [r["position"] for r in d["replicas"]] == [0, 1, 2] and d["steps"] == 4
    json.dumps(d)  # plain values only


def test_trace_is_json_with_a_range_per_replica_and_phase(measured, tmp_path):
    _, report = measured
    trace = json.load(open(report.trace(tmp_path / "trace.json")))
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {0: "step", 1: "replica 0 (cpu)", 2: "replica 1 (cpu)", 3: "replica 2 (cpu)"}
    for step in {e["args"]["step"] for e in events if e["name"] == "backward"}:
        mine = [e for e in events if e["args"]["step"] == step]
        assert {e["name"] for e in mine if e["tid"] == 0} >= {"scatter", "replicate", "apply", "gather"}
        for tid in (1, 2, 3):
            assert {e["name"] for e in mine if e["tid"] == tid} == {"forward", "backward"}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in events)
    slow = [e["dur"] for e in events if e["tid"] == 2 and e["name"] == "forward"]
    assert min(slow) >= 5000  # µs: the 5 ms sleep of position 1


def test_plot_is_a_png(measured, tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    _, report = measured
    path = report.plot(tmp_path / "report.png")
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    image = imread(path)
    assert image.shape[0] > 200 and image.shape[1] > 800
    assert image[..., :3].std() > 0.05  # something was drawn


def test_plot_without_matplotlib_says_how_to_install_it(measured, tmp_path, monkeypatch):
    _, report = measured
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install 'fastdp\[plot\]'"):
        report.plot(tmp_path / "x.png")


def test_phases_show_in_a_torch_profiler_trace():
    dp = fastdp.DataParallel(mlp(), device_ids=["cpu"] * 2, report=True)
    train(dp, 1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        train(dp, 1)
    names = {e.key for e in prof.key_averages()}
    assert {"fastdp.forward[0]", "fastdp.forward[1]"} <= names


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


# ---- advice on constructed cases ---------------------------------------------------------------------------------


def _report_with(peaks, forward, backward=None, gil=None, criterion=False, split=None):
    n = len(peaks)
    wrapper = fastdp.DataParallel(mlp(), device_ids=["cpu"] * n,
                                  criterion=nn.CrossEntropyLoss() if criterion else None, chunk_sizes=split)
    replicas = [_report.ReplicaStats(i, f"cuda:{i}", 8, forward[i], (backward or forward)[i],
                                     max(forward) - forward[i], None, (gil or [0] * n)[i], peaks[i])
                for i in range(n)]
    report = _report.Report(steps=5, training=True, devices=[f"cuda:{i}" for i in range(n)],
                            step_ms=2 * max(forward) + 1, period_ms=None, replicas=replicas, phases=[],
                            memory=fastdp.memory_report(wrapper))
    return _report.advise(report, wrapper)


def test_memory_advice_fires_from_its_threshold_and_names_the_fixes():
    advice = _report_with([180, 100, 100, 90], [1, 1, 1, 1])
    assert [a.rule for a in advice] == ["memory"]
    assert "GPU 0 holds 1.8x the median memory" in advice[0].text and "criterion=" in advice[0].text
    assert 'chunk_sizes="auto"' in advice[0].text and advice[0].threshold == _report.THRESHOLDS["memory"]
    quiet = _report_with([120, 100, 100, 90], [1, 1, 1, 1])
    assert quiet == []
    with_both = _report_with([180, 100, 100, 90], [1, 1, 1, 1], criterion=True, split="auto")
    assert "criterion=" not in with_both[0].text and '"auto"' not in with_both[0].text


def test_wait_and_gil_advice_fire_on_their_cases_only():
    assert [a.rule for a in _report_with([None] * 3, [1.0, 1.0, 5.0])] == ["wait"]
    assert _report_with([None] * 3, [1.0, 1.05, 1.1]) == []
    gil = _report_with([None] * 2, [4.0, 4.0], gil=[2.0, 2.0])
    assert [a.rule for a in gil] == ["gil"] and "torchrun --nproc_per_node 2 your_script.py" in gil[0].text


def test_python_bound_forwards_on_threads_draw_the_gil_advice(monkeypatch):
    monkeypatch.setattr(pa, "_CPU_THREADS", True)  # emulated replicas on threads, as CUDA replicas run

    class Python(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(1, dtype=torch.float64))

        def forward(self, x):
            total = 0
            for i in range(60_000):  # holds the GIL
                total += i % 7
            return x * self.w + total * 0

    dp = fastdp.DataParallel(Python(), device_ids=["cpu"] * 3, report=True)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1.0)  # each thread keeps the GIL through its forward: the others wait to start
    try:
        for s in range(4):
            dp(torch.randn(12, 1, dtype=torch.float64)).sum().backward()
    finally:
        sys.setswitchinterval(interval)
    report = dp.report()
    assert "gil" in [a.rule for a in report.advice]
    assert all(r.wait_gil_ms > 0 for r in report.replicas)


def test_gil_wait_is_the_wait_to_start_plus_the_time_off_the_cpu():
    rec = _recorder.Recorder(2)
    step = rec.begin(["cpu", "cpu"], True)
    step.rows = [4, 4]
    t = step.t0
    rec.record("forward", 0, t, t + 10_000_000, off_cpu_ns=2_000_000, queued_ns=0, thread=1)
    rec.record("forward", 1, t + 10_000_000, t + 15_000_000, off_cpu_ns=1_000_000, queued_ns=10_000_000, thread=2)
    assert _report._StepNumbers(_recorder.resolve(step)).gil == [2_000_000, 11_000_000]
    sequential = rec.begin(["cpu", "cpu"], True)  # one thread ran them: nothing waited for the GIL
    rec.record("forward", 0, t, t + 1)
    assert _report._StepNumbers(_recorder.resolve(sequential)).gil == [0, None]


def test_a_balanced_run_draws_no_advice():
    dp = fastdp.DataParallel(mlp(width=128), device_ids=["cpu"] * 3, report=True)
    train(dp, 12, n=96)
    report = dp.report()
    assert report.advice == [], str(report)
    assert all(r.wait_others_ms < (r.forward_ms + r.backward_ms) / 2 for r in report.replicas), str(report)
    assert all(r.wait_gil_ms == 0 for r in report.replicas)  # one thread: nothing waits for the GIL


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


# ---- chunk_sizes="auto": time ------------------------------------------------------------------------------------


def test_auto_moves_rows_away_from_a_sleeping_replica_settles_and_equals_the_bare_model():
    bare = mlp(width=256)
    model = copy.deepcopy(bare)
    sleep_in_forward(model, 1, 3)
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 3, chunk_sizes="auto")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(bare.parameters(), lr=0.05)
    sizes = []
    for s in range(14):
        train(dp, 1, n=90, seed=s, opt=opt)
        train(bare, 1, n=90, seed=s, opt=ref_opt)
        sizes.append(dp._last_step.chunk_sizes)
    rule = dp._split
    assert rule.settled, rule.describe()
    assert sizes[0] == [30, 30, 30]
    assert sizes[-1][1] <= 15 and sizes[-1][0] + sizes[-1][2] >= 75, (sizes, rule.describe(), rule.time_history)
    assert sizes[-1] == sizes[-2] == sizes[-3]  # settled: fixed from then on
    assert dp._recording.recorder is None  # it measured only while it had to
    params_close(model, bare)


def test_auto_time_phase_converges_to_the_speeds_and_keeps_its_bounds():
    costs = [1.0, 2.0, 1.0]  # ms per row: position 1 is half as fast

    def run(costs, **options):
        rule = fastdp.AutoSplit(warmup=0, timer=lambda: timings[0], **options).bind(["cpu"] * 3)
        timings = [None]
        for _ in range(20):
            sizes = rule.split(60, 0, 3)
            timings[0] = (sizes, [n * c / 1e3 for n, c in zip(sizes, costs)])
            rule.observe()
        return rule, rule.split(60, 0, 3)

    rule, sizes = run(costs)
    assert rule.settled and abs(sizes[1] - 12) <= 2 and abs(sizes[0] - 24) <= 2  # rows as speeds: busy times level
    rule, sizes = run([1.0, 1000.0, 1.0], min_weight=0.2)
    assert rule.settled and min(rule.weights) >= 0.2 * max(rule.weights) - 1e-12  # held at its bound
    rule, sizes = run([1.0, 1.0, 1.0])
    assert rule.settled and sizes == [20, 20, 20] and len(rule.time_history) == 1


@pytest.mark.parametrize("options, error, text", [
    ({"time_tolerance": -1}, ValueError, "time_tolerance must be a finite non-negative number, got -1"),
    ({"time_steps": 0}, ValueError, "time_steps must be a positive int, got 0"),
    ({"min_weight": 0}, ValueError, "min_weight must be a number in (0, 1]"),
    ({"balance_time": 1}, TypeError, "balance_time must be True or False, got int"),
    ({"timer": 3}, TypeError, "timer must be callable"),
])
def test_auto_time_options_are_checked(options, error, text):
    with pytest.raises(error) as info:
        fastdp.AutoSplit(**options)
    assert text in str(info.value)


# ---- chunk_sizes="auto": memory between samples --------------------------------------------------------------------


def test_peak_window_sees_device_0s_backward_high_and_never_resets_the_users_counters(monkeypatch):
    cuda = FakeCuda(2).install(monkeypatch)
    window = _memory.PeakWindow([0, 1])
    window.read()  # the window starts
    cuda.allocate(0, 500)  # forward: activations on both devices
    cuda.allocate(1, 400)
    window.sample()  # the end of the forward
    cuda.allocate(0, 300)  # backward on device 0: the gathered outputs' gradient, alive for a moment
    cuda.allocate(0, -300)
    cuda.allocate(0, -500)
    cuda.allocate(1, -400)
    assert window.read() == [800, 400]  # the counter moved: device 0's high is known exactly
    assert window.exact == [True, True]
    # Later steps stay below the first high: the counter cannot move, so the samples are what is known...
    cuda.allocate(0, 200)
    window.sample()
    cuda.allocate(0, 100)  # ... unless one is taken where the high is (backward reaching the outputs)
    window.sample()
    cuda.allocate(0, -300)
    assert window.read() == [300, 0] and window.exact == [False, False]
    cuda.reset_peak_memory_stats(0)  # the user resets their own counter inside a window
    cuda.log.remove(("reset_peak", 0))
    cuda.allocate(0, 250)
    cuda.allocate(0, -250)
    assert window.read()[0] == 250 and window.exact[0]
    assert cuda.entries("reset_peak") == []  # fastdp never reset a counter


# ---- out-of-memory rescue ----------------------------------------------------------------------------------------


def bn_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3)).double()


def test_forward_oom_moves_rows_and_counts_the_batch_once():
    model = bn_model()
    bare = copy.deepcopy(model)
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 3, oom="rebalance")
    injection = fastdp.inject_oom(dp, 2, above=5)
    x, y = data(18)
    with pytest.warns(RuntimeWarning, match="out of memory at position 2"):
        out = dp(x)
    assert injection.fired == 1
    sizes = dp._last_step.chunk_sizes
    assert sizes[2] <= 5 and sum(sizes) == 18
    bn, ref = model[1], bare[1]
    ref(bare[0](x[: sizes[0]]))  # upstream's rule: statistics from chunk 0, of the step that ran, once
    assert int(bn.num_batches_tracked) == 1
    torch.testing.assert_close(bn.running_mean, ref.running_mean, rtol=0, atol=TOL)
    torch.testing.assert_close(bn.running_var, ref.running_var, rtol=0, atol=TOL)
    assert out.shape == (18, 3)
    dp(x)  # the next steps keep the moved split, and fit
    assert dp._last_step.chunk_sizes == sizes and injection.fired == 1
    dp.enable_report()
    dp.disable_report()  # switching the report leaves a test's injection in place
    assert dp._recording.recorder is not None and dp._recording.recorder.inject is injection


def test_forward_oom_rescue_equals_the_bare_model():
    bare = mlp()
    model = copy.deepcopy(bare)
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 3, oom="rebalance", chunk_sizes="auto", report=True)
    fastdp.inject_oom(dp, 0, above=6, times=1)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(bare.parameters(), lr=0.1)
    with pytest.warns(RuntimeWarning):
        train(dp, 3, n=21, opt=opt)
    train(bare, 3, n=21, opt=ref_opt)
    params_close(model, bare)
    assert dp._split.settled and dp._last_step.chunk_sizes[0] < 7
    assert dp.report().steps == 3  # the failed attempt is not a step


def test_the_failed_attempt_leaves_nothing_alive_before_the_retry():
    model = mlp()
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 3, oom="rebalance")
    fastdp.inject_oom(dp, 2, above=5)
    outputs, alive_at_retry = [], []

    def hook(module, inputs, output):
        if len(outputs) == 2:  # positions 0 and 1 ran in the failed attempt; this is the retry's first call
            alive_at_retry.append([r() is not None for r in outputs])
        outputs.append(weakref.ref(output))

    model.register_forward_hook(hook)
    with pytest.warns(RuntimeWarning):
        dp(data(18)[0])
    assert alive_at_retry == [[False, False]]


def test_forward_oom_twice_raises_the_first_error_with_advice_and_leaves_nothing_changed():
    model = bn_model()
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 3, oom="rebalance")
    fastdp.inject_oom(dp, 1)  # every attempt fails
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.warns(RuntimeWarning), pytest.raises(torch.OutOfMemoryError) as info:
        dp(data(18)[0]).sum().backward()
    text = str(info.value) + "\n".join(getattr(info.value, "__notes__", []))
    assert "position 1" in text and "6 -> 4 rows of 18" in text and "failed too" in text
    assert "criterion=" in text and "a smaller batch" in text
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    assert all(p.grad is None for p in model.parameters())


def test_without_rebalance_the_error_is_raised_as_it_is():
    dp = fastdp.DataParallel(mlp(), device_ids=["cpu"] * 2)
    fastdp.inject_oom(dp, 1)
    with pytest.raises(torch.OutOfMemoryError) as info:
        dp(data(8)[0])
    assert "oom='rebalance'" not in str(info.value) + "".join(getattr(info.value, "__notes__", []))


def test_train_step_rescues_a_backward_oom_and_grads_count_each_step_once():
    bare = mlp()
    model = copy.deepcopy(bare)
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 3, criterion=nn.CrossEntropyLoss(), oom="rebalance",
                             bucket_cap_mb=1e-4)  # many buckets: some reach .grad before a later one fails
    x, y = data(18)
    dp.train_step(x, target=y)  # .grad exists now: the next step accumulates onto it
    params = list(model.parameters())
    arrived = []

    def fail_last_once(grad):  # the reduction of the last bucket fails (once), after the others reached .grad
        arrived.append(1)
        if len(arrived) == len(params):
            raise torch.OutOfMemoryError("CUDA out of memory (test): GPU 0 ran out during the reduction")
        return None

    for p in params:
        p.register_hook(fail_last_once)
    x2, y2 = data(18, seed=7)
    with pytest.warns(RuntimeWarning, match="position 0"):
        loss = dp.train_step(x2, target=y2)
    assert not loss.requires_grad
    for a, b in ((x, y), (x2, y2)):
        F.cross_entropy(bare(a), b).backward()
    for p, q in zip(model.parameters(), bare.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=TOL)
    assert dp._last_step.chunk_sizes[0] < 6


def test_train_step_backward_oom_injected_in_a_replica():
    bare = mlp()
    model = copy.deepcopy(bare)
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 3, oom="rebalance")
    injection = fastdp.inject_oom(dp, 2, phase="backward", above=4)
    x, y = data(15)
    with pytest.warns(RuntimeWarning, match="position 2"):
        dp.train_step(x, loss_fn=lambda out: F.cross_entropy(out, y))
    F.cross_entropy(bare(x), y).backward()
    for p, q in zip(model.parameters(), bare.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=TOL)
    assert injection.fired == 1 and dp._last_step.chunk_sizes[2] <= 4


class _OOMOnce(torch.autograd.Function):
    """Identity whose backward runs out of memory once, when `armed` says so (after some bucket's sum started)."""

    @staticmethod
    def forward(ctx, x, armed):
        ctx.armed = armed
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if ctx.armed():
            raise torch.OutOfMemoryError("CUDA out of memory (a test's, in the first layer's backward)")
        return g, None


def test_train_step_drops_the_sums_a_failed_backward_started(monkeypatch):
    """A backward that runs out of memory after some buckets' sums started never delivers them: the rescue drops them
    before the step runs again, so they hold no memory through the retry, and the step equals the bare model's."""
    started, fired = [], []

    def armed():
        if started and not fired:
            fired.append(True)
            return True
        return False

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = mlp(width=64)
            self.__dict__["armed"] = armed

        def forward(self, x):
            return self.body[1:](_OOMOnce.apply(self.body[0](x), self.armed))

    bare = Net()
    model = copy.deepcopy(bare)
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 3, oom="rebalance", bucket_cap_mb=1e-6)
    x, y = data(15)
    real_start = fastdp._reduction.reducer.start
    first_attempt = []  # weak references to the sums the failing backward started

    def start(bucket, grads):
        started.append(bucket.index)
        handed = real_start(bucket, grads)
        job = getattr(handed[0], "_fastdp_sum", None)  # a weak reference to the started sum
        if job is not None and not fired:
            first_attempt.append(job)
        return handed

    monkeypatch.setattr(fastdp._reduction.reducer, "start", start)
    with pytest.warns(RuntimeWarning):
        dp.train_step(x, loss_fn=lambda out: F.cross_entropy(out, y))
    assert fired and first_attempt  # sums were in flight at the failure
    assert [r() for r in first_attempt] == [None] * len(first_attempt)  # and none outlived it (no collection needed)
    started.append(-1)  # the bare model: no failure (fired already)
    F.cross_entropy(bare(x), y).backward()
    for p, q in zip(model.parameters(), bare.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=TOL)


def test_train_step_failing_twice_leaves_grads_and_buffers_as_they_were():
    model = bn_model()
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 3, oom="rebalance")
    x, y = data(18)
    dp.train_step(x, loss_fn=lambda out: F.cross_entropy(out, y))
    grads = [p.grad.clone() for p in model.parameters()]
    buffers = [b.clone() for b in model.buffers()]
    fastdp.inject_oom(dp, 1, phase="backward")
    with pytest.warns(RuntimeWarning), pytest.raises(torch.OutOfMemoryError) as info:
        dp.train_step(x, loss_fn=lambda out: F.cross_entropy(out, y))
    assert "failed too" in "".join(getattr(info.value, "__notes__", [])) + str(info.value)
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)
    for b, c in zip(model.buffers(), buffers):
        torch.testing.assert_close(b, c, rtol=0, atol=0)


@pytest.mark.parametrize("kwargs, text", [
    ({"position": 3}, "position=3 must be a device_ids position in [0, 3)"),
    ({"position": 0, "phase": "optimizer"}, "phase='optimizer' must be 'forward' or 'backward'"),
    ({"position": 0, "above": -1}, "above=-1 must be a non-negative int"),
    ({"position": 0, "times": 0}, "times=0 must be None or a positive int"),
])
def test_inject_oom_checks_its_arguments(kwargs, text):
    dp = fastdp.DataParallel(mlp(), device_ids=["cpu"] * 3)
    with pytest.raises(ValueError) as info:
        fastdp.inject_oom(dp, **kwargs)
    assert text in str(info.value)


def test_train_step_needs_a_scalar_loss():
    dp = fastdp.DataParallel(mlp(), device_ids=["cpu"] * 2)
    with pytest.raises(TypeError, match="one-element loss tensor"):
        dp.train_step(data(4)[0])


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
