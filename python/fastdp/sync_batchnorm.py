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

from . import _streams, comm

__all__ = ["convert_sync_batchnorm"]

# NOTE [synced layers]: for one forward the wrapper opens a _Session over the replicas it runs. Each replica's
# SyncBatchNorm layers get, for that forward, a class whose SyncBatchNorm.forward (_SyncedLayer; a subclass's own
# forward still runs around it) meets the other replicas' calls of the same layer at a rendezvous (one per layer and
# call number); end() gives the layers their own class back. The last replica to arrive runs one autograd node
# (_SyncNorm) over every replica's input: per-replica mean and variance (torch's batch-norm statistics kernel) are
# gathered onto device_ids[0] through fastdp.comm, combined there (Chan's formula, float64, each replica weighted by
# its count, so uneven chunk sizes give the full-batch result) and broadcast back; the node's backward sees every
# replica's gradient at once, sums (sum dy, sum dy * x_hat) onto device_ids[0] and broadcasts them back. Per layer:
# one small exchange (3 x C values) in forward and one (2 x C) in backward. On CUDA the exchange, forward and
# backward, runs on the caller's current stream of every device (captured by begin() in the caller's thread): the
# replicas' inputs and gradients were made there, and the thread that runs it (the last arriver, or autograd's)
# would otherwise use its own streams. The last arriver then waits until the others hold their outputs: otherwise it
# would keep the GIL and each woken replica would wait up to sys.getswitchinterval() (5 ms) per layer. Replicas must
# run at the same time: emulated "cpu" replicas then run on worker threads (parallel_apply asks needs_threads). A
# replica that raises, or ends without reaching a layer the others wait in, releases them with an error; a layer
# counts the batch (num_batches_tracked) once every replica has reached it, as the bare model's layer counts it on
# entry, and updates its running statistics only from an exchange's result, so a failed forward leaves the buffers
# as the bare model's failed forward does. Running statistics are updated on every replica's buffers with the
# full-batch values (replica 0's are the master's; the copy-back used when device 0 runs no chunk, which runs after a
# failed forward too, sees the same values).


def convert_sync_batchnorm(module):
    """``module`` with every ``BatchNorm1d/2d/3d`` replaced by ``nn.SyncBatchNorm`` (parameters, buffers and
    settings kept; the module itself when it has none, a new one when it is a BatchNorm). Under
    ``fastdp.DataParallel`` these layers normalise over the whole batch across replicas."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"convert_sync_batchnorm: module must be a torch.nn.Module, got {type(module).__name__}")
    return torch.nn.SyncBatchNorm.convert_sync_batchnorm(module)


def layer_indices(modules):
    """Positions of the SyncBatchNorm layers in a module list (fastdp._replicas keeps it per kept structure)."""
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
    """(master layers, per replica its layers) from the layer list a fastdp._replicas.ReplicaSet keeps."""
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
    """What ``SyncBatchNorm.forward`` means for a replica's layer during a synced forward: the session's exchange.

    A replica layer's class becomes ``_synced_class(its class)`` for the forward, which places this class just
    before ``nn.SyncBatchNorm`` in the method order: a subclass's own forward (timm's SyncBatchNormAct adds its
    activation and drop path) still runs, and its ``super().forward(x)`` reaches the exchange.
    """

    def forward(self, input):
        return self.__dict__[_SYNCED](input)


_SYNCED_CLASSES = {torch.nn.SyncBatchNorm: _SyncedLayer}


def _synced_class(cls):
    synced = _SYNCED_CLASSES.get(cls)
    if synced is None:
        synced = _SYNCED_CLASSES[cls] = type(cls.__name__, (cls, _SyncedLayer), {"__module__": cls.__module__,
                                                                                  "__qualname__": cls.__qualname__})
    return synced


class _Slot:
    """One layer call's rendezvous: every replica's input, then the node's outputs (or the error)."""

    __slots__ = ("inputs", "arrived", "outputs", "error", "taken")

    def __init__(self, n):
        self.inputs = [None] * n
        self.taken = [False] * n  # per replica: it has its output
        self.arrived = 0
        self.outputs = None
        self.error = None


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
        self.patched = []  # (layer, its own class)
        for r, row in enumerate(rows):
            for j, layer in enumerate(row):
                if _SYNCED in layer.__dict__:  # already set up here (one layer object twice)
                    continue
                layer.__dict__[_SYNCED] = functools.partial(_synced_forward, self, j, r, layer)
                self.patched.append((layer, type(layer)))
                layer.__class__ = _synced_class(type(layer))

    def track(self, callables):
        """What parallel_apply runs: each replica's callable, reporting to the session when it ends."""
        return [_Tracked(self, r, c) for r, c in enumerate(callables)]

    def end(self):
        for layer, cls in self.patched:
            layer.__class__ = cls
            layer.__dict__.pop(_SYNCED, None)
        self.patched = []

    def leave(self, r, error):
        with self.cond:
            self.left[r] = "" if error is None else f"{type(error).__name__}: {error}"
            self.cond.notify_all()

    def meet(self, j, r, x, layer):
        """Replica r's normalised input at synced layer j (this call; ``layer``, its replica layer): (x_hat, (mean,
        invstd, unbiased var) on its device), once every replica has brought its input."""
        key = (j, self.calls[r][j])
        self.calls[r][j] += 1
        with self.cond:
            slot = self.slots.get(key)
            if slot is None:
                slot = self.slots[key] = _Slot(self.n)
            slot.inputs[r] = x
            slot.arrived += 1
            last = slot.arrived == self.n
            if not last:
                self._await(slot, j, key[1])
        # Every replica reached this call: the bare model's layer ran, and counted the batch, even where the
        # exchange then fails (torch counts it before normalising).
        _count(layer)
        if last:
            self._exchange(slot, r, layer.eps)
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

    def _exchange(self, slot, r, eps):
        """The last arriver (replica r): runs the node over every replica's input, hands out the outputs and waits
        until the others hold theirs."""
        try:
            # Entered around apply: autograd notes each output's stream as this call returns, and its backward
            # hands the gradients over on those streams.
            with _streams.entered(self.streams):
                outs = _SyncNorm.apply(self.devices, self.streams, eps, *slot.inputs)
        except BaseException as e:
            with self.cond:
                slot.error = f"{type(e).__name__}: {e}"
                self.cond.notify_all()
            raise
        with self.cond:
            slot.outputs = outs
            slot.inputs = None  # the node holds what backward needs
            slot.taken[r] = True
            self.cond.notify_all()
            # Wait until the others have their outputs: a thread that just woke up needs the GIL, which this
            # one would otherwise keep for up to sys.getswitchinterval() (5 ms) per layer.
            while not all(slot.taken[q] or self.left[q] is not None for q in range(self.n)):
                self.cond.wait()


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
        return out


