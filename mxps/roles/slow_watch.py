"""A server whose acknowledgements slow down inside a round (MXPS_DIVERT, docs/REPLAN.md).

A worker's pushes to a server go out while less than MXPS_SEND_WINDOW bytes of them are
unacknowledged; while more wait behind the window (a *backlog*), each ACK releases the next
push, so the rate at which ACKs come is the rate the path to that server delivers this
worker's gradients.  ``SlowWatch`` keeps, per server, that rate over the backlogged time of
each of the last rounds, and over the last ``WINDOW`` seconds of the present backlog (a
server that stops answering measures 0).  A server is *slow* when its present rate fell
under 1/``FACTOR`` of its last rounds' while the other backlogged servers of this worker kept
theirs (their median within 1/``OTHERS``): what slows every server alike (this worker's own
link or CPU, a busier machine) moves nothing, and a server can be judged only while another
one is.  Rates are compared with each server's own past, not with the other servers' present:
when the slow link moves from one server to another, the server it left speeds up, and next
to it every other server would look slower.

The worker reports a slow server to the scheduler (``MsgType.SLOW``), which may move that
server's slices to the others inside the round (``roles.reroute``).  One round of history is
not enough to judge (the first rounds, and a server just moved away from); a server is
reported at most once per round, and a server whose slices were moved away forgets its
history (it is of the link it had).
"""
import collections
import statistics


class SlowWatch:
    WINDOW = 0.8        # seconds of backlog the present rate is taken over (a server's CPU
                        # stalls for tenths of a second on this 2-core machine; a link that
                        # changed stays changed)
    FACTOR = 3.0        # this much slower than the server's last rounds: slow
    OTHERS = 1.5        # ... while the others (their median) slowed by less than this
    ROUNDS = 3          # rounds of history per server (their median is the reference)
    MIN_BUSY = 0.05     # a round with less backlogged time than this is not history

    def __init__(self, num_servers):
        n = num_servers
        self.history = [collections.deque(maxlen=self.ROUNDS) for _ in range(n)]
        self.round = [None] * n          # the round the busy totals below are of
        self.busy = [[0, 0.0] for _ in range(n)]    # bytes, seconds of that round's backlog
        self.since = [None] * n          # when the present backlog started (its first ACK)
        self.last = [None] * n           # the present backlog's last ACK
        self.acks = [collections.deque() for _ in range(n)]   # (time, bytes), last WINDOW
        self.reported = {}               # server -> the last round it was reported slow in

    def acked(self, s, rnd, nbytes, now, backlogged):
        """An ACK of a windowed push of round ``rnd`` from server ``s``; ``backlogged``:
        more pushes to ``s`` wait behind the window."""
        if self.round[s] is None or rnd > self.round[s]:
            self._close_round(s)
            self.round[s] = rnd
        if not backlogged:
            self._end_backlog(s, now)
            return
        if self.since[s] is None:
            # the first ACK of a backlog starts its clock (the time before it is unknown)
            self.since[s] = self.last[s] = now
            return
        self.busy[s][0] += nbytes
        self.busy[s][1] += now - self.last[s]
        self.last[s] = now
        q = self.acks[s]
        q.append((now, nbytes))
        while q and q[0][0] < now - self.WINDOW:
            q.popleft()

    def _end_backlog(self, s, now):
        self.since[s] = self.last[s] = None
        self.acks[s].clear()

    def _close_round(self, s):
        b, t = self.busy[s]
        if t >= self.MIN_BUSY and b > 0:
            self.history[s].append(b / t)
        self.busy[s] = [0, 0.0]
        self._end_backlog(s, None)

    def forget(self, s):
        """Server ``s``'s slices left it (a divert): its history is of the link it had."""
        self.history[s].clear()
        self.busy[s] = [0, 0.0]
        self.round[s] = None
        self._end_backlog(s, None)

    def rate(self, s, now):
        """Server ``s``'s ACK rate over the last WINDOW of its present backlog, or None if it
        cannot be judged (no backlog for WINDOW seconds, or fewer than two rounds of
        history)."""
        since = self.since[s]
        if since is None or now - since < self.WINDOW or len(self.history[s]) < 2:
            return None
        return sum(n for t, n in self.acks[s] if t >= now - self.WINDOW) / self.WINDOW

    def slow(self, now):
        """[(server, ratio)] of the servers slow now and not yet reported this round: those
        whose present rate fell under 1/FACTOR of their last rounds' (``ratio``: present over
        past), while the other servers judged now kept (the median of theirs) at least
        1/OTHERS of theirs."""
        change = {}
        for s in range(len(self.since)):
            r = self.rate(s, now)
            if r is not None:
                change[s] = r / statistics.median(self.history[s])
        out = []
        for s, c in change.items():
            others = [x for o, x in change.items() if o != s]
            if c * self.FACTOR >= 1 or not others or \
                    statistics.median(others) * self.OTHERS < 1 or \
                    self.reported.get(s) == self.round[s]:
                continue
            self.reported[s] = self.round[s]
            out.append((s, c))
        return out
