#!/usr/bin/env python3
"""Does a concurrent TCP flow keep a fair share next to LTP? Measured.

    flock /tmp/mxps-bench.lock python scripts/ltp_fairness.py --out ltp_fairness.json

(about 12.5 minutes for the default grid of 32 points; results and discussion:
docs/bench/LTP_FAIRNESS.md.)

On the emulated network (``mxps_tools.emunet``: every link 400 Mbit/s, offloads off so the switch
queue and the loss act per packet) one receiver node ``r0``, N LTP senders ``s0..`` and one TCP
node ``t0`` all send to ``r0``: the bottleneck is the switch port towards ``r0`` (its queue
``--queues`` ms at the link rate; ``--losses`` percent of the packets towards ``r0`` dropped at
random, TCP's and LTP's alike).

- **LTP**: ``LtpSender``/``LtpReceiver`` of ``mxps/ltp/incast.py`` (the worker's sender with its
  BBR-style ``PathRate``, the server's receiver with its ``Share`` grant, Early Close), each in
  its own process; rounds of ``--message`` (4 MB) per sender, back to back: ``r0`` sends
  ``go k`` on a small control connection to every sender and the next round starts when round
  k closed, as in ``mxps_tools.incast``.
- **TCP**: one bulk flow from ``t0`` to a plain socket sink on ``r0`` (a non-blocking send loop
  of 1 MB writes, no application pacing), with the namespace's default congestion control
  (this machine's: ``bbr``) or ``cubic`` set on the socket (``TCP_CONGESTION``; root may use
  any loaded algorithm).

A point runs three phases back to back (``--order ltp-first``, the default): LTP alone
(``--alone`` s), then TCP joins and both run (``--both`` s), then LTP stops and TCP runs alone
(``--after`` s); ``--order tcp-first`` swaps the roles (TCP alone, LTP joins, TCP leaves).
Reported per phase, over a window that leaves out the phase's first ``SETTLE`` seconds: the
goodput (payload bytes delivered per second: TCP bytes read by the sink; LTP gradient bytes of
DATA packets accepted into their round, each counted once) of TCP and of every LTP sender; each
flow's fraction of the link, ``x = goodput / G`` with ``G`` the whole link's goodput for that
transport's frames (``rate * payload / (payload + headers + 14)``), so that header sizes do not
count as unfairness; each side's ratio to an equal per-flow share (the TCP flow is one flow
among N+1: ``x_tcp * (N+1)`` and ``x_ltp_total * (N+1) / N``; 1.0 is fair); Jain's index over the
N+1 flows' ``x``; LTP's delivered fraction (mean over the rounds that ended in the window) and
close reasons; TCP's RTT (median of ``TCP_INFO`` samples every 50 ms); the LTP senders'
grant and the receiver's measured capacity (medians of samples); and what the network did
(packets dropped by the switch queue and by the loss rule, TCP retransmissions and timeouts,
UDP datagrams ``r0``'s socket buffer dropped, from the namespaces' counters per phase).

Processes: one *agent* per role stays up for a whole topology (one topology per MTU) and is
told what to do over its stdin (JSON lines; it answers on stdout): importing the LTP runtime
imports MXNet (about 3 s, more on a busy machine), which would otherwise cost every point.
``r0`` holds two agents (the LTP receiver, the TCP sink), every other node one.  The driver
sets the queue and the loss between points, while nothing is sent.  Every process and
namespace is removed on exit, failure, Ctrl-C and SIGTERM (``emunet.Topology`` stops them by
PID).  All agents take their timestamps on CLOCK_MONOTONIC, which every namespace shares.
Needs root, ``ip``, ``tc``, ``ethtool``, ``nft`` (``scripts/test-deps.sh``).
"""
import argparse
import dataclasses
import json
import os
import queue
import resource
import select
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

RATE_MBIT = 400.0
MESSAGE_BYTES = 4 << 20
MTUS = (9000, 1500)
QUEUES_MS = (2.0, 50.0)
LOSSES = (0.0, 1.0)
SENDERS = (1, 4)
#: TCP congestion controls: "default" is the namespace's (copied from the machine's).
CCS = ("default", "cubic")
#: Seconds left out at the start of each phase's window: the first flow's start (slow start,
#: BBR's first round trips), the newcomer's convergence (the LTP grant is a median over the
#: last second), the leaver's last round draining.
SETTLE = {"alone": 1.0, "both": 3.0, "after": 0.75}
PREFIX = "mxfair-"
PORT_BASE = 6100              # a point uses PORT_BASE + 4 i .. + 2 (LTP hello, control, TCP)
CONNECT_TIMEOUT = 20.0
AGENT_UP_TIMEOUT = 180.0      # the LTP agents import MXNet; 6 of them at once on a busy machine
ROUND_TIMEOUT = 30.0
SAMPLE_S = 0.05
START_MARGIN = 0.5            # between the last agent's "ready" and the first phase
CONTROL = struct.Struct("!cQ")    # go / end and the round (as mxps_tools.incast)
HELLO = struct.Struct("!I")
ETH = 14
TCP_HEADERS = 52              # IPv4 20 + TCP 20 + timestamps 12
#: struct tcp_info up to tcpi_delivery_rate (linux/tcp.h): 8 u8, 24 u32, 4 u64, 6 u32, 1 u64.
TCP_INFO = struct.Struct("<8B24I4Q6IQ")


