"""How much of the gradient reduction backward hides (scripts/gpu_check.sh's overlap step): a timeline of one
training step of ``fastdp.DataParallel`` with one bucket per layer, when each bucket's reduction starts and ends
against the backward of the replicas, and the fraction of the reduction's time that runs while backward still
computes.

``--device cuda`` runs ``device_ids=[0] * replicas`` on one GPU (the reduction on its own stream; the wrapper's
report times everything with CUDA events); ``--device cpu`` runs emulated replicas (the host reducer thread, the
host clock). The ranges come from ``dp.report()``: each replica's backward, each bucket's reduction. Prints the
timeline (ms from the step's start), the overlap fraction, the report itself, and with ``--compare`` the backward's
time with every reduction started early (as shipped) against held until the end of backward (the order autograd gave
the reduction before it started early), interleaved.
"""

import argparse
import statistics
import sys
import time

import torch
import torch.nn as nn

import fastdp
from fastdp._reduction import reducer as _reducer


def model(width, layers):
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.Tanh())])


def spans(report):
    """Per recorded step: (when the last replica's backward ended, [(bucket, start, end, bytes)]) in ms."""
    steps = {}
    for r in report.to_dict()["ranges"]:
        step = steps.setdefault(r["step"], [0.0, []])
        if r["phase"] == "backward":
            step[0] = max(step[0], r["end_ms"])
        elif r["phase"] == "reduce":
            step[1].append((r.get("bucket"), r["start_ms"], r["end_ms"], r["bytes"]))
    return [(end, sorted(buckets, key=lambda b: b[1])) for _, (end, buckets) in sorted(steps.items())]


def hidden(compute_end, start, end):
    return max(0.0, min(end, compute_end) - start)


def overlap_fraction(compute_end, buckets):
    busy = sum(e - s for _, s, e, _ in buckets)
    return sum(hidden(compute_end, s, e) for _, s, e, _ in buckets) / busy if busy > 0 else 0.0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--compare", action="store_true")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("no GPU: nothing to measure")
        return 1
    torch.manual_seed(0)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    layer_mb = (args.width * args.width + args.width) * 4 / 2**20
    dp = fastdp.DataParallel(model(args.width, args.layers).to(device), bucket_cap_mb=layer_mb, report=args.steps,
                             device_ids=[0] * args.replicas if cuda else ["cpu"] * args.replicas)
    x = torch.randn(args.batch, args.width, device=device)
    for _ in range(2 + args.steps):  # builds the kept replicas, warms up, then the steps the report keeps
        dp(x).pow(2).mean().backward()
    report = dp.report()
    where = (f"one {torch.cuda.get_device_name(0)}, device_ids=[0] * {args.replicas}" if cuda
             else f"{args.replicas} emulated replicas, {torch.get_num_threads()} torch threads")
    print(f"overlap of the gradient reduction with backward: {where}; {args.layers} x Linear({args.width}, "
          f"{args.width}), one bucket per layer, batch {args.batch}; torch {torch.__version__}")
    per_step = spans(report)
    fractions = [overlap_fraction(end, buckets) for end, buckets in per_step if buckets]
    compute_end, buckets = per_step[-1]
    print(f"\none step (ms from the step's start; the replicas' backward ends at {compute_end:.3f}):")
    print(f"{'bucket':>7}{'MB':>8}{'starts':>10}{'ends':>10}{'hidden':>9}")
    for b, s, e, n in buckets:
        print(f"{b:>7}{n / 2**20:>8.2f}{s:>10.3f}{e:>10.3f}{hidden(compute_end, s, e) / (e - s) if e > s else 0:>8.0%}")
    if fractions:
        print(f"\noverlap fraction (reduction time hidden behind the replicas' backward): median "
              f"{statistics.median(fractions):.0%} over {len(fractions)} steps ({', '.join(f'{f:.0%}' for f in fractions)})")
    print()
    print(report)
    if args.compare:
        dp.disable_report()
        compare(dp, x, args.steps, cuda)
    return 0


def compare(dp, x, steps, cuda):
    """Backward's time with each bucket's reduction started early (as shipped) and held until the end of backward
    (its node given the sequence number of a node made at the first step, as before it started early),
    interleaved."""
    times = {"early": [], "held": []}
    for _ in range(steps):
        for mode in ("early", "held"):
            _hold_until_the_end(dp, mode == "held")
            loss = dp(x).pow(2).mean()
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss.backward()
            if cuda:
                torch.cuda.synchronize()
            times[mode].append((time.perf_counter() - t0) * 1e3)
    _hold_until_the_end(dp, False)
    early, held = statistics.median(times["early"]), statistics.median(times["held"])
    print(f"backward time, interleaved, median of {steps}: reductions started early {early:.3f} ms, held until "
          f"the end {held:.3f} ms (ratio {early / held:.2f})")


def _hold_until_the_end(dp, hold):
    """Gives each bucket node the lowest sequence number (held) or the highest (as shipped)."""
    for out in dp._replica_set.kept.outs:
        if out.grad_fn is not None:
            out.grad_fn._set_sequence_nr(_reducer.LAST if hold else _reducer.FIRST)


if __name__ == "__main__":
    sys.exit(main())
