"""``replicate(network, devices, detach=False)``: per-device copies of a module tree, as torch.nn.parallel builds them.

Each replica is a shallow copy (``Module._replicate_for_data_parallel``) whose parameters and buffers are
broadcast copies: replica 0 shares storage with the master, the others have their own. With ``detach=False``
parameters (and buffers that require grad) come from one ``Broadcast`` node, so gradients are summed back onto
the master. Deliberate difference: a replica's ``parameters()`` yields its parameter copies (upstream: nothing).
"""

from collections import OrderedDict

import torch
from torch.nn.parameter import is_lazy

from . import _devices
from ._functions import Broadcast, broadcast_coalesced

__all__ = ["replicate"]


def _is_script_module(module):
    return isinstance(module, torch.jit.ScriptModule)


def _check_replicatable(network):
    """Upstream refuses a ScriptModule that has plain Python modules below it."""
    for module in network.modules():
        if _is_script_module(module):
            for sub in module.modules():
                if not _is_script_module(sub):
                    raise RuntimeError("Cannot replicate network where python modules are children of ScriptModule")


def _check_initialized(tensors):
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
    _check_initialized(params)
    _check_initialized(buffers)
    # Buffers that require grad travel with the parameters, through the differentiable broadcast.
    grad_tensors = params + [b for b in buffers if b.requires_grad and not detach]
    other_buffers = [b for b in buffers if not (b.requires_grad and not detach)]
    index = {id(t): i for i, t in enumerate(grad_tensors)}
    other_index = {id(t): i for i, t in enumerate(other_buffers)}
    copies = _broadcast(grad_tensors, devices, detach)
    other_copies = _broadcast(other_buffers, devices, True)

    modules = list(network.modules())
    module_index = {id(m): i for i, m in enumerate(modules)}
    module_copies = [[m._replicate_for_data_parallel() for m in modules] for _ in range(num_replicas)]
    for j in range(num_replicas):
        for replica in module_copies[j]:
            if not _is_script_module(replica):
                replica._former_parameters = OrderedDict()

    for i, module in enumerate(modules):
        for key, child in module._modules.items():
            for j in range(num_replicas):
                replica = module_copies[j][i]
                if child is None:
                    replica._modules[key] = None
                else:
                    setattr(replica, key, module_copies[j][module_index[id(child)]])
        for key, param in module._parameters.items():
            for j in range(num_replicas):
                replica = module_copies[j][i]
                if param is None:
                    replica._parameters[key] = None
                else:
                    _set_parameter(replica, key, copies[j][index[id(param)]])
        for key, buf in module._buffers.items():
            for j in range(num_replicas):
                replica = module_copies[j][i]
                if buf is None:
                    replica._buffers[key] = None
                elif id(buf) in index:
                    setattr(replica, key, copies[j][index[id(buf)]])
                else:
                    setattr(replica, key, other_copies[j][other_index[id(buf)]])

    return [module_copies[j][0] for j in range(num_replicas)]
