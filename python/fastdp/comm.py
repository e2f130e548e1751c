"""Collectives with the names, signatures, results and messages of ``torch.nn.parallel.comm``, on fastdp's C core.

Devices are what upstream accepts (ints, ``"cuda:k"``, ``torch.device``) plus ``"cpu"`` /
``torch.device("cpu")`` entries, served by the host backend. Every entry of a device list is a distinct device:
the first entry holding the source returns the source itself (as upstream does for the source device), every
other entry gets storage of its own. CPU and CUDA entries cannot be mixed in one list.

Deliberate differences from upstream, all documented in README.md: complex tensors keep their dtype (upstream
returns real views); int16 and other dtypes NCCL lacks work (upstream raises "Unconvertible NCCL type");
``reduce_add`` accepts CPU tensors and defaults to their device.
"""

import operator
import warnings

import torch

from . import _devices
from ._fallback import core as _C  # _C, with torch behind every data-moving call
from ._core import dtype_key, prepare, reduce_columns, streams_for, to_core_dtype

__all__ = [
    "broadcast",
    "broadcast_coalesced",
    "reduce_add",
    "reduce_add_coalesced",
    "scatter",
    "gather",
]

_CPU = torch.device("cpu")


def _device(d, what, allow_none=False):
    """One device-list entry → torch.device ("cpu" or "cuda:k"): fastdp._devices.normalize, with upstream's None."""
    if d is None:
        if allow_none:
            return None
        raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{d}")
    return _devices.torch_device(_devices.normalize(d, what))


def _device_list(devices, what="devices"):
    if devices is None:
        raise TypeError(f"'{what}' must be an iterable of devices, got None")
    if isinstance(devices, (str, torch.device, int)):
        raise TypeError(f"'{what}' must be an iterable of devices, got a single {type(devices).__name__}")
    try:
        out = [_device(d, what) for d in devices]
    except _C.BackendUnavailableError:
        devices = list(devices)
        if any(isinstance(d, (str, torch.device)) and str(d).startswith("cpu") for d in devices):
            raise ValueError(
                f"'{what}' mixes CPU and CUDA devices ({devices}); use \"cpu\" entries only (emulated devices)"
            ) from None
        raise
    except TypeError as e:
        if "iterable" in str(e) or "not iterable" in str(e):
            raise TypeError(f"'{what}' must be an iterable of devices, got {type(devices).__name__}") from None
        raise
    kinds = {d.type for d in out}
    if len(kinds) > 1:
        raise ValueError(
            f"'{what}' mixes CPU and CUDA devices ({[str(d) for d in out]}); use \"cpu\" entries only "
            "(emulated devices) or CUDA devices only"
        )
    return out


def _check_tensor(t, what):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"'{what}' must be a torch.Tensor, got {type(t).__name__}")


def _check_tensors(ts, what):
    if isinstance(ts, torch.Tensor) or not hasattr(ts, "__iter__"):
        raise TypeError(f"'{what}' must be a sequence of tensors, got {type(ts).__name__}")
    ts = list(ts)
    for i, t in enumerate(ts):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"'{what}'[{i}] must be a torch.Tensor, got {type(t).__name__}")
    return ts


def _source_slots(devices, source_device):
    """Index of the entry that may hand out the source itself: the first equal to the source's device."""
    for i, d in enumerate(devices):
        if d == source_device:
            return i
    return -1


def _empty_like(t, device):
    """A fresh tensor shaped like t on device; same strides when t is dense (channels_last kept)."""
    return torch.empty_like(t, device=device)


