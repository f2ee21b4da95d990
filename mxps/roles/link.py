"""A node's link to the scheduler: registration, heartbeats, barriers, shutdown and abort.

Shared by workers and servers.  The owner polls ``sock`` in its own loop and hands scheduler
messages to ``handle``; ``tick`` sends heartbeats and detects a silent scheduler.  Nothing here
waits without a deadline: a lost scheduler or an ABORT ends the process with a message naming
the lost node (``fatal``), exit code ``EXIT_LOST_PEER``.  A scheduler that refuses this node's
credentials (a different job secret) ends the registration within a second, saying so
(``CredentialsRefused``).  A scheduler message that does not parse (bad JSON, missing or
mistyped fields) is dropped and counted (``drops``), never fatal.
"""
import json
import logging
import numbers
import os
import sys
import threading
import time

import zmq

from ..wire import frame as wire, tcp as transport
from ..wire.frame import Header, MsgType

log = logging.getLogger("mxps")

EXIT_LOST_PEER = 3


# a scheduler that closed this many handshakes in a row (none succeeded) refuses our
# credentials: libzmq retries every 100 ms, so this takes a few tenths of a second (a
# handshake refused outright, e.g. a node without a secret, is not retried: one is enough)
HANDSHAKE_FAILURES = 3


class PeerLostError(RuntimeError):
    """Another node of the job died or went silent; the message names it."""


class CredentialsRefused(PeerLostError):
    """The scheduler refused this node's handshake: the nodes' job secrets differ."""


def _body(payload, what):
    """A control message's JSON object; raises WireError naming ``what`` otherwise."""
    if payload is None:
        raise wire.WireError("%s without a body" % what)
    try:
        body = json.loads(payload.bytes if hasattr(payload, "bytes") else payload)
    except (ValueError, UnicodeDecodeError) as e:
        raise wire.WireError("%s body is not JSON: %s" % (what, e)) from None
    if not isinstance(body, dict):
        raise wire.WireError("%s body is not a JSON object" % what)
    return body


def _field(body, name, kind, what, optional=False):
    v = body.get(name)
    if v is None and optional:
        return None
    if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
        raise wire.WireError("%s: field %r is %r" % (what, name, v))
    return v


def parse_welcome(payload):
    """The scheduler's WELCOME, checked: rank, server addresses, job size, mode."""
    body = _body(payload, "WELCOME")
    rank = _field(body, "rank", int, "WELCOME")
    workers = _field(body, "num_workers", int, "WELCOME")
    servers = _field(body, "num_servers", int, "WELCOME")
    addrs = _field(body, "servers", list, "WELCOME")
    if len(addrs) != servers or not all(
            isinstance(a, list) and len(a) == 2 and isinstance(a[0], str)
            and isinstance(a[1], int) and 0 < a[1] < 65536 for a in addrs):
        raise wire.WireError("WELCOME: %d server addresses %r" % (servers, addrs))
    seals = body.setdefault("seals", [""] * servers)
    if not (isinstance(seals, list) and len(seals) == servers and all(
            isinstance(s, str) and len(s) in (0, 32) for s in seals)):
        raise wire.WireError("WELCOME: %d server nonces %r" % (servers, seals))
    try:
        body["seals"] = [bytes.fromhex(s) for s in seals]
    except ValueError:
        raise wire.WireError("WELCOME: server nonces %r are not hex" % (seals,)) from None
    resume = body.setdefault("resume_round", None)
    if resume is not None and (not isinstance(resume, int) or isinstance(resume, bool)
                               or resume < 0):
        raise wire.WireError("WELCOME: resume round %r" % (resume,))
    if body.get("mode") not in ("sync", "async", "wsp") or rank < 0 or workers < 1:
        raise wire.WireError("WELCOME: rank %d, %d workers, mode %r"
                             % (rank, workers, body.get("mode")))
    return body


def parse_bandwidth(payload):
    body = _body(payload, "BANDWIDTH")
    rates = _field(body, "rates", list, "BANDWIDTH")
    if not rates or not all(isinstance(r, numbers.Real) and not isinstance(r, bool) and r > 0
                            for r in rates):
        raise wire.WireError("BANDWIDTH: rates %r" % (rates,))
    return body


def parse_replan(payload):
    body = _body(payload, "REPLAN")
    _field(body, "rates", list, "REPLAN", optional=True)
    if "full_next" in body and not isinstance(body["full_next"], bool):
        raise wire.WireError("REPLAN: full_next %r" % (body["full_next"],))
    if body.get("table") is not None:
        _field(body, "table", (list, dict), "REPLAN")
        _field(body, "version", int, "REPLAN")
    if "seed" in body:      # MXPS_REPLAN_SEED: the weights this worker sends the new owners
        _field(body, "version", int, "REPLAN")
        seed = body["seed"]
        if not isinstance(seed, list) or not all(
                isinstance(t, list) and len(t) == 4 and all(
                    isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in t)
                for t in seed):
            raise wire.WireError("REPLAN: seed %.80r is not [key, offset, length, server] "
                                 "tasks" % (seed,))
    return body


