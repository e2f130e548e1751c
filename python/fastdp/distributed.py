"""fastdp on torch.distributed: the same ``fastdp.DataParallel(model)`` runs as one process per device under torchrun.

``fastdp.DataParallel`` hands its construction here when the script was launched by ``torchrun`` with
WORLD_SIZE > 1, or when a default process group already exists (see docs/distributed.md). The wrapper,
``DistributedDataParallel``, is a ``fastdp.DataParallel`` whose forward is torch's DistributedDataParallel; the
helpers ``shard``, ``save``, ``print0`` and ``RankZeroFilter`` make one script run unchanged in both modes.
"""

import atexit
import inspect
import itertools
import logging
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.modules import Module
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

from ._wrapper import checkpoint as _checkpoint
from ._platform import devices as _devices
from ._balance import rescue as _rescue, replica_loss as _replica_loss, split as _split
from ._report import recorder as _recorder
from .data_parallel import DataParallel
from ._wrapper.launch import (  # noqa: F401  (LaunchEnv, launch_env, is_distributed and MODES stay public here)
    LAUNCH_HINT, LAUNCH_VARS, MODES, LaunchEnv, check_mode, group_initialized, int_var, is_distributed, launch_env,
)

__all__ = [
    "DistributedDataParallel",
    "shard",
    "ShardedLoader",
    "save",
    "print0",
    "RankZeroFilter",
    "get_rank",
    "get_world_size",
    "is_distributed",
]

# ---- Process group and device ------------------------------------------------------------------------------------

_owned_group = False


def _destroy_owned_group():
    # An uncaught exception (a failing rank, Ctrl-C) leaves sys.last_value set before atexit runs: the peers may be
    # gone or stuck, and tearing communicators down could then block the exit: such a process is not torn down.
    if not (_owned_group and group_initialized()):
        return
    # Gloo's worker threads drop each finished collective's tensors themselves, which takes the GIL; one still
    # waiting for it when the interpreter finalises is ended by Python inside a C++ destructor, and the process
    # aborts ("terminate called without an active exception", pytorch/pytorch PR 179291). Giving the GIL up
    # briefly lets them finish first: 2 exits in 12 aborted in tests/test_distributed.py without it, 0 in 25
    # with it. A failing rank needs it as much as one that ends well (the collective that failed on its peer is
    # dropped the same way), or its exit code 1 becomes SIGABRT: a rank aborted in 12 of 50 launches of the
    # "fail" scenario with the pause on clean exits only, in 0 of 50 with it on every exit.
    time.sleep(0.05)
    if getattr(sys, "last_value", None) is None:
        dist.destroy_process_group()


def _local_rank():
    text = os.environ.get("LOCAL_RANK", "")
    if text != "":
        return int_var(os.environ, "LOCAL_RANK", lo=0)
    if group_initialized():
        # Groups set up by hand (mp.spawn) may lack LOCAL_RANK: assume ranks are packed node by node.
        return dist.get_rank() % max(torch.cuda.device_count(), 1)
    return 0


