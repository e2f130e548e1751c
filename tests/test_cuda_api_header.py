"""csrc/dl/cuda_api.h against the CUDA toolkit's cuda.h, wherever a toolkit is installed: fastdp builds without one,
so its own copy of the driver's ABI (enum values, parameter structs, entry-point signatures and the versioned
symbol names dlsym binds) must be exactly the driver's. Skipped without cuda.h or a C compiler."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
API = ROOT / "csrc" / "dl" / "cuda_api.h"


def _cuda_include():
    for home in filter(None, [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]):
        if (Path(home) / "include" / "cuda.h").is_file():
            return Path(home) / "include"
    nvcc = shutil.which("nvcc")
    if nvcc:
        inc = Path(os.path.realpath(nvcc)).parent.parent / "include"
        if (inc / "cuda.h").is_file():
            return inc
    return None


CUDA_INCLUDE = _cuda_include()
CC = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")
pytestmark = pytest.mark.skipif(CUDA_INCLUDE is None or CC is None, reason="no CUDA toolkit (cuda.h) or C compiler")


def _facts():
    """The names cuda_api.h defines: enum constants, and each struct with its fields."""
    text = API.read_text()
    body = text[text.index("#ifndef __cuda_cuda_h__"):text.index("#endif /* __cuda_cuda_h__ */")]
    constants = re.findall(r"^\s+(CUDA?_[A-Z0-9_]+)\s*=", body, re.M)
    structs = {}
    for fields, name in re.findall(r"typedef struct \w+ \{(.*?)\} (\w+);", body, re.S):
        structs[name] = re.findall(r"(\w+);", fields)
    return constants, structs


def _program(constants, structs):
    lines = ["#include <stdio.h>", "#include <stddef.h>", "#ifdef WITH_TOOLKIT", "#include <cuda.h>", "#endif",
             '#include "dl/cuda_api.h"', "int main(void) {"]
    lines += [f'  printf("{c} %lld\\n", (long long){c});' for c in constants]
    for name, fields in structs.items():
        lines.append(f'  printf("sizeof {name} %zu\\n", sizeof({name}));')
        lines += [f'  printf("{name}.{f} %zu %zu\\n", offsetof({name}, {f}), sizeof((({name} *)0)->{f}));'
                  for f in fields]
    lines += ["  return 0;", "}"]
    return "\n".join(lines) + "\n"


def _run(tmp_path, name, source, *flags):
    src = tmp_path / f"{name}.c"
    src.write_text(source)
    exe = tmp_path / name
    res = subprocess.run([CC, "-std=c11", "-Wall", "-Werror", *flags, f"-I{ROOT / 'csrc'}", str(src), "-o", str(exe)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    return subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout


def test_constants_and_structs_match_the_toolkit(tmp_path):
    constants, structs = _facts()
    assert len(constants) > 30 and {"CUDA_MEMCPY2D", "CUDA_MEMCPY3D_PEER"} <= set(structs)
    source = _program(constants, structs)
    ours = _run(tmp_path, "ours", source)
    toolkit = _run(tmp_path, "toolkit", source, "-DWITH_TOOLKIT", f"-I{CUDA_INCLUDE}")
    assert ours == toolkit


ENTRY_POINTS = """\
#include <stdio.h>
#include <string.h>
#include <cuda.h>
#include "dl/cuda_api.h"
/* A redeclaration with other parameter types than cuda.h's is a compile error. */
#define DECLARE(field, symbol, optional, params) CUresult CUDAAPI symbol params;
FDP_CU_ENTRY_POINTS(DECLARE)
#define TEXT(x) #x
#define EXPANDED(x) TEXT(x)
int main(void) {
  int bad = 0;
  /* The name the loader binds must be the one cuda.h maps the call to (else dlsym binds a legacy ABI). */
#define SAME_NAME(field, symbol, optional, params) \\
  if (strcmp(#symbol, EXPANDED(symbol)) != 0) bad++, printf("%s is %s in cuda.h\\n", #symbol, EXPANDED(symbol));
  FDP_CU_ENTRY_POINTS(SAME_NAME)
  return bad;
}
"""


def test_entry_points_match_the_toolkit(tmp_path):
    out = _run(tmp_path, "entries", ENTRY_POINTS, f"-I{CUDA_INCLUDE}")
    assert out == ""


def test_a_wrong_entry_point_is_caught(tmp_path):
    # The check above can fail: a parameter type changed, and a symbol without the version suffix cuda.h uses.
    text = API.read_text()
    wrong_type = text.replace("X(DeviceGet, cuDeviceGet, 0, (CUdevice *dev, int ordinal))",
                              "X(DeviceGet, cuDeviceGet, 0, (CUdevice *dev, long ordinal))")
    wrong_name = text.replace("X(MemAlloc, cuMemAlloc_v2, 0,", "X(MemAlloc, cuMemAlloc, 0,")
    assert wrong_type != text and wrong_name != text
    for label, mutated in (("type", wrong_type), ("name", wrong_name)):
        inc = tmp_path / label / "dl"
        inc.mkdir(parents=True)
        (inc / "cuda_api.h").write_text(mutated)
        src = tmp_path / label / "entries.c"
        src.write_text(ENTRY_POINTS)
        exe = tmp_path / label / "entries"
        res = subprocess.run([CC, "-std=c11", "-Wall", "-Werror", f"-I{tmp_path / label}", f"-I{CUDA_INCLUDE}",
                              str(src), "-o", str(exe)], capture_output=True, text=True)
        if label == "type":
            assert res.returncode != 0 and "cuDeviceGet" in res.stderr
        else:
            assert res.returncode == 0, res.stderr
            run = subprocess.run([str(exe)], capture_output=True, text=True)
            assert run.returncode != 0 and "cuMemAlloc is cuMemAlloc_v2" in run.stdout
