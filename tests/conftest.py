"""Shared test set-up: GPU tests are marked and skipped cleanly; CUDA is never initialised at collection."""

import signal

import pytest

import _mkl
import _torchvision_ops

_torchvision_ops.install()  # before any test imports torchvision or transformers
_mkl.warm_vml()  # before any test runs replicas on worker threads (tests/_mkl.py)

# A run started where SIGINT is ignored (a background job of a non-interactive shell, nohup in a script) would pass
# that on to every child process, and the tests that interrupt a child would see nothing arrive: give the children
# the disposition an interactive run has (exec resets a handled signal to its default; an ignored one stays ignored).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _cuda_count():
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_runtest_setup(item):
    if item.get_closest_marker("multi_gpu") and _cuda_count() < 2:
        pytest.skip("needs two or more CUDA GPUs")
    if item.get_closest_marker("gpu") and _cuda_count() < 1:
        pytest.skip("needs a CUDA GPU")


@pytest.fixture(params=["in-thread", "threads"])
def cpu_apply(request, monkeypatch):
    """Runs a test with emulated "cpu" replicas one after another in the calling thread (the default) and again on
    worker threads (the path CUDA replicas always take), so that path stays covered without a GPU. Child
    processes started by the test read TEST_CPU_THREADS (1: threads)."""
    import importlib

    threads = request.param == "threads"
    monkeypatch.setattr(importlib.import_module("fastdp.parallel_apply"), "_CPU_THREADS", threads)
    monkeypatch.setenv("TEST_CPU_THREADS", "1" if threads else "0")
    return request.param


@pytest.fixture(scope="module")
def one_torch_thread():
    """Timings are read against injected sleeps: one torch thread, so a loaded machine's OpenMP pool waiting for
    a core does not make every replica look slow. The report's and rebalancing's test files use it for every test
    (``pytestmark = pytest.mark.usefixtures("one_torch_thread")``)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _fake_cuda(monkeypatch, ndev):
    """tests/_fake_cuda.py's stand-in for torch.cuda with `ndev` devices, installed for the shim's CUDA-only
    branches (the tests/test_cuda_*.py files): peer access is recorded, not granted."""
    from _fake_cuda import FakeCuda
    from fastdp._native import core as _core
    from fastdp._platform import devices as _devices

    fake = FakeCuda(ndev).install(monkeypatch)
    # CUDA device entries pass the normaliser although this torch has no CUDA
    monkeypatch.setattr(_devices, "_require_cuda", lambda d, what: d)
    monkeypatch.setattr(_core, "_PEERS_OPEN", set())
    monkeypatch.setattr(_core, "_grant_peer", lambda device, peer: fake.record("grant_peer", device, peer))
    return fake


@pytest.fixture
def cuda(monkeypatch):
    """Two fake CUDA devices (see _fake_cuda); the test fails if the code under test misused them."""
    fake = _fake_cuda(monkeypatch, 2)
    yield fake
    assert fake.misuse == [], fake.misuse  # a device that does not exist, a stream told the wrong device


@pytest.fixture
def cuda3(monkeypatch):
    """Three fake CUDA devices, checked as ``cuda``'s are."""
    fake = _fake_cuda(monkeypatch, 3)
    yield fake
    assert fake.misuse == [], fake.misuse
