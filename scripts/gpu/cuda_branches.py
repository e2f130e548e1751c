"""The shim's CUDA-only branches on a real GPU (scripts/gpu_check.sh): one check per run, each comparing fastdp's
training with the bare model's on the whole batch, with replicas on one GPU listed twice (``device_ids=[0, 0]``).

  python cuda_branches.py CHECK [--trace DIR]      # CHECK: one of CHECKS below; exit 1 when it fails
  python cuda_branches.py map-report --trace DIR   # which entries of the map in docs/gpu-verification.md ran

``--trace DIR`` notes, with sys.settrace, every function of python/fastdp named in the map that the check ran, in
DIR/CHECK.txt (the GPU machine has no coverage tool); ``map-report`` reads those files and prints, for every entry of
the map, whether it ran and in which check. C entries are reported through the gpu_check.sh step that runs them.
"""

import argparse
import contextlib
import copy
import os
import re
import sys
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAP_DOC = os.path.join(ROOT, "docs", "gpu-verification.md")
MAP_HEADING = "## CUDA-only branches and the step that runs them"


# ---- the map and the tracer (no torch needed) -----------------------------------------------------------------


def read_map(path=MAP_DOC):
    """The map's rows as dicts (file, function, branch, step), parsed from its Markdown table."""
    with open(path) as f:
        text = f.read()
    if MAP_HEADING not in text:
        raise ValueError(f"{path} has no section {MAP_HEADING!r}")
    section = text.split(MAP_HEADING, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.lstrip().startswith("|") or len(cells) != 4 or cells[0] in ("file", "") or set(cells[0]) <= {"-"}:
            continue
        rows.append(dict(zip(("file", "function", "branch", "step"), (c.strip("`") for c in cells))))
    return rows


class Tracer:
    """Notes which of the map's Python functions run in this process (every thread), by file and qualified name."""

    def __init__(self, rows):
        self.wanted = {(r["file"], r["function"]) for r in rows if r["file"].endswith(".py")}
        self.seen = set()
        self.codes = {}  # code object -> its map key or None

    def _trace(self, frame, event, arg):
        code = frame.f_code
        key = self.codes.get(code, 0)
        if key == 0:
            key = self._key(code)
            self.codes[code] = key
        if key is not None:
            self.seen.add(key)
        return None  # no line events

    def _key(self, code):
        path = code.co_filename.replace(os.sep, "/")
        at = path.rfind("/fastdp/")
        if at < 0:
            return None
        key = ("python" + path[at:], getattr(code, "co_qualname", code.co_name))
        return key if key in self.wanted else None

    def start(self):
        sys.settrace(self._trace)
        threading.settrace(self._trace)

    def stop(self, out_file):
        sys.settrace(None)
        threading.settrace(None)
        with open(out_file, "w") as f:
            for file, function in sorted(self.seen):
                f.write(f"{file} {function}\n")


def map_report(trace_dir, path=MAP_DOC, out=sys.stdout):
    """Prints every entry of the map with the checks that ran it (Python) or its gpu_check.sh step (C); returns the
    number of Python entries that ran."""
    rows = read_map(path)
    ran = {}
    if os.path.isdir(trace_dir):
        for name in sorted(os.listdir(trace_dir)):
            if name.endswith(".txt"):
                with open(os.path.join(trace_dir, name)) as f:
                    for line in f:
                        if line.strip():
                            file, function = line.split(None, 1)
                            ran.setdefault((file, function.strip()), []).append(name[:-4])
    count = 0
    print(f"{'ran':4} {'entry':64} by", file=out)
    for r in rows:
        key = (r["file"], r["function"])
        if r["file"].endswith(".py"):
            by = ran.get(key)
            count += bool(by)
            print(f"{'yes' if by else 'NO':4} {r['file'] + ' ' + r['function']:64} {', '.join(by or [r['step']])}",
                  file=out)
        else:
            print(f"{'C':4} {r['file'] + ' ' + r['function']:64} step {r['step']} (C: not traced)", file=out)
    python = sum(r["file"].endswith(".py") for r in rows)
    print(f"python entries that ran: {count} of {python}", file=out)
    return count


# ---- the checks (torch and fastdp imported here) ---------------------------------------------------------------


DEVICE = "cuda"  # "cpu": the comparisons themselves checked on emulated replicas (tests/test_gpu_map.py)


def _setup():
    global torch, fastdp
    import torch

    import fastdp


def _ids():
    return [0, 0] if DEVICE == "cuda" else ["cpu", "cpu"]


def _close(a, b, tol):
    err = (a.double() - b.double()).abs().max().item()
    scale = max(1.0, b.double().abs().max().item())
    return err <= tol * scale, err


def _net(bn=False, sync=False):
    layers = [torch.nn.Conv2d(3, 8, 3, padding=1)]
    if bn:
        layers.append(torch.nn.SyncBatchNorm(8) if sync else torch.nn.BatchNorm2d(8))
    layers += [torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 5)]
    return torch.nn.Sequential(*layers)


