#!/usr/bin/env python3
"""Mutation testing of the GPU paths: plants each bug of the catalogues in scripts/mutants/*.py, one at a time, in a
scratch copy of this checkout, and runs scripts/sim_tests.sh --fail-fast against it. A mutant is killed when the
simulated-GPU tests fail (or time out), and survives when they pass. Prints one line per mutant and the score.

    python scripts/mutants.py [--only NAME[,NAME...]] [--jobs N] [--timeout SECONDS] [--keep]

Each catalogue module defines MUTANTS, a list of dicts: name (short id), file (relative to the repository root),
find (text that occurs exactly once in that file), replace (what it becomes), what (one line: the bug). Every job has
its own scratch copy under the system's temporary folder and its own virtual environment, which sees the packages of
the checkout's .venv (scripts/setup.sh) and gets fastdp installed from the mutated copy; so one mutant costs a build
of fastdp's extension and the simulated-GPU tests, and the checkout itself is never touched. Not part of CI: it rebuilds
and reruns the suite per mutant (docs/gpu-verification.md, "Mutation testing", has the last result)."""

import argparse
import concurrent.futures
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CATALOGUES = os.path.join(ROOT, "scripts", "mutants")
# Left out of scratch copies: version control, environments and build outputs (each copy builds its own).
IGNORED = shutil.ignore_patterns(".git", ".venv", "build", ".hypothesis", "__pycache__", "*.egg-info", "*.so")
FIELDS = ("name", "file", "find", "replace", "what")


