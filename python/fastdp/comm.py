"""Collectives with the names, signatures, results and messages of ``torch.nn.parallel.comm``, on fastdp's C core.

Devices are what upstream accepts (ints, ``"cuda:k"``, ``torch.device``) plus ``"cpu"`` /
``torch.device("cpu")`` entries, served by the host backend. Every entry of a device list is a distinct device:
the first entry holding the source returns the source itself (as upstream does for the source device), every
other entry gets storage of its own. CPU and CUDA entries cannot be mixed in one list.

Deliberate differences from upstream, all documented in README.md (its API section): complex tensors keep their
dtype (upstream returns real views); int16 and other dtypes NCCL lacks work (upstream raises "Unconvertible NCCL
type"); ``reduce_add`` accepts CPU tensors and defaults to their device.

Who checks what (one owner per check, as upstream's comm.py normalises and comm.cpp checks):
- This module owns every check on the user's arguments as upstream's Python and C++ word them (types, device
  lists, ``out``/``devices``/``destination`` exclusions, shapes and dtypes across the lists, ``chunk_sizes``,
  ``dim``), with upstream's exception types and texts (those of upstream's comm.cpp, which needs CUDA to run, are
  kept in tests/test_comm_messages.py); it runs them before anything reaches the core, so the core's own checks of
  the same facts never fire from here.
- The core (csrc/core/ops.c) owns what a direct C caller needs as much as we do, and this module does not repeat
  it: descriptor validity, overlapping writes (PyTorch's texts), dtypes a sum supports, and the scatter chunks'
  total against the source (upstream's "Total size ..." text, raised as RuntimeError here as comm.cpp does).
- Which backend runs an operation is the core's decision too (NOTE [routing] in csrc/core/backend.h); the
  backends assert what the core established and check nothing twice.
"""

import operator
import warnings

import torch

from . import _C
from ._platform import devices as _devices
from ._native import route as _route
from ._native.core import dtype_key, open_peers, prepare, reduce_columns, streams_for, to_core_dtype

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
    """One device-list entry → torch.device ("cpu" or "cuda:k"): fastdp._platform.devices.normalize, with
    upstream's None."""
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


def _first_failure(items, checks):
    """The message of the first check that fails, item by item and check by check; None when all pass. Each check is
    check(i, item) -> message or None, so that an item's first fault is reported before a later item's."""
    for i, item in enumerate(items):
        for check in checks:
            message = check(i, item)
            if message:
                return message
    return None


def _raise_first(exc, items, checks, ok=False):
    """Raises exc with the first failure; `ok`, a cheap test that everything passes, skips the walk (the hot path)."""
    if ok:
        return
    message = _first_failure(items, checks)
    if message:
        raise exc(message)


def _one_kind(ts):
    """All CPU or all CUDA: the common case, tested without building a message."""
    if ts[0].is_cuda:
        return all(t.is_cuda for t in ts)
    return all(t.is_cpu for t in ts)


def _same_kind_as(first, noun):
    """Upstream's check that every tensor is a CUDA tensor, widened to all-CPU lists (noun: "output"/"input")."""

    def check(i, t):
        if t.device.type != first.device.type or t.device.type not in ("cpu", "cuda"):
            return (f"Expected all {noun} tensors to be CUDA tensors, but {noun} tensor at index {i} has device "
                    f"'{t.device}' (fastdp also accepts all-CPU {noun}s, not a mix)")
        return None

    return check


def _same_but_dim(ts, like, d):
    """Every tensor has like's dtype and shape except along dim d: the common case, tested without messages."""
    dtype, shape = like.dtype, like.shape
    before, after, ndim = shape[:d], shape[d + 1:], len(shape)
    return all(t.dtype == dtype and len(s := t.shape) == ndim and s[:d] == before and s[d + 1:] == after for t in ts)


def _nonempty_devices(devices):
    devices = _device_list(devices)
    if not devices:
        raise ValueError("'devices' must name at least one device")
    return devices


def _broadcast_to_devices(tensor, src, devices):
    """Results of broadcast(tensor, devices) and the tensors the core must fill."""
    devices = _nonempty_devices(devices)
    own = _source_slots(devices, tensor.device)
    if tensor.layout != torch.strided:  # sparse: copied by torch, as upstream's copy path does
        return tuple(tensor if i == own else tensor.to(d, copy=True) for i, d in enumerate(devices)), []
    results = [tensor if i == own else _empty_like(src, d) for i, d in enumerate(devices)]
    return tuple(results), [r for i, r in enumerate(results) if i != own]


