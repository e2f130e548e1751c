"""``python -m fastdp.bench growth``: how the wrapper's host cost per step grows with the number of parameter tensors,
gradient buckets and replicas, for the installed fastdp and, with ``--against PYTHON``, for the fastdp another
interpreter imports (an earlier release in its own virtual environment), in alternated rounds.

The model is fastdp.bench.workloads.Chain (N bias-free Linear(8, 8) layers: N tensors of 64 values, so bytes and
compute stay small and what grows is the bookkeeping). The cost measured is the one ``--params`` measures:
replicate plus the gradient reduction calls, host-side times. Buckets are set by ``bucket_cap_mb``: N tensors of 256
bytes in B buckets of ceil(N / B) tensors each (tests/test_bench_train.py checks that the wrapper makes B).

Every round runs one fresh process per tree, which measures every configuration once (the steps of a
configuration are consecutive) and prints one JSON line; medians are over rounds. The child is this file run as a
script by the tree's interpreter, so an earlier release needs no growth benchmark of its own, only
fastdp.bench.phases and workloads, which every release since the per-tensor sweep has.
"""

import json
import math
import os
import statistics
import subprocess
import sys
import time

__all__ = ["main"]

TENSOR_BYTES = 64 * 4  # one Linear(8, 8) weight in float32


def _counts(parser, text, name):
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        parser.error(f"--{name} takes positive integers, comma-separated (e.g. 1,10,100), got {text!r}")
    return values


def bucket_cap_mb(tensors, buckets):
    """The ``bucket_cap_mb`` that makes `tensors` Linear(8, 8) weights into `buckets` gradient buckets (where
    `buckets` divides `tensors`, as in the default grid)."""
    return math.ceil(tensors / buckets) * TENSOR_BYTES / 2**20


def _measure(tensors, buckets, replicas, steps, warmup):
    """One configuration in this process: (replicate + reduction ms, step ms) per step."""
    import torch

    import fastdp
    from fastdp.bench import phases, workloads

    torch.manual_seed(0)
    module = workloads.Chain(tensors)
    x = torch.randn(4 * replicas, 8)
    opt = torch.optim.SGD(module.parameters(), lr=1e-3)
    dp = phases.timed(fastdp.DataParallel(module, device_ids=["cpu"] * replicas,
                                          bucket_cap_mb=bucket_cap_mb(tensors, buckets)))
    split = phases.Split(None)

    def loss(out, _target):
        return out.sum()

    with phases.instrumented(split, module, "fastdp"):
        for _ in range(warmup):
            phases.timed_step(dp, x, None, opt, split, loss=loss)
        split.reset()
        total = sum(phases.timed_step(dp, x, None, opt, split, loss=loss) for _ in range(steps))
    wrapper = split.phases.get("replicate", 0.0) + split.phases.get("reduction", 0.0)
    return 1e3 * wrapper / steps, 1e3 * total / steps


def _child(args):
    import torch

    import fastdp

    torch.set_num_threads(1)
    rows = []
    for t in args.tensors:
        for b in args.buckets:
            for r in args.replicas:
                host_ms, step_ms = _measure(t, b, r, args.steps, args.warmup)
                rows.append({"tensors": t, "buckets": b, "replicas": r, "host_ms": host_ms, "step_ms": step_ms})
    print(json.dumps({"version": fastdp.__version__, "torch": torch.__version__,
                      "where": os.path.dirname(fastdp.__file__), "rows": rows}))


