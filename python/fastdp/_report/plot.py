"""``Report.plot(path)``: one PNG with the last step's timeline per replica and each device's memory by holder.

matplotlib is optional (``pip install 'fastdp[plot]'``). The figure is drawn on its own Agg canvas, never through
pyplot, so a notebook's or a script's own matplotlib state (backend, current figure) is left as it was.
"""

__all__ = ["draw"]

_COLOURS = {"scatter": "#8c564b", "replicate": "#9467bd", "forward": "#1f77b4", "gather": "#e377c2",
            "backward": "#ff7f0e", "reduce": "#2ca02c", "wait-reduce": "#d62728"}
_STEP_ROW = ("scatter", "replicate", "gather", "reduce", "wait-reduce")


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(
            "Report.plot needs matplotlib, an optional extra of fastdp: pip install 'fastdp[plot]' (or pip install "
            "matplotlib); the report's numbers need nothing: print(report), report.to_csv(path), report.trace(path)"
        ) from e
    return Figure, FigureCanvasAgg


def _shown_step(report):
    """The last training step whose backward was recorded, else the last step."""
    for r in reversed(report.ranges):
        if r.training and any(phase == "backward" for phase, *_ in r.ranges):
            return r
    return report.ranges[-1] if report.ranges else None


def _timeline(ax, report, step):
    labels = ["step"] + [f"{p}: {d}" for p, d in enumerate(report.devices)]
    seen = set()
    if step is not None:
        for phase, replica, start, end, _, _ in step.ranges:
            if replica is None and phase not in _STEP_ROW:
                continue
            y = 0 if replica is None else replica + 1
            colour = _COLOURS.get(phase, "#7f7f7f")
            ax.barh(y, (end - start) / 1e6, left=start / 1e6, height=0.6, color=colour,
                    label=None if phase in seen else phase, edgecolor="white", linewidth=0.3)
            seen.add(phase)
        for pos, rows in enumerate(step.rows):
            labels[pos + 1] += f" ({rows} rows)"
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms from the forward's start")
    title = "one step per replica" if step is None else f"step {step.index}: where each replica spent its time"
    ax.set_title(title, fontsize=10)
    if seen:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def _memory_bars(ax, report):
    devices = report.memory.devices
    holders = (("master", "#1f77b4"), ("replica_buffers", "#9467bd"), ("staging", "#8c564b"),
               ("pending_grads", "#2ca02c"))
    mib = 2**20
    measured = {r.position: r.peak_bytes for r in report.replicas}
    for i, d in enumerate(devices):
        bottom = 0.0
        for name, colour in holders:
            v = getattr(d, name) / mib
            ax.bar(i, v, bottom=bottom, color=colour, label=name.replace("_", " ") if i == 0 else None)
            bottom += v
        peak = measured.get(d.position) or d.peak
        if peak is not None and peak / mib > bottom:
            ax.bar(i, peak / mib - bottom, bottom=bottom, color="#c7c7c7",
                   label="activations and the rest (peak)" if i == 0 else None)
    ax.set_xticks(range(len(devices)))
    ax.set_xticklabels([f"{d.position}: {d.device}" for d in devices], fontsize=8)
    ax.set_ylabel("MiB")
    host = any(d.peak is None for d in devices)
    ax.set_title("memory per device" + (" (host: fastdp's)" if host else ", by holder"), fontsize=10)
    ax.legend(fontsize=7)


def draw(report, path):
    Figure, Canvas = _matplotlib()
    fig = Figure(figsize=(12, 0.5 * len(report.devices) + 3.2))
    Canvas(fig)
    ax_time, ax_mem = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2.4, 1]})
    _timeline(ax_time, report, _shown_step(report))
    _memory_bars(ax_mem, report)
    head = report.headline()
    advice = "; ".join(a.text for a in report.advice) or "advice: none"
    fig.suptitle(head, fontsize=9)
    fig.text(0.01, 0.01, advice if len(advice) < 220 else advice[:217] + "...", fontsize=7)
    fig.tight_layout(rect=(0, 0.04, 1, 0.95))
    fig.savefig(path, dpi=110)
    return path

