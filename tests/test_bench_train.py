"""Smoke test of ``python -m fastdp.bench train``: tiny settings on the CPU, exit status and CSV columns only."""

import csv
import os
import subprocess
import sys

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