def _bind_device(device_ids):
    """This process's device (_local_device), made the current CUDA device: NCCL, barriers and the user's own
    .cuda() calls then use this GPU."""
    device = _local_device(device_ids)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def _local_device(device_ids):
    """This process's device: CPU for "cpu" device_ids or without a GPU, else cuda:LOCAL_RANK (or as device_ids says).

    ``device_ids`` keeps both meanings it has in user code: one entry (DDP's ``[local_rank]``) is the device;
    several entries (DataParallel's list of this machine's GPUs) are indexed by LOCAL_RANK.
    """
    if device_ids is not None:
        _devices.require_indexable(device_ids)
        if any(_devices.is_cpu(d) for d in device_ids):
            _devices.normalize_list(device_ids, "device_ids")  # Mixed lists raise, as in single-process mode.
            return torch.device("cpu")
    if not _devices.cuda_available():
        return torch.device("cpu")  # CUDA device_ids without a GPU are ignored, as DataParallel does.
    local = _local_rank()
    count = torch.cuda.device_count()
    if device_ids is None or len(device_ids) == 0:
        if local >= count:
            raise RuntimeError(
                f"LOCAL_RANK={local} but only {count} CUDA device(s) are visible: each process needs its own GPU. "
                f"Start at most {count} processes per machine (torchrun --nproc_per_node {count}), or pass "
                "device_ids=['cpu'] to train on the CPU with gloo."
            )
        return torch.device("cuda", local)
    ids = [_devices.cuda_index(d, "device_ids") for d in device_ids]
    if len(ids) == 1:
        index = ids[0]
    elif local < len(ids):
        index = ids[local]
    else:
        raise ValueError(
            f"device_ids={list(device_ids)!r} lists {len(ids)} GPUs but this process has LOCAL_RANK={local}: start "
            f"at most {len(ids)} processes per machine, or leave device_ids unset to use cuda:LOCAL_RANK."
        )
    if index >= count:
        raise RuntimeError(f"device_ids selects cuda:{index} but only {count} CUDA device(s) are visible")
    return torch.device("cuda", index)


def _ensure_group(device):
    """Initialises the default process group from the torchrun variables unless one exists (NCCL for CUDA, gloo
    for the CPU); the group is destroyed at a clean exit."""
    global _owned_group
    if group_initialized():
        return
    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed; use mode=\"single\"")
    if launch_env(require=True) is None:
        raise RuntimeError(
            "mode=\"distributed\" needs a torch.distributed launch, but none of "
            f"{', '.join(LAUNCH_VARS)} is set and no default process group is initialised. {LAUNCH_HINT} "
            "Alternatively call torch.distributed.init_process_group() before wrapping the model."
        )
    if device.type == "cuda":
        dist.init_process_group(backend="nccl", init_method="env://", device_id=device)
    else:
        dist.init_process_group(backend="gloo", init_method="env://")
    if not _owned_group:
        atexit.register(_destroy_owned_group)
    _owned_group = True


def get_rank():
    """This process's global rank: the process group's, else RANK from the environment, else 0."""
    if group_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0") or 0)
    except ValueError:
        return 0


def get_world_size():
    """The number of processes: the process group's size, else WORLD_SIZE from the environment, else 1."""
    if group_initialized():
        return dist.get_world_size()
    try:
        return max(int(os.environ.get("WORLD_SIZE", "1") or 1), 1)
    except ValueError:
        return 1


# ---- The wrapper -------------------------------------------------------------------------------------------------


