"""``Report.plot(path)``: one PNG with a typical step's timeline per replica and each device's memory by holder.

matplotlib is optional (``pip install 'fastdp[plot]'``). The figure is drawn on its own Agg canvas, never through
pyplot, so a notebook's or a script's own matplotlib state (backend, current figure) is left as it was. The picture
says what the text says: its title is the report's headline, the step drawn is named (the one nearest the median
the headline gives), and the footer holds the report's notes and its advice.
"""

import itertools
import textwrap

from .._balance import memory as _memory

__all__ = ["draw", "figure", "drawn_step"]

_COLOURS = {"scatter": "#8c564b", "replicate": "#9467bd", "forward": "#1f77b4", "gather": "#e377c2",
            "backward": "#ff7f0e", "reduce": "#2ca02c", "wait-reduce": "#d62728"}
_STEP_ROW = ("scatter", "replicate", "gather", "reduce", "wait-reduce")
_HOLDER_COLOURS = {"master": "#1f77b4", "replica_buffers": "#9467bd", "staging": "#8c564b", "pending_grads": "#2ca02c"}
_PEAK_COLOUR = "#c7c7c7"

# Text sizes (points) and how many characters a line holds at that size: across the figure (12 inches wide), across
# the timeline (about two thirds of it) and across the memory panel.
_WIDTH_IN = 12
_HEAD_PT, _HEAD_CHARS = 11, 140
_FOOT_PT, _FOOT_CHARS = 9, 165
_TIMELINE_CHARS = 85
_MEMORY_CHARS = 40


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


def drawn_step(report):
    """The recorded step the picture draws: the summarised one nearest the median (``report.median_step``), or
    None when no step is summarised."""
    return next((r for r in report.ranges if r.index == report.median_step), None)


def _span_ms(step):
    return max((end for _, _, _, end, _, _ in step.ranges), default=0) / 1e6


def _timeline_title(report, step):
    typical = ", the one nearest the median" if report.steps > 1 else ""
    return f"step {step.index} ({_span_ms(step):.2f} ms){typical}: where each replica spent its time"


def _timeline(ax, report, step):
    """A bar per recorded range of `step`: the whole-step phases on the first row, each replica's below. Without a
    step, the report's notes say why in its place."""
    if step is None:
        ax.set_title("no step to draw yet", fontsize=10)
        why = "\n\n".join(textwrap.fill(n, _TIMELINE_CHARS) for n in report.notes) or "nothing recorded"
        ax.text(0.5, 0.5, why, ha="center", va="center", fontsize=10, transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])
        return
    labels = ["step"] + [f"{p}: {d} ({rows} rows)" for p, (d, rows) in enumerate(zip(report.devices, step.rows))]
    seen = set()
    for phase, replica, start, end, _, _ in step.ranges:
        if replica is None and phase not in _STEP_ROW:
            continue
        ax.barh(0 if replica is None else replica + 1, (end - start) / 1e6, left=start / 1e6, height=0.6,
                color=_COLOURS.get(phase, "#7f7f7f"), label=None if phase in seen else phase, edgecolor="white",
                linewidth=0.3)
        seen.add(phase)
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel("ms from the forward's start", fontsize=9)
    ax.set_title(_timeline_title(report, step), fontsize=10)
    if seen:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def _holder_label(name, label):
    return f"{label}: yours, not fastdp's" if name == "master" else f"fastdp: {label}"


def _memory_bars(ax, report):
    """Each device's bytes stacked by what holds them (the memory table's columns), and above them the rest up to
    the step's peak where the allocator measures one."""
    devices = report.memory.devices
    shown, held, peaks = _holdings(report)
    tallest = max([sum(h) for h in held] + [p or 0 for p in peaks] + [1])
    unit, scale = _memory.byte_unit(tallest)
    _stacked(ax, [[v / scale for v in h] for h in held], [None if p is None else p / scale for p in peaks], shown)
    ax.set_xticks(range(len(devices)))
    ax.set_xticklabels([f"{d.position}: {d.device}" for d in devices], fontsize=9)
    ax.set_ylabel(unit, fontsize=9)
    ax.set_ylim(0, tallest / scale * 1.45)  # room for the legend above the bars
    title = "memory now, by what holds it"
    if any(d.peak is None for d in devices):
        title += "\n" + textwrap.fill("'cpu' replicas share the host's memory", _MEMORY_CHARS)
    ax.set_title(title, fontsize=10)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper right")


def _holdings(report):
    """(the holders some device has bytes in, each device's bytes per such holder, each device's peak or None)."""
    devices = report.memory.devices
    measured = {r.position: r.peak_bytes for r in report.replicas}
    shown = [(name, label) for name, label in _memory.HOLDERS if any(getattr(d, name) for d in devices)]
    return (shown, [[getattr(d, name) for name, _ in shown] for d in devices],
            [measured.get(d.position) or d.peak for d in devices])


def _stacked(ax, values, peaks, shown):
    """A bar per device: `values` (per device, one per holder in `shown`) stacked, then the rest up to its peak."""
    labelled = set()

    def bar(i, value, bottom, colour, label):
        ax.bar(i, value, bottom=bottom, color=colour, label=None if label in labelled else label)
        labelled.add(label)

    for i, (held, peak) in enumerate(zip(values, peaks)):
        for v, (name, label), bottom in zip(held, shown, itertools.accumulate([0.0] + held)):
            bar(i, v, bottom, _HOLDER_COLOURS[name], _holder_label(name, label))
        if peak is not None and peak > sum(held):
            bar(i, peak - sum(held), sum(held), _PEAK_COLOUR, "the rest up to the peak (activations...)")


def _footer(report):
    """The report's notes (when a step is drawn: else they stand in its place) and its advice, wrapped, in the
    text's words."""
    lines = []
    if report.notes and drawn_step(report) is not None:
        lines.append("notes:")
        for n in report.notes:
            lines += textwrap.wrap(n, _FOOT_CHARS, initial_indent="  - ", subsequent_indent="    ")
    if not report.advice:
        return lines + ["advice: none" + ("" if report.steps else " yet (no step measured)")]
    lines.append("advice:")
    for a in report.advice:
        lines += textwrap.wrap(a.text, _FOOT_CHARS, initial_indent="  - ", subsequent_indent="    ")
    return lines


def figure(report):
    """The report's picture: a matplotlib Figure on its own Agg canvas."""
    Figure, Canvas = _matplotlib()
    head = textwrap.wrap(report.headline(), _HEAD_CHARS)
    foot = _footer(report)
    head_in, foot_in = 0.2 * len(head) + 0.1, 0.18 * len(foot) + 0.25
    body_in = 0.5 * len(report.devices) + 3.0
    height = head_in + body_in + foot_in
    fig = Figure(figsize=(_WIDTH_IN, height))
    Canvas(fig)
    ax_time, ax_mem = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2.4, 1]})
    _timeline(ax_time, report, drawn_step(report))
    _memory_bars(ax_mem, report)
    fig.suptitle("\n".join(head), fontsize=_HEAD_PT)
    fig.text(0.01, 0.12 / height, "\n".join(foot), fontsize=_FOOT_PT, va="bottom")
    fig.tight_layout(rect=(0, foot_in / height, 1, 1 - head_in / height))
    return fig


def draw(report, path):
    """Saves the report's picture (:func:`figure`) as a PNG at `path`; returns `path`."""
    figure(report).savefig(path, dpi=110)
    return path