def _broadcast_into(tensor, out):
    """Results of broadcast(tensor, out=out), checked with upstream's messages, and the tensors the core must fill."""
    results = _check_tensors(out, "out")
    if not results:
        raise ValueError("'out' must hold at least one tensor")
    ok = _one_kind(results) and all(o.shape == tensor.shape and o.dtype == tensor.dtype for o in results)
    _raise_first(RuntimeError, results, [
        _same_kind_as(results[0], "output"),
        lambda i, o: None if o.shape == tensor.shape else (
            f"Expected all output tensors to have same shape as the source (shape {list(tensor.shape)}) "
            f"in order to broadcast, but output tensor at index {i} has shape {list(o.shape)}"),
        lambda i, o: None if o.dtype == tensor.dtype else (
            f"Expected all output tensors to have the dtype of the source ({tensor.dtype}), but output "
            f"tensor at index {i} is {o.dtype}"),
    ], ok)
    return tuple(results), [o for o in results if o is not tensor]


def broadcast(tensor, devices=None, *, out=None):
    """Copies ``tensor`` to each device (or into each ``out`` tensor); see ``torch.nn.parallel.comm.broadcast``."""
    _check_tensor(tensor, "tensor")
    if not ((devices is None) ^ (out is None)):
        raise RuntimeError(
            f"Exactly one of 'devices' and 'out' must be specified, but got devices={devices} and out={out}"
        )
    src = prepare(tensor) if tensor.layout == torch.strided else tensor
    if devices is not None:
        results, targets = _broadcast_to_devices(tensor, src, devices)
    else:
        results, targets = _broadcast_into(tensor, out)
    if targets:
        _route.broadcast(src, targets, streams_for([src, *targets]))
    return results


def _plan(tensors, buffer_size):
    if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size <= 0:
        raise ValueError(f"'buffer_size' must be a positive int (bytes), got {buffer_size!r}")
    return _C.plan(tensors, [dtype_key(t.dtype) for t in tensors], buffer_size)


def _split(flat, sizes, like):
    """Views of a flat buffer, one per member, shaped like the tensors in `like`."""
    return [piece.view(t.shape) for piece, t in zip(flat.split(sizes), like)]


_ROUTES = {}


def broadcast_is_collective(devices):
    """True when the core broadcasts a packed buffer from devices[0] to the others with NCCL (it asks the backends,
    see NOTE [routing] in csrc/core/backend.h); otherwise every member is copied straight into every buffer.
    Loads libraries and counts devices; creates no CUDA context. Answers are kept per device list."""
    key = tuple(-1 if d.type == "cpu" else d.index for d in devices)
    route = _ROUTES.get(key)
    if route is None:
        try:
            route = _C.route("broadcast", key)
        except _C.BackendUnavailableError:
            route = "none"  # nothing can move these buffers: the copies raise the error that says why
        _ROUTES[key] = route
    return route == "nccl"


def _broadcast_bucket(srcs, sizes, numel, devices, collective):
    """One bucket to every device but devices[0]: a flat buffer each; returns the members' views, per device."""
    flats = [torch.empty(numel, dtype=srcs[0].dtype, device=d) for d in devices[1:]]
    views = [_split(flat, sizes, srcs) for flat in flats]
    if collective:  # NCCL broadcasts one packed buffer from devices[0]
        if len(srcs) == 1 and srcs[0].is_contiguous():
            src_flat = srcs[0].view(-1)
        else:
            src_flat = torch.empty(numel, dtype=srcs[0].dtype, device=devices[0])
            _route.copy(_split(src_flat, sizes, srcs), srcs, streams_for([src_flat]))
        _route.broadcast(src_flat, flats, streams_for([src_flat, *flats]))
    else:  # host entries or repeated CUDA ids: copy every member straight into every flat, in one call
        _route.copy([v for vs in views for v in vs], srcs * len(flats), streams_for([*srcs, *flats]))
    return views


