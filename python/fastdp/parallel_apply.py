"""``parallel_apply(modules, inputs, kwargs_tup=None, devices=None)``: runs each replica on its inputs.

Emulated "cpu" replicas run one after another in the calling thread (measured faster than threads: they contend
for the GIL, and their backward runs in the calling thread anyway). Otherwise replica 0 runs in the calling
thread and the others run on persistent worker threads taken from an idle pool and put back when done (reused
by every call instead of upstream's new threads every step; a call made from inside a replica gets idle or new
workers, never a busy one). Each worker re-enters the caller's grad mode, inference
mode, autocast state (enabled flag and dtype), device and current stream; exceptions, BaseException included,
come back as "Caught X in replica i on device d." with the original traceback, the lowest replica index first,
and the worker stays in the pool. Differences from upstream: the autocast dtype (not only the enabled flag) and
inference mode reach the workers, so bf16 autocast stays bf16 inside replicas; a BaseException in a replica is
reported instead of ending its thread.
"""

import os
import queue
import signal
import threading
from contextlib import ExitStack

import torch
from torch._utils import ExceptionWrapper

from ._platform import devices as _devices
from ._step import step as _step
from .sync_batchnorm import first_cause, needs_threads

__all__ = ["parallel_apply", "run"]


def _autocast_state(device_types):
    """The caller's autocast settings per device type, re-entered in each worker."""
    state = []
    for device_type in device_types:
        if torch.is_autocast_enabled(device_type):
            state.append((device_type, torch.get_autocast_dtype(device_type)))
    return tuple(state)


class _Context:
    """Thread-local state captured in the caller and re-applied in each worker."""

    __slots__ = ("grad_enabled", "inference", "autocast", "cache_enabled", "steps")

    def __init__(self, devices):
        self.grad_enabled = torch.is_grad_enabled()
        self.inference = torch.is_inference_mode_enabled()
        types = ["cpu"]
        if any(d != _devices.CPU for d in devices):
            types.append("cuda")
        self.autocast = _autocast_state(types)
        self.cache_enabled = torch.is_autocast_cache_enabled()
        self.steps = _step.running.steps  # a wrapper called inside a replica knows it is re-entered


class _ReplicaError(ExceptionWrapper):
    """torch's ExceptionWrapper, whose reraise never fails on its own: a type that cannot be built from the one
    message (exception groups, whose ``message`` attribute makes upstream call ``type(message=...)``) becomes
    ``RuntimeError(msg)``, the fallback upstream documents, instead of a TypeError about the constructor."""

    def __init__(self, index, **kwargs):
        super().__init__(**kwargs)
        self.index = index

    def reraise(self):
        try:
            super().reraise()
        except BaseException as e:
            e._fastdp_replica = self.index  # which replica failed (an out-of-memory rescue moves rows away from it)
            if isinstance(e, self.exc_type) or (type(e) is RuntimeError and str(e).startswith("Caught ")):
                raise
            msg = f"Caught {self.exc_type.__name__} {self.where}.\nOriginal {self.exc_msg}"
            error = RuntimeError(msg)
            error._fastdp_replica = self.index
            raise error from None


def _run(index, module, args, kwargs, device, stream, context, results, site=None):
    """Runs one replica; stores its output or an ExceptionWrapper in results[index]. ``site``: what runs the
    replica instead of calling it while the step records (fastdp._report.recorder.ReplicaSite), None otherwise.

    Any exception is caught, BaseException included (KeyboardInterrupt, SystemExit, GeneratorExit raised by the
    replica's code): it comes back to the caller as upstream's "Caught X in replica i on device d." and never
    ends the thread it ran on.
    """
    running = _step.running
    outer = running.steps
    try:
        with ExitStack() as stack:
            if context is not None:
                running.steps = context.steps
                stack.enter_context(torch.inference_mode(context.inference))
                stack.enter_context(torch.set_grad_enabled(context.grad_enabled))
            if device != _devices.CPU:
                stack.enter_context(torch.cuda.device(device))
                if stream is not None:
                    stack.enter_context(torch.cuda.stream(stream))
            if context is not None:
                for device_type, dtype in context.autocast:
                    stack.enter_context(
                        torch.autocast(device_type, dtype=dtype, enabled=True, cache_enabled=context.cache_enabled)
                    )
            if not isinstance(args, (list, tuple)):
                args = (args,)
            if site is None:
                results[index] = module(*args, **kwargs)
            else:
                results[index] = site(index, module, args, kwargs, device)
    except BaseException:
        results[index] = _ReplicaError(index, where=f"in replica {index} on device {device}")
    finally:
        running.steps = outer


