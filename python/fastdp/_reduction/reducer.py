"""The gradient reduction of the kept replicas (fastdp._step.step.replicas): when a bucket's reduction starts, where it runs,
and how its sum reaches the master parameters. See NOTE [reduction while backward runs].

NOTE [reduction while backward runs]
Each gradient bucket has two autograd nodes, made once with the kept replicas (NOTE [kept replica tensors] in
_replicas.py):

    master parameters <- delivery node <- bucket node <- every replica's tensors of the bucket

The bucket node is where the replicas' gradients of the bucket meet. Autograd calls it once every gradient that will
reach it exists: its count of incoming edges is exact, whatever the graph (members some replicas never use, a
retained graph run again, checkpointed blocks recomputed, several graphs alive). But autograd's ready queue runs the
node with the highest sequence number first, and a node made at the first step is older than every node of the
steps after it: left so, it would run only once nothing else was ready, after the whole backward. So the bucket node
gets the highest sequence number (the one autograd gives AccumulateGrad nodes, which DDP's reducer hooks for the same
reason): it runs as soon as it is ready, and starts the bucket's reduction there, on the host backend's reducer
thread for emulated replicas or on streams of the reduction's own on CUDA devices, while autograd goes on with the
rest of backward. It hands the delivery node a token of the started sum (a zero of the first member's shape on
device_ids[0]; the sum lives exactly as long as the backward: one that fails drops it with its memory). The
delivery node, whose only input comes from the bucket node, gets the lowest sequence number, so autograd runs it
when nothing else is ready in device_ids[0]'s queue; it waits for the reduction (host) or orders its stream after
it (CUDA) and hands the sum to the master parameters' AccumulateGrad nodes. So hooks on master parameters,
``torch.autograd.grad``, ``backward(inputs=...)``, post-accumulate-grad hooks and double backward see one summed
gradient per backward, as on the bare model. On the host, where every node runs in one queue, the delivery nodes run
last, so a backward that fails in the replicas' part has written no ``.grad`` (one that fails among the deliveries,
in a hook on a master parameter say, keeps what was accumulated before, as the bare model's does); on CUDA devices,
where each device's nodes run on their own thread, a sum delivered before another device's backward failed stays in
``.grad``, as the bare model's accumulated gradients do. Where the result must be differentiable
(``create_graph=True``) or nothing is summed (``no_sync()``), the bucket node computes its result at once and the
delivery node passes it on.

On CUDA (NOTE [reduction streams]) every piece of the reduction's work runs on one stream of its own per device,
which first waits for the stream where autograd guarantees the gradients are ready; the tensors it reads or writes
are held until a fence behind that work reports it complete, so the caching allocator never hands their memory out
while the reduction still uses it, and the consumer's stream waits for the fence before the sum is used.
"""

import collections
import contextlib
import operator
import os
import queue
import threading
import time
import weakref
from functools import partial
from itertools import repeat

import torch
from torch.autograd import Function

from .. import _C, comm
from .._platform import streams as _streams
from .._native.core import reduce_columns, to_core_dtype
from .._step.functions import ReduceAddCoalesced

__all__ = ["BucketNode", "Delivery", "start", "deliver", "flush", "sweep"]

_unflatten_dense = getattr(getattr(torch._C, "_nn", None), "unflatten_dense_tensors", None)
_flatten_dense = getattr(getattr(torch._C, "_nn", None), "flatten_dense_tensors", None)
_is_sparse = operator.attrgetter("is_sparse")
_graph_task_id = torch._C._current_graph_task_id  # the backward running in this thread (torch 2.1 and newer)
_will_run = getattr(torch._C, "_will_engine_execute_node", None)
_queue_callback = torch.autograd.Variable._execution_engine.queue_callback

_FIRST = 2**64 - 1  # the sequence number of AccumulateGrad nodes: autograd runs such a node as soon as it is ready
_LAST = 0


def unflatten(flat, like, sizes, shapes):
    """Views of `flat` shaped like the tensors `like` (torch's C++ loop where it has one)."""
    if _unflatten_dense is not None:
        return _unflatten_dense(flat, like)
    return [piece.view(shape) for piece, shape in zip(flat.split(sizes), shapes)]


