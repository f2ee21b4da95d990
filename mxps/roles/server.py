"""The server process: sockets around ``server_state.ServerState``.

The protocol (rounds, the optimizer, pulls, moving slices in a re-plan) is the state machine in
``mxps.roles.server_state``; this loop binds the workers' socket, registers through the
scheduler link, polls, feeds every message to the state and sends what it returns: replies to
the connection a request came on, parts to peer servers (a DEALER per peer, opened at the first
migration), plan reports to the scheduler.  Heartbeats and the scheduler's other messages
(shutdown, abort) are the link's (``roles.link``).

Every connection is bound to a node: a worker's and a peer server's connections carry the zmq
identity ``worker:<rank>`` / ``server:<rank>`` (with a job secret only the job's nodes connect
at all).  ``authenticate`` derives the sender from that identity, overwrites the header's
``sender`` with it (so ``ServerState`` may trust ``header.sender`` as the connection's rank:
a push counts for the rank that sent it, never for the rank a header claims) and refuses the
message types that role does not send.  Nothing a peer sends stops the loop: a malformed
message or an unknown connection is dropped and counted (``drops``, logged rate-limited), a
reply to a peer that does not read (its queue at MXPS_HWM) is dropped and logged.
"""
import dataclasses
import logging
import os
import re
import time

import zmq

from ..placement import metrics, trace
from ..store.checkpoints import held as checkpoints_held
from ..wire import frame as wire, tcp as transport
from ..wire.frame import MsgType
from . import link as control
from .link import SchedulerLink, poll_forever
from .server_state import LtpSettings, Out, ServerState, StoreSettings, WspSettings

log = logging.getLogger("mxps.server")

BATCH = 64      # requests handled before the scheduler link and peers get a look

# what each kind of peer may ask of a server
ALLOWED = {
    "worker": frozenset((MsgType.INIT, MsgType.PUSH, MsgType.PULL, MsgType.PUSHPULL,
                         MsgType.SET_OPTIMIZER, MsgType.GET_STATES, MsgType.SET_STATES,
                         MsgType.PROBE, MsgType.LTP_HELLO, MsgType.LEAVE,
                         MsgType.PUSH_ROWS, MsgType.PULL_ROWS, MsgType.INIT_TABLE,
                         MsgType.SEED)),
    "server": frozenset((MsgType.MIGRATE, MsgType.REPLICA, MsgType.VALUE, MsgType.STATE)),
}
_IDENTITY = re.compile(rb"(worker|server):(0|[1-9][0-9]{0,8})\Z")


class Refused(Exception):
    """A message the server does not take from that connection; ``reply`` says whether the
    sender (a node of the job, wrong in what it asked) gets an ERROR with the message."""

    def __init__(self, message, reply):
        super().__init__(message)
        self.reply = reply


def identity(role, rank):
    """The zmq identity of a node's connections to servers."""
    return b"%s:%d" % (role.encode(), rank)


def authenticate(ident, header, num_workers, num_servers):
    """Bind a request to its connection: the sender's role and rank come from the connection's
    identity ``ident``, and ``header.sender`` is overwritten with that rank.  Returns the role;
    raises ``Refused`` for an identity that names no node of this job (dropped: the peer is
    not one of the job's nodes) or a message type that role does not send (answered)."""
    m = _IDENTITY.match(ident)
    size = {b"worker": num_workers, b"server": num_servers}
    if m is None or int(m.group(2)) >= size[m.group(1)]:
        raise Refused("a connection with identity %r is not a node of this job (worker:<rank> "
                      "or server:<rank>)" % (ident,), reply=False)
    role, rank = m.group(1).decode(), int(m.group(2))
    if header.type not in ALLOWED[role]:
        raise Refused("%s %d may not send %s to a server" % (
            role, rank, MsgType(header.type).name), reply=True)
    header.sender = rank
    return role


