"""fastdp._C on the simulated GPU through duck-typed CUDA tensors (tests/sim/simgpu.py SimTensor), compared with
torch's CPU results; the fault-injection sweep through the binding (CudaError/NcclError); and one test per GPU-path
defect found so far that the simulator can reach without CUDA torch. Every case runs in its own process
(tests/sim/pycases.py), with the simulated libraries named in its environment."""

import functools
import importlib.util
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.sim

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("fastdp_sim_build", os.path.join(HERE, "sim", "build.py"))
_simbuild = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_simbuild)


@functools.lru_cache(maxsize=None)
def _env():
    if _simbuild.compiler() is None:
        pytest.skip("no C compiler found (cc, gcc or clang; or set CC): the simulated GPU needs one")
    return dict(os.environ, **_simbuild.env())


@pytest.fixture(params=["pool", "caching"], autouse=True)
def scratch(request, monkeypatch):
    """Every case runs twice: the core's scratch memory from the driver's pool (a PyTorch without CUDA), and from a
    caching allocator registered as fastdp._native.core registers PyTorch's (every CUDA build of torch: the users'
    route). tests/sim/pycases.py sets it up from SIMGPU_ALLOCATOR."""
    monkeypatch.setenv("SIMGPU_ALLOCATOR", request.param)
    return request.param


def _case(name, timeout=300, **env):
    env = dict(_env(), SIMGPU_ALLOCATOR=os.environ["SIMGPU_ALLOCATOR"], **env)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "sim", "pycases.py"), name], env=env,
                          cwd=HERE,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("PASS"), proc.stdout[-20000:]


def test_ops_through_the_binding():
    _case("ops")


def test_simulator_catches_each_misuse():
    """Each kind of misuse the simulator claims to catch is caught, and the corrected use is not flagged."""
    _case("selfcheck")


def test_fault_injection_sweep_through_the_binding():
    _case("sweep")


@pytest.mark.parametrize("case", [
    "defect_transient_module_failure",
    "defect_usability_touches_gpu",
    "defect_peer_access",
    "defect_staging_retry",
    "defect_shutdown_order",
])
def test_gpu_path_defect(case):
    _case(case)


def test_no_kernels_on_simulated_devices():
    """A GPU for which no kernels exist: no fatbin and no NVRTC. Copies stay in the core, kernel work falls back to torch's result."""
    _case("no_kernels", FASTDP_DISABLE_NVRTC="1", FASTDP_DISABLE_FATBIN="1")


def test_library_status_and_out_of_memory():
    """.status carries the CUresult / ncclResult_t; CUDA out of memory (the driver's pool or PyTorch's
    allocator) is fastdp.CudaOutOfMemoryError, a torch.OutOfMemoryError."""
    _case("status")