def result_views(flat, bucket):
    """Per member of `bucket`, a tensor over `flat` shaped like it, for results nobody differentiates through
    (reduced gradients): the C shim makes plain tensors sharing flat's memory (about a third of the cost of torch's
    unflatten into autograd views, docs/benchmarks.md), torch makes views where the shim cannot, detached by
    ``.data`` into plain tensors too. Either way each has a version counter of its own, as a gradient autograd made
    would: zeroing one member's ``.grad`` in place must not look like a change to the others' (NOTE [no_sync sums])."""
    views = _C.views(flat, bucket.spec)
    if views is not None:
        return views
    return [v.data for v in unflatten(flat, bucket.like, bucket.sizes, bucket.shapes)]


# ---- the two nodes -------------------------------------------------------------------------------------------------


class Delivery(Function):
    """The master tensors of one bucket as the bucket node sees them (detached aliases: the master's storage and
    version counter); its backward hands them the bucket's sum (NOTE [reduction while backward runs])."""

    @staticmethod
    def forward(ctx, bucket, *masters):
        ctx.bucket = bucket
        ctx.set_materialize_grads(False)
        return tuple(t.detach() for t in masters)

    @staticmethod
    def backward(ctx, *grads):
        return (None,) + deliver(ctx.bucket, grads)


class BucketNode(Function):
    """One bucket's replica tensors: replica 0's detached aliases of the master tensors, then the other replicas'
    detached views of their flat buffers (`flats`); its backward starts the bucket's reduction."""

    @staticmethod
    def forward(ctx, bucket, flats, *sources):
        ctx.bucket = bucket
        ctx.set_materialize_grads(False)
        outs = [t.detach() for t in sources]
        for flat in flats:
            outs += [v.detach() for v in unflatten(flat, bucket.like, bucket.sizes, bucket.shapes)]
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        return (None, None) + start(ctx.bucket, grads)


def make_nodes(bucket, flats):
    """The bucket's two nodes over its master tensors and the other replicas' flat buffers: the node outputs (every
    replica's tensors), with the sequence numbers NOTE [reduction while backward runs] gives them."""
    aliases = Delivery.apply(bucket, *bucket.master)
    outs = BucketNode.apply(bucket, flats, *aliases)
    _set_sequence_nr(aliases[0].grad_fn, _LAST)
    _set_sequence_nr(outs[0].grad_fn, _FIRST)
    bucket.delivery = weakref.ref(aliases[0].grad_fn)  # (the node holds the bucket: a strong reference would cycle)
    return outs


def _set_sequence_nr(node, nr):
    setter = getattr(node, "_set_sequence_nr", None)  # every torch fastdp supports has it (2.2 and newer)
    if setter is not None:
        setter(nr)


# ---- the bucket node's backward: start -----------------------------------------------------------------------------


def start(bucket, grads):
    """Every replica's gradients of `bucket` are complete (replica-major: replica 0's k members, then replica 1's...,
    None where a replica did not use a member). Starts the sum and hands autograd a token of it for the delivery
    node, or, where the result is needed at once (no_sync, create_graph), hands the result itself: one gradient or
    None per member."""
    state = bucket.state
    if not state.host:
        _streams.refuse_capture("fastdp.DataParallel's gradient reduction")
    # no_sync's bookkeeping, one node at a time (a reentrant checkpoint runs a bucket's node in nested backwards,
    # which can run on several of autograd's threads at once).
    with state.lock:
        if bucket.returned:
            _take_back(bucket)
        if bucket.pending is not None:
            keeps_pending(bucket)  # drops the sums of members whose .grad the user cleared since
        # Which members this backward accumulates into .grad: asked only where no_sync's sums are involved.
        accumulating = _accumulating(bucket) if not state.sync or bucket.pending is not None or state.kept else None
        if not state.sync and any(accumulating):
            with _ordered(state, grads) as hand:
                return hand(_accumulate(bucket, grads, accumulating))
        if state.sync and state.kept and any(accumulating):
            _queue_flush(state)
        kept = _take_pending(bucket, accumulating) if state.sync else None
    if torch.is_grad_enabled():
        # create_graph=True: the differentiable sum, whose backward broadcasts again (double backward), at once.
        with _ordered(state, (grads, kept)) as hand:
            rows = _member_rows(bucket, grads, kept)
            return hand(ReduceAddCoalesced.apply(state.devices[0], state.devices, len(bucket.members),
                                                 *(g for row in rows for g in row)))
    if kept is None and all(map(operator.is_, grads, repeat(None))):
        return grads[: len(bucket.members)]  # no gradient reached the bucket
    backward = _this_backward(state)
    try:
        if state.host and backward.last_to_start(len(state.grad_buckets)):
            # Nothing of the replicas' backward is left to overlap: handing the sum to the reducer thread would only
            # add the hand-over to the step.
            job = _Done(_host_sum(bucket, grads, kept))
        else:
            job = state.reduction.launch(bucket, grads, kept)
    except BaseException:
        if kept is not None:
            _put_back(weakref.ref(bucket), kept)
        raise
    if kept is not None:
        # Kept again unless delivered, when the backward ends (not the job: an error raised from it may hold it).
        job.restore = weakref.finalize(backward, _put_back, weakref.ref(bucket), kept)
    backward.jobs.append(job)
    return (_token(bucket, job),) + (None,) * (len(bucket.members) - 1)


