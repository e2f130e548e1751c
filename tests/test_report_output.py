"""What ``dp.report()`` gives back on emulated replicas: the readings of one measured run (text, HTML, CSV, dict,
Chrome trace, PNG, and its ranges in a torch profiler trace), what a newcomer reads in the text and the picture (which
steps the numbers are, emulated replicas taking turns, a report before any step, a wrapper without a GPU), and the
advice it draws on constructed cases (memory, waits, the GIL; none for a balanced run).

Timings only against injected sleeps, with generous bounds (never a speed), on one torch thread (conftest's
``one_torch_thread``).
"""

import csv
import importlib
import json
import re
import statistics
import sys

import pytest
import torch
import torch.nn as nn

import fastdp
from fastdp._balance import memory as _memory
from fastdp._report import recorder as _recorder, report as _report

from _fake_cuda import FakeCuda
from _report_cases import data, mlp, sleep_in_forward, train

pa = importlib.import_module("fastdp.parallel_apply")
_devices = importlib.import_module("fastdp._platform.devices")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


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
    assert "wait: others" in text and "peak memory" in text and "memory now" in text


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


# ---- what a newcomer reads: each message names its cause (and the fix, where there is one) ---------------------


def _words(text):
    return " ".join(text.split())  # the picture wraps its lines


def _picture(report, tmp_path, monkeypatch):
    """The figure ``report.plot`` draws, caught as it is saved, and every text on it."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure
    from matplotlib.text import Text

    drawn = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *args, **kwargs: (drawn.append(fig), save(fig, *args, **kwargs)))
    report.plot(tmp_path / "report.png")
    fig = drawn[0]
    return fig, _words(" ".join(t.get_text() for t in fig.findobj(Text)))


def _step_spans(report):
    """Each summarised (training, backward seen) step's length in ms, from its recorded ranges."""
    ranges = report.to_dict()["ranges"]
    steps = {r["step"] for r in ranges if r["training"] and r["phase"] == "backward"}
    return {s: max(r["end_ms"] for r in ranges if r["step"] == s) for s in steps}


def test_headline_table_and_picture_say_which_steps_they_show(measured, tmp_path, monkeypatch):
    _, report = measured
    spans = _step_spans(report)
    assert len(spans) == report.steps and report.step_ms == pytest.approx(statistics.median(spans.values()))
    covers = f"medians over {report.steps} training steps"
    assert covers in report.headline() and f"{report.step_ms:.2f} ms" in report.headline()
    assert f"per replica ({covers})" in str(report) and f"per phase ({covers})" in str(report)
    fig, words = _picture(report, tmp_path, monkeypatch)
    assert covers in words
    # the picture draws a step nearest the median (of an even count, the two middle ones are), and says so
    least = min(abs(ms - report.step_ms) for ms in spans.values())
    nearest = [s for s, ms in spans.items() if abs(ms - report.step_ms) == pytest.approx(least, abs=1e-9)]
    drawn = [s for s in nearest if f"step {s} ({spans[s]:.2f} ms), the one nearest the median" in words]
    assert len(drawn) == 1, words
    assert max(bar.get_x() + bar.get_width() for bar in fig.axes[0].patches) == pytest.approx(spans[drawn[0]])


def _gpu_report(monkeypatch):
    """A report of one step recorded on two (fake) distinct GPUs."""
    FakeCuda(2).install(monkeypatch)
    rec = _recorder.Recorder(2)
    step = rec.begin([0, 1], True)
    step.rows = [4, 4]
    for pos in (0, 1):
        for phase in ("forward", "backward"):
            rec.record(phase, pos, rec.stamp(pos), rec.stamp(pos))
    return _report.build(rec, _report.Setup([0, 1], None, False, 2**20), lambda: _memory.MemoryReport([]))


def test_emulated_replicas_are_said_to_take_turns_in_the_text_and_the_picture(measured, tmp_path, monkeypatch):
    _, report = measured
    text = str(report)
    for words in (_words(text), _picture(report, tmp_path, monkeypatch)[1]):
        assert "emulated 'cpu' replicas take turns" in words and "each starts when the one before ends" in words
        assert "'wait: others' is the wait each would have side by side, as GPUs run them" in words
    assert text.index("take turns") < text.index("per phase")  # under the table whose waits it explains
    assert "take turns" not in str(_gpu_report(monkeypatch))  # GPUs run side by side


def test_the_report_ends_with_its_advice_and_says_each_thing_once(measured):
    _, report = measured
    text = str(report)
    lines = [line for line in text.splitlines() if line.strip()]
    advice = lines.index(next(line for line in lines if line.startswith("advice")))
    assert lines[advice + 1:] == [f"  - {a.text}" for a in report.advice]
    assert len(lines) == len(set(lines))
    for note in report.notes:  # each note stands under the replicas' table, whose numbers it explains
        assert text.index(note) < text.index("per phase")


def test_a_report_before_any_step_says_nothing_was_recorded_yet_and_why(tmp_path, monkeypatch):
    dp = fastdp.DataParallel(mlp(), device_ids=["cpu"] * 2, report=True)
    report = dp.report()
    text = _words(str(report))
    assert report.steps == 0 and "no step to summarise yet" in report.headline()
    why = "nothing recorded yet: no forward of this wrapper has run since recording was turned on"
    fix = "run training steps (forward and backward), then call dp.report()"
    assert why in text and fix in text
    assert "evaluation" not in text and "per replica" not in text  # no table of dashes
    words = _picture(report, tmp_path, monkeypatch)[1]
    assert why in words and fix in words
    dp(data(6)[0])  # a training forward whose backward has not run
    text = _words(str(dp.report()))
    assert "the last training step is left out: its backward has not run yet" in text
    assert "call dp.report() after loss.backward() to include it" in text


def test_a_pass_through_wrapper_names_the_missing_gpu_and_the_fix(monkeypatch):
    monkeypatch.setattr(_devices, "cuda_available", lambda: False)
    dp = fastdp.DataParallel(mlp(), report=True)
    with pytest.raises(RuntimeError, match=r"no GPU is visible and device_ids was not given.*"
                                           r"pass device_ids=\['cpu'\] \* N for N emulated replicas"):
        dp.report()


def test_the_pictures_words_are_readable_and_the_tables(measured, tmp_path, monkeypatch):
    _, report = measured
    fig, words = _picture(report, tmp_path, monkeypatch)
    footer = [t for t in fig.texts if "advice" in t.get_text()]
    assert footer and min(t.get_fontsize() for t in footer) >= 9
    assert "`" not in words + str(report) and "advice from" not in words
    for a in report.advice:
        assert _words(a.text) in words
    columns = re.split(r"\s{2,}", str(report.memory).splitlines()[0].strip())
    holders = [t.get_text() for t in fig.axes[1].get_legend().get_texts()]
    assert holders and all(any(c in h for c in columns) for h in holders), (holders, columns)
    model = [h for h in holders if "model" in h]
    assert model and "not fastdp's" in model[0]  # the table's "fastdp total" leaves it out too


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
    return _report.advise(report, wrapper._report_setup())


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