class FairnessError(RuntimeError):
    """The measurement could not run (names the node, agent, point or setting)."""


# --------------------------------------------------------------------------- pure parts


@dataclasses.dataclass(frozen=True)
class Point:
    mtu: int
    queue_ms: float
    loss: float
    senders: int
    cc: str
    order: str = "ltp-first"

    def label(self):
        return "mtu%d-q%g-l%g-n%d-%s-%s" % (self.mtu, self.queue_ms, self.loss, self.senders,
                                             self.cc, self.order)


def schedule(order, alone, both, after):
    """Start and stop of each flow (seconds after the point's epoch): the first one alone,
    then both, then the second one alone after the first left."""
    first, second = (0.0, alone + both), (alone, alone + both + after)
    if order == "ltp-first":
        return {"ltp": first, "tcp": second}
    if order == "tcp-first":
        return {"tcp": first, "ltp": second}
    raise FairnessError("--order must be ltp-first or tcp-first, got %r" % order)


def jain(xs):
    """Jain's fairness index of the allocations ``xs``: 1 when equal, 1/n when one takes all."""
    xs = [float(x) for x in xs]
    sq = sum(x * x for x in xs)
    return (sum(xs) ** 2) / (len(xs) * sq) if sq > 0 else None


def cumulative_at(timeline, t):
    """Bytes delivered by time ``t`` from samples ``[(time, cumulative bytes), ...]`` (sorted),
    linear between samples, flat outside them."""
    if not timeline or t <= timeline[0][0]:
        return timeline[0][1] if timeline else 0.0
    for (t0, b0), (t1, b1) in zip(timeline, timeline[1:]):
        if t <= t1:
            return b0 + (b1 - b0) * (t - t0) / (t1 - t0) if t1 > t0 else b1
    return timeline[-1][1]


def rate_between(timeline, t0, t1):
    """Mean bytes/s delivered over [t0, t1]."""
    if t1 <= t0:
        raise FairnessError("empty measurement window [%g, %g]" % (t0, t1))
    return (cumulative_at(timeline, t1) - cumulative_at(timeline, t0)) / (t1 - t0)


def link_goodput(rate_mbit, payload, headers):
    """Payload bytes/s of a link of ``rate_mbit`` carrying frames of ``payload`` bytes behind
    ``headers`` bytes of IP and transport headers (tbf counts the 14-byte Ethernet header)."""
    return rate_mbit * 1e6 / 8 * payload / (payload + headers + ETH)


def median(xs):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def in_window(samples, t0, t1):
    return [s for s in samples if t0 <= s[0] <= t1]


# --------------------------------------------------------------------------- agents


def _emit(out, ev, **fields):
    out.write(json.dumps(dict(ev=ev, **fields)) + "\n")
    out.flush()


def _wait_until(t):
    """One timed wait until monotonic time ``t`` (a known instant, not a poll)."""
    left = t - time.monotonic()
    if left > 0:
        time.sleep(left)


def _cpu():
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _recv_exact(sock, n, what):
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise FairnessError("%s: connection closed after %d of %d bytes" % (what, len(buf), n))
        buf += chunk
    return bytes(buf)


def _listen(port, backlog):
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("0.0.0.0", port))
    sock.listen(backlog)
    return sock


def _endpoint(senders, sender, port, mtu):
    from mxps_tools.incast import Endpoint
    return Endpoint(senders, sender, MESSAGE_BYTES, port, ROUND_TIMEOUT, RATE_MBIT, mtu, None)


def _counting_receiver(base, data_type):
    """``LtpReceiver`` that also counts, per sender, the gradient bytes of the DATA packets its
    round accepted (a duplicate or a late packet is not counted: ``LtpRound.add`` raises the
    sender's ``received`` count only for a new packet), sampled every ``SAMPLE_S`` with the
    server's capacity estimate and grant (``Share``)."""

    class Counting(base):
        def __init__(self, spec):
            super().__init__(spec)
            self.bytes = [0] * spec.senders
            self.timeline = []            # (t, [cumulative bytes per sender])
            self.grants = []              # (t, capacity bytes/s, grant bytes/s)
            self._next_sample = 0.0

        def _on_packet(self, f, payload, now):
            rnd = self._round
            before = rnd.received[f.worker] if rnd is not None and f.type == data_type else None
            super()._on_packet(f, payload, now)
            if before is not None and rnd.received[f.worker] != before:
                if now >= self._next_sample:    # before counting: these bytes are from now on
                    self.sample(now)
                self.bytes[f.worker] += f.count * 4

        def sample(self, now):
            self.timeline.append((now, list(self.bytes)))
            share = self.receiver.share
            self.grants.append((now, share.capacity, share.grant(now)))
            self._next_sample = now + SAMPLE_S

    return Counting


