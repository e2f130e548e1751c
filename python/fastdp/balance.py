"""``fastdp.balance``: the public names of balancing device 0 in one namespace (docs/balance.md).

They live in the modules named for each part: the batch split (``fastdp.split``), the per-replica loss
(``fastdp.replica_loss``), the idle master's buffers (``fastdp.idle_master``) and the memory report
(``fastdp.memory``).
"""

from .memory import DeviceMemory, MemoryReport, memory_report
from .split import AutoSplit, largest_remainder

__all__ = ["AutoSplit", "DeviceMemory", "MemoryReport", "memory_report", "largest_remainder"]
