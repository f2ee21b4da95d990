"""WSP, worker-selection parallel (MXPS_MODE=wsp): a synchronous round that waits only for the
workers worth waiting for.  Pure rules and one slice's bookkeeping; the server applies them
(``server_state``), docs/WSP.md says why.

A round of a slice completes, in order, when

1. at least ``k`` workers contributed to it (``k`` set, or chosen from the workers' measured
   response times, from the value sent to a worker to its next push: ``choose_k``), and
2. no worker that did not contribute would be left more than ``s`` rounds behind: a worker
   whose last received value is round ``b`` sends a gradient computed on ``b``; if round ``R``
   completes without it, that gradient lands in round ``R + 1`` or later, ``R - b`` rounds
   stale (a BSP gradient is 0 rounds stale).  While ``R - b`` would exceed ``s``, the round
   waits for it: bounded staleness, and the slowest is never starved (the round it holds up is
   the one its next push goes into).  ``s = 0`` is BSP whatever ``k``.

Rounds are numbered by the workers' own push counts (labels), as under BSP: worker w's i-th
push of a slice goes into round i if that round is still open, or else into the next open
round (a late push is folded in, never dropped; a worker may then have two gradients in one
round, n counts gradients).  A pull after a worker's i-th push is answered once round i is
complete, not the later round a folded push went into: a round's completion then depends only
on pushes made after pulls of earlier rounds, so waits cannot form a cycle across keys or
servers (each key deciding its rounds alone, a pull that waited for the round its folded push
went into did deadlock: docs/WSP.md).  A round's sum is scaled by W / n for its n gradients:
the expected sum of a full round (docs/WSP.md).

With ``k = W`` every round waits for every worker, no push is ever late, the scale is 1: BSP
exactly (tests/test_wsp.py checks both).  A worker that leaves (LEAVE: it has finished
training) no longer counts: rounds need ``min(k, workers still training)`` contributors and
nobody waits for it.
"""
import collections

#: Auto k: a worker is waited for while its response time is at most this factor times the
#: median response time of the workers.
AUTO_FACTOR = 1.5
#: Auto k: responses per worker a choice rests on (the median of the last ones).
HISTORY = 5


def choose_k(intervals, factor=AUTO_FACTOR, slack=0.001):
    """How many workers a round waits for, from each worker's typical response time (seconds
    from the value sent to it to its next push: its compute and its links, not the waiting for
    others, which a push interval would include; None: not known yet).  While any is unknown:
    all of them (BSP until measured).  Otherwise the workers whose time is at most ``factor``
    times the median: a worker that computes or sends ``factor`` times slower than the typical
    one is not waited for (``slack`` seconds of jitter are always tolerated)."""
    w = len(intervals)
    if w == 0 or any(x is None for x in intervals):
        return w
    xs = sorted(intervals)
    mid = w // 2
    median = xs[mid] if w % 2 else 0.5 * (xs[mid - 1] + xs[mid])
    return max(1, sum(1 for x in intervals if x <= factor * median + slack))


def may_complete(r, contributors, base, k, staleness, gone=()):
    """Whether round ``r`` may complete: ``contributors`` (the workers in it), ``base[w]`` the
    round of the value worker w last received (0: the initial value), ``k`` the workers
    needed, ``staleness`` s, ``gone`` the workers that left."""
    active = [w for w in range(len(base)) if w not in gone]
    need = min(k, len(active))
    if len(contributors) < need:
        return False
    return all(r - base[w] <= staleness for w in active if w not in contributors)


def before_point(r, replan_every):
    """Whether round ``r`` is the last before a re-plan point (workers stop before rounds
    1 + m * MXPS_REPLAN_INTERVAL, m >= 1; docs/REPLAN.md).  Such a round waits for every
    worker's own push: at the point every round before it is then complete and none after it
    has begun, so the slices can move (a push folded into a later round would leave that round
    partly pushed, and parts of one new slice could disagree on who is in it)."""
    return replan_every > 0 and r > 0 and r % replan_every == 0


def target_round(applied, label):
    """The round a push labelled ``label`` (its worker's push count) goes into: its own round if
    that is still open, else the first open one (``applied`` rounds are complete)."""
    return max(label, applied + 1)


class SliceWsp:
    """One slice's WSP bookkeeping on its server: for every worker, its last push label, the
    round of the last value it received, the rounds its recent pushes went into (label ->
    round) and its response times (auto k)."""

    __slots__ = ("latest", "base", "placed", "sent_at", "times")

    def __init__(self, workers):
        self.latest = [0] * workers          # the last push label per worker
        self.base = [0] * workers            # the round of the last value it received
        self.placed = [dict() for _ in range(workers)]   # label -> round, recent ones
        self.sent_at = [None] * workers      # when its last value was sent
        self.times = [collections.deque(maxlen=HISTORY) for _ in range(workers)]

    def place(self, w, label, applied, now=None):
        """Worker ``w``'s push ``label``: the round it goes into (raises ValueError for a
        label not after the last one)."""
        if label <= self.latest[w]:
            raise ValueError("pushed round %d after round %d (labels must grow)"
                             % (label, self.latest[w]))
        r = target_round(applied, label)
        self.latest[w] = label
        placed = self.placed[w]
        placed[label] = r
        if len(placed) > 16:                 # kept for inspection (tests, traces): recent ones
            for old in sorted(placed)[:-16]:
                del placed[old]
        if now is not None and self.sent_at[w] is not None:
            self.times[w].append(max(0.0, now - self.sent_at[w]))
            self.sent_at[w] = None
        return r

    @classmethod
    def settled(cls, workers, applied):
        """The bookkeeping of a slice a re-plan moved (built at a point where every worker has
        pushed and received every round up to ``applied``); response times start afresh."""
        ws = cls(workers)
        ws.latest = [applied] * workers
        ws.base = [applied] * workers
        return ws

    def pull_round(self, w, label):
        """The round a pull after ``w``'s push ``label`` waits for: round ``label`` (even if the
        push was folded into a later one; see the module's text); None: that push has not
        arrived yet (the pull waits for it)."""
        if label <= 0:
            return 0
        return None if label > self.latest[w] else label

    def received(self, w, r, now=None):
        """Worker ``w`` was sent the value after round ``r`` (at ``now``)."""
        if r > self.base[w]:
            self.base[w] = r
        if now is not None:
            self.sent_at[w] = now

    def intervals(self):
        """Each worker's median response time over its last pushes (None: not measured)."""
        out = []
        for ts in self.times:
            if not ts:
                out.append(None)
                continue
            xs = sorted(ts)
            m = len(xs) // 2
            out.append(xs[m] if len(xs) % 2 else 0.5 * (xs[m - 1] + xs[m]))
        return out


def scale(workers, gradients):
    """The factor a round's sum of ``gradients`` gradients is multiplied by: W / n (1 for a
    full round)."""
    if gradients <= 0:
        raise ValueError("a round without contributors cannot complete")
    return float(workers) / gradients if gradients != workers else 1.0


def staleness_of(landed, base_w):
    """How many rounds stale a gradient computed on round ``base_w``'s value is when it is
    applied in round ``landed`` (0 in BSP)."""
    return landed - 1 - base_w


