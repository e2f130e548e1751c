"""A checkpointed block's recomputation, in backward, of a synced BatchNorm call: what each synced forward keeps for
it while its graph lives, how a recomputed call finds its own, and what the recomputation computes, saves, counts and
updates; and the reentrant checkpoints a synced replica starts, which run without reentry. See NOTE [synced layers]
in fastdp/sync_batchnorm.py."""

import contextlib
import math
import threading
import weakref

import torch
import torch.utils.checkpoint as _torch_checkpoint
from torch.autograd import Function

from .._step import step as _step
from . import chunk as _chunk

__all__ = ["Call", "Recording", "RECORDINGS", "remember", "anchor", "recomputed_call", "recomputed_forward",
           "reentrant_checkpoints_redirected"]


class Call:
    """One replica's share of one synced call, as a recomputation needs it: its chunk's statistics (mean and biased
    variance; how the call is found again), the whole batch's (mean, biased and unbiased variance, on the replica's
    device), the input's shape, whether grad mode was on and whether the output took part in autograd."""

    __slots__ = ("local", "pack", "shape", "grad_mode", "grad")

    def __init__(self, local, pack, shape, grad_mode, grad):
        self.local, self.pack, self.shape, self.grad_mode, self.grad = local, pack, shape, grad_mode, grad


class Recording:
    """The synced calls of one forward, kept while its graph lives (the exchange's nodes and the replicas' outputs
    hold it; RECORDINGS only sees it): per (replica, layer) the list of its calls (Call), and for each replica
    layer where it sits."""

    __slots__ = ("calls", "layers", "root", "masters", "names", "__weakref__")

    def __init__(self, root, masters, names):
        self.calls = {}  # (replica, layer index) -> [Call]
        self.layers = {}  # id(replica layer) -> (weakref to it, replica, layer index); filled when the forward ends
        self.root = root  # the wrapped module, where an error finds a layer's name
        self.masters = masters
        self.names = names

    def layer_name(self, j):
        """Synced layer j as a user finds it: its class and its name in the wrapped module."""
        path = next((name for name, m in self.root.named_modules() if m is self.masters[j]), None)
        return f"{self.names[j]} layer {j}" if path is None else f"{self.names[j]} '{path}'"


RECORDINGS = weakref.WeakSet()  # every Recording whose graph still lives
_RECORDINGS_LOCK = threading.Lock()
_ANCHOR = "fastdp_synced_layers"  # the key of a replica output's autograd node metadata that keeps a Recording


def remember(recording, rows):
    """After the forward: the calls of ``recording`` become findable by a recomputation of the replica layers in
    ``rows`` (per replica, its synced layers)."""
    for r, row in enumerate(rows):
        for j, layer in enumerate(row):
            recording.layers.setdefault(id(layer), (weakref.ref(layer), r, j))
    with _RECORDINGS_LOCK:
        RECORDINGS.add(recording)


def anchor(recording, output):
    """Keeps ``recording`` alive as long as the autograd graph of a replica's ``output``."""
    for node in _graph_nodes(output, []):
        node.metadata[_ANCHOR] = recording


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


# How far a recomputed chunk's statistics may lie from its forward's (in standard deviations of each channel) and
# still be that call: a recomputation on the same input gives the same values; a kernel that adds in a varying
# order (atomics) moves them by rounding only. Another batch lies about 1 / sqrt(samples per channel) away.
_SAME_CALL = {torch.float64: 1e-9, torch.float32: 1e-5}

_graph_task_id = torch._C._current_graph_task_id  # the backward running in this thread, -1 outside (torch 2.1+)


def recomputed_call(layer, input):
    """(recording, replica, layer index, Call) when this call of a replica layer is a checkpointed block's
    recomputation, in backward, of a synced call whose graph lives; None when torch's SyncBatchNorm runs it (a
    forward the layer runs alone: one replica, a process group; eval with running statistics; no such call)."""
    if _step.running.steps or _graph_task_id() == -1:
        return None  # in a forward, or outside any backward
    if not (layer.training or (layer.running_mean is None and layer.running_var is None)):
        return None  # eval with running statistics: the forward's computation, whatever thread runs it
    found = _calls_of(layer, tuple(input.shape))
    if not found:
        return None
    dtype = _chunk.stat_dtype(input)
    with torch.no_grad():
        mean, var = _chunk.local_statistics(input, dtype)
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


def _calls_of(layer, shape):
    """(recording, replica, layer index, Call) for every kept call of ``layer`` on an input of ``shape``."""
    with _RECORDINGS_LOCK:
        recordings = list(RECORDINGS)
    found = []
    for rec in recordings:
        where = rec.layers.get(id(layer))
        if where is not None and where[0]() is layer:
            _, r, j = where
            found.extend((rec, r, j, call) for call in rec.calls.get((r, j), ()) if call.shape == shape)
    return found


