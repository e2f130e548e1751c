"""The model, data and injections the tests of ``dp.report()`` and of rebalancing share (tests/test_report_*.py,
test_rebalance.py, test_rescue_contract.py): a float64 MLP (and one with a BatchNorm), seeded batches, a sleep
injected in one replica's forward, and a training loop."""

import time

import torch
import torch.nn as nn
import torch.nn.functional as F


SLEEP = 0.02


def mlp(seed=0, width=32):
    torch.manual_seed(seed)
    layers = [nn.Linear(8, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 3)]
    return nn.Sequential(*layers).double()


def bn_model(seed=0, momentum=0.1):
    """The MLP's shape with a BatchNorm (running statistics, num_batches_tracked) after its first layer."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16, momentum=momentum), nn.Tanh(),
                         nn.Linear(16, 3)).double()


def data(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)


def sleep_in_forward(model, position, replicas, seconds=SLEEP):
    """Emulated replicas run one after another in the calling thread: the k-th call of a step is position k."""
    calls = [0]

    def hook(module, inputs, output):
        if calls[0] % replicas == position:
            time.sleep(seconds)
        calls[0] += 1

    return model[0].register_forward_hook(hook)


def train(dp, steps, n=24, seed=1, opt=None):
    for s in range(steps):
        x, y = data(n, seed + s)
        if opt is not None:
            opt.zero_grad()
        F.cross_entropy(dp(x), y).backward()
        if opt is not None:
            opt.step()
