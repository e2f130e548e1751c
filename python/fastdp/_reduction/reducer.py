"""The reducer: the one owner of a replica set's gradient reduction. For each gradient bucket it decides when the
sum starts (the bucket node's readiness), where it runs (fastdp._reduction.host or .cuda), what is in flight (the
sums a backward started, the tensors the streams still read) and what no_sync keeps (fastdp._reduction.unsynced),
and it hands the sum to the master's ``.grad`` through autograd. The replica set holds one Reducer and asks it
through its methods; see NOTE [reduction while backward runs].

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
which first waits for the stream where autograd guarantees the gradients are ready; the bucket node is made with the
first device's reduction stream current, so that autograd's own waits for the gradients land there and not on
replica 0's compute stream. The tensors it reads or writes are recorded as used by its streams, so the caching
allocator hands their memory out again only after that work (the host holds nothing), and the consumer's stream
waits for a fence behind the work before the sum is used.
"""

import operator
import threading
import time
import weakref
from functools import partial
from itertools import repeat

import torch
from torch.autograd import Function

from .._platform import streams as _streams
from .._step.functions import ReduceAddCoalesced
from . import host as _host
from .cuda import CudaStreams, consumer_stream, node_streams, ordered
from .flat import unflatten
from .host import HOST_THREAD
from .jobs import Finished, HostJob
from .sums import reduce_members, replica_rows
from .unsynced import NoSync, UnsyncedSums

__all__ = ["Reducer", "Bucket", "BucketNode", "Delivery", "kept_node"]

_graph_task_id = torch._C._current_graph_task_id  # the backward running in this thread (torch 2.1 and newer)
_will_run = getattr(torch._C, "_will_engine_execute_node", None)
_queue_callback = torch.autograd.Variable._execution_engine.queue_callback

FIRST = 2**64 - 1  # the sequence number of AccumulateGrad nodes: autograd runs such a node as soon as it is ready
LAST = 0


