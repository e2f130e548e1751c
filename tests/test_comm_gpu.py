"""fastdp.comm on CUDA against torch.nn.parallel.comm: one device ([0]) and repeated ids ([0, 0, 0]) through the
cuda backend; on two or more GPUs, nccl across distinct devices (a one-GPU machine reaches NCCL only through the
one-rank self-test of scripts/gpu/nccl_selftest.c in the GPU check). Skipped without a GPU; nothing here touches
CUDA at collection."""

import functools

import pytest
import torch
import torch.nn.parallel.comm as upstream

import fastdp
from fastdp import comm

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int16, torch.int32, torch.int64,
          torch.uint8, torch.bool]


def make(shape, dtype, seed=0, device="cuda:0"):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        t = torch.randint(0, 2, shape, generator=g).bool()
    elif dtype.is_floating_point:
        t = (torch.randn(shape, generator=g) * 100).to(dtype)
    else:
        t = torch.randint(0, 100, shape, generator=g).to(dtype)
    return t.to(device)


def test_backends_usable():
    info = fastdp.info()
    assert info["backends"]["cuda"]["usable"], info["backends"]["cuda"]["why"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("devices", [[0], [0, 0, 0]])
def test_broadcast_matches_upstream(dtype, devices):
    x = make((33, 7), dtype)
    ours = comm.broadcast(x, devices)
    assert ours[0] is x
    for o in ours[1:]:
        assert o.device == x.device and o.data_ptr() != x.data_ptr() and torch.equal(o, x)
    if dtype != torch.int16 and len(devices) == 1:
        theirs = upstream.broadcast(x, devices)
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [2, 3, 5])
def test_reduce_add_repeated_ids_bit_exact(dtype, n):
    inputs = [make((1001,), dtype, seed=k) for k in range(n)]
    ours = comm.reduce_add(inputs, destination=0)
    ref = functools.reduce(torch.add, inputs)  # torch's in-order a + b + c on the GPU
    assert ours.dtype == ref.dtype and torch.equal(ours, ref)


@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("devices", [[0], [0, 0, 0]])
def test_scatter_gather_match_upstream(dim, devices):
    x = make((9, 6, 5), torch.float32)
    ours = comm.scatter(x, devices, dim=dim)
    for o, r in zip(ours, torch.chunk(x, len(devices), dim)):
        assert torch.equal(o, r)
    back = comm.gather(list(ours), dim=dim, destination=0)
    assert torch.equal(back, x)
    cpu = comm.gather(list(ours), dim=dim, destination="cpu")
    assert cpu.device.type == "cpu" and torch.equal(cpu, x.cpu())
    if len(devices) == 1:
        assert torch.equal(upstream.gather(list(ours), dim=dim, destination=0), back)


def test_cpu_source_scatter_and_strided_copies():
    x = torch.randn(8, 12)[:, ::2]  # strided host source
    outs = comm.scatter(x, [0, 0], dim=1)
    for o, r in zip(outs, torch.chunk(x, 2, 1)):
        assert o.is_cuda and torch.equal(o.cpu(), r)
    t = make((6, 10), torch.float64).t()
    outs = comm.broadcast(t, [0, 0])
    assert torch.equal(outs[1], t)


@pytest.mark.parametrize("buffer_size", [64, 10485760])
def test_coalesced_repeated_ids(buffer_size):
    ts = [make((5, 3), torch.float32, 1), make((7,), torch.int64, 2), make((4,), torch.float16, 3),
          make((3,), torch.int16, 4)]
    outs = comm.broadcast_coalesced(ts, [0, 0, 0], buffer_size=buffer_size)
    for row in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(row, ts))
    red = comm.reduce_add_coalesced([ts, ts, ts], destination=0, buffer_size=buffer_size)
    for r, t in zip(red, ts):
        assert torch.equal(r, t + t + t)


@pytest.mark.multi_gpu
def test_nccl_two_devices_match_upstream():
    x = make((1024, 33), torch.float32)
    ours = comm.broadcast(x, [0, 1])
    theirs = upstream.broadcast(x, [0, 1])
    assert torch.equal(ours[1].cpu(), theirs[1].cpu())
    ins = [make((4096,), torch.float32, 1, "cuda:0"), make((4096,), torch.float32, 2, "cuda:1")]
    torch.testing.assert_close(comm.reduce_add(ins, 0), upstream.reduce_add(ins, 0), rtol=0, atol=0)
    shorts = [make((100,), torch.int16, 1, "cuda:0"), make((100,), torch.int16, 2, "cuda:1")]
    assert torch.equal(comm.reduce_add(shorts, 0), shorts[0] + shorts[1].to(0))


def test_dataparallel_repeated_ids_matches_upstream():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).cuda()
    ref = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).cuda()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(30, 16, device="cuda")
    ours = fastdp.DataParallel(model, device_ids=[0, 0, 0])
    theirs = torch.nn.DataParallel(ref, device_ids=[0, 0, 0])
    ours(x).square().sum().backward()
    theirs(x).square().sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
