"""The scheduler: rendezvous and ranks, barriers, liveness, clean shutdown.

Listens on DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT.  Waits for DMLC_NUM_SERVER servers and
DMLC_NUM_WORKER workers to REGISTER, gives each a rank (servers and workers ordered by address,
as ps-lite does) and the list of server addresses, then serves barriers and watches heartbeats.
A node that goes silent for MXPS_HEARTBEAT_TIMEOUT seconds, or reports a fatal error, fails the
job: every other node gets an ABORT naming the lost node and exits non-zero.  When every worker
has said FINISH, servers and workers get SHUTDOWN and the job ends with exit code 0.
"""
import ipaddress
import json
import logging
import time

import zmq

from ..placement import adaptive
from ..wire import tcp as transport
from .link import EXIT_LOST_PEER, poll_forever
from ..placement.plan import table_from_json as _table_from_json, table_to_json as _table_to_json
from ..wire.frame import Header, MsgType

log = logging.getLogger("mxps.scheduler")


class JobError(RuntimeError):
    """The job cannot start as its nodes asked (the message says why)."""


class _Node:
    __slots__ = ("ident", "role", "host", "port", "pid", "rank", "last_heard", "finished",
                 "mode")

    def __init__(self, ident, role, host, port, pid, mode=None):
        self.ident = ident
        self.role = role
        self.host = host
        self.port = port
        self.pid = pid
        self.rank = -1
        self.last_heard = time.monotonic()
        self.finished = False
        self.mode = mode

    def describe(self):
        return "%s %d (%s:%s, pid %s)" % (self.role, self.rank, self.host, self.port, self.pid)


def _addr_key(node):
    try:
        host = ipaddress.ip_address(node.host)
    except ValueError:
        host = node.host
    return (str(type(host)), host, node.port, node.pid)


