"""Builds the simulated GPU (the driver's files, sim_nccl.c, sim_host.c and the kernels → one shared object,
reachable as libcuda.so.1 and libnccl.so.2) with the machine's C and C++ compilers, cached under tests/sim/build/ by
a hash of its sources and flags.

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
SOURCES = ["sim_state.c", "sim_device.c", "sim_context.c", "sim_stream.c", "sim_memory.c", "sim_copy.c", "sim_launch.c",
           "sim_arith.c", "sim_controls.c", "sim_allocator.c", "sim_nccl.c", "sim_host.c"]
# fastdp's real kernels, compiled as host C++ with kernel_host.h (sim_kernels.cc runs them over their grids).
KERNELS = [os.path.join(ROOT, "cuda", "sum.cu"), os.path.join(ROOT, "cuda", "copy.cu")]
CXX_SOURCES = [os.path.join(HERE, "sim_kernels.cc")]
HEADERS = [os.path.join(HERE, "sim.h"), os.path.join(HERE, "sim_driver.h"), os.path.join(HERE, "kernel_host.h"),
           os.path.join(ROOT, "csrc", "dl", "cuda_api.h"), os.path.join(ROOT, "csrc", "dl", "nccl_api.h"),
           os.path.join(ROOT, "csrc", "backend", "cuda", "kernels.h"), os.path.join(ROOT, "csrc", "fastdp.h"),
           os.path.join(ROOT, "csrc", "base", "base.h"), os.path.join(ROOT, "csrc", "core", "backend.h")]
CXXFLAGS = ["-std=c++17", "-g", "-O1", "-fPIC", "-Wall", "-Wextra", "-Werror", "-ffp-contract=off", "-fno-fast-math"]
CFLAGS = ["-std=c11", "-D_GNU_SOURCE", "-g", "-O1", "-fPIC", "-shared", "-Wall", "-Wextra", "-Werror",
          "-ffp-contract=off", "-fno-fast-math"]
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer"]
# The kernel sources: every typed access checked for alignment, trapping where it is misaligned, as a GPU faults
# (sim_kernels.cc reports the trap as the launch's failure); AddressSanitizer too in the sanitized build.
KERNEL_CHECKS = ["-fsanitize=alignment", "-fsanitize-undefined-trap-on-error"]
KERNEL_SANITIZE = ["-fsanitize=address", "-fno-omit-frame-pointer"]


def compiler():
    """The C compiler tests/c/build.py picks ($CC, else cc, gcc or clang on PATH); None when there is none."""
    spec = importlib.util.spec_from_file_location("fastdp_c_tests_build", os.path.join(ROOT, "tests", "c", "build.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.compiler()


def cxx_compiler():
    """The C++ compiler for the kernels: $CXX, else c++, g++ or clang++ on PATH; None when there is none."""
    for name in filter(None, [os.environ.get("CXX"), "c++", "g++", "clang++"]):
        path = shutil.which(name)
        if path:
            return path
    return None


def build(sanitize=False, for_tsan=False):
    """Returns {"cuda": path of libcuda.so.1, "nccl": path of libnccl.so.2, "dir": folder}; builds when the
    sources or flags changed. Raises RuntimeError with the compiler output when the build fails. `for_tsan`: for a
    program under ThreadSanitizer, uninstrumented, with a lock the sanitizer cannot see (sim_state.c)."""
    cc, cxx = compiler(), cxx_compiler()
    if cc is None or cxx is None:
        raise RuntimeError("no C and C++ compiler found (set CC and CXX, or install gcc/g++ or clang/clang++)")
    flags = CFLAGS + (SANITIZE if sanitize else []) + (["-DSIM_OPAQUE_LOCK"] if for_tsan else [])
    h = hashlib.sha256(" ".join([cc, cxx] + flags + CXXFLAGS + KERNEL_CHECKS).encode())
    for f in [os.path.join(HERE, s) for s in SOURCES] + KERNELS + CXX_SOURCES + HEADERS:
        with open(f, "rb") as fh:
            h.update(fh.read())
    out = os.path.join(HERE, "build", ("asan-" if sanitize else "tsan-" if for_tsan else "") + h.hexdigest()[:16])
    lib = os.path.join(out, "libsimgpu.so")
    paths = {"cuda": os.path.join(out, "libcuda.so.1"), "nccl": os.path.join(out, "libnccl.so.2"), "dir": out}
    if os.path.exists(paths["nccl"]):
        return paths
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(out))
    includes = ["-I" + os.path.join(ROOT, "csrc"), "-I" + os.path.join(ROOT, "csrc", "backend", "cuda"), "-I" + HERE]
    objects, cmds = [], []
    for src in KERNELS + CXX_SOURCES:
        obj = os.path.join(tmp, os.path.basename(src) + ".o")
        if src.endswith(".cu"):
            # The kernels' own warnings are nvcc's business (a build there has no -Werror either).
            cxxflags = CXXFLAGS + KERNEL_CHECKS + (KERNEL_SANITIZE if sanitize else [])
            lang = ["-x", "c++", "-DFDP_HOST_EMULATION", "-Wno-error"]
        else:
            cxxflags, lang = CXXFLAGS + (SANITIZE if sanitize else []), []
        cmds.append([cxx, *cxxflags, *includes, "-include", os.path.join(HERE, "kernel_host.h"), *lang, "-c", src,
                     "-o", obj])
        objects.append(obj)
    cmds.append([cc, *flags, *includes, *[os.path.join(HERE, s) for s in SOURCES], *objects, "-o",
                 os.path.join(tmp, "libsimgpu.so"), "-Wl,-soname,libsimgpu.so", "-lstdc++", "-lm", "-pthread",
                 # every symbol defined (NOTE [driver entry points]); the sanitizers' runtime comes from the program
                 *([] if sanitize else ["-Wl,-z,defs"])])
    for cmd in cmds:
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


def env(sanitize=False, for_tsan=False, **extra):
    """Environment variables that make fastdp load the simulated libraries."""
    p = build(sanitize, for_tsan)
    e = {"FASTDP_CUDA_DRIVER_LIBRARY": p["cuda"], "FASTDP_NCCL_LIBRARY": p["nccl"]}
    e.update({k: str(v) for k, v in extra.items()})
    return e


if __name__ == "__main__":
    p = build("--sanitize" in sys.argv[1:])
    print(p["cuda"])
    print(p["nccl"])
