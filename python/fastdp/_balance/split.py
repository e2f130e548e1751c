"""How ``fastdp.DataParallel`` splits the batch across its devices: the ``chunk_sizes=`` rules (sizes, weights,
device 0's share, ``"auto"``), the per-forward chunk sizes, and the target check of the per-replica loss.

Any split gives the same gradients (they are sums over samples); see docs/balance.md for the user-facing rules.
"""

import collections
import copy
import math
import numbers
import statistics
from fractions import Fraction

import torch
from torch.nn.utils.rnn import PackedSequence

from .._platform import devices as _devices
from . import memory as _memory

__all__ = ["AutoSplit", "BatchSplit", "largest_remainder", "parse_chunk_sizes", "begin_forward", "split_for",
           "weights_of", "check_target", "parse_broadcast", "describe"]

BatchSplit = collections.namedtuple("BatchSplit", ["chunk_sizes", "rule"])
BatchSplit.__doc__ = """What ``dp.batch_split`` returns: how a ``fastdp.DataParallel`` splits its batch.

``chunk_sizes``: the rows each ``device_ids`` position got in the last forward that split a batch by a
``chunk_sizes=`` rule (a list of ints, one per position, 0 where a position ran nothing); None before such a forward,
and under torch.chunk's rule (the default, as ``torch.nn.DataParallel``). ``rule``: the rule in words, as
``fastdp.memory_report`` shows it (for ``"auto"``: where it stands, and why)."""


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


def weights_of(rule, ndev):
    """Each device's relative weight under a sizes or weights rule (None, torch.chunk's rule: equal weights; sizes:
    the sizes), as a new list of floats."""
    if rule is None:
        return [1.0] * ndev
    if isinstance(rule, _Explicit):
        return [float(n) for n in rule.sizes]
    return [float(w) for w in rule.weights]


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


def begin_forward(rule, inputs, kwargs, dim, ndev, *, with_target, training, sizes, recorder=None):
    """One forward's split work, in order: "auto" judges the training step that just ended (``training``), the
    target (the last of ``inputs`` when ``with_target``) is checked against the other inputs, then this batch's
    chunk sizes are returned when ``sizes`` is true (None: torch.chunk's rule, or ``sizes`` false for a wrapper
    whose own ``scatter`` asks ``split_for``). ``recorder``: the wrapper's fastdp._report.recorder.Recorder, whose last
    step's times drive "auto"'s time phase (None: not measured)."""
    if training and isinstance(rule, AutoSplit):
        rule.observe(None if recorder is None else recorder.last_timings())
    if with_target:
        check_target(inputs[:-1], kwargs, inputs[-1], dim)
    if rule is None or not sizes:
        return None
    return split_for(rule, inputs, kwargs, dim, ndev)


# ---- Settling device 0's share from measured peaks ("auto") ------------------------------------------------------


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)  # True is an int to Python, never a count here


