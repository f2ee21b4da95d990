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

from . import transport
from .control import EXIT_LOST_PEER, poll_forever
from .wire import Header, MsgType

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
                body = json.dumps({"rates": rates}).encode()
                for n in self.nodes.values():
                    if n.role == "worker":
                        self._send(n, MsgType.BANDWIDTH, body)
                self.rate_reports = {}
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
        return None

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
