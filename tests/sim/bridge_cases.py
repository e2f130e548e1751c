"""The simulated-device bridge itself (tests/sim/simcuda.py), run under tests/sim/contract.py by
tests/test_sim_contract.py: values, views and poisoned fresh memory; values crossing devices through the C core on
the simulated driver; an operation on tensors of two devices refused, as a kernel refuses it, and a gradient on
another device than its input, as the engine refuses it; and the two kinds of bug the contract run is for, planted,
and caught: a core copy that reads what the Python layer wrote on another stream without a wait (a race), and a
Python-layer buffer left unwritten (poison in the result)."""

import gc
import threading

import pytest
import torch

import _places
from fastdp import _C, comm
from fastdp._native import core as _core


@pytest.fixture
def bridge():
    return _places.SIM


def _races(bridge):
    """The misuse recorded so far, cleared (so that a planted bug's race does not fail the test's own check)."""
    n, text = bridge.sim.errors()
    bridge.sim.reset()
    return n, text


def test_values_views_and_in_place_operations(bridge):
    host = torch.arange(24.0).reshape(4, 6)
    x = _places.on(host, 2)
    assert x.is_cuda and x.device == torch.device("cuda", 2) and x.get_device() == 2
    view = x[1:, ::2]
    assert view.data_ptr() == x.data_ptr() + (6 * 4) and view.stride() == (6, 2)
    view.mul_(10)  # writes through the view into x's memory
    want = host.clone()
    want[1:, ::2] *= 10
    assert torch.equal(x.cpu(), want)
    y = x.t() + 1  # a fresh result on x's device
    assert y.device == x.device and torch.equal(y.cpu(), want.t() + 1)
    moved = host.to(torch.device("cuda", 3))
    assert moved.device == torch.device("cuda", 3) and torch.equal(moved.cpu(), host)


@pytest.mark.parametrize("dtype, poison", [(torch.float32, float("nan")), (torch.float16, float("nan")),
                                           (torch.int64, -1), (torch.uint8, 255)])
def test_fresh_memory_is_poisoned(bridge, dtype, poison):
    """Memory nobody wrote reads as NaN or all ones, never as zeros, on every route to fresh memory."""
    for fresh in (torch.empty(5, dtype=dtype, device="cuda:1"),
                  torch.empty_like(_places.on(torch.zeros(5, dtype=dtype), 1)),
                  _places.on(torch.zeros(5, dtype=dtype), 0).new_empty(5)):
        values = fresh.cpu()
        if dtype.is_floating_point:
            assert values.isnan().all(), values
        else:
            assert (values == poison).all(), values


def test_an_operation_on_two_devices_is_refused_as_a_kernel_refuses_it(bridge):
    """A CUDA kernel refuses inputs on two devices (a gradient sent to the wrong replica's device fails there on a GPU,
    so it must fail here); a copy between devices runs."""
    a, b = _places.on(torch.ones(3), 0), _places.on(torch.ones(3), 1)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        a + b
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.mm(_places.on(torch.ones(2, 3), 1), _places.on(torch.ones(3, 2), 2))
    assert torch.equal(b.copy_(a * 2).cpu(), torch.full((3,), 2.0))
    assert torch.equal(a.to(torch.device("cuda", 3)).cpu(), torch.ones(3))


class _GradientElsewhere(torch.autograd.Function):
    """Passes its input on; its backward sends the gradient to ``device`` (a node with a wrong device list)."""

    @staticmethod
    def forward(ctx, device, x):
        ctx.device = device
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        return None, grad.to(torch.device("cuda", ctx.device))


@pytest.mark.parametrize("device, valid", [(1, True), (0, False)])
def test_a_gradient_on_another_device_than_its_input_is_refused_as_the_engine_refuses_it(bridge, monkeypatch, device,
                                                                                        valid):
    """Autograd's engine checks that each gradient a node returns is on its input's device; the engine of a CPU build
    sees host tensors only, so the bridge's engine makes the check (fastdp's own nodes run under it)."""
    bridge.cuda.engine(monkeypatch, _GradientElsewhere)
    x = _places.on(torch.ones(3), 1).requires_grad_()
    y = _GradientElsewhere.apply(device, x).sum()
    if valid:
        (grad,) = torch.autograd.grad(y, x)
        assert grad.get_device() == 1 and torch.equal(grad.cpu(), torch.ones(3))
    else:
        with pytest.raises(RuntimeError, match="invalid gradient at index 1 - expected device cuda:1 but got cuda:0"):
            torch.autograd.grad(y, x)


