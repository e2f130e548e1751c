"""Balancing device 0 and the devices against each other: how a batch is split (``split``), the loss computed on
each replica (``replica_loss``), the memory each device holds (``memory``), and the out-of-memory rescue
(``rescue``). The public names are in ``fastdp.balance``."""
