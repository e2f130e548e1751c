"""Synchronised BatchNorm across the replicas of one ``fastdp.DataParallel`` forward (no process group needed).

Every ``nn.SyncBatchNorm`` layer normalises with the statistics of the whole batch, all replicas' chunks together,
so training equals the bare model's ``BatchNorm`` on the full batch whatever the split. See NOTE [synced layers].
"""

import functools
import threading

import torch
import torch.nn.functional as F
from torch.autograd import Function
from torch._utils import ExceptionWrapper
from torch.autograd.function import once_differentiable

from ._platform import streams as _streams
from ._syncbn import chunk as _chunk, recompute as _recompute
from . import comm

__all__ = ["convert_sync_batchnorm"]

# NOTE [synced layers]: for one forward the wrapper opens a _Session over the replicas it runs. Each replica's
# SyncBatchNorm layers take a class whose SyncBatchNorm.forward (_SyncedLayer; a subclass's own forward still runs
# around it) meets, during that forward, the other replicas' calls of the same layer at a rendezvous (one per layer
# and call number); a replica layer keeps that class after the forward, which then behaves as described below for
# recomputations and as torch's SyncBatchNorm otherwise. Each replica computes its chunk's per-channel mean and
# variance in its own thread (fastdp._syncbn.chunk); the last replica to arrive runs one autograd node (_SyncNorm)
# over every replica's input: the chunks' statistics are gathered onto device_ids[0] through fastdp.comm, combined
# there (Chan's formula, float64, each replica weighted by its count, so uneven chunk sizes give the full-batch
# result) and broadcast back; each replica's output is torch's batch-norm kernel on its chunk with those statistics
# and its own weight and bias. The node's backward sees every replica's gradient at once, sums (sum dy,
# sum dy * x_hat) onto device_ids[0] and broadcasts them back, and gives each replica's weight and bias its chunk's
# share. Per layer: one small exchange (3 x C values) in forward and one (2 x C) in backward. On CUDA the exchange,
# forward and backward, runs on the caller's current stream of every device (captured by begin() in the caller's
# thread): the replicas' inputs and gradients were made there, and the thread that runs it (the last arriver, or
# autograd's) would otherwise use its own streams. The last arriver then waits until the others hold their outputs:
# otherwise it would keep the GIL and each woken replica would wait up to sys.getswitchinterval() (5 ms) per layer.
# Replicas must run at the same time: emulated "cpu" replicas then run on worker threads (parallel_apply asks
# needs_threads).
#
# Dtypes. batch_norm has no autocast rule on CPU or CUDA (it is in neither the lower-precision nor the float32 list):
# it runs in its input's dtype, float16 or bfloat16 included, with float32 statistics and parameters, and returns
# that dtype. A synced layer does the same: its statistics are float32 for a low-precision input (float64 stays
# float64), and its output comes from torch's own batch-norm kernel under the caller's autocast state, so it has the
# dtype torch's BatchNorm would return on that device, and the layers after it run in the same precision as the bare
# model's.
#
# Saved tensors. Saved-tensor hooks are per thread, and activation checkpointing (torch.utils.checkpoint with
# use_reentrant=False) is such hooks: what a replica's block saves must be saved in that replica's thread, so that its
# own checkpoint drops it and recomputes it. So where a replica's thread saves through hooks, its chunk is saved by a
# node of its own, made in that thread (fastdp._syncbn.chunk.statistics); _SyncNorm, which runs in whichever thread
# arrived last, saves only those nodes' outputs (or, where no thread has hooks, the chunks themselves), the
# statistics and the weights, under hooks of its own that keep them as they are, and its backward reads each chunk
# back through the replica's node.
#
# Recomputation (fastdp._syncbn.recompute). A checkpointed block runs its forward again inside backward, one replica
# at a time, long after the rendezvous: the replicas cannot meet there. The bare model's recomputed BatchNorm sees the
# same full batch as its forward did, so it normalises with the same statistics, and it counts the batch and updates
# its running statistics a second time (torch's BatchNorm does that in every forward it runs, a recomputation
# included). So every synced call keeps, for as long as its graph lives (anchored on the _SyncNorm node and on the
# replica's outputs), its chunk's own statistics and the whole batch's (a Recording). A replica layer called in
# backward outside a forward finds its call among them by the chunk's statistics (the recomputation sees the input
# the forward saw), gives the forward's output with the whole batch's statistics, saves what the forward saved, and,
# for the replica whose buffers are the master's, counts and updates the master's running statistics once more, as
# the bare model's recomputation does. An input that matches no kept call of the layer (a block whose recomputation
# differs from its forward) raises rather than normalising with another call's statistics; a layer with no kept call
# at all (a forward that ran it alone: one replica) runs as torch's. The non-reentrant checkpoint keeps the forward's
# graph, so the backward is the forward's _SyncNorm node: the gradients are the synced ones.
#
# Reentrant checkpoints. The reentrant checkpoint (use_reentrant=True, torch's default before 2.9) cannot carry a
# synced layer as it runs: its forward runs under no_grad, and in backward it recomputes one replica's block and runs
# that replica's backward through it to the block's input before it returns, and only then can autograd start the
# next replica's (emulated replicas' backward, and that of replicas sharing a device, runs on one thread; elsewhere a
# rendezvous would hang on autograd's order of work). A replica's input gradient at a synced layer,
# w * invstd * (dy - mean(dy) - x_hat * mean(dy * x_hat)), takes its means over the whole batch, so it needs every
# other replica's dy at that layer, which only their recomputations, still to come, compute: no order of the work
# gives it. What the bare model's reentrant checkpoint computes is what the non-reentrant one computes (the same
# recomputed forward: its BatchNorm normalises the same batch with the same statistics and counts and updates its
# running statistics once more, as a recomputed synced call does). So while a replica's forward runs in a synced
# session, the reentrant checkpoints that torch.utils.checkpoint starts in that replica's thread run as non-reentrant
# ones (NOTE [reentrant checkpoints in synced replicas] in fastdp/_syncbn/recompute.py), and train as the bare model
# under its reentrant checkpoint. A reentrant checkpoint fastdp does not see (torch's class applied directly, another
# library's) still recomputes a synced call under autograd where its forward ran under no_grad: that raises, naming
# the layer and torch.utils.checkpoint.checkpoint(..., use_reentrant=False).
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
    return _Session(master, masters, rows, list(devices), _streams.current(devices))


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
        call = _recompute.recomputed_call(self, input)
        if call is None:
            return super().forward(input)
        return _recompute.recomputed_forward(self, input, *call)


