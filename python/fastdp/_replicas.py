"""Persistent replicas and bucketed gradient reduction for ``fastdp.DataParallel``.

Replica module skeletons are built once per (module structure, device list) and kept; every step only tensors
move. Each step:

1. the structure signature (modules, parameter/buffer/child identities, dtypes, shapes, devices, requires_grad)
   is compared with the one the skeletons were built from; any difference rebuilds them;
2. each replica's ``__dict__`` is refreshed from its master module in C (what ``_replicate_for_data_parallel``
   would copy: attributes, hook dicts, the training flag), keeping the replica's own parameter/buffer/child dicts;
3. parameters (and buffers that require grad) are broadcast bucket by bucket, each bucket one autograd node
   whose outputs are the replicas' tensors, made once and kept with them (``_KeptBroadcast``, see NOTE [kept
   replica tensors]); the other buffers and frozen parameters are copied into flat buffers reused across steps,
   outside autograd. The master tensors of a bucket themselves live in one flat buffer on device_ids[0] (their
   ``.data`` re-pointed to slices of its storage when the replicas are built, as DDP's gradient_as_bucket_view;
   see _pieces), so a bucket is one copy or one NCCL broadcast per device;
   members whose ``.data`` was replaced since (``.to()``, ``p.data = ...``: a data pointer changed) are
   flattened again, and a bucket that cannot be flat (members sharing memory, non-contiguous members) is copied
   member by member;
4. the tensors are installed into the skeletons in C (``_C.rebind``; kept ones only when they change).

In backward, a bucket's node runs as soon as every replica has produced that bucket's gradients (buckets hold
parameters in reverse registration order, so the last layers' reduction starts while earlier layers are still in
backward); when every replica has every member's gradient and the members are small (where per-member Python
would cost more than copying the bytes), each replica's gradients are packed into one flat tensor by torch's C++
and the R flat tensors are summed onto ``device_ids[0]`` in one core call (otherwise, and for sparse gradients,
column by column in one core call, without packing); the master parameters get views of the flat result (autograd's
AccumulateGrad takes them as ``.grad`` or adds them to the ``.grad`` already there). ``no_sync()`` hands replica
0's gradients to the master's ``.grad`` and keeps the other replicas' sums (one packed tensor per replica and
bucket where the members are small; NOTE [no_sync sums]), reduced at the first backward outside it; buckets that
backward never reaches (none of their members used) are reduced by a callback at its end.

A buffer's flat buffer is reused only when none of the views it handed out is alive any more (a second forward
before backward gets fresh buffers), so a graph still waiting for backward never sees its tensors overwritten.

NOTE [kept replica tensors]
Making R x N replica tensors every step (autograd outputs, views, replica 0's aliases) costs more per parameter
tensor, in torch's C++ alone and whatever the binding does, than a step's whole per-tensor target
(docs/benchmarks.md). So each grad bucket's node is made once and kept with its outputs: replica 0's tensors are
detached aliases of the master tensors (sharing their storage and version counter, as upstream's aliases do), the
other replicas' tensors detached views of flat buffers of their own; none is an autograd view, so writing the flat
buffers in place never rewrites their grad_fn. Every step copies the master's flat buffer into the kept ones (one
copy or broadcast per bucket and device; a bucket whose master cannot be flat is copied member by member, in one
core call) and nothing else, whether autograd is on or not (without it the skeletons hold plain aliases of the same
buffers); the node is remade when the master moves under it (flattened again, a member's ``.data`` replaced). The
node has no saved tensors, so every backward may run it again, and the gradients reaching it from all graphs alive
are reduced by ``reduce_bucket`` as before. What users see is upstream's: replica tensors are non-leaves with a
grad_fn, the master parameters are in the graph (``torch.autograd.grad``, hooks on them, double backward). Two
things keep it honest:
- a graph still waiting for backward may have saved kept tensors. The master is copied every step (``p.data``
  edits are invisible to version counters), and when the master's version counters moved since the last copy
  the kept buffers' counters are bumped too, so such a graph fails loudly in backward, as the bare model does
  (replica 0's aliases share the master's counters already); an unchanged master is copied to equal values;
- hooks registered on a replica tensor during forward belong to that step on a fresh replica: the kept tensors'
  hook dicts are emptied before each forward.
"""

import operator
import weakref
from array import array
from functools import partial
from itertools import chain, repeat

import torch
from torch.autograd import Function
from torch.nn.parameter import is_lazy

from . import _C, _devices, _hooks, _route, _streams, comm
from ._core import reduce_columns, streams_for, to_core_dtype
from ._functions import ReduceAddCoalesced
from .replicate import check_initialized, is_compiled, skeletons
from .sync_batchnorm import layer_indices

__all__ = ["ReplicaSet", "persistable", "reduce_bucket"]

# Keys of a replica's __dict__ that belong to the replica (Module._replicate_for_data_parallel and RNNBase's
# override give the replica its own copies of these); everything else mirrors the master every step.
_OWNED = ("_parameters", "_buffers", "_modules", "_is_replica", "_former_parameters", "_flat_weights",
          "_flat_weights_names")
