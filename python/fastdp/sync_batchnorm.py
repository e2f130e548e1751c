"""Synchronised BatchNorm across the replicas of one ``fastdp.DataParallel`` forward (no process group needed).

Every ``nn.SyncBatchNorm`` layer normalises with the statistics of the whole batch, all replicas' chunks together,
so training equals the bare model's ``BatchNorm`` on the full batch whatever the split. See NOTE [synced layers].
"""

import functools
import math
import threading
import weakref

import torch
import torch.nn.functional as F
from torch.autograd import Function
from torch._utils import ExceptionWrapper
from torch.autograd.function import once_differentiable

from ._step import step as _step
from ._platform import streams as _streams
from . import comm

__all__ = ["convert_sync_batchnorm"]

# NOTE [synced layers]: for one forward the wrapper opens a _Session over the replicas it runs. Each replica's
# SyncBatchNorm layers take a class whose SyncBatchNorm.forward (_SyncedLayer; a subclass's own forward still runs
# around it) meets, during that forward, the other replicas' calls of the same layer at a rendezvous (one per layer
# and call number); a replica layer keeps that class after the forward, which then behaves as described below for
# recomputations and as torch's SyncBatchNorm otherwise. Each replica computes its chunk's per-channel mean and
# variance in its own thread (_Local); the last replica to arrive runs one autograd node (_SyncNorm) over every
# replica's input: the chunks' statistics are gathered onto device_ids[0] through fastdp.comm, combined there (Chan's
# formula, float64, each replica weighted by its count, so uneven chunk sizes give the full-batch result) and
# broadcast back; each replica's output is torch's batch-norm kernel on its chunk with those statistics and its own
# weight and bias; the node's backward sees every replica's gradient at once, sums (sum dy, sum dy * x_hat) onto
# device_ids[0] and broadcasts them back, and gives each replica's weight and bias its chunk's share. Per layer: one
# small exchange (3 x C values) in forward and one (2 x C) in backward.
#
# Dtypes. batch_norm has no autocast rule on CPU or CUDA (it is in neither the lower-precision nor the float32 list):
# it runs in its input's dtype, float16 or bfloat16 included, with float32 statistics and parameters, and returns
# that dtype. A synced layer does the same: its statistics are float32 for a low-precision input (float64 stays
# float64), and its output comes from torch's own batch-norm kernel under the caller's autocast state, so it has the
# dtype torch's BatchNorm would return on that device, and the layers after it run in the same precision as the bare
# model's. On CUDA the exchange, forward and backward, runs on the caller's current stream of every device
# (captured by begin() in the caller's thread): the replicas' inputs and gradients were made there, and the thread
# that runs it (the last arriver, or autograd's) would otherwise use its own streams. The last arriver then waits
# until the others hold their outputs: otherwise it would keep the GIL and each woken replica would wait up to
# sys.getswitchinterval() (5 ms) per layer. Replicas must run at the same time: emulated "cpu" replicas then run on
# worker threads (parallel_apply asks needs_threads).
#
# Saved tensors. Saved-tensor hooks are per thread, and activation checkpointing (torch.utils.checkpoint with
# use_reentrant=False) is such hooks: what a replica's block saves must be saved in that replica's thread, so that its
# own checkpoint drops it and recomputes it. So where a replica's thread saves through hooks, its chunk is saved by a
# _Local node of its own, made in that thread; _SyncNorm, which runs in whichever thread arrived last, saves only
# those nodes' outputs (or, where no thread has hooks, the chunks themselves) and the statistics, under hooks of its
# own that keep them as they are, and its backward reads each chunk back through the replica's _Local.
#
# Recomputation. A checkpointed block runs its forward again inside backward, one replica at a time, long after the
# rendezvous: the replicas cannot meet there. The bare model's recomputed BatchNorm sees the same full batch as its
# forward did, so it normalises with the same statistics, and it counts the batch and updates its running statistics a
# second time (torch's BatchNorm does that in every forward it runs, a recomputation included). So every synced call
# keeps, for as long as its graph lives (anchored on the _SyncNorm node and on the replica's outputs), its chunk's own
# statistics and the whole batch's (_Recording). A replica layer called in backward outside a forward finds its call
# among them by the chunk's statistics (the recomputation sees the input the forward saw), normalises with the whole
# batch's statistics, saves what the forward saved, and, for the replica whose buffers are the master's, counts and
# updates the master's running statistics once more, as the bare model's recomputation does. An input that matches no
# kept call of the layer (a block whose recomputation differs from its forward) raises rather than normalising with
# another call's statistics; a layer with no kept call at all (a forward that ran it alone: one replica) runs as
# torch's. The non-reentrant checkpoint keeps the forward's graph, so the backward is the forward's _SyncNorm node:
# the gradients are the synced ones. The reentrant checkpoint (use_reentrant=True) instead runs its forward under
# no_grad and builds a new graph per replica inside backward: a replica's gradient through the whole batch's
# statistics needs every replica's gradient at that layer, which the others' backward has not computed yet, so a
# synced layer recomputed that way raises, naming use_reentrant=False.
#
# Failures and empty chunks. A replica that raises, or ends without reaching a layer the others wait in, releases them
# with an error. A layer counts the batch (num_batches_tracked) once every replica has reached it, as the bare model's
# layer counts it on entry, and updates its running statistics only with an exchange's result: a failed forward leaves
# the buffers as the bare model's failed forward does. A chunk with no value per channel (a replica with no sample at
# that layer) weighs nothing in the exchange; a batch with none at all leaves the running statistics as they are, as
# torch's BatchNorm does with an empty input. Running statistics are updated on every replica's buffers with the
# full-batch values (replica 0's are the master's; the copy-back used when device 0 runs no chunk, which also runs
# after a failed forward, sees the same values).


