"""One forward beyond upstream's four calls: the step's own state (``step``), the kept replicas that replicate hands
out (``replicas``) with the hooks they mirror (``hooks``), the autograd functions of scatter and gather
(``functions``), and the idle master's buffers when device 0 runs no chunk (``idle_master``)."""
