"""A device that receives no rows in a step (``chunk_sizes`` with a zero, a batch smaller than the device count under
torch.chunk's rule, a rescue that moved rows away) keeps the device list of the gradient reduction: every bucket is
summed over every device of the replica set, zeros standing in for the idle device's gradients. Across distinct
CUDA devices the sum is one NCCL collective per device list, and a list NCCL has not seen sets up a communicator set
of its own (ncclCommInitAll: memory on every device, and seconds) in the middle of backward; a sum over a column
that lacks a device is such a list.

Run on the recording fake of torch.cuda (tests/_fake_cuda.py, conftest's ``cuda3``: three devices) with the
reduction's CUDA path (its own streams, its stream-ordered releases), over host tensors; the columns each core call sums are what the
core would hand NCCL. References: the bare model's gradients over the same rows.
"""

import copy

import pytest
import torch
import torch.nn as nn

from fastdp._platform import devices as _devices
from fastdp._reduction import reducer as _reducer, cuda as _rcuda, sums as _sums
from fastdp._step import replicas as _replicas

pytestmark = pytest.mark.sim


def _cuda_replica_set(net, ndev):
    """A ReplicaSet built over host tensors whose state then says CUDA devices 0..ndev-1 (the tensors stay on the
    host; every torch.cuda call goes to the fake)."""
    devices = list(range(ndev))
    rs = _replicas.ReplicaSet(net, [_devices.CPU] * ndev, 1 << 20)
    rs.state.devices = devices
    rs.state.host = False
    reducer = _reducer.Reducer(devices, rs.state.tdevs, net)
    reducer.host, reducer.runner = False, _rcuda.CudaStreams(devices)
    rs.reducer, rs.reduced = reducer, [reducer.bucket(b) for b in rs.layout[0]]
    return rs


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))


def _count_columns(monkeypatch):
    """The number of inputs of every column the core is asked to sum (one per device the column's sum spans)."""
    columns = []
    real = _sums.reduce_columns

    def spy(cols, outs):
        columns.extend(len(c) for c in cols)
        return real(cols, outs)

    monkeypatch.setattr(_sums, "reduce_columns", spy)
    return columns


@pytest.mark.parametrize("idle", [1, 2])
def test_a_device_without_rows_is_summed_as_zeros_over_the_full_device_list(cuda3, monkeypatch, idle):
    net = _net()
    bare = copy.deepcopy(net)
    rs = _cuda_replica_set(net, 3)
    columns = _count_columns(monkeypatch)
    x = torch.randn(6, 4)
    chunks = {0: x[:3], 1: x[3:], 2: x[3:]}
    chunks[idle] = None
    for _ in range(2):
        roots = rs.refresh()
        out = sum(roots[r](c).pow(2).sum() for r, c in chunks.items() if c is not None)
        out.backward()
        (bare(x[:3]).pow(2).sum() + bare(x[3:]).pow(2).sum()).backward()
    assert columns and all(n == 3 for n in columns), columns
    for p, q in zip(net.parameters(), bare.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    assert cuda3.host_syncs() == []


def test_a_parameter_one_replica_did_not_use_is_summed_over_the_full_device_list(cuda3, monkeypatch):
    """A parameter a replica's forward skipped (a branch its chunk did not take) gives no gradient there: zeros stand
    in for it too."""

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 3)

        def forward(self, x, use_b):
            return self.a(x) + (self.b(x) if use_b else 0)

    net = Branchy()
    bare = copy.deepcopy(net)
    rs = _cuda_replica_set(net, 3)
    columns = _count_columns(monkeypatch)
    x = torch.randn(6, 4)
    roots = rs.refresh()
    uses = [True, False, True]
    sum(roots[r](x[2 * r:2 * r + 2], uses[r]).pow(2).sum() for r in range(3)).backward()
    sum(bare(x[2 * r:2 * r + 2], uses[r]).pow(2).sum() for r in range(3)).backward()
    assert columns and all(n == 3 for n in columns), columns
    for p, q in zip(net.parameters(), bare.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
