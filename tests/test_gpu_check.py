"""The GPU check (scripts/gpu_check.sh) proven on CPU, so that a broken script is caught before device time is
spent: a dry run of the whole script with no GPU visible and no package index reachable (set-up must complete,
every GPU step reports "skipped: no GPU", the others pass, the summary and log are written); its step helper's
failure, timeout and selection handling; and the Python and C helpers it runs, on the host (and on the simulated
GPU where tests/sim exists), each also shown to fail when what it checks is broken."""

import csv
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.sh")
HELPERS = os.path.join(ROOT, "scripts", "gpu")
NON_GPU_STEPS = ["env", "build", "info", "helpers"]
GPU_STEPS = ["nccl-selftest", "copy-paths", "dp-repeated", "sync-debug", "alloc-expandable", "alloc-async",
             "caller-stream", "cpu-batch", "output-cpu", "syncbn-dtypes", "graph-capture", "oom-rescue", "pytest-gpu",
             "c-gpu-ops", "c-memcheck", "c-racecheck", "bench-comm", "bench-train", "per-tensor", "overlap",
             "memory-across-step",
             "lockstep", "report-exposed"]
LAST_STEPS = ["map-report"]  # runs everywhere: on a CPU it lists every entry of the map as not run
# Where an index or any network use would go: nowhere (a closed local port), so a step that tried would fail.
NO_NETWORK = {"PIP_NO_INDEX": "1", "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "http_proxy": "http://127.0.0.1:9",
              "https_proxy": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9",
              "HTTPS_PROXY": "http://127.0.0.1:9"}


def script_env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FASTDP_", "GPU_CHECK_")) and k != "PYTHON"}
    env.update(NO_NETWORK)
    env["OUT"] = str(tmp_path / "out")
    env["TMPDIR"] = str(tmp_path)
    env["CUDA_VISIBLE_DEVICES"] = ""  # no GPU, even on a machine that has one
    env["GPU_CHECK_TIME_SCALE"] = "4"  # a loaded 2-core CI machine builds several times slower than the GPU box
    if not os.access(os.path.join(ROOT, ".venv", "bin", "python"), os.X_OK):
        env["PYTHON"] = sys.executable  # the script's default is .venv/bin/python, then python3
    env.update(extra)
    return env


def read_summary(out):
    with open(os.path.join(out, "summary.csv"), newline="") as f:
        return {row["step"]: row for row in csv.DictReader(f)}


def test_script_parses():
    subprocess.run(["bash", "-n", SCRIPT], check=True)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_shellcheck():
    res = subprocess.run(["shellcheck", "-x", SCRIPT], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_dry_run_without_gpu_or_index(tmp_path):
    env = script_env(tmp_path)
    t0 = time.monotonic()
    res = subprocess.run(["bash", SCRIPT], cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - t0
    out = env["OUT"]
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-2000:]
    summary = read_summary(out)
    assert list(summary) == NON_GPU_STEPS + GPU_STEPS + LAST_STEPS
    for name in NON_GPU_STEPS + LAST_STEPS:
        assert summary[name]["result"] == "ok", (name, summary[name])
    for name in GPU_STEPS:
        assert summary[name]["result"] == "skipped: no GPU", (name, summary[name])
    budgets = {name: int(row["budget_s"]) for name, row in summary.items()}
    assert sum(budgets.values()) <= 450, f"step budgets add up to {sum(budgets.values())} s, over 7.5 minutes"
    with open(SCRIPT) as f:  # the budget written at the top of the script is the one it uses
        head = f.read().split("# Budget", 1)[1].split("\n# A step", 1)[0]
    assert {n: int(b) for n, b in re.findall(r"([a-z-]+) (\d+)", head.split("\n", 1)[1])} == budgets
    with open(os.path.join(out, "gpu_check.log")) as f:
        log = f.read()
    assert log == res.stdout  # everything printed is in the log
    assert "total " in log and "all ran steps ok" in log
    assert "Successfully installed fastdp" in log or "built " in log
    with open(os.path.join(out, "info.json")) as f:
        assert '"backends"' in f.read()
    assert not [p for p in os.listdir(tmp_path) if p.startswith("fastdp-gpu-check.")], "scratch folder left behind"
    print(f"dry run: {elapsed:.1f} s")


def run_helper(tmp_path, body, **env):
    """Sources the script (which then only defines its functions) and runs `body` in that bash."""
    prog = f'source "{SCRIPT}"\nOUT="{tmp_path}"\nGPU_CHECK_DEADLINE=$((SECONDS + 100))\n{body}\n'
    return subprocess.run(["bash", "-c", prog], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})


