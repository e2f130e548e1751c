"""Replicas' own hook dicts: a hook a replica registers on itself during ``forward`` (transformers installs its
output-capturing hooks lazily that way) stays on that replica for that step and never lands on the master.

``Module._replicate_for_data_parallel`` (and upstream's replicas) share the master's hook dicts, so such hooks
pile up on the master, one set per replica per step. fastdp gives each replica its own dict objects holding the
master's hooks: kept replicas get them refilled by ``_C.refresh`` every step (two size reads per dict when both are
empty), fresh ones get copies when built.
"""

from torch.utils.hooks import RemovableHandle as _RemovableHandle

from .. import _C

# The hook dicts Module.__init__ creates that forward and backward read (state-dict hooks are never run by a
# replica). Listed in the order torch creates them.
KEYS = ("_backward_pre_hooks", "_backward_hooks", "_forward_hooks", "_forward_hooks_with_kwargs",
        "_forward_hooks_always_called", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs")


def own(master, replica):
    """Gives `replica` (a shallow copy of `master`) its own copies of master's hook dicts."""
    mine, theirs = replica.__dict__, master.__dict__
    for key in KEYS:
        d = theirs.get(key)
        if d is not None and mine.get(key) is d:
            mine[key] = type(d)(d)


def clear_tensor_hooks(tensors, cleared_at):
    """Empties the hook dicts of `tensors` (kept replica tensors: a hook a forward registers on one lasts that step),
    unless none can hold a hook registered since they were last emptied: every hook torch's API registers comes with
    a ``RemovableHandle``, whose class counts them, and `cleared_at` is that count after the last emptying (None: not
    yet). Returns the count now, for the next call."""
    made = getattr(_RemovableHandle, "next_id", None)
    if made is None or made != cleared_at:
        _C.clear_hooks(tensors)
        made = getattr(_RemovableHandle, "next_id", None)
    return made
