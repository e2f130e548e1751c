"""Persistent replicas for ``fastdp.DataParallel``: replica module skeletons built once per (module structure, device
list) and kept; every step only tensors move.

Each step:

1. the structure signature (modules, parameter/buffer/child identities, dtypes, shapes, devices, requires_grad)
   is compared with the one the skeletons were built from; any difference rebuilds them;
2. each replica's ``__dict__`` is refreshed from its master module in C (what ``_replicate_for_data_parallel``
   would copy: attributes, hook dicts, the training flag), keeping the replica's own parameter/buffer/child dicts;
3. the master's values are copied into the other replicas' tensors, bucket by bucket (one core call for every
   member of every bucket on the host or repeated CUDA ids; a packed buffer broadcast by NCCL across distinct
   devices). Parameters that require grad (and buffers that do) are the outputs of each bucket's kept autograd
   nodes (NOTE [kept replica tensors]); frozen parameters are copied into flat buffers reused across steps, and
   buffers into tensors of their own (a forward may resize a buffer in place, as lazily sized buffers and
   quantization observers do: each replica's must grow alone, as the bare model's does);
4. the tensors are installed into the skeletons in C (``_C.rebind``; kept ones only when they change).

NOTE [the master's tensors stay the user's]
The master's parameters and buffers are never moved: they keep the storage the user gave them (resizable, shared
memory, pinned memory, memory format, storage shared between tensors or modules, ``.data`` rebinds), and
replication copies from them member by member. Replica 0 runs on the master's own storage, as upstream's does:
its buffers are the master's buffers, its parameters detached aliases of them (so a forward that rebinds a
parameter's ``.data`` rebinds replica 0's alias, not the master, as upstream; under ``no_grad`` frozen parameters
are the master's, as upstream's detached replicate gives them). What the other replicas get is theirs alone. The
per-step cost of copying member by member instead of one flat buffer per bucket is in docs/benchmarks.md.

The gradient reduction (each bucket's sum, started while backward still runs) is fastdp._reduction.reducer's (NOTE
[reduction while backward runs]).

A buffer's flat buffer is reused only when none of the views it handed out is alive any more (a second forward
before backward gets fresh buffers), so a graph still waiting for backward never sees its tensors overwritten.

NOTE [kept replica tensors]
Making R x N replica tensors every step (autograd outputs, views, replica 0's aliases) costs more per parameter
tensor, in torch's C++ alone and whatever the binding does, than a step's whole per-tensor target
(docs/benchmarks.md). So each grad bucket's nodes are made once and kept with their outputs: replica 0's tensors are
detached aliases of the master tensors (sharing their storage and version counter, as upstream's aliases do), the
other replicas' tensors detached views of flat buffers of their own; none is an autograd view, so writing the flat
buffers in place never rewrites their grad_fn. Every step copies the master into the kept buffers and nothing else,
whether autograd is on or not (without it the skeletons hold plain aliases of the same buffers); the nodes are
remade when the master moves under them (a member's ``.data`` replaced, its storage moved to shared memory). The
nodes have no saved tensors, so every backward may run them again. What users see is upstream's: replica tensors
are non-leaves with a grad_fn, the master parameters are in the graph (``torch.autograd.grad``, hooks on them,
double backward). Two things keep it honest:
- a graph still waiting for backward may have saved kept tensors. The master is copied every step (``p.data``
  edits are invisible to version counters), and when the master's version counters moved since the last copy
  the kept buffers' counters are bumped too, so such a graph fails loudly in backward, as the bare model does
  (replica 0's aliases share the master's counters already); an unchanged master is copied to equal values;
- hooks registered on a replica tensor during forward belong to that step on a fresh replica: the kept tensors'
  hook dicts are emptied before each forward.

NOTE [a forward's own edits]
Upstream's replicas are made afresh every forward, so what a forward does to the replica it runs on ends with the
step. A kept replica must end it too. A forward can change its replica's own dicts (assign a tensor, a Parameter, a
buffer or a module to an attribute, register one, swap a submodule, delete an attribute: each replica module owns
its parameter, buffer and child dicts) or a kept tensor in place (rebind its ``.data``, ``set_``, ``resize_``,
``t_``, ``requires_grad_``; a running statistic kept as a frozen parameter is the common case). Plain attributes and
hook dicts are refilled from the master every step anyway (_C.refresh; a replica's hook dict is read again once a
hook was registered anywhere, so one that a forward or a hook edits in place without registering stays so on its
replica until then: NOTE [refresh records]). Before each forward:
- the owned dicts: each replica module's dicts are compared with what the last step left in them (dict version
  tags, CPython's up to 3.11 and a dict watcher's from 3.12: a few loads per module, none while the watcher saw no
  change; where there are no tags, their keys with the master's, and every grad slot is installed again each
  step), and a changed one gets the master's keys back, in its order, and the children as built; the step then
  installs every tensor into them;
- the kept tensors: a _C.TensorWatch notes each one's memory, shape, strides and dtype (holding a handle of its
  own, so reading them again costs no conversion); kept nodes whose tensors a forward changed are made again (a
  graph still waiting for backward keeps the ones it saw, as it would keep upstream's), a changed frozen alias of
  replica 0 is made again alone, and a pooled buffer whose memory moved (a view of it grown in place) is dropped,
  since its prepared copy would write where that memory was.
Replica 0's buffers, and without autograd its parameters, are the master's own tensors, as upstream's are: what a
forward does to them is done to the master, on both.
A stand-in for a parameter during one forward (the report's backward mark: ``stand_in``) goes into the module's
``__dict__``, which attribute reads consult before the parameter dict: a plain attribute, refilled every step, so it
is not an edit of an owned dict and costs the next step nothing.
"""