class Reducer:
    """One replica set's gradient reduction. ``sync``: False inside ``no_sync()``; ``recorder``: the running step's
    recorder, or None (set together by ``begin_step``). What it owns: its buckets (weakly: the replica set keeps
    them), where their sums run (``runner``), the sums the
    running backward started (``started``), and no_sync's bookkeeping (``nosync``, and each bucket's unsynced
    sums), guarded by ``lock``: bucket nodes of nested backwards may run at once. Memory its CUDA streams use goes
    back to the caching allocator stream-ordered (NOTE [reduction streams]): the host holds none of it."""

    __slots__ = ("devices", "tdevs", "host", "nrep", "sync", "recorder", "buckets", "network", "runner",
                 "started", "nosync", "lock", "__weakref__")

    def __init__(self, devices, tdevs, network):
        self.devices, self.tdevs = list(devices), list(tdevs)
        self.host = all(d.type == "cpu" for d in self.tdevs)
        self.nrep = len(self.tdevs)
        self.sync = True
        self.recorder = None
        # Weak references to every bucket (the replica set holds them: they hold the reducer, so strong ones would
        # make a cycle, and a replaced replica set's buffers would wait for the collector).
        self.buckets = []
        self.network = weakref.ref(network)  # names parameters in errors
        self.runner = HOST_THREAD if self.host else CudaStreams(self.devices)
        self.started = None  # a weak reference to the sums the running backward started (_Backward)
        self.nosync = NoSync()
        self.lock = threading.Lock()

    def bucket(self, layout):
        """The reducer's side of one gradient bucket of the replica set's layout (`layout`: its members, shapes,
        master tensors...), for the caller to keep."""
        bucket = Bucket(self, layout)
        self.buckets.append(weakref.ref(bucket))
        return bucket

    def begin_step(self, sync, recorder):
        """Before a forward: whether its backward synchronises (False inside no_sync()), and the recorder that
        times its reductions (None when nothing records)."""
        self.sync = sync
        self.recorder = recorder

    def set_sync(self, sync):
        """Entering or leaving no_sync() between forwards."""
        self.sync = sync

    def unsynced_bytes(self):
        """Per replica, the bytes of the unsynced sums no_sync holds for it (replica 0's share is in .grad: 0)."""
        held = [0] * self.nrep
        for bucket in (ref() for ref in self.buckets):
            if bucket is not None:
                for r, row in enumerate(bucket.unsynced.rows or []):
                    held[r] += sum(g.numel() * g.element_size() for g in row or () if g is not None)
        return held

    def settle(self):
        """Waits for the reductions in flight on CUDA devices: before a step runs again after an out-of-memory
        error, the memory the failed attempt's reductions still use (recorded on their streams) must be the
        allocator's to hand out again."""
        if not self.host:
            for d in _streams.cuda_indices(self.devices):
                torch.cuda.synchronize(d)

    def holds_unsynced(self):
        """Whether no_sync() sums are waiting for a synchronising backward."""
        return any(b is not None and b.unsynced.rows is not None for b in (ref() for ref in self.buckets))

    def flush(self):
        """Reduces the sums no_sync still keeps and adds them to the master's ``.grad``: at the end of the first
        backward after no_sync that writes gradients, for buckets whose node it never ran (none of their members was
        used) or members it left out, or for every bucket when the replica set is replaced."""
        with self.lock, torch.no_grad():
            self.nosync.held = False
            network = self.network()
            for ref in self.buckets:
                bucket = ref()
                if bucket is None:
                    continue
                sums = bucket.unsynced
                self._take_back(bucket)
                if sums.drop_cleared(bucket, self.nosync, network):
                    _add_to_grad(bucket, self._reduce_taken(bucket, sums.take(bucket)))

    def _reduce_taken(self, bucket, taken):
        nones = (None,) * (len(bucket.members) * self.nrep)
        with ordered(bucket) as hand:
            out = torch.empty(bucket.numel, dtype=bucket.dtype, device=self.tdevs[0])
            return hand(reduce_members(bucket, replica_rows(bucket, nones, taken), out))

    def _take_back(self, bucket):
        """Holds again what failed backwards gave back of `bucket`'s unsynced sums. The additions run where the
        next reduction reads them, on the reduction's own streams after the streams autograd names ready: the sums
        given back were written there, and the next sum reads them there, with nothing else to order."""
        if bucket.unsynced.returned:
            with ordered(bucket):
                bucket.unsynced.take_back(bucket, self.nosync)

    def _mark_grads(self):
        """At the end of a no_sync backward: notes each master member's .grad of the buckets that hold unsynced
        sums, so that a later clear is seen (NOTE [no_sync sums])."""
        with self.lock:
            self.nosync.marking = None
            for ref in self.buckets:
                bucket = ref()
                if bucket is not None:
                    bucket.unsynced.mark(bucket)

    def this_backward(self):
        """The running backward's _Backward, made (and queued as its final callback) by its first bucket to start."""
        task = _graph_task_id()
        with self.lock:
            backward = self.started() if self.started is not None else None
            if backward is None or backward.task != task:
                backward = _Backward(task)
                _queue_callback(backward)
                self.started = weakref.ref(backward)
            return backward


def _add_to_grad(bucket, result):
    for p, g in zip(bucket.master, result):
        if g is not None:
            if p.grad is None:
                p.grad = g
            else:
                p.grad += g


