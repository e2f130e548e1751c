"""Never hang, never corrupt: nested wrappers, exceptions of every kind in replicas, one wrapper shared by threads,
interrupts during forward and backward, overlapping destinations.

Every case runs in a subprocess with a timeout, so a hang fails its test instead of blocking the run. A few
subprocesses hold many cases each (starting Python and torch costs more than most cases). The references are
the bare model (outputs and gradients) and torch's own results.
"""

import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

# Every test runs with "cpu" replicas in the calling thread and on worker threads (conftest.cpu_apply).
pytestmark = pytest.mark.usefixtures("cpu_apply")

HERE = os.path.dirname(os.path.abspath(__file__))

PRELUDE = f"""
import faulthandler, os, signal, sys, threading, time
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for every thread's stack when it hangs
import torch, torch.nn as nn
import fastdp
from fastdp import comm
torch.set_num_threads(1)
torch.manual_seed(0)
sys.path.insert(0, {HERE!r})
import _mkl
_mkl.warm_vml()  # before replicas run on threads (tests/_mkl.py)
sys.modules["fastdp.parallel_apply"]._CPU_THREADS = os.environ.get("TEST_CPU_THREADS") == "1"

def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

def grads(module):
    return [p.grad.clone() for p in module.parameters()]

def step_equals_bare(dp, net, x):  # one forward and backward of the wrapper gives the bare model's
    net.zero_grad()
    y = dp(x)
    y.sum().backward()
    g = grads(net)
    net.zero_grad()
    ref = net(x)
    ref.sum().backward()
    close(y, ref)
    for a, b in zip(g, grads(net)):
        close(a, b)
"""


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("FASTDP_LOG", None)
    return env


def run_case(body, timeout=90):
    """Runs PRELUDE + body in a fresh interpreter; it must print OK last and exit 0 within `timeout` seconds."""
    code = PRELUDE + textwrap.dedent(body)
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=_env())
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"hung: no result within {timeout}s; output so far:\n{out[-3000:]}")
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-5000:]}"
    assert r.stdout.strip().splitlines()[-1] == "OK", r.stdout[-3000:]
    return r.stdout


def test_nested_wrappers_and_wrapper_in_forward():
    run_case("""
    def check(model, bare, x):
        # The wrapper and the bare model share their parameters: gradients are read between the two backwards.
        model.zero_grad(); bare.zero_grad()
        y = model(x)
        y.pow(2).sum().backward()
        got = {id(p): p.grad.clone() for p in bare.parameters()}
        bare.zero_grad()
        ref = bare(x)
        ref.pow(2).sum().backward()
        close(y, ref)
        for p in bare.parameters():
            close(got[id(p)], p.grad)

    x = torch.randn(16, 4)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    two = fastdp.DataParallel(fastdp.DataParallel(net, device_ids=["cpu"] * 2), device_ids=["cpu"] * 2)
    three = fastdp.DataParallel(fastdp.DataParallel(fastdp.DataParallel(net, device_ids=["cpu"] * 2),
                                                    device_ids=["cpu"] * 3), device_ids=["cpu"] * 2)
    for _ in range(3):  # kept replicas are reused from the second step on
        check(two, net, x)
        check(three, net, x)
    with torch.no_grad():
        close(three(x), net(x))

    # A wrapper called inside forward: one that is a submodule (replicated with the model) and one that is not.
    class Calls(nn.Module):
        def __init__(self, inner, keep_inside):
            super().__init__()
            self.head = nn.Linear(3, 2)
            if keep_inside:
                self.inner = inner
            else:
                self.__dict__["outside"] = inner  # not a submodule: every replica calls the same wrapper

        def forward(self, x):
            inner = self._modules.get("inner") or self.__dict__["outside"]
            return self.head(inner(x))

    for keep_inside in (True, False):
        model = Calls(fastdp.DataParallel(net, device_ids=["cpu"] * 2), keep_inside)
        bare = nn.Sequential(net, model.head)
        dp = fastdp.DataParallel(model, device_ids=["cpu"] * 4)
        for _ in range(3):
            check(dp, bare, x)

    # A wrapper whose module calls the same wrapper again (re-entered from a replica's worker thread).
    class Recurse(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, depth=0):
            y = self.lin(x)
            return SELF(y, depth=depth + 1) if depth < 1 else y

    rec = Recurse()
    SELF = fastdp.DataParallel(rec, device_ids=["cpu"] * 2)
    bare_rec = nn.Sequential(rec.lin, rec.lin)
    for _ in range(2):
        check(SELF, bare_rec, torch.randn(8, 4))
    print("OK")
    """)


