"""fastdp on torch.distributed: detection, the DDP-backed wrapper and the helpers.

Multi-process tests start their own ranks as subprocesses with torchrun's variables (gloo over loopback, GPUs
hidden), each launch under a hard timeout after which every child is killed. Detection and helper tests run in
this process with a patched environment and never initialise a process group. This file is also the workers'
entry point: ``python tests/test_distributed.py SCENARIO OUTDIR``.
"""

import copy
import inspect
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, TensorDataset

import fastdp
from fastdp import distributed as fdist

HERE = os.path.abspath(__file__)
# The folder holding the fastdp these tests import (the installed package), for child processes.
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(fastdp.__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
LAUNCH_TIMEOUT = 90  # seconds for one multi-process launch, start-up included; then every child is killed
STEPS = 5
SAMPLES, GLOBAL_BATCH = 16, 8  # two ranks x 4 samples: two steps per epoch, so 5 steps span three epochs


# ---- Shared by the workers and the reference ---------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        self.scale = 2.0  # a plain attribute, for attribute forwarding

    def forward(self, x):
        return self.net(x)


def make_model():
    torch.manual_seed(0)
    return MLP().double()


def make_dataset():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 6, generator=gen, dtype=torch.float64)
    y = torch.randn(SAMPLES, 3, generator=gen, dtype=torch.float64)
    return TensorDataset(torch.arange(SAMPLES), x, y)


def sgd(params):
    return torch.optim.SGD(params, lr=0.2, momentum=0.5)


# ---- Workers (run as ``python tests/test_distributed.py SCENARIO OUTDIR``) --------------------------------------


def _train_steps(dp, loader, steps, on_step=None):
    """SGD on the mean MSE of each rank's shard; returns the sample indices each step used on this rank."""
    opt = sgd(dp.parameters())
    device = next(dp.parameters()).device
    seen = []
    while len(seen) < steps:
        for idx, x, y in loader:
            opt.zero_grad(set_to_none=True)
            loss = F.mse_loss(dp(x.to(device)), y.to(device))
            loss.backward()
            opt.step()
            seen.append(idx.tolist())
            if on_step is not None:
                on_step(len(seen))
            if len(seen) == steps:
                break
    return seen


