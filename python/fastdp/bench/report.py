"""What the training benchmarks print and write: the table, the verdict against the targets, CSV rows and the PNG
(with matplotlib, when installed)."""

import csv
import os
import shlex
import sys
import time

import torch


def cell(v, fmt="{:.2f}"):
    if v is None or v == "":
        return "n/a"
    return fmt.format(v)


def print_table(rows):
    head = (f"{'model':<12}{'config':<30}{'steps/s':>9}{'xbare':>7}{'step':>8}{'scatter':>8}{'replic':>8}"
            f"{'fwd':>8}{'apply+':>8}{'gather':>8}{'bwd':>8}{'reduce':>8}{'loss+opt':>9}{'other':>8}"
            f"{'overhead':>9}{'instr':>7}  peak memory")
    print(head)
    for r in rows:
        if r.get("error"):
            print(f"{r['model']:<12}{r['config']:<30}  failed: {r['error']}")
            continue
        ms = [cell(r.get(k)) for k in ("scatter_ms", "replicate_ms", "replica_fwd_ms", "apply_other_ms",
                                         "gather_ms", "replica_bwd_ms", "reduction_ms")]
        print(f"{r['model']:<12}{r['config']:<30}{r['steps_per_s']:>9.1f}{cell(r['ratio_to_bare']):>7}"
              f"{r['step_ms']:>8.2f}" + "".join(f"{m:>8}" for m in ms)
              + f"{r['loss_optim_ms']:>9.2f}{r['other_ms']:>8.2f}{r['overhead_ms']:>9.2f}"
              f"{r['split_step_ms'] / r['step_ms']:>7.2f}  {r['peak_mem']}")


def find(rows, model, wrapper, multi):
    for r in rows:
        if r["model"] == model and r["wrapper"] == wrapper and (r["replicas"] > 1) == multi and not r["error"]:
            return r
    return None


def verdict(rows, kind, models, per_device_batch):
    """Lines of (target, measured, verdict) from the issue's targets; measured values only."""
    lines = []
    for m in models:
        r = find(rows, m, "fastdp", False)
        if r and r.get("ratio_to_bare"):
            v = r["ratio_to_bare"]
            lines.append((f"{m}: one device ({r['config']}) / bare steps/s", "within 2% (>= 0.98)",
                          f"{v:.3f}", "met" if v >= 0.98 else "not met"))
    gpus = torch.cuda.device_count() if kind == "cuda" else 0
    if gpus == 1:
        for m in models:
            up, fd = find(rows, m, "upstream", True), find(rows, m, "fastdp", True)
            if not (up and fd):
                lines.append((f"{m}: fastdp / upstream, repeated ids", "", "n/a (a configuration failed)", ""))
                continue
            speed = fd["steps_per_s"] / up["steps_per_s"]
            if m == "mlp":
                over = fd["overhead_ms"] / up["overhead_ms"] if up["overhead_ms"] else None
                lines.append(("mlp: overhead fastdp / upstream", "<= 0.25", cell(over, "{:.3f}"),
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
            fd, bare = find(rows, m, "fastdp", True), find(rows, m, "bare", False)
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
            r = find(rows, m, "fastdp", True)
            if r and r.get("ratio_to_bare"):
                lines.append((f"{m}: {r['config']} emulated / bare steps/s", "tracked, not bounded",
                              f"{r['ratio_to_bare']:.3f}", ""))
    return lines


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (said once per chart) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'fastdp[bench]'): no chart written")
        return None
    return plt


def write_png(rows, path):
    plt = pyplot()
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


def csv_value(key, row):
    v = row.get(key)
    if v is None:
        return "n/a" if key.endswith("_ms") and not row.get("error") else ""
    return round(v, 4) if isinstance(v, float) else v


def command_line(args):
    parts = [os.path.basename(sys.executable), "-m", "fastdp.bench", "train", "--models", args.models,
             "--replicas", str(args.replicas), "--batch", str(args.batch), "--steps", str(args.steps),
             "--warmup", str(args.warmup), "--rounds", str(args.rounds), "--device", args.device,
             "--out", args.out]
    if args.threads:
        parts += ["--threads", str(args.threads)]
    if args.params:
        parts += ["--params", args.params]
    if getattr(args, "ddp", False):
        parts.append("--ddp")
    if getattr(args, "clock", "wall") != "wall":
        parts += ["--clock", args.clock]
    if getattr(args, "sync_bn", ""):
        parts += ["--sync-bn", args.sync_bn]
    if args.split:
        parts.append("--split")
    if args.per_device_batch:
        parts.append("--per-device-batch")
    return " ".join(shlex.quote(p) for p in parts)


def finish(rows, out, name, columns, value, write_png, started):
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
