"""How much of the gradient reduction backward hides (scripts/gpu_check.sh's overlap step): a timeline of one
training step of ``fastdp.DataParallel`` with one bucket per layer, when each bucket's reduction starts and ends
against the backward of the replicas, and the fraction of the reduction's time that runs while backward still
computes.

``--device cuda`` runs ``device_ids=[0] * replicas`` on one GPU (the reduction on its own stream, timed with CUDA
events on that stream and on the caller's); ``--device cpu`` runs emulated replicas (the host reducer thread, timed
with the host clock). The backward's compute ends when the last replica's gradient for its input is made (a marker
at the model's input records it). Prints the timeline (ms from the start of backward) and the overlap fraction;
``--compare`` also runs the same steps with every reduction held until the end of backward (the order autograd gave
the reduction before it started early), interleaved, and prints both step times.
"""

import argparse
import statistics
import sys
import threading
import time

import torch
import torch.nn as nn

import fastdp
from fastdp import _reducer


class _Clock:
    """Host times (ns) or CUDA events, read back as ms after the step."""

    def __init__(self, cuda):
        self.cuda = cuda

    def now(self, stream=None):
        if not self.cuda:
            return time.perf_counter_ns()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream or torch.cuda.current_stream())
        return event

    def ms(self, origin, t):
        if not self.cuda:
            return (t - origin) / 1e6
        return origin.elapsed_time(t)


class _Recorder:
    """The interface of the wrapper's step recorder: keeps the reductions' spans."""

    def __init__(self):
        self.spans, self.lock = [], threading.Lock()

    def record(self, phase, replica, start, end, nbytes=0, **extra):
        if phase == "reduce":
            with self.lock:
                self.spans.append((extra.get("bucket"), start, end, nbytes))


class _InputMarker(torch.autograd.Function):
    """Identity on the model's input; its backward (the last of each replica's) notes when the compute ends."""

    @staticmethod
    def forward(ctx, x, note):
        ctx.note = note
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.note()
        return g, None


class Model(nn.Module):
    def __init__(self, width, layers, note):
        super().__init__()
        self.layers = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.Tanh())])
        self.__dict__["note"] = note

    def forward(self, x):
        return self.layers(_InputMarker.apply(x.requires_grad_(), self.note))


def one_step(dp, x, clock, ends, recorder):
    ends.clear()
    recorder.spans.clear()
    loss = dp(x).pow(2).mean()
    origin = clock.now()
    loss.backward()
    done = clock.now()
    if clock.cuda:
        torch.cuda.synchronize()
    compute_end = max(clock.ms(origin, t) for t in ends)
    spans = sorted((b, clock.ms(origin, s), clock.ms(origin, e), n) for b, s, e, n in recorder.spans)
    return compute_end, clock.ms(origin, done), spans


def overlap_fraction(compute_end, spans):
    busy = sum(e - s for _, s, e, _ in spans)
    hidden = sum(max(0.0, min(e, compute_end) - s) for _, s, e, _ in spans)
    return hidden / busy if busy > 0 else 0.0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--compare", action="store_true")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("no GPU: nothing to measure")
        return 1
    torch.manual_seed(0)
    clock = _Clock(cuda)
    ends = []
    note = lambda: ends.append(clock.now())  # noqa: E731 (autograd's thread for the device runs it)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    model = Model(args.width, args.layers, note).to(device)
    layer_mb = (args.width * args.width + args.width) * 4 / 2**20
    dp = fastdp.DataParallel(model, device_ids=[0] * args.replicas if cuda else ["cpu"] * args.replicas,
                             bucket_cap_mb=layer_mb)
    x = torch.randn(args.batch, args.width, device=device)
    recorder = _Recorder()
    for _ in range(2):  # builds the kept replicas; warms up
        dp(x).pow(2).mean().backward()
    dp._replica_set.state.recorder = recorder
    where = (f"one {torch.cuda.get_device_name(0)}, device_ids=[0] * {args.replicas}" if cuda
             else f"{args.replicas} emulated replicas, {torch.get_num_threads()} torch threads")
    print(f"overlap of the gradient reduction with backward: {where}; {args.layers} x Linear({args.width}, "
          f"{args.width}), one bucket per layer, batch {args.batch}; torch {torch.__version__}")
    fractions, steps = [], []
    for _ in range(args.steps):
        compute_end, step_ms, spans = one_step(dp, x, clock, ends, recorder)
        fractions.append(overlap_fraction(compute_end, spans))
        steps.append(step_ms)
    print(f"\none step (ms from the start of backward; the replicas' compute ends at {compute_end:.3f}, backward "
          f"returns at {step_ms:.3f}):")
    print(f"{'bucket':>7}{'MB':>8}{'starts':>10}{'ends':>10}{'hidden':>9}")
    for b, s, e, n in spans:
        hidden = max(0.0, min(e, compute_end) - s) / (e - s) if e > s else 0.0
        print(f"{b:>7}{n / 2**20:>8.2f}{s:>10.3f}{e:>10.3f}{hidden:>8.0%}")
    print(f"\noverlap fraction (reduction time hidden behind backward's compute): median {statistics.median(fractions):.0%}"
          f" over {args.steps} steps ({', '.join(f'{f:.0%}' for f in fractions)})")
    if args.compare:
        compare(dp, x, clock, ends, recorder, args.steps)
    return 0


def compare(dp, x, clock, ends, recorder, steps):
    """Step times with each bucket's reduction started early (as shipped) and held until the end of backward (its
    node given the sequence number of a node made at the first step, as before it started early), interleaved."""
    times = {"early": [], "held": []}
    for _ in range(steps):
        for mode in ("early", "held"):
            _hold_until_the_end(dp, mode == "held")
            times[mode].append(one_step(dp, x, clock, ends, recorder)[1])
    _hold_until_the_end(dp, False)
    early, held = statistics.median(times["early"]), statistics.median(times["held"])
    print(f"\nbackward time, interleaved, median of {steps}: reductions started early {early:.3f} ms, held until "
          f"the end {held:.3f} ms (ratio {early / held:.2f})")


def _hold_until_the_end(dp, hold):
    """Gives each bucket node the lowest sequence number (held) or the highest (as shipped)."""
    kept = dp._replica_set.kept
    for out in kept.outs:
        if out.grad_fn is not None:
            out.grad_fn._set_sequence_nr(_reducer._LAST if hold else _reducer._FIRST)


if __name__ == "__main__":
    sys.exit(main())