class _Worker:
    """One daemon thread that runs replica tasks; between tasks it waits in the idle pool.

    A worker is handed out to one call at a time (taken from the idle pool, put back when its task is done), so a
    call made from inside a replica (nested wrappers, a wrapper called in ``forward``) never queues behind the
    busy worker it runs on: it gets an idle one or a new one. It keeps no reference to a task once it is done.
    """

    def __init__(self, serial):
        self._tasks = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=f"fastdp-replica-{serial}", daemon=True)
        self.thread.start()

    def submit(self, args, done, finished):
        self._tasks.put((args, done, finished))

    def _loop(self):
        while True:
            try:
                args, done, finished = self._tasks.get()
            except BaseException:  # an asynchronous exception while idle: keep serving
                continue
            index = args[0]
            try:
                _run(*args)
            except BaseException:  # _run stores every exception; nothing may end the loop
                pass
            finally:
                del args
                # Idle again before the caller is told, so its next call can reuse it (the same call may too:
                # a worker done with its replica can take a later one, hence one report per replica).
                kept = _release(self)
                finished[index] = True
                done.put(index)
                del done, finished
            if not kept:
                return


_IDLE = []  # workers waiting for a task
_IDLE_MAX = 64  # more idle workers than this (after a burst of nested calls) are let go
_POOL_LOCK = threading.Lock()
_SERIAL = [0]
_LIVENESS_S = 1.0  # how often a wait for replicas checks that the workers it waits on are alive


def _acquire():
    """An idle live worker, or a new one; never one that is running a task."""
    with _POOL_LOCK:
        while _IDLE:
            w = _IDLE.pop()
            if w.thread.is_alive():
                return w
        _SERIAL[0] += 1
        serial = _SERIAL[0]
    return _Worker(serial)


def _release(worker):
    """Puts a worker back in the idle pool; False when the pool is full (the worker then ends)."""
    with _POOL_LOCK:
        if len(_IDLE) < _IDLE_MAX:
            _IDLE.append(worker)
            return True
    return False


class _HoldSigint:
    """In the main thread, defers SIGINT (while Python's default handler is installed) to the end of the block,
    where it is raised as KeyboardInterrupt (also when the block raised: the interrupt then reaches the caller with
    that error as its context); elsewhere, or under another handler, it does nothing."""

    __slots__ = ("previous", "held")

    def __enter__(self):
        self.previous, self.held = None, False
        if threading.current_thread() is threading.main_thread():
            try:
                if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                    signal.signal(signal.SIGINT, self._hold)
                    self.previous = signal.default_int_handler
            except (ValueError, OSError):  # no signals here (embedded interpreter, subinterpreter)
                pass
        return self

    def _hold(self, signum, frame):
        self.held = True

    def __exit__(self, exc_type, exc, tb):
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
            if self.held:
                raise KeyboardInterrupt


def _wait(done, workers, finished):
    """Waits until every replica in `workers` (replica index -> its worker) is finished.

    ``finished[i]`` is the truth, set by the worker before it posts to `done`, which only wakes this wait up (an
    interrupt may land between taking a post and recording it). The wait is bounded by liveness checks: a worker
    whose thread ended before finishing raises RuntimeError instead of blocking forever. An interrupt
    (KeyboardInterrupt…) arriving while waiting is re-raised once the workers are done with the replicas, so the
    next call never rebinds modules still in use; a second interrupt while draining is re-raised at once.
    """
    pending = dict(workers)
    interrupted = None
    while True:
        dead = None
        try:
            for i in [i for i in pending if finished[i]]:
                del pending[i]
            if not pending:
                break
            try:
                done.get(timeout=_LIVENESS_S)
                continue
            except queue.Empty:
                pass
            dead = [i for i, w in pending.items() if not finished[i] and not w.thread.is_alive()]
        except BaseException as e:
            if interrupted is not None:
                e._fastdp_abandoned = True  # workers may still run replicas: the caller must not reuse them
                raise
            interrupted = e
            continue
        if dead:
            error = RuntimeError(
                f"fastdp: the worker thread(s) running replica(s) {dead} ended without reporting a result "
                "(interpreter shutting down?)"
            )
            if interrupted is None:
                raise error
            raise interrupted from error  # Ctrl-C reaches the caller as itself
    if interrupted is not None:
        raise interrupted


def _after_fork():
    # Threads do not survive a fork: the child starts its own workers.
    global _POOL_LOCK
    _IDLE.clear()
    _POOL_LOCK = threading.Lock()
    _step.running.steps = ()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


