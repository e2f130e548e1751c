"""Replicas' own hook dicts: a hook a replica registers on itself during ``forward`` (transformers installs its
output-capturing hooks lazily that way) stays on that replica for that step and never lands on the master.

``Module._replicate_for_data_parallel`` (and upstream's replicas) share the master's hook dicts, so such hooks
pile up on the master, one set per replica per step. fastdp gives each replica its own dict objects holding the
master's hooks: kept replicas get them refilled by ``_C.refresh`` whenever the master's changed or a hook was
registered since (two size reads per dict when both are empty), fresh ones get copies when built.
"""

import threading

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


# Handles made by on_node: hooks on a step's autograd nodes (the report's marks), never in a module's or a tensor's
# hook dict. The lock makes a registration and its count one step for handles_made, whichever threads register.
_node_handles = 0
_count_lock = threading.Lock()


def on_node(node, hook, pre=False):
    """Registers `hook` on autograd node `node` for fastdp's own use (with `pre`, as a pre-hook), and returns its
    handle. Such a handle holds no hook of a module or a tensor, so it does not count in handles_made: a recording
    step does not make the next one empty every kept tensor's hook dict or read every replica's."""
    global _node_handles
    with _count_lock:
        handle = node.register_prehook(hook) if pre else node.register_hook(hook)
        _node_handles += 1
    return handle


def handles_made():
    """How many hook handles torch made that may hold a module's or a tensor's hook (None where torch does not count
    them): every registration through torch's API makes one; those on_node made are left out."""
    with _count_lock:
        made = getattr(_RemovableHandle, "next_id", None)
        return None if made is None else made - _node_handles


def clear_tensor_hooks(tensors, cleared_at):
    """Empties the hook dicts of `tensors` (kept replica tensors: a hook a forward registers on one lasts that step),
    unless none can hold a hook registered since they were last emptied: every hook torch's API registers comes with
    a ``RemovableHandle``, whose class counts them, and `cleared_at` is that count, less fastdp's own hooks on nodes
    (on_node), after the last emptying (None: not yet). Returns the count now, for the next call."""
    made = handles_made()
    if made is None or made != cleared_at:
        _C.clear_hooks(tensors)
        made = handles_made()
    return made
