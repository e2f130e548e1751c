"""The wrapper's own ``dp(x)``: ``nn.Module.__call__`` reduced to the call of ``forward`` when none of it applies.

NOTE [the wrapper's own call]
``Module.__call__`` passes through two Python frames, the JIT tracer's state and eight hook dicts before
``forward`` runs: on one device, a noticeable part of what the wrapper adds to a small model's step. Where it would
do nothing but call ``forward``, the wrapper calls ``forward`` itself. Not while the JIT traces (``_slow_forward``
records the wrapper's scope), not after ``dp.compile()``, and not while any forward or backward hook is registered
on the wrapper or globally (``register_module_forward_hook`` and friends); a torch whose modules lack one of those
dicts takes torch's call every time. Those cases run ``Module.__call__`` as it stands then, a patched one included.
"""

import torch
from torch.nn.modules import module as _module

from .._platform import compiler as _compiler

__all__ = ["call"]

_tracing = getattr(torch._C, "_get_tracing_state", None) or (lambda: None)
# torch mutates the global hook dicts in place (registration adds, a handle's remove() deletes): held once, read
# on every call.
_fpre, _fwd, _bpre, _bwd = (getattr(_module, name, None) for name in (
    "_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks", "_global_backward_hooks"))
_PLAIN_CALL_POSSIBLE = None not in (_fpre, _fwd, _bpre, _bwd)


@_compiler.skip_frame  # a frame Dynamo never compiles: a compiled caller breaks its graph once, in forward
def call(self, *args, **kwargs):
    """``Module.__call__`` for the wrapper: its ``forward`` at once when torch's call would only call it."""
    d = self.__dict__
    get = d.get
    if (not _PLAIN_CALL_POSSIBLE or _fpre or _fwd or _bpre or _bwd or get("_forward_pre_hooks", True)
            or get("_forward_hooks", True) or get("_backward_pre_hooks", True) or get("_backward_hooks", True)
            or get("_compiled_call_impl") is not None or _tracing() is not None):
        return _module.Module.__call__(self, *args, **kwargs)
    return self.forward(*args, **kwargs)