def broadcast(tensor, devices=None, *, out=None):
    """Copies ``tensor`` to each device (or into each ``out`` tensor); see ``torch.nn.parallel.comm.broadcast``."""
    _check_tensor(tensor, "tensor")
    if not ((devices is None) ^ (out is None)):
        raise RuntimeError(
            f"Exactly one of 'devices' and 'out' must be specified, but got devices={devices} and out={out}"
        )
    src = prepare(tensor) if tensor.layout == torch.strided else tensor
    if devices is not None:
        devices = _device_list(devices)
        if not devices:
            raise ValueError("'devices' must name at least one device")
        own = _source_slots(devices, tensor.device)
        if tensor.layout != torch.strided:  # sparse: copied by torch, as upstream's copy path does
            return tuple(tensor if i == own else tensor.to(d, copy=True) for i, d in enumerate(devices))
        results = [tensor if i == own else _empty_like(src, d) for i, d in enumerate(devices)]
        targets = [r for i, r in enumerate(results) if i != own]
    else:
        results = _check_tensors(out, "out")
        if not results:
            raise ValueError("'out' must hold at least one tensor")
        for i, o in enumerate(results):
            if o.device.type != results[0].device.type or o.device.type not in ("cpu", "cuda"):
                raise RuntimeError(
                    f"Expected all output tensors to be CUDA tensors, but output tensor at index {i} has "
                    f"device '{o.device}' (fastdp also accepts all-CPU outputs, not a mix)"
                )
            if o.shape != tensor.shape:
                raise RuntimeError(
                    f"Expected all output tensors to have same shape as the source (shape {list(tensor.shape)}) "
                    f"in order to broadcast, but output tensor at index {i} has shape {list(o.shape)}"
                )
            if o.dtype != tensor.dtype:
                raise RuntimeError(
                    f"Expected all output tensors to have the dtype of the source ({tensor.dtype}), but output "
                    f"tensor at index {i} is {o.dtype}"
                )
        targets = [o for o in results if o is not tensor]
    if targets:
        _C.broadcast(src, targets, streams_for([src, *targets]))
    return tuple(results)


def _plan(tensors, buffer_size):
    if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size <= 0:
        raise ValueError(f"'buffer_size' must be a positive int (bytes), got {buffer_size!r}")
    return _C.plan(tensors, [dtype_key(t.dtype) for t in tensors], buffer_size)


def _split(flat, sizes, like):
    """Views of a flat buffer, one per member, shaped like the tensors in `like`."""
    return [piece.view(t.shape) for piece, t in zip(flat.split(sizes), like)]


_COLLECTIVE = None


def _collective(devices):
    """True when NCCL serves this device list: distinct CUDA devices and a usable nccl backend."""
    global _COLLECTIVE
    if devices[0].type != "cuda" or len(set(devices)) != len(devices):
        return False
    if _COLLECTIVE is None:
        # The backend's own check loads libraries and counts devices; it creates no CUDA context on any GPU
        # (_C.info() would, to read free memory).
        _COLLECTIVE = bool(_C.usable("nccl")[0])
    return _COLLECTIVE


def broadcast_coalesced(tensors, devices, buffer_size=10485760):
    """Broadcasts many tensors in dtype buckets of ``buffer_size`` bytes; entry 0 returns the inputs themselves."""
    tensors = _check_tensors(tensors, "tensors")
    devices = _device_list(devices)
    if not devices:
        raise ValueError("'devices' must name at least one device")
    for i, t in enumerate(tensors):
        if t.device != devices[0]:
            raise RuntimeError(
                f"All tensors must be on devices[0]: {devices[0]}, but tensor at index {i} is on {t.device}"
            )
    outputs = [list(tensors)] + [[None] * len(tensors) for _ in devices[1:]]
    sparse = [i for i, t in enumerate(tensors) if t.is_sparse]
    for i in sparse:  # Sparse tensors are rare here; their pieces are broadcast one by one.
        copies = broadcast(tensors[i].coalesce(), devices)
        for k in range(1, len(devices)):
            outputs[k][i] = copies[k]
    dense_idx = [i for i, t in enumerate(tensors) if not t.is_sparse]
    dense = [prepare(tensors[i]) for i in dense_idx]
    if not dense or len(devices) == 1:
        return tuple(outputs)
    collective = _collective(devices)
    for numel, members in _plan(dense, buffer_size):
        idx = [i for i, _, _ in members]
        sizes = [n for _, _, n in members]
        srcs = [dense[i] for i in idx]
        flats = [torch.empty(numel, dtype=srcs[0].dtype, device=d) for d in devices[1:]]
        views = [_split(flat, sizes, srcs) for flat in flats]
        if collective:  # NCCL broadcasts one packed buffer from devices[0]
            if len(srcs) == 1 and srcs[0].is_contiguous():
                src_flat = srcs[0].view(-1)
            else:
                src_flat = torch.empty(numel, dtype=srcs[0].dtype, device=devices[0])
                _C.copy(_split(src_flat, sizes, srcs), srcs, streams_for([src_flat]))
            _C.broadcast(src_flat, flats, streams_for([src_flat, *flats]))
        else:  # host entries or repeated CUDA ids: copy every member straight into every flat, in one call
            dsts = [v for vs in views for v in vs]
            _C.copy(dsts, srcs * len(flats), streams_for([*srcs, *flats]))
        for k, vs in enumerate(views, start=1):
            for i, v in zip(idx, vs):
                # Views of one flat buffer, each with its own version counter (as upstream's).
                outputs[k][dense_idx[i]] = v.data
    return tuple(outputs[0] if k == 0 else outputs[k] for k in range(len(devices)))


