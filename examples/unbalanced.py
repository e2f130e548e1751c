"""What ``dp.report()`` shows for replicas of unequal speed, and what ``chunk_sizes="auto"`` does about it.

Four emulated replicas train a small MLP. Each stands for a GPU whose time grows with its rows: its forward sleeps
``--ms-per-row`` for every row of its chunk, and the replica at position 2 is a slower GPU, ``--slower`` times as
long per row. The first run splits the batch evenly, as torch.nn.DataParallel does: the report shows the slow
replica's forward, the others' wait for it, and the advice. The second run trains with ``chunk_sizes="auto"``,
which measures each replica's time per row and moves rows away from the slow one until their times are even. Both
reports are printed, and their pictures written to the folder ``--out`` names (``unbalanced-before.png``,
``unbalanced-after.png``).

Emulated replicas take turns on the host, so a step there lasts as long as all of them together; on GPUs they run
side by side and a step lasts as long as the slowest one: the example prints both.

    python examples/unbalanced.py [--out demo-out] [--steps 12] [--ms-per-row 0.05] [--slower 4]
"""

import argparse
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import fastdp

REPLICAS, SLOW, BATCH = 4, 2, 256
WARMUP = 16  # steps for chunk_sizes="auto" to measure the replicas and settle, before its report records


def make_model(seconds_per_row):
    """The MLP, with a forward hook that sleeps `seconds_per_row[position]` for each row of a replica's chunk."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    calls = [0]

    def device_speed(module, inputs, output):  # emulated replicas run in turn: the k-th call of a step is position k
        time.sleep(seconds_per_row[calls[0] % REPLICAS] * inputs[0].shape[0])
        calls[0] += 1

    model[0].register_forward_hook(device_speed)
    return model


def train(dp, steps):
    opt = torch.optim.SGD(dp.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(BATCH, 64, generator=g), torch.randint(0, 10, (BATCH,), generator=g)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(dp(x), y).backward()
        opt.step()


def show(title, dp, path):
    """Prints the wrapper's report and its split, writes the report's picture to `path`; returns the report."""
    report = dp.report()
    print(f"\n== {title}\n{report}\nsplit of the last forward: {dp.batch_split.chunk_sizes} "
          f"({dp.batch_split.rule})")
    try:
        print("wrote", report.plot(path))
    except ImportError as e:
        print(f"no picture: {e}")
    return report


def slowest_ms(report):
    """The busiest replica's forward plus backward: how long a step's replicas take when they run side by side."""
    return max((r.forward_ms or 0) + (r.backward_ms or 0) for r in report.replicas)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="demo-out", help="folder for the two pictures")
    parser.add_argument("--steps", type=int, default=12, help="steps each report covers")
    parser.add_argument("--ms-per-row", type=float, default=0.05, help="each replica's time per row")
    parser.add_argument("--slower", type=float, default=4.0, help="how many times slower per row replica 2 is")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # steady timings on a machine shared with other jobs
    os.makedirs(args.out, exist_ok=True)
    per_row = [args.ms_per_row / 1e3] * REPLICAS
    per_row[SLOW] *= args.slower

    even = fastdp.DataParallel(make_model(per_row), device_ids=["cpu"] * REPLICAS, report=args.steps)
    train(even, args.steps)
    before = show("an even split (torch.nn.DataParallel's)", even,
                  os.path.join(args.out, "unbalanced-before.png"))

    auto = fastdp.DataParallel(make_model(per_row), device_ids=["cpu"] * REPLICAS, chunk_sizes="auto")
    train(auto, WARMUP)  # "auto" measures and settles; the report then records the split it settled on
    auto.enable_report(steps=args.steps)
    train(auto, args.steps)
    after = show('chunk_sizes="auto", once settled', auto, os.path.join(args.out, "unbalanced-after.png"))

    print(f"\na step with the replicas taking turns (emulated, as here): {before.step_ms:.1f} ms even, "
          f"{after.step_ms:.1f} ms with \"auto\"")
    print(f"a step with the replicas side by side (GPUs: the slowest replica's forward and backward): "
          f"{slowest_ms(before):.1f} ms even, {slowest_ms(after):.1f} ms with \"auto\"")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
