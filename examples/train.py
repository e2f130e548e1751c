"""fastdp demo: train a small classifier on synthetic data with fastdp.DataParallel, save, reload, compare.

Runs on every visible GPU, or on 2 emulated replicas on the CPU when there is none (``--device cpu`` forces it).
No downloads; about ten seconds on a 2-core CPU. Ends with ``dp.report()`` of its own run (per replica: rows,
forward, backward, waits, memory; advice) and writes its picture (with matplotlib) and its trace.

    python examples/train.py [--steps 200] [--batch-size 512] [--device auto|cpu|cuda] [--replicas 2]
                             [--out demo-out]
"""

import argparse
import os
import resource
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import fastdp

FEATURES, HIDDEN, CLASSES = 64, 256, 10


def make_model():
    return nn.Sequential(
        nn.Linear(FEATURES, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, CLASSES),
    )


class Teacher:
    """Synthetic labels from a fixed random network, so the student has something learnable."""

    def __init__(self, seed):
        gen = torch.Generator().manual_seed(seed)
        self.gen = gen
        self.w1 = torch.randn(FEATURES, 32, generator=gen)
        self.w2 = torch.randn(32, CLASSES, generator=gen)

    def batch(self, n):
        x = torch.randn(n, FEATURES, generator=self.gen)
        y = (torch.tanh(x @ self.w1) @ self.w2).argmax(1)
        return x, y


def memory_report(device_ids):
    if device_ids and device_ids[0] != "cpu":
        parts = [
            f"cuda:{d} {torch.cuda.memory_allocated(d) / 2**20:.1f}/{torch.cuda.max_memory_allocated(d) / 2**20:.1f} MiB"
            for d in sorted(set(device_ids))
        ]
        return "mem (alloc/peak) " + ", ".join(parts)
    # Emulated replicas share the host's memory: report the process's peak resident set.
    return f"mem host peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB"


def show_report(dp, out):
    """Prints what the last training steps measured per replica, and writes its picture, trace and numbers."""
    report = dp.report()
    print(report, flush=True)
    os.makedirs(out, exist_ok=True)
    written = [report.trace(os.path.join(out, "report_trace.json")), report.to_csv(os.path.join(out, "report.csv"))]
    try:
        written.append(report.plot(os.path.join(out, "report.png")))
    except ImportError as e:
        print(f"no picture: {e}")
    print("wrote " + ", ".join(written) + " (open the trace in ui.perfetto.dev)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--replicas", type=int, default=2, help="emulated CPU replicas (CPU only)")
    parser.add_argument("--checkpoint", default=os.path.join(tempfile.gettempdir(), "fastdp_demo.pt"))
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--out", default="demo-out", help="folder for the report's picture, trace and CSV")
    args = parser.parse_args(argv)

    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    torch.manual_seed(0)
    model = make_model()
    if use_cuda:
        device_ids = list(range(torch.cuda.device_count()))
        device = torch.device("cuda", device_ids[0])
        model = model.to(device)
    else:
        device_ids = ["cpu"] * args.replicas
        device = torch.device("cpu")
        # Emulated replicas run one after another on the host: one torch thread each keeps their timings in the
        # report steady on a machine shared with other jobs (the benchmarks run the same way).
        torch.set_num_threads(1)
    dp = fastdp.DataParallel(model, device_ids=device_ids, report=True)  # the last 20 steps, for dp.report()
    opt = torch.optim.SGD(dp.parameters(), lr=args.lr, momentum=0.9)
    teacher = Teacher(seed=1)
    where = ", ".join(f"cuda:{d}" for d in device_ids) if use_cuda else f"{len(device_ids)} emulated CPU replicas"
    n_params = sum(p.numel() for p in model.parameters())
    print(f"fastdp {fastdp.__version__} | torch {torch.__version__} | {where} | {n_params:,} parameters | "
          f"batch {args.batch_size} | {args.steps} steps", flush=True)

    start = time.perf_counter()
    window_start, window_samples = start, 0
    for step in range(1, args.steps + 1):
        x, y = teacher.batch(args.batch_size)
        x, y = x.to(device), y.to(device)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(dp(x), y)
        loss.backward()
        opt.step()
        window_samples += args.batch_size
        if step % args.log_every == 0 or step == args.steps:
            if use_cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            rate = window_samples / (now - window_start)
            print(f"step {step:4d}/{args.steps}  loss {loss.item():.4f}  {rate:9.0f} samples/s  "
                  f"{memory_report(device_ids)}", flush=True)
            window_start, window_samples = now, 0
    train_s = time.perf_counter() - start
    show_report(dp, args.out)

    state = dp.state_dict()
    torch.save(state, args.checkpoint)
    prefixed = [k for k in state if k.startswith("module.")]
    print(f"saved {args.checkpoint}: {len(state)} tensors, {len(prefixed)} keys with a 'module.' prefix")

    bare = make_model()
    bare.load_state_dict(torch.load(args.checkpoint, map_location="cpu"), strict=True)
    dp.eval()
    bare.eval()
    x, y = teacher.batch(1000)
    with torch.no_grad():
        expected = dp(x.to(device)).cpu()
        got = bare(x)
    diff = (expected - got).abs().max().item()
    accuracy = (got.argmax(1) == y).float().mean().item()
    ok = torch.allclose(expected, got, rtol=1e-5, atol=1e-5)
    print(f"reloaded into a bare nn.Sequential (strict=True): max |wrapper - bare| = {diff:.3g} "
          f"-> {'outputs match' if ok else 'MISMATCH'}; held-out accuracy {accuracy:.1%}")
    print(f"done in {time.perf_counter() - start:.1f}s (training {train_s:.1f}s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