#: Diagnostics (``--diagnose``): each switches one LTP mechanism off in the agents, to test an
#: explanation of what the plain runs show.  Not modes of LTP: the runs that answer the
#: question use none.
DIAGNOSES = {
    "no-grant": "the LTP senders ignore the server's grant (PathRate.cap does nothing): "
                "each paces at its own BBR-style model alone",
    "no-deadline": "the LTP receiver's rounds have no deadline (close.deadline_for gives "
                   "None): a round closes only when complete, at the acceptance ratio or "
                   "after every END",
}


def _apply_diagnoses(names):
    """Switch off the mechanisms ``names`` name, in this agent process only."""
    from mxps_tools import runtime
    if "no-grant" in names:
        runtime.module("ltp.rate").PathRate.cap = lambda self, ceiling: None
    if "no-deadline" in names:
        runtime.module("ltp.close").deadline_for = lambda spans, *a, **k: None


class LtpReceiverAgent:
    """``r0``'s LTP side: the receiver and the control connections that start each round."""

    def __init__(self):
        from mxps_tools import incast, runtime
        self.cls = _counting_receiver(incast.load_transport("ltp")[1],
                                      runtime.module("kernels.ltp_packet").DATA)

    def setup(self, out, senders, port, mtu):
        self.senders = senders
        self.rx = self.cls(_endpoint(senders, -1, port, mtu))
        self.control = _listen(port + 1, senders + 8)
        _emit(out, "listening")
        self.control.settimeout(CONNECT_TIMEOUT)
        self.conns = {}
        while len(self.conns) < senders:
            try:
                sock, _ = self.control.accept()
            except socket.timeout:
                raise FairnessError("LTP receiver: only senders %s of %d opened their control "
                                    "connection within %.0f s" % (sorted(self.conns), senders,
                                                                  CONNECT_TIMEOUT)) from None
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(CONNECT_TIMEOUT)
            (index,) = HELLO.unpack(_recv_exact(sock, HELLO.size, "control hello"))
            self.conns[index] = sock
        self.rx.accept(CONNECT_TIMEOUT)
        budget = self.rx.receiver.budget
        _emit(out, "ready", budget=budget, packet_payload=(budget // 4) * 4)

    def _control(self, kind, k):
        for sock in self.conns.values():
            sock.sendall(CONTROL.pack(kind, k))

    def start(self, out, begin, end):
        _wait_until(begin)
        cpu0, rounds, k = _cpu(), [], 0
        self.rx.sample(time.monotonic())
        while time.monotonic() < end:
            go = time.monotonic()
            self._control(b"G", k)
            delivered, reason = self.rx.receive_round(k)
            done = time.monotonic()
            self.rx.sample(done)
            rounds.append({"round": k, "go": go, "done": done, "delivered": delivered,
                           "expected": MESSAGE_BYTES * self.senders, "reason": reason})
            k += 1
        busy = (time.monotonic() - begin, _cpu() - cpu0)
        self._control(b"E", k)
        self.rx.close()
        for sock in self.conns.values():
            sock.close()
        self.control.close()
        _emit(out, "result", rounds=rounds, timeline=self.rx.timeline, grants=self.rx.grants,
              late=self.rx._late, drops=dict(self.rx.receiver.drops.counts),
              counts=self.rx.receiver.counts, wall_s=busy[0], cpu_s=busy[1])


class LtpSenderAgent:
    """One LTP sender node: sends a round whenever ``r0`` says go."""

    def __init__(self):
        from mxps_tools import incast
        self.cls = incast.load_transport("ltp")[0]
        self.payload = memoryview(bytearray(MESSAGE_BYTES))

    def setup(self, out, index, senders, host, port, mtu):
        self.index = index
        self.tx = self.cls(_endpoint(senders, index, port, mtu), host)
        self.ctl = socket.create_connection((host, port + 1), timeout=CONNECT_TIMEOUT)
        self.ctl.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.ctl.sendall(HELLO.pack(index))
        _emit(out, "ready")

    def start(self, out, begin, end):
        rounds, cpu0 = [], _cpu()
        self.ctl.settimeout(max(0.0, begin - time.monotonic()) + ROUND_TIMEOUT + 5)
        while True:
            try:
                kind, k = CONTROL.unpack(_recv_exact(self.ctl, CONTROL.size, "control"))
            except socket.timeout:
                raise FairnessError("LTP sender %d: no go or end from r0 within %.0f s"
                                    % (self.index, self.ctl.gettimeout())) from None
            self.ctl.settimeout(ROUND_TIMEOUT + 5)
            if kind == b"E":
                break
            self.tx.send(k, self.payload)
            rounds.append(self._snapshot(k))
        cpu = _cpu() - cpu0
        self.tx.close()
        self.ctl.close()
        _emit(out, "result", rounds=rounds, cpu_s=cpu,
              counts=dict(self.tx.sender.counts))

    def _snapshot(self, k):
        """The path's model when round ``k`` was acknowledged: the grant (``max_rate``, the
        server's cap), the pacing rate, the bottleneck estimate, the window and min RTT."""
        path = next(iter(self.tx.sender.paths.values()))
        snap = path.rate.snapshot()
        return {"round": k, "t": time.monotonic(), "grant": path.rate.max_rate,
                "pacing": snap["pacing_rate"], "btl_bw": snap["btl_bw"], "cwnd": snap["cwnd"],
                "min_rtt": snap["min_rtt"], "state": snap["state"]}


class TcpSinkAgent:
    """``r0``'s TCP side: reads everything the TCP flow sends, sampling the byte count."""

    def __init__(self):
        self.scratch = bytearray(1 << 20)

    def setup(self, out, port):
        listener = _listen(port, 4)
        _emit(out, "listening")
        listener.settimeout(CONNECT_TIMEOUT)
        try:
            self.conn, _ = listener.accept()
        except socket.timeout:
            raise FairnessError("TCP sink: t0 did not connect within %.0f s"
                                % CONNECT_TIMEOUT) from None
        finally:
            listener.close()
        _emit(out, "ready")

    def start(self, out, begin, end):
        """Read until the sender's reset (or end of stream), at most until ``end`` + 10 s."""
        total, timeline, view = 0, [(time.monotonic(), 0)], memoryview(self.scratch)
        deadline, how = end + 10.0, "deadline"
        self.conn.setblocking(False)
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.conn], [], [], deadline - time.monotonic())
            if not ready:
                continue
            try:
                n = self.conn.recv_into(view)
            except BlockingIOError:
                continue
            except ConnectionResetError:
                how = "reset"
                break
            if n == 0:
                how = "eof"
                break
            now = time.monotonic()
            if now - timeline[-1][0] >= SAMPLE_S:   # before counting: n arrived from now on
                timeline.append((now, total))
            total += n
        timeline.append((time.monotonic(), total))
        self.conn.close()
        _emit(out, "result", timeline=timeline, bytes=total, ended=how)