_MIRRORED = _hooks.KEYS  # the replica's own hook dicts, refilled from the master's every step (fastdp._hooks)
_KEPT = _OWNED + _MIRRORED  # refresh mirrors the last len(_MIRRORED) kept keys
_POOL = 3  # flat buffers kept per bucket and device; beyond that (views held elsewhere) buffers are not kept


def persistable(network):
    """Whether every module replicates the standard way, so that a persistent skeleton equals a fresh one.

    Modules with their own ``_replicate_for_data_parallel`` (other than torch's RNNs) and ScriptModules take the
    rebuild-every-step path.
    """
    standard = (torch.nn.Module._replicate_for_data_parallel, torch.nn.RNNBase._replicate_for_data_parallel)
    for m in network.modules():
        if isinstance(m, torch.jit.ScriptModule) or type(m)._replicate_for_data_parallel not in standard:
            return False
    return True


def inference_made(network):
    """Whether a parameter or buffer was made under ``torch.inference_mode`` (a model materialised for serving).

    Such tensors have no version counter, which kept replicas track, so they are replicated afresh every forward as
    upstream does. Training them is refused here, naming the tensor: the bare model fails in backward ("Inference
    tensors cannot be saved for backward") or, with a single layer, silently leaves ``.grad`` None.
    """
    found = False
    for name, p in network.named_parameters():
        if is_lazy(p):  # uninitialised: replication raises torch's own error for it
            continue
        if p.is_inference():
            if p.requires_grad and torch.is_grad_enabled():
                raise RuntimeError(
                    f"parameter {name!r} was created under torch.inference_mode(), and inference tensors cannot be "
                    "trained: run the forward under torch.inference_mode() or torch.no_grad(), or, to train, clone "
                    "the parameters outside inference mode (for each: setattr(module, name, "
                    "nn.Parameter(p.clone())))"
                )
            found = True
    return found or any(not is_lazy(b) and b.is_inference() for b in network.buffers())


def check_replicatable(network):
    """The checks fresh replication makes (uninitialised lazy parameters raise torch's ValueError)."""
    check_initialized(network.parameters())
    check_initialized(network.buffers())


# (every distinct module under root, root first; the structure signature: everything whose change makes kept
# skeletons or bucket layouts stale: per module its id, type and tensor counts, per parameter and buffer slot its
# tensor's id, dtype, shape, device, requires_grad and layout, per child slot the child's id). Built in C
# (csrc/python/structure.c), where _C.matches compares a kept one with the modules in place every step.
walk = _C.walk


def _unflatten(flat, like, sizes, shapes):
    """Views of `flat` shaped like the tensors `like` (torch's C++ loop where it has one)."""
    if _unflatten_dense is not None:
        return _unflatten_dense(flat, like)
    return [piece.view(shape) for piece, shape in zip(flat.split(sizes), shapes)]


def _pieces(flat, shapes, sizes):
    """Tensors over consecutive pieces of `flat`, shaped `shapes`, each on a storage of its own covering exactly
    its bytes: a slice of flat's storage, which keeps flat's memory alive. The master's members are made so: one
    copy replicates a whole bucket, yet pickle, torch.save and safetensors write each member's own bytes, as for
    the bare model, never the whole flat buffer (a view's storage is the whole buffer)."""
    storage, item = flat.untyped_storage(), flat.element_size()
    pieces, at = [], 0
    for shape, n in zip(shapes, sizes):
        piece = storage[at * item : (at + n) * item]
        pieces.append(torch.empty(0, dtype=flat.dtype, device=flat.device).set_(piece, 0, shape))
        at += n
    return pieces


def _result_views(flat, bucket):
    """Per member of `bucket`, a tensor over `flat` shaped like it, for results nobody differentiates through
    (reduced gradients): the C shim makes plain tensors sharing flat's memory (about a third of the cost of torch's
    unflatten into autograd views, docs/benchmarks.md), torch makes views where the shim cannot, detached by
    ``.data`` into plain tensors too. Either way each has a version counter of its own, as a gradient autograd made
    would: zeroing one member's ``.grad`` in place must not look like a change to the others' (NOTE [no_sync sums])."""
    views = _C.views(flat, bucket.spec)
    if views is not None:
        return views
    return [v.data for v in _unflatten(flat, bucket.like, bucket.sizes, bucket.shapes)]


_unflatten_dense = getattr(getattr(torch._C, "_nn", None), "unflatten_dense_tensors", None)
_flatten_dense = getattr(getattr(torch._C, "_nn", None), "flatten_dense_tensors", None)
_is_sparse = operator.attrgetter("is_sparse")


# The number of tensors using a storage: a flat buffer is free when only it (and the temporary wrapper the query
# makes) uses its memory, whoever else held a view, a view of a view or a saved copy of one. Without this
# private query, views carry their own version counter (.data, their own root) and weak references decide.
_use_count = getattr(torch._C, "_storage_Use_Count", None)


_data_ptr = torch.Tensor.data_ptr
_PACK_MEAN = 4096  # values per member, on average, up to which a bucket's gradients are packed before the sum
_REFLATTEN = 3  # a bucket whose members' .data are replaced more often than this stays on the per-member path


