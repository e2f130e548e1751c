"""scripts/flat_grads.py, the measurement of the bucket-node layouts docs/benchmarks.md reports ("Fewer tensors
through the bucket node"): each layout's sums are the bare sum of the replicas' gradients, and what an unused member
gets is what the page says (no gradient for fastdp's per-member layout, zeros where autograd's C++ assembles a flat
gradient)."""

import importlib.util
import pathlib

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "flat_grads.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("flat_grads", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_layout_sums_as_the_bare_replicas_and_says_what_an_unused_member_gets(script):
    lines = script.check(6, 3)
    assert lines == [
        "per-member: sums match the bare sum; the unused member gets no gradient",
        "split-view: sums match the bare sum; the unused member gets zeros",
        "unsafe-split: sums match the bare sum; the unused member gets zeros",
    ]


def test_the_timing_run_prints_every_layout(script, capsys):
    assert script.main(["--members", "4", "--replicas", "2", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {layout} " in out for layout in script.LAYOUTS)


def test_bad_sizes_are_refused(script):
    with pytest.raises(SystemExit):
        script.main(["--members", "1"])
