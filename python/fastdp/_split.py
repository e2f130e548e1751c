"""How ``fastdp.DataParallel`` splits the batch across its devices: the ``chunk_sizes=`` rules (sizes, weights,
device 0's share, ``"auto"``), the per-forward chunk sizes, and the target check of the per-replica loss.

Any split gives the same gradients (they are sums over samples); see docs/balance.md for the user-facing rules.
"""

import copy
import math
import numbers
import statistics
from fractions import Fraction

import torch
from torch.nn.utils.rnn import PackedSequence

from . import _devices

__all__ = ["AutoSplit", "largest_remainder", "parse_chunk_sizes", "begin_forward", "split_for", "check_target",
           "parse_broadcast"]


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
    spec = _unwrap(spec)
    if isinstance(spec, AutoSplit):
        return spec
    if isinstance(spec, (bool, numbers.Real)):
        return _share_rule(spec, ndev)
    return _list_rule(spec, ndev)


def _unwrap(spec):
    """"auto" → an AutoSplit; a 0-dim tensor → its number."""
    if isinstance(spec, str):
        if spec != "auto":
            raise ValueError(
                f"chunk_sizes={spec!r}: expected None, 'auto', a float in [0, 1] (device 0's share of each other "
                "device's share), or one int size or float weight per device"
            )
        return AutoSplit()
    if isinstance(spec, torch.Tensor) and spec.dim() == 0:
        return spec.item()
    return spec


def _share_rule(spec, ndev):
    """A single number: device 0's share relative to each other device's."""
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
    if ndev > 1:
        return _Weights([float(share)] + [1.0] * (ndev - 1))
    if share == 0:
        raise ValueError(
            "chunk_sizes=0 gives device 0 no samples, but device_ids has a single device; expected a share "
            "in (0, 1] with one device, or more devices"
        )
    return _Weights([1.0])


# Each entry of a list: (test failing it, what the message says it is, what it expects), checked in order.
_ENTRY_CHECKS = (
    (lambda v: not math.isfinite(v), "expected finite, non-negative weights"),
    (lambda v: v < 0, "expected non-negative sizes or weights"),
)


def _list_rule(spec, ndev):
    """One int size or float weight per device."""
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
        for fails, expected in _ENTRY_CHECKS:
            if fails(v):
                raise ValueError(f"chunk_sizes[{i}] is {v}; {expected}")
    if not any(v > 0 for v in values):
        raise ValueError(
            f"chunk_sizes={list(spec)} are all zero; expected at least one device with a positive size or weight"
        )
    if all(isinstance(v, int) for v in values):
        return _Explicit(values)
    return _Weights([float(v) for v in values])


def _leaf_sizes(obj, dim, path, out):
    """(path, size along dim) of every tensor leaf that scatter splits, in scatter's recursion order (a
    PackedSequence is refused by scatter, with its own message)."""
    if isinstance(obj, torch.Tensor):
        if obj.dim() > 0:
            d = dim + obj.dim() if dim < 0 else dim
            if 0 <= d < obj.dim():
                out.append((path, obj.shape[d]))
        return out
    if isinstance(obj, (tuple, list)) and not isinstance(obj, PackedSequence):
        for i, x in enumerate(obj):
            _leaf_sizes(x, dim, f"{path}[{i}]", out)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _leaf_sizes(v, dim, f"{path}[{k!r}]", out)
    return out


def _sizes_along(obj, dim, out):
    """_leaf_sizes without the paths (the per-forward check; paths are built only when sizes disagree)."""
    if isinstance(obj, torch.Tensor):
        if obj.dim() > 0:
            d = dim + obj.dim() if dim < 0 else dim
            if 0 <= d < obj.dim():
                out.append(obj.shape[d])
    elif isinstance(obj, (tuple, list)) and not isinstance(obj, PackedSequence):
        for x in obj:
            _sizes_along(x, dim, out)
    elif isinstance(obj, dict):
        for x in obj.values():
            _sizes_along(x, dim, out)
    return out


