"""Balancing device 0 for ``fastdp.DataParallel``: the batch split (``chunk_sizes=``), the per-replica loss
(``criterion=``) and ``fastdp.memory_report``.

The wrapper calls into this module from ``forward``; see docs/balance.md for the user-facing rules. Nothing here
changes the training result: gradients are sums over samples, so any split of the batch gives the same gradients,
and the per-replica losses are combined with the weights that make them equal the full-batch loss.
"""

import copy
import math
import numbers
import statistics
from dataclasses import dataclass, field
from fractions import Fraction
from typing import List, Optional

import torch
import torch.nn as nn

from . import _devices
from ._functions import Gather

__all__ = ["AutoSplit", "DeviceMemory", "MemoryReport", "memory_report", "largest_remainder"]


# ---- Chunk sizes -------------------------------------------------------------------------------------------------


def largest_remainder(weights, total):
    """Integer sizes adding up to ``total`` in proportion to ``weights`` (Hamilton's largest-remainder method).

    Exact (weights become Fractions, floats included), so the result never depends on rounding noise. Each entry
    gets the floor of its quota; the samples left go to the largest remainders, ties to the later device (device 0
    holds the master, so it never gets the extra sample of a tie). A zero weight always gets zero.
    """
    quotas = [Fraction(w) for w in weights]
    whole = sum(quotas)
    quotas = [total * q / whole for q in quotas]
    sizes = [q.numerator // q.denominator for q in quotas]
    left = total - sum(sizes)
    order = sorted(range(len(sizes)), key=lambda i: (quotas[i] - sizes[i], i), reverse=True)
    for i in order[:left]:
        sizes[i] += 1
    return sizes


class _Explicit:
    """Per-device ints; every batch must add up to them."""

    kind = "sizes"

    def __init__(self, sizes):
        self.sizes = sizes

    def split(self, batch, dim):
        if sum(self.sizes) != batch:
            raise ValueError(
                f"chunk_sizes={self.sizes} add up to {sum(self.sizes)}, but the batch has {batch} samples along dim "
                f"{dim}; explicit sizes (ints) must add up to the batch. Pass float weights (e.g. "
                f"{[float(s) for s in self.sizes]}) to split batches of any size in that proportion."
            )
        return list(self.sizes)

    def describe(self):
        return f"sizes {self.sizes}"


class _Weights:
    """Relative weights, rounded per batch size by largest remainder (cached: the rule is deterministic)."""

    kind = "weights"

    def __init__(self, weights):
        self.weights = weights
        self._cache = {}

    def split(self, batch, dim):
        sizes = self._cache.get(batch)
        if sizes is None:
            sizes = self._cache[batch] = largest_remainder(self.weights, batch)
        return list(sizes)

    def describe(self):
        return f"weights {self.weights}"


def _number(x, where):
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{where} must be an int (a size) or a float (a weight), got {type(x).__name__} {x!r}")
    if isinstance(x, numbers.Integral):
        return int(x)
    return float(x)


def parse_chunk_sizes(spec, ndev):
    """The split rule for ``chunk_sizes=spec`` over ``ndev`` devices (None: upstream's torch.chunk rule).

    ``ndev`` is None for a pass-through wrapper (no devices), which checks the form only.
    """
    if spec is None:
        return None
    if isinstance(spec, str):
        if spec != "auto":
            raise ValueError(
                f"chunk_sizes={spec!r}: expected None, 'auto', a float in [0, 1] (device 0's share of each other "
                "device's share), or one int size or float weight per device"
            )
        spec = AutoSplit()
    if isinstance(spec, AutoSplit):
        return spec
    if isinstance(spec, torch.Tensor) and spec.dim() == 0:
        spec = spec.item()
    if isinstance(spec, (bool, numbers.Real)):
        share = _number(spec, "chunk_sizes")
        if not math.isfinite(share) or not 0 <= share <= 1:
            raise ValueError(
                f"chunk_sizes={spec!r}: a single number is device 0's share relative to each other device's, and "
                "must be finite and in [0, 1] (0.5: device 0 gets half as many samples as each other device; 0: "
                "none). For a fixed number of samples pass one int per device; for any other proportion, one "
                "float weight per device"
            )
        if ndev is None:
            return _Weights([share])
        if ndev == 1:
            if share == 0:
                raise ValueError(
                    "chunk_sizes=0 gives device 0 no samples, but device_ids has a single device; expected a share "
                    "in (0, 1] with one device, or more devices"
                )
            return _Weights([1.0])
        return _Weights([float(share)] + [1.0] * (ndev - 1))
    if hasattr(spec, "tolist") and not isinstance(spec, (list, tuple)):
        spec = spec.tolist()  # tensors and numpy arrays
    if not isinstance(spec, (list, tuple)):
        raise TypeError(
            f"chunk_sizes must be None, 'auto', a float share for device 0, or a list/tuple with one entry per "
            f"device; got {type(spec).__name__}"
        )
    values = [_number(x, f"chunk_sizes[{i}]") for i, x in enumerate(spec)]
    if ndev is not None and len(values) != ndev:
        raise ValueError(
            f"chunk_sizes has {len(values)} entries but device_ids has {ndev} devices; expected one size (int) or "
            "weight (float) per device"
        )
    for i, v in enumerate(values):
        if not math.isfinite(v):
            raise ValueError(f"chunk_sizes[{i}] is {v}; expected finite, non-negative weights")
        if v < 0:
            raise ValueError(f"chunk_sizes[{i}] is {v}; expected non-negative sizes or weights")
    if not any(v > 0 for v in values):
        raise ValueError(
            f"chunk_sizes={list(spec)} are all zero; expected at least one device with a positive size or weight"
        )
    if all(isinstance(v, int) for v in values):
        return _Explicit(values)
    return _Weights([float(v) for v in values])


def _leaf_sizes(obj, dim, path, out):
    """(path, size along dim) of every tensor leaf that scatter splits, in scatter's recursion order."""
    if isinstance(obj, torch.Tensor):
        if obj.dim() > 0:
            d = dim + obj.dim() if dim < 0 else dim
            if 0 <= d < obj.dim():
                out.append((path, obj.shape[d]))
        return out
    if isinstance(obj, (tuple, list)):
        for i, x in enumerate(obj):
            _leaf_sizes(x, dim, f"{path}[{i}]", out)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _leaf_sizes(v, dim, f"{path}[{k!r}]", out)
    return out


def _one_batch(leaves, dim, why):
    sizes = {n for _, n in leaves}
    if len(sizes) > 1:
        listed = ", ".join(f"{p}: {n}" for p, n in leaves[:8])
        raise ValueError(
            f"{why}, so every tensor must have the same size along dim {dim}; got {listed}"
        )
    return leaves[0][1]


def split_for(rule, inputs, kwargs, dim, ndev):
    """Per-device chunk sizes of this forward's batch, or None for upstream's rule (no tensors, empty batch)."""
    leaves = _leaf_sizes(inputs, dim, "input", [])
    _leaf_sizes(kwargs, dim, "kwargs", leaves)
    if not leaves:
        return None
    batch = _one_batch(leaves, dim, "chunk_sizes splits every tensor of the inputs in the same way")
    if batch == 0:
        return None
    if isinstance(rule, AutoSplit):
        return rule.split(batch, dim, ndev)
    return rule.split(batch, dim)


def check_target(inputs, kwargs, target, dim):
    """The target must have the inputs' batch size along dim: it is split exactly like them."""
    leaves = _leaf_sizes(inputs, dim, "input", [])
    _leaf_sizes(kwargs, dim, "kwargs", leaves)
    theirs = _leaf_sizes(target, dim, "target", [])
    if not leaves or not theirs:
        return
    batch = leaves[0][1]
    for path, n in theirs:
        if n != batch:
            raise ValueError(
                f"{path} has {n} samples along dim {dim} but the inputs have {batch} ({leaves[0][0]}); the target is "
                "split across replicas like the inputs, so its batch size must be the same"
            )


# ---- Settling device 0's share from measured peaks ("auto") ------------------------------------------------------


class _CudaPeaks:
    """Peak allocated bytes of each device since the previous call (the peak counters are reset after reading)."""

    def __init__(self, devices):
        self.devices = list(devices)

    def __call__(self):
        peaks = [torch.cuda.max_memory_allocated(d) for d in self.devices]
        for d in self.devices:
            torch.cuda.reset_peak_memory_stats(d)
        return peaks


class AutoSplit:
    """``chunk_sizes="auto"``: device 0's share (relative to each other device) found from measured peak memory.

    Training forwards (grad enabled, module in training mode) drive it: at the start of each one, ``reader()``
    returns every device's peak allocated bytes since the previous call (the default reader uses
    ``torch.cuda.max_memory_allocated`` and resets the peak counters). The first ``warmup`` steps are not judged
    (optimizers allocate their state in the first step). Then the share starts at 1 (equal split); while device
    0's peak exceeds ``(1 + tolerance)`` times the median of the others', the share is bisected in [0, 1] for
    ``probes`` steps, and settles on the largest share measured within the bound (0 if none was). Steps whose
    batch size differs from the first judged step's are not judged. Once settled the share never changes, so the
    split is deterministic from then on. Without a usable reader (CPU replicas, a GPU listed more than once) it
    settles at once on share 1.
    """

    kind = "auto"

    def __init__(self, *, warmup=2, probes=5, tolerance=0.05, reader=None):
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"warmup must be a non-negative int, got {warmup!r}")
        if isinstance(probes, bool) or not isinstance(probes, int) or probes < 1:
            raise ValueError(f"probes must be a positive int, got {probes!r}")
        if isinstance(tolerance, bool) or not isinstance(tolerance, numbers.Real) or not 0 <= tolerance < math.inf:
            raise ValueError(f"tolerance must be a finite non-negative number, got {tolerance!r}")
        if reader is not None and not callable(reader):
            raise TypeError(f"reader must be callable (returning one peak per device), got {type(reader).__name__}")
        self.warmup, self.probes, self.tolerance, self.reader = warmup, probes, float(tolerance), reader
        self.share = 1.0
        self.settled = False
        self.reason = None
        self.history = []  # (share, device-0 peak / median of the others) of every judged step
        self._lo, self._hi = 0.0, 1.0
        self._calls = 0
        self._step_share = None
        self._last_batch = None
        self._armed = False
        self._ref_batch = None
        self._ndev = None

    def bind(self, devices):
        """A copy of this rule for one wrapper's device list (a rule object may be passed to several wrappers)."""
        bound = copy.copy(self)
        bound.history = []
        bound._ndev = len(devices)
        if len(devices) < 2:
            bound._settle(1.0, "one device")
        elif bound.reader is None:
            if any(d == _devices.CPU for d in devices):
                bound._settle(1.0, "no allocator to measure on 'cpu' devices: equal split")
            elif len(set(devices)) != len(devices):
                bound._settle(1.0, "a GPU listed more than once cannot be measured per replica: equal split")
            else:
                bound.reader = _CudaPeaks(devices)
        return bound

    def _settle(self, share, reason):
        self.share, self.settled, self.reason = share, True, reason

    def split(self, batch, dim, ndev):
        if self._armed:  # the training forward that observe() just opened (not an evaluation in between)
            self._last_batch, self._armed = batch, False
        return largest_remainder([self.share] + [1.0] * (ndev - 1), batch)

    def observe(self):
        """Called at the start of every training forward: judges the step that just ended, picks the next share."""
        if self.settled:
            return
        peaks = list(self.reader())
        if len(peaks) != self._ndev:
            raise ValueError(f"chunk_sizes='auto': the reader returned {len(peaks)} peaks for {self._ndev} devices")
        judged, batch = self._step_share, self._last_batch
        self._step_share = self.share
        self._armed = True
        self._calls += 1
        if self._calls <= 1 + self.warmup or judged is None:
            return  # the first reading covers what ran before training; then the warm-up steps
        if self._ref_batch is None:
            self._ref_batch = batch
        elif batch != self._ref_batch:
            return
        others = statistics.median(peaks[1:])
        ratio = peaks[0] / others if others > 0 else math.inf
        self.history.append((judged, ratio))
        over = ratio > 1 + self.tolerance
        if len(self.history) == 1:  # the equal split
            if not over:
                self._settle(1.0, "device 0 within the bound at the equal split")
                return
            self._hi = 1.0
        elif over:
            self._hi = judged
        else:
            self._lo = judged
        if len(self.history) > self.probes:
            self._settle(self._lo, f"settled after {len(self.history)} measured steps")
        else:
            self.share = (self._lo + self._hi) / 2
        self._step_share = self.share

    def describe(self):
        state = f"settled ({self.reason})" if self.settled else f"measuring, {len(self.history)} steps judged"
        return f"auto: device 0 share {self.share:g}, {state}"


