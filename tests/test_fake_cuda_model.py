"""The model of a GPU in tests/_fake_cuda.py, checked against what CUDA and PyTorch do, so that the tests built on it
fail for a bug of each class whatever its example: queues that run late, the order of work across streams, the
caching allocator's reuse and record_stream, autograd's engine either side of torch 2.8, poisoned fresh memory."""

import pytest
import torch

pytestmark = pytest.mark.sim

CUDA1 = torch.device("cuda", 1)


def _taken(cuda):
    found, cuda.misuse[:] = list(cuda.misuse), []
    return found


def test_a_late_queue_completes_only_once_the_host_waited_for_it(cuda):
    """Each stream runs behind the host by an amount of its own: its events, its fences and timings between events
    are pending until the host synchronises with what they follow (the device, the stream or the event)."""
    cuda.late()
    a, b = cuda.stream_on(0, "a@0"), cuda.stream_on(1, "b@1")
    assert a.lag != b.lag
    start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
    start.record(a)
    end.record(a)
    other = b.record_event()
    assert not (start.query() or end.query() or other.query())
    with pytest.raises(RuntimeError, match="not completed"):
        start.elapsed_time(end)
    cuda.synchronize(0)
    assert start.query() and end.query() and start.elapsed_time(end) >= 0
    other.synchronize()
    assert other.query()
    cuda.late(0)  # queues keep up again: what was enqueued has run
    assert a.query() and b.query()


def test_a_read_needs_its_write_ordered_before_it(cuda, monkeypatch):
    """A read of memory on another stream than its write's, with no wait in between and the write not yet run, is
    a misuse; a wait on the writing stream, an event or a fence behind it, or a host synchronisation orders it."""
    cuda.install_memory(monkeypatch)
    cuda.late()
    w, r = cuda.stream_on(1, "w@1"), cuda.stream_on(1, "r@1")
    alive = []  # (a block freed under the reader would be a misuse of its own)
    for order in (None, "wait_stream", "event", "fence", "sync"):
        with cuda.stream(w):
            t = torch.empty(4, device=CUDA1)
        cuda.use(t, stream=w, write=True)
        if order == "wait_stream":
            r.wait_stream(w)
        elif order == "event":
            r.wait_event(w.record_event())
        elif order == "fence":
            cuda.order([(1, r.cuda_stream)], [(1, w.cuda_stream)])
        elif order == "sync":
            cuda.synchronize(1)
        cuda.use(t, stream=r)
        alive.append(t)
        assert bool(_taken(cuda)) == (order is None), order


@pytest.mark.parametrize("recorded", [False, True])
def test_a_freed_block_goes_to_the_next_allocation_on_its_stream(cuda, monkeypatch, recorded):
    """The caching allocator hands a freed block to the next allocation on the stream it was allocated on at once:
    another stream still reading it is a misuse unless record_stream named it (then the block waits for that
    stream's work up to the free). The counters follow the blocks; fresh blocks are poisoned."""
    cuda.install_memory(monkeypatch)
    cuda.late()
    mine, reader = cuda.stream_on(1, "mine@1"), cuda.stream_on(1, "reader@1")
    with cuda.stream(mine):
        t = torch.empty(16, device=CUDA1)
    cuda.use(t, stream=mine, write=True)
    reader.wait_stream(mine)
    cuda.use(t, stream=reader)
    if recorded:
        t.record_stream(reader)
    assert cuda.allocated[1] == 64
    del t
    assert cuda.allocated[1] == 0 and cuda.peak[1] == 64
    with cuda.stream(mine):
        again = torch.empty(16, device=CUDA1)
    assert torch.isnan(again).all()
    assert bool(_taken(cuda)) == (not recorded)
    assert len(cuda.pool) == (1 if recorded else 0)  # a recorded block waits for the reader
    cuda.synchronize(1)
    with cuda.stream(mine):
        third = torch.empty(16, device=CUDA1)
    assert cuda.pool == [] and _taken(cuda) == [] and third.numel() == 16


def test_fresh_memory_is_poisoned_and_zeros_are_written(cuda, monkeypatch):
    cuda.install_memory(monkeypatch)
    assert torch.isnan(torch.empty(3, device=CUDA1)).all()
    assert (torch.empty(3, dtype=torch.int32, device=CUDA1) != 0).all()
    assert torch.empty(3, dtype=torch.bool, device=CUDA1).all()
    assert not torch.zeros(3, device=CUDA1).any() and not torch.zeros_like(torch.ones(3), device=CUDA1).any()
    assert torch.isnan(torch.empty_like(torch.zeros(2, device=CUDA1))).all()


class _Node(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        return a.detach(), b.detach()

    @staticmethod
    def backward(ctx, ga, gb):
        ctx.ran_on = torch.cuda.current_stream(0).name
        _Node.ran.append(ctx.ran_on)
        return ga, gb


@pytest.mark.parametrize("rule, waits", [
    ("canonical", [("wait_event", "made@0", "ready@p0@0"), ("wait_event", "made@0", "ready@p1@1")]),
    ("default", [("wait_event", "made@0", "ready@p0@0"), ("wait_event", "default@1", "ready@p1@1")])])
def test_the_engine_runs_a_node_on_its_canonical_stream_after_its_rules_waits(cuda, monkeypatch, rule, waits):
    """A node's canonical stream is the one current on its first output's device when it was made; the engine runs
    it there, after the waits of its rule: torch 2.8 and newer, that stream waits for every gradient's producer;
    before, it waits for those of its device, and another device's default stream for that device's."""
    producers = {0: cuda.stream_on(0, "p0@0"), 1: cuda.stream_on(1, "p1@1")}
    cuda.engine(monkeypatch, _Node, rule, producers, lambda ctx, n: [0, 1])
    _Node.ran = []
    a, b = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    with cuda.stream(cuda.stream_on(0, "made@0")):
        x, y = _Node.apply(a, b)
    (x.sum() + y.sum()).backward()
    assert _Node.ran == ["made@0"]
    assert [e for e in cuda.log if e[0] == "wait_event"] == waits


def test_torch_operations_on_device_memory_run_on_the_current_stream(cuda, monkeypatch):
    """With operations noted (install_memory(work=True)), a torch operation on a block reads its inputs and writes
    its output on the current stream of their device: an add on a stream that did not wait for the stream that
    wrote an input is a misuse; copy_ and fill_ overwrite without reading; views move no data; a result in new
    memory is a block of the current stream."""
    cuda.install_memory(monkeypatch, work=True)
    try:
        cuda.late()
        w, r = cuda.stream_on(1, "w@1"), cuda.stream_on(1, "r@1")
        with cuda.stream(w):
            a = torch.empty(4, device=CUDA1)
            a.fill_(1.0)
            b = a * 2
        assert cuda.block_of(b).stream == w and _taken(cuda) == []
        with cuda.stream(r):
            a.view(2, 2)  # no data moved: no read
            assert _taken(cuda) == []
            b.add_(1)
        assert _taken(cuda)  # r read b before w's write was ordered before it
        with cuda.stream(r):
            r.wait_stream(w)
            c = torch.empty(4, device=CUDA1)
            c.copy_(a)
            c += b
        assert _taken(cuda) == [] and c.tolist() == [4.0] * 4
    finally:
        cuda.leave()
