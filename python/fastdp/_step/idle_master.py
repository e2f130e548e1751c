"""When ``device_ids[0]`` runs no chunk (``chunk_sizes`` gives it none): the master module stays there, unused by
the forward, and the first running replica's buffers are copied back to it, as upstream keeps replica 0's."""

import torch

__all__ = ["BufferWatch"]


class BufferWatch:
    """When device 0 has no chunk, the first running replica plays chunk 0's part: its buffers (BatchNorm running
    stats, num_batches_tracked, quantization observers) are copied back to the master's after the forward, as
    upstream keeps replica 0's.

    All of them are copied: BatchNorm updates its running stats inside the kernel without bumping their version
    counters, so changed buffers cannot be told apart cheaply; unchanged ones hold the master's values anyway. Each is
    read from the replica's module when the forward has ended, and a master buffer whose replica the forward resized
    (an observer sizing its statistics per channel in its first forward, a lazily sized module) takes that size
    first, as the bare model's forward would have resized it. The master's version counter moves only where the
    replica's buffer was written or replaced (a write the master's own forward would have counted): a pending graph
    that saved a master buffer the forward left alone stays valid, as on the bare model.
    """

    def __init__(self, master, replica):
        theirs = dict(replica.named_modules())
        self.pairs = []  # (master buffer, replica module, key, the replica's buffer before the forward, its version)
        for name, module in master.named_modules():
            other = theirs.get(name)
            if other is None or other is module:
                continue
            for key, b in module._buffers.items():
                r = other._buffers.get(key)
                if b is not None and r is not None and r is not b and not b.requires_grad and r.shape == b.shape:
                    self.pairs.append((b, other, key, r, r._version))

    def copy_back(self):
        with torch.no_grad():
            for b, module, key, before, version in self.pairs:
                r = module._buffers.get(key)
                if r is None or r is b:
                    continue
                if r.shape != b.shape:  # sized by the forward (a lazily sized buffer, an observer): the size too
                    b.resize_(r.shape)
                written = r is not before or r._version != version
                (b if written else b.data).copy_(r)
