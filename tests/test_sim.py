"""The C programs on the simulated GPU (tests/sim): tests/c/test_gpu_ops.c runs every core operation through the
cuda and nccl backends under ASan/UBSan, bit-exact against its host reference, with the simulator's misuse and
race checks; then its fault-injection sweep makes every driver/NCCL call fail in turn, one entry point per test
item, and once more with each failure followed by a failure of the recovery. Each runs in a subprocess with a timeout, so a hang or crash fails one item."""

import functools
import importlib.util
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.sim

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD_SCRIPT = os.path.join(HERE, "c", "build.py")


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_cbuild = _load("fastdp_c_tests_build", BUILD_SCRIPT)
_simbuild = _load("fastdp_sim_build", os.path.join(HERE, "sim", "build.py"))

SWEPT = """cuDeviceGet cuDeviceGetAttribute cuDevicePrimaryCtxRetain cuDevicePrimaryCtxGetState cuCtxPushCurrent_v2
    cuCtxPopCurrent_v2 cuCtxGetCurrent cuCtxSetCurrent cuCtxEnablePeerAccess cuMemAllocAsync cuMemFreeAsync
    cuMemcpyAsync cuMemcpyHtoDAsync_v2 cuMemcpyDtoHAsync_v2 cuStreamSynchronize cuMemcpyPeerAsync cuMemcpy2DAsync_v2
    cuMemcpy3DPeerAsync cuEventCreate cuEventRecord cuEventDestroy_v2 cuStreamWaitEvent cuModuleLoadData
    cuModuleGetFunction cuLaunchKernel ncclCommInitAll ncclGroupStart ncclGroupEnd ncclBroadcast ncclReduce""".split()


def _need_cc():
    if _cbuild.compiler() is None:
        pytest.skip("no C compiler found (cc, gcc or clang; or set CC): the simulated GPU needs one")