class Bucket:
    """The reducer's side of one gradient bucket: its layout (copied from the replica set's bucket: members,
    shapes, master tensors, whether its gradients are packed before the sum), its unsynced sums, and a weak
    reference to its delivery node."""

    __slots__ = ("reducer", "index", "members", "shapes", "sizes", "numel", "dtype", "itemsize", "like", "spec",
                 "master", "pack", "tdevs", "host", "nrep", "unsynced", "delivery", "consumer", "rows",
                 "__weakref__")

    def __init__(self, reducer, layout):
        self.reducer = reducer
        self.index = layout.index  # its position among the grad buckets (reports name buckets by it)
        self.members, self.shapes, self.sizes = layout.members, layout.shapes, layout.sizes
        self.numel, self.dtype, self.itemsize = layout.numel, layout.dtype, layout.itemsize
        self.like, self.spec, self.master, self.pack = layout.like, layout.spec, layout.master, layout.pack
        self.tdevs, self.host, self.nrep = reducer.tdevs, reducer.host, reducer.nrep
        self.unsynced = UnsyncedSums()
        self.delivery = None
        self.consumer = None  # the delivery node's stream on CUDA devices, where the sum's memory is allocated
        self.rows = None  # the host sum prepared for its members (fastdp._reduction.sums), made by its first sum

    def nodes(self, flats):
        """The bucket's two nodes over its master tensors and the other replicas' flat buffers (`flats`): the node
        outputs (every replica's tensors), with the sequence numbers NOTE [reduction while backward runs] gives
        them. The bucket node's canonical stream is the reduction's own (NOTE [reduction streams]); the delivery
        node's is the caller's: the sum's consumer."""
        devices = self.reducer.devices
        aliases = Delivery.apply(self, *self.master)
        self.consumer = consumer_stream(devices)
        with node_streams(devices):
            outs = BucketNode.apply(self, flats, *aliases)
        _set_sequence_nr(aliases[0].grad_fn, LAST)
        _set_sequence_nr(outs[0].grad_fn, FIRST)
        self.delivery = weakref.ref(aliases[0].grad_fn)  # (the node holds the bucket: a strong reference would cycle)
        return outs


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


def kept_node(node):
    """Whether `node` is one of a bucket's two nodes, which live as long as the kept replicas: the grad_fn of a kept
    replica tensor, which a forward can hand out as it is (a module returning its parameter). A hook registered on
    one for a single step would stay there and run at every later backward."""
    return type(node) in _KEPT_NODE_TYPES


def _set_sequence_nr(node, nr):
    setter = getattr(node, "_set_sequence_nr", None)  # every torch fastdp supports has it (2.2 and newer)
    if setter is not None:
        setter(nr)


_KEPT_NODE_TYPES = (BucketNode._backward_cls, Delivery._backward_cls)


# ---- the bucket node's backward: start -----------------------------------------------------------------------------


def start(bucket, grads):
    """Every replica's gradients of `bucket` are complete (replica-major: replica 0's k members, then replica 1's...,
    None where a replica did not use a member). Starts the sum and hands autograd a token of it for the delivery
    node, or, where the result is needed at once (no_sync, create_graph), hands the result itself: one gradient or
    None per member."""
    reducer = bucket.reducer
    if not reducer.host:
        _streams.refuse_capture("fastdp.DataParallel's gradient reduction")
    at_once, taken = _settle_unsynced(bucket, grads)
    if at_once is not None:
        return at_once
    if torch.is_grad_enabled():
        # create_graph=True: the differentiable sum, whose backward broadcasts again (double backward), at once.
        with ordered(bucket, grads) as hand:
            rows = replica_rows(bucket, grads, taken)
            return hand(ReduceAddCoalesced.apply(reducer.devices[0], reducer.devices, len(bucket.members),
                                                 *(g for row in rows for g in row)))
    if taken is None and all(map(operator.is_, grads, repeat(None))):
        return grads[: len(bucket.members)]  # no gradient reached the bucket
    return _launch(bucket, grads, taken)


def _settle_unsynced(bucket, grads):
    """no_sync's part of a bucket node, one node at a time (a reentrant checkpoint runs a bucket's node in nested
    backwards, which can run on several of autograd's threads at once): (the node's result when no_sync hands it
    back at once, else None; the unsynced sums this backward's sum consumes, or None)."""
    reducer = bucket.reducer
    nosync, sums = reducer.nosync, bucket.unsynced
    with reducer.lock:
        reducer._take_back(bucket)
        if sums.rows is not None:
            sums.drop_cleared(bucket, nosync, reducer.network())
        # Which members this backward accumulates into .grad: asked only where no_sync's sums are involved.
        involved = not reducer.sync or sums.rows is not None or nosync.held
        accumulating = _accumulating(bucket) if involved else None
        if not reducer.sync and any(accumulating):
            with ordered(bucket, grads) as hand:
                return hand(_accumulate(bucket, grads, accumulating)), None
        if reducer.sync and nosync.held and any(accumulating):
            nosync.flush_at_end(reducer.flush)
        return None, (sums.take(bucket, accumulating) if reducer.sync else None)


