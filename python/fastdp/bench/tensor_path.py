"""Cost of turning tensors into core descriptors on each tensor path ("aoti": libtorch's C shim, "python": the
tensor's Python API), measured through ``_C.copy`` of many tiny CPU pairs (2 descriptors per pair), next to
``torch._foreach_copy_`` of the same pairs. Interleaved rounds, medians, one torch thread.

python -m fastdp.bench.tensor_path [--tensors 1000] [--numel 4] [--rounds 15] [--calls 20] [--out bench-out]
"""

import argparse
import csv
import os
import statistics
import sys
import time

import torch

from .. import _C
from .._native.core import tensor_shim_usable


def _per_call(fn, calls):
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def measure(tensors=1000, numel=4, rounds=15, calls=20):
    """{name: median seconds per call} for copy on each usable path and torch._foreach_copy_."""
    torch.set_num_threads(1)
    dst = [torch.empty(numel) for _ in range(tensors)]
    src = [torch.randn(numel) for _ in range(tensors)]
    available = ["python"] + (["aoti"] if _C.tensor_path()[0] == "aoti" or tensor_shim_usable() else [])
    previous = _C.tensor_path()[0]

    def on(path):
        def run():
            _C.set_tensor_path(path)
            _C.copy(dst, src)
        return run

    configs = {f"_C.copy ({p} path)": on(p) for p in available}
    configs["torch._foreach_copy_"] = lambda: torch._foreach_copy_(dst, src)
    samples = {name: [] for name in configs}
    try:
        for name, fn in configs.items():  # warm-up
            _per_call(fn, 2)
        for _ in range(rounds):
            for name, fn in configs.items():
                samples[name].append(_per_call(fn, calls))
    finally:
        _C.set_tensor_path(previous)
    return {name: statistics.median(v) for name, v in samples.items()}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m fastdp.bench.tensor_path", description=__doc__.split("\n")[0])
    p.add_argument("--tensors", type=int, default=1000, help="pairs per call")
    p.add_argument("--numel", type=int, default=4, help="elements per tensor")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds; medians over rounds are reported")
    p.add_argument("--calls", type=int, default=20, help="calls per configuration and round")
    p.add_argument("--out", default="bench-out", help="folder for the CSV")
    a = p.parse_args(argv)
    res = measure(a.tensors, a.numel, a.rounds, a.calls)
    print(f"torch {torch.__version__}, {a.tensors} CPU pairs of {a.numel} float32, 1 torch thread, "
          f"median of {a.rounds} interleaved rounds x {a.calls} calls; path in use: {_C.tensor_path()[0]}")
    print(f"{'configuration':<24} {'us/call':>10} {'ns/tensor':>10}")
    rows = []
    for name, sec in res.items():
        per_tensor = sec / (2 * a.tensors) * 1e9
        print(f"{name:<24} {sec * 1e6:>10.1f} {per_tensor:>10.1f}")
        rows.append((name, sec, per_tensor))
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "tensor_path.csv")
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["configuration", "seconds_per_call", "ns_per_tensor"])
        w.writerows(rows)
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