def _token(bucket, job):
    """What the bucket node hands the delivery node for its first member: a zero of that member's shape that refers
    to the started sum (weakly: the sum belongs to its backward, see _Backward)."""
    token = _zero(bucket.dtype, bucket.state.tdevs[0]).expand(bucket.shapes[0])
    token._fastdp_sum = weakref.ref(job)
    return token


_ZEROS = {}


def _zero(dtype, device):
    """One zero per dtype and device, made once (no fill kernel per token on CUDA); tokens are expanded views of
    it that nothing reads or writes."""
    zero = _ZEROS.get((dtype, device))
    if zero is None:
        zero = _ZEROS.setdefault((dtype, device), torch.zeros((), dtype=dtype, device=device))
    return zero


class _Backward:
    """The sums one backward started, held by the callback autograd runs at that backward's end, so that they live
    exactly as long as the backward (the tokens cannot hold them: autograd leaves a failed backward's pending nodes
    and their inputs in the calling thread's ready queue until its next backward). What no_sync kept for a sum is
    kept again, unless the sum was delivered, when this object dies (finalizers on it, set by start). Autograd
    drops it with the backward: on the host before a failed backward's error reaches the caller; on CUDA devices
    once the device threads have also finished the nodes they were running. Also counts the buckets that started
    a sum in this backward."""

    __slots__ = ("task", "jobs", "count", "__weakref__")

    def __init__(self, task):
        self.task, self.jobs, self.count = task, [], 0

    def last_to_start(self, buckets):
        """Whether every other of the `buckets` gradient buckets has started its sum in this backward."""
        self.count += 1
        return self.count >= buckets

    def __call__(self):  # the backward completed: every sum was delivered
        self.jobs.clear()


def _this_backward(state):
    """The running backward's _Backward, made (and queued as its final callback) by its first bucket to start."""
    task = _graph_task_id()
    with state.lock:
        backward = state.started() if state.started is not None else None
        if backward is None or backward.task != task:
            backward = _Backward(task)
            _queue_callback(backward)
            state.started = weakref.ref(backward)
        return backward


def _queue_flush(state):
    """The first backward after no_sync that writes gradients: what no_sync kept for the buckets it never reaches
    (or for members it leaves out) reaches .grad at its end (once per backward; a backward that fails never flushes,
    and its kept sums stay kept)."""
    task = _graph_task_id()
    if state.flushing != task:
        state.flushing = task
        _queue_callback(partial(flush, state))


def deliver(bucket, grads):
    """The delivery node's backward: the sum the bucket node computed at once (passed on), or the one it started
    (waited for on the host, ordered before the consumer's stream on CUDA)."""
    ref = getattr(grads[0], "_fastdp_sum", None) if grads and grads[0] is not None else None
    if ref is None:
        return grads
    job = ref()  # alive: its backward (this one) holds it until its end
    sweep()
    recorder = bucket.state.recorder
    if recorder is None or type(job) is not _Job:  # only a host thread's sum can keep backward waiting here
        return job.take()
    began = time.perf_counter_ns()
    try:
        return job.take()
    finally:
        recorder.record("wait-reduce", None, began, time.perf_counter_ns(), bucket=bucket.index)


def _put_back(ref, kept):
    """What no_sync kept, taken for a sum that was never delivered (its backward failed): returned to the bucket, to
    be kept again (by _take_back, under the lock, before the bucket's next use: this runs whenever the failed
    backward's graph is freed, possibly in the middle of other work)."""
    bucket = ref()
    if bucket is not None:
        bucket.returned.append(kept)


def _take_back(bucket):
    """Keeps again what failed backwards returned (see _put_back). The state's lock is held."""
    while bucket.returned:
        kept = bucket.returned.pop()
        now = _pending_rows(bucket)
        for row, back in zip(now[1:], _kept_rows(bucket, kept)[1:]):
            for j, acc in enumerate(back):
                if acc is not None:
                    row[j] = acc if row[j] is None else row[j] + acc
        bucket.pending = now
        bucket.state.kept = True