# ---- Per-replica loss --------------------------------------------------------------------------------------------

_RATIO = (nn.CrossEntropyLoss, nn.NLLLoss)


def _first_tensor(obj):
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, (tuple, list)):
        items = obj
    elif isinstance(obj, dict):
        items = obj.values()
    else:
        return None
    for x in items:
        t = _first_tensor(x)
        if t is not None:
            return t
    return None


def _tensor_bytes(obj):
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(_tensor_bytes(x) for x in obj)
    if isinstance(obj, dict):
        return sum(_tensor_bytes(x) for x in obj.values())
    return 0


def loss_rule(criterion, target, dim):
    """How the replicas' losses combine into the full-batch loss: "sum", "mean", "ratio" or "none".

    "mean" weights each replica's loss by its chunk's share of the batch. "ratio" is for CrossEntropyLoss and
    NLLLoss with class-index targets, whose mean divides by the summed class weights of the targets that are not
    ``ignore_index``: each replica returns its sum and that denominator, and the total is sum / denominator.
    """
    reduction = getattr(criterion, "reduction", "mean")
    if reduction == "sum":
        return "sum"
    if reduction == "none":
        return "none"
    if reduction == "batchmean":  # KLDivLoss: the sum over the chunk divided by its size along dim 0
        return "mean" if dim == 0 else "sum"
    if reduction == "mean":
        t = _first_tensor(target)
        if isinstance(criterion, _RATIO) and t is not None and not t.is_floating_point():
            return "ratio"
        return "mean"
    raise ValueError(
        f"criterion.reduction is {reduction!r}; fastdp combines per-replica losses for 'mean', 'sum', 'batchmean' "
        "and 'none'"
    )