def test_values_cross_devices_through_the_core(bridge):
    """A broadcast over four devices is the simulated driver's work (NCCL and peer copies), not torch's."""
    calls = {e: bridge.sim.calls(e) for e in ("ncclBroadcast", "cuMemcpy3DPeerAsync")}
    host = torch.randn(33, 5)
    outs = comm.broadcast(_places.on(host), [0, 1, 2, 3])
    assert all(torch.equal(o.cpu(), host) for o in outs)
    assert bridge.sim.calls("ncclBroadcast") > calls["ncclBroadcast"]
    comm.broadcast(_places.on(host)[:, 1:], [0, 1])  # strided: a copy
    assert bridge.sim.calls("cuMemcpy3DPeerAsync") > calls["cuMemcpy3DPeerAsync"]


def _produced_on_a_side_stream(bridge):
    """A source the caller made on a stream of its own, which stays current: the core must order its copies on it."""
    side = bridge.cuda.stream_on(0, "side@0")
    torch.cuda.set_stream(side)
    return _places.on(torch.randn(8, 3)) * 2, side


def test_a_copy_not_ordered_after_the_sources_write_is_caught(bridge, monkeypatch):
    """The planted bug: the Python layer hands the core the device's default stream rather than the caller's current
    one, so the core's copy reads the source without waiting for the stream that wrote it. The simulator records
    the race; the right streams leave it clean."""
    x, side = _produced_on_a_side_stream(bridge)
    try:
        outs = comm.broadcast(x, [0, 1])
        assert torch.equal(outs[1].cpu(), x.cpu())
        assert _races(bridge)[0] == 0
        y = x * 3
        monkeypatch.setattr(comm, "streams_for", lambda ts: [(d, 0) for d, _ in _core.streams_for(ts)])
        comm.broadcast(y, [0, 1])
        n, text = _races(bridge)
        assert n > 0 and "race" in text, text
    finally:
        torch.cuda.set_stream(bridge.cuda.default_stream(0))
        torch.cuda.synchronize(0)  # the planted read is over before its block goes back to the side stream


def test_a_wait_between_streams_reaches_the_simulator(bridge):
    """stream.wait_stream is the simulator's event wait: a copy on the default stream after the default stream
    waited for the side stream is clean; without that wait it is a race."""
    x, side = _produced_on_a_side_stream(bridge)
    default = bridge.cuda.default_stream(0)
    torch.cuda.set_stream(default)
    default.wait_stream(side)
    comm.broadcast(x, [0, 1])
    assert _races(bridge)[0] == 0
    torch.cuda.set_stream(side)
    y = x + 1
    torch.cuda.set_stream(default)
    comm.broadcast(y, [0, 1])
    assert _races(bridge)[0] > 0
    torch.cuda.synchronize(0)  # the unordered read is over before y's block goes back to the side stream


def test_a_buffer_part_left_unwritten_shows_in_the_result(bridge, monkeypatch):
    """The planted bug: the packed sum of columns spread over devices (a gradient bucket of several replicas) leaves
    the slots of a device that has no tensor for a column unwritten instead of zeroed. Poisoned fresh memory turns the
    sum to NaN; the right code gives torch's sum."""
    hosts = [[torch.randn(4), torch.randn(4)], [torch.randn(3)]]
    columns = [[_places.on(hosts[0][0], 0), _places.on(hosts[0][1], 1)], [_places.on(hosts[1][0], 0)]]
    want = [hosts[0][0] + hosts[0][1], hosts[1][0]]

    def reduce():
        outs = [torch.empty(4, device="cuda:0"), torch.empty(3, device="cuda:0")]
        _core.reduce_columns(columns, outs)
        return [o.cpu() for o in outs]

    assert all(torch.equal(o, w) for o, w in zip(reduce(), want))
    monkeypatch.setattr(torch.Tensor, "zero_", lambda t: t)
    assert reduce()[1].isnan().all()