def _sum(inputs, destination):
    """A new tensor on destination holding inputs[0] + inputs[1] + ... (dense, same shape and dtype)."""
    dense = [prepare(t).contiguous() for t in inputs]
    result = torch.empty(dense[0].shape, dtype=dense[0].dtype, device=destination)
    reduce_columns([[to_core_dtype(t) for t in dense]], [to_core_dtype(result)])
    return result


def reduce_add(inputs, destination=None):
    """Sums tensors from several devices onto ``destination``; see ``torch.nn.parallel.comm.reduce_add``."""
    inputs = _check_tensors(inputs, "inputs")
    if not inputs:
        raise ValueError("reduce_add expects at least one input tensor")
    on_cpu = [t.device.type == "cpu" for t in inputs]
    if any(on_cpu) and not all(on_cpu):
        i = on_cpu.index(not on_cpu[0])
        raise ValueError(
            f"reduce_add: input {i} is on {inputs[i].device} but input 0 is on {inputs[0].device}; "
            "CPU and CUDA inputs cannot be mixed"
        )
    for i, t in enumerate(inputs):
        if t.device.type not in ("cpu", "cuda"):
            raise ValueError(
                f"reduce_add: input {i} is on a {t.device.type} device; fastdp sums CPU and CUDA tensors only"
            )
    if destination is None:
        destination = inputs[0].device if all(on_cpu) else torch.device("cuda", torch.cuda.current_device())
    destination = _device(destination, "destination")
    input_size = inputs[0].size()
    root_index = None
    for i, inp in enumerate(inputs):
        if inp.device == destination:
            root_index = i
        if inp.size() != input_size:
            got = "x".join(str(x) for x in inp.size())
            expected = "x".join(str(x) for x in input_size)
            raise ValueError(f"input {i} has invalid size: got {got}, but expected {expected}")
        if inp.dtype != inputs[0].dtype:
            raise ValueError(f"input {i} has dtype {inp.dtype}, but input 0 has {inputs[0].dtype}; cast them first")
    if root_index is None:
        raise RuntimeError("reduce_add expects destination to be on the same GPU with one of the tensors")
    if len(inputs) == 1:
        return inputs[0]
    if any(t.is_sparse for t in inputs):
        result = inputs[0].to(destination)
        for t in inputs[1:]:
            result = result + t.to(destination)
        return result
    try:
        return _sum(inputs, destination)
    except TypeError as e:
        if "dtype not supported" not in str(e):
            raise
        raise TypeError(f"reduce_add: cannot sum {inputs[0].dtype} tensors ({e})") from None


