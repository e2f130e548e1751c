"""Run-time compilation of fastdp's kernels with NVRTC, through the core's own loader and compile path
(``_C.kernels_image``): needs an NVRTC library (``pip install nvidia-cuda-nvrtc``), no GPU."""

import ctypes
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from _kernel_subprocess import HEADER_BYTES, nvrtc_or_skip, run_images

ROOT = Path(__file__).resolve().parent.parent


def _supported_archs(library):
    """NVRTC's own list of real architectures, read straight from the library the core loaded."""
    lib = ctypes.CDLL(library)
    n = ctypes.c_int()
    assert lib.nvrtcGetNumSupportedArchs(ctypes.byref(n)) == 0
    archs = (ctypes.c_int * n.value)()
    assert lib.nvrtcGetSupportedArchs(archs) == 0
    return sorted(archs)


def _payload(result):
    data = Path(result["file"]).read_bytes()
    assert len(data) == HEADER_BYTES + result["bytes"]
    return data[HEADER_BYTES:]


def _elf_flags(cubin):
    assert cubin[:4] == b"\x7fELF", "a cubin is an ELF file"
    return cubin[7], struct.unpack_from("<I", cubin, 0x30)[0]  # EI_OSABI, e_flags (the target architecture)


def _sm(osabi, flags):
    """The SM number a cubin's e_flags name: in its low byte up to CUDA 12's ELF ABI (EI_OSABI 51), in its second
    byte from CUDA 13's (EI_OSABI 65), so cubins of two toolkit generations compare by this, not by raw flags."""
    return (flags >> 8) & 0xFF if osabi >= 65 else flags & 0xFF


def _nvcc():
    for cand in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if cand and (Path(cand) / "bin" / "nvcc").is_file():
            return str(Path(cand) / "bin" / "nvcc")
    return shutil.which("nvcc")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """sm_80 and sm_90 compiled in one fresh process with an empty cache."""
    nvrtc_or_skip()
    cache = tmp_path_factory.mktemp("kcache")
    results = run_images([80, 90], {"FASTDP_CACHE_DIR": str(cache)})
    return dict(zip((80, 90), results))


@pytest.mark.parametrize("cc", [80, 90])
def test_cubin_for_the_exact_architecture(compiled, cc, tmp_path):
    r = compiled[cc]
    assert "error" not in r, r
    assert (r["target"], r["arch"], r["origin"]) == ("cubin", cc, "compiled")
    print(f"NVRTC compile sm_{cc}: {r['seconds']:.3f} s, {r['bytes']} bytes")
    osabi, flags = _elf_flags(_payload(r))
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("no nvcc here to compare the cubin's architecture with")
    src = tmp_path / "k.cu"
    src.write_text("extern \"C\" __global__ void k(int *p) { p[threadIdx.x] = 1; }\n")
    ref = tmp_path / "k.cubin"
    subprocess.run([nvcc, "-cubin", f"-arch=sm_{cc}", str(src), "-o", str(ref)], check=True, capture_output=True)
    assert _sm(osabi, flags) == _sm(*_elf_flags(ref.read_bytes())) == cc, \
        "NVRTC's cubin targets another architecture than nvcc's"


def test_sm80_and_sm90_images_differ(compiled):
    a, b = _payload(compiled[80]), _payload(compiled[90])
    assert _elf_flags(a)[1] != _elf_flags(b)[1]


def test_gpu_newer_than_nvrtc_gets_ptx(tmp_path):
    info = nvrtc_or_skip()
    archs = _supported_archs(info["nvrtc_library"])
    newest = archs[-1]
    (r,) = run_images([newest + 10], {"FASTDP_CACHE_DIR": str(tmp_path)})
    assert (r["target"], r["arch"]) == ("ptx", newest), r
    ptx = _payload(r).rstrip(b"\0").decode()
    assert f".target sm_{newest}" in ptx
    for name in ("fdp_sum_f32", "fdp_sum_bf16", "fdp_copy_16"):
        assert f".entry {name}(" in ptx


def test_architecture_between_known_ones_gets_ptx_of_the_one_below(tmp_path):
    info = nvrtc_or_skip()
    archs = _supported_archs(info["nvrtc_library"])
    gaps = [(a, b) for a, b in zip(archs, archs[1:]) if b - a > 1]
    if not gaps:
        pytest.skip("this NVRTC knows every architecture in its range")
    below, above = gaps[0]
    (r,) = run_images([below + 1], {"FASTDP_CACHE_DIR": str(tmp_path)})
    assert (r["target"], r["arch"]) == ("ptx", below), r


def test_gpu_older_than_nvrtc_is_unavailable(tmp_path):
    info = nvrtc_or_skip()
    oldest = _supported_archs(info["nvrtc_library"])[0]
    (r,) = run_images([oldest - 5], {"FASTDP_CACHE_DIR": str(tmp_path)})
    assert r.get("error") == "BackendUnavailableError", r
    assert f"sm_{oldest - 5}" in r["message"] and f"sm_{oldest}" in r["message"]


