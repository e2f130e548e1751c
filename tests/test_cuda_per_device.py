"""What each CUDA device reports and which one is made current, run on a CPU against a recording stand-in for
torch.cuda (tests/_fake_cuda.py): memory_report's figures and peak resets per listed device, upstream's imbalance
warning naming the weaker GPU, a distributed rank's GPU made current, the benchmarks' syncs and peaks on every
device they use, and ``chunk_sizes="auto"`` reading peaks without resetting the user's counters.

Tensors stay on the host; the code under test is told its devices are CUDA devices (conftest's ``cuda``
and ``cuda3`` fixtures install the fake, and fail a test that misused it). Every numeric result is compared with
torch's own on the bare model.
"""

import importlib
import types
import warnings

import pytest
import torch
import torch.nn as nn

import fastdp
from fastdp._balance import split as _split

dp_module = importlib.import_module("fastdp.data_parallel")

pytestmark = pytest.mark.sim


# ---- what each device reports: memory, properties ----------------------------------------------------------------


def test_memory_report_reads_and_resets_each_device(cuda):
    """memory_report's figures are each listed device's own, and reset_peak resets the peaks of those devices."""

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.module = nn.Linear(2, 2)
            self.device_ids = [1, 0]

    cuda.allocated, cuda.peak = [10, 20], [100, 200]
    report = fastdp.memory_report(Wrapper(), reset_peak=True)
    assert [(d.device, d.allocated, d.peak) for d in report.devices] == [("cuda:1", 20, 200), ("cuda:0", 10, 100)]
    assert sorted(cuda.entries("reset_peak")) == [("reset_peak", 0), ("reset_peak", 1)]


@pytest.mark.parametrize("ids, warned", [([0, 1], (1, 0)), ([1, 0], (1, 0)), ([0, 0], None)])
def test_imbalance_warning_names_the_weaker_gpu(cuda, ids, warned):
    """Upstream's warning compares each listed GPU's own properties and names the one with less memory."""
    cuda.props[1].total_memory = 40 << 30
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dp_module._checks.check_balance(ids)
    texts = [str(w.message) for w in caught]
    if warned is None:
        assert texts == []
    else:
        assert texts == [dp_module._checks.IMBALANCE_WARNING.format(*warned)]


@pytest.mark.parametrize("local_rank, device_ids, want", [("1", None, 1), ("1", [0, 1], 1), ("0", [1], 1)])
def test_distributed_rank_makes_its_gpu_current(cuda, monkeypatch, local_rank, device_ids, want):
    """Each process of fastdp.DistributedDataParallel makes its own GPU current before the process group (and the
    user's own .cuda() calls) use it: LOCAL_RANK's, or the one device_ids names for it."""
    from fastdp import distributed

    monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert distributed._bind_device(device_ids) == torch.device("cuda", want)
    assert cuda.entries("set_device") == [("set_device", want)] and cuda.current_device() == want


# ---- the benchmarks: timings wait for every GPU they use, peaks per device ----------------------------------------


def test_benchmarks_wait_for_and_measure_every_device(cuda):
    """A timing of work over several GPUs ends when the last of them is done (torch.cuda.synchronize() waits for the
    current device only), and peak memory is reset and read on each device a configuration uses."""
    from fastdp.bench import comm as bench_comm, phases, syncbn

    def synced(fn):
        cuda.log.clear()
        fn()
        return sorted(e[1] for e in cuda.entries("device_sync"))

    assert synced(phases.synchronize_all([1, 0, 1])) == [0, 1]
    config = types.SimpleNamespace(device_ids=[1, 1])
    assert synced(phases.device_sync("cuda", [config, types.SimpleNamespace(device_ids=None)])) == [0, 1]
    assert synced(syncbn._step_sync("cuda", [0, 1])) == [0, 1]
    targets = {name: sync for name, _, sync, _ in bench_comm._targets(2)}
    assert synced(targets["cuda"]) == [0] and synced(targets["nccl"]) == [0, 1]
    cuda.peak = [7 << 20, 9 << 20]
    assert phases.peak_read("cuda", config) == {"cuda:1": 9.0}
    phases.peak_reset("cuda", config)
    assert cuda.entries("reset_peak") == [("reset_peak", 1)]


# ---- chunk_sizes="auto": the user's peak counters stay whole ------------------------------------------------------


def test_auto_split_reads_peaks_without_resetting_them(cuda):
    """The default reader samples the allocator's current figure (end of each training forward, and when read)
    and never resets the process-wide peak counters, which the user may be reading too."""
    rule = _split.AutoSplit(warmup=0, probes=2).bind([0, 1])
    reader = rule.reader
    assert isinstance(reader.__self__, fastdp._balance.memory.PeakWindow)
    cuda.peak = [10**9, 10**9]  # the user's own high-water marks: never moved here, so the samples tell
    cuda.allocated = [50, 40]
    reader.__self__.sample()
    cuda.allocated = [20, 45]
    assert reader() == [50, 45]  # the highest of the samples and the reading
    cuda.allocated = [5, 5]
    assert reader() == [20, 45]  # a new interval starts at each reading, with what was allocated then
    assert reader() == [5, 5]
    for a0, a1 in [(50, 40), (80, 40), (70, 60), (30, 30)]:
        rule.observe()
        rule.split(8, 0, 2)
        cuda.allocated = [a0, a1]
        rule.sample()  # the end of the training forward
        cuda.allocated = [5, 5]
    assert [round(r, 3) for _, r in rule.history] == [1.25, 2.0, 1.167]  # each judged step its own peaks
    assert cuda.entries("reset_peak") == []
    assert cuda.peak == [10**9, 10**9]