def test_every_base_exception_in_every_replica_then_good_steps():
    run_case("""
    from fastdp import parallel_apply as _unused  # noqa: F401
    pa = sys.modules["fastdp.parallel_apply"]

    def instance(cls):
        if issubclass(cls, BaseExceptionGroup):
            return cls("group", [KeyboardInterrupt("inner")])  # stays a BaseExceptionGroup
        return cls("boom")

    def expected_type(cls):
        try:
            cls("probe")
            return cls
        except Exception:
            return RuntimeError  # upstream's ExceptionWrapper falls back to RuntimeError

    kinds = [c for c in BaseException.__subclasses__() if not c.__module__.startswith("_")]
    names = {c.__name__ for c in kinds}
    assert {"Exception", "KeyboardInterrupt", "SystemExit", "GeneratorExit"} <= names, names

    class Fails(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)
            self.fail = None  # (exception class, replica index)

        def forward(self, x):
            if self.fail is not None and int(x[0, 0]) == self.fail[1]:
                raise instance(self.fail[0])
            return self.lin(x)

    n = 4
    model = Fails()
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * n)
    x = torch.randn(4 * n, 4)
    x[:, 0] = torch.arange(n).repeat_interleave(4).float()  # column 0 holds the replica index
    for cls in kinds:
        for r in range(n):
            model.fail = (cls, r)
            try:
                dp(x)
            except BaseException as e:
                assert type(e) is expected_type(cls), (cls, type(e))
                # upstream's ExceptionWrapper text: its first line exactly; the original traceback below (a tree for
                # exception groups) is not compared
                first = str(e).splitlines()[0]
                assert first == f"Caught {cls.__name__} in replica {r} on device cpu.", str(e)[:300]
            else:
                raise AssertionError(f"{cls.__name__} in replica {r} was swallowed")
    model.fail = None
    threads_before = threading.active_count()
    for step in range(50):
        model.zero_grad()
        y = dp(x)
        y.sum().backward()
        g = grads(model)
        model.zero_grad()
        ref = model.lin(x)
        ref.sum().backward()
        close(y, ref)
        for a, b in zip(g, grads(model)):
            close(a, b)
    assert threading.active_count() <= threads_before + n, (threads_before, threading.active_count())

    # A dead worker left in the idle pool is skipped, never handed a task (the worker pool: threads forced).
    pa._CPU_THREADS = True
    dead = threading.Thread(target=lambda: None)
    dead.start()
    dead.join()
    ghost = pa._Worker.__new__(pa._Worker)
    ghost.thread = dead
    ghost.submit = lambda *a: (_ for _ in ()).throw(AssertionError("task queued to a dead worker"))
    pa._IDLE.append(ghost)
    close(dp(x), model.lin(x))
    assert ghost not in pa._IDLE

    # A worker that dies with a task pending is noticed by the liveness check instead of waited on forever.
    real_acquire = pa._acquire
    pa._LIVENESS_S = 0.05
    class Vanished:  # its thread has ended; the task it was given is never run
        thread = dead

        def submit(self, *args):
            pass

    pa._acquire = Vanished
    t0 = time.perf_counter()
    try:
        dp(x)
    except RuntimeError as e:
        # Replica 0 runs on the calling thread; replicas 1 to 3 were handed to the vanished workers.
        assert str(e) == ("fastdp: the worker thread(s) running replica(s) [1, 2, 3] ended without reporting a "
                          "result (interpreter shutting down?)"), e
    else:
        raise AssertionError("a dead worker's replica was not reported")
    assert time.perf_counter() - t0 < 30
    pa._acquire = real_acquire
    close(dp(x), model.lin(x))
    print("OK")
    """)


def test_one_wrapper_shared_by_four_threads():
    run_case("""
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    dp = fastdp.DataParallel(net, device_ids=["cpu"] * 3)
    params = list(net.parameters())
    errors = []

    def work(k):
        g = torch.Generator().manual_seed(k)
        try:
            for step in range(200):
                x = torch.randn(9, 6, generator=g)
                if step % 4 == 3:
                    with torch.no_grad():
                        close(dp(x), net(x))
                    continue
                y = dp(x)
                got = torch.autograd.grad(y.pow(2).sum(), params)
                ref_y = net(x)
                ref = torch.autograd.grad(ref_y.pow(2).sum(), params)
                close(y, ref_y)
                for a, b in zip(got, ref):
                    close(a, b)
        except BaseException as e:
            errors.append(f"thread {k}: {type(e).__name__}: {str(e)[:500]}")

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    print("OK")
    """, timeout=150)


