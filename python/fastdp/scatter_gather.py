"""``scatter``, ``scatter_kwargs`` and ``gather`` with torch.nn.parallel's recursion rules.

Scatter splits every tensor leaf along ``dim`` and rebuilds tuples, lists, dicts and namedtuples per replica;
any other value reaches every replica by reference. Gather concatenates the replicas' tensors and rebuilds the
containers of replica 0's output. Differences: ``scatter_kwargs`` pads the shorter list correctly (current
upstream compares against the wrong length), and outputs that cannot be gathered (strings, numbers, other
objects, mismatched containers) raise a TypeError/ValueError naming where they are instead of producing garbage.
The helpers take their state as arguments (no self-referencing closures), so no reference cycles are created.
"""

import sys

import torch
from torch.nn.utils.rnn import PackedSequence

from ._platform import devices as _devices
from ._step.functions import Gather, Scatter

__all__ = ["scatter", "scatter_kwargs", "gather"]


def _is_namedtuple(obj):
    return isinstance(obj, tuple) and hasattr(obj, "_asdict") and hasattr(obj, "_fields")


def _scatter_map(obj, devices, dim, sizes=None):
    """One entry per replica; the replica count is the fewest chunks among the tensor leaves (zip).

    With explicit ``sizes`` (one per device) every tensor is split by them, and every device gets an entry.
    """
    if isinstance(obj, torch.Tensor):
        return list(Scatter.apply(devices, sizes, dim, obj))
    if _is_cache(obj):
        return _scatter_cache(obj, devices, sizes)
    parts, rebuild = _parts(obj)
    if rebuild is None:
        return [obj for _ in devices]
    return [rebuild(items) for items in zip(*[_scatter_map(x, devices, dim, sizes) for x in parts])]


def _parts(obj):
    """(the parts scatter recurses into, how one replica's container is rebuilt from its parts), or (None, None)
    for a value every replica gets by reference. Dict items are (key, value) tuples, so keys follow the same rules
    as values (as upstream)."""
    if isinstance(obj, PackedSequence):
        raise _Unsplittable()  # scatter's caller names it (_unsplittable_error)
    if _is_namedtuple(obj):
        return obj, lambda fields: type(obj)(*fields)
    if not isinstance(obj, (tuple, list, dict)) or not obj:
        return None, None
    if isinstance(obj, tuple):
        return obj, tuple
    if isinstance(obj, list):
        return obj, list
    return obj.items(), type(obj)


class _Unsplittable(Exception):
    """A PackedSequence met while scattering (raised where the path is unknown, answered with the path)."""


def _packed_path(obj, path):
    """The path of the first PackedSequence in a (nested) input, or None."""
    if isinstance(obj, PackedSequence):
        return path
    if isinstance(obj, dict):
        items = ((f"{path}[{k!r}]", v) for k, v in obj.items())
    elif isinstance(obj, (tuple, list)):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(obj))
    else:
        return None
    for where, value in items:
        found = _packed_path(value, where)
        if found is not None:
            return found
    return None


def _unsplittable_error(where):
    return TypeError(
        f"{where} is a PackedSequence, which DataParallel cannot split along the batch: its data interleaves all "
        "sequences time step by time step, so a slice along dim 0 would cut sequences apart. Pass the padded batch "
        "and its lengths instead (a (B, T, ...) tensor and a (B,) tensor) and pack inside forward with "
        "torch.nn.utils.rnn.pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)"
    )


# NOTE [caches]: a transformers key/value cache (DynamicCache, EncoderDecoderCache) passed in or returned holds one
# entry per layer, whose tensors are [batch, heads, positions, head dim] and whose other items (a sliding window
# size, None) are the same for every sample. Handing one cache object to every replica, as upstream does, lets the
# replicas append to the same tensors; instead each replica gets its own cache of its samples, split along dim 0 like
# a tensor, and the replicas' returned caches are gathered into one along dim 0. Both directions use the
# caches' own data-parallel protocol: iterating gives per-layer tuples, and type(cache)(tuples) rebuilds one.
_CACHE_TYPES = ("DynamicCache", "EncoderDecoderCache")


def _is_cache(obj):
    """Whether obj is a transformers cache (without importing transformers: only when its cache module is loaded)."""
    module = sys.modules.get("transformers.cache_utils")
    return module is not None and isinstance(obj, module.Cache)


