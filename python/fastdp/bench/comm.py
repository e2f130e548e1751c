"""Bandwidth of fastdp.comm per operation and backend, next to the copy limit measured in the same run.

GB/s counts the bytes each call writes to destination buffers (broadcast, scatter, gather, and the flat buffers of
broadcast_coalesced) or, for reduce, the bytes of the inputs it sums. The limit is one plain copy of the same size:
libc memcpy on the host, a device-to-device copy_ on a GPU; 100% is that limit. Writing several destinations for
one read of the source, counting every input a reduce reads, and the host backend's threads against one memcpy
can each pass 100%: the table's header, the CSV (bytes_counted, counted_as, limit_reference) and the chart say so.
Outputs are preallocated (the ``out=`` forms), so the numbers measure the transport, not the allocator. Every
buffer of a size is held at once (about 19 times the size at 4 entries), so the default sizes stop at 32 MB.
"""

import csv
import ctypes
import ctypes.util
import os
import statistics
import sys
import time

import torch

from .. import _C, comm
from . import phases

MB = 1 << 20


def _host_memcpy(nbytes):
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.memcpy.restype = ctypes.c_void_p
    libc.memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return lambda: libc.memcpy(dst.data_ptr(), src.data_ptr(), nbytes)


def _cases(device_entries, nbytes, replicas):
    """(operation, bytes counted, what they are, callable) for one buffer size."""
    dev0 = torch.device(device_entries[0])
    n = nbytes // 4
    x = torch.rand(n, device=dev0)
    devs = [torch.device(d) for d in device_entries]
    b_out = [x] + [torch.empty_like(x, device=d) for d in devs[1:]]
    chunks = [c.shape[0] for c in torch.chunk(x, replicas)]
    s_out = [x[: chunks[0]]] + [torch.empty(c, device=d) for c, d in zip(chunks[1:], devs[1:])]
    g_in = [torch.rand(c, device=d) for c, d in zip(chunks, devs)]
    g_out = torch.empty(n, device=dev0)
    r_in = [torch.rand(n, device=dev0) for _ in range(replicas)]
    r_out = torch.empty(n, device=dev0)
    # A model-like parameter list: 64 tensors of mixed sizes adding up to the buffer size.
    sizes = [max(1, int(n * w)) for w in torch.softmax(torch.linspace(0, 3, 64), 0).tolist()]
    params = [torch.rand(s, device=dev0) for s in sizes]
    p_bytes = sum(sizes) * 4
    dests = f"written to {replicas - 1} destinations"
    return [
        ("broadcast", nbytes * (replicas - 1), dests, lambda: comm.broadcast(x, out=b_out)),
        ("broadcast_coalesced", p_bytes * (replicas - 1), dests + " (64 tensors)",
         lambda: comm.broadcast_coalesced(params, device_entries)),
        ("scatter", (n - chunks[0]) * 4, dests + " (chunk 0 stays in place)", lambda: comm.scatter(x, out=s_out)),
        ("gather", nbytes, f"written to 1 destination from {replicas} inputs", lambda: comm.gather(g_in, out=g_out)),
        (f"reduce x{replicas}", nbytes * replicas, f"read from {replicas} inputs (1 output written)",
         lambda: _C.reduce(r_in, r_out, _streams(r_in))),
    ]


def buffer_bytes(nbytes, replicas):
    """What one size holds at once (every operation's inputs and outputs, the copy limit's two buffers, the fresh
    outputs of broadcast_coalesced and its packed source): the benchmark's memory, beyond torch's own, is this at
    its largest size."""
    r = replicas
    return int(nbytes * (2 + 1 + (r - 1) + (r - 1) / r + 1 + 1 + r + 1 + 1 + (r - 1) + 1))


def _streams(ts):
    from .._native.core import streams_for

    return streams_for(ts)


def _d2d(nbytes):
    a = torch.ones(nbytes, dtype=torch.uint8, device="cuda:0")
    b = torch.empty_like(a)
    return lambda: b.copy_(a)


# What 100% is on each backend: one plain copy of the same size, timed with the operations.
_LIMIT = {
    "host": ("memcpy of the same size, one thread", "one memcpy of the same size on one thread (libc)"),
    "cuda": ("copy_ of the same size on cuda:0", "one device-to-device copy_ of the same size on cuda:0"),
    "nccl": ("copy_ of the same size on cuda:0", "one device-to-device copy_ of the same size on cuda:0"),
}
DEFAULT_SIZES_MB = "1,4,16,32"
MIN_ROUNDS = 7


