"""pytest plugin (``-p contract``, with tests/sim on the path and the simulated libraries named in the environment,
tests/sim/build.py env()): the contract tests run on simulated CUDA devices through the real C core. tests/_places.py
puts their tensors on those devices; every test fails on any misuse or race the simulator recorded, or any misuse of
torch.cuda the fake recorded, during it or when its tensors died.

SIMGPU_CALLER_STREAMS=1 makes a non-default stream of its own current on every device during each test, as a caller
that works on its own streams does. SIMGPU_ALLOCATOR=caching (the default) registers the simulator's caching
allocator for the core's scratch memory, as fastdp registers PyTorch's in every CUDA build of torch; "pool" leaves
the core on the driver's pool."""

import gc
import os

import pytest
import torch

from simcuda import Bridge  # first: it puts tests/ on the path
from simgpu import Sim

import _places


def pytest_configure(config):
    from fastdp import _C

    sim = Sim().open()
    if os.environ.get("SIMGPU_ALLOCATOR", "caching") == "caching":
        _C.set_device_allocator(sim.caching_allocator())
    torch.set_num_threads(1)
    config._simulated_devices = pytest.MonkeyPatch()
    _places.SIM = Bridge(sim).install(config._simulated_devices)


_CALLER_STREAMS = []


@pytest.fixture(autouse=True)
def _simulated_devices_clean():
    bridge = _places.SIM
    bridge.sim.reset()
    bridge.cuda.misuse.clear()
    if os.environ.get("SIMGPU_CALLER_STREAMS") == "1":
        # The caller works on streams of its own, not the default ones: everything fastdp does for it must be
        # ordered on them (a use of the default stream instead is a race with the caller's work). The same ones
        # for every test: the simulator checks races on its first 1024 streams only.
        if not _CALLER_STREAMS:
            _CALLER_STREAMS.extend(bridge.cuda.stream_on(d, f"caller@{d}") for d in range(bridge.sim.ndev))
        for s in reversed(_CALLER_STREAMS):
            torch.cuda.set_stream(s)
    yield
    for d in reversed(range(bridge.sim.ndev)):
        torch.cuda.set_stream(bridge.cuda.default_stream(d))
    gc.collect(1)  # the test's tensors die: a block given back while another stream may use it is the test's race
    n, text = bridge.sim.errors()
    assert n == 0, f"the simulated GPU recorded {n} misuse(s)/race(s):\n{text}"
    assert bridge.cuda.misuse == [], bridge.cuda.misuse

