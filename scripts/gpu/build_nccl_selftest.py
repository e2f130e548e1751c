"""Builds scripts/gpu/nccl_selftest.c with fastdp's C core and every backend (the sources setup.py compiles, less
the Python binding; an empty kernel blob, since NCCL needs no fastdp kernel). Needs a C compiler only, so the
CPU dry run of scripts/gpu_check.sh proves it builds. Usage: python build_nccl_selftest.py OUTPUT_EXE."""

import glob
import importlib.util
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CFLAGS = ["-std=c11", "-D_GNU_SOURCE", "-g", "-O1", "-Wall", "-Wextra", "-Werror", "-pthread"]


def _c_tests_build():
    """tests/c/build.py (the C test programs' builder): its compiler choice and kernel-blob helpers serve here too."""
    spec = importlib.util.spec_from_file_location("fastdp_c_tests_build", os.path.join(ROOT, "tests", "c", "build.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def compiler():
    return _c_tests_build().compiler()


def core_sources():
    """Every C file of csrc/ except the binding (csrc/python/), which needs Python.h."""
    files = sorted(glob.glob(os.path.join(ROOT, "csrc", "**", "*.c"), recursive=True))
    return [f for f in files if os.sep + os.path.join("csrc", "python") + os.sep not in f]


def empty_blob(path):
    """The kernel blob a build without nvcc has (cuda/build_kernels.py writes it)."""
    _c_tests_build().build_kernels_module().build_blob(os.path.join(ROOT, "cuda"), None, path)
    return path


def main(argv):
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    exe = os.path.abspath(argv[0])
    os.makedirs(os.path.dirname(exe), exist_ok=True)
    cc = compiler()
    if cc is None:
        print("no C compiler found (set CC, or install cc/gcc/clang)", file=sys.stderr)
        return 127
    blob = empty_blob(os.path.join(os.path.dirname(exe), "nccl_selftest_blob.c"))
    cmd = [cc, *CFLAGS, "-I" + os.path.join(ROOT, "csrc"), *core_sources(), blob,
           os.path.join(HERE, "nccl_selftest.c"), "-o", exe, "-ldl", "-lm"]
    print("+ " + " ".join(os.path.relpath(a, ROOT) if a.startswith(ROOT) else a for a in cmd), flush=True)
    return subprocess.call(cmd, cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