def _targets(replicas):
    """(backend, device entries, sync, copy-limit maker) per target. A target's sync waits for every GPU its
    calls use: a timing over several devices ends when the last of them is done."""
    targets = [("host", ["cpu"] * replicas, lambda: None, _host_memcpy)]
    if torch.cuda.is_available():
        targets.append(("cuda", ["cuda:0"] * replicas, phases.synchronize_all([0]), _d2d))
        if torch.cuda.device_count() >= replicas:
            targets.append(("nccl", [f"cuda:{i}" for i in range(replicas)], phases.synchronize_all(range(replicas)),
                            _d2d))
    return targets


def _mb(nbytes):
    return f"{nbytes / MB / 1024:.1f} GB" if nbytes >= 1 << 30 else f"{nbytes / MB:.0f} MB"


def _parallel_min_mib():
    """The size from which the host backend splits a call across threads (FASTDP_HOST_PARALLEL_MIN, bytes)."""
    try:
        return int(os.environ.get("FASTDP_HOST_PARALLEL_MIN", 16 * MB)) // MB
    except ValueError:
        return 16


def _header(replicas, sizes, targets):
    """What the table's numbers count and what they are compared with, printed before it."""
    most = buffer_bytes(max(sizes) * MB, replicas)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    lines = [
        f"fastdp comm benchmark: {replicas} device entries per call; sizes {', '.join(map(str, sizes))} MB "
        f"(--sizes-mb for others: {max(sizes)} MB holds about {_mb(most)} of buffers)",
        f"host threads: {os.environ.get('FASTDP_HOST_THREADS', 'all cores')} of {os.cpu_count()} cores"
        + (f"; load average {load:.2f}" if load is not None else "")
        + ("; other jobs on these cores move the rates between runs" if load is not None and load >= 1 else ""),
        f"GB/s = bytes counted per call / median time per call (interleaved rounds): broadcast, "
        f"broadcast_coalesced and scatter count the bytes written to their {replicas - 1} destinations, gather "
        f"the bytes it writes, reduce x{replicas} the bytes of its {replicas} inputs (it writes one output).",
    ]
    for backend in dict.fromkeys(t[0] for t in targets):
        lines.append(f"% ({backend}): 100% = {_LIMIT[backend][1]}, the copy limit, measured at each size in the "
                     "same rounds.")
    lines.append(f"Above 100% is possible: broadcast writes {replicas - 1} destinations for one read of its "
                 f"source, reduce x{replicas} reads {replicas} inputs for each output it writes, and the host "
                 f"backend splits a call of {_parallel_min_mib()} MiB or more across threads where the copy limit "
                 "uses one.")
    return lines


