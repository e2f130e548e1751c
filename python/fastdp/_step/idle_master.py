"""When ``device_ids[0]`` runs no chunk (``chunk_sizes`` gives it none): the master module stays there, unused by
the forward, and the first running replica's buffers are copied back to it, as upstream keeps replica 0's."""

import torch

__all__ = ["BufferWatch"]


class BufferWatch:
    """When device 0 has no chunk, the first running replica plays chunk 0's part: its buffers (BatchNorm running
    stats, num_batches_tracked) are copied back to the master's after the forward, as upstream keeps replica 0's.

    All of them are copied: BatchNorm updates its running stats inside the kernel without bumping their version
    counters, so changed buffers cannot be told apart cheaply; unchanged ones hold the master's values anyway. The
    master's version counter moves only where the replica's did (a write the master's own forward would have
    counted): a pending graph that saved a master buffer the forward left alone stays valid, as on the bare model.
    """

    def __init__(self, master, replica):
        theirs = dict(replica.named_buffers())
        self.pairs = []
        for name, b in master.named_buffers():
            r = theirs.get(name)
            if r is not None and r is not b and not b.requires_grad and r.shape == b.shape:
                self.pairs.append((b, r, r._version))

    def copy_back(self):
        with torch.no_grad():
            for b, r, version in self.pairs:
                if b.shape != r.shape:  # sized by the forward (a lazily sized buffer, an observer): the size too
                    b.resize_(r.shape)
                (b if r._version != version else b.data).copy_(r)
