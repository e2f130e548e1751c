"""The shim's side of the binding: dtype codes for the core, tensor preparation and the per-device streams that
order core work (PyTorch's current stream of each CUDA device; none for host tensors)."""

import torch

from .. import _C
from . import route as _route

_CODES = _C.dtype_codes()
_CORE_DTYPES = {
    torch.bool: _CODES["bool"],
    torch.uint8: _CODES["uint8"],
    torch.int8: _CODES["int8"],
    torch.int16: _CODES["int16"],
    torch.int32: _CODES["int32"],
    torch.int64: _CODES["int64"],
    torch.float16: _CODES["float16"],
    torch.bfloat16: _CODES["bfloat16"],
    torch.float32: _CODES["float32"],
    torch.float64: _CODES["float64"],
}
_C.set_dtypes(_CORE_DTYPES, torch.Tensor)

_DTYPE_KEYS = {}


def dtype_key(dtype):
    """A small int per torch dtype, so that buckets never mix dtypes of one element size."""
    key = _DTYPE_KEYS.get(dtype)
    if key is None:
        key = _DTYPE_KEYS.setdefault(dtype, len(_DTYPE_KEYS))
    return key


def prepare(t):
    """The tensor whose memory the core may read: conjugate and negative bits applied."""
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t


def to_core_dtype(t):
    """Complex tensors are summed as their real pairs; every other dtype as itself."""
    return torch.view_as_real(t) if t.is_complex() else t


def streams_for(tensors):
    """(device, stream handle) of PyTorch's current stream for each CUDA device among tensors; None if none. Work
    over several devices gets peer access through PyTorch first (open_peers)."""
    seen = None
    for t in tensors:
        if t.is_cuda:
            if seen is None:
                seen = {}
            index = t.get_device()
            if index not in seen:
                seen[index] = torch.cuda.current_stream(index).cuda_stream
    if seen is None:
        return None
    if len(seen) > 1:
        open_peers(seen)
    return list(seen.items())


def streams_on(indices):
    """streams_for for a known list of CUDA device indices (distinct): the current stream of each."""
    pairs = [(d, torch.cuda.current_stream(d).cuda_stream) for d in indices]
    if len(pairs) > 1:
        open_peers(indices)
    return pairs


# NOTE [peer access through PyTorch]
# A cross-device copy by the core runs on the destination's stream and reads the source device's memory. Enabling
# peer access on the driver's contexts (cuCtxEnablePeerAccess) covers memory from cuMemAlloc, but not what PyTorch
# hands out under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (virtual memory, mapped per device with
# cuMemSetAccess) or backend:cudaMallocAsync (a memory pool, opened per device with cudaMemPoolSetAccess): only
# PyTorch's allocator can grant a peer access to its memory, and it does in every mode when asked through its own
# path (at::cuda::get_p2p_access, which torch's copy between two devices takes). So before the core first works
# over a set of devices, every ordered pair that the hardware connects is opened that way, once per process; the
# core's own cuCtxEnablePeerAccess then finds access already enabled.
_PEERS_OPEN = set()  # frozensets of device indices whose ordered pairs have been opened through PyTorch


def open_peers(indices):
    """Opens peer access through PyTorch (NOTE [peer access through PyTorch]) between every ordered pair of the CUDA
    devices ``indices`` (device indices), once per set of devices and process."""
    key = frozenset(indices)
    if key in _PEERS_OPEN:
        return
    if not torch.cuda.is_available():  # no PyTorch allocator to ask (tensors that only present themselves as CUDA)
        _PEERS_OPEN.add(key)
        return
    for a in key:
        for b in key:
            if a != b and torch.cuda.can_device_access_peer(b, a):
                _grant_peer(b, a)
    _PEERS_OPEN.add(key)


def _grant_peer(device, peer):
    """Lets ``device`` access ``peer``'s memory from PyTorch's allocator: torch copies between two devices on the
    source device, after asking its allocator for access from there to the destination (one element, once)."""
    torch.empty(1, device=torch.device("cuda", peer)).copy_(torch.empty(1, device=torch.device("cuda", device)))


