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
from ..kernels.ltp import RoundCore

RESCALE, ZERO = "rescale", "zero"
FILLS = (RESCALE, ZERO)


class LtpRound(RoundCore):
    """One slice's round at a server under LTP; ``acc`` is its (zeroed) accumulator.  Its state
    and ``add`` (a DATA packet: check, scatter-add, count; per packet the server's hot path)
    are ``RoundCore``'s (kernels.ltp_py documents the attributes; kernels._ltp compiles them,
    and its ``intake`` adds most packets without a call here); ``lowest``: the lowest
    acceptance ratio the round can close at (``below``)."""

    __slots__ = ()

    def credit(self, worker, k):
        """Count ``k`` more packets of ``worker``'s part (``received`` and ``below``)."""
        r = self.received[worker] = self.received[worker] + k
        if r - k < self.need <= r:
            self.below -= 1

    def packet_elements(self, seq):
        """Elements of packet ``seq``: all but the last carry ``epp``."""
        return min(self.epp, self.length - seq * self.epp)

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
