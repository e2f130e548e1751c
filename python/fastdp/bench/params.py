"""``python -m fastdp.bench train --params N,...``: per parameter tensor and step, what replicate and the gradient
reduction cost for N x Linear(8, 8) (fastdp, and torch.nn.DataParallel on a GPU); writes params.csv and params.png."""

import contextlib
import copy
import os
import statistics
import sys

import torch

import fastdp
from . import phases, report, workloads


_CLOCK_TEXT = {"wall": "clock: wall (elapsed time)",
               "cpu": "clock: cpu (this process's CPU time, all its threads; other processes' load not counted)"}


def parse_counts(text):
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


def _make(w, module, ids):
    """The model wrapper `w` runs: fastdp (timed phases), upstream, DDP over a copy of the module (one process), or
    the bare module."""
    if w == "bare":
        return module
    if w == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        _process_group(module)
        dev = next(module.parameters()).device
        return DistributedDataParallel(copy.deepcopy(module), device_ids=[dev.index] if dev.type == "cuda" else None)
    if w == "upstream":
        return phases.timed(torch.nn.DataParallel(module, device_ids=ids))
    # "single": the one-process group made for DDP must not turn it into fastdp's DDP wrapper.
    return phases.timed(fastdp.DataParallel(module, device_ids=ids, mode="single"))


def _process_group(module):
    """A one-process group for DDP (NCCL on a GPU, Gloo on the CPU), made once."""
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build")
    if not dist.is_initialized():
        backend = "nccl" if next(module.parameters()).is_cuda else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def _wrappers(kind, with_ddp):
    return ["fastdp"] + (["upstream"] if kind == "cuda" else []) + (["ddp", "bare"] if with_ddp else [])


def _sweep(counts, kind, args, sync):
    """Rows of per-step replicate and reduction time for every tensor count and wrapper (medians over rounds)."""
    replicas = max(2, args.replicas)
    ids, _ = _sweep_ids(kind, replicas)
    wrappers = _wrappers(kind, getattr(args, "ddp", False))
    dev0 = torch.device("cuda:0") if kind == "cuda" else torch.device("cpu")
    batch = args.batch or 4 * len(ids)
    rows = []
    for n in counts:
        torch.manual_seed(0)
        module = workloads.Chain(n).to(dev0)
        x = torch.randn(batch, 8, device=dev0)
        models, errors = {}, {}
        for w in wrappers:
            try:
                models[w] = _make(w, module, ids)
            except Exception as e:
                errors[w] = f"{type(e).__name__}: {e}"
        opts = {w: torch.optim.SGD(m.parameters(), lr=1e-3) for w, m in models.items()}
        per_round = {w: {"replicate": [], "reduction": [], "step": []} for w in wrappers}
        split = phases.Split(sync if args.split else None, phases.CLOCKS[getattr(args, "clock", "wall")])
        for r in range(args.rounds):
            live = [w for w in wrappers if w not in errors]
            for w in live[r % max(1, len(live)):] + live[: r % max(1, len(live))]:
                try:
                    _round(w, models[w], opts[w], module, x, split, args, sync, per_round[w])
                except Exception as e:
                    errors[w] = f"{type(e).__name__}: {e}"
                    print(f"  {n} tensors / {w}: failed: {errors[w]}", flush=True)
        rows += _rows(n, ids, wrappers, per_round, errors)
        del models, opts, module
    return rows


def _round(w, model, opt, module, x, split, args, sync, into):
    """One round of `w`'s timed steps; fastdp and upstream with their phases instrumented."""
    context = phases.instrumented(split, module, w) if w in ("fastdp", "upstream") else contextlib.nullcontext()
    with context:
        for _ in range(args.warmup):
            phases.timed_step(model, x, None, opt, split, loss=_sum_loss)
        if sync:
            sync()
        split.reset()
        total = sum(phases.timed_step(model, x, None, opt, split, loss=_sum_loss) for _ in range(args.steps))
    for phase in ("replicate", "reduction"):
        into[phase].append(split.phases.get(phase, 0.0) / args.steps)
    into["step"].append(total / args.steps)


