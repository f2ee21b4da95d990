"""Push-alone incast benchmark on the emulated network.

    python -m mxps_tools.incast --transport tcp --message 4M --queue-ms 2 --loss 1 --rounds 50
    python -m mxps_tools.incast --grid --out incast-tcp.json

What a parameter server's push looks like without the training around it: W senders (workers)
and R receivers (servers), default 8 -> 1, in an ``emunet.Topology`` (nodes ``s0..``, ``r0..``)
whose every link is shaped to ``--rate`` Mbit/s both ways (default 400), whose switch ports
queue ``--queue-ms`` at that rate (default 2 ms: 100 kB at 400 Mbit/s) and drop ``--loss``
percent of the packets towards each receiver at random (per packet: emunet turns offloads off).
In each round every sender sends one message of ``--message`` bytes (K = 1024, M = 1024**2),
split evenly over the receivers (receiver r gets ``slice_bytes(M, R, r)``), and the next round
starts when every receiver has all of them.

Control and timing. Each sender also opens a small control TCP connection to each receiver.
A receiver starts round k by sending ``go k`` on all its control connections (the direction
towards the senders has no loss and carries nothing else); a sender sends round k's message
once it has ``go k`` from every receiver. A receiver records when it sent ``go k`` and when
round k was complete (or closed), on CLOCK_MONOTONIC, which every namespace shares. The round
takes ``max over receivers of done_k - max over receivers of go_k``: the control's cost (one
tiny message, the senders waking up) is *included*, as in a synchronous step; ``start_lag``
(go to the round's first data byte at the receiver, mean over rounds) shows how much of the
round it is. The first ``--warmup`` rounds (default 2: connections' slow start) are recorded
but not summarised.

Reported per grid point: mean round / ideal and p99 round / ideal (p99 by linear
interpolation, as numpy's default), where ``ideal = W * ceil(M / R) / goodput`` and
``goodput = rate * (MTU - 52) / (MTU + 14)`` bytes/s: tbf counts every frame's 14-byte
Ethernet header and every payload pays 52 bytes of IPv4 (20), TCP (20) and TCP timestamps (12):
at MTU 1500, 1448 of every 1514 bytes (95.6%). The same ideal serves every transport, so a
transport with smaller headers gains by it. Also per point: the fraction of the messages
delivered per round (1.0 for TCP), why rounds closed, and what the network did (packets dropped
by the loss rule and by the switch queue, TCP retransmissions and retransmission timeouts,
from the namespaces' counters). TCP's congestion control is the machine's unless ``--tcp-cc``
names one (set in every namespace); the record says which was in force.

Transports (``TRANSPORTS``: a name -> ``(module, sender class, receiver class)``). A
transport is two classes; each node process builds one:

- ``Receiver(spec: Endpoint)``: binds ``spec.port`` on every address of its node at once.
  ``accept(timeout)``: returns once every one of ``spec.senders`` senders is known (TCP:
  connected), or raises ``IncastError``. ``receive_round(round) -> (bytes delivered, reason)``:
  blocks until the round's message from every sender has arrived (TCP: ``"complete"``) or the
  transport closed the round early (LTP: the acceptance ratio or deadline, the reason naming
  which); a receiver that can neither raises ``IncastError`` after ``spec.round_timeout``
  seconds, naming the round and the senders missing. ``close()``.
- ``Sender(spec: Endpoint, host: str)``: connects to the receiver at ``host:spec.port``.
  ``send(round, payload)``: pushes the round's message (a memoryview of
  ``spec.message_bytes``); may return before delivery (TCP: once the kernel has it all).
  ``close()``.

The control connections, the timing and the report are the benchmark's, not the transport's.
``--transport ltp`` is added by registering the LTP classes (``mxps/ltp/``) in
``TRANSPORTS``; a transport in the runtime (``mxps.*``) is imported through
``mxps_tools.runtime`` in the node processes only, so this module imports neither MXNet nor
the runtime.

Processes: this process (root namespace) builds the topology once and, per grid point, sets the
queue and loss live, starts a receiver process per receiver node (``Topology.start_service``,
ready when it listens) and a sender process per sender node (``Topology.popen``), all
``python -m mxps_tools.incast --role ...``, then waits for them (woken by their exits; a
failing one stops the run with the end of its log). Every process and namespace is removed on
exit, failure, Ctrl-C and SIGTERM (``Topology`` does). Needs root, ``ip``, ``tc``, ``ethtool``
and ``nft`` (``scripts/test-deps.sh``).
"""

import argparse
import dataclasses
import importlib
import json
import math
import os
import re
import select
import selectors
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