def _flattenable(t):
    """Whether a master tensor can become a view of a flat buffer without changing what users see of it."""
    return (t.layout == torch.strided and t.is_contiguous() and not t.is_conj() and not t.is_neg()
            and t.untyped_storage().nbytes() == t.numel() * t.element_size() and t.device.type != "meta")


def _free(entry):
    if _use_count is not None:
        return _use_count(entry[0].untyped_storage()._cdata) <= 2
    return all(r() is None for r in entry[1])


class _FlatPool:
    """Flat buffers of one bucket on one device, reused once no view handed out from them is alive."""

    __slots__ = ("numel", "dtype", "device", "flats")

    def __init__(self, numel, dtype, device):
        self.numel, self.dtype, self.device = numel, dtype, device
        self.flats = []  # [flat, [weakrefs of its views]]

    def take(self, like, sizes, shapes, own_versions=True):
        """A free flat buffer and fresh views of it shaped like the bucket's members (`like`); `own_versions`:
        each view with a version counter of its own."""
        entry = next((e for e in self.flats if _free(e)), None)
        if entry is None:
            # Never an inference tensor: buffers made under inference_mode are reused by training forwards.
            with torch.inference_mode(False):
                entry = [torch.empty(self.numel, dtype=self.dtype, device=self.device), []]
            if len(self.flats) < _POOL:
                self.flats.append(entry)
        views = _unflatten(entry[0], like, sizes, shapes)
        if own_versions or _use_count is None:
            # .data: each buffer copy gets a version counter of its own, as upstream's broadcast copies do, so an
            # in-place update of one (BatchNorm statistics) never invalidates another saved for backward.
            views = [v.data for v in views]
        if _use_count is None:  # liveness by weak references only where the storage use count is missing
            entry[1] = [weakref.ref(v) for v in views]
        return entry[0], views


class _State:
    """What the wrapper and the bucket nodes share: devices, the reduction mode, no_sync bookkeeping."""

    __slots__ = ("devices", "tdevs", "host", "collective", "sync", "grad_buckets", "kept", "marking", "network",
                 "__weakref__")

    def __init__(self, devices):
        self.devices = list(devices)
        self.tdevs = [_devices.torch_device(d) for d in devices]
        self.host = all(d.type == "cpu" for d in self.tdevs)  # emulated replicas: sums need no packing
        self.collective = comm.broadcast_is_collective(self.tdevs)
        self.sync = True
        # Weak references to every bucket with an autograd node (set by ReplicaSet): buckets hold the state, so
        # strong ones would make a cycle, and a replaced ReplicaSet's flat buffers would wait for the collector.
        self.grad_buckets = []
        self.kept = False  # whether no_sync kept sums that the next synchronising backward must reduce
        self.marking = None  # the backward whose end notes the master's .grad (its graph task id; _mark_grads)
        self.network = None  # a weak reference to the master module (names parameters in errors)


