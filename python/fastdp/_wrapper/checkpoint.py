"""Checkpoint keys of a wrapped module: DataParallel's "module." prefix and torch.compile's "_orig_mod.".

The wrappers' ``state_dict()`` has the bare model's keys; ``load_state_dict`` accepts those and the prefixed forms
(checkpoints of ``torch.nn.DataParallel``, of a compiled module); a wrapper that is a submodule of another model
loads the other model's checkpoint through ``nested_load_pre_hook``.
"""

from collections import OrderedDict

from ..replicate import is_compiled

__all__ = ["PREFIX", "COMPILED_PREFIX", "has_module_prefix", "strip_prefix", "uncompiled", "load",
           "nested_load_pre_hook"]

PREFIX = "module."
COMPILED_PREFIX = "_orig_mod."


def has_module_prefix(keys, expected, prefix=PREFIX):
    """Whether checkpoint keys carry DataParallel's "module." prefix (or torch.compile's "_orig_mod."), judged
    against the module's own keys."""
    keys = list(keys)
    if not keys or not all(k.startswith(prefix) for k in keys):
        return False
    # A module whose own child is named "module" has prefix-free keys that start with "module." too.
    if all(k in expected for k in keys) and not all(k[len(prefix) :] in expected for k in keys):
        return False
    return True


def strip_prefix(state_dict, prefix=PREFIX):
    """A copy of a "module."-prefixed (or other prefixed) state dict without the prefix, metadata included."""
    out = OrderedDict((k[len(prefix) :], v) for k, v in state_dict.items())
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        stripped = OrderedDict()
        for k, v in metadata.items():
            if k == prefix[:-1]:
                stripped[""] = v
            elif k.startswith(prefix):
                stripped[k[len(prefix) :]] = v
        out._metadata = stripped
    return out


def uncompiled(module):
    """The module under torch.compile's wrapper(s): checkpoints carry its keys, as the bare model's."""
    while is_compiled(module):
        module = module._orig_mod
    return module


def load(module, state_dict, *, strict, assign):
    """Loads a plain or a "module."-prefixed state dict into ``module`` (errors name plain keys); for a compiled
    module, "_orig_mod."-prefixed keys (torch.compile's own checkpoints) are accepted too."""
    target = uncompiled(module)
    expected = set(target.state_dict(keep_vars=True).keys())
    if has_module_prefix(state_dict.keys(), expected):
        state_dict = strip_prefix(state_dict)
    while target is not module and has_module_prefix(state_dict.keys(), expected, COMPILED_PREFIX):
        state_dict = strip_prefix(state_dict, COMPILED_PREFIX)
    return target.load_state_dict(state_dict, strict=strict, assign=assign)


def nested_load_pre_hook(wrapper, state_dict, prefix, *unused):
    """When the wrapper is a submodule, adds "module." to prefix-free keys under it so nested loads match.

    Registered with ``with_module=True``: torch holds the wrapper weakly (no reference cycle) and re-binds it
    when the wrapper is pickled or deep-copied.
    """
    keys = [k for k in state_dict if k.startswith(prefix)]
    relative = [k[len(prefix) :] for k in keys]
    if not keys:
        return
    expected = set(wrapper.module.state_dict(keep_vars=True).keys())
    if has_module_prefix(relative, expected):
        return
    for key, rel in zip(keys, relative):
        state_dict[prefix + PREFIX + rel] = state_dict.pop(key)