import operator
import weakref
from array import array
from functools import partial
from itertools import chain

import torch
from torch.nn.parameter import is_lazy

from .. import _C, comm
from .._platform import devices as _devices, streams as _streams
from . import hooks as _hooks
from .kept import Kept
from .._reduction.flat import flatten as _flatten_dense, unflatten as _unflatten
from .._reduction.reducer import Reducer
from .._native import route as _route
from .._native.core import streams_on
from ..replicate import check_initialized, is_compiled, skeletons
from ..sync_batchnorm import layer_indices

__all__ = ["ReplicaSet", "persistable", "stand_in"]

# Keys of a replica's __dict__ that belong to the replica (Module._replicate_for_data_parallel and RNNBase's
# override give the replica its own copies of these); everything else mirrors the master every step.
_OWNED = ("_parameters", "_buffers", "_modules", "_is_replica", "_former_parameters", "_flat_weights",
          "_flat_weights_names")
_MIRRORED = _hooks.KEYS  # the replica's own hook dicts, refilled from the master's every step (fastdp._step.hooks)
_KEPT = _OWNED + _MIRRORED  # refresh mirrors the last len(_MIRRORED) kept keys
_POOL = 3  # buffers kept per bucket and device; beyond that (views held elsewhere) buffers are not kept


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


# The number of tensors using a storage: a pooled buffer is free when only the pool (its tensor and the storage
# object it keeps to ask) uses its memory, whoever else held a view, a view of a view or a saved copy of one. What
# that count is for an unused storage is measured once (torch versions count a temporary storage object
# differently; a kept one counts in all). Without this private query, views carry their own version counter
# (.data, their own root) and weak references decide.
_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _unused_count():
    t = torch.empty(1)
    storage = t.untyped_storage()
    return _use_count(storage._cdata)


_UNUSED = _unused_count() if _use_count is not None else None

_PACK_MEAN = 4096  # values per member, on average, up to which a bucket's gradients are packed before the sum


def stand_in(module, name, tensor):
    """Makes attribute reads of parameter `name` of `module` return `tensor` until the returned callable is called
    (NOTE [a forward's own edits]). A class that defines the name itself (a property) does not read the instance's
    ``__dict__``: its parameter dict takes the stand-in then, which the next step sees as an edit and undoes."""
    if not hasattr(type(module), name):
        module.__dict__[name] = tensor
        return partial(module.__dict__.pop, name, None)
    params = module._parameters
    param, params[name] = params[name], tensor
    return partial(params.__setitem__, name, param)


