"""``python -m fastdp.bench report``: a smoke run with tiny settings on the CPU (exit status, what it prints, its CSV's
columns) and its statistics against a reference."""

import csv
import os
import statistics
import subprocess
import sys

import fastdp
from fastdp.bench import report_cost

COLUMNS = ["what", "model", "replicas", "rounds", "off_ms", "off_cpu_ms", "site_us", "site_pct", "ratio", "ratio_lo",
           "ratio_hi", "ns_per_step", "target"]


def test_report_bench_prints_both_targets_and_writes_the_site_share_and_the_interval(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(fastdp.__file__))] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    cmd = [sys.executable, "-m", "fastdp.bench", "report", "--models", "mlp", "--replicas", "2", "--rounds", "3",
           "--steps", "1", "--warmup", "1", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "within 0.2 µs" in proc.stdout and "<= 1% of the step" in proc.stdout
    with open(tmp_path / "report_cost.csv", newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert reader.fieldnames == COLUMNS
    off, sites, mlp = rows
    assert off["target"] == "200 ns" and off["ns_per_step"] != ""
    assert sites["model"] == "tiny" and sites["site_us"] != ""
    assert mlp["model"] == "mlp" and mlp["target"] == "1%" and mlp["rounds"] == "3"
    # The sites' share is the tiny model's on - off against this model's own step with the report off, both in
    # the stepping thread's CPU time, which a step cannot spend more of than its wall time.
    assert abs(float(mlp["site_pct"]) - float(sites["site_us"]) / 1e3 / float(mlp["off_cpu_ms"]) * 100) < 0.01
    assert 0 < float(mlp["off_cpu_ms"]) <= float(mlp["off_ms"]) * 1.01
    assert float(mlp["ratio_lo"]) <= float(mlp["ratio"]) <= float(mlp["ratio_hi"])


def test_median_interval_is_the_median_between_the_binomial_ranks():
    # For 30 values a 95% interval for the median runs from the 10th to the 21st smallest (the binomial table's
    # ranks); with 5 or fewer values no narrower interval reaches 95%, so it is the whole range.
    values = [(7 * i) % 31 for i in range(30)]
    mid, lo, hi = report_cost.median_interval(values)
    ranked = sorted(values)
    assert (mid, lo, hi) == (statistics.median(values), ranked[9], ranked[20])
    assert report_cost.median_interval([3, 1, 2]) == (2, 1, 3)
    assert report_cost.median_interval([4, 1, 3, 2]) == (2.5, 1, 4)