def _rows(n, ids, wrappers, per_round, errors):
    """One row per wrapper; DDP's reduction is its step over the bare module's, round by round (its reducer runs
    inside autograd, where no Python call can be timed), and the bare module's row is the reference only."""
    if "ddp" in per_round and not errors.get("ddp") and not errors.get("bare"):
        pairs = zip(per_round["ddp"]["step"], per_round["bare"]["step"])
        per_round["ddp"]["reduction"] = [max(0.0, d - b) for d, b in pairs]
    rows = []
    for w in wrappers:
        row = {"tensors": n, "wrapper": w, "device_ids": ",".join(str(d) for d in ids) if w not in ("ddp", "bare")
               else "0", "replicas": len(ids) if w not in ("ddp", "bare") else 1, "error": errors.get(w, "")}
        if w not in errors and per_round[w]["step"]:
            rep = 1e3 * statistics.median(per_round[w]["replicate"])
            red = 1e3 * statistics.median(per_round[w]["reduction"])
            row.update(replicate_ms=rep, reduction_ms=red, step_ms=1e3 * statistics.median(per_round[w]["step"]),
                       replicate_us_per_tensor=1e3 * rep / n, reduction_us_per_tensor=1e3 * red / n,
                       us_per_tensor=1e3 * (rep + red) / n)
        rows.append(row)
    return rows


def _sum_loss(out, _target):
    return out.sum()


SWEEP_COLUMNS = ["tensors", "wrapper", "device_ids", "replicas", "replicate_ms", "reduction_ms", "step_ms",
                 "replicate_us_per_tensor", "reduction_us_per_tensor", "us_per_tensor", "error"]


def _write_sweep_png(rows, path):
    plt = report.pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for w in dict.fromkeys(r["wrapper"] for r in rows):
        pts = [(r["tensors"], r["us_per_tensor"]) for r in rows
               if r["wrapper"] == w and w != "bare" and not r["error"]]
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


def main(args, kind, started):
    counts = parse_counts(args.params)
    if counts is None:
        print(f"--params takes positive tensor counts, comma-separated (e.g. 10,100,1000), got {args.params!r}",
              file=sys.stderr)
        return 2
    replicas = max(2, args.replicas)
    _, label = _sweep_ids(kind, replicas)
    sync = None
    if kind == "cuda":
        ids, _ = _sweep_ids(kind, replicas)
        sync = phases.synchronize_all(ids)
    where = (f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if kind == "cuda"
             else f"CPU, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads")
    print(f"fastdp per-tensor sweep on {where}; torch {torch.__version__}, fastdp {fastdp.__version__}")
    print(f"model: N x Linear(8, 8, bias=False) with tanh (N parameter tensors), {label}, loss = output sum, SGD; "
          f"{args.rounds} interleaved rounds x {args.steps} steps (+{args.warmup} warm-up); medians over rounds of "
          "each round's mean per step; replicate = the wrapper's replicate method, reduction = the gradient "
          "reduction calls (" + ("devices synchronised around each" if args.split and sync else "host-side times")
          + "); " + _CLOCK_TEXT[getattr(args, "clock", "wall")])
    if kind == "cpu":
        print("no GPU: torch.nn.DataParallel cannot run on the CPU, so it is not measured")
    if getattr(args, "ddp", False):
        print("ddp: DistributedDataParallel in one process (world size 1: its reducer's per-tensor bookkeeping, no "
              "exchange); its reduction = its step minus the bare module's, round by round; bare: the reference")
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
        if r["wrapper"] == "bare":
            print(f"{r['tensors']:>8}  {'bare':<10}{'':>11}{'':>11}{r['step_ms']:>9.2f}   (the reference step)")
            continue
        print(f"{r['tensors']:>8}  {r['wrapper']:<10}{r['replicate_ms']:>11.3f}{r['reduction_ms']:>11.3f}"
              f"{r['step_ms']:>9.2f}{r['replicate_us_per_tensor']:>12.2f}{r['reduction_us_per_tensor']:>12.2f}"
              f"{r['us_per_tensor']:>12.2f}")
    os.makedirs(args.out, exist_ok=True)
    return report.finish(rows, args.out, "params", SWEEP_COLUMNS,
                   lambda k, r: round(r[k], 4) if isinstance(r.get(k), float) else r.get(k, ""), _write_sweep_png,
                   started)