def _broadcast_sparse(tensors, devices, outputs):
    """Sparse tensors are rare here: each is broadcast on its own, its copies put in outputs[1:]."""
    for i in (i for i, t in enumerate(tensors) if t.is_sparse):
        copies = broadcast(tensors[i].coalesce(), devices)
        for k in range(1, len(devices)):
            outputs[k][i] = copies[k]


def broadcast_coalesced(tensors, devices, buffer_size=10485760):
    """Broadcasts many tensors in dtype buckets of ``buffer_size`` bytes; entry 0 returns the inputs themselves."""
    tensors = _check_tensors(tensors, "tensors")
    devices = _nonempty_devices(devices)
    _raise_first(RuntimeError, tensors, [lambda i, t: None if t.device == devices[0] else (
        f"All tensors must be on devices[0]: {devices[0]}, but tensor at index {i} is on {t.device}")],
        all(t.device == devices[0] for t in tensors))
    outputs = [list(tensors)] + [[None] * len(tensors) for _ in devices[1:]]
    _broadcast_sparse(tensors, devices, outputs)
    dense_idx = [i for i, t in enumerate(tensors) if not t.is_sparse]
    dense = [prepare(tensors[i]) for i in dense_idx]
    if not dense or len(devices) == 1:
        return tuple(outputs)
    collective = broadcast_is_collective(devices)
    for numel, members in _plan(dense, buffer_size):
        idx = [i for i, _, _ in members]
        views = _broadcast_bucket([dense[i] for i in idx], [n for _, _, n in members], numel, devices, collective)
        for k, vs in enumerate(views, start=1):
            for i, v in zip(idx, vs):
                # Views of one flat buffer, each with its own version counter (as upstream's).
                outputs[k][dense_idx[i]] = v.data
    return tuple(outputs)


def _sum(inputs, destination):
    """A new tensor on destination holding inputs[0] + inputs[1] + ... (dense, same shape and dtype)."""
    dense = [prepare(t).contiguous() for t in inputs]
    result = torch.empty(dense[0].shape, dtype=dense[0].dtype, device=destination)
    reduce_columns([[to_core_dtype(t) for t in dense]], [to_core_dtype(result)])
    return result


def _check_input_devices(inputs):
    """All CPU or all CUDA (fastdp sums both; upstream asserts GPUs); True when all CPU."""
    if _one_kind(inputs):
        return inputs[0].device.type == "cpu"
    on_cpu = [t.device.type == "cpu" for t in inputs]
    if any(on_cpu) and not all(on_cpu):
        i = on_cpu.index(not on_cpu[0])
        raise ValueError(
            f"reduce_add: input {i} is on {inputs[i].device} but input 0 is on {inputs[0].device}; "
            "CPU and CUDA inputs cannot be mixed"
        )
    _raise_first(ValueError, inputs, [lambda i, t: None if t.device.type in ("cpu", "cuda") else (
        f"reduce_add: input {i} is on a {t.device.type} device; fastdp sums CPU and CUDA tensors only")])
    return all(on_cpu)


def _size_text(t):
    return "x".join(str(x) for x in t.size())


def _check_summands(column, dtype_text):
    """Upstream's size check, then one dtype per column; dtype_text(i, t) words the dtype failure."""
    first = column[0]
    size, dtype = first.size(), first.dtype
    _raise_first(ValueError, column, [
        lambda i, t: None if t.size() == size else (
            f"input {i} has invalid size: got {_size_text(t)}, but expected {_size_text(first)}"),
        lambda i, t: None if t.dtype == dtype else dtype_text(i, t),
    ], all(t.size() == size and t.dtype == dtype for t in column))


def reduce_add(inputs, destination=None):
    """Sums tensors from several devices onto ``destination``; see ``torch.nn.parallel.comm.reduce_add``."""
    inputs = _check_tensors(inputs, "inputs")
    if not inputs:
        raise ValueError("reduce_add expects at least one input tensor")
    all_cpu = _check_input_devices(inputs)
    if destination is None:
        destination = inputs[0].device if all_cpu else torch.device("cuda", torch.cuda.current_device())
    destination = _device(destination, "destination")
    _check_summands(inputs, lambda i, t: (
        f"input {i} has dtype {t.dtype}, but input 0 has {inputs[0].dtype}; cast them first"))
    if all(t.device != destination for t in inputs):
        raise RuntimeError("reduce_add expects destination to be on the same GPU with one of the tensors")
    if len(inputs) == 1:
        return inputs[0]
    if any(t.is_sparse for t in inputs):
        return sum((t.to(destination) for t in inputs[1:]), inputs[0].to(destination))
    try:
        return _sum(inputs, destination)
    except TypeError as e:
        if "dtype not supported" not in str(e):
            raise
        raise TypeError(f"reduce_add: cannot sum {inputs[0].dtype} tensors ({e})") from None


