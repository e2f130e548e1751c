"""Training equivalence: 5 SGD steps through fastdp.DataParallel on R emulated replicas give the parameters of the
bare module trained on the full batch (float64 within 1e-10, float32 within 1e-5), for R = 1..4 and batches that
R does not divide.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fastdp
from _places import devices, host, module, on

STEPS = 5
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, x):
        return self.net(x)


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 6, 3)
        self.fc = nn.Linear(6 * 2 * 2, 3)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.relu(self.conv2(x))
        return self.fc(x.flatten(1))


class KwargsNested(nn.Module):
    """Takes positional, keyword and nested inputs and returns a dict holding a tuple and a list."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(6, 8)
        self.gate = nn.Linear(4, 8)
        self.head = nn.Linear(8, 3)
        self.aux = nn.Linear(8, 2)

    def forward(self, x, pair, *, mask=None, scale=1.0):
        a, (b,) = pair
        h = torch.tanh(self.enc(x) + self.gate(a * b))
        if mask is not None:
            h = h * mask
        return {"logits": (self.head(h) * scale,), "aux": [self.aux(h), h.mean(1, keepdim=True)]}


def _batch(model_cls, n, dtype, gen):
    def r(*shape):
        return torch.randn(*shape, dtype=dtype, generator=gen)

    if model_cls is SmallCNN:
        return (r(n, 2, 8, 8),), {}
    if model_cls is KwargsNested:
        mask = (torch.rand(n, 8, generator=gen) > 0.2).to(dtype)
        return (r(n, 6), (r(n, 4), (r(n, 4),))), {"mask": mask, "scale": 0.5}
    return (r(n, 6),), {}


def _loss(out, target):
    if isinstance(out, dict):
        return F.mse_loss(out["logits"][0], target) + out["aux"][0].pow(2).mean() + out["aux"][1].abs().mean()
    return F.mse_loss(out, target)


def _train(model, batches):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for args, kwargs, target in batches:
        opt.zero_grad()
        _loss(model(*args, **kwargs), target).backward()
        opt.step()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("model_cls", [MLP, SmallCNN, KwargsNested])
@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
def test_sgd_steps_match_full_batch(model_cls, replicas, dtype):
    torch.manual_seed(1234)
    bare = model_cls().to(dtype)
    wrapped_module = copy.deepcopy(bare)
    gen = torch.Generator().manual_seed(replicas)
    batches = []
    for step in range(STEPS):
        n = replicas * (2 + step) + 1  # R > 1 never divides it; the chunk rule may leave a replica idle
        args, kwargs = _batch(model_cls, n, dtype, gen)
        batches.append((args, kwargs, torch.randn(n, 3, dtype=dtype, generator=gen)))
    _train(bare, batches)
    wrapped_module = module(wrapped_module)
    _train(fastdp.DataParallel(wrapped_module, device_ids=devices(replicas)), on(batches))
    for (name, p), q in zip(bare.named_parameters(), wrapped_module.parameters()):
        torch.testing.assert_close(host(q), p, rtol=0, atol=TOL[dtype], msg=lambda m: f"{name}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_sgd_steps_match_full_batch_cuda(replicas):
    torch.manual_seed(0)
    bare = MLP().double().cuda()
    wrapped_module = copy.deepcopy(bare)
    gen = torch.Generator().manual_seed(0)
    batches = []
    for step in range(STEPS):
        n = replicas * (2 + step) + 1
        x = torch.randn(n, 6, dtype=torch.float64, generator=gen).cuda()
        batches.append(((x,), {}, torch.randn(n, 3, dtype=torch.float64, generator=gen).cuda()))
    _train(bare, batches)
    _train(fastdp.DataParallel(wrapped_module, device_ids=[0] * replicas), batches)
    for p, q in zip(bare.parameters(), wrapped_module.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-10)