def test_the_core_writes_what_torch_reads_next_on_the_same_stream(bridge):
    """A result the core wrote is read by the caller's next operation on the same stream: clean, and the values are
    the core's."""
    parts = [_places.on(torch.full((2, 3), float(k)), k) for k in range(4)]
    out = comm.gather(parts, destination=1)
    assert torch.equal((out + 0).cpu(), torch.cat([torch.full((2, 3), float(k)) for k in range(4)]))
    assert _C is not None and _races(bridge)[0] == 0


def test_an_operation_that_writes_an_input_without_saying_so(bridge):
    """native_batch_norm updates the running statistics in place although its schema does not mark them written:
    the bridge writes back whatever an operation changed, so BatchNorm's statistics on a device equal the host's."""
    bn, ref = torch.nn.BatchNorm1d(3), torch.nn.BatchNorm1d(3)
    bn = bn.to(torch.device("cuda", 1))
    x = torch.randn(8, 3) * 3 + 1
    torch.testing.assert_close(bn(_places.on(x, 1)).cpu(), ref(x))
    torch.testing.assert_close(bn.running_mean.cpu(), ref.running_mean)
    torch.testing.assert_close(bn.running_var.cpu(), ref.running_var)


def test_conjugate_and_negative_views(bridge):
    """A conjugate view is one by a bit, as on any device: its values, and complex gradients (which autograd takes
    through conjugate views), equal the host's."""
    w_host = torch.randn(5, dtype=torch.cfloat)
    x_host = torch.randn(3, 5, dtype=torch.cfloat)
    w = _places.on(w_host, 2).requires_grad_()
    x = _places.on(x_host, 2)
    assert w.conj().is_conj() and torch.equal(w.conj().cpu(), w_host.conj())
    (x * w).abs().sum().backward()
    w_ref = w_host.clone().requires_grad_()
    (x_host * w_ref).abs().sum().backward()
    torch.testing.assert_close(w.grad.cpu(), w_ref.grad)


def test_factory_calls_in_other_threads(bridge):
    """Replica workers allocate on their devices too: a factory call naming a CUDA device works in any thread."""
    made = []
    worker = threading.Thread(target=lambda: made.append(torch.empty(4, device="cuda:3")))
    worker.start()
    worker.join()
    assert made and made[0].device == torch.device("cuda", 3) and made[0].cpu().isnan().all()


def test_tied_weights_stay_tied_on_the_device(bridge):
    """A module moved to a simulated device keeps a parameter that two submodules share as one (as a real CUDA move
    does), so that the wrapper sees the tie the host model has."""
    emb = torch.nn.Embedding(10, 4)
    out = torch.nn.Linear(4, 10, bias=False)
    out.weight = emb.weight
    model = torch.nn.Sequential(emb, out)
    want = emb.weight.detach().clone()
    _places.module(model)
    assert model[1].weight is model[0].weight and model[0].weight.is_cuda
    assert len(list(model.parameters())) == 1 and torch.equal(model[0].weight.cpu(), want)


def test_moves_to_a_device_under_inference_mode(bridge):
    """A host tensor moved to a simulated device, and a device tensor "moved" where it is, under inference mode (where
    aten::to is not decomposed before the bridge sees it)."""
    host = torch.arange(6.0).reshape(2, 3)
    with torch.inference_mode():
        moved = host.to(torch.device("cuda", 1), non_blocking=True)
        assert moved.device == torch.device("cuda", 1) and torch.equal(moved.cpu(), host)
        assert moved.to(torch.device("cuda", 1)) is moved


def test_operations_leave_no_garbage(bridge):
    """The bridge's own work for an operation, a view and fresh memory leaves no reference cycle behind, so that a
    test counting garbage (a step's reference cycles) counts fastdp's alone."""
    x = _places.on(torch.randn(4, 3), 1)
    gc.collect()
    gc.disable()  # every cycle made stays until the count below, none collected on the way
    try:
        values, where = torch.max(x.t() * 2, 0)  # a view, a product in fresh memory, a structured result
        assert torch.equal(values.cpu(), (x.cpu().t() * 2).max(0).values) and where.device == x.device
        del values, where
    finally:
        gc.enable()
    assert gc.collect() == 0
