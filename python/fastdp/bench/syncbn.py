"""``python -m fastdp.bench train --sync-bn N,...``: what synchronised BatchNorm costs per step, the CNN with
nn.SyncBatchNorm (statistics exchanged across replicas) against BatchNorm; writes syncbn.csv."""

import copy
import csv
import importlib
import os
import statistics
import sys
import time

import torch
from torch import nn

import fastdp
from . import params, phases, report, workloads


SYNCBN_COLUMNS = ["replicas", "device_ids", "config", "bn_layers", "step_ms", "extra_ms", "extra_ms_per_layer",
                  "rounds", "steps"]


def _syncbn_configs(kind):
    """(label, convert to SyncBatchNorm, run emulated replicas on threads). SyncBatchNorm needs the replicas to run
    at the same time, so on the CPU it runs them on threads; "BatchNorm, threads" tells the thread cost apart from
    the exchange's. CUDA replicas always run on threads."""
    if kind == "cuda":
        return [("BatchNorm", False, None), ("SyncBatchNorm", True, None)]
    return [("BatchNorm", False, False), ("BatchNorm, threads", False, True), ("SyncBatchNorm", True, None)]


def _step_sync(kind, ids):
    """What a timed step waits for before and after: every replica's GPU."""
    return phases.synchronize_all(ids) if kind == "cuda" else (lambda: None)


def main(args, kind, started):
    pa = importlib.import_module("fastdp.parallel_apply")  # the module (fastdp.parallel_apply is the function)

    counts = params.parse_counts(args.sync_bn)
    if counts is None or any(n < 2 for n in counts):
        print("--sync-bn takes replica counts of 2 or more, e.g. --sync-bn 2,4", file=sys.stderr)
        return 2
    dev0 = torch.device("cuda:0") if kind == "cuda" else torch.device("cpu")
    module, x, y, batch = workloads.build("cnn", kind, args.batch)
    layers = sum(isinstance(m, nn.BatchNorm2d) for m in module.modules())
    print(f"SyncBatchNorm on the cnn ({layers} BatchNorm2d layers, batch {batch}), "
          + (f"{torch.cuda.get_device_name(0)}" if kind == "cuda" else f"CPU, {torch.get_num_threads()} torch threads")
          + f"; ms per training step, median of {args.rounds} interleaved rounds x {args.steps} steps")
    x, y = x.to(dev0), y.to(dev0)
    rows = []
    for n in counts:
        ids = ["cpu"] * n if kind == "cpu" else ([0] * n if torch.cuda.device_count() < n else list(range(n)))
        models = {}
        for label, convert, _ in _syncbn_configs(kind):
            m = copy.deepcopy(module)
            if convert:
                m = fastdp.convert_sync_batchnorm(m)
            m.to(dev0)
            models[label] = (fastdp.DataParallel(m, device_ids=ids), torch.optim.SGD(m.parameters(), lr=1e-3))
        times = {label: [] for label in models}
        sync = _step_sync(kind, ids)
        saved = pa._CPU_THREADS
        try:
            for r in range(args.rounds):
                configs = _syncbn_configs(kind)
                for label, _, threads in configs[r % len(configs):] + configs[: r % len(configs)]:
                    if threads is not None:
                        pa._CPU_THREADS = threads
                    dp, opt = models[label]
                    for _ in range(args.warmup):
                        phases.train_step(dp, x, y, opt)
                    for _ in range(args.steps):
                        sync()
                        t0 = time.perf_counter()
                        phases.train_step(dp, x, y, opt)
                        sync()
                        times[label].append(time.perf_counter() - t0)
        finally:
            pa._CPU_THREADS = saved
        base = None
        for label, _, threads in _syncbn_configs(kind):
            step = 1e3 * statistics.median(times[label])
            # The exchange's cost: SyncBatchNorm against BatchNorm run the same way (threads).
            if label != "SyncBatchNorm" and (threads is not False or kind == "cuda"):
                base = step
            extra = step - base if label == "SyncBatchNorm" and base is not None else None
            rows.append({"replicas": n, "device_ids": ",".join(str(d) for d in ids), "config": label,
                         "bn_layers": layers, "step_ms": step, "extra_ms": extra,
                         "extra_ms_per_layer": None if extra is None else extra / layers,
                         "rounds": args.rounds, "steps": args.steps})
    print(f"{'replicas':>8}  {'config':<22}{'step ms':>9}{'extra ms':>10}{'per layer':>11}")
    for r in rows:
        print(f"{r['replicas']:>8}  {r['config']:<22}{r['step_ms']:>9.2f}{report.cell(r['extra_ms']):>10}"
              f"{report.cell(r['extra_ms_per_layer'], '{:.3f}'):>11}")
    print("extra: SyncBatchNorm's step minus BatchNorm's with the replicas on threads (its forward and backward "
          "exchange per layer, and the rendezvous)")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "syncbn.csv")
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=SYNCBN_COLUMNS)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: "" if r[k] is None else (f"{r[k]:.4f}" if isinstance(r[k], float) else r[k])
                             for k in SYNCBN_COLUMNS})
    print(f"wrote {path} ({time.perf_counter() - started:.0f} s)")
    return 0
