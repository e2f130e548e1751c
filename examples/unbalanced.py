"""What ``dp.report()`` shows for an unbalanced run, and what ``chunk_sizes="auto"`` does about it.

Four emulated replicas train a small MLP; the replica at position 2 stands for a slower GPU (its forward sleeps
``--sleep-ms``). The first run prints the report (the slow replica's forward, the others' wait, the advice) and
draws its picture; the second run trains with ``chunk_sizes="auto"``, which moves rows away from the slow replica.

    python examples/unbalanced.py [--out demo-out] [--steps 12] [--sleep-ms 20]
"""

import argparse
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import fastdp

REPLICAS, SLOW = 4, 2


def make_model(slow_s):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    calls = [0]

    def slower_gpu(module, inputs, output):  # emulated replicas run in turn: the k-th call of a step is position k
        if calls[0] % REPLICAS == SLOW:
            time.sleep(slow_s)
        calls[0] += 1

    model[0].register_forward_hook(slower_gpu)
    return model


def train(dp, steps, batch=256):
    opt = torch.optim.SGD(dp.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(batch, 64, generator=g), torch.randint(0, 10, (batch,), generator=g)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(dp(x), y).backward()
        opt.step()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="demo-out")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--sleep-ms", type=float, default=20.0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)

    dp = fastdp.DataParallel(make_model(args.sleep_ms / 1e3), device_ids=["cpu"] * REPLICAS, report=True)
    train(dp, args.steps)
    report = dp.report()
    print(report)
    try:
        print("wrote", report.plot(os.path.join(args.out, "unbalanced.png")))
    except ImportError as e:
        print(f"no picture: {e}")

    print('\nThe same run with chunk_sizes="auto":')
    dp = fastdp.DataParallel(make_model(args.sleep_ms / 1e3), device_ids=["cpu"] * REPLICAS, chunk_sizes="auto",
                             report=True)
    train(dp, args.steps)
    print(f"split after {args.steps} steps: {dp._last_step.chunk_sizes} ({dp._split.describe()})")
    report = dp.report(steps=4)
    print(report.headline())
    print("advice:", [a.text for a in report.advice] or "none")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