def _launch(bucket, grads, taken):
    """Starts the sum where it runs; the job belongs to this backward, and the unsynced sums it took are given
    back if it is never delivered."""
    reducer = bucket.reducer
    backward = reducer.this_backward()
    try:
        if reducer.host and backward.last_to_start(len(reducer.buckets)):
            # Nothing of the replicas' backward is left to overlap: handing the sum to the reducer thread would only
            # add the hand-over to the step.
            job = Finished(_host.timed_sum(bucket, grads, taken))
        else:
            job = reducer.runner.launch(bucket, grads, taken)
    except BaseException:
        if taken is not None:
            _give_back(weakref.ref(bucket), taken)
        raise
    if taken is not None:
        # Held again unless delivered, when the backward ends (not the job: an error raised from it may hold it).
        job.restore = weakref.finalize(backward, _give_back, weakref.ref(bucket), taken)
    backward.jobs.append(job)
    return (_token(bucket, job),) + (None,) * (len(bucket.members) - 1)


def _give_back(ref, taken):
    bucket = ref()
    if bucket is not None:
        bucket.unsynced.give_back(taken)


def _token(bucket, job):
    """What the bucket node hands the delivery node for its first member: a zero of that member's shape that refers
    to the started sum (weakly: the sum belongs to its backward, see _Backward)."""
    token = _zero(bucket.dtype, bucket.tdevs[0]).expand(bucket.shapes[0])
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
    and their inputs in the calling thread's ready queue until its next backward). The unsynced sums a sum took are
    held again, unless the sum was delivered, when this object dies (finalizers on it, set by _launch). Autograd
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


# ---- the delivery node's backward ----------------------------------------------------------------------------------


def deliver(bucket, grads):
    """The delivery node's backward: the sum the bucket node computed at once (passed on), or the one it started
    (waited for on the host, ordered before the consumer's stream on CUDA)."""
    ref = getattr(grads[0], "_fastdp_sum", None) if grads and grads[0] is not None else None
    if ref is None:
        return grads
    job = ref()  # alive: its backward (this one) holds it until its end
    recorder = bucket.reducer.recorder
    if recorder is None or type(job) is not HostJob:  # only a host thread's sum can keep backward waiting here
        return job.take()
    began = time.perf_counter_ns()
    try:
        return job.take()
    finally:
        recorder.record("wait-reduce", None, began, time.perf_counter_ns(), bucket=bucket.index)


# ---- no_sync backwards ---------------------------------------------------------------------------------------------


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
    """no_sync: replica 0's gradients for autograd to accumulate in the master's .grad, the others' added to the
    unsynced sums; members this backward does not accumulate get their full sum, and nothing is held for them."""
    reducer = bucket.reducer
    k = len(bucket.members)
    own = list(grads[:k])
    rows = [None] + [list(grads[r * k : (r + 1) * k]) for r in range(1, reducer.nrep)]
    whole = [j for j in range(k) if not accumulating[j]]
    if whole:
        _sum_whole(bucket, grads, whole, own, rows)
    for j, g in enumerate(own):
        if g is None and accumulating[j]:  # replica 0 did not use it: another replica's gradient shows in .grad
            for row in rows[1:]:
                if row[j] is not None:
                    own[j], row[j] = row[j].to(reducer.tdevs[0]), None
                    break
    if any(g is not None for row in rows[1:] for g in row):
        bucket.unsynced.add(bucket, rows, reducer.nosync)
    reducer.nosync.mark_at_end(reducer._mark_grads)
    return tuple(own)


def _sum_whole(bucket, grads, whole, own, rows):
    """The members in `whole` summed across replicas into `own` (and taken out of the other replicas' `rows`)."""
    k, reducer = len(bucket.members), bucket.reducer
    only = [[g if j in whole else None for j, g in enumerate(grads[r * k : (r + 1) * k])] for r in range(reducer.nrep)]
    summed = reduce_members(bucket, only, torch.empty(bucket.numel, dtype=bucket.dtype, device=reducer.tdevs[0]))
    for j in whole:
        own[j] = summed[j]
        for row in rows[1:]:
            row[j] = None