def _scratch(device, nbytes, stream):
    """Device scratch for the C core (staging of strided copies, partial sums; see NOTE [scratch memory] in
    csrc/backend/cuda/scratch.c): a uint8 tensor from PyTorch's caching allocator, made with the core's stream current
    so that the block belongs to that stream, where the core also uses and frees it. The core drops the tensor when
    done. An allocation that does not fit frees PyTorch's cached blocks and retries, as every torch allocation."""
    stream = torch.cuda.ExternalStream(stream, device=device) if stream else torch.cuda.default_stream(device)
    with torch.cuda.stream(stream):
        return torch.empty(nbytes, dtype=torch.uint8, device=device)


if torch.backends.cuda.is_built():  # a PyTorch without CUDA has no allocator to lend: the core uses the driver's pool
    _C.set_device_allocator(_scratch)


def _reduce(columns, outs):
    _route.reduce_many(columns, outs, streams_for([*outs, *(t for c in columns for t in c)]))


def _tiles(outs):
    """The flat tensor that outs cover exactly, in order (consecutive contiguous views of one storage), or None."""
    first = outs[0]
    if not all(o.is_contiguous() and o.dtype == first.dtype and o.device == first.device for o in outs):
        return None
    if any(o.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() for o in outs):
        return None
    offset = first.storage_offset()
    for o in outs:
        if o.storage_offset() != offset:
            return None
        offset += o.numel()
    return first.as_strided((offset - first.storage_offset(),), (1,), first.storage_offset())


def _pack(columns, outs):
    """One flat input per (device, occurrence) and one flat output: the columns as a single reduce.

    Column j's k-th tensor on device d goes to the flat of slot (d, k) at out j's offset; slots a column has no
    tensor for hold zeros there. Slots are ordered by first appearance, so a column's tensors keep their order
    wherever each column lists one tensor per device or all its tensors on one device (the cases DataParallel
    produces). The output's device always has a slot, packed straight into the output when outs tile one flat
    buffer (then reduced in place), so that NCCL finds its root there.
    """
    dest = outs[0].device
    flat_out = _tiles(outs)
    result = flat_out if flat_out is not None else torch.empty(sum(o.numel() for o in outs), dtype=outs[0].dtype,
                                                              device=dest)
    slots = {(dest, 0): None}
    placed = []  # per column: the slot of each of its tensors
    for column in columns:
        seen, keys = {}, []
        for t in column:
            k = seen.get(t.device, 0)
            seen[t.device] = k + 1
            keys.append((t.device, k))
            slots.setdefault((t.device, k), None)
        placed.append(keys)
    offsets, at = [], 0
    for o in outs:
        offsets.append(at)
        at += o.numel()
    for key in slots:
        slots[key] = result if key == (dest, 0) and flat_out is not None else torch.empty_like(result, device=key[0])
    filled = {key: 0 for key in slots}
    dsts, srcs = [], []
    for column, keys, off in zip(columns, placed, offsets):
        for t, key in zip(column, keys):
            dsts.append(slots[key][off : off + t.numel()].view(t.shape))
            srcs.append(t)
            filled[key] += t.numel()
    for key, flat in slots.items():
        if filled[key] != flat.numel():  # some column has no tensor here: its part must add nothing
            flat.zero_()
    if dsts:
        _route.copy(dsts, srcs, streams_for([*slots.values(), *srcs]))
    return list(slots.values()), result, flat_out is None


def reduce_columns(columns, outs):
    """outs[j] = sum of columns[j] (dense, core dtypes, one dtype per column and output).

    Columns that span several CUDA devices (a gradient bucket of several replicas) are packed first, one flat buffer
    per device, and reduced as one tensor: one NCCL group per call rather than one per column (upstream's
    reduce_add_coalesced flattens too). Otherwise each column is reduced in place, all in one core call. CUDA
    inputs spread over several devices with no NCCL to sum them are first staged on each output's device.
    """
    spread = len(columns) > 1 and outs[0].is_cuda and len({t.device for c in columns for t in c}) > 1
    same = all(o.dtype == outs[0].dtype and o.device == outs[0].device for o in outs)
    if spread and same and all(t.dtype == outs[0].dtype for c in columns for t in c):
        flats, result, copy_back = _pack(columns, outs)
        _reduce([flats], [result])
        if copy_back:
            parts = list(result.split([o.numel() for o in outs]))
            _route.copy([o.view(-1) for o in outs], parts, streams_for([result]))
        return
    _reduce(columns, outs)


def tensor_shim_usable():
    """Whether the binding can read tensors through libtorch's C shim here (whatever path is selected now)."""
    try:
        previous = _C.set_tensor_path("aoti")
    except RuntimeError:
        return False
    _C.set_tensor_path(previous)
    return True