# ---- the sum -------------------------------------------------------------------------------------------------------


def _sum(bucket, grads, kept, out):
    """One gradient (or None) per member: the replicas' sum plus what no_sync kept (`kept`, taken from the bucket),
    into `out` (a flat buffer of the bucket on device_ids[0]) or a new one."""
    state = bucket.state
    if out is None:
        out = torch.empty(bucket.numel, dtype=bucket.dtype, device=state.tdevs[0])
    if state.host and kept is None and _C.reduce_rows(grads, len(bucket.members), out):
        return tuple(result_views(out, bucket))  # each member summed in place, nothing packed
    if _packable(bucket, grads, kept):
        result = _reduce_packed(bucket, grads, kept, out)
        if result is not None:
            return result
    return _reduce_members(bucket, _member_rows(bucket, grads, kept), out)


def _packable(bucket, grads, kept):
    """Whether the packed path may run: every replica produced every member's dense gradient (the common case),
    and whatever no_sync kept is packed too."""
    return (bucket.pack and (kept is None or kept[0]) and not any(map(operator.is_, grads, repeat(None)))
            and not any(map(_is_sparse, grads)))


def _reduce_packed(bucket, grads, kept, out):
    """Each replica's gradients packed into one flat tensor by torch's C++ and the packed tensors summed in one core
    call, with the packed sums no_sync kept. None where packing changed a dtype (the caller then takes the
    per-member path)."""
    k, nrep = len(bucket.members), len(bucket.state.tdevs)
    flats = [_flatten_dense(grads[r * k : (r + 1) * k]) for r in range(nrep)]
    if not all(f.dtype == bucket.dtype for f in flats):
        return None
    if kept is not None:
        flats = [f if acc is None else acc + f for acc, f in zip(kept[1], flats)]
    if bucket.dtype.is_complex:
        reduce_columns([[to_core_dtype(f) for f in flats]], [to_core_dtype(out)])
    else:
        reduce_columns([flats], [out])
    return tuple(result_views(out, bucket))


def _member_rows(bucket, grads, kept):
    """Per replica, per member, the gradient to sum: this backward's plus what no_sync kept (`kept`)."""
    k, nrep = len(bucket.members), len(bucket.state.tdevs)
    rows = [list(grads[r * k : (r + 1) * k]) for r in range(nrep)]
    if kept is None:
        return rows
    for row, acc_row in zip(rows[1:], _kept_rows(bucket, kept)[1:]):
        for j, acc in enumerate(acc_row):
            if acc is not None:
                row[j] = acc if row[j] is None else acc + row[j]
    return rows


def _reduce_members(bucket, rows, out):
    """Column by column in one core call into views of `out` (sparse gradients through comm)."""
    dest = bucket.state.tdevs[0]
    result = [None] * len(bucket.members)
    columns, outs = [], []
    views = None
    complex_ = bucket.dtype.is_complex  # one dtype per bucket: only complex buckets need the real-pair views
    for j in range(len(result)):
        column = [row[j] for row in rows if row[j] is not None]
        if not column:
            continue
        if any(g.is_sparse for g in column):
            result[j] = comm.reduce_add([g.to(dest) if g.device != dest else g for g in column], dest)
            continue
        if views is None:  # every member's view of one flat result, in one call
            views = result_views(out, bucket)
        result[j] = views[j]
        columns.append([to_core_dtype(_dense(g)) if complex_ else _dense(g) for g in column])
        outs.append(to_core_dtype(views[j]) if complex_ else views[j])
    if columns:
        reduce_columns(columns, outs)
    return tuple(result)


def _dense(g):
    return g if g.is_contiguous() else g.contiguous()


# ---- where the sum runs --------------------------------------------------------------------------------------------


def reduction_for(state):
    """Where `state`'s buckets are summed: the host reducer thread for emulated replicas, the reduction's own CUDA
    streams for CUDA devices."""
    return _HOST if state.host else _CudaReduction(state)


class _Done:
    """A sum computed already (the last bucket of a host backward). ``take()`` hands it over once; ``restore``: the
    finalizer (on the backward's _Backward) that keeps what no_sync kept again if it never is."""

    __slots__ = ("value", "restore", "__weakref__")

    def __init__(self, value):
        self.value, self.restore = value, None

    def take(self):
        if self.restore is not None:
            self.restore.detach()
        value, self.value = self.value, None  # (autograd takes the sum as .grad only if nothing else holds it)
        return value


