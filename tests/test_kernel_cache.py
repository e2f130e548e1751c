"""The NVRTC kernel disk cache: a later process reads what an earlier one compiled; a corrupt, truncated or stale
entry is rebuilt; an unusable folder keeps the image in memory; the folder honours FASTDP_CACHE_DIR and
XDG_CACHE_HOME. Each step runs in its own process (the core keeps images in memory per process)."""

import concurrent.futures
import os
from pathlib import Path

import pytest

from _kernel_subprocess import HEADER_BYTES, nvrtc_or_skip, run_images

CC = 90


@pytest.fixture(autouse=True)
def _nvrtc():
    nvrtc_or_skip()


def _env(cache):
    return {"FASTDP_CACHE_DIR": str(cache)}


def test_second_process_reads_the_disk_cache(tmp_path):
    (first,) = run_images([CC], _env(tmp_path))
    (second,) = run_images([CC], _env(tmp_path))
    assert first["origin"] == "compiled" and second["origin"] == "disk"
    assert first["file"] == second["file"] and Path(first["file"]).parent == tmp_path
    assert second["bytes"] == first["bytes"]
    print(f"sm_{CC}: compiled in {first['seconds']:.3f} s, read from the cache in {second['seconds'] * 1e3:.2f} ms")
    assert second["seconds"] < first["seconds"]


def test_same_process_compiles_once(tmp_path):
    """Asked twice in one process: the second answer is the first image (no new compilation, no disk read)."""
    a, b = run_images([CC, CC], _env(tmp_path))
    assert a == b


@pytest.mark.parametrize(
    "damage, words",
    [
        (lambda d: d[:-1] + bytes([d[-1] ^ 0xFF]), "checksum mismatch"),
        (lambda d: d[: len(d) // 2], "truncated"),
        (lambda d: b"garbage" + d[7:], "not a fastdp kernel cache entry"),
        (lambda d: b"", "not a fastdp kernel cache entry"),
    ],
    ids=["flipped-byte", "truncated", "bad-magic", "empty"],
)
def test_corrupt_entry_is_rebuilt(tmp_path, damage, words):
    (good,) = run_images([CC], _env(tmp_path))
    path = Path(good["file"])
    original = path.read_bytes()
    path.write_bytes(damage(original))
    (rebuilt,) = run_images([CC], _env(tmp_path))
    assert rebuilt["origin"] == "compiled" and words in rebuilt["note"], rebuilt
    assert path.read_bytes() == original, "the rebuilt entry is written back, identical to the first"
    (again,) = run_images([CC], _env(tmp_path))
    assert again["origin"] == "disk"


def test_stale_entry_is_rebuilt(tmp_path):
    """An entry whose header names another key (here: sm_80's image under sm_90's name) is never loaded."""
    other, mine = run_images([80, CC], _env(tmp_path))
    Path(mine["file"]).write_bytes(Path(other["file"]).read_bytes())
    (rebuilt,) = run_images([CC], _env(tmp_path))
    assert rebuilt["origin"] == "compiled" and "stale" in rebuilt["note"], rebuilt
    assert rebuilt["bytes"] == mine["bytes"]


def test_unwritable_folder_keeps_memory_only(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    (r,) = run_images([CC], _env(blocker / "kernels"))  # mkdir fails even for root
    assert r["origin"] == "memory" and r["file"] == "" and "memory only" in r["note"], r
    assert r["target"] == "cubin" and r["bytes"] > 0


def test_cache_off(tmp_path):
    (r,) = run_images([CC], {**_env(tmp_path), "FASTDP_KERNEL_CACHE": "0"})
    assert r["origin"] == "memory" and "FASTDP_KERNEL_CACHE=0" in r["note"]
    assert list(tmp_path.iterdir()) == []


def test_xdg_cache_home(tmp_path):
    env = {"FASTDP_CACHE_DIR": "", "XDG_CACHE_HOME": str(tmp_path)}
    (r,) = run_images([CC], env)
    assert Path(r["file"]).parent == tmp_path / "fastdp" / "kernels"


def test_concurrent_writers_leave_one_valid_entry(tmp_path):
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        results = [f.result()[0] for f in [pool.submit(run_images, [CC], _env(tmp_path)) for _ in range(3)]]
    assert all("error" not in r for r in results)
    assert [p.name for p in tmp_path.iterdir()] == [Path(results[0]["file"]).name], "no temporary file is left"
    (last,) = run_images([CC], _env(tmp_path))
    assert last["origin"] == "disk" and last["bytes"] == results[0]["bytes"]
    assert os.path.getsize(last["file"]) == HEADER_BYTES + last["bytes"]