def convert_sync_batchnorm(module):
    """``module`` with every ``BatchNorm1d/2d/3d`` replaced by ``nn.SyncBatchNorm`` (parameters, buffers and
    settings kept; the module itself when it has none, a new one when it is a BatchNorm). Under
    ``fastdp.DataParallel`` these layers normalise over the whole batch across replicas."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"convert_sync_batchnorm: module must be a torch.nn.Module, got {type(module).__name__}")
    return torch.nn.SyncBatchNorm.convert_sync_batchnorm(module)


def layer_indices(modules):
    """Positions of the SyncBatchNorm layers in a module list (fastdp._step.replicas keeps it per kept structure)."""
    return [i for i, m in enumerate(modules) if isinstance(m, torch.nn.SyncBatchNorm)]


def needs_threads(modules):
    """Whether parallel_apply must run these replicas at the same time (they meet in synced layers)."""
    return bool(modules) and type(modules[0]) is _Tracked


class ReplicaReleased(RuntimeError):
    """Raised in a replica waiting in a synced layer when another replica failed or ended: parallel_apply
    reports the other replica's error first (the cause), whatever the replica order."""


def first_cause(results):
    """The error parallel_apply re-raises: the first replica's that is not a ReplicaReleased, else the first."""
    errors = [o for o in results if isinstance(o, ExceptionWrapper)]
    return next((e for e in errors if e.exc_type is not ReplicaReleased), errors[0])


