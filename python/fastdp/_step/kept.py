"""The kept replica tensors of a replica set's gradient buckets (NOTE [kept replica tensors] in
fastdp._step.replicas): the other replicas' flat buffers, the reducer's nodes over them, the copies of the master
into them each step, and the watch on what a forward may change in place."""

from itertools import chain

import torch

from .. import _C
from .._platform import streams as _streams
from .._reduction.flat import unflatten as _unflatten
from . import hooks as _hooks

__all__ = ["Kept"]


class Kept:
    """The grad buckets' kept nodes (NOTE [kept replica tensors] in fastdp._step.replicas): per bucket the other
    devices' flat buffers, and the prepared copies of the master into them; `got` is what the kept path hands the
    picker (the master tensors, then every node's outputs)."""

    __slots__ = ("buckets", "state", "flats", "views", "outs", "got", "plain", "masters", "stamp", "hooks_cleared",
                 "streams", "devices", "copy", "flat_copy", "watches")

    def __init__(self, buckets, reduced, tensors, state):
        self.buckets, self.state = buckets, state
        # The current stream of each CUDA device when the nodes are made: autograd orders their backward on these
        # for good, so a forward on other streams gets new nodes (see usable).
        self.devices = state.devices
        self.streams = _streams.current(self.devices)
        self.masters = list(chain.from_iterable(b.master for b in buckets))
        # Made in whatever mode the first forward runs, used in every mode: never inference tensors, always nodes.
        with torch.inference_mode(False), torch.enable_grad():
            self.flats = [[torch.empty(b.numel, dtype=b.dtype, device=d) for d in state.tdevs[1:]]
                          for b in buckets]
            self.outs = []
            for bucket, flats in zip(reduced, self.flats):  # the reducer's side of each bucket makes its nodes
                self.outs += bucket.nodes(flats)
            # Without autograd: the other replicas' tensors as plain aliases of the same buffers (in the order
            # ReplicaSet._picker gives buckets without a node), so no second set of buffers is ever made.
            self.plain, self.views = list(tensors), []
            for bucket, flats in zip(buckets, self.flats):
                views = [_unflatten(flat.detach(), bucket.like, bucket.sizes, bucket.shapes) for flat in flats]
                self.views.append(views)
                for vs in views:
                    self.plain += vs
        self.got = list(tensors) + self.outs
        self.stamp = None  # the master's version counters summed at the last copy
        self.hooks_cleared = None  # torch's count of hook handles when the outputs' hooks were last cleared
        # Every member of every bucket into every other replica's buffer, in prepared copies (NCCL broadcasts each
        # bucket's packed buffer instead, across distinct devices). Host replicas copy the members into the second
        # replica's buffers only, and each of those buffers whole into the other replicas': one copy per bucket and
        # replica instead of one per member.
        self.copy = None if state.collective else _C.PreparedCopy(*_member_copies(buckets, self.views, state.host))
        self.flat_copy = _C.PreparedCopy(*_flat_copies(self.flats)) if state.host else None
        self.watches = {}  # grad mode -> _C.TensorWatch over the flat buffers and the tensors that mode installs

    def usable(self, grad_enabled):
        """Whether the kept nodes serve this forward: made on its streams, and no forward of its grad mode changed
        the tensors they install in place (NOTE [a forward's own edits]). They are dropped when the master's memory
        moves under their aliases too (ReplicaSet.matches)."""
        if self.streams and _streams.current(self.devices) != self.streams:
            return False
        watch = self.watches.get(grad_enabled)
        if watch is None:  # no forward of this mode has had them yet: they are as made
            installed = self.outs if grad_enabled else self.plain[len(self.got) - len(self.outs):]
            # Without autograd they are leaves, whose requires_grad a forward can set (the outputs' it cannot).
            self.watches[grad_enabled] = _C.TensorWatch(list(chain.from_iterable(self.flats)) + installed,
                                                        leaves=not grad_enabled)
            return True
        return watch.moved() is None

    def refresh(self):
        """Copies the master into the kept buffers; bumps their version counters where the master's moved."""
        if self.copy is not None:
            self.copy.run(self.state.core_streams())
            if self.flat_copy is not None:
                self.flat_copy.run()
        else:
            for bucket, flats in zip(self.buckets, self.flats):
                bucket.broadcast(flats)
        stamp = _C.version_sum(self.masters)
        if stamp != self.stamp:
            if self.stamp is not None:
                for flat in chain.from_iterable(self.flats):
                    _increment_version(flat)
            self.stamp = stamp
        self.hooks_cleared = _hooks.clear_tensor_hooks(self.outs, self.hooks_cleared)


_increment_version = torch.autograd.graph.increment_version


def _member_copies(buckets, views, first_only):
    """(destinations, sources): each bucket's master members into their views of the other replicas' buffers
    (`views`: per bucket, per other replica, the member views), or of the first other replica's only."""
    dsts, srcs = [], []
    for bucket, replicas in zip(buckets, views):
        for vs in replicas[:1] if first_only else replicas:
            dsts += vs
            srcs += bucket.master
    return dsts, srcs


def _flat_copies(flats):
    """(destinations, sources): per bucket, the first other replica's flat buffer into each further replica's."""
    pairs = [(flat, fs[0]) for fs in flats for flat in fs[1:]]
    return [d for d, _ in pairs], [s for _, s in pairs]