@functools.lru_cache(maxsize=None)
def _gpu_ops_exe():
    """Builds the sanitized simulator and tests/c/test_gpu_ops.c once per session; returns (exe, env)."""
    env = dict(os.environ, **_simbuild.env(sanitize=True))
    proc = subprocess.run([sys.executable, BUILD_SCRIPT, "--gpu-ops", "--build-only"], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, f"building tests/c/test_gpu_ops.c failed:\n{proc.stdout}"
    env["ASAN_OPTIONS"] = "detect_leaks=0:abort_on_error=0:halt_on_error=1"
    env["UBSAN_OPTIONS"] = _cbuild.UBSAN_OPTIONS
    return _cbuild.GPU_EXE, env


def _run(args, timeout, detect_leaks=False, extra_env=None):
    exe, env = _gpu_ops_exe()
    env = dict(env, **(extra_env or {}))
    if detect_leaks:
        env = dict(env, ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:halt_on_error=1")
    proc = subprocess.run([exe, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    out = proc.stdout
    if proc.returncode != 0 and detect_leaks and any(s in out for s in _cbuild.LSAN_BROKEN):
        return _run(args, timeout, extra_env=extra_env)
    closing = re.findall(r"^(\d+) passed, (\d+) failed$", out, re.MULTILINE)
    assert closing, f"no closing 'N passed, M failed' line (exit {proc.returncode}):\n{out[-20000:]}"
    passed, failed = map(int, closing[-1])
    assert proc.returncode == 0 and failed == 0 and passed > 0, f"{failed} checks failed:\n{out[-20000:]}"
    return out


# The core's scratch memory: the driver's pool (a PyTorch without CUDA, other embedders), or a caching allocator
# registered as the binding registers PyTorch's (every CUDA build of torch: the route users take). See
# tests/sim/README.md, "The registered allocator".
ROUTES = {"pool": {}, "caching": {"SIMGPU_ALLOCATOR": "caching"}}
SCRATCH = {"pool": "the driver's pool", "caching": "the simulated caching allocator (registered)"}


@pytest.mark.parametrize("route", ROUTES)
def test_gpu_ops_on_simulated_gpu(route):
    _need_cc()
    out = _run([], timeout=300, detect_leaks=True, extra_env=ROUTES[route])
    assert "simulated GPU" in out and f"scratch memory: {SCRATCH[route]}" in out


@pytest.mark.parametrize("route", ROUTES)
def test_gpu_ops_on_one_simulated_gpu(route):
    """The GPU check machine has one GPU: the program must pass there too."""
    _need_cc()
    _gpu_ops_exe()
    out = _run([], timeout=300, extra_env={"SIMGPU_DEVICES": "1", **ROUTES[route]})
    assert "1 device(s)" in out


# Each route's own allocation entry: cuMemAllocAsync (the pool), simgpu_cache_alloc (the registered allocator).
_ALLOCATING = {"cuMemAllocAsync": "pool", "simgpu_cache_alloc": "caching"}
SWEEPS = [(entry, route) for route in ROUTES for entry in SWEPT + ["simgpu_cache_alloc"]
          if _ALLOCATING.get(entry, route) == route]


@pytest.mark.parametrize("entry, route", SWEEPS)
def test_fault_injection_sweep(entry, route):
    """Every operation with each call of `entry` failing in turn: FDP_CUDA/FDP_NCCL with a detail (or success),
    no misuse, no leaked push/stream/event/allocation/group, caches released at shutdown, and the next call
    succeeds with the right result."""
    _need_cc()
    out = _run(["--sweep", "--only", entry], timeout=240, extra_env=ROUTES[route])
    assert re.search(r"^sweep: ", out, re.MULTILINE), out


@pytest.mark.parametrize("route", ROUTES)
def test_fault_injection_pairs(route):
    """Two failures in a row: each call of every operation failing, then the next call of each recovery's fallback
    (the host wait, the context push it needs, a plain free, a communicator's abort) failing too. Nothing may be
    freed under work that may still use it (a race in the simulator), only what work may still use may leak, and the
    next call succeeds."""
    _need_cc()
    out = _run(["--pairs"], timeout=240, extra_env=ROUTES[route])
    assert re.search(r"^sweep: .*each followed by another", out, re.MULTILINE), out


def _race_env():
    """Kernels from NVRTC images during the race, where NVRTC is found (one thread then drops the images kept in
    memory while another loads one); the fatbin otherwise."""
    try:
        from fastdp import _C

        nvrtc = _C.kernels_info()["nvrtc_library"]
    except Exception:  # noqa: BLE001 -- no fastdp or no NVRTC: the race runs on the fatbin
        nvrtc = ""
    return {"FASTDP_DISABLE_FATBIN": "1", "FASTDP_NVRTC_LIBRARY": nvrtc} if nvrtc else {}


def test_first_use_races():
    """Threads racing on the first use of everything fastdp makes lazily per device (contexts, peer access, kernel
    modules and images, communicator sets, facts), with the simulator pausing inside each making call: right
    results, no misuse, NCCL launches of threads never interleaved without PyTorch's free mutex, nothing made
    twice, and no image freed under a load (AddressSanitizer)."""
    _need_cc()
    out = _run(["--race"], timeout=180, detect_leaks=True, extra_env=_race_env())
    assert re.search(r"^race: \d+ rounds", out, re.MULTILINE), out


@functools.lru_cache(maxsize=None)
def _tsan_exe():
    """tests/c/test_gpu_ops.c under ThreadSanitizer, against the simulator built for it; None when the compiler
    cannot build with ThreadSanitizer."""
    env = dict(os.environ, **_simbuild.env(for_tsan=True))
    proc = subprocess.run([sys.executable, BUILD_SCRIPT, "--gpu-ops", "--tsan", "--build-only"], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    if proc.returncode != 0 and ("tsan" in proc.stdout or "sanitize=thread" in proc.stdout):
        return None, proc.stdout
    assert proc.returncode == 0, f"building tests/c/test_gpu_ops.c under ThreadSanitizer failed:\n{proc.stdout}"
    env["TSAN_OPTIONS"] = _cbuild.TSAN_OPTIONS
    return _cbuild.TSAN_EXE, env


def test_first_use_races_under_thread_sanitizer():
    """The same race under ThreadSanitizer: lazily made state read by another thread before it was published (a
    load or store with too weak an order, a pointer published before what it points to is written) is a data
    race. The simulator's lock is invisible to the sanitizer, so only fastdp's own synchronisation orders fastdp's
    accesses."""
    _need_cc()
    exe, env = _tsan_exe()
    if exe is None:
        pytest.skip(f"the C compiler cannot build with ThreadSanitizer:\n{env[-2000:]}")
    proc = subprocess.run([exe, "--race"], env=dict(env, **_race_env()), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=180)
    assert proc.returncode == 0 and "ThreadSanitizer" not in proc.stdout, proc.stdout[-20000:]
    assert re.search(r"^race: \d+ rounds", proc.stdout, re.MULTILINE), proc.stdout[-20000:]


def test_simulator_exports_every_symbol_the_loaders_resolve():
    """Every driver entry point of FDP_CU_ENTRY_POINTS (csrc/dl/cuda_api.h) and every name in nccl_loader.c's k_syms
    table (optional ones included) is an entry point of the simulator: a loader that learns a new symbol needs it
    simulated too (tests/sim/sim.h)."""
    _need_cc()
    import ctypes

    lib = ctypes.CDLL(_simbuild.build()["cuda"])
    root = os.path.dirname(HERE)
    with open(os.path.join(root, "csrc", "dl", "cuda_api.h")) as fh:
        names = re.findall(r"^  X\(\w+, (\w+), [01],", fh.read(), re.M)
    with open(os.path.join(root, "csrc", "dl", "nccl_loader.c")) as fh:
        text = fh.read()
    table = text[text.index("k_syms[] = {"):]
    table = table[:table.index("};")]
    names += re.findall(r'\{"(\w+)", offsetof', table)
    assert len(names) > 40, names
    missing = [n for n in names if not hasattr(lib, n)]
    assert not missing, f"the simulated GPU lacks {missing}: add them to tests/sim (SIM_ENTRIES in sim.h, and code)"


def _toolkit_cuda_h():
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.path.isfile(os.path.join(home, "include", "cuda.h")):
            return os.path.join(home, "include", "cuda.h")
    return None


def test_simulator_signatures_match_the_toolkit(tmp_path):
    """The simulated GPU's C files (build.py's SOURCES: the driver's files, NCCL, host memory) compiled with the
    toolkit's cuda.h in scope: every entry point they define must have the real prototype (a conflicting type is a
    compile error). Skipped where no toolkit header is found."""
    _need_cc()
    cuda_h = _toolkit_cuda_h()
    if cuda_h is None:
        pytest.skip("no CUDA toolkit cuda.h (CUDA_HOME, CUDA_PATH, /usr/local/cuda) to compare with")
    root = os.path.dirname(HERE)
    _simbuild.write_bounds_header(str(tmp_path))  # the launch bounds table build.py generates
    cmd = [_cbuild.compiler(), "-std=c11", "-D_GNU_SOURCE", "-fsyntax-only", "-Wall", "-Wextra", "-Werror",
           "-I" + os.path.join(root, "csrc"), "-I" + os.path.join(HERE, "sim"), "-I" + str(tmp_path),
           "-include", cuda_h,
           *[os.path.join(HERE, "sim", src) for src in _simbuild.SOURCES]]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout


def test_library_knob_loads_exactly_that_file(tmp_path):
    """FASTDP_CUDA_DRIVER_LIBRARY / FASTDP_NCCL_LIBRARY naming a missing file: nothing else is loaded instead, and
    the reason names the file."""
    missing = str(tmp_path / "no-such-libcuda.so.1")
    code = ("import fastdp; b = fastdp._C.info()['backends']; "
            "print(b['cuda']['usable'], b['nccl']['usable']); print(b['cuda']['why'])")
    env = dict(os.environ, FASTDP_CUDA_DRIVER_LIBRARY=missing, FASTDP_NCCL_LIBRARY=missing)
    proc = subprocess.run([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=120, cwd=HERE)
    assert proc.returncode == 0, proc.stdout
    lines = proc.stdout.strip().splitlines()
    assert lines[-2] == "False False" and missing in lines[-1], proc.stdout