def criterion_replicas(criterion, devices, rule):
    """One criterion per replica device: Module criteria are replicated like the model (their tensors, e.g.
    class weights, then live on each device, and learnable ones get their gradients summed back)."""
    if not isinstance(criterion, nn.Module):
        return [criterion] * len(devices)
    from .replicate import replicate

    copies = replicate(criterion, devices, not torch.is_grad_enabled())
    if rule == "ratio":
        for c in copies:
            c.reduction = "sum"  # each copy is a shallow copy with its own __dict__: the master keeps "mean"
    return copies


def _ratio_denominator(criterion, target):
    valid = target != criterion.ignore_index
    weight = criterion.weight
    if weight is None:
        return valid.sum()
    # No boolean-mask indexing: that would synchronise the device with the host in every replica.
    return (weight.detach()[target.masked_fill(~valid, 0)] * valid).sum()


class ReplicaLoss:
    """What a worker runs for one replica: its forward, then the criterion on its chunk of the target (the last
    positional argument). Returns (loss, denominator or None, bytes of the output it did not gather)."""

    __slots__ = ("replica", "criterion", "rule")

    def __init__(self, replica, criterion, rule):
        self.replica, self.criterion, self.rule = replica, criterion, rule

    def __call__(self, *args, **kwargs):
        *args, target = args
        out = self.replica(*args, **kwargs)
        loss = self.criterion(out, target)
        den = _ratio_denominator(self.criterion, target) if self.rule == "ratio" else None
        return loss, den, _tensor_bytes(out)


