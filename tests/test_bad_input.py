"""Bad input to every public function: the exception type and a fragment of a message that names the argument
and, where there is one, the fix. One table row per case; each row is its own test."""

import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn

import fastdp
from fastdp import comm

CPU2 = ["cpu", "cpu"]
NO_CUDA = not torch.cuda.is_available()


def _lin():
    return nn.Linear(2, 2)


def _overlapping_scatter():
    b = torch.zeros(6)
    comm.scatter(torch.arange(6.0), out=[b[:3], b[1:4]])


# (id, call, exception type, message fragment)
CASES = [
    # ---- fastdp.comm.broadcast
    ("broadcast/tensor-not-tensor", lambda: comm.broadcast([1, 2], CPU2), TypeError, "'tensor' must be a torch.Tensor"),
    ("broadcast/devices-int", lambda: comm.broadcast(torch.ones(2), 3), TypeError, "'devices' must be an iterable"),
    ("broadcast/neither", lambda: comm.broadcast(torch.ones(2)), RuntimeError, "Exactly one of 'devices' and 'out'"),
    ("broadcast/one-out-shape", lambda: comm.broadcast(torch.ones(2), out=[torch.ones(3)]), RuntimeError,
     "output tensor at index 0 has shape [3]"),
    ("broadcast/meta-source", lambda: comm.broadcast(torch.ones(2, device="meta"), CPU2), ValueError,
     "tensor is on a meta device"),
    ("broadcast/expanded-out", lambda: comm.broadcast(torch.arange(4.0), out=[torch.empty(4),
                                                                           torch.zeros(1).expand(4)]),
     RuntimeError, "more than one element of the written-to tensor refers to a single memory location"),
    pytest.param("broadcast/cuda-without-cuda", lambda: comm.broadcast(torch.ones(2), [0, 1]),
                 fastdp.BackendUnavailableError, "devices: cuda:0 is a CUDA device",
                 marks=pytest.mark.skipif(not NO_CUDA, reason="CUDA is available")),
    ("broadcast/mixed", lambda: comm.broadcast(torch.ones(2), ["cpu", 0]), ValueError, "mixes CPU and CUDA"),
    # ---- fastdp.comm.broadcast_coalesced
    ("broadcast_coalesced/not-a-list", lambda: comm.broadcast_coalesced(torch.ones(2), CPU2), TypeError,
     "'tensors' must be a sequence of tensors"),
    ("broadcast_coalesced/buffer-negative", lambda: comm.broadcast_coalesced([torch.ones(2)], CPU2, buffer_size=-1),
     ValueError, "'buffer_size' must be a positive int"),
    ("broadcast_coalesced/buffer-overflow",
     lambda: comm.broadcast_coalesced([torch.ones(2)], CPU2, buffer_size=2**64 + 5), OverflowError,
     "does not fit in 64 bits"),
    # ---- fastdp.comm.reduce_add
    ("reduce_add/empty", lambda: comm.reduce_add([]), ValueError, "at least one input"),
    ("reduce_add/sizes", lambda: comm.reduce_add([torch.ones(3), torch.ones(4)]), ValueError,
     "input 1 has invalid size: got 4, but expected 3"),
    ("reduce_add/meta", lambda: comm.reduce_add([torch.ones(2, device="meta")] * 2), ValueError,
     "input 0 is on a meta device"),
    ("reduce_add/dtype-named", lambda: comm.reduce_add([torch.ones(2, dtype=torch.uint16)] * 2), TypeError,
     "cannot sum torch.uint16 tensors"),
    pytest.param("reduce_add/cuda-destination", lambda: comm.reduce_add([torch.ones(2)], destination=0),
                 fastdp.BackendUnavailableError, "destination: cuda:0 is a CUDA device",
                 marks=pytest.mark.skipif(not NO_CUDA, reason="CUDA is available")),
    # ---- fastdp.comm.reduce_add_coalesced
    ("reduce_add_coalesced/sizes", lambda: comm.reduce_add_coalesced([[torch.ones(2)], [torch.ones(3)]]),
     ValueError, "input 1 has invalid size"),
    ("reduce_add_coalesced/buffer-overflow",
     lambda: comm.reduce_add_coalesced([[torch.ones(2)]] * 2, buffer_size=2**64 + 5), OverflowError,
     "does not fit in 64 bits"),
    ("reduce_add_coalesced/dtype-named",
     lambda: comm.reduce_add_coalesced([[torch.ones(2, dtype=torch.uint16)]] * 2), TypeError, "torch.uint16"),
    # ---- fastdp.comm.scatter
    ("scatter/chunk-float", lambda: comm.scatter(torch.ones(4), CPU2, chunk_sizes=[1.0, 3]), TypeError,
     "'chunk_sizes'[0] must be an int, got float"),
    ("scatter/chunk-numpy-bool", lambda: comm.scatter(torch.ones(4), CPU2, chunk_sizes=[np.bool_(True), 3]),
     TypeError, "'chunk_sizes'[0] must be an int"),
    ("scatter/chunk-sum", lambda: comm.scatter(torch.ones(4), CPU2, chunk_sizes=[1, 2]), RuntimeError,
     "add up to 3, but the tensor has 4"),
    ("scatter/dim", lambda: comm.scatter(torch.ones(4), CPU2, dim=3), IndexError, "Dimension out of range"),
    ("scatter/overlapping-outs", _overlapping_scatter, RuntimeError,
     "more than one element of the written-to tensor refers to a single memory location"),
    ("scatter/out-overlaps-source", lambda: (lambda b: comm.scatter(b[:6], out=[b[2:5], b[5:8]]))(torch.zeros(9)),
     RuntimeError, "some elements of the input tensor and the written-to tensor refer to a single memory location"),
    pytest.param("scatter/cuda-without-cuda", lambda: comm.scatter(torch.ones(4), [0, 1]),
                 fastdp.BackendUnavailableError, "cuda:0 is a CUDA device",
                 marks=pytest.mark.skipif(not NO_CUDA, reason="CUDA is available")),
    # ---- fastdp.comm.gather
    ("gather/empty", lambda: comm.gather([]), RuntimeError, "at least one tensor to gather"),
    ("gather/meta", lambda: comm.gather([torch.ones(2, device="meta")] * 2, destination="cpu"), RuntimeError,
     "input tensor at index 0 has device 'meta'"),
    ("gather/expanded-out", lambda: comm.gather([torch.arange(3.0)] * 2, out=torch.zeros(1).expand(6)),
     RuntimeError, "more than one element of the written-to tensor refers to a single memory location"),
    ("gather/out-and-destination", lambda: comm.gather([torch.ones(2)], destination="cpu", out=torch.empty(2)),
     RuntimeError, "'destination' must not be specified"),
    pytest.param("gather/cuda-without-cuda", lambda: comm.gather([torch.ones(2)], destination=0),
                 fastdp.BackendUnavailableError, "destination: cuda:0 is a CUDA device",
                 marks=pytest.mark.skipif(not NO_CUDA, reason="CUDA is available")),
    # ---- fastdp.DataParallel
    ("DataParallel/module-None", lambda: fastdp.DataParallel(None, device_ids=CPU2), TypeError,
     "module must be a torch.nn.Module"),
    ("DataParallel/module-lambda", lambda: fastdp.DataParallel(lambda x: x, device_ids=CPU2), TypeError,
     "got function"),
    ("DataParallel/device-ids-str", lambda: fastdp.DataParallel(_lin(), device_ids="cpu"), TypeError,
     "device_ids must be a list or tuple"),
    ("DataParallel/mixed-ids", lambda: fastdp.DataParallel(_lin(), device_ids=["cpu", 0]), ValueError,
     "device_ids mixes 'cpu' entries with CUDA devices"),
    ("DataParallel/bucket", lambda: fastdp.DataParallel(_lin(), device_ids=CPU2, bucket_cap_mb=0), ValueError,
     "bucket_cap_mb must be a positive number"),
    ("DataParallel/chunk-sizes-length", lambda: fastdp.DataParallel(_lin(), device_ids=CPU2, chunk_sizes=[1, 2, 3]),
     ValueError, "chunk_sizes has 3 entries but device_ids has 2"),
    ("DataParallel/criterion", lambda: fastdp.DataParallel(_lin(), device_ids=CPU2, criterion=3), TypeError,
     "criterion must be callable"),
    ("DataParallel/output-device", lambda: fastdp.DataParallel(_lin(), device_ids=CPU2, output_device=0),
     ValueError, "output_device=0 is a CUDA device"),
    # ---- fastdp.data_parallel
    ("data_parallel/module-lambda", lambda: fastdp.data_parallel(lambda x: x, torch.ones(2, 2), device_ids=CPU2),
     TypeError, "data_parallel: module must be a torch.nn.Module"),
    ("data_parallel/device-ids-str", lambda: fastdp.data_parallel(_lin(), torch.ones(2, 2), device_ids="cpu"),
     TypeError, "device_ids must be a list or tuple"),
    # ---- fastdp.replicate
    ("replicate/None", lambda: fastdp.replicate(None, CPU2), TypeError, "network must be a torch.nn.Module"),
    ("replicate/devices-str", lambda: fastdp.replicate(_lin(), "cpu"), TypeError, "devices must be a list of devices"),
    ("replicate/mixed", lambda: fastdp.replicate(_lin(), ["cpu", 0]), ValueError, "devices mixes 'cpu' entries"),
    pytest.param("replicate/cuda-without-cuda", lambda: fastdp.replicate(_lin(), [0, 1]),
                 fastdp.BackendUnavailableError, "devices: cuda:0 is a CUDA device",
                 marks=pytest.mark.skipif(not NO_CUDA, reason="CUDA is available")),
    # ---- fastdp.scatter / scatter_kwargs / gather
    ("scatter_fn/target-str", lambda: fastdp.scatter(torch.ones(4), "cpu"), TypeError,
     "target_gpus must be a list of devices"),
    ("scatter_fn/target-None", lambda: fastdp.scatter(torch.ones(4), None), TypeError,
     "target_gpus must be a list of devices"),
    ("scatter_kwargs/target-str", lambda: fastdp.scatter_kwargs((torch.ones(4),), {}, "cpu"), TypeError,
     "target_gpus must be a list of devices"),
    ("gather_fn/mixed-outputs", lambda: fastdp.gather([torch.ones(2), 3], "cpu"), TypeError,
     "replica 0 returned a Tensor but replica 1 returned int"),
    pytest.param("gather_fn/cuda-without-cuda", lambda: fastdp.gather([torch.ones(2)], 0),
                 fastdp.BackendUnavailableError, "target_device: cuda:0 is a CUDA device",
                 marks=pytest.mark.skipif(not NO_CUDA, reason="CUDA is available")),
    # ---- fastdp.parallel_apply
    ("parallel_apply/lengths", lambda: fastdp.parallel_apply([_lin(), _lin()], [torch.ones(1, 2)]), AssertionError,
     "The number of modules 2 is not equal to the number of inputs 1"),
    ("parallel_apply/replica-raises", lambda: fastdp.parallel_apply([_lin(), None], [torch.ones(1, 2)] * 2,
                                                                    devices=CPU2),
     TypeError, "Caught TypeError in replica 1 on device cpu."),
    pytest.param("parallel_apply/cuda-without-cuda",
                 lambda: fastdp.parallel_apply([_lin()], [torch.ones(1, 2)], devices=[0]),
                 fastdp.BackendUnavailableError, "device: cuda:0 is a CUDA device",
                 marks=pytest.mark.skipif(not NO_CUDA, reason="CUDA is available")),
    # ---- fastdp.memory_report
    ("memory_report/None", lambda: fastdp.memory_report(None), TypeError,
     "memory_report expects a fastdp.DataParallel"),
    ("memory_report/plain-module", lambda: fastdp.memory_report(_lin()), TypeError, "got Linear"),
]