def test_disable_knob(tmp_path):
    nvrtc_or_skip()
    (r,) = run_images([90], {"FASTDP_CACHE_DIR": str(tmp_path), "FASTDP_DISABLE_NVRTC": "1"})
    assert r.get("error") == "BackendUnavailableError" and "FASTDP_DISABLE_NVRTC" in r["message"]


def test_library_knob(tmp_path):
    info = nvrtc_or_skip()
    (bad,) = run_images([90], {"FASTDP_CACHE_DIR": str(tmp_path), "FASTDP_NVRTC_LIBRARY": str(tmp_path / "none.so")})
    assert bad.get("error") == "BackendUnavailableError" and "FASTDP_NVRTC_LIBRARY" in bad["message"]
    (good,) = run_images([90], {"FASTDP_CACHE_DIR": str(tmp_path), "FASTDP_NVRTC_LIBRARY": info["nvrtc_library"]})
    assert good["target"] == "cubin", good


def test_search_folders_are_fixed_once_nvrtc_is_loaded():
    nvrtc_or_skip()  # loads NVRTC in this process
    from fastdp import _C

    with pytest.raises(ValueError) as info:
        _C.nvrtc_search_dirs("/nowhere")
    assert str(info.value) == "NVRTC search folders must be set before NVRTC is first loaded"


def test_embedded_source_is_the_kernels_in_cuda():
    from fastdp import _C

    sys.path.insert(0, str(ROOT / "cuda"))
    try:
        from build_kernels import kernel_source
    finally:
        sys.path.pop(0)
    text = kernel_source(ROOT / "cuda")
    assert _C.kernels_info()["source_bytes"] == len(text.encode())
    assert "#include <" not in text.replace("#include <stddef.h>", ""), "NVRTC has no host or toolkit headers"


def test_info_table_shows_libraries_kernels_and_fallback():
    import json

    from fastdp import _C

    facts = _C.kernels_info()
    run = lambda *a: subprocess.run([sys.executable, "-m", "fastdp", "info", *a], capture_output=True, text=True,
                                    timeout=120, check=True).stdout
    info = json.loads(run("--json"))
    assert set(info["libraries"]) == {"host", "cuda", "nvrtc", "nccl"}
    assert info["libraries"]["nvrtc"]["library"] == (facts["nvrtc_library"] or None)
    assert info["kernels"]["fatbin_bytes"] == facts["fatbin_bytes"] and info["fallback"] is None
    table = run()
    nvrtc_row = next(line for line in table.splitlines() if line.startswith("nvrtc "))
    assert (facts["nvrtc_library"] or "none:") in nvrtc_row
    assert any(line.startswith("kernels: ") for line in table.splitlines())
    assert any(line.startswith("fallback: ") for line in table.splitlines())
    for name in ("host", "cuda", "nccl"):
        row = next(line for line in table.splitlines() if line.startswith(name + " "))
        assert row.split()[1] == "yes", "every backend is compiled"


def test_every_kernel_the_backend_binds_is_in_the_image(compiled):
    """The names kernel_module.c looks up (its k_sum_names / k_copy_names tables) are all defined in NVRTC's cubin."""
    import re

    table = (ROOT / "csrc" / "backend" / "cuda" / "kernel_module.c").read_text()
    names = set(re.findall(r'"(fdp_(?:sum|copy)_\w+)"', table))
    assert len(names) >= 10
    for cc in (80, 90):
        cubin = _payload(compiled[cc])
        missing = [n for n in sorted(names) if n.encode() + b"\0" not in cubin]
        assert not missing, f"sm_{cc} image lacks {missing}"


# ---- every target fastdp claims, with the real NVRTC and exactly fastdp's options ----

def _claimed_targets(nvrtc_archs):
    """The architectures fastdp claims: those the build's fatbin names (cuda/build_kernels.py's DEFAULT_ARCHS), and
    every one NVRTC knows from the oldest of them on (its compute_ PTX is documented to serve them all)."""
    sys.path.insert(0, str(ROOT / "cuda"))
    try:
        from build_kernels import DEFAULT_ARCHS, _parse_archs
    finally:
        sys.path.pop(0)
    named = sorted({int(num) for _, num in _parse_archs(DEFAULT_ARCHS)})
    return named, sorted(set(named) | {a for a in nvrtc_archs if a >= named[0]})


def _launch_bound():
    """FDP_KERNEL_THREADS: the block size every launch of the backend uses (csrc/backend/cuda/kernel_module.h)."""
    import re

    text = (ROOT / "csrc" / "backend" / "cuda" / "kernel_module.h").read_text()
    return int(re.search(r"#define FDP_KERNEL_THREADS (\d+)", text).group(1))


def _bound_names():
    import re

    table = (ROOT / "csrc" / "backend" / "cuda" / "kernel_module.c").read_text()
    return sorted(set(re.findall(r'"(fdp_(?:sum|copy)_\w+)"', table)))