def test_step_failures_timeouts_and_skips_are_recorded(tmp_path):
    res = run_helper(tmp_path, """
GPU_COUNT=0
step fails 5 - false
step slow 1 - sleep 30
step passes 5 - true
step needs-gpu 5 gpu false
summary; echo "summary rc=$?"
""")
    rows = read_summary(str(tmp_path))
    assert rows["fails"]["result"] == "FAILED rc=1"
    assert rows["slow"]["result"] == "FAILED rc=124 (timeout 1s)" and int(rows["slow"]["seconds"]) < 10
    assert rows["passes"]["result"] == "ok"  # ran after the failures
    assert rows["needs-gpu"]["result"] == "skipped: no GPU"
    assert "summary rc=1" in res.stdout and "FAILURES above" in res.stdout


def test_step_selection_and_total_budget(tmp_path):
    res = run_helper(tmp_path, """
GPU_COUNT=1
step first 5 - true
step second 5 gpu true
GPU_CHECK_DEADLINE=$SECONDS
step third 5 - true
summary; echo "summary rc=$?"
""", GPU_CHECK_STEPS="second,third")
    rows = read_summary(str(tmp_path))
    assert rows["first"]["result"] == "skipped: not selected"
    assert rows["second"]["result"] == "ok"
    assert rows["third"]["result"] == "skipped: out of time"
    assert "summary rc=1" in res.stdout  # a step that could not run is a failure


def test_every_step_function_reaches_the_step_shells(tmp_path):
    """A step runs its function in a child bash, which sees only exported functions: one left out of
    export_for_steps would fail on the GPU machine alone (the dry run skips GPU steps before they start)."""
    with open(SCRIPT) as f:
        body = f.read().split("\nmain() {", 1)[1].split("\n}", 1)[0]
    functions = re.findall(r"^\s*step \S+ \d+ \S+ (\S+)", body, re.M)
    assert len(functions) == len(NON_GPU_STEPS + GPU_STEPS + LAST_STEPS)
    res = run_helper(tmp_path, f"""
PY=python3; WORK="{tmp_path}"; SANITIZER=""
export_for_steps
for f in {' '.join(functions)}; do bash -c "declare -F $f >/dev/null" || echo "not exported: $f"; done
""")
    assert res.returncode == 0 and "not exported" not in res.stdout, res.stdout + res.stderr


def test_gpu_ops_step_skips_while_build_py_lacks_the_option(tmp_path):
    res = run_helper(tmp_path, """
GPU_COUNT=1
step ops 5 gpu,gpu-ops true
summary; echo "summary rc=$?"
""")
    with open(os.path.join(ROOT, "tests", "c", "build.py")) as f:
        has_option = "--gpu-ops" in f.read()
    expected = "ok" if has_option else "skipped: not available"
    assert read_summary(str(tmp_path))["ops"]["result"] == expected
    assert "summary rc=0" in res.stdout


