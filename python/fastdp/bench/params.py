"""``python -m fastdp.bench train --params N,...``: per parameter tensor and step, what replicate and the gradient
reduction cost for N x Linear(8, 8) (fastdp, and torch.nn.DataParallel on a GPU); writes params.csv and params.png."""

import os
import statistics
import sys

import torch

import fastdp
from . import phases, report, workloads


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
        module = workloads.Chain(n).to(dev0)
        x = torch.randn(batch, 8, device=dev0)
        opt = torch.optim.SGD(module.parameters(), lr=1e-3)
        models, errors = {}, {}
        for w in wrappers:
            base = torch.nn.DataParallel if w == "upstream" else fastdp.DataParallel
            try:
                models[w] = phases.timed(base(module, device_ids=ids))
            except Exception as e:
                errors[w] = f"{type(e).__name__}: {e}"
        per_round = {w: {"replicate": [], "reduction": [], "step": []} for w in wrappers}
        split = phases.Split(sync if args.split else None)
        for r in range(args.rounds):
            live = [w for w in wrappers if w not in errors]
            for w in live[r % max(1, len(live)):] + live[: r % max(1, len(live))]:
                try:
                    with phases.instrumented(split, module, w):
                        for _ in range(args.warmup):
                            phases.timed_step(models[w], x, None, opt, split, loss=_sum_loss)
                        if sync:
                            sync()
                        split.reset()
                        total = sum(phases.timed_step(models[w], x, None, opt, split, loss=_sum_loss)
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
    plt = report.pyplot()
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
    return report.finish(rows, args.out, "params", SWEEP_COLUMNS,
                   lambda k, r: round(r[k], 4) if isinstance(r.get(k), float) else r.get(k, ""), _write_sweep_png,
                   started)
