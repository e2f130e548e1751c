"""Whether this process is one rank of a torch.distributed launch: torchrun's variables, an existing default
process group, and the ``mode=`` values that choose between a single-process and a distributed wrapper.

Read by ``fastdp.DataParallel``'s constructor (which class to build) and by ``fastdp.distributed`` (how to join
the launch); it imports nothing from fastdp, so both can use it.
"""

import os
from collections import namedtuple

import torch.distributed as dist

__all__ = ["MODES", "LaunchEnv", "LAUNCH_VARS", "LAUNCH_HINT", "launch_env", "is_distributed", "check_mode",
           "group_initialized", "int_var", "choose_class"]

MODES = ("auto", "single", "distributed")

# The variables torchrun sets for every worker; init_process_group("env://") reads all but LOCAL_RANK.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

LAUNCH_HINT = (
    "Launch the script with `torchrun --nproc_per_node N script.py` (add --nnodes/--node_rank/--master_addr or "
    "--rdzv_endpoint across machines), which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; "
    "or set the missing variables; or pass mode=\"single\" to run a single-process DataParallel."
)

LaunchEnv = namedtuple("LaunchEnv", "rank world_size local_rank master_addr master_port")


# ---- Detection --------------------------------------------------------------------------------------------------


def group_initialized():
    """Whether this process has a default torch.distributed process group."""
    return dist.is_available() and dist.is_initialized()


def int_var(env, name, lo=None, hi=None):
    """``env[name]`` as an int within [lo, hi]; else a ValueError naming the variable and how to launch."""
    text = env[name]
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"environment variable {name}={text!r} is not an integer. {LAUNCH_HINT}") from None
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"environment variable {name}={value} is out of range (expected {bounds}). {LAUNCH_HINT}")
    return value


def launch_env(environ=None, require=False):
    """The torchrun variables as a ``LaunchEnv``, or None when the process was not launched for several ranks.

    None when none of RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT is set (empty counts as unset), or
    when WORLD_SIZE is 1 and ``require`` is false. Raises ValueError for a half-set environment: some of them set
    without WORLD_SIZE, or WORLD_SIZE > 1 (or ``require``) with any of them missing, or values out of range.
    """
    env = os.environ if environ is None else environ
    present = {name: env[name] for name in LAUNCH_VARS if env.get(name, "") != ""}
    if not present:
        return None
    if "WORLD_SIZE" not in present:
        raise ValueError(
            f"{', '.join(sorted(present))} {'is' if len(present) == 1 else 'are'} set but WORLD_SIZE is not: the "
            f"environment is half a torch.distributed launch. {LAUNCH_HINT}"
        )
    world_size = int_var(present, "WORLD_SIZE", lo=1)
    if world_size == 1 and not require:
        return None
    missing = [name for name in LAUNCH_VARS if name not in present]
    if missing:
        raise ValueError(
            f"WORLD_SIZE={world_size} is set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not: "
            f"the environment is half a torch.distributed launch. {LAUNCH_HINT}"
        )
    return LaunchEnv(
        rank=int_var(present, "RANK", lo=0, hi=world_size - 1),
        world_size=world_size,
        local_rank=int_var(present, "LOCAL_RANK", lo=0),
        master_addr=present["MASTER_ADDR"],
        master_port=int_var(present, "MASTER_PORT", lo=1, hi=65535),
    )


def is_distributed():
    """Whether fastdp.DataParallel(mode="auto") would run on torch.distributed here (never initialises anything).

    True when a default process group is initialised, or when the torchrun variables say WORLD_SIZE > 1.
    Raises ValueError for a half-set environment.
    """
    if group_initialized():
        return True
    return launch_env() is not None


def check_mode(mode):
    """``mode=`` must be one of MODES (a ValueError naming them otherwise)."""
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(repr(m) for m in MODES)}; got {mode!r}")


def choose_class(cls, mode, single, distributed):
    """The class ``single(..., mode=mode)`` builds when called as ``cls``: ``cls``, or ``distributed`` (the class a
    distributed launch builds, None while it is not defined) in a distributed launch."""
    check_mode(mode)
    if mode == "single" or (distributed is not None and issubclass(cls, distributed)):
        return cls
    if mode == "auto" and not is_distributed():
        return cls
    if cls is not single:
        # A subclass overrides the single-process pipeline (scatter, gather…), which DDP does not run.
        raise RuntimeError(
            f"{cls.__name__} subclasses fastdp.DataParallel and cannot be switched to torch.distributed "
            f"(mode={mode!r} in a distributed launch). Pass mode=\"single\" to run it as a single-process "
            "DataParallel in each process, or wrap the model with fastdp.DataParallel itself."
        )
    return distributed