class Server:
    def __init__(self, cfg):
        host = cfg.node_host or transport.local_address_towards(cfg.root_uri, cfg.root_port)
        settings = transport.Settings.from_config(cfg)
        self.sock, self.port, nonce = transport.bind_data(
            host, settings, job={"worker": cfg.num_workers, "server": cfg.num_servers})
        self.link = SchedulerLink(cfg, "server", settings)
        # a resumed store: the checkpoints each server directory here can return to, so that
        # the scheduler picks the round every server can (docs/STORE.md)
        held = checkpoints_held(cfg.store_dir) if cfg.store_resume else None
        welcome = self.link.register(host, self.port, seal=nonce, checkpoints=held)
        self.cfg = dataclasses.replace(cfg, mode=welcome["mode"])   # the workers' choice
        self.rank = welcome["rank"]
        self.num_workers = welcome["num_workers"]
        self.num_servers = welcome["num_servers"]
        if isinstance(self.sock, transport.SealedSocket):
            self.sock.seal.members = frozenset(
                [identity("worker", r) for r in range(self.num_workers)]
                + [identity("server", r) for r in range(self.num_servers)])
        # MXPS_TRACE: the state records every push, round, pull and migration step; the
        # file is written at the clean shutdown (placement.trace)
        self.trace = trace.Recorder("server", self.rank) if cfg.trace else None
        # MXPS_PUSH=ltp (docs/LTP.md): a UDP socket for the workers' gradient packets (sync
        # mode only: an async push is applied on arrival, there is no round to close)
        self.ltp = None
        ltp = None
        if self.cfg.push == "ltp" and self.cfg.sync:
            from ..ltp.receiver import Receiver
            self.ltp = Receiver(host, self.num_workers, self.cfg.ltp_mtu,
                                busy_windows=self.cfg.ltp_busy_windows,
                                owing=self.cfg.ltp_owing, fair=self.cfg.ltp_fair,
                                probe_loss=self.cfg.ltp_probe_loss,
                                startup=self.cfg.ltp_startup)
            ltp = LtpSettings(self.ltp.budget, self.cfg.ltp_fill, self.cfg.ltp_ratio,
                              self.cfg.ltp_deadline, self.cfg.ltp_grace,
                              loss=lambda: self.ltp.loss,
                              reordered=(None if self.cfg.ltp_grace_always
                                         else lambda: self.ltp.reordered_at),
                              share=self.ltp.share, fast=self.cfg.ltp_fast)
            log.info("server %d: LTP on udp %s:%d, %d payload bytes per packet (MTU %d)",
                     self.rank, host, self.ltp.port, self.ltp.budget, self.ltp.mtu)
        wsp = None
        if self.cfg.mode == "wsp":      # docs/WSP.md
            wsp = WspSettings(self.cfg.wsp_k, self.cfg.wsp_staleness, time.monotonic,
                              self.cfg.replan_interval if self.cfg.replanning else 0)
        store = None
        if self.cfg.store == "disk":     # docs/STORE.md: one directory per server
            if (self.cfg.store_checkpoint_rounds or self.cfg.store_checkpoint_seconds) and \
                    self.cfg.mode != "sync":
                self.link.fail("MXPS_STORE_CHECKPOINT_ROUNDS/_SECONDS need sync mode (BSP), not %s: "
                               "there the rounds of different keys complete at different "
                               "times, so no round is a state of the whole model to return "
                               "to (the store is flushed at the clean stop only)"
                               % self.cfg.mode)
            directory = os.path.join(self.cfg.store_dir, "server%d" % self.rank)
            os.makedirs(directory, exist_ok=True)
            store = StoreSettings(directory, int(self.cfg.store_cache_mb * (1 << 20)),
                                  self.cfg.store_resume, every=self.cfg.store_checkpoint_rounds,
                                  resume_at=welcome.get("resume_round"))
        self.state = ServerState(self.rank, welcome["num_workers"], self.cfg.sync,
                                 num_servers=welcome["num_servers"], trace=self.trace, ltp=ltp,
                                 wsp=wsp, store=store, replica=self.cfg.replica,
                                 failover=self.cfg.failover or self.cfg.divert,
                                 progress=lambda: self.link.beat(time.monotonic()))
        self.peer_addrs = welcome["servers"]
        self.peer_seals = welcome["seals"]
        self.peers = {}            # server rank -> DEALER (opened at the first migration)
        self.drops = transport.Tally(log)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.link.sock, zmq.POLLIN)
        if self.ltp is not None:
            self.poller.register(self.ltp.sock, zmq.POLLIN)
        log.info("server %d listening on %s:%d", self.rank, host, self.port)

    def _send(self, outs):
        for out in outs:
            if out.to == Out.CLIENT:
                self._reply(out.dest, out.header, out.payload)
            elif out.to == Out.PEER:
                transport.send(self._peer(out.dest), out.header, out.payload)
            else:
                self.link.send(out.header.type, out.payload)

    def _reply(self, ident, header, payload):
        try:
            transport.send(self.sock, header, payload, ident=ident)
        except transport.QueueFull as e:
            self.drops("full:%r" % ident, "server %d: reply %r dropped: %s; a peer that "
                       "does not read its replies (or raise MXPS_HWM)", self.rank, header, e)
        except transport.TransportError:
            log.warning("server %d: connection %r is gone; reply %r dropped", self.rank, ident,
                        header)

    def _peer(self, rank):
        sock = self.peers.get(rank)
        if sock is None:
            host, port = self.peer_addrs[rank]
            sock = self.peers[rank] = transport.connect_data(
                host, port, self.link.settings, identity("server", self.rank),
                self.peer_seals[rank])
            self.poller.register(sock, zmq.POLLIN)
        return sock

    def _serve_requests(self):
        for _ in range(BATCH):
            if not self.sock.poll(0):
                break
            try:
                ident, h, payload = transport.recv(self.sock, with_ident=True)
                authenticate(ident, h, self.num_workers, self.num_servers)
            except wire.WireError as e:
                # a stranger's (the seal refuses it unopened) is logged per connection
                kind = ("refused:%r" % (e.ident,) if getattr(e, "why", None) == "stranger"
                        else "malformed")
                self.drops(kind, "server %d: dropped a malformed message: %s", self.rank, e)
                continue
            except Refused as e:
                if e.reply:
                    self._reply(ident, h.reply(MsgType.ERROR, dtype=wire.NO_DTYPE, length=0),
                                str(e).encode())
                self.drops("refused:%r" % ident, "server %d: refused a message: %s",
                           self.rank, e)
                continue
            self._fault(h)
            if h.type == MsgType.LTP_HELLO:
                self._ltp_hello(ident, h, payload)
                continue
            self._send(self.state.on_request(ident, h, payload))

    def _ltp_hello(self, ident, h, payload):
        """A worker's UDP address for LTP: register it, answer with this server's port, packet
        size and the worker's key (over this authenticated connection)."""
        try:
            if self.ltp is None:
                raise ValueError("server %d does not take LTP pushes (MXPS_PUSH=%s, mode %s): "
                                 "set MXPS_PUSH=ltp for every node of the job"
                                 % (self.rank, self.cfg.push, self.cfg.mode))
            body = self.ltp.hello(h.sender, payload.bytes if payload is not None else b"")
        except ValueError as e:
            self._reply(ident, h.reply(MsgType.ERROR, dtype=wire.NO_DTYPE, length=0),
                        str(e).encode())
            return
        self._reply(ident, h.reply(MsgType.DATA, dtype=wire.NO_DTYPE, length=0), body)

    def _serve_packets(self):
        now = time.monotonic()
        state = self.state
        take = state.take_packet
        for _ in range(BATCH):
            got = self.ltp.receive(take, now, state.ltp_fast, state.plan_version,
                                   state.fast_taken)
            self._send(self.state.outs())      # what the batch's packets closed
            if not got:
                break
            now = time.monotonic()

    def _fault(self, header):
        """Test-only pauses (MXPS_FAULT_POINT): inside a migration, inside GET_STATES."""
        if header.type == MsgType.MIGRATE:
            control.fault_point(self.cfg, "migrate", "server", self.rank)
        elif header.type == MsgType.GET_STATES:
            control.fault_point(self.cfg, "get_states", "server", self.rank)

    def _serve_scheduler(self):
        for h, payload in self.link.receive():
            if h.type == MsgType.PLAN:
                self.link.last_heard = time.monotonic()
                try:
                    outs = self.state.on_scheduler(h, payload)
                except (ValueError, KeyError, TypeError, AttributeError) as e:
                    self.drops("plan", "server %d: dropped a PLAN that does not parse: %s: %s",
                               self.rank, type(e).__name__, e)
                    continue
                self._send(outs)
            else:
                self.link.handle(h, payload)

    def _serve_peer(self, rank, sock):
        while sock.poll(0):
            try:
                _, h, payload = transport.recv(sock)
            except wire.WireError as e:
                self.drops("peer", "server %d: dropped a malformed message from server %d: %s",
                           self.rank, rank, e)
                continue
            self._send(self.state.on_peer_reply(rank, h, payload))

    def run(self):
        wait_ms = int(self.cfg.heartbeat_interval * 1000 / 2)
        while not self.link.shutdown:
            timeout = wait_ms
            wake = self.state.next_wake()
            if wake is not None:
                timeout = max(0, min(wait_ms, int((wake - time.monotonic()) * 1000) + 1))
            events = poll_forever(self.poller, timeout)
            if self.ltp is not None:
                if self.ltp.sock.fileno() in events:
                    self._serve_packets()
                self._send(self.state.on_tick(time.monotonic()))
            if self.sock in events:
                self._serve_requests()
            # after long work (a table made from its rule) the scheduler's messages of
            # meanwhile are read before its silence is judged
            if self.link.sock in events or self.link.sock.poll(0):
                self._serve_scheduler()
            for rank, sock in list(self.peers.items()):
                if sock in events:
                    self._serve_peer(rank, sock)
            self.link.tick(time.monotonic())
        for sock in self.peers.values():
            sock.close(linger=0)
        self.sock.close(linger=1000)
        self.link.close()
        self._write_trace()
        self._report_ltp()
        self._close_store()
        return 0

    def _close_store(self):
        """At a clean shutdown: the disk store flushed (a later job may resume from it) and
        its counters reported (log, and with MXPS_METRICS ``<metrics>.server<rank>.store.json``)."""
        if self.cfg.store != "disk":
            return
        self.state.flush_store()
        report = {"server": self.rank, "stats": self.state.store_stats(),
                  "cache_bytes": int(self.cfg.store_cache_mb * (1 << 20))}
        self._report("store", report)

    def _report_ltp(self):
        """At shutdown: how the LTP rounds went (docs/LTP.md), in the log and, with
        MXPS_METRICS, in ``<metrics>.server<rank>.ltp.json``."""
        if self.ltp is None:
            return
        report = {"server": self.rank, "stats": dict(self.state.ltp_stats),
                  "receiver": dict(self.ltp.counts), "drops": dict(self.ltp.drops.counts),
                  "loss_estimate": self.ltp.loss, "budget": self.ltp.budget,
                  "mtu": self.ltp.mtu, "capacity": self.ltp.share.capacity,
                  "starting": self.ltp.share.starting,     # the grant's startup not yet ended
                  "others": dict(self.ltp.share.others_seen)}
        self._report("ltp", report)
        self.ltp.close()

    def _report(self, what, report):
        """A shutdown report: in the log (INFO) and, with MXPS_METRICS, in
        ``<metrics>.server<rank>.<what>.json`` (``placement.metrics.write_report``)."""
        metrics.write_report(self.cfg.metrics, "server", self.rank, what, report, log)

    def _write_trace(self):
        if self.trace is not None:
            self.trace.save(self.cfg.trace, log)


def run(cfg):
    try:
        return Server(cfg).run()
    except control.PeerLostError as e:
        control.fatal("server", str(e))