class TcpSourceAgent:
    """``t0``: one bulk TCP flow, stopped by a reset at its end time (so that nothing it had
    queued keeps flowing into the next phase)."""

    def __init__(self):
        self.data = memoryview(bytearray(1 << 20))

    def setup(self, out, host, port, cc):
        from mxps_tools.incast import set_congestion_control
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        set_congestion_control(self.sock, None if cc == "default" else cc)
        self.sock.settimeout(CONNECT_TIMEOUT)
        self.sock.connect((host, port))
        used = self.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16)
        _emit(out, "ready", cc=used.split(b"\0")[0].decode())

    def _info(self, now):
        f = TCP_INFO.unpack_from(self.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO,
                                                      TCP_INFO.size))
        u32, u64 = f[8:32], f[32:36]
        return {"t": now, "rtt_us": u32[15], "cwnd": u32[18], "total_retrans": u32[23],
                "pacing_rate": u64[0], "delivery_rate": f[42], "min_rtt_us": f[39]}

    def start(self, out, begin, end):
        _wait_until(begin)
        self.sock.setblocking(False)
        sent, infos, cpu0 = 0, [], _cpu()
        next_info = time.monotonic()
        while True:
            now = time.monotonic()
            if now >= end:
                break
            if now >= next_info:
                infos.append(self._info(now))
                next_info = now + SAMPLE_S
            _, writable, _ = select.select([], [self.sock], [], min(end, next_info) - now)
            if writable:
                try:
                    sent += self.sock.send(self.data)
                except BlockingIOError:
                    pass
        infos.append(self._info(time.monotonic()))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()
        _emit(out, "result", sent=sent, info=infos, cpu_s=_cpu() - cpu0)


AGENTS = {"ltp-rx": LtpReceiverAgent, "ltp-tx": LtpSenderAgent, "tcp-rx": TcpSinkAgent,
          "tcp-tx": TcpSourceAgent}