def _per_device_lists(inputs):
    """inputs as one list of tensors per device, all of one length."""
    if isinstance(inputs, torch.Tensor) or not hasattr(inputs, "__iter__"):
        raise TypeError(f"'inputs' must be a sequence of sequences of tensors, got {type(inputs).__name__}")
    per_device = [_check_tensors(ts, f"inputs[{k}]") for k, ts in enumerate(inputs)]
    if not per_device:
        raise ValueError("reduce_add_coalesced expects at least one list of tensors")
    count = len(per_device[0])
    _raise_first(ValueError, per_device, [lambda k, ts: None if len(ts) == count else (
        f"inputs[{k}] holds {len(ts)} tensors, but inputs[0] holds {count}")])
    return per_device


def _dense_columns(per_device, destination, outputs):
    """Reduces the all-sparse columns into outputs (as upstream, with reduce_add); returns the other columns'
    indices and, per device, those columns' tensors made dense, checked column by column."""
    dense_cols = []
    for j in range(len(outputs)):
        column = [ts[j] for ts in per_device]
        if all(t.is_sparse for t in column):
            outputs[j] = reduce_add(column, destination)
        else:
            dense_cols.append(j)
    columns = [[ts[j].to_dense() if ts[j].is_sparse else ts[j] for j in dense_cols] for ts in per_device]
    for j_pos, j in enumerate(dense_cols):
        col = [ts[j_pos] for ts in columns]
        _check_summands(col, lambda k, t, j=j, col=col: (
            f"input {k} has dtype {t.dtype} for tensor {j}, but input 0 has {col[0].dtype}"))
    return dense_cols, columns


def _reduce_bucket(columns, idx, sizes, numel, destination):
    """One bucket: each device's members packed into a flat buffer, the flats summed onto destination."""
    flats = []
    for ts in columns:
        srcs = [prepare(ts[i]) for i in idx]
        flat = torch.empty(numel, dtype=srcs[0].dtype, device=srcs[0].device)
        _route.copy(_split(flat, sizes, srcs), srcs, streams_for([flat, *srcs]))
        flats.append(flat)
    return reduce_add(flats, destination)


def reduce_add_coalesced(inputs, destination=None, buffer_size=10485760):
    """Sums lists of tensors (one list per device) in dtype buckets; see upstream's ``reduce_add_coalesced``."""
    per_device = _per_device_lists(inputs)
    outputs = [None] * len(per_device[0])
    dense_cols, columns = _dense_columns(per_device, destination, outputs)
    if not dense_cols:
        return tuple(outputs)
    if len(per_device) == 1:
        dest = _device(destination, "destination") if destination is not None else columns[0][0].device
        for t, j in zip(columns[0], dense_cols):
            outputs[j] = t if t.device == dest else t.to(dest)
        return tuple(outputs)
    ref = [prepare(t) for t in columns[0]]
    for numel, members in _plan(ref, buffer_size):
        idx = [i for i, _, _ in members]
        flat_result = _reduce_bucket(columns, idx, [n for _, _, n in members], numel, destination)
        for i, v in zip(idx, _split(flat_result, [n for _, _, n in members], [ref[i] for i in idx])):
            outputs[dense_cols[i]] = v.data
    return tuple(outputs)


def torch_chunk_sizes(size, n):
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
    stream (its current one where None); a device listed twice is written on the stream of its first entry, and
    the other entries' streams are handed their chunks by _hand_over."""
    chosen = {}
    if src.is_cuda:
        chosen[src.get_device()] = torch.cuda.current_stream(src.device)
    for s, d in zip(streams, devices):
        if d.type == "cuda" and d.index not in chosen:
            chosen[d.index] = s if s is not None else torch.cuda.current_stream(d)
    return chosen


