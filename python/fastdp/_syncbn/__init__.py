"""What a synced BatchNorm layer (``fastdp.sync_batchnorm``, NOTE [synced layers]) computes beside the exchange between
replicas: each replica's arithmetic on its own chunk (``chunk``), and a checkpointed block's recomputation of a synced
call in backward (``recompute``)."""