class _Nvrtc:
    """The library the core loaded, driven directly: a compile's verdict, its log and its PTX."""

    def __init__(self, path):
        for builtins in sorted(Path(path).parent.glob("libnvrtc-builtins.so.*")):
            if builtins.name.count(".") >= 4:  # libnvrtc-builtins.so.MAJOR.MINOR, as NVRTC opens it
                ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
        self.lib = ctypes.CDLL(path)

    def compile(self, source, options):
        lib, prog, n = self.lib, ctypes.c_void_p(), ctypes.c_size_t()
        assert lib.nvrtcCreateProgram(ctypes.byref(prog), source, b"fastdp_kernels.cu", 0, None, None) == 0
        try:
            argv = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            verdict = lib.nvrtcCompileProgram(prog, len(options), argv)
            assert lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n)) == 0
            log = ctypes.create_string_buffer(max(n.value, 1))
            assert lib.nvrtcGetProgramLog(prog, log) == 0
            ptx = ""
            if verdict == 0 and lib.nvrtcGetPTXSize(prog, ctypes.byref(n)) == 0 and n.value > 1:
                buf = ctypes.create_string_buffer(n.value)
                assert lib.nvrtcGetPTX(prog, buf) == 0
                ptx = buf.value.decode()
            return verdict, log.value.decode(errors="replace").strip(), ptx
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _entries(ptx):
    """{kernel name: its .maxntid (x, y, z), or None when it has none} for every .entry of a PTX text."""
    import re

    out = {}
    for chunk in ptx.split(".entry ")[1:]:
        name = chunk.split("(", 1)[0].strip()
        head = chunk.split("{", 1)[0]
        m = re.search(r"\.maxntid\s+(\d+)(?:,\s*(\d+))?(?:,\s*(\d+))?", head)  # newer NVVM omits y and z
        out[name] = tuple(int(v or 1) for v in m.groups()) if m else None
    return out


@pytest.fixture(scope="module")
def claimed(tmp_path_factory):
    info = nvrtc_or_skip()
    named, targets = _claimed_targets(_supported_archs(info["nvrtc_library"]))
    results = run_images(targets, {"FASTDP_CACHE_DIR": str(tmp_path_factory.mktemp("claimed"))})
    return info, named, dict(zip(targets, results))


# Part of the simulated-GPU checks (scripts/sim_tests.sh, which the mutation runs use): what NVRTC accepts and produces
# is a rule of the GPU path that the simulator, which runs the kernels as host C++, cannot see.
@pytest.mark.sim
def test_every_claimed_target_compiles_through_fastdp(claimed):
    """fastdp's own path (its loader, its options, its cache) gives a cubin for the exact architecture of every
    target it claims; one this NVRTC cannot build is named here, not on a user's GPU."""
    info, named, results = claimed
    archs = _supported_archs(info["nvrtc_library"])
    missing = [cc for cc in named if cc not in archs]
    assert not missing, f"the build claims sm_{missing} but NVRTC {info['nvrtc_version']} cannot compile for them"
    for cc, r in results.items():
        assert "error" not in r, (cc, r)
        assert (r["target"], r["arch"]) == ("cubin", cc), r
        assert f"sm_{cc}" in r["options"].split()[0], r["options"]
    print("targets: " + ", ".join(f"sm_{cc}" for cc in results))


@pytest.mark.sim
def test_nvrtc_verdict_log_and_code_for_every_claimed_target(claimed):
    """The same source with exactly the options fastdp passed (as it reports them): NVRTC accepts them without a
    word in its log, and the code it produces has every kernel fastdp binds, each bounded to the block size every
    launch uses (its .maxntid), which is also the bound the simulated driver enforces."""
    info, _, results = claimed
    nvrtc = _Nvrtc(info["nvrtc_library"])
    sys.path.insert(0, str(ROOT / "cuda"))
    try:
        from build_kernels import kernel_source
    finally:
        sys.path.pop(0)
    source = kernel_source(ROOT / "cuda").encode()
    threads, names = _launch_bound(), _bound_names()
    sim_bounds = _sim_launch_bounds()
    for cc, r in results.items():
        verdict, log, ptx = nvrtc.compile(source, r["options"].split())
        assert verdict == 0, f"sm_{cc}: NVRTC refuses {r['options']!r}: {log}"
        assert log == "", f"sm_{cc}: NVRTC's log is not empty with {r['options']!r}:\n{log}"
        assert f".target sm_{cc}" in ptx
        entries = _entries(ptx)
        for name in names:
            assert name in entries, f"sm_{cc}: no kernel {name} in NVRTC's code"
            assert entries[name] == (threads, 1, 1), \
                f"sm_{cc}: {name} is bounded to {entries[name]} threads, every launch uses {threads}"
            assert sim_bounds(name) == threads, f"the simulated driver bounds {name} to {sim_bounds(name)}"


def _sim_launch_bounds():
    import importlib.util

    spec = importlib.util.spec_from_file_location("fastdp_sim_build", ROOT / "tests" / "sim" / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    table = mod.launch_bounds()
    return lambda name: next(t for n, prefix, t in table if (name.startswith(n) if prefix else name == n))