def _scenario_train(out):
    mode = "auto" if os.environ["WORLD_SIZE"] != "1" else "distributed"  # auto needs WORLD_SIZE > 1
    dp = fastdp.DataParallel(make_model(), mode=mode)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = next(dp.parameters()).device
    checks = {
        "is_ddp": isinstance(dp, fastdp.DistributedDataParallel),
        "is_dp": isinstance(dp, fastdp.DataParallel),
        "backend": dist.get_backend(),
        "device": str(device),
        "forwarded": dp.scale == 2.0 and dp.net is dp.module.net and dp.module is dp.ddp.module,
        "params_once": len(list(dp.parameters())) == len(list(dp.module.parameters())),
    }
    loader = fastdp.shard(DataLoader(make_dataset(), batch_size=GLOBAL_BATCH, shuffle=True))
    checks["shard_batch"] = loader.batch_size
    seen = _train_steps(dp, loader, STEPS)
    state = {k: v.detach().cpu().clone() for k, v in dp.state_dict().items()}
    checks["state_equals_module"] = list(dp.state_dict()) == list(dp.module.state_dict())

    # Checkpoint: written once, on rank 0; readable everywhere as soon as save() returns, in both key forms.
    ckpt = os.path.join(out, "ckpt.pt")
    real_save, writes = torch.save, []
    torch.save = lambda *a, **k: (writes.append(1), real_save(*a, **k))[1]
    try:
        fastdp.save(dp.state_dict(), ckpt)
    finally:
        torch.save = real_save
    checks["writes"] = len(writes)
    loaded = torch.load(ckpt, map_location="cpu")
    bare = make_model()
    bare.load_state_dict(loaded, strict=True)
    fresh = fastdp.DataParallel(make_model(), mode=mode)
    fresh.load_state_dict({"module." + k: v for k, v in loaded.items()})
    checks["ckpt_bare"] = all(torch.equal(bare.state_dict()[k], state[k]) for k in state)
    checks["ckpt_wrapper"] = all(torch.equal(fresh.state_dict()[k].cpu(), state[k]) for k in state)

    # The per-replica loss API of DataParallel: here the loss of this rank's shard; chunk_sizes has nothing to split.
    with_loss = fastdp.DataParallel(make_model(), mode=mode, criterion=nn.MSELoss(), chunk_sizes=[1])
    _, x, y = make_dataset()[:4]
    x, y = x.to(device), y.to(device)
    loss = with_loss(x, target=y)
    checks["criterion"] = loss.dim() == 0 and torch.equal(loss, F.mse_loss(with_loss.module(x), y)) and (
        with_loss(x).shape == (4, 3)
    )

    # A failed save raises on every rank instead of leaving the others waiting.
    try:
        fastdp.save({}, os.path.join(out, "no-such-dir", "x.pt"))
        checks["save_error"] = None
    except RuntimeError as exc:
        checks["save_error"] = str(exc)

    # no_sync(): gradients stay local inside it, and are averaged again after it.
    def grads_across_ranks():
        g = dp.module.net[0].weight.grad.detach().clone()
        everyone = [torch.zeros_like(g) for _ in range(world)]
        dist.all_gather(everyone, g)
        return everyone

    x = torch.full((2, 6), float(rank + 1), dtype=torch.float64, device=device)
    dp.zero_grad()
    with dp.no_sync():
        dp(x).sum().backward()
    checks["no_sync_local"] = world == 1 or not torch.equal(*grads_across_ranks()[:2])
    dp.zero_grad()
    dp(x).sum().backward()
    checks["sync_equal"] = world == 1 or torch.equal(*grads_across_ranks()[:2])

    # deepcopy keeps the wrapper a distributed one, on a copy of the module.
    twin = copy.deepcopy(dp)
    checks["deepcopy"] = (
        type(twin) is fastdp.DistributedDataParallel and twin.module is twin.ddp.module and twin.module is not dp.module
    )
    # Moving the module after wrapping would silently break DDP: .to(its own device) is fine, elsewhere raises.
    twin.to(device).double().train(False)
    checks["eval_synced"] = twin.training is False and twin.ddp.training is False and not twin.module.training
    try:
        twin.to("meta")
        checks["move_error"] = None
    except RuntimeError as exc:
        checks["move_error"] = str(exc)

    fastdp.print0("PRINT0-MARK", rank)
    handler = logging.StreamHandler(sys.stdout)
    handler.addFilter(fastdp.RankZeroFilter())
    log = logging.getLogger("fastdp-test")
    log.addHandler(handler)
    log.warning("LOG0-MARK %d", rank)
    sys.stdout.flush()
    torch.save({"seen": seen, "state": state, "checks": checks}, os.path.join(out, f"rank{rank}.pt"))


def _scenario_fail(out):
    dp = fastdp.DataParallel(make_model())
    loader = fastdp.shard(DataLoader(make_dataset(), batch_size=GLOBAL_BATCH, shuffle=True))

    def on_step(step):
        if step == 3 and dist.get_rank() == 1:
            raise RuntimeError("rank 1 fails on purpose")

    _train_steps(dp, loader, 10**6, on_step)


def _scenario_loop(out):
    dp = fastdp.DataParallel(make_model())
    loader = fastdp.shard(DataLoader(make_dataset(), batch_size=GLOBAL_BATCH, shuffle=True))

    def on_step(step):
        if step == 2:
            open(os.path.join(out, f"ready{dist.get_rank()}"), "w").close()

    _train_steps(dp, loader, 10**6, on_step)


def _worker(argv):
    scenario, out = argv
    {"train": _scenario_train, "fail": _scenario_fail, "loop": _scenario_loop}[scenario](out)


# ---- Launching ranks ---------------------------------------------------------------------------------------------


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(scenario, out, world=2, gpus=False):
    port = _free_port()
    procs = []
    for rank in range(world):
        env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
        env.update(
            RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port), OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([_PACKAGE_PARENT, env.get("PYTHONPATH", "")]),
        )
        if not gpus:
            env["CUDA_VISIBLE_DEVICES"] = ""
        if os.path.exists("/sys/class/net/lo"):
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        logs = [open(os.path.join(out, f"{name}{rank}.txt"), "w") for name in ("stdout", "stderr")]
        procs.append(
            subprocess.Popen(
                [sys.executable, HERE, scenario, str(out)], env=env, stdout=logs[0], stderr=logs[1],
                start_new_session=True,
            )
        )
        for f in logs:
            f.close()
    return procs


