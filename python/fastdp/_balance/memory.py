"""``fastdp.memory_report(model)``: per-device allocator figures of a DataParallel and the bytes fastdp keeps on each
device (master, persistent replica buffers, broadcast staging, no_sync gradients)."""

import statistics
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from .._platform import devices as _devices

__all__ = ["DeviceMemory", "MemoryReport", "memory_report", "allocated_and_peak", "PeakWindow", "format_bytes",
           "byte_unit", "distinct_peaks", "HOLDERS"]

# What holds a device's memory, by DeviceMemory field and the name the memory table and the report's picture give it:
# the model's own tensors first (the user's, not fastdp's), then what fastdp keeps (they add up to "fastdp total").
HOLDERS = (("master", "model (master)"), ("replica_buffers", "replica bufs"), ("staging", "staging"),
           ("pending_grads", "no_sync grads"))


def allocated_and_peak(device):
    """(current, peak) allocated bytes of a CUDA device from one allocator query: host-side counters, no device
    synchronisation. The peak is the process-wide counter, which only ``torch.cuda.reset_peak_memory_stats``
    (the user's) lowers."""
    stats = torch.cuda.memory_stats_as_nested_dict(device)["allocated_bytes"]["all"]
    return stats["current"], stats["peak"]


class PeakWindow:
    """Each device's highest allocated bytes between two reads, without resetting the user's peak counters.

    NOTE [peak between reads]: the allocator's peak counter is process-wide and only grows (until the user resets
    it), and the current figure is a moment. At each query (``sample``, and ``read``) both are taken. When the
    peak counter differs from the last query's, a new high was set inside the window (or the user reset the
    counter inside it, and the counter holds the high since then): that high is known exactly and belongs to this
    window. When it did not move, the window's high lies between the highest current figure sampled and the
    counter, and the highest sample is what is known. The wrapper samples where a step's memory is highest: at the
    end of each training forward (every activation alive) and when backward reaches the replicas' outputs (on
    the output device, the gathered outputs and their gradient are alive together then). ``exact`` says, per
    device, whether the last read's figure came from the counter.
    """

    def __init__(self, devices):
        self.devices = list(devices)
        self.high = [0] * len(self.devices)
        self.current = [0] * len(self.devices)
        self.last_peak = [None] * len(self.devices)
        self.moved = [False] * len(self.devices)
        self.exact = [False] * len(self.devices)

    def sample(self):
        for i, d in enumerate(self.devices):
            current, peak = allocated_and_peak(d)
            if self.last_peak[i] is not None and peak != self.last_peak[i]:
                self.moved[i] = True
                self.high[i] = max(self.high[i], peak)
            self.last_peak[i] = peak
            self.current[i] = current
            self.high[i] = max(self.high[i], current)

    def peek(self):
        """Each device's high since the previous read, without starting a new window."""
        self.sample()
        return list(self.high)

    def read(self):
        """Each device's high since the previous read; the next window starts at the current figure."""
        self.sample()
        highs, self.exact = self.high, self.moved
        self.high = list(self.current)
        self.moved = [False] * len(self.devices)
        return highs


@dataclass
class DeviceMemory:
    """One entry of ``device_ids``: allocator figures of its device and what fastdp keeps there."""

    position: int  # index in device_ids
    device: str  # "cuda:k" or "cpu"
    chunk: Optional[int]  # samples it got in the last forward (None: not known)
    allocated: Optional[int]  # torch.cuda.memory_allocated (None on "cpu": n/a)
    peak: Optional[int]  # torch.cuda.max_memory_allocated (None on "cpu": n/a)
    master: int  # the master module's parameters, buffers and gradients on this device
    replica_buffers: int  # persistent flat buffers holding this replica's parameter and buffer copies
    staging: int  # NCCL broadcast staging buffers (device_ids[0] only)
    pending_grads: int  # the unsynced sums no_sync() holds for this replica (not yet reduced)

    @property
    def fastdp_bytes(self):
        """What fastdp itself keeps on this device ("fastdp total"): the model's own tensors (``master``) are not
        counted."""
        return self.replica_buffers + self.staging + self.pending_grads


def distinct_peaks(pairs):
    """The peaks of distinct devices, first seen first, from (device, peak or None) pairs (a device listed twice
    holds one allocator)."""
    seen, peaks = set(), []
    for device, peak in pairs:
        if peak is not None and device not in seen:
            seen.add(device)
            peaks.append(peak)
    return peaks


