"""A worker's connection to the job: the scheduler link, one DEALER per server, one I/O thread.

Any thread (the training thread, MXNet engine threads) submits requests with ``submit``; the
I/O thread owns every socket, sends them, matches replies by request id and runs the request's
callback.  ``call`` is the blocking form for control requests, with a deadline.  Heartbeats, an
ABORT from the scheduler or a silent scheduler end the process with a message naming the lost
node (MXNet engine threads may be waiting on transfers that will never finish: there is nothing
to unwind to).
"""
import collections
import heapq
import itertools
import json
import logging
import os
import sys
import threading
import time

import zmq

from ..placement import metrics, trace
from ..wire import frame as wire, tcp as transport
from ..wire.frame import Header, MsgType
from . import link as control
from .link import SchedulerLink
from .push_gate import PushGate
from .reroute import Rerouting

log = logging.getLogger("mxps.worker")
# zmq's POLLOUT is an IntFlag: ``int & zmq.POLLOUT`` runs enum code, on every turn of the I/O
# loop (measured: 3% of an LTP worker's I/O thread)
_POLLOUT = int(zmq.POLLOUT)

# MXPS_TRACE: the kinds of a data request's events (placement.trace), by request type and stage
_QUEUED, _HELD, _RELEASED, _SENT, _ANSWERED = range(5)
_KINDS = {t: tuple("%s_%s" % (name, stage) for stage in
                   ("queued", "held", "released", "sent", "acked" if t == MsgType.PUSH
                    else "answered"))
          for t, name in ((MsgType.PUSH, "push"), (MsgType.PULL, "pull"),
                          (MsgType.PUSHPULL, "pushpull"))}


#: requests whose `iteration` is a round (an INIT's carries the key's row width): the traffic
#: of a round is theirs
_ROUND_TYPES = frozenset((MsgType.PUSH, MsgType.PULL, MsgType.PUSHPULL, MsgType.PUSH_ROWS,
                          MsgType.PULL_ROWS))


def _nbytes(payload):
    return memoryview(payload).nbytes if payload is not None else 0


#: requests answered by the values of the slice they name (a DATA reply must name it too)
_VALUE_REQUESTS = frozenset((MsgType.PULL, MsgType.PUSHPULL))


def _mismatch(request, h, payload):
    """Why ``h`` (with ``payload``) cannot be the answer to the value request ``request``, or
    None: an ACK never is (found by the reply fuzzer: an ACK carrying three floats completed a
    pull); a DATA reply must name the same key and elements, carry the request's dtype where the
    request names one, and hold exactly that many values.  Other replies are their
    callbacks' to judge."""
    if request.type not in _VALUE_REQUESTS:
        return None
    if h.type == MsgType.ACK:           # a value request is answered with values or refused
        return "an ACK answers no %s" % MsgType(request.type).name
    if h.type != MsgType.DATA:
        return None
    if (h.key, h.offset, h.length) != (request.key, request.offset, request.length):
        return ("it answers key %d elements [%d, %d), the request asked for key %d [%d, %d)"
                % (h.key, h.offset, h.offset + h.length, request.key, request.offset,
                   request.offset + request.length))
    if request.dtype != wire.NO_DTYPE and h.dtype != request.dtype:
        return "dtype code %d, the request's is %d" % (h.dtype, request.dtype)
    try:
        wire.payload_array(h, payload)
    except wire.WireError as e:
        return str(e)
    return None


class RemoteError(RuntimeError):
    """A server refused a request; the message is the server's, naming the key and cause."""


class _Call:
    __slots__ = ("event", "header", "payload")

    def __init__(self):
        self.event = threading.Event()
        self.header = None
        self.payload = None

    def __call__(self, header, payload):
        self.header = header
        self.payload = payload
        self.event.set()


