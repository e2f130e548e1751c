"""``replicate(network, devices, detach=False)``: per-device copies of a module tree, as torch.nn.parallel builds them.

Each replica is a shallow copy (``Module._replicate_for_data_parallel``) whose parameters and buffers are
broadcast copies: replica 0 shares storage with the master, the others have their own (a buffer each on storage of
its own). With ``detach=False``
parameters (and buffers that require grad) come from one ``Broadcast`` node, so gradients are summed back onto
the master. Deliberate difference: a replica's ``parameters()`` yields its parameter copies (upstream: nothing).
"""

from collections import OrderedDict

import torch
from torch.nn.parameter import is_lazy

from ._platform import devices as _devices
from ._step import hooks as _hooks
from ._step.functions import Broadcast, broadcast_coalesced

__all__ = ["replicate"]


def _is_script_module(module):
    return isinstance(module, torch.jit.ScriptModule)


try:  # torch.compile's module wrapper
    from torch._dynamo.eval_frame import OptimizedModule as _CompiledModule
except Exception:  # a torch without Dynamo
    _CompiledModule = None


def is_compiled(module):
    """Whether module is the wrapper torch.compile(module) returns (an OptimizedModule)."""
    return _CompiledModule is not None and isinstance(module, _CompiledModule)


def _compiled_replica(modules, index, row, i):
    """row[i], building the compiled wrapper there first when it is one (around row's replica of its module)."""
    if row[i] is None:
        m = modules[i]
        row[i] = _CompiledModule(_compiled_replica(modules, index, row, index[id(m._orig_mod)]), m.dynamo_ctx)
    return row[i]


def skeletons(modules, count):
    """``count`` rows of replica skeletons of ``modules`` (one list, parents before children, as ``modules()`` and
    ``_replicas.walk`` give): shallow copies with their children linked, parameters and buffers still to set.

    NOTE [compiled modules]: a ``torch.compile`` wrapper is not copied the usual way: its copy would share the
    master's child dict (the wrapper forwards attribute writes to the module it wraps) and call the master's
    compiled forward. Each row gets a new wrapper, with the master's compile settings, around that row's replica of
    the compiled module, so replicas run compiled code: Dynamo compiles each distinct input shape once and reuses
    it across replicas and steps (the replicas' parameters are graph inputs, not constants).
    """
    index = {id(m): i for i, m in enumerate(modules)}
    rows = []
    for _ in range(count):
        row = [None if is_compiled(m) else m._replicate_for_data_parallel() for m in modules]
        for i in range(len(modules)):
            _compiled_replica(modules, index, row, i)
        for i, m in enumerate(modules):
            if is_compiled(m):
                continue
            replica = row[i]
            script = _is_script_module(replica)
            if not script:
                replica._former_parameters = OrderedDict()
                _hooks.own(m, replica)  # hooks registered in forward stay on the replica (fastdp._step.hooks)
            for key, child in m._modules.items():
                if child is None:
                    replica._modules[key] = None
                elif script:
                    setattr(replica, key, row[index[id(child)]])
                else:
                    replica._modules[key] = row[index[id(child)]]
        rows.append(row)
    return rows


def _check_replicatable(network):
    """Upstream refuses a ScriptModule that has plain Python modules below it."""
    for module in network.modules():
        if _is_script_module(module):
            for sub in module.modules():
                if not _is_script_module(sub):
                    raise RuntimeError("Cannot replicate network where python modules are children of ScriptModule")


def check_initialized(tensors):
    for t in tensors:
        if is_lazy(t):
            # torch's own text for uninitialized (lazy) parameters and buffers.
            raise ValueError(
                "Attempted to use an uninitialized parameter in fastdp.replicate. This error happens when you are "
                "using a `LazyModule` or explicitly manipulating `torch.nn.parameter."
                f"{type(t).__name__}` objects. When using LazyModules Call `forward` with a dummy batch to "
                "initialize the parameters before calling torch functions"
            )


def _broadcast(tensors, devices, detach):
    """One list per device of the copies of ``tensors``; differentiable unless ``detach``."""
    if not tensors:
        return [[] for _ in devices]
    if detach:
        return broadcast_coalesced(tensors, devices)
    flat = Broadcast.apply(devices, *tensors)
    n = len(tensors)
    return [list(flat[k * n : (k + 1) * n]) for k in range(len(devices))]


def _own_storage(rows):
    """``rows`` (per device, the broadcast copies of the buffers; entry 0 the master's own) with every other device's
    copy on storage of its own, where the broadcast gives views of one flat buffer (as upstream's does): a forward
    that resizes a buffer in place (a quantization observer sizing its statistics per channel in its first forward,
    a lazily sized module) then grows that replica's buffer alone, as a kept replica's, instead of writing across the
    buffers next to it."""
    return [rows[0]] + [[t if t is None or t.is_sparse else t.clone() for t in row] for row in rows[1:]]


def _set_parameter(replica, key, value):
    """Registers a parameter copy so that replica.parameters() and RNN flat-weight lists see it."""
    if _is_script_module(replica):
        setattr(replica, key, value)
        return
    replica._parameters[key] = value
    replica._former_parameters[key] = value
    names = replica.__dict__.get("_flat_weights_names")
    if names is not None and key in names:
        replica._flat_weights[names.index(key)] = value


def _install_parameters(module, replicas, copies, index):
    """Sets module's parameters on its replicas (one per device) from the per-device copies."""
    for key, param in module._parameters.items():
        for replica, got in zip(replicas, copies):
            if param is None:
                replica._parameters[key] = None
            else:
                _set_parameter(replica, key, got[index[id(param)]])


def _install_buffers(module, replicas, grad, other):
    """Sets module's buffers on its replicas from the differentiable copies (buffers that require grad) or the
    detached ones; `grad` and `other` are (per-device copies, index by tensor id) pairs."""
    (copies, index), (other_copies, other_index) = grad, other
    for key, buf in module._buffers.items():
        for replica, got, other_got in zip(replicas, copies, other_copies):
            if buf is None:
                replica._buffers[key] = None
            elif id(buf) in index:
                setattr(replica, key, got[index[id(buf)]])
            else:
                setattr(replica, key, other_got[other_index[id(buf)]])


def replicate(network, devices, detach=False):
    """Returns one replica of ``network`` per entry of ``devices`` (ints, "cuda:k", torch.device or "cpu")."""
    if not isinstance(network, torch.nn.Module):
        raise TypeError(f"replicate: network must be a torch.nn.Module, got {type(network).__name__}")
    _check_replicatable(network)
    if not devices:
        return []
    devices = _devices.normalize_list(devices, "devices")
    num_replicas = len(devices)

    params = list(network.parameters())
    buffers = list(network.buffers())
    check_initialized(params)
    check_initialized(buffers)
    # Buffers that require grad travel with the parameters, through the differentiable broadcast.
    grad_tensors = params + [b for b in buffers if b.requires_grad and not detach]
    other_buffers = [b for b in buffers if not (b.requires_grad and not detach)]
    index = {id(t): i for i, t in enumerate(grad_tensors)}
    other_index = {id(t): i for i, t in enumerate(other_buffers)}
    copies = _broadcast(grad_tensors, devices, detach)
    other_copies = _own_storage(_broadcast(other_buffers, devices, True))

    modules = list(network.modules())
    module_copies = skeletons(modules, num_replicas)
    for i, module in enumerate(modules):
        replicas = [row[i] for row in module_copies]
        _install_parameters(module, replicas, copies, index)
        _install_buffers(module, replicas, (copies, index), (other_copies, other_index))

    return [module_copies[j][0] for j in range(num_replicas)]
