"""fastdp.patch(): a library's own call of torch.nn.DataParallel builds fastdp's wrapper, trains exactly as the
bare model does, and unwraps; unpatch() and the context form put torch's names back."""

import copy
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import fastdp

import _thirdparty_trainer as trainer

dp_module = sys.modules["torch.nn.parallel.data_parallel"]  # the attribute of that name is the function

def _names():
    return {
        "nn.DataParallel": torch.nn.DataParallel,
        "parallel.DataParallel": torch.nn.parallel.DataParallel,
        "parallel.data_parallel": torch.nn.parallel.data_parallel,
        "module.DataParallel": dp_module.DataParallel,
        "module.data_parallel": dp_module.data_parallel,
    }


UPSTREAM = _names()


@pytest.fixture(autouse=True)
def _restore():
    yield
    fastdp.unpatch()
    assert _names() == UPSTREAM


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _batches(steps=5):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randn(8, 3, generator=g, dtype=torch.float64))
            for _ in range(steps)]


def _bare_training(model, batches, lr=0.1):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_every_name_resolves_to_fastdp_while_patched():
    fastdp.patch()
    assert fastdp.is_patched()
    assert torch.nn.DataParallel is fastdp.DataParallel
    assert torch.nn.parallel.DataParallel is fastdp.DataParallel
    assert dp_module.DataParallel is fastdp.DataParallel
    assert torch.nn.parallel.data_parallel is fastdp.data_parallel
    assert dp_module.data_parallel is fastdp.data_parallel
    fastdp.patch()  # twice: still one saved set of upstream names
    fastdp.unpatch()
    assert not fastdp.is_patched() and _names() == UPSTREAM
    fastdp.unpatch()  # not patched: nothing happens
    assert _names() == UPSTREAM


@pytest.mark.parametrize("device_ids", [["cpu"] * 2, ["cpu"] * 3, None])
def test_library_training_loop_gets_fastdp_and_matches_the_bare_model(device_ids):
    """The library's loop, unedited: fastdp's wrapper (emulated replicas accepted where upstream refuses "cpu"),
    isinstance(.., torch.nn.DataParallel) true so .module unwraps, parameters and losses equal to the bare
    model trained on the same batches (float64; summed replica gradients equal the full-batch gradient)."""
    model, reference = _model(), _model()
    batches = _batches()
    with fastdp.patched():
        wrapped, unwrapped, losses = trainer.train(model, batches, device_ids=device_ids)
        assert isinstance(wrapped, torch.nn.DataParallel)
    assert type(wrapped) is fastdp.DataParallel
    assert unwrapped is model
    expected = _bare_training(reference, batches)
    assert losses == pytest.approx(expected, rel=1e-12, abs=1e-12)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12, msg=name)
    assert list(wrapped.state_dict()) == list(reference.state_dict())  # no "module." prefix


def test_functional_form_and_context_restores():
    model = _model()
    x = torch.randn(8, 6, dtype=torch.float64)
    with fastdp.patched():
        out = trainer.functional_forward(model, x, device_ids=["cpu"] * 2)
    assert _names() == UPSTREAM
    torch.testing.assert_close(out, model(x), rtol=1e-12, atol=1e-12)
    with pytest.raises(Exception):  # upstream's own function refuses "cpu" device ids again
        trainer.functional_forward(model, x, device_ids=["cpu"] * 2)


def test_context_inside_a_patch_leaves_it_patched():
    fastdp.patch()
    with fastdp.patched():
        assert torch.nn.DataParallel is fastdp.DataParallel
    assert fastdp.is_patched() and torch.nn.DataParallel is fastdp.DataParallel


def test_context_restores_after_an_exception():
    with pytest.raises(RuntimeError, match="^inside$"):
        with fastdp.patched():
            raise RuntimeError("inside")
    assert _names() == UPSTREAM


def test_upstream_wrappers_made_before_the_patch_keep_working():
    model = _model()
    upstream = torch.nn.DataParallel(copy.deepcopy(model))
    x = torch.randn(4, 6, dtype=torch.float64)
    with fastdp.patched():
        torch.testing.assert_close(upstream(x), model(x))
        assert not isinstance(upstream, torch.nn.DataParallel)  # the name is fastdp's class while patched
    assert isinstance(upstream, torch.nn.DataParallel)


def test_patch_in_a_fresh_process_before_the_library_is_imported():
    """The documented recipe: patch first, then import and run code that calls torch.nn.DataParallel."""
    code = (
        "import fastdp, torch\n"
        "fastdp.patch()\n"
        "import _thirdparty_trainer as t\n"
        "m = torch.nn.Linear(4, 2).double()\n"
        "w, u, losses = t.train(m, [(torch.ones(4, 4, dtype=torch.float64), torch.zeros(4, 2, dtype=torch.float64))],"
        " device_ids=['cpu'] * 2)\n"
        "print(type(w).__module__, u is m)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=__import__("os").path.dirname(__file__))
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["fastdp.data_parallel", "True"]
