"""The scheduler process: the I/O loop around ``scheduler_state.SchedulerState``.

Listens on DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT, feeds every message and the passing of time to
the state machine (which holds the protocol: rendezvous and ranks, barriers, liveness, re-plan
points, clean shutdown; see its module), and does what it answers: sends its messages, writes
the job's facts to MXPS_JOB_INFO, and ends with its exit code (after an ABORT naming the lost
node, a short pause that lets zmq put it on the wire; a clean end waits for every node's BYE).

With a job secret only the job's nodes can connect, so only they can register (refused
connections are logged with their address by ``mxps.wire.auth``).  Nothing a connection sends
ends the scheduler: a malformed message, or one the state machine cannot parse, is dropped and
counted (``drops``, logged rate-limited).
"""
import json
import logging
import os
import tempfile
import time

import zmq

from ..wire import frame as wire, tcp as transport
from .link import poll_forever
from .scheduler_state import SchedulerState

log = logging.getLogger("mxps.scheduler")

# seconds to let zmq's I/O thread put an ABORT on the wire before the process ends (a clean
# end needs none: it comes once every node said BYE to its SHUTDOWN, or after
# MXPS_HEARTBEAT_TIMEOUT)
FLUSH_SECONDS_ABORT = 0.5


class JobInfoError(OSError):
    """MXPS_JOB_INFO names a file the scheduler cannot write."""


def write_job_info(path, facts):
    """Write ``facts`` as JSON to ``path`` atomically: a reader sees the old file or the new
    one, never a half-written one (a temporary file in the same directory, then os.replace)."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=".%s." % os.path.basename(path), dir=directory)
    except OSError as e:
        raise JobInfoError("cannot write the job's facts to %s (MXPS_JOB_INFO): %s"
                           % (path, e)) from None
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(facts, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:
        os.unlink(tmp)
        raise JobInfoError("cannot write the job's facts to %s (MXPS_JOB_INFO): %s"
                           % (path, e)) from None


class Scheduler:
    def __init__(self, cfg):
        self.cfg = cfg
        self.sock, _ = transport.bind_router(cfg.root_uri, cfg.root_port,
                                             transport.Settings.from_config(cfg),
                                             who="scheduler")
        self.state = SchedulerState(cfg, time.monotonic())
        self.drops = transport.Tally(log)

    def _do(self, step):
        """Carry out one answer of the state machine; the exit code when the job ended."""
        if step.facts is not None and self.cfg.job_info:
            try:
                write_job_info(self.cfg.job_info, step.facts)
            except JobInfoError as e:
                if step.exit is None:    # the start: end the job rather than run without them
                    return self._do(self.state.abort(str(e), time.monotonic()))
                log.error("%s", e)
        for s in step.sends:
            try:
                transport.send(self.sock, s.header, s.body, ident=s.ident)
            except transport.QueueFull as e:
                self.drops("full", "scheduler: %r dropped: %s", s.header, e)
            except transport.TransportError:
                pass    # that node is gone; the heartbeat check reports it
        if step.exit is None:
            return None
        if step.exit.code != 0:
            time.sleep(FLUSH_SECONDS_ABORT)
        return step.exit.code

    def _serve(self):
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        wait_ms = int(self.cfg.heartbeat_interval * 1000 / 2)
        code = None
        while True:
            if poll_forever(poller, wait_ms):
                while self.sock.poll(0):
                    step = self._receive()
                    if step is not None:
                        code = _first(code, self._do(step))
            code = _first(code, self._do(self.state.tick(time.monotonic())))
            # aborted in start-up, the job may still expect nodes: they are told why
            if code is not None and not self.state.expects_late(time.monotonic()):
                return code

    def _receive(self):
        """Read one message and feed it to the state machine; its answer, or None when the
        message was dropped (malformed, or a body the state machine could not parse)."""
        try:
            ident, h, payload = transport.recv(self.sock, with_ident=True)
        except wire.WireError as e:
            self.drops("malformed", "scheduler: dropped a malformed message: %s", e)
            return None
        body = None if payload is None else payload.bytes
        try:
            return self.state.on_message(ident, h, body, time.monotonic())
        except Exception as e:   # the state's parsing of bodies: the job goes on without it
            self.drops("body:" + type(e).__name__, "scheduler: dropped %r from connection %r: "
                       "%s: %s", h, ident, type(e).__name__, e)
            return None

    def run(self):
        try:
            return self._serve()
        finally:
            self.sock.close(linger=1000)


def _first(code, new):
    return new if code is None else code


def run(cfg):
    return Scheduler(cfg).run()
