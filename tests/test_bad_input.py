"""Bad input to every public function: the exception type and the whole message, which names the argument and,
where there is one, the fix. One table row per case; each row is its own test."""

import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn

import fastdp

from _replica_errors import ReplicaError
from fastdp import comm

CPU2 = ["cpu", "cpu"]
NO_CUDA = not torch.cuda.is_available()
# What fastdp says where CUDA cannot run, by build: a CPU build has no CUDA at all; a CUDA build (what `pip install
# torch` gives on Linux, GPU or not) has it, but sees no device here.
NO_CUDA_WHY = "this torch build has no CUDA" if not torch.backends.cuda.is_built() else "no CUDA device is visible"


def _lin():
    return nn.Linear(2, 2)


def _overlapping_scatter():
    b = torch.zeros(6)
    comm.scatter(torch.arange(6.0), out=[b[:3], b[1:4]])


def _torch_text(call):
    """The message torch (or Python) itself raises for `call`."""
    with pytest.raises(Exception) as info:
        call()
    return str(info.value)


def _written_twice():
    """torch's text for a write into a tensor whose elements share memory."""
    return _torch_text(lambda: torch.zeros(1).expand(4).copy_(torch.arange(4.0)))


def _input_overlap():
    """torch's text for a write into memory that overlaps the source."""
    return _torch_text(lambda: (lambda b: b[2:5].copy_(b[:3]))(torch.zeros(9)))


