"""LTP as a transport of the push-alone incast benchmark (``mxps_tools.incast --transport ltp``).

The same pieces as a training job's push, without the parameter server around them: the
worker's ``sender.Sender`` (packets, paced by ``rate.PathRate``, the END resent until ACKed),
the server's ``receiver.Receiver`` (address + tag check, selective ACKs, the path loss
estimate), ``rounds.LtpRound`` (accounting, filling) and ``close.decide`` (Early Close, with the
adaptive ratio and deadline the server uses).  The hello goes over a small TCP connection, as
LTP_HELLO goes over the job's TCP connection: the sender tells its UDP address and path MTU,
the receiver answers with its UDP port, the packet size and the sender's key.

A message is ``message_bytes / 4`` float32 elements, one slice of key 0; round k is its
iteration k.
"""
import json
import os
import select
import sys
import socket
import struct
import time

import numpy as np

from . import close
from ..kernels import ltp_packet as pk
from ..config import ltp_settings
from .receiver import Receiver
from .rounds import LtpRound
from .sender import Sender

_LEN = struct.Struct("<I")
FLOAT32 = 0
# the job's MXPS_LTP_* settings that the push alone follows too (grace, END copies, the
# grant's rules): ablations of the benchmark set them as a job would
_SETTINGS = ltp_settings(os.environ)


class IncastError(RuntimeError):
    pass


def _send_blob(sock, body):
    sock.sendall(_LEN.pack(len(body)) + body)


def _recv_blob(sock):
    head = b""
    while len(head) < _LEN.size:
        chunk = sock.recv(_LEN.size - len(head))
        if not chunk:
            raise IncastError("hello connection closed")
        head += chunk
    (n,) = _LEN.unpack(head)
    body = b""
    while len(body) < n:
        chunk = sock.recv(n - len(body))
        if not chunk:
            raise IncastError("hello connection closed")
        body += chunk
    return body


class _Head:
    """What ``Sender`` reads of a push's header."""

    def __init__(self, length, iteration):
        self.type = 11
        self.key = 0
        self.offset = 0
        self.length = length
        self.iteration = iteration
        self.plan_version = 0
        self.dtype = FLOAT32


class LtpSender:
    def __init__(self, spec, host):
        self.spec = spec
        deadline = time.monotonic() + 30
        while True:
            try:
                ctl = socket.create_connection((host, spec.port), timeout=30)
                break
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise IncastError("sender %d: the receiver at %s:%d does not listen"
                                      % (spec.sender, host, spec.port)) from None
                time.sleep(0.05)
        local = ctl.getsockname()[0]
        self.sender = Sender(spec.sender, local, quantum=_SETTINGS["ltp_quantum"],
                             end_copies=_SETTINGS["ltp_end_copies"],
                             end_rto=_SETTINGS["ltp_end_rto"])
        _send_blob(ctl, json.dumps({"sender": spec.sender, "hello": json.loads(
            self.sender.hello_body(host, spec.port))}).encode())
        # the reply is read at the first send: the receiver answers hellos only once the
        # benchmark's control connections are up (which the harness opens after this)
        self._ctl, self._host = ctl, host

    def _install(self):
        ctl, self._ctl = self._ctl, None
        ctl.settimeout(self.spec.round_timeout)
        reply = _recv_blob(ctl)
        ctl.close()
        spec = self.spec
        initial = spec.rate_mbit * 1e6 / 8 / spec.senders if spec.rate_mbit else None
        self.sender.add_path(0, self._host, reply, time.monotonic(), initial_rate=initial)

    def send(self, round_no, payload):
        if self._ctl is not None:
            self._install()
        n = len(payload) // 4
        done = []
        self.sender.enqueue(0, _Head(n, round_no), payload[:n * 4], 4, done.append)
        deadline = time.monotonic() + self.spec.round_timeout
        sock = self.sender.sock
        while True:
            now = time.monotonic()
            for push in self.sender.receive(now):
                done.append(push)
            if done and not self.sender.busy:
                return
            if now > deadline:
                raise IncastError("sender %d: round %d's END not acknowledged within %.0f s"
                                  % (self.spec.sender, round_no, self.spec.round_timeout))
            wake = self.sender.pump(now)
            timeout = 0.05 if wake is None else max(0.0, wake - time.monotonic())
            if timeout > 0:
                select.select([sock], [], [], timeout)

    def close(self):
        for path in self.sender.paths.values():
            sys.stderr.write("ltp sender %d: %s max_rate %.0f counts %s\n" % (
                self.spec.sender, json.dumps(path.rate.snapshot()), path.rate.max_rate,
                dict(self.sender.counts)))
        self.sender.close()


