"""Autograd Functions that connect replicas to the master module: Broadcast, ReduceAddCoalesced, Scatter, Gather.

They mirror ``torch.nn.parallel._functions`` on top of ``fastdp.comm`` and also run on emulated "cpu" devices
(upstream asserts "not implemented for CPU tensors"). Devices are normalised lists (all ints or all "cpu"), which
fastdp.comm accepts as they are; it also keeps complex tensors complex.
Deliberate difference: gradients that no replica produced stay None instead of being reduced as zeros, so a
parameter unused by every replica ends with ``.grad is None``, as with the bare module.
"""

import warnings

import torch
from torch.autograd import Function

from .._platform import devices as _devices, streams as _streams
from .. import comm


def _caller_streams(*device_lists):
    """The caller's current stream of each CUDA device a function moves data between, taken in forward, for its
    backward. Autograd runs a node on its first device's thread with only that device's stream made current; the
    thread's stream of every other device is the default one. The replicas' gradients are made on the caller's
    streams (where the replicas ran) and belong to them: work on them listed on the default streams would leave
    their memory going back to the caller's streams unordered with it."""
    return _streams.current([d for devices in device_lists for d in devices if isinstance(d, int) and d >= 0])


def broadcast_coalesced(tensors, devices):
    """comm.broadcast_coalesced over tensors that may contain None; returns one list per device."""
    present = [i for i, t in enumerate(tensors) if t is not None]
    rows = [[None] * len(tensors) for _ in devices]
    if present:
        copies = comm.broadcast_coalesced([tensors[i] for i in present], list(devices))
        for row, dev_copies in zip(rows, copies):
            for i, c in zip(present, dev_copies):
                row[i] = c
    return rows


class Broadcast(Function):
    """Copies tensors from their device (entry 0) to every target; backward sums the replicas' gradients."""

    @staticmethod
    def forward(ctx, target_devices, *inputs):
        ctx.set_materialize_grads(False)
        ctx.target_devices = tuple(target_devices)
        ctx.num_inputs = len(inputs)
        first = next((t for t in inputs if t is not None), None)
        ctx.input_device = _devices.of_tensor(first) if first is not None else target_devices[0]
        if not inputs:
            return ()
        rows = broadcast_coalesced(inputs, target_devices)
        outputs = tuple(t for row in rows for t in row)
        non_diff = [
            t for k, t in enumerate(outputs) if t is not None and not ctx.needs_input_grad[1 + k % len(inputs)]
        ]
        ctx.mark_non_differentiable(*non_diff)
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        return (None,) + ReduceAddCoalesced.apply(
            ctx.input_device, ctx.target_devices, ctx.num_inputs, *grad_outputs
        )


class ReduceAddCoalesced(Function):
    """Sums per-device gradient lists (device-major, ``num_inputs`` per device) onto ``destination``.

    Columns where no device has a gradient give None; partially present columns count the missing ones as zero.
    Its backward broadcasts again, so double backward works.
    """

    @staticmethod
    def forward(ctx, destination, target_devices, num_inputs, *grads):
        ctx.set_materialize_grads(False)
        ctx.target_devices = tuple(target_devices)
        ctx.present = tuple(g is not None for g in grads)
        n_dev = len(grads) // num_inputs if num_inputs else 0
        rows = [list(grads[d * num_inputs : (d + 1) * num_inputs]) for d in range(n_dev)]
        result = [None] * num_inputs
        columns = []
        for j in range(num_inputs):
            column = [row[j] for row in rows]
            ref = next((g for g in column if g is not None), None)
            if ref is None:
                continue
            for d, g in enumerate(column):
                if g is None:
                    rows[d][j] = torch.zeros_like(ref, device=_devices.torch_device(target_devices[d]))
            columns.append(j)
        if columns:
            per_device = [[row[j] for j in columns] for row in rows]
            reduced = comm.reduce_add_coalesced(per_device, destination)
            for j, r in zip(columns, reduced):
                result[j] = r
        return tuple(result)

    @staticmethod
    def backward(ctx, *grad_outputs):
        grads = Broadcast.apply(ctx.target_devices, *grad_outputs)
        grads = tuple(g if present else None for g, present in zip(grads, ctx.present))
        return (None, None, None) + grads


_PIN_MIN_BYTES = 1 << 20


def _scatter_host_to_cuda(input, target_devices, chunk_sizes, dim):
    """A CPU batch straight to each GPU, every chunk its own host-to-device copy (nothing staged on device 0).

    Every copy is asynchronous, on each device's current stream: batches of 1 MiB and more go through pinned memory
    (torch's own copy is used for that because only its pinned-memory allocator knows when a pinned block may be
    reused); smaller ones are copied from where they are, since the driver has read pageable host memory by the
    time the copy call returns. A blocking copy would wait for the device on every step.
    """
    sizes = chunk_sizes if chunk_sizes is not None else comm.torch_chunk_sizes(input.size(dim), len(target_devices))
    src = input
    if not src.is_pinned() and src.numel() * src.element_size() >= _PIN_MIN_BYTES:
        src = src.pin_memory()
    chunks = src.split(list(sizes), dim)
    return tuple(c.to(_devices.torch_device(d), non_blocking=True) for c, d in zip(chunks, target_devices))


class Scatter(Function):
    """Splits ``input`` along ``dim`` onto the target devices; backward gathers the gradient to its device."""

    @staticmethod
    def forward(ctx, target_devices, chunk_sizes, dim, input):
        ctx.dim = dim
        ctx.input_device = _devices.of_tensor(input)
        ctx.streams = _caller_streams(target_devices, (ctx.input_device,))
        if input.device.type == "cpu" and target_devices and target_devices[0] != _devices.CPU:
            return _scatter_host_to_cuda(input, target_devices, chunk_sizes, dim)
        return tuple(comm.scatter(input, list(target_devices), chunk_sizes, dim))

    @staticmethod
    def backward(ctx, *grad_outputs):
        with _streams.entered(ctx.streams):
            return (None, None, None, Gather.apply(ctx.input_device, ctx.dim, *grad_outputs))


class Gather(Function):
    """Concatenates the replicas' tensors along ``dim`` on ``target_device``; 0-dim inputs become a vector."""

    @staticmethod
    def forward(ctx, target_device, dim, *inputs):
        ctx.dim = dim
        ctx.input_devices = tuple(_devices.of_tensor(t) for t in inputs)
        ctx.streams = _caller_streams(ctx.input_devices, (target_device,))
        ctx.unsqueezed_scalar = False
        if dim == 0 and all(t.dim() == 0 for t in inputs):
            inputs = tuple(t.view(1) for t in inputs)
            # Upstream's text (torch.nn.parallel._functions.Gather).
            warnings.warn(
                "Was asked to gather along dimension 0, but all input tensors were scalars; "
                "will instead unsqueeze and return a vector.",
                stacklevel=2,
            )
            ctx.unsqueezed_scalar = True
        ctx.input_sizes = tuple(t.size(ctx.dim) for t in inputs)
        return comm.gather(inputs, ctx.dim, target_device)

    @staticmethod
    def backward(ctx, grad_output):
        with _streams.entered(ctx.streams):
            scattered = Scatter.apply(ctx.input_devices, ctx.input_sizes, ctx.dim, grad_output)
        if ctx.unsqueezed_scalar:
            scattered = tuple(g[0] for g in scattered)
        return (None, None) + scattered
