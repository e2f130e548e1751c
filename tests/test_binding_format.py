"""The checked-in .clang-format: the binding's files are formatted with it, and it declares the GIL macros as
statements (undeclared, clang-format glues `Py_BEGIN_ALLOW_THREADS` to the next statement). Skipped where no
clang-format is installed (pip install clang-format)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CLANG_FORMAT = shutil.which("clang-format") or shutil.which("clang-format", path=os.path.dirname(sys.executable))

pytestmark = pytest.mark.skipif(CLANG_FORMAT is None, reason="clang-format is not installed")

GIL_BLOCK = """\
static int f(int x) {
  int r;
  Py_BEGIN_ALLOW_THREADS
  r = g(x);
  Py_END_ALLOW_THREADS
  return r;
}
"""


def _format(text, name="x.c"):
    r = subprocess.run([CLANG_FORMAT, f"--assume-filename={ROOT / 'csrc' / name}"], input=text, text=True,
                       capture_output=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_gil_blocks_are_left_alone():
    assert _format(GIL_BLOCK) == GIL_BLOCK


@pytest.mark.parametrize("path", sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "python").glob("*.[ch]")))
def test_binding_files_are_formatted(path):
    text = (ROOT / path).read_text()
    assert _format(text, Path(path).name) == text
