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
with the batch: session 11), so when the server got round to reading a packet does not matter;
since session 16 a window is a gain phase's bytes over the link's busy time in it (``_arrival``:
the idle spells between a job's rounds are not a slower link, and a window across phases
averaged the probe away).
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
OTHERS_HOLD = 0.5      # seconds a sample of other processes' TCP traffic (``others``) holds
COMBINED = 0.2         # seconds per capacity sample of the job's and others' bytes together
HEADROOM = 0.05        # of the capacity, left free while others' TCP traffic is under its share
IDLE_GAP = 4 * WINDOW  # seconds without a packet after which the link was idle anyway
TRAIN_SKIP = 0.001     # seconds at the start of a busy time not counted (a burst after idle)
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
    """``busy_windows``: with arrival stamps, the capacity over the link's busy time, a sample
    per gain phase (``_arrival``; False: windows over all the time, as before issue #11's
    session 16, for ablations); ``owing``: the grant shared by the workers that still owe an
    open round (False: by all active workers); ``fair``: the grant leaves other processes'
    TCP flows into this host their share (``others``; False: it does not look)."""

    def __init__(self, num_workers, busy_windows=True, owing=True, fair=True):
        self.n = num_workers
        self.busy_windows = busy_windows
        self.owing = owing
        self.fair = fair
        self._x, self._k, self._others_at = 0.0, 0, None
        self._read_bytes = self._other_bytes = 0.0      # cumulative, for ``others``
        self._combined = None           # (since, read bytes, others' bytes) of that sample
        # what ``others`` was told, for the server's report
        self.others_seen = {"looks": 0, "looks_with_flows": 0, "most_flows": 0,
                            "most_bytes_per_s": 0.0}
        self._start = None              # the window: reads in (start, read]; None: no window
        #                                 (waiting for a read that drains the socket)
        self._read = None               # the time of the last read (its packets share it)
        self._drained = True            # ... and whether it emptied the socket
        self._bytes = 0
        self._samples = deque()         # (window end, bytes/s), oldest first
        self._last = [None] * num_workers
        # stamped arrivals (_arrival): who is sending, and the window's busy time
        self._sending = [False] * num_workers
        self._busy_workers = 0
        self._busy = 0.0
        self._train = None              # when the current busy time began
        self._offset = None             # stamp clock - read clock, at the first stamp
        self._phase = None              # the gain phase the busy time and bytes are of
        self._owing = [0] * num_workers      # open rounds each worker's push is owed to
        self.capacity = None

    def on_packet(self, worker, nbytes, now, drained=True, arrival=None, end=False):
        """A packet of ``nbytes`` from ``worker`` was read at ``now`` (the packets of one
        batch read share their ``now``); ``drained``: that read emptied the socket (it returned
        fewer datagrams than it could take); ``end``: it is an END (the worker has sent its
        push whole).  A window runs from one read to a later one and
        holds the bytes of the reads after its start: those arrived within it, provided the
        read at its start drained the socket.  So a window starts only at a draining read: after
        a read that left datagrams behind (a server behind its link), the next reads hold what
        came before it, and counting that backlog measured how fast the server caught up, not
        the link (issue #11: 72 MB/s of capacity on a 50 MB/s link, 13-17% of the packets
        dropped by its queue with no random loss).  A batch read after a pause does not count
        the pause's bytes in the next window either.

        ``arrival``: the kernel's arrival time of the packet (SO_TIMESTAMPNS, another clock
        than ``now``; None if there is none).  With it the windows are the link's own schedule,
        whenever the server read them (``now`` still says when the worker was last active),
        and they count only the link's busy time (``_arrival``)."""
        self._last[worker] = now
        self._read_bytes += nbytes
        if arrival is not None:
            if self.busy_windows:
                self._arrival(worker, nbytes, arrival, now, end)
                return
            now, drained = arrival, True        # each packet its own read at its arrival
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

    def _arrival(self, worker, nbytes, t, now, end):
        """A packet that arrived at ``t`` (the kernel's stamp), read at ``now``.

        A rate sample is one phase of the grant's gain (a ``WINDOW`` of the read clock, which
        ``t`` is mapped to by the offset between the clocks at the first stamp), over the link's
        busy time in it: the time between consecutive arrivals while some worker was sending,
        i.e. had a packet of its push here and not yet its END (and for at most ``IDLE_GAP``
        without a packet: an END lost and being resent, a worker gone); a phase with less than
        half a window of it gives no sample.
        - Busy time, not all of it: the time after every worker's END until the next packet is
          the link idle, not carrying less.  Counted, it made every window of a job of small
          pushes a mix of both (rounds of 8 x 50 KB with the round trip between them: a
          capacity of 75-92% of the link), and the grant cut from it made the next rounds
          longer still (docs/bench/RESULTS.md).
        - The first ``TRAIN_SKIP`` of a busy time does not count (its first packet was sent
          before its stamp): a link idle for a while lets a burst through at once (a token
          bucket full of tokens, a NIC's coalesced interrupt; the emulated switch's tbf:
          10 kB), which counted made the capacity 3% more than the link could carry (50.0
          MB/s where LTP's datagrams fill a 400 Mbit/s link at 48.6: 3% of the packets dropped
          by the queue with no random loss).
        - One sample per gain phase: random loss before the bottleneck delivers 1 - p of what
          is sent, so only a probe phase's sample (1.15 (1 - p) of the capacity) can raise the
          capacity when the link is not full; a window across phases averages the gains to 1
          and the capacity sank to 65% of the link at 10% loss."""
        sending = self._sending
        prev, self._read = self._read, t
        if self._offset is None or (prev is not None and t < prev):
            # the first stamp, or a clock step back (the realtime clock was set): start over
            self._offset, self._phase, self._busy, self._bytes = t - now, None, 0.0, 0
            prev = None
        busy = self._busy_workers > 0 and prev is not None and t - prev < IDLE_GAP
        if not busy:
            self._train = t
        if end:
            if sending[worker]:
                sending[worker] = False
                self._busy_workers -= 1
        elif not sending[worker]:
            sending[worker] = True
            self._busy_workers += 1
        phase = int((t - self._offset) / WINDOW)
        if phase != self._phase:
            if self._busy >= WINDOW / 2:
                self._add(t, self._bytes / self._busy)
            self._phase, self._busy, self._bytes = phase, 0.0, 0
        if busy and t - self._train >= TRAIN_SKIP:
            self._busy += t - prev
            self._bytes += nbytes

    def _add(self, now, rate):
        samples = self._samples
        samples.append((now, rate))
        while samples[0][0] < now - HORIZON:
            samples.popleft()
        self.capacity = kth_highest([r for _, r in samples])

    def others(self, now, rate, flows):
        """Other processes' TCP flows into this host received ``rate`` bytes/s over ``flows``
        flows since the last call (``others.ForeignTcp``).  They share the link LTP measures,
        and LTP, which takes no loss for congestion, left a CUBIC flow a third of its fair
        share (docs/bench/LTP_FAIRNESS.md).  So the grant (``grants``) gives the job's
        workers no more than the rest of the link less a ``HEADROOM`` to grow into, as long
        as that leaves them less than their per-flow share (``flows`` of them among the
        active workers), and their share otherwise; and while they are there, every
        ``COMBINED`` seconds the capacity gets a sample of everything that crossed the link,
        the job's packets (by read time) and theirs, over the same interval (LTP's own
        samples alone would fall to its share, and the grant with them, round after round).
        Their rate is not added to LTP's busy-time samples: over other intervals it counted
        twice (a simulated 50 MB/s link measured at 62)."""
        if self._others_at is not None and now > self._others_at:
            self._other_bytes += rate * (now - self._others_at)
        self._x, self._k, self._others_at = float(rate), int(flows), now
        seen = self.others_seen
        seen["looks"] += 1
        if flows:
            seen["looks_with_flows"] += 1
            seen["most_flows"] = max(seen["most_flows"], int(flows))
            seen["most_bytes_per_s"] = max(seen["most_bytes_per_s"], float(rate))
        start = self._combined
        if flows and start is not None and now - start[0] >= COMBINED:
            total = (self._read_bytes - start[1]) + (self._other_bytes - start[2])
            self._add(now + (self._offset or 0.0), total / (now - start[0]))
            start = None
        if start is None or not flows:
            self._combined = (now, self._read_bytes, self._other_bytes)

    def _others(self, now):
        """(bytes/s, flows) of others' TCP traffic in force at ``now`` (0, 0: none, or not
        looked at)."""
        if not self.fair or self._others_at is None or now - self._others_at > OTHERS_HOLD:
            return 0.0, 0
        return self._x, self._k

    def opened(self, workers):
        """A round opened that each of ``workers`` owes its push to (until ``settled``)."""
        for w in workers:
            self._owing[w] += 1

    def settled(self, worker):
        """``worker``'s push to an open round arrived whole (its END) or the round closed."""
        if self._owing[worker] > 0:
            self._owing[worker] -= 1

    def grant(self, now):
        """``grants(now)``'s grant."""
        return self.grants(now)[0]

    def grants(self, now):
        """``(grant, start)`` at ``now``: the rate (bytes/s) each active worker is asked not to
        exceed, and the rate a worker begins its next push at after its path went idle (an
        equal share among all active workers: a grant raised while others had nothing left
        to send would let every worker begin the next round at it).  The grant is the
        ``gain(now)`` times an equal share of the capacity among the active workers that still
        owe an open round their push (all active workers if none does); 0 before the first
        sample (no grant: the workers' own models rule).  A worker whose pushes are all in
        leaves its share to the others: the last of a round's pushers get the link, so the
        round ends when its bytes are in, not when a late starter has sent them at an
        eighth of the link (measured, the push alone, 8 x 50 KB at 10% loss: the last worker
        started 2.4 ms after the first and its last packet came 10-11 ms into an 8.6 ms round,
        docs/bench/RESULTS.md).  A round's workers all owe it from its first packet on, those
        not yet heard too, so its start is shared by all (session 12's reverted change, a
        worker active only while it sent, gave the first pusher the link and overran the
        queue when the others came)."""
        if self.capacity is None:
            return 0.0, 0.0
        active = owing = 0
        for w in range(self.n):
            last = self._last[w]
            if last is not None and now - last <= ACTIVE:
                active += 1
                owing += self._owing[w] > 0
        if not active:
            return 0.0, 0.0
        capacity = self.capacity
        x, k = self._others(now)
        if k:           # others' TCP flows: their share, or what they take and a headroom
            capacity = max(capacity * active / (active + k), capacity * (1 - HEADROOM) - x)
        g = gain(now) * capacity
        return g / ((owing if self.owing else 0) or active), g / active