def _hand_over(results, devices, given, chosen):
    """Each chunk the core wrote on another stream than the one given for its entry (a device listed twice, the
    source's device) becomes that stream's: the given stream waits for the copy before anything it runs reads the
    chunk, and the chunk's block, allocated on the writing stream, is recorded as used on the given one, so the
    allocator does not hand it out again while that stream may still use it."""
    for r, d, s in zip(results, devices, given):
        if s is None or d.type != "cuda":
            continue
        writer = chosen[d.index]
        if s != writer:
            s.wait_stream(writer)
            r.record_stream(s)


def _not_with_out(name, value):
    if value is not None:
        raise RuntimeError(f"'{name}' must not be specified when 'out' is specified, but got {name}={value}")


def _scatter_into(tensor, src, dim, out):
    """scatter(tensor, dim=dim, out=out): upstream's checks on the outputs; the chunks' total is the core's."""
    outs = _check_tensors(out, "out")
    if not outs:
        raise RuntimeError("Expected at least one output tensor to scatter to")
    d = _wrap_dim(dim, tensor.dim())

    def shape(i, o):
        expect = list(tensor.shape)
        expect[d] = o.shape[d] if o.dim() == tensor.dim() else expect[d]
        if list(o.shape) != expect or o.dtype != tensor.dtype:
            return (f"Output tensor at index {i} has incorrect shape: {list(o.shape)} ({o.dtype}). Expected same "
                    f"shape except for scatter dim {d} as the source tensor: {list(tensor.shape)} ({tensor.dtype}).")
        return None

    _raise_first(RuntimeError, outs, [_same_kind_as(outs[0], "output"), shape],
                 _one_kind(outs) and _same_but_dim(outs, tensor, d))
    try:
        _route.scatter(src, outs, d, [o.shape[d] for o in outs], streams_for([src, *outs]))
    except ValueError as e:  # upstream's comm.cpp raises its checks (the core's, here) as RuntimeError
        raise RuntimeError(str(e)) from None
    return tuple(outs)


def _index(i, s):
    """chunk_sizes[i] as an int: numpy integers too, as DataParallel's chunk_sizes accepts. Booleans never: numpy 1's
    bool_ still has a (deprecated) __index__, numpy 2's has none."""
    if isinstance(s, (bool, torch.Tensor)) or type(s).__name__ in ("bool", "bool_") or not hasattr(s, "__index__"):
        raise TypeError(f"'chunk_sizes'[{i}] must be an int, got {type(s).__name__}")
    s = operator.index(s)
    if s < 0:
        raise RuntimeError(f"'chunk_sizes'[{i}] is {s}; chunk sizes must be non-negative")
    return s


def _scatter_sizes(chunk_sizes, size, n, d):
    """The chunk sizes: torch.chunk's rule, or the user's, which are checked here, where they are named."""
    if chunk_sizes is None:
        return torch_chunk_sizes(size, n)
    if isinstance(chunk_sizes, (int, torch.Tensor)) or not hasattr(chunk_sizes, "__iter__"):
        raise TypeError(f"'chunk_sizes' must be a sequence of ints, got {type(chunk_sizes).__name__}")
    sizes = list(chunk_sizes)
    if len(sizes) != n:
        raise RuntimeError(
            f"Expected devices and chunk_sizes to be of same length, but got len(chunk_sizes) == {len(sizes)} "
            f"and len(devices) == {n}"
        )
    sizes = [_index(i, s) for i, s in enumerate(sizes)]
    if sum(sizes) != size:
        raise RuntimeError(
            f"chunk_sizes {sizes} add up to {sum(sizes)}, but the tensor has {size} elements along dim {d}; "
            "they must add up exactly"
        )
    return sizes


def _scatter_results(tensor, src, used, sizes, d, chosen):
    """One result per used device: a view for the source's own entry (the core recognises and skips it), else a
    fresh tensor; with explicit streams allocated with the stream that writes it current, as upstream does, so that
    PyTorch's caching allocator ties the block to that stream (no reuse before the copy into it has run)."""
    own = _source_slots(used, tensor.device)
    results, start = [], 0
    for i, (dev, n) in enumerate(zip(used, sizes)):
        view = src.narrow(d, start, n)
        start += n
        if i == own:
            results.append(view)
        elif chosen is None or dev.type != "cuda":
            results.append(_empty_like(view, dev))
        else:
            with torch.cuda.stream(chosen[dev.index]):
                results.append(_empty_like(view, dev))
    return results


