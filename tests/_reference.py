"""The reference the emulated-replica tests of balancing and of the report hold fastdp to: the bare model's
parameters, float64, within ``TOL``."""

import torch


TOL = 1e-10


def params_close(a, b, tol=TOL):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=tol, msg=name)
