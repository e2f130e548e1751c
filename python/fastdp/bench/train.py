"""``python -m fastdp.bench train``: training steps of the bare model, torch.nn.DataParallel and fastdp.DataParallel,
side by side in one process, with the per-step split of phases.py (workloads.py: the models; report.py: the
output); ``--params`` and ``--sync-bn`` run params.py and syncbn.py instead."""

import os
import statistics
import sys
import time

import torch
from torch import nn

import fastdp
from . import params, phases, report, syncbn, workloads


class _Config:
    """One way of running the model: bare, or a wrapper over a device list."""

    def __init__(self, name, wrapper, device_ids, batch_factor=1):
        self.name = name
        self.wrapper = wrapper
        self.device_ids = device_ids
        self.batch_factor = batch_factor
        self.error = None

    def build(self, module):
        """(plain model, timed model) for this configuration around the shared module."""
        if self.wrapper == "bare":
            return module, module
        base = torch.nn.DataParallel if self.wrapper == "upstream" else fastdp.DataParallel
        return base(module, device_ids=self.device_ids), phases.timed(base(module, device_ids=self.device_ids))


def _configs(kind, replicas, per_device_batch):
    if kind == "cpu":
        return [_Config("bare", "bare", None),
                _Config("fastdp x1", "fastdp", ["cpu"]),
                _Config(f"fastdp x{replicas}", "fastdp", ["cpu"] * replicas)]
    n = torch.cuda.device_count()
    configs = [_Config("bare", "bare", None),
               _Config("upstream x1", "upstream", [0]),
               _Config("fastdp x1", "fastdp", [0])]
    if n == 1:
        ids, label = [0] * replicas, f"x{replicas} (repeated id 0)"
        factor = 1
    else:
        ids, label = list(range(n)), f"x{n} GPUs"
        factor = n if per_device_batch else 1
    configs += [_Config(f"upstream {label}", "upstream", ids, factor),
                _Config(f"fastdp {label}", "fastdp", ids, factor)]
    return configs


