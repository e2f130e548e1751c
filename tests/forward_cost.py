"""What the wrapper's own Python path costs per call: a model too small to measure anything else.

Not a test (nothing is asserted): prints the median over blocks of the time per call, in µs, of a training step
(forward + backward) and of a no_grad forward, for Linear(4, 4) on 2 emulated replicas, batch 8, 1 torch thread.
To compare two trees, install each into its own folder and alternate the runs (docs/benchmarks.md):
    PYTHONPATH=<site folder> python tests/forward_cost.py [--blocks 9] [--calls 300]
"""

import argparse
import statistics
import time

import torch

import fastdp


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=9)
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dp = fastdp.DataParallel(torch.nn.Linear(4, 4), device_ids=["cpu"] * 2)
    x = torch.randn(8, 4)

    def train(n):
        for _ in range(n):
            dp(x).sum().backward()

    def no_grad(n):
        with torch.no_grad():
            for _ in range(n):
                dp(x)

    results = []
    for name, run in (("train", train), ("no_grad", no_grad)):
        run(50)  # warm-up: kept replicas built, worker pool and allocator settled
        blocks = []
        for _ in range(args.blocks):
            t0 = time.perf_counter()
            run(args.calls)
            blocks.append((time.perf_counter() - t0) / args.calls)
        results.append(f"{name} {statistics.median(blocks) * 1e6:.1f}")
    print(" ".join(results), "(µs per call, median of blocks)")


if __name__ == "__main__":
    main()
