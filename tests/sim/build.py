"""Builds the simulated GPU (sim_cuda.c + sim_nccl.c → one shared object, reachable as libcuda.so.1 and
libnccl.so.2) with the machine's C compiler, cached under tests/sim/build/ by a hash of its sources and flags.

    from build import build; paths = build()            # plain, for Python processes
    build(sanitize=True)                                 # ASan/UBSan, for the sanitized C test program
    python tests/sim/build.py [--sanitize]               # prints the two library paths

Both names point at one file, so the dynamic loader maps it once and the driver and NCCL halves share state."""

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SOURCES = ["sim_cuda.c", "sim_nccl.c"]
HEADERS = [os.path.join(HERE, "sim.h"), os.path.join(ROOT, "csrc", "dl", "cuda_api.h"),
           os.path.join(ROOT, "csrc", "dl", "nccl_api.h"), os.path.join(ROOT, "csrc", "backend", "cuda", "kernels.h"),
           os.path.join(ROOT, "csrc", "fastdp.h"), os.path.join(ROOT, "csrc", "base", "base.h"),
           os.path.join(ROOT, "csrc", "core", "backend.h")]
CFLAGS = ["-std=c11", "-D_GNU_SOURCE", "-g", "-O1", "-fPIC", "-shared", "-Wall", "-Wextra", "-Werror",
          "-ffp-contract=off", "-fno-fast-math"]
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer"]


def compiler():
    """The C compiler tests/c/build.py picks ($CC, else cc, gcc or clang on PATH); None when there is none."""
    spec = importlib.util.spec_from_file_location("fastdp_c_tests_build", os.path.join(ROOT, "tests", "c", "build.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.compiler()


def build(sanitize=False):
    """Returns {"cuda": path of libcuda.so.1, "nccl": path of libnccl.so.2, "dir": folder}; builds when the
    sources or flags changed. Raises RuntimeError with the compiler output when the build fails."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install cc/gcc/clang)")
    flags = CFLAGS + (SANITIZE if sanitize else [])
    h = hashlib.sha256(" ".join([cc] + flags).encode())
    for f in [os.path.join(HERE, s) for s in SOURCES] + HEADERS:
        with open(f, "rb") as fh:
            h.update(fh.read())
    out = os.path.join(HERE, "build", ("asan-" if sanitize else "") + h.hexdigest()[:16])
    lib = os.path.join(out, "libsimgpu.so")
    paths = {"cuda": os.path.join(out, "libcuda.so.1"), "nccl": os.path.join(out, "libnccl.so.2"), "dir": out}
    if os.path.exists(paths["nccl"]):
        return paths
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(out))
    cmd = [cc, *flags, "-I" + os.path.join(ROOT, "csrc"), "-I" + HERE, *[os.path.join(HERE, s) for s in SOURCES],
           "-o", os.path.join(tmp, "libsimgpu.so"), "-Wl,-soname,libsimgpu.so", "-lm", "-pthread"]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError("building the simulated GPU failed:\n" + " ".join(cmd) + "\n" + proc.stdout)
    os.symlink("libsimgpu.so", os.path.join(tmp, "libcuda.so.1"))
    os.symlink("libsimgpu.so", os.path.join(tmp, "libnccl.so.2"))
    try:
        os.rename(tmp, out)
    except OSError:  # another process built it at the same time
        shutil.rmtree(tmp, ignore_errors=True)
    assert os.path.exists(lib)
    return paths


def env(sanitize=False, **extra):
    """Environment variables that make fastdp load the simulated libraries."""
    p = build(sanitize)
    e = {"FASTDP_CUDA_DRIVER_LIBRARY": p["cuda"], "FASTDP_NCCL_LIBRARY": p["nccl"]}
    e.update({k: str(v) for k, v in extra.items()})
    return e


if __name__ == "__main__":
    p = build("--sanitize" in sys.argv[1:])
    print(p["cuda"])
    print(p["nccl"])