def byte_unit(n):
    """(unit, bytes per unit): the largest binary unit that keeps ``n`` bytes at 1 or more."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return unit, scale
    return "B", 1


def format_bytes(n):
    """Bytes in the largest binary unit that keeps the number at 1 or more ("n/a" for None)."""
    if n is None:
        return "n/a"
    unit, scale = byte_unit(n)
    return f"{n} B" if scale == 1 else f"{n / scale:.1f} {unit}"


@dataclass
class MemoryReport:
    """``fastdp.memory_report(model)``: one DeviceMemory per entry of device_ids, plus what applies to all."""

    devices: List[DeviceMemory]
    avoided_gather_bytes: Optional[int] = None  # outputs the last per-replica loss forward did not gather
    split: Optional[str] = None  # the chunk_sizes rule
    notes: List[str] = field(default_factory=list)

    def peak_ratio(self):
        """Device 0's peak over the median of the other devices' peaks (None when it cannot be measured)."""
        peaks = distinct_peaks((d.device, d.peak) for d in self.devices)
        if len(peaks) < 2:
            return None
        others = statistics.median(peaks[1:])
        return peaks[0] / others if others else None

    def __str__(self):
        head = ("#", "device", "chunk", "allocated", "peak", *(label for _, label in HOLDERS), "fastdp total")
        rows = [head]
        for d in self.devices:
            rows.append((str(d.position), d.device, "-" if d.chunk is None else str(d.chunk),
                         format_bytes(d.allocated), format_bytes(d.peak),
                         *(format_bytes(getattr(d, name)) for name, _ in HOLDERS), format_bytes(d.fastdp_bytes)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
        ratio = self.peak_ratio()
        if ratio is not None:
            lines.append(f"peak of device 0 / median of the others: {ratio:.2f}")
        if self.avoided_gather_bytes is not None:
            lines.append(
                f"per-replica loss: {format_bytes(self.avoided_gather_bytes)} of outputs not gathered on the output "
                "device in the last forward (their gradient would have been as large again in backward)"
            )
        if self.split is not None:
            lines.append(f"chunk_sizes: {self.split}")
        lines.extend(self.notes)
        return "\n".join(lines)


def _bytes(t):
    return t.numel() * t.element_size()


def _master_bytes(module, device):
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        for x in (t, t.grad if isinstance(t, torch.Tensor) and t.grad is not None else None):
            if x is not None and x.device == device and id(x) not in seen:
                seen.add(id(x))
                total += _bytes(x)
    return total


def memory_report(model, *, reset_peak=False):
    """Per-device memory of a ``fastdp.DataParallel`` (or ``torch.nn.DataParallel``) and what fastdp holds.

    ``reset_peak=True`` resets the CUDA peak counters of the listed devices after reading them.
    """
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "device_ids"):
        raise TypeError(
            f"memory_report expects a fastdp.DataParallel or torch.nn.DataParallel, got {type(model).__name__}"
        )
    device_ids = list(getattr(model, "device_ids", None) or [])
    if not device_ids:
        return MemoryReport([], notes=["pass-through wrapper (no device_ids): nothing to report"])
    # A fastdp wrapper answers what its last forward found and what its kept replicas hold; upstream's has neither.
    facts = getattr(model, "_memory_facts", None)
    last_step, held, split = facts() if facts is not None else (None, None, None)
    ids = [_devices.normalize(d) for d in device_ids]
    master = _master_bytes(model.module, _devices.torch_device(ids[0])) if hasattr(model, "module") else 0
    last = (last_step.chunk_sizes if last_step is not None else None) or ()
    rows = _device_rows(ids, last, master)
    notes = []
    if _devices.CPU in ids:
        notes.append("'cpu' devices: current/peak allocator figures are n/a on the host; fastdp's own bytes shown")
    _add_held(rows, notes, held, facts is not None)
    if reset_peak:
        for d in sorted(set(ids) - {_devices.CPU}):
            torch.cuda.reset_peak_memory_stats(d)
    return MemoryReport(
        rows,
        avoided_gather_bytes=None if last_step is None else last_step.avoided_gather_bytes,
        split=split,
        notes=notes,
    )


def _device_rows(ids, last, master):
    """One row per entry of device_ids: the allocator's figures, the chunk the last forward gave it (None past the
    chunks it split into), and the master copy's bytes on the first entry (where the wrapped module lives)."""
    return [_row(i, d, last[i] if i < len(last) else None, master if i == 0 else 0) for i, d in enumerate(ids)]


def _row(position, d, chunk, master):
    """The allocator's figures for one entry of device_ids (n/a on "cpu"); fastdp's buffers are added after."""
    cpu = d == _devices.CPU
    return DeviceMemory(
        position=position,
        device="cpu" if cpu else f"cuda:{d}",
        chunk=chunk,
        allocated=None if cpu else torch.cuda.memory_allocated(d),
        peak=None if cpu else torch.cuda.max_memory_allocated(d),
        master=master,
        replica_buffers=0, staging=0, pending_grads=0,
    )


def _add_held(rows, notes, held, fastdp_wrapper):
    """Adds what the kept replicas hold (flat buffers, staging buffers, no_sync's unsynced sums) to the rows of the
    device_ids positions they live on, or a note that there are none."""
    if held is None:
        if fastdp_wrapper:
            notes.append("no kept replicas yet (or the module replicates afresh every step): fastdp holds no buffers")
        return
    for position, (buffers, staging, unsynced) in held.items():
        rows[position].replica_buffers += buffers
        rows[position].staging += staging
        rows[position].pending_grads += unsynced
