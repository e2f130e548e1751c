"""What ``dp.report()``'s recording costs: off (the tests its sites pay while the wrapper's recorder is None) and on
(a training step with the report recording, against the same wrapper with it off), on the training benchmark's
models. Prints tables and writes bench-out/report_cost.csv; asserts nothing.

Off: a step pays one test per recording site while nothing records. Those tests are timed here as the step runs
them (the same attribute reads and comparisons, in a loop), because a difference of well under a microsecond cannot
be resolved by timing whole steps that vary by tens of microseconds from run to run.
On: rounds alternate off and on for the same wrapper and batch, in pairs whose order flips each round; the ratio
reported is the median over rounds of each pair's on/off, so a machine whose speed drifts (other jobs) moves both
halves of a pair alike.
"""

import csv
import os
import statistics
import time
import timeit

import torch
import torch.nn.functional as F

from .. import DataParallel
from . import workloads


class _Holder:
    """Stands in for the wrapper (its __dict__) and the step (a slotted object) in the off-path timing."""

    __slots__ = ("recorder", "site")

    def __init__(self):
        self.recorder = self.site = None


def off_path_ns(replicas, repeat=7, number=200_000):
    """ns per step of what the recording sites cost while the report is off: per step, the wrapper's two settings
    read from its __dict__, the step's recorder set and tested in the four phases and the parallel_apply method,
    and one test per replica where it runs."""
    wrapper_dict = {"_recorder": None, "_oom": None}
    step = _Holder()

    def sites():
        step.recorder = wrapper_dict.get("_recorder")
        if wrapper_dict.get("_oom") is not None:
            pass
        rec = step.recorder
        if rec is not None:
            pass
        if rec is not None:
            pass
        if rec is not None:
            pass
        if rec is not None:
            pass
        site = step.site
        for _ in range(replicas):
            if site is None:
                pass

    def baseline():
        for _ in range(replicas):
            pass

    def best(fn):
        return min(timeit.repeat(fn, repeat=repeat, number=number)) / number * 1e9

    return best(sites) - best(baseline)


def _steps(dp, opt, x, y, n):
    t0 = time.perf_counter()
    for _ in range(n):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(dp(x), y).backward()
        opt.step()
    return (time.perf_counter() - t0) / n


def on_vs_off(model_name, replicas, rounds, steps, warmup):
    """(median ms per step off, median ms per step on, median of the rounds' on/off ratios)."""
    torch.manual_seed(0)
    module, x, y, _ = workloads.build(model_name, "cpu", 0)
    dp = DataParallel(module, device_ids=["cpu"] * replicas)
    opt = torch.optim.SGD(dp.parameters(), lr=1e-3)
    off, on, ratios = [], [], []
    for r in range(rounds):
        order = ("off", "on") if r % 2 == 0 else ("on", "off")
        got = {}
        for mode in order:
            if mode == "on":
                dp.enable_report()
            else:
                dp.disable_report()
            _steps(dp, opt, x, y, warmup)
            got[mode] = _steps(dp, opt, x, y, steps)
        off.append(got["off"])
        on.append(got["on"])
        ratios.append(got["on"] / got["off"])
    return statistics.median(off) * 1e3, statistics.median(on) * 1e3, statistics.median(ratios)


def run(args):
    torch.set_num_threads(args.threads or 1)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    print(f"report off: the recording sites' tests per step ({args.replicas} replicas)")
    ns = off_path_ns(args.replicas)
    print(f"  {ns:.0f} ns per step (target: within 1 µs)")
    rows.append({"what": "off: recording sites per step", "model": "", "replicas": args.replicas,
                 "off_ms": "", "on_ms": "", "ratio": "", "ns_per_step": round(ns, 1)})
    print(f"\nreport on / off: ms per training step, medians over {args.rounds} interleaved rounds of {args.steps} "
          f"steps, {args.replicas} emulated replicas, {torch.get_num_threads()} torch thread(s) (target: ratio "
          "<= 1.02)")
    print(f"{'model':<13}{'off':>10}{'on':>10}{'on/off':>9}")
    for name in args.models.split(","):
        off, on, ratio = on_vs_off(name, args.replicas, args.rounds, args.steps, args.warmup)
        print(f"{name:<13}{off:>10.3f}{on:>10.3f}{ratio:>9.3f}")
        rows.append({"what": "on/off", "model": name, "replicas": args.replicas, "off_ms": round(off, 4),
                     "on_ms": round(on, 4), "ratio": round(ratio, 4), "ns_per_step": ""})
    path = os.path.join(args.out, "report_cost.csv")
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")
    return 0