def _cache_layers(cache, what):
    if type(cache).__name__ not in _CACHE_TYPES:
        raise TypeError(
            f"{what} is a {type(cache).__name__}, which DataParallel cannot split along the batch or gather back "
            f"(its size is fixed when it is made); pass a {' or '.join(_CACHE_TYPES)} (the default cache of "
            "generate()), or give the cache to a single device"
        )
    return [tuple(layer) for layer in cache]


def _batch_major(item):
    return isinstance(item, torch.Tensor) and item.dim() > 0


def _scatter_cache(cache, devices, sizes):
    """One cache per replica with its samples' keys and values (see NOTE [caches])."""
    layers = _cache_layers(cache, "a cache argument")
    if not layers:  # nothing cached yet: each replica starts its own
        return [type(cache)([]) for _ in devices]
    split = [[list(Scatter.apply(devices, sizes, 0, x)) if _batch_major(x) else None for x in layer]
             for layer in layers]
    count = min((len(parts) for layer in split for parts in layer if parts is not None), default=len(devices))
    return [type(cache)([tuple(x if parts is None else parts[r] for x, parts in zip(layer, pieces))
                         for layer, pieces in zip(layers, split)]) for r in range(count)]


def _gather_cache(outputs, target, dim, path):
    """The replicas' returned caches as one cache of the whole batch (see NOTE [caches])."""
    out = outputs[0]
    layers = []
    for i, o in enumerate(outputs):
        if type(o) is not type(out):
            raise TypeError(
                f"Cannot gather {path}: replica 0 returned {_kind(out)} but replica {i} returned {_kind(o)}"
            )
        layers.append(_cache_layers(o, f"output {path}"))
    gathered = []
    for k, first in enumerate(layers[0]):
        items = zip(*(replica[k] for replica in layers))
        gathered.append(tuple(Gather.apply(target, 0, *xs) if _batch_major(xs[0]) else xs[0] for xs in items))
    return type(out)(gathered)


def _target_list(target_gpus):
    return _devices.normalize_list(target_gpus, "target_gpus")


def _sizes_for(chunk_sizes, devices):
    if chunk_sizes is None:
        return None
    sizes = list(chunk_sizes)
    if len(sizes) != len(devices):
        raise ValueError(
            f"chunk_sizes has {len(sizes)} entries for {len(devices)} devices; expected one size per device"
        )
    return sizes


def scatter(inputs, target_gpus, dim=0, *, chunk_sizes=None):
    """Slices tensors into approximately equal chunks (or ``chunk_sizes``, one int per device, adding up to every
    tensor's size along ``dim``) and distributes them across the given devices."""
    devices = _target_list(target_gpus)
    try:
        return _scatter_map(inputs, devices, dim, _sizes_for(chunk_sizes, devices))
    except _Unsplittable:
        raise _unsplittable_error(_packed_path(inputs, "inputs")) from None


def scatter_kwargs(inputs, kwargs, target_gpus, dim=0, *, chunk_sizes=None):
    """Scatters positional args and kwargs; the shorter per-replica list is padded with () or {}.

    ``chunk_sizes`` (one int per device) splits every tensor by those sizes instead of torch.chunk's rule; every
    device then gets an entry, empty tensors where its size is 0.
    """
    devices = _target_list(target_gpus)
    sizes = _sizes_for(chunk_sizes, devices)
    try:
        scattered_inputs = _scatter_map(inputs, devices, dim, sizes) if inputs else []
        scattered_kwargs = _scatter_map(kwargs, devices, dim, sizes) if kwargs else []
    except _Unsplittable:
        where = _packed_path(tuple(inputs or ()), "input")
        if where is None:
            where = next(f"keyword argument {k!r}" for k, v in kwargs.items() if _packed_path(v, "") is not None)
        raise _unsplittable_error(where) from None
    if len(scattered_inputs) < len(scattered_kwargs):
        scattered_inputs.extend(() for _ in range(len(scattered_kwargs) - len(scattered_inputs)))
    elif len(scattered_kwargs) < len(scattered_inputs):
        scattered_kwargs.extend({} for _ in range(len(scattered_inputs) - len(scattered_kwargs)))
    return tuple(scattered_inputs), tuple(scattered_kwargs)


def _kind(obj):
    return type(obj).__name__