class Scheduler:
    def __init__(self, cfg):
        self.cfg = cfg
        self.sock, _ = transport.bind_router(cfg.root_uri, cfg.root_port)
        self.nodes = {}            # ident -> _Node
        self.barrier_waiting = []  # idents
        self.barrier_count = 0
        self.rate_reports = {}     # worker rank -> probe timings {bytes, seconds} per server
        # live re-planning (docs/REPLAN.md)
        self.replanner = adaptive.Replanner(cfg.num_servers, cfg.num_workers,
                                            window=cfg.replan_window)
        self.replan_reports = {}   # worker rank -> its REPLAN request body
        self.replan_points = 0     # re-plan points passed (MXPS_REPLAN_FORCE counts them)
        self.plan_version = 0
        self.pending_plan = None   # a plan the servers are moving state for

    # -- helpers -----------------------------------------------------------------------------
    def _send(self, node, type_, body=None, **fields):
        try:
            transport.send(self.sock, Header(type_, **fields), body, ident=node.ident)
        except transport.TransportError:
            pass    # that node is gone; the heartbeat check reports it

    def _abort(self, reason):
        log.error("aborting the job: %s", reason)
        body = reason.encode()
        for n in self.nodes.values():
            self._send(n, MsgType.ABORT, body)
        time.sleep(0.5)  # let zmq flush the aborts before the process ends
        return EXIT_LOST_PEER

    # -- phases ------------------------------------------------------------------------------
    def _rendezvous(self):
        want = {"server": self.cfg.num_servers, "worker": self.cfg.num_workers}
        deadline = time.monotonic() + self.cfg.start_timeout
        while any(sum(n.role == r for n in self.nodes.values()) < k for r, k in want.items()):
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000)):
                have = {r: sum(n.role == r for n in self.nodes.values()) for r in want}
                raise TimeoutError(
                    "mxps scheduler: only %d of %d servers and %d of %d workers registered "
                    "within %.0f s (MXPS_START_TIMEOUT)" % (
                        have["server"], want["server"], have["worker"], want["worker"],
                        self.cfg.start_timeout))
            ident, h, payload = transport.recv(self.sock, with_ident=True)
            if h.type == MsgType.REGISTER:
                info = json.loads(payload.bytes)
                if info["role"] not in want:
                    continue
                if sum(n.role == info["role"] for n in self.nodes.values()) >= want[info["role"]]:
                    self._send(_Node(ident, info["role"], "", 0, 0), MsgType.ABORT,
                               ("the job already has %d %ss (DMLC_NUM_%s)" % (
                                   want[info["role"]], info["role"],
                                   info["role"].upper())).encode())
                    continue
                self.nodes[ident] = _Node(ident, info["role"], info["host"], info["port"],
                                          info["pid"], info.get("mode"))
            elif ident in self.nodes:
                self.nodes[ident].last_heard = time.monotonic()
        servers = sorted((n for n in self.nodes.values() if n.role == "server"), key=_addr_key)
        workers = sorted((n for n in self.nodes.values() if n.role == "worker"), key=_addr_key)
        for group in (servers, workers):
            for rank, n in enumerate(group):
                n.rank = rank
        server_addrs = [[n.host, n.port] for n in servers]
        # sync or async is the workers' choice (the kvstore name, e.g. mxps_async, or their
        # MXPS_MODE); the servers follow it
        modes = sorted({n.mode for n in workers})
        if len(modes) != 1:
            raise JobError("workers disagree on the mode: %s (kvstore names or MXPS_MODE "
                               "differ between workers)" % ", ".join(
                                   "worker %d: %s" % (n.rank, n.mode) for n in workers))
        self.mode = modes[0]
        for n in servers + workers:
            body = json.dumps({"rank": n.rank, "role": n.role, "servers": server_addrs,
                               "num_workers": self.cfg.num_workers,
                               "num_servers": self.cfg.num_servers,
                               "mode": self.mode}).encode()
            self._send(n, MsgType.WELCOME, body)
            n.last_heard = time.monotonic()
        log.info("job started: %d servers %s, %d workers", len(servers),
                 ["%s:%d" % tuple(a) for a in server_addrs], len(workers))
        log.info("mode: %s", self.mode)

    def _serve(self):
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        tick = self.cfg.heartbeat_interval
        while True:
            if poll_forever(poller, int(tick * 1000 / 2)):
                while self.sock.poll(0):
                    ident, h, payload = transport.recv(self.sock, with_ident=True)
                    node = self.nodes.get(ident)
                    if node is None:
                        continue
                    node.last_heard = time.monotonic()
                    code = self._on_message(node, h, payload)
                    if code is not None:
                        return code
            now = time.monotonic()
            code = self._check_plan_deadline(now)
            if code is not None:
                return code
            for n in self.nodes.values():
                if not n.finished and now - n.last_heard > self.cfg.heartbeat_timeout:
                    return self._abort("lost %s: no heartbeat for %.1f s (MXPS_HEARTBEAT_TIMEOUT"
                                       "=%s); the process died or hangs"
                                       % (n.describe(), now - n.last_heard,
                                          self.cfg.heartbeat_timeout))

    def _on_message(self, node, h, payload):
        if h.type == MsgType.HEARTBEAT:
            self._send(node, MsgType.HEARTBEAT)
        elif h.type == MsgType.BARRIER:
            self.barrier_waiting.append(node)
            live = [n for n in self.nodes.values() if n.role == "worker" and not n.finished]
            if len(self.barrier_waiting) >= len(live):
                self.barrier_count += 1
                for n in self.barrier_waiting:
                    self._send(n, MsgType.ACK, key=-2, iteration=self.barrier_count)
                self.barrier_waiting = []
        elif h.type == MsgType.BANDWIDTH:
            self.rate_reports[node.rank] = json.loads(payload.bytes)
            if len(self.rate_reports) == self.cfg.num_workers:
                reports = list(self.rate_reports.values())
                # a server's rate: all bytes echoed through it over the slowest worker's time
                rates = [sum(r["bytes"][s] for r in reports) /
                         max(r["seconds"][s] for r in reports)
                         for s in range(self.cfg.num_servers)]
                log.info("server rates agreed (MB/s): %s",
                         " ".join("%.1f" % (r / 1e6) for r in rates))
                self.replanner.rates = list(rates)
                body = json.dumps({"rates": rates}).encode()
                for n in self.nodes.values():
                    if n.role == "worker":
                        self._send(n, MsgType.BANDWIDTH, body)
                self.rate_reports = {}
        elif h.type == MsgType.REPLAN:
            self.replan_reports[node.rank] = json.loads(payload.bytes)
            return self._maybe_replan()
        elif h.type == MsgType.PLAN:
            return self._on_plan_ack(node, json.loads(payload.bytes))
        elif h.type == MsgType.ABORT:
            reason = payload.bytes.decode() if payload is not None else "unknown error"
            return self._abort("%s failed: %s" % (node.describe(), reason))
        elif h.type == MsgType.FINISH:
            node.finished = True
            if all(n.finished for n in self.nodes.values() if n.role == "worker"):
                for n in self.nodes.values():
                    self._send(n, MsgType.SHUTDOWN)
                    n.finished = True
                time.sleep(0.2)
                log.info("all workers finished; job done")
                return 0
            # a barrier some finished worker will never join must not wait for it
            live = [n for n in self.nodes.values() if n.role == "worker" and not n.finished]
            if self.barrier_waiting and len(self.barrier_waiting) >= len(live):
                self.barrier_count += 1
                for n in self.barrier_waiting:
                    self._send(n, MsgType.ACK, key=-2, iteration=self.barrier_count)
                self.barrier_waiting = []
            return self._maybe_replan()
        return None

    # -- live re-planning --------------------------------------------------------------------
    def _live_workers(self):
        return [n for n in self.nodes.values() if n.role == "worker" and not n.finished]

    def _maybe_replan(self):
        """Every live worker reached the re-plan point of the same round, having drained its own
        operations.  At a full point (every worker waits for the answer, so nothing is in
        flight anywhere) measure, decide, and either release them at once or have the servers
        move state first; at a light one (workers went on) measure and say whether the next
        point must be a full one (``Replanner.wants_point``)."""
        live = self._live_workers()
        if not self.replan_reports or len(self.replan_reports) < len(live):
            return None
        reports, self.replan_reports = self.replan_reports, {}
        rounds = sorted({r["round"] for r in reports.values()})
        if len(rounds) != 1:
            return self._abort("workers reached the re-plan point at different rounds (%s): "
                               "they do not push the same keys the same number of times"
                               % ", ".join("worker %d: %d" % (w, r["round"])
                                           for w, r in sorted(reports.items())))
        full = {bool(r.get("full", True)) for r in reports.values()}
        if len(full) != 1:
            return self._abort("workers disagree whether the re-plan point of round %d is a "
                               "full one (%s)" % (rounds[0], ", ".join(
                                   "worker %d: %s" % (w, r.get("full", True))
                                   for w, r in sorted(reports.items()))))
        self.replanner.observe([r.get("traffic", {}) for r in reports.values()])
        lead = reports.get(0) or reports[min(reports)]
        table = old = keys = None
        opts = {}
        if "table" in lead:
            old = _table_from_json(lead["table"])
            keys = [(int(k), int(n)) for k, n in lead["keys"]]
            opts = dict(min_slice=int(lead.get("min_slice", adaptive.DEFAULT_MIN_SLICE)),
                        min_gain=float(lead.get("min_gain", 0.05)),
                        horizon=int(lead.get("horizon", 20)),
                        max_chunk=int(lead.get("max_chunk", 0)))
        # MXPS_REPLAN_FORCE=N: a forced new table at every N-th point (always a full one)
        self.replan_points += 1
        every = int(lead.get("force") or 0)
        forced_next = bool(every) and (self.replan_points + 1) % every == 0
        is_full = full.pop()
        if keys is not None and is_full:
            table = self.replanner.decide(
                keys, old, self.plan_version + 1, rounds[0],
                force=bool(every) and self.replan_points % every == 0, **opts)
        if table is None:
            # a light point, or a full one that keeps the plan: is the next one a full one?
            full_next = forced_next or (keys is not None and
                                        self.replanner.wants_point(keys, old, **opts))
            log.info("round %d: %s point, plan %d kept; next point %s", rounds[0],
                     "full" if is_full else "light", self.plan_version,
                     "full" if full_next else "light")
            self._release({"version": self.plan_version, "table": None,
                           "rates": self.replanner.rates, "full_next": full_next})
            return None
        self.plan_version += 1
        moved = adaptive.moved_bytes(old, table, 4)
        self.pending_plan = {"version": self.plan_version, "table": table, "acks": set(),
                             "moved": moved, "round": rounds[0],
                             "full_next": forced_next or self.replanner.suspects_change(),
                             "deadline": time.monotonic() + self.cfg.timeout}
        body = json.dumps({"version": self.plan_version, "old": _table_to_json(old),
                           "new": _table_to_json(table)}).encode()
        for n in self.nodes.values():
            if n.role == "server":
                self._send(n, MsgType.PLAN, body, plan_version=self.plan_version)
        return None

    def _on_plan_ack(self, node, body):
        p = self.pending_plan
        if p is None or body.get("version") != p["version"]:
            return None
        if body.get("error"):
            return self._abort("%s could not move state for plan %d: %s"
                               % (node.describe(), p["version"], body["error"]))
        p["acks"].add(node.rank)
        if len(p["acks"]) == self.cfg.num_servers:
            self.pending_plan = None
            log.info("plan %d in place (round %d, %d bytes moved)", p["version"], p["round"],
                     p["moved"])
            self._release({"version": p["version"], "table": _table_to_json(p["table"]),
                           "moved_bytes": p["moved"], "rates": self.replanner.rates,
                           "full_next": p["full_next"]})
        return None

    def _check_plan_deadline(self, now):
        p = self.pending_plan
        if p is not None and now > p["deadline"]:
            late = [n.describe() for n in self.nodes.values()
                    if n.role == "server" and n.rank not in p["acks"]]
            return self._abort("plan %d: %s did not finish moving state within %.0f s "
                               "(MXPS_TIMEOUT)" % (p["version"], ", ".join(late),
                                                   self.cfg.timeout))
        return None

    def _release(self, body):
        data = json.dumps(body).encode()
        for n in self._live_workers():
            self._send(n, MsgType.REPLAN, data, plan_version=body["version"])

    def run(self):
        try:
            try:
                self._rendezvous()
            except (TimeoutError, JobError) as e:
                return self._abort(str(e))
            return self._serve()
        finally:
            self.sock.close(linger=1000)


def run(cfg):
    return Scheduler(cfg).run()
