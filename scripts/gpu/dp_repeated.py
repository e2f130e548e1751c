"""fastdp.DataParallel against torch.nn.DataParallel with repeated device ids on one GPU (scripts/gpu_check.sh):
the same models, inputs and optimizer steps through both wrappers with ``device_ids=[0] * replicas``; forward
outputs, gradients, parameters and BatchNorm running statistics must agree after every step (float32
tolerances: the two sum the replicas' gradients in different orders). ``--device cpu`` runs fastdp's emulated
replicas (``["cpu"] * replicas``) against the bare model instead, on models without BatchNorm, whose
full-batch gradients equal the sum over chunks (a check of this script itself; upstream cannot run there).
Prints one line per model; exits 1 if any disagrees."""

import argparse
import copy
import sys
import time

import torch
import torch.nn as nn

import fastdp


class TwoHeads(nn.Module):
    """Keyword input and a dict + tuple output, as users' models have."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 24), nn.GELU())
        self.a = nn.Linear(24, 3)
        self.b = nn.Linear(24, 5)

    def forward(self, x, scale=1.0):
        h = self.body(x) * scale
        return {"a": self.a(h), "pair": (self.b(h), h.sum(dim=1))}


def models(with_bn):
    out = [("mlp", lambda: nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(32, 32), nn.ReLU())],
                                          nn.Linear(32, 4)), (37, 32)),
           ("two-heads kwargs/dict", TwoHeads, (29, 12))]
    if with_bn:
        out += [("mlp+batchnorm", lambda: nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(),
                                                        nn.Linear(32, 4)), (40, 16)),
                ("cnn+batchnorm", lambda: nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10)),
                 (18, 3, 12, 12))]
    return out


def loss_of(out):
    if isinstance(out, dict):
        return out["a"].square().mean() + out["pair"][0].square().mean() + out["pair"][1].abs().mean()
    return out.square().mean()


def flat_outputs(out):
    if isinstance(out, dict):
        return [out["a"], out["pair"][0], out["pair"][1]]
    return [out]


def close(a, b):
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-5)


def compare(name, make, shape, device, replicas, steps=3):
    torch.manual_seed(0)
    base = make().to(device)
    ours_m, ref_m = copy.deepcopy(base), copy.deepcopy(base)
    if device.type == "cuda":
        ours = fastdp.DataParallel(ours_m, device_ids=[0] * replicas)
        ref = nn.DataParallel(ref_m, device_ids=[0] * replicas)
    else:
        ours = fastdp.DataParallel(ours_m, device_ids=["cpu"] * replicas)
        ref = ref_m  # the bare model: upstream DataParallel has no CPU replicas
    opt_ours = torch.optim.SGD(ours_m.parameters(), lr=0.05, momentum=0.9)
    opt_ref = torch.optim.SGD(ref_m.parameters(), lr=0.05, momentum=0.9)
    kwargs = {"scale": 0.5} if name.startswith("two-heads") else {}
    problems = []
    for step in range(steps):
        x = torch.randn(*shape, device=device)
        out_o, out_r = ours(x, **kwargs), ref(x, **kwargs)
        for i, (a, b) in enumerate(zip(flat_outputs(out_o), flat_outputs(out_r))):
            if not close(a, b):
                problems.append(f"step {step}: output {i} differs (max {(a - b).abs().max().item():.3g})")
        opt_ours.zero_grad()
        opt_ref.zero_grad()
        loss_of(out_o).backward()
        loss_of(out_r).backward()
        for (pn, p), q in zip(ours_m.named_parameters(), ref_m.parameters()):
            if p.grad is None or q.grad is None or not close(p.grad, q.grad):
                problems.append(f"step {step}: grad of {pn} differs")
        opt_ours.step()
        opt_ref.step()
        for (bn, a), b in zip(ours_m.named_buffers(), ref_m.buffers()):
            if a.dtype.is_floating_point and not close(a, b):
                problems.append(f"step {step}: buffer {bn} differs")
    with torch.no_grad():  # eval mode: running statistics used, no grad
        ours.eval()
        ref.eval()
        x = torch.randn(*shape, device=device)
        for a, b in zip(flat_outputs(ours(x, **kwargs)), flat_outputs(ref(x, **kwargs))):
            if not close(a, b):
                problems.append("eval output differs")
    return problems


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--replicas", type=int, default=4)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    against = "torch.nn.DataParallel" if device.type == "cuda" else "the bare model"
    failures = 0
    for name, make, shape in models(with_bn=device.type == "cuda"):
        t0 = time.perf_counter()
        try:
            problems = compare(name, make, shape, device, args.replicas)
        except Exception as e:  # reported, not raised: every model runs
            problems = [f"{type(e).__name__}: {e}"]
        ms = (time.perf_counter() - t0) * 1e3
        print(f"{name:24s} {args.replicas} replicas vs {against}: {'ok' if not problems else 'FAILED'} "
              f"({ms:.0f} ms)", flush=True)
        for line in problems[:5]:
            print(f"    {line}")
        failures += bool(problems)
    print(f"dp repeated ids: {'ok' if not failures else f'{failures} model(s) FAILED'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
