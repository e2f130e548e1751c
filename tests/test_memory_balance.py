"""Device 0's memory on emulated CPU replicas: ``fastdp.memory_report``'s figures (replica buffers, the master,
the peak ratio over distinct devices), ``chunk_sizes="auto"`` settling its memory phase by bisection with an
injected reader (on simulated CUDA devices too, tests/test_sim_contract.py), and the split, per-replica loss and
report on CUDA (marked ``gpu`` and ``multi_gpu``).

References: the bare module on the full batch; the injected reader's peaks, computed from the split it reads.
"""

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fastdp
from fastdp.balance import DeviceMemory, MemoryReport, largest_remainder

from _balance_cases import R, batch, batch_of, net
from _places import devices, module


# ---- memory report -----------------------------------------------------------------------------------------------


def _param_bytes(module):
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


@pytest.mark.parametrize("spec, holders", [(None, [1, 2]), ([0, 5, 5], [1, 2]), ([5, 0, 5], [2])])
def test_memory_report_counts_the_replicas_flat_buffers(spec, holders):
    model = net()
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * R, chunk_sizes=spec)
    dp(batch_of(10)).sum().backward()
    report = fastdp.memory_report(dp)
    assert [d.position for d in report.devices] == [0, 1, 2]
    size = _param_bytes(model)
    assert [d.replica_buffers for d in report.devices] == [size if i in holders else 0 for i in range(R)]
    assert report.devices[0].master == size + sum(p.grad.numel() * 8 for p in model.parameters() if p.grad is not None)
    assert all(d.allocated is None and d.peak is None and d.staging == 0 for d in report.devices)
    assert report.peak_ratio() is None
    text = str(report)
    assert "n/a" in text and "replica bufs" in text and "allocator figures are n/a on the host" in text
    if spec is not None:
        assert [d.chunk for d in report.devices] == spec


def test_memory_report_before_any_step_and_for_pass_through(monkeypatch):
    dp = fastdp.DataParallel(net(), device_ids=["cpu"] * 2)
    report = fastdp.memory_report(dp)
    assert [d.fastdp_bytes for d in report.devices] == [0, 0] and any("no kept replicas" in n for n in report.notes)
    monkeypatch.setattr(fastdp._platform.devices, "cuda_available", lambda: False)
    assert fastdp.memory_report(fastdp.DataParallel(net())).devices == []


def test_memory_report_peak_ratio_uses_distinct_devices():
    rows = [DeviceMemory(i, f"cuda:{d}", None, 1, peak, 0, 0, 0, 0)
            for i, (d, peak) in enumerate([(0, 110), (1, 100), (2, 90), (3, 200)])]
    assert MemoryReport(rows).peak_ratio() == pytest.approx(110 / 100)
    same = [DeviceMemory(i, "cuda:0", None, 1, 50, 0, 0, 0, 0) for i in range(3)]
    assert MemoryReport(same).peak_ratio() is None


# ---- chunk_sizes="auto" with an injected reader -------------------------------------------------------------------


class FakeMemory:
    """Peak of each device = base + per_sample * chunk, plus `extra` on device 0 (master, grads, optimizer)."""

    def __init__(self, dp, base=1000, per_sample=100, extra=600):
        self.dp, self.base, self.per_sample, self.extra = dp, base, per_sample, extra
        self.calls = 0

    def __call__(self):
        self.calls += 1
        last = self.dp._last_step  # the previous forward's split (None before the first)
        sizes = (last and last.chunk_sizes) or [0] * len(self.dp.device_ids)
        return [self.base + self.per_sample * n + (self.extra if i == 0 else 0) for i, n in enumerate(sizes)]


def _auto_run(extra, steps=14, batch_size=32, ndev=4, **options):
    model = nn.Linear(6, 3).double()
    # The memory phase alone: the time phase (tests/test_rebalance.py) would move rows by the replicas' timing noise.
    auto = fastdp.AutoSplit(reader=lambda: reader(), balance_time=False, **options)
    dp = fastdp.DataParallel(module(model), device_ids=devices(ndev), chunk_sizes=auto)
    reader = FakeMemory(dp, extra=extra)
    shares = []
    for _ in range(steps):
        dp(batch_of(batch_size)).sum().backward()
        shares.append(dp._split.share)
    return dp._split, shares, dp


def test_auto_settles_by_bisection_within_the_bound_and_stays():
    rule, shares, dp = _auto_run(extra=600)
    # Peaks at the equal split: 1000 + 800 + 600 vs 1000 + 800 → over; the bound holds from share 0.25 down.
    assert rule.settled and shares[-1] == rule.share
    assert shares[:3] == [1.0, 1.0, 1.0]  # the first reading and two warm-up steps are not judged
    assert [s for s, _ in rule.history] == [1.0, 0.5, 0.25, 0.375, 0.3125, 0.34375]
    assert rule.share == 0.34375 and all(r > 1.05 for s, r in rule.history if s > rule.share)
    sizes = largest_remainder([rule.share, 1.0, 1.0, 1.0], 32)
    assert dp._last_step.chunk_sizes == sizes
    assert 1000 + 600 + 100 * sizes[0] <= 1.05 * (1000 + 100 * sizes[1])
    assert len(set(shares[9:])) == 1  # settled after 2 + 1 + 1 + 5 steps, fixed from then on
    again, shares_again, _ = _auto_run(extra=600)
    assert shares_again == shares  # deterministic


