"""Builds a C test program with the core and every backend under AddressSanitizer and UndefinedBehaviorSanitizer,
runs it, and exits with its status.

    python tests/c/build.py [--build-only | --no-build] [--list | SUITE...]
        tests/c/test_core.c and its suites (core_*.c): the core and the host backend (no CUDA toolkit needed; an
        empty kernel blob). Runs every suite, or the SUITEs named; --list prints the suite names, one a line
        (tests/test_c_core.py makes one pytest item of each); --no-build reuses the program built before.
    python tests/c/build.py --gpu-ops [--sim] [--sweep | --pairs | --race] [--build-only] [--no-sanitize | --tsan]
        tests/c/test_gpu_ops.c and its parts (gpu_ops_*.c): every operation through the cuda and nccl backends.
        Against the driver and NCCL that FASTDP_CUDA_DRIVER_LIBRARY / FASTDP_NCCL_LIBRARY name, or the system's
        libcuda.so.1/libnccl.so.2 when unset (then the kernels are the nvcc fatbin when a toolkit is found). --sim sets both variables to
        the simulated GPU of tests/sim (built here, sanitized); --sweep runs its fault-injection sweep instead,
        --pairs the sweep with each failure followed by another, --race threads racing on first use.
        --no-sanitize builds without ASan/UBSan (e.g. to run tests/c/build/test_gpu_ops under compute-sanitizer);
        --tsan builds tests/c/build/test_gpu_ops_tsan under ThreadSanitizer instead (with --sim, against a simulator
        built for it: see tests/sim/build.py).
        Exit status 77: no usable driver or device (skipped)."""

import glob
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BUILD = os.path.join(HERE, "build")
EXE = os.path.join(BUILD, "test_core")
GPU_EXE = os.path.join(BUILD, "test_gpu_ops")
TSAN_EXE = os.path.join(BUILD, "test_gpu_ops_tsan")
# Accesses the simulated GPU makes through intercepted functions (memcpy of its device pages, under a lock the
# sanitizer cannot see) are not the code under test's: ignored (tests/sim/build.py, for_tsan).
TSAN_SUPPRESSIONS = os.path.join(ROOT, "tests", "sim", "tsan.supp")
TSAN_OPTIONS = f"suppressions={TSAN_SUPPRESSIONS}:halt_on_error=1:second_deadlock_stack=1"

CFLAGS = [
    "-std=c11", "-D_GNU_SOURCE", "-g", "-O1", "-Wall", "-Wextra", "-Werror",
    "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer",
]
UBSAN_OPTIONS = "halt_on_error=1:print_stacktrace=1"
# What LeakSanitizer prints when it cannot run (e.g. ptrace is forbidden in a sandbox).
LSAN_BROKEN = ("LeakSanitizer has encountered a fatal error", "LeakSanitizer does not work under ptrace")


def compiler():
    """The C compiler: $CC, else cc, gcc or clang on PATH; None when there is none."""
    for name in filter(None, [os.environ.get("CC"), "cc", "gcc", "clang"]):
        path = shutil.which(name)
        if path:
            return path
    return None


def build_kernels_module():
    """cuda/build_kernels.py, loaded by path (it is not part of the installed package)."""
    spec = importlib.util.spec_from_file_location("fastdp_build_kernels",
                                                  os.path.join(ROOT, "cuda", "build_kernels.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def empty_blob():
    """A kernel blob with no fatbin, as a build without nvcc has (cuda/build_kernels.py writes it)."""
    path = os.path.join(BUILD, "fdp_kernels_blob.c")
    mod = build_kernels_module()
    mod.build_blob(os.path.join(ROOT, "cuda"), None, path)
    return path


def kernel_blob(simulated):
    """The kernels for the GPU test: on the simulated GPU a stand-in image (it runs fastdp's kernels on the host
    and accepts any image); otherwise the nvcc fatbin when a toolkit is found, else the empty blob (a build
    without nvcc)."""
    path = os.path.join(BUILD, "fdp_kernels_blob_gpu.c")
    mod = build_kernels_module()
    if simulated:
        mod._write_c(path, b"fastdp simulated kernels\0", "stand-in image for the simulated GPU",
                     mod.kernel_source(os.path.join(ROOT, "cuda")))
        return path
    nvcc = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.path.exists(p)), None)
    cuda_home = os.path.dirname(os.path.dirname(os.path.realpath(nvcc))) if nvcc else None
    mod.build_blob(os.path.join(ROOT, "cuda"), cuda_home, path)
    return path


# The C files of each test program: its main file, the files of its suites, what they share, and the checks both
# programs count with.
CORE_PROGRAM = ["test_core.c", "core_harness.c", "core_errors.c", "core_backends.c", "core_layout.c", "core_plan.c",
                "core_copy.c", "core_collectives.c", "core_reduce.c", "core_kernel_cache.c", "check.c"]
# The NVRTC that core_kernel_cache.c compiles with: a stand-in whose images say what they were built from.
FAKE_NVRTC = os.path.join(BUILD, "libfake_nvrtc.so")
GPU_OPS_PROGRAM = ["test_gpu_ops.c", "gpu_ops_harness.c", "gpu_ops_copy.c", "gpu_ops_reduce.c", "gpu_ops_threads.c",
                   "gpu_ops_kernels.c", "gpu_ops_nccl.c", "gpu_ops_sweep.c", "check.c"]