def begin(master, replicas, devices, kept=None):
    """A _Session for one forward over `replicas` (their roots) on `devices`, or None when nothing is synced
    (no SyncBatchNorm layer, or a single replica, which is plain batch norm)."""
    if len(replicas) < 2:
        return None  # one replica: plain BatchNorm
    known = kept is not None and kept.network is master and any(row[0] is replicas[-1] for row in kept.replicas)
    if (known and not kept.synced) or (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None  # nothing synced; or a process group, where torch's own SyncBatchNorm runs
    masters, rows = _kept_layers(kept, replicas) if known else _walked_layers(master, replicas)
    if not masters:
        return None
    return _Session(masters, rows, list(devices), _streams.current(devices))


def _kept_layers(kept, replicas):
    """(master layers, per replica its layers) from the layer list a fastdp._step.replicas.ReplicaSet keeps."""
    roots = {id(r): i for i, r in enumerate(replicas)}
    rows = [None] * len(replicas)
    for row in kept.replicas:
        if id(row[0]) in roots:
            rows[roots[id(row[0])]] = [row[i] for i in kept.synced]
    return [kept.modules[i] for i in kept.synced], rows


def _walked_layers(master, replicas):
    """(master layers, per replica its layers) found by walking the module trees."""
    modules = list(master.modules())
    index = layer_indices(modules)
    if not index:  # no SyncBatchNorm: the replicas' trees are not walked (this path runs every forward)
        return [], []
    rows = []
    for r in replicas:
        mods = list(r.modules())
        rows.append([mods[i] for i in index])
    return [modules[i] for i in index], rows


_SYNCED = "_fastdp_synced_forward"  # a replica layer's entry: its SyncBatchNorm.forward in this synced forward
_ANCHOR = "fastdp_synced_layers"  # the key of a replica output's autograd node metadata that keeps a _Recording


class _SyncedLayer(torch.nn.SyncBatchNorm):
    """What ``SyncBatchNorm.forward`` means for a replica's layer: the session's exchange during a synced forward;
    outside one, a checkpoint's recomputation of a synced call, or else torch's own SyncBatchNorm.

    A replica layer's class becomes ``_synced_class(its class)``, which places this class just before
    ``nn.SyncBatchNorm`` in the method order: a subclass's own forward (timm's SyncBatchNormAct adds its
    activation and drop path) still runs, and its ``super().forward(x)`` reaches the exchange.
    """

    def forward(self, input):
        synced = self.__dict__.get(_SYNCED)
        if synced is not None:
            return synced(input)
        call = _recomputed_call(self, input)
        if call is None:
            return super().forward(input)
        return _recomputed_forward(self, input, *call)


_SYNCED_CLASSES = {torch.nn.SyncBatchNorm: _SyncedLayer}


def _synced_class(cls):
    synced = _SYNCED_CLASSES.get(cls)
    if synced is None:
        synced = _SYNCED_CLASSES[cls] = type(cls.__name__, (cls, _SyncedLayer), {"__module__": cls.__module__,
                                                                                  "__qualname__": cls.__qualname__})
    return synced


class _Slot:
    """One layer call's rendezvous: every replica's (input, its statistics), then the node's outputs (or the
    error)."""

    __slots__ = ("inputs", "arrived", "outputs", "error", "taken")

    def __init__(self, n):
        self.inputs = [None] * n
        self.taken = [False] * n  # per replica: it has its output
        self.arrived = 0
        self.outputs = None
        self.error = None


class _Call:
    """One replica's share of one synced call, as a recomputation needs it: its chunk's statistics (mean and biased
    variance; how the call is found again), the whole batch's (mean, biased and unbiased variance, on the replica's
    device), the input's shape, whether grad mode was on and whether the normalised input took part in autograd."""

    __slots__ = ("local", "pack", "shape", "grad_mode", "grad")

    def __init__(self, local, pack, shape, grad_mode, grad):
        self.local, self.pack, self.shape, self.grad_mode, self.grad = local, pack, shape, grad_mode, grad


class _Recording:
    """The synced calls of one forward, kept while its graph lives (the _SyncNorm nodes and the replicas' outputs
    hold it; _RECORDINGS only sees it): per (replica, layer) the list of its calls (_Call), and for each replica
    layer where it sits. See NOTE [synced layers]."""

    __slots__ = ("calls", "layers", "masters", "names", "__weakref__")

    def __init__(self, masters, names):
        self.calls = {}  # (replica, layer index) -> [_Call]
        self.layers = {}  # id(replica layer) -> (weakref to it, replica, layer index); filled when the forward ends
        self.masters = masters
        self.names = names


_RECORDINGS = weakref.WeakSet()  # every _Recording whose graph still lives
_RECORDINGS_LOCK = threading.Lock()


class _Session:
    """The synced layers of one forward: their replica overrides, the rendezvous and who has left."""

    def __init__(self, masters, rows, devices, streams=()):
        self.n = len(rows)
        self.devices = devices
        self.streams = streams  # the caller's current stream of each CUDA device: the exchange is ordered there
        self.cond = threading.Condition()
        self.slots = {}
        self.left = [None] * self.n  # per replica: None while running, else "" or the error it raised
        self.calls = [[0] * len(masters) for _ in range(self.n)]
        self.names = [type(m).__name__ for m in masters]
        self.recording = _Recording(masters, self.names)
        self.rows = rows
        self.patched = []  # replica layers given this session's forward
        self.lent = []  # (master layer, its class): a replicate override may hand out the master's own layers
        for r, row in enumerate(rows):
            for j, layer in enumerate(row):
                if _SYNCED in layer.__dict__:  # already set up here (one layer object twice)
                    continue
                layer.__dict__[_SYNCED] = functools.partial(_synced_forward, self, j, r, layer)
                self.patched.append(layer)
                if not isinstance(layer, _SyncedLayer):
                    if layer is masters[j]:
                        self.lent.append((layer, type(layer)))
                    layer.__class__ = _synced_class(type(layer))

    def track(self, callables):
        """What parallel_apply runs: each replica's callable, reporting to the session when it ends."""
        return [_Tracked(self, r, c) for r, c in enumerate(callables)]

    def end(self):
        """After the forward: the replica layers leave the session (their class stays: a checkpointed block may
        run them again in backward), and what they computed becomes findable by such a recomputation."""
        for layer in self.patched:
            layer.__dict__.pop(_SYNCED, None)
        for layer, cls in self.lent:
            layer.__class__ = cls
        self.patched = []
        self.lent = []
        recording = self.recording
        if recording.calls:
            for r, row in enumerate(self.rows):
                for j, layer in enumerate(row):
                    recording.layers.setdefault(id(layer), (weakref.ref(layer), r, j))
            with _RECORDINGS_LOCK:
                _RECORDINGS.add(recording)

    def leave(self, r, error):
        with self.cond:
            self.left[r] = "" if error is None else f"{type(error).__name__}: {error}"
            self.cond.notify_all()

    def anchor(self, output):
        """Keeps this forward's recording alive as long as the autograd graph of a replica's output."""
        if self.recording.calls:
            for node in _graph_nodes(output, []):
                node.metadata[_ANCHOR] = self.recording

    def meet(self, j, r, x, stats, layer):
        """Replica r's output at layer j (this call) and the whole batch's (mean, biased var, unbiased var) on its
        device, once every replica has brought its input, its chunk's statistics and its layer."""
        key = (j, self.calls[r][j])
        self.calls[r][j] += 1
        with self.cond:
            slot = self.slots.get(key)
            if slot is None:
                slot = self.slots[key] = _Slot(self.n)
            slot.inputs[r] = (x, stats, layer)
            slot.arrived += 1
            last = slot.arrived == self.n
            if not last:
                self._await(slot, j, key[1])
        # Every replica reached this call: the bare model's layer ran, and counted the batch, even where the
        # exchange then fails (torch counts it before normalising).
        _count(layer, layer)
        if last:
            self._exchange(slot, r, j, layer.eps)
        elif slot.error is not None:
            raise ReplicaReleased(f"fastdp: the exchange of {self.names[j]} layer {j} failed in another replica: "
                                  f"{slot.error}")
        else:
            with self.cond:
                slot.taken[r] = True
                self.cond.notify_all()
        n = self.n
        return slot.outputs[r], slot.outputs[n + r]

    def _await(self, slot, j, call):
        """Waits, holding self.cond, until the last arriver at `slot` (call `call` of layer j) has run the node or
        failed; raises ReplicaReleased when a replica that has not brought its input has ended."""
        while slot.outputs is None and slot.error is None:
            gone = [q for q in range(self.n) if slot.inputs[q] is None and self.left[q] is not None]
            if gone:
                q = gone[0]
                why = f" (it raised {self.left[q]})" if self.left[q] else ""
                raise ReplicaReleased(
                    f"fastdp: replica {q} ended its forward without reaching call {call} of "
                    f"{self.names[j]} layer {j}{why}; every replica must run the same synced layers"
                )
            self.cond.wait()

    def _exchange(self, slot, r, j, eps):
        """The last arriver (replica r): runs the node over every replica's input, hands out the outputs and waits
        until the others hold theirs."""
        xs = [x for x, _, _ in slot.inputs]
        stats = [s for _, s, _ in slot.inputs]
        weights = [layer.weight for _, _, layer in slot.inputs]
        biases = [layer.bias for _, _, layer in slot.inputs]
        try:
            # Entered around apply: autograd notes each output's stream as this call returns, and its backward
            # hands the gradients over on those streams. The node's own saves bypass this thread's saved-tensor
            # hooks: they belong to one replica's checkpoint, not to every replica's (NOTE [synced layers]).
            with _streams.entered(self.streams):
                with torch.autograd.graph.saved_tensors_hooks(_same, _same):
                    outs = _SyncNorm.apply(self.devices, self.streams, eps, self.recording, stats, *xs, *weights,
                                           *biases)
        except BaseException as e:
            with self.cond:
                slot.error = f"{type(e).__name__}: {e}"
                self.cond.notify_all()
            raise
        n = self.n
        # The whole batch's statistics, or None where it had no value to count: the running statistics then stay.
        packs = [p.detach() for p in outs[n:]] if any(x.numel() for x in xs) else [None] * n
        calls = self.recording.calls
        grad_mode, grad = torch.is_grad_enabled(), outs[0].requires_grad
        for q in range(n):
            call = _Call(stats[q].detach(), packs[q], tuple(xs[q].shape), grad_mode, grad)
            calls.setdefault((q, j), []).append(call)
        with self.cond:
            slot.outputs = outs[:n] + tuple(packs)
            slot.inputs = None  # the node holds what backward needs
            slot.taken[r] = True
            self.cond.notify_all()
            # Wait until the others have their outputs: a thread that just woke up needs the GIL, which this
            # one would otherwise keep for up to sys.getswitchinterval() (5 ms) per layer.
            while not all(slot.taken[q] or self.left[q] is not None for q in range(self.n)):
                self.cond.wait()


def _same(t):
    return t


def _graph_nodes(obj, found):
    """The autograd nodes of the tensors in ``obj`` (nested tuples, lists and dicts), appended to ``found``."""
    if isinstance(obj, torch.Tensor):
        if obj.grad_fn is not None:
            found.append(obj.grad_fn)
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            _graph_nodes(x, found)
    elif isinstance(obj, dict):
        for x in obj.values():
            _graph_nodes(x, found)
    return found


class _Tracked:
    """One replica's callable for parallel_apply; tells the session when the replica's forward ends."""

    __slots__ = ("session", "index", "fn")

    def __init__(self, session, index, fn):
        self.session, self.index, self.fn = session, index, fn

    def __call__(self, *args, **kwargs):
        try:
            out = self.fn(*args, **kwargs)
        except BaseException as e:
            self.session.leave(self.index, e)
            raise
        self.session.leave(self.index, None)
        self.session.anchor(out)
        return out


def _shape(x):
    return (1, -1) + (1,) * (x.dim() - 2)


def _stat_dtype(x):
    return x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32


def _count(layer, owner):
    """Counts a batch in ``owner``'s num_batches_tracked, as torch's BatchNorm does on entering a training forward
    (``layer`` has the settings: the replica layer itself, or its master's buffers for a recomputation)."""
    if layer.training and layer.track_running_stats and owner.num_batches_tracked is not None:
        owner.num_batches_tracked.add_(1)


def _update_running(layer, owner, pack):
    """``owner``'s running statistics moved towards the whole batch's mean and unbiased variance in ``pack`` (None:
    the batch had no value, and they stay)."""
    if pack is None or not (layer.training and layer.track_running_stats) or owner.running_mean is None:
        return
    factor = 1.0 / owner.num_batches_tracked.item() if layer.momentum is None else layer.momentum
    with torch.no_grad():
        mean, unbiased = pack[0], pack[2]
        owner.running_mean.mul_(1 - factor).add_(mean.to(owner.running_mean.dtype), alpha=factor)
        owner.running_var.mul_(1 - factor).add_(unbiased.to(owner.running_var.dtype), alpha=factor)


def _synced_forward(session, j, r, layer, input):
    """SyncBatchNorm.forward for replica r of synced layer j (torch's steps, the statistics exchanged)."""
    layer._check_input_dim(input)
    layer._check_non_zero_input_channels(input)
    bn_training = layer.training or (layer.running_mean is None and layer.running_var is None)
    if not bn_training:  # eval with running statistics: nothing to exchange
        factor = 0.0 if layer.momentum is None else layer.momentum
        return F.batch_norm(input, layer.running_mean, layer.running_var, layer.weight, layer.bias, False, factor,
                            layer.eps)
    stats = _chunk_stats(input)
    out, pack = session.meet(j, r, input, stats, layer)
    _update_running(layer, layer, pack)
    return out


# How far a recomputed chunk's statistics may lie from its forward's (in standard deviations of each channel) and
# still be that call: a recomputation on the same input gives the same values; a kernel that adds in a varying
# order (atomics) moves them by rounding only. Another batch lies about 1 / sqrt(samples per channel) away.
_SAME_CALL = {torch.float64: 1e-9, torch.float32: 1e-5}


def _recomputed_call(layer, input):
    """(recording, replica, layer index, _Call) when this call of a replica layer is a checkpointed block's
    recomputation, in backward, of a synced call whose graph lives; None when torch's SyncBatchNorm runs it (a
    forward the layer runs alone: one replica, a process group; eval with running statistics; no such call)."""
    if _step.running.steps or _graph_task_id() == -1:
        return None  # in a forward, or outside any backward
    if not (layer.training or (layer.running_mean is None and layer.running_var is None)):
        return None  # eval with running statistics: the forward's computation, whatever thread runs it
    with _RECORDINGS_LOCK:
        recordings = list(_RECORDINGS)
    shape = tuple(input.shape)
    found = []
    for rec in recordings:
        where = rec.layers.get(id(layer))
        if where is not None and where[0]() is layer:
            _, r, j = where
            found.extend((rec, r, j, call) for call in rec.calls.get((r, j), ()) if call.shape == shape)
    if not found:
        return None
    dtype = _stat_dtype(input)
    with torch.no_grad():
        mean, var = _local_stats(input, dtype)
        best, distance = None, math.inf
        for entry in found:
            local = entry[3].local
            scale = (local[1] + layer.eps).sqrt()
            d = max(((mean - local[0]).abs() / scale).max().item(),
                    ((var - local[1]).abs() / scale.square()).max().item())
            if d < distance:
                best, distance = entry, d
    if distance > _SAME_CALL[dtype]:
        rec, _, j, _ = best
        raise RuntimeError(
            f"fastdp: {rec.names[j]} layer {j} of a replica runs again in backward (a checkpointed block's "
            "recomputation) on an input whose statistics differ from every call its forward made: a "
            "checkpointed block must recompute what its forward computed (keep checkpoint's preserve_rng_state=True "
            "when the block draws random numbers), and a graph must be backwarded before another forward on fewer "
            "replicas recomputes the same layers"
        )
    return best


def _recomputed_forward(layer, input, rec, r, j, call):
    """A checkpointed block's recomputation of a synced call: the forward's normalisation with the forward's
    whole-batch statistics, the same tensors saved, and the master's buffers counted and updated once more by the
    replica whose buffers are the master's, as the bare model's recomputed BatchNorm does (NOTE [synced layers])."""
    if not call.grad_mode and torch.is_grad_enabled():  # a forward under no_grad, recomputed with autograd
        raise RuntimeError(
            f"fastdp: {rec.names[j]} layer {j} sits in a block checkpointed in reentrant mode "
            "(torch.utils.checkpoint or checkpoint_sequential with use_reentrant=True, torch's default when it is "
            "not given; transformers' gradient_checkpointing_kwargs={'use_reentrant': True}): that mode recomputes "
            "each replica's block alone inside backward, where a synced layer's gradient, which needs every "
            "replica's, cannot be computed. Pass use_reentrant=False: its gradients equal the bare model's"
        )
    if r == 0:  # the recomputation's count and update must come first: checkpoint may stop at the next save
        master = rec.masters[j]
        _count(layer, master)
        _update_running(layer, master, call.pack)
    _chunk_stats(input)  # saves the input as the forward did; its value is the forward's
    with torch.no_grad():
        out = input.clone() if call.pack is None else _output(input, call.pack, layer.weight, layer.bias, layer.eps)
    if call.grad:
        out.requires_grad_()  # the forward's output took part in autograd: the layers after it save alike
    return out


_graph_task_id = torch._C._current_graph_task_id  # the backward running in this thread, -1 outside (torch 2.1+)


def _output(x, pack, weight, bias, eps):
    """A replica's output: torch's batch-norm kernel on its chunk with the whole batch's statistics (``pack``) and
    its weight and bias, in the dtype torch's BatchNorm gives ``x`` (see Dtypes in NOTE [synced layers]). The
    parameters are taken in the statistics' dtype, the form torch's kernels accept for every input dtype."""
    dtype = pack.dtype
    weight = None if weight is None else weight.detach().to(dtype)
    bias = None if bias is None else bias.detach().to(dtype)
    return F.batch_norm(x, pack[0], pack[1], weight, bias, False, 0.0, eps)


def _normalised(x, mean, var, eps):
    """(x - mean) / sqrt(var + eps) per channel, in the statistics' dtype."""
    if x.dtype == mean.dtype:
        return F.batch_norm(x, mean, var, None, None, False, 0.0, eps)
    shape = _shape(x)
    return (x.to(mean.dtype) - mean.view(shape)) * (var + eps).rsqrt().view(shape)


def _local_stats(x, dtype):
    """This replica's per-channel mean and biased variance: sums of (x - k) and (x - k)^2 with k one sample of each
    channel, so no cancellation unless that sample lies many standard deviations from the mean. Measured 5 times
    faster on the CPU than torch.var_mean or the batch-norm statistics kernel (16 x 16 x 16 x 16 float32)."""
    count = x.numel() // x.size(1)
    if count == 0:  # no value in this chunk (no sample, or an empty spatial extent): it weighs nothing
        zeros = x.new_zeros(x.size(1), dtype=dtype)
        return zeros, zeros.clone()
    dims = [d for d in range(x.dim()) if d != 1]
    x = x.to(dtype)
    shape = _shape(x)
    k = x.select(0, 0).reshape(x.size(1), -1)[:, 0].reshape(shape)
    shifted = x - k
    s1 = shifted.sum(dims)
    s2 = shifted.square_().sum(dims)
    mean = s1 / count
    return k.view(-1) + mean, (s2 / count - mean * mean).clamp_(min=0)


class _Local(Function):
    """One replica's chunk -> its per-channel (mean, biased variance), computed in the replica's own thread. The node
    saves the chunk for _SyncNorm's backward (its own backward never runs: its output feeds no loss), so the chunk
    goes through that replica's saved-tensor hooks (NOTE [synced layers])."""

    @staticmethod
    def forward(ctx, x, dtype):
        ctx.save_for_backward(x)
        return torch.stack(_local_stats(x, dtype))

    @staticmethod
    def backward(ctx, grad):
        return None, None


_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)  # this thread's innermost


