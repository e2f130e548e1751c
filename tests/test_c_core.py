"""Runs the C test program of the core (tests/c/test_core.c, its suites in tests/c/core_*.c) under AddressSanitizer
and UBSan via tests/c/build.py, one pytest item per suite the program lists; and checks of the core's messages and
debug trail from Python."""

import functools
import importlib.util
import os
import re
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD_SCRIPT = os.path.join(HERE, "c", "build.py")
_spec = importlib.util.spec_from_file_location("fastdp_c_tests_build", BUILD_SCRIPT)
_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_build)


@functools.lru_cache(maxsize=None)
def _suites():
    """The C suites, as the program lists them (`test_core --list`); builds it once per session. None when there is
    no C compiler, or the build failed (then the text says why)."""
    if _build.compiler() is None:
        return None, "no C compiler found (cc, gcc or clang; or set CC): the C core tests need one"
    proc = subprocess.run([sys.executable, BUILD_SCRIPT, "--list"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=900)
    names = [line for line in proc.stdout.splitlines() if re.fullmatch(r"[a-z][a-z0-9_]*", line)]
    if proc.returncode != 0 or not names:
        return None, f"tests/c/build.py --list exited {proc.returncode}:\n{proc.stdout}"
    return names, ""


# Suites that are part of the simulated-GPU checks (scripts/sim_tests.sh, which the mutation runs use): the kernel
# cache's key is a GPU-path rule whose bugs only the C suite sees.
SIM_SUITES = {"kernel_cache"}


def _with_marks(name):
    return pytest.param(name, marks=pytest.mark.sim) if name in SIM_SUITES else name


def pytest_generate_tests(metafunc):
    if "c_suite" not in metafunc.fixturenames:
        return
    names = _suites()[0]
    # Without a program there is one item that says why: skipped (no compiler) or failing (a broken build).
    params = [_with_marks(n) for n in names] if names else [pytest.param(None, id="build")]
    metafunc.parametrize("c_suite", params)


def test_c_suite_under_sanitizers(c_suite):
    """One C suite of the core's C test program, in its own process, under AddressSanitizer and UBSan."""
    if c_suite is None:
        why = _suites()[1]
        if _build.compiler() is None:
            pytest.skip(why)
        pytest.fail(why)
    proc = subprocess.run(
        [sys.executable, BUILD_SCRIPT, "--no-build", c_suite],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=900,
    )
    out = proc.stdout
    closing = re.findall(r"^(\d+) passed, (\d+) failed$", out, re.MULTILINE)
    assert proc.returncode == 0, f"tests/c/build.py --no-build {c_suite} exited {proc.returncode}:\n{out}"
    assert closing, f"no closing 'N passed, M failed' line:\n{out}"
    passed, failed = map(int, closing[-1])
    assert failed == 0 and passed > 0, f"{failed} C checks failed:\n{out}"


@pytest.mark.parametrize("dim", [0, 1])
def test_scatter_total_size_message_matches_comm(dim):
    """The core's scatter size check says what comm.scatter (upstream's wording) says, word for word."""
    import torch

    from fastdp import _C, comm

    x = torch.ones(4, 6)
    outs = [torch.empty(*(1 if d == dim else s for d, s in enumerate(x.shape))) for _ in range(2)]
    with pytest.raises(RuntimeError) as upstream:
        comm.scatter(x, dim=dim, out=outs)
    with pytest.raises(ValueError) as core:
        _C.scatter(x, outs, dim, [1, 1])
    assert str(core.value) == str(upstream.value)
    assert f"scatter dim {dim} " in str(core.value)


def test_debug_trail_names_the_failing_call():
    """Under FASTDP_DEBUG a failure passing through FDP_CHECK logs file:line and the call; the line it names holds
    that call in the source."""
    code = (
        "import torch\n"
        "from fastdp import _C\n"
        "try:\n"
        "    _C.scatter(torch.ones(4), [torch.empty(2), torch.empty(2)], 3, [2, 2])\n"
        "except ValueError:\n"
        "    pass\n"
    )
    env = dict(os.environ, FASTDP_DEBUG="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    trail = re.findall(r"^\[fastdp\] (\S+\.c):(\d+): (.+) -> FDP_INVALID$", proc.stderr, re.MULTILINE)
    assert trail, f"no file:line trail under FASTDP_DEBUG:\n{proc.stderr}"
    root = os.path.dirname(HERE)
    for path, line, call in trail:
        with open(os.path.join(root, path)) as f:
            source_line = f.read().splitlines()[int(line) - 1]
        assert call in source_line, (path, line, call, source_line)
