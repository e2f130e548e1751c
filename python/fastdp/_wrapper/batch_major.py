"""The wrapper's warnings about what upstream splits or gathers along ``dim`` without a word: an argument whose size
along ``dim`` is not the batch's (scatter splits it anyway) and an output whose sizes do not follow the replicas'
chunks (gather concatenates it anyway). Each is said once per argument or output path: ``warned`` is the set of
paths the wrapper has warned about, which it keeps (None until the first warning)."""

import warnings

from .._balance import split as _split
from ..scatter_gather import unaligned_outputs

__all__ = ["warn_not_batch_major", "warn_unaligned"]


def warn_not_batch_major(inputs, kwargs, dim, warned):
    """Warns once per argument whose size along dim differs from the batch's; returns `warned`, made when first
    needed."""
    odd, first = _split.not_batch_major(inputs, kwargs, dim)
    for path, size in odd:
        if warned is None:
            warned = set()
        if path in warned:
            continue
        warned.add(path)
        name = path[len("kwargs['"):-2] if path.startswith("kwargs[") and path.count("[") == 1 else None
        fix = (f"pass broadcast=({name!r},) to DataParallel to give it whole to every replica" if name else
               "pass it as a keyword argument named in DataParallel's broadcast=(...) to give it whole to every "
               "replica")
        warnings.warn(
            f"fastdp.DataParallel: {path} has size {size} along dim {dim} but the batch has {first[1]} "
            f"({first[0]}); it is split along dim {dim} like the batch, as upstream does, which is wrong "
            f"for a tensor that is not batch-major (a (T, T) attention mask, a lookup table); {fix}",
            stacklevel=2,  # the wrapper's line that scatters
        )
    return warned


def warn_unaligned(outputs, inputs, module_kwargs, dim, warned):
    """Warns once per output whose sizes along dim do not follow the replicas' chunks (an RNN's (layers, batch,
    hidden) state); returns `warned`, made when first needed."""
    counts = [_split.batch_size(args, kwargs, dim) for args, kwargs in zip(inputs, module_kwargs)]
    if None in counts or 0 in counts:
        return warned
    for path, sizes in unaligned_outputs(outputs, counts, dim):
        if warned is None:
            warned = set()
        if path in warned:
            continue
        warned.add(path)
        warnings.warn(
            f"fastdp.DataParallel: {path} has sizes {tuple(sizes)} along dim {dim} in the replicas, whose "
            f"chunks have {tuple(counts)} samples: it is not batch-major along dim {dim} (a per-replica "
            "summary, a state of fixed size), and the gather concatenates it anyway, as upstream does, so its "
            "entries do not follow the batch; return it batch-major (one entry per sample) or keep it out of "
            "forward's output",
            stacklevel=2,  # the wrapper's line that gathers
        )
    return warned
