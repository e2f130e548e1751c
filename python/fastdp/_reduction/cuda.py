"""Where a CUDA bucket's sum runs: on one stream of the reduction's own per device, ordered after the stream where
autograd says the gradients are ready and before the stream that consumes the sum; everything it reads or writes
goes back to the caching allocator stream-ordered (NOTE [reduction streams])."""

import contextlib
import re

import torch

from .._platform import streams as _streams
from .jobs import Finished
from . import sums

__all__ = ["CudaStreams", "node_streams", "ordered", "own_stream", "ready_streams", "release_after", "stream_rule"]

# NOTE [reduction streams]
# On CUDA devices the reduction runs on one stream of its own per device (made once per process and device), so it
# neither waits for compute enqueued after the gradients it sums nor holds up compute enqueued after it.
# The bucket node is made with the reduction's stream of its first device current (node_streams), so that stream is
# the node's canonical stream: the one autograd makes current while the node runs and, from torch 2.8, makes wait
# for every incoming gradient. Made under the caller's stream, it was replica 0's compute stream that waited, at
# every bucket, for the slowest device's gradients: replica 0's backward went in lock-step with the others.
# Autograd says where the bucket node's gradients are ready, and the rule changed in torch 2.8:
# - torch 2.8 and newer: the node's canonical stream (the first device's reduction stream) has waited for every
#   incoming gradient, whatever its device; so every other reduction stream waits for it.
# - before 2.8: gradients on the node's first device are ready on its canonical stream; a gradient on another
#   device is ready on that device's default stream, where autograd also added several contributions to it. So each
#   other device's reduction stream waits for its default stream.
# - a 2.8 build from before its release (its version string cannot tell which rule it has): both (stream_rule).
# Memory goes back to the caching allocator stream-ordered, never held by the host: each gradient the reduction's
# streams read is recorded as used by its device's reduction stream (release_after), so when autograd drops it the
# allocator hands its block out again only after that stream has read it, and on its out-of-memory path it can wait
# for those streams and reclaim it. That is one record per gradient, as autograd's engine itself records each
# gradient it hands to a node on another stream. A started sum is written into a buffer allocated on the consumer's
# stream (its memory is the consumer's to reuse once the sum is used) and recorded as used by the first device's
# reduction stream (a backward that fails drops it before the sum ran); a sum handed over at once (no_sync,
# create_graph) is allocated by the reduction's streams and recorded as used by the consumer's stream. The
# consumer's stream waits for the first device's reduction stream before autograd uses a sum. Once backward ends,
# nothing of the reduction outlives its tensors: memory held past optimizer.step() is what upstream holds.
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


def node_streams(devices):
    """The context the bucket node is made in: the reduction's stream of its first CUDA device current there, so that
    it is the node's canonical stream (NOTE [reduction streams]); nothing for emulated replicas."""
    cuda = _streams.cuda_indices(devices)
    return torch.cuda.stream(own_stream(cuda[0])) if cuda else contextlib.nullcontext()


def consumer_stream(devices):
    """The stream of the first CUDA device current now (where the delivery node made now runs), or None."""
    cuda = _streams.cuda_indices(devices)
    return torch.cuda.current_stream(cuda[0]) if cuda else None


def release_after(own, devices, grads):
    """Each of `grads` (replica-major: per replica its members, on the replica's device in `devices`) goes back to
    the caching allocator, when autograd drops it, only after its device's reduction stream (`own`) has read it."""
    k = len(grads) // len(devices)
    for r, d in enumerate(devices):
        s = own[d]
        for g in grads[r * k : (r + 1) * k]:
            if g is not None:
                for t in (g._indices(), g._values()) if g.is_sparse else (g,):
                    t.record_stream(s)


def _no_handover(result):
    return result


@contextlib.contextmanager
def ordered(bucket, grads=None):
    """The reduction's work for one bucket whose result autograd takes at once (CUDA: on the reduction's own
    streams, after the gradients are ready there, the node's `grads` it reads released stream-ordered; NOTE
    [reduction streams]). Yields ``hand(result)``: the consumer's stream (the delivery node's) waits for the work,
    and the result's memory, which the reduction's streams allocated, counts as used by that stream too."""
    reducer = bucket.reducer
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

    if grads is not None:
        release_after(own, reducer.devices, grads)
    with _streams.entered(tuple(own.values())):
        yield hand
    consumer = bucket.consumer or torch.cuda.current_stream(first)
    _streams.Fence([own[first]]).wait(consumer)
    for result in handed:
        for t in result if isinstance(result, (tuple, list)) else (result,):
            if t is not None:
                t.record_stream(consumer)


def _gave_gradients(bucket, grads, device):
    """Whether a replica on ``device`` handed the bucket node a gradient. The sum writes ``out``, a block of the
    consumer's stream (one that stream may have just freed while its own work still reads it), on the first device's
    reduction stream; autograd orders that stream after the consumer's work only by the gradients of the first
    device, made there. Where the first device gave none (its replica left the bucket's parameters unused, or ran no
    rows), the reduction stream waits for the consumer's stream itself."""
    k = len(bucket.members)
    return any(g is not None for r, d in enumerate(bucket.reducer.devices) if d == device
               for g in grads[r * k : (r + 1) * k])


class CudaStreams:
    """Sums of one replica set's buckets on the reduction's own streams (NOTE [reduction streams])."""

    def __init__(self, devices):
        self.devices = list(_streams.cuda_indices(devices))

    def launch(self, bucket, grads, taken):
        first = self.devices[0]
        own = {d: own_stream(d) for d in self.devices}
        # The consumer's memory, taken on its stream before the reduction's streams are ordered after the consumer's.
        consumer = bucket.consumer or torch.cuda.current_stream(first)
        with torch.cuda.stream(consumer):
            out = torch.empty(bucket.numel, dtype=bucket.dtype, device=bucket.tdevs[0])
        out.record_stream(own[first])
        ready = ready_streams(self.devices)
        pairs = [(s, r) for d, s in own.items() for r in ready[d]]
        if not _gave_gradients(bucket, grads, first):
            pairs.append((own[first], consumer))
        _streams.order(pairs)
        release_after(own, bucket.reducer.devices, grads)
        recorder = bucket.reducer.recorder
        with _streams.entered(tuple(own.values())):
            began = recorder.stamp(first) if recorder is not None else None  # on the first reduction stream
            result = sums.bucket_sum(bucket, grads, taken, out)
            if began is not None:  # device timings, read when the report is (no synchronisation here)
                recorder.record("reduce", None, began, recorder.stamp(first), bucket.numel * bucket.itemsize,
                                bucket=bucket.index)
        return CudaJob(result, _streams.Fence([own[first]]), first)


class CudaJob(Finished):
    """A sum enqueued on the reduction's streams: ``take()`` first orders the consumer's stream after it."""

    __slots__ = ("fence", "device")

    def __init__(self, value, fence, device):
        super().__init__(value)
        self.fence, self.device = fence, device

    def take(self):
        self.fence.wait(torch.cuda.current_stream(self.device))  # the delivery node's stream: the consumer's
        return super().take()
