"""Where a contract test puts its tensors. By default on emulated "cpu" devices; in the simulated-device contract run
(tests/sim/contract.py, run by tests/test_sim_contract.py) on simulated CUDA devices, so that the same test bodies
check the Python layer's CUDA paths through the real C core, against the same torch CPU references.

``devices(n)``: a device list of n entries (distinct simulated devices while there are enough, then repeated ids);
``device(d)``: the torch.device of entry d; ``on(x, k)``: the tensors of x (a tensor, or tuples, lists and dicts of them) on the k-th of those devices (same
values, shapes and strides); ``module(m, k)``: m on the k-th (the first by default); ``dest()``: where a sum or a gather goes; ``host(x)``:
x's tensors back on the host, to compare with a reference computed there."""

import torch
from torch.utils._pytree import tree_map

SIM = None  # the simulated devices' bridge (tests/sim/simcuda.py Bridge), set by tests/sim/contract.py


def devices(n):
    return ["cpu"] * n if SIM is None else [k % SIM.sim.ndev for k in range(n)]


def on(x, k=0):
    if SIM is None:
        return x
    return tree_map(lambda t: SIM.tensor(t, k % SIM.sim.ndev) if isinstance(t, torch.Tensor) else t, x)


def module(m, k=0):
    return m if SIM is None else SIM.module(m, k % SIM.sim.ndev)


def device(d):
    """The torch.device of an entry of ``devices(n)``."""
    return torch.device("cuda", d) if isinstance(d, int) else torch.device(d)


def dest():
    return "cpu" if SIM is None else 0


def host(x):
    return tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) and t.is_cuda else t, x)
