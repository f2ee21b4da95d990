"""The server process: sockets around ``server_state.ServerState``.

The protocol (rounds, the optimizer, pulls, moving slices in a re-plan) is the state machine in
``mxps.roles.server_state``; this loop binds the workers' socket, registers through the
scheduler link, polls, feeds every message to the state and sends what it returns: replies to
the connection a request came on, parts to peer servers (a DEALER per peer, opened at the first
migration), plan reports to the scheduler.  Heartbeats and the scheduler's other messages
(shutdown, abort) are the link's (``roles.link``).
"""
import dataclasses
import logging
import time

import zmq

from ..wire import frame as wire, tcp as transport
from ..wire.frame import MsgType
from . import link as control
from .link import SchedulerLink, poll_forever
from .server_state import Out, ServerState

log = logging.getLogger("mxps.server")

BATCH = 64      # requests handled before the scheduler link and peers get a look


class Server:
    def __init__(self, cfg):
        host = cfg.node_host or transport.local_address_towards(cfg.root_uri, cfg.root_port)
        self.sock, self.port = transport.bind_router(host, None)
        self.link = SchedulerLink(cfg, "server")
        welcome = self.link.register(host, self.port)
        self.cfg = dataclasses.replace(cfg, mode=welcome["mode"])   # the workers' choice
        self.rank = welcome["rank"]
        self.state = ServerState(self.rank, welcome["num_workers"], self.cfg.sync)
        self.peer_addrs = welcome["servers"]
        self.peers = {}            # server rank -> DEALER (opened at the first migration)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.link.sock, zmq.POLLIN)
        log.info("server %d listening on %s:%d", self.rank, host, self.port)

    def _send(self, outs):
        for out in outs:
            if out.to == Out.CLIENT:
                try:
                    transport.send(self.sock, out.header, out.payload, ident=out.dest)
                except transport.TransportError:
                    log.warning("worker connection %r is gone; reply %r dropped", out.dest,
                                out.header)
            elif out.to == Out.PEER:
                transport.send(self._peer(out.dest), out.header, out.payload)
            else:
                self.link.send(out.header.type, out.payload)

    def _peer(self, rank):
        sock = self.peers.get(rank)
        if sock is None:
            host, port = self.peer_addrs[rank]
            sock = self.peers[rank] = transport.connect_dealer(host, port)
            self.poller.register(sock, zmq.POLLIN)
        return sock

    def _serve_requests(self):
        for _ in range(BATCH):
            if not self.sock.poll(0):
                break
            try:
                ident, h, payload = transport.recv(self.sock, with_ident=True)
            except wire.WireError as e:
                log.warning("server %d: dropped a malformed message: %s", self.rank, e)
                continue
            self._send(self.state.on_request(ident, h, payload))

    def _serve_scheduler(self):
        while self.link.sock.poll(0):
            _, h, payload = transport.recv(self.link.sock)
            if h.type == MsgType.PLAN:
                self.link.last_heard = time.monotonic()
                self._send(self.state.on_scheduler(h, payload))
            else:
                self.link.handle(h, payload)

    def _serve_peer(self, rank, sock):
        while sock.poll(0):
            _, h, _ = transport.recv(sock)
            self._send(self.state.on_peer_reply(rank, h))

    def run(self):
        wait_ms = int(self.cfg.heartbeat_interval * 1000 / 2)
        while not self.link.shutdown:
            events = poll_forever(self.poller, wait_ms)
            if self.sock in events:
                self._serve_requests()
            if self.link.sock in events:
                self._serve_scheduler()
            for rank, sock in list(self.peers.items()):
                if sock in events:
                    self._serve_peer(rank, sock)
            self.link.tick(time.monotonic())
        for sock in self.peers.values():
            sock.close(linger=0)
        self.sock.close(linger=1000)
        self.link.close()
        return 0


def run(cfg):
    try:
        return Server(cfg).run()
    except control.PeerLostError as e:
        control.fatal("server", str(e))