def _gather_map(outputs, target, dim, path):
    out = outputs[0]
    if out is None:
        return None
    for kinds, gather_kind in _GATHERERS:
        if isinstance(out, kinds):
            return gather_kind(outputs, target, dim, path)
    if _is_cache(out):
        return _gather_cache(outputs, target, dim, path)
    if _rebuildable(out):
        return _gather_iterable(outputs, target, dim, path)
    raise TypeError(
        f"Cannot gather {path} of type {_kind(out)}: DataParallel gathers tensors, None, and tuples, lists, dicts "
        "and namedtuples of them, and rebuilds other iterables from their gathered items. Return a tensor instead "
        "(e.g. torch.tensor(value)), or keep such values out of forward's output."
    )


def _gather_tensors(outputs, target, dim, path):
    for i, o in enumerate(outputs):
        if not isinstance(o, torch.Tensor):
            raise TypeError(f"Cannot gather {path}: replica 0 returned a Tensor but replica {i} returned {_kind(o)}")
    try:
        return Gather.apply(target, dim, *outputs)
    except RuntimeError as e:
        unequal = _unequal_dimension(outputs, dim)
        if unequal is None:
            raise
        raise RuntimeError(  # upstream's type, with what and where
            f"Cannot gather {path}: its size along dim {unequal} differs across replicas "
            f"({', '.join(str(o.size(unequal)) for o in outputs)}), so the replicas' tensors cannot be concatenated "
            f"along dim {dim}. An output whose size follows the replica's chunk in another dimension (an RNN's "
            "(layers, batch, hidden) state, a similarity matrix between the chunk's samples as CLIP's "
            f"logits_per_image) is not batch-major along dim {dim}: return it batch-major (h_n.transpose(0, 1)), or "
            f"return its batch-major parts (the embeddings) and compute it from the gathered outputs ({e})"
        ) from e


def _unequal_dimension(outputs, dim):
    """The first dimension other than ``dim`` whose size differs between the replicas' tensors, or None."""
    first = outputs[0]
    if any(o.dim() != first.dim() for o in outputs) or first.dim() == 0:
        return None
    along = dim % first.dim()
    for d in range(first.dim()):
        if d != along and any(o.size(d) != first.size(d) for o in outputs):
            return d
    return None


def _gather_dicts(outputs, target, dim, path):
    out = outputs[0]
    for i, d in enumerate(outputs):
        if not isinstance(d, dict):
            raise TypeError(f"Cannot gather {path}: replica 0 returned a dict but replica {i} returned {_kind(d)}")
        if len(d) != len(out):
            # Upstream's exception and text.
            raise ValueError("All dicts must have the same number of keys")
        if d.keys() != out.keys():
            missing = [k for k in out if k not in d]
            raise ValueError(
                f"All dicts must have the same keys: at {path}, replica {i} lacks {missing!r} "
                f"(replica 0 has {list(out)!r}, replica {i} has {list(d)!r})"
            )
    return type(out)((k, _gather_map([d[k] for d in outputs], target, dim, f"{path}[{k!r}]")) for k in out)


def _gather_sequences(outputs, target, dim, path):
    out = outputs[0]
    for i, o in enumerate(outputs):
        if not isinstance(o, (tuple, list)):
            raise TypeError(
                f"Cannot gather {path}: replica 0 returned a {_kind(out)} but replica {i} returned {_kind(o)}"
            )
        if len(o) != len(out):
            raise ValueError(
                f"Cannot gather {path}: replica 0 returned a {_kind(out)} of {len(out)} elements but replica "
                f"{i} returned {len(o)}"
            )
    gathered = [_gather_map([o[k] for o in outputs], target, dim, f"{path}[{k}]") for k in range(len(out))]
    if _is_namedtuple(out):
        return type(out)._make(gathered)
    return type(out)(gathered)


# Replica 0's output type → how the replicas' outputs of that type are gathered (checked in order).
_GATHERERS = ((torch.Tensor, _gather_tensors), (dict, _gather_dicts), ((tuple, list), _gather_sequences))


def _rebuildable(out):
    """Upstream's last rule applies: an iterable that is not text (text would recurse forever upstream)."""
    return not isinstance(out, (str, bytes, bytearray)) and hasattr(type(out), "__iter__")