class DistributedDataParallel(DataParallel, distributed_launch=True):
    """``fastdp.DataParallel`` on torch.distributed: one process per device, torch's DDP underneath.

    Built by ``fastdp.DataParallel(model)`` in a torchrun launch (WORLD_SIZE > 1) or when a default process group
    exists, or directly. Initialises the default group if needed, moves ``module`` to this process's device
    (cuda:LOCAL_RANK, or the CPU) and wraps it in ``torch.nn.parallel.DistributedDataParallel`` (``self.ddp``);
    ``ddp_options`` (``find_unused_parameters``, ``bucket_cap_mb``, ``static_graph``…) go to it unchanged.
    With ``criterion``, ``model(x, target=y)`` returns ``criterion(output, y)`` for this rank's shard (DataParallel's
    per-replica loss); ``chunk_sizes`` is accepted and ignored, since every process has a single device.
    Keeps DataParallel's conveniences: prefix-free ``state_dict()``, ``load_state_dict`` accepting both forms and
    attribute forwarding to the wrapped module; adds DDP's ``no_sync()`` and ``join()``.
    """

    def __init__(self, module, device_ids=None, output_device=None, dim=0, *, mode="distributed", chunk_sizes=None,
                 criterion=None, criterion_reduction=None, broadcast=None, report=False, oom=None, **ddp_options):
        """Wraps ``module`` for this rank: DataParallel's arguments (see the class docstring for those that apply
        here), plus ``ddp_options`` for ``torch.nn.parallel.DistributedDataParallel``."""
        check_mode(mode)
        if mode == "single":
            raise ValueError(
                "fastdp.DistributedDataParallel always runs on torch.distributed; use fastdp.DataParallel(..., "
                "mode=\"single\") for a single-process DataParallel"
            )
        if criterion is not None and not callable(criterion):
            raise TypeError(f"criterion must be callable (e.g. nn.CrossEntropyLoss()), got {type(criterion).__name__}")
        # chunk_sizes splits a batch among one process's replicas, criterion_reduction says how a criterion's chunk
        # losses combine and broadcast names arguments not split; here every process has one device: checked, then
        # ignored.
        _replica_loss.check_declared(criterion_reduction, criterion)
        _split.parse_broadcast(broadcast)
        # report= and oom= see the replicas of one process; with one device per process, torch's profiler and
        # DDP's own tools measure a rank: checked, then ignored.
        _recorder.parse_steps(report)
        _rescue.parse(oom)
        # DataParallel.__init__ resolves single-process devices; this wrapper needs only Module's set-up plus the
        # conveniences DataParallel defines as methods and one load hook, which it inherits or reuses below.
        Module.__init__(self)
        torch._C._log_api_usage_once("fastdp.DistributedDataParallel")
        device = _bind_device(device_ids)
        _ensure_group(device)
        module.to(device)
        index = [device.index] if device.type == "cuda" else None
        # output_device is ignored: each rank's outputs stay on its own device (one GPU per process).
        ddp = torch.nn.parallel.DistributedDataParallel(module, device_ids=index, dim=dim, **ddp_options)
        self.module = module
        # Outside _modules: the wrapped module is reached once, through self.module, by parameters(), state_dict(),
        # to(), apply()…; DDP's own forward is called explicitly.
        self.__dict__["ddp"] = ddp
        self.__dict__["_criterion"] = criterion  # not a submodule, as in DataParallel
        self._register_load_state_dict_pre_hook(_checkpoint.nested_load_pre_hook, with_module=True)
        self.dim = dim
        self.device_ids = index if index is not None else []
        self.output_device = ddp.output_device if index is not None else None
        self.src_device_obj = device

    def forward(self, *inputs, **kwargs):
        """``model(*inputs, **kwargs)``: DDP's forward on this rank's batch; with ``criterion=`` and ``target=``,
        ``criterion(output, target)`` on this rank."""
        criterion = self.__dict__.get("_criterion")
        if criterion is not None and "target" in kwargs:  # DataParallel's per-replica loss: here, per process
            target = kwargs.pop("target")
            return criterion(self.ddp(*inputs, **kwargs), target)
        return self.ddp(*inputs, **kwargs)

    def report(self, steps=None):
        """DataParallel's report measures the replicas of one process; here each process runs one device."""
        raise RuntimeError(
            "dp.report() measures the replicas of a single-process fastdp.DataParallel; under torch.distributed "
            "each process runs one device: use torch.profiler on a rank, or mode=\"single\" to compare replicas"
        )

    def enable_report(self, steps=20):
        """Raises, as ``report()`` does: each process runs one device, with no replicas of its own to compare."""
        self.report()

    @property
    def batch_split(self):
        """Each process runs one device on its own batch (``fastdp.shard(loader)``): nothing is split here."""
        return _split.BatchSplit(None, "none: one device per process, each rank's batch its own")

    def no_sync(self):
        """DDP's context manager: backward inside it accumulates gradients locally, without communication."""
        return self.ddp.no_sync()

    def join(self, *args, **kwargs):
        """DDP's context manager for ranks with unequal numbers of batches (``torch.distributed.algorithms.Join``)."""
        return self.ddp.join(*args, **kwargs)

    def register_comm_hook(self, state, hook):
        """DDP's gradient communication hook (compression, PowerSGD, …)."""
        return self.ddp.register_comm_hook(state, hook)

    def train(self, mode=True):
        """``nn.Module.train``, passed on to the DDP wrapper inside."""
        super().train(mode)
        self.ddp.training = mode
        return self

    def _apply(self, fn, recurse=True):
        result = super()._apply(fn, recurse)
        # DDP's reducer is bound to the parameters' device: a move after wrapping would break gradient sync, and
        # a hard-coded "cuda:0" would put every rank on one GPU. Refuse loudly instead.
        ddp = self.__dict__.get("ddp")
        if ddp is not None:
            for t in itertools.chain(self.module.parameters(), self.module.buffers()):
                if t.device != self.src_device_obj:
                    raise RuntimeError(
                        f"the module was moved to {t.device} after fastdp wrapped it for torch.distributed on "
                        f"{self.src_device_obj}: each process owns one device (cuda:LOCAL_RANK). Move the model "
                        "before wrapping it, or use torch.device('cuda') (this process's current device)."
                    )
        return result

    def extra_repr(self):
        """Rank, world size, device and backend, shown in ``repr(model)``."""
        backend = dist.get_backend() if group_initialized() else "?"
        return f"rank={get_rank()}, world_size={get_world_size()}, device={self.src_device_obj}, backend={backend}"


