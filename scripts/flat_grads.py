"""Where the per-tensor host cost of a gradient bucket goes, and what handing autograd fewer tensors would change: the
shapes a bucket's two autograd nodes could take, each timed over a whole backward (docs/benchmarks.md, "Fewer
tensors through the bucket node").

One bucket of ``--members`` parameters of shape (8, 8) on ``--replicas`` emulated replicas; each replica tensor feeds
one small linear, and the loss sums them. The layouts:

- ``per-member`` (fastdp's): the bucket node has one output per member and replica; its backward sums the
  gradients with the prepared host sum (``fastdp._C.PreparedSum``) and makes one result tensor per member.
- ``split-view``: the node has one flat output per replica, and the replica tensors are views of it
  (``split_with_sizes`` then ``view``): autograd's C++ backward of those views assembles each replica's flat
  gradient, the node adds the flats. Every replica is flat here, replica 0 included (fastdp's replica 0 runs on the
  master's own tensors, which are not one flat buffer).
- ``unsafe-split``: replica 0 keeps one output per member; each other replica has one output per bucket cut by
  ``torch.unsafe_split`` (pieces that are not autograd views, each with a version counter of its own), so
  autograd's C++ cat assembles its flat gradient; the node adds the flats and then replica 0's gradients, in one
  ``torch._foreach_add_``.
- ``stacked-delivery``: the replicas as in ``per-member``, but the delivery to the master takes one stacked input
  per shape (``torch.stack``), so the node hands autograd one tensor per shape and autograd's C++ unbind gives
  each master parameter its piece.

Prints, per layout, the whole backward's and the node's own thread CPU time (the host's work, not the waits of a
shared machine), medians of ``--rounds`` alternated rounds. ``--check`` runs one backward of each layout with one
member no replica uses, and prints whether each gives the master the same gradients as the bare sum and the unused
member no gradient (as fastdp does), or zeros.
"""

import argparse
import statistics
import sys
import time
from array import array

import torch
from torch.autograd import Function

from fastdp import _C

SHAPE = (8, 8)
NUMEL = SHAPE[0] * SHAPE[1]


class Case:
    """One bucket: `k` master parameters, `nrep` replicas, a small input for each replica tensor's linear."""

    def __init__(self, k, nrep, seed=0):
        torch.manual_seed(seed)
        self.k, self.nrep = k, nrep
        self.master = [torch.nn.Parameter(torch.randn(SHAPE)) for _ in range(k)]
        self.flats = [torch.cat([m.detach().reshape(-1) for m in self.master]) for _ in range(nrep)]
        self.x = [torch.randn(2, 8) for _ in range(nrep)]
        self.plan = _C.PreparedSum(self.master, nrep)
        self.spec = array("q", [len(SHAPE), *SHAPE] * k)
        self.node_ns = 0

    def rows(self, outs):
        """The replica tensors as rows (replica-major, `k` per replica)."""
        return [outs[r * self.k : (r + 1) * self.k] for r in range(self.nrep)]

    def loss(self, rows, unused=None):
        return sum((x @ w.t()).sum() for x, row in zip(self.x, rows) for j, w in enumerate(row) if j != unused)


def _timed(case, body):
    began = time.thread_time_ns()
    try:
        return body()
    finally:
        case.node_ns += time.thread_time_ns() - began


def _views(case, out, present):
    views = _C.views(out, case.spec)
    return tuple(v if p else None for v, p in zip(views, present))


class _Delivery(Function):
    """Between the master and the bucket node: its backward hands the master the node's sum."""

    @staticmethod
    def forward(ctx, case, *master):
        ctx.set_materialize_grads(False)
        return tuple(m.detach() for m in master)

    @staticmethod
    def backward(ctx, *sums):
        return (None,) + sums


def _member_views(ctx, case):
    """Each replica's members as separate outputs (views of its flat buffer), as the kept bucket node hands them out."""
    ctx.case = case
    ctx.set_materialize_grads(False)
    return tuple(v for f in case.flats for v in f.detach().view(case.k, *SHAPE).unbind(0))


class _PerMember(Function):
    @staticmethod
    def forward(ctx, case, *aliases):
        return _member_views(ctx, case)

    @staticmethod
    def backward(ctx, *grads):
        case = ctx.case

        def body():
            present = [any(g is not None for g in grads[j :: case.k]) for j in range(case.k)]
            out = torch.empty(case.k * NUMEL)
            if not case.plan.run(grads, out):
                zero = torch.zeros(SHAPE)
                rows = [[zero if g is None else g for g in row] for row in case.rows(grads)]
                torch.sum(torch.stack([torch.cat([g.reshape(-1) for g in row]) for row in rows]), 0, out=out)
            return _views(case, out, present)

        return (None,) + _timed(case, body)


class _Flat(Function):
    """The `split-view` node: one flat output per replica."""

    @staticmethod
    def forward(ctx, case, *aliases):
        ctx.case = case
        ctx.set_materialize_grads(False)
        return tuple(f.detach() for f in case.flats)

    @staticmethod
    def backward(ctx, *flats):
        case = ctx.case

        def body():
            out = torch.empty(case.k * NUMEL)
            torch.sum(torch.stack([f for f in flats if f is not None]), 0, out=out)
            return _views(case, out, [True] * case.k)

        return (None,) + _timed(case, body)