def _gather_iterable(outputs, target, dim, path):
    """Upstream's rule for any other iterable (a transformers cache, for one): ``type(out)(gathered items)``, the
    items gathered position by position. A type whose constructor does not take that raises a TypeError naming it."""
    out = outputs[0]
    items = []
    for i, o in enumerate(outputs):
        if type(o) is not type(out):
            raise TypeError(f"Cannot gather {path}: replica 0 returned {_kind(out)} but replica {i} returned {_kind(o)}")
        items.append(list(o))
        if len(items[-1]) != len(items[0]):
            raise ValueError(
                f"Cannot gather {path}: replica 0 returned a {_kind(out)} of {len(items[0])} items but replica {i} "
                f"returned {len(items[-1])}"
            )
    gathered = [_gather_map([it[k] for it in items], target, dim, f"{path}[{k}]") for k in range(len(items[0]))]
    try:
        return type(out)(gathered)
    except Exception as e:
        raise TypeError(
            f"Cannot gather {path} of type {_kind(out)}: it is iterable, but {type(out).__name__}(gathered items) "
            f"failed ({type(e).__name__}: {e}); upstream DataParallel rebuilds it the same way. Return tensors, "
            "tuples, lists or dicts from forward instead."
        ) from e


def unaligned_outputs(outputs, counts, dim, path="output", found=None):
    """(path, sizes along dim) of the replicas' output tensors whose sizes are not proportional to their chunks'
    sample counts ``counts``: gathering concatenates them anyway, so their rows do not follow the batch. Walks what
    gather walks (tensors in dicts, lists and tuples of one shape across replicas); anything else is gather's to
    judge."""
    if found is None and _single_tensor_aligned(outputs, counts, dim):
        return []
    found = [] if found is None else found
    if isinstance(outputs[0], torch.Tensor):
        sizes = _unaligned_sizes(outputs, counts, dim)
        if sizes is not None:
            found.append((path, sizes))
    for suffix, values in _entries_alike(outputs):
        unaligned_outputs(values, counts, dim, f"{path}{suffix}", found)
    return found


def _single_tensor_aligned(outputs, counts, dim):
    """The common case, checked at once: every replica returned one plain tensor, and their rows follow the batch
    (or there are no rows to judge: 0-dim tensors, or tensors of different ranks)."""
    out = outputs[0]
    if type(out) is not torch.Tensor or not all(type(o) is torch.Tensor for o in outputs):
        return False
    if out.dim() == 0 or any(o.dim() != out.dim() for o in outputs):
        return True
    first = out.size(dim)
    return all(o.size(dim) * counts[0] == first * c for o, c in zip(outputs, counts))


def _unaligned_sizes(outputs, counts, dim):
    """The replicas' sizes along dim when all are tensors of one rank (not 0) and their sizes are not proportional
    to ``counts``; None otherwise."""
    out = outputs[0]
    if out.dim() > 0 and all(isinstance(o, torch.Tensor) and o.dim() == out.dim() for o in outputs):
        sizes = [o.size(dim) for o in outputs]
        if any(n * counts[0] != sizes[0] * c for n, c in zip(sizes, counts)):
            return sizes
    return None


def _entries_alike(outputs):
    """(path suffix, the replicas' values) of each entry of the replicas' dicts (the same keys in each) or lists
    and tuples (the same length in each), one entry at a time; nothing for anything else."""
    out = outputs[0]
    if isinstance(out, dict):
        if all(isinstance(o, dict) and o.keys() == out.keys() for o in outputs):
            for k in out:
                yield f"[{k!r}]", [o[k] for o in outputs]
    elif isinstance(out, (tuple, list)):
        if all(isinstance(o, (tuple, list)) and len(o) == len(out) for o in outputs):
            for k in range(len(out)):
                yield f"[{k}]", [o[k] for o in outputs]


def gather(outputs, target_device, dim=0):
    """Gathers tensors from the replicas' outputs onto ``target_device`` (-1 or "cpu" for the host)."""
    outputs = list(outputs)
    if not outputs:
        raise ValueError("gather expects the output of at least one replica")
    if target_device is None:
        target = torch.cuda.current_device() if _devices.cuda_available() else _devices.CPU
    elif isinstance(target_device, int) and not isinstance(target_device, bool) and target_device == -1:
        target = -1  # comm.gather gives upstream's FutureWarning for -1.
    else:
        target = _devices.normalize(target_device, "target_device")
    return _gather_map(outputs, target, dim, "output")
