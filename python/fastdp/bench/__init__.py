"""Benchmarks: programs that print tables and write CSV files, never timed assertions.

python -m fastdp.bench comm [--sizes-mb 1,4,16,32] [--replicas 4] [--out bench-out]
python -m fastdp.bench train [--models mlp,cnn,transformer] [--replicas 4] [--rounds 5] [--threads 1] [--split]
                             [--params 10,100,1000 [--clock wall|cpu]] [--out bench-out]
python -m fastdp.bench report [--models mlp,cnn,transformer] [--replicas 4] [--rounds 30] [--steps 5]
python -m fastdp.bench growth [--tensors 100,1000,10000] [--buckets 1,10,100] [--replicas 2,4,8] [--against PYTHON]
python -m fastdp.bench one-device [--blocks 15] [--calls 500]
"""

import argparse
import sys


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["growth"]:  # its own parser: its child processes run the same module as a script
        from .growth import main as growth

        return growth(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m fastdp.bench")
    sub = parser.add_subparsers(dest="which", metavar="{comm,train,report,growth,one-device}")
    p = sub.add_parser("comm", help="GB/s per operation and backend next to the copy limit of the same run")
    p.add_argument("--sizes-mb", default=None,
                   help="buffer sizes in MB, comma-separated (default 1,4,16,32: about 1 GB of memory; each size "
                   "holds about 19 times itself at 4 entries, e.g. 5 GB at 256)")
    p.add_argument("--replicas", type=int, default=4, help="device entries per operation")
    p.add_argument("--seconds", type=float, default=0.3, help="time budget per measurement")
    p.add_argument("--out", default="bench-out", help="folder for the CSV")
    p = sub.add_parser("train", help="training steps/s and per-step split: bare model, torch.nn.DataParallel, "
                       "fastdp.DataParallel")
    p.add_argument("--models", default="mlp,cnn,transformer", help="comma-separated: mlp, cnn, transformer")
    p.add_argument("--replicas", type=int, default=4, help="repeated ids on one GPU / emulated 'cpu' replicas")
    p.add_argument("--batch", type=int, default=0, help="batch size for every model (0: each model's default)")
    p.add_argument("--steps", type=int, default=25, help="timed training steps per configuration and round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before each timed run")
    p.add_argument("--rounds", type=int, default=9, help="interleaved rounds; medians over rounds are reported")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads (torch.set_num_threads); 0: 1 on the CPU, torch's default with a GPU")
    p.add_argument("--params", default="", metavar="N[,N...]",
                   help="instead of the models: per parameter tensor and step, the cost of replicate and of the "
                   "gradient reduction for N x Linear(8, 8) (fastdp, and torch.nn.DataParallel on a GPU); "
                   "writes params.csv and params.png")
    p.add_argument("--ddp", action="store_true",
                   help="with --params: also DistributedDataParallel in one process and the bare module")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="with --params: what every time is measured with: wall (elapsed) or cpu (the CPU time of "
                   "this process, all its threads: other processes' load on a shared machine stretches wall times, "
                   "not these; host work only)")
    p.add_argument("--sync-bn", default="", metavar="N[,N...]",
                   help="instead of the models: the CNN's training step with nn.SyncBatchNorm (statistics "
                   "exchanged across replicas) against BatchNorm, for N replicas each; writes syncbn.csv")
    p.add_argument("--out", default="bench-out", help="folder for train.csv and train.png")
    p.add_argument("--split", action="store_true",
                   help="synchronise the GPUs around each timed region of the instrumented pass")
    p.add_argument("--per-device-batch", action="store_true",
                   help="several GPUs: the DataParallel runs get --batch per GPU (weak scaling)")
    p = sub.add_parser("report", help="what dp.report()'s recording costs: off (per step) and on (against off)")
    p.add_argument("--models", default="mlp,cnn,transformer", help="comma-separated: mlp, cnn, transformer")
    p.add_argument("--replicas", type=int, default=4, help="emulated 'cpu' replicas")
    p.add_argument("--steps", type=int, default=5, help="timed training steps per mode and round (the fastest counts)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after each switch")
    p.add_argument("--rounds", type=int, default=30,
                   help="interleaved rounds (their paired on/off ratios give the median and its 95%% interval)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--out", default="bench-out", help="folder for report_cost.csv")
    sub.add_parser("growth", help="host cost per step against tensors, buckets and replicas, against another "
                   "tree's fastdp with --against PYTHON (its own options: growth --help)")
    p = sub.add_parser("one-device", help="what the wrapper adds per step over the bare model on one device")
    p.add_argument("--blocks", type=int, default=15, help="interleaved blocks per model; medians over blocks")
    p.add_argument("--calls", type=int, default=500, help="steps per block")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args(argv)
    if args.which is None:  # argparse alone would say "arguments are required: which"
        parser.error("choose a benchmark: 'comm' (GB/s per operation) or 'train' (training steps/s), e.g. "
                     "python -m fastdp.bench train --replicas 4; add --help after either for its options")
    if args.which == "comm":
        from .comm import run

        return run(args)
    if args.which == "train":
        from .train import run

        return run(args)
    if args.which == "report":
        from .report_cost import run

        return run(args)
    if args.which == "one-device":
        from .one_device import run

        return run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