def reduce_add_coalesced(inputs, destination=None, buffer_size=10485760):
    """Sums lists of tensors (one list per device) in dtype buckets; see upstream's ``reduce_add_coalesced``."""
    if isinstance(inputs, torch.Tensor) or not hasattr(inputs, "__iter__"):
        raise TypeError(f"'inputs' must be a sequence of sequences of tensors, got {type(inputs).__name__}")
    per_device = [_check_tensors(ts, f"inputs[{k}]") for k, ts in enumerate(inputs)]
    if not per_device:
        raise ValueError("reduce_add_coalesced expects at least one list of tensors")
    count = len(per_device[0])
    for k, ts in enumerate(per_device):
        if len(ts) != count:
            raise ValueError(f"inputs[{k}] holds {len(ts)} tensors, but inputs[0] holds {count}")
    outputs = [None] * count
    dense_cols = []
    for j in range(count):
        column = [ts[j] for ts in per_device]
        if all(t.is_sparse for t in column):
            outputs[j] = reduce_add(column, destination)
        else:
            dense_cols.append(j)
    if not dense_cols:
        return tuple(outputs)
    columns = [[per_device[k][j] for j in dense_cols] for k in range(len(per_device))]
    columns = [[t.to_dense() if t.is_sparse else t for t in ts] for ts in columns]
    for j_pos, j in enumerate(dense_cols):  # validate once, with upstream's messages
        col = [ts[j_pos] for ts in columns]
        for k, t in enumerate(col):
            if t.size() != col[0].size():
                got = "x".join(str(x) for x in t.size())
                expected = "x".join(str(x) for x in col[0].size())
                raise ValueError(f"input {k} has invalid size: got {got}, but expected {expected}")
            if t.dtype != col[0].dtype:
                raise ValueError(f"input {k} has dtype {t.dtype} for tensor {j}, but input 0 has {col[0].dtype}")
    if len(per_device) == 1:
        ref = columns[0]
        dest = _device(destination, "destination") if destination is not None else ref[0].device
        for j_pos, j in enumerate(dense_cols):
            outputs[j] = ref[j_pos] if ref[j_pos].device == dest else ref[j_pos].to(dest)
        return tuple(outputs)
    ref = [prepare(t) for t in columns[0]]
    for numel, members in _plan(ref, buffer_size):
        idx = [i for i, _, _ in members]
        sizes = [n for _, _, n in members]
        flats = []
        for ts in columns:
            srcs = [prepare(ts[i]) for i in idx]
            flat = torch.empty(numel, dtype=srcs[0].dtype, device=srcs[0].device)
            _C.copy(_split(flat, sizes, srcs), srcs, streams_for([flat, *srcs]))
            flats.append(flat)
        flat_result = reduce_add(flats, destination)
        for i, v in zip(idx, _split(flat_result, sizes, [ref[i] for i in idx])):
            outputs[dense_cols[i]] = v.data
    return tuple(outputs)


def _chunk_sizes(size, n):
    """torch.chunk's rule: pieces of ceil(size/n), the last one short, fewer than n pieces when they run out."""
    if size == 0:
        return [0] * n
    step = -(-size // n)
    return [min(step, size - start) for start in range(0, size, step)]


def _wrap_dim(dim, ndim, what="dim"):
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"'{what}' must be an int, got {type(dim).__name__}")
    if ndim == 0:
        raise RuntimeError(f"{what}: cannot split or join a 0-dimensional tensor (it has no dim {dim})")
    if not -ndim <= dim < ndim:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-ndim}, {ndim - 1}], but got {dim})")
    return dim % ndim


def _cuda_streams(streams, devices):
    """Explicit streams (one per target device, None allowed) → that list, checked; None → None."""
    if streams is None:
        return None
    streams = list(streams)
    if len(streams) != len(devices):
        raise ValueError(f"Expected one stream per device: got {len(streams)} streams for {len(devices)} devices")
    for i, (s, d) in enumerate(zip(streams, devices)):
        if s is None or d.type != "cuda":
            continue
        if s.device != d:
            raise RuntimeError(
                f"Expected the device associated with the stream at index {i} (was {s.device.index}) to match "
                f"the device supplied at that index (expected {d.index})"
            )
    return streams


