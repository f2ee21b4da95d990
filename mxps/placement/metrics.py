"""Per-step metrics of a worker, as JSON lines (MXPS_METRICS), and the bandwidth estimate.

A *step* is one round of the keys (the workers' per-key push count).  For every finished round
the worker writes one line: wall time, step seconds (between the first requests of consecutive
rounds), the plan version in force, the bytes the servers moved before the round for a new plan
(``migration_bytes``), and per server: bytes moved (pushed + pulled), the busy span (first
request sent to last reply received), the rate bytes/span, its smoothed estimate, the share of
the round's bytes, and with live re-planning the scheduler's estimate (``rate_agreed``, from
all workers' traffic, see ``adaptive.Replanner``).  A round is finished when the next-but-one
starts: in synchronous training every operation of round r has completed before any key's
round r+1 is launched (the next forward reads the weights round r wrote), and the extra round
of slack covers update-on-workers and async use.  At a re-plan point (nothing in flight) and
at a clean exit every round so far is written.

The worker's own estimate: an EWMA (``alpha``) of each server's per-round rate, skipping rounds
where a server moved too few bytes to time (under 64 KB), and clipping a round to at most 3x /
at least 1/3 of the current estimate so that one noisy round cannot swing it.
"""
import json
import time

MIN_BYTES = 64 * 1024


def report_path(metrics, role, rank, what):
    """Where a node's shutdown report ``what`` goes with MXPS_METRICS=``metrics``:
    ``<metrics>.<role><rank>.<what>.json`` (``{rank}`` in ``metrics`` written as ``x``)."""
    return "%s.%s%d.%s.json" % (metrics.replace("{rank}", "x"), role, rank, what)


def write_report(metrics, role, rank, what, report, logger):
    """Log a node's shutdown report (INFO) and, with ``metrics`` set, write it to
    ``report_path``; a file that cannot be written is a warning, not an error."""
    logger.info("%s %d: %s %s", role, rank, what, json.dumps(report))
    if not metrics:
        return
    path = report_path(metrics, role, rank, what)
    try:
        with open(path, "w") as f:
            json.dump(report, f)
    except OSError as e:
        logger.warning("%s %d: cannot write %s: %s", role, rank, path, e)


def tail_of(marks, nbytes, last):
    """(bytes, seconds) of the second half of a round's traffic through one server: from the
    moment half of its bytes had been moved to its last reply.  A link that changes in the
    middle of a round shows its new rate there, while the whole round's rate mixes the old
    and the new one (``adaptive.Replanner`` uses it for a round that changed).  ``marks``:
    [(time, cumulative bytes), ...] in time order; (0, 0.0) without traffic."""
    if not marks or not nbytes or last is None:
        return 0, 0.0
    half = nbytes / 2.0
    for t, cum in marks:
        if cum >= half:
            return nbytes - cum, max(0.0, last - t)
    return 0, 0.0


class BandwidthEstimate:
    def __init__(self, num_servers, alpha=0.3, initial=None):
        self.alpha = alpha
        self.rates = list(initial) if initial else [None] * num_servers

    def update(self, rates):
        for s, r in enumerate(rates):
            if r is None:
                continue
            old = self.rates[s]
            if old is None:
                self.rates[s] = r
            else:
                r = min(max(r, old / 3.0), old * 3.0)
                self.rates[s] = (1 - self.alpha) * old + self.alpha * r
        return self.rates


class StepMetrics:
    """``keep``: also keep each round's per-server [bytes, busy seconds] until
    ``take_recent`` (the live re-planner's measurements)."""

    def __init__(self, client, path, plan_version=0, initial_rates=None, keep=False):
        self.client = client
        self.path = path
        self.estimate = BandwidthEstimate(client.num_servers, initial=initial_rates)
        self.latest = 0
        self.first_send = {}
        self.keep = keep
        self.recent = {}
        self.versions = [(1, plan_version)]   # (first round, plan version), in round order
        self.migrations = {}                  # round -> bytes the servers moved before it
        self.agreed = None                    # the scheduler's rate estimates (re-planning)
        self._file = open(path, "a") if path else None

    def new_plan(self, first_round, version, moved_bytes):
        """Plan ``version`` is in force from ``first_round`` on; it moved ``moved_bytes``."""
        self.versions.append((first_round, version))
        self.migrations[first_round] = moved_bytes

    def flush(self, before):
        """Write the lines of every round before ``before`` (all complete: call when this
        worker has nothing in flight)."""
        for r, per in sorted(self.client.take_traffic(before).items()):
            self._emit(r, per)

    def take_recent(self):
        """{round: per server [bytes, busy seconds]} since the last call."""
        out, self.recent = self.recent, {}
        return out

    def _version_at(self, r):
        v = self.versions[0][1]
        for first, version in self.versions:
            if first <= r:
                v = version
        return v

    def on_round(self, iteration):
        """Called (training thread) when an operation of ``iteration`` is launched."""
        if iteration <= self.latest:
            return
        self.latest = iteration
        self.first_send.setdefault(iteration, time.monotonic())
        for r, per in sorted(self.client.take_traffic(iteration - 1).items()):
            self._emit(r, per)

    def _emit(self, r, per):
        total = sum(t[0] for t in per) or 1
        rates = []
        servers = []
        tails = []
        for s, (nbytes, first, last, *marks) in enumerate(per):
            span = (last - first) if first is not None else 0.0
            rate = nbytes / span if nbytes >= MIN_BYTES and span > 0 else None
            rates.append(rate)
            tails.append(tail_of(marks[0] if marks else [], nbytes, last))
            servers.append({"server": s, "bytes": nbytes, "busy_seconds": round(span, 6),
                            "rate": rate, "share": nbytes / total})
        if self.keep:
            self.recent[r] = [[x["bytes"], x["busy_seconds"], tb, round(ts, 6)]
                              for x, (tb, ts) in zip(servers, tails)]
        est = self.estimate.update(rates)
        for s, rec in enumerate(servers):
            rec["rate_estimate"] = est[s]
            if self.agreed:
                rec["rate_agreed"] = self.agreed[s]
        start, nxt = self.first_send.pop(r, None), self.first_send.get(r + 1)
        line = {"step": r, "wall": time.time(), "rank": self.client.rank,
                "step_seconds": (nxt - start) if start is not None and nxt is not None else None,
                "plan_version": self._version_at(r),
                "migration_bytes": self.migrations.pop(r, 0), "servers": servers}
        if self._file is not None:
            self._file.write(json.dumps(line) + "\n")
            self._file.flush()