def _wait_all(procs, out, timeout=LAUNCH_TIMEOUT):
    """Exit codes of every rank; kills them all and fails if any is still running after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        pytest.fail(f"ranks still running after {timeout}s (killed):\n{_logs(out, len(procs))}")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return [p.returncode for p in procs]


def _logs(out, world):
    text = []
    for rank in range(world):
        for name in ("stdout", "stderr"):
            path = os.path.join(out, f"{name}{rank}.txt")
            if os.path.exists(path):
                with open(path) as f:
                    text.append(f"--- rank {rank} {name}\n{f.read()[-3000:]}")
    return "\n".join(text)


def _reference(seen_per_rank):
    """The bare module trained by one process on the full batch of each step (the union of the ranks' shards)."""
    model, data = make_model(), make_dataset()
    opt = sgd(model.parameters())
    for step in range(STEPS):
        idx = torch.tensor(sum((seen[step] for seen in seen_per_rank), []))
        _, x, y = data[idx]
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()  # the mean over the full batch = the mean of equal shards' means
        opt.step()
    return model.state_dict()


def _check_train_run(out, world, backend, device_prefix):
    codes = _wait_all(_launch("train", out, world, gpus=backend == "nccl"), out)
    assert codes == [0] * world, _logs(out, world)
    results = [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(world)]
    seen = [r["seen"] for r in results]

    # Sharding: equal, disjoint shards; each epoch (two steps) covers the dataset; epochs are shuffled differently.
    for step in range(STEPS):
        shards = [set(s[step]) for s in seen]
        assert all(len(s) == GLOBAL_BATCH // world for s in shards)
        assert len(set().union(*shards)) == GLOBAL_BATCH
    epoch = [sorted(sum((s[2 * e] + s[2 * e + 1] for s in seen), [])) for e in range(2)]
    assert epoch[0] == epoch[1] == list(range(SAMPLES))
    assert [s[0] for s in seen] != [s[2] for s in seen], "set_epoch did not reshuffle"

    reference = _reference(seen)
    initial = make_model().state_dict()
    for rank, res in enumerate(results):
        checks, state = res["checks"], res["state"]
        assert checks["is_ddp"] and checks["is_dp"] and checks["forwarded"] and checks["params_once"]
        assert checks["backend"] == backend and checks["device"].startswith(device_prefix)
        assert checks["shard_batch"] == GLOBAL_BATCH // world
        assert list(state) == list(reference), "state_dict keys must carry no 'module.' prefix"
        assert checks["state_equals_module"]
        for k in reference:
            assert (state[k] - reference[k]).abs().max().item() <= 1e-10, (rank, k)
            assert (state[k] - initial[k]).abs().max().item() > 1e-3  # training moved every tensor
            assert torch.equal(state[k], results[0]["state"][k])  # ranks agree bit for bit
        assert checks["writes"] == (1 if rank == 0 else 0)
        assert checks["ckpt_bare"] and checks["ckpt_wrapper"]
        assert checks["save_error"] and ("rank 0 failed" in checks["save_error"] or rank == 0)
        assert checks["no_sync_local"] and checks["sync_equal"]
        assert checks["deepcopy"] and checks["eval_synced"] and checks["criterion"]
        assert "after fastdp wrapped it" in checks["move_error"]
    stdout = "".join(open(os.path.join(out, f"stdout{r}.txt")).read() for r in range(world))
    assert stdout.count("PRINT0-MARK") == 1 and "PRINT0-MARK 0" in stdout
    assert stdout.count("LOG0-MARK") == 1 and "LOG0-MARK 0" in stdout


# ---- Multi-process tests -----------------------------------------------------------------------------------------


def test_two_ranks_gloo_match_full_batch(tmp_path):
    """5 SGD steps on 2 CPU ranks (gloo) equal one process on the full batch; checkpoint, no_sync, print0 too."""
    _check_train_run(str(tmp_path), 2, "gloo", "cpu")


def test_failing_rank_ends_every_process(tmp_path):
    out = str(tmp_path)
    codes = _wait_all(_launch("fail", out), out)
    assert codes[1] == 1 and codes[0] != 0, (codes, _logs(out, 2))
    assert "rank 1 fails on purpose" in open(os.path.join(out, "stderr1.txt")).read()


def test_sigint_to_one_rank_ends_every_process(tmp_path):
    """Ctrl-C reaching one rank only (the harder case: the other must notice by itself)."""
    out = str(tmp_path)
    procs = _launch("loop", out)
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT
        while not all(os.path.exists(os.path.join(out, f"ready{r}")) for r in range(2)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), _logs(out, 2)
            time.sleep(0.05)
        procs[1].send_signal(signal.SIGINT)
    finally:
        codes = _wait_all(procs, out)
    assert all(c != 0 for c in codes), (codes, _logs(out, 2))
    assert "KeyboardInterrupt" in open(os.path.join(out, "stderr1.txt")).read()


def test_example_runs_single_and_under_torchrun(tmp_path):
    """examples/train_ddp.py: one process (emulated replicas), then two ranks through torchrun."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([_PACKAGE_PARENT, env.get("PYTHONPATH", "")]))
    script = os.path.join(ROOT, "examples", "train_ddp.py")
    args = ["--epochs", "2", "--checkpoint", str(tmp_path / "ckpt.pt")]
    single = subprocess.run([sys.executable, script, *args], env=env, capture_output=True, text=True,
                            timeout=LAUNCH_TIMEOUT)
    assert single.returncode == 0, single.stdout + single.stderr
    assert "outputs match" in single.stdout and "1 process" in single.stdout
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                "127.0.0.1", "--master_port", str(_free_port())]
    multi = subprocess.run([*launcher, script, *args], env=env, capture_output=True, text=True,
                           timeout=LAUNCH_TIMEOUT, start_new_session=True)
    assert multi.returncode == 0, multi.stdout + multi.stderr
    assert multi.stdout.count("outputs match") == 1 and "2 processes" in multi.stdout  # printed once, by rank 0


def test_example_uses_one_torch_thread_per_cpu_process(tmp_path):
    """examples/train_ddp.py on the CPU sets one torch thread itself, as examples/train.py does: with torch's
    default (a thread per core) a small model's operations fight each other for the cores of a shared machine."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and k != "OMP_NUM_THREADS"}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join([_PACKAGE_PARENT, env.get("PYTHONPATH", "")]))
    script = os.path.join(ROOT, "examples", "train_ddp.py")
    r = subprocess.run([sys.executable, script, "--epochs", "1", "--samples", "512", "--checkpoint",
                        str(tmp_path / "ckpt.pt")], env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "torch threads: 1 |" in r.stdout, r.stdout


@pytest.mark.multi_gpu
def test_two_ranks_nccl_match_full_batch(tmp_path):
    _check_train_run(str(tmp_path), 2, "nccl", "cuda:")


@pytest.mark.gpu
def test_one_rank_nccl(tmp_path):
    """mode="distributed" in a world of one on cuda:0 over NCCL: placement, set_device, save/load on the GPU path."""
    _check_train_run(str(tmp_path), 1, "nccl", "cuda:0")


# ---- In-process tests: detection, mode, helpers (no process group is ever created here) ------------------------


class _InitCalled(Exception):
    pass


@pytest.fixture
def env(monkeypatch):
    """A clean launch environment, and init_process_group patched to raise: these tests must never start one."""
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is initialised in the test process")
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)

    def init(*args, **kwargs):
        raise _InitCalled(args, kwargs)

    monkeypatch.setattr(dist, "init_process_group", init)

    def set_vars(**values):
        for name, value in values.items():
            monkeypatch.setenv(name, value)

    return set_vars


FULL = dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29555")


def test_clean_environment_is_single_process(env):
    assert fdist.launch_env() is None and not fdist.is_distributed()
    assert type(fastdp.DataParallel(nn.Linear(2, 2))) is fastdp.DataParallel


def test_world_size_one_is_single_process(env):
    env(**dict(FULL, WORLD_SIZE="1"))
    assert not fdist.is_distributed()
    assert type(fastdp.DataParallel(nn.Linear(2, 2))) is fastdp.DataParallel
    env(WORLD_SIZE="1", MASTER_ADDR="")  # WORLD_SIZE=1 needs nothing else in auto mode
    assert type(fastdp.DataParallel(nn.Linear(2, 2))) is fastdp.DataParallel


def test_full_environment_builds_distributed(env):
    env(**FULL)
    assert fdist.is_distributed()
    assert fdist.launch_env() == fdist.LaunchEnv(0, 2, 0, "127.0.0.1", 29555)
    with pytest.raises(_InitCalled) as info:
        fastdp.DataParallel(nn.Linear(2, 2), device_ids=["cpu"])
    assert info.value.args[1] == {"backend": "gloo", "init_method": "env://"}


_HINT = (
    "Launch the script with `torchrun --nproc_per_node N script.py` (add --nnodes/--node_rank/--master_addr or "
    "--rdzv_endpoint across machines), which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; or set "
    "the missing variables; or pass mode=\"single\" to run a single-process DataParallel."
)


@pytest.mark.parametrize(
    "values, missing",
    [
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 is set but RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT are not"),
        ({"RANK": "0"}, "RANK is set but WORLD_SIZE is not"),
        ({"LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"},
         "LOCAL_RANK, MASTER_ADDR, MASTER_PORT are set but WORLD_SIZE is not"),
        ({k: v for k, v in FULL.items() if k != "MASTER_ADDR"}, "WORLD_SIZE=2 is set but MASTER_ADDR is not"),
        ({k: v for k, v in FULL.items() if k != "LOCAL_RANK"}, "WORLD_SIZE=2 is set but LOCAL_RANK is not"),
    ],
)
def test_half_set_environment_names_what_is_missing(env, values, missing):
    env(**values)
    with pytest.raises(ValueError) as info:
        fastdp.DataParallel(nn.Linear(2, 2))
    assert str(info.value) == f"{missing}: the environment is half a torch.distributed launch. {_HINT}"
    assert type(fastdp.DataParallel(nn.Linear(2, 2), mode="single")) is fastdp.DataParallel  # the way out


@pytest.mark.parametrize(
    "values, message",
    [
        (dict(FULL, WORLD_SIZE="two"), "environment variable WORLD_SIZE='two' is not an integer."),
        (dict(FULL, WORLD_SIZE="0"), "environment variable WORLD_SIZE=0 is out of range (expected >= 1)."),
        (dict(FULL, RANK="2"), "environment variable RANK=2 is out of range (expected [0, 1])."),
        (dict(FULL, LOCAL_RANK="-1"), "environment variable LOCAL_RANK=-1 is out of range (expected >= 0)."),
        (dict(FULL, MASTER_PORT="70000"),
         "environment variable MASTER_PORT=70000 is out of range (expected [1, 65535])."),
    ],
)
def test_bad_launch_values(env, values, message):
    env(**values)
    with pytest.raises(ValueError) as info:
        fastdp.DataParallel(nn.Linear(2, 2))
    assert str(info.value) == f"{message} {_HINT}"


@pytest.mark.parametrize("mode", ["Auto", "ddp", None, 1])
def test_unknown_mode(env, mode):
    with pytest.raises(ValueError) as info:
        fastdp.DataParallel(nn.Linear(2, 2), mode=mode)
    assert str(info.value) == f"mode must be one of 'auto', 'single', 'distributed'; got {mode!r}"


def test_mode_single_ignores_the_launch(env):
    env(**FULL)
    dp = fastdp.DataParallel(nn.Linear(2, 2), device_ids=["cpu"] * 2, mode="single")
    assert type(dp) is fastdp.DataParallel and dp.device_ids == ["cpu", "cpu"]


def test_mode_distributed_without_launch(env):
    with pytest.raises(RuntimeError) as info:
        fastdp.DataParallel(nn.Linear(2, 2), mode="distributed", device_ids=["cpu"])
    assert str(info.value) == (
        'mode="distributed" needs a torch.distributed launch, but none of RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, '
        f"MASTER_PORT is set and no default process group is initialised. {_HINT} Alternatively call "
        "torch.distributed.init_process_group() before wrapping the model."
    )
    with pytest.raises(ValueError) as info:
        fastdp.DistributedDataParallel(nn.Linear(2, 2), mode="single")
    assert str(info.value) == ("fastdp.DistributedDataParallel always runs on torch.distributed; use "
                               "fastdp.DataParallel(..., mode=\"single\") for a single-process DataParallel")


def test_signatures():
    head = "(module, device_ids=None, output_device=None, dim=0, *, mode="
    assert str(inspect.signature(fastdp.DataParallel)).startswith(head + "'auto'")
    assert str(inspect.signature(fastdp.DistributedDataParallel)).startswith(head + "'distributed'")


def test_copy_and_pickle_never_switch(env):
    dp = fastdp.DataParallel(nn.Linear(2, 2))
    env(**FULL)  # a distributed environment now: unpickling must still not look at it
    for clone in (copy.deepcopy(dp), pickle.loads(pickle.dumps(dp))):
        assert type(clone) is fastdp.DataParallel
        assert list(clone.state_dict()) == ["weight", "bias"]


def test_subclass_is_not_switched_silently(env):
    class Balanced(fastdp.DataParallel):
        pass

    assert type(Balanced(nn.Linear(2, 2))) is Balanced
    env(**FULL)
    with pytest.raises(RuntimeError) as info:
        Balanced(nn.Linear(2, 2))
    assert str(info.value) == (
        "Balanced subclasses fastdp.DataParallel and cannot be switched to torch.distributed (mode='auto' in a "
        "distributed launch). Pass mode=\"single\" to run it as a single-process DataParallel in each process, or "
        "wrap the model with fastdp.DataParallel itself."
    )
    assert type(Balanced(nn.Linear(2, 2), mode="single")) is Balanced


def test_local_device(env, monkeypatch):
    cpu = torch.device("cpu")
    assert fdist._local_device(["cpu"]) == cpu
    monkeypatch.setattr(fastdp._platform.devices, "cuda_available", lambda: False)
    assert fdist._local_device(None) == cpu and fdist._local_device([0, 1]) == cpu
    monkeypatch.setattr(fastdp._platform.devices, "cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    env(LOCAL_RANK="1")
    assert fdist._local_device(None) == torch.device("cuda", 1)
    assert fdist._local_device([2, 3]) == torch.device("cuda", 3)  # DataParallel's list, indexed by LOCAL_RANK
    assert fdist._local_device([2]) == torch.device("cuda", 2)  # DDP's [device]
    env(LOCAL_RANK="2")
    with pytest.raises(ValueError) as info:
        fdist._local_device([0, 1])
    assert str(info.value) == (
        "device_ids=[0, 1] lists 2 GPUs but this process has LOCAL_RANK=2: start at most 2 processes per machine, "
        "or leave device_ids unset to use cuda:LOCAL_RANK."
    )
    env(LOCAL_RANK="4")
    with pytest.raises(RuntimeError) as info:
        fdist._local_device(None)
    assert str(info.value) == (
        "LOCAL_RANK=4 but only 4 CUDA device(s) are visible: each process needs its own GPU. Start at most 4 "
        "processes per machine (torchrun --nproc_per_node 4), or pass device_ids=['cpu'] to train on the CPU with "
        "gloo."
    )
    with pytest.raises(ValueError) as info:
        fdist._local_device(["cpu", 0])
    assert str(info.value) == (
        "device_ids mixes 'cpu' entries with CUDA devices (['cpu', 0]). fastdp emulates replicas on the host only "
        "when every entry is 'cpu': pass device_ids=['cpu'] * N for emulated replicas, or CUDA device indices only "
        "(e.g. [0, 1])."
    )


def test_print0_and_filter(env, capsys):
    handler = logging.StreamHandler(sys.stdout)
    handler.addFilter(fastdp.RankZeroFilter())
    log = logging.getLogger("fastdp-test-filter")
    log.addHandler(handler)
    try:
        env(RANK="1")
        fastdp.print0("hidden")
        log.warning("hidden too")
        env(RANK="0")
        fastdp.print0("shown")
        log.warning("shown too")
    finally:
        log.removeHandler(handler)
    assert capsys.readouterr().out == "shown\nshown too\n"


def test_shard_without_distribution_returns_the_loader(env):
    loader = DataLoader(make_dataset(), batch_size=4, shuffle=True)
    assert fastdp.shard(loader) is loader
    assert fastdp.shard(loader, num_replicas=1) is loader


def test_shard_splits_the_global_batch_and_reshuffles(env):
    base = DataLoader(make_dataset(), batch_size=8, shuffle=True, collate_fn=None)
    loaders = [fastdp.shard(base, num_replicas=2, rank=r, seed=3) for r in range(2)]
    assert all(isinstance(l, fdist.ShardedLoader) and l.batch_size == 4 for l in loaders)
    assert len(loaders[0]) == 2 and loaders[0].dataset is base.dataset
    epochs = []
    for _ in range(2):
        batches = [[b[0].tolist() for b in l] for l in loaders]
        assert not set(sum(batches[0], [])) & set(sum(batches[1], []))
        assert sorted(sum(batches[0] + batches[1], [])) == list(range(SAMPLES))
        epochs.append(batches)
    assert epochs[0] != epochs[1] and loaders[0].epoch == 2
    loaders[0].set_epoch(0)
    assert [b[0].tolist() for b in loaders[0]] == epochs[0][0]  # resuming replays an epoch
    ordered = fastdp.shard(DataLoader(make_dataset(), batch_size=8), num_replicas=2, rank=1)
    assert [b[0].tolist() for b in ordered] == [[1, 3, 5, 7], [9, 11, 13, 15]]
    assert fastdp.shard(base, num_replicas=2, rank=0, split_batch=False).batch_size == 8


def test_shard_refuses_what_it_cannot_shard(env):
    data = make_dataset()
    with pytest.raises(ValueError) as info:
        fastdp.shard(DataLoader(data, batch_size=8), num_replicas=3, rank=0)
    assert str(info.value) == (
        "batch_size=8 is the global batch (split_batch=True) and must be divisible by the world size 3; pick a "
        "multiple of 3, or pass split_batch=False to load batch_size samples on every rank"
    )
    with pytest.raises(ValueError) as info:
        fastdp.shard(DataLoader(data, batch_size=8, sampler=[0, 1, 2]), num_replicas=2, rank=0)
    assert str(info.value) == (
        "shard() cannot shard a DataLoader with a custom sampler (list); use shuffle=True/False, or a "
        "torch.utils.data.DistributedSampler of your own"
    )
    for sampler in (RandomSampler(data, replacement=True), RandomSampler(data, num_samples=4)):
        with pytest.raises(ValueError) as info:
            fastdp.shard(DataLoader(data, batch_size=8, sampler=sampler), num_replicas=2, rank=0)
        assert str(info.value) == "shard() cannot shard a RandomSampler with replacement or num_samples"
    with pytest.raises(ValueError) as info:
        fastdp.shard(DataLoader(data, batch_sampler=[[0, 1]]), num_replicas=2, rank=0)
    assert str(info.value) == (
        "shard() needs a DataLoader built with batch_size= (and shuffle= or no sampler), not batch_sampler= or "
        "batch_size=None; build a DistributedSampler yourself for custom batching"
    )

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(4))

    with pytest.raises(ValueError) as info:
        fastdp.shard(DataLoader(Stream(), batch_size=2), num_replicas=2, rank=0)
    assert str(info.value) == (
        "shard() cannot shard an IterableDataset: split it by rank inside the dataset's __iter__"
    )
    with pytest.raises(TypeError) as info:
        fastdp.shard(data)
    assert str(info.value) == "shard() expects a torch.utils.data.DataLoader, got TensorDataset"


def test_save_without_distribution(env, tmp_path):
    fastdp.save({"a": torch.ones(2)}, tmp_path / "x.pt")
    assert torch.equal(torch.load(tmp_path / "x.pt")["a"], torch.ones(2))


if __name__ == "__main__":
    _worker(sys.argv[1:])
