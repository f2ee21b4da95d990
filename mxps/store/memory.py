"""One slice of one key held in RAM (see ``mxps.store``)."""
import mxnet as mx
import numpy as np

from ..kernels.ndview import numpy_view


class MemorySlice:
    """The numbers of one slice: ``weight_nd`` (the stored value, an NDArray the optimizer
    updates in place; ``weight`` is a numpy view of it), ``snapshot`` (what pulls are served:
    the value after the last complete round) and reusable accumulators for the rounds' sums.

    ``value`` (a flat numpy array) becomes the first snapshot as it is: the caller hands over
    an array nothing else writes.  It is copied into the stored value ``COPY_BLOCK`` elements
    at a time, ``progress()`` called after every block: a slice of GBs takes seconds to copy
    (first touch of its pages), and a server doing that keeps heartbeating."""

    __slots__ = ("weight_nd", "weight", "snapshot", "_free")

    #: 4 MB of float32 per block: ms each
    COPY_BLOCK = 1 << 20

    def __init__(self, value, progress=None):
        self.weight_nd = mx.nd.empty(value.shape, dtype=value.dtype)
        self.weight_nd.wait_to_read()
        self.weight = numpy_view(self.weight_nd)
        for a in range(0, value.size, self.COPY_BLOCK):
            self.weight[a:a + self.COPY_BLOCK] = value[a:a + self.COPY_BLOCK]
            if progress is not None:
                progress()
        self.snapshot = value
        self._free = []            # (acc, acc_nd) accumulators of completed rounds

    def accumulator(self, like, for_optimizer):
        """A buffer for one round's sum, shaped and typed as ``like``: ``(acc, acc_nd)``, the
        numpy array to sum into and, ``for_optimizer``, the NDArray behind it (handed to the
        updater, then reused).  Without an optimizer the sum itself becomes the served value,
        so it gets a fresh buffer that is never reused (a reply may still be reading the
        previous one) and no NDArray."""
        if not for_optimizer:
            return np.empty_like(like), None
        if self._free:
            return self._free.pop()
        acc_nd = mx.nd.zeros((like.size,), dtype=like.dtype)
        acc_nd.wait_to_read()
        return numpy_view(acc_nd), acc_nd

    def recycle(self, acc, acc_nd):
        """An accumulator whose round was applied (the updater has finished reading it)."""
        self._free.append((acc, acc_nd))

    def serve_sum(self, acc):
        """Update on workers: the round's sum is the stored value."""
        self.snapshot = acc

    def serve_weights(self, copy):
        """Serve the weights after an update: the weights themselves, or (``copy``, when a
        reply may still be reading the last value while the weights change) a copy."""
        self.snapshot = self.weight.copy() if copy else self.weight

    def read(self, rows):
        """The served elements of ``rows`` (a ``sparse.RowSet``: a PULL_ROWS)."""
        return self.snapshot[rows.positions()]

    def cut(self, lo, hi):
        """A copy of the served elements [lo, hi) (slice coordinates)."""
        return np.array(self.snapshot[lo:hi])