class _Job(_Done):
    """A sum started on the reducer thread; ``take()`` waits for it and raises what it raised."""

    __slots__ = ("done", "error")

    def __init__(self):
        super().__init__(None)
        self.done = threading.Event()
        self.error = None

    def take(self):
        self.done.wait()
        if self.error is not None:
            error, self.error = self.error, None  # (its traceback holds this frame: no cycle through the job)
            raise error
        return super().take()


class _HostReduction:
    """One thread per process that sums host buckets in the order their nodes started them, while the thread that
    runs backward goes on (the core releases the GIL while it adds). Made on first use, and again in a forked
    child (threads do not survive a fork)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._queue = None
        self._pid = None

    def launch(self, bucket, grads, kept):
        job = _Job()
        self._tasks().put((weakref.ref(job), bucket, grads, kept))  # the job is its backward's (_Backward)
        return job

    def _tasks(self):
        with self._lock:
            if self._pid != os.getpid():
                self._queue = queue.SimpleQueue()
                self._pid = os.getpid()
                threading.Thread(target=self._run, args=(self._queue,), name="fastdp-reducer", daemon=True).start()
            return self._queue

    @staticmethod
    def _run(tasks):
        while True:
            ref, bucket, grads, kept = tasks.get()
            value = error = None
            try:
                value = _host_sum(bucket, grads, kept)
            except BaseException as e:  # handed to the delivery node, which raises it in backward
                error = e
            del bucket, grads, kept
            job = ref()
            if job is not None:  # else its backward failed: nobody waits, and the sum is dropped here
                job.value, job.error = value, error
                done = job.done
                del job
                done.set()
            del value, error


_HOST = _HostReduction()


def _host_sum(bucket, grads, kept):
    """_sum on the host, timed for the wrapper's recorder when one records."""
    recorder = bucket.state.recorder
    if recorder is None:
        return _sum(bucket, grads, kept, None)
    began = time.perf_counter_ns()
    result = _sum(bucket, grads, kept, None)
    recorder.record("reduce", None, began, time.perf_counter_ns(), bucket.numel * bucket.itemsize, bucket=bucket.index)
    return result


# NOTE [reduction streams]
# On CUDA devices the reduction runs on one stream of its own per device (made once per process and device), so it
# neither waits for compute enqueued after the gradients it sums nor holds up compute enqueued after it. Autograd
# says where the bucket node's gradients are ready, and the rule changed in torch 2.8:
# - torch 2.8 and newer: the node's canonical stream (its first device's, current while the node runs) has waited for
#   every incoming gradient, whatever its device; so every reduction stream waits for that stream.
# - before 2.8: gradients on the node's first device are ready on its canonical stream; a gradient on another
#   device is ready on that device's default stream, where autograd also added several contributions to it. So the
#   first device's reduction stream waits for the canonical stream, each other device's for its default stream.
# A started sum is written into a buffer allocated on the consumer's stream (its memory is the consumer's to reuse
# once the sum is used); a sum handed over at once (no_sync, create_graph) is allocated by the reduction's streams
# and recorded as used by the consumer's stream. The consumer's stream waits for the first device's reduction stream
# before autograd uses a sum. Every tensor the reduction reads or writes is held until a fence behind its work on
# every device has passed (swept at each reduction, delivery and forward; a failure part way included), so the caching
# allocator reuses no memory the reduction still reads.
_LEGACY_STREAMS = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 8)


def ready_streams(devices, legacy=None):
    """Per distinct CUDA device among `devices` (first one first): the stream its reduction stream waits for before
    reading the gradients autograd handed the bucket node (NOTE [reduction streams])."""
    legacy = _LEGACY_STREAMS if legacy is None else legacy
    first = devices[0]
    canonical = torch.cuda.current_stream(first)
    ready = {}
    for d in devices:
        if d not in ready:
            ready[d] = canonical if d == first or not legacy else torch.cuda.default_stream(d)
    return ready


_OWN_STREAMS = {}


def own_stream(device):
    """The reduction's stream on one CUDA device (one per process and device)."""
    s = _OWN_STREAMS.get(device)
    if s is None:
        s = _OWN_STREAMS.setdefault(device, torch.cuda.Stream(device=device))
    return s


class _Ledger:
    """Tensors the reduction's streams still use, each group released once its fence has passed."""

    def __init__(self):
        self._held = []
        self._lock = threading.Lock()

    def hold(self, fence, tensors):
        with self._lock:
            self._held.append((fence, tensors))

    def sweep(self):
        with self._lock:
            if self._held:
                self._held = [entry for entry in self._held if not entry[0].done()]


_LEDGER = _Ledger()


