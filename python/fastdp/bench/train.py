"""Training steps of the bare model, torch.nn.DataParallel and fastdp.DataParallel, side by side in one process.

Every configuration trains the same module on the same batch (forward, loss, backward, SGD step). Steps/s come
from an un-instrumented pass; the per-step split comes from a second, instrumented pass that times the wrappers'
overridable methods, the gradient reduction and hooks on the module (see ``_Split``). Runs are interleaved over
the configurations, round after round (the starting configuration rotates), and medians are reported: on the CPU
the median of every timed step (steps are synchronous, so a preempted step is one outlier), on a GPU the median
over rounds of each round's mean step (steps are queued, so only whole blocks are timed).

How the split is approximated:
- scatter / replicate / gather: wall time of the wrapper's method (timed wrappers set on the instance, so the
  class, and with it fastdp's one-device short path, is the one users run; a method not called reports n/a);
- replica forward: the union of the intervals during which at least one replica was inside the module's forward
  (a forward pre-hook and a forward hook on the master module, which every replica shares); what else
  ``parallel_apply`` spends (thread hand-off, joins) is reported as "apply other";
- replica backward: the wall time of ``loss.backward()`` minus the time spent in gradient-reduction calls, so it
  also holds the backward of the wrapper's own nodes (the gather's scatter of the output gradient, autograd
  scheduling across devices);
- reduction: time inside ``torch.nn.parallel.comm.reduce_add_coalesced`` (upstream) or
  ``fastdp._replicas.reduce_bucket`` / ``fastdp.comm.reduce_add_coalesced`` (fastdp), outermost calls only,
  looked up as module attributes at call time; a reduction that overlaps the replicas' backward on a GPU is
  counted at its host (launch) cost unless ``--split`` serialises it;
- overhead: step time minus replica forward and backward minus loss and optimizer (the same work as the bare
  model's), all from the instrumented pass.
On a GPU these are host-side times unless ``--split`` synchronises the devices around every timed region, which
perturbs the steady state (it removes overlap); steps/s never come from the synchronised pass.
"""

import contextlib
import copy
import csv
import importlib
import os
import shlex
import statistics
import sys
import threading
import time

import torch
from torch import nn

import fastdp

MODELS = ("mlp", "cnn", "transformer")

COLUMNS = [
    "model", "config", "wrapper", "device_ids", "replicas", "batch", "steps_per_s", "samples_per_s",
    "ratio_to_bare", "step_ms", "scatter_ms", "replicate_ms", "replica_fwd_ms", "apply_other_ms", "gather_ms",
    "replica_bwd_ms", "reduction_ms", "loss_optim_ms", "other_ms", "replica_compute_ms", "overhead_ms",
    "split_step_ms", "split_synced", "peak_mem", "rounds", "steps", "error",
]

# Model sizes per device kind: small enough for a 2-core CPU, larger on a GPU so the CNN and transformer are not
# purely launch-bound there. The MLP stays deep and narrow (overhead-bound) everywhere.
_SIZES = {
    "cpu": {"mlp": dict(depth=20, width=128, batch=64),
            "cnn": dict(width=16, image=16, blocks=2, batch=32),
            "transformer": dict(d_model=64, layers=2, seq=16, batch=32)},
    "cuda": {"mlp": dict(depth=20, width=256, batch=256),
             "cnn": dict(width=64, image=32, blocks=3, batch=128),
             "transformer": dict(d_model=256, layers=4, seq=64, batch=64)},
}


class _Block(nn.Module):
    """A ResNet basic block: two 3x3 convolutions with batch norm and an identity shortcut."""

    def __init__(self, width):
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(y)))


class _SmallTransformer(nn.Module):
    """A few encoder layers over a batch-first float sequence, mean-pooled into 10 classes."""

    def __init__(self, d_model, layers):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=2 * d_model, dropout=0.0,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, 10)

    def forward(self, x):
        return self.head(self.encoder(x).mean(dim=1))