def parse_failover(payload):
    """The scheduler's FAILOVER (MXPS_FAILOVER): {version, dead}, checked; "divert": true
    (MXPS_DIVERT) names a live, slow server."""
    body = _body(payload, "FAILOVER")
    for name in ("version", "dead"):
        if _field(body, name, int, "FAILOVER") < 0:
            raise wire.WireError("FAILOVER: %s %r" % (name, body[name]))
    if not isinstance(body.get("divert", False), bool):
        raise wire.WireError("FAILOVER: divert %r is not a boolean" % (body["divert"],))
    avoid = body.get("avoid", [])
    if not isinstance(avoid, list) or not all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in avoid):
        raise wire.WireError("FAILOVER: avoid %.80r is not a list of server ranks" % (avoid,))
    return body


def _failed(n):
    return "%d failed handshake%s" % (n, "" if n == 1 else "s")


def _text(payload, default):
    if payload is None:
        return default
    return (payload.bytes if hasattr(payload, "bytes") else bytes(payload)).decode(
        "utf-8", errors="replace")


def fault_claimed(cfg, point, role, rank=-1):
    """Test-only fault injection (MXPS_FAULT_POINT, docs/SETTINGS.md): whether this node is the
    one the fault at ``point`` hits.  The claim is the file ``<MXPS_FAULT_DIR>/<point>`` (JSON:
    role, rank, pid), created exclusively: only the first node of the job to reach the point is
    hit, the others go on.  False unless the switch names this point."""
    if cfg.fault_point != point:
        return False
    path = os.path.join(cfg.fault_dir, point)
    try:
        fd = os.open(path + ".tmp%d" % os.getpid(), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump({"role": role, "rank": rank, "pid": os.getpid(), "point": point}, f)
    try:
        os.link(path + ".tmp%d" % os.getpid(), path)    # atomic, fails if another node was first
    except FileExistsError:
        return False
    finally:
        os.remove(path + ".tmp%d" % os.getpid())
    return True


def fault_point(cfg, point, role, rank=-1):
    """At ``point`` (``fault_claimed``), pause for MXPS_FAULT_HOLD seconds without
    heartbeating, as a frozen node would, so the failure matrix (scripts/failure_matrix.py)
    kills or freezes a node at exactly that phase."""
    if not fault_claimed(cfg, point, role, rank):
        return
    log.warning("%s %s: MXPS_FAULT_POINT=%s: pausing %.1f s", role, rank, point, cfg.fault_hold)
    time.sleep(cfg.fault_hold)     # the injected freeze itself (not a wait for anything)


def fatal(who, message, code=EXIT_LOST_PEER):
    """Report a job-ending error and leave at once (other threads may be blocked in MXNet)."""
    try:
        sys.stderr.write("mxps %s: fatal: %s\n" % (who, message))
        sys.stderr.flush()
        sys.stdout.flush()
    finally:
        os._exit(code)


class SchedulerLink:
    def __init__(self, cfg, role, settings=None):
        self.cfg = cfg
        self.role = role
        # how every socket of this node is made (job secret, queue bounds)
        self.settings = settings or transport.Settings.from_config(cfg)
        self.sock = transport.new_dealer(self.settings)
        # registration watches the handshake: a refusal is reported at once, not at the timeout
        self._handshake = transport.HandshakeWatch(self.sock)
        transport.connect(self.sock, cfg.root_uri, cfg.root_port)
        self.drops = transport.Tally(log)
        self.rank = -1
        self.welcome = None
        self.last_heard = time.monotonic()
        self.last_sent = 0.0
        self._heard_at_start = False   # the scheduler answered during registration
        self.shutdown = False
        self.abort_message = None
        self.failing = False      # this node reported its own failure: the ABORT echo is ours
        self.bandwidth = None     # the server rates the scheduler agreed (MXPS_PLAN=adaptive)
        self.barrier_done = 0
        self.replan = None        # the scheduler's last answer at a re-plan point
        self.replans = 0          # how many answers so far
        self.failovers = []       # FAILOVER notices (MXPS_FAILOVER) for the I/O thread
        # ``handle`` runs on the socket's owner thread (a worker's I/O thread); other threads
        # wait on this for what it changes (barrier releases, agreed rates, re-plan answers,
        # shutdown) instead of polling
        self.changed = threading.Condition()

    @property
    def name(self):
        return "%s %s" % (self.role, self.rank if self.rank >= 0 else "?")

    def register(self, host, port=0, seal=b"", checkpoints=None):
        """Announce this node and wait for the scheduler's WELCOME (rank, peers).

        While it waits the node heartbeats (``start_heartbeats`` in the REGISTER tells the
        scheduler to watch it from now on, so a node that dies during start-up ends the job in
        MXPS_HEARTBEAT_TIMEOUT) and watches the scheduler's echoes: once the scheduler has
        answered, its silence for MXPS_HEARTBEAT_TIMEOUT ends the wait, naming it."""
        info = {"role": self.role, "host": host, "port": port, "pid": os.getpid(),
                "mode": self.cfg.mode, "start_heartbeats": True}
        if seal:
            info["seal"] = seal.hex()       # a server's data-plane nonce (mxps.wire.seal)
        if checkpoints is not None:         # a resumed store's: {server rank: [rounds]}
            info["checkpoints"] = {str(k): v for k, v in checkpoints.items()}
        body = json.dumps(info).encode()
        fault_point(self.cfg, "register", self.role)
        deadline = time.monotonic() + self.cfg.start_timeout
        self.send(MsgType.REGISTER, body)
        self._heard_at_start = False
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._handshake.sock, zmq.POLLIN)
        try:
            while True:
                now = time.monotonic()
                self._start_tick(now)
                wait = min(deadline - now, self.last_sent + self.cfg.heartbeat_interval - now)
                events = poll_forever(poller, max(0, int(wait * 1000) + 1)) if wait > 0 else {}
                if self._handshake.sock in events:
                    self._handshake.on_readable()
                    self._check_handshake()
                if self.sock in events:
                    welcome = self._read_welcome()
                    if self._heard_at_start:
                        # the scheduler answered, so it has our REGISTER (test-only pause)
                        fault_point(self.cfg, "welcome", self.role)
                    if welcome is not None:
                        return welcome
                elif time.monotonic() >= deadline:
                    raise PeerLostError(self._start_timeout_message())
        finally:
            self._handshake.close()

    def _start_timeout_message(self):
        """Why the start timeout passed.  Blames the import order only when nothing answered
        at all (a native MXNet scheduler takes the port and never speaks mxps)."""
        where = "%s:%d" % (self.cfg.root_uri, self.cfg.root_port)
        if self._heard_at_start:
            return ("the mxps scheduler at %s did not start the job within %.0f s "
                    "(MXPS_START_TIMEOUT): it answered but never sent this node its WELCOME; "
                    "its own log names the nodes that did not register" % (
                        where, self.cfg.start_timeout))
        return ("no mxps scheduler answered at %s within %.0f s (MXPS_START_TIMEOUT): the "
                "scheduler is not running, not reachable, or (if its process runs) the training "
                "script does not `import mxps` before `import mxnet` (otherwise the scheduler "
                "and server processes start MXNet's native roles instead)"
                % (where, self.cfg.start_timeout))

    def _start_tick(self, now):
        """During registration: heartbeat when due; a scheduler that answered before and has
        been silent for MXPS_HEARTBEAT_TIMEOUT is lost."""
        if now - self.last_sent >= self.cfg.heartbeat_interval:
            self.send(MsgType.HEARTBEAT)
        if self._heard_at_start and now - self.last_heard > self.cfg.heartbeat_timeout:
            raise PeerLostError(
                "lost the scheduler at %s:%d during start-up: it answered, then was silent for "
                "%.1f s (MXPS_HEARTBEAT_TIMEOUT=%s)" % (
                    self.cfg.root_uri, self.cfg.root_port, now - self.last_heard,
                    self.cfg.heartbeat_timeout))

    def _read_welcome(self):
        """Read what the scheduler sent; its WELCOME once it came (else None)."""
        while self.sock.poll(0):
            try:
                _, h, payload = transport.recv(self.sock)
                if h.type == MsgType.WELCOME:
                    self.welcome = parse_welcome(payload)
            except wire.WireError as e:
                self.drops("malformed", "%s: dropped a malformed message from the scheduler: "
                           "%s", self.name, e)
                continue
            self.last_heard = time.monotonic()
            self._heard_at_start = True
            if h.type == MsgType.WELCOME:
                self.rank = self.welcome["rank"]
                return self.welcome
            if h.type == MsgType.ABORT:
                raise PeerLostError(_text(payload, "the scheduler refused this node"))
        return None

    def _check_handshake(self):
        w = self._handshake
        if w.succeeded or not (w.refused or w.failures >= HANDSHAKE_FAILURES):
            return
        where = "%s:%d" % (self.cfg.root_uri, self.cfg.root_port)
        took = time.monotonic() - w.first_failure
        if self.settings.authenticated:
            raise CredentialsRefused(
                "the scheduler at %s did not accept this node's credentials (%s within %.1f s): "
                "MXPS_SECRET differs between the nodes of this job? Every node needs the same "
                "MXPS_SECRET or MXPS_SECRET_FILE (or the scheduler runs without a secret, or "
                "it is not an mxps scheduler)" % (where, _failed(w.failures), took))
        raise CredentialsRefused(
            "the scheduler at %s refused this node's connection (%s within %.1f s): it "
            "requires a job secret and this node has none. Set the job's MXPS_SECRET or "
            "MXPS_SECRET_FILE on every node" % (where, _failed(w.failures), took))

    def send(self, type_, body=None, **fields):
        transport.send(self.sock, Header(type_, sender=self.rank, **fields), body)
        self.last_sent = time.monotonic()

    def beat(self, now):
        """Heartbeat when due (also from inside long work of the node's loop, which is busy,
        not frozen; the scheduler's silence is judged by ``tick`` once the loop is back)."""
        if now - self.last_sent >= self.cfg.heartbeat_interval:
            self.send(MsgType.HEARTBEAT)

    def tick(self, now):
        """Heartbeat when due; fatal if the scheduler has been silent too long."""
        self.beat(now)
        if now - self.last_heard > self.cfg.heartbeat_timeout and not self.shutdown:
            fatal(self.name, "lost the scheduler at %s:%d (silent for %.1f s, "
                  "MXPS_HEARTBEAT_TIMEOUT=%s)" % (self.cfg.root_uri, self.cfg.root_port,
                                                  now - self.last_heard,
                                                  self.cfg.heartbeat_timeout))

    def handle(self, header, payload):
        """Process one scheduler message; returns its type for the owner to act on (None: it
        was malformed, dropped and counted)."""
        self.last_heard = time.monotonic()
        try:
            body = self._parse(header, payload)
        except wire.WireError as e:
            self.drops("malformed", "%s: dropped a malformed message from the scheduler: %s",
                       self.name, e)
            return None
        with self.changed:
            self._handle(header, payload, body)
            self.changed.notify_all()
        return header.type

    @staticmethod
    def _parse(header, payload):
        if header.type == MsgType.BANDWIDTH:
            return parse_bandwidth(payload)
        if header.type == MsgType.REPLAN:
            return parse_replan(payload)
        if header.type == MsgType.FAILOVER:
            return parse_failover(payload)
        return None

    def receive(self):
        """Read and handle every message waiting on the link (the owner's loop calls it when
        ``sock`` polls readable); a message that does not parse is dropped and counted."""
        while self.sock.poll(0):
            try:
                _, h, payload = transport.recv(self.sock)
            except wire.WireError as e:
                self.drops("malformed", "%s: dropped a malformed message from the scheduler: "
                           "%s", self.name, e)
                continue
            yield h, payload

    def wait_for(self, predicate, timeout=None):
        """Wait until ``predicate()`` (of this link's state) holds, or ``timeout`` seconds
        (None: no deadline of its own; a lost peer ends the process through ``fatal``).
        Returns the predicate's last value."""
        with self.changed:
            return self.changed.wait_for(predicate, timeout)

    def _handle(self, header, payload, body):
        if header.type == MsgType.ABORT:
            self.abort_message = _text(payload, "aborted")
            if not self.failing:
                fatal(self.name, self.abort_message)
        elif header.type == MsgType.SHUTDOWN:
            if fault_claimed(self.cfg, "shutdown", self.role, self.rank):
                log.warning("%s: MXPS_FAULT_POINT=shutdown: dropped the scheduler's SHUTDOWN, "
                            "as if it were lost", self.name)
                return
            self.shutdown = True
            # the scheduler ends once every node said BYE (a second SHUTDOWN, sent because a
            # heartbeat crossed the first, is answered again: the scheduler counts one)
            self.send(MsgType.BYE)
        elif header.type == MsgType.ACK and header.key == -2:   # barrier release
            self.barrier_done = max(self.barrier_done, header.iteration)
        elif header.type == MsgType.BANDWIDTH:
            self.bandwidth = body
        elif header.type == MsgType.REPLAN:
            self.replan = body
            self.replans += 1
        elif header.type == MsgType.FAILOVER:
            self.failovers.append(body)

    def fail(self, message, code=1):
        """Tell the scheduler this node failed (so the job ends now, with this message), then
        leave.  Call from the thread that owns the socket."""
        self.failing = True
        try:
            self.send(MsgType.ABORT, message.encode())
            time.sleep(0.3)    # let zmq's I/O thread put the ABORT on the wire
        finally:
            fatal(self.name, message, code)

    def close(self):
        self._handshake.close()
        self.sock.close(linger=500)


def poll_forever(poller, timeout_ms):
    try:
        return dict(poller.poll(timeout_ms))
    except zmq.ZMQError as e:
        if transport.is_interrupted(e):
            return {}
        raise


__all__ = ["SchedulerLink", "PeerLostError", "CredentialsRefused", "fatal", "EXIT_LOST_PEER",
           "poll_forever"]