def sweep():
    """Releases the tensors of reductions that have completed (called at each forward and delivery)."""
    if _LEDGER._held:
        _LEDGER.sweep()


def _no_handover(result):
    return result


@contextlib.contextmanager
def _ordered(state, held):
    """The reduction's work of one node whose result autograd takes at once (CUDA: on the reduction's own streams,
    after the gradients are ready there, `held` (what it reads) kept alive until it completes; NOTE [reduction
    streams]). Yields ``hand(result)``: the node's stream waits for the work, and the result's memory, which the
    reduction's streams allocated, counts as used by that stream too."""
    if state.host:
        yield _no_handover
        return
    own = {d: own_stream(d) for d in _streams.cuda_indices(state.devices)}
    first = next(iter(own))
    ready = ready_streams(list(own))
    _streams.order([(own[d], ready[d]) for d in own])
    handed = []

    def hand(result):
        handed.append(result)
        return result

    try:
        with _streams.entered(tuple(own.values())):
            yield hand
    finally:
        _LEDGER.hold(_streams.Fence(list(own.values())), held)  # a failure part way included
    consumer = torch.cuda.current_stream(first)
    _streams.Fence([own[first]]).wait(consumer)
    for result in handed:
        for t in result if isinstance(result, (tuple, list)) else (result,):
            if t is not None:
                t.record_stream(consumer)


class _CudaReduction:
    """Sums of one replica set's buckets on the reduction's own streams (NOTE [reduction streams])."""

    def __init__(self, state):
        self.devices = list(_streams.cuda_indices(state.devices))

    def launch(self, bucket, grads, kept):
        sweep()
        first = self.devices[0]
        own = [own_stream(d) for d in self.devices]
        # The consumer's memory, taken before the reduction's streams are ordered after the consumer's.
        out = torch.empty(bucket.numel, dtype=bucket.dtype, device=bucket.state.tdevs[0])
        ready = ready_streams(self.devices)
        _streams.order([(s, ready[d]) for d, s in zip(self.devices, own)])
        recorder = bucket.state.recorder
        try:
            with _streams.entered(tuple(own)):
                began = recorder.stamp(first) if recorder is not None else None  # on the first reduction stream
                result = _sum(bucket, grads, kept, out)
                if began is not None:  # device timings, read when the report is (no synchronisation here)
                    recorder.record("reduce", None, began, recorder.stamp(first), bucket.numel * bucket.itemsize,
                                    bucket=bucket.index)
        finally:
            # Held until the reduction's work on every device has passed (a failure part way included). Not the
            # results: autograd takes a sum nothing else holds as .grad without copying it.
            _LEDGER.hold(_streams.Fence(own), (grads, kept, out))
        return _CudaJob(result, _streams.Fence([own[0]]), first)


class _CudaJob(_Done):
    __slots__ = ("fence", "device")

    def __init__(self, value, fence, device):
        super().__init__(value)
        self.fence, self.device = fence, device

    def take(self):
        self.fence.wait(torch.cuda.current_stream(self.device))  # the delivery node's stream: the consumer's
        return super().take()


# ---- no_sync -------------------------------------------------------------------------------------------------------

# NOTE [no_sync sums]
# Under DDP's no_sync, whose contract fastdp keeps, each rank accumulates its own gradients in .grad, and what the
# user does to .grad (zero_grad in either set_to_none mode, p.grad = None, a new optimizer's zero_grad) is done to
# that accumulation. Here replica 0 plays the rank: its gradients are returned to autograd, which accumulates them
# in the master's .grad; the other replicas' are summed per replica and kept until the next synchronising backward
# (no reduction while no_sync lasts). A member replica 0 did not use takes another replica's gradient instead, so
# whatever a member accumulated shows in its .grad. Only what autograd accumulates into .grad is kept: a backward
# that leaves a member's .grad alone (torch.autograd.grad, backward(inputs=...) naming other tensors) gets that
# member's full sum, as the bare model's, and keeps nothing of it. At the end of each no_sync backward the master's
# .grad objects and version counters are noted (_mark_grads); before the kept sums are used, a member whose .grad is
# gone, replaced or zeroed since was cleared by the user, and its kept sums are dropped with it. A .grad changed in
# place to anything but zeros cannot be applied to sums kept apart, and raises instead of being silently ignored.
# A synchronising backward that fails gives back the kept sums of every bucket it did not deliver (_Backward). Two
# rare failures lose them instead: one between a delivery and its AccumulateGrad (a hook on a master parameter
# raising, or on CUDA devices another device failing in between), and a failing create_graph=True backward, whose
# differentiable sums take them at once.