def _compare(name, wrapped, bare, tol):
    ok = True
    for (n, p), q in zip(wrapped.named_parameters(), bare.parameters()):
        if p.grad is None or q.grad is None:
            print(f"  {name}: {n} has no gradient")
            ok = False
            continue
        good, err = _close(p.grad, q.grad, tol)
        if not good:
            print(f"  {name}: gradient of {n} off by {err:.3g}")
            ok = False
    return ok


def _train(steps, dp_kwargs=None, x_of=None, stream=None, loss_on_replicas=False, bn=False, sync=False,
           dtype=None, tol=1e-4, name="", around=None, size=10, prepare=None):
    """``steps`` training steps (forward, backward, SGD) of fastdp.DataParallel(device_ids=[0, 0]) against the bare
    model on the whole batch (in float64 for other dtypes than float32); True when every step's gradients agree.
    ``stream(step)``: the caller's stream of that step; ``around(step)``: a context around the wrapper's step;
    ``prepare(model)``: the wrapped model, changed before wrapping (hooks)."""
    torch.manual_seed(0)
    dtype = dtype or torch.float32
    bare = _net(bn, False).to(DEVICE)
    model = _net(bn, sync).to(DEVICE)
    model.load_state_dict(bare.state_dict())
    model.to(dtype)
    if dtype != torch.float32:
        bare.double()
    ref_dtype = next(bare.parameters()).dtype
    loss_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    criterion = torch.nn.MSELoss()
    kwargs = dict(device_ids=_ids())
    kwargs.update(dp_kwargs or {})
    if loss_on_replicas:
        kwargs["criterion"] = criterion
    if prepare is not None:
        model = prepare(model)
    dp = fastdp.DataParallel(model, **kwargs)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, bare)]
    cuda = DEVICE == "cuda"
    ok = True
    for step in range(steps):
        x = torch.randn(16, 3, size, size, device=DEVICE)
        y = torch.randn(16, 5, device=DEVICE)
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        caller = None
        if cuda:
            caller = stream(step) if stream is not None else torch.cuda.current_stream()
            caller.wait_stream(torch.cuda.current_stream())  # the batch and the last optimizer step
        xin = (x_of(x) if x_of is not None else x).to(dtype)
        with (torch.cuda.stream(caller) if cuda else contextlib.nullcontext()), (
                around(step) if around is not None else contextlib.nullcontext()):
            if loss_on_replicas:
                loss = dp(xin, target=y.to(dtype))
            else:  # the loss of a half-precision output in float32, as mixed-precision training computes it
                loss = criterion(dp(xin).to(y.device).to(loss_dtype), y.to(loss_dtype))
            loss.backward()
        if cuda:
            torch.cuda.current_stream().wait_stream(caller)
        criterion(bare(x.to(ref_dtype)), y.to(ref_dtype)).backward()
        ok &= _compare(f"{name} step {step}", model, bare, tol)
        for opt in opts:
            opt.step()
    if cuda:
        torch.cuda.synchronize()
    return ok


def check_sync_debug():
    """Steady-state steps under torch.cuda.set_sync_debug_mode("error"): no host synchronisation (plain outputs,
    per-replica loss, SyncBatchNorm)."""
    ok = True
    for what, kw in [("outputs", {}), ("per-replica loss", dict(loss_on_replicas=True)),
                     ("syncbn", dict(bn=True, sync=True))]:
        try:
            ok &= _train(6, name=what, around=_sync_debug_after(3), **kw)
        except RuntimeError as e:
            print(f"  {what}: {e}")
            ok = False
    return ok


def _sync_debug_after(warm):
    """Per step: a context with torch's sync-debug mode "error" on, from step ``warm`` on (the steady state)."""

    @contextlib.contextmanager
    def around(step):
        torch.cuda.set_sync_debug_mode("error" if step >= warm else "default")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")

    return around


def check_allocator():
    """Training and the comm calls under the allocator that PYTORCH_CUDA_ALLOC_CONF selects (gpu_check.sh runs this
    with expandable_segments:True and with backend:cudaMallocAsync)."""
    print(f"  allocator: {torch.cuda.get_allocator_backend()}, "
          f"PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')!r}")
    ok = _train(4, name="train") and _train(3, bn=True, sync=True, name="syncbn")
    from fastdp import comm

    x = torch.randn(1 << 20, device="cuda")
    copies = comm.broadcast(x, [0, 0])
    total = comm.reduce_add([x, x.clone()], 0)
    parts = comm.scatter(x, [0, 0])
    ok &= all(torch.equal(c, x) for c in copies) and torch.equal(total, x + x) and torch.equal(torch.cat(parts), x)
    return ok


