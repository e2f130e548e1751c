"""The host backend's copy and sum next to torch's: ``_C.copy`` of one contiguous pair against ``dst.copy_(src)``,
``_C.reduce`` of several inputs into one output against ``a + b + c + d`` (out= chain) and ``torch.sum(torch.stack)``,
for a few sizes and dtypes. Interleaved rounds (each starting at the next configuration, so that none always runs
after the cache-evicting one), medians, one torch thread.

python -m fastdp.bench.host [--sizes 331530,262144,4194304] [--dtypes float32,float64,bfloat16,float16]
                            [--inputs 4] [--rounds 9] [--calls 10] [--out bench-out]

Sizes are element counts; 262144 float32 is 1 MB and 4194304 float32 is 16 MB (the same counts are used for the
other dtypes, so their byte sizes differ).
"""

import argparse
import csv
import os
import statistics
import sys
import time

import torch

from .. import _C


def _per_call(fn, calls):
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def _chain_sum(inputs, out):
    """out = ((a + b) + c) + d, the core's order, without allocating (what torch does for the same sum)."""
    torch.add(inputs[0], inputs[1], out=out)
    for x in inputs[2:]:
        out.add_(x)


def configs_for(numel, dtype, inputs):
    """{name: callable} for one size and dtype."""
    src = torch.randn(numel).to(dtype)
    dst = torch.empty_like(src)
    ins = [torch.randn(numel).to(dtype) for _ in range(inputs)]
    out = torch.empty_like(ins[0])
    return {
        "copy _C.copy": lambda: _C.copy([dst], [src]),
        "copy torch copy_": lambda: dst.copy_(src),
        f"sum{inputs} _C.reduce": lambda: _C.reduce(ins, out),
        f"sum{inputs} torch add chain": lambda: _chain_sum(ins, out),
        f"sum{inputs} torch a+b+..": lambda: sum(ins[1:], ins[0]),
        f"sum{inputs} torch.sum(stack)": lambda: torch.sum(torch.stack(ins), 0),
    }


def measure(numel, dtype, inputs=4, rounds=9, calls=10):
    """{name: median seconds per call} for one size and dtype; configurations interleaved round by round."""
    torch.set_num_threads(1)
    configs = configs_for(numel, dtype, inputs)
    samples = {name: [] for name in configs}
    for fn in configs.values():  # warm-up: pages touched, caches filled
        _per_call(fn, 2)
    order = list(configs)
    for r in range(rounds):
        for name in order[r % len(order):] + order[:r % len(order)]:  # each round starts one further along
            fn = configs[name]
            fn()  # untimed: brings this configuration's tensors back into the caches the previous one evicted
            samples[name].append(_per_call(fn, calls))
    return {name: statistics.median(v) for name, v in samples.items()}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m fastdp.bench.host", description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="331530,262144,4194304", help="element counts, comma-separated")
    p.add_argument("--dtypes", default="float32,float64,bfloat16,float16", help="torch dtype names")
    p.add_argument("--inputs", type=int, default=4, help="inputs per sum")
    p.add_argument("--rounds", type=int, default=9, help="interleaved rounds; medians over rounds are reported")
    p.add_argument("--calls", type=int, default=10, help="calls per configuration and round")
    p.add_argument("--out", default="bench-out", help="folder for the CSV")
    a = p.parse_args(argv)
    sizes = [int(s) for s in a.sizes.split(",") if s]
    dtypes = [getattr(torch, d) for d in a.dtypes.split(",") if d]
    print(f"torch {torch.__version__}, 1 torch thread, FASTDP_HOST_THREADS="
          f"{os.environ.get('FASTDP_HOST_THREADS', '(all cores)')} of {os.cpu_count()} cores, "
          f"median of {a.rounds} interleaved rounds x {a.calls} calls")
    print(f"{'dtype':<9} {'numel':>9} {'MB':>6}  {'configuration':<28} {'ms/call':>8} {'GB/s':>6}")
    rows = []
    for dtype in dtypes:
        for numel in sizes:
            es = torch.empty(0, dtype=dtype).element_size()
            res = measure(numel, dtype, a.inputs, a.rounds, a.calls)
            for name, sec in res.items():
                moved = numel * es * (2 if name.startswith("copy") else a.inputs + 1)
                print(f"{str(dtype)[6:]:<9} {numel:>9} {numel * es / 2**20:>6.2f}  {name:<28} {sec * 1e3:>8.3f} "
                      f"{moved / sec / 1e9:>6.1f}")
                rows.append((str(dtype)[6:], numel, name, sec))
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "host.csv")
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["dtype", "numel", "configuration", "seconds_per_call"])
        w.writerows(rows)
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
