"""The scheduler's protocol as a state machine: one message in, what to do out.

The scheduler's rules (who gets which rank, when a barrier opens, when a silent node ends the
job, when a re-plan point is answered) used to live inside its zmq loop, so only multi-process
jobs exercised them.  Here they hold no socket and read no clock: ``on_message`` takes one
message (the sender's zmq identity, the header, the payload bytes) and the current time,
``tick`` takes the time alone (start, heartbeat and plan deadlines), and both return a ``Step``:
the messages to send (to which identities), the job's facts when they are due to be written
(MXPS_JOB_INFO), and, when the job ends, its exit code and reason.  ``mxps.roles.scheduler``
is the loop that does the I/O; tests drive this class with a made-up clock.

The protocol:
- rendezvous: DMLC_NUM_SERVER servers and DMLC_NUM_WORKER workers REGISTER within
  MXPS_START_TIMEOUT; each role is ranked by address (as ps-lite does) and every node gets a
  WELCOME with its rank, the server addresses and the mode (sync or async: the workers' choice,
  which must be the same for all).  A node beyond the job's size is refused with an ABORT.
- barriers: released (ACK, key -2) once every worker that has not finished arrived.
- liveness: any message from a node counts as a heartbeat; a node silent for
  MXPS_HEARTBEAT_TIMEOUT, or one reporting its own failure (ABORT), ends the job: every node
  gets an ABORT naming it, exit code EXIT_LOST_PEER.
- FINISH from every worker: SHUTDOWN to every node, then exit code 0 once every node answered
  it with BYE, or MXPS_HEARTBEAT_TIMEOUT after the SHUTDOWN (naming the nodes that did not).
  Until then the scheduler's socket stays open: a SHUTDOWN whose TCP segment was lost is
  retransmitted by the kernel only while the socket lives (a closed one answers the node's next
  heartbeat with a reset, and the node, never told, would report the scheduler lost), and a
  node that heartbeats meanwhile gets the SHUTDOWN again instead of the echo.
- BANDWIDTH: every worker's probe timings -> one agreed rate per server, sent to every worker.
- re-plan points (docs/REPLAN.md): every live worker's REPLAN of one round -> the Replanner
  decides -> either the workers are answered at once, or the servers get the PLAN and the
  workers are answered once every server acknowledged it (within MXPS_TIMEOUT).
- garbage (docs/ROBUSTNESS.md): a body that does not parse or fit (every REPLAN report is
  checked field by field when it arrives), or a message type the sender's role does not send
  (``SENDS``), is dropped and counted (``malformed``); messages of connections that are no node
  are counted (``strangers``) and get nothing (a REGISTER beyond the job's size an ABORT).
  Nothing a message holds raises out of ``on_message``.
"""
import ipaddress
import json
import logging
import math
from dataclasses import dataclass, field
from typing import List, NamedTuple, Optional

from ..placement import adaptive
from ..placement.plan import PlanError, check_slices, table_from_json, table_to_json
from ..store import checkpoints
from ..wire.frame import Header, MsgType
from .link import EXIT_LOST_PEER
from .scheduler_failover import Failover

log = logging.getLogger("mxps.scheduler")

BARRIER_KEY = -2            # an ACK with this key releases a barrier (SchedulerLink.handle)
ROLES = ("server", "worker")
CLEAN_EXIT_REASON = "all workers finished"
# what each role sends the scheduler once the job has started (anything else from a node is
# dropped and counted: a server's BARRIER must not open a barrier for a worker)
SENDS = {"worker": frozenset((MsgType.HEARTBEAT, MsgType.BARRIER, MsgType.BANDWIDTH,
                              MsgType.REPLAN, MsgType.FINISH, MsgType.ABORT,
                              MsgType.FAILOVER, MsgType.SLOW)),
         "server": frozenset((MsgType.HEARTBEAT, MsgType.PLAN, MsgType.ABORT))}
# a finished worker only waits for the SHUTDOWN
AFTER_FINISH = frozenset((MsgType.HEARTBEAT, MsgType.FINISH, MsgType.ABORT))


class Send(NamedTuple):
    """One message for the loop to send: to the node whose zmq identity is ``ident``."""
    ident: bytes
    header: Header
    body: Optional[bytes] = None


class Exit(NamedTuple):
    code: int
    reason: str


@dataclass
class Step:
    """What the loop must do after one input, in this order: write ``facts`` to MXPS_JOB_INFO
    if not None (before the WELCOMEs go out, so a node that started can find them); send
    ``sends``; end the process with ``exit`` if not None."""
    sends: List[Send] = field(default_factory=list)
    facts: Optional[dict] = None
    exit: Optional[Exit] = None