def _scalars_to(values, device):
    """The replicas' 0-dim tensors as one vector on ``device`` (differentiable: only these scalars travel)."""
    return Gather.apply(device, 0, *(v.reshape(1) for v in values))


def combine(results, targets, rule, dim, device, gather):
    """The full-batch loss from the replicas' (loss, denominator, bytes) results; `targets` are their chunks."""
    losses = [r[0] for r in results]
    for i, loss in enumerate(losses):
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"the criterion returned {type(loss).__name__} in replica {i}; expected a tensor")
        if rule != "none" and loss.numel() != 1:
            raise ValueError(
                f"the criterion returned a tensor of shape {tuple(loss.shape)} in replica {i} with reduction "
                f"{rule!r}; expected a scalar"
            )
    if rule == "none":
        return gather(losses)
    if rule == "sum":
        return _scalars_to(losses, device).sum()
    if rule == "ratio":
        sums = _scalars_to(losses, device)
        dens = _scalars_to([r[1].to(losses[0].dtype) for r in results], device)
        return sums.sum() / dens.sum()
    counts = []
    for t in targets:
        first = _first_tensor(t)
        counts.append(first.shape[dim] if first is not None and first.dim() > 0 else 1)
    vec = _scalars_to(losses, device)
    total = sum(counts)
    weights = torch.tensor([c / total for c in counts], dtype=vec.dtype, device=vec.device)
    return (vec * weights).sum()


# ---- Buffers when device 0 runs no chunk -------------------------------------------------------------------------


class BufferWatch:
    """When device 0 has no chunk, the first running replica plays chunk 0's part: its buffers (BatchNorm running
    stats, num_batches_tracked) are copied back to the master's after the forward, as upstream keeps replica 0's.

    All of them are copied: BatchNorm updates its running stats inside the kernel without bumping their version
    counters, so changed buffers cannot be told apart cheaply; unchanged ones hold the master's values anyway.
    """

    def __init__(self, master, replica):
        theirs = dict(replica.named_buffers())
        self.pairs = []
        for name, b in master.named_buffers():
            r = theirs.get(name)
            if r is not None and r is not b and not b.requires_grad and r.shape == b.shape:
                self.pairs.append((b, r))

    def copy_back(self):
        with torch.no_grad():
            for b, r in self.pairs:
                b.copy_(r)


