"""What several of the fastdp.DataParallel conformance tests (tests/test_dp_*.py) share: the emulated device
lists, and the containers that inputs and outputs carry through scatter and gather."""

import collections
import dataclasses

import torch


def ids(kind, n):
    """n emulated replicas: distinct "cpu" entries, or CUDA device 0 repeated."""
    return ["cpu"] * n if kind == "cpu" else [0] * n


Point = collections.namedtuple("Point", "x y")


@dataclasses.dataclass
class Box:
    t: torch.Tensor
