"""fastdp: a drop-in, faster ``torch.nn.DataParallel`` with a C core (host, CUDA and NCCL backends).

``import fastdp; model = fastdp.DataParallel(model)``. ``fastdp.comm`` mirrors ``torch.nn.parallel.comm``.
"""

import torch  # loaded first: the GPU backends reuse the CUDA libraries torch brings

from ._version import __version__  # noqa: F401
from . import _C
from ._native import libs as _libs  # noqa: F401  (tells the core where pip's NVRTC is, before its first use)
from ._C import BackendUnavailableError, CudaError, FastDPError, NcclError

_TORCH_OOM = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


class CudaOutOfMemoryError(CudaError, _TORCH_OOM):
    """CUDA ran out of memory inside fastdp's core: a ``CudaError`` (``.status`` is CUDA_ERROR_OUT_OF_MEMORY, 2)
    and PyTorch's ``OutOfMemoryError``, so ``except torch.OutOfMemoryError`` handles it as PyTorch's own."""


_C.set_oom_error(CudaOutOfMemoryError, _TORCH_OOM)
from ._native.fallback import FallbackWarning
from . import comm

__all__ = [
    "comm",
    "FastDPError",
    "CudaError",
    "CudaOutOfMemoryError",
    "NcclError",
    "BackendUnavailableError",
    "FallbackWarning",
    "info",
]


def info(memory=False):
    """A dict of what fastdp can do on this machine (see ``python -m fastdp info``); ``memory=True`` also reads free
    memory on GPUs that no CUDA context uses yet, creating one on each for the query."""
    from ._native.info import collect

    return collect(memory=memory)


# ---- DataParallel layer: torch.nn.parallel's public names --------------------------------------------
from .data_parallel import DataParallel, data_parallel  # noqa: E402
from .parallel_apply import parallel_apply  # noqa: E402
from .replicate import replicate  # noqa: E402
from .scatter_gather import gather, scatter, scatter_kwargs  # noqa: E402

__all__ += ["DataParallel", "data_parallel", "replicate", "scatter", "scatter_kwargs", "gather", "parallel_apply"]

# ---- torch.distributed layer: the wrapper under torchrun, and the helpers for one script everywhere ------
from . import distributed  # noqa: E402
from .distributed import DistributedDataParallel, RankZeroFilter, print0, save, shard  # noqa: E402

__all__ += ["distributed", "DistributedDataParallel", "shard", "save", "print0", "RankZeroFilter"]

# ---- Balancing device 0: batch split, per-replica loss, memory report ------------------------------------
from . import balance  # noqa: E402
from ._balance.memory import MemoryReport, memory_report  # noqa: E402
from ._balance.split import AutoSplit, BatchSplit  # noqa: E402

__all__ += ["balance", "AutoSplit", "BatchSplit", "MemoryReport", "memory_report"]

# ---- Seeing each replica: the report, its advice, and the out-of-memory rescue's test hook ------------------------
from ._balance.inject import inject_oom  # noqa: E402
from ._report.report import Advice, Report  # noqa: E402

__all__ += ["Report", "Advice", "inject_oom"]

# ---- Code that calls torch.nn.DataParallel itself: fastdp's wrapper without editing it ----------------------------
from .patch import is_patched, patch, patched, unpatch  # noqa: E402

__all__ += ["patch", "unpatch", "patched", "is_patched"]

# ---- SyncBatchNorm across the replicas of one forward --------------------------------------------------------------
from .sync_batchnorm import convert_sync_batchnorm  # noqa: E402

__all__ += ["convert_sync_batchnorm"]