_SIGNAL_BODY = """
MODE = sys.argv[1] if len(sys.argv) > 1 else os.environ["STRESS_MODE"]

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.fire = False

    def forward(self, x):
        y = self.lin(x)
        if self.fire and int(x[0, 0]) == 1:  # replica 1 of 2
            if MODE == "forward":
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.2)
            elif y.requires_grad:
                def hook(g):
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(0.2)
                    return g
                y.register_hook(hook)
        return y

model = Model()
dp = fastdp.DataParallel(model, device_ids=["cpu"] * 2)
x = torch.zeros(8, 4)
x[4:, 0] = 1

def good_step():
    model.zero_grad()
    y = dp(x)
    y.sum().backward()
    g = grads(model)
    model.zero_grad()
    ref = model.lin(x)
    ref.sum().backward()
    close(y, ref)
    for a, b in zip(g, grads(model)):
        close(a, b)
"""


@pytest.mark.parametrize("mode", ["forward", "backward"])
def test_sigint_reaches_main_thread_and_next_call_works(mode):
    run_case(_SIGNAL_BODY.replace('os.environ["STRESS_MODE"]', repr(mode)) + """
good_step()
for attempt in range(3):
    model.fire = True
    try:
        dp(x).sum().backward()
        raise AssertionError("the interrupt was lost")
    except KeyboardInterrupt:
        pass
    model.fire = False
    for _ in range(5):
        good_step()
print("OK")
""")


@pytest.mark.parametrize("mode", ["forward", "backward"])
def test_uncaught_sigint_ends_the_process(mode):
    code = PRELUDE + _SIGNAL_BODY.replace('os.environ["STRESS_MODE"]', repr(mode)) + """
good_step()
model.fire = True
print("READY", flush=True)
dp(x).sum().backward()
print("NOT INTERRUPTED", flush=True)
"""
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=_env())
    except subprocess.TimeoutExpired:
        pytest.fail("an uncaught KeyboardInterrupt left the process hanging")
    assert "READY" in r.stdout and "NOT INTERRUPTED" not in r.stdout, r.stdout
    assert r.returncode != 0 and "KeyboardInterrupt" in r.stderr, (r.returncode, r.stderr[-2000:])


DELAYS = (0.05, 0.13, 0.31, 0.02, 0.21, 0.08, 0.17, 0.03)  # seconds between an interrupt and the next


def test_sigint_from_outside_at_arbitrary_points():
    """The parent interrupts a training loop at several moments; each time the child recovers and checks a step."""
    code = PRELUDE + f"N = {len(DELAYS)}" + """
net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
dp = fastdp.DataParallel(net, device_ids=["cpu"] * 3)
x = torch.randn(48, 32)
recovered = 0
print("READY", flush=True)
while recovered < N:
    try:
        while True:
            dp(x).sum().backward()
    except KeyboardInterrupt:
        recovered += 1
        step_equals_bare(dp, net, x)
        print("RECOVERED", flush=True)
print("OK", flush=True)
"""
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=_env())
    lines = queue.Queue()
    errors = []
    threading.Thread(target=lambda: [lines.put(l.strip()) for l in p.stdout] and None, daemon=True).start()
    threading.Thread(target=lambda: errors.extend(p.stderr), daemon=True).start()

    def next_line(timeout=60):  # never blocks the test for longer than `timeout`
        try:
            return lines.get(timeout=timeout)
        except queue.Empty:
            p.send_signal(signal.SIGUSR1)
            time.sleep(1)
            pytest.fail(f"hung: no output within {timeout}s; stderr:\n{''.join(errors)[-6000:]}")

    try:
        assert next_line() == "READY", "".join(errors)[-3000:]
        for delay in DELAYS:
            time.sleep(delay)
            p.send_signal(signal.SIGINT)
            assert next_line() == "RECOVERED", "".join(errors)[-3000:]
        assert next_line() == "OK", "".join(errors)[-3000:]
        p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("hung after printing OK")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, (p.returncode, "".join(errors)[-3000:])


SIGNALS = int(os.environ.get("FASTDP_STRESS_SIGNALS", "50"))  # per kind of moment; hundreds for a long run

