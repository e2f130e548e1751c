"""Builds fastdp._C from C sources with a C compiler and the Python headers only.

All three backends (host, cuda, nccl) are always compiled: the driver API, NVRTC and NCCL declarations fastdp uses
live in csrc/dl/, and the libraries are loaded at run time, so the extension never links against CUDA and imports
on any machine. The kernel source in cuda/ is always embedded (NVRTC compiles it at run time for each GPU). When
nvcc happens to be found (CUDA_HOME, CUDA_PATH, the default folder, PATH), it also compiles the kernels into a
fatbin embedded beside the source, which the driver tries first.

Build-time knobs: FASTDP_NO_NVCC=1 skips the fatbin even where nvcc exists; FASTDP_CUDA_DEFAULT_HOME replaces the
default toolkit folder (/usr/local/cuda; the no-toolkit build test points it nowhere); FASTDP_CUDA_ARCHS picks the
fatbin's architectures (cuda/build_kernels.py); FASTDP_WERROR=1 adds -Werror.
"""
import os
import shutil
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def cuda_home():
    """The CUDA toolkit that holds nvcc, or None; only the optional fatbin uses it."""
    default = os.environ.get("FASTDP_CUDA_DEFAULT_HOME", "/usr/local/cuda")
    for cand in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), default):
        if cand and (Path(cand) / "bin" / "nvcc").is_file():
            return Path(cand)
    nvcc = shutil.which("nvcc")
    return Path(nvcc).resolve().parent.parent if nvcc else None


def sources(*dirs):
    out = []
    for d in dirs:
        out += sorted(str(p.relative_to(ROOT)) for p in (ROOT / d).glob("*.c"))
    return out


# FASTDP_NO_NVCC=1 skips the fatbin even where nvcc exists (the build a machine without a toolkit makes).
CUDA = None if os.environ.get("FASTDP_NO_NVCC") else cuda_home()
SRC = sources("csrc/base", "csrc/core", "csrc/backend/host", "csrc/backend/cuda", "csrc/dl", "csrc/python")
# assert() marks invariants the core has already checked (see NOTE [routing] in csrc/core/backend.h); they are live
# only in the test programs' sanitizer builds. Defined here, not taken from Python's own flags, so that a Python
# built without NDEBUG can never turn one into an abort.
MACROS = [("NDEBUG", None)]
INCLUDES = ["csrc"]

CFLAGS = ["-std=c11", "-O3", "-Wall", "-Wextra", "-fvisibility=hidden", "-D_GNU_SOURCE"]
if os.environ.get("FASTDP_WERROR"):
    CFLAGS.append("-Werror")


class BuildExt(build_ext):
    """Adds the generated kernel blob: cuda/*.cu as source text, plus one fatbin when nvcc exists, as C arrays."""

    def build_extensions(self):
        sys.path.insert(0, str(ROOT / "cuda"))
        from build_kernels import build_blob  # noqa: E402  (cuda/build_kernels.py)

        blob_c = Path(self.build_temp) / "fdp_kernels_blob.c"
        blob_c.parent.mkdir(parents=True, exist_ok=True)
        build_blob(ROOT / "cuda", CUDA, blob_c)
        for ext in self.extensions:
            ext.sources.append(str(blob_c))
        super().build_extensions()


setup(
    ext_modules=[
        Extension(
            "fastdp._C",
            sources=SRC,
            include_dirs=INCLUDES,
            define_macros=MACROS,
            extra_compile_args=CFLAGS,
            libraries=["dl", "pthread", "m"],
        )
    ],
    cmdclass={"build_ext": BuildExt},
)