def _scatter_streams(src, devices, streams):
    """{device index: stream} of a scatter with explicit streams, the one stream the core orders each device's work
    on. The source's device keeps its current stream, the one whose work produced the source: every copy waits
    for it there, and it waits for the copies before the source's memory can be reused. A target gets its given
    stream (its current one where None); a device listed twice uses the stream of its first entry."""
    chosen = {}
    if src.is_cuda:
        chosen[src.get_device()] = torch.cuda.current_stream(src.device)
    for s, d in zip(streams, devices):
        if d.type == "cuda" and d.index not in chosen:
            chosen[d.index] = s if s is not None else torch.cuda.current_stream(d)
    return chosen


def scatter(tensor, devices=None, chunk_sizes=None, dim=0, streams=None, *, out=None):
    """Splits ``tensor`` along ``dim`` across devices (or into ``out``); see upstream's ``comm.scatter``."""
    _check_tensor(tensor, "tensor")
    src = prepare(tensor)
    if out is not None:
        if devices is not None:
            raise RuntimeError(f"'devices' must not be specified when 'out' is specified, but got devices={devices}")
        if chunk_sizes is not None:
            raise RuntimeError(
                f"'chunk_sizes' must not be specified when 'out' is specified, but got chunk_sizes={chunk_sizes}"
            )
        outs = _check_tensors(out, "out")
        if not outs:
            raise RuntimeError("Expected at least one output tensor to scatter to")
        d = _wrap_dim(dim, tensor.dim())
        for i, o in enumerate(outs):
            if o.device.type != outs[0].device.type or o.device.type not in ("cpu", "cuda"):
                raise RuntimeError(
                    f"Expected all output tensors to be CUDA tensors, but output tensor at index {i} has device "
                    f"'{o.device}' (fastdp also accepts all-CPU outputs, not a mix)"
                )
            expect = list(tensor.shape)
            expect[d] = o.shape[d] if o.dim() == tensor.dim() else expect[d]
            if list(o.shape) != expect or o.dtype != tensor.dtype:
                raise RuntimeError(
                    f"Output tensor at index {i} has incorrect shape: {list(o.shape)} ({o.dtype}). Expected same "
                    f"shape except for scatter dim {d} as the source tensor: {list(tensor.shape)} ({tensor.dtype})."
                )
        total = sum(o.shape[d] for o in outs)
        if total != tensor.shape[d]:
            raise RuntimeError(
                f"Total size for output tensors along scatter dim {d} does not match the source tensor size at dim "
                f"{d}. Expected {tensor.shape[d]}, but got total size {total}."
            )
        _C.scatter(src, outs, d, [o.shape[d] for o in outs], streams_for([src, *outs]))
        return tuple(outs)

    devices = _device_list(devices)
    if not devices:
        raise RuntimeError("Expected at least one device to scatter to")
    d = _wrap_dim(dim, tensor.dim())
    size = tensor.shape[d]
    if chunk_sizes is None:
        sizes = _chunk_sizes(size, len(devices))
    else:
        if isinstance(chunk_sizes, (int, torch.Tensor)) or not hasattr(chunk_sizes, "__iter__"):
            raise TypeError(f"'chunk_sizes' must be a sequence of ints, got {type(chunk_sizes).__name__}")
        sizes = list(chunk_sizes)
        if len(sizes) != len(devices):
            raise RuntimeError(
                f"Expected devices and chunk_sizes to be of same length, but got len(chunk_sizes) == {len(sizes)} "
                f"and len(devices) == {len(devices)}"
            )
        for i, s in enumerate(sizes):
            if isinstance(s, (bool, torch.Tensor)) or not hasattr(s, "__index__"):
                raise TypeError(f"'chunk_sizes'[{i}] must be an int, got {type(s).__name__}")
            sizes[i] = s = operator.index(s)  # numpy integers too, as DataParallel's chunk_sizes accepts
            if s < 0:
                raise RuntimeError(f"'chunk_sizes'[{i}] is {s}; chunk sizes must be non-negative")
        if sum(sizes) != size:
            raise RuntimeError(
                f"chunk_sizes {sizes} add up to {sum(sizes)}, but the tensor has {size} elements along dim {d}; "
                "they must add up exactly"
            )
    used = devices[: len(sizes)]
    given = _cuda_streams(streams, used)
    chosen = None if given is None else _scatter_streams(src, used, given)
    own = _source_slots(used, tensor.device)
    results, start = [], 0
    for i, (dev, n) in enumerate(zip(used, sizes)):
        view = src.narrow(d, start, n)
        start += n
        if i == own:  # the source's own entry gets a view, which the core recognises and skips
            results.append(view)
        elif chosen is None or dev.type != "cuda":
            results.append(_empty_like(view, dev))
        else:
            # As upstream: allocated with the stream that writes it current, so that PyTorch's caching allocator
            # ties the block to that stream (no reuse before the copy into it has run).
            with torch.cuda.stream(chosen[dev.index]):
                results.append(_empty_like(view, dev))
    if chosen is None:
        stream_pairs = streams_for([src, *results])
    else:
        stream_pairs = [(k, s.cuda_stream) for k, s in chosen.items()]
    _C.scatter(src, results, d, sizes, stream_pairs)
    return tuple(results)