_INTERRUPTS_BODY = """
import random
from fastdp._step import step as running_steps
N = int(os.environ["FASTDP_STRESS_SIGNALS"])
rng = random.Random(0)
net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
dp = fastdp.DataParallel(net, device_ids=["cpu"] * 2)
opt = torch.optim.SGD(net.parameters(), lr=0.01)
x = torch.randn(8, 8)
x[:4, 0], x[4:, 0] = 0, 1  # the chunk of replica r has r in column 0
sleeping, sent = threading.Event(), threading.Event()
target = [None]  # the replica whose forward hook sleeps until the interrupt is sent

def hook(module, args, out):
    if target[0] is not None and int(args[0][0, 0]) == target[0]:
        target[0] = None
        sleeping.set()
        wait_for(sent)
    return out

net[0].register_forward_hook(hook)

def interrupt(after):
    # A real SIGINT, from a thread that is not the main one, once `after` is set (then a random instant later).
    def send():
        after.wait()
        time.sleep(rng.choice((0, 0, 0.0002, 0.001, 0.003)))
        os.kill(os.getpid(), signal.SIGINT)
        sent.set()
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    return sender

def good_step():
    step_equals_bare(dp, net, x)

def wait_for(event):
    while not event.is_set():  # however late the sender runs on a loaded machine (interruptible where it runs)
        time.sleep(0.001)

def iteration(k, kind):
    # 'hook': the interrupt is sent while a replica's forward hook sleeps and must come out of dp(x);
    # 'anywhere': at a random instant of a training step, and must come out of that step.
    sleeping.clear(), sent.clear()
    start = threading.Event()
    if kind == "hook":
        target[0] = k % 2
    sender = interrupt(sleeping if kind == "hook" else start)
    try:
        start.set()
        y = dp(x)
        if kind == "anywhere":
            y.square().mean().backward()
            opt.step()
            opt.zero_grad()
            wait_for(sent)  # the step lasts until the interrupt is sent
        outcome = "returned"
    except KeyboardInterrupt:
        outcome = "interrupted"
    sender.join()
    return outcome

counts = {}
for kind in ("hook", "anywhere"):
    for k in range(N):
        try:
            outcome = iteration(k, kind)
        except KeyboardInterrupt:
            outcome = "late"  # arrived after the call it was sent into had returned
        counts[(kind, outcome)] = counts.get((kind, outcome), 0) + 1
        # An interrupted step leaves no step open on the thread (the next would take itself for a re-entered one).
        assert running_steps.running.steps == (), (kind, k, outcome)
        if k % 10 == 9:
            good_step()  # the interrupted steps left nothing behind
print(sorted(counts.items()), flush=True)
assert counts == {("hook", "interrupted"): N, ("anywhere", "interrupted"): N}, counts
print("OK")
"""


