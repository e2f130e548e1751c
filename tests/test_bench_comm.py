"""``python -m fastdp.bench comm`` on the CPU: its memory with the default sizes, and what its percentages mean in
the table and the CSV. Exit status, columns and printed lines only: timings are never asserted."""

import csv
import os
import subprocess
import sys

import pytest

import fastdp

MB = 1 << 20
# Runs the benchmark as a child and prints the child's peak resident set (kB), measured by the kernel.
_PEAK = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
         "print('peak_kb', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)")


def _env():
    # The subprocess imports the same fastdp as this process, wherever it was installed or built.
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(fastdp.__file__))] + [p for p in [os.environ.get("PYTHONPATH")] if p]))


def _comm(args, cwd, peak=False):
    cmd = [sys.executable, "-m", "fastdp.bench", "comm", *args]
    if peak:
        cmd = [sys.executable, "-c", _PEAK, *cmd]
    return subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300)


def _import_peak_kb(cwd):
    """The peak resident set of a child that only imports torch and the benchmark: what the benchmark's own memory
    comes on top of (some 0.3 GB with torch's CPU build, 0.75 GB with a CUDA build's libraries)."""
    code = "import torch, fastdp.bench.comm"
    proc = subprocess.run([sys.executable, "-c", _PEAK, sys.executable, "-c", code], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return int(proc.stdout.rsplit("peak_kb", 1)[1])


def test_default_sizes_bound_the_memory(tmp_path):
    """Every size holds its buffers at once (some 19 times the size at 4 entries, 5 GB at 256 MB): the default
    sizes add under 1 GiB to what importing torch takes, so the benchmark fits a small machine; larger sizes are
    asked for with --sizes-mb."""
    proc = _comm(["--seconds", "0.01", "--out", str(tmp_path)], tmp_path, peak=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    peak_kb = int(proc.stdout.rsplit("peak_kb", 1)[1])
    added_kb = peak_kb - _import_peak_kb(tmp_path)
    assert added_kb < 1 << 20, f"the default sizes added {added_kb / 1024:.0f} MiB (peak {peak_kb / 1024:.0f} MiB)"
    assert "--sizes-mb" in proc.stdout  # the header says how to measure other sizes


def test_table_and_csv_name_what_each_percentage_compares(tmp_path):
    proc = _comm(["--sizes-mb", "1,2", "--seconds", "0.01", "--out", str(tmp_path)], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    # What 100% is, and why several destinations or reduce's input counting can pass it.
    assert "100% = one memcpy" in out, out
    assert "3 destinations" in out and "4 inputs" in out, out
    # A line per size as it goes: the measuring line comes before that size's row.
    lines = out.splitlines()
    for mb in (1, 2):
        start = next(i for i, line in enumerate(lines) if line.startswith(f"measuring {mb} MB"))
        row = next(i for i, line in enumerate(lines) if line.startswith("host") and f" {mb} MB " in line)
        assert start < row, out
    with open(tmp_path / "comm.csv", newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert {"gb_s", "copy_limit_gb_s", "percent_of_limit", "bytes_counted", "counted_as",
            "limit_reference"} <= set(reader.fieldnames)
    assert len(rows) == 2 * 5
    by = {(r["operation"], int(r["size_mb"])): r for r in rows}
    for mb in (1, 2):
        assert int(by["broadcast", mb]["bytes_counted"]) == 3 * mb * MB
        assert "3 destinations" in by["broadcast", mb]["counted_as"]
        assert int(by["reduce x4", mb]["bytes_counted"]) == 4 * mb * MB
        assert "4 inputs" in by["reduce x4", mb]["counted_as"]
        assert int(by["gather", mb]["bytes_counted"]) == mb * MB
    for r in rows:
        assert r["limit_reference"].startswith("memcpy"), r
        assert float(r["percent_of_limit"]) == pytest.approx(
            100 * float(r["gb_s"]) / float(r["copy_limit_gb_s"]), rel=0.02, abs=0.2)


@pytest.mark.parametrize("sizes", ["0", "1,zero", ","])
def test_bad_sizes_are_refused_with_the_form_expected(tmp_path, sizes):
    proc = _comm(["--sizes-mb", sizes, "--out", str(tmp_path)], tmp_path)
    assert proc.returncode == 2 and "--sizes-mb takes positive whole MB" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_samples_interleave_and_the_copy_limit_gets_twice_as_many():
    """Never the same call twice in a row (the second would find its buffers in the cache), every operation once
    per round, the copy limit (the reference of every percentage) twice."""
    from fastdp.bench import comm as bench_comm

    calls = []
    fns = [(name, (lambda n=name: calls.append(n))) for name in ("copy limit", "a", "b", "c", "d", "e")]
    per_call = bench_comm.measure(fns, lambda: None, seconds=0.0)
    assert set(per_call) == {name for name, _ in fns}
    timed = calls[len(fns):]  # after one untimed call of each
    assert all(x != y for x, y in zip(timed, timed[1:])), timed
    assert timed.count("copy limit") == 2 * timed.count("a") == 2 * bench_comm.MIN_ROUNDS