def agent_main(role, diagnoses):
    """An agent: commands on stdin, events on stdout (the real stdout; anything a library
    prints goes to stderr, the agent's log).  Exits at ``quit``, at the end of stdin (the
    driver is gone) or after reporting an error."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        agent = AGENTS[role]()
        if diagnoses and role.startswith("ltp"):
            _apply_diagnoses(diagnoses)
    except Exception as exc:      # reported to the driver, which names the node
        _emit(out, "error", message="%s: %s" % (type(exc).__name__, exc))
        return 1
    _emit(out, "up", pid=os.getpid())
    for line in sys.stdin:
        cmd = json.loads(line)
        name = cmd.pop("cmd")
        if name == "quit":
            return 0
        try:
            getattr(agent, name)(out, **cmd)
        except Exception as exc:  # reported to the driver, which stops the run
            _emit(out, "error", message="%s: %s" % (type(exc).__name__, exc))
            return 1
    return 0


# --------------------------------------------------------------------------- driver


class Agent:
    """An agent process in a node: ``send`` a command, ``expect`` its next event."""

    def __init__(self, topo, node, role, log_path, diagnoses=()):
        self.name = "%s (%s)" % (node, role)
        self.log_path = log_path
        argv = [sys.executable, os.path.abspath(__file__), "--agent", role]
        if diagnoses:
            argv += ["--diagnose", ",".join(diagnoses)]
        with open(log_path, "ab") as log:
            self.proc = topo.popen(node, argv, cwd=REPO, stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=log)
        self.events = queue.Queue()
        threading.Thread(target=self._read, daemon=True, name="agent-" + node).start()

    def _read(self):
        for line in self.proc.stdout:
            try:
                self.events.put(json.loads(line))
            except ValueError:
                self.events.put({"ev": "error", "message": "unparseable line %r" % line[:200]})
        self.events.put(None)

    def send(self, cmd, **args):
        try:
            self.proc.stdin.write((json.dumps(dict(cmd=cmd, **args)) + "\n").encode())
            self.proc.stdin.flush()
        except OSError as exc:
            raise FairnessError("agent %s: cannot send %r (%s); its log (%s) ends with:\n%s"
                                % (self.name, cmd, exc, self.log_path, self._tail())) from None

    def expect(self, ev, timeout):
        try:
            msg = self.events.get(timeout=timeout)
        except queue.Empty:
            raise FairnessError("agent %s: no %r within %.0f s; its log (%s) ends with:\n%s"
                                % (self.name, ev, timeout, self.log_path, self._tail())) from None
        if msg is None:
            code = self.proc.wait()
            raise FairnessError("agent %s exited with code %s before %r; its log (%s) ends "
                                "with:\n%s" % (self.name, code, ev, self.log_path, self._tail()))
        if msg["ev"] != ev:
            raise FairnessError("agent %s: %s instead of %r; its log (%s) ends with:\n%s"
                                % (self.name, msg.get("message", msg["ev"]), ev,
                                   self.log_path, self._tail()))
        return msg

    def _tail(self):
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-1500:] or "(empty)"
        except OSError as exc:
            return "(no log: %s)" % exc

    def quit(self, timeout=10.0):
        try:
            self.send("quit")
            self.proc.stdin.close()
            self.proc.wait(timeout)
        except (OSError, subprocess.TimeoutExpired):
            pass                 # the topology stops it by PID on close


def _netstat(topo, node):
    """``/proc/net/snmp`` and ``netstat`` counters of ``node``'s namespace, as "Proto.Name"."""
    out = subprocess.run(topo.wrap(node, ["cat", "/proc/net/snmp", "/proc/net/netstat"]),
                         check=True, capture_output=True, text=True, timeout=10).stdout
    values, lines = {}, out.splitlines()
    for head, vals in zip(lines[0::2], lines[1::2]):
        proto, names = head.split(":", 1)
        for name, num in zip(names.split(), vals.split(":", 1)[1].split()):
            values["%s.%s" % (proto, name)] = int(num)
    return values


def counters(topo):
    """What the network did so far: switch-queue and loss-rule drops towards r0, t0's TCP
    retransmissions and timeouts, datagrams r0's UDP socket buffers dropped."""
    t0, r0 = _netstat(topo, "t0"), _netstat(topo, "r0")
    return {"queue_drops": int(topo.qdisc_stats("r0")["down"]["drops"]),
            "loss_drops": topo.loss_drops("r0"),
            "tcp_retrans_segs": t0.get("Tcp.RetransSegs", 0),
            "tcp_timeouts": t0.get("TcpExt.TCPTimeouts", 0),
            "udp_rcvbuf_errors": r0.get("Udp.RcvbufErrors", 0)}


def _delta(after, before):
    return {k: after[k] - before[k] for k in after}


def start_agents(topo, max_senders, workdir, diagnoses=()):
    """Every agent of a topology, each once it is up (its imports done)."""
    agents = {"ltp-rx": Agent(topo, "r0", "ltp-rx", os.path.join(workdir, "r0-ltp.log"),
                              diagnoses),
              "tcp-rx": Agent(topo, "r0", "tcp-rx", os.path.join(workdir, "r0-tcp.log")),
              "tcp-tx": Agent(topo, "t0", "tcp-tx", os.path.join(workdir, "t0.log"))}
    for i in range(max_senders):
        agents["s%d" % i] = Agent(topo, "s%d" % i, "ltp-tx",
                                  os.path.join(workdir, "s%d.log" % i), diagnoses)
    for agent in agents.values():
        agent.expect("up", AGENT_UP_TIMEOUT)
    return agents