def measure(fns, sync, seconds):
    """Median seconds per call of each (name, fn), over interleaved rounds; fns[0] is the copy limit. Each round
    times every operation once and the copy limit twice, first and halfway, so drift in the machine's speed hits
    all columns alike and the reference of every percentage gets twice the samples. One call per sample, never
    the same call twice in a row: a call repeated at once would find its buffers in the cache, which a step's
    communication does not."""
    for _, fn in fns:
        fn()
    sync()
    times = {name: [] for name, _ in fns}
    limit, ops = fns[0], fns[1:]
    half = (len(ops) + 1) // 2
    order = [limit] + ops[:half] + [limit] + ops[half:]
    deadline = time.perf_counter() + seconds * len(fns)
    while len(times[limit[0]]) < 2 * MIN_ROUNDS or (time.perf_counter() < deadline
                                                    and len(times[limit[0]]) < 80):
        for name, fn in order:
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def run(args):
    sizes_arg = args.sizes_mb or DEFAULT_SIZES_MB
    try:
        sizes = [int(s) for s in sizes_arg.split(",") if s.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        print(f"python -m fastdp.bench comm: --sizes-mb takes positive whole MB, e.g. 1,4,16,32 (got "
              f"{sizes_arg!r})", file=sys.stderr)
        return 2
    replicas = max(2, args.replicas)
    rows = []
    targets = _targets(replicas)
    for line in _header(replicas, sizes, targets):
        print(line, flush=True)
    header = f"{'backend':<8}{'size':>8}  {'copy limit':>11}  " + "  ".join(
        f"{name:>22}" for name in ["broadcast", "broadcast_coalesced", "scatter", "gather", f"reduce x{replicas}"])
    print(header, flush=True)
    for backend, entries, sync, limit_fn in targets:
        for mb in sizes:
            nbytes = mb * MB
            print(f"measuring {mb} MB on the {backend} backend (about {_mb(buffer_bytes(nbytes, replicas))} of "
                  "buffers)...", flush=True)
            cases = _cases(entries, nbytes, replicas)
            fns = [("copy limit", limit_fn(nbytes))] + [(name, fn) for name, _, _, fn in cases]
            per_call = measure(fns, sync, args.seconds)
            limit = nbytes / per_call["copy limit"] / 1e9
            cells = []
            for name, counted, counted_as, _ in cases:
                gbs = counted / per_call[name] / 1e9
                rows.append({"backend": backend, "size_mb": mb, "operation": name, "gb_s": round(gbs, 2),
                             "copy_limit_gb_s": round(limit, 2), "percent_of_limit": round(100 * gbs / limit, 1),
                             "bytes_counted": counted, "counted_as": counted_as,
                             "limit_reference": _LIMIT[backend][0]})
                cells.append(f"{gbs:7.2f} GB/s ({100 * gbs / limit:4.0f}%)")
            del cases, fns
            print(f"{backend:<8}{mb:>5} MB  {limit:6.2f} GB/s  " + "  ".join(f"{c:>22}" for c in cells), flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "comm.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {path}")
    png = write_png(rows, os.path.join(args.out, "comm.png"))
    if png:
        print(f"wrote {png}")
    return 0


def write_png(rows, path):
    """Per backend, two panels against the buffer size: GB/s per operation with the copy limit measured at each
    size, and the same rates as % of that limit, where the reference is the flat 100% line. The legend and the
    note on what the percentages count sit below the panels, off the lines (matplotlib)."""
    from .report import pyplot

    plt = pyplot()
    if plt is None:
        return None
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    below = 0.95  # inches under the panels for the legend and the note
    height = 3.9 * len(backends) + below
    fig, axes = plt.subplots(len(backends), 2, figsize=(12, height), squeeze=False)
    for (ax_rate, ax_pct), backend in zip(axes, backends):
        mine = [r for r in rows if r["backend"] == backend]
        sizes = sorted({r["size_mb"] for r in mine})
        for op in dict.fromkeys(r["operation"] for r in mine):
            by = {r["size_mb"]: r for r in mine if r["operation"] == op}
            ax_rate.plot(sizes, [by[s]["gb_s"] for s in sizes], marker="o", label=op)
            ax_pct.plot(sizes, [by[s]["percent_of_limit"] for s in sizes], marker="o", label=op)
        limit = {r["size_mb"]: r["copy_limit_gb_s"] for r in mine}
        ax_rate.plot(sizes, [limit[s] for s in sizes], color="black", linestyle="--", marker="x",
                     label="copy limit (= 100%)")
        ax_pct.axhline(100, color="black", linestyle="--")
        ax_pct.set_ylim(bottom=0, top=max(110, 1.08 * max(r["percent_of_limit"] for r in mine)))
        ax_rate.set_ylim(bottom=0, top=1.08 * max(max(r["gb_s"] for r in mine), max(limit.values())))
        reference = mine[0]["limit_reference"]
        ax_rate.set_title(f"fastdp.comm, {backend} backend: GB/s (bytes counted per second)", fontsize=10)
        ax_pct.set_title(f"{backend} backend: % of the copy limit ({reference})", fontsize=10)
        ax_rate.set_ylabel("GB/s")
        ax_pct.set_ylabel("% of the copy limit")
        for ax in (ax_rate, ax_pct):
            ax.set_xscale("log", base=2)
            ax.set_xticks(sizes)
            ax.set_xticklabels([f"{s} MB" for s in sizes])
            ax.minorticks_off()
            ax.set_xlabel("buffer size per call (MB, log scale)")
            ax.grid(True, alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    reduce_op = next(r["operation"] for r in rows if r["operation"].startswith("reduce"))
    dests = next(r["counted_as"] for r in rows if r["operation"] == "broadcast")
    inputs = next(r["counted_as"] for r in rows if r["operation"] == reduce_op)
    note = (f"Bytes counted: broadcast, broadcast_coalesced, scatter: {dests}; gather: what it writes; {reduce_op}: "
            f"{inputs}. 100% = the copy limit, one plain copy of the same size.\nAbove 100% is possible: several "
            "destinations written for one read of the source, the inputs a reduce reads counted, several host "
            "threads against one memcpy.")
    fig.tight_layout(rect=(0, below / height, 1, 1))
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, (below - 0.05) / height))
    fig.text(0.5, 0.05 / height, note, ha="center", va="bottom", fontsize=8)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
