"""Bandwidth of fastdp.comm per operation and backend, next to the copy limit measured in the same run.

GB/s counts the bytes each call writes to destination buffers (broadcast, scatter, gather, and the flat buffers of
broadcast_coalesced) or, for reduce, the bytes of the inputs it sums. The limit is one plain copy of the same size:
libc memcpy on the host, a device-to-device copy_ on a GPU. Outputs are preallocated (the ``out=`` forms), so
the numbers measure the transport, not the allocator.
"""

import csv
import ctypes
import ctypes.util
import os
import statistics
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
    """(operation, bytes counted, callable) for one buffer size."""
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
    return [
        ("broadcast", nbytes * (replicas - 1), lambda: comm.broadcast(x, out=b_out)),
        ("broadcast_coalesced", p_bytes * (replicas - 1), lambda: comm.broadcast_coalesced(params, device_entries)),
        ("scatter", (n - chunks[0]) * 4, lambda: comm.scatter(x, out=s_out)),
        ("gather", nbytes, lambda: comm.gather(g_in, out=g_out)),
        (f"reduce x{replicas}", nbytes * replicas, lambda: _C.reduce(r_in, r_out, _streams(r_in))),
    ]


def _streams(ts):
    from .._native.core import streams_for

    return streams_for(ts)


def _d2d(nbytes):
    a = torch.ones(nbytes, dtype=torch.uint8, device="cuda:0")
    b = torch.empty_like(a)
    return lambda: b.copy_(a)


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


def run(args):
    sizes = [int(s) for s in args.sizes_mb.split(",") if s.strip()]
    replicas = max(2, args.replicas)
    rows = []
    targets = _targets(replicas)
    print(f"fastdp comm benchmark: {replicas} device entries per call; GB/s = bytes written (reduce: bytes summed)"
          " per second; % = of the copy limit")
    print(f"host threads: {os.environ.get('FASTDP_HOST_THREADS', 'all cores')} of {os.cpu_count()} cores")
    header = f"{'backend':<8}{'size':>8}  {'copy limit':>11}  " + "  ".join(
        f"{name:>22}" for name in ["broadcast", "broadcast_coalesced", "scatter", "gather", f"reduce x{replicas}"])
    print(header)
    for backend, entries, sync, limit_fn in targets:
        for mb in sizes:
            nbytes = mb * MB
            # Interleaved rounds: each round times the copy limit and every operation once, so drift in the
            # machine's speed hits all columns alike; medians over the rounds are reported.
            fns = [("copy limit", nbytes, limit_fn(nbytes))] + _cases(entries, nbytes, replicas)
            times = {name: [] for name, _, _ in fns}
            for _, _, fn in fns:
                fn()
            sync()
            deadline = time.perf_counter() + args.seconds * len(fns)
            while len(times["copy limit"]) < 5 or (time.perf_counter() < deadline and len(times["copy limit"]) < 40):
                for name, _, fn in fns:
                    t0 = time.perf_counter()
                    fn()
                    sync()
                    times[name].append(time.perf_counter() - t0)
            rates = {name: counted / statistics.median(times[name]) / 1e9 for name, counted, _ in fns}
            limit = rates.pop("copy limit")
            cells = []
            for name, gbs in rates.items():
                rows.append({"backend": backend, "size_mb": mb, "operation": name, "gb_s": round(gbs, 2),
                             "copy_limit_gb_s": round(limit, 2), "percent_of_limit": round(100 * gbs / limit, 1)})
                cells.append(f"{gbs:7.2f} GB/s ({100 * gbs / limit:4.0f}%)")
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
    """GB/s per operation against the buffer size, one panel per backend, the copy limit dashed (matplotlib)."""
    from .report import pyplot

    plt = pyplot()
    if plt is None:
        return None
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    fig, axes = plt.subplots(1, len(backends), figsize=(6.5 * len(backends), 4.2), squeeze=False)
    for ax, backend in zip(axes[0], backends):
        mine = [r for r in rows if r["backend"] == backend]
        sizes = sorted({r["size_mb"] for r in mine})
        for op in dict.fromkeys(r["operation"] for r in mine):
            by = {r["size_mb"]: r["gb_s"] for r in mine if r["operation"] == op}
            ax.plot(sizes, [by.get(s) for s in sizes], marker="o", label=op)
        limit = {r["size_mb"]: r["copy_limit_gb_s"] for r in mine}
        ax.plot(sizes, [limit[s] for s in sizes], "k--", label="copy limit")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes)
        ax.set_xticklabels([f"{s} MB" for s in sizes])
        ax.set_ylabel("GB/s")
        ax.set_title(f"fastdp.comm, {backend} backend", fontsize=10)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