def run_point(topo, agents, point, index, a):
    """One point: set the switch, set every flow up, run the three phases, collect."""
    topo.set_queue(point.queue_ms)
    topo.set_loss("r0", point.loss)
    port = PORT_BASE + 4 * index
    host = topo.addr("r0")
    senders = [agents["s%d" % i] for i in range(point.senders)]
    rx, sink, src = agents["ltp-rx"], agents["tcp-rx"], agents["tcp-tx"]
    rx.send("setup", senders=point.senders, port=port, mtu=point.mtu)
    sink.send("setup", port=port + 2)
    rx.expect("listening", CONNECT_TIMEOUT)
    sink.expect("listening", CONNECT_TIMEOUT)
    for i, s in enumerate(senders):
        s.send("setup", index=i, senders=point.senders, host=host, port=port, mtu=point.mtu)
    src.send("setup", host=host, port=port + 2, cc=point.cc)
    for s in senders:
        s.expect("ready", CONNECT_TIMEOUT * 2)
    cc_used = src.expect("ready", CONNECT_TIMEOUT)["cc"]
    rx_ready = rx.expect("ready", CONNECT_TIMEOUT * 2)
    sink.expect("ready", CONNECT_TIMEOUT)
    plan = schedule(point.order, a.alone, a.both, a.after)
    epoch = time.monotonic() + START_MARGIN
    at = {flow: (epoch + b, epoch + e) for flow, (b, e) in plan.items()}
    rx.send("start", begin=at["ltp"][0], end=at["ltp"][1])
    for s in senders:
        s.send("start", begin=at["ltp"][0], end=at["ltp"][1])
    sink.send("start", begin=at["tcp"][0], end=at["tcp"][1])
    src.send("start", begin=at["tcp"][0], end=at["tcp"][1])
    marks = [counters(topo)]
    for offset in (a.alone, a.alone + a.both):
        _wait_until(epoch + offset)
        marks.append(counters(topo))
    last = epoch + a.alone + a.both + a.after + ROUND_TIMEOUT + 10
    res = {"ltp-rx": rx.expect("result", max(1.0, last - time.monotonic())),
           "senders": [s.expect("result", ROUND_TIMEOUT) for s in senders],
           "tcp-tx": src.expect("result", ROUND_TIMEOUT),
           "tcp-rx": sink.expect("result", ROUND_TIMEOUT)}
    marks.append(counters(topo))
    return summarise(point, epoch, at, res, rx_ready, cc_used, marks)


def _flow_ends(at, res):
    """When each flow really stopped: TCP at its reset, LTP when its last round closed."""
    rounds = res["ltp-rx"]["rounds"]
    return {"tcp": at["tcp"][1], "ltp": max(at["ltp"][1], rounds[-1]["done"] if rounds else 0)}


def windows(point, epoch, at, res):
    """The measurement window of each phase (absolute monotonic times)."""
    first, second = ("ltp", "tcp") if point.order == "ltp-first" else ("tcp", "ltp")
    ends = _flow_ends(at, res)
    alone = (epoch + SETTLE["alone"], at[second][0])
    both = (at[second][0] + SETTLE["both"], at[first][1])
    after = (ends[first] + SETTLE["after"], at[second][1])
    return {"%s_alone" % first: alone, "both": both,
            "%s_after_%s_left" % (second, first): after}


def summarise(point, epoch, at, res, rx_ready, cc_used, marks):
    """A point's record: every phase's numbers over its window, with the network's counters
    over the whole phase (``marks``: counters at the phases' boundaries)."""
    rx = res["ltp-rx"]
    g_tcp = link_goodput(RATE_MBIT, point.mtu - TCP_HEADERS, TCP_HEADERS)
    payload = rx_ready["packet_payload"]
    g_ltp = link_goodput(RATE_MBIT, payload, point.mtu - payload)
    tcp_line = res["tcp-rx"]["timeline"]
    per_sender = [[(t, bs[i]) for t, bs in rx["timeline"]] for i in range(point.senders)]
    phases = {}
    spans = zip(marks, marks[1:])
    for (name, (t0, t1)), (before, after) in zip(windows(point, epoch, at, res).items(),
                                                 spans):
        if t1 - t0 < 0.25:
            phases[name] = {"skipped": "window %.2f s too short" % (t1 - t0)}
        else:
            phases[name] = _phase(point, (t0, t1), epoch, tcp_line, per_sender, rx, res,
                                  g_tcp, g_ltp)
        phases[name]["counters"] = _delta(after, before)
    return {"point": dataclasses.asdict(point), "cc_used": cc_used,
            "link_goodput_mbit": {"tcp": g_tcp * 8e-6, "ltp": g_ltp * 8e-6},
            "ltp_packet_payload": payload, "schedule_s": {f: (b - epoch, e - epoch)
                                                          for f, (b, e) in at.items()},
            "phases": phases,
            "ltp_receiver": {k: rx[k] for k in ("late", "drops", "counts", "wall_s", "cpu_s")},
            "ltp_senders": [{"cpu_s": s["cpu_s"], "counts": s["counts"]}
                            for s in res["senders"]],
            "tcp_sender": {"sent": res["tcp-tx"]["sent"], "cpu_s": res["tcp-tx"]["cpu_s"],
                           "ended": res["tcp-rx"]["ended"]},
            "ltp_rounds": len(rx["rounds"]), "loadavg_1min": os.getloadavg()[0]}


