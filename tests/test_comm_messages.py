"""fastdp.comm's errors, whole messages, against upstream torch.nn.parallel.comm on the same bad input where upstream
raises on a CPU-only machine (its Python-side checks; meta tensors stand in for CUDA ones where upstream asserts GPUs
before its check), else against the texts of upstream's comm.cpp checks (CONTRACT below: comm.cpp needs CUDA to run)."""

import pytest
import torch
import torch.nn.parallel.comm as upstream

from fastdp import comm


def _raised(fn):
    with pytest.raises(Exception) as info:
        fn()
    return type(info.value), str(info.value)


x = torch.arange(6.0).view(2, 3)
outs = [torch.zeros(2, 3)]  # one object for both sides: its repr is part of the message


def _meta(t):
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


# (name, fastdp call, upstream call): the same arguments, or meta twins where upstream asserts GPU inputs first
SAME_AS_UPSTREAM = [
    ("broadcast/neither", lambda m: m.broadcast(x)),
    ("broadcast/both", lambda m: m.broadcast(x, ["cpu"], out=outs)),
    ("scatter/out-and-devices", lambda m: m.scatter(x, ["cpu"], out=outs)),
    ("scatter/out-and-chunk-sizes", lambda m: m.scatter(x, chunk_sizes=[2], out=outs)),
    ("gather/out-and-destination", lambda m: m.gather([x], destination="cpu", out=outs[0])),
]


@pytest.mark.parametrize("name,call", SAME_AS_UPSTREAM, ids=[c[0] for c in SAME_AS_UPSTREAM])
def test_message_equals_upstream(name, call):
    assert _raised(lambda: call(comm)) == _raised(lambda: call(upstream))


def test_reduce_add_size_message_equals_upstream():
    a, b = torch.ones(2, 3), torch.ones(3, 2)
    ours = _raised(lambda: comm.reduce_add([a, b], "cpu"))
    theirs = _raised(lambda: upstream.reduce_add([_meta(a), _meta(b)], 0))
    assert ours == theirs


def test_reduce_add_coalesced_size_message_equals_upstream_reduce_add():
    """Ours checks each column with reduce_add's words: what upstream's reduce_add raises for that column (upstream's
    reduce_add_coalesced, given meta twins, stops earlier at its destination)."""
    a, b = torch.ones(2, 3), torch.ones(3, 2)
    ours = _raised(lambda: comm.reduce_add_coalesced([[a], [b]], "cpu"))
    theirs = _raised(lambda: upstream.reduce_add([_meta(a), _meta(b)], 0))
    assert ours == theirs


# Texts of upstream's comm.cpp checks (torch/csrc/cuda/comm.cpp), which upstream raises as RuntimeError.
CONTRACT = [
    ("scatter/no-devices", lambda: comm.scatter(x, []), "Expected at least one device to scatter to"),
    ("scatter/no-outputs", lambda: comm.scatter(x, out=[]), "Expected at least one output tensor to scatter to"),
    ("gather/no-inputs", lambda: comm.gather([]), "Expected at least one tensor to gather from"),
    ("scatter/out-total", lambda: comm.scatter(x, out=[torch.empty(1, 3)]),
     "Total size for output tensors along scatter dim 0 does not match the source tensor size at dim 0. "
     "Expected 2, but got total size 1."),
    ("scatter/out-total-over", lambda: comm.scatter(x, dim=1, out=[torch.empty(2, 2), torch.empty(2, 2)]),
     "Total size for output tensors along scatter dim 1 does not match the source tensor size at dim 1. "
     "Expected 3, but got total size 4."),
]


@pytest.mark.parametrize("name,call,text", CONTRACT, ids=[c[0] for c in CONTRACT])
def test_message_equals_contract(name, call, text):
    assert _raised(call) == (RuntimeError, text)


def test_scatter_total_is_the_cores_check():
    """The core owns the chunks' total: called directly it raises the same text (as ValueError, the binding's
    type for invalid arguments); comm.scatter raises it as upstream's RuntimeError and does not check it itself."""
    from fastdp._native import route as _route

    text = _raised(lambda: comm.scatter(x, out=[torch.empty(1, 3)]))[1]
    typ, direct = _raised(lambda: _route.scatter(x, [torch.empty(1, 3)], 0, [1], None))
    assert (typ, direct) == (ValueError, text)