def _chunk_stats(x):
    """This replica's per-channel (mean, biased variance) of its chunk ``x``: through a _Local node, which saves the
    chunk, where this thread saves tensors through hooks (activation checkpointing, offloading) and the chunk takes
    part in autograd; computed plainly otherwise (the exchange then keeps the chunk itself, at no node's cost)."""
    dtype = _stat_dtype(x)
    if x.requires_grad and torch.is_grad_enabled() and _saves_through_hooks():
        return _Local.apply(x, dtype)
    with torch.no_grad():
        return torch.stack(_local_stats(x, dtype))


def _saves_through_hooks():
    """Whether this thread's saved tensors go through saved-tensor hooks; True where torch cannot tell."""
    if _top_hooks is None:
        return True
    try:
        return _top_hooks(False) is not None
    except (TypeError, RuntimeError):
        return True


class _SyncNorm(Function):
    """N replicas' inputs, then their N weights and N biases (None without affine parameters) -> N outputs (then N
    stat packs, not differentiable): one node over all replicas, so its backward sees every replica's gradient at
    once. ``stats`` are the replicas' _Local outputs."""

    @staticmethod
    def forward(ctx, devices, streams, eps, recording, stats, *tensors):
        n = len(stats)
        xs, weights, biases = tensors[:n], tensors[n:2 * n], tensors[2 * n:]
        counts = [x.numel() // x.size(1) for x in xs]
        total = sum(counts)
        pack = _whole_batch(xs, stats, counts, total)
        packs = comm.broadcast(pack, devices)
        outs = [_output(x, p, w, b, eps) for x, p, w, b in zip(xs, packs, weights, biases)]
        # Saved detached: a saved output would hold this node through the hooks' packed value, a cycle that
        # outlives a graph dropped without backward.
        ctx.local = [s.grad_fn is not None for s in stats]  # per replica: its _Local node saved its chunk
        ctx.save_for_backward(*(s if local else x for s, x, local in zip(stats, xs, ctx.local)),
                              *(p.detach() for p in packs), *weights)
        ctx.bias_dtypes = [None if b is None else b.dtype for b in biases]
        ctx.devices, ctx.streams, ctx.total, ctx.eps = devices, streams, total, eps
        ctx.recording = recording  # kept while this graph lives: a recomputation may look for it
        for p in packs:
            ctx.mark_non_differentiable(p)
        return tuple(outs) + tuple(packs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        with _streams.entered(ctx.streams):  # autograd's thread: the caller's streams, where the gradients are
            return (None, None, None, None, None) + _sync_backward(ctx, grads)


def _whole_batch(xs, stats, counts, total):
    """The whole batch's (mean, biased variance, unbiased variance) per channel on device_ids[0], in the statistics'
    dtype, from every replica's chunk statistics and value count."""
    dest = xs[0].device
    dtype = stats[0].dtype
    if total == 1:  # torch's check: none for a batch with no value at all
        size = list(xs[0].shape)
        size[0] = sum(x.size(0) for x in xs)
        raise ValueError(f"Expected more than 1 value per channel when training, got input size {size}")
    if total == 0:  # nothing to normalise; the caller leaves the running statistics as they are, as torch does
        ones = torch.ones(xs[0].size(1), dtype=dtype, device=dest)
        return torch.stack([torch.zeros_like(ones), ones, ones])
    # (N, 2, C): each replica's mean and variance
    both = comm.gather([s.detach().unsqueeze(0) for s in stats], 0, dest).to(torch.float64)
    # Chan et al.: exact for any split. The counts stay Python numbers: a tensor made from them on the device would
    # be a host-to-device copy that waits for the device in every layer of every step.
    mean = sum(both[i, 0] * (c / total) for i, c in enumerate(counts))
    m2 = sum((both[i, 1] + (both[i, 0] - mean).square()) * c for i, c in enumerate(counts))
    # mean, biased variance (normalisation), unbiased variance (running_var), as BatchNorm uses them.
    return torch.stack([mean, m2 / total, m2 / (total - 1)]).to(dtype)


def _grad_sums(g, x, mean, var, eps):
    """Per channel (sum g, sum g * x_hat) in the statistics' dtype, by torch's batch-norm backward kernel. It is
    given the statistics the way training saved them (save_mean, save_invstd; float32 for float16 and bfloat16
    inputs, as torch's CUDA batch norm keeps them): the CUDA kernel asserts on the eval-mode form, running
    statistics with no saved ones."""
    if x.numel() == 0:  # a chunk with no value adds nothing (the kernel would divide by its size)
        zeros = mean.new_zeros(mean.shape)
        return zeros, zeros.clone()
    invstd = (var + eps).rsqrt()
    _, sum_gx, sum_g = torch.ops.aten.native_batch_norm_backward(
        g, x, None, None, None, mean, invstd, True, eps, [False, True, True])
    return sum_g.to(mean.dtype), sum_gx.to(mean.dtype)


def _sync_backward(ctx, grads):
    """The replicas' input gradients (the per-channel sums of every replica reduced, averaged and broadcast back),
    then their weights' and biases' (each replica's own chunk's sums, as its affine step alone would give)."""
    saved = ctx.saved_tensors
    n = len(ctx.local)
    # Each chunk as the forward kept it: read back through its replica's _Local node, or kept itself.
    xs = [k.grad_fn.saved_tensors[0] if local else k for k, local in zip(saved[:n], ctx.local)]
    packs, weights = saved[n:2 * n], saved[2 * n:]
    eps = ctx.eps
    sums, contiguous = [], []
    for x, g, p in zip(xs, grads[:n], packs):
        g = g.contiguous()
        contiguous.append(g)
        sums.append(torch.stack(_grad_sums(g, x, p[0], p[1], eps)))
    total = comm.reduce_add(sums, xs[0].device) / ctx.total
    means = comm.broadcast(total, ctx.devices)
    dxs = []
    for x, g, m, p, w in zip(xs, contiguous, means, packs, weights):
        shape = _shape(x)
        scale = (p[1] + eps).rsqrt() if w is None else (p[1] + eps).rsqrt() * w.to(p.dtype)
        dx = (g.to(p.dtype) - m[0].view(shape)).addcmul_(_normalised(x, p[0], p[1], eps), m[1].view(shape), value=-1)
        dxs.append(dx.mul_(scale.view(shape)).to(x.dtype))
    dws = [None if w is None else s[1].to(w.dtype) for s, w in zip(sums, weights)]
    dbs = [None if dtype is None else s[0].to(dtype) for s, dtype in zip(sums, ctx.bias_dtypes)]
    return tuple(dxs) + tuple(dws) + tuple(dbs)
