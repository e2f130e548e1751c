"""The cuda backend's kernel-module cache (which image failures stick, and the fatbin → NVRTC order), driven through
the core on the simulated GPU, whose cuModuleLoadData is made to fail on chosen calls (SIMGPU_FAIL): only an image
the driver refuses sticks; out-of-memory is retried; copies never need kernels; a refused fatbin moves on to NVRTC."""

import glob
import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
pytestmark = pytest.mark.sim  # runs on the simulated GPU (scripts/sim_tests.sh)
CFLAGS = ["-std=c11", "-D_GNU_SOURCE", "-g", "-O1", "-Wall", "-Wextra", "-Werror", "-fsanitize=address,undefined",
          "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer"]


def _cc():
    for name in filter(None, [os.environ.get("CC"), "cc", "gcc", "clang"]):
        if shutil.which(name):
            return shutil.which(name)
    pytest.skip("no C compiler")


def _blob(path, fatbin):
    spec = importlib.util.spec_from_file_location("fdp_bk", ROOT / "cuda" / "build_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.build_blob(ROOT / "cuda", None, path)
    if fatbin:  # a stand-in fatbin: the simulated driver loads any image it can read to its end (this one ends at
        # its NUL) unless told to fail
        text = path.read_text()
        text = text.replace("fdp__kernels_fatbin[] = {0};", "fdp__kernels_fatbin[] = {1, 2, 3, 0};")
        text = text.replace("fdp__kernels_fatbin_size = 0;", "fdp__kernels_fatbin_size = 4;")
        assert "fdp__kernels_fatbin_size = 4;" in text
        path.write_text(text)
    return path


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    cc = _cc()
    out = tmp_path_factory.mktemp("kmod")
    sim = _load("fastdp_sim_build", HERE / "sim" / "build.py").env(sanitize=True)
    core = []
    for sub in ("base", "core", "backend/host", "backend/cuda", "dl"):
        core += sorted(glob.glob(str(ROOT / "csrc" / sub / "*.c")))
    exes = {}
    for kind in ("source_only", "with_fatbin"):
        blob = _blob(out / f"blob_{kind}.c", kind == "with_fatbin")
        exe = out / f"kernel_module_{kind}"
        subprocess.run([cc, *CFLAGS, f"-I{ROOT / 'csrc'}", *core, str(blob), str(HERE / "kmod" / "kernel_module.c"),
                        "-o", str(exe), "-lm", "-pthread", "-ldl"], check=True)
        exes[kind] = exe
    return sim, exes


def _nvrtc_dirs():
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations) if spec else []
    return ":".join(os.path.join(r, s) for s in ("cu13/lib", "cuda_nvrtc/lib") for r in roots)


def _has_nvrtc():
    from fastdp import _C

    return bool(_C.kernels_info()["nvrtc_version"][0])


@pytest.mark.parametrize(
    "kind, scenario, results, extra, needs_nvrtc",
    [
        ("source_only", "transient", "2", {}, True),
        ("source_only", "sticky", "209", {}, True),
        ("source_only", "no_kernels", "", {"FASTDP_DISABLE_NVRTC": "1"}, False),
        ("with_fatbin", "fatbin_refused", "209", {}, True),
        ("with_fatbin", "fatbin_transient", "2", {"FASTDP_DISABLE_NVRTC": "1"}, False),
    ],
)
def test_kernel_module(build, tmp_path, kind, scenario, results, extra, needs_nvrtc):
    if needs_nvrtc and not _has_nvrtc():
        pytest.skip("no NVRTC here")
    sim, exes = build
    fail = ",".join(f"cuModuleLoadData:{k}:{code}" for k, code in enumerate(results.split(","), 1) if code)
    env = {**os.environ, **sim, "SIMGPU_FAIL": fail, "FASTDP_CACHE_DIR": str(tmp_path), "NVRTC_DIRS": _nvrtc_dirs(),
           "ASAN_OPTIONS": "detect_leaks=0", **extra}
    for k in ("FASTDP_DISABLE_CUDA", "FASTDP_DISABLE_FATBIN"):
        env.pop(k, None)
    res = subprocess.run([str(exes[kind]), scenario], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.strip().endswith(f"{scenario}: ok")