_SYNCED_CLASSES = {torch.nn.SyncBatchNorm: _SyncedLayer}


def _synced_class(cls):
    synced = _SYNCED_CLASSES.get(cls)
    if synced is None:
        synced = _SYNCED_CLASSES[cls] = type(cls.__name__, (cls, _SyncedLayer), {"__module__": cls.__module__,
                                                                                  "__qualname__": cls.__qualname__})
    return synced


class _Slot:
    """One layer call's rendezvous: every replica's (input, its statistics, its layer), then the node's outputs (or
    the error)."""

    __slots__ = ("inputs", "arrived", "outputs", "error", "taken")

    def __init__(self, n):
        self.inputs = [None] * n
        self.taken = [False] * n  # per replica: it has its output
        self.arrived = 0
        self.outputs = None
        self.error = None


class _Session:
    """The synced layers of one forward: their replica overrides, the rendezvous and who has left."""

    def __init__(self, root, masters, rows, devices, streams=()):
        self.n = len(rows)
        self.devices = devices
        self.streams = streams  # the caller's current stream of each CUDA device: the exchange is ordered there
        self.cond = threading.Condition()
        self.slots = {}
        self.left = [None] * self.n  # per replica: None while running, else "" or the error it raised
        self.calls = [[0] * len(masters) for _ in range(self.n)]
        self.names = [type(m).__name__ for m in masters]
        self.recording = _recompute.Recording(root, masters, self.names)
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
        if self.recording.calls:
            _recompute.remember(self.recording, self.rows)

    def leave(self, r, error):
        with self.cond:
            self.left[r] = "" if error is None else f"{type(error).__name__}: {error}"
            self.cond.notify_all()

    def anchor(self, output):
        """Keeps this forward's recording alive as long as the autograd graph of a replica's output."""
        if self.recording.calls:
            _recompute.anchor(self.recording, output)

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
        _chunk.count(layer, layer)
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
            call = _recompute.Call(stats[q].detach(), packs[q], tuple(xs[q].shape), grad_mode, grad)
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


class _Tracked:
    """One replica's callable for parallel_apply; tells the session when the replica's forward ends."""

    __slots__ = ("session", "index", "fn")

    def __init__(self, session, index, fn):
        self.session, self.index, self.fn = session, index, fn

    def __call__(self, *args, **kwargs):
        try:
            with _recompute.reentrant_checkpoints_redirected():
                out = self.fn(*args, **kwargs)
        except BaseException as e:
            self.session.leave(self.index, e)
            raise
        self.session.leave(self.index, None)
        self.session.anchor(out)
        return out


def _synced_forward(session, j, r, layer, input):
    """SyncBatchNorm.forward for replica r of synced layer j (torch's steps, the statistics exchanged)."""
    layer._check_input_dim(input)
    layer._check_non_zero_input_channels(input)
    bn_training = layer.training or (layer.running_mean is None and layer.running_var is None)
    if not bn_training:  # eval with running statistics: nothing to exchange
        factor = 0.0 if layer.momentum is None else layer.momentum
        return F.batch_norm(input, layer.running_mean, layer.running_var, layer.weight, layer.bias, False, factor,
                            layer.eps)
    stats = _chunk.statistics(input)
    out, pack = session.meet(j, r, input, stats, layer)
    _chunk.update_running(layer, layer, pack)
    return out


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
        outs = [_chunk.output(x, p, w, b, eps) for x, p, w, b in zip(xs, packs, weights, biases)]
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
        shape = _chunk.channel_shape(x)
        x_hat = _chunk.normalised(x, p[0], p[1], eps)
        scale = (p[1] + eps).rsqrt() if w is None else (p[1] + eps).rsqrt() * w.to(p.dtype)
        dx = (g.to(p.dtype) - m[0].view(shape)).addcmul_(x_hat, m[1].view(shape), value=-1)
        dxs.append(dx.mul_(scale.view(shape)).to(x.dtype))
    dws = [None if w is None else s[1].to(w.dtype) for s, w in zip(sums, weights)]
    dbs = [None if dtype is None else s[0].to(dtype) for s, dtype in zip(sums, ctx.bias_dtypes)]
    return tuple(dxs) + tuple(dws) + tuple(dbs)
