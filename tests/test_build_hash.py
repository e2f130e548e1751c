"""scripts/build_hash.sh: the set-up reuses fastdp's build while this hash is unchanged, so it must change with every
source and build setting, and never with what the build itself writes into the checkout."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tree(tmp_path, git):
    for rel, text in {"csrc/base/a.c": "int a;\n", "cuda/k.cu": "// k\n", "python/fastdp/__init__.py": "x = 1\n",
                      "setup.py": "# setup\n", "pyproject.toml": "[project]\n", "README.md": "readme\n"}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    (tmp_path / "scripts").mkdir()
    shutil.copy(os.path.join(ROOT, "scripts", "build_hash.sh"), tmp_path / "scripts")
    shutil.copy(os.path.join(ROOT, ".gitignore"), tmp_path / ".gitignore")
    if git:
        if shutil.which("git") is None:
            pytest.skip("git is not installed")
        for cmd in (["init", "-q"], ["add", "-A"]):
            subprocess.run(["git", *cmd], cwd=tmp_path, check=True, capture_output=True)


def _hash(tmp_path, **env):
    r = subprocess.run(["bash", str(tmp_path / "scripts" / "build_hash.sh")], capture_output=True, text=True,
                       env=dict(os.environ, PYTHON=sys.executable, **env), timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


@pytest.mark.parametrize("git", [True, False], ids=["git-checkout", "plain-folder"])
def test_hash_follows_sources_and_knobs_not_build_outputs(tmp_path, git):
    _tree(tmp_path, git)
    first = _hash(tmp_path)
    assert len(first) == 64 and _hash(tmp_path) == first
    # What a build writes into the checkout (generated kernel blob, bytecode, egg-info, build folder), and files
    # outside fastdp's sources, leave it alone.
    for rel in ("python/fastdp/_kernels_blob.c", "python/fastdp/__pycache__/x.cpython-311.pyc",
                "python/fastdp.egg-info/PKG-INFO", "build/lib/fastdp/_C.so", "README.md", "bench-out/comm.csv"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("generated\n")
    assert _hash(tmp_path) == first
    # A build setting changes it.
    assert _hash(tmp_path, FASTDP_WERROR="0") != first
    # An edited source, and a new one not yet tracked, change it.
    (tmp_path / "csrc/base/a.c").write_text("int a = 1;\n")
    edited = _hash(tmp_path)
    assert edited != first
    (tmp_path / "python/fastdp/new.py").write_text("y = 2\n")
    assert _hash(tmp_path) not in (first, edited)