def batch_size(inputs, kwargs, dim):
    """The size along dim of the first tensor scatter split into these arguments (one replica's chunk), or None."""
    if inputs and type(inputs[0]) is torch.Tensor and 0 <= dim < inputs[0].dim():  # the common case, at once
        return inputs[0].shape[dim]
    sizes = _sizes_along(kwargs, dim, _sizes_along(inputs, dim, []))
    return sizes[0] if sizes else None


def not_batch_major(inputs, kwargs, dim):
    """(path, size) of the tensors whose size along dim differs from the first tensor's (the batch), and the first
    (path, size); ([], None) when they all agree. Scatter splits them all along dim, as upstream does."""
    if not kwargs and len(inputs) < 2:  # one argument: a single tensor agrees with itself
        if not inputs or type(inputs[0]) is torch.Tensor:
            return [], None
    sizes = _sizes_along(kwargs, dim, _sizes_along(inputs, dim, []))
    if len(sizes) < 2 or all(n == sizes[0] for n in sizes):
        return [], None
    leaves = _leaf_sizes(kwargs, dim, "kwargs", _leaf_sizes(inputs, dim, "input", []))
    return [(p, n) for p, n in leaves if n != leaves[0][1]], leaves[0]


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


def begin_forward(rule, inputs, kwargs, dim, ndev, *, with_target, training, sizes):
    """One forward's split work, in order: "auto" judges the training step that just ended (``training``), the
    target (the last of ``inputs`` when ``with_target``) is checked against the other inputs, then this batch's
    chunk sizes are returned when ``sizes`` is true (None: torch.chunk's rule, or ``sizes`` false for a wrapper
    whose own ``scatter`` asks ``split_for``)."""
    if training and isinstance(rule, AutoSplit):
        rule.observe()
    if with_target:
        check_target(inputs[:-1], kwargs, inputs[-1], dim)
    if rule is None or not sizes:
        return None
    return split_for(rule, inputs, kwargs, dim, ndev)


# ---- Settling device 0's share from measured peaks ("auto") ------------------------------------------------------


class _CudaPeaks:
    """Each device's highest allocated bytes seen since the previous call. The allocator's current figure
    (``torch.cuda.memory_allocated``, a host-side counter: no device synchronisation) is sampled when the wrapper
    asks (``sample``: at the end of each training forward, when that step's activations are all alive) and at every
    call; the process-wide peak counters (``torch.cuda.max_memory_allocated``) are never reset, so the user's own
    readings of them stay whole."""

    def __init__(self, devices):
        self.devices = list(devices)
        self.high = [0] * len(self.devices)

    def sample(self):
        self.high = [max(h, torch.cuda.memory_allocated(d)) for h, d in zip(self.high, self.devices)]

    def __call__(self):
        self.sample()
        peaks, self.high = self.high, [0] * len(self.devices)
        return peaks


class AutoSplit:
    """``chunk_sizes="auto"``: device 0's share (relative to each other device) found from measured peak memory.

    Training forwards (grad enabled, module in training mode) drive it: at the start of each one, ``reader()``
    returns every device's peak allocated bytes since the previous call (the default reader samples
    ``torch.cuda.memory_allocated`` at the end of each training forward and at that call, see _CudaPeaks; the
    process-wide peak counters are left alone). The first ``warmup`` steps are not judged
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

    def sample(self):
        """Called at the end of every training forward: the default reader notes each device's allocated bytes."""
        if not self.settled and isinstance(self.reader, _CudaPeaks):
            self.reader.sample()

    def describe(self):
        state = f"settled ({self.reason})" if self.settled else f"measuring, {len(self.history)} steps judged"
        return f"auto: device 0 share {self.share:g}, {state}"


def parse_broadcast(broadcast):
    """``broadcast=``: the keyword arguments every replica gets whole instead of split, as a frozenset."""
    if broadcast is None:
        return frozenset()
    if isinstance(broadcast, str) or not all(isinstance(n, str) for n in broadcast):
        raise TypeError(
            f"broadcast must be a tuple of keyword argument names, e.g. broadcast=('tgt_mask',), got {broadcast!r}"
        )
    return frozenset(broadcast)
