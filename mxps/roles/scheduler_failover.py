"""The scheduler's side of failover (MXPS_FAILOVER, docs/FAILOVER.md): a server that goes
silent is left behind instead of ending the job.

1. ``_fail_over``: the heartbeat check found server s silent.  The scheduler marks it lost and
   sends every worker FAILOVER {version, dead}.  Each worker computes the successor table
   itself (``placement.failover``: every lost slice whole to one survivor), sends the
   successors its copy of the lost slices' weights (a SEED naming the round its last pull of
   that slice got) and every request the lost server left unanswered again, and goes on.
2. ``_on_failover_tables``: the first worker's FAILOVER answer carries the old and new
   tables; the survivors get them as a PLAN naming the lost servers (``roles.migration``).
   A successor builds each lost slice from the workers' seeds (the latest round any worker
   pulled) with its buddy's replica of the optimizer state (MXPS_REPLICA) or fresh state,
   and acknowledges the plan; the acknowledgements say
   which slices' optimizer state was reset.
3. The failover is in place once every survivor acknowledged: the job facts' ``failovers``.

A server lost while a re-plan moves state at a full point rolls the move back first
(``_fail_over_move``); one lost during start-up leaves a job of the servers that came
(``_start_without``, ``_start_short``).  Limits, each ending the job with a message naming it:
a second server lost before the first failover is in place, a server lost during an
overlapped move; re-planning stops after a failover (the planner places on every server of the
job).  The scheduler's own death ends the job: every node gives up after
MXPS_HEARTBEAT_TIMEOUT of its silence.

A *divert* (MXPS_DIVERT, docs/REPLAN.md) is the same move for a server that is alive but
slow: a worker reports its acknowledgements slowed down inside a round (``_on_slow``), and
the scheduler sends every worker FAILOVER {version, dead, divert}; the server stays in the job
and gets a PLAN too, sending the successors its slices' optimizer state only.  At most one
divert of a server until a plan gives it slices again, none while a plan moves state or a
worker waits at a point; the next point re-plans with the slow rate the worker measured.
"""
import dataclasses
import json
import logging

from ..placement import adaptive
from ..placement.failover import successors
from ..placement.plan import table_to_json
from ..wire.frame import MsgType

log = logging.getLogger("mxps.scheduler")


