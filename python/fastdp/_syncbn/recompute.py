"""A checkpointed block's recomputation, in backward, of a synced BatchNorm call: what each synced forward keeps for
it while its graph lives, how a recomputed call finds its own, and what the recomputation computes, saves, counts and
updates. See NOTE [synced layers] in fastdp/sync_batchnorm.py."""

import math
import threading
import weakref

import torch

from .._step import step as _step
from . import chunk as _chunk

__all__ = ["Call", "Recording", "RECORDINGS", "remember", "anchor", "recomputed_call", "recomputed_forward"]


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

    __slots__ = ("calls", "layers", "masters", "names", "__weakref__")

    def __init__(self, masters, names):
        self.calls = {}  # (replica, layer index) -> [Call]
        self.layers = {}  # id(replica layer) -> (weakref to it, replica, layer index); filled when the forward ends
        self.masters = masters
        self.names = names


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
            f"fastdp: {rec.names[j]} layer {j} sits in a block checkpointed in reentrant mode "
            "(torch.utils.checkpoint or checkpoint_sequential with use_reentrant=True, torch's default when it is "
            "not given; transformers' gradient_checkpointing_kwargs={'use_reentrant': True}): that mode recomputes "
            "each replica's block alone inside backward, where a synced layer's gradient, which needs every "
            "replica's, cannot be computed. Pass use_reentrant=False: its gradients equal the bare model's"
        )
    if r == 0:  # the recomputation's count and update must come first: checkpoint may stop at the next save
        master = rec.masters[j]
        _chunk.count(layer, master)
        _chunk.update_running(layer, master, call.pack)
    _chunk.statistics(input)  # saves the input as the forward did; its value is the forward's
    with torch.no_grad():
        out = input.clone() if call.pack is None else _chunk.output(input, call.pack, layer.weight, layer.bias,
                                                                   layer.eps)
    if call.grad:
        out.requires_grad_()  # the forward's output took part in autograd: the layers after it save alike
    return out