class _Split(Function):
    """The `unsafe-split` node: replica 0 per member, one output per other replica."""

    @staticmethod
    def forward(ctx, case, *aliases):
        ctx.case = case
        ctx.set_materialize_grads(False)
        own = tuple(case.flats[0].detach().view(case.k, *SHAPE).unbind(0))
        return own + tuple(f.detach().view(case.k * SHAPE[0], *SHAPE[1:]) for f in case.flats[1:])

    @staticmethod
    def backward(ctx, *grads):
        case = ctx.case

        def body():
            own, others = grads[: case.k], [g for g in grads[case.k :] if g is not None]
            out = torch.empty(case.k * NUMEL)
            torch.sum(torch.stack([g.reshape(-1) for g in others]), 0, out=out)
            views = _C.views(out, case.spec)
            present = [g is not None for g in own]
            torch._foreach_add_([v for v, p in zip(views, present) if p], [g for g in own if g is not None])
            return tuple(views)

        return (None,) + _timed(case, body)


class _StackedDelivery(Function):
    """The `stacked-delivery` delivery: one stacked input; the node's sum reaches the master through it."""

    @staticmethod
    def forward(ctx, case, stacked):
        ctx.case = case
        ctx.set_materialize_grads(False)
        return tuple(m.detach() for m in case.master)

    @staticmethod
    def backward(ctx, *sums):
        case = ctx.case
        token = sums[0]
        return None, (None if token is None else token._flat_sum.view(case.k, *SHAPE))


class _StackedNode(_PerMember):
    """The per-member node with the stacked delivery's backward."""

    @staticmethod
    def backward(ctx, *grads):
        case = ctx.case

        def body():
            out = torch.empty(case.k * NUMEL)
            if not case.plan.run(grads, out):
                raise RuntimeError("stacked-delivery times the prepared sum only: every member must be used")
            token = torch.zeros(SHAPE)
            token._flat_sum = out
            return (token,) + (None,) * (case.k - 1)

        return (None,) + _timed(case, body)


def build(case, layout):
    """The replica tensors of `layout` (replica-major) over `case`'s master."""
    if layout == "stacked-delivery":
        aliases = _StackedDelivery.apply(case, torch.stack(case.master))
        return list(_StackedNode.apply(case, *aliases))
    aliases = _Delivery.apply(case, *case.master)
    if layout == "per-member":
        return list(_PerMember.apply(case, *aliases))
    if layout == "split-view":
        flats = _Flat.apply(case, *aliases)
        return [p.view(SHAPE) for f in flats for p in f.split_with_sizes([NUMEL] * case.k)]
    if layout == "unsafe-split":
        outs = _Split.apply(case, *aliases)
        own, others = list(outs[: case.k]), outs[case.k :]
        return own + [p for t in others for p in torch.unsafe_split(t, SHAPE[0])]
    raise ValueError(f"layout: {layout!r} is none of {LAYOUTS}")


LAYOUTS = ("per-member", "split-view", "unsafe-split", "stacked-delivery")


def backward_ms(case, outs):
    """(whole backward, the node's own part) in thread CPU ms; the master's gradients cleared first."""
    for m in case.master:
        m.grad = None
    loss = case.loss(case.rows(outs))
    case.node_ns = 0
    began = time.thread_time_ns()
    loss.backward()
    return (time.thread_time_ns() - began) / 1e6, case.node_ns / 1e6


def check(k, nrep):
    """Per layout: whether the master gets the bare sum, and what an unused member gets. Returns the lines."""
    unused = k // 2
    ref = Case(k, nrep)
    leaves = [[f.detach().view(k, *SHAPE)[j].clone().requires_grad_() for j in range(k)] for f in ref.flats]
    ref.loss(leaves, unused).backward()
    want = [sum(row[j].grad for row in leaves) if j != unused else None for j in range(k)]
    lines = []
    for layout in LAYOUTS:
        if layout == "stacked-delivery":
            continue  # it times the prepared sum only, which an unused member sends elsewhere
        case = Case(k, nrep)
        case.loss(case.rows(build(case, layout)), unused).backward()
        same = all(torch.allclose(m.grad, w) for j, (m, w) in enumerate(zip(case.master, want)) if j != unused)
        got = case.master[unused].grad
        what = "no gradient" if got is None else ("zeros" if not got.any() else "a gradient")
        lines.append(f"{layout}: sums {'match' if same else 'DIFFER from'} the bare sum; the unused member gets {what}")
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--members", type=int, default=1000)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--check", action="store_true", help="check each layout's sums and its unused member, then exit")
    args = p.parse_args(argv)
    if args.members < 2 or args.replicas < 2 or args.rounds < 1:
        p.error("--members and --replicas must be at least 2, --rounds at least 1")
    torch.set_num_threads(1)
    if args.check:
        print("\n".join(check(args.members, args.replicas)))
        return 0
    case = Case(args.members, args.replicas)
    outs = {layout: build(case, layout) for layout in LAYOUTS}
    times = {layout: [] for layout in LAYOUTS}
    for layout in LAYOUTS:  # one backward each before timing
        backward_ms(case, outs[layout])
    for _ in range(args.rounds):
        for layout in LAYOUTS:
            times[layout].append(backward_ms(case, outs[layout]))
    print(f"{args.members} members of {SHAPE} x {args.replicas} replicas, torch {torch.__version__}, 1 thread; "
          f"thread CPU ms per backward, medians of {args.rounds} alternated rounds")
    for layout in LAYOUTS:
        whole = statistics.median(t[0] for t in times[layout])
        node = statistics.median(t[1] for t in times[layout])
        print(f"  {layout:17s} backward {whole:8.2f}   of which the bucket node {node:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