def gather(tensors, dim=0, destination=None, *, out=None):
    """Concatenates tensors along ``dim`` on one device (or into ``out``); see upstream's ``comm.gather``."""
    tensors = _check_tensors(tensors, "tensors")
    if out is not None:
        if destination is not None:
            raise RuntimeError(
                f"'destination' must not be specified when 'out' is specified, but got destination={destination}"
            )
        _check_tensor(out, "out")
    if not tensors:
        raise RuntimeError("Expected at least one tensor to gather from")
    first = tensors[0]
    kinds = {t.device.type for t in tensors}
    if len(kinds) > 1 or not kinds <= {"cpu", "cuda"}:
        i = next(i for i, t in enumerate(tensors) if t.device.type not in ("cpu", "cuda") or
                 t.device.type != first.device.type)
        raise RuntimeError(
            f"Expected all input tensors to be CUDA tensors, but input tensor at index {i} has device "
            f"'{tensors[i].device}' (fastdp also accepts all-CPU inputs, not a mix)"
        )
    d = _wrap_dim(dim, first.dim())
    for i, t in enumerate(tensors):
        if t.dim() != first.dim():
            raise RuntimeError(
                f"Expected all input tensors to have the same number of dimensions, but input tensor at index {i} "
                f"has {t.dim()} dimensions, (expected {first.dim()})"
            )
        expect = list(first.shape)
        expect[d] = t.shape[d]
        if list(t.shape) != expect:
            raise RuntimeError(
                f"Input tensor at index {i} has invalid shape {list(t.shape)}, but expected {expect} "
                f"(all dimensions but {d} must match input 0)"
            )
        if t.dtype != first.dtype:
            raise RuntimeError(f"Input tensor at index {i} has dtype {t.dtype}, but input 0 has {first.dtype}")
    total = list(first.shape)
    total[d] = sum(t.shape[d] for t in tensors)
    if out is None:
        if destination == -1:
            warnings.warn(
                'Using -1 to represent CPU tensor is deprecated. Please use a device object or string instead, e.g., "cpu".',
                FutureWarning,
                stacklevel=2,
            )
            dest = _CPU
        elif destination is None:
            dest = first.device if first.device.type == "cpu" else torch.device("cuda", torch.cuda.current_device())
        else:
            dest = _device(destination, "destination")
        formats = {_memory_format(t) for t in tensors}
        fmt = formats.pop() if len(formats) == 1 else torch.contiguous_format
        out = torch.empty(total, dtype=first.dtype, device=dest, memory_format=fmt)
    else:
        if list(out.shape) != total or out.dtype != first.dtype:
            raise RuntimeError(
                f"Expected out tensor to have shape {total} and dtype {first.dtype}, but got {list(out.shape)} "
                f"and {out.dtype}"
            )
    ins = [prepare(t) for t in tensors]
    _C.gather(ins, out, d, streams_for([*ins, out]))
    return out


def _memory_format(t):
    if t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if t.dim() == 5 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format
