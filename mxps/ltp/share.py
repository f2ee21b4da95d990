"""The server's share of its receive rate among the workers pushing to it (the ACK's grant).

Incast is many paths into one link: each worker's BBR model sees only its own path, and eight of
them, each probing 25% above its estimate and each estimate a windowed max, together overrun a
shallow switch queue (measured: 10% of the packets dropped by the queue with no random loss at
all, docs/LTP.md).  The server sees all of them: it measures what arrives, ``capacity`` (the
median over recent windows of the bytes that arrived per second while packets kept coming: a
bottleneck's rate when it was busy; not the max, because the server reads its socket in batches
and a batch read after a pause looks like a burst far above the link), and grants each active worker an equal share of it, with ``HEADROOM`` above it so that a link
that got faster is found.  Not a max-min (water-filling) share: measured, it gave more than
the link in all (sum of grants 1.8x the capacity), because on a busy machine a worker's
packets come in clumps and a worker that looks slow in one window is only late, not limited
elsewhere (a max-min share needs a server that can tell the two apart).  The worker paces at
``min(its BBR rate, the grant)``: BBR still finds a bottleneck of its own (a slow uplink), the
grant keeps the sum near the server's link.  Pure: every method takes ``now``.
"""
from collections import deque

WINDOW = 0.01          # seconds per rate sample
CAPACITY_WINDOWS = 100     # capacity: the median over this many samples (1 s)
ACTIVE = 0.5           # a worker is active if a packet of it came within this many seconds
#                        (longer than a training step's compute: a round's early pushers do
#                        not get the whole link just because the others have not started)
HEADROOM = 1.05        # the grant's margin over an exact share (to find more capacity)


class Share:
    def __init__(self, num_workers):
        self.n = num_workers
        self._start = None
        self._bytes = 0
        self._per = [0] * num_workers
        self._rates = deque(maxlen=CAPACITY_WINDOWS)
        self._worker_rate = [0.0] * num_workers
        self._last = [None] * num_workers
        self._hi = [None] * num_workers
        self.capacity = None

    def on_packet(self, worker, nbytes, now, pn=None):
        """A packet of ``nbytes`` from ``worker`` arrived at ``now``.  With its packet number
        ``pn`` the packets it skipped (lost on the way) count as sent too: the grant is a
        sending rate, and counting only what arrived would shrink it by the loss rate at every
        window (measured: rounds 40% slower at 5% loss, and slower round after round)."""
        if pn is not None:
            hi = self._hi[worker]
            if hi is not None:
                gap = (pn - hi) & 0xFFFFFFFF
                if gap == 0 or gap >= 1 << 31:          # a duplicate or a late one
                    nbytes = 0
                else:
                    nbytes *= min(gap, 64)
            if nbytes or hi is None:
                self._hi[worker] = pn
        if self._start is None:
            self._start = now
        elif now - self._start >= WINDOW:
            span = now - self._start
            if span < 4 * WINDOW:       # a gap (nothing arrived) is not a rate sample
                self._rates.append(self._bytes / span)
                xs = sorted(self._rates)
                self.capacity = xs[len(xs) // 2]
                for w in range(self.n):
                    self._worker_rate[w] = self._per[w] / span
            self._start, self._bytes = now, 0
            self._per = [0] * self.n
        self._bytes += nbytes
        self._per[worker] += nbytes
        self._last[worker] = now

    def grant(self, now):
        """The rate (bytes/s) each active worker is asked not to exceed; 0 before the first
        sample (no grant: the workers' own models rule)."""
        if self.capacity is None:
            return 0.0
        active = [w for w in range(self.n)
                  if self._last[w] is not None and now - self._last[w] <= ACTIVE]
        if not active:
            return 0.0
        return HEADROOM * self.capacity / len(active)