# ---- Helpers: data sharding, saving, printing once -------------------------------------------------------------


class ShardedLoader:
    """A DataLoader over this rank's shard (a DistributedSampler) that calls ``set_epoch`` on every ``iter()``.

    Iterating starts epoch ``self.epoch`` and then increments it, so each epoch is shuffled differently and the
    same way on every rank. ``set_epoch(n)`` sets the next epoch (for resuming). Other attributes are the loader's.
    """

    def __init__(self, loader, sampler, epoch=0):
        """``loader`` (built by ``fastdp.shard`` around ``sampler``), whose next ``iter()`` starts ``epoch``."""
        self.loader = loader
        self.sampler = sampler
        self.epoch = epoch

    def set_epoch(self, epoch):
        """The epoch the next ``iter()`` starts (for resuming)."""
        self.epoch = epoch

    def __iter__(self):
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return iter(self.loader)

    def __len__(self):
        return len(self.loader)

    def __getattr__(self, name):
        if name.startswith("__") or "loader" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["loader"], name)


_COPIED_LOADER_ARGS = (
    "num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context", "generator",
    "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order",
)


def _shardable_shuffle(loader):
    """The loader's shuffle setting, after checking that shard() can rebuild it around a DistributedSampler."""
    if isinstance(loader.dataset, IterableDataset):
        raise ValueError("shard() cannot shard an IterableDataset: split it by rank inside the dataset's __iter__")
    if loader.batch_size is None:
        raise ValueError(
            "shard() needs a DataLoader built with batch_size= (and shuffle= or no sampler), not batch_sampler= "
            "or batch_size=None; build a DistributedSampler yourself for custom batching"
        )
    if isinstance(loader.sampler, RandomSampler):
        if loader.sampler.replacement or loader.sampler._num_samples is not None:
            raise ValueError("shard() cannot shard a RandomSampler with replacement or num_samples")
        return True
    if isinstance(loader.sampler, SequentialSampler):
        return False
    raise ValueError(
        f"shard() cannot shard a DataLoader with a custom sampler ({type(loader.sampler).__name__}); use "
        "shuffle=True/False, or a torch.utils.data.DistributedSampler of your own"
    )


def _rank_batch_size(batch_size, num_replicas, split_batch):
    """Each rank's batch size: the global batch split over the ranks with split_batch, else batch_size."""
    if not split_batch:
        return batch_size
    if batch_size % num_replicas:
        raise ValueError(
            f"batch_size={batch_size} is the global batch (split_batch=True) and must be divisible by the "
            f"world size {num_replicas}; pick a multiple of {num_replicas}, or pass split_batch=False to load "
            f"batch_size samples on every rank"
        )
    return batch_size // num_replicas