class Client(Rerouting):
    def __init__(self, cfg):
        self.cfg = cfg
        self.link = SchedulerLink(cfg, "worker")
        host = cfg.node_host or transport.local_address_towards(cfg.root_uri, cfg.root_port)
        try:
            welcome = self.link.register(host)
        except control.PeerLostError:
            self.link.close()
            raise
        self.rank = welcome["rank"]
        self.num_workers = welcome["num_workers"]
        self.num_servers = welcome["num_servers"]
        # a job resumed from a disk store starts after this round (store.checkpoints)
        self.resume_round = welcome["resume_round"]
        # the connection's identity is this worker's rank: servers count a push for the rank
        # of the connection it came on, never for the rank a header claims
        identity = b"worker:%d" % self.rank
        self.servers = [transport.connect_data(h, p, self.link.settings, identity, nonce)
                        for (h, p), nonce in zip(welcome["servers"], welcome["seals"])]
        self.server_addrs = ["%s:%d" % (h, p) for h, p in welcome["servers"]]
        self._ids = itertools.count(1)
        self._pending = {}
        self._queue = collections.deque()
        # per server: messages waiting for room in the connection's queue (MXPS_HWM); the I/O
        # thread never blocks in a send, so it always reads the replies that make room
        self._outbox = [collections.deque() for _ in self.servers]
        self._landers = [self._lander(i) for i in range(len(self.servers))]
        self._poller = None
        self.drops = transport.Tally(log)
        self._held = [[] for _ in self.servers]     # per server: heap of prioritised pushes
        self._unacked = [0] * len(self.servers)     # per server: bytes of unacked pushes
        self._unacked_count = [0] * len(self.servers)   # ... and how many (two may always
        # be in flight, so a slice larger than the window never leaves the link idle while
        # its ACK comes back)
        self._seq = 0
        self._init_rerouting(cfg)
        # MXPS_PUSH_GATHER: the round's first pushes go in the same order on every worker
        self._gates = [PushGate(cfg.push_gather) for _ in self.servers]
        self._gate_wake = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._barrier_seq = 0
        self._stopped = threading.Event()
        # operations on MXNet's engine waiting for this client's replies (``begin_op``); a
        # failing worker completes them all (``abandon``) so that MXNet's shutdown, which
        # waits for every operation, can end the process
        self._ops_lock = threading.Lock()
        self._open_ops = set()
        self.abandoned = False
        self._sleeping = True
        self._finished = False
        self.at_finish = []       # callables run at a clean exit, once MXNet's engine is idle
        # MXPS_TRACE (placement.trace): every event of every data request, written at exit
        # (for timelines; off by default); the adapter adds its re-plan points to ``trace``
        self.trace = self._trace = self._paths_trace = None
        self._next_path_sample = 0.0
        if cfg.trace:
            self.trace = trace.Recorder("worker", self.rank)
            self._trace = self.trace.rows["requests"]
            self._paths_trace = self.trace.rows["paths"]
            self.at_finish.append(self._write_trace)
        # per round (the workers' push count): per server [bytes, first send, last reply],
        # for the bandwidth estimate (mxps.metrics); the I/O thread writes, others take rounds
        self.traffic = {}
        self.traffic_lock = threading.Lock()
        # MXPS_PUSH=ltp (docs/LTP.md): large gradient slices go as paced UDP packets; the
        # socket belongs to the I/O thread, the paths to the servers come from LTP_HELLO
        self.ltp = None
        self._ltp_wake = None
        self.io_stats = {"turns": 0, "timeouts": 0}
        if cfg.push == "ltp" and cfg.sync:
            from ..ltp.sender import Sender
            self.ltp = Sender(self.rank, host, cfg.ltp_drop, cfg.ltp_seed,
                              quantum=cfg.ltp_quantum, end_copies=cfg.ltp_end_copies,
                              end_rto=cfg.ltp_end_rto)
        self._thread = threading.Thread(target=self._io_loop, name="mxps-io", daemon=True)
        self._thread.start()
        if self.ltp is not None:
            self._ltp_hello(welcome["servers"])

    def _ltp_hello(self, servers):
        """Register this worker's UDP socket with every server and install the paths (on the
        I/O thread, which owns the sender)."""
        calls = []
        for s, (host, port) in enumerate(servers):
            c = _Call()

            def on_reply(h, payload, s=s, host=host, c=c):
                if h.type == MsgType.DATA:
                    self.ltp.add_path(s, host, payload.bytes, time.monotonic())
                c(h, payload)
            self.submit(s, Header(MsgType.LTP_HELLO), self.ltp.hello_body(host, port),
                        on_reply)
            calls.append((s, c))
        for s, c in calls:
            if not c.event.wait(self.cfg.timeout):
                raise TimeoutError("mxps worker %d: server %d (%s) did not answer LTP_HELLO "
                                   "within %.0f s (MXPS_TIMEOUT)"
                                   % (self.rank, s, self.server_addrs[s], self.cfg.timeout))
            if c.header.type == MsgType.ERROR:
                raise RemoteError(c.payload.bytes.decode())

    # -- submitting --------------------------------------------------------------------------
    def submit(self, server, header, payload, on_reply, priority=None):
        """Queue a request to ``server``; ``on_reply(header, payload)`` runs on the I/O thread.

        With a ``priority`` (a PUSH, whose ACK comes as soon as the server has it) the request
        waits in a per-server queue ordered by (-priority, key, offset) and goes out while
        less than MXPS_SEND_WINDOW bytes (or fewer than two pushes) of this worker's pushes to
        that server are unacked:
        every worker then sends the chunks in nearly the same order, so the server completes
        (and answers) chunk after chunk instead of all at the end, and a gradient that is
        ready late but needed first overtakes the queue.  Waiting only for the server's
        receipt, never for other workers, cannot deadlock.  At a round's start the queue
        waits up to MXPS_PUSH_GATHER for the pushes the previous round had first
        (``push_gate``); with MXPS_PUSH=ltp a push that goes by TCP skips the queue
        (MXPS_LTP_CRITICAL_FIRST).

        The queue is bounded by the model: MXNet runs one operation per key at a time (each
        holds its key's ``seq`` variable), an operation submits at most two requests per slice,
        and control requests wait for their answers; so it needs no bound of its own (and a
        blocking bound could stall the engine threads that submit)."""
        header.request_id = next(self._ids)
        header.sender = self.rank
        if self._trace is not None:      # before the I/O thread can see it
            self._record(_QUEUED, server, header, _nbytes(payload))
        self._queue.append((server, header, payload, on_reply, priority))
        self._wake()

    def _wake(self):
        # Only a sleeping I/O thread needs the (GIL-releasing) write: it sets _sleeping before
        # its last look at the queue, so an append it missed always sees _sleeping set.
        if self._sleeping:
            try:
                os.write(self._wake_w, b"x")
            except BlockingIOError:
                pass   # the pipe is full of wake-ups already

    def call(self, server, header, payload=None, what="request"):
        """Send and wait for the reply (deadline MXPS_TIMEOUT); raises RemoteError on ERROR."""
        c = _Call()
        self.submit(server, header, payload, c)
        if not c.event.wait(self.cfg.timeout):
            raise TimeoutError("mxps worker %d: %s to server %d (%s) got no reply within %.0f s "
                               "(MXPS_TIMEOUT)" % (self.rank, what, server,
                                                   self.server_addrs[server], self.cfg.timeout))
        if c.header.type == MsgType.ERROR:
            raise RemoteError(c.payload.bytes.decode())
        return c.header, c.payload

    def barrier(self):
        """Wait until every worker reached the same barrier."""
        self._barrier_seq += 1
        seq = self._barrier_seq
        self._queue.append((None, Header(MsgType.BARRIER, sender=self.rank), None, None, None))
        self._wake()
        # no deadline of our own: a dead peer is reported by the scheduler's heartbeat check
        self.link.wait_for(lambda: self.link.barrier_done >= seq)

    def probe(self, nbytes, servers, rounds=3, min_seconds=0.3, max_bytes=64 << 20):
        """Time echoes through each of ``servers`` (all at once), ``rounds`` times: the first
        warms TCP up, the best of the others counts (noise on a shared machine only ever slows
        a round down).  A round shorter than ``min_seconds`` is too short to time a link: the
        next one echoes twice as much (up to ``max_bytes``).  Returns {server: (bytes, s)}."""
        best = {}
        r = 0
        while r < rounds:
            payload = bytes(nbytes)
            done = {}
            events = {s: threading.Event() for s in servers}
            start = time.monotonic()
            for s in servers:
                def on_reply(h, p, s=s):
                    done[s] = time.monotonic()
                    events[s].set()
                self.submit(s, Header(MsgType.PROBE, length=0), payload, on_reply)
            for s, e in events.items():
                if not e.wait(self.cfg.timeout):
                    raise TimeoutError("mxps worker %d: bandwidth probe of server %d (%s) got no "
                                       "reply within %.0f s (MXPS_TIMEOUT)"
                                       % (self.rank, s, self.server_addrs[s], self.cfg.timeout))
            took = max(done.values()) - start
            if took < min_seconds and nbytes < max_bytes:
                nbytes = min(2 * nbytes, max_bytes)
                best = {}
                r = max(r, 1)        # a longer round follows; the warm-up is done
                continue
            if r:
                for s in servers:
                    rate = 2.0 * nbytes / max(done[s] - start, 1e-6)
                    if s not in best or rate > best[s][0] / best[s][1]:
                        best[s] = (2 * nbytes, done[s] - start)
            r += 1
        return best

    def agree_rates(self, nbytes):
        """Measure every server's rate as training loads it, and agree on them with the other
        workers: server by server, all workers echo ``nbytes`` through it at the same time (the
        incast of a synchronous step).  The scheduler takes each server's rate as all bytes
        echoed through it over the slowest worker's time (single flows share a link unevenly;
        the server's total does not), and gives every worker the same list."""
        if self.link.bandwidth is None:
            moved, seconds = [0] * self.num_servers, [0.0] * self.num_servers
            for s in range(self.num_servers):
                self.barrier()
                moved[s], seconds[s] = self.probe(nbytes, [s])[s]
            self._queue.append((None, Header(MsgType.BANDWIDTH, sender=self.rank),
                                json.dumps({"seconds": seconds, "bytes": moved}).encode(),
                                None, None))
            self._wake()
            if not self.link.wait_for(lambda: self.link.bandwidth is not None,
                                      self.cfg.timeout):
                raise TimeoutError("mxps worker %d: the scheduler did not agree server rates "
                                   "within %.0f s (MXPS_TIMEOUT)" % (self.rank, self.cfg.timeout))
        return self.link.bandwidth["rates"]

    def replan(self, report, wait=True):
        """At a re-plan point (nothing of this worker in flight): send the scheduler
        ``report`` (this worker's traffic since the last point, and from rank 0 the placement)
        and wait for its answer, which comes once every worker is here and, if the plan
        changes, every server has moved its state.  Like ``barrier``, no deadline of its own:
        a dead peer is reported by the scheduler's heartbeat check.  ``wait=False`` (a light
        point): return a ticket for ``replan_answer`` instead of waiting."""
        seen = self.link.replans
        self._queue.append((None, Header(MsgType.REPLAN, sender=self.rank),
                            json.dumps(report).encode(), None, None))
        self._wake()
        return self.replan_answer(seen) if wait else seen

    def replan_answer(self, ticket):
        """The scheduler's answer to the report ``replan`` gave ``ticket`` for (one report is
        outstanding at a time, so the answers come in order)."""
        self.link.wait_for(lambda: self.link.replans != ticket)
        return self.link.replan

    def finish(self):
        """Tell the scheduler this worker is done and wait for the job's shutdown."""
        if self._finished:
            return
        self._finished = True
        if self.cfg.mode == "wsp":
            # WSP rounds stop counting on this worker (docs/WSP.md): without this, the rounds
            # the others still push into would wait for it for ever
            for server in self.live_servers():
                self.call(server, Header(MsgType.LEAVE, sender=self.rank), what="leave")
        self._queue.append((None, Header(MsgType.FINISH, sender=self.rank), None, None, None))
        self._wake()
        if not self.link.wait_for(lambda: self.link.shutdown, self.cfg.timeout):
            sys.stderr.write("mxps worker %d: warning: the scheduler did not end the job within "
                             "%.0f s of this worker finishing (MXPS_TIMEOUT); other workers are "
                             "probably still training or stuck\n" % (self.rank, self.cfg.timeout))
        self._stopped.set()
        self._thread.join(5)

    def report_failure(self, message):
        """Tell the scheduler this worker failed, so the job ends now instead of timing out;
        the process then exits with its own status (an uncaught exception: 1)."""
        if self._finished:
            return
        self._finished = True
        self.link.failing = True
        self._queue.append((None, Header(MsgType.ABORT, sender=self.rank), message.encode(),
                            None, None))
        self._wake()
        time.sleep(0.3)
        self._stopped.set()

    def begin_op(self, op):
        """Register an engine operation that waits for replies; False (not registered) once
        the client was abandoned: the operation must then complete without sending."""
        with self._ops_lock:
            if self.abandoned:
                return False
            self._open_ops.add(op)
            return True

    def end_op(self, op):
        with self._ops_lock:
            self._open_ops.discard(op)

    def abandon(self):
        """The script failed: stop the I/O thread and complete every engine operation still
        waiting for replies (their outputs are left as they are), and every later one at once,
        so that the process can end with the script's exception instead of MXNet waiting at
        exit for replies that will never come."""
        self._stopped.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(5)
        with self._ops_lock:
            self.abandoned = True
            ops, self._open_ops = list(self._open_ops), set()
        for op in ops:
            op.finish()

    def _uncount(self, iteration, server, nbytes):
        """Take back a reply's bytes counted before its callback refused it."""
        with self.traffic_lock:
            per = self.traffic.get(iteration)
            if per is not None:
                t = per[server]
                t[0] -= nbytes
                if nbytes and t[3]:
                    t[3].pop()

    def _count(self, iteration, server, nbytes, now):
        with self.traffic_lock:
            per = self.traffic.get(iteration)
            if per is None:
                per = self.traffic[iteration] = [[0, None, None, []] for _ in self.servers]
            t = per[server]
            t[0] += nbytes
            if t[1] is None:
                t[1] = now
            t[2] = now
            if nbytes:
                t[3].append((now, t[0]))      # the cumulative bytes over the round, for
                #                               the rate of its second half (tail_of)

    def take_traffic(self, before):
        """Remove and return {round: per-server [bytes, first, last, [(time, cumulative
        bytes), ...]]} for rounds < before."""
        with self.traffic_lock:
            done = {r: v for r, v in self.traffic.items() if r < before}
            for r in done:
                del self.traffic[r]
        return done

    def _record(self, stage, server, h, nbytes):
        """One trace row of data request ``h`` (to or from ``server``) at ``stage``."""
        kinds = _KINDS.get(h.type)
        if kinds is not None:
            self._trace.append((kinds[stage], trace.clock(), h.iteration, server, h.key,
                                h.offset, h.length, nbytes, h.plan_version, h.request_id))

    def _write_trace(self):
        self.trace.save(self.cfg.trace, log)

    _FLOATS = {wire.dtype_code(t): wire.dtype_of(wire.dtype_code(t)).itemsize
               for t in ("float32", "float64", "float16")}

    def _ltp_takes(self, server, h, payload):
        """Whether LTP takes this push: a dense, uncompressed float slice of
        MXPS_LTP_MIN_BYTES or more to a server with a path.  A row-sparse push (PUSH_ROWS: ids
        and rows, not the slice's elements), a compressed one (16-32x smaller) and one marked
        for a checkpoint (its header's flag must reach the server) go by TCP."""
        return h.type == MsgType.PUSH and not h.flags and self.ltp.takes(
            server, h, payload, self.cfg.ltp_min_bytes, self._FLOATS.get(h.dtype))

    def _ltp_push(self, server, h, payload, on_reply, held):
        """Hand a released push to LTP if it takes it (``_ltp_takes``); its END's ACK
        completes it (``_ltp_done``)."""
        if not self._ltp_takes(server, h, payload):
            return False
        itemsize = self._FLOATS.get(h.dtype)
        self.ltp.enqueue(server, h, payload, itemsize, (on_reply, held, server))
        if self._trace is not None:
            self._record(_SENT, server, h, _nbytes(payload))
        if h.iteration > 0 and h.type in _ROUND_TYPES:
            # the span starts now; the bytes count as the server acknowledges them
            # (``_ltp_delivered``), so the placement measures what the path delivers, not
            # what was queued (a push's loss-tolerant end does not count unsent bytes)
            self._count(h.iteration, server, 0, time.monotonic())
        return True

    def _ltp_delivered(self, now):
        for server, iteration, nbytes in self.ltp.take_delivered():
            if iteration > 0:
                self._count(iteration, server, nbytes, now)

    def _ltp_done(self, push, now):
        on_reply, held, server = push.on_done
        h = push.h
        if self._trace is not None:
            self._record(_ANSWERED, server, h, 0)
        if held:
            self._unacked[server] -= held
            self._unacked_count[server] -= 1
        if h.iteration > 0 and h.type in _ROUND_TYPES:
            self._count(h.iteration, server, 0, now)
        on_reply(h.reply(MsgType.ACK, dtype=wire.NO_DTYPE, length=0), None)

    def _check_overdue(self, now):
        if self.ltp is not None:
            worst = self.ltp.oldest_end()
            if worst is not None and now - worst[0] > self.cfg.timeout:
                self.link.fail("server %d (%s) did not acknowledge LTP push %r within %.0f s "
                               "(MXPS_TIMEOUT)" % (worst[1], self.server_addrs[worst[1]],
                                                   worst[2].h, self.cfg.timeout))
        # the oldest outstanding request is the first one in insertion order
        for _, sent, server, h, _, _ in self._pending.values():
            if now - sent > self.cfg.timeout:
                self.link.fail("server %d (%s) did not answer %r within %.0f s (MXPS_TIMEOUT); "
                               "a worker may have stopped pushing this key"
                               % (server, self.server_addrs[server], h, self.cfg.timeout))
            break

    # -- the I/O thread ----------------------------------------------------------------------
    def _io_loop(self):
        try:
            self._io_loop_inner()
        except Exception as e:   # a bug in mxps: fail the job loudly rather than hang it
            log.exception("mxps I/O thread failed")
            self.link.fail("I/O thread failed: %r" % (e,))

    def _io_loop_inner(self):
        poller = self._poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(self.link.sock, zmq.POLLIN)
        index = {}
        for i, s in enumerate(self.servers):
            poller.register(s, zmq.POLLIN)
            index[s] = i
        wait_ms = int(self.cfg.heartbeat_interval * 1000 / 2)
        ltp = self.ltp
        if ltp is not None:
            poller.register(ltp.sock, zmq.POLLIN)
            ltp_fd = ltp.sock.fileno()
        # what the thread costs (the LTP report): its turns, those a poll timeout ended with
        # nothing to read, and its CPU time
        io = self.io_stats
        cpu0, wall0 = time.thread_time(), time.monotonic()
        while not self._stopped.is_set():
            io["turns"] += 1
            self._sleeping = True
            timeout = 0 if self._queue else wait_ms
            if self._gate_wake is not None and timeout:
                ahead = self._gate_wake - time.monotonic()
                timeout = 0 if ahead <= 0 else max(1, min(timeout, int(ahead * 1000) + 1))
            if self._ltp_wake is not None and timeout:
                # whole milliseconds, rounded up: a packet due in 0.4 ms waits 1 ms (pacing
                # credit catches up) instead of the thread spinning on a zero timeout
                # (measured: 14% of a core per worker, on a machine it shares with 8 of them)
                ahead = self._ltp_wake - time.monotonic()
                timeout = 0 if ahead <= 0 else max(1, min(timeout, int(ahead * 1000) + 1))
            events = control.poll_forever(poller, timeout)
            self._sleeping = False
            if not events:
                io["timeouts"] += 1
            if self._wake_r in events:
                os.read(self._wake_r, 65536)
            for sock, i in index.items():
                if events.get(sock, 0) & _POLLOUT:
                    self._flush_outbox(i)
            while self._queue:
                server, h, payload, on_reply, priority = self._queue.popleft()
                if server is None:
                    self.link.send(h.type, payload)
                    continue
                if self.lost or self.diverted:
                    server = self._rerouted(server, h)
                if priority is not None and ltp is not None and self.cfg.ltp_critical_first \
                        and not self._ltp_takes(server, h, payload):
                    # MXPS_PUSH=ltp: a push that goes by TCP (a small slice, critical) skips
                    # the queue.  Sent first, its TCP retransmission timeout (200 ms and
                    # more) passes while LTP moves the bulk; sent last, in priority order,
                    # it was the round's end (docs/LTP.md)
                    if self._trace is not None:
                        self._record(_HELD, server, h, _nbytes(payload))
                        self._record(_RELEASED, server, h, _nbytes(payload))
                    self._send(server, h, payload, on_reply, 0)
                    continue
                if priority is not None:
                    self._seq += 1
                    self._gates[server].arrived(h.iteration, time.monotonic())
                    heapq.heappush(self._held[server], (-priority, h.key, h.offset, self._seq,
                                                        h, payload, on_reply))
                    if self._trace is not None:
                        self._record(_HELD, server, h, _nbytes(payload))
                    continue
                self._send(server, h, payload, on_reply, 0)
            for sock, i in index.items():
                if sock in events:
                    self._read_replies(i, sock)
            # after the replies: an ACK that opened a window sends the next held push now
            # (MXPS_PUSH_GATHER: at a round's start, only in the order of the previous round)
            self._gate_wake = None
            now = time.monotonic()
            for server, held in enumerate(self._held):
                gate = self._gates[server]
                while held and (self._unacked[server] < self.cfg.send_window
                                or self._unacked_count[server] < 2):
                    rank, rnd = held[0][:3], held[0][4].iteration
                    wait = gate.wait(rank, rnd, now)
                    if wait > 0:
                        if self._gate_wake is None or now + wait < self._gate_wake:
                            self._gate_wake = now + wait
                        break
                    gate.sent(rank, rnd)
                    _, _, _, _, h, payload, on_reply = heapq.heappop(held)
                    n = memoryview(payload).nbytes
                    self._unacked[server] += n
                    self._unacked_count[server] += 1
                    if self._trace is not None:
                        self._record(_RELEASED, server, h, n)
                    if ltp is not None and self._ltp_push(server, h, payload, on_reply, n):
                        continue
                    self._send(server, h, payload, on_reply, n)
                    if self._force_slow and h.iteration >= self._force_slow[0]:
                        self._report_slow(self._force_slow[1], h.iteration, 0.0, True)
                        self._force_slow = ()
            if self._watch is not None:
                self._watch_slow(now)
            if ltp is not None:
                now = time.monotonic()
                if ltp_fd in events:
                    done = ltp.receive(now)
                    self._ltp_delivered(now)
                    for push in done:
                        self._ltp_done(push, now)
                self._ltp_wake = ltp.pump(time.monotonic())
                if self._paths_trace is not None and now >= self._next_path_sample:
                    self._next_path_sample = now + trace.PATH_SAMPLE
                    self._paths_trace.extend(ltp.path_rows("ltp_path", trace.clock()))
            if self.link.sock in events:
                for h, p in self.link.receive():
                    self.link.handle(h, p)
                if self.link.failovers:
                    self._take_failovers()
            now = time.monotonic()
            if not self._finished or not self.link.shutdown:
                self.link.tick(now)
            self._check_overdue(now)
        io["cpu_s"] = time.thread_time() - cpu0
        io["wall_s"] = time.monotonic() - wall0
        if ltp is not None:
            self._report_ltp()
        for s in self.servers:
            s.close(linger=500)
        self.link.close()

    def _report_ltp(self):
        """At the end of the I/O thread with MXPS_PUSH=ltp: what this worker's sender did
        (``ltp.sender.Sender.report``) and what the thread cost (``io_stats``: loop turns,
        turns a poll timeout ended with nothing to read, CPU and wall seconds), in the log and,
        with MXPS_METRICS, in ``<metrics>.worker<rank>.ltp.json`` (as the servers'
        ``.server<rank>.ltp.json``)."""
        report = {"worker": self.rank, "io": dict(self.io_stats)}
        report.update(self.ltp.report())
        metrics.write_report(self.cfg.metrics, "worker", self.rank, "ltp", report, log)

    _REPLY_TYPES = frozenset((MsgType.ACK, MsgType.DATA, MsgType.ERROR))

    def _lander(self, i):
        """``transport.recv``'s ``land`` for server ``i``'s replies: a DATA reply that answers a
        pending value request exactly (``_mismatch``'s rules but the payload's) lands in the
        buffer its callback names (``on_reply.land(header)``: the pulled slice of the
        NDArray), so a pulled slice is deciphered or copied once, into its place.  Before
        the callback runs nothing reads that buffer (the engine operation holds the array),
        and a reply that is then dropped leaves the request pending."""
        pending = self._pending

        def land(h, nbytes):
            entry = pending.get(h.request_id)
            if entry is None or entry[2] != i or h.type != MsgType.DATA:
                return None
            request = entry[3]
            fn = getattr(entry[0], "land", None)
            if (fn is None or request.type not in _VALUE_REQUESTS
                    or (h.key, h.offset, h.length) != (request.key, request.offset,
                                                       request.length)
                    or (request.dtype != wire.NO_DTYPE and h.dtype != request.dtype)):
                return None
            return fn(h)
        return land

    def _read_replies(self, i, sock):
        """Match server ``i``'s replies to their requests and run the requests' callbacks.
        Anything else (a malformed message, a reply to no request of this worker or from
        another server, a reply its callback cannot use) is dropped and counted; the request
        stays pending, so a server that never answers it properly is still reported when
        MXPS_TIMEOUT runs out."""
        land = self._landers[i]
        while sock.poll(0):
            try:
                _, h, payload = transport.recv(sock, land=land)
            except wire.WireError as e:
                self.drops("malformed", "worker %d: dropped a malformed message from server %d "
                           "(%s): %s", self.rank, i, self.server_addrs[i], e)
                continue
            entry = self._pending.pop(h.request_id, None)
            if entry is None or entry[2] != i or h.type not in self._REPLY_TYPES:
                if entry is not None:
                    self._pending[h.request_id] = entry
                if self.diverted and self.moved_reply(i, h):
                    continue
                self.drops("unexpected", "worker %d: dropped %r from server %d (%s): not a reply "
                           "to a request of this worker to that server", self.rank, h, i,
                           self.server_addrs[i])
                continue
            why = _mismatch(entry[3], h, payload)
            if why is not None:
                self._pending[h.request_id] = entry
                self.drops("mismatch", "worker %d: dropped server %d's (%s) reply %r to %r: %s",
                           self.rank, i, self.server_addrs[i], h, entry[3], why)
                continue
            received = time.monotonic()
            if self._trace is not None:
                # before the callback, which may complete the last operation (and so let
                # the training thread exit and write the trace)
                self._record(_ANSWERED, i, entry[3], len(payload) if payload is not None else 0)
            # counted before the callback, which may complete the last operation (and so let
            # the training thread finish and write the last round's metrics)
            counted = h.iteration > 0 and entry[3].type in _ROUND_TYPES
            if counted:
                n = len(payload) if payload is not None else 0
                self._count(h.iteration, i, n, received)
            try:
                entry[0](h, payload)
            except Exception as e:
                self._pending[h.request_id] = entry
                if counted:
                    self._uncount(h.iteration, i, n)
                if self._trace is not None:
                    self._trace.append(("reply_unusable", trace.clock(), h.iteration, i, h.key,
                                        h.offset, h.length, 0, h.plan_version, h.request_id))
                self.drops("unusable", "worker %d: dropped server %d's reply %r to %r: %s: %s",
                           self.rank, i, h, entry[3], type(e).__name__, e)
                continue
            if entry[4]:
                self._unacked[i] -= entry[4]
                self._unacked_count[i] -= 1
                if self._watch is not None:
                    self._watch.acked(i, entry[3].iteration, entry[4], received,
                                      bool(self._held[i]))
            if self.failover:
                self._remember(i, entry[3], h, entry[0], entry[5])

    def _send(self, server, h, payload, on_reply, held_bytes):
        if on_reply is not None:
            self._pending[h.request_id] = (on_reply, time.monotonic(), server, h, held_bytes,
                                           payload)
        box = self._outbox[server]
        if box or not self._transmit(server, h, payload):
            if not box:   # the queue just filled: wake when it has room again
                self._poller.modify(self.servers[server], zmq.POLLIN | zmq.POLLOUT)
            box.append((h, payload))

    def _flush_outbox(self, server):
        box = self._outbox[server]
        while box and self._transmit(server, *box[0]):
            box.popleft()
        if not box:
            self._poller.modify(self.servers[server], zmq.POLLIN)

    def _transmit(self, server, h, payload):
        """Hand one message to server's connection; False (nothing sent) if its queue is full."""
        try:
            transport.send(self.servers[server], h, payload, block=False)
        except transport.QueueFull:
            return False
        if self._trace is not None:
            self._record(_SENT, server, h, _nbytes(payload))
        if h.iteration > 0 and h.type in _ROUND_TYPES:
            self._count(h.iteration, server, _nbytes(payload), time.monotonic())
        return True