#: Bytes of every packet's payload spent on IPv4 (20), TCP (20) and TCP timestamps (12).
TCP_IP_HEADER_BYTES = 52
#: Ethernet header, counted by tbf on top of the MTU (veths have no preamble, FCS or gap).
ETH_HEADER_BYTES = 14

#: The issue's grid: message per sender, switch queue (ms), loss towards the receiver (%).
GRID_MESSAGES = (4 << 20, 256 << 10, 50 << 10)
GRID_QUEUES_MS = (100.0, 2.0)
GRID_LOSSES = (0.0, 1.0, 5.0, 10.0)
#: Rounds per point in ``--grid`` unless ``--rounds`` is given: small rounds are cheap, and a
#: p99 wants a few hundred of them.
GRID_ROUNDS = {4 << 20: 50, 256 << 10: 200, 50 << 10: 500}

DEFAULT_PORT = 5600
DEFAULT_CONTROL_PORT = 5601
#: Seconds for every process to start and every connection to be made.
CONNECT_TIMEOUT = 20.0

#: A TCP message's header: round and payload length (the receiver checks both).
MESSAGE_HEADER = struct.Struct("!QQ")
#: A control message: kind (``G`` go, ``E`` end) and round.
CONTROL = struct.Struct("!cQ")
#: A sender's first bytes on each connection: its index.
HELLO = struct.Struct("!I")
SCRATCH_BYTES = 1 << 20


class IncastError(RuntimeError):
    """The benchmark could not run or a round failed (names the round, node or setting)."""


# --------------------------------------------------------------------------- pure parts


def parse_size(text: str) -> int:
    """Bytes from ``"4M"``, ``"256K"``, ``"50k"``, ``"1000"`` (K = 1024, M = 1024**2)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)[bB]?\s*", str(text))
    if not m or int(m.group(1)) <= 0:
        raise IncastError("message size %r must be a positive number of bytes, optionally with "
                          "K or M (e.g. 4M, 256K, 50K)" % (text,))
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20}[m.group(2).lower()]


def size_label(n: int) -> str:
    """``4 MB``, ``256 KB``, ``50 KB`` or bytes: the inverse of ``parse_size``, for tables."""
    if n % (1 << 20) == 0:
        return "%d MB" % (n >> 20)
    if n % (1 << 10) == 0:
        return "%d KB" % (n >> 10)
    return "%d B" % n


def goodput(rate_mbit: float, mtu: int = 1500, header: int = TCP_IP_HEADER_BYTES) -> float:
    """Payload bytes/s a link of ``rate_mbit`` carries at ``mtu``: the rate times the share of
    each frame (``mtu + 14`` bytes, as tbf counts it) that is payload (``mtu - header``)."""
    if rate_mbit <= 0 or mtu <= header:
        raise IncastError("goodput needs a positive rate and an MTU above the %d header bytes, "
                          "got rate %r Mbit/s, MTU %r" % (header, rate_mbit, mtu))
    return rate_mbit * 1e6 / 8 * (mtu - header) / (mtu + ETH_HEADER_BYTES)


def slice_bytes(message: int, receivers: int, r: int) -> int:
    """Bytes of a ``message`` that receiver ``r`` of ``receivers`` gets: an even split, the
    first ``message % receivers`` receivers one byte more."""
    return message // receivers + (1 if r < message % receivers else 0)


def ideal_seconds(senders: int, message: int, rate_mbit: float, mtu: int = 1500,
                  receivers: int = 1) -> float:
    """A round's ideal: the busiest receiver's link carrying every sender's slice at goodput."""
    return senders * slice_bytes(message, receivers, 0) / goodput(rate_mbit, mtu)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation between order statistics."""
    if not values:
        raise IncastError("percentile of no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def combine_receivers(per_receiver: Sequence[Sequence[Mapping]]) -> List[Dict]:
    """One record per round from every receiver's records of it.

    A round starts when the last receiver sent its go (a sender needs every go) and ends when
    the last receiver is done; delivered bytes add up; ``reason`` is the receivers' reasons,
    joined when they differ.
    """
    if not per_receiver or any(len(r) != len(per_receiver[0]) for r in per_receiver):
        raise IncastError("receivers recorded different numbers of rounds: %s"
                          % [len(r) for r in per_receiver])
    rounds = []
    for recs in zip(*per_receiver):
        if len({rec["round"] for rec in recs}) != 1:
            raise IncastError("receivers' records disagree on the round: %s"
                              % [rec["round"] for rec in recs])
        start, end = max(rec["go"] for rec in recs), max(rec["done"] for rec in recs)
        firsts = [rec["first"] for rec in recs if rec.get("first") is not None]
        reasons = sorted({rec["reason"] for rec in recs})
        rounds.append({
            "round": recs[0]["round"],
            "seconds": end - start,
            "start_lag": (min(firsts) - start) if firsts else None,
            "delivered": sum(rec["delivered"] for rec in recs),
            "expected": sum(rec["expected"] for rec in recs),
            "reason": "+".join(reasons),
            "warmup": bool(recs[0].get("warmup")),
        })
    return rounds


def summarise(rounds: Sequence[Mapping], ideal: float) -> Dict:
    """Mean, p50, p99 and max round time (seconds and / ideal), delivered fraction (mean and
    minimum over rounds), start lag, and the count of each close reason, over the rounds not
    marked warmup."""
    timed = [r for r in rounds if not r.get("warmup")]
    if not timed:
        raise IncastError("no timed rounds to summarise (all %d are warmup)" % len(rounds))
    secs = [r["seconds"] for r in timed]
    fractions = [r["delivered"] / r["expected"] if r["expected"] else 1.0 for r in timed]
    lags = [r["start_lag"] for r in timed if r.get("start_lag") is not None]
    reasons: Dict[str, int] = {}
    for r in timed:
        reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
    mean = sum(secs) / len(secs)
    p50, p99 = percentile(secs, 50), percentile(secs, 99)
    return {
        "rounds": len(timed),
        "ideal_s": ideal,
        "mean_s": mean, "p50_s": p50, "p99_s": p99, "max_s": max(secs),
        "mean_over_ideal": mean / ideal, "p50_over_ideal": p50 / ideal,
        "p99_over_ideal": p99 / ideal, "max_over_ideal": max(secs) / ideal,
        "delivered_mean": sum(fractions) / len(fractions),
        "delivered_min": min(fractions),
        "start_lag_mean_s": sum(lags) / len(lags) if lags else None,
        "reasons": reasons,
    }


@dataclasses.dataclass(frozen=True)
class Point:
    """One measurement: message bytes per sender, switch queue (ms), loss towards receivers (%),
    timed rounds."""
    message: int
    queue_ms: float
    loss: float
    rounds: int


def grid_points(rounds: Optional[int] = None) -> List[Point]:
    """The issue's grid, largest messages first; ``rounds`` overrides ``GRID_ROUNDS``."""
    return [Point(m, q, l, rounds or GRID_ROUNDS[m])
            for m in GRID_MESSAGES for q in GRID_QUEUES_MS for l in GRID_LOSSES]