def _copied_loader_args(loader):
    """The DataLoader arguments shard() copies from loader (those this torch accepts; the worker-only ones only
    with workers)."""
    accepted = inspect.signature(DataLoader.__init__).parameters
    kwargs = {name: getattr(loader, name) for name in _COPIED_LOADER_ARGS if name in accepted and hasattr(loader, name)}
    if not kwargs.get("num_workers"):
        kwargs.pop("prefetch_factor", None)
        kwargs.pop("persistent_workers", None)
    return kwargs


def shard(loader, *, split_batch=True, seed=0, num_replicas=None, rank=None):
    """Returns ``loader`` sharded across the ranks: one call, for DataLoaders built with ``batch_size=`` and
    ``shuffle=`` (or a default sampler).

    Not distributed (and ``num_replicas`` unset, or 1): returns ``loader`` itself, so the script runs unchanged on
    one machine. Otherwise returns a ``ShardedLoader`` with a ``DistributedSampler`` (``shuffle`` as the loader's,
    ``seed``, ``drop_last`` as the loader's) and every other DataLoader argument copied; its ``__iter__`` calls
    ``set_epoch``. With ``split_batch`` (default) ``batch_size`` stays the global batch, as with DataParallel:
    each rank loads ``batch_size // world_size`` samples, so learning rates and results keep their meaning;
    ``split_batch=False`` gives every rank ``batch_size`` samples (DDP's convention). ``num_replicas`` and
    ``rank`` override the process group's.
    """
    if not isinstance(loader, DataLoader):
        raise TypeError(f"shard() expects a torch.utils.data.DataLoader, got {type(loader).__name__}")
    if num_replicas is None:
        num_replicas = get_world_size() if group_initialized() or is_distributed() else 1
    if rank is None:
        rank = get_rank() if num_replicas > 1 else 0
    if num_replicas == 1:
        return loader
    shuffle = _shardable_shuffle(loader)
    batch_size = _rank_batch_size(loader.batch_size, num_replicas, split_batch)
    sampler = DistributedSampler(
        loader.dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=loader.drop_last
    )
    kwargs = _copied_loader_args(loader)
    inner = DataLoader(loader.dataset, batch_size=batch_size, sampler=sampler, drop_last=loader.drop_last, **kwargs)
    return ShardedLoader(inner, sampler)


def save(obj, f, *args, src=0, **kwargs):
    """``torch.save(obj, f, ...)`` on rank ``src`` only; every rank must call it, and all return once it is written.

    The other ranks can then ``torch.load`` the file (on a filesystem they share). If the save fails on ``src``,
    it raises there and a RuntimeError naming the failure on the other ranks, instead of leaving them waiting.
    Not distributed: plain ``torch.save``.
    """
    if not group_initialized() or dist.get_world_size() == 1:
        torch.save(obj, f, *args, **kwargs)
        return
    error = None
    if dist.get_rank() == src:
        try:
            torch.save(obj, f, *args, **kwargs)
        except BaseException as exc:  # noqa: BLE001  (re-raised below, after the others were told)
            error = exc
    status = [None if error is None else f"{type(error).__name__}: {error}"]
    dist.broadcast_object_list(status, src=src)
    if error is not None:
        raise error
    if status[0] is not None:
        raise RuntimeError(f"fastdp.save: rank {src} failed to write {f!r}: {status[0]}")


def print0(*args, **kwargs):
    """``print`` on global rank 0 only (every process when not distributed)."""
    if get_rank() == 0:
        print(*args, **kwargs)


class RankZeroFilter(logging.Filter):
    """A logging filter that passes records on global rank ``rank`` (default 0) only.

    Attach it to a handler (``handler.addFilter(fastdp.RankZeroFilter())``) so records from every logger are
    filtered; a filter on a logger sees only that logger's own records.
    """

    def __init__(self, rank=0):
        """Passes the records of global rank ``rank`` only."""
        super().__init__()
        self.rank = rank

    def filter(self, record):
        """Whether ``record`` passes: this process is global rank ``self.rank``."""
        return get_rank() == self.rank