def _build(name, kind, batch):
    """(module, input, target, batch) for one model on the CPU; the caller moves them."""
    s = _SIZES[kind][name]
    batch = batch or s["batch"]
    if name == "mlp":
        layers = [nn.Linear(s["width"], s["width"]) if i % 2 == 0 else nn.ReLU() for i in range(2 * s["depth"])]
        module = nn.Sequential(*layers, nn.Linear(s["width"], 10))
        x = torch.randn(batch, s["width"])
    elif name == "cnn":
        w = s["width"]
        module = nn.Sequential(nn.Conv2d(3, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU(),
                               *[_Block(w) for _ in range(s["blocks"])],
                               nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(w, 10))
        x = torch.randn(batch, 3, s["image"], s["image"])
    elif name == "transformer":
        module = _SmallTransformer(s["d_model"], s["layers"])
        x = torch.randn(batch, s["seq"], s["d_model"])
    else:
        raise ValueError(f"unknown model {name!r} (choose from {', '.join(MODELS)})")
    return module, x, torch.randint(0, 10, (batch,)), batch


class _Split:
    """Phase times of one instrumented run: seconds summed per phase, forward intervals, call counts."""

    def __init__(self, sync):
        self.sync = sync
        self.lock = threading.Lock()
        self.local = threading.local()
        self.reset()

    def reset(self):
        self.phases = {}
        self.calls = {}
        self.intervals = []
        self.fwd_open = {}

    def timed(self, phase, fn, *args, **kwargs):
        active = getattr(self.local, "active", None)
        if active is None:
            active = self.local.active = set()
        if phase in active:  # Nested call of the same phase (e.g. reduce_bucket calling comm): count once.
            return fn(*args, **kwargs)
        active.add(phase)
        try:
            if self.sync:
                self.sync()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            if self.sync:
                self.sync()
            dt = time.perf_counter() - t0
        finally:
            active.discard(phase)
        with self.lock:
            self.phases[phase] = self.phases.get(phase, 0.0) + dt
            self.calls[phase] = self.calls.get(phase, 0) + 1
        return out

    # Forward hooks on the master module; replicas share the hook dicts, so these run in every replica's thread.

    def pre_hook(self, module, args):
        self.fwd_open[threading.get_ident()] = time.perf_counter()

    def post_hook(self, module, args, output):
        if self.sync:
            self.sync()
        t1 = time.perf_counter()
        t0 = self.fwd_open.pop(threading.get_ident(), None)
        if t0 is not None:
            with self.lock:
                self.intervals.append((t0, t1))

    def forward_union(self):
        total, end = 0.0, None
        for t0, t1 in sorted(self.intervals):
            if end is None or t0 > end:
                total += t1 - t0
                end = t1
            elif t1 > end:
                total += t1 - end
                end = t1
        return total


class _Probe:
    """The split being recorded, or None; read by the timed wrapper subclasses."""

    split = None


_PHASES = ("scatter", "replicate", "parallel_apply", "gather")


def _timed(model):
    """`model` with its overridable methods reporting their time to ``_Probe.split``.

    The timed methods are set on the instance, not in a subclass: the class stays the one users run, so paths
    that depend on it (fastdp's one-device short path is taken only when ``scatter`` is not overridden) are the
    ones measured. A method the wrapper does not call (no scatter on that short path) reports nothing.
    """
    for phase in _PHASES:
        bound = getattr(type(model), phase).__get__(model)

        def timed(*args, _phase=phase, _bound=bound, **kwargs):
            return _call(_phase, _bound, args, kwargs)

        model.__dict__[phase] = timed
    return model


def _call(phase, fn, args, kwargs):
    split = _Probe.split
    if split is None:
        return fn(*args, **kwargs)
    return split.timed(phase, fn, *args, **kwargs)


def _reduction_targets(wrapper):
    """(module, attribute) pairs whose calls are the gradient reduction of ``wrapper``'s kind."""
    if wrapper == "upstream":
        return [(torch.nn.parallel.comm, "reduce_add_coalesced")]
    if wrapper == "fastdp":
        targets = []
        try:
            replicas_mod = importlib.import_module("fastdp._replicas")
        except ImportError:
            replicas_mod = None
        if getattr(replicas_mod, "reduce_bucket", None) is not None:
            targets.append((replicas_mod, "reduce_bucket"))
        targets.append((fastdp.comm, "reduce_add_coalesced"))
        return targets
    return []


@contextlib.contextmanager
def _instrumented(split, module, wrapper):
    """Installs the reduction wrappers and forward hooks for one instrumented run, and removes them after."""
    saved = []
    handles = [module.register_forward_pre_hook(split.pre_hook), module.register_forward_hook(split.post_hook)]
    try:
        for mod, name in _reduction_targets(wrapper):
            original = getattr(mod, name)

            def timed_reduction(*args, _original=original, **kwargs):
                return split.timed("reduction", _original, *args, **kwargs)

            setattr(mod, name, timed_reduction)
            saved.append((mod, name, original))
        _Probe.split = split
        yield
    finally:
        _Probe.split = None
        for mod, name, original in reversed(saved):
            setattr(mod, name, original)
        for h in handles:
            h.remove()


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
        return base(module, device_ids=self.device_ids), _timed(base(module, device_ids=self.device_ids))


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


def _device_sync(kind, configs):
    if kind != "cuda":
        return None
    devices = sorted({d for c in configs if c.device_ids for d in c.device_ids} | {0})
    return lambda: [torch.cuda.synchronize(d) for d in devices]


def _train_step(model, x, y, opt):
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()


def _timed_step(model, x, y, opt, split, loss=nn.functional.cross_entropy):
    t0 = time.perf_counter()
    split.timed("optimizer", opt.zero_grad, set_to_none=True)
    out = split.timed("forward", model, x)
    loss = split.timed("loss", loss, out, y)
    split.timed("backward", loss.backward)
    split.timed("optimizer", opt.step)
    if split.sync:
        split.sync()
    return time.perf_counter() - t0


def _peak_reset(kind, config):
    if kind == "cuda":
        for d in set(config.device_ids or [0]):
            torch.cuda.reset_peak_memory_stats(d)
    else:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # Resets the process's RSS high-water mark (Linux).
        except OSError:
            pass


def _peak_read(kind, config):
    """Peak memory in MiB: per device on a GPU, the process's RSS high-water mark on the CPU, or None."""
    if kind == "cuda":
        return {f"cuda:{d}": torch.cuda.max_memory_allocated(d) / 2**20 for d in sorted(set(config.device_ids or [0]))}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return {"host RSS": int(line.split()[1]) / 1024}
    except OSError:
        pass
    return None


def _summarise(phase_rounds, step_rounds):
    """Median over rounds of each phase's per-step mean (ms), with the derived replica compute and overhead."""
    med = {k: 1e3 * statistics.median(v) for k, v in phase_rounds.items()}
    g = med.get
    fwd = g("replica_fwd", 0.0)
    applied = "parallel_apply" in med
    apply_other = max(0.0, g("parallel_apply", 0.0) - fwd) if applied else 0.0
    reduction = g("reduction")
    bwd = g("backward", 0.0) - (reduction or 0.0)
    loss_optim = g("loss", 0.0) + g("optimizer", 0.0)
    step = 1e3 * statistics.median(step_rounds)
    inside_forward = g("scatter", 0.0) + g("replicate", 0.0) + g("gather", 0.0) + (
        g("parallel_apply", 0.0) if applied else fwd)
    other = max(0.0, step - loss_optim - g("backward", 0.0) - inside_forward)
    return {
        "scatter_ms": g("scatter"), "replicate_ms": g("replicate"), "replica_fwd_ms": fwd,
        "apply_other_ms": apply_other if applied else None, "gather_ms": g("gather"), "replica_bwd_ms": bwd,
        "reduction_ms": reduction, "loss_optim_ms": loss_optim, "other_ms": other,
        "replica_compute_ms": fwd + bwd, "overhead_ms": max(0.0, step - fwd - bwd - loss_optim),
        "split_step_ms": step,
    }


def _bench_model(name, kind, configs, args, sync):
    module, x, y, batch = _build(name, kind, args.batch)
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
    split = _Split(sync if args.split else None)
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
                        _peak_reset(kind, c)
                        for _ in range(args.warmup):
                            _train_step(plain, bx, by, opt)
                        if sync:
                            # GPU steps are queued: time the block, one mean per round.
                            sync()
                            t0 = time.perf_counter()
                            for _ in range(args.steps):
                                _train_step(plain, bx, by, opt)
                            sync()
                            step_times[c.name].append((time.perf_counter() - t0) / args.steps)
                        else:
                            # CPU steps are synchronous: time each one, so a preempted step is one outlier.
                            for _ in range(args.steps):
                                t0 = time.perf_counter()
                                _train_step(plain, bx, by, opt)
                                step_times[c.name].append(time.perf_counter() - t0)
                        rounds_done[c.name] += 1
                        peak = _peak_read(kind, c) or {}
                        for k, v in peak.items():
                            peaks[c.name][k] = max(v, peaks[c.name].get(k, 0.0))
                        continue
                    with _instrumented(split, module, c.wrapper):
                        for _ in range(args.warmup):
                            _timed_step(timed, bx, by, opt, split)
                        if sync:
                            sync()
                        split.reset()
                        total = 0.0
                        for _ in range(args.steps):
                            split.intervals = []
                            total += _timed_step(timed, bx, by, opt, split)
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
            row.update(_summarise(phase_rounds[c.name], split_steps[c.name]))
            row["peak_mem"] = " ".join(f"{k}={v:.0f}MiB" for k, v in peaks[c.name].items()) or "n/a"
        rows.append(row)
    del models, opt, module
    return rows


def _cell(v, fmt="{:.2f}"):
    if v is None or v == "":
        return "n/a"
    return fmt.format(v)


def _print_table(rows):
    head = (f"{'model':<12}{'config':<30}{'steps/s':>9}{'xbare':>7}{'step':>8}{'scatter':>8}{'replic':>8}"
            f"{'fwd':>8}{'apply+':>8}{'gather':>8}{'bwd':>8}{'reduce':>8}{'loss+opt':>9}{'other':>8}"
            f"{'overhead':>9}{'instr':>7}  peak memory")
    print(head)
    for r in rows:
        if r.get("error"):
            print(f"{r['model']:<12}{r['config']:<30}  failed: {r['error']}")
            continue
        ms = [_cell(r.get(k)) for k in ("scatter_ms", "replicate_ms", "replica_fwd_ms", "apply_other_ms",
                                         "gather_ms", "replica_bwd_ms", "reduction_ms")]
        print(f"{r['model']:<12}{r['config']:<30}{r['steps_per_s']:>9.1f}{_cell(r['ratio_to_bare']):>7}"
              f"{r['step_ms']:>8.2f}" + "".join(f"{m:>8}" for m in ms)
              + f"{r['loss_optim_ms']:>9.2f}{r['other_ms']:>8.2f}{r['overhead_ms']:>9.2f}"
              f"{r['split_step_ms'] / r['step_ms']:>7.2f}  {r['peak_mem']}")


def _find(rows, model, wrapper, multi):
    for r in rows:
        if r["model"] == model and r["wrapper"] == wrapper and (r["replicas"] > 1) == multi and not r["error"]:
            return r
    return None


def _verdict(rows, kind, models, per_device_batch):
    """Lines of (target, measured, verdict) from the issue's targets; measured values only."""
    lines = []
    for m in models:
        r = _find(rows, m, "fastdp", False)
        if r and r.get("ratio_to_bare"):
            v = r["ratio_to_bare"]
            lines.append((f"{m}: one device ({r['config']}) / bare steps/s", "within 2% (>= 0.98)",
                          f"{v:.3f}", "met" if v >= 0.98 else "not met"))
    gpus = torch.cuda.device_count() if kind == "cuda" else 0
    if gpus == 1:
        for m in models:
            up, fd = _find(rows, m, "upstream", True), _find(rows, m, "fastdp", True)
            if not (up and fd):
                lines.append((f"{m}: fastdp / upstream, repeated ids", "", "n/a (a configuration failed)", ""))
                continue
            speed = fd["steps_per_s"] / up["steps_per_s"]
            if m == "mlp":
                over = fd["overhead_ms"] / up["overhead_ms"] if up["overhead_ms"] else None
                lines.append(("mlp: overhead fastdp / upstream", "<= 0.25", _cell(over, "{:.3f}"),
                              "n/a" if over is None else ("met" if over <= 0.25 else "not met")))
                lines.append(("mlp: steps/s fastdp / upstream", ">= 1.5", f"{speed:.3f}",
                              "met" if speed >= 1.5 else "not met"))
            else:
                lines.append((f"{m}: steps/s fastdp / upstream", ">= 1.0", f"{speed:.3f}",
                              "met" if speed >= 1.0 else "not met"))
    else:
        lines.append(("one GPU, repeated ids: overhead and steps/s vs upstream", "<= 0.25 / >= 1.5 / >= 1.0",
                      "unmeasured (no GPU)" if gpus == 0 else f"unmeasured ({gpus} GPUs; use CUDA_VISIBLE_DEVICES=0)",
                      ""))
    if gpus >= 2 and per_device_batch:
        for m in models:
            fd, bare = _find(rows, m, "fastdp", True), _find(rows, m, "bare", False)
            if fd and bare:
                v = fd["samples_per_s"] / fd["replicas"] / bare["samples_per_s"]
                lines.append((f"{m}: per-GPU samples/s at {fd['replicas']} GPUs / bare", ">= 0.90", f"{v:.3f}",
                              "met" if v >= 0.90 else "not met"))
    else:
        why = "unmeasured (no GPU)" if gpus == 0 else (
            "unmeasured (one GPU)" if gpus == 1 else "unmeasured (run with --per-device-batch)")
        lines.append(("several GPUs: per-GPU throughput / bare", ">= 0.90", why, ""))
    if kind == "cpu":
        for m in models:
            r = _find(rows, m, "fastdp", True)
            if r and r.get("ratio_to_bare"):
                lines.append((f"{m}: {r['config']} emulated / bare steps/s", "tracked, not bounded",
                              f"{r['ratio_to_bare']:.3f}", ""))
    return lines


def _pyplot():
    """matplotlib.pyplot on the Agg backend, or None (said once per chart) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'fastdp[bench]'): no chart written")
        return None
    return plt


def _write_png(rows, path):
    plt = _pyplot()
    if plt is None:
        return None
    ok = [r for r in rows if not r["error"] and r.get("steps_per_s")]
    models = list(dict.fromkeys(r["model"] for r in ok))
    configs = list(dict.fromkeys(r["config"] for r in ok))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / max(1, len(configs))
    for i, c in enumerate(configs):
        xs, speed, over = [], [], []
        for j, m in enumerate(models):
            r = next((r for r in ok if r["model"] == m and r["config"] == c), None)
            if r:
                xs.append(j + (i - (len(configs) - 1) / 2) * width)
                speed.append(r["ratio_to_bare"] or 0.0)
                over.append(r["overhead_ms"])
        axes[0].bar(xs, speed, width, label=c)
        axes[1].bar(xs, over, width, label=c)
    for ax, title in ((axes[0], "steps/s relative to the bare model"),
                      (axes[1], "overhead per step (ms): step - replica fwd/bwd - loss/optimizer")):
        ax.set_xticks(range(len(models)))
        ax.set_xticklabels(models)
        ax.set_title(title, fontsize=10)
    axes[0].axhline(1.0, color="grey", linewidth=0.8)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _csv_value(key, row):
    v = row.get(key)
    if v is None:
        return "n/a" if key.endswith("_ms") and not row.get("error") else ""
    return round(v, 4) if isinstance(v, float) else v


def _command_line(args):
    parts = [os.path.basename(sys.executable), "-m", "fastdp.bench", "train", "--models", args.models,
             "--replicas", str(args.replicas), "--batch", str(args.batch), "--steps", str(args.steps),
             "--warmup", str(args.warmup), "--rounds", str(args.rounds), "--device", args.device,
             "--out", args.out]
    if args.threads:
        parts += ["--threads", str(args.threads)]
    if args.params:
        parts += ["--params", args.params]
    if getattr(args, "sync_bn", ""):
        parts += ["--sync-bn", args.sync_bn]
    if args.split:
        parts.append("--split")
    if args.per_device_batch:
        parts.append("--per-device-batch")
    return " ".join(shlex.quote(p) for p in parts)


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
        module, x, y, _ = _build(name, kind, args.batch)
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
                for d in sorted(set(ids)):
                    torch.cuda.reset_peak_memory_stats(d)
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
    print(f"command: {_command_line(args)}")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in models:
        if m not in MODELS:
            print(f"unknown model {m!r} (choose from {', '.join(MODELS)})", file=sys.stderr)
            return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device is available", file=sys.stderr)
        return 2
    kind = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    if args.threads < 0:
        print("--threads must be 0 (1 on the CPU, torch's default with a GPU) or a positive count", file=sys.stderr)
        return 2
    if args.threads or kind == "cpu":
        # One torch thread on the CPU by default: on a small shared machine every configuration is faster and
        # far less noisy with it.
        torch.set_num_threads(args.threads or 1)
    if args.params:
        return _sweep_main(args, kind, started)
    if args.sync_bn:
        return _syncbn_main(args, kind, started)
    replicas = max(2, args.replicas)
    configs = _configs(kind, replicas, args.per_device_batch)
    sync = _device_sync(kind, configs)
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
    _print_table(rows)
    for m in models:
        up, fd = _find(rows, m, "upstream", True), _find(rows, m, "fastdp", True)
        if fd:
            line = f"fastdp overhead {m}: {fd['overhead_ms']:.2f} ms/step ({fd['config']})"
            if up:
                ratio = _cell(fd["overhead_ms"] / up["overhead_ms"] if up["overhead_ms"] else None, "{:.3f}")
                line += f"; upstream {up['overhead_ms']:.2f} ms/step; fastdp/upstream {ratio}"
            print(line)
    print()
    lines = _verdict(rows, kind, models, args.per_device_batch)
    w = max(len(t) for t, *_ in lines)
    print(f"{'target':<{w}}  {'goal':<26}{'measured':<30}verdict")
    for target, goal, measured, verdict in lines:
        print(f"{target:<{w}}  {goal:<26}{measured:<30}{verdict}")
    print()
    _memory_section(models, kind, configs, args)
    os.makedirs(args.out, exist_ok=True)
    return _finish(rows, args.out, "train", COLUMNS, lambda k, r: _csv_value(k, r), _write_png, started)


def _finish(rows, out, name, columns, value, write_png, started):
    """Writes <name>.csv and <name>.png in out, prints where and the load; exit status 1 when a row failed."""
    path = os.path.join(out, f"{name}.csv")
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, restval="")
        writer.writeheader()
        for r in rows:
            writer.writerow({k: value(k, r) for k in columns})
    print(f"wrote {path}")
    png = write_png(rows, os.path.join(out, f"{name}.png"))
    if png:
        print(f"wrote {png}")
    print("load average at end: " + " ".join(f"{v:.2f}" for v in os.getloadavg()))
    print(f"total time {time.perf_counter() - started:.0f} s")
    return 1 if any(r["error"] for r in rows) else 0


# The --params sweep: what replicate and the gradient reduction cost per parameter tensor and step.


class _Chain(nn.Module):
    """n bias-free Linear(8, 8) layers with tanh between: n parameter tensors of 64 values, so replicate and the
    reduction grow with the tensor count while the bytes and the compute stay small."""

    def __init__(self, n):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8, bias=False) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _parse_counts(text):
    try:
        counts = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        counts = []
    if not counts or any(n < 1 for n in counts):
        return None
    return counts


def _sweep_ids(kind, replicas):
    if kind == "cpu":
        return ["cpu"] * replicas, f"{replicas} emulated 'cpu' replicas"
    n = torch.cuda.device_count()
    if n == 1:
        return [0] * replicas, f"{replicas} repeated ids on GPU 0"
    return list(range(n)), f"{n} GPUs"


def _sweep(counts, kind, args, sync):
    """Rows of per-step replicate and reduction time for every tensor count and wrapper (medians over rounds)."""
    replicas = max(2, args.replicas)
    ids, _ = _sweep_ids(kind, replicas)
    wrappers = ["fastdp"] + (["upstream"] if kind == "cuda" else [])
    dev0 = torch.device("cuda:0") if kind == "cuda" else torch.device("cpu")
    batch = args.batch or 4 * len(ids)
    rows = []
    for n in counts:
        torch.manual_seed(0)
        module = _Chain(n).to(dev0)
        x = torch.randn(batch, 8, device=dev0)
        opt = torch.optim.SGD(module.parameters(), lr=1e-3)
        models, errors = {}, {}
        for w in wrappers:
            base = torch.nn.DataParallel if w == "upstream" else fastdp.DataParallel
            try:
                models[w] = _timed(base(module, device_ids=ids))
            except Exception as e:
                errors[w] = f"{type(e).__name__}: {e}"
        per_round = {w: {"replicate": [], "reduction": [], "step": []} for w in wrappers}
        split = _Split(sync if args.split else None)
        for r in range(args.rounds):
            live = [w for w in wrappers if w not in errors]
            for w in live[r % max(1, len(live)):] + live[: r % max(1, len(live))]:
                try:
                    with _instrumented(split, module, w):
                        for _ in range(args.warmup):
                            _timed_step(models[w], x, None, opt, split, loss=_sum_loss)
                        if sync:
                            sync()
                        split.reset()
                        total = sum(_timed_step(models[w], x, None, opt, split, loss=_sum_loss)
                                    for _ in range(args.steps))
                    for phase in ("replicate", "reduction"):
                        per_round[w][phase].append(split.phases.get(phase, 0.0) / args.steps)
                    per_round[w]["step"].append(total / args.steps)
                except Exception as e:
                    errors[w] = f"{type(e).__name__}: {e}"
                    print(f"  {n} tensors / {w}: failed: {errors[w]}", flush=True)
        for w in wrappers:
            row = {"tensors": n, "wrapper": w, "device_ids": ",".join(str(d) for d in ids), "replicas": len(ids),
                   "error": errors.get(w, "")}
            if w not in errors and per_round[w]["step"]:
                rep = 1e3 * statistics.median(per_round[w]["replicate"])
                red = 1e3 * statistics.median(per_round[w]["reduction"])
                row.update(replicate_ms=rep, reduction_ms=red, step_ms=1e3 * statistics.median(per_round[w]["step"]),
                           replicate_us_per_tensor=1e3 * rep / n, reduction_us_per_tensor=1e3 * red / n,
                           us_per_tensor=1e3 * (rep + red) / n)
            rows.append(row)
        del models, opt, module
    return rows


def _sum_loss(out, _target):
    return out.sum()


SWEEP_COLUMNS = ["tensors", "wrapper", "device_ids", "replicas", "replicate_ms", "reduction_ms", "step_ms",
                 "replicate_us_per_tensor", "reduction_us_per_tensor", "us_per_tensor", "error"]


def _write_sweep_png(rows, path):
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for w in dict.fromkeys(r["wrapper"] for r in rows):
        pts = [(r["tensors"], r["us_per_tensor"]) for r in rows if r["wrapper"] == w and not r["error"]]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=w)
    ax.set_xscale("log")
    ax.set_xlabel("parameter tensors")
    ax.set_ylabel("µs per tensor per step (replicate + reduction)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _sweep_main(args, kind, started):
    counts = _parse_counts(args.params)
    if counts is None:
        print(f"--params takes positive tensor counts, comma-separated (e.g. 10,100,1000), got {args.params!r}",
              file=sys.stderr)
        return 2
    replicas = max(2, args.replicas)
    _, label = _sweep_ids(kind, replicas)
    sync = None
    if kind == "cuda":
        ids, _ = _sweep_ids(kind, replicas)
        devices = sorted(set(ids))
        sync = lambda: [torch.cuda.synchronize(d) for d in devices]  # noqa: E731
    where = (f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if kind == "cuda"
             else f"CPU, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads")
    print(f"fastdp per-tensor sweep on {where}; torch {torch.__version__}, fastdp {fastdp.__version__}")
    print(f"model: N x Linear(8, 8, bias=False) with tanh (N parameter tensors), {label}, loss = output sum, SGD; "
          f"{args.rounds} interleaved rounds x {args.steps} steps (+{args.warmup} warm-up); medians over rounds of "
          "each round's mean per step; replicate = the wrapper's replicate method, reduction = the gradient "
          "reduction calls (" + ("devices synchronised around each" if args.split and sync else "host-side times")
          + ")")
    if kind == "cpu":
        print("no GPU: torch.nn.DataParallel cannot run on the CPU, so only fastdp is measured")
    print("load average at start: " + " ".join(f"{v:.2f}" for v in os.getloadavg()))
    rows = _sweep(counts, kind, args, sync)
    print()
    print(f"{'tensors':>8}  {'wrapper':<10}{'replicate':>11}{'reduction':>11}{'step':>9}"
          f"{'rep/tensor':>12}{'red/tensor':>12}{'per tensor':>12}")
    print(f"{'':>8}  {'':<10}{'ms':>11}{'ms':>11}{'ms':>9}{'µs':>12}{'µs':>12}{'µs':>12}")
    for r in rows:
        if r["error"]:
            print(f"{r['tensors']:>8}  {r['wrapper']:<10}  failed: {r['error']}")
            continue
        print(f"{r['tensors']:>8}  {r['wrapper']:<10}{r['replicate_ms']:>11.3f}{r['reduction_ms']:>11.3f}"
              f"{r['step_ms']:>9.2f}{r['replicate_us_per_tensor']:>12.2f}{r['reduction_us_per_tensor']:>12.2f}"
              f"{r['us_per_tensor']:>12.2f}")
    os.makedirs(args.out, exist_ok=True)
    return _finish(rows, args.out, "params", SWEEP_COLUMNS,
                   lambda k, r: round(r[k], 4) if isinstance(r.get(k), float) else r.get(k, ""), _write_sweep_png,
                   started)


# ---- --sync-bn: what synchronised BatchNorm costs per step ------------------------------------------------------

SYNCBN_COLUMNS = ["replicas", "device_ids", "config", "bn_layers", "step_ms", "extra_ms", "extra_ms_per_layer",
                  "rounds", "steps"]


def _syncbn_configs(kind):
    """(label, convert to SyncBatchNorm, run emulated replicas on threads). SyncBatchNorm needs the replicas to run
    at the same time, so on the CPU it runs them on threads; "BatchNorm, threads" tells the thread cost apart from
    the exchange's. CUDA replicas always run on threads."""
    if kind == "cuda":
        return [("BatchNorm", False, None), ("SyncBatchNorm", True, None)]
    return [("BatchNorm", False, False), ("BatchNorm, threads", False, True), ("SyncBatchNorm", True, None)]


def _syncbn_main(args, kind, started):
    pa = importlib.import_module("fastdp.parallel_apply")  # the module (fastdp.parallel_apply is the function)

    counts = _parse_counts(args.sync_bn)
    if counts is None or any(n < 2 for n in counts):
        print("--sync-bn takes replica counts of 2 or more, e.g. --sync-bn 2,4", file=sys.stderr)
        return 2
    dev0 = torch.device("cuda:0") if kind == "cuda" else torch.device("cpu")
    module, x, y, batch = _build("cnn", kind, args.batch)
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
        saved = pa._CPU_THREADS
        try:
            for r in range(args.rounds):
                configs = _syncbn_configs(kind)
                for label, _, threads in configs[r % len(configs):] + configs[: r % len(configs)]:
                    if threads is not None:
                        pa._CPU_THREADS = threads
                    dp, opt = models[label]
                    for _ in range(args.warmup):
                        _train_step(dp, x, y, opt)
                    for _ in range(args.steps):
                        if kind == "cuda":
                            torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        _train_step(dp, x, y, opt)
                        if kind == "cuda":
                            torch.cuda.synchronize()
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
        print(f"{r['replicas']:>8}  {r['config']:<22}{r['step_ms']:>9.2f}{_cell(r['extra_ms']):>10}"
              f"{_cell(r['extra_ms_per_layer'], '{:.3f}'):>11}")
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