class _Entry:
    """One pooled set of a bucket's tensors on one device (one flat buffer, or one tensor per member) and the
    prepared copy of the master into them (valid while the master's tensors stay where they were: see
    _State.generation, and while their own memory stays where it was: `watch`)."""

    __slots__ = ("pooled", "storages", "members", "refs", "copy", "generation", "watch")

    def __init__(self, pooled, members):
        self.pooled = pooled  # the tensors the pool made
        self.storages = [t.untyped_storage() for t in pooled] if _use_count is not None else None
        self.members = members  # the members' tensors over them (views of the flat buffer, or the pooled ones)
        self.refs = []  # weak references of the views handed out, where the storage use count is missing
        self.copy = self.generation = None
        self.watch = _C.TensorWatch(pooled)  # a view handed out and grown in place moves their storage

    def free(self):
        if _use_count is not None:
            return all(_use_count(s._cdata) <= _UNUSED for s in self.storages)
        return all(r() is None for r in self.refs)

    def prepared(self, bucket):
        """The copy of the bucket's master tensors into this entry's, described once per placement of the master."""
        generation = bucket.state.generation
        if self.generation != generation:
            self.copy, self.generation = _C.PreparedCopy(self.members, bucket.master), generation
        return self.copy


class _Pool:
    """Tensors of one bucket on one device, reused once no view handed out from them is alive: one flat buffer
    whose views are the members, or (``separate``) one tensor per member, each on storage of its own."""

    __slots__ = ("numel", "dtype", "device", "separate", "entries")

    def __init__(self, numel, dtype, device, separate=False):
        self.numel, self.dtype, self.device, self.separate = numel, dtype, device, separate
        self.entries = []

    def take(self, bucket, own_versions=True):
        """A free entry and fresh views of its tensors, shaped like the bucket's members; `own_versions`: each
        view with a version counter of its own."""
        entry = self._free_entry()
        if entry is None:
            # Never an inference tensor: buffers made under inference_mode are reused by training forwards.
            with torch.inference_mode(False):
                if self.separate:
                    pooled = [torch.empty(shape, dtype=self.dtype, device=self.device) for shape in bucket.shapes]
                    members = pooled
                else:
                    pooled = [torch.empty(self.numel, dtype=self.dtype, device=self.device)]
                    members = _unflatten(pooled[0], bucket.like, bucket.sizes, bucket.shapes)
            entry = _Entry(pooled, members)
            if len(self.entries) < _POOL:
                self.entries.append(entry)
        views = entry.members
        if own_versions or _use_count is None:
            # .data: each buffer copy gets a version counter of its own, as upstream's broadcast copies do, so an
            # in-place update of one (BatchNorm statistics) never invalidates another saved for backward.
            views = [v.data for v in views]
        if _use_count is None:  # liveness by weak references only where the storage use count is missing
            entry.refs = [weakref.ref(v) for v in views]
        return entry, views

    def _free_entry(self):
        """A kept entry no view handed out still uses. One whose storage a forward moved (a view of it grown in place
        past its memory) is dropped: its prepared copy would write where that memory was (NOTE [a forward's own
        edits])."""
        for entry in list(self.entries):
            if not entry.free():
                continue
            if entry.watch.moved() is None:
                return entry
            self.entries.remove(entry)
        return None


class _State:
    """What the replica set's buckets share: the devices, and where the master's tensors are."""

    __slots__ = ("devices", "tdevs", "cuda", "host", "collective", "generation", "__weakref__")

    def __init__(self, devices):
        self.devices = list(devices)
        self.tdevs = [_devices.torch_device(d) for d in devices]
        self.host = all(d.type == "cpu" for d in self.tdevs)  # emulated replicas: sums need no packing
        self.cuda = _streams.cuda_indices(self.devices)
        self.collective = comm.broadcast_is_collective(self.tdevs)
        # Where the master's tensors are: counts each time one moved (ReplicaSet.matches); the prepared copies from
        # the master (fastdp._C.PreparedCopy) hold its descriptors and are made again when it changes.
        self.generation = 0

    def core_streams(self):
        """The current stream of each CUDA device, for the core (None on the host)."""
        return None if self.host else streams_on(self.cuda)