def load_helper(name):
    spec = importlib.util.spec_from_file_location(f"gpu_check_{name}", os.path.join(HELPERS, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_copy_paths_helper_on_host(capsys):
    mod = load_helper("copy_paths")
    assert mod.main(["--device", "cpu"]) == 0
    assert "FAILED" not in capsys.readouterr().out


def test_copy_paths_helper_catches_one_wrong_element(monkeypatch, capsys):
    mod = load_helper("copy_paths")
    real = mod.comm.broadcast

    def one_element_off(src, out):
        res = real(src, out=out)
        o, idx = out[0], (0,) * out[0].dim()
        o[idx] = ~o[idx] if o.dtype == mod.torch.bool else o[idx] + 1
        return res

    monkeypatch.setattr(mod.comm, "broadcast", one_element_off)
    assert mod.main(["--device", "cpu"]) == 1
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.rstrip().endswith(" ms")]
    copies = [ln for ln in lines if not ln.startswith(("sum", "big sum"))]
    assert copies and all(" FAILED " in ln for ln in copies), "\n".join(copies)
    assert all(" ok " in ln for ln in lines if ln.startswith(("sum", "big sum")))


def test_copy_paths_helper_catches_a_wrong_sum(monkeypatch, capsys):
    mod = load_helper("copy_paths")
    monkeypatch.setattr(mod.comm, "reduce_add", lambda inputs, destination=None: inputs[0] + inputs[1])
    assert mod.main(["--device", "cpu"]) == 1
    sums = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(("sum", "big sum"))]
    # every sum of more than two inputs is caught (a two-input sum is right by construction here)
    assert sums and all((" FAILED " in ln) != ("x2" in ln) for ln in sums), "\n".join(sums)


def test_dp_repeated_helper_on_host(capsys):
    mod = load_helper("dp_repeated")
    assert mod.main(["--device", "cpu", "--replicas", "3"]) == 0
    assert "FAILED" not in capsys.readouterr().out


def test_dp_repeated_helper_catches_wrong_gradients(monkeypatch, capsys):
    mod = load_helper("dp_repeated")

    class Skewed(mod.fastdp.DataParallel):  # outputs (and so gradients) off by 1%
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            if isinstance(out, dict):
                return {"a": out["a"] * 1.01, "pair": out["pair"]}
            return out * 1.01

    monkeypatch.setattr(mod.fastdp, "DataParallel", Skewed)
    assert mod.main(["--device", "cpu", "--replicas", "2"]) == 1
    assert "FAILED" in capsys.readouterr().out


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_findings_helper_on_host(tmp_path, capsys):
    """scripts/gpu/findings.py's three measurements on emulated replicas: each runs through, prints its table and
    writes its CSV; the lockstep model finds its replica (the slowed ones show their delay), and the exposed table has
    a row per step and their medians."""
    mod = load_helper("findings")
    for what in ("memory", "lockstep", "exposed"):
        assert mod.main([what, "--device", "cpu", "--out", str(tmp_path)]) == 0, what
    out = capsys.readouterr().out
    assert "FAILED" not in out and "failed:" not in out
    memory = read_csv(tmp_path / "findings-memory.csv")
    assert [r["config"] for r in memory] == ["bare"] * 2 + ['fastdp ["cpu"] * 2'] * 2 + ["fastdp, swept"] * 2
    assert all(r["held_after_step_mb"] == "" for r in memory if r["config"] == "bare")
    assert all(float(r["held_after_step_mb"]) == 0 for r in memory if r["config"] != "bare")  # host: no streams
    lockstep = read_csv(tmp_path / "findings-lockstep.csv")
    assert [r["busy"] for r in lockstep] == ["0", "1", "4"]
    assert [r["layers"] for r in lockstep] == ["-", "7", "7,5,3,1"]
    assert all(float(r["slowest_other_ms"]) >= 1.0 for r in lockstep[1:])  # the 1 ms sleep reached its replica
    assert "replica 0's backward with 4 slowed replicas over 1:" in out
    exposed = read_csv(tmp_path / "findings-exposed.csv")
    assert [r["step"] for r in exposed] == ["1", "2", "3", "median"]
    assert all(r["report_exposed_ms"] != "" and r["direct_tail_ms"] != "" for r in exposed)