# Whether emulated "cpu" replicas run on worker threads (as CUDA replicas always do) rather than one after another
# in the calling thread. Internal: tests set it to cover the threaded path on machines without a GPU.
_CPU_THREADS = False


def _checked(modules, inputs, kwargs_tup, devices):
    """(kwargs_tup, normalised devices) with the defaults filled in, after upstream's checks (and texts)."""
    if len(modules) != len(inputs):
        raise AssertionError(
            f"The number of modules {len(modules)} is not equal to the number of inputs {len(inputs)}"
        )
    if kwargs_tup is not None:
        if len(modules) != len(kwargs_tup):
            raise AssertionError(
                f"The number of modules {len(modules)} is not equal to the number of kwargs_tup {len(kwargs_tup)}"
            )
    else:
        kwargs_tup = ({},) * len(modules)
    if devices is not None:
        if len(modules) != len(devices):
            raise AssertionError(
                f"The number of modules {len(modules)} is not equal to the number of devices {len(devices)}"
            )
        devices = [_devices.normalize(d) for d in devices]
    else:
        default = torch.cuda.current_device() if _devices.cuda_available() else _devices.CPU
        devices = [default] * len(modules)
    return kwargs_tup, devices


def parallel_apply(modules, inputs, kwargs_tup=None, devices=None):
    """Applies each module to its inputs (a tuple of args or a single object) and returns the outputs in order."""
    return run(modules, inputs, kwargs_tup, devices)


def run(modules, inputs, kwargs_tup=None, devices=None, site=None):
    """``parallel_apply`` with a ``site`` that runs each replica (DataParallel's recording; see ``_run``)."""
    kwargs_tup, devices = _checked(modules, inputs, kwargs_tup, devices)
    streams = [None if d == _devices.CPU else torch.cuda.current_stream(d) for d in devices]
    results = [None] * len(modules)

    threads = _on_threads(modules, devices)
    if site is not None:
        site.threads = threads  # whether replicas share the GIL (their time off the CPU is measured then)
    if len(modules) == 1:
        # Inline in the caller's thread: its grad mode and autocast state apply as they are.
        _run(0, modules[0], inputs[0], kwargs_tup[0], devices[0], streams[0], None, results, site)
    elif not threads:
        _run_in_turn(modules, inputs, kwargs_tup, devices, results, site)
    else:
        _run_on_workers(modules, inputs, kwargs_tup, devices, streams, results, site)

    for output in results:
        if isinstance(output, ExceptionWrapper):
            first_cause(results).reraise()
    return results


def _on_threads(modules, devices):
    """Whether the replicas run on worker threads: always for several replicas on a GPU; "cpu" replicas only when
    they must run at the same time (they meet in synced batch-norm layers), or a test asks for it."""
    return len(modules) > 1 and (_CPU_THREADS or any(d != _devices.CPU for d in devices) or needs_threads(modules))


def _run_in_turn(modules, inputs, kwargs_tup, devices, results, site):
    """Emulated host replicas: one after another in the caller's thread, each under the caller's thread-local
    state as a worker would be. Threads would buy nothing (their backward runs in the caller's thread anyway, and
    the forwards contend for the GIL); the first failing replica ends the call."""
    context = _Context(devices)
    for i in range(len(modules)):
        _run(i, modules[i], inputs[i], kwargs_tup[i], devices[i], None, context, results, site)
        if isinstance(results[i], ExceptionWrapper):
            break


def _run_on_workers(modules, inputs, kwargs_tup, devices, streams, results, site):
    """Replica 0 in the caller's thread, each other replica on a worker thread of its own; returns once every
    worker is done with its replica, whatever happened meanwhile."""
    context = _Context(devices)
    done = queue.SimpleQueue()
    finished = [False] * len(modules)
    workers = {}
    try:
        # Every worker is taken before any task is queued: one thread per replica, the same threads call after
        # call (a worker done early is not handed a second replica of this call). Ctrl-C is held back while
        # they are handed out: every task recorded in `workers` is queued, so the wait below always ends.
        with _HoldSigint():
            for i in range(1, len(modules)):
                workers[i] = _acquire()
            for i, w in workers.items():
                w.submit((i, modules[i], inputs[i], kwargs_tup[i], devices[i], streams[i], context, results,
                          site), done, finished)
        # Replica 0 runs here while the workers run the others; its thread-local state is re-entered like
        # theirs. An interrupt that reaches this thread while it runs replica 0 is stored like any exception.
        _run(0, modules[0], inputs[0], kwargs_tup[0], devices[0], streams[0], context, results, site)
    finally:
        _wait(done, workers, finished)