def test_auto_keeps_the_equal_split_when_device_0_is_within_the_bound():
    rule, shares, _ = _auto_run(extra=20)
    assert rule.settled and rule.share == 1.0 and len(rule.history) == 1


def test_auto_bounded_at_zero_and_skips_other_batch_sizes_and_eval():
    rule, _, _ = _auto_run(extra=50_000)
    assert rule.settled and rule.share == 0.0  # never within the bound: device 0 gets no chunk at all
    model = nn.Linear(6, 3).double()
    auto = fastdp.AutoSplit(reader=lambda: reader(), warmup=0, probes=2, balance_time=False)
    dp = fastdp.DataParallel(module(model), device_ids=devices(3), chunk_sizes=auto)
    reader = FakeMemory(dp, extra=600)
    for n in (12, 12, 7, 12):
        dp(batch_of(n)).sum().backward()
    # Judged: the first 12-sample step (share 1, over) and the second (share 0.5, over); the 7-sample step
    # (share 0.25) was not, so the share waits at 0.25 for a step of the reference size.
    assert [s for s, _ in dp._split.history] == [1.0, 0.5] and dp._split.share == 0.25
    with torch.no_grad():
        dp(batch_of(5))
    dp.eval()
    dp(batch_of(5))
    assert reader.calls == 4  # only training forwards drive it
    dp.train()
    dp(batch_of(12)).sum().backward()  # judges the 12-sample step of share 0.25, despite the 5-sample evaluations
    assert [s for s, _ in dp._split.history] == [1.0, 0.5, 0.25]


def test_auto_without_a_reader_settles_its_memory_phase_at_once_on_cpu():
    dp = fastdp.DataParallel(nn.Linear(6, 3), device_ids=["cpu"] * 3, chunk_sizes="auto")
    assert dp._split.memory_settled and dp._split.share == 1.0 and "'cpu'" in dp._split.reason
    assert not dp._split.time_settled  # replica times can be measured on the host: that phase runs
    dp(torch.randn(10, 6))
    assert dp._last_step.chunk_sizes == [3, 3, 4]
    assert "auto" in str(fastdp.memory_report(dp))
    shared = fastdp.AutoSplit(reader=lambda: [0, 0])
    a = fastdp.DataParallel(nn.Linear(6, 3), device_ids=["cpu"] * 2, chunk_sizes=shared)
    assert a._split is not shared  # each wrapper settles on its own


@pytest.mark.parametrize("options, error, text", [
    ({"warmup": -1}, ValueError, "warmup must be a non-negative int, got -1"),
    ({"probes": 0}, ValueError, "probes must be a positive int, got 0"),
    ({"tolerance": math.inf}, ValueError, "tolerance must be a finite non-negative number, got inf"),
    ({"reader": 3}, TypeError, "reader must be callable (returning one peak per device), got int"),
])
def test_auto_options_are_checked(options, error, text):
    with pytest.raises(error) as info:
        fastdp.AutoSplit(**options)
    assert str(info.value) == text


# ---- GPU (skipped without CUDA) ----------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_split_loss_and_report_on_repeated_ids():
    bare = net().cuda()
    dp = fastdp.DataParallel(copy.deepcopy(bare), device_ids=[0, 0, 0], chunk_sizes=[0, 4, 7],
                             criterion=nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)))
    x, pair, mask, y = (t.cuda() if isinstance(t, torch.Tensor) else t for t in batch(11))
    loss = dp(x, target=y)
    ref = F.cross_entropy(bare(x), y, weight=torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64, device="cuda"))
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-9)
    loss.backward()
    ref.backward()
    for p, q in zip(dp.module.parameters(), bare.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-9)
    report = fastdp.memory_report(dp, reset_peak=True)
    assert report.devices[0].allocated > 0 and report.devices[0].peak >= report.devices[0].allocated
    assert report.devices[1].replica_buffers > 0 and report.peak_ratio() is None
    twice = fastdp.AutoSplit().bind([0, 0])  # one GPU listed twice cannot be measured per replica: equal memory
    assert twice.memory_settled and "more than once" in twice.reason  # (its time phase still runs, as on 'cpu')


@pytest.mark.multi_gpu
def test_multi_gpu_share_zero_and_auto_reader():
    n = torch.cuda.device_count()
    bare = net().cuda()
    dp = fastdp.DataParallel(copy.deepcopy(bare), device_ids=list(range(n)), chunk_sizes=0.0,
                             criterion=nn.CrossEntropyLoss())
    x, pair, mask, y = (t.cuda() if isinstance(t, torch.Tensor) else t for t in batch(4 * n))
    loss = dp(x, target=y)
    ref = F.cross_entropy(bare(x), y)
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-9)
    loss.backward()
    ref.backward()
    for p, q in zip(dp.module.parameters(), bare.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-9)
    rule = fastdp.AutoSplit().bind(list(range(n)))
    assert not rule.settled and len(rule.reader()) == n
