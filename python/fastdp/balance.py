"""``fastdp.balance``: the public names of balancing device 0 in one namespace (docs/balance.md).

The code lives in private modules named for each part: the batch split (``fastdp._balance.split``), the per-replica loss
(``fastdp._balance.replica_loss``), the idle master's buffers (``fastdp._step.idle_master``) and the memory report
(``fastdp._balance.memory``).
"""

from ._balance.memory import DeviceMemory, MemoryReport, memory_report
from ._balance.split import AutoSplit, BatchSplit, largest_remainder

__all__ = ["AutoSplit", "BatchSplit", "DeviceMemory", "MemoryReport", "memory_report", "largest_remainder"]