class Node:
    __slots__ = ("ident", "role", "host", "port", "pid", "mode", "rank", "last_heard",
                 "finished", "watched", "seal", "checkpoints", "lost")

    def __init__(self, ident, role, host, port, pid, mode, now):
        self.ident = ident
        self.role = role
        self.host = host
        self.port = port
        self.pid = pid
        self.mode = mode
        self.rank = -1
        self.last_heard = now
        self.finished = False
        self.watched = True
        self.seal = ""            # a server's data-plane nonce, hex (mxps.wire.seal)
        self.checkpoints = None   # a resumed store's {server rank: [rounds]} (a server's)
        self.lost = False         # a server the job went on without (MXPS_FAILOVER)

    def describe(self):
        rank = self.rank if self.rank >= 0 else "?"
        return "%s %s (%s:%s, pid %s)" % (self.role, rank, self.host, self.port, self.pid)

    def fact(self):
        fact = {"rank": self.rank if self.rank >= 0 else None, "host": self.host,
                "port": self.port, "pid": self.pid}
        if self.seal:
            fact["seal"] = self.seal      # a salt, not a secret (mxps.wire.seal)
        if self.lost:
            fact["lost"] = True
        return fact


class MalformedBody(ValueError):
    """A control message whose body is not what its type requires (dropped, never fatal)."""


def _json(payload):
    try:
        return json.loads(payload)
    except (TypeError, ValueError, RecursionError) as e:
        raise MalformedBody("not JSON: %s" % (e,)) from None


def _register_info(payload):
    """A REGISTER body: {role, host, port, pid, mode, start_heartbeats?}, checked."""
    info = _json(payload)
    if not isinstance(info, dict):
        raise MalformedBody("REGISTER body is not an object")
    ok = (isinstance(info.get("role"), str) and isinstance(info.get("host"), str)
          and isinstance(info.get("port"), int) and isinstance(info.get("pid"), int)
          and isinstance(info.get("mode"), (str, type(None)))
          and isinstance(info.get("seal", ""), str) and len(info.get("seal", "")) in (0, 32))
    if not ok:
        raise MalformedBody("REGISTER body lacks role/host/port/pid/mode of the right types "
                            "(or has a seal that is not 32 hex digits)")
    held = info.get("checkpoints")
    if held is not None:
        if not (isinstance(held, dict) and all(
                isinstance(k, str) and k.isdigit() and isinstance(v, list)
                and all(_integer(x) for x in v) for k, v in held.items())):
            raise MalformedBody("REGISTER checkpoints are not {server rank: [rounds]}")
        info["checkpoints"] = {int(k): [int(x) for x in v] for k, v in held.items()}
    return info


def _integer(x, low=0):
    return isinstance(x, int) and not isinstance(x, bool) and x >= low


def _number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) \
        and x >= 0


def read_table(obj, num_servers, what="table"):
    """A placement table as JSON (``plan.table_to_json``), checked before use: every key's
    slices are [server, offset, length] integers covering its elements once, in order, on
    servers 0 .. ``num_servers`` - 1.  Raises ``ValueError`` naming the problem."""
    if not isinstance(obj, dict):
        raise ValueError("%s is a %s, not a table" % (what, type(obj).__name__))
    for k, slices in obj.items():
        if not isinstance(slices, list) or not all(
                isinstance(x, list) and len(x) == 3 and all(_integer(v, -2 ** 63) for v in x)
                for x in slices):
            raise ValueError("%s: the slices of key %.20r are not [server, offset, length] "
                             "integers" % (what, k))
    try:
        table = table_from_json(obj)
        for key, slices in table.items():
            if any(x.length < 0 for x in slices):
                raise PlanError("key %d has a slice of negative length" % key)
            check_slices(key, sum(x.length for x in slices), slices, num_servers,
                         one_per_server=False)
    except (ValueError, PlanError) as e:          # int() of a key that is not a number
        raise ValueError("%s: %s" % (what, e)) from None
    return table


def _replan_report(payload, num_servers):
    """A worker's REPLAN body, checked field by field before anything of it is used: the
    point's round, whether it is a full one, its traffic per round and server, rank 0's
    placement (keys, the table in force) and planner options."""
    report = _json(payload)
    if not isinstance(report, dict) or not _integer(report.get("round"), -2 ** 63):
        raise MalformedBody("REPLAN body lacks an integer round")

    def bad(what):
        return MalformedBody("REPLAN of round %d: %s" % (report["round"], what))

    if not isinstance(report.get("full", True), bool):
        raise bad("'full' is not true or false")
    seed = report.get("seed", [])
    if not isinstance(seed, list) or not all(map(_integer, seed)):
        raise bad("'seed' is not a list of keys")
    traffic = report.get("traffic", {})
    if not isinstance(traffic, dict):
        raise bad("'traffic' is not an object")
    for r, per in traffic.items():
        if not (r.lstrip("-").isdigit() and isinstance(per, list) and len(per) == num_servers
                and all(isinstance(t, list) and len(t) in (2, 4) and all(map(_number, t))
                        for t in per)):
            raise bad("the traffic of round %.20r is not [bytes, seconds] or [bytes, seconds, "
                      "tail bytes, tail seconds] for each of %d servers" % (r, num_servers))
    for name in ("force", "min_slice", "max_chunk", "horizon"):
        if name in report and not _integer(report[name]):
            raise bad("%r is not a non-negative integer" % name)
    if "min_gain" in report and not _number(report["min_gain"]):
        raise bad("'min_gain' is not a non-negative number")
    if "table" in report:
        keys = report.get("keys")
        if not isinstance(keys, list) or not all(
                isinstance(k, list) and len(k) == 2 and all(map(_integer, k)) for k in keys) \
                or len({k for k, _ in keys}) != len(keys):
            raise bad("'keys' is not a list of distinct [key, elements] integers")
        try:
            table = read_table(report["table"], num_servers, "the table in force")
        except ValueError as e:
            raise bad(str(e)) from None
        for k, n in keys:
            if k in table and sum(x.length for x in table[k]) != n:
                raise bad("key %d has %d elements, the table in force places %d"
                          % (k, n, sum(x.length for x in table[k])))
    return report