def _shape(x):
    return (1, -1) + (1,) * (x.dim() - 2)


def _stat_dtype(x):
    return x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32


def _count(layer):
    """Counts a batch in num_batches_tracked, as torch's BatchNorm does on entering a training forward."""
    if layer.training and layer.track_running_stats and layer.num_batches_tracked is not None:
        layer.num_batches_tracked.add_(1)


def _synced_forward(session, j, r, layer, input):
    """SyncBatchNorm.forward for replica r of synced layer j (torch's steps, the statistics exchanged)."""
    layer._check_input_dim(input)
    layer._check_non_zero_input_channels(input)
    bn_training = layer.training or (layer.running_mean is None and layer.running_var is None)
    if not bn_training:  # eval with running statistics: nothing to exchange
        factor = 0.0 if layer.momentum is None else layer.momentum
        return F.batch_norm(input, layer.running_mean, layer.running_var, layer.weight, layer.bias, False, factor,
                            layer.eps)
    x_hat, stats = session.meet(j, r, input, layer)  # counts the batch once every replica has reached the layer
    if layer.training and layer.track_running_stats and layer.running_mean is not None:
        factor = 1.0 / layer.num_batches_tracked.item() if layer.momentum is None else layer.momentum
        with torch.no_grad():
            mean, unbiased = stats[0], stats[2]
            layer.running_mean.mul_(1 - factor).add_(mean.to(layer.running_mean.dtype), alpha=factor)
            layer.running_var.mul_(1 - factor).add_(unbiased.to(layer.running_var.dtype), alpha=factor)
    if layer.weight is not None:
        x_hat = x_hat * layer.weight.view(_shape(x_hat)) + layer.bias.view(_shape(x_hat))
    return x_hat


def _normalise(x, mean, var, eps):
    """(x - mean) / sqrt(var + eps) per channel, with torch's batch-norm kernel where the dtypes allow."""
    if x.dtype == mean.dtype:
        return F.batch_norm(x, mean, var, None, None, False, 0.0, eps)
    shape = _shape(x)
    return ((x.to(mean.dtype) - mean.view(shape)) * (var + eps).rsqrt().view(shape)).to(x.dtype)


