"""Where a CUDA bucket's sum runs: on one stream of the reduction's own per device, ordered after the stream where
autograd says the gradients are ready and before the stream that consumes the sum, with everything it reads or
writes held in the reducer's ledger until a fence behind the work passes (NOTE [reduction streams])."""

import collections
import contextlib
import re
import threading

import torch

from .._platform import streams as _streams
from .jobs import Finished
from . import sums

__all__ = ["CudaStreams", "Ledger", "ordered", "own_stream", "ready_streams", "stream_rule"]

# NOTE [reduction streams]
# On CUDA devices the reduction runs on one stream of its own per device (made once per process and device), so it
# neither waits for compute enqueued after the gradients it sums nor holds up compute enqueued after it. Autograd
# says where the bucket node's gradients are ready, and the rule changed in torch 2.8:
# - torch 2.8 and newer: the node's canonical stream (its first device's, current while the node runs) has waited for
#   every incoming gradient, whatever its device; so every reduction stream waits for that stream.
# - before 2.8: gradients on the node's first device are ready on its canonical stream; a gradient on another
#   device is ready on that device's default stream, where autograd also added several contributions to it. So the
#   first device's reduction stream waits for the canonical stream, each other device's for its default stream.
# - a 2.8 build from before its release (its version string cannot tell which rule it has): both (stream_rule).
# A started sum is written into a buffer allocated on the consumer's stream (its memory is the consumer's to reuse
# once the sum is used); a sum handed over at once (no_sync, create_graph) is allocated by the reduction's streams
# and recorded as used by the consumer's stream. The consumer's stream waits for the first device's reduction stream
# before autograd uses a sum. Every tensor the reduction reads or writes is held until a fence behind its work on
# every device has passed (swept at each reduction, delivery and forward; a failure part way included; each replica
# set's reducer has a ledger of its own), so the caching allocator reuses no memory the reduction still reads.
def stream_rule(version):
    """Which stream autograd makes wait for a bucket node's gradients on its other devices, by torch's version:
    "canonical" (torch 2.8 and newer: the node's canonical stream), "default" (before: each device's default
    stream), or "both" where the version cannot tell: a 2.8 build made before its release (a source build
    "2.8.0a0+git...", as containers ship, or a nightly "2.8.0.dev...") may predate the engine's change, so the
    reduction waits for both streams (one wait more, never a read before the gradients exist)."""
    found = re.match(r"(\d+)\.(\d+)(?:\.\d+)?((?:a|\.dev)\d*)?", version)
    if found is None:
        return "both"
    release = (int(found[1]), int(found[2]))
    if release < (2, 8):
        return "default"
    if release == (2, 8) and found[3]:
        return "both"
    return "canonical"


_STREAM_RULE = stream_rule(torch.__version__)


def ready_streams(devices, rule=None):
    """Per distinct CUDA device among `devices` (first one first): the streams its reduction stream waits for
    before reading the gradients autograd handed the bucket node (NOTE [reduction streams])."""
    rule = _STREAM_RULE if rule is None else rule
    first = devices[0]
    canonical = torch.cuda.current_stream(first)
    ready = {}
    for d in devices:
        if d not in ready:
            ready[d] = _ready_on(d, first, canonical, rule)
    return ready


def _ready_on(d, first, canonical, rule):
    if d == first or rule == "canonical":
        return (canonical,)
    if rule == "default":
        return (torch.cuda.default_stream(d),)
    return (canonical, torch.cuda.default_stream(d))


_OWN_STREAMS = {}


def own_stream(device):
    """The reduction's stream on one CUDA device (one per process and device)."""
    s = _OWN_STREAMS.get(device)
    if s is None:
        s = _OWN_STREAMS.setdefault(device, torch.cuda.Stream(device=device))
    return s


