"""Smoke test of ``python -m fastdp.bench train``: tiny settings on the CPU, exit status and CSV columns only."""

import csv
import os
import subprocess
import sys
import time

import pytest
import torch

import fastdp

EXPECTED_COLUMNS = {
    "model", "config", "wrapper", "device_ids", "replicas", "batch", "steps_per_s", "ratio_to_bare", "step_ms",
    "scatter_ms", "replicate_ms", "replica_fwd_ms", "gather_ms", "replica_bwd_ms", "reduction_ms",
    "overhead_ms", "peak_mem", "error",
}


def test_train_bench_runs_on_cpu_and_writes_csv(tmp_path):
    # The subprocess imports the same fastdp as this process, wherever it was installed or built.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(fastdp.__file__))] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    cmd = [sys.executable, "-m", "fastdp.bench", "train", "--device", "cpu", "--models", "mlp,cnn,transformer",
           "--replicas", "2", "--batch", "4", "--steps", "2", "--warmup", "1", "--rounds", "1",
           "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "command:" in proc.stdout
    with open(tmp_path / "train.csv", newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert EXPECTED_COLUMNS <= set(reader.fieldnames)
    assert {r["model"] for r in rows} == {"mlp", "cnn", "transformer"}
    assert {r["wrapper"] for r in rows} == {"bare", "fastdp"}
    assert all(r["error"] == "" and float(r["steps_per_s"]) > 0 for r in rows)
    # The x1 split measures the path users run: fastdp's one-device short path calls no scatter.
    x1 = [r for r in rows if r["wrapper"] == "fastdp" and r["replicas"] == "1"]
    assert len(x1) == 3 and all(r["scatter_ms"] == "n/a" and r["replicate_ms"] == "n/a" for r in x1)
    multi = [r for r in rows if r["wrapper"] == "fastdp" and r["replicas"] == "2"]
    assert all(float(r["scatter_ms"]) > 0 and float(r["replicate_ms"]) > 0 for r in multi)
    assert "1 torch threads" in proc.stdout  # --threads defaults to 1 on the CPU


def _run(bench, args, cwd, timeout=120):
    """``python -m fastdp.bench <bench> args`` in a child that imports the same fastdp as this process."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(fastdp.__file__))] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    return subprocess.run([sys.executable, "-m", "fastdp.bench", bench, *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _bench(args, cwd):
    return _run("train", args, cwd)


def test_params_sweep_prints_per_tensor_cost_and_writes_csv(tmp_path):
    proc = _bench(["--device", "cpu", "--params", "3,12", "--replicas", "2", "--steps", "2", "--warmup", "1",
                   "--rounds", "1", "--threads", "2", "--out", str(tmp_path)], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 torch threads" in proc.stdout and "torch.nn.DataParallel cannot run on the CPU" in proc.stdout
    with open(tmp_path / "params.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["tensors"], r["wrapper"]) for r in rows] == [("3", "fastdp"), ("12", "fastdp")]
    for r in rows:
        assert r["error"] == ""
        rep, red, per = float(r["replicate_ms"]), float(r["reduction_ms"]), float(r["us_per_tensor"])
        assert rep > 0 and red > 0
        assert abs(per - 1e3 * (rep + red) / int(r["tensors"])) <= 0.05 + 1e-3 * per  # CSV rounds to 1e-4 ms


def test_params_sweep_rejects_bad_counts(tmp_path):
    proc = _bench(["--device", "cpu", "--params", "10,zero", "--out", str(tmp_path)], tmp_path)
    assert proc.returncode == 2 and "--params takes positive tensor counts" in proc.stderr, proc.stderr
    proc = _bench(["--device", "cpu", "--threads", "-1", "--out", str(tmp_path)], tmp_path)
    assert proc.returncode == 2 and "--threads" in proc.stderr, proc.stderr


def test_the_cpu_clock_counts_this_process_work_only():
    """--clock cpu: a phase that waits (as a step preempted by another process does) costs its wall time on the
    wall clock and next to nothing on the CPU clock; work counts on both."""
    from fastdp.bench import phases

    def wait_then_work():
        time.sleep(0.2)
        deadline = time.process_time() + 0.05
        while time.process_time() < deadline:
            pass

    wall, cpu = phases.Split(None, phases.CLOCKS["wall"]), phases.Split(None, phases.CLOCKS["cpu"])
    wall.timed("phase", wait_then_work)
    cpu.timed("phase", wait_then_work)
    assert wall.phases["phase"] >= 0.25
    assert 0.05 <= cpu.phases["phase"] < 0.15


def test_params_sweep_on_the_cpu_clock_says_so(tmp_path):
    proc = _bench(["--device", "cpu", "--params", "3", "--replicas", "2", "--steps", "1", "--warmup", "0",
                   "--rounds", "1", "--clock", "cpu", "--out", str(tmp_path)], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "--clock cpu" in proc.stdout and "clock: cpu (this process's CPU time" in proc.stdout
    with open(tmp_path / "params.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and all(r["error"] == "" and float(r["replicate_ms"]) > 0 for r in rows)
    proc = _bench(["--device", "cpu", "--clock", "cpu", "--out", str(tmp_path)], tmp_path)
    assert proc.returncode == 2 and "--clock applies to the per-tensor sweep only" in proc.stderr, proc.stderr


def _growth(args, cwd):
    return _run("growth", args, cwd, timeout=300)


def test_growth_table_covers_every_configuration_for_both_trees(tmp_path):
    # --against names the same interpreter: the comparison machinery runs, both columns from one fastdp.
    proc = _growth(["--tensors", "6,12", "--buckets", "1,3", "--replicas", "2,3", "--steps", "1", "--warmup", "0",
                    "--rounds", "2", "--against", sys.executable, "--out", str(tmp_path)], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(tmp_path / "growth.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    keys = {(r["tree"], r["tensors"], r["buckets"], r["replicas"]) for r in rows}
    assert keys == {(tree, t, b, r) for tree in ("this tree", "release") for t in ("6", "12") for b in ("1", "3")
                    for r in ("2", "3")}
    for r in rows:
        assert float(r["host_ms"]) > 0


@pytest.mark.parametrize("tensors,buckets", [(6, 1), (6, 3), (12, 4), (100, 10), (1000, 100)])
def test_growth_bucket_cap_makes_the_bucket_count_the_table_names(tensors, buckets):
    from fastdp.bench import growth, workloads

    dp = fastdp.DataParallel(workloads.Chain(tensors), device_ids=["cpu"] * 2,
                             bucket_cap_mb=growth.bucket_cap_mb(tensors, buckets))
    dp(torch.randn(4, 8)).sum().backward()
    assert len(dp._replica_set.reduced) == buckets


def test_growth_rejects_bad_counts(tmp_path):
    proc = _growth(["--buckets", "1,none"], tmp_path)
    assert proc.returncode == 2 and "--buckets takes positive integers" in proc.stderr, proc.stderr
    proc = _growth(["--replicas", "1,2"], tmp_path)
    assert proc.returncode == 2 and "--replicas" in proc.stderr and "at least 2" in proc.stderr, proc.stderr


def test_params_sweep_with_ddp_measures_ddp_against_the_bare_module(tmp_path):
    proc = _bench(["--device", "cpu", "--params", "5", "--replicas", "2", "--steps", "2", "--warmup", "1",
                   "--rounds", "2", "--ddp", "--out", str(tmp_path)], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(tmp_path / "params.csv", newline="") as f:
        rows = {r["wrapper"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"fastdp", "ddp", "bare"} and not any(r["error"] for r in rows.values()), rows
    # fastdp stays the single-process wrapper although DDP's one-process group exists: it replicates.
    assert rows["fastdp"]["replicas"] == "2" and float(rows["fastdp"]["replicate_ms"]) > 0
    assert rows["ddp"]["replicas"] == "1" and float(rows["ddp"]["replicate_ms"]) == 0
    assert float(rows["bare"]["step_ms"]) > 0 and "(the reference step)" in proc.stdout