def test_findings_count_each_held_storage_once():
    """The memory measurement's count of what the reduction holds: every tensor of every held group, each storage
    once (a bucket's views share one), less the storage a master's .grad uses; nothing for a wrapper without a
    reducer."""
    import collections
    import types

    import torch

    mod = load_helper("findings")
    flat, other = torch.zeros(256), torch.zeros(3, dtype=torch.float64)
    held = collections.deque([(None, ((flat[:10], None, flat[10:]), None, other)), (None, [flat])])
    ledger = types.SimpleNamespace(held=lambda: [tensors for _, tensors in held])  # the reducer's ledger, as read
    wrapped = types.SimpleNamespace(_replica_set=types.SimpleNamespace(reducer=types.SimpleNamespace(ledger=ledger)))
    assert mod.ledger_bytes(wrapped) == 256 * 4 + 3 * 8
    wrapped.module = torch.nn.Linear(3, 1, bias=False)
    wrapped.module.weight.grad = other.float().view(1, 3)  # a storage of its own: nothing held is it
    assert mod.ledger_bytes(wrapped) == 256 * 4 + 3 * 8
    wrapped.module.weight.grad = flat[20:23].view(1, 3)  # the held flat buffer is this .grad's storage
    assert mod.ledger_bytes(wrapped) == 3 * 8
    assert mod.ledger_bytes(torch.nn.Linear(2, 2)) is None
    # each slowed replica sleeps before a layer of its own, the same one whatever the number slowed
    assert mod.slowed_layers(4, 4, 8) == {1: 14, 2: 10, 3: 6, 4: 2}
    assert mod.slowed_layers(1, 4, 8) == {1: 14}