class _Bucket:
    """Tensors of one dtype copied to the replicas together and, for a gradient bucket, reduced together;
    `members` index the ReplicaSet's tensor list. The reduction of a gradient bucket (its sums in flight, what
    no_sync keeps) is the reducer's (fastdp._reduction.reducer.Bucket)."""

    __slots__ = ("state", "index", "members", "shapes", "sizes", "numel", "dtype", "itemsize", "pools", "src_pool",
                 "like", "spec", "master", "pack", "__weakref__")

    def __init__(self, state, index, members, tensors, separate=False):
        self.state = state
        self.index = index  # its position among the buckets of its kind (reports name buckets by it)
        self.members = members
        # Shape-only stand-ins for unflattening (meta tensors hold no memory and no reference to the master).
        self.like = [torch.empty(tensors[i].shape, device="meta") for i in members]
        self.shapes = [tensors[i].shape for i in members]
        self.sizes = [tensors[i].numel() for i in members]
        self.spec = array("q", [v for shape in self.shapes for v in (len(shape), *shape)])  # see _C.views
        self.numel = sum(self.sizes)
        self.dtype = tensors[members[0]].dtype
        self.itemsize = tensors[members[0]].element_size()
        self.pools = [_Pool(self.numel, self.dtype, d, separate) for d in state.tdevs[1:]]
        self.src_pool = None  # staging of NCCL's packed source (pooled: a broadcast may still read the last one)
        self.master = [tensors[i] for i in members]  # the master tensors, in member order
        # Gradients packed before the sum only where members are small on average: packing costs a copy of every
        # byte, which the per-member path's Python overhead outweighs only for small members (_PACK_MEAN: from
        # about 8K values per member on, the per-member path is already the faster).
        self.pack = _flatten_dense is not None and self.numel <= _PACK_MEAN * len(members)

    def fill(self):
        """Copies the master tensors into free pooled tensors on every other device; returns their fresh views."""
        entries, views = [], []
        for pool in self.pools:
            entry, vs = pool.take(self)
            entries.append(entry)
            views.append(vs)
        if self.state.collective and not self.pools[0].separate:
            self.broadcast([e.pooled[0] for e in entries])
        else:
            streams = self.state.core_streams()
            for entry in entries:
                entry.prepared(self).run(streams)
        return views

    def broadcast(self, flats):
        """Across distinct CUDA devices with NCCL: the members packed on device_ids[0] (one prepared copy into a
        staging buffer) and the packed buffer broadcast into each other device's flat buffer (`flats`)."""
        if self.src_pool is None:
            self.src_pool = _Pool(self.numel, self.dtype, self.state.tdevs[0])
        staging, _ = self.src_pool.take(self, False)
        streams = self.state.core_streams()
        staging.prepared(self).run(streams)
        _route.broadcast(staging.pooled[0], flats, streams)


def _buckets(state, tensors, indices, bucket_bytes, separate=False):
    """Dtype-homogeneous buckets of about bucket_bytes over `indices`, in reverse registration order."""
    order = list(reversed(indices))
    if not order:
        return []
    plan = _C.plan([tensors[i].detach() for i in order], [0] * len(order), bucket_bytes)
    return [_Bucket(state, b, [order[m[0]] for m in members], tensors, separate)
            for b, (_, members) in enumerate(plan)]


def _slots(modules, replicas, tensors):
    """Where each replica keeps each tensor (its _parameters / _buffers dicts, RNN flat-weight lists): parallel
    lists of containers, keys and (replica, tensor index) references. Every slot is made here, in the master's
    order, the tensors installed later by each step; so a replica's dicts list their keys as the master's do."""
    tindex = {id(t): i for i, t in enumerate(tensors)}
    containers, keys, refs = [], [], []
    for r, row in enumerate(replicas):
        for m, replica in zip(modules, row):
            names = replica.__dict__.get("_flat_weights_names")
            for key, p in m._parameters.items():
                replica._parameters[key] = None
                if p is None:
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
    """(grad buckets, frozen-parameter buckets, buffer buckets) over params + buffers: the parameters and buffers
    that require grad, the other parameters, the other buffers (each replica's buffers on storage of their own)."""
    tensors = params + buffers
    n = len(params)
    diff = [i for i in range(n) if params[i].requires_grad]
    diff += [n + i for i, b in enumerate(buffers) if b.requires_grad]
    frozen = [i for i in range(n) if not params[i].requires_grad]
    plain = [n + i for i, b in enumerate(buffers) if not b.requires_grad]
    return (_buckets(state, tensors, diff, bucket_bytes), _buckets(state, tensors, frozen, bucket_bytes),
            _buckets(state, tensors, plain, bucket_bytes, separate=True))