def sources(gpu_ops=False, simulated=False):
    files = []
    for sub in (("base",), ("core",), ("backend", "host"), ("backend", "cuda"), ("dl",)):
        files += sorted(glob.glob(os.path.join(ROOT, "csrc", *sub, "*.c")))
    if gpu_ops:
        return files + [kernel_blob(simulated)] + [os.path.join(HERE, f) for f in GPU_OPS_PROGRAM]
    return files + [empty_blob()] + [os.path.join(HERE, f) for f in CORE_PROGRAM]


def build(cc, gpu_ops=False, simulated=False, sanitize=True, tsan=False):
    os.makedirs(BUILD, exist_ok=True)
    exe = TSAN_EXE if tsan else GPU_EXE if gpu_ops else EXE
    flags = CFLAGS if sanitize and not tsan else [f for f in CFLAGS if not f.startswith("-fsanitize") and
                                                   "sanitize" not in f]
    if tsan:
        flags = flags + ["-fsanitize=thread"]
    cmd = [cc, *flags, "-I" + os.path.join(ROOT, "csrc"), *sources(gpu_ops, simulated), "-o", exe, "-lm", "-pthread",
           "-ldl"]
    print("+ " + " ".join(os.path.relpath(a, ROOT) if a.startswith(ROOT) else a for a in cmd), flush=True)
    rc = subprocess.call(cmd, cwd=ROOT)
    if rc == 0 and not gpu_ops:
        rc = subprocess.call([cc, "-std=c11", "-g", "-O1", "-Wall", "-Wextra", "-Werror", "-fPIC", "-shared",
                              os.path.join(HERE, "fake_nvrtc.c"), "-o", FAKE_NVRTC], cwd=ROOT)
    return rc


def run(detect_leaks, exe=EXE, args=()):
    env = dict(os.environ)
    # protect_shadow_gap=0: the real CUDA driver maps memory where ASan's shadow gap would be (cuInit fails else).
    env["ASAN_OPTIONS"] = f"detect_leaks={detect_leaks}:abort_on_error=0:halt_on_error=1:protect_shadow_gap=0"
    env["UBSAN_OPTIONS"] = UBSAN_OPTIONS
    env["TSAN_OPTIONS"] = TSAN_OPTIONS
    with tempfile.TemporaryDirectory(prefix="fastdp-kcache-") as cache:
        if exe == EXE:  # core_kernel_cache.c: the fake NVRTC, and a kernel cache of its own
            env.update(FASTDP_NVRTC_LIBRARY=FAKE_NVRTC, FASTDP_CACHE_DIR=cache)
        proc = subprocess.run([exe, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    return proc.returncode, proc.stdout


def use_simulator(sanitize=True, tsan=False):
    """Points FASTDP_CUDA_DRIVER_LIBRARY / FASTDP_NCCL_LIBRARY at the simulated GPU (tests/sim), built with the
    sanitizers when the test program is (or for a program under ThreadSanitizer)."""
    spec = importlib.util.spec_from_file_location("fastdp_sim_build", os.path.join(ROOT, "tests", "sim", "build.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    os.environ.update(mod.env(sanitize=sanitize and not tsan, for_tsan=tsan))


def main(argv):
    cc = compiler()
    if cc is None:
        print("no C compiler found (set CC, or install cc/gcc/clang)", file=sys.stderr)
        return 127
    gpu_ops = "--gpu-ops" in argv
    tsan = gpu_ops and "--tsan" in argv
    if gpu_ops and "--sim" in argv:
        use_simulator(sanitize="--no-sanitize" not in argv, tsan=tsan)
    simulated = gpu_ops and bool(os.environ.get("FASTDP_CUDA_DRIVER_LIBRARY"))
    exe = TSAN_EXE if tsan else GPU_EXE if gpu_ops else EXE
    reuse = "--no-build" in argv and os.path.exists(exe)
    rc = 0 if reuse else build(cc, gpu_ops, simulated, sanitize="--no-sanitize" not in argv, tsan=tsan)
    if rc != 0:
        print(f"build failed ({rc})", flush=True)
        return rc or 1
    if "--build-only" in argv:
        return 0
    args = [a for a in argv if a in ("--sweep", "--pairs", "--race")]
    if "--only" in argv and argv.index("--only") + 1 < len(argv):
        args += ["--only", argv[argv.index("--only") + 1]]
    if not gpu_ops:
        args = ["--list"] if "--list" in argv else [a for a in argv if not a.startswith("--")]
    # The real driver keeps allocations to process exit that LeakSanitizer would report: leaks are checked on
    # the simulated GPU only.
    leaks = 0 if (gpu_ops and not simulated) or tsan else 1
    rc, out = run(leaks, exe, args)
    if rc != 0 and leaks and any(s in out for s in LSAN_BROKEN):
        print("LeakSanitizer cannot run here (ptrace restrictions?); rerunning with detect_leaks=0", flush=True)
        rc, out = run(0, exe, args)
        out += "note: leak detection was off (LeakSanitizer unavailable in this environment)\n"
    sys.stdout.write(out)
    sys.stdout.flush()
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
