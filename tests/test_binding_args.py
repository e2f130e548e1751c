"""Argument parsing of fastdp._C (the "O&" converters of csrc/python/tensors.c): the errors it raises for a bad
argument name that argument, on either tensor path."""

import operator

import pytest
import torch

from fastdp import _C


@pytest.mark.parametrize("item", [None, 3, [0, 1], torch.ones(2)], ids=lambda v: type(v).__name__)
def test_stream_entries_must_be_tuples(item):
    """Was a SystemError from PyArg_ParseTuple on a non-tuple; now a TypeError naming the entry."""
    with pytest.raises(TypeError) as info:
        _C.copy([torch.zeros(2)], [torch.ones(2)], [(0, 0), item])
    assert str(info.value) == f"streams[1] must be a (device, handle) tuple, got {type(item).__name__}"


@pytest.mark.parametrize("item", [(0,), (0, 0, 0), ()], ids=len)
def test_stream_entries_must_be_pairs(item):
    """A tuple of another length names the entry too (PyArg_ParseTuple's own text did not)."""
    with pytest.raises(TypeError) as info:
        _C.copy([torch.zeros(2)], [torch.ones(2)], [(0, 0), item])
    assert str(info.value) == f"streams[1] must be a (device, handle) tuple, got a tuple of {len(item)} items"


def test_chunk_sizes_length_is_checked_before_its_items():
    """The length message comes first, as before the converters, even when the items are not ints either."""
    with pytest.raises(ValueError) as info:
        _C.scatter(torch.ones(4), [torch.zeros(2), torch.zeros(2)], 0, ["a"])
    assert str(info.value) == "Expected devices and chunk_sizes to be of same length"
    with pytest.raises(TypeError) as python:  # Python's own text for a str where an index is expected
        operator.index("a")
    with pytest.raises(TypeError) as info:
        _C.scatter(torch.ones(4), [torch.zeros(2), torch.zeros(2)], 0, ["a", 2])
    assert str(info.value) == str(python.value)


def test_scatter_after_a_failed_chunk_sizes_call_still_works():
    """The converters' cleanup left nothing half-made: the next call with good arguments gives torch's result."""
    src = torch.arange(6.0)
    outs = [torch.zeros(2), torch.zeros(4)]
    for bad in (["a", 1], [1], None):
        with pytest.raises((TypeError, ValueError)):
            _C.scatter(src, outs, 0, bad)
    _C.scatter(src, outs, 0, [2, 4])
    assert torch.equal(torch.cat(outs), src)
