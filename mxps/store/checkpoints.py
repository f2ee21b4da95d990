"""Job-wide checkpoints of the disk store (MXPS_STORE_CHECKPOINT_ROUNDS, docs/STORE.md).

Every server flushes all its tables at the same rounds (every N-th), each table keeping its
last two checkpoints reachable (``rows.DiskRows(keep=2)``).  In BSP a server's flush of round
r ends before any worker has its round-r pulls of that server's keys, so no server can reach
round r + N before every server finished flushing r: at a crash the servers' newest complete
checkpoints differ by at most one, and with two kept every server can return to the newest
round they all hold.  At resume each server reports what its directories hold
(``held``), and the scheduler picks that round (``agree``) and tells every node.
"""
import os

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