def _run_round(python, argv):
    # Bounded: a child that hangs must not hold the benchmark (the default grid's slowest round takes minutes).
    out = subprocess.run([python, os.path.abspath(__file__), "--child", *argv], capture_output=True, text=True,
                         timeout=3600)
    if out.returncode != 0:
        raise SystemExit(f"{python}: the growth benchmark failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _table(trees, medians, args):
    names = list(trees)
    widths = {n: max(16, len(n) + 6) for n in names}
    head = f"{'tensors':>8}{'buckets':>8}{'replicas':>9}"
    for n in names:
        head += f"{n + ' ms':>{widths[n]}}{'µs/tensor':>11}"
    print(head)
    for t in args.tensors:
        for b in args.buckets:
            for r in args.replicas:
                line = f"{t:>8}{b:>8}{r:>9}"
                for n in names:
                    ms = medians[n][(t, b, r)]
                    line += f"{ms:>{widths[n]}.3f}{1e3 * ms / t:>11.2f}"
                print(line)


def main(argv=None):
    import argparse

    p = argparse.ArgumentParser(prog="python -m fastdp.bench growth", description=__doc__.split("\n\n")[0])
    p.add_argument("--tensors", default="100,1000,10000")
    p.add_argument("--buckets", default="1,10,100")
    p.add_argument("--replicas", default="2,4,8", help="emulated 'cpu' replicas")
    p.add_argument("--steps", type=int, default=3, help="timed steps per configuration and round")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3, help="alternated rounds; medians over rounds")
    p.add_argument("--against", default="", metavar="PYTHON", help="another interpreter whose fastdp is compared")
    p.add_argument("--name", default="this tree", help="what to call the installed fastdp in the table")
    p.add_argument("--against-name", default="release", help="what to call --against's fastdp")
    p.add_argument("--out", default="bench-out", help="folder for growth.csv")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.tensors, args.buckets = _counts(p, args.tensors, "tensors"), _counts(p, args.buckets, "buckets")
    args.replicas = _counts(p, args.replicas, "replicas")
    if any(r < 2 for r in args.replicas):
        p.error(f"--replicas: each count must be at least 2 (one replica reduces nothing), got {args.replicas}")
    if args.steps < 1 or args.rounds < 1 or args.warmup < 0:
        p.error("--steps and --rounds take at least 1, --warmup at least 0")
    if args.child:
        return _child(args)
    passed = [f"--tensors={','.join(map(str, args.tensors))}", f"--buckets={','.join(map(str, args.buckets))}",
              f"--replicas={','.join(map(str, args.replicas))}", f"--steps={args.steps}", f"--warmup={args.warmup}"]
    trees = {args.name: sys.executable}
    if args.against:
        trees[args.against_name] = args.against
    started = time.perf_counter()
    print("command: python -m fastdp.bench growth " + " ".join(passed) + f" --rounds={args.rounds}"
          + (f" --against {args.against}" if args.against else ""))
    print(f"CPU, {os.cpu_count()} cores, 1 torch thread; model: N x Linear(8, 8) (N tensors of 256 bytes), "
          "B buckets by bucket_cap_mb, R emulated 'cpu' replicas; host ms = replicate + reduction calls per step; "
          f"medians of {args.rounds} alternated rounds x {args.steps} steps (+{args.warmup} warm-up)")
    print("load average at start: " + " ".join(f"{v:.2f}" for v in os.getloadavg()))
    per_round = {n: [] for n in trees}
    info = {}
    for k in range(args.rounds):
        order = list(trees) if k % 2 == 0 else list(reversed(trees))
        for n in order:
            result = _run_round(trees[n], passed)
            info[n] = f"fastdp {result['version']} from {result['where']}, torch {result['torch']}"
            per_round[n].append({(r["tensors"], r["buckets"], r["replicas"]): r for r in result["rows"]})
    medians = {n: {key: statistics.median(rd[key]["host_ms"] for rd in per_round[n]) for key in per_round[n][0]}
               for n in trees}
    for n in trees:
        print(f"{n}: {info[n]}")
    print()
    _table(trees, medians, args)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "growth.csv")
    with open(path, "w") as f:
        f.write("tree,tensors,buckets,replicas,host_ms,us_per_tensor\n")
        for n in trees:
            for (t, b, r), ms in medians[n].items():
                f.write(f"{n},{t},{b},{r},{ms:.4f},{1e3 * ms / t:.3f}\n")
    print(f"wrote {path}")
    print("load average at end: " + " ".join(f"{v:.2f}" for v in os.getloadavg()))
    print(f"total time {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