def _phase(point, window, epoch, tcp_line, per_sender, rx, res, g_tcp, g_ltp):
    """One phase's numbers over ``window``."""
    t0, t1 = window
    n = point.senders
    tcp = rate_between(tcp_line, t0, t1)
    ltp_each = [rate_between(line, t0, t1) for line in per_sender]
    ltp = sum(ltp_each)
    x = [tcp / g_tcp] + [r / g_ltp for r in ltp_each]
    rounds = [r for r in rx["rounds"] if t0 <= r["done"] <= t1]
    reasons = {}
    for r in rounds:
        reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
    infos = in_window([(i["t"], i) for i in res["tcp-tx"]["info"]], t0, t1)
    grants = in_window(rx["grants"], t0, t1)
    snaps = [(r["t"], r) for s in res["senders"] for r in s["rounds"]]
    snaps = [s for t, s in in_window(snaps, t0, t1)]
    out = {"window_s": (t0 - epoch, t1 - epoch),
           "tcp_mbit": tcp * 8e-6, "ltp_mbit": ltp * 8e-6,
           "ltp_each_mbit": [r * 8e-6 for r in ltp_each],
           "tcp_share": x[0] * (n + 1), "ltp_share": sum(x[1:]) * (n + 1) / n,
           "link_used": sum(x), "jain": jain(x) if tcp > 0 and ltp > 0 else None,
           "ltp_rounds": len(rounds),
           "ltp_delivered": (sum(r["delivered"] / r["expected"] for r in rounds) / len(rounds)
                             if rounds else None),
           "ltp_reasons": reasons,
           "tcp_rtt_ms": _ms(median(i["rtt_us"] for _, i in infos)),
           "tcp_cwnd": median(i["cwnd"] for _, i in infos),
           "capacity_mbit": _mbit(median(c for _, c, _ in grants)),
           "grant_mbit": _mbit(median(g for _, _, g in grants if g)),
           "ltp_btl_bw_mbit": _mbit(median(s["btl_bw"] for s in snaps)),
           "ltp_pacing_mbit": _mbit(median(s["pacing"] for s in snaps)),
           "ltp_cwnd_kb": _kb(median(s.get("cwnd") for s in snaps)),
           "ltp_min_rtt_ms": _ms(median(s["min_rtt"] * 1e6 for s in snaps if s["min_rtt"]))}
    return out


def _mbit(bytes_per_s):
    return None if bytes_per_s is None else bytes_per_s * 8e-6


def _kb(nbytes):
    return None if nbytes is None else nbytes / 1000.0


def _ms(us):
    return None if us is None else us / 1000.0


# --------------------------------------------------------------------------- report

TABLE_HEADER = (
    "| MTU | queue | loss | N | TCP cc | phase | TCP Mbit/s | LTP Mbit/s | TCP / fair | "
    "LTP / fair | Jain | link used | LTP delivered | TCP RTT ms | queue drops |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def _f(v, fmt="%.2f"):
    return "-" if v is None else fmt % v


def format_rows(rec):
    p = rec["point"]
    rows = []
    for name, ph in rec["phases"].items():
        if "skipped" in ph:
            continue
        solo_tcp = name.startswith("tcp")
        solo_ltp = name.startswith("ltp")
        rows.append("| %d | %g ms | %g%% | %d | %s | %s | %.0f | %.0f | %s | %s | %s | %.2f | "
                    "%s | %s | %s |" % (
                        p["mtu"], p["queue_ms"], p["loss"], p["senders"], rec["cc_used"], name,
                        ph["tcp_mbit"], ph["ltp_mbit"],
                        "-" if solo_ltp else _f(ph["tcp_share"]),
                        "-" if solo_tcp else _f(ph["ltp_share"]), _f(ph["jain"], "%.3f"),
                        ph["link_used"], "-" if solo_tcp else _f(ph["ltp_delivered"], "%.3f"),
                        "-" if solo_ltp else _f(ph["tcp_rtt_ms"]),
                        ph["counters"]["queue_drops"]))
    return rows


# --------------------------------------------------------------------------- main


def grid(a):
    """Every point of the run, MTU outermost (one topology per MTU)."""
    points = [Point(m, q, l, n, cc, a.order) for m in a.mtus for q in a.queues
              for l in a.losses for n in a.senders for cc in a.ccs]
    return points


def _write_json(path, record):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, path)


