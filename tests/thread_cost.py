"""What the thread-safety of fastdp.DataParallel costs: the per-forward lock, and 4 threads sharing one wrapper.

Not a test (nothing is asserted): prints medians over interleaved rounds. 1 torch thread.
    python tests/thread_cost.py [--rounds 15] [--steps 40]
"""

import argparse
import statistics
import threading
import time

import torch
import torch.nn as nn

import fastdp


def step(dp, x):
    dp(x).sum().backward()


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    locked = fastdp.DataParallel(net, device_ids=["cpu"] * 2)
    unlocked = fastdp.DataParallel(net, device_ids=["cpu"] * 2)
    unlocked.__dict__["_forward_lock"] = None  # the unsafe path: no lock (the step is still opened and closed)
    x = torch.randn(32, 64)
    xs = [torch.randn(32, 64) for _ in range(4)]
    for dp in (locked, unlocked):
        for _ in range(5):
            step(dp, x)

    def serial(dp, n):
        for _ in range(n):
            step(dp, x)

    def threads4(n):
        def work(k):
            for _ in range(n // 4):
                step(locked, xs[k])

        ts = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    res = {"locked": [], "unlocked": [], "4 threads (locked)": []}
    runs = {"unlocked": lambda: serial(unlocked, args.steps), "locked": lambda: serial(locked, args.steps),
            "4 threads (locked)": lambda: threads4(args.steps)}
    order = list(runs)
    for r in range(args.rounds):  # interleaved, order rotated: machine load hits every variant alike
        for k in order[r % 3:] + order[: r % 3]:
            res[k].append(timed(runs[k]) / args.steps)
    for k, v in res.items():
        print(f"{k:20s} median {statistics.median(v) * 1e6:8.1f} us/step  (min {min(v) * 1e6:.1f})")
    m = {k: statistics.median(v) for k, v in res.items()}
    # The added work itself, without the model: make the step, look for a re-entry, take the lock, enter and
    # leave the step (its findings left on the wrapper).
    from fastdp._step import step as _step

    lock = threading.Lock()

    def bookkeeping():
        for _ in range(10000):
            step = _step.Step(locked, None, lambda outcome: None)
            step.fresh = _step.is_running(locked)
            with lock:
                outer = step.push()
                _step.running.steps = outer
                step.finish()

    book = statistics.median(timed(bookkeeping) / 10000 for _ in range(9))
    print(f"lock + re-entry bookkeeping alone: {book * 1e6:.2f} us per forward")
    print(f"lock overhead: {(m['locked'] / m['unlocked'] - 1) * 100:+.1f}% per step; 4 threads vs one thread: "
          f"{m['4 threads (locked)'] / m['locked']:.2f}x time per step")


if __name__ == "__main__":
    main()