def check_caller_stream():
    """Training on a non-default caller stream, then alternating between two: the kept replicas' nodes follow."""
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    ok = _train(3, stream=lambda step: s1, name="one stream")
    ok &= _train(4, stream=lambda step: (s1, s2)[step % 2], name="alternating", bn=True, sync=True)
    from fastdp import comm

    x = torch.randn(1 << 22, device="cuda")
    s1.wait_stream(torch.cuda.current_stream())
    s2.wait_stream(torch.cuda.current_stream())
    parts = comm.scatter(x, [0, 0], streams=[s1, s2])  # one GPU listed twice: the second chunk handed to s2
    with torch.cuda.stream(s2):
        second = parts[1] * 1  # read on its own stream
    torch.cuda.synchronize()
    good = torch.equal(torch.cat(parts), x) and torch.equal(second, x[x.numel() // 2:])
    if not good:
        print("  comm.scatter with explicit streams: wrong chunks")
    return ok and good


def check_cpu_batch():
    """A CPU batch into CUDA replicas: pageable and pinned, below and above the pinning threshold."""
    ok = True
    for what, to_host in [("pageable", lambda x: x.cpu()), ("pinned", lambda x: x.cpu().pin_memory())]:
        ok &= _train(3, x_of=to_host, name=f"{what} small")
    ok &= _train(2, x_of=lambda x: x.cpu(), size=80, name="large pageable (pinned by fastdp)")  # 1.2 MiB
    return ok


def check_output_cpu():
    """output_device="cpu": the outputs gathered to the host, the gradients still equal the bare model's."""
    return _train(3, dp_kwargs=dict(output_device="cpu"), name="output on cpu")


def check_syncbn_dtypes():
    """SyncBatchNorm on CUDA in float16, bfloat16, float32 and float64 against BatchNorm on the whole batch."""
    ok = True
    for dtype, tol in [(torch.float16, 3e-2), (torch.bfloat16, 1e-1), (torch.float32, 1e-4), (torch.float64, 1e-9)]:
        try:
            ok &= _train(3, bn=True, sync=True, dtype=dtype, tol=tol, name=str(dtype))
        except RuntimeError as e:
            print(f"  {dtype}: {e}")
            ok = False
    return ok


def check_graph_capture():
    """A multi-device step inside CUDA-graph capture raises the error that names the capture, and the wrapper
    still trains afterwards."""
    model = _net().cuda()
    dp = fastdp.DataParallel(model, device_ids=[0, 0])
    x = torch.randn(8, 3, 10, 10, device="cuda")
    dp(x).sum().backward()  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    raised = None
    try:
        with torch.cuda.graph(graph):
            dp(x)
    except RuntimeError as e:
        raised = e
    if raised is None or "capturing a CUDA graph" not in str(raised):
        print(f"  expected the capture error, got {raised!r}")
        return False
    print(f"  refused: {str(raised)[:100]}...")
    return _train(2, name="after the refused capture")


def check_oom_rescue():
    """oom="rebalance" on real streams: an out-of-memory error raised in a replica's forward once (as the allocator
    would) is rescued, the reductions the first steps left in flight settled first, and training still equals the
    bare model's."""
    fired = []

    class OnceOutOfMemory:
        def __call__(self, module, args):
            if len(fired) == 0 and self.armed:
                fired.append(True)
                raise torch.OutOfMemoryError("CUDA out of memory (raised by the check, as the allocator would) GPU 0")

    hook = OnceOutOfMemory()
    hook.armed = False

    def around(step):
        hook.armed = step == 2
        return contextlib.nullcontext()

    def with_hook(model):
        model[0].register_forward_pre_hook(hook)
        return model

    ok = _train(4, dp_kwargs=dict(oom="rebalance"), name="oom-rescue", around=around, prepare=with_hook)
    if not fired:
        print("  the out-of-memory error never fired")
    return ok and bool(fired)


CHECKS = {
    "sync-debug": check_sync_debug,
    "allocator": check_allocator,
    "caller-stream": check_caller_stream,
    "cpu-batch": check_cpu_batch,
    "output-cpu": check_output_cpu,
    "syncbn-dtypes": check_syncbn_dtypes,
    "graph-capture": check_graph_capture,
    "oom-rescue": check_oom_rescue,
}
HOST_CHECKS = ("output-cpu", "syncbn-dtypes", "per-replica-loss", "oom-rescue")
CHECKS["per-replica-loss"] = lambda: _train(3, loss_on_replicas=True, bn=True, sync=True, name="per-replica loss")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("check", choices=sorted(CHECKS) + ["map-report"])
    p.add_argument("--trace", help="folder for the trace files (map-report reads them)")
    p.add_argument("--name", help="the trace file's name (default: the check's)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: the comparisons on emulated replicas (a check of this script; no CUDA branch runs)")
    p.add_argument("--map", default=MAP_DOC, help="the document holding the map (default: docs/gpu-verification.md)")
    args = p.parse_args(argv)
    if args.check == "map-report":
        map_report(args.trace or ".", args.map)
        return 0
    global DEVICE
    DEVICE = args.device
    _setup()
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    if DEVICE == "cpu" and args.check not in HOST_CHECKS:
        print(f"{args.check} needs a CUDA device; on the host: {', '.join(sorted(HOST_CHECKS))}")
        return 2
    tracer = None
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
        tracer = Tracer(read_map(args.map))
        tracer.start()
    try:
        ok = CHECKS[args.check]()
    finally:
        if tracer is not None:
            tracer.stop(os.path.join(args.trace, f"{args.name or args.check}.txt"))
    print(f"{args.check}: {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
