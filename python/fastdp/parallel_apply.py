"""``parallel_apply(modules, inputs, kwargs_tup=None, devices=None)``: runs each replica on its inputs.

Replica 0 runs in the calling thread; the others run on persistent worker threads (one per replica index, started
once per process and reused by every call, instead of upstream's new threads every step). Each worker re-enters
the caller's grad mode, inference mode, autocast state (enabled flag and dtype), device and current stream;
exceptions come back as "Caught X in replica i on device d." with the original traceback, the lowest replica
index first. Differences from upstream: the autocast dtype (not only the enabled flag) and inference mode reach
the workers, so bf16 autocast stays bf16 inside replicas.
"""

import os
import queue
import threading
from contextlib import ExitStack

import torch
from torch._utils import ExceptionWrapper

from . import _devices

__all__ = ["parallel_apply"]


def _autocast_state(device_types):
    """The caller's autocast settings per device type, re-entered in each worker."""
    state = []
    for device_type in device_types:
        if torch.is_autocast_enabled(device_type):
            state.append((device_type, torch.get_autocast_dtype(device_type)))
    return tuple(state)


class _Context:
    """Thread-local state captured in the caller and re-applied in each worker."""

    __slots__ = ("grad_enabled", "inference", "autocast", "cache_enabled")

    def __init__(self, devices):
        self.grad_enabled = torch.is_grad_enabled()
        self.inference = torch.is_inference_mode_enabled()
        types = ["cpu"]
        if any(d != _devices.CPU for d in devices):
            types.append("cuda")
        self.autocast = _autocast_state(types)
        self.cache_enabled = torch.is_autocast_cache_enabled()


def _run(index, module, args, kwargs, device, stream, context, results):
    """Runs one replica; stores its output or an ExceptionWrapper in results[index]."""
    try:
        with ExitStack() as stack:
            if context is not None:
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
            results[index] = module(*args, **kwargs)
    except Exception:
        results[index] = ExceptionWrapper(where=f"in replica {index} on device {device}")


class _Worker:
    """One daemon thread that runs replica tasks in order; it keeps no reference to a task once it is done."""

    def __init__(self, index):
        self._tasks = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=f"fastdp-replica-{index}", daemon=True)
        self._thread.start()

    def submit(self, args, done):
        self._tasks.put((args, done))

    def _loop(self):
        while True:
            args, done = self._tasks.get()
            try:
                _run(*args)
            finally:
                del args
                done.put(None)
                del done


_WORKERS = {}
_WORKERS_LOCK = threading.Lock()


def _worker(index):
    """The persistent worker for replica `index`, started on first use (threads cannot outlive a fork: a child
    process starts its own)."""
    w = _WORKERS.get(index)
    if w is None or not w._thread.is_alive():
        with _WORKERS_LOCK:
            w = _WORKERS.get(index)
            if w is None or not w._thread.is_alive():
                w = _WORKERS[index] = _Worker(index)
    return w


def _after_fork():
    _WORKERS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def parallel_apply(modules, inputs, kwargs_tup=None, devices=None):
    """Applies each module to its inputs (a tuple of args or a single object) and returns the outputs in order."""
    # Upstream's checks and texts.
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
    streams = [None if d == _devices.CPU else torch.cuda.current_stream(d) for d in devices]
    results = [None] * len(modules)

    if len(modules) == 1:
        # Inline in the caller's thread: its grad mode and autocast state apply as they are.
        _run(0, modules[0], inputs[0], kwargs_tup[0], devices[0], streams[0], None, results)
    else:
        context = _Context(devices)
        done = queue.SimpleQueue()
        for i in range(1, len(modules)):
            _worker(i).submit((i, modules[i], inputs[i], kwargs_tup[i], devices[i], streams[i], context, results), done)
        # Replica 0 runs here while the workers run the others; its thread-local state is re-entered like theirs.
        _run(0, modules[0], inputs[0], kwargs_tup[0], devices[0], streams[0], context, results)
        for _ in range(1, len(modules)):
            done.get()

    for output in results:
        if isinstance(output, ExceptionWrapper):
            output.reraise()
    return results