def scatter(tensor, devices=None, chunk_sizes=None, dim=0, streams=None, *, out=None):
    """Splits ``tensor`` along ``dim`` across devices (or into ``out``); see upstream's ``comm.scatter``."""
    _check_tensor(tensor, "tensor")
    src = prepare(tensor)
    if out is not None:
        _not_with_out("devices", devices)
        _not_with_out("chunk_sizes", chunk_sizes)
        return _scatter_into(tensor, src, dim, out)
    devices = _device_list(devices)
    if not devices:
        raise RuntimeError("Expected at least one device to scatter to")
    d = _wrap_dim(dim, tensor.dim())
    sizes = _scatter_sizes(chunk_sizes, tensor.shape[d], len(devices), d)
    used = devices[: len(sizes)]
    given = _cuda_streams(streams, used)
    chosen = None if given is None else _scatter_streams(src, used, given)
    results = _scatter_results(tensor, src, used, sizes, d, chosen)
    if chosen is None:
        stream_pairs = streams_for([src, *results])
    else:
        stream_pairs = [(k, s.cuda_stream) for k, s in chosen.items()]
        if len(chosen) > 1:
            open_peers(chosen)
    _route.scatter(src, results, d, sizes, stream_pairs)
    if given is not None:
        _hand_over(results, used, given, chosen)
    return tuple(results)


def _check_gather_inputs(tensors, d):
    first = tensors[0]

    def ndim(i, t):
        if t.dim() != first.dim():
            return (f"Expected all input tensors to have the same number of dimensions, but input tensor at index {i} "
                    f"has {t.dim()} dimensions, (expected {first.dim()})")
        return None

    def shape(i, t):
        expect = list(first.shape)
        expect[d] = t.shape[d]
        if list(t.shape) != expect:
            return (f"Input tensor at index {i} has invalid shape {list(t.shape)}, but expected {expect} "
                    f"(all dimensions but {d} must match input 0)")
        return None

    _raise_first(RuntimeError, tensors, [ndim, shape, lambda i, t: None if t.dtype == first.dtype else (
        f"Input tensor at index {i} has dtype {t.dtype}, but input 0 has {first.dtype}")],
        _same_but_dim(tensors, first, d))


def _gather_destination(first, destination):
    if destination == -1:
        warnings.warn(
            'Using -1 to represent CPU tensor is deprecated. Please use a device object or string instead, e.g., "cpu".',
            FutureWarning,
            stacklevel=4,  # gather's caller (_gather_result, gather in between)
        )
        return _CPU
    if destination is None:
        return first.device if first.device.type == "cpu" else torch.device("cuda", torch.cuda.current_device())
    return _device(destination, "destination")


def _gather_result(tensors, total, destination):
    """The fresh result: on the destination, in the inputs' memory format when they all share one."""
    dest = _gather_destination(tensors[0], destination)
    formats = {_memory_format(t) for t in tensors}
    fmt = formats.pop() if len(formats) == 1 else torch.contiguous_format
    return torch.empty(total, dtype=tensors[0].dtype, device=dest, memory_format=fmt)


def gather(tensors, dim=0, destination=None, *, out=None):
    """Concatenates tensors along ``dim`` on one device (or into ``out``); see upstream's ``comm.gather``."""
    tensors = _check_tensors(tensors, "tensors")
    if out is not None:
        _not_with_out("destination", destination)
        _check_tensor(out, "out")
    if not tensors:
        raise RuntimeError("Expected at least one tensor to gather from")
    first = tensors[0]
    _raise_first(RuntimeError, tensors, [_same_kind_as(first, "input")], _one_kind(tensors))
    d = _wrap_dim(dim, first.dim())
    _check_gather_inputs(tensors, d)
    total = list(first.shape)
    total[d] = sum(t.shape[d] for t in tensors)
    if out is None:
        out = _gather_result(tensors, total, destination)
    elif list(out.shape) != total or out.dtype != first.dtype:
        raise RuntimeError(
            f"Expected out tensor to have shape {total} and dtype {first.dtype}, but got {list(out.shape)} "
            f"and {out.dtype}"
        )
    ins = [prepare(t) for t in tensors]
    _route.gather(ins, out, d, streams_for([*ins, out]))
    return out


def _memory_format(t):
    if t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if t.dim() == 5 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format