def run_topology(a, mtu, points, nodes, workdir, record):
    """Every point of one MTU on one topology, with one set of agents."""
    from mxps_tools import emunet
    from mxps_tools.incast import default_congestion_control
    with emunet.Topology(nodes, default_rate=RATE_MBIT, mtu=mtu, per_packet=True,
                         prefix=PREFIX) as topo:
        record["tcp_default_cc"] = default_congestion_control(topo, "t0")
        agents = start_agents(topo, len(nodes) - 2, workdir, a.diagnose)
        for point in points:
            rec = run_point(topo, agents, point, len(record["points"]), a)
            record["points"].append(rec)
            for row in format_rows(rec):
                print(row, flush=True)
            if a.out:
                _write_json(a.out, record)
        for agent in agents.values():
            agent.quit()


def run(a):
    from mxps_tools import emunet
    points = grid(a)
    record = {"benchmark": "ltp_fairness", "rate_mbit": RATE_MBIT, "message_bytes": MESSAGE_BYTES,
              "phases_s": {"alone": a.alone, "both": a.both, "after": a.after},
              "settle_s": SETTLE, "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "loadavg_start": os.getloadavg(), "cpus": os.cpu_count(),
              "command": " ".join(sys.argv), "diagnose": {d: DIAGNOSES[d] for d in a.diagnose},
              "points": []}
    workdir = a.log_dir or tempfile.mkdtemp(prefix="mxps-fairness-")
    os.makedirs(workdir, exist_ok=True)
    max_n = max(a.senders)
    nodes = ["s%d" % i for i in range(max_n)] + ["t0", "r0"]
    print(TABLE_HEADER, flush=True)
    try:
        emunet.check_prerequisites(tools=emunet.Topology._tools_needed(True, True))
        for mtu in a.mtus:
            run_topology(a, mtu, [p for p in points if p.mtu == mtu], nodes, workdir, record)
    except (emunet.EmunetError, FairnessError) as exc:
        raise FairnessError("%s (agent logs in %s)" % (exc, workdir)) from exc
    record["loadavg_end"] = os.getloadavg()
    if a.out:
        _write_json(a.out, record)
    if not a.log_dir:
        shutil.rmtree(workdir, ignore_errors=True)
    return record


def _floats(text):
    return [float(x) for x in text.split(",") if x]


def _ints(text):
    return [int(x) for x in text.split(",") if x]


def build_parser():
    p = argparse.ArgumentParser(description="TCP next to LTP on the emulated network: does "
                                            "TCP keep a fair share? (needs root)")
    p.add_argument("--mtus", type=_ints, default=list(MTUS), help="default 9000,1500")
    p.add_argument("--queues", type=_floats, default=list(QUEUES_MS),
                   help="switch queues in ms at the link rate, default 2,50")
    p.add_argument("--losses", type=_floats, default=list(LOSSES),
                   help="percent lost towards r0, default 0,1")
    p.add_argument("--senders", type=_ints, default=list(SENDERS), help="N, default 1,4")
    p.add_argument("--ccs", type=lambda t: t.split(","), default=list(CCS),
                   help="TCP congestion controls (default: the namespace's), default "
                        "default,cubic")
    p.add_argument("--order", default="ltp-first", choices=("ltp-first", "tcp-first"),
                   help="which flow starts alone (and leaves first), default ltp-first")
    p.add_argument("--alone", type=float, default=3.0, help="s the first flow runs alone")
    p.add_argument("--both", type=float, default=15.0, help="s both run")
    p.add_argument("--after", type=float, default=2.5, help="s the second runs alone")
    p.add_argument("--out", help="write every point's record (JSON) here, as it goes")
    p.add_argument("--log-dir", help="keep the agents' logs here (default: a temporary "
                                     "directory, removed after a successful run)")
    p.add_argument("--diagnose", type=lambda t: [d for d in t.split(",") if d], default=[],
                   help="switch LTP mechanisms off to test an explanation (not a mode of LTP): "
                        + "; ".join("%s: %s" % kv for kv in DIAGNOSES.items()))
    p.add_argument("--agent", choices=sorted(AGENTS), help=argparse.SUPPRESS)
    return p


def check_args(a):
    if min(a.senders) < 1 or min(a.alone, a.both, a.after) <= 0:
        raise FairnessError("--senders must be >= 1 and every phase positive")
    if a.both <= SETTLE["both"] + 1 or a.alone <= SETTLE["alone"]:
        raise FairnessError("--both must exceed %g s and --alone %g s (the settle times)"
                            % (SETTLE["both"] + 1, SETTLE["alone"]))
    unknown = sorted(set(a.diagnose) - set(DIAGNOSES))
    if unknown:
        raise FairnessError("--diagnose: unknown %s; known: %s" % (unknown, ", ".join(DIAGNOSES)))
    for loss in a.losses:
        if not 0 <= loss <= 100:
            raise FairnessError("--losses: %g is not a percentage" % loss)


def main(argv=None):
    a = build_parser().parse_args(argv)
    if a.agent:
        return agent_main(a.agent, a.diagnose)
    try:
        check_args(a)
        run(a)
    except FairnessError as exc:
        print("ltp_fairness: %s" % exc, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("ltp_fairness: interrupted; every node process and namespace is removed",
              file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