class _Bucket:
    """Tensors of one dtype broadcast and reduced together; `members` index the ReplicaSet's tensor list."""

    __slots__ = ("state", "members", "shapes", "sizes", "numel", "dtype", "pools", "src_pool", "pending", "like",
                 "spec", "master", "flat", "ptrs", "reflattened", "pack", "pending_flat", "marks", "__weakref__")

    def __init__(self, state, members, tensors):
        self.state = state
        self.members = members
        # Shape-only stand-ins for unflattening (meta tensors hold no memory and no reference to the master).
        self.like = [torch.empty(tensors[i].shape, device="meta") for i in members]
        self.shapes = [tensors[i].shape for i in members]
        self.sizes = [tensors[i].numel() for i in members]
        self.spec = array("q", [v for shape in self.shapes for v in (len(shape), *shape)])  # see _C.views
        self.numel = sum(self.sizes)
        self.dtype = tensors[members[0]].dtype
        self.pools = [_FlatPool(self.numel, self.dtype, d) for d in state.tdevs[1:]]
        self.src_pool = None  # staging for NCCL's packed source, only while the master is not flat
        # no_sync: per replica, per member, the gradient sums kept so far (replica 0's row None: its gradients go
        # to the master's .grad at once); see NOTE [no_sync sums]
        self.pending = None
        self.pending_flat = False  # whether pending holds one packed sum per replica instead (pending[r][0])
        self.marks = None  # per member, the master's .grad as the last no_sync backward left it (see _mark_grads)
        self.master = [tensors[i] for i in members]  # the master tensors, in member order
        self.flat = None  # the master's flat buffer on device_ids[0] when the members live in it
        self.ptrs = None  # the members' data pointers when flattened: any difference means .data was replaced
        self.reflattened = 0
        # Gradients packed before the sum only where members are small on average: packing costs a copy of every
        # byte, which the per-member path's Python overhead outweighs only for small members (_PACK_MEAN: from
        # about 8K values per member on, the per-member path is already the faster).
        self.pack = _flatten_dense is not None and self.numel <= _PACK_MEAN * len(members)

    def flatten(self):
        """Moves the master tensors into one flat buffer (their ``.data`` become pieces of it, see _pieces), so that
        replicate copies one buffer per device; False (and the members left as they are) where they cannot be
        flat."""
        master = self.master
        # Every member must own its memory alone (members sharing memory, tied through .data or cuDNN's flat RNN
        # weights, stay as they are); members of this bucket's previous flat buffer do (see _pieces).
        storages = {t.untyped_storage().data_ptr() for t in master}
        if self.reflattened > _REFLATTEN or len(storages) != len(master) or not all(map(_flattenable, master)):
            self.flat = self.ptrs = None
            self.reflattened = _REFLATTEN + 1  # checked once: the per-member path from now on
            return False
        # Outside inference mode: a first forward under it must not turn the master's storage into inference
        # tensors, which training could not save for backward afterwards.
        with torch.inference_mode(False), torch.no_grad():
            flat = torch.empty(self.numel, dtype=self.dtype, device=master[0].device)
            pieces = _pieces(flat, self.shapes, self.sizes)
            torch._foreach_copy_(pieces, [t.detach() for t in master])
            for t, piece in zip(master, pieces):
                t.data = piece
        self.flat = flat
        self.ptrs = list(map(_data_ptr, master))
        self.reflattened += 1
        return True

    def keeps_pending(self):
        """Whether no_sync still keeps sums for this bucket, once those of members whose master ``.grad`` the user
        cleared since the last no_sync backward are dropped (NOTE [no_sync sums])."""
        if self.pending is None or self.marks is None:
            return self.pending is not None
        # A no_sync backward that failed before its end (an error in a hook, Ctrl-C) never took the marks: what it
        # accumulated counts as kept, and only a .grad now gone or zero counts as cleared.
        state = self.state
        stale = state.marking is not None and state.marking != _graph_task_id()
        cleared = [j for j, (p, mark) in enumerate(zip(self.master, self.marks)) if _cleared(state, p, mark, stale)]
        if len(cleared) == len(self.members):
            self.pending = None
        elif cleared:  # (the marks are taken again at the end of the next no_sync backward)
            for row in _pending_rows(self)[1:]:
                for j in cleared:
                    row[j] = None
        return self.pending is not None

    def master_flat(self):
        """The master's flat buffer, flattened again when a member's ``.data`` was replaced (``.to()``,
        ``.double()``, ``p.data = ...``) since; None where the members are not flat."""
        if self.flat is not None and list(map(_data_ptr, self.master)) == self.ptrs:
            return self.flat
        if self.reflattened > _REFLATTEN:
            return None  # found unflattenable before (or flattened too often): the per-member path
        return self.flat if self.flatten() else None

    def fill(self, flat):
        """Copies the master tensors into fresh views on every other device (see send); returns the views."""
        flats, views = [], []
        for pool in self.pools:
            f, vs = pool.take(self.like, self.sizes, self.shapes)
            flats.append(f)
            views.append(vs)
        self.send(flat, flats, views)
        return views

    def send(self, flat, flats, views):
        """Copies the master tensors into `flats`, one flat buffer per other device (`views`: per device, the
        members' views of it). `flat` is the master's flat buffer (one copy or one NCCL broadcast per device), or
        None: then the members are copied one by one (NCCL: packed first)."""
        state = self.state
        if flat is not None:
            if state.collective:
                _route.broadcast(flat, flats, streams_for([flat, *flats]))
            else:
                _route.copy(flats, [flat] * len(flats), streams_for([flat, *flats]))
            return
        sources = [t.detach() for t in self.master]
        if state.collective:  # NCCL broadcasts one packed buffer from device_ids[0]
            if self.src_pool is None:
                self.src_pool = _FlatPool(self.numel, self.dtype, state.tdevs[0])
            src_flat, src_views = self.src_pool.take(self.like, self.sizes, self.shapes, False)
            _route.copy(src_views, sources, streams_for([src_flat]))
            _route.broadcast(src_flat, flats, streams_for([src_flat, *flats]))
        else:  # host entries or repeated CUDA ids: every member straight into every replica's buffer, one call
            _route.copy([v for vs in views for v in vs], sources * len(views), streams_for([*sources, *flats]))


class _KeptBroadcast(Function):
    """One bucket's node made once and kept (NOTE [kept replica tensors]): outputs are replica 0's detached aliases
    of the master tensors followed by the other replicas' detached views of `flats`; its backward reduces that
    bucket's gradients, in every backward that reaches it."""

    @staticmethod
    def forward(ctx, bucket, flats, streams, *sources):
        ctx.bucket = bucket
        ctx.streams = streams
        ctx.set_materialize_grads(False)
        outs = [t.detach() for t in sources]
        for flat in flats:
            outs += [v.detach() for v in _unflatten(flat, bucket.like, bucket.sizes, bucket.shapes)]
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        # Autograd hands the replicas' gradients over on the streams current when the node was made (one per
        # device); the reduction runs there, whichever thread autograd runs it on.
        with _streams.entered(ctx.streams):
            return (None, None, None) + reduce_bucket(ctx.bucket, grads)