class Failover:
    """Part of ``SchedulerState``: leaving a lost server behind."""

    def _fail_over(self, node, silent):
        why = "no heartbeat for %.1f s (MXPS_HEARTBEAT_TIMEOUT=%s)" % (
            silent, self.cfg.heartbeat_timeout)
        p = self.pending_plan
        if p is not None and ("failover" in p or p.get("released") or "old" not in p):
            # a second loss during a failover, or a move the workers did not wait for
            # (MXPS_REPLAN_OVERLAP): they were not all drained
            self._abort("lost %s: %s, while plan %d moved state; a failover during %s is not "
                        "supported (MXPS_FAILOVER)" % (
                            node.describe(), why, p["version"], "a failover" if "failover"
                            in p else "a divert (MXPS_DIVERT)" if "divert" in p else
                            "an overlapped move"))
            return
        if len(self._servers()) < 2:
            self._abort("lost %s: %s; no server is left to take its keys"
                        % (node.describe(), why))
            return
        workers = self._live_workers()
        node.lost = True
        self.plan_version += 1
        record = {"server": node.rank, "plan_version": self.plan_version,
                  "detected_at": round(self._now - self.started_at, 6),
                  "silent_s": round(silent, 3), "in_place_at": None,
                  "slices": 0, "state_reset": []}
        self.failovers.append(record)
        if p is not None:
            self._fail_over_move(node, why, p, record, workers)
            return
        self.pending_plan = {"version": self.plan_version, "table": None, "acks": set(),
                             "planned": 0, "moved": 0, "sent": 0, "round": None,
                             "full_next": False, "released": True, "failover": record,
                             "deadline": self._now + self.cfg.timeout}
        log.warning("lost %s: %s; its slices go to the other servers (MXPS_FAILOVER, plan %d)",
                    node.describe(), why, self.plan_version)
        body = json.dumps({"version": self.plan_version, "dead": node.rank}).encode()
        for w in workers:
            self._send(w, MsgType.FAILOVER, body, plan_version=self.plan_version)
        self._step.facts = self.facts()

    # -- during start-up: the job starts with the servers it has -----------------------------
    def _start_without(self, node, why):
        """A server that registered went silent before the job started: forget it and start
        with one server fewer (no key is placed yet, nothing is lost)."""
        servers = self._count("server")
        if servers <= 1:
            self._abort("lost %s during start-up: %s; no other server registered"
                        % (node.describe(), why))
            return
        del self.nodes[node.ident]
        log.warning("lost %s during start-up: %s; the job starts without it (MXPS_FAILOVER)",
                    node.describe(), why)
        self._shrink(self.want["server"] - 1, "lost %s during start-up" % node.describe())

    def _start_short(self):
        """At the start deadline, every worker but not every server here: start with the
        servers that came (MXPS_FAILOVER).  False if the job cannot start."""
        have = self._count("server")
        if not self.cfg.failover or have < 1 or self._count("worker") < self.want["worker"]:
            return False
        log.warning("%d of %d servers registered within %.0f s (MXPS_START_TIMEOUT); the job "
                    "starts with them (MXPS_FAILOVER)", have, self.want["server"],
                    self.cfg.start_timeout)
        self._shrink(have, "%d of %d servers came" % (have, self.want["server"]))
        return True

    def _shrink(self, servers, why):
        self.want["server"] = servers
        self.cfg = dataclasses.replace(self.cfg, num_servers=servers)
        self.replanner = adaptive.Replanner(servers, self.cfg.num_workers,
                                            window=self.cfg.replan_window,
                                            one_round=self.cfg.replan_one_round)
        self.failovers.append({"server": None, "during": "start-up", "why": why,
                               "servers": servers})
        if all(self._count(r) == k for r, k in self.want.items()):
            self._start()

    def _fail_over_move(self, node, why, p, record, workers):
        """A server lost while plan ``p`` moves state at a full point: every worker waits,
        drained, at the point, still by the plan before ``p``.  The move is rolled back: each
        survivor puts back the slices it had cut for ``p`` (it keeps a copy until the next
        plan) and drops those ``p`` built, and the failover is the one of the plan before
        ``p`` (the workers compute it so from the table they hold); the point is released
        once it is in place."""
        lost = {n.rank for n in self.nodes.values() if n.lost}
        old = p["old"]
        new, moved = successors(old, lost, self.cfg.num_servers, self.cfg.replica)
        record["during_plan"] = p["version"]
        record["slices"] = len(moved)
        self.pending_plan = {"version": self.plan_version, "table": new, "acks": set(),
                             "planned": 0, "moved": 0, "sent": 0, "round": p["round"],
                             "full_next": p["full_next"], "failover": record,
                             "abandoned": p["version"],
                             "deadline": self._now + self.cfg.timeout}
        log.warning("lost %s: %s, while plan %d moved state; that move is rolled back and plan "
                    "%d puts the lost server's slices on the others (MXPS_FAILOVER)",
                    node.describe(), why, p["version"], self.plan_version)
        plan = {"version": self.plan_version, "old": table_to_json(old),
                "new": table_to_json(new), "lost": sorted(lost), "abandon": p["version"]}
        data = json.dumps(plan).encode()
        for n in self._servers():
            self._send(n, MsgType.PLAN, data, plan_version=self.plan_version)
        body = json.dumps({"version": self.plan_version, "dead": node.rank}).encode()
        for w in workers:
            self._send(w, MsgType.FAILOVER, body, plan_version=self.plan_version)
        self._step.facts = self.facts()

    def _on_failover_tables(self, node, version, old, new):
        """A worker's successor tables (checked): the PLAN for the survivors (the first
        answer counts; every worker computed the same tables)."""
        p = self.pending_plan
        if p is None or not ("failover" in p or "divert" in p) or version != p["version"] \
                or p["table"] is not None:
            return
        lost = sorted(n.rank for n in self.nodes.values() if n.lost)
        gone = [p["divert"]["server"]] if "divert" in p else lost
        on_lost = [k for k, slices in new.items() if any(x.server in gone for x in slices)]
        if on_lost:
            self._abort("%s placed key %d on %s server(s) %s after the %s"
                        % (node.describe(), on_lost[0], "slow" if "divert" in p else "lost",
                           gone, "divert" if "divert" in p else "failover"))
            return
        p["table"] = new
        (p.get("failover") or p["divert"])["slices"] = sum(
            1 for k, slices in old.items() for x in slices if x.server in gone)
        plan = {"version": p["version"], "old": table_to_json(old), "new": table_to_json(new),
                "lost": lost}
        if "divert" in p:
            plan["diverted"] = gone
        data = json.dumps(plan).encode()
        for n in self._servers():
            self._send(n, MsgType.PLAN, data, plan_version=p["version"])

    def _failover_in_place(self, p):
        record = p["failover"]
        record["in_place_at"] = round(self._now - self.started_at, 6)
        reset = record["state_reset"]
        log.warning("plan %d in place: server %d's %d slices rebuilt on the other servers from "
                    "the workers' weights, %.1f s after it was found lost; %s", p["version"],
                    record["server"], record["slices"],
                    record["in_place_at"] - record["detected_at"],
                    "optimizer state of %d of them reset (it was on the lost server only)"
                    % len(reset) if reset else "no optimizer state was lost")
        self._step.facts = self.facts()

    # -- MXPS_DIVERT: a slow server's slices leave it inside the round -----------------------
    def _on_slow(self, node, server, round_, ratio, forced=False):
        """Worker ``node`` found server ``server``'s acknowledgements at ``ratio`` of their
        rate in round ``round_``: move its slices to the others now, if nothing else moves."""
        target = next((n for n in self._servers() if n.rank == server), None)
        seen = self.slow_reports.setdefault((server, round_), set())
        seen.add(node.rank)
        # two workers must agree (a server's own stall looks slow to one worker first), but
        # a forced report (MXPS_DIVERT_FORCE) counts alone
        agreed = len(seen) >= min(2, len(self._live_workers())) or forced
        if not self.cfg.divert or target is None or self.pending_plan is not None or \
                self.replan_reports or self.failovers or server in self.slow_idle or \
                len(self._servers()) - len(self.slow_idle) < 2 or not agreed:
            log.info("%s reports server %d slow in round %d (%.2fx); not moved now",
                     node.describe(), server, round_, ratio)
            return
        self.plan_version += 1
        record = {"server": server, "plan_version": self.plan_version, "round": round_,
                  "ratio": round(ratio, 4), "reported_by": node.rank,
                  "detected_at": round(self._now - self.started_at, 6), "in_place_at": None,
                  "slices": 0}
        self.diverts.append(record)
        self.pending_plan = {"version": self.plan_version, "table": None, "acks": set(),
                             "planned": 0, "moved": 0, "sent": 0, "round": None,
                             "full_next": False, "released": True, "divert": record,
                             "deadline": self._now + self.cfg.timeout}
        # that round's times are not a link's (the slow server's work left it mid-round),
        # and the next decision plans with the rate the worker saw
        self.overlapped.add(round_)
        if not forced:
            self.replanner.diverted(server, ratio)
        log.warning("%s reports server %d's acknowledgements at %.2fx of their last rounds' rate in round "
                    "%d: its slices go to the other servers inside the round (MXPS_DIVERT, "
                    "plan %d)", node.describe(), server, ratio, round_, self.plan_version)
        # the successors: as a failover's (whole slices, by elements), on the servers but those
        # diverted before and given nothing since.  Not by the planner's rates: a server with a small share
        # measures what it delivered, not what its link can (docs/REPLAN.md), so right after
        # the slow link moved the server it left looks as slow as it was
        body = json.dumps({"version": self.plan_version, "dead": server, "divert": True,
                           "avoid": sorted(self.slow_idle)}).encode()
        self.slow_idle.add(server)
        for w in self._live_workers():
            self._send(w, MsgType.FAILOVER, body, plan_version=self.plan_version)
        self._step.facts = self.facts()

    def _divert_in_place(self, p):
        record = p["divert"]
        record["in_place_at"] = round(self._now - self.started_at, 6)
        # the weights and state the servers sent one another (MIGRATE parts): with
        # MXPS_REPLICA the slow server sends neither, unless a successor asks (VALUE)
        record["moved_bytes"] = p["sent"]
        self.divert_table = p["table"]
        log.info("plan %d in place: server %d's %d slices on the other servers, %.3f s after "
                 "it was reported slow", p["version"], record["server"], record["slices"],
                 record["in_place_at"] - record["detected_at"])
        self._step.facts = self.facts()
