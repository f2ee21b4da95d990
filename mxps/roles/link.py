"""A node's link to the scheduler: registration, heartbeats, barriers, shutdown and abort.

Shared by workers and servers.  The owner polls ``sock`` in its own loop and hands scheduler
messages to ``handle``; ``tick`` sends heartbeats and detects a silent scheduler.  Nothing here
waits without a deadline: a lost scheduler or an ABORT ends the process with a message naming
the lost node (``fatal``), exit code ``EXIT_LOST_PEER``.
"""
import json
import logging
import os
import sys
import threading
import time

import zmq

from ..wire import tcp as transport
from ..wire.frame import Header, MsgType

log = logging.getLogger("mxps")

EXIT_LOST_PEER = 3


class PeerLostError(RuntimeError):
    """Another node of the job died or went silent; the message names it."""


def fatal(who, message, code=EXIT_LOST_PEER):
    """Report a job-ending error and leave at once (other threads may be blocked in MXNet)."""
    try:
        sys.stderr.write("mxps %s: fatal: %s\n" % (who, message))
        sys.stderr.flush()
        sys.stdout.flush()
    finally:
        os._exit(code)


class SchedulerLink:
    def __init__(self, cfg, role):
        self.cfg = cfg
        self.role = role
        self.sock = transport.connect_dealer(cfg.root_uri, cfg.root_port)
        self.rank = -1
        self.welcome = None
        self.last_heard = time.monotonic()
        self.last_sent = 0.0
        self.shutdown = False
        self.abort_message = None
        self.failing = False      # this node reported its own failure: the ABORT echo is ours
        self.bandwidth = None     # the server rates the scheduler agreed (MXPS_PLAN=adaptive)
        self.barrier_done = 0
        self.replan = None        # the scheduler's last answer at a re-plan point
        self.replans = 0          # how many answers so far
        # ``handle`` runs on the socket's owner thread (a worker's I/O thread); other threads
        # wait on this for what it changes (barrier releases, agreed rates, re-plan answers,
        # shutdown) instead of polling
        self.changed = threading.Condition()

    @property
    def name(self):
        return "%s %s" % (self.role, self.rank if self.rank >= 0 else "?")

    def register(self, host, port=0):
        """Announce this node and wait for the scheduler's WELCOME (rank, peers)."""
        body = json.dumps({"role": self.role, "host": host, "port": port,
                           "pid": os.getpid(), "mode": self.cfg.mode}).encode()
        transport.send(self.sock, Header(MsgType.REGISTER), body)
        deadline = time.monotonic() + self.cfg.start_timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000)):
                raise PeerLostError(
                    "no mxps scheduler answered at %s:%d within %.0f s (MXPS_START_TIMEOUT). Is the "
                    "scheduler running, and does the training script `import mxps` before "
                    "`import mxnet` (otherwise the scheduler and server processes start "
                    "MXNet's native roles instead)?"
                    % (self.cfg.root_uri, self.cfg.root_port, self.cfg.start_timeout))
            _, h, payload = transport.recv(self.sock)
            if h.type == MsgType.WELCOME:
                self.welcome = json.loads(payload.bytes)
                self.rank = self.welcome["rank"]
                self.last_heard = time.monotonic()
                return self.welcome
            if h.type == MsgType.ABORT:
                raise PeerLostError(payload.bytes.decode())

    def send(self, type_, body=None, **fields):
        transport.send(self.sock, Header(type_, sender=self.rank, **fields), body)
        self.last_sent = time.monotonic()

    def tick(self, now):
        """Heartbeat when due; fatal if the scheduler has been silent too long."""
        if now - self.last_sent >= self.cfg.heartbeat_interval:
            self.send(MsgType.HEARTBEAT)
        if now - self.last_heard > self.cfg.heartbeat_timeout and not self.shutdown:
            fatal(self.name, "lost the scheduler at %s:%d (silent for %.1f s, "
                  "MXPS_HEARTBEAT_TIMEOUT=%s)" % (self.cfg.root_uri, self.cfg.root_port,
                                                  now - self.last_heard,
                                                  self.cfg.heartbeat_timeout))

    def handle(self, header, payload):
        """Process one scheduler message; returns its type for the owner to act on."""
        self.last_heard = time.monotonic()
        with self.changed:
            self._handle(header, payload)
            self.changed.notify_all()
        return header.type

    def wait_for(self, predicate, timeout=None):
        """Wait until ``predicate()`` (of this link's state) holds, or ``timeout`` seconds
        (None: no deadline of its own; a lost peer ends the process through ``fatal``).
        Returns the predicate's last value."""
        with self.changed:
            return self.changed.wait_for(predicate, timeout)

    def _handle(self, header, payload):
        if header.type == MsgType.ABORT:
            self.abort_message = payload.bytes.decode() if payload is not None else "aborted"
            if not self.failing:
                fatal(self.name, self.abort_message)
        elif header.type == MsgType.SHUTDOWN:
            self.shutdown = True
        elif header.type == MsgType.ACK and header.key == -2:   # barrier release
            self.barrier_done = max(self.barrier_done, header.iteration)
        elif header.type == MsgType.BANDWIDTH:
            self.bandwidth = json.loads(payload.bytes)
        elif header.type == MsgType.REPLAN:
            self.replan = json.loads(payload.bytes)
            self.replans += 1

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
        self.sock.close(linger=500)


def poll_forever(poller, timeout_ms):
    try:
        return dict(poller.poll(timeout_ms))
    except zmq.ZMQError as e:
        if transport.is_interrupted(e):
            return {}
        raise


__all__ = ["SchedulerLink", "PeerLostError", "fatal", "EXIT_LOST_PEER", "poll_forever"]