PARAMS = [pytest.param(*c[1:], id=c[0]) if type(c) is tuple else pytest.param(*c.values[1:], marks=c.marks,
                                                                                    id=c.values[0]) for c in CASES]


@pytest.mark.parametrize("call,exc,fragment", PARAMS)
def test_bad_input(call, exc, fragment):
    with pytest.raises(exc) as info:
        call()
    assert type(info.value) is exc, f"{type(info.value).__name__}: {info.value}"
    assert fragment in str(info.value), str(info.value)


def test_numpy_chunk_sizes_accepted_like_data_parallel():
    """DataParallel accepts numpy integers as chunk_sizes; comm.scatter now does too, with the same split."""
    x = torch.arange(8.0).view(4, 2)
    sizes = [np.int64(1), np.int64(3)]
    parts = comm.scatter(x, CPU2, chunk_sizes=sizes)
    assert [p.shape[0] for p in parts] == [1, 3]
    torch.testing.assert_close(torch.cat(parts), x)
    lin = _lin()
    dp = fastdp.DataParallel(lin, device_ids=CPU2, chunk_sizes=sizes)
    torch.testing.assert_close(dp(x), lin(x))


def test_buffer_size_at_the_64_bit_limit_is_accepted():
    t = [torch.arange(3.0)]
    got = comm.broadcast_coalesced(t, CPU2, buffer_size=2**64 - 1)
    for row in got:
        torch.testing.assert_close(row[0], t[0])


@pytest.mark.parametrize("argv,fragment", [([], "choose a benchmark: 'comm'"),
                                           (["nope"], "invalid choice: 'nope'")])
def test_bench_cli(argv, fragment):
    r = subprocess.run([sys.executable, "-m", "fastdp.bench", *argv], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.returncode
    assert fragment in r.stderr, r.stderr
    assert "arguments are required: which" not in r.stderr
