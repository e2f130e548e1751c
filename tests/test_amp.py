"""Mixed precision as users run it: autocast (bf16, fp16) through the wrapper with torch.amp.GradScaler, several
training steps, against the bare model trained on the same full batches. CPU here; the GPU tests run the CUDA
form. The wrapper's replicas compute the same rows as the bare model, but matrix products over a smaller batch
may round differently in low precision, so parameters are compared within a tolerance per dtype."""

import copy

import pytest
import torch
import torch.nn as nn

import fastdp

# Largest parameter difference allowed after STEPS steps, as a fraction of how far training moved the parameters
# (the smallest per-tensor movement), per autocast dtype; measured here: bf16 about 0.045, fp16 about 0.004.
TOLERANCE = {torch.bfloat16: 0.1, torch.float16: 0.02}
STEPS = 5


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _train(model, forward, dtype, batches):
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scales, out_dtypes = [], []
    for x, y in batches:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            out = forward(x)
            out_dtypes.append(out.dtype)
            loss = nn.functional.mse_loss(out.float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, out_dtypes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("replicas", [2, 3])
def test_autocast_with_grad_scaler_matches_the_bare_model(dtype, replicas):
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(12, 16, generator=g), torch.randn(12, 4, generator=g)) for _ in range(STEPS)]
    bare = _model()
    wrapped_model = copy.deepcopy(bare)
    dp = fastdp.DataParallel(wrapped_model, device_ids=["cpu"] * replicas)
    ours = _train(dp, dp, dtype, batches)
    theirs = _train(bare, bare, dtype, batches)
    assert ours[1] == theirs[1] == [dtype] * STEPS  # autocast's dtype reached the replicas
    assert ours[0] == theirs[0]  # the scaler saw the same overflows (none or the same steps)
    worst = max((p - q).abs().max().item() for p, q in zip(wrapped_model.parameters(), bare.parameters()))
    moved = min((p - q).abs().max().item() for p, q in zip(bare.parameters(), _model().parameters()))
    assert moved > 1e-3, moved  # training moved every tensor
    assert worst <= TOLERANCE[dtype] * moved, (worst, moved)
    assert all(p.dtype == torch.float32 for p in wrapped_model.parameters())


def test_scaler_skips_the_step_on_overflow_like_the_bare_model():
    """An inf in the gradients (a huge target): both skip the optimizer step and halve the scale alike."""
    bare = _model()
    wrapped_model = copy.deepcopy(bare)
    dp = fastdp.DataParallel(wrapped_model, device_ids=["cpu"] * 2)
    x = torch.randn(8, 16)
    y = torch.full((8, 4), 3e38)
    ours = _train(dp, dp, torch.float16, [(x, y)])
    theirs = _train(bare, bare, torch.float16, [(x, y)])
    assert ours[0] == theirs[0] and ours[0][0] < 2.0**10
    for p, q in zip(wrapped_model.parameters(), bare.parameters()):
        assert torch.equal(p, q)  # step skipped on both: parameters untouched
