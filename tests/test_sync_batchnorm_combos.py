"""SyncBatchNorm with what real training code combines it with: mixed precision (autocast), quantization-aware training
(fused convolution, BatchNorm and ReLU modules with fake quantization) and reentrant activation checkpointing. Each
combination trains as the bare model's BatchNorm on the full batch under the same setting."""

import copy

import pytest
import torch
import torch.nn as nn

import fastdp


def _close(got, expected, tol, what):
    assert got.dtype == expected.dtype, f"{what}: {got.dtype}, the bare model's {expected.dtype}"
    err = (got.double() - expected.double()).abs().max().item() if got.numel() else 0.0
    assert err <= tol * max(1.0, expected.double().abs().max().item()), f"{what}: max error {err}"


# ---- autocast -------------------------------------------------------------------------------------------------------


class Stack(nn.Module):
    """BatchNorm on the raw float32 images first, then convolutions that autocast runs in low precision, each
    followed by a BatchNorm (one without affine parameters): the layers after a BatchNorm run in the dtype it
    returns."""

    def __init__(self):
        super().__init__()
        self.raw = nn.BatchNorm2d(3)
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8, affine=False)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(self.raw(x))))
        h = torch.tanh(self.bn2(self.conv2(h)))
        return self.head(h.mean((2, 3)))


def _output_dtypes(model):
    """The output dtypes of every BatchNorm call, by layer (its width and whether it is affine tell the layers of
    Stack apart; the wrapper's replicas mirror the master's hooks)."""
    seen = []
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.register_forward_hook(lambda mod, args, out: seen.append(((mod.num_features, mod.affine), out.dtype)))
    return seen


# Largest difference from the bare model, relative to the largest value, per autocast dtype: about one rounding step
# of the dtype (each replica's convolution runs on fewer rows than the bare model's, which may round differently in
# low precision), ten times what was measured here.
AUTOCAST_TOL = {torch.bfloat16: 4e-3, torch.float16: 5e-4}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_autocast_synced_layers_return_batch_norms_dtype(dtype):
    # batch_norm has no autocast rule on CPU or CUDA: it runs in its input's dtype (float32 statistics and
    # parameters with a low-precision input give a low-precision output), and so must every synced layer.
    torch.manual_seed(0)
    bare = Stack()
    synced = fastdp.convert_sync_batchnorm(copy.deepcopy(bare))
    dp = fastdp.DataParallel(synced, device_ids=["cpu"] * 3, chunk_sizes=[3, 5, 4])
    dtypes_bare, dtypes_synced = _output_dtypes(bare), _output_dtypes(synced)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (bare, synced)]
    gen = torch.Generator().manual_seed(1)
    tol = AUTOCAST_TOL[dtype]
    for step in range(2):
        x = torch.randn(12, 3, 6, 6, generator=gen)
        dtypes_bare.clear()
        dtypes_synced.clear()
        with torch.autocast("cpu", dtype=dtype):
            yb, yd = bare(x), dp(x)
        assert [t for _, t in dtypes_bare] == [torch.float32, dtype, dtype], dtypes_bare
        assert sorted(dtypes_synced, key=str) == sorted(dtypes_bare * 3, key=str), dtypes_synced
        _close(yd, yb, tol, f"step {step} output")
        yb.float().square().mean().backward()
        yd.float().square().mean().backward()
        for (name, pb), pd in zip(bare.named_parameters(), synced.parameters()):
            _close(pd.grad, pb.grad, tol, f"step {step} grad of {name}")
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for (name, bb), bd in zip(bare.named_buffers(), synced.buffers()):
            if bb.is_floating_point():
                _close(bd, bb, tol, f"step {step} buffer {name}")
            else:
                assert torch.equal(bd, bb), name
