"""fastdp.patch(): code that calls ``torch.nn.DataParallel`` itself (a library's trainer, an old script) gets
fastdp's wrapper without being edited.

While patched, ``torch.nn.DataParallel``, ``torch.nn.parallel.DataParallel`` and the class and function of the
``torch.nn.parallel.data_parallel`` module resolve to ``fastdp.DataParallel`` and ``fastdp.data_parallel``, so
code that looks the names up when it runs builds fastdp wrappers, and its ``isinstance(m, torch.nn.DataParallel)``
checks hold for them (``m.module`` unwraps them as before). Code that bound the upstream class to a name of its
own before the patch (``from torch.nn import DataParallel`` at import time) keeps upstream's class: patch first,
then import such code. ``unpatch()`` puts every name back; ``with fastdp.patched():`` patches for a block and then
restores what was there before it.
"""

import contextlib
import sys
import threading

import torch

from .data_parallel import DataParallel, data_parallel

__all__ = ["patch", "unpatch", "patched", "is_patched"]

_lock = threading.Lock()
_saved = None  # [(namespace, name, upstream value)] while patched, else None


def _targets():
    """(namespace, attribute, fastdp's replacement) for every place upstream's names are looked up."""
    dp_module = sys.modules["torch.nn.parallel.data_parallel"]
    return [
        (torch.nn, "DataParallel", DataParallel),
        (torch.nn.parallel, "DataParallel", DataParallel),
        (torch.nn.parallel, "data_parallel", data_parallel),
        (dp_module, "DataParallel", DataParallel),
        (dp_module, "data_parallel", data_parallel),
    ]


def patch():
    """Makes torch's DataParallel names resolve to fastdp's until ``unpatch()``; patching twice changes nothing."""
    global _saved
    with _lock:
        if _saved is not None:
            return
        targets = _targets()
        _saved = [(ns, name, getattr(ns, name)) for ns, name, _ in targets]
        for ns, name, ours in targets:
            setattr(ns, name, ours)


def unpatch():
    """Puts torch's own DataParallel names back; a no-op when not patched."""
    global _saved
    with _lock:
        if _saved is None:
            return
        for ns, name, upstream in _saved:
            setattr(ns, name, upstream)
        _saved = None


def is_patched():
    """True while torch's DataParallel names resolve to fastdp's."""
    return _saved is not None


@contextlib.contextmanager
def patched():
    """``with fastdp.patched():`` torch's DataParallel names are fastdp's inside the block; afterwards they are
    what they were before it (still patched when the block began patched)."""
    was = is_patched()
    patch()
    try:
        yield
    finally:
        if not was:
            unpatch()