class Ledger:
    """Tensors one reducer's streams still use, each group released once its fence has passed. Every fence of a
    reducer is recorded behind the same streams (its own, one per device), in the order the groups were held, so
    they pass in that order: a sweep releases from the front and stops at the first fence still pending, one query
    whatever the number of groups behind it."""

    def __init__(self):
        self._held = collections.deque()
        self._lock = threading.Lock()

    def hold(self, fence, tensors):
        with self._lock:
            self._held.append((fence, tensors))

    def sweep(self):
        """Releases the tensors of reductions that have completed (called at each launch, delivery and forward)."""
        if self._held:
            with self._lock:
                held = self._held
                while held and held[0][0].done():
                    held.popleft()

    def __len__(self):
        return len(self._held)

    def held(self):
        """The groups of tensors still held, oldest first (what a measurement of the reduction's memory reads)."""
        with self._lock:
            return [tensors for _, tensors in self._held]


def _no_handover(result):
    return result


@contextlib.contextmanager
def ordered(reducer, held):
    """The reduction's work of one node whose result autograd takes at once (CUDA: on the reduction's own streams,
    after the gradients are ready there, `held` (what it reads) kept alive until it completes; NOTE [reduction
    streams]). Yields ``hand(result)``: the node's stream waits for the work, and the result's memory, which the
    reduction's streams allocated, counts as used by that stream too."""
    if reducer.host:
        yield _no_handover
        return
    own = {d: own_stream(d) for d in _streams.cuda_indices(reducer.devices)}
    first = next(iter(own))
    ready = ready_streams(list(own))
    _streams.order([(own[d], r) for d in own for r in ready[d]])
    handed = []

    def hand(result):
        handed.append(result)
        return result

    try:
        with _streams.entered(tuple(own.values())):
            yield hand
    finally:
        reducer.ledger.hold(_streams.Fence(list(own.values())), held)  # a failure part way included
    consumer = torch.cuda.current_stream(first)
    _streams.Fence([own[first]]).wait(consumer)
    for result in handed:
        for t in result if isinstance(result, (tuple, list)) else (result,):
            if t is not None:
                t.record_stream(consumer)


class CudaStreams:
    """Sums of one replica set's buckets on the reduction's own streams (NOTE [reduction streams])."""

    def __init__(self, devices):
        self.devices = list(_streams.cuda_indices(devices))

    def launch(self, bucket, grads, taken):
        ledger = bucket.reducer.ledger
        ledger.sweep()
        first = self.devices[0]
        own = [own_stream(d) for d in self.devices]
        # The consumer's memory, taken before the reduction's streams are ordered after the consumer's.
        out = torch.empty(bucket.numel, dtype=bucket.dtype, device=bucket.tdevs[0])
        ready = ready_streams(self.devices)
        _streams.order([(s, r) for d, s in zip(self.devices, own) for r in ready[d]])
        recorder = bucket.reducer.recorder
        try:
            with _streams.entered(tuple(own)):
                began = recorder.stamp(first) if recorder is not None else None  # on the first reduction stream
                result = sums.bucket_sum(bucket, grads, taken, out)
                if began is not None:  # device timings, read when the report is (no synchronisation here)
                    recorder.record("reduce", None, began, recorder.stamp(first), bucket.numel * bucket.itemsize,
                                    bucket=bucket.index)
        finally:
            # Held until the reduction's work on every device has passed (a failure part way included). Not the
            # results: autograd takes a sum nothing else holds as .grad without copying it.
            ledger.hold(_streams.Fence(own), (grads, taken, out))
        return CudaJob(result, _streams.Fence([own[0]]), first)


class CudaJob(Finished):
    """A sum enqueued on the reduction's streams: ``take()`` first orders the consumer's stream after it."""

    __slots__ = ("fence", "device")

    def __init__(self, value, fence, device):
        super().__init__(value)
        self.fence, self.device = fence, device

    def take(self):
        self.fence.wait(torch.cuda.current_stream(self.device))  # the delivery node's stream: the consumer's
        return super().take()