def _accumulating(bucket):
    """Per member, whether this backward accumulates the master's gradient into .grad (its AccumulateGrad node
    runs): not under torch.autograd.grad, nor for members backward(inputs=...) leaves out."""
    node = bucket.delivery and bucket.delivery()
    if _will_run is None or node is None:
        return [True] * len(bucket.members)
    flags = []
    for acc, _ in node.next_functions:
        try:
            flags.append(acc is not None and _will_run(acc))
        except RuntimeError:  # a leaf whose gradient torch.autograd.grad captures: it is returned, not accumulated
            flags.append(False)
    return flags


def _accumulate(bucket, grads, accumulating):
    """no_sync: replica 0's gradients for autograd to accumulate in the master's .grad, the others' kept; members
    this backward does not accumulate get their full sum, and nothing is kept for them."""
    state = bucket.state
    k, nrep, dest = len(bucket.members), len(state.tdevs), state.tdevs[0]
    own = list(grads[:k])
    rows = [None] + [list(grads[r * k : (r + 1) * k]) for r in range(1, nrep)]
    whole = [j for j in range(k) if not accumulating[j]]
    if whole:
        summed = _reduce_members(bucket, [[g if j in whole else None for j, g in enumerate(grads[r * k : (r + 1) * k])]
                                          for r in range(nrep)],
                                 torch.empty(bucket.numel, dtype=bucket.dtype, device=dest))
        for j in whole:
            own[j] = summed[j]
            for row in rows[1:]:
                row[j] = None
    for j, g in enumerate(own):
        if g is None and accumulating[j]:  # replica 0 did not use it: another replica's gradient shows in .grad
            for row in rows[1:]:
                if row[j] is not None:
                    own[j], row[j] = row[j].to(dest), None
                    break
    if any(g is not None for row in rows[1:] for g in row):
        _keep(bucket, rows)
    task = _graph_task_id()  # once per backward; a backward that failed before its end never ran its callback
    if state.marking != task:
        state.marking = task
        _queue_callback(partial(_mark_grads, state))
    return tuple(own)


def _keep(bucket, rows):
    """Adds replicas 1.. 's gradients to the sums kept for them: packed into one tensor per replica where every
    member is there and dense (and what is kept is packed too), else member by member."""
    pending = bucket.pending
    if (bucket.pack and (pending is None or bucket.pending_flat)
            and not any(g is None or g.is_sparse for row in rows[1:] for g in row)):
        flats = [None] + [_flatten_dense([g.detach() for g in row]) for row in rows[1:]]
        if all(f.dtype == bucket.dtype for f in flats[1:]):
            if pending is None:  # one member: the packed tensor is a view of autograd's gradient, not a copy
                flats = [None] + [f.clone() if len(row) == 1 else f for f, row in zip(flats[1:], rows[1:])]
            else:
                flats = [None] + [acc[0] + f for acc, f in zip(pending[1:], flats[1:])]
            bucket.pending, bucket.pending_flat = [None] + [[f] for f in flats[1:]], True
            bucket.state.kept = True
            return
    kept = _pending_rows(bucket)
    for row, acc in zip(rows[1:], kept[1:]):
        for j, g in enumerate(row):
            if g is not None:
                g = g.detach()
                acc[j] = g.clone() if acc[j] is None else acc[j] + g
    bucket.pending = kept
    bucket.state.kept = True


def _pending_rows(bucket):
    """The kept sums member by member (packed ones cut into views), empty rows where nothing is kept."""
    k, nrep = len(bucket.members), len(bucket.state.tdevs)
    if bucket.pending is None:
        bucket.pending_flat = False
        return [None] + [[None] * k for _ in range(1, nrep)]
    if bucket.pending_flat:
        bucket.pending = [None] + [list(result_views(acc[0], bucket)) for acc in bucket.pending[1:]]
        bucket.pending_flat = False
    return bucket.pending


def _take_pending(bucket, accumulating=None):
    """What no_sync kept for `bucket`, taken for the sum that consumes it: (packed, per replica: one packed tensor or
    a row of members; None for replica 0), or None. With `accumulating` (per member), only the members this
    backward accumulates into .grad are taken; the others' sums stay kept."""
    if bucket.pending is None or (accumulating is not None and not any(accumulating)):
        return None
    if accumulating is not None and not all(accumulating):
        rows = _pending_rows(bucket)
        taken = [None] + [[acc if accumulating[j] else None for j, acc in enumerate(row)] for row in rows[1:]]
        for row in rows[1:]:
            for j, flag in enumerate(accumulating):
                if flag:
                    row[j] = None
        if all(acc is None for row in rows[1:] for acc in row):
            bucket.pending = None
        return False, taken
    packed = bucket.pending_flat
    rows = [None] + [acc[0] if packed else acc for acc in bucket.pending[1:]]
    bucket.pending, bucket.pending_flat = None, False
    return packed, rows


