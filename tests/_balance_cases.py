"""The model and batches the tests of the batch split, the per-replica loss and device 0's memory share
(tests/test_chunk_sizes.py, test_replica_loss.py, test_memory_balance.py): ``R`` emulated replicas, a model with
positional, nested and keyword inputs that records the batch size each call sees, and float64 batches for it."""

import torch
import torch.nn as nn


R = 3
STEPS = 5


class Net(nn.Module):
    """Positional, nested and keyword inputs; records the batch size of every input each call sees."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(6, 8)
        self.gate = nn.Linear(4, 8)
        self.head = nn.Linear(8, 3)
        self.seen = []

    def forward(self, x, pair=None, *, mask=None, scale=1.0):
        h = self.enc(x)
        sizes = [x.shape[0]]
        if pair is not None:
            a, (b,) = pair
            h = h + self.gate(a * b)
            sizes += [a.shape[0], b.shape[0]]
        if mask is not None:
            h = h * mask
            sizes.append(mask.shape[0])
        self.seen.append(sizes)
        return self.head(torch.tanh(h)) * scale


def net(seed=0):
    torch.manual_seed(seed)
    return Net().double()


def batch(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    a = torch.randn(n, 4, generator=g, dtype=torch.float64)
    b = torch.randn(n, 4, generator=g, dtype=torch.float64)
    mask = (torch.rand(n, 8, generator=g) > 0.2).double()
    y = torch.randint(0, 3, (n,), generator=g)
    return x, (a, (b,)), mask, y


def batch_of(n):
    return torch.randn(n, 6, dtype=torch.float64)