def load_catalogues():
    """Every mutant of every scripts/mutants/*.py, checked: all fields present, names unique, find unique in file."""
    mutants, problems = [], []
    for path in sorted(glob.glob(os.path.join(CATALOGUES, "*.py"))):
        spec = importlib.util.spec_from_file_location("fastdp_mutants_" + os.path.basename(path)[:-3], path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        for m in getattr(mod, "MUTANTS", []):
            m = dict(m, catalogue=os.path.basename(path))
            missing = [f for f in FIELDS if not m.get(f) and f != "replace"]
            if missing:
                problems.append(f"{path}: a mutant lacks {missing}: {m.get('name')}")
                continue
            target = os.path.join(ROOT, m["file"])
            text = open(target, encoding="utf-8").read() if os.path.isfile(target) else None
            if text is None:
                problems.append(f"{m['name']}: no file {m['file']}")
            elif text.count(m["find"]) != 1:
                problems.append(f"{m['name']}: its find text occurs {text.count(m['find'])} times in {m['file']}")
            else:
                mutants.append(m)
    names = [m["name"] for m in mutants]
    problems += [f"{n}: name used twice" for n in sorted({n for n in names if names.count(n) > 1})]
    return mutants, problems


def make_slot(base):
    """A scratch copy of the checkout with a virtual environment that sees the checkout's .venv packages."""
    src_python = os.path.join(ROOT, ".venv", "bin", "python")
    if not os.path.exists(src_python):
        sys.exit("mutants.py: no .venv in the checkout; run scripts/setup.sh first")
    copy = os.path.join(base, "repo")
    shutil.copytree(ROOT, copy, ignore=IGNORED, symlinks=True)
    venv = os.path.join(copy, ".venv")
    base_python = subprocess.check_output([src_python, "-c", "import sys; print(sys._base_executable)"], text=True)
    subprocess.run([base_python.strip(), "-m", "venv", "--without-pip", venv], check=True)
    site = subprocess.check_output([os.path.join(venv, "bin", "python"), "-c",
                                    "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip()
    # Every package folder the checkout's interpreter sees (its .venv, and the system's when the .venv includes them).
    shared = subprocess.check_output(
        [src_python, "-c", "import sys; print('\\n'.join(p for p in sys.path if p.endswith(('site-packages', "
                           "'dist-packages'))))"], text=True)
    with open(os.path.join(site, "checkout_venv.pth"), "w") as fh:
        fh.write(shared)  # after the copy's own site-packages, so its fastdp wins
    return copy


def first_failure(output):
    """The pytest item that failed first (its test name), or a short reason."""
    m = re.search(r"^(?:FAILED|ERROR) (\S+)", output, re.MULTILINE)
    if m:
        return m.group(1).split("/")[-1]
    return "no pytest summary (see --keep)"


def run_mutant(m, slot, timeout):
    """Plants m in the slot's copy, installs fastdp from it, runs the simulated-GPU tests; restores the file."""
    target = os.path.join(slot, m["file"])
    original = open(target, encoding="utf-8").read()
    start = time.time()
    try:
        with open(target, "w", encoding="utf-8") as fh:
            fh.write(original.replace(m["find"], m["replace"], 1))
        python = os.path.join(slot, ".venv", "bin", "python")
        env = dict(os.environ, FASTDP_PYTHON=python, PYTHONNOUSERSITE="1")
        # --ignore-installed: the checkout's own fastdp (visible through the .pth) is left alone, never uninstalled.
        pip = subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                              "--ignore-installed", "--no-index", slot], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, timeout=timeout)
        if pip.returncode != 0:
            return "killed", "the extension does not build", time.time() - start, pip.stdout
        try:
            proc = subprocess.run(["bash", os.path.join(slot, "scripts", "sim_tests.sh"), "--fail-fast"], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                                  start_new_session=True)
        except subprocess.TimeoutExpired as e:
            return "killed", f"timed out after {timeout} s", time.time() - start, str(e.output)
        if proc.returncode == 0:
            return "survived", "", time.time() - start, proc.stdout
        return "killed", first_failure(proc.stdout), time.time() - start, proc.stdout
    finally:
        with open(target, "w", encoding="utf-8") as fh:
            fh.write(original)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated mutant names")
    ap.add_argument("--jobs", type=int, default=1, help="mutants run side by side (each uses up to 2 cores)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per mutant before it counts as killed")
    ap.add_argument("--keep", action="store_true", help="keep the scratch copies and each mutant's output")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = ap.parse_args()
    mutants, problems = load_catalogues()
    if problems:
        sys.exit("mutants.py: the catalogues are not usable:\n  " + "\n  ".join(problems))
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - {m["name"] for m in mutants})
        if unknown:
            sys.exit(f"mutants.py: no mutant named {', '.join(unknown)} (--list shows them)")
        mutants = [m for m in mutants if m["name"] in wanted]
    if args.list:
        for m in mutants:
            print(f"{m['name']:32} {m['file']:34} {m['what']}")
        return 0
    base = tempfile.mkdtemp(prefix="fastdp-mutants-")
    jobs = max(1, min(args.jobs, len(mutants)))
    print(f"{len(mutants)} mutants, {jobs} job(s), scratch copies in {base}", flush=True)
    slots = [make_slot(os.path.join(base, f"slot{i}")) for i in range(jobs)]
    free = list(slots)
    results = {}

    def job(m):
        slot = free.pop()
        try:
            return m, run_mutant(m, slot, args.timeout)
        finally:
            free.append(slot)

    began = time.time()
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        for m, (verdict, by, seconds, output) in pool.map(job, mutants):
            results[m["name"]] = verdict
            print(f"{m['name']:32} {verdict:8} {seconds:6.0f} s  {by or m['what']}", flush=True)
            if args.keep:
                with open(os.path.join(base, m["name"] + ".log"), "w") as fh:
                    fh.write(output)
    killed = sum(v == "killed" for v in results.values())
    print(f"score: {killed}/{len(results)} killed ({100.0 * killed / max(1, len(results)):.0f}%) in "
          f"{(time.time() - began) / 60:.1f} min")
    survivors = [n for n, v in results.items() if v == "survived"]
    if survivors:
        print("survived: " + ", ".join(survivors))
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