def address_order(node):
    """Sort key: ranks follow addresses (IP addresses numerically, then port, then pid)."""
    try:
        host = ipaddress.ip_address(node.host)
    except ValueError:
        host = node.host
    return (str(type(host)), host, node.port, node.pid)


class SchedulerState(Failover):
    """All of the scheduler's protocol state; see the module docstring.  ``now`` is a
    monotonic time in seconds, supplied by the caller with every input."""

    def __init__(self, cfg, now):
        self.cfg = cfg
        self.want = {"server": cfg.num_servers, "worker": cfg.num_workers}
        self.start_deadline = now + cfg.start_timeout
        self.started_at = None     # when the rendezvous completed
        self.mode = None
        self.nodes = {}            # ident -> Node, in registration order
        self.barrier_waiting = []  # Nodes
        self.barrier_count = 0
        self.rate_reports = {}     # worker rank -> probe timings {bytes, seconds} per server
        self.replanner = adaptive.Replanner(cfg.num_servers, cfg.num_workers,
                                            window=cfg.replan_window,
                                            one_round=cfg.replan_one_round)
        self.replan_reports = {}   # worker rank -> its REPLAN request body
        self.replan_points = 0     # re-plan points passed (MXPS_REPLAN_FORCE counts them)
        self.plan_version = 0
        self.pending_plan = None   # a plan the servers are moving state for
        self.overlapped = set()    # rounds a move overlapped: not timed (_decide)
        self.points = []           # the job facts' "replan_points"
        self.failovers = []        # the job facts' "failovers" (MXPS_FAILOVER)
        self.diverts = []          # the job facts' "diverts" (MXPS_DIVERT)
        self.slow_idle = set()     # servers diverted that no plan has given a slice since
        self.slow_reports = {}     # (server, round) -> workers that reported it slow
        self.divert_table = None   # the table after the last divert, until the next point
        self.resume_round = None   # a resumed store's round, agreed at the start
        self.exit = None
        self.leaving = None        # after the SHUTDOWN: idents of the nodes yet to say BYE
        self.leave_deadline = None
        self.malformed = 0         # messages of nodes dropped as malformed (body, or type)
        self.strangers = 0         # messages of connections that are not nodes, ignored
        self.told_late = set()     # after an abort in start-up: late arrivals told why
        self._now = now
        self._step = None

    # -- inputs ------------------------------------------------------------------------------
    def on_message(self, ident, header, payload, now):
        """One message from the node with zmq identity ``ident``; ``payload``: bytes or None."""
        self._begin(now)
        node = self.nodes.get(ident)
        try:
            if self.exit is not None:
                self._tell_late(ident, node, header)
            elif self.leaving is not None:
                if node is not None:
                    self._on_leaving(node, header)
            elif header.type == MsgType.REGISTER and node is None:
                self._on_register(ident, _register_info(payload))
            elif node is not None and node.lost:
                # a server the job went on without (MXPS_FAILOVER), back from a freeze
                self._send(node, MsgType.ABORT, b"this server was found lost and the job went "
                           b"on without it (MXPS_FAILOVER)")
            elif node is not None:
                node.last_heard = now
                if self.started_at is not None:
                    self._check_sender(node, header)
                    self._on_message(node, header, payload)
                elif header.type == MsgType.HEARTBEAT:
                    self._send(node, MsgType.HEARTBEAT)   # a node waiting for its WELCOME
            else:
                # a connection that is no node of the job (with a secret: one of the job's
                # processes that never registered); it gets nothing
                self.strangers += 1
                if self.strangers <= 10 or self.strangers % 1000 == 0:
                    log.warning("ignored %s from connection %r, which is not a node of the job "
                                "(%d so far)", MsgType(header.type).name, ident, self.strangers)
        except MalformedBody as e:
            # a node's own bug, or bytes that are not mxps's: dropped, never fatal
            self.malformed += 1
            if self.malformed <= 10 or self.malformed % 1000 == 0:
                log.warning("dropped a malformed %s from %s (%d so far): %s",
                            MsgType(header.type).name, node.describe() if node else ident,
                            self.malformed, e)
        return self._end()

    @staticmethod
    def _check_sender(node, h):
        if h.type not in SENDS[node.role]:
            raise MalformedBody("a %s does not send %s to the scheduler"
                                % (node.role, MsgType(h.type).name))
        if node.finished and h.type not in AFTER_FINISH:
            raise MalformedBody("%s after its FINISH" % MsgType(h.type).name)

    def tick(self, now):
        """The passing of time: the start, plan and heartbeat deadlines."""
        self._begin(now)
        if self.exit is not None:
            pass
        elif self.leaving is not None:
            if now >= self.leave_deadline:
                log.warning("no BYE from %s within %.1f s of the SHUTDOWN "
                            "(MXPS_HEARTBEAT_TIMEOUT); ending the job anyway", ", ".join(
                                sorted(self.nodes[i].describe() for i in self.leaving)),
                            self.cfg.heartbeat_timeout)
                self._end_job(0, CLEAN_EXIT_REASON)
        elif self.started_at is None:
            if now >= self.start_deadline:
                if not self._start_short():
                    self._abort(self._start_timeout_message())
            else:
                self._check_heartbeats(starting=True)
        elif not self._check_plan_deadline():
            self._check_heartbeats()
        return self._end()

    def expects_late(self, now):
        """Whether the job, aborted during start-up, still expects nodes that had not
        registered yet: until each has registered (and been told why the job ended) or the
        start deadline passed, the scheduler stays to answer them, so a node that arrives
        after the abort fails at once naming the cause, not at its own start timeout."""
        return (self.exit is not None and self.exit.code != 0 and self.started_at is None
                and now < self.start_deadline
                and len(self.nodes) + len(self.told_late) < sum(self.want.values()))

    def _tell_late(self, ident, node, header):
        """After the job ended in start-up: a node that registers now gets the reason."""
        if node is not None or ident in self.told_late or header.type != MsgType.REGISTER or \
                not self.expects_late(self._now):
            return
        self.told_late.add(ident)
        self._step.sends.append(Send(ident, Header(MsgType.ABORT), self.exit.reason.encode()))

    def abort(self, reason, now):
        """End the job from outside the protocol (the loop's own failure), naming ``reason``."""
        self._begin(now)
        if self.exit is None:
            self._abort(reason)
        return self._end()

    def facts(self):
        """The job's facts as data (what MXPS_JOB_INFO receives)."""
        return {"mode": self.mode, "servers": self._roster("server"),
                "workers": self._roster("worker"),
                "replan_points": [dict(p) for p in self.points],
                "failovers": [dict(f) for f in self.failovers],
                "diverts": [dict(d) for d in self.diverts],
                "resume_round": self.resume_round,
                "exit": None if self.exit is None else dict(self.exit._asdict())}

    @staticmethod
    def _server_order(node):
        """Servers rank by address; resuming a store, one that holds the store of exactly
        one rank (its own disk) is given that rank first."""
        held = node.checkpoints or {}
        return (next(iter(held)) if len(held) == 1 else float("inf"),) + address_order(node)

    def _begin(self, now):
        self._now = now
        self._step = Step()

    def _end(self):
        step, self._step = self._step, None
        return step

    # -- helpers -----------------------------------------------------------------------------
    def _send(self, node, type_, body=None, **fields):
        self._step.sends.append(Send(node.ident, Header(type_, **fields), body))

    def _workers(self):
        return [n for n in self.nodes.values() if n.role == "worker"]

    def _servers(self):
        """The servers of the job, but those lost to a failover."""
        return [n for n in self.nodes.values() if n.role == "server" and not n.lost]

    def _live_workers(self):
        return [n for n in self._workers() if not n.finished]

    def _roster(self, role):
        group = sorted((n for n in self.nodes.values() if n.role == role),
                       key=lambda n: (n.rank, address_order(n)))
        return [n.fact() for n in group]

    def _count(self, role):
        return sum(n.role == role for n in self.nodes.values())

    def _end_job(self, code, reason):
        self.exit = Exit(code, reason)
        self._step.exit = self.exit
        self._step.facts = self.facts()

    def _abort(self, reason):
        log.error("aborting the job: %s", reason)
        body = reason.encode()
        for n in self.nodes.values():
            self._send(n, MsgType.ABORT, body)
        self._end_job(EXIT_LOST_PEER, reason)

    # -- rendezvous --------------------------------------------------------------------------
    def _on_register(self, ident, info):
        role = info.get("role")
        if role not in self.want:
            return
        if self._count(role) >= self.want[role]:
            refusal = "the job already has %d %ss (DMLC_NUM_%s)" % (
                self.want[role], role, role.upper())
            self._step.sends.append(Send(ident, Header(MsgType.ABORT), refusal.encode()))
            return
        node = self.nodes[ident] = Node(ident, role, info["host"], info["port"], info["pid"],
                                        info.get("mode"), self._now)
        # a node that heartbeats while it waits for its WELCOME is watched from now on, so
        # its death during start-up ends the job in MXPS_HEARTBEAT_TIMEOUT, not the start timeout
        node.watched = bool(info.get("start_heartbeats"))
        node.seal = info.get("seal", "")
        if role == "server":
            node.checkpoints = info.get("checkpoints")
        if all(self._count(r) == k for r, k in self.want.items()):
            self._start()

    def _start_timeout_message(self):
        """Names what is missing: per role, how many of how many registered, and who did (the
        scheduler cannot know the address of a node that never reached it)."""
        parts = []
        for role in ROLES:
            have = [n for n in self.nodes.values() if n.role == role]
            missing = self.want[role] - len(have)
            if not missing:
                continue
            parts.append("%d of %d %ss missing (DMLC_NUM_%s=%d; registered: %s)" % (
                missing, self.want[role], role, role.upper(), self.want[role],
                ", ".join("%s:%s pid %s" % (n.host, n.port, n.pid) for n in have) or "none"))
        return ("mxps scheduler: only %d of %d servers and %d of %d workers registered within "
                "%.0f s (MXPS_START_TIMEOUT): %s. A missing node did not start, died before "
                "registering, cannot reach %s:%d, or imported mxnet before mxps" % (
                    self._count("server"), self.want["server"], self._count("worker"),
                    self.want["worker"], self.cfg.start_timeout, "; ".join(parts),
                    self.cfg.root_uri, self.cfg.root_port))

    def _start(self):
        servers = sorted(self._servers(), key=self._server_order)
        workers = sorted(self._workers(), key=address_order)
        for group in (servers, workers):
            for rank, n in enumerate(group):
                n.rank = rank
        if any(n.checkpoints is not None for n in servers):
            try:
                self.resume_round = checkpoints.agree(
                    [n.checkpoints or {} for n in servers], len(servers))
            except checkpoints.NoCommonCheckpoint as e:
                self._abort("cannot resume the disk store (MXPS_STORE_RESUME=1): %s" % e)
                return
            lost = [n.describe() for n in servers if n.rank not in (n.checkpoints or {})]
            if lost:
                self._abort("cannot resume the disk store: %s do not hold the store of their "
                            "rank (server<rank> under MXPS_STORE_DIR)" % ", ".join(lost))
                return
            log.info("resuming the disk store at round %d", self.resume_round)
        # sync or async is the workers' choice (the kvstore name, e.g. mxps_async, or their
        # MXPS_MODE); the servers follow it
        if len({n.mode for n in workers}) != 1:
            self._abort("workers disagree on the mode: %s (kvstore names or MXPS_MODE differ "
                        "between workers)" % ", ".join("worker %d: %s" % (n.rank, n.mode)
                                                       for n in workers))
            return
        self.mode = workers[0].mode
        self.started_at = self._now
        server_addrs = [[n.host, n.port] for n in servers]
        for n in servers + workers:
            body = json.dumps({"rank": n.rank, "role": n.role, "servers": server_addrs,
                               "seals": [s.seal for s in servers],
                               "num_workers": self.cfg.num_workers,
                               "num_servers": self.cfg.num_servers,
                               "mode": self.mode,
                               "resume_round": self.resume_round}).encode()
            self._send(n, MsgType.WELCOME, body)
            n.last_heard = self._now
        log.info("job started: %d servers %s, %d workers", len(servers),
                 ["%s:%d" % tuple(a) for a in server_addrs], len(workers))
        log.info("mode: %s", self.mode)
        self._step.facts = self.facts()

    # -- the running job ---------------------------------------------------------------------
    def _on_message(self, node, h, payload):
        if h.type == MsgType.HEARTBEAT:
            self._send(node, MsgType.HEARTBEAT)
        elif h.type == MsgType.BARRIER:
            if node in self.barrier_waiting:
                raise MalformedBody("a second BARRIER before the first was released")
            self.barrier_waiting.append(node)
            self._maybe_release_barrier()
        elif h.type == MsgType.BANDWIDTH:
            self._on_bandwidth(node, self._bandwidth_report(payload))
        elif h.type == MsgType.REPLAN:
            self.replan_reports[node.rank] = _replan_report(payload, self.cfg.num_servers)
            self._maybe_replan()
        elif h.type == MsgType.PLAN:
            ack = _json(payload)
            if not isinstance(ack, dict):
                raise MalformedBody("PLAN body is not an object")
            self._on_plan_ack(node, ack)
        elif h.type == MsgType.ABORT:
            reason = payload.decode(errors="replace") if payload is not None else \
                "unknown error"
            self._abort("%s failed: %s" % (node.describe(), reason))
        elif h.type == MsgType.FINISH:
            self._on_finish(node)
        elif h.type == MsgType.FAILOVER:
            body = _json(payload)
            version = body.get("version") if isinstance(body, dict) else None
            if not _integer(version):
                raise MalformedBody("FAILOVER body has no version")
            try:
                old = read_table(body.get("old"), self.cfg.num_servers, "the old table")
                new = read_table(body.get("new"), self.cfg.num_servers, "the new table")
            except ValueError as e:
                raise MalformedBody("FAILOVER: %s" % e) from None
            self._on_failover_tables(node, version, old, new)
        elif h.type == MsgType.SLOW:
            body = _json(payload)
            if not isinstance(body, dict) or not _integer(body.get("server")) or not \
                    _integer(body.get("round")) or not _number(body.get("ratio")) or \
                    not 0 <= body["server"] < self.cfg.num_servers or body["ratio"] < 0:
                raise MalformedBody("SLOW body needs server (a rank), round and ratio (>= 0)")
            self._on_slow(node, body["server"], body["round"], float(body["ratio"]),
                          body.get("forced") is True)

    def _bandwidth_report(self, payload):
        report = _json(payload)
        n = self.cfg.num_servers
        good = isinstance(report, dict) and all(
            isinstance(report.get(k), list) and len(report[k]) == n
            and all(map(_number, report[k])) for k in ("bytes", "seconds")) and all(
            x > 0 for x in report["seconds"])
        if not good:
            raise MalformedBody("BANDWIDTH body needs 'bytes' and 'seconds' lists of %d "
                                "numbers (seconds > 0)" % n)
        return report

    def _maybe_release_barrier(self):
        if self.barrier_waiting and len(self.barrier_waiting) >= len(self._live_workers()):
            self.barrier_count += 1
            for n in self.barrier_waiting:
                self._send(n, MsgType.ACK, key=BARRIER_KEY, iteration=self.barrier_count)
            self.barrier_waiting = []

    def _on_bandwidth(self, node, report):
        self.rate_reports[node.rank] = report
        if len(self.rate_reports) < self.cfg.num_workers:
            return
        reports = list(self.rate_reports.values())
        self.rate_reports = {}
        # a server's rate: all bytes echoed through it over the slowest worker's time
        rates = [sum(r["bytes"][s] for r in reports) / max(r["seconds"][s] for r in reports)
                 for s in range(self.cfg.num_servers)]
        log.info("server rates agreed (MB/s): %s", " ".join("%.1f" % (r / 1e6) for r in rates))
        self.replanner.rates = list(rates)
        body = json.dumps({"rates": rates}).encode()
        for n in self._workers():
            self._send(n, MsgType.BANDWIDTH, body)

    def _on_finish(self, node):
        node.finished = True
        if all(n.finished for n in self._workers()):
            for n in self.nodes.values():
                self._send(n, MsgType.SHUTDOWN)
                n.finished = True
            log.info("all workers finished; job done once every node said BYE")
            self.leaving = {i for i, n in self.nodes.items() if not n.lost}
            self.leave_deadline = self._now + self.cfg.heartbeat_timeout
            return
        # a barrier or re-plan point some finished worker will never join must not wait for it
        self._maybe_release_barrier()
        self._maybe_replan()

    def _on_leaving(self, node, h):
        """After the SHUTDOWN: a node's BYE; a heartbeat of a node that did not get the
        SHUTDOWN yet is answered with it again.  Anything else is moot now."""
        if node.ident not in self.leaving:
            return
        if h.type == MsgType.BYE:
            self.leaving.discard(node.ident)
            if not self.leaving:
                self._end_job(0, CLEAN_EXIT_REASON)
        elif h.type == MsgType.HEARTBEAT:
            self._send(node, MsgType.SHUTDOWN)

    def _check_heartbeats(self, starting=False):
        for n in list(self.nodes.values()):
            if starting and not n.watched or n.lost:
                continue
            silent = self._now - n.last_heard
            if not n.finished and silent > self.cfg.heartbeat_timeout:
                if n.role == "server" and self.cfg.failover:
                    if starting:
                        self._start_without(n, "no heartbeat for %.1f s" % silent)
                    else:
                        self._fail_over(n, silent)
                    if self.exit is not None or self.started_at is not None:
                        return
                    continue
                self._abort("lost %s%s: no heartbeat for %.1f s (MXPS_HEARTBEAT_TIMEOUT=%s); the "
                            "process died or hangs" % (
                                n.describe(), " during start-up" if starting else "", silent,
                                self.cfg.heartbeat_timeout))
                return

    # -- live re-planning --------------------------------------------------------------------
    def _maybe_replan(self):
        """Every live worker reached the re-plan point of the same round, having drained its own
        operations.  At a full point (every worker waits for the answer, so nothing is in
        flight anywhere) measure, decide, and either release them at once or have the servers
        move state first; at a light one (workers went on) measure and say whether the next
        point must be a full one (``Replanner.wants_point``)."""
        if not self.replan_reports or len(self.replan_reports) < len(self._live_workers()):
            return
        if self.pending_plan is not None:
            return      # overlapped: the last plan's state is still moving; its acks call back
        reports, self.replan_reports = self.replan_reports, {}
        point = self._agreed_point(reports)
        if point is None:
            return
        round_, is_full = point
        self.replan_points += 1
        try:
            table, old, full_next = self._decide(round_, is_full, reports)
        except Exception as e:
            # every worker waits for an answer: one that the planner cannot decide on keeps
            # the plan in force (and says so) rather than leave them waiting
            log.error("round %d: re-plan point failed, plan %d kept: %s: %s", round_,
                      self.plan_version, type(e).__name__, e)
            table, full_next = None, True
        if table is None:
            self._keep_plan(round_, is_full, full_next)
        else:
            # MXPS_REPLAN_SEED: every worker holds the weights its last pull got, so a quiescent
            # move can take them from the workers (docs/REPLAN.md)
            seed = set()
            if not self.cfg.replan_overlap:     # the keys every worker holds
                seed = set.intersection(*(set(r.get("seed") or ()) for r in reports.values()))
            self._send_plan(round_, old, table, full_next, seed)

    def _decide(self, round_, is_full, reports):
        """(new table or None, the table in force, whether the next point must be full)."""
        # a round that a move overlapped (MXPS_REPLAN_OVERLAP) is not timed: the servers that
        # received state answered its pulls only once the state was in, and would look slow
        skip, self.overlapped = {str(r) for r in self.overlapped}, set()
        self.replanner.observe([{r: t for r, t in rep.get("traffic", {}).items()
                                 if r not in skip} for rep in reports.values()])
        lead = reports.get(0) or reports[min(reports)]
        keys, old, opts = self._placement(lead)
        if self.divert_table is not None:
            # a divert since the last point: a worker may have reported the table before it
            old, self.divert_table = self.divert_table, None
            if skip and not any(r not in skip for rep in reports.values()
                                for r in rep.get("traffic", {})):
                # MXPS_DIVERT: the only round since the last point was the diverted one, not
                # timed; the rates are those from before the link moved (the server the slow
                # link left still looks slow): decide at the next point, on the divert's plan
                return None, old, True
        if self.failovers:
            # the planner places on every server of the job: after a failover the
            # successor table stays (docs/FAILOVER.md)
            return None, old, False
        # MXPS_REPLAN_FORCE=N: a forced new table at every N-th point (always a full one)
        every = int(lead.get("force") or 0)
        forced_next = bool(every) and (self.replan_points + 1) % every == 0
        table = None
        if keys is not None and is_full:
            table = self.replanner.decide(
                keys, old, self.plan_version + 1, round_,
                force=bool(every) and self.replan_points % every == 0, **opts)
        if table is None:
            return None, old, forced_next or (
                keys is not None and self.replanner.wants_point(keys, old, **opts))
        adaptive.moved_bytes(old, table, 4)       # the two tables agree on every key's size
        return table, old, forced_next or self.replanner.suspects_change()

    def _agreed_point(self, reports):
        """(round, full?) of a point every worker reported alike; else abort, naming each."""
        rounds = sorted({r["round"] for r in reports.values()})
        if len(rounds) != 1:
            self._abort("workers reached the re-plan point at different rounds (%s): they do "
                        "not push the same keys the same number of times"
                        % ", ".join("worker %d: %d" % (w, r["round"])
                                    for w, r in sorted(reports.items())))
            return None
        full = {bool(r.get("full", True)) for r in reports.values()}
        if len(full) != 1:
            self._abort("workers disagree whether the re-plan point of round %d is a full one "
                        "(%s)" % (rounds[0], ", ".join("worker %d: %s" % (w, r.get("full", True))
                                                      for w, r in sorted(reports.items()))))
            return None
        return rounds[0], full.pop()

    @staticmethod
    def _placement(lead):
        """(keys, table in force, planner options) from rank 0's report, or Nones."""
        if "table" not in lead:
            return None, None, {}
        opts = dict(min_slice=int(lead.get("min_slice", adaptive.DEFAULT_MIN_SLICE)),
                    min_gain=float(lead.get("min_gain", 0.05)),
                    horizon=int(lead.get("horizon", 20)),
                    max_chunk=int(lead.get("max_chunk", 0)))
        keys = [(int(k), int(n)) for k, n in lead["keys"]]
        return keys, table_from_json(lead["table"]), opts

    def _keep_plan(self, round_, is_full, full_next):
        log.info("round %d: %s point, plan %d kept; next point %s", round_,
                 "full" if is_full else "light", self.plan_version,
                 "full" if full_next else "light")
        self._record_point(round_, is_full, False, full_next, 0)
        self._release({"version": self.plan_version, "table": None,
                       "rates": self.replanner.rates, "full_next": full_next})

    def _seeds(self, old, table, keys):
        """The weights of ``keys`` that change server, as [key, offset, length, server, worker]
        tasks: every part of an old slice that a new slice on another server takes, each to
        the worker with the fewest elements to send so far (parts differ in size)."""
        load = {n.rank: 0 for n in self._live_workers()}
        tasks = []
        for key in sorted(k for k in table if k in keys):
            for n in table[key]:
                for o in old.get(key, ()):
                    lo, hi = max(n.offset, o.offset), min(n.stop, o.stop)
                    if hi > lo and o.server != n.server:
                        w = min(load, key=lambda r: (load[r], r))
                        load[w] += hi - lo
                        tasks.append([key, lo, hi - lo, n.server, w])
        return tasks

    def _send_plan(self, round_, old, table, full_next, seed=()):
        self.plan_version += 1
        # "planned": the weights' bytes that change server; "moved": what the servers report
        # they sent for them (values and optimizer state), known once all are in place
        planned = adaptive.moved_bytes(old, table, 4)
        self.pending_plan = {"version": self.plan_version, "table": table, "acks": set(),
                             "planned": planned, "moved": planned, "sent": 0, "round": round_,
                             "full_next": full_next, "deadline": self._now + self.cfg.timeout,
                             "old": old}
        plan = {"version": self.plan_version, "old": table_to_json(old),
                "new": table_to_json(table)}
        tasks = self._seeds(old, table, seed) if seed else None
        if tasks:
            plan["seeds"] = [[k, off, n, w] for k, off, n, _, w in tasks]
        body = json.dumps(plan).encode()
        for n in self._servers():
            self._send(n, MsgType.PLAN, body, plan_version=self.plan_version)
        if tasks:
            # each worker sends the new owners the weights it was given, then waits for the
            # answer that releases it (once every server has its state in place)
            for n in self._live_workers():
                mine = [[k, off, length, srv] for k, off, length, srv, w in tasks
                        if w == n.rank]
                self._send(n, MsgType.REPLAN, json.dumps(
                    {"version": self.plan_version, "seed": mine}).encode(),
                    plan_version=self.plan_version)
        if self.cfg.replan_overlap:
            # MXPS_REPLAN_OVERLAP: the workers go on with the new plan at once; a server
            # holds a request for a slice it is still building until the slice is built,
            # so the move overlaps the next round's pushes instead of stopping the job
            # (server_state._defer).  The next point waits for this plan's acks.
            p = self.pending_plan
            p["released"] = True
            self.overlapped.add(round_)
            self._record_point(round_, True, True, full_next, p["moved"])
            self._release(self._plan_body(p))

    def _on_plan_ack(self, node, body):
        p = self.pending_plan
        if p is None or body.get("version") != p["version"]:
            return
        if body.get("error"):
            self._abort("%s could not move state for plan %d: %s"
                        % (node.describe(), p["version"], body["error"]))
            return
        sent = body.get("moved_bytes", 0)
        if not _integer(sent):
            raise MalformedBody("PLAN of version %d: moved_bytes %.40r is not a byte count"
                                % (p["version"], sent))
        if node.rank in p["acks"]:
            return
        p["acks"].add(node.rank)
        p["sent"] += sent
        if "failover" in p or "divert" in p:
            record = p.get("failover") or p["divert"]
            reset = body.get("reset") or []
            if not isinstance(reset, list):
                raise MalformedBody("PLAN of version %d: reset is not a list" % p["version"])
            if "failover" in p:
                record["state_reset"].extend(reset)
            stale = body.get("stale") or []
            if not isinstance(stale, list):
                raise MalformedBody("PLAN of version %d: stale is not a list" % p["version"])
            if stale:
                # a lazy replica's state (MXPS_REPLICA=K): [key, offset, length, rounds behind]
                record.setdefault("state_stale", []).extend(stale)
        if len(p["acks"]) < len(self._servers()):
            return
        self.pending_plan = None
        if "divert" in p:
            self._divert_in_place(p)
            self._maybe_replan()
            return
        if "failover" in p:
            self._failover_in_place(p)
            if p.get("abandoned") is not None:     # the workers wait at the point: release
                self._record_point(p["round"], True, True, p["full_next"], 0)
                self._release(self._plan_body(p))
            self._maybe_replan()
            return
        p["moved"] = p["sent"]
        self.slow_idle -= {x.server for slices in p["table"].values() for x in slices}
        self.replanner.moved(p["planned"], p["sent"])
        log.info("plan %d in place (round %d, %d bytes of weights changed server, %d bytes "
                 "sent)", p["version"], p["round"], p["planned"], p["sent"])
        if not p.get("released"):
            self._record_point(p["round"], True, True, p["full_next"], p["moved"])
            self._release(self._plan_body(p))
        else:       # overlapped: the point was recorded at the release; the state is in now
            self.points[-1]["in_place_at"] = round(self._now - self.started_at, 6)
            self.points[-1]["moved_bytes"] = int(p["sent"])
        self._maybe_replan()            # a point that waited for this plan's state

    def _plan_body(self, p):
        return {"version": p["version"], "table": table_to_json(p["table"]),
                "moved_bytes": p["moved"], "rates": self.replanner.rates,
                "full_next": p["full_next"]}

    def _check_plan_deadline(self):
        p = self.pending_plan
        if p is None or self._now <= p["deadline"]:
            return False
        late = [n.describe() for n in self._servers() if n.rank not in p["acks"]]
        self._abort("plan %d: %s did not finish moving state within %.0f s (MXPS_TIMEOUT)"
                    % (p["version"], ", ".join(late), self.cfg.timeout))
        return True

    def _record_point(self, round_, is_full, new_plan, full_next, moved):
        self.points.append({"round": round_, "kind": "full" if is_full else "light",
                            "plan_version": self.plan_version, "new_plan": new_plan,
                            "full_next": bool(full_next), "moved_bytes": int(moved),
                            "at": round(self._now - self.started_at, 6)})

    def _release(self, body):
        data = json.dumps(body).encode()
        for n in self._live_workers():
            self._send(n, MsgType.REPLAN, data, plan_version=body["version"])
