"""One forward owns its state: nothing about a running step is stored on the wrapper where another thread, a nested
call or a re-entered call could read or overwrite it, and what the step found stays on the wrapper only once it has
ended (for ``fastdp.memory_report`` and the ``chunk_sizes="auto"`` reader). The reference for every result is the
bare model."""

import threading
import time

import pytest
import torch
import torch.nn as nn

import fastdp
from fastdp._step import step as _step

pytestmark = pytest.mark.usefixtures("cpu_apply")


def _snapshot(module):
    """The wrapper's own attributes, each by identity (a value replaced in place of another shows)."""
    return {k: id(v) for k, v in module.__dict__.items()}


class Probe(nn.Module):
    """Calls ``look()`` from inside each replica's forward, while the wrapper's step is running."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.__dict__["look"] = None  # not replicated state: every replica calls the same function

    def forward(self, x):
        if self.__dict__["look"] is not None:
            self.__dict__["look"]()
        return self.lin(x)


@pytest.mark.parametrize("chunk_sizes", [None, [0.0, 1.0, 1.0]])
def test_a_running_step_leaves_the_wrapper_as_it_was(chunk_sizes):
    model = Probe()
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 3, chunk_sizes=chunk_sizes)
    x = torch.randn(9, 4)
    dp(x).sum().backward()  # the kept replicas are built by the first step
    before = _snapshot(dp)
    seen = []
    model.__dict__["look"] = lambda: seen.append(_snapshot(dp))
    out = dp(x)
    model.__dict__["look"] = None
    assert seen and all(s == before for s in seen), "a running step must not store its state on the wrapper"
    after = _snapshot(dp)
    assert {k for k in after if after[k] != before.get(k)} == {"_last_step"}
    torch.testing.assert_close(out, model(x))


def test_another_thread_sees_no_running_step():
    model = Probe()
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 2, chunk_sizes=[1.0, 3.0])
    found = []

    def from_another_thread():
        t = threading.Thread(target=lambda: found.append((_step.current(dp), dp.__dict__["_last_step"])))
        t.start()
        t.join(timeout=60)
        assert not t.is_alive(), "the reading thread hung"

    model.__dict__["look"] = from_another_thread
    dp(torch.randn(8, 4))
    model.__dict__["look"] = None
    assert found and all(step is None and last is None for step, last in found)
    assert dp._last_step.chunk_sizes == [2, 6]  # ended: its split is now the wrapper's last


class Reenter(nn.Module):
    """Calls the wrapper that runs it once more, on its own chunk (a re-entered call)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, depth=0):
        y = self.lin(x)
        return WRAPPER[0](y, depth=depth + 1) if depth < 1 else y


WRAPPER = []


def test_a_re_entered_call_does_not_overwrite_the_outer_steps_findings():
    model = Reenter()
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 3, chunk_sizes=[0.0, 1.0, 1.0])
    WRAPPER[:] = [dp]
    try:
        x = torch.randn(8, 4)
        out = dp(x)
        # The outer step split 8 as (0, 4, 4); each re-entered call split its 4 as (0, 2, 2) and ended first.
        assert [d.chunk for d in fastdp.memory_report(dp).devices] == [0, 4, 4]
        torch.testing.assert_close(out, model.lin(model.lin(x)))
        assert _step.running.steps == ()
    finally:
        WRAPPER.clear()


def test_the_per_replica_loss_reports_the_step_that_computed_it():
    model = nn.Linear(4, 3)
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 2, criterion=nn.CrossEntropyLoss())
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    loss = dp(x, target=y)
    torch.testing.assert_close(loss, nn.CrossEntropyLoss()(model(x), y))
    assert fastdp.memory_report(dp).avoided_gather_bytes == 6 * 3 * 4  # the logits it did not gather
    with torch.no_grad():
        dp(x)  # an evaluation without a target: the figure stays the last criterion forward's
    assert fastdp.memory_report(dp).avoided_gather_bytes == 6 * 3 * 4
    assert fastdp.memory_report(dp).devices[0].chunk is None  # torch.chunk's rule: no sizes of its own


@pytest.mark.parametrize("ndev", [1, 2])
def test_a_forward_without_a_target_leaves_the_figure_as_it_was(ndev):
    # One device computes the loss on its one output (nothing to avoid: no figure); two avoid the gather. Either
    # way an evaluation without a target, which takes the short path on one device, changes nothing.
    dp = fastdp.DataParallel(nn.Linear(4, 3), device_ids=["cpu"] * ndev, criterion=nn.CrossEntropyLoss())
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    dp(x, target=y)
    before = fastdp.memory_report(dp).avoided_gather_bytes
    with torch.no_grad():
        dp(x)
    assert fastdp.memory_report(dp).avoided_gather_bytes == before


@pytest.mark.parametrize("ndev", [1, 2])
def test_a_criterion_on_the_gathered_output_avoids_nothing(ndev):
    model = nn.Linear(4, 3)
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * ndev, criterion=lambda out, y: (out - y).abs().max())
    x, y = torch.randn(6, 4), torch.randn(6, 3)
    torch.testing.assert_close(dp(x, target=y), (model(x) - y).abs().max())
    assert fastdp.memory_report(dp).avoided_gather_bytes == 0


def test_the_last_step_survives_pickling_under_every_protocol():
    import pickle

    dp = fastdp.DataParallel(nn.Linear(4, 3), device_ids=["cpu"] * 3, chunk_sizes=[1.0, 1.0, 2.0])
    dp(torch.randn(8, 4))
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        clone = pickle.loads(pickle.dumps(dp, protocol=protocol))
        assert clone._last_step == dp._last_step == ([2, 2, 4], None, [0, 1, 2]), protocol


def test_a_failing_step_ends_and_the_next_one_runs():
    model = Probe()
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 2)

    def fail():
        raise ValueError("in the replica")

    model.__dict__["look"] = fail
    with pytest.raises(ValueError, match="in the replica"):
        dp(torch.randn(4, 4))
    assert _step.running.steps == ()  # no step left open on the thread
    model.__dict__["look"] = None
    x = torch.randn(4, 4)
    torch.testing.assert_close(dp(x), model(x))


def test_a_step_ends_before_the_next_forward_of_its_wrapper_starts(monkeypatch):
    """Threads sharing a wrapper: a forward's findings are left on the wrapper while it still holds the forward
    lock, so the next forward (and its "auto" reader) sees them, and an older forward never overwrites a newer."""
    events = []
    publish = fastdp.DataParallel._keep_outcome

    def slow_publish(*args):
        events.append("ending")
        time.sleep(0.02)
        publish(*args)
        events.append("ended")

    monkeypatch.setattr(fastdp.DataParallel, "_keep_outcome", slow_publish)
    model = Probe()
    model.__dict__["look"] = lambda: events.append("forward")
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 2)
    x = torch.randn(4, 4)
    threads = [threading.Thread(target=dp, args=(x,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a forward of the shared wrapper hung"
    assert events.count("ended") == 4 and events.count("forward") == 8
    ending = False
    for e in events:
        assert not (ending and e == "forward"), events
        ending = e == "ending"
