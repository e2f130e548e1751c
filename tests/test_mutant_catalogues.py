"""The mutation catalogues (scripts/mutants/*.py) stay usable as the code they plant bugs in changes: every mutant's
find text occurs exactly once in its file, so a mutation run plants every bug it lists."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_mutant_still_finds_its_site():
    spec = importlib.util.spec_from_file_location("fastdp_mutants_runner", os.path.join(ROOT, "scripts", "mutants.py"))
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    mutants, problems = runner.load_catalogues()
    assert problems == []
    assert mutants
