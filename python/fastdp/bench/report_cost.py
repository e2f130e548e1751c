"""What ``dp.report()``'s recording costs: off (the tests its sites pay while the wrapper's recorder is None) and on
(a training step with the report recording, against the same wrapper with it off), on the training benchmark's
models. Prints tables and writes bench-out/report_cost.csv; asserts nothing.

Off: a step pays one test per recording site while nothing records. Those tests are timed here as the step runs
them (the same attribute reads and comparisons, in a loop), because a difference of well under a microsecond cannot
be resolved by timing whole steps that vary by tens of microseconds from run to run. Target: 0.2 µs per step.
On, two ways (target: 1% of the step):
- the recording sites' own cost per step: a tiny model's on - off (its step is almost nothing but the wrapper's
  own work, so what recording adds shows plainly), against each benchmark model's step with the report off, both
  in the stepping thread's CPU time (the recording is host work in that thread; CPU time leaves out the time other
  jobs hold the cores, which on a shared machine moves wall times by more than the recording costs);
- end to end: rounds alternate off and on for the same wrapper and batch, in pairs whose order flips each round;
  each round keeps the fastest of its steps per mode and gives one paired ratio (on / off of the same round, so a
  load that moves between rounds moves both); the median ratio is printed with a distribution-free 95% confidence
  interval (order statistics of the rounds' ratios): the interval's width is what the noise allowed to resolve.
"""

import csv
import math
import os
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
    """ns per step of what the recording sites cost while the report is off: per step, the step's two new slots
    set, the wrapper's two settings read from its __dict__, the recorder handed to the split's call, tested in the
    four phases and read by the parallel_apply method, and one test per replica where it runs (less the loop and
    the call they replace)."""
    wrapper_dict = {"_recorder": None, "_oom": None}
    step = _Holder()

    def takes(*args, recorder=None):
        return recorder

    def takes_plain(*args):
        return None

    def sites():
        step.recorder = step.site = None  # the step's two new slots
        step.recorder = wrapper_dict.get("_recorder")
        takes(1, recorder=step.recorder)  # the split's call gets the recorder
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
        takes_plain(1)
        for _ in range(replicas):
            pass

    def best(fn):
        # This thread's CPU time: a job on another core that preempts this one adds nothing to it.
        return min(timeit.repeat(fn, repeat=repeat, number=number, timer=time.thread_time)) / number * 1e9

    return best(sites) - best(baseline)


def _step(dp, opt, x, y):
    """(wall ns, the stepping thread's CPU ns) of one training step."""
    t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(dp(x), y).backward()
    opt.step()
    return time.perf_counter_ns() - t0, time.thread_time_ns() - c0


def _tiny(replicas):
    """A model so small that the recording dominates what the step adds: its on - off is the recording's own
    cost per step."""
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    return module, torch.randn(8 * replicas, 8), torch.randint(0, 4, (8 * replicas,))


def paired_rounds(model_name, replicas, rounds, steps, warmup):
    """Per round, (ns per step off, ns per step on) in wall time and in the stepping thread's CPU time: per clock the
    fastest of `steps` steps per mode, the two modes run one after the other in an order that flips each round."""
    torch.manual_seed(0)
    if model_name == "tiny":
        module, x, y = _tiny(replicas)
    else:
        module, x, y, _ = workloads.build(model_name, "cpu", 0)
    dp = DataParallel(module, device_ids=["cpu"] * replicas)
    opt = torch.optim.SGD(dp.parameters(), lr=1e-3)
    out = []
    for r in range(rounds):
        best = {}
        for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
            if mode == "on":
                dp.enable_report()
            else:
                dp.disable_report()
            for _ in range(warmup):
                _step(dp, opt, x, y)
            times = [_step(dp, opt, x, y) for _ in range(steps)]
            best[mode] = (min(t[0] for t in times), min(t[1] for t in times))
        out.append(((best["off"][0], best["on"][0]), (best["off"][1], best["on"][1])))
    return out


def median_interval(values):
    """(median, low, high): the median of `values` and a distribution-free 95% confidence interval for it, the
    order statistics whose ranks a fair coin's binomial places around the middle (the whole range for fewer than
    6 values, where no narrower interval reaches 95%)."""
    v = sorted(values)
    n = len(v)
    mid = v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2
    half = 0.98 * math.sqrt(n)  # 1.96 standard deviations of Binomial(n, 1/2), in ranks either side of the middle
    lo, hi = int(math.floor(n / 2 - half)), int(math.ceil(n / 2 + half)) - 1
    return mid, v[max(lo, 0)], v[min(hi, n - 1)]


