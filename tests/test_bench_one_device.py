"""``python -m fastdp.bench one-device``: a smoke run with tiny settings (exit status and what it prints)."""

import os
import re
import subprocess
import sys

import fastdp


def test_one_device_bench_prints_both_modes_with_the_difference():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(fastdp.__file__))] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    cmd = [sys.executable, "-m", "fastdp.bench", "one-device", "--blocks", "3", "--calls", "5"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert [("forward + backward" in line, "forward only" in line) for line in lines] == [(True, False),
                                                                                         (False, True)]
    for line in lines:
        bare, wrapped, added = map(float, re.search(r"bare (\S+) µs, wrapper (\S+) µs, added (\S+) µs", line).groups())
        assert bare > 0 and wrapped > 0 and "median of 3 blocks of 5" in line