class _Skeletons:
    """One set of replica skeletons (per replica, one module per master module, in walk order) and what is
    installed in them: their ``__dict__`` refresh records, their tensor slots (those of grad-bucket members, and
    the rest), the kept nodes whose tensors the grad slots hold, and the dicts each replica owns as built."""

    __slots__ = ("replicas", "pairs", "seen", "handles_seen", "kept_containers", "rest_containers", "kept", "owned",
                 "owned_seen", "rest_owned")

    def __init__(self, modules, replicas, containers, kept_index, rest_index):
        self.replicas = replicas
        # A compiled wrapper's replica keeps its own attributes (its forward calls its own module: see NOTE
        # [compiled modules] in replicate.py); every other replica mirrors its master each step.
        self.pairs = [(m.__dict__, row[i].__dict__) for row in replicas for i, m in enumerate(modules)
                      if not is_compiled(m)]
        # What refresh saw of each pair's dicts, to skip the unchanged ones (see _C.refresh, NOTE [refresh records]).
        self.seen = _C.refresh_records(len(self.pairs), len(_MIRRORED))
        self.handles_seen = None  # the hook handles made when this set was last refreshed (_hooks.handles_made)
        self.kept_containers = [containers[j] for j in kept_index]
        self.rest_containers = [containers[j] for j in rest_index]
        self.kept = None  # the Kept whose tensors the grad slots hold
        # Per replica module: (master __dict__, its own __dict__, parameter, buffer and child dicts, the children
        # as built), and what the last step left in them (NOTE [a forward's own edits]).
        self.owned = [(m.__dict__, r.__dict__, r._parameters, r._buffers, r._modules, dict(r._modules))
                      for row in replicas for m, r in zip(modules, row) if not is_compiled(m)]
        self.owned_seen = _C.owned_records(len(self.owned))
        rest = {id(c) for c in self.rest_containers}
        self.rest_owned = [e for e, o in enumerate(self.owned) if id(o[2]) in rest or id(o[3]) in rest]

    def refresh_dicts(self):
        """Each replica module's __dict__ refreshed from its master's (_C.refresh); the replicas' own hook dicts are
        not read while no hook was registered anywhere since this set's last refresh (NOTE [refresh records])."""
        made = _hooks.handles_made()
        _C.refresh(self.pairs, _KEPT, len(_MIRRORED), self.seen, made is not None and made == self.handles_seen)
        self.handles_seen = made

    def undo_edits(self):
        """Puts back the dicts a forward changed in its replica modules: the master's keys in its order (this step
        installs the tensors into them: every grad slot too, as after a change nothing tells which of them a forward
        replaced) and the children as built."""
        edited = _C.owned_edits(self.owned, self.owned_seen)
        for e in edited:
            master, replica, params, buffers, children, built = self.owned[e]
            replica["_parameters"], replica["_buffers"], replica["_modules"] = params, buffers, children
            for mine, theirs in ((params, master["_parameters"]), (buffers, master["_buffers"]), (children, built)):
                mine.clear()
                mine.update(theirs if mine is children else dict.fromkeys(theirs))
        if edited or not _C.DICT_TAGS:  # without dict tags a tensor put in a grad slot's place cannot be seen
            self.kept = None
        return bool(edited)

    def note_installed(self, every):
        """What this step installed in the owned dicts, for the next step's undo_edits: in every replica module
        (`every`: the grad slots were installed), or in those whose slots every step installs."""
        _C.owned_record(self.owned, self.owned_seen, None if every else self.rest_owned)


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
        self._walk(network)
        self.nrep = len(devices)
        # Every distinct parameter, then every distinct buffer: the tensors refreshed each step.
        self.params = list(network.parameters())
        self.buffers = list(network.buffers())
        self.tensors = self.params + self.buffers
        self.synced = layer_indices(self.modules)  # SyncBatchNorm layers (fastdp.sync_batchnorm)
        # One bucket layout for both grad modes (NOTE [the master's tensors stay the user's]).
        grad_buckets, frozen, plain = _layout(self.state, self.params, self.buffers, bucket_bytes)
        self.layout = (grad_buckets, frozen + plain)  # (grad buckets, the other buckets)
        # Replica 0's frozen parameters in forwards with autograd: detached aliases of the master's (see NOTE [the
        # master's tensors stay the user's]), remade when a master's data pointer changes.
        self.frozen = [i for b in frozen for i in b.members]
        self.frozen_aliases = self.frozen_watch = None
        layout = self.layout
        # The reducer owns each grad bucket's reduction; the set keeps the reducer's side of its buckets alive.
        self.reducer = Reducer(devices, self.state.tdevs, network)
        self.reduced = [self.reducer.bucket(b) for b in layout[0]]
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
        self.kept = None  # Kept (fastdp._step.kept), made at the first forward

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
        """Whether these replicas serve `network` on `devices` (its structure unchanged). Where only some master
        tensor's memory moved (``.data`` replaced, a storage moved), what aliases the master is made again."""
        if network is not self.network or list(devices) != self.state.devices:
            return False
        found = _C.matches(self.modules, self.signature, self.structure_seen)
        if found == 2:
            self._walk(network)
            self.kept = self.frozen_aliases = None
            self.state.generation += 1
        return found != 0

    def _walk(self, network):
        """The network's modules and structure signature as they are now, and empty records of what matches() finds
        unchanged against them (NOTE [structure records]): records belong to one walk."""
        self.modules, self.signature = walk(network)
        self.structure_seen = _C.structure_records()

    def held_bytes(self):
        """What the kept replicas hold, per device_ids position: {position: (replica buffers, staging, no_sync's
        unsynced sums)} in bytes."""
        where = self.positions if self.positions is not None else list(range(self.nrep))
        held = {p: [0, 0, 0] for p in where}
        for bucket in self.layout[0] + self.layout[1]:
            size = bucket.numel * bucket.itemsize
            for r, pool in enumerate(bucket.pools, start=1):
                held[where[r]][0] += size * len(pool.entries)
            if bucket.src_pool is not None:
                held[where[0]][1] += size * len(bucket.src_pool.entries)
        for r, nbytes in enumerate(self.reducer.unsynced_bytes()):
            held[where[r]][2] += nbytes
        if self.kept is not None:  # the kept replica tensors' buffers (NOTE [kept replica tensors])
            for flats in self.kept.flats:
                for r, flat in enumerate(flats, start=1):
                    held[where[r]][0] += flat.numel() * flat.element_size()
        return {p: tuple(v) for p, v in held.items()}

    def flush_unsynced(self):
        """Reduces the gradient sums no_sync() still keeps into the master's ``.grad`` (before the set is replaced:
        a changed structure or device list then loses nothing, as accumulating on the bare model would not)."""
        self.reducer.flush()

    def refresh(self):
        """Refreshes the kept replicas for one forward and returns their root modules."""
        grad_enabled = torch.is_grad_enabled()
        skel = self._skeletons((grad_enabled, self.network.training))
        every = skel.undo_edits()
        skel.refresh_dicts()
        grad_buckets, rest_buckets = self.layout
        if grad_buckets:
            kept = self._step_kept(grad_buckets)
            if skel.kept is not kept:
                _C.rebind(skel.kept_containers, self.kept_keys,
                          self.pick_outs(kept.got) if grad_enabled else self.pick_plain(kept.plain))
                skel.kept, every = kept, True
        if skel.rest_containers:
            # Last step's views released first: their buffers can be reused.
            _C.rebind(skel.rest_containers, self.rest_keys, self.rest_nones)
            got = list(self.tensors)
            if grad_enabled and self.frozen:
                for i, alias in zip(self.frozen, self._frozen_aliases()):
                    got[i] = alias
            with torch.no_grad():
                for bucket in rest_buckets:
                    for vs in bucket.fill():
                        got.extend(vs)
            _C.rebind(skel.rest_containers, self.rest_keys, self.pick_rest(got))
        skel.note_installed(every)
        self.replicas = skel.replicas
        return [row[0] for row in skel.replicas]

    def _step_kept(self, grad_buckets):
        """The grad buckets' kept nodes, made again when the master moved under them (a member's ``.data``
        replaced, its storage moved), with the master's values copied in. (The skeleton sets of forwards with
        autograd hold their outputs; the others, as upstream's detached replicate, the master tensors on replica 0
        and plain aliases of the kept buffers on the others.)"""
        kept = self.kept
        grad_enabled = torch.is_grad_enabled()
        if kept is None or not kept.usable(grad_enabled):
            kept = self.kept = Kept(grad_buckets, self.reduced, self.tensors, self.state)
            kept.usable(grad_enabled)  # watched from now on
        kept.refresh()
        return kept

    def _frozen_aliases(self):
        """Replica 0's frozen parameters for a forward with autograd: detached aliases of the master's (made again
        when the master's memory moves, see matches), each made again after a forward changed it in place (NOTE [a
        forward's own edits]: a running statistic kept as a frozen parameter, its ``.data`` rebound)."""
        aliases = self.frozen_aliases
        moved = range(len(self.frozen)) if aliases is None else self.frozen_watch.moved()
        if moved is not None:
            if aliases is None:
                aliases = self.frozen_aliases = [None] * len(self.frozen)
            for k in moved:
                aliases[k] = self.tensors[self.frozen[k]].detach()
            self.frozen_watch = _C.TensorWatch(aliases, leaves=True)
        return aliases