def _kept_rows(bucket, kept):
    """Kept sums member by member (packed ones cut into views)."""
    packed, rows = kept
    if not packed:
        return rows
    return [None] + [list(result_views(acc, bucket)) for acc in rows[1:]]


def keeps_pending(bucket):
    """Whether no_sync still keeps sums for `bucket`, once those of members whose master ``.grad`` the user cleared
    since the last no_sync backward are dropped (NOTE [no_sync sums])."""
    if bucket.pending is None or bucket.marks is None:
        return bucket.pending is not None
    # A no_sync backward that failed before its end (an error in a hook, Ctrl-C) never took the marks: what it
    # accumulated counts as kept, and only a .grad now gone or zero counts as cleared.
    state = bucket.state
    stale = state.marking is not None and state.marking != _graph_task_id()
    rows = bucket.pending[1:]
    kept = (range(len(bucket.members)) if bucket.pending_flat else
            [j for j in range(len(bucket.members)) if any(row[j] is not None for row in rows)])
    cleared = [j for j in kept if _cleared(state, bucket.master[j], bucket.marks[j], stale)]
    if len(cleared) == len(bucket.members):
        bucket.pending = None
    elif cleared:  # (the marks are taken again at the end of the next no_sync backward)
        for row in _pending_rows(bucket)[1:]:
            for j in cleared:
                row[j] = None
        if all(acc is None for row in bucket.pending[1:] for acc in row):
            bucket.pending = None
    return bucket.pending is not None


def _grad_mark(g):
    return None if g is None else (weakref.ref(g), g._version)


def _cleared(state, p, mark, stale=False):
    """Whether master parameter p's .grad was cleared since `mark` (gone, replaced, or zeroed in place); with
    `stale` marks, whether it is gone or zero."""
    if mark is None and not stale:
        return False  # nothing was accumulated for p: nothing is kept for it either
    g = p.grad
    if g is None:
        return True
    if stale:
        return not (g._values() if g.is_sparse else g).any()
    if g is not mark[0]():
        return True
    if g._version == mark[1]:
        return False
    if not (g._values() if g.is_sparse else g).any():
        return True
    network = state.network and state.network()
    name = next((n for n, q in network.named_parameters() if q is p), None) if network is not None else None
    raise RuntimeError(
        f"the .grad of parameter {name or tuple(p.shape)!r} was changed in place while gradients accumulated "
        "under no_sync() were not yet reduced: .grad shows replica 0's share only (the others' are kept apart "
        "until the next backward outside no_sync()), so a change other than clearing it (zero_grad(), "
        "p.grad = None) cannot be applied to them. Change .grad after the backward outside no_sync()."
    )


def _mark_grads(state):
    """At the end of a no_sync backward: notes each master member's .grad (object and version) of the buckets that
    keep sums, so that a later clear is seen (NOTE [no_sync sums])."""
    with state.lock:
        state.marking = None
        for ref in state.grad_buckets:
            bucket = ref()
            if bucket is not None and bucket.pending is not None:
                bucket.marks = [_grad_mark(p.grad) for p in bucket.master]


def flush(state):
    """Reduces the sums no_sync still keeps and adds them to the master's ``.grad``: at the end of the first
    backward after no_sync that writes gradients, for buckets whose node it never ran (none of their members was
    used) or members it left out, or for every bucket when the set is replaced."""
    with state.lock, torch.no_grad():
        state.kept = False
        for ref in state.grad_buckets:
            bucket = ref()
            if bucket is not None and bucket.returned:
                _take_back(bucket)
            if bucket is None or not keeps_pending(bucket):
                continue
            nones = (None,) * (len(bucket.members) * len(state.tdevs))
            kept = _take_pending(bucket)
            with _ordered(state, kept) as hand:
                result = hand(_reduce_members(bucket, _member_rows(bucket, nones, kept),
                                              torch.empty(bucket.numel, dtype=bucket.dtype, device=state.tdevs[0])))
            for p, g in zip(bucket.master, result):
                if g is not None:
                    if p.grad is None:
                        p.grad = g
                    else:
                        p.grad += g