class _Kept:
    """The grad buckets' kept nodes: per bucket the master flat buffer they were made from (None for a bucket copied
    member by member, whose members' data pointers are noted instead) and the other devices' flat buffers; `got` is
    what the kept path hands the picker (the master tensors, then every node's outputs)."""

    __slots__ = ("buckets", "sources", "ptrs", "flats", "views", "outs", "got", "plain", "masters", "stamp",
                 "streams", "devices")

    def __init__(self, buckets, sources, tensors, devices):
        self.buckets, self.sources = buckets, sources
        # The current stream of each CUDA device when the nodes are made: autograd orders their backward on these
        # for good, so a forward on other streams needs new nodes (see valid).
        self.devices = devices
        self.streams = _streams.current(devices)
        # Replica 0's aliases of a member that is not flat stay right while its data pointer does.
        self.ptrs = [None if s is not None else list(map(_data_ptr, b.master)) for b, s in zip(buckets, sources)]
        # Made in whatever mode the first forward runs, used in every mode: never inference tensors, always nodes.
        with torch.inference_mode(False), torch.enable_grad():
            self.flats = [[torch.empty(b.numel, dtype=b.dtype, device=d) for d in b.state.tdevs[1:]]
                          for b in buckets]
            self.outs = []
            for bucket, flats in zip(buckets, self.flats):
                self.outs += _KeptBroadcast.apply(bucket, flats, self.streams, *bucket.master)
            # Without autograd: the other replicas' tensors as plain aliases of the same buffers (in the order
            # ReplicaSet._picker gives buckets without a node), so no second set of buffers is ever made.
            self.plain, self.views = list(tensors), []
            for bucket, flats in zip(buckets, self.flats):
                views = [_unflatten(flat.detach(), bucket.like, bucket.sizes, bucket.shapes) for flat in flats]
                self.views.append(views)
                for vs in views:
                    self.plain += vs
        self.got = list(tensors) + self.outs
        self.masters = list(chain.from_iterable(b.master for b in buckets))
        self.stamp = None  # the master's version counters summed at the last copy

    def valid(self, sources):
        """Whether the kept nodes still alias the master (the same flat buffers, the same unflattened members) and
        were made on this forward's streams."""
        same_ptrs = all(ptrs is None or list(map(_data_ptr, b.master)) == ptrs
                        for b, ptrs in zip(self.buckets, self.ptrs))
        return (all(map(operator.is_, sources, self.sources)) and same_ptrs
                and (not self.streams or _streams.current(self.devices) == self.streams))

    def step(self):
        """Copies the master into the kept buffers; bumps their version counters where the master's moved."""
        for bucket, flat, flats, views in zip(self.buckets, self.sources, self.flats, self.views):
            bucket.send(flat, flats, views)
        stamp = _C.version_sum(self.masters)
        if stamp != self.stamp:
            if self.stamp is not None:
                for flat in chain.from_iterable(self.flats):
                    _increment_version(flat)
            self.stamp = stamp
        _C.clear_hooks(self.outs)  # hooks registered on a replica tensor by last step's forward


_increment_version = torch.autograd.graph.increment_version


def _dense(g):
    return g if g.is_contiguous() else g.contiguous()


def reduce_bucket(bucket, grads):
    """Sums the replicas' gradients of one bucket onto device_ids[0]; one gradient (or None) per member.

    `grads` is replica-major: the k gradients of replica 0, then replica 1's, ... (None where a replica did not
    use a member). Under no_sync replica 0's gradients are returned and the others' kept (NOTE [no_sync sums]).
    """
    state = bucket.state
    if not state.host:
        _streams.refuse_capture("fastdp.DataParallel's gradient reduction")
    if bucket.pending is not None:
        bucket.keeps_pending()  # drops the sums of members whose .grad the user cleared since
    if not state.sync:
        return _accumulate(bucket, grads)
    if state.kept:  # the first backward after no_sync: buckets it never reaches are flushed
        state.kept = False
        torch.autograd.Variable._execution_engine.queue_callback(partial(_flush, state))
    if state.host and bucket.pending is None and not torch.is_grad_enabled():
        out = torch.empty(bucket.numel, dtype=bucket.dtype)
        if _C.reduce_rows(grads, len(bucket.members), out):  # each member summed in place, nothing packed
            return tuple(_result_views(out, bucket))
    if _packable(bucket, grads):
        result = _reduce_packed(bucket, grads)
        if result is not None:
            return result
    rows = _member_rows(bucket, grads)
    if torch.is_grad_enabled():
        # create_graph=True: the differentiable reduction, whose backward broadcasts again (double backward).
        return ReduceAddCoalesced.apply(state.devices[0], state.devices, len(bucket.members),
                                        *(g for row in rows for g in row))
    return _reduce_members(bucket, rows)


# NOTE [no_sync sums]
# Under DDP's no_sync, whose contract fastdp keeps, each rank accumulates its own gradients in .grad, and what the
# user does to .grad (zero_grad in either set_to_none mode, p.grad = None, a new optimizer's zero_grad) is done to
# that accumulation. Here replica 0 plays the rank: its gradients are returned to autograd, which accumulates them
# in the master's .grad; the other replicas' are summed per replica and kept until the next synchronising backward
# (no reduction while no_sync lasts). A member replica 0 did not use takes another replica's gradient instead, so
# whatever a member accumulated shows in its .grad. At the end of each no_sync backward the master's .grad objects
# and version counters are noted (_mark_grads); before the kept sums are used, a member whose .grad is gone,
# replaced or zeroed since was cleared by the user, and its kept sums are dropped with it. A .grad changed in
# place to anything but zeros cannot be applied to sums kept apart, and raises instead of being silently ignored.