class LtpReceiver:
    def __init__(self, spec):
        self.spec = spec
        self.ctl = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.ctl.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.ctl.bind(("0.0.0.0", spec.port))
        self.ctl.listen(spec.senders + 8)
        self.receiver = None
        self.spans = close.Deadline()
        self.first_byte = None
        self.stats = {}
        self._round = None
        self._late = 0

    def accept(self, timeout):
        deadline = time.monotonic() + timeout
        known = set()
        while len(known) < self.spec.senders:
            self.ctl.settimeout(max(0.0, deadline - time.monotonic()))
            try:
                conn, _ = self.ctl.accept()
            except socket.timeout:
                raise IncastError("only senders %s of %d said hello within %.0f s"
                                  % (sorted(known), self.spec.senders, timeout)) from None
            conn.settimeout(10)
            body = json.loads(_recv_blob(conn))
            if self.receiver is None:
                host = conn.getsockname()[0]
                self.receiver = Receiver(host, self.spec.senders, self.spec.mtu,
                                         busy_windows=_SETTINGS["ltp_busy_windows"],
                                         owing=_SETTINGS["ltp_owing"],
                                         fair=_SETTINGS["ltp_fair"],
                                         probe_loss=_SETTINGS["ltp_probe_loss"],
                                         startup=_SETTINGS["ltp_startup"])
            _send_blob(conn, self.receiver.hello(int(body["sender"]),
                                                 json.dumps(body["hello"]).encode()))
            conn.close()
            known.add(int(body["sender"]))

    def _on_packet(self, f, payload, now):
        rnd = self._round
        if rnd is None or f.round != self._round_no:
            if f.type == pk.DATA:
                self._late += 1
            return
        if self.first_byte is None:
            self.first_byte = now
        if f.type == pk.DATA:
            rnd.add(f.worker, f.seq, f.count, payload, now)
        elif rnd.ends[f.worker] is None:
            rnd.end(f.worker, f.seq, now)
            self.receiver.share.settled(f.worker)

    def receive_round(self, round_no):
        n = self.spec.message_bytes // 4
        epp = pk.elements_per_packet(self.receiver.budget, 4)
        rnd = self._round = LtpRound(np.zeros(n, np.float32), epp, self.spec.senders, FLOAT32)
        self._round_no = round_no
        self.receiver.share.opened(range(rnd.workers))
        self.first_byte = None
        deadline = time.monotonic() + self.spec.round_timeout
        sock = self.receiver.sock
        reason = None
        try:
            while True:
                now = time.monotonic()
                self.receiver.receive(self._on_packet, now)
                loss = max(self.receiver.loss) if self.receiver.loss else 0.0
                ratio = close.acceptance_ratio(rnd.n, loss)
                reason, wake = close.decide(now, [rnd.n] * rnd.workers, rnd.received,
                                            rnd.heard, rnd.ends, ratio,
                                            close.grace_for(
                                                _SETTINGS["ltp_grace"],
                                                None if _SETTINGS["ltp_grace_always"]
                                                else self.receiver.reordered_at, now),
                                            self.spans.value())
                if reason is not None:
                    break
                if now > deadline:
                    raise IncastError("round %d: received %s of %d packets per sender within "
                                      "%.0f s" % (round_no, rnd.received, rnd.n,
                                                  self.spec.round_timeout))
                timeout = 0.05 if wake is None else max(0.0, min(0.05, wake - now))
                select.select([sock], [], [], timeout)
        finally:
            self._round = None
            for w in range(rnd.workers):
                if rnd.ends[w] is None:
                    self.receiver.share.settled(w)
        self.spans.closed(reason, None if rnd.last is None else rnd.last - max(rnd.heard))
        rnd.fill("zero")
        delivered = sum(rnd.received[w] for w in range(rnd.workers))
        got = int(delivered * epp * 4) if delivered < rnd.n * rnd.workers else \
            self.spec.message_bytes * self.spec.senders
        return min(got, self.spec.message_bytes * self.spec.senders), reason

    def close(self):
        if self.receiver is not None:
            # late ENDs of the last round still get their ACK (a sender waits for it)
            quiet = time.monotonic() + 0.5
            while time.monotonic() < quiet:
                if self.receiver.receive(lambda f, p, now: None, time.monotonic()):
                    quiet = time.monotonic() + 0.5
                else:
                    select.select([self.receiver.sock], [], [], 0.05)
            sys.stderr.write("ltp receiver: capacity %s grant %s counts %s drops %s\n" % (
                self.receiver.share.capacity, self.receiver.share.grant(time.monotonic()),
                self.receiver.counts, dict(self.receiver.drops.counts)))
        self.ctl.close()
        if self.receiver is not None:
            self.receiver.close()
