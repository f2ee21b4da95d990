"""Job-wide checkpoints of the disk store (MXPS_STORE_CHECKPOINT_ROUNDS, docs/STORE.md).

Every server flushes all its tables at the same rounds (every N-th), each table keeping its
last two checkpoints reachable (``rows.DiskRows(keep=2)``).  In BSP a server's flush of round
r ends before any worker has its round-r pulls of that server's keys, so no server can reach
round r + N before every server finished flushing r: at a crash the servers' newest complete
checkpoints differ by at most one, and with two kept every server can return to the newest
round they all hold.  At resume each server reports what its directories hold
(``held``), and the scheduler picks that round (``agree``) and tells every node.

Every S seconds (MXPS_STORE_CHECKPOINT_SECONDS) instead: the servers must still flush the same
round, so one node picks it.  Worker 0 (``RoundClock``) marks every push of the first round it
starts once S seconds have passed since the last mark (the header's CHECKPOINT flag; a marked
push goes by TCP, never LTP, so every server reads the flag); a server checkpoints a round one
of its pushes marked, and every server gets worker 0's pushes of every round.
"""
import os
import time

from .rows import reachable_steps

SERVER_DIR = "server%d"


def held(store_dir):
    """{server rank: the rounds every table in ``<store_dir>/server<rank>`` can return to,
    ascending} for each such directory here (a directory without tables holds none)."""
    out = {}
    if not os.path.isdir(store_dir):
        return out
    for name in os.listdir(store_dir):
        rank = name[len("server"):]
        if not name.startswith("server") or not rank.isdigit():
            continue
        tables = reachable_steps(os.path.join(store_dir, name))
        common = None
        for steps in tables.values():
            common = set(steps) if common is None else common & set(steps)
        out[int(rank)] = sorted(common or ())
    return out


class NoCommonCheckpoint(ValueError):
    """The servers' stores hold no round all of them can return to (the message says why)."""


def agree(reports, num_servers):
    """The round a resumed job starts from: the newest one every server directory
    0..num_servers-1 holds, from ``reports`` ({server rank: [rounds]} of each server process,
    parsed from its REGISTER).  Raises NoCommonCheckpoint naming what is missing."""
    rounds = {}
    for report in reports:
        for rank, steps in report.items():
            rounds.setdefault(rank, set()).update(steps)
    missing = [k for k in range(num_servers) if k not in rounds]
    if missing:
        raise NoCommonCheckpoint("no server holds the store of server %s (%s under "
                                 "MXPS_STORE_DIR)" % (", ".join(map(str, missing)),
                                                      ", ".join(SERVER_DIR % k
                                                                for k in missing)))
    common = set.intersection(*(rounds[k] for k in range(num_servers)))
    if not common:
        raise NoCommonCheckpoint(
            "the servers' stores hold no round in common: %s (a store of another job, or "
            "more than one checkpoint apart)" % "; ".join(
                "server %d: %s" % (k, sorted(rounds[k]) or "none")
                for k in range(num_servers)))
    return max(common)


class RoundClock:
    """Worker 0's choice of the rounds to checkpoint every ``seconds`` (``clock``: seconds).
    ``marks(r)`` for every push of round r, in the order the worker launches them: whether
    to mark it.  Rounds are decided at their first push, from the time since the last mark."""

    def __init__(self, seconds, clock=time.monotonic):
        self.seconds = seconds
        self.clock = clock
        self.last = clock()
        self.seen = 0
        self.marked = None

    def marks(self, round_):
        if round_ > self.seen:
            self.seen = round_
            now = self.clock()
            if now - self.last >= self.seconds:
                self.marked, self.last = round_, now
        return round_ == self.marked