def _accumulate(bucket, grads):
    """no_sync: replica 0's gradients for autograd to accumulate in the master's .grad, the others' kept."""
    state = bucket.state
    k, nrep, dest = len(bucket.members), len(state.tdevs), state.tdevs[0]
    own = list(grads[:k])
    rows = [None] + [list(grads[r * k : (r + 1) * k]) for r in range(1, nrep)]
    for j, g in enumerate(own):
        if g is None:  # replica 0 did not use this member: another replica's gradient shows in .grad instead
            for row in rows[1:]:
                if row[j] is not None:
                    own[j], row[j] = row[j].to(dest), None
                    break
    if any(g is not None for row in rows[1:] for g in row):
        _keep(bucket, rows)
    task = _graph_task_id()  # once per backward; a backward that failed before its end never ran its callback
    if state.marking != task:
        state.marking = task
        torch.autograd.Variable._execution_engine.queue_callback(partial(_mark_grads, state))
    return tuple(own)


_graph_task_id = torch._C._current_graph_task_id  # the backward running in this thread (torch 2.1 and newer)


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
        bucket.pending = [None] + [list(_result_views(acc[0], bucket)) for acc in bucket.pending[1:]]
        bucket.pending_flat = False
    return bucket.pending


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
    state.marking = None
    for ref in state.grad_buckets:
        bucket = ref()
        if bucket is not None and bucket.pending is not None:
            bucket.marks = [_grad_mark(p.grad) for p in bucket.master]


def _flush(state):
    """Reduces the sums no_sync still keeps and adds them to the master's ``.grad``: at the end of the first
    synchronising backward after no_sync for buckets whose node it never ran (none of their members was used),
    or for every bucket when the set is replaced."""
    with torch.no_grad():
        for ref in state.grad_buckets:
            bucket = ref()
            if bucket is None or not bucket.keeps_pending():
                continue
            result = _reduce_members(bucket, _member_rows(bucket, (None,) * (len(bucket.members) * len(state.tdevs))))
            for p, g in zip(bucket.master, result):
                if g is not None:
                    if p.grad is None:
                        p.grad = g
                    else:
                        p.grad += g


def _packable(bucket, grads):
    """Whether the packed path may run: every replica produced every member's dense gradient (the common
    case), outside create_graph, and whatever no_sync kept is packed too."""
    return (bucket.pack and (bucket.pending is None or bucket.pending_flat) and not torch.is_grad_enabled()
            and not any(map(operator.is_, grads, repeat(None))) and not any(map(_is_sparse, grads)))


def _reduce_packed(bucket, grads):
    """Each replica's gradients packed into one flat tensor by torch's C++ and the packed tensors summed in one
    core call, with the packed sums no_sync kept. None where packing changed a dtype (the caller then takes the
    per-member path)."""
    state = bucket.state
    k, nrep = len(bucket.members), len(state.tdevs)
    flats = [_flatten_dense(grads[r * k : (r + 1) * k]) for r in range(nrep)]
    if not all(f.dtype == bucket.dtype for f in flats):
        return None
    if bucket.pending is not None:
        flats = [f if acc is None else acc[0] + f for acc, f in zip(bucket.pending, flats)]
        bucket.pending = None
    out = torch.empty(bucket.numel, dtype=bucket.dtype, device=state.tdevs[0])
    if bucket.dtype.is_complex:
        reduce_columns([[to_core_dtype(f) for f in flats]], [to_core_dtype(out)])
    else:
        reduce_columns([flats], [out])
    return tuple(_result_views(out, bucket))


def _member_rows(bucket, grads):
    """Per replica, per member, the gradient to reduce: this backward's plus whatever no_sync kept (which is
    consumed)."""
    k, nrep = len(bucket.members), len(bucket.state.tdevs)
    rows = [list(grads[r * k : (r + 1) * k]) for r in range(nrep)]
    if bucket.pending is None:
        return rows
    for row, kept in zip(rows[1:], _pending_rows(bucket)[1:]):
        for j, acc in enumerate(kept):
            if acc is not None:
                row[j] = acc if row[j] is None else acc + row[j]
    bucket.pending = None
    return rows


def _reduce_members(bucket, rows):
    """Column by column in one core call into views of one flat result (sparse gradients through comm)."""
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
            views = _result_views(torch.empty(bucket.numel, dtype=bucket.dtype, device=dest), bucket)
        out = result[j] = views[j]
        columns.append([to_core_dtype(_dense(g)) if complex_ else _dense(g) for g in column])
        outs.append(to_core_dtype(out) if complex_ else out)
    if columns:
        reduce_columns(columns, outs)
    return tuple(result)


