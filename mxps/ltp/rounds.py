"""A server's LTP accounting of one (slice, round), and Bubble Filling when it closes.

Packets are added straight into the round's accumulator (zeroed when the round opens) at their
offset, in whatever order they come; ``counts[i]`` says how many workers' packet ``i`` arrived
(a worker's packet is counted once: duplicates and replays change nothing).  A worker that
pushed the slice over TCP instead (``add_whole``) counts for every packet.

When the round closes the holes are filled (``fill``):
- ``rescale`` (unbiased): packet i's sum is multiplied by W / counts[i], the expected full sum
  given the workers that arrived (more variance, no bias);
- ``zero``: a missing packet adds zero (the sum shrinks by the loss, like a smaller learning
  rate for those elements, no extra variance).
Elements of a packet that reached the server from *no* worker carry no information at all;
``fill`` returns them as ``frozen`` ranges and the server keeps their weights and optimizer
state as they were (a round that did not happen for them: no momentum step, no weight decay),
under either filling.  With the optimizer on the workers the server can only serve a sum, and
those elements' sum is zero.
"""
import numpy as np

from ..kernels.accum import add_into, copy_into
from ..kernels.ltp import round_add
from .packet import packet_count

RESCALE, ZERO = "rescale", "zero"
FILLS = (RESCALE, ZERO)


class LtpRound:
    """One slice's round at a server under LTP; ``acc`` is its (zeroed) accumulator."""

    __slots__ = ("acc", "length", "epp", "n", "workers", "counts", "seen", "received",
                 "heard", "ends", "first", "last", "dtype", "duplicates", "need", "below")

    def __init__(self, acc, epp, num_workers, dtype_code, lowest=0.0):
        """``lowest``: the lowest acceptance ratio the round can close at (``below``)."""
        self.acc = acc
        self.length = acc.size
        self.epp = epp
        self.n = packet_count(self.length, epp)
        self.workers = num_workers
        self.dtype = dtype_code
        self.counts = np.zeros(self.n, dtype=np.uint16)
        self.seen = [None] * num_workers      # per worker: bytearray(n) once it sent a packet
        self.received = [0] * num_workers
        self.heard = [None] * num_workers
        self.ends = [None] * num_workers
        self.first = None
        self.last = None
        self.duplicates = 0
        # how many workers' parts are still below ``lowest`` of the packets: while any is, no
        # DATA packet can close the round by ratio or completion (the server skips the look)
        self.need = lowest * self.n
        self.below = num_workers if self.need > 0 else 0

    def credit(self, worker, k):
        """Count ``k`` more packets of ``worker``'s part (``received`` and ``below``)."""
        r = self.received[worker] = self.received[worker] + k
        if r - k < self.need <= r:
            self.below -= 1

    def packet_elements(self, seq):
        """Elements of packet ``seq``: all but the last carry ``epp``."""
        return min(self.epp, self.length - seq * self.epp)

    def _hear(self, worker, now):
        if self.heard[worker] is None:
            self.heard[worker] = now
        if self.first is None:
            self.first = now

    def add(self, worker, seq, count, payload, now):
        """Add DATA packet ``seq`` of ``worker``.  Returns False for a duplicate (nothing
        changes); raises ValueError for a packet that does not fit the slice.  The check, the
        scatter-add and the counting are one call of ``kernels.ltp.round_add`` (per packet
        this is the server's hot path)."""
        seen = self.seen[worker]
        if seen is None:                # kept only once a packet was added
            seen = bytearray(self.n)
        if not round_add(self.acc, self.counts, seen, seq, self.epp, count, payload,
                         self.dtype):
            self.duplicates += 1
            return False
        self.seen[worker] = seen
        r = self.received[worker] = self.received[worker] + 1
        if r - 1 < self.need <= r:           # credit(worker, 1), without a call per packet
            self.below -= 1
        if self.heard[worker] is None:
            self._hear(worker, now)
        self.last = now
        return True

    def add_whole(self, worker, grad, now):
        """A worker's whole slice (pushed reliably).  False if it had already sent any of it."""
        if self.seen[worker] is not None or self.ends[worker] is not None:
            return False
        if self.counts.any():
            add_into(self.acc, grad, self.dtype)
        else:
            copy_into(self.acc, grad)
        self.seen[worker] = bytearray(b"\x01") * self.n
        self.counts += 1
        self.credit(worker, self.n - self.received[worker])
        self.ends[worker] = now
        self._hear(worker, now)
        self.last = now
        return True

    def end(self, worker, sent, now):
        """Worker's END: it sent all ``sent`` packets.  Raises ValueError if ``sent`` is not the
        slice's packet count; a repeated END changes nothing."""
        if sent != self.n:
            raise ValueError("an END for %d packets, the slice has %d" % (sent, self.n))
        if self.ends[worker] is None:
            self.ends[worker] = now
        self._hear(worker, now)

    def delivered(self):
        """The fraction of all workers' packets that arrived."""
        return float(sum(self.received)) / (self.n * self.workers) if self.n else 1.0

    def fill(self, mode):
        """Fill the holes (see module doc); returns the frozen element ranges [(lo, hi), ...]
        (packets no worker delivered)."""
        if mode not in FILLS:
            raise ValueError("unknown filling %r (use %s)" % (mode, " or ".join(FILLS)))
        c = self.counts
        w = self.workers
        if mode == RESCALE:
            partial = (c > 0) & (c < w)
            if partial.any():
                scale = np.ones(self.n, dtype=np.float64)
                scale[partial] = w / c[partial].astype(np.float64)
                self.acc *= np.repeat(scale, self.epp)[:self.length].astype(self.acc.dtype)
        frozen = []
        for i in np.flatnonzero(c == 0):
            lo = int(i) * self.epp
            hi = lo + self.packet_elements(int(i))
            if frozen and frozen[-1][1] == lo:
                frozen[-1] = (frozen[-1][0], hi)
            else:
                frozen.append((lo, hi))
        return frozen
