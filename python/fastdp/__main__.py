"""python -m fastdp info | bench ... — machine facts and benchmarks."""

import argparse
import json
import sys


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m fastdp")
    sub = parser.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="versions, backends and their libraries, kernel source, fallback, GPUs")
    p_info.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p_info.add_argument(
        "--memory",
        action="store_true",
        help="also read free memory on GPUs no CUDA context uses yet (creates one on each for the query)",
    )
    sub.add_parser("bench", help="benchmarks (same as python -m fastdp.bench)", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "info":
        from ._native.info import collect, render

        info = collect(memory=args.memory)
        print(json.dumps(info, indent=2) if args.json else render(info))
        return 0
    from .bench import main as bench_main

    return bench_main(rest)


if __name__ == "__main__":
    sys.exit(main())
