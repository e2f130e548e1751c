"""What the wrapper keeps between steps stays invisible: whatever a training script does between and inside steps,
the wrapped model gives the bare model's gradients, parameters, buffers and saved bytes (docs/step-state.md).

Each test runs the same script on the bare model (full batch) and on the wrapper (4 emulated replicas) and compares.
"""

import copy
import io
import pickle
import time

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import fastdp

pytestmark = [
    pytest.mark.usefixtures("cpu_apply"),
    # A reentrant checkpoint in a forward without grad warns, on the bare model as on the wrapper.
    pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True"),
]

R = 4
TOL = 1e-12


class EvalScale(nn.Module):
    """Halves its input in eval mode: a deterministic layer whose result depends on the training flag."""

    def forward(self, x):
        return x if self.training else 0.5 * x


class Checkpointed(nn.Module):
    """An MLP whose middle block is recomputed in backward (torch.utils.checkpoint), then a head."""

    def __init__(self, reentrant=False, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.stem = nn.Linear(6, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Tanh(), EvalScale(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 3)
        self.reentrant = reentrant
        self.double()

    def forward(self, x):
        h = torch.tanh(self.stem(x))
        # Recomputed in backward: what it reads of the replica then (training flags, parameters) must be what this
        # forward read.
        h = checkpoint(self.block, h, use_reentrant=self.reentrant)
        return self.head(h)


class Gated(nn.Module):
    """An MLP whose middle layer applies to the samples whose first value is positive and is skipped by a batch
    without any: a replica whose chunk has none leaves that layer without a gradient while another uses it, and
    the full batch gets the same result."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.a, self.b, self.c = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.double()

    def forward(self, x):
        h = torch.tanh(self.a(x))
        gate = x[:, :1] > 0
        if gate.any():
            h = torch.where(gate, torch.tanh(self.b(h)), h)
        return self.c(h)


def batch(n, seed):
    return torch.randn(n, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def loss_of(model, x):
    return model(x).pow(2).sum()


def pair(make):
    bare = make()
    dp = fastdp.DataParallel(copy.deepcopy(bare), device_ids=["cpu"] * R)
    return bare, dp


def assert_same(bare, dp, tol=TOL):
    """Same .grad (None where None), parameters and buffers."""
    model = dp.module
    for (name, p), q in zip(model.named_parameters(), bare.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=tol, atol=tol, msg=name)
        torch.testing.assert_close(p.detach(), q.detach(), rtol=tol, atol=tol, msg=name)
    for b, c in zip(model.buffers(), bare.buffers()):
        torch.testing.assert_close(b, c, rtol=tol, atol=tol)


# ---- forwards between a training forward and its backward ------------------------------------------------------


def _between(model, kind, x):
    """A forward of another kind, as an evaluation, EMA/teacher pass or a discriminator scored without grad does."""
    training = model.training  # put back after an eval() pass, as a script does before it backwards
    if kind == "no_grad":
        with torch.no_grad():
            model(x)
    elif kind == "eval_no_grad":
        model.eval()
        with torch.no_grad():
            model(x)
        model.train(training)
    elif kind == "inference_mode":
        with torch.inference_mode():
            model(x)
    elif kind == "eval_with_grad":  # validation without no_grad: a graph built and dropped
        model.eval()
        model(x).sum()
        model.train(training)
    elif kind == "training_forward":  # another training forward, its loss never backwarded
        model(x)
    else:
        raise AssertionError(kind)


KINDS = ["no_grad", "eval_no_grad", "inference_mode", "eval_with_grad", "training_forward"]


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("between_size", [8, 3])  # all replicas, or fewer chunks than replicas
def test_a_forward_between_a_training_forward_and_its_backward(reentrant, kind, between_size):
    bare, dp = pair(lambda: Checkpointed(reentrant))
    inputs = []
    for model in (bare, dp):
        x = batch(8, 1).requires_grad_()  # the reentrant checkpoint needs an input that requires grad
        for step in range(2):
            loss = loss_of(model, x)
            _between(model, kind, batch(between_size, 2 + step))
            loss.backward()
        inputs.append(x.grad)
    assert_same(bare, dp)
    torch.testing.assert_close(inputs[1], inputs[0], rtol=TOL, atol=TOL)


@pytest.mark.parametrize("kind", KINDS)
def test_two_pending_graphs_across_kinds(kind):
    """Two training forwards pending at once, with a forward of another kind between them; backwarded in the
    reverse order."""
    bare, dp = pair(Checkpointed)
    for model in (bare, dp):
        first = loss_of(model, batch(8, 1))
        _between(model, kind, batch(8, 2))
        second = loss_of(model, batch(6, 3))
        second.backward()
        first.backward()
    assert_same(bare, dp)


# ---- clearing .grad discards what no_sync() accumulated ------------------------------------------------------------


def _clear(model, opt, how):
    if how == "optimizer_none":
        opt.zero_grad()
    elif how == "optimizer_zeros":
        opt.zero_grad(set_to_none=False)
    elif how == "module_zeros":
        model.zero_grad(set_to_none=False)
    elif how == "module_none":
        model.zero_grad()
    elif how == "assign_none":
        for p in model.parameters():
            p.grad = None
    elif how == "new_optimizer":
        torch.optim.SGD(model.parameters(), lr=0.1).zero_grad()
    else:
        raise AssertionError(how)


CLEARS = ["optimizer_none", "optimizer_zeros", "module_zeros", "module_none", "assign_none", "new_optimizer"]


@pytest.mark.parametrize("how", CLEARS)
@pytest.mark.parametrize("make", [Checkpointed, Gated])
def test_zero_grad_discards_an_abandoned_no_sync_micro_batch(how, make):
    """A micro-batch accumulated under no_sync, abandoned by clearing .grad (a skipped step), never reaches a later
    step's .grad; the kept micro-batch after the clear does."""
    bare, dp = pair(make)
    xs = [batch(8, s) for s in range(3)]
    xs[1][:2, 0] = -xs[1][:2, 0].abs()  # Gated: replica 0 skips the middle layer in the second micro-batch
    xs[1][2:, 0] = xs[1][2:, 0].abs()  # and the others use it
    for model, run in ((bare, bare), (dp.module, dp)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with dp.no_sync():
            loss_of(run, xs[0]).backward()
        _clear(model, opt, how)
        with dp.no_sync():
            loss_of(run, xs[1]).backward()
        loss_of(run, xs[2]).backward()  # synchronising
    assert_same(bare, dp)


@pytest.mark.parametrize("how", CLEARS)
def test_zero_grad_then_a_synchronising_backward(how):
    bare, dp = pair(Checkpointed)
    for model, run in ((bare, bare), (dp.module, dp)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            with dp.no_sync():
                loss_of(run, batch(8, 0)).backward()
                loss_of(run, batch(5, 1)).backward()
            _clear(model, opt, how)
            loss_of(run, batch(8, 2)).backward()
            opt.step()
    assert_same(bare, dp, tol=1e-10)


def test_one_parameter_cleared_keeps_the_others():
    bare, dp = pair(Checkpointed)
    for model, run in ((bare, bare), (dp.module, dp)):
        with dp.no_sync():
            loss_of(run, batch(8, 0)).backward()
        model.head.weight.grad = None
        model.stem.bias.grad.zero_()
        loss_of(run, batch(8, 1)).backward()
    assert_same(bare, dp)


def test_no_sync_grad_shows_replica_0s_share():
    """Between no_sync backwards .grad holds replica 0's own accumulation, as a DDP rank's .grad holds its own."""
    bare, dp = pair(Checkpointed)
    xs = [batch(8, 0), batch(7, 1)]
    with dp.no_sync():
        for x in xs:
            loss_of(dp, x).backward()
            loss_of(bare, x.chunk(R)[0]).backward()
    assert_same(bare, dp)


def test_grad_changed_in_place_under_no_sync_raises():
    """A change to .grad other than clearing it cannot be applied to the other replicas' kept sums: an error
    naming the parameter, never a silent difference."""
    _, dp = pair(Checkpointed)
    with dp.no_sync():
        loss_of(dp, batch(8, 0)).backward()
    dp.module.head.weight.grad.mul_(0.5)
    with pytest.raises(RuntimeError, match=r"\.grad of parameter 'head\.weight' was changed in place while"):
        loss_of(dp, batch(8, 1)).backward()


# ---- no_sync with micro-batches of any size --------------------------------------------------------------------


@pytest.mark.parametrize("sizes", [(8, 5, 8), (8, 8, 2), (3, 8, 8), (1, 8), (2, 3, 1, 8), (8, 2)])
@pytest.mark.parametrize("make", [Checkpointed, Gated])
def test_no_sync_micro_batches_of_any_size(sizes, make):
    """A small micro-batch uses fewer replicas (torch.chunk's rule); whatever each replica received is kept."""
    bare, dp = pair(make)
    for model, run in ((bare, bare), (dp.module, dp)):
        for step in range(2):
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            with dp.no_sync():
                for i, n in enumerate(sizes[:-1]):
                    loss_of(run, batch(n, 10 * step + i)).backward()
            loss_of(run, batch(sizes[-1], 10 * step + 9)).backward()
            opt.step()
            opt.zero_grad()
            loss_of(run, batch(sizes[0], 99)).backward()  # and plain steps after, with the same replicas
    assert_same(bare, dp, tol=1e-10)


def test_no_sync_with_chunk_sizes_that_skip_devices():
    bare = Checkpointed()
    dp = fastdp.DataParallel(copy.deepcopy(bare), device_ids=["cpu"] * R, chunk_sizes=[0.0, 3.0, 0.0, 5.0])
    for model, run in ((bare, bare), (dp.module, dp)):
        with dp.no_sync():
            loss_of(run, batch(8, 0)).backward()
            loss_of(run, batch(2, 1)).backward()
        loss_of(run, batch(8, 2)).backward()
    assert_same(bare, dp)


def test_fewer_chunks_reuse_the_kept_replicas():
    """A short batch runs on some of the kept replicas: nothing is rebuilt."""
    _, dp = pair(Checkpointed)
    loss_of(dp, batch(8, 0)).backward()
    kept = dp._replica_set
    for n in (3, 1, 8, 2):
        loss_of(dp, batch(n, n)).backward()
        assert dp._replica_set is kept


# ---- serialising the wrapped model ---------------------------------------------------------------------------------


def _stack(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(20)], nn.BatchNorm1d(64))


def _trained_pair():
    bare, dp = pair(_stack)
    for model in (bare, dp):  # eval: BatchNorm's running statistics (saved buffers) stay the bare model's
        model.eval()
        model(torch.randn(8, 64, generator=torch.Generator().manual_seed(0))).sum().backward()
    return bare, dp


def _pickled(obj):
    return pickle.dumps(obj)


def _torch_saved(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _equal_tensors(a, b):
    if isinstance(a, dict):
        assert sorted(a) == sorted(b)
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    else:
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("route", ["pickle", "torch.save"])
@pytest.mark.parametrize("what", ["state_dict", "parameter", "module_state"])
def test_serialised_bytes_equal_the_bare_models(route, what):
    """At most 1.1x the bare model's bytes, and loads back equal."""
    bare, dp = _trained_pair()
    pick = {
        "state_dict": lambda b, d: (b.state_dict(), d.state_dict()),
        "parameter": lambda b, d: (b[3].weight, d.module[3].weight),
        "module_state": lambda b, d: (b.state_dict(), d.module.state_dict()),
    }[what]
    ours, theirs = pick(bare, dp)
    dump = _pickled if route == "pickle" else _torch_saved
    load = pickle.loads if route == "pickle" else (lambda data: torch.load(io.BytesIO(data), weights_only=False))
    mine, reference = dump(theirs), dump(ours)
    assert len(mine) <= 1.1 * len(reference), (len(mine), len(reference))
    _equal_tensors(load(mine), ours)


def test_pickled_and_deep_copied_wrapper():
    bare, dp = _trained_pair()
    for clone in (pickle.loads(pickle.dumps(dp)), copy.deepcopy(dp)):
        _equal_tensors(clone.state_dict(), bare.state_dict())
    assert len(pickle.dumps(dp)) <= 1.1 * len(pickle.dumps(bare))
    assert len(_torch_saved(dp)) <= 1.1 * len(_torch_saved(bare))


def test_safetensors_routes(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    bare, dp = _trained_pair()
    safetensors.save_model(dp.module, str(tmp_path / "dp.safetensors"))
    safetensors.save_model(bare, str(tmp_path / "bare.safetensors"))
    size = (tmp_path / "dp.safetensors").stat().st_size
    assert size <= 1.1 * (tmp_path / "bare.safetensors").stat().st_size
    fresh = _stack(seed=1)
    safetensors.load_model(fresh, str(tmp_path / "dp.safetensors"))
    _equal_tensors(fresh.state_dict(), bare.state_dict())
    safetensors.save_file(dp.state_dict(), str(tmp_path / "sd.safetensors"))
    _equal_tensors(safetensors.load_file(str(tmp_path / "sd.safetensors")), bare.state_dict())
    # Loading into the wrapped model in place, then training on: still the bare model.
    safetensors.load_model(dp.module, str(tmp_path / "bare.safetensors"))
    for model in (bare, dp):
        model(torch.randn(8, 64, generator=torch.Generator().manual_seed(5))).sum().backward()
    for p, q in zip(dp.module.parameters(), bare.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5)  # float32 sums in another order


def test_save_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=99, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    bare = transformers.GPT2LMHeadModel(cfg)
    dp = fastdp.DataParallel(copy.deepcopy(bare), device_ids=["cpu"] * R)
    ids = torch.randint(0, 99, (8, 7), generator=torch.Generator().manual_seed(0))
    dp(input_ids=ids, labels=ids).loss.sum().backward()
    dp.module.save_pretrained(tmp_path / "dp")
    bare.save_pretrained(tmp_path / "bare")
    size = sum(f.stat().st_size for f in (tmp_path / "dp").iterdir())
    assert size <= 1.1 * sum(f.stat().st_size for f in (tmp_path / "bare").iterdir())
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "dp")
    _equal_tensors(loaded.state_dict(), bare.state_dict())


# ---- the process forked after training steps -----------------------------------------------------------------------


def test_forked_child_trains_like_the_bare_model():
    """A child forked after steps (a DataLoader worker, multiprocessing with fork) has the parent's kept replicas
    and worker pool in memory, its threads gone: a step there still equals the bare model's."""
    import os
    import signal

    bare, dp = pair(Checkpointed)
    for model in (bare, dp):
        loss_of(model, batch(8, 0)).backward()
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 when equal, 1 otherwise; an alarm ends it if anything hangs
        code = 1
        try:
            signal.alarm(60)
            # As DataLoader workers do: torch's OpenMP pool is not usable after a fork (the bare model hangs too).
            torch.set_num_threads(1)
            for model in (bare, dp):
                with dp.no_sync():
                    loss_of(model, batch(5, 1)).backward()
                loss_of(model, batch(8, 2)).backward()
            assert_same(bare, dp)
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + 120
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child did not finish within 120 s")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0
    loss_of(dp, batch(8, 3)).backward()  # and the parent carries on
    loss_of(bare, batch(8, 3)).backward()
    assert_same(bare, dp)


@pytest.mark.parametrize("path", ["python", "aoti"])
def test_zeroing_one_grad_in_place_keeps_the_others_sums(path):
    """Reduced gradients are separate tensors over one flat result, each with its own version counter on either
    tensor path: zeroing one parameter's .grad between no_sync micro-batches clears that one only (torch's views
    share one counter, which made the others look changed in place)."""
    from fastdp import _C
    from fastdp._native import core as _core

    if path == "aoti" and not _core.tensor_shim_usable():
        pytest.skip("this torch has no C shim path")
    previous = _C.set_tensor_path(path)
    try:
        bare, dp = pair(Checkpointed)
        for model, run in ((bare, bare), (dp.module, dp)):
            loss_of(run, batch(8, 0)).backward()  # synchronising: .grad cut from one flat result
            with dp.no_sync():
                loss_of(run, batch(8, 1)).backward()
            model.head.weight.grad.zero_()
            loss_of(run, batch(8, 2)).backward()
        assert_same(bare, dp)
    finally:
        _C.set_tensor_path(previous)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copied_inside_an_accumulation_window(how):
    """A wrapper copied (or pickled and loaded) between no_sync micro-batches: the copy and the original each end
    the window with the bare model's .grad, as a copy of the bare model would (a copy has no .grad, and none of
    the original's kept sums)."""
    bare, dp = pair(Checkpointed)
    for model, run in ((bare, bare), (dp.module, dp)):
        with dp.no_sync():
            loss_of(run, batch(8, 0)).backward()
    copies = [copy.deepcopy(m) if how == "deepcopy" else pickle.loads(pickle.dumps(m)) for m in (bare, dp)]
    for (b, d) in ((bare, dp), tuple(copies)):
        for model, run in ((b, b), (d.module, d)):
            with d.no_sync():
                loss_of(run, batch(5, 1)).backward()
            loss_of(run, batch(8, 2)).backward()
        assert_same(b, d)


def test_device_ids_shortened_between_steps():
    """device_ids set to fewer devices after steps ran on more: the kept replicas are rebuilt for the new list."""
    bare, dp = pair(Checkpointed)
    for model in (bare, dp):
        loss_of(model, batch(8, 0)).backward()
    dp.device_ids = ["cpu"] * 2
    for model in (bare, dp):
        loss_of(model, batch(8, 1)).backward()
        loss_of(model, batch(1, 2)).backward()
    assert_same(bare, dp)


@pytest.mark.parametrize("clear", [True, False])
def test_an_interrupted_no_sync_backward_then_a_fresh_window(clear):
    """A no_sync backward that fails after the wrapper's reduction nodes ran (a hook on a master parameter raises,
    as Ctrl-C could land there), then .grad cleared and a new accumulation window: the bare model's .grad."""
    bare, dp = pair(Checkpointed)
    armed = []

    def hook(p):
        if armed:
            armed.clear()
            raise KeyboardInterrupt("interrupted backward (test)")

    for model, run in ((bare, bare), (dp.module, dp)):
        model.stem.weight.register_post_accumulate_grad_hook(hook)
        with dp.no_sync():
            loss_of(run, batch(8, 0)).backward()
            armed.append(True)
            with pytest.raises(KeyboardInterrupt):
                loss_of(run, batch(8, 1)).backward()
        if clear:
            model.zero_grad()
        with dp.no_sync():
            loss_of(run, batch(8, 2)).backward()
            loss_of(run, batch(8, 3)).backward()
        loss_of(run, batch(8, 4)).backward()
    if clear:
        assert_same(bare, dp)
    else:  # what the failed backward accumulated before failing differs by where it failed: only no error here
        assert all(p.grad is not None for p in dp.module.parameters())