def summarize(rounds):
    """The rounds of :func:`paired_rounds` as (median wall ms off, median wall on/off, its 95% interval low, high;
    median CPU ms off, median CPU on - off in µs)."""
    wall = [w for w, _ in rounds]
    cpu = [c for _, c in rounds]
    ratio, lo, hi = median_interval([b / a for a, b in wall])
    return (median_interval([a for a, _ in wall])[0] / 1e6, ratio, lo, hi,
            median_interval([a for a, _ in cpu])[0] / 1e6, median_interval([b - a for a, b in cpu])[0] / 1e3)


ON_TARGET = 0.01  # of the step
OFF_TARGET_NS = 200


def run(args):
    torch.set_num_threads(args.threads or 1)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    fields = dict.fromkeys(("what", "model", "replicas", "rounds", "off_ms", "off_cpu_ms", "site_us", "site_pct",
                            "ratio", "ratio_lo", "ratio_hi", "ns_per_step", "target"), "")
    print(f"report off: the recording sites' tests per step ({args.replicas} replicas)")
    ns = off_path_ns(args.replicas)
    verdict = "met" if ns <= OFF_TARGET_NS else "NOT met"
    print(f"  {ns:.0f} ns per step (target: within {OFF_TARGET_NS / 1e3:.1f} µs: {verdict})")
    rows.append({**fields, "what": "off: recording sites per step", "replicas": args.replicas,
                 "ns_per_step": round(ns, 1), "target": f"{OFF_TARGET_NS} ns"})
    print(f"\nreport on: {args.rounds} interleaved rounds, the fastest of {args.steps} steps per mode and round, "
          f"{args.replicas} emulated replicas, {torch.get_num_threads()} torch thread(s)")
    tiny = summarize(paired_rounds("tiny", args.replicas, args.rounds, args.steps, args.warmup))
    site_us = tiny[5]
    print(f"  the recording sites' own cost per step: {site_us:.1f} µs of CPU (median on - off of 'tiny': Linear(8, "
          f"8), ReLU, Linear(8, 4), whose step takes {tiny[4]:.3f} ms of CPU off)")
    rows.append({**fields, "what": "on: sites per step (tiny on - off)", "model": "tiny", "replicas": args.replicas,
                 "rounds": args.rounds, "off_ms": round(tiny[0], 4), "off_cpu_ms": round(tiny[4], 4),
                 "site_us": round(site_us, 1),
                 "ratio": round(tiny[1], 4), "ratio_lo": round(tiny[2], 4), "ratio_hi": round(tiny[3], 4)})
    print(f"\n{'model':<13}{'CPU ms':>9}{'sites %':>9}{'wall ms':>9}{'on/off':>9}{'95% interval':>18}   target: "
          f"<= {ON_TARGET:.0%} of the step")
    for name in args.models.split(","):
        off, ratio, lo, hi, cpu, _ = summarize(paired_rounds(name, args.replicas, args.rounds, args.steps,
                                                             args.warmup))
        pct = site_us / 1e3 / cpu * 100
        bound = "within" if hi <= 1 + ON_TARGET else ("above" if lo > 1 + ON_TARGET else "not resolved")
        print(f"{name:<13}{cpu:>9.3f}{pct:>8.2f}%{off:>9.3f}{ratio:>9.3f}   [{lo:.3f}, {hi:.3f}]   sites "
              f"{'met' if pct <= ON_TARGET * 100 else 'NOT met'}; end to end {bound}", flush=True)
        rows.append({**fields, "what": "on/off", "model": name, "replicas": args.replicas, "rounds": args.rounds,
                     "off_ms": round(off, 4), "off_cpu_ms": round(cpu, 4), "site_us": round(site_us, 1),
                     "site_pct": round(pct, 3),
                     "ratio": round(ratio, 4), "ratio_lo": round(lo, 4), "ratio_hi": round(hi, 4),
                     "target": f"{ON_TARGET:.0%}"})
    path = os.path.join(args.out, "report_cost.csv")
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(fields))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")
    return 0