@pytest.mark.sim
def test_nccl_selftest_on_the_simulated_gpu(tmp_path):
    """The C self-test against tests/sim's libcuda.so.1/libnccl.so.2, found by the production lookup (by name,
    through LD_LIBRARY_PATH) as the real ones are on the GPU machine."""
    sim_build = os.path.join(ROOT, "tests", "sim", "build.py")
    if not os.path.exists(sim_build):
        pytest.skip("no simulated GPU in this tree (tests/sim/build.py)")
    res = subprocess.run([sys.executable, sim_build], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    libs = [line.strip() for line in res.stdout.splitlines() if line.strip().endswith((".so.1", ".so.2"))]
    assert libs, res.stdout
    exe = str(tmp_path / "nccl_selftest")
    subprocess.run([sys.executable, os.path.join(HELPERS, "build_nccl_selftest.py"), exe], check=True,
                   capture_output=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTDP_")}
    env["LD_LIBRARY_PATH"] = ":".join(dict.fromkeys(os.path.dirname(p) for p in libs))
    run = subprocess.run([exe], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "nccl self-test: ok" in run.stdout


def test_interpreter_choice(tmp_path):
    """$PYTHON when given, else .venv/bin/python, else python3: the first that imports torch. A venv that cannot
    see torch (what a --system-site-packages venv of the GPU machine's python3 is) is refused, never repaired by
    installing torch; the script then fails its Python steps and exits non-zero."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    bare = str(venv / "bin" / "python")
    res = run_helper(tmp_path, 'pick_python; echo "rc=$?"', PYTHON=bare)
    assert f"{bare} cannot import torch; not used" in res.stderr and "rc=1" in res.stdout
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    res = subprocess.run(["bash", "-c", f'source "{SCRIPT}"; pick_python'], capture_output=True, text=True, env=env)
    own = os.path.join(ROOT, ".venv", "bin", "python")
    if os.access(own, os.X_OK):
        assert res.stdout.strip() == own
    whole = subprocess.run(["bash", SCRIPT], cwd=str(tmp_path), capture_output=True, text=True, timeout=120,
                           env=script_env(tmp_path, PYTHON=bare, GPU_CHECK_STEPS="none"))
    assert whole.returncode != 0
    rows = read_summary(os.path.join(str(tmp_path), "out"))
    assert rows["env"]["result"].startswith("FAILED") and rows["build"]["result"].startswith("FAILED")
    assert "no interpreter imports torch" in whole.stdout


def test_gpu_steps_commands_run_here(tmp_path):
    """The GPU steps' own commands, forced to run on this CPU machine against the installed fastdp: the paths and
    flags are right (the GPU tests are collected and skip; the helpers start and find no CUDA device; the C
    self-test, not built here, is looked for where the helpers step puts it)."""
    res = run_helper(tmp_path, f"""
PY="{sys.executable}"; WORK="{tmp_path}/work"; SANITIZER=""; GPU_COUNT=1
mkdir -p "$WORK/site"
export_for_steps
step pytest-gpu 120 gpu step_pytest_gpu
step copy-paths 60 gpu step_copy_paths
step dp-repeated 60 gpu step_dp_repeated
step nccl-selftest 10 gpu step_nccl_selftest
step overlap 60 gpu step_overlap
step per-tensor 60 gpu step_per_tensor
step map-report 60 - step_map_report
summary
""", CUDA_VISIBLE_DEVICES="")
    rows = read_summary(str(tmp_path))
    assert rows["pytest-gpu"]["result"] == "ok", res.stdout[-3000:]
    assert re.search(r"\d+ skipped, \d+ deselected", res.stdout) and " passed" not in res.stdout
    assert rows["copy-paths"]["result"] == rows["dp-repeated"]["result"] == "FAILED rc=2"
    assert res.stdout.count("no CUDA device") == 2
    assert rows["map-report"]["result"] == "ok" and "python entries that ran: 0 of " in res.stdout
    assert rows["nccl-selftest"]["result"] == "FAILED rc=127" and "work/bin/nccl_selftest" in res.stderr
    assert rows["overlap"]["result"] == "FAILED rc=1" and "no GPU: nothing to measure" in res.stdout
    assert rows["per-tensor"]["result"] == "FAILED rc=2" and "--device cuda: no CUDA device" in res.stderr
    assert "--params 1000 --ddp" in res.stdout  # the bench took the step's options


def test_findings_steps_commands_run_here(tmp_path):
    """The findings' steps, forced to run here: each starts scripts/gpu/findings.py with its measurement, finds no
    CUDA device and writes no CSV."""
    res = run_helper(tmp_path, f"""
PY="{sys.executable}"; WORK="{tmp_path}/work"; SANITIZER=""; GPU_COUNT=1
mkdir -p "$WORK/site"
export_for_steps
step memory-across-step 50 gpu step_memory_across_step
step lockstep 50 gpu step_lockstep
step report-exposed 50 gpu step_report_exposed
summary
""", CUDA_VISIBLE_DEVICES="")
    rows = read_summary(str(tmp_path))
    for name in ("memory-across-step", "lockstep", "report-exposed"):
        assert rows[name]["result"] == "FAILED rc=2", res.stdout[-3000:] + res.stderr[-2000:]
    assert res.stdout.count("no CUDA device") == 3
    assert not [p for p in os.listdir(tmp_path) if p.startswith("findings-")]


def test_cuda_branch_steps_commands_run_here(tmp_path):
    """A step of the CUDA-only branch checks, forced to run here: the helper starts with the allocator setting in
    its environment, finds no CUDA device, and leaves no trace file behind."""
    res = run_helper(tmp_path, f"""
PY="{sys.executable}"; WORK="{tmp_path}/work"; SANITIZER=""; GPU_COUNT=1
mkdir -p "$WORK/site"
export_for_steps
step alloc-async 50 gpu step_alloc_async
summary
""", CUDA_VISIBLE_DEVICES="")
    rows = read_summary(str(tmp_path))
    assert rows["alloc-async"]["result"] == "FAILED rc=2", res.stdout[-3000:]
    assert "no CUDA device" in res.stdout
    assert not os.path.exists(os.path.join(str(tmp_path), "map-trace", "alloc-async.txt"))