def _bench_model(name, kind, configs, args, sync):
    module, x, y, batch = workloads.build(name, kind, args.batch)
    dev0 = torch.device("cuda:0") if kind == "cuda" else torch.device("cpu")
    module.to(dev0)
    opt = torch.optim.SGD(module.parameters(), lr=1e-3)
    batches = {}
    for c in configs:
        n = batch * c.batch_factor
        if n not in batches:
            reps = -(-n // batch)
            batches[n] = (x.repeat((reps,) + (1,) * (x.dim() - 1))[:n].to(dev0), y.repeat(reps)[:n].to(dev0))
    live = [c for c in configs if c.error is None]
    models = {}
    for c in live:
        try:
            models[c.name] = c.build(module)
        except Exception as e:  # A configuration that cannot be built is reported, not fatal to the others.
            c.error = f"{type(e).__name__}: {e}"
    step_times = {c.name: [] for c in configs}
    phase_rounds = {c.name: {} for c in configs}
    split_steps = {c.name: [] for c in configs}
    peaks = {c.name: {} for c in configs}
    rounds_done = {c.name: 0 for c in configs}
    split = phases.Split(sync if args.split else None)
    for r in range(args.rounds):
        live = [c for c in configs if c.error is None]
        order = live[r % len(live):] + live[: r % len(live)] if live else []
        for instrumented in (False, True):
            for c in order:
                if c.error is not None:
                    continue
                bx, by = batches[batch * c.batch_factor]
                plain, timed = models[c.name]
                try:
                    if not instrumented:
                        phases.peak_reset(kind, c)
                        for _ in range(args.warmup):
                            phases.train_step(plain, bx, by, opt)
                        if sync:
                            # GPU steps are queued: time the block, one mean per round.
                            sync()
                            t0 = time.perf_counter()
                            for _ in range(args.steps):
                                phases.train_step(plain, bx, by, opt)
                            sync()
                            step_times[c.name].append((time.perf_counter() - t0) / args.steps)
                        else:
                            # CPU steps are synchronous: time each one, so a preempted step is one outlier.
                            for _ in range(args.steps):
                                t0 = time.perf_counter()
                                phases.train_step(plain, bx, by, opt)
                                step_times[c.name].append(time.perf_counter() - t0)
                        rounds_done[c.name] += 1
                        peak = phases.peak_read(kind, c) or {}
                        for k, v in peak.items():
                            peaks[c.name][k] = max(v, peaks[c.name].get(k, 0.0))
                        continue
                    with phases.instrumented(split, module, c.wrapper):
                        for _ in range(args.warmup):
                            phases.timed_step(timed, bx, by, opt, split)
                        if sync:
                            sync()
                        split.reset()
                        total = 0.0
                        for _ in range(args.steps):
                            split.intervals = []
                            total += phases.timed_step(timed, bx, by, opt, split)
                            split.phases["replica_fwd"] = split.phases.get("replica_fwd", 0.0) + split.forward_union()
                    split_steps[c.name].append(total / args.steps)
                    for phase, seconds in split.phases.items():
                        phase_rounds[c.name].setdefault(phase, []).append(seconds / args.steps)
                except Exception as e:
                    c.error = f"{type(e).__name__}: {e}"
                    print(f"  {name} / {c.name}: failed: {c.error}", flush=True)
    rows = []
    bare = statistics.median(step_times["bare"]) if step_times.get("bare") else None
    for c in configs:
        row = {"model": name, "config": c.name, "wrapper": c.wrapper,
               "device_ids": "" if c.device_ids is None else ",".join(str(d) for d in c.device_ids),
               "replicas": len(c.device_ids or [None]), "batch": batch * c.batch_factor,
               "rounds": rounds_done[c.name], "steps": args.steps, "error": c.error or "",
               "split_synced": bool(args.split and sync)}
        if c.error is None and step_times[c.name] and split_steps[c.name]:
            step = statistics.median(step_times[c.name])
            row.update(steps_per_s=1.0 / step, samples_per_s=row["batch"] / step, step_ms=1e3 * step,
                       ratio_to_bare=(bare / step) if bare else None)
            row.update(phases.summarise(phase_rounds[c.name], split_steps[c.name]))
            row["peak_mem"] = " ".join(f"{k}={v:.0f}MiB" for k, v in peaks[c.name].items()) or "n/a"
        rows.append(row)
    del models, opt, module
    return rows


def _memory_section(models, kind, configs, args):
    """Device 0's peak over the median of the others (upstream and fastdp, same run), what fastdp holds per
    device, and the gathered outputs that per-replica loss avoids: a few steps per model with the multi-replica
    configuration's devices."""
    multi = [c for c in configs if c.wrapper == "fastdp" and c.device_ids and len(c.device_ids) > 1]
    if not multi:
        return
    ids = multi[-1].device_ids
    print(f"memory (device ids {ids}; the GPU 0 ratio needs distinct GPUs, so it reads n/a on one GPU or the CPU)")
    fmt = lambda r: "n/a" if r is None else f"{r:.2f}"  # noqa: E731
    for name in models:
        module, x, y, _ = workloads.build(name, kind, args.batch)
        dev0 = torch.device("cuda:0") if kind == "cuda" else torch.device("cpu")
        module.to(dev0)
        x, y = x.to(dev0), y.to(dev0)
        reports = {}
        wrappers = [("fastdp", lambda: fastdp.DataParallel(module, device_ids=ids)),
                    ("fastdp, per-replica loss", lambda: fastdp.DataParallel(module, device_ids=ids,
                                                                             criterion=nn.CrossEntropyLoss()))]
        if kind == "cuda":
            wrappers.insert(0, ("upstream", lambda: nn.DataParallel(module, device_ids=ids)))
        for label, make in wrappers:
            model = make()
            opt = torch.optim.SGD(module.parameters(), lr=1e-3)
            if kind == "cuda":
                phases.reset_peaks(ids)
            for _ in range(3):
                opt.zero_grad(set_to_none=True)
                loss = model(x, target=y) if "per-replica" in label else nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
            reports[label] = fastdp.memory_report(model, reset_peak=True)
        held = reports["fastdp"]
        ratios = ", ".join(f"{label} {fmt(r.peak_ratio())}" for label, r in reports.items())
        size = lambda n: f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"  # noqa: E731
        per_device = " ".join(f"{d.device}={size(d.fastdp_bytes)}" for d in held.devices)
        avoided = reports["fastdp, per-replica loss"].avoided_gather_bytes or 0
        print(f"  {name:<12} GPU0 peak / median of others: {ratios}")
        print(f"  {'':<12} fastdp holds per device: {per_device}; per-replica loss avoids gathering "
              f"{size(avoided)} of outputs per step (and as much again for their gradient)")


def run(args):
    started = time.perf_counter()
    print(f"command: {report.command_line(args)}")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in models:
        if m not in workloads.MODELS:
            print(f"unknown model {m!r} (choose from {', '.join(workloads.MODELS)})", file=sys.stderr)
            return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device is available", file=sys.stderr)
        return 2
    kind = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    if args.threads < 0:
        print("--threads must be 0 (1 on the CPU, torch's default with a GPU) or a positive count", file=sys.stderr)
        return 2
    if getattr(args, "clock", "wall") != "wall" and not args.params:
        print("--clock applies to the per-tensor sweep only: add --params N[,N...]", file=sys.stderr)
        return 2
    if args.threads or kind == "cpu":
        # One torch thread on the CPU by default: on a small shared machine every configuration is faster and
        # far less noisy with it.
        torch.set_num_threads(args.threads or 1)
    if args.params:
        return params.main(args, kind, started)
    if args.sync_bn:
        return syncbn.main(args, kind, started)
    replicas = max(2, args.replicas)
    configs = _configs(kind, replicas, args.per_device_batch)
    sync = phases.device_sync(kind, configs)
    where = (f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if kind == "cuda"
             else f"CPU, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads")
    print(f"fastdp train benchmark on {where}; torch {torch.__version__}, fastdp {fastdp.__version__}")
    print(f"{args.rounds} interleaved rounds x {args.steps} steps (+{args.warmup} warm-up) per configuration and "
          "pass; times in ms per step; steps/s from the un-instrumented pass: "
          + ("median over rounds of each round's mean step" if kind == "cuda" else "median of all timed steps")
          + "; split: median over rounds of each phase's mean")
    print("load average at start: " + " ".join(f"{v:.2f}" for v in os.getloadavg()))
    print("split: instrumented pass, " + ("devices synchronised around each timed region" if sync and args.split
          else "host-side times, no device synchronisation" if sync else "CPU (synchronous)")
          + "; fwd/bwd = inside the replicas (fwd: union of replica forward intervals; bwd: backward minus "
          "reduction); apply+ = parallel_apply minus fwd; overhead = step - fwd - bwd - loss/optimizer, all from "
          "the instrumented pass; instr = its step time / the un-instrumented one (far from 1: the split is off)")
    if kind == "cpu":
        print("no GPU: torch.nn.DataParallel cannot run on the CPU, so fastdp's emulated replicas are compared "
              "with the bare model only")
    rows = []
    for m in models:
        print(f"running {m} ...", flush=True)
        rows += _bench_model(m, kind, configs, args, sync)
    print()
    report.print_table(rows)
    for m in models:
        up, fd = report.find(rows, m, "upstream", True), report.find(rows, m, "fastdp", True)
        if fd:
            line = f"fastdp overhead {m}: {fd['overhead_ms']:.2f} ms/step ({fd['config']})"
            if up:
                ratio = report.cell(fd["overhead_ms"] / up["overhead_ms"] if up["overhead_ms"] else None, "{:.3f}")
                line += f"; upstream {up['overhead_ms']:.2f} ms/step; fastdp/upstream {ratio}"
            print(line)
    print()
    lines = report.verdict(rows, kind, models, args.per_device_batch)
    w = max(len(t) for t, *_ in lines)
    print(f"{'target':<{w}}  {'goal':<26}{'measured':<30}verdict")
    for target, goal, measured, verdict in lines:
        print(f"{target:<{w}}  {goal:<26}{measured:<30}{verdict}")
    print()
    _memory_section(models, kind, configs, args)
    os.makedirs(args.out, exist_ok=True)
    return report.finish(rows, args.out, "train", phases.COLUMNS, lambda k, r: report.csv_value(k, r), report.write_png, started)