def test_real_interrupts_under_load_always_reach_the_caller():
    """Real SIGINTs sent from another thread while the machine is busy: while a replica's forward hook sleeps (in
    the calling thread, or on a worker thread while the caller waits), the interrupt comes out of dp(x); at any
    instant of a training step, out of that step. Never swallowed, never late. FASTDP_STRESS_SIGNALS sets how many
    of each (50 here; a few hundred for a long run)."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        env = dict(os.environ, FASTDP_STRESS_SIGNALS=str(SIGNALS))
        code = PRELUDE + _INTERRUPTS_BODY
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60 + SIGNALS,
                           env={**_env(), **env})
    finally:
        busy.kill()
        busy.wait()
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-5000:]}"
    assert r.stdout.strip().splitlines()[-1] == "OK", r.stdout[-3000:]


def test_an_interrupt_a_finalizer_swallows_still_ends_the_forward():
    """Ctrl-C landing in a finalizer (a weakref callback, a ``__del__``, one the garbage collector runs), which Python
    reports as "Exception ignored" and drops, still comes out of dp(x); other errors there are still only reported,
    to the hook the user installed, and that hook is in place again after every forward."""
    run_case("""
    import gc, weakref
    reported = []
    user_hook = lambda unraisable: reported.append(unraisable.exc_type)
    sys.unraisablehook = user_hook
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    dp = fastdp.DataParallel(net, device_ids=["cpu"] * 2)
    x = torch.randn(6, 4)
    error = [None]  # what the finalizer of the next forward raises

    class Doomed:
        def __del__(self):
            if error[0] is not None:
                raise error[0]

    def by_refcount():
        Doomed()

    def by_weakref_callback():
        def callback(ref):
            raise error[0]
        obj = Doomed.__new__(Doomed)
        keep = weakref.ref(obj, callback)
        del obj
        return keep

    def by_collector():
        a, b = Doomed(), Doomed()
        a.other, b.other = b, a
        del a, b
        gc.collect()

    def hook(module, args, out):
        kill()
        return out

    net[0].register_forward_hook(hook)
    for kill in (by_refcount, by_weakref_callback, by_collector):
        error[0] = KeyboardInterrupt("landed in a finalizer")
        try:
            dp(x)
            raise AssertionError(f"{kill.__name__}: the interrupt was lost")
        except KeyboardInterrupt:
            pass
        assert sys.unraisablehook is user_hook
        error[0] = ValueError("not an interrupt")
        before = len(reported)
        close(dp(x), net(x))  # only reported, as without the wrapper
        assert reported[before:] and all(t is ValueError for t in reported[before:]), reported
        assert sys.unraisablehook is user_hook
    error[0] = None
    print("OK")
    """)


def test_overlap_matrix():
    run_case("""
    def raised(fn):
        try:
            fn()
        except RuntimeError as e:
            return str(e)
        raise AssertionError(f"accepted: {fn.__doc__}")

    # torch's own texts: an expanded destination, and a destination that partly overlaps its source. fastdp's
    # message is torch's, then which tensors of the call collide.
    INTERNAL = raised(lambda: torch.add(torch.ones(4), 1, out=torch.zeros(1).expand(4)))
    PARTIAL = raised(lambda: (lambda t: t[2:5].copy_(t[:3]))(torch.zeros(9)))

    def refused(fn, text):
        message = raised(fn)
        assert message == text, (message, text)

    b = torch.zeros(12)
    cases = [
        # (what, call, whole message)
        ("gather into an expanded out", lambda: comm.gather([torch.arange(3.)] * 2, out=torch.zeros(1).expand(6)),
         f"{INTERNAL} (copy: destination 0)"),
        ("broadcast into an expanded out", lambda: comm.broadcast(torch.arange(4.), out=[torch.empty(4),
                                                                                     torch.zeros(1).expand(4)]),
         f"{INTERNAL} (copy: destination 1)"),
        ("scatter into an expanded out", lambda: comm.scatter(torch.arange(4.), out=[torch.zeros(1).expand(2),
                                                                                     torch.empty(2)]),
         f"{INTERNAL} (copy: destination 0)"),
        ("scatter outs overlap", lambda: comm.scatter(torch.arange(6.), out=[b[:3], b[1:4]]),
         f"{INTERNAL} (copy: destinations 0 and 1 overlap)"),
        ("broadcast outs overlap", lambda: comm.broadcast(torch.arange(4.), out=[b[:4], b[2:6]]),
         f"{INTERNAL} (copy: destinations 0 and 1 overlap)"),
        ("broadcast outs are one tensor", lambda: comm.broadcast(torch.arange(4.), out=[b[:4], b[:4]]),
         f"{INTERNAL} (copy: destinations 0 and 1 overlap)"),
        ("broadcast out overlaps the source", lambda: comm.broadcast(b[:4], out=[b[2:6]]),
         f"{PARTIAL} (copy: destination 0 overlaps source 0)"),
        ("scatter out overlaps the source", lambda: comm.scatter(b[:6], out=[b[4:7], b[7:10]]),
         f"{PARTIAL} (copy: destination 0 overlaps source 1)"),
        ("gather out overlaps an input", lambda: comm.gather([b[:3], b[3:6]], out=b[2:8]),
         f"{PARTIAL} (copy: destination 0 overlaps source 0)"),
        ("gather out overlaps an input (columns)",
         lambda: comm.gather([b.view(3, 4)[:, 0:1], b.view(3, 4)[:, 1:2]], out=b.view(3, 4)[:, 1:3], dim=1),
         f"{PARTIAL} (copy: destination 0 overlaps source 1)"),
    ]
    for what, fn, text in cases:
        fn.__doc__ = what
        before = b.clone()
        refused(fn, text)
        assert torch.equal(b, before), f"{what}: memory written before refusing"

    # Disjoint but interleaved destinations stay accepted, with torch's results.
    m = torch.zeros(3, 4)
    src = torch.arange(12.).view(3, 4)
    outs = comm.scatter(src, out=[m[:, :2], m[:, 2:]], dim=1)
    assert torch.equal(m, src) and all(o.data_ptr() == p.data_ptr() for o, p in zip(outs, (m[:, :2], m[:, 2:])))
    g = torch.zeros(3, 4)
    comm.gather([src[:, :1], src[:, 1:]], out=g, dim=1)
    assert torch.equal(g, src)
    even, odd = torch.zeros(8)[0::2], torch.zeros(8)[1::2]
    comm.broadcast(torch.arange(4.), out=[even, odd])
    assert torch.equal(even, torch.arange(4.)) and torch.equal(odd, torch.arange(4.))
    # The identical view as source and destination is no copy at all.
    t = torch.arange(6.)
    comm.scatter(t, out=[t[:3], t[3:]])
    assert torch.equal(t, torch.arange(6.))
    print("OK")
    """)