# --------------------------------------------------------------------------- transports


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """What a transport's sender or receiver is told.

    ``senders``: W. ``sender``: this sender's index (-1 in a receiver). ``message_bytes``: one
    sender's message to this receiver per round. ``port``: the receiver's data port.
    ``round_timeout``: seconds a round may take before the receiver gives up. ``rate_mbit``,
    ``mtu``: the links' (a rate-controlled transport's first guess, packet sizes).
    ``tcp_cc``: TCP's congestion control for a TCP transport (None: the system's).
    """
    senders: int
    sender: int
    message_bytes: int
    port: int
    round_timeout: float
    rate_mbit: float
    mtu: int
    tcp_cc: Optional[str] = None


def _recv_exact(sock: socket.socket, n: int, what: str) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise IncastError("%s: connection closed after %d of %d bytes" % (what, len(buf), n))
        buf += chunk
    return bytes(buf)


def _sendmsg_all(sock: socket.socket, parts: Sequence) -> None:
    """Send every byte of ``parts`` (buffers) in as few system calls as the kernel allows."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]


def set_congestion_control(sock: socket.socket, name: Optional[str]) -> None:
    """Use ``name`` for this socket (None: the namespace's default). Per socket, because a
    namespace other than the machine's may only default to the algorithms the machine allows
    unprivileged users (``tcp_allowed_congestion_control``); a root process may pick any loaded
    one for its own sockets."""
    if not name:
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
    except OSError as exc:
        try:
            with open("/proc/sys/net/ipv4/tcp_available_congestion_control") as f:
                available = f.read().strip()
        except OSError:
            available = "unknown"
        raise IncastError("--tcp-cc %s: cannot use it on a socket: %s (available: %s)"
                          % (name, exc, available)) from None


class TcpSender:
    """A PS push over TCP: one connection to the receiver, each message headed by its round and
    length, sent whole (``TCP_NODELAY``, so a message's last segment is not held back)."""

    def __init__(self, spec: Endpoint, host: str) -> None:
        self.spec = spec
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        set_congestion_control(self.sock, spec.tcp_cc)
        self.sock.settimeout(CONNECT_TIMEOUT)
        self.sock.connect((host, spec.port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(spec.round_timeout)
        self.sock.sendall(HELLO.pack(spec.sender))

    def send(self, round_no: int, payload: memoryview) -> None:
        _sendmsg_all(self.sock, [MESSAGE_HEADER.pack(round_no, len(payload)), payload])

    def close(self) -> None:
        self.sock.close()


class _Inbound:
    """One sender's connection at a TCP receiver and what is left of its current message."""

    def __init__(self, sock: socket.socket, sender: int) -> None:
        self.sock, self.sender = sock, sender
        self.header = bytearray()
        self.left = 0
        self.payload = 0

    def start(self, message: int) -> None:
        self.header.clear()
        self.left = MESSAGE_HEADER.size + message
        self.payload = 0

    def read(self, scratch: memoryview, round_no: int, message: int) -> None:
        """Read what is there (at most the rest of this round's message)."""
        n = self.sock.recv_into(scratch, min(len(scratch), self.left))
        if n == 0:
            raise IncastError("round %d: sender %d closed its connection with %d of %d bytes "
                              "left" % (round_no, self.sender, self.left, message))
        self.left -= n
        missing = MESSAGE_HEADER.size - len(self.header)
        if missing > 0:
            self.header += scratch[:min(n, missing)]
            if len(self.header) == MESSAGE_HEADER.size:
                got_round, got_len = MESSAGE_HEADER.unpack(self.header)
                if (got_round, got_len) != (round_no, message):
                    raise IncastError("round %d: sender %d sent round %d with %d bytes, expected "
                                      "round %d with %d" % (round_no, self.sender, got_round,
                                                            got_len, round_no, message))
        self.payload += max(0, n - max(0, missing))


class TcpReceiver:
    """The receiving end of ``TcpSender``: accepts W connections, reads each round's message
    from every one of them (a selector over non-blocking sockets, never past the round)."""

    def __init__(self, spec: Endpoint) -> None:
        self.spec = spec
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("0.0.0.0", spec.port))
        self.listener.listen(spec.senders + 8)
        self.inbound: Dict[int, _Inbound] = {}
        self.selector = selectors.DefaultSelector()
        self.scratch = memoryview(bytearray(SCRATCH_BYTES))
        self.first_byte: Optional[float] = None

    def accept(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.inbound) < self.spec.senders:
            self.listener.settimeout(max(0.0, deadline - time.monotonic()))
            try:
                sock, _ = self.listener.accept()
            except socket.timeout:
                raise IncastError("only senders %s of %d connected within %.0f s"
                                  % (sorted(self.inbound), self.spec.senders, timeout)) from None
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            (sender,) = HELLO.unpack(_recv_exact(sock, HELLO.size, "hello of a sender"))
            if sender in self.inbound or not 0 <= sender < self.spec.senders:
                raise IncastError("a connection said it is sender %d: duplicate or not in "
                                  "0..%d" % (sender, self.spec.senders - 1))
            sock.setblocking(False)
            self.inbound[sender] = _Inbound(sock, sender)

    def receive_round(self, round_no: int) -> Tuple[int, str]:
        message = self.spec.message_bytes
        pending = set(self.inbound)
        for sender, conn in self.inbound.items():
            conn.start(message)
            self.selector.register(conn.sock, selectors.EVENT_READ, sender)
        self.first_byte = None
        deadline = time.monotonic() + self.spec.round_timeout
        try:
            while pending:
                remaining = deadline - time.monotonic()
                events = self.selector.select(remaining) if remaining > 0 else []
                if not events and time.monotonic() >= deadline:
                    late = sorted(pending)
                    raise IncastError("round %d: senders %s delivered %s of %d bytes within "
                                      "%.1f s" % (round_no, late,
                                                  [self.inbound[s].payload for s in late],
                                                  message, self.spec.round_timeout))
                if self.first_byte is None and events:
                    self.first_byte = time.monotonic()
                for key, _ in events:
                    conn = self.inbound[key.data]
                    conn.read(self.scratch, round_no, message)
                    if conn.left == 0:
                        self.selector.unregister(conn.sock)
                        pending.discard(key.data)
        finally:
            for sender in pending:
                self.selector.unregister(self.inbound[sender].sock)
        return sum(c.payload for c in self.inbound.values()), "complete"

    def close(self) -> None:
        self.selector.close()
        for conn in self.inbound.values():
            conn.sock.close()
        self.listener.close()


#: Transport name -> (module, sender class, receiver class). A module under ``mxps.`` is
#: imported through ``mxps_tools.runtime`` (the node processes only).
TRANSPORTS: Dict[str, Tuple[str, str, str]] = {
    "tcp": (__name__, "TcpSender", "TcpReceiver"),
    "ltp": ("mxps.ltp.incast", "LtpSender", "LtpReceiver"),
}


def load_transport(name: str):
    """``(Sender, Receiver)`` classes of transport ``name``."""
    if name not in TRANSPORTS:
        raise IncastError("unknown transport %r; known: %s" % (name, ", ".join(sorted(TRANSPORTS))))
    module_name, sender, receiver = TRANSPORTS[name]
    if module_name.startswith("mxps."):
        from . import runtime
        module = runtime.module(module_name[len("mxps."):])
    elif module_name == __name__:
        module = sys.modules[__name__]
    else:
        module = importlib.import_module(module_name)
    return getattr(module, sender), getattr(module, receiver)


# --------------------------------------------------------------------------- node processes


def _send_control(conns: Sequence[socket.socket], kind: bytes, round_no: int) -> None:
    msg = CONTROL.pack(kind, round_no)
    for c in conns:
        c.sendall(msg)


def run_receiver(a) -> int:
    """A receiver node: listen, wait for every sender, run the rounds, write the records."""
    spec = Endpoint(a.senders, -1, a.message_bytes, a.port, a.round_timeout, a.rate, a.mtu,
                    a.tcp_cc)
    _, receiver_cls = load_transport(a.transport)
    receiver = receiver_cls(spec)
    control = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    control.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    control.bind(("0.0.0.0", a.control_port))
    control.listen(a.senders + 8)
    print("ready", flush=True)
    control.settimeout(CONNECT_TIMEOUT)
    senders = {}
    try:
        while len(senders) < a.senders:
            try:
                sock, _ = control.accept()
            except socket.timeout:
                raise IncastError("receiver %d: only senders %s of %d opened their control "
                                  "connection within %.0f s"
                                  % (a.index, sorted(senders), a.senders,
                                     CONNECT_TIMEOUT)) from None
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(CONNECT_TIMEOUT)
            (sender,) = HELLO.unpack(_recv_exact(sock, HELLO.size, "control hello"))
            senders[sender] = sock
        receiver.accept(CONNECT_TIMEOUT)
        conns = [senders[s] for s in sorted(senders)]
        records = []
        for k in range(a.warmup + a.rounds):
            go = time.monotonic()
            _send_control(conns, b"G", k)
            delivered, reason = receiver.receive_round(k)
            done = time.monotonic()
            records.append({"round": k, "go": go, "first": getattr(receiver, "first_byte", None),
                            "done": done, "delivered": delivered,
                            "expected": a.senders * a.message_bytes, "reason": reason,
                            "warmup": k < a.warmup})
        _send_control(conns, b"E", a.warmup + a.rounds)
        with open(a.result, "w") as f:
            json.dump(records, f)
    finally:
        for sock in senders.values():
            sock.close()
        control.close()
        receiver.close()
    return 0


def run_sender(a) -> int:
    """A sender node: connect to every receiver, send each round when every receiver says go."""
    hosts = a.hosts.split(",")
    sender_cls, _ = load_transport(a.transport)
    sizes = [slice_bytes(a.message_bytes, len(hosts), r) for r in range(len(hosts))]
    specs = [Endpoint(a.senders, a.index, n, a.port, a.round_timeout, a.rate, a.mtu, a.tcp_cc)
             for n in sizes]
    payload = memoryview(bytearray(max(sizes)))
    data = [sender_cls(spec, host) for spec, host in zip(specs, hosts)]
    controls = []
    for host in hosts:
        sock = socket.create_connection((host, a.control_port), timeout=CONNECT_TIMEOUT)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(HELLO.pack(a.index))
        # The first go waits for every sender to connect; later ones for a round.
        sock.settimeout(CONNECT_TIMEOUT + a.round_timeout)
        controls.append(sock)
    try:
        while True:
            kinds = {_control_of(sock, host) for sock, host in zip(controls, hosts)}
            if len(kinds) != 1:
                raise IncastError("sender %d: receivers disagree on what comes next: %s"
                                  % (a.index, sorted(kinds)))
            kind, k = kinds.pop()
            if kind == b"E":
                return 0
            _send_all(data, k, [payload[:n] for n in sizes])
    finally:
        for sock in controls:
            sock.close()
        for d in data:
            d.close()


def _control_of(sock: socket.socket, host: str) -> Tuple[bytes, int]:
    try:
        return CONTROL.unpack(_recv_exact(sock, CONTROL.size, "control from receiver " + host))
    except socket.timeout:
        raise IncastError("no go or end from receiver %s within %.0f s"
                          % (host, sock.gettimeout())) from None


def _send_all(data: Sequence, k: int, payloads: Sequence[memoryview]) -> None:
    """Send round ``k`` to every receiver at once (a thread per receiver beyond the first)."""
    if len(data) == 1:
        data[0].send(k, payloads[0])
        return
    errors: List[BaseException] = []

    def one(d, p):
        try:
            d.send(k, p)
        except BaseException as exc:  # re-raised below, in the sender's main thread
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(d, p), daemon=True)
               for d, p in zip(data[1:], payloads[1:])]
    for t in threads:
        t.start()
    one(data[0], payloads[0])
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


# --------------------------------------------------------------------------- driver


def node_names(senders: int, receivers: int) -> Tuple[List[str], List[str]]:
    return ["s%d" % i for i in range(senders)], ["r%d" % i for i in range(receivers)]


def _netstat(topo, node: str) -> Dict[str, int]:
    """TCP counters of ``node``'s namespace: segments retransmitted, retransmission timeouts."""
    out = subprocess.run(topo.wrap(node, ["cat", "/proc/net/snmp", "/proc/net/netstat"]),
                         check=True, capture_output=True, text=True, timeout=10).stdout
    values: Dict[str, int] = {}
    lines = out.splitlines()
    for head, vals in zip(lines[0::2], lines[1::2]):
        proto, names = head.split(":", 1)
        _, nums = vals.split(":", 1)
        for name, num in zip(names.split(), nums.split()):
            values["%s.%s" % (proto, name)] = int(num)
    return {"retrans_segs": values.get("Tcp.RetransSegs", 0),
            "rto_timeouts": values.get("TcpExt.TCPTimeouts", 0)}


def _counters(topo, senders: Sequence[str], receivers: Sequence[str]) -> Dict[str, int]:
    total = {"loss_drops": 0, "queue_drops": 0, "retrans_segs": 0, "rto_timeouts": 0}
    for r in receivers:
        total["loss_drops"] += topo.loss_drops(r)
        total["queue_drops"] += int(topo.qdisc_stats(r)["down"]["drops"])
    for s in senders:
        for key, value in _netstat(topo, s).items():
            total[key] += value
    return total


def default_congestion_control(topo, node: str) -> str:
    """TCP's congestion control in ``node``'s namespace (Linux copies the machine's default
    into every new namespace). It matters: BBR, which ignores random loss, and CUBIC give very
    different numbers here."""
    return subprocess.run(topo.wrap(node, ["cat", "/proc/sys/net/ipv4/tcp_congestion_control"]),
                          check=True, capture_output=True, text=True, timeout=10).stdout.strip()


def _log_tail(path: str, chars: int = 2000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:] or "(empty)"
    except OSError as exc:
        return "(no log: %s)" % exc


def _wait_processes(procs: Mapping[str, Tuple[subprocess.Popen, str]], timeout: float) -> None:
    """Wait for every process to exit 0, woken by each exit (pidfds); the first failure, or
    the deadline, raises IncastError with the end of the failed (or a running) node's log."""
    fds = {os.pidfd_open(p.pid): name for name, (p, _) in procs.items()}
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + timeout
    try:
        left = set(fds)
        while left:
            remaining = deadline - time.monotonic()
            ready = poller.poll(max(0.0, remaining) * 1000) if remaining > 0 else []
            if not ready:
                name = fds[next(iter(left))]
                raise IncastError("node %s still running after %.0f s; its log ends with:\n%s"
                                  % (name, timeout, _log_tail(procs[name][1])))
            for fd, _ in ready:
                poller.unregister(fd)
                left.discard(fd)
                name = fds[fd]
                proc, log = procs[name]
                rc = proc.wait()
                if rc != 0:
                    raise IncastError("node %s exited with code %d; its log (%s) ends with:\n%s"
                                      % (name, rc, log, _log_tail(log)))
    finally:
        for fd in fds:
            os.close(fd)


def _node_argv(a, role: str, index: int, message_bytes: int, rounds: int, extra: Sequence[str]):
    from .runtime import python_argv
    return python_argv(
        ["-m", "mxps_tools.incast", "--role", role, "--index", str(index),
         "--transport", a.transport, "--senders", str(a.senders),
         "--message-bytes", str(message_bytes), "--rounds", str(rounds),
         "--warmup", str(a.warmup), "--port", str(a.port),
         "--control-port", str(a.control_port), "--round-timeout", str(a.round_timeout),
         "--rate", str(a.rate), "--mtu", str(a.mtu)]
        + (["--tcp-cc", a.tcp_cc] if a.tcp_cc else []) + list(extra))


def run_point(topo, a, point: Point, workdir: str) -> Dict:
    """Measure one grid point on the open topology; its record (config, summary, counters,
    every round)."""
    senders, receivers = node_names(a.senders, a.receivers)
    topo.set_queue(point.queue_ms)
    for r in receivers:
        topo.set_loss(r, point.loss)
    tag = "%s-q%g-l%g" % (point.message, point.queue_ms, point.loss)
    before = _counters(topo, senders, receivers)
    started = time.monotonic()
    procs: Dict[str, Tuple[subprocess.Popen, str]] = {}
    results = []
    for i, node in enumerate(receivers):
        log = os.path.join(workdir, "%s-%s.log" % (tag, node))
        results.append(os.path.join(workdir, "%s-%s.json" % (tag, node)))
        argv = _node_argv(a, "receiver", i, slice_bytes(point.message, a.receivers, i),
                          point.rounds, ["--result", results[-1]])
        procs[node] = (topo.start_service(node, argv, ready=r"^ready", log_path=log,
                                          timeout=CONNECT_TIMEOUT), log)
    hosts = ",".join(topo.addr(r) for r in receivers)
    for i, node in enumerate(senders):
        log = os.path.join(workdir, "%s-%s.log" % (tag, node))
        with open(log, "wb") as out:
            proc = topo.popen(node, _node_argv(a, "sender", i, point.message, point.rounds,
                                               ["--hosts", hosts]),
                              stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        procs[node] = (proc, log)
    _wait_processes(procs, CONNECT_TIMEOUT + (a.warmup + point.rounds) * a.round_timeout)
    elapsed = time.monotonic() - started
    after = _counters(topo, senders, receivers)
    per_receiver = []
    for path in results:
        with open(path) as f:
            per_receiver.append(json.load(f))
    rounds = combine_receivers(per_receiver)
    ideal = ideal_seconds(a.senders, point.message, a.rate, a.mtu, a.receivers)
    return {"message_bytes": point.message, "queue_ms": point.queue_ms, "loss_pct": point.loss,
            "warmup": a.warmup, "summary": summarise(rounds, ideal),
            "counters": {k: after[k] - before[k] for k in after}, "elapsed_s": elapsed,
            "loadavg_1min_end": os.getloadavg()[0], "rounds": rounds}


def format_row(rec: Mapping) -> str:
    s = rec["summary"]
    c = rec["counters"]
    return ("| %s | %g ms | %g%% | %.2f | %.2f | %.3f | %d | %d | %d | %d |"
            % (size_label(rec["message_bytes"]), rec["queue_ms"], rec["loss_pct"],
               s["mean_over_ideal"], s["p99_over_ideal"], s["delivered_mean"], s["rounds"],
               c["loss_drops"], c["queue_drops"], c["rto_timeouts"]))


TABLE_HEADER = ("| message per sender | switch queue | loss | mean / ideal | p99 / ideal | "
                "delivered | rounds | loss drops | queue drops | RTOs |\n"
                "|---|---|---|---|---|---|---|---|---|---|")


def run(a) -> Dict:
    """Build the topology, run every point, return the whole record (and write ``--out``)."""
    from . import emunet
    points = (grid_points(a.rounds) if a.grid else
              [Point(parse_size(a.message), a.queue_ms, a.loss, a.rounds or 50)])
    senders, receivers = node_names(a.senders, a.receivers)
    record = {"benchmark": "incast", "transport": a.transport, "senders": a.senders,
              "receivers": a.receivers, "rate_mbit": a.rate, "mtu": a.mtu,
              "goodput_bytes_per_s": goodput(a.rate, a.mtu),
              "goodput_formula": "rate * (MTU - 52) / (MTU + 14)",
              "ideal_formula": "senders * ceil(message / receivers) / goodput",
              "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "loadavg_start": os.getloadavg(),
              "cpus": os.cpu_count(), "points": []}
    workdir = a.log_dir or tempfile.mkdtemp(prefix="mxps-incast-")
    os.makedirs(workdir, exist_ok=True)
    try:
        emunet.check_prerequisites(tools=emunet.Topology._tools_needed(True, True))
        emunet.cleanup_stale(a.netns_prefix)
        with emunet.Topology(senders + receivers, default_rate=a.rate, mtu=a.mtu,
                             per_packet=None if a.offloads else True,
                             prefix=a.netns_prefix) as topo:
            record["tcp_congestion_control"] = (a.tcp_cc or
                                                default_congestion_control(topo, senders[0]))
            print("%s over TCP %s, %d -> %d, %g Mbit/s, MTU %d"
                  % (a.transport, record["tcp_congestion_control"], a.senders, a.receivers,
                     a.rate, a.mtu), flush=True)
            print(TABLE_HEADER, flush=True)
            for point in points:
                rec = run_point(topo, a, point, workdir)
                record["points"].append(rec)
                print(format_row(rec), flush=True)
                if a.out:
                    _write_json(a.out, record)
    except emunet.EmunetError as exc:
        raise IncastError("emulated network: %s (node logs in %s)" % (exc, workdir)) from exc
    record["loadavg_end"] = os.getloadavg()
    if a.out:
        _write_json(a.out, record)
    if not a.log_dir:
        shutil.rmtree(workdir, ignore_errors=True)
    return record


def _write_json(path: str, record: Mapping) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m mxps_tools.incast",
        description="Push-alone incast benchmark on the emulated network (needs root).")
    p.add_argument("--transport", default="tcp", help="transport (%s)" % ", ".join(TRANSPORTS))
    p.add_argument("--senders", "-W", type=int, default=8, help="senders (workers), default 8")
    p.add_argument("--receivers", "-R", type=int, default=1,
                   help="receivers (servers), default 1; a message is split evenly over them")
    p.add_argument("--rate", type=float, default=400.0, help="every link's Mbit/s, default 400")
    p.add_argument("--mtu", type=int, default=1500, help="MTU of every link, default 1500")
    p.add_argument("--message", default="4M", help="bytes per sender per round (K, M), default 4M")
    p.add_argument("--queue-ms", type=float, default=2.0,
                   help="switch queue in ms at the link rate, default 2")
    p.add_argument("--loss", type=float, default=0.0,
                   help="percent of packets towards each receiver lost at random, default 0")
    p.add_argument("--rounds", type=int, default=None,
                   help="timed rounds per point (default 50; in --grid per message: %s)"
                   % ", ".join("%s: %d" % (size_label(m), n) for m, n in GRID_ROUNDS.items()))
    p.add_argument("--warmup", type=int, default=2, help="untimed first rounds, default 2")
    p.add_argument("--grid", action="store_true",
                   help="run the issue's grid (messages 4M, 256K, 50K; queues 100, 2 ms; loss "
                        "0, 1, 5, 10%%) instead of one point: --message, --queue-ms and --loss "
                        "are then not used")
    p.add_argument("--out", help="write every point's record (JSON) here, as it goes")
    p.add_argument("--round-timeout", type=float, default=60.0,
                   help="seconds a round may take before the run fails, default 60")
    p.add_argument("--offloads", action="store_true",
                   help="leave the links' offloads on where the shaping allows it (no loss, a "
                        "queue of at least the default): as mxps bench's lossless runs have "
                        "them; default: off, every packet shaped and dropped on its own")
    p.add_argument("--tcp-cc", metavar="NAME",
                   help="TCP congestion control in every node (e.g. cubic, bbr); default: the "
                        "machine's (recorded in the JSON either way)")
    p.add_argument("--log-dir", help="keep the nodes' logs here (default: a temporary directory "
                                     "removed after a successful run)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=argparse.SUPPRESS)
    p.add_argument("--control-port", type=int, default=DEFAULT_CONTROL_PORT,
                   help=argparse.SUPPRESS)
    p.add_argument("--netns-prefix", default="mxps-", help=argparse.SUPPRESS)
    # A node process's own arguments (started by the driver in a namespace).
    p.add_argument("--role", choices=("driver", "sender", "receiver"), default="driver",
                   help=argparse.SUPPRESS)
    p.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--message-bytes", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--hosts", default="", help=argparse.SUPPRESS)
    p.add_argument("--result", default="", help=argparse.SUPPRESS)
    return p


def check_args(a) -> None:
    """Reject settings the benchmark cannot run, naming them."""
    if a.transport not in TRANSPORTS:
        raise IncastError("unknown transport %r; known: %s"
                          % (a.transport, ", ".join(sorted(TRANSPORTS))))
    for name in ("senders", "receivers"):
        if getattr(a, name) < 1:
            raise IncastError("--%s must be at least 1, got %d" % (name, getattr(a, name)))
    if a.senders + a.receivers > 200:
        raise IncastError("--senders + --receivers must be at most 200, got %d"
                          % (a.senders + a.receivers))
    if a.rounds is not None and a.rounds < 1:
        raise IncastError("--rounds must be at least 1, got %d" % a.rounds)
    if a.warmup < 0 or a.round_timeout <= 0:
        raise IncastError("--warmup must be >= 0 and --round-timeout > 0, got %d and %g"
                          % (a.warmup, a.round_timeout))
    if not 0 <= a.loss <= 100:
        raise IncastError("--loss must be a percentage in [0, 100], got %g" % a.loss)
    if a.queue_ms <= 0 or a.rate <= 0:
        raise IncastError("--queue-ms and --rate must be positive, got %g and %g"
                          % (a.queue_ms, a.rate))
    goodput(a.rate, a.mtu)
    message = parse_size(a.message)
    if message < a.receivers:
        raise IncastError("--message %s is smaller than one byte per receiver (%d)"
                          % (a.message, a.receivers))


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        if a.role == "receiver":
            return run_receiver(a)
        if a.role == "sender":
            return run_sender(a)
        check_args(a)
        run(a)
    except IncastError as exc:
        print("incast: %s" % exc, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("incast: interrupted; the network and every node process are removed",
              file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
