"""``python -m fastdp.bench one-device``: what the wrapper adds to a forward (+ backward) on one device.

``fastdp.DataParallel(nn.Linear(16, 4), device_ids=["cpu"])`` at batch 8 takes the short path (the module runs on
the inputs as they are), so the difference from the bare model is the wrapper's own Python work per call. Both run
in alternating blocks of ``--calls`` steps in this thread's CPU time (``time.thread_time_ns``: other processes' load
on a shared machine does not stretch it); the medians over blocks, and the median of the paired differences, are
printed in µs per step.
"""

import statistics
import time

import torch

from .. import DataParallel


def _block(step, calls):
    began = time.thread_time_ns()
    for _ in range(calls):
        step()
    return (time.thread_time_ns() - began) / calls / 1e3


def measure(blocks, calls, backward=True):
    """(bare µs, wrapper µs, median of the paired differences µs) per step."""
    torch.manual_seed(0)
    bare = torch.nn.Linear(16, 4)
    dp = DataParallel(bare, device_ids=["cpu"])
    x = torch.randn(8, 16)

    def step_of(model):
        if not backward:
            def forward():
                model(x)
            return forward

        def train():
            model(x).sum().backward()
        return train

    steps = (step_of(bare), step_of(dp))
    for step in steps:
        _block(step, calls)  # warm-up
    times = ([], [])
    for b in range(blocks):
        order = (0, 1) if b % 2 == 0 else (1, 0)  # alternate which goes first
        for which in order:
            times[which].append(_block(steps[which], calls))
    diffs = [w - b for b, w in zip(*times)]
    return statistics.median(times[0]), statistics.median(times[1]), statistics.median(diffs)


def run(args):
    torch.set_num_threads(args.threads)
    for backward in (True, False):
        bare, wrapped, added = measure(args.blocks, args.calls, backward)
        what = "forward + backward" if backward else "forward only"
        print(f"Linear(16, 4), batch 8, device_ids=['cpu'], {what}: bare {bare:.2f} µs, wrapper {wrapped:.2f} µs, "
              f"added {added:.2f} µs per step (thread CPU time, median of {args.blocks} blocks of {args.calls})")
    return 0
