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
it: measured (resnet18 over 3 x 3 servers), the capacity began at 0.5-2 MB/s from
the first windows of the job and stayed at 2-4 MB/s for its whole run on 12.5-50 MB/s links,
with every busy path paced at the grant.  A window fuller than the link cannot happen, so a
high rank is a lower bound of the link that only a real window raises; not the very highest
(``RANK`` > 1), so that one odd window is ignored.  A time horizon, not a count of windows, so
that the windows of a slow stretch (a backward pass) do not push out the full ones of the last
push phase.  The windows run on the kernel's arrival time of each packet (SO_TIMESTAMPNS, read
with the batch), so when the server got round to reading a packet does not matter;
a window is a gain phase's bytes over the link's busy time in it (``_arrival``:
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
start in 2.5-3 s (x25), random loss does not lower it (the probe sends 1 / (1 - p) more, p
the workers' mean measured loss, so that its windows deliver 1.15 x the capacity: ``probe_gain``;
without it they delivered 1.15 x (1 - p) of it, nothing more from 13% loss on),
and a full link sees 1.5 ms of queue per probe and its average
(a continuous 10% margin would overrun a full link by 9% all the time: with it, and reads
counted where they happened, the incast benchmark delivered 76% of its packets in time, 93%
without the margin).  Pure: every method takes ``now``.
"""
import heapq
from collections import deque

from ..kernels import ltp_py
from ..kernels.ltp import ShareCore

WINDOW = ltp_py.WINDOW  # seconds per rate sample (0.01)
HORIZON = 10.0         # seconds: capacity is a high rank of the samples of this long ...
RANK = 2               # ... the RANK-th highest (a lone burst from a late read is ignored)
ACTIVE = 0.5           # a worker is active if a packet of it came within this many seconds
#                        (longer than a training step's compute: a round's early pushers do
#                        not get the whole link just because the others have not started)
OTHERS_HOLD = 0.5      # seconds a sample of other processes' TCP traffic (``others``) holds
COMBINED = 0.2         # seconds per capacity sample of the job's and others' bytes together
HEADROOM = 0.05        # of the capacity, left free while others' TCP traffic is under its share
IDLE_GAP = ltp_py.IDLE_GAP      # seconds without a packet after which the link was idle
#                                 anyway (4 windows)
TRAIN_SKIP = ltp_py.TRAIN_SKIP  # seconds at the start of a busy time not counted (a burst
#                                 after idle: 1 ms)
GAINS = (1.15, 0.85, 1.0, 1.0)   # the grant's gain over an exact share, one WINDOW each, in turn
#                        (the same phase for every worker: the sum of their rates probes)
MAX_PROBE_LOSS = 0.5    # the probe makes up for at most this loss (its gain at most 2.3)
STARTUP_GAIN = 2.0      # the grant's gain while the capacity still grows (``Share``'s startup)
STARTUP_GROWTH = 1.25   # ... i.e. until the capacity has not grown by this factor ...
STARTUP_ROUNDS = 3      # ... over this many samples in a row (BBR's full-pipe check) ...
STARTUP_FULL = 0.8      # ... of those that carried this much of the capacity at least
STARTUP_MAX = 100       # samples: the startup ends after this many whatever they were


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


def probe_gain(g, loss):
    """The gain ``g`` of a phase, for workers whose packets a fraction ``loss`` (mean over
    them) is lost on the way: a probe (``g`` > 1) sends ``1 / (1 - loss)`` more, so that what
    arrives is ``g`` times the capacity whatever the random loss (at most MAX_PROBE_LOSS made
    up for); the other phases are left as they are."""
    if g <= 1.0 or loss <= 0.0:
        return g
    return g / (1.0 - min(loss, MAX_PROBE_LOSS))


class Share(ShareCore):
    """``busy_windows``: with arrival stamps, the capacity over the link's busy time, a sample
    per gain phase (``_arrival``; False: windows over all the time, for
    ablations); ``owing``: the grant shared by the workers that still owe an
    open round (False: by all active workers); ``fair``: the grant leaves other processes'
    TCP flows into this host their share (``others``; False: it does not look);
    ``probe_loss``: the probe phase makes up for the workers' measured loss (``probe_gain``;
    False: it does not, for ablations); ``startup``: the capacity's start
    (``_add``; False: none, for ablations)."""

    def __init__(self, num_workers, busy_windows=True, owing=True, fair=True, probe_loss=True,
                 startup=True):
        # the arrival side (on_packet, the windows, the bytes read; kernels.ltp_py.ShareCore,
        # compiled in kernels._ltp)
        super().__init__(num_workers, busy_windows)
        self.owing = owing
        self.fair = fair
        self.probe_loss = probe_loss
        self.starting = startup         # in the startup (``_add``) ...
        # ... its capacity at the last growth, full samples since, samples in all
        self._full, self._flat, self._taken = None, 0, 0
        self._x, self._k, self._others_at = 0.0, 0, None
        self._other_bytes = 0.0         # cumulative, for ``others`` (with ``_read_bytes``)
        self._combined = None           # (since, read bytes, others' bytes) of that sample
        # what ``others`` was told, for the server's report
        self.others_seen = {"looks": 0, "looks_with_flows": 0, "most_flows": 0,
                            "most_bytes_per_s": 0.0}
        self._samples = deque()         # (window end, bytes/s), oldest first
        self._owing = [0] * num_workers      # open rounds each worker's push is owed to
        self.capacity = None

    # ``on_packet(worker, nbytes, now, drained=True, arrival=None, end=False)``, called for
    # every packet, and the rate windows it keeps are ShareCore's (kernels.ltp_py documents
    # them; kernels._ltp is the compiled twin); a finished window's rate comes to ``_add``.

    def _add(self, now, rate):
        """A gain phase's sample (``_phase`` the phase; None: read-time windows, no phases).

        The startup: the job's first samples come from phases in which a few workers had
        begun, or whose busy time held a round's tail, and the capacity (the grant) began far
        under the link (the push alone, 8 x 50 KB at 10% loss: 11-44 MB/s of 48.6 over 14
        traced runs); from there a probe at 1.15 raises it 15% per two
        probes (80 ms of busy time), and the first 50 rounds took 1.6-1.8x the later ones.  So,
        as BBR's STARTUP, until ``STARTUP_ROUNDS`` samples in a row have not raised the capacity
        ``STARTUP_GROWTH``-fold, the grant's gain is ``STARTUP_GAIN`` in every phase and the
        capacity is the highest sample (a low first sample does not hold it down): a capacity
        that started at a tenth of the link finds it in four phases.  Every phase, not the
        probe's alone (measured: probe phases without a sample, too little busy time in them,
        left a capacity at a third of the link for 150 ms); several samples, not one (a single
        probe's ended it at 35 MB/s of a 48.6 link: a phase's busy time holds the ends and
        starts of rounds).  A sample under ``STARTUP_FULL`` of the capacity neither grows it
        nor counts as flat: its phase did not use its grant (a worker done or late, the
        resent END of a lost one awaited: measured, a phase of busy time with next to no
        bytes ended a startup at 70% of the link), so it says nothing of a full link, as
        BBR's app-limited samples.  The capacity counts only what arrived, so it never exceeds
        the link; what the startup costs is ``STARTUP_ROUNDS`` phases at twice a full link (10 ms
        each, the queue's drops), however long the workers had too little to send to fill a
        phase before (a job's first pushes, a backward pass's trickle).  At most
        ``STARTUP_MAX`` samples (a second of busy phases): a lone sample far over the link (a
        burst) would otherwise keep every later one under ``STARTUP_FULL`` of the capacity
        and the grant at twice it, for the ``HORIZON``.  Without arrival
        stamps the windows are not phases (late reads made some 1.5-2.2x the link, which a
        startup's highest sample would take for it): no startup."""
        if self.starting:
            phase = self._phase
            self._taken += 1
            if phase is None or self._taken >= STARTUP_MAX:
                self.starting = False
            elif self.capacity is not None:
                top = max(self.capacity, rate)      # the capacity with this sample
                if self._full is None or top >= STARTUP_GROWTH * self._full:
                    self._full, self._flat = top, 0
                elif rate >= STARTUP_FULL * self.capacity:
                    self._flat += 1
                    self.starting = self._flat < STARTUP_ROUNDS
        self._sample(now, rate)

    def _sample(self, now, rate):
        samples = self._samples
        samples.append((now, rate))
        while samples[0][0] < now - HORIZON:
            samples.popleft()
        self.capacity = kth_highest([r for _, r in samples], 1 if self.starting else RANK)

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
            self._sample(now + (self._offset or 0.0), total / (now - start[0]))
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

    def grant(self, now, loss=None):
        """``grants(now, loss)``'s grant."""
        return self.grants(now, loss)[0]

    def grants(self, now, loss=None):
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
        started 2.4 ms after the first and its last packet came 10-11 ms into an 8.6 ms round).
        A round's workers all owe it from its first packet on, those
        not yet heard too, so its start is shared by all (measured and reverted: a
        worker active only while it sent gave the first pusher the link and overran the
        queue when the others came).

        ``loss``: each worker's measured loss on its path (the receiver's ``loss``); the
        probe makes up for their mean over the active workers (``probe_gain``).  The capacity
        counts what arrives, so a probe at 1.15 x the capacity delivered 1.15 x (1 - p) of
        it: at 10% random loss 3.5% more per probe, from 13% none, and a capacity that began
        low stayed low (measured: the push alone, 8 x 50 KB at 10% loss, a capacity that began
        at 24 MB/s of a 48.6 MB/s link took ~300 rounds to find it, the first 50 rounds
        taking 1.6-1.8x the later ones)."""
        if self.capacity is None:
            return 0.0, 0.0
        active = owing = 0
        lost = 0.0
        for w in range(self.n):
            last = self._last[w]
            if last is not None and now - last <= ACTIVE:
                active += 1
                owing += self._owing[w] > 0
                if loss is not None:
                    lost += loss[w]
        if not active:
            return 0.0, 0.0
        capacity = self.capacity
        x, k = self._others(now)
        if k:           # others' TCP flows: their share, or what they take and a headroom
            capacity = max(capacity * active / (active + k), capacity * (1 - HEADROOM) - x)
        g = gain(now)
        if self.starting:
            g = STARTUP_GAIN
        if self.probe_loss and lost:
            g = probe_gain(g, lost / active)
        g *= capacity
        return g / ((owing if self.owing else 0) or active), g / active
