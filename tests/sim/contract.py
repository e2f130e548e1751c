"""pytest plugin (``-p contract``, with tests/sim on the path and the simulated libraries named in the environment,
tests/sim/build.py env()): the contract tests run on simulated CUDA devices through the real C core. tests/_places.py
puts their tensors on those devices; every test fails on any misuse or race the simulator recorded, or any misuse of
torch.cuda the fake recorded, during it or when its tensors died.

SIMGPU_ALLOCATOR=caching (the default) registers the simulator's caching allocator for the core's scratch memory, as
fastdp registers PyTorch's in every CUDA build of torch; "pool" leaves the core on the driver's pool."""

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


@pytest.fixture(autouse=True)
def _simulated_devices_clean():
    bridge = _places.SIM
    bridge.sim.reset()
    bridge.cuda.misuse.clear()
    yield
    gc.collect(1)  # the test's tensors die: a block given back while another stream may use it is the test's race
    n, text = bridge.sim.errors()
    assert n == 0, f"the simulated GPU recorded {n} misuse(s)/race(s):\n{text}"
    assert bridge.cuda.misuse == [], bridge.cuda.misuse

