"""How ``fastdp.DataParallel`` stands to ``torch.nn.DataParallel``: a subclass for ``isinstance`` only, none of whose
members runs on a fastdp wrapper.

NOTE [nn.DataParallel subclass]: training scripts, accelerate, transformers and checkpoint helpers unwrap with
``isinstance(model, torch.nn.DataParallel)``; that holds because fastdp's class derives from torch's. Only the
relation is inherited: torch's constructor never runs (Module's does) and fastdp defines every method torch's class
has; ``detach`` makes any other member torch's class defines resolve to Module's, so a method torch adds to its
class later never runs on a fastdp wrapper. A metaclass ``__instancecheck__`` cannot do this: the check is answered
by torch's class's metaclass, which fastdp does not own.
"""

import importlib

from torch.nn.modules import Module

__all__ = ["UPSTREAM", "detach"]

UPSTREAM = importlib.import_module("torch.nn.parallel.data_parallel").DataParallel  # read before any patch()


def detach(cls, upstream=UPSTREAM):
    """Members of torch's DataParallel that ``cls`` does not define resolve to Module's (or are absent)."""
    kept = {"__module__", "__doc__", "__dict__", "__weakref__", "__orig_bases__", "__parameters__", "__annotations__",
            "__qualname__", "__firstlineno__", "__static_attributes__", "__type_params__"}
    for name in vars(upstream):
        if name in kept or name in vars(cls):
            continue
        for base in Module.__mro__:
            if name in vars(base):
                setattr(cls, name, vars(base)[name])
                break
        else:
            setattr(cls, name, _Absent(name))


class _Absent:
    """A member torch's DataParallel has and Module lacks: reads raise AttributeError, so the wrapper's attribute
    forwarding answers them from the wrapped module, as for any name the wrapper lacks."""

    def __init__(self, name):
        self.name = name

    def __get__(self, obj, owner=None):
        raise AttributeError(self.name)
