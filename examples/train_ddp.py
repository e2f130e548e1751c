"""fastdp demo, one script for one machine or many: fastdp.DataParallel alone, or torch's DDP under torchrun.

Trains a small classifier on a synthetic data set, saves a checkpoint on rank 0, reloads it everywhere, compares.
No downloads; a few seconds on a 2-core CPU.

    python examples/train_ddp.py                          # one process: every GPU, or 2 emulated CPU replicas
    torchrun --nproc_per_node 2 examples/train_ddp.py     # one process per GPU (or 2 CPU processes on gloo)
    torchrun --nnodes 2 --node_rank R --nproc_per_node 8 \\
             --master_addr HOST --master_port 29500 examples/train_ddp.py --checkpoint /shared/ckpt.pt

Options: [--epochs 3] [--batch-size 256] [--samples 8192] [--device auto|cpu|cuda] [--replicas 2]
"""

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import fastdp

# The model of examples/train.py (this script's folder is on sys.path, also under torchrun).
from train import CLASSES, FEATURES, make_model  # noqa: E402


def make_data(n, seed):
    """Inputs drawn with ``seed`` (so the same on every rank), labelled by a fixed random network."""
    teacher = torch.Generator().manual_seed(1234)
    w1 = torch.randn(FEATURES, 32, generator=teacher)
    w2 = torch.randn(32, CLASSES, generator=teacher)
    x = torch.randn(n, FEATURES, generator=torch.Generator().manual_seed(seed))
    return x, (torch.tanh(x @ w1) @ w2).argmax(1)


def mean_over_ranks(value):
    """The mean of a float over all processes (itself when not distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    t = torch.tensor([value], dtype=torch.float64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256, help="global batch, split across GPUs/processes")
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--replicas", type=int, default=2, help="emulated CPU replicas (one CPU process only)")
    parser.add_argument("--checkpoint", default=os.path.join(tempfile.gettempdir(), "fastdp_ddp_demo.pt"),
                        help="on a filesystem every machine sees, when running across machines")
    args = parser.parse_args(argv)

    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    torch.manual_seed(0)
    model = make_model()
    # One line for both cases: under torchrun (WORLD_SIZE > 1) it becomes fastdp.DistributedDataParallel on
    # cuda:LOCAL_RANK (device_ids[LOCAL_RANK]) or, with "cpu" entries, on the CPU over gloo.
    device_ids = list(range(torch.cuda.device_count())) if use_cuda else ["cpu"] * args.replicas
    if not use_cuda:
        # Emulated replicas (or gloo processes) run on the host: one torch thread each, as examples/train.py and
        # the benchmarks do, so that the threads of a small model's operations do not fight each other and other
        # jobs for the cores of a small or shared machine.
        torch.set_num_threads(1)
    dp = fastdp.DataParallel(model, device_ids=device_ids)
    device = next(dp.parameters()).device
    world = fastdp.distributed.get_world_size()

    x_all, y_all = make_data(args.samples, seed=1)
    # The global batch stays --batch-size: with N processes each loads batch_size / N samples of its own shard.
    loader = fastdp.shard(DataLoader(TensorDataset(x_all, y_all), batch_size=args.batch_size, shuffle=True,
                                     drop_last=True))
    opt = torch.optim.SGD(dp.parameters(), lr=args.lr, momentum=0.9)

    if isinstance(dp, fastdp.DistributedDataParallel):
        where = f"{world} processes ({dist.get_backend()}), this one on {device}"
    elif use_cuda:
        where = "1 process on " + ", ".join(f"cuda:{d}" for d in device_ids)
    else:
        where = f"1 process, {len(device_ids)} emulated CPU replicas"
    if not use_cuda:
        where += f", torch threads: {torch.get_num_threads()}"
    fastdp.print0(f"fastdp {fastdp.__version__} | torch {torch.__version__} | {where} | "
                  f"global batch {args.batch_size} | {len(loader)} steps/epoch", flush=True)

    start = time.perf_counter()
    for epoch in range(args.epochs):
        total, steps = 0.0, 0
        for x, y in loader:  # each epoch reshuffles: fastdp.shard calls set_epoch for you
            x, y = x.to(device), y.to(device)
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(dp(x), y)
            loss.backward()
            opt.step()
            total, steps = total + loss.item(), steps + 1
        loss = mean_over_ranks(total / steps)
        rate = (epoch + 1) * len(loader) * args.batch_size / (time.perf_counter() - start)
        fastdp.print0(f"epoch {epoch + 1}/{args.epochs}  loss {loss:.4f}  {rate:9.0f} samples/s", flush=True)

    fastdp.save(dp.state_dict(), args.checkpoint)  # rank 0 writes; every rank returns once it is on disk
    state = torch.load(args.checkpoint, map_location="cpu")
    prefixed = sum(k.startswith("module.") for k in state)
    fastdp.print0(f"saved {args.checkpoint}: {len(state)} tensors, {prefixed} keys with a 'module.' prefix")

    bare = make_model()
    bare.load_state_dict(state, strict=True)
    dp.eval()
    bare.eval()
    x, y = make_data(1000, seed=2)
    with torch.no_grad():
        expected = dp(x.to(device)).cpu()
        got = bare(x)
    ok = torch.allclose(expected, got, rtol=1e-5, atol=1e-5)
    ok = mean_over_ranks(float(ok)) == 1.0  # every rank reloaded the same checkpoint
    accuracy = (got.argmax(1) == y).float().mean().item()
    fastdp.print0(f"reloaded into a bare nn.Sequential on every rank (strict=True) -> "
                  f"{'outputs match' if ok else 'MISMATCH'}; held-out accuracy {accuracy:.1%}")
    fastdp.print0(f"done in {time.perf_counter() - start:.1f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