def recomputed_forward(layer, input, rec, r, j, call):
    """A checkpointed block's recomputation of a synced call: the forward's output with the forward's whole-batch
    statistics, the same tensors saved, and the master's buffers counted and updated once more by the replica whose
    buffers are the master's, as the bare model's recomputed BatchNorm does (NOTE [synced layers])."""
    if not call.grad_mode and torch.is_grad_enabled():  # a forward under no_grad, recomputed with autograd
        raise RuntimeError(
            f"fastdp: {rec.layer_name(j)} sits in a block checkpointed in reentrant mode by a call fastdp does not "
            "see (torch.utils.checkpoint.CheckpointFunction bound before the forward and applied directly, or "
            "another library's reentrant checkpoint): that mode recomputes each replica's block alone inside "
            "backward, where a synced layer's gradient, which needs every replica's, cannot be computed. Checkpoint "
            "the block with torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False) (or the "
            "library's non-reentrant mode): its gradients equal the bare model's"
        )
    if r == 0:  # the recomputation's count and update must come first: checkpoint may stop at the next save
        master = rec.masters[j]
        _chunk.count(layer, master)
        _chunk.update_running(layer, master, call.pack)
    _chunk.statistics(input)  # saves the input as the forward did; its value is the forward's
    # The forward's output took part in autograd or not; the recomputed one alike, so the layers after it save alike.
    with torch.set_grad_enabled(call.grad):
        return _Output.apply(input, layer.weight, layer.bias, call.pack, layer.eps)


class _Output(Function):
    """A recomputed synced call's output, made by a node as the exchange's was: the layers after it may change it in
    place (timm's SyncBatchNormAct applies its activation in place), which a tensor made to require grad by hand
    would refuse. Its backward never runs: a checkpoint takes only what the recomputation saves."""

    @staticmethod
    def forward(ctx, x, weight, bias, pack, eps):
        return x.clone() if pack is None else _chunk.output(x, pack, weight, bias, eps)

    @staticmethod
    def backward(ctx, grad):
        return None, None, None, None, None


# NOTE [reentrant checkpoints in synced replicas]: torch.utils.checkpoint.checkpoint looks its reentrant class up when
# it is called (``CheckpointFunction.apply``), so while a synced forward runs that name holds a stand-in. In a thread
# that runs a replica's forward of a synced session, a reentrant checkpoint of inputs that need a gradient (under
# grad mode) runs as torch's non-reentrant one, whose gradients are the bare model's under the reentrant checkpoint
# (see Reentrant checkpoints in NOTE [synced layers]); every other call, in any thread, reaches torch's class
# unchanged, as does a block none of whose inputs needs a gradient (torch's reentrant checkpoint then gives its
# parameters no gradient, in the bare model and the replicas alike). The determinism check stays off, as in the
# reentrant mode. The name is torch's own again once the last synced forward running has ended.

_replica_thread = threading.local()  # .synced: this thread runs a replica's forward in a synced session
_redirect_lock = threading.Lock()
_redirect = {"forwards": 0, "stand_in": None}  # synced forwards running, and the stand-in they installed


class _ReentrantStandIn:
    """``torch.utils.checkpoint.CheckpointFunction`` while synced forwards run (NOTE [reentrant checkpoints in synced
    replicas]); everything but ``apply`` is torch's class."""

    def __init__(self, reentrant):
        self.reentrant = reentrant

    def apply(self, function, preserve_rng_state, *args):
        if not (getattr(_replica_thread, "synced", False) and torch.is_grad_enabled()
                and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)):
            return self.reentrant.apply(function, preserve_rng_state, *args)
        return _torch_checkpoint.checkpoint(function, *args, use_reentrant=False,
                                            preserve_rng_state=preserve_rng_state, determinism_check="none")

    def __getattr__(self, name):
        return getattr(self.reentrant, name)


@contextlib.contextmanager
def reentrant_checkpoints_redirected():
    """Around a replica's forward in a synced session, in the replica's thread: the reentrant checkpoints it starts
    run without reentry (NOTE [reentrant checkpoints in synced replicas])."""
    with _redirect_lock:
        if _redirect["forwards"] == 0:
            _redirect["stand_in"] = _ReentrantStandIn(_torch_checkpoint.CheckpointFunction)
            _torch_checkpoint.CheckpointFunction = _redirect["stand_in"]
        _redirect["forwards"] += 1
    outer = getattr(_replica_thread, "synced", False)  # a wrapper called inside a replica's forward
    _replica_thread.synced = True
    try:
        yield
    finally:
        _replica_thread.synced = outer
        with _redirect_lock:
            _redirect["forwards"] -= 1
            stand_in = _redirect["stand_in"]
            if _redirect["forwards"] == 0:
                if _torch_checkpoint.CheckpointFunction is stand_in:  # left as it is if replaced meanwhile
                    _torch_checkpoint.CheckpointFunction = stand_in.reentrant
                _redirect["stand_in"] = None
