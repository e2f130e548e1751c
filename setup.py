"""Builds fastdp._C from C sources with a C compiler and the Python headers only.

The CUDA and NCCL backends are compiled when the CUDA toolkit's headers are found (CUDA_HOME, /usr/local/cuda);
their kernels are compiled by nvcc into a fatbin that is embedded in the extension and loaded through the
driver API at run time, so the built extension never links against CUDA and imports on any machine.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def cuda_home():
    for cand in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if cand and (Path(cand) / "include" / "cuda.h").is_file():
            return Path(cand)
    nvcc = shutil.which("nvcc")
    if nvcc:
        home = Path(nvcc).resolve().parent.parent
        if (home / "include" / "cuda.h").is_file():
            return home
    return None


def sources(*dirs):
    out = []
    for d in dirs:
        out += sorted(str(p.relative_to(ROOT)) for p in (ROOT / d).glob("*.c"))
    return out


CUDA = None if os.environ.get("FASTDP_NO_CUDA") else cuda_home()
SRC = sources("csrc/core", "csrc/backend/host", "csrc/python")
MACROS = []
INCLUDES = ["csrc"]
if CUDA is not None:
    SRC += sources("csrc/backend/cuda", "csrc/dl")
    MACROS.append(("FDP_WITH_CUDA", "1"))
    INCLUDES.append(str(CUDA / "include"))

CFLAGS = ["-std=c11", "-O3", "-Wall", "-Wextra", "-fvisibility=hidden", "-D_GNU_SOURCE"]
if os.environ.get("FASTDP_WERROR"):
    CFLAGS.append("-Werror")


class BuildExt(build_ext):
    """Adds the nvcc step: cuda/*.cu → one fatbin → a generated C array compiled into the extension."""

    def build_extensions(self):
        if CUDA is not None:
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
