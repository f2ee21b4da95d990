"""The start of a round's pushes, in the same order on every worker (MXPS_PUSH_GATHER).

A worker's pushes to a server wait in a priority queue and go out as its send window opens
(``roles.worker``).  At the start of a round the window is open, so the first pushes go in the
order their gradients happened to arrive, and that order differs between workers: where
backward was still running, the last layers' gradients came first; where it had finished,
MXNet's priorities did.  A slice that some workers send first and others last completes only
at the end of the round, and its pulls then share the server's link with the last chunk's:
the round's tail doubles (measured: docs/bench/ltp_gather_critical_first.json).

The gate holds the round's first pushes until the canonical next one (the highest-ranked push
to that server the previous round had that has not gone yet) is the one at the head of the
queue, or until ``hold`` seconds after the round's first push arrived, whichever is first.
So the link idles at most ``hold`` per round, once, at its start; a worker whose gradients
arrive in priority order is not held at all; and a key that is no longer pushed (a new plan,
a frozen parameter) costs at most the hold.

Pure bookkeeping, no clock of its own (the caller passes ``now``), one per server; the I/O
thread owns it.
"""


class PushGate:
    __slots__ = ("hold", "round", "start", "expected", "ptr", "released")

    def __init__(self, hold):
        if hold < 0:
            raise ValueError("hold must be >= 0, not %r" % (hold,))
        self.hold = hold
        self.round = None        # the round being released
        self.start = 0.0         # when its first push arrived
        self.expected = []       # the previous round's pushes, by rank
        self.ptr = 0             # expected[:ptr] have gone this round
        self.released = set()    # ranks released this round (the next one's ``expected``)

    def arrived(self, rnd, now):
        """A push of round ``rnd`` entered the queue at ``now``."""
        if self.round is None or rnd > self.round:
            self.expected = sorted(self.released) if rnd == (self.round or 0) + 1 else []
            self.round = rnd
            self.start = now
            self.ptr = 0
            self.released = set()

    def wait(self, rank, rnd, now):
        """Seconds the head of the queue (``rank``, round ``rnd``) must still wait; 0: send."""
        if self.hold == 0 or rnd != self.round:
            return 0.0
        exp = self.expected
        while self.ptr < len(exp) and exp[self.ptr] in self.released:
            self.ptr += 1
        if self.ptr == len(exp) or exp[self.ptr] >= rank:
            return 0.0
        return max(0.0, self.start + self.hold - now)

    def sent(self, rank, rnd):
        """The head of the queue (``rank``, round ``rnd``) went out."""
        if rnd == self.round:
            self.released.add(rank)