# (id, call, exception type, message): the whole message, or a function giving it (a text torch or Python raises
# itself, taken from them at run time), or a ReplicaError (a replica's error with its traceback)
CASES = [
    # ---- fastdp.comm.broadcast
    ("broadcast/tensor-not-tensor", lambda: comm.broadcast([1, 2], CPU2), TypeError,
     "'tensor' must be a torch.Tensor, got list"),
    ("broadcast/devices-int", lambda: comm.broadcast(torch.ones(2), 3), TypeError,
     "'devices' must be an iterable of devices, got a single int"),
    ("broadcast/neither", lambda: comm.broadcast(torch.ones(2)), RuntimeError,
     "Exactly one of 'devices' and 'out' must be specified, but got devices=None and out=None"),
    ("broadcast/one-out-shape", lambda: comm.broadcast(torch.ones(2), out=[torch.ones(3)]), RuntimeError,
     "Expected all output tensors to have same shape as the source (shape [2]) in order to broadcast, but output "
     "tensor at index 0 has shape [3]"),
    ("broadcast/meta-source", lambda: comm.broadcast(torch.ones(2, device="meta"), CPU2), ValueError,
     "tensor is on a meta device; fastdp moves CPU and CUDA tensors only"),
    ("broadcast/expanded-out", lambda: comm.broadcast(torch.arange(4.0), out=[torch.empty(4),
                                                                           torch.zeros(1).expand(4)]),
     RuntimeError, lambda: f"{_written_twice()} (copy: destination 1)"),
    pytest.param("broadcast/cuda-without-cuda", lambda: comm.broadcast(torch.ones(2), [0, 1]),
                 fastdp.BackendUnavailableError,
                 f'devices: cuda:0 is a CUDA device, but {NO_CUDA_WHY}; use "cpu" devices (emulated '
                 "replicas) on this machine",
                 marks=pytest.mark.skipif(not NO_CUDA, reason="CUDA is available")),
    ("broadcast/mixed", lambda: comm.broadcast(torch.ones(2), ["cpu", 0]), ValueError,
     "'devices' mixes CPU and CUDA devices (['cpu', 0]); use \"cpu\" entries only (emulated devices)"),
    # ---- fastdp.comm.broadcast_coalesced
    ("broadcast_coalesced/not-a-list", lambda: comm.broadcast_coalesced(torch.ones(2), CPU2), TypeError,
     "'tensors' must be a sequence of tensors, got Tensor"),
    ("broadcast_coalesced/buffer-negative", lambda: comm.broadcast_coalesced([torch.ones(2)], CPU2, buffer_size=-1),
     ValueError, "'buffer_size' must be a positive int (bytes), got -1"),
    ("broadcast_coalesced/buffer-overflow",
     lambda: comm.broadcast_coalesced([torch.ones(2)], CPU2, buffer_size=2**64 + 5), OverflowError,
     "bucket size 18446744073709551621 bytes does not fit in 64 bits; pass at most 2**64 - 1"),
    # ---- fastdp.comm.reduce_add
    ("reduce_add/empty", lambda: comm.reduce_add([]), ValueError,
     "reduce_add expects at least one input tensor"),
    ("reduce_add/sizes", lambda: comm.reduce_add([torch.ones(3), torch.ones(4)]), ValueError,
     "input 1 has invalid size: got 4, but expected 3"),
    ("reduce_add/meta", lambda: comm.reduce_add([torch.ones(2, device="meta")] * 2), ValueError,
     "reduce_add: input 0 is on a meta device; fastdp sums CPU and CUDA tensors only"),
    ("reduce_add/dtype-named", lambda: comm.reduce_add([torch.ones(2, dtype=torch.uint16)] * 2), TypeError,
     "reduce_add: cannot sum torch.uint16 tensors (reduce: dtype not supported (supported: bool, uint8, int8, int16, "
     "int32, int64, float16, bfloat16, float32, float64))"),
    pytest.param("reduce_add/cuda-destination", lambda: comm.reduce_add([torch.ones(2)], destination=0),
                 fastdp.BackendUnavailableError,
                 f'destination: cuda:0 is a CUDA device, but {NO_CUDA_WHY}; use "cpu" devices (emulated '
                 "replicas) on this machine",
                 marks=pytest.mark.skipif(not NO_CUDA, reason="CUDA is available")),
    # ---- fastdp.comm.reduce_add_coalesced
    ("reduce_add_coalesced/sizes", lambda: comm.reduce_add_coalesced([[torch.ones(2)], [torch.ones(3)]]),
     ValueError, "input 1 has invalid size: got 3, but expected 2"),
    ("reduce_add_coalesced/buffer-overflow",
     lambda: comm.reduce_add_coalesced([[torch.ones(2)]] * 2, buffer_size=2**64 + 5), OverflowError,
     "bucket size 18446744073709551621 bytes does not fit in 64 bits; pass at most 2**64 - 1"),
    ("reduce_add_coalesced/dtype-named",
     lambda: comm.reduce_add_coalesced([[torch.ones(2, dtype=torch.uint16)]] * 2), TypeError,
     "reduce_add: cannot sum torch.uint16 tensors (reduce: dtype not supported (supported: bool, uint8, int8, int16, "
     "int32, int64, float16, bfloat16, float32, float64))"),
    # ---- fastdp.comm.scatter
    ("scatter/chunk-float", lambda: comm.scatter(torch.ones(4), CPU2, chunk_sizes=[1.0, 3]), TypeError,
     "'chunk_sizes'[0] must be an int, got float"),
    ("scatter/chunk-numpy-bool", lambda: comm.scatter(torch.ones(4), CPU2, chunk_sizes=[np.bool_(True), 3]),
     TypeError, f"'chunk_sizes'[0] must be an int, got {type(np.bool_(True)).__name__}"),  # numpy 1: bool_
    ("scatter/chunk-sum", lambda: comm.scatter(torch.ones(4), CPU2, chunk_sizes=[1, 2]), RuntimeError,
     "chunk_sizes [1, 2] add up to 3, but the tensor has 4 elements along dim 0; they must add up exactly"),
    ("scatter/dim", lambda: comm.scatter(torch.ones(4), CPU2, dim=3), IndexError,
     lambda: _torch_text(lambda: torch.ones(4).size(3))),
    ("scatter/overlapping-outs", _overlapping_scatter, RuntimeError,
     lambda: f"{_written_twice()} (copy: destinations 0 and 1 overlap)"),
    ("scatter/out-overlaps-source", lambda: (lambda b: comm.scatter(b[:6], out=[b[2:5], b[5:8]]))(torch.zeros(9)),
     RuntimeError, lambda: f"{_input_overlap()} (copy: destination 0 overlaps source 0)"),
    pytest.param("scatter/cuda-without-cuda", lambda: comm.scatter(torch.ones(4), [0, 1]),
                 fastdp.BackendUnavailableError,
                 f'devices: cuda:0 is a CUDA device, but {NO_CUDA_WHY}; use "cpu" devices (emulated '
                 "replicas) on this machine",
                 marks=pytest.mark.skipif(not NO_CUDA, reason="CUDA is available")),
    # ---- fastdp.comm.gather
    ("gather/empty", lambda: comm.gather([]), RuntimeError,
     "Expected at least one tensor to gather from"),
    ("gather/meta", lambda: comm.gather([torch.ones(2, device="meta")] * 2, destination="cpu"), RuntimeError,
     "Expected all input tensors to be CUDA tensors, but input tensor at index 0 has device 'meta' (fastdp also "
     "accepts all-CPU inputs, not a mix)"),
    ("gather/expanded-out", lambda: comm.gather([torch.arange(3.0)] * 2, out=torch.zeros(1).expand(6)),
     RuntimeError, lambda: f"{_written_twice()} (copy: destination 0)"),
    ("gather/out-and-destination", lambda: comm.gather([torch.ones(2)], destination="cpu", out=torch.empty(2)),
     RuntimeError, "'destination' must not be specified when 'out' is specified, but got destination=cpu"),
    pytest.param("gather/cuda-without-cuda", lambda: comm.gather([torch.ones(2)], destination=0),
                 fastdp.BackendUnavailableError,
                 f'destination: cuda:0 is a CUDA device, but {NO_CUDA_WHY}; use "cpu" devices (emulated '
                 "replicas) on this machine",
                 marks=pytest.mark.skipif(not NO_CUDA, reason="CUDA is available")),
    # ---- fastdp.DataParallel
    ("DataParallel/module-None", lambda: fastdp.DataParallel(None, device_ids=CPU2), TypeError,
     "DataParallel: module must be a torch.nn.Module (its parameters and buffers are replicated), got NoneType; wrap "
     "a plain function in an nn.Module subclass"),
    ("DataParallel/module-lambda", lambda: fastdp.DataParallel(lambda x: x, device_ids=CPU2), TypeError,
     "DataParallel: module must be a torch.nn.Module (its parameters and buffers are replicated), got function; wrap "
     "a plain function in an nn.Module subclass"),
    ("DataParallel/device-ids-str", lambda: fastdp.DataParallel(_lin(), device_ids="cpu"), TypeError,
     "device_ids must be a list or tuple of devices (DataParallel reads device_ids[0]), got str 'cpu'"),
    ("DataParallel/mixed-ids", lambda: fastdp.DataParallel(_lin(), device_ids=["cpu", 0]), ValueError,
     "device_ids mixes 'cpu' entries with CUDA devices (['cpu', 0]). fastdp emulates replicas on the host only when "
     "every entry is 'cpu': pass device_ids=['cpu'] * N for emulated replicas, or CUDA device indices only (e.g. [0, "
     "1])."),
    ("DataParallel/bucket", lambda: fastdp.DataParallel(_lin(), device_ids=CPU2, bucket_cap_mb=0), ValueError,
     "bucket_cap_mb must be a positive number of MiB, got 0"),
    ("DataParallel/chunk-sizes-length", lambda: fastdp.DataParallel(_lin(), device_ids=CPU2, chunk_sizes=[1, 2, 3]),
     ValueError, "chunk_sizes has 3 entries but device_ids has 2 devices; expected one size (int) or weight (float) "
                 "per device"),
    ("DataParallel/criterion", lambda: fastdp.DataParallel(_lin(), device_ids=CPU2, criterion=3), TypeError,
     "criterion must be callable (e.g. nn.CrossEntropyLoss()), got int"),
    ("DataParallel/output-device", lambda: fastdp.DataParallel(_lin(), device_ids=CPU2, output_device=0),
     ValueError, "output_device=0 is a CUDA device but device_ids are emulated 'cpu' replicas; with 'cpu' device_ids "
                 "leave output_device unset or pass 'cpu'"),
    # ---- fastdp.data_parallel
    ("data_parallel/module-lambda", lambda: fastdp.data_parallel(lambda x: x, torch.ones(2, 2), device_ids=CPU2),
     TypeError, "data_parallel: module must be a torch.nn.Module (its parameters and buffers are replicated), got "
                "function; wrap a plain function in an nn.Module subclass"),
    ("data_parallel/device-ids-str", lambda: fastdp.data_parallel(_lin(), torch.ones(2, 2), device_ids="cpu"),
     TypeError, "device_ids must be a list or tuple of devices (DataParallel reads device_ids[0]), got str 'cpu'"),
    # ---- fastdp.replicate
    ("replicate/None", lambda: fastdp.replicate(None, CPU2), TypeError,
     "replicate: network must be a torch.nn.Module, got NoneType"),
    ("replicate/devices-str", lambda: fastdp.replicate(_lin(), "cpu"), TypeError,
     "devices must be a list of devices (e.g. ['cpu'] * 2 or [0, 1]), got str 'cpu'"),
    ("replicate/mixed", lambda: fastdp.replicate(_lin(), ["cpu", 0]), ValueError,
     "devices mixes 'cpu' entries with CUDA devices (['cpu', 0]). fastdp emulates replicas on the host only when "
     "every entry is 'cpu': pass devices=['cpu'] * N for emulated replicas, or CUDA device indices only (e.g. "
     "[0, 1])."),
    pytest.param("replicate/cuda-without-cuda", lambda: fastdp.replicate(_lin(), [0, 1]),
                 fastdp.BackendUnavailableError,
                 f'devices: cuda:0 is a CUDA device, but {NO_CUDA_WHY}; use "cpu" devices (emulated '
                 "replicas) on this machine",
                 marks=pytest.mark.skipif(not NO_CUDA, reason="CUDA is available")),
    # ---- fastdp.scatter / scatter_kwargs / gather
    ("scatter_fn/target-str", lambda: fastdp.scatter(torch.ones(4), "cpu"), TypeError,
     "target_gpus must be a list of devices (e.g. ['cpu'] * 2 or [0, 1]), got str 'cpu'"),
    ("scatter_fn/target-None", lambda: fastdp.scatter(torch.ones(4), None), TypeError,
     "target_gpus must be a list of devices (e.g. ['cpu'] * 2 or [0, 1]), got NoneType None"),
    ("scatter_kwargs/target-str", lambda: fastdp.scatter_kwargs((torch.ones(4),), {}, "cpu"), TypeError,
     "target_gpus must be a list of devices (e.g. ['cpu'] * 2 or [0, 1]), got str 'cpu'"),
    ("gather_fn/mixed-outputs", lambda: fastdp.gather([torch.ones(2), 3], "cpu"), TypeError,
     "Cannot gather output: replica 0 returned a Tensor but replica 1 returned int"),
    pytest.param("gather_fn/cuda-without-cuda", lambda: fastdp.gather([torch.ones(2)], 0),
                 fastdp.BackendUnavailableError,
                 f'target_device: cuda:0 is a CUDA device, but {NO_CUDA_WHY}; use "cpu" devices '
                 "(emulated replicas) on this machine",
                 marks=pytest.mark.skipif(not NO_CUDA, reason="CUDA is available")),
    # ---- fastdp.parallel_apply
    ("parallel_apply/lengths", lambda: fastdp.parallel_apply([_lin(), _lin()], [torch.ones(1, 2)]), AssertionError,
     "The number of modules 2 is not equal to the number of inputs 1"),
    ("parallel_apply/replica-raises", lambda: fastdp.parallel_apply([_lin(), None], [torch.ones(1, 2)] * 2,
                                                                    devices=CPU2),
     TypeError, ReplicaError("TypeError", 1, "TypeError: 'NoneType' object is not callable")),
    pytest.param("parallel_apply/cuda-without-cuda",
                 lambda: fastdp.parallel_apply([_lin()], [torch.ones(1, 2)], devices=[0]),
                 fastdp.BackendUnavailableError,
                 f'device: cuda:0 is a CUDA device, but {NO_CUDA_WHY}; use "cpu" devices (emulated '
                 "replicas) on this machine",
                 marks=pytest.mark.skipif(not NO_CUDA, reason="CUDA is available")),
    # ---- fastdp.memory_report
    ("memory_report/None", lambda: fastdp.memory_report(None), TypeError,
     "memory_report expects a fastdp.DataParallel or torch.nn.DataParallel, got NoneType"),
    ("memory_report/plain-module", lambda: fastdp.memory_report(_lin()), TypeError,
     "memory_report expects a fastdp.DataParallel or torch.nn.DataParallel, got Linear"),
]


PARAMS = [pytest.param(*c[1:], id=c[0]) if type(c) is tuple else pytest.param(*c.values[1:], marks=c.marks,
                                                                                    id=c.values[0]) for c in CASES]


@pytest.mark.parametrize("call,exc,message", PARAMS)
def test_bad_input(call, exc, message):
    with pytest.raises(exc) as info:
        call()
    assert type(info.value) is exc, f"{type(info.value).__name__}: {info.value}"
    text = str(info.value)
    if isinstance(message, ReplicaError):
        assert message.matches(text), text
    else:
        assert text == (message if isinstance(message, str) else message())


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