def _local_stats(x, dtype):
    """This replica's per-channel mean and biased variance: sums of (x - k) and (x - k)^2 with k one sample of each
    channel, so no cancellation unless that sample lies many standard deviations from the mean. Measured 5 times
    faster on the CPU than torch.var_mean or the batch-norm statistics kernel (16 x 16 x 16 x 16 float32)."""
    dims = [d for d in range(x.dim()) if d != 1]
    x = x.to(dtype)
    shape = _shape(x)
    k = x.select(0, 0).reshape(x.size(1), -1)[:, 0].reshape(shape)
    shifted = x - k
    count = x.numel() // x.size(1)
    s1 = shifted.sum(dims)
    s2 = shifted.square_().sum(dims)
    mean = s1 / count
    return k.view(-1) + mean, (s2 / count - mean * mean).clamp_(min=0)


class _SyncNorm(Function):
    """N replicas' inputs -> N normalised outputs (then N stat packs, not differentiable): one node over all
    replicas, so its backward sees every replica's gradient at once."""

    @staticmethod
    def forward(ctx, devices, streams, eps, *xs):
        dest = xs[0].device
        dtype = _stat_dtype(xs[0])
        counts, parts = [], []
        for x in xs:
            counts.append(x.numel() // x.size(1))
            parts.append(torch.stack(_local_stats(x, dtype)).unsqueeze(0))
        total = sum(counts)
        if total <= 1:
            size = list(xs[0].shape)
            size[0] = sum(x.size(0) for x in xs)
            raise ValueError(f"Expected more than 1 value per channel when training, got input size {size}")
        both = comm.gather(parts, 0, dest).to(torch.float64)  # (N, 2, C): each replica's mean and variance
        # Chan et al.: exact for any split. The counts stay Python numbers: a tensor made from them on the device
        # would be a host-to-device copy that waits for the device in every layer of every step.
        mean = sum(both[i, 0] * (c / total) for i, c in enumerate(counts))
        m2 = sum((both[i, 1] + (both[i, 0] - mean).square()) * c for i, c in enumerate(counts))
        # mean, biased variance (normalisation), unbiased variance (running_var), as BatchNorm uses them.
        pack = torch.stack([mean, m2 / total, m2 / (total - 1)]).to(dtype)
        packs = comm.broadcast(pack, devices)
        outs = [_normalise(x, p[0], p[1], eps) for x, p in zip(xs, packs)]
        ctx.save_for_backward(*xs, *packs)
        ctx.devices, ctx.streams, ctx.total, ctx.eps = devices, streams, total, eps
        for p in packs:
            ctx.mark_non_differentiable(p)
        return tuple(outs) + tuple(packs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        with _streams.entered(ctx.streams):  # autograd's thread: the caller's streams, where the gradients are
            return (None, None, None) + _sync_backward(ctx, grads)


def _grad_sums(g, x, mean, var, eps):
    """Per channel (sum g, sum g * x_hat) in the statistics' dtype, by torch's batch-norm backward kernel. It is
    given the statistics the way training saved them (save_mean, save_invstd; float32 for float16 and bfloat16
    inputs, as torch's CUDA batch norm keeps them): the CUDA kernel asserts on the eval-mode form, running
    statistics with no saved ones."""
    invstd = (var + eps).rsqrt()
    _, sum_gx, sum_g = torch.ops.aten.native_batch_norm_backward(
        g, x, None, None, None, mean, invstd, True, eps, [False, True, True])
    return sum_g.to(mean.dtype), sum_gx.to(mean.dtype)


def _sync_backward(ctx, grads):
    """The replicas' input gradients: the per-channel sums of every replica reduced, averaged and broadcast back."""
    saved = ctx.saved_tensors
    n = len(saved) // 2
    xs, packs = saved[:n], saved[n:]
    eps = ctx.eps
    sums, hats = [], []
    for x, g, p in zip(xs, grads[:n], packs):
        g = g.contiguous()
        hats.append(g)
        sums.append(torch.stack(_grad_sums(g, x, p[0], p[1], eps)))
    total = comm.reduce_add(sums, xs[0].device) / ctx.total
    means = comm.broadcast(total, ctx.devices)
    dxs = []
    for x, g, m, p in zip(xs, hats, means, packs):
        shape = _shape(x)
        x_hat = _normalise(x, p[0], p[1], eps)
        dx = (g.to(p.dtype) - m[0].view(shape)).addcmul_(x_hat.to(p.dtype), m[1].view(shape), value=-1)
        dxs.append(dx.mul_((p[1] + eps).rsqrt().view(shape)).to(x.dtype))
    return tuple(dxs)
