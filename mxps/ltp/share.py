"""The server's share of its receive rate among the workers pushing to it (the ACK's grant).

Incast is many paths into one link: each worker's BBR model sees only its own path, and eight of
them, each probing 25% above its estimate and each estimate a windowed max, together overrun a
shallow switch queue (measured: 10% of the packets dropped by the queue with no random loss at
all, docs/LTP.md).  The server sees all of them: it measures what arrives and grants each active
worker an equal share of its link, with ``HEADROOM`` above it.  The worker paces at
``min(its BBR rate, the grant)``: BBR still finds a bottleneck of its own (a slow uplink), the
grant keeps the sum near the server's link.  Not a max-min (water-filling) share: measured, it
gave more than the link in all (sum of grants 1.8x the capacity), because on a busy machine a
worker's packets come in clumps and a worker that looks slow in one window is only late, not
limited elsewhere (a max-min share needs a server that can tell the two apart).

``capacity`` is what the link has been seen to carry: the ``RANK``-th highest rate (bytes
that arrived per second of a ``WINDOW`` while packets kept coming) of the last ``HORIZON``
seconds.  A high rank, not the median: the rate of a window is at most the link's, but it is
also at most what the workers had to send and what the grant let them send, and in a training
job most windows are neither full nor grant-limited (the gradients of a backward pass come
layer by layer, rounds start and end, workers finish at different times).  The median of such
windows measured the demand, not the link, and a grant cut from it capped the next windows at
it: measured (issue #11, resnet18 over 3 x 3 servers), the capacity began at 0.5-2 MB/s from
the first windows of the job and stayed at 2-4 MB/s for its whole run on 12.5-50 MB/s links,
with every busy path paced at the grant.  A window fuller than the link cannot happen, so a
high rank is a lower bound of the link that only a real window raises; not the very highest
(``RANK`` > 1), so that one odd window is ignored.  A time horizon, not a count of windows, so
that the windows of a slow stretch (a backward pass) do not push out the full ones of the last
push phase.  The windows run on the kernel's arrival time of each packet (SO_TIMESTAMPNS, read
with the batch: session 11), so when the server got round to reading a packet does not matter.
Without stamps (a socket that refuses the option) they run on read times: the server reads its
socket in batches, a window runs from one read to a later one and counts the bytes of the reads
after its start (they arrived within it), and it starts only at a read that drained the socket;
counting a read in the window in which it happened put the bytes that came during a pause (a
busy CPU) into the next window, 1.5-2.2x the link, and starting a window at a read that left a
backlog counted the catching up, 1.45x (tests/test_ltp_share.py).

Only bytes that arrived count, not the packet numbers that were skipped (lost on the way):
counting the skipped ones measured the sending rate, which the grant itself sets, so with a
full link the drops of the switch queue raised the estimate and the grant with it (simulated,
tests/test_ltp_share.py's closed loop: 4 backlogged workers into a 25 MB/s link, the sum of
the grants settled at 1.4x the link without random loss and 1.6x with 5%).  To find a link
faster than what it has seen, the grant probes as BBR does, for the sum of the workers: its
gain over an exact share is ``GAINS`` in turn, a window each, the same phase for every worker
(1.15 for a window, then 0.85 to drain what the probe queued, then 1 for two): a probe window
that delivers more raises the capacity, so grant-limited senders find the link from a low
start in 2.5-3 s (x25), random loss does not lower it (the probe's windows deliver 1.15 x
(1 - p) of the capacity), and a full link sees 1.5 ms of queue per probe and its average
(a continuous 10% margin would overrun a full link by 9% all the time: with it, and reads
counted where they happened, the incast benchmark delivered 76% of its packets in time, 93%
before issue #11).  Pure: every method takes ``now``.
"""
import heapq
from collections import deque

WINDOW = 0.01          # seconds per rate sample
HORIZON = 10.0         # seconds: capacity is a high rank of the samples of this long ...
RANK = 2               # ... the RANK-th highest (a lone burst from a late read is ignored)
ACTIVE = 0.5           # a worker is active if a packet of it came within this many seconds
#                        (longer than a training step's compute: a round's early pushers do
#                        not get the whole link just because the others have not started)
GAINS = (1.15, 0.85, 1.0, 1.0)   # the grant's gain over an exact share, one WINDOW each, in turn
#                        (the same phase for every worker: the sum of their rates probes)


