"""``fastdp.balance``: the public names of balancing device 0 in one namespace (docs/balance.md).

The code lives in private modules named for each part: the batch split (``fastdp._split``), the per-replica loss
(``fastdp._replica_loss``), the idle master's buffers (``fastdp._idle_master``) and the memory report
(``fastdp._memory``).
"""

from ._memory import DeviceMemory, MemoryReport, memory_report
from ._split import AutoSplit, largest_remainder

__all__ = ["AutoSplit", "DeviceMemory", "MemoryReport", "memory_report", "largest_remainder"]
