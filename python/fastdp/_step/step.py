"""One forward of a ``fastdp.DataParallel``: the state that belongs to it and to no other call.

``forward`` makes a :class:`Step` and runs it on this thread's stack of running steps (``push``, and the stack put back
when it ends: NOTE [an interrupt as a step ends]); the step is handed down through scatter, replicate, parallel_apply
and gather. The overridable methods keep upstream's signatures, so when ``forward`` calls them through ``self`` they
find their step with :func:`current`. A step is seen only by the thread that runs it and by the workers running its
replicas (which inherit the stack: a wrapper called again from inside a replica knows it is re-entered); another
thread's forward, or a nested or re-entrant call, has a step of its own. When the step ends (inside the wrapper's
forward lock, so before the next forward of the wrapper starts), what it found is handed to the wrapper as an
:data:`Outcome` (``publish``), for ``fastdp.memory_report`` and for the next forward's ``chunk_sizes="auto"`` reader.
"""

import collections
import threading

__all__ = ["Step", "Outcome", "running", "current", "is_running", "merged"]


class Step:
    """What one forward decided and found.

    ``wrapper``: the DataParallel running it. ``fresh``: its replicas are built afresh instead of taken from the
    wrapper's kept set (a call re-entered while the outer one holds the set, or the forward of a replicated wrapper).
    ``loss``: the per-replica loss (``fastdp._balance.replica_loss.PerReplicaLoss``) or None. After the scatter:
    ``chunk_sizes`` (per device_ids position, None for torch.chunk's rule), then the plan: ``run`` (the positions with a
    chunk), ``positions`` (the positions replicated to: ``run``, with position 0 in front when it has no chunk, because
    replication starts from the master there), ``replicated`` (their devices), ``skip`` (1 when that replica is built
    but not run) and ``devices`` (the devices of the replicas that run). At the end: ``avoided_gather_bytes``, the
    outputs a per-replica loss did not gather (0 for a criterion computed on the gathered output, None without one).
    ``recorder``: the wrapper's fastdp._report.recorder.Recorder while the step records (None otherwise), and ``site``,
    what runs each replica then. ``publish``: called with the step's :data:`Outcome` when it ends (the wrapper keeps
    it).
    """

    __slots__ = ("wrapper", "fresh", "loss", "chunk_sizes", "run", "positions", "replicated", "skip", "devices",
                 "avoided_gather_bytes", "recorder", "site", "publish")

    def __init__(self, wrapper, loss, publish):
        self.wrapper = wrapper
        self.publish = publish
        self.fresh = False  # decided when the step starts running (DataParallel._run_step)
        self.loss = loss
        self.chunk_sizes = None
        self.run = self.positions = self.replicated = self.devices = None
        self.skip = 0
        self.avoided_gather_bytes = None
        self.recorder = self.site = None

    def push(self):
        """Puts the step on this thread's stack of running steps; returns the stack as it was, for the caller to
        put back itself when the step ends.

        NOTE [an interrupt as a step ends]
        Ctrl-C is raised in whatever Python code the main thread runs next, the first line of a function included:
        a ``with`` block's ``__exit__`` can be interrupted before its first statement runs. A step taken off the
        stack there would stay on it, and every later forward of its wrapper would take itself for a re-entered
        call (replicating afresh, without the wrapper's lock). So the caller puts the stack back in its own
        ``finally``, as that block's first statement, with no call before it (``running.steps = outer``), then
        calls ``finish``."""
        outer = running.steps
        running.steps = outer + (self,)
        return outer

    def finish(self):
        """Hands what the step found to the wrapper, once it is off the stack."""
        self.publish(Outcome(self.chunk_sizes, self.avoided_gather_bytes, self.run))

    def plan(self, nchunks, device_ids):
        """Which devices run a replica: those with a non-empty chunk (all ``nchunks`` under torch.chunk's rule)."""
        run = list(range(nchunks))
        sizes = self.chunk_sizes
        if sizes is not None and 0 in sizes:
            run = [i for i in run if sizes[i] > 0]
        self.run = run
        self.positions = run if run[0] == 0 else [0] + run
        self.skip = len(self.positions) - len(run)
        self.replicated = [device_ids[i] for i in self.positions]
        self.devices = self.replicated[self.skip:]

    def chunks_that_run(self, per_chunk):
        """The entries of the chunks that run."""
        if len(self.run) == len(per_chunk):
            return per_chunk
        return tuple(per_chunk[i] for i in self.run)


Outcome = collections.namedtuple("Outcome", ["chunk_sizes", "avoided_gather_bytes", "run"], defaults=(None,))
Outcome.__doc__ = """What a wrapper's forwards found, kept after them by the wrapper:
``chunk_sizes``, the split of the last forward that split the batch (None: torch.chunk's rule);
``avoided_gather_bytes``, the outputs the last forward with a criterion did not gather (0 when the criterion ran on
the gathered output); ``run``, the positions whose replica that forward ran (None before its plan). Plain values:
no reference to a step's objects."""


def merged(last, outcome):
    """The wrapper's Outcome after a forward that found `outcome`, its last one being `last` (None before the first):
    a forward without a criterion keeps the last one's ``avoided_gather_bytes``."""
    if outcome.avoided_gather_bytes is None and last is not None:
        return outcome._replace(avoided_gather_bytes=last.avoided_gather_bytes)
    return outcome


class _Running(threading.local):
    """Per thread: the steps running in this thread or in a caller waiting on it, innermost last."""

    def __init__(self):
        self.steps = ()


running = _Running()


def current(wrapper):
    """The innermost running step of ``wrapper`` seen from this thread, or None outside its forward."""
    for step in reversed(running.steps):
        if step.wrapper is wrapper:
            return step
    return None


def is_running(wrapper):
    """Whether a forward of ``wrapper`` runs in this thread or in a caller waiting on it (a re-entered call)."""
    return any(step.wrapper is wrapper for step in running.steps)