def kth_highest(rates, k=RANK):
    """The ``k``-th highest of ``rates`` (the lowest if there are fewer than ``k``); None if
    empty."""
    if not rates:
        return None
    top = heapq.nlargest(k, rates)
    return top[-1]


def gain(now):
    """The grant's gain at ``now``: ``GAINS`` in turn, a ``WINDOW`` each."""
    return GAINS[int(now / WINDOW) % len(GAINS)]


class Share:
    def __init__(self, num_workers):
        self.n = num_workers
        self._start = None              # the window: reads in (start, read]; None: no window
        #                                 (waiting for a read that drains the socket)
        self._read = None               # the time of the last read (its packets share it)
        self._drained = True            # ... and whether it emptied the socket
        self._bytes = 0
        self._samples = deque()         # (window end, bytes/s), oldest first
        self._last = [None] * num_workers
        self.capacity = None

    def on_packet(self, worker, nbytes, now, drained=True, arrival=None):
        """A packet of ``nbytes`` from ``worker`` was read at ``now`` (the packets of one
        batch read share their ``now``); ``drained``: that read emptied the socket (it returned
        fewer datagrams than it could take).  A window runs from one read to a later one and
        holds the bytes of the reads after its start: those arrived within it, provided the
        read at its start drained the socket.  So a window starts only at a draining read: after
        a read that left datagrams behind (a server behind its link), the next reads hold what
        came before it, and counting that backlog measured how fast the server caught up, not
        the link (issue #11: 72 MB/s of capacity on a 50 MB/s link, 13-17% of the packets
        dropped by its queue with no random loss).  A batch read after a pause does not count
        the pause's bytes in the next window either.

        ``arrival``: the kernel's arrival time of the packet (SO_TIMESTAMPNS, another clock
        than ``now``; None if there is none).  With it each packet is its own "read" at the
        moment it arrived, drained by definition: the windows are the link's own schedule,
        whenever the server read them (``now`` still says when the worker was last active)."""
        self._last[worker] = now
        if arrival is not None:
            now, drained = arrival, True
            if self._read is not None and now < self._read:
                # a clock step back (the realtime clock was set): start over from here
                self._read, self._start, self._bytes = now, now, 0
                return
        if self._read is None:
            self._read, self._drained = now, drained
            self._start = now if drained else None
            return
        if now != self._read:           # the first packet of a new read
            prev, prev_drained = self._read, self._drained
            self._read, self._drained = now, drained
            if self._start is not None and prev - self._start >= WINDOW:
                span = prev - self._start
                if span < 4 * WINDOW:   # a gap (nothing arrived) is not a rate sample
                    self._add(prev, self._bytes / span)
                self._start = None
            if now - prev >= 4 * WINDOW:
                # after a gap this read holds bytes that came at some time in it: a window
                # may start here (if it drained), its bytes not counted
                self._start, self._bytes = (now if drained else None), 0
            elif self._start is None:
                self._start, self._bytes = (prev if prev_drained else None), 0
        elif not drained:
            self._drained = False
        if self._start is not None and now > self._start:
            self._bytes += nbytes

    def _add(self, now, rate):
        samples = self._samples
        samples.append((now, rate))
        while samples[0][0] < now - HORIZON:
            samples.popleft()
        self.capacity = kth_highest([r for _, r in samples])

    def grant(self, now):
        """The rate (bytes/s) each active worker is asked not to exceed at ``now``: the
        ``gain(now)`` times an equal share of the capacity; 0 before the first sample (no
        grant: the workers' own models rule)."""
        if self.capacity is None:
            return 0.0
        active = [w for w in range(self.n)
                  if self._last[w] is not None and now - self._last[w] <= ACTIVE]
        if not active:
            return 0.0
        return gain(now) * self.capacity / len(active)