def _buckets(state, tensors, indices, bucket_bytes):
    """Dtype-homogeneous buckets of about bucket_bytes over `indices`, in reverse registration order."""
    order = list(reversed(indices))
    if not order:
        return []
    plan = _C.plan([tensors[i].detach() for i in order], [0] * len(order), bucket_bytes)
    return [_Bucket(state, [order[m[0]] for m in members], tensors) for _, members in plan]


def _slots(modules, replicas, tensors):
    """Where each replica keeps each tensor (its _parameters / _buffers dicts, RNN flat-weight lists): parallel
    lists of containers, keys and (replica, tensor index) references."""
    tindex = {id(t): i for i, t in enumerate(tensors)}
    containers, keys, refs = [], [], []
    for r, row in enumerate(replicas):
        for m, replica in zip(modules, row):
            names = replica.__dict__.get("_flat_weights_names")
            for key, p in m._parameters.items():
                if p is None:
                    replica._parameters[key] = None
                    continue
                t = tindex[id(p)]
                containers += [replica._parameters, replica._former_parameters]
                keys += [key, key]
                refs += [(r, t), (r, t)]
                if names is not None and key in names:
                    containers.append(replica._flat_weights)
                    keys.append(names.index(key))
                    refs.append((r, t))
            for key, b in m._buffers.items():
                if b is not None:
                    containers.append(replica._buffers)
                    keys.append(key)
                    refs.append((r, tindex[id(b)]))
    return containers, keys, refs


def _layout(state, params, buffers, bucket_bytes):
    """(grad buckets, detached buckets) over params + buffers: the parameters and buffers that require grad,
    then the rest."""
    tensors = params + buffers
    n = len(params)
    diff = [i for i in range(n) if params[i].requires_grad]
    diff += [n + i for i, b in enumerate(buffers) if b.requires_grad]
    taken = set(diff)
    rest = [i for i in range(len(tensors)) if i not in taken]
    return _buckets(state, tensors, diff, bucket_bytes), _buckets(state, tensors, rest, bucket_bytes)


class _Skeletons:
    """One set of replica skeletons (per replica, one module per master module, in walk order) and what is
    installed in them: their ``__dict__`` refresh records, their tensor slots (those of grad-bucket members, and
    the rest) and the kept nodes whose tensors the grad slots hold."""

    __slots__ = ("replicas", "pairs", "seen", "kept_containers", "rest_containers", "kept")

    def __init__(self, modules, replicas, containers, kept_index, rest_index):
        self.replicas = replicas
        # A compiled wrapper's replica keeps its own attributes (its forward calls its own module: see NOTE
        # [compiled modules] in replicate.py); every other replica mirrors its master each step.
        self.pairs = [(m.__dict__, row[i].__dict__) for row in replicas for i, m in enumerate(modules)
                      if not is_compiled(m)]
        # What refresh saw of each pair's dicts, to skip the unchanged ones (see _C.refresh, NOTE [refresh records]).
        self.seen = _C.refresh_records(len(self.pairs), len(_MIRRORED))
        self.kept_containers = [containers[j] for j in kept_index]
        self.rest_containers = [containers[j] for j in rest_index]
        self.kept = None  # the _Kept whose tensors the grad slots hold