# ---- Memory report -----------------------------------------------------------------------------------------------


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
    pending_grads: int  # gradient sums kept by no_sync() for this replica

    @property
    def fastdp_bytes(self):
        return self.replica_buffers + self.staging + self.pending_grads


def _fmt(n):
    """Bytes in the largest binary unit that keeps the number at 1 or more ("n/a" for None)."""
    if n is None:
        return "n/a"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


@dataclass
class MemoryReport:
    """``fastdp.memory_report(model)``: one DeviceMemory per entry of device_ids, plus what applies to all."""

    devices: List[DeviceMemory]
    avoided_gather_bytes: Optional[int] = None  # outputs the last per-replica loss forward did not gather
    split: Optional[str] = None  # the chunk_sizes rule
    notes: List[str] = field(default_factory=list)

    def peak_ratio(self):
        """Device 0's peak over the median of the other devices' peaks (None when it cannot be measured)."""
        seen, peaks = set(), []
        for d in self.devices:
            if d.peak is not None and d.device not in seen:
                seen.add(d.device)
                peaks.append(d.peak)
        if len(peaks) < 2:
            return None
        others = statistics.median(peaks[1:])
        return peaks[0] / others if others else None

    def __str__(self):
        head = ("#", "device", "chunk", "allocated", "peak", "master", "replica bufs", "staging", "no_sync grads",
                "fastdp total")
        rows = [head]
        for d in self.devices:
            rows.append((str(d.position), d.device, "-" if d.chunk is None else str(d.chunk), _fmt(d.allocated),
                         _fmt(d.peak), _fmt(d.master), _fmt(d.replica_buffers), _fmt(d.staging),
                         _fmt(d.pending_grads), _fmt(d.fastdp_bytes)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
        ratio = self.peak_ratio()
        if ratio is not None:
            lines.append(f"peak of device 0 / median of the others: {ratio:.2f}")
        if self.avoided_gather_bytes is not None:
            lines.append(
                f"per-replica loss: {_fmt(self.avoided_gather_bytes)} of outputs not gathered on the output "
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
    state = getattr(model, "__dict__", {})
    notes = []
    if not device_ids:
        return MemoryReport([], notes=["pass-through wrapper (no device_ids): nothing to report"])
    ids = [_devices.normalize(d) for d in device_ids]
    last = state.get("_last_chunk_sizes")
    positions = state.get("_replica_positions")
    rows = []
    src = _devices.torch_device(ids[0])
    module = getattr(model, "module", None)
    for i, d in enumerate(ids):
        cpu = d == _devices.CPU
        rows.append(DeviceMemory(
            position=i,
            device="cpu" if cpu else f"cuda:{d}",
            chunk=last[i] if last is not None and i < len(last) else None,
            allocated=None if cpu else torch.cuda.memory_allocated(d),
            peak=None if cpu else torch.cuda.max_memory_allocated(d),
            master=_master_bytes(module, src) if i == 0 and module is not None else 0,
            replica_buffers=0, staging=0, pending_grads=0,
        ))
    if any(d == _devices.CPU for d in ids):
        notes.append("'cpu' devices: current/peak allocator figures are n/a on the host; fastdp's own bytes shown")
    kept = state.get("_replica_set")
    if kept is not None:
        nrep = len(kept.state.devices)
        where = positions if positions is not None and len(positions) == nrep else list(range(nrep))
        for plan in kept.plans.values():
            for bucket in plan[0] + plan[1]:
                size = bucket.numel * torch.empty((), dtype=bucket.dtype).element_size()
                for r, pool in enumerate(bucket.pools, start=1):
                    rows[where[r]].replica_buffers += size * len(pool.flats)
                if bucket.src_pool is not None:
                    rows[where[0]].staging += size * len(bucket.src_pool.flats)
                for r, row in enumerate(bucket.pending or []):
                    rows[where[r]].pending_grads += sum(_bytes(g) for g in row if g is not None)
    elif hasattr(model, "_replica_set"):
        notes.append("no kept replicas yet (or the module replicates afresh every step): fastdp holds no buffers")
    if reset_peak:
        for d in sorted({d for d in ids if d != _devices.CPU}):
            torch.cuda.reset_peak_memory_stats(d)
    split = state.get("_split")
    return MemoryReport(
        rows,
        avoided_gather_bytes=state.get("_avoided_gather_bytes"),
        split=None if split is None else split.describe(),
        notes=notes,
    )