def _is_number(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _non_negative_int(value):
    return _is_int(value) and value >= 0


def _positive_int(value):
    return _is_int(value) and value >= 1


def _finite_non_negative(value):
    return _is_number(value) and 0 <= value < math.inf


def _fraction_of_largest(value):
    return _is_number(value) and 0 < value <= 1


def _callable_or_none(value):
    return value is None or callable(value)


def _true_or_false(value):
    return isinstance(value, bool)


# AutoSplit's arguments, checked in this order: (name, the test a valid value passes, the error raised otherwise,
# what the message says the value must be). A ValueError's message ends with the value, a TypeError's with its type.
_AUTO_ARGUMENTS = (
    ("warmup", _non_negative_int, ValueError, "a non-negative int"),
    ("probes", _positive_int, ValueError, "a positive int"),
    ("tolerance", _finite_non_negative, ValueError, "a finite non-negative number"),
    ("reader", _callable_or_none, TypeError, "callable (returning one peak per device)"),
    ("balance_time", _true_or_false, TypeError, "True or False"),
    ("time_tolerance", _finite_non_negative, ValueError, "a finite non-negative number"),
    ("min_gap_s", _finite_non_negative, ValueError, "a finite non-negative number"),
    ("time_steps", _positive_int, ValueError, "a positive int"),
    ("min_weight", _fraction_of_largest, ValueError,
     "a number in (0, 1] (the least weight relative to the largest)"),
    ("timer", _callable_or_none, TypeError, "callable (returning (rows, busy seconds) per device, or None)"),
)


def _check_auto_arguments(values):
    """Raises for the first of ``values`` (AutoSplit's arguments by name) that ``_AUTO_ARGUMENTS`` rejects."""
    for name, valid, error, expected in _AUTO_ARGUMENTS:
        value = values[name]
        if not valid(value):
            got = repr(value) if error is ValueError else type(value).__name__
            raise error(f"{name} must be {expected}, got {got}")


class AutoSplit:
    """``chunk_sizes="auto"``: a split found from measured memory, then from measured time.

    Training forwards (grad enabled, module in training mode) drive it; evaluations never do. Two phases, each
    settling for good (NOTE [auto split]):

    1. **Memory.** At the start of each training forward, ``reader()`` returns every device's peak allocated bytes
       since the previous call (the default reader is a fastdp._balance.memory.PeakWindow: exact where the allocator's
       peak counter moved, the highest sample otherwise; the process-wide counters are never reset). The first
       ``warmup`` steps are not judged (optimizers allocate their state in the first step). Then device 0's share
       (relative to each other device) starts at 1; while device 0's peak exceeds ``(1 + tolerance)`` times the
       median of the others', the share is bisected in [0, 1] for ``probes`` steps and settles on the largest
       share measured within the bound (0 if none was). Steps whose batch size differs from the first judged
       step's are not judged. Without a usable reader ('cpu' replicas, a GPU listed more than once) this phase
       settles at once on share 1.
    2. **Time** (``balance_time=True``). Each judged step's per-replica busy time (forward plus backward, measured
       by the wrapper's recorder, or ``timer()`` when given) and rows give each device's speed in rows per second
       (the best of its last three judged steps);
       the weights move halfway (geometrically) towards weights proportional to those speeds, by at most a factor
       of 2 per step, never below ``min_weight`` times the largest weight, and device 0 never above the memory
       phase's share times the median of the others when that phase found device 0 over its bound. It settles
       when the busiest replica is within ``time_tolerance`` of the least busy (or within ``min_gap_s`` seconds),
       when no weight moves by 5% any more (the bounds hold it), or after ``time_steps`` judged steps.

    Once both phases settled the split never changes, so it is deterministic from then on.
    """

    kind = "auto"

    def __init__(self, *, warmup=2, probes=5, tolerance=0.05, reader=None, balance_time=True, time_tolerance=0.1,
                 min_gap_s=0.0005, time_steps=8, min_weight=0.1, timer=None):
        """``chunk_sizes=fastdp.AutoSplit(...)``: ``"auto"`` with other settings; each one is described in the class
        docstring (``chunk_sizes="auto"`` uses these defaults)."""
        _check_auto_arguments(dict(warmup=warmup, probes=probes, tolerance=tolerance, reader=reader,
                                   balance_time=balance_time, time_tolerance=time_tolerance, min_gap_s=min_gap_s,
                                   time_steps=time_steps, min_weight=min_weight, timer=timer))
        self.warmup, self.probes, self.tolerance, self.reader = warmup, probes, float(tolerance), reader
        self.balance_time, self.time_tolerance, self.min_gap_s = balance_time, float(time_tolerance), float(min_gap_s)
        self.time_steps, self.min_weight, self.timer = time_steps, float(min_weight), timer
        self.share = 1.0
        self.memory_settled = False
        self.reason = None
        self.history = []  # (share, device-0 peak / median of the others) of every judged step
        self.weights = None  # per device, from the time phase (None: [share, 1, 1, ...])
        self.time_settled = not balance_time
        self.time_reason = None if balance_time else "balance_time=False"
        self.time_history = []  # (weights, busy seconds per device) of every step the time phase judged
        self._capped = False  # the memory phase found device 0 over its bound: its share caps device 0's weight
        self._costs = []  # seconds per row of each device, the last three judged steps
        self._lo, self._hi = 0.0, 1.0
        self._calls = 0
        self._step_share = None
        self._last_batch = None
        self._armed = False
        self._ref_batch = None
        self._ndev = None

    @property
    def settled(self):
        """Both phases settled: the split is fixed from now on."""
        return self.memory_settled and self.time_settled

    def bind(self, devices):
        """A copy of this rule for one wrapper's device list (a rule object may be passed to several wrappers)."""
        bound = copy.copy(self)
        bound.history, bound.time_history, bound._costs = [], [], []
        bound._ndev = len(devices)
        if len(devices) < 2:
            bound._settle(1.0, "one device")
            bound._settle_time("one device")
        elif bound.reader is None:
            if any(d == _devices.CPU for d in devices):
                bound._settle(1.0, "no allocator to measure on 'cpu' devices: equal split")
            elif len(set(devices)) != len(devices):
                bound._settle(1.0, "a GPU listed more than once cannot be measured per replica: equal split")
            else:
                bound.reader = _memory.PeakWindow(devices).read
        return bound

    def _settle(self, share, reason):
        self.share, self.memory_settled, self.reason = share, True, reason
        if self._ndev is not None and self.weights is None:
            self.weights = [float(share)] + [1.0] * (self._ndev - 1)

    def _settle_time(self, reason):
        self.time_settled, self.time_reason = True, reason

    def split(self, batch, dim, ndev):
        """The sizes of a batch of ``batch`` rows for ``ndev`` devices: the current weights, rounded by largest
        remainder."""
        if self._armed:  # the training forward that observe() just opened (not an evaluation in between)
            self._last_batch, self._armed = batch, False
        weights = self.weights if self.weights is not None else [self.share] + [1.0] * (ndev - 1)
        return largest_remainder(weights, batch)

    def needs_timings(self):
        """Whether the wrapper should measure replica times for this rule (its time phase is still running)."""
        return not self.time_settled and self.timer is None

    def observe(self, timings=None):
        """Called at the start of every training forward: judges the step that just ended, picks the next split.
        ``timings``: (rows, busy seconds) per device of that step, from the wrapper's recorder, or None."""
        if self.settled:
            return
        if not self.memory_settled:
            self._observe_memory()
            return
        self._calls += 1
        if self._calls <= 1 + self.warmup:
            return
        if self.timer is not None:
            timings = self.timer()
        if timings is not None:
            self._observe_time(*timings)

    def _observe_memory(self):
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
            self._capped = True
        elif over:
            self._hi = judged
        else:
            self._lo = judged
        if len(self.history) > self.probes:
            self._settle(self._lo, f"settled after {len(self.history)} measured steps")
        else:
            self.share = (self._lo + self._hi) / 2
        self._step_share = self.share

    def _observe_time(self, rows, busy):
        """NOTE [auto split]: one judged step of the time phase (see the class docstring for the rule)."""
        active = [i for i in range(self._ndev) if rows[i] > 0 and busy[i] > 0]
        if len(active) < 2:
            return
        weights = list(self.weights)
        self.time_history.append((list(weights), list(busy)))
        if self._times_even([busy[i] for i in active]):
            self._settle_time(f"replicas within {self.time_tolerance:.0%} of each other's time")
            return
        speed = self._speeds(rows, busy, active)
        new = self._bounded(self._moved_towards(weights, speed))
        self.weights = new
        if all(abs(n / w - 1) < 0.05 for n, w in zip(new, weights) if w > 0):
            self._settle_time("settled: the weights stopped moving (held by their bounds)")
        elif len(self.time_history) >= self.time_steps:
            self._settle_time(f"settled after {len(self.time_history)} timed steps")

    def _times_even(self, times):
        """Whether the busiest replica is within ``time_tolerance`` (or ``min_gap_s`` seconds) of the least busy."""
        most, least = max(times), min(times)
        return most - least <= self.time_tolerance * most or most - least <= self.min_gap_s

    def _speeds(self, rows, busy, active):
        """Rows per second of each active device, from its least seconds per row over the last three judged steps:
        a step disturbed by the machine (another process, a collection) only lengthens times, so one such step
        does not move the split."""
        recent = self._costs = (self._costs + [{i: busy[i] / rows[i] for i in active}])[-3:]
        cost = {i: min(c[i] for c in recent if i in c) for i in active}
        return {i: 1 / cost[i] for i in active}

    @staticmethod
    def _moved_towards(weights, speed):
        """The weights moved halfway (geometrically) towards weights proportional to the devices' speeds, by at
        most a factor of 2; the devices without a speed (no rows, no time) keep theirs."""
        scale = sum(weights[i] for i in speed) / sum(speed.values())
        new = list(weights)
        for i in speed:
            target = speed[i] * scale
            new[i] = min(2 * weights[i], max(weights[i] / 2, math.sqrt(weights[i] * target)))
        return new

    def _bounded(self, weights):
        """No weight below ``min_weight`` times the largest; device 0 not above the memory phase's share of the
        others' median when that phase found it over its bound."""
        floor = self.min_weight * max(weights)
        weights = [max(w, floor) for w in weights]
        if self._capped and self._ndev > 1:
            weights[0] = min(weights[0], self.share * statistics.median(weights[1:]))
        return weights

    def avoid(self, position):
        """Halves ``position``'s weight for good (an out-of-memory rescue moved rows away from it) and settles."""
        if self.weights is None:
            self.weights = [self.share] + [1.0] * (self._ndev - 1)
        self.weights[position] /= 2
        if not self.memory_settled:
            self._settle(self.share, "an out-of-memory rescue fixed the split")
        self._settle_time("an out-of-memory rescue fixed the split")

    def sample(self):
        """Called where a step's memory is highest (the end of each training forward, backward reaching the
        outputs): the default reader notes each device's allocated bytes."""
        window = getattr(self.reader, "__self__", None)
        if not self.memory_settled and isinstance(window, _memory.PeakWindow):
            window.sample()

    def describe(self):
        """Where each phase stands, in words (``fastdp.memory_report`` and ``dp.batch_split`` show it)."""
        state = (f"settled ({self.reason})" if self.memory_settled
                 else f"measuring, {len(self.history)} steps judged")
        text = f"auto: device 0 share {self.share:g}, {state}"
        if self.balance_time and self.weights is not None and self._ndev and self._ndev > 1:
            top = max(self.weights)
            shown = ", ".join(f"{w / top:.2f}" for w in self.weights)
            state = (self.time_reason if self.time_settled
                     else f"measuring, {len(self.time_history)} timed steps judged")
            text += f"; time weights [{shown}], {state}"
        return text


def parse_broadcast(broadcast):
    """``broadcast=``: the keyword arguments every replica gets whole instead of split, as a frozenset."""
    if broadcast is None:
        return frozenset()
    if isinstance(broadcast, str) or not all(isinstance(n, str) for n in broadcast):
        raise TypeError(
            f"broadcast must be a tuple of keyword argument names, e.g. broadcast=('tgt_mask',), got {broadcast!r}"
        )
    return frozenset(broadcast)


def describe(rule):
    """The split `rule` in words (None: torch.chunk's, the default)."""
    if rule is None:
        return "torch.chunk's rule, as torch.nn.DataParallel: ceil(batch / devices) rows each, the last ones fewer"
    return rule.describe()


def timings_wanted(rule, ndev):
    """Whether the split `rule` needs the replicas' times recorded (``"auto"`` while it balances time)."""
    return isinstance(rule, AutoSplit) and ndev > 1 and rule.needs_timings()


def memory_samplers(rule):
    """What the split `rule` samples in each training replica's forward (``"auto"`` while it balances memory)."""
    return (rule.sample,) if isinstance(rule, AutoSplit) and not rule.memory_settled else ()