class ReplicaSet:
    """Kept replicas of one master module on one device list.

    NOTE [one skeleton set per kind of forward]
    A graph still waiting for backward may run its replica modules again inside that backward: a checkpointed
    block (``torch.utils.checkpoint``, either mode) recomputes its forward there, reading the replica's training
    flag, attributes and parameter slots as they are then. With one set of skeletons, a forward of another kind in
    between (under ``no_grad`` or ``inference_mode``, where the slots hold plain tensors; after ``eval()``) would
    have rewritten them, and that backward's gradients would be silently wrong or its recomputation refused. So
    the skeletons come in sets, one per kind of forward (grad mode, the root's training flag), made when that kind
    first runs: a forward refreshes and rebinds only its own kind's set, and a pending graph of another kind finds
    its replicas as its forward left them. The tensors behind them (the kept buffers, the master) are shared;
    their version counters guard them as the bare model's guard its parameters.
    """

    def __init__(self, network, devices, bucket_bytes, positions=None):
        self.network = network
        self.state = _State(devices)
        self.positions = positions  # the device_ids positions of `devices` (None: devices a caller named)
        self.bucket_bytes = bucket_bytes
        self.modules, self.signature = walk(network)
        self.nrep = len(devices)
        # Every distinct parameter, then every distinct buffer: the tensors refreshed each step.
        self.params = list(network.parameters())
        self.buffers = list(network.buffers())
        self.tensors = self.params + self.buffers
        self.synced = layer_indices(self.modules)  # SyncBatchNorm layers (fastdp.sync_batchnorm)
        # One bucket layout for both grad modes: the master tensors of each bucket live in one flat buffer.
        layout = _layout(self.state, self.params, self.buffers, bucket_bytes)
        for bucket in chain(*layout):
            bucket.flatten()
        self.layout = layout  # (grad buckets, the other buckets)
        self.state.grad_buckets = [weakref.ref(b) for b in layout[0]]
        self.state.network = weakref.ref(network)
        # The grad buckets' slots hold kept tensors (NOTE [kept replica tensors]), installed when they change; the
        # others' are installed every step: the slots split by whether their tensor is in a grad bucket. Every
        # skeleton set has the same slots in the same order, so the split and the picks are made once.
        replicas = skeletons(self.modules, self.nrep)
        containers, keys, refs = _slots(self.modules, replicas, self.tensors)
        graded = set(chain.from_iterable(b.members for b in layout[0]))
        self.split = ([], [])  # (slots of the other tensors, slots of grad-bucket members)
        for j, (_, t) in enumerate(refs):
            self.split[t in graded].append(j)
        kept_refs = [refs[j] for j in self.split[True]]
        rest_refs = [refs[j] for j in self.split[False]]
        self.kept_keys = [keys[j] for j in self.split[True]]
        self.rest_keys = [keys[j] for j in self.split[False]]
        self.rest_nones = [None] * len(rest_refs)
        # What the grad slots hold: the kept nodes' outputs with autograd, their plain aliases without.
        self.pick_outs = self._picker(layout[0], [], kept_refs)
        self.pick_plain = self._picker([], layout[0], kept_refs)
        self.pick_rest = self._picker([], layout[1], rest_refs)
        self.sets = {}  # (grad mode, training) -> _Skeletons: NOTE [one skeleton set per kind of forward]
        self.unused = (replicas, containers)  # the first set's skeletons, until a forward takes them
        self.replicas = replicas  # the rows of the set the last forward ran
        self.kept = None  # _Kept, made at the first forward

    def _skeletons(self, kind):
        """The skeleton set for one kind of forward, made on its first use."""
        skel = self.sets.get(kind)
        if skel is None:
            if self.unused is not None:
                (replicas, containers), self.unused = self.unused, None
            else:
                replicas = skeletons(self.modules, self.nrep)
                containers = _slots(self.modules, replicas, self.tensors)[0]
            skel = self.sets[kind] = _Skeletons(self.modules, replicas, containers, self.split[True],
                                                self.split[False])
        return skel

    def _picker(self, grad_buckets, rest_buckets, refs):
        """What step installs into the slots `refs`, as one C-level pick from the tensors it gathers in order: the
        master tensors (replica 0's default), then each grad bucket's node outputs (every replica, replica 0's
        aliases included), then each other bucket's views (replicas 1 and up)."""
        nrep = self.nrep
        where = {(0, t): t for t in range(len(self.tensors))}
        at = len(self.tensors)
        for bucket in grad_buckets:
            for r in range(nrep):
                for i in bucket.members:
                    where[(r, i)] = at
                    at += 1
        for bucket in rest_buckets:
            for r in range(1, nrep):
                for i in bucket.members:
                    where[(r, i)] = at
                    at += 1
        indices = [where[ref] for ref in refs]
        if len(indices) > 1:
            return operator.itemgetter(*indices)
        return lambda got: [got[i] for i in indices]  # itemgetter of one index returns the item, not a tuple

    def matches(self, network, devices):
        return (network is self.network and list(devices) == self.state.devices
                and _C.matches(self.modules, self.signature))

    def reduce_pending(self):
        """Reduces the gradient sums no_sync() still keeps into the master's ``.grad`` (before the set is replaced:
        a changed structure or device list then loses nothing, as accumulating on the bare model would not)."""
        _flush(self.state)

    def step(self):
        """Refreshes the kept replicas for one forward and returns their root modules."""
        grad_enabled = torch.is_grad_enabled()
        skel = self._skeletons((grad_enabled, self.network.training))
        _C.refresh(skel.pairs, _KEPT, len(_MIRRORED), skel.seen)
        grad_buckets, rest_buckets = self.layout
        if grad_buckets:
            kept = self._step_kept(grad_buckets)
            if skel.kept is not kept:
                _C.rebind(skel.kept_containers, self.kept_keys,
                          self.pick_outs(kept.got) if grad_enabled else self.pick_plain(kept.plain))
                skel.kept = kept
        if skel.rest_containers:
            # Last step's views released first: their flat buffers can be reused.
            _C.rebind(skel.rest_containers, self.rest_keys, self.rest_nones)
            got = list(self.tensors)
            with torch.no_grad():
                for bucket in rest_buckets:
                    for vs in bucket.fill(bucket.master_flat()):
                        got.extend(vs)
            _C.rebind(skel.rest_containers, self.rest_keys, self.pick_rest(got))
        self.replicas = skel.replicas
        return [row[0] for row in skel.replicas]

    def _step_kept(self, grad_buckets):
        """The grad buckets' kept nodes, made again when the master moved under them (flattened again, a member's
        ``.data`` replaced), with the master's values copied in. (The skeleton sets of forwards with autograd hold
        their outputs; the others, as upstream's detached replicate, the master tensors on replica 0 and plain
        aliases of the kept buffers on the others.)"""
        sources = [b.master_flat() for b in grad_buckets]
        kept = self.kept
        if kept is None or not kept.valid(sources):
            kept = self.kept = _Kept(grad_buckets, sources, self.tensors, self.state.devices)
        kept.step()
        return kept
