"""A stand-in for a library's training loop (as Hugging Face's Trainer does with several GPUs in one process): it
wraps the model in ``torch.nn.DataParallel`` itself, looking the name up when it runs, trains, and unwraps with
``.module`` when the wrapper is a DataParallel. Used by tests/test_patch.py; not a test module itself."""

import torch
import torch.nn.functional as F


def train(model, batches, device_ids=None, lr=0.1):
    wrapped = torch.nn.DataParallel(model, device_ids=device_ids)
    opt = torch.optim.SGD(wrapped.parameters(), lr=lr)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = F.mse_loss(wrapped(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    unwrapped = wrapped.module if isinstance(wrapped, torch.nn.DataParallel) else wrapped
    return wrapped, unwrapped, losses


def functional_forward(model, x, device_ids=None):
    return torch.nn.parallel.data_parallel(model, x, device_ids=device_ids)
