"""Where torch.compile stops: the wrapper's forward is never traced by Dynamo.

NOTE [compile boundary]
torch.compile never traces into the wrapper (fastdp's C calls, its thread pool and its replica bookkeeping are not
traceable: 31 graph breaks when Dynamo first traces a 2-replica wrapper, 1 with this boundary;
tests/test_compile.py). A compiled program calling the wrapper breaks its graph once there; the replicas run
compiled code when the module is a torch.compile module (``DataParallel(torch.compile(m))``).

``torch.compiler.disable`` draws that line, but its wrapper switches Dynamo's frame hook off and on around every
call, which in eager mode (no hook installed) is most of a small model's forward cost over the bare model. So the
forward asks first whether Dynamo could be at work: ``is_compiling()`` (Dynamo answers True while it traces, so
tracing reaches the disabled call and breaks the graph there) or a frame hook installed (a compiled function's
code calling the wrapper after its graph break, or any frame while torch.compile runs). Only then does it run
through the disabled wrapper; the forward's own frame is one Dynamo never compiles (``skip_frame``), so the question
itself is never traced.
"""

import torch

__all__ = ["outside_dynamo", "skip_frame", "is_compiling", "frame_hook"]

_compiler = getattr(torch, "compiler", None)
is_compiling = getattr(_compiler, "is_compiling", None) or (lambda: False)
# Dynamo's frame hook in this thread (None when no torch.compile'd code is running); a torch without Dynamo: None.
frame_hook = getattr(getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None), "get_eval_frame_callback",
                     None) or (lambda: None)


def outside_dynamo(fn):
    """``fn`` run with Dynamo's frame hook off, and never inlined by Dynamo: a graph break where it is called."""
    disable = getattr(_compiler, "disable", None)
    return disable(fn, recursive=True) if disable is not None else fn


def skip_frame(fn):
    """``fn``'s own frame is never compiled by Dynamo (the functions it calls are, unless the hook is off)."""
    try:
        from torch._dynamo.eval_frame import skip_code
    except ImportError:  # a torch without Dynamo: nothing to skip
        return fn
    skip_code(fn.__code__)
    return fn
