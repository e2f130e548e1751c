"""Which errors ``oom="rebalance"`` rescues: an allocation that failed, whoever says so. PyTorch's allocator raises
``torch.OutOfMemoryError``; other libraries that allocate for themselves raise a RuntimeError in their own words
(cuBLAS's handle, cuDNN's workspace, CUDA outside PyTorch's allocator, NCCL's communicator set-up), and fastdp's core
a MemoryError when its own allocations fail. Each is rescued as an out-of-memory error is: rows moved away, the step
run again, the bare model's result. Any other error is the step's own and is raised as it is, nothing moved.

The errors are injected into an emulated replica (``fastdp.inject_oom(..., error=...)``), in the words the libraries
use. References: the bare model on the full batch (float64 within 1e-10, tests/test_rescue_contract.py's helpers).
"""

import warnings

import pytest
import torch.nn.functional as F

import fastdp

from _report_cases import bn_model, data
from test_rescue_contract import assert_buffers, assert_grads, bare_step, one_sample_repeated, wrapped

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ALLOCATION_FAILURES = {
    "cublas": lambda: RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    "cudnn": lambda: RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
    "cuda": lambda: RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at "
                                 "some other API call, so the stacktrace below might be incorrect."),
    "nccl-calloc": lambda: fastdp.NcclError("ncclCommInitAll on devices [0, 1, 2]: unhandled system error (run with "
                                            "NCCL_DEBUG=INFO for details): Failed to CUDA calloc 6291456 bytes"),
    "nccl-cuda": lambda: fastdp.NcclError("ncclCommInitAll on devices [0, 1, 2]: unhandled cuda error (run with "
                                          "NCCL_DEBUG=INFO for details): Cuda failure 'out of memory'"),
    "nccl-shm": lambda: fastdp.NcclError("ncclGroupEnd on devices [0, 1, 2]: unhandled system error: Call to "
                                         "posix_fallocate failed : No space left on device"),
    "fastdp-core": lambda: MemoryError("nccl: cannot allocate a communicator set"),
}

OTHER_ERRORS = {
    "shapes": lambda: RuntimeError("mat1 and mat2 shapes cannot be multiplied (6x8 and 7x3)"),
    "illegal-access": lambda: fastdp.CudaError("cuLaunchKernel: an illegal memory access was encountered"),
    "cublas-execution": lambda: RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm`"),
    "nccl-unsaid": lambda: fastdp.NcclError("ncclCommInitAll on devices [0, 1, 2]: unhandled system error (run with "
                                            "NCCL_DEBUG=INFO for details)"),
    "value": lambda: ValueError("expected a positive batch"),
}


def _step(dp, route, error, x, y):
    """One step of `dp` by `route`, `error` raised once in replica 1's forward; the warnings it gave."""
    injection = fastdp.inject_oom(dp, 1, times=1, error=error)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if route == "train_step":
                dp.train_step(x, loss_fn=lambda out: F.cross_entropy(out, y))
            else:
                F.cross_entropy(dp(x), y).backward()
        finally:
            injection.remove()
    assert injection.fired == 1
    return [str(w.message) for w in caught if "oom='rebalance'" in str(w.message)]


@pytest.mark.parametrize("route", ["loss.backward", "train_step"])
@pytest.mark.parametrize("name", sorted(ALLOCATION_FAILURES))
def test_an_allocation_failure_in_another_librarys_words_is_rescued(name, route):
    bare = bn_model()
    dp, model = wrapped(bare)
    for s in range(2):
        x, y = one_sample_repeated(18, s)  # BatchNorm's statistics from replica 0's chunk are the bare model's
        rescued = _step(dp, route, ALLOCATION_FAILURES[name], x, y)
        assert len(rescued) == 1 and "position 1" in rescued[0], rescued
        bare_step(bare, (x,), lambda out: F.cross_entropy(out, y))
        assert_buffers(model, bare)
    assert_grads(model, bare)
    assert dp.batch_split.chunk_sizes[1] < 6  # rows moved away from the device that failed


@pytest.mark.parametrize("route", ["loss.backward", "train_step"])
@pytest.mark.parametrize("name", sorted(OTHER_ERRORS))
def test_any_other_error_is_raised_as_it_is_with_nothing_moved(name, route):
    bare = bn_model()
    dp, model = wrapped(bare)
    x, y = data(18, seed=0)
    F.cross_entropy(dp(x), y).backward()
    split = dp.batch_split.chunk_sizes
    made = OTHER_ERRORS[name]()
    with pytest.raises(type(made)) as raised:
        _step(dp, route, OTHER_ERRORS[name], x, y)
    assert str(made) in str(raised.value)
    assert "oom='rebalance'" not in str(raised.value) and not getattr(raised.value, "__notes__", None)
    dp(x)
    assert dp.batch_split.chunk_sizes == split
    assert dp._oom.rescues == []
