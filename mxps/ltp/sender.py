"""A worker's LTP endpoint: large gradient slices go out as paced UDP packets.

Owned by the worker's I/O thread (``roles.worker``), which hands it a push once the push's turn
has come (the per-server priority queue and send window are the same as for TCP), calls
``pump`` to send what the pacing allows and ``receive`` when ACKs are waiting, and sleeps until
``wake_at``.  A push is cut into packets of whole elements (``packet``); its DATA packets are
*normal* (a lost one is never resent: the server's Early Close and Bubble Filling deal with it);
its END, sent after the last DATA packet, is *critical*: resent (with a new packet number) until
ACKed, with a timeout from the path's smoothed RTT and its variation (RFC 6298's
``srtt + 4 rttvar``, at least 5 ms; ``end_timeout``) and a doubling backoff.  The END's ACK completes the
push, as the server's ACK of a TCP push does.  On a lossy path an END goes as several copies at
once (``end_copies`` of the path's measured loss): a lost END costs its push a retransmission
timeout (5 ms at least), which at 10% loss hit more than half of an 8-worker round's ENDs.

Each (worker -> server) path paces at its ``rate.PathRate`` model: bottleneck rate and minimum
RTT from the ACKs, random loss not taken for congestion.  The packets one pump sends on a path
go out together, with one system call: a run of one push's DATA packets is made, tagged and
sent by one call (``kernels.ltp.send_run``: in C, with sendmmsg), after the rate model
recorded the run (``PathRate.send_run``); ENDs and resent ENDs go by ``send_batch`` (each
datagram gathered from its header and tag).  ACKs are read in batches too (``recv_batch``).

Test-only: ``drop`` > 0 (MXPS_LTP_DROP) drops that fraction of DATA packets here, at random from
a seeded generator, instead of sending them, as a lossy network would (the rate model sees them
as lost too).
"""
import collections
import json
import logging
import math
import random
import socket

from ..kernels import ltp_packet as pk
from ..kernels.ltp import recv_batch, send_batch, send_run
from .rate import PathRate
from .receiver import SO_RCVBUFFORCE, SO_SNDBUFFORCE, big_buffer

log = logging.getLogger("mxps.ltp")

SNDBUF = 8 << 20
BURST = 32                 # packets sent per path per pump before looking at the others
MIN_RTO = 0.005
MAX_RTO = 1.0
# Pacing credit (seconds) a path may spend at once when its pump comes late.  The I/O loop
# sleeps whole milliseconds, rounded up (roles.worker), and on a busy machine wakes later
# still, so pumps come 1-3 ms apart: with the rate model's default credit of 1 ms a path whose
# queue was never empty sent 25-31% of its pacing rate (measured: resnet18, 3 x 3,
# paths paced at 7-19 MB/s sent 2-5 MB/s).  The model still bounds a burst to 64 KB.
PUMP_CREDIT = 0.004
# A path held back by its pacing (or its window) is pumped again no sooner than this later
# (MXPS_LTP_QUANTUM), or half its pacing credit if that is shorter, so that a fast path loses
# no rate to it: the credit then sends what came due meanwhile in one call.  Waking for
# the next single packet made the I/O loop a main cost of the worker: measured (resnet18,
# 3 x 3, MTU 1500, docs/bench/ltp_resnet18_mtu1500.json), 85% of its ~950 turns a second
# found a packet already due and pumped ~8 packets, and a turn costs its Python whatever it sends
# (15.5 us of the I/O thread's CPU per packet sent; with the quantum ~400 turns a second,
# 11.3 us).  Linux's TCP paces bursts of ~1 ms of data too (TSO autosizing, sk_pacing_shift).
# The loop sleeps whole milliseconds rounded up (roles.worker), so 1 ms here is a 1-2 ms sleep.
PACING_QUANTUM = 0.001
# An END goes as the fewest copies whose all being lost is at most END_LOSS_TARGET likely at the
# path's loss rate (end_copies), at most MAX_END_COPIES; the loss rate is the share of the bytes
# the path settled (delivered, or given up by the rate model) that were lost, averaged over
# about LOSS_WINDOW_PACKETS packets
END_LOSS_TARGET = 1e-3
MAX_END_COPIES = 4
LOSS_WINDOW_PACKETS = 256
# The END's first timeout: "rtt", RFC 6298's srtt + 4 rttvar of the path's ACKed packets (the
# default); "min_rtt": 4 x the path's minimum RTT (the earlier rule, for
# ablations).  Both at least MIN_RTO (4 x MIN_RTO before an RTT sample).  Measured (resnet18 at MTU 1500,
# 5% loss): with 4 x min_rtt a worker resent 3.8 ENDs per
# push, nearly all spurious: on a busy machine an ACK comes back much later than the idle path's
# round trip, which only the smoothed RTT and its variation follow.
END_TIMEOUTS = ("rtt", "min_rtt")
ACK_BATCH = 64             # ACK datagrams per read
ACK_SLOT = 4096            # an ACK: a 16-byte head, pk.MAX_ACK_RANGES ranges of 8, the tag: 1056
IP_MTU = getattr(socket, "IP_MTU", 14)


def path_mtu(host, port):
    """The MTU of the route to (host, port), as the kernel knows it."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect((host, port))
        return s.getsockopt(socket.IPPROTO_IP, IP_MTU)
    except OSError:
        return 1500
    finally:
        s.close()


def end_timeout(rate, rule="rtt"):
    """Seconds before an unACKed END is first sent again on a path whose model is ``rate`` (a
    ``rate.PathRate``), by ``rule`` (END_TIMEOUTS); each resend doubles it (at most MAX_RTO)."""
    if rule == "rtt":
        rto = rate.rto(MIN_RTO, MAX_RTO)
    elif rule == "min_rtt":
        rtt = rate.min_rtt
        rto = min(MAX_RTO, max(MIN_RTO, 4 * rtt)) if rtt else None
    else:
        raise ValueError("END timeout rule %r: one of %s" % (rule, ", ".join(END_TIMEOUTS)))
    return 4 * MIN_RTO if rto is None else rto


def end_copies(loss, target=END_LOSS_TARGET, cap=MAX_END_COPIES):
    """How many copies of an END to send at once on a path that loses a fraction ``loss`` of
    its packets (independently): the fewest k with loss ** k <= ``target``, 1 to ``cap``."""
    p = min(max(float(loss), 0.0), 1.0)
    if p <= target:
        return 1
    if p >= 1.0:
        return cap
    return max(1, min(cap, math.ceil(math.log(target) / math.log(p) - 1e-9)))


class _Push:
    __slots__ = ("h", "data", "itemsize", "epp", "n", "next", "on_done", "end_pns", "end_at",
                 "first_end", "rto", "sent_bytes", "tries")

    def __init__(self, h, payload, itemsize, budget, on_done):
        self.h = h
        self.data = memoryview(payload).cast("B")
        self.itemsize = itemsize
        self.epp = pk.elements_per_packet(budget, itemsize)
        self.n = pk.packet_count(h.length, self.epp)
        self.next = 0              # next DATA packet; n: the END is next; n + 1: END sent
        self.on_done = on_done
        self.end_pns = []          # every END sent (an ACK of any of them completes the push)
        self.end_at = None         # the last END's send time
        self.first_end = None
        self.rto = None
        self.sent_bytes = 0
        self.tries = 0


class _Path:
    __slots__ = ("server", "addr", "tagger", "budget", "rate", "pn", "queue", "ends", "waiting",
                 "loss", "_settled", "start_rate")

    def __init__(self, server, addr, key, budget, now, initial_rate):
        self.server = server
        self.addr = addr
        self.tagger = pk.Tagger(key)
        self.budget = budget
        self.rate = PathRate(now, initial_rate=initial_rate, mss=budget + pk.OVERHEAD,
                             burst=PUMP_CREDIT)
        self.pn = 0
        self.queue = collections.deque()     # pushes with packets still to send
        self.ends = {}                       # END packet number -> its push (not ACKed yet)
        self.waiting = []                    # pushes whose END is not ACKed yet
        self.loss = 0.0                      # measured loss rate (update_loss)
        self._settled = (0, 0)               # (delivered, lost) bytes at the last update
        self.start_rate = 0.0                # the server's rate for a push after idle (ACKs)

    def update_loss(self):
        """Fold the bytes settled since the last call into ``loss``: lost (given up by the
        rate model and never ACKed late) over delivered + lost, weighted by how many bytes
        settled (a window of about LOSS_WINDOW_PACKETS packets)."""
        r = self.rate
        delivered, lost = r.delivered_bytes, r.lost_bytes - r.late_bytes
        d, l = delivered - self._settled[0], lost - self._settled[1]
        if d + l <= 0:
            return self.loss
        self._settled = (delivered, lost)
        w = min(1.0, (d + l) / float(LOSS_WINDOW_PACKETS * r.mss))
        self.loss += w * (max(0.0, l) / float(d + l) - self.loss)
        return self.loss


class Sender:
    """The UDP socket of worker ``worker`` and one path per server."""

    def __init__(self, worker, host, drop=0.0, seed=0, itemsize_of=None,
                 quantum=PACING_QUANTUM, end_copies=MAX_END_COPIES, end_rto="rtt"):
        if end_rto not in END_TIMEOUTS:
            raise ValueError("END timeout rule %r: one of %s"
                             % (end_rto, ", ".join(END_TIMEOUTS)))
        self.worker = worker
        self.end_rto = end_rto
        self.quantum = quantum
        self.end_copies = end_copies          # the most copies of an END (1: one END)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        big_buffer(self.sock, socket.SO_SNDBUF, SO_SNDBUFFORCE, SNDBUF)
        big_buffer(self.sock, socket.SO_RCVBUF, SO_RCVBUFFORCE, 1 << 20)
        self.sock.bind((host, 0))
        self.sock.setblocking(False)
        self.host = host
        self.port = self.sock.getsockname()[1]
        self.paths = {}
        self._by_addr = {}
        self.drop = drop
        self._rng = random.Random((seed << 16) ^ worker)
        self._ring = bytearray(ACK_BATCH * ACK_SLOT)
        self._out = []                        # (buffers, address) a pump has for its path
        self.counts = collections.Counter()
        # (server, round, payload bytes) the server acknowledged, as ACKs come: what the
        # placement's rate measurement counts (``take_delivered``)
        self._delivered = []

    def hello_body(self, server_host, server_port):
        """The LTP_HELLO body for a server at (host, TCP port): this socket and the path MTU."""
        return json.dumps({"host": self.host, "port": self.port,
                           "mtu": path_mtu(server_host, server_port)}).encode()

    def add_path(self, server, server_host, reply, now, initial_rate=None):
        """Install the path to ``server`` from its LTP_HELLO reply body."""
        try:
            body = json.loads(bytes(reply))
            port, key, budget = int(body["port"]), bytes.fromhex(body["key"]), int(body["budget"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError("LTP_HELLO reply of server %d does not parse: %s" % (server, e)) \
                from None
        path = _Path(server, (server_host, port), key, budget, now, initial_rate)
        self.paths[server] = path
        self._by_addr[path.addr] = path

    def takes(self, server, h, payload, min_bytes, itemsize):
        """Whether this push goes by LTP: a path to its server, a floating-point slice of at
        least ``min_bytes`` (smaller slices, integer keys and control go by TCP)."""
        return (server in self.paths and itemsize is not None
                and payload is not None and memoryview(payload).nbytes >= min_bytes)

    def enqueue(self, server, h, payload, itemsize, on_done):
        """Send push ``h`` of ``payload``; ``on_done(push)`` runs when its END is ACKed."""
        path = self.paths[server]
        if not path.queue and not path.waiting and path.start_rate:
            # the path was idle: begin at the server's start rate, not at a grant raised while
            # others had nothing to send (ltp.share)
            path.rate.cap(path.start_rate)
        path.queue.append(_Push(h, payload, itemsize, path.budget, on_done))

    @property
    def busy(self):
        return any(p.queue or p.waiting for p in self.paths.values())

    # -- sending -------------------------------------------------------------------------
    def pump(self, now):
        """Send what pacing allows on every path; resend overdue ENDs.  Returns the time of the
        next thing to do (None: nothing to do until an ACK or a new push)."""
        wake = None
        for path in self.paths.values():
            t = self._pump_path(path, now)
            self._flush(path)
            if t is not None and (wake is None or t < wake):
                wake = t
        return wake

    def _pump_path(self, path, now):
        rate = path.rate
        wake = None
        for push in list(path.waiting):       # overdue ENDs first: they are critical
            due = push.end_at + push.rto
            if now >= due:
                push.rto = min(MAX_RTO, push.rto * 2)
                self.counts["end_resent"] += 1
                self._send_end(path, push, now)
                due = push.end_at + push.rto
            wake = due if wake is None else min(wake, due)
        sent = 0
        while path.queue and sent < BURST:
            push = path.queue[0]
            if push.next < push.n and not self.drop:
                # a run of this push's DATA packets, as many as pacing allows, in one call
                room = min(BURST - sent, push.n - push.next)
                full = push.epp * push.itemsize + pk.OVERHEAD
                last = self._size_of(push, push.next + room - 1) + pk.OVERHEAD
                k = rate.send_run(path.pn, full, room, now, last)
                if k:
                    self._send_data_run(path, push, k)
                    sent += k
                    continue
            size = self._next_size(push) + pk.OVERHEAD
            t = rate.next_send_time(size, now)
            if t > now:
                t = max(t, now + min(self.quantum, rate.credit / 2))
                wake = t if wake is None else min(wake, t)
                break
            if push.next < push.n:
                self._send_data(path, push, now)
            else:
                path.queue.popleft()
                self._send_end(path, push, now)
                end_due = push.end_at + push.rto
                wake = end_due if wake is None else min(wake, end_due)
            sent += 1
        else:
            if path.queue:
                wake = now
        if not path.queue and not path.waiting:
            rate.idle(now)
        return wake

    def _next_size(self, push):
        if push.next >= push.n:
            return 0
        return self._size_of(push, push.next)

    @staticmethod
    def _size_of(push, seq):
        """Payload bytes of DATA packet ``seq`` of ``push``."""
        return min(push.epp, push.h.length - seq * push.epp) * push.itemsize

    def _send_data_run(self, path, push, k):
        """Send DATA packets ``push.next ..`` + ``k`` (the rate model has recorded them) with one
        call: ``send_run`` makes and tags them (compiled: in C) and sends them with sendmmsg.
        Whatever ``_transmit`` queued goes first (an END must not overtake its DATA)."""
        if self._out:
            self._flush(path)
        h = push.h
        seq, pn = push.next, path.pn
        path.pn += k
        push.next += k
        push.sent_bytes += min(h.length, (seq + k) * push.epp) * push.itemsize \
            - seq * push.epp * push.itemsize
        self.counts["data"] += k
        self._send_all(path, k, lambda i: send_run(
            self.sock, path.addr, path.tagger, self.worker, h.dtype, h.key, h.plan_version,
            h.iteration, h.offset, h.length, push.data, push.itemsize, push.epp, seq + i, k - i,
            pn + i))

    def _send_data(self, path, push, now):
        h = push.h
        seq = push.next
        count = min(push.epp, h.length - seq * push.epp)
        lo = seq * push.epp * push.itemsize
        payload = push.data[lo:lo + count * push.itemsize]
        pn = path.pn
        path.pn += 1
        push.next += 1
        bufs = pk.encode(path.tagger, pk.DATA, self.worker, h.dtype, pn & pk.PN_MASK, h.key,
                         h.plan_version,
                         h.iteration, h.offset, h.length, seq, count, payload)
        size = len(bufs[0]) + payload.nbytes + pk.TAG_SIZE
        push.sent_bytes += payload.nbytes
        path.rate.on_send(pn, size, now)
        if self.drop and self._rng.random() < self.drop:
            self.counts["dropped_on_purpose"] += 1
            return
        self._transmit(path, bufs)
        self.counts["data"] += 1

    def _send_end(self, path, push, now):
        """Send push's END (the first time or again), as ``end_copies`` of the path's loss
        datagrams: an ACK of any of them completes the push."""
        h = push.h
        if push.rto is None:
            push.rto = end_timeout(path.rate, self.end_rto)
        if push.next <= push.n:
            push.next = push.n + 1
            push.first_end = now
            path.waiting.append(push)
        copies = end_copies(path.update_loss(), cap=self.end_copies)
        for _ in range(copies):
            pn = path.pn
            path.pn += 1
            bufs = pk.encode(path.tagger, pk.END, self.worker, h.dtype, pn & pk.PN_MASK, h.key,
                             h.plan_version, h.iteration, h.offset, h.length, push.n, 0)
            path.rate.on_send(pn, pk.OVERHEAD, now)
            push.end_pns.append(pn)
            path.ends[pn] = push
            self._transmit(path, bufs)
        push.end_at = now
        push.tries += 1
        self.counts["end"] += 1
        self.counts["end_copies"] += copies - 1

    def _transmit(self, path, bufs):
        """Queue one datagram for ``path``; ``pump`` sends the path's queue (``_flush``) once
        its pacing loop is done (the buffers, the gradient's among them, are not copied)."""
        self._out.append((bufs, path.addr))

    def _flush(self, path):
        """Send what ``_transmit`` queued for ``path``, in order, with as few system calls as
        the socket allows.  A datagram the full send buffer does not take is as good as lost
        on the wire (``sndbuf_full``); one that fails is counted and logged (``send_error``);
        either way the next one is tried, as when each was sent alone."""
        msgs, self._out = self._out, []
        self._send_all(path, len(msgs), lambda i: send_batch(self.sock, msgs[i:] if i else msgs))

    def _send_all(self, path, n, send_from):
        """Send ``n`` datagrams to ``path``: ``send_from(i)`` sends from datagram ``i`` on and
        says how many went (``send_batch``/``send_run``).  A datagram the full send buffer does
        not take is counted (``sndbuf_full``) and one that fails is counted and logged
        (``send_error``): either is as good as lost on the wire, and the next one is tried."""
        i = 0
        while i < n:
            self.counts["send_calls"] += 1
            try:
                sent = send_from(i)
            except OSError as e:                 # datagram i failed
                self.counts["send_error"] += 1
                log.warning("mxps worker %d: LTP send to server %d failed: %s", self.worker,
                            path.server, e)
                sent = 1
            if sent == 0:                        # the send buffer is full at datagram i
                self.counts["sndbuf_full"] += 1
                sent = 1
            i += sent

    # -- ACKs ----------------------------------------------------------------------------
    def receive(self, now):
        """Read waiting ACKs; returns the pushes whose END they acknowledged."""
        done = []
        view = memoryview(self._ring)
        for _ in range(256 // ACK_BATCH):
            got = recv_batch(self.sock, self._ring, ACK_SLOT, ACK_BATCH)
            for i, (size, addr) in enumerate(got):
                self._ack(view[i * ACK_SLOT:i * ACK_SLOT + size], addr, now, done)
            if len(got) < ACK_BATCH:
                break
        return done

    def _ack(self, dgram, addr, now, done):
        """One datagram read from the socket: an ACK of a path (the pushes whose END it
        acknowledges go to ``done``), or counted and dropped."""
        path = self._by_addr.get(addr)
        if path is None:
            self.counts["ack_stranger"] += 1
            return
        try:
            ranges, grant, start = pk.decode_ack_grant(dgram, path.tagger, self.worker)
        except pk.PacketError as e:
            self.counts["ack_" + e.reason] += 1
            return
        # packet numbers travel modulo 2**32; the path counts on (unwrap near the last)
        last = path.pn - 1
        pns = [last - ((last - pn) & pk.PN_MASK)
               for first, n in ranges for pn in range(first, first + n)]
        self.counts["acks"] += 1
        if grant:             # the server's share for this worker (ltp.share)
            path.rate.cap(grant)
        if start:
            path.start_rate = start
        before = path.rate.delivered_bytes
        path.rate.on_ack(pns, now)
        got = path.rate.delivered_bytes - before
        if got > 0:
            # the bytes belong to the oldest push in flight (ENDs go after all DATA, so a push
            # waiting for its END's ACK is older than any still sending)
            head = path.waiting[0] if path.waiting else path.queue[0] if path.queue else None
            if head is not None:
                payload = got * path.budget // (path.budget + pk.OVERHEAD)
                self._delivered.append((path.server, head.h.iteration, payload))
        for pn in pns:
            push = path.ends.get(pn)
            if push is not None:
                done.append(push)
                for other in push.end_pns:      # every END of it, resent ones too
                    path.ends.pop(other, None)
                path.waiting.remove(push)

    def take_delivered(self):
        """The (server, round, payload bytes) acknowledged since the last call: what each path
        delivered, when it was delivered (the ACKs' arrival), whatever the pacing."""
        got, self._delivered = self._delivered, []
        return got

    def path_rows(self, kind, t):
        """One trace row per path (``trace.PATH_COLUMNS``) at wall time ``t``: the rate
        model's snapshot, its ceiling (the server's last grant) and the pushes queued."""
        rows = []
        for server, path in sorted(self.paths.items()):
            m = path.rate.snapshot()
            rows.append((kind, t, server, m["state"], m["pacing_rate"], m["btl_bw"],
                         path.rate.max_rate, m["min_rtt"], m["srtt"], m["cwnd"], m["inflight"],
                         len(path.queue) + len(path.waiting), m["sent_bytes"],
                         m["delivered_bytes"], m["lost_bytes"]))
        return rows

    def report(self):
        """What this sender did, for the worker's shutdown report: its counts (``data`` and
        ``end`` datagrams, ``end_resent``, ``sndbuf_full``, ``send_error``, ``ack_*`` drops, ...)
        and per path the rate model's totals and last estimates."""
        paths = {}
        for server, path in sorted(self.paths.items()):
            m = path.rate.snapshot()
            paths[str(server)] = {k: m[k] for k in (
                "sent_bytes", "delivered_bytes", "lost_bytes", "late_bytes", "ignored_acks",
                "btl_bw", "min_rtt", "pacing_rate")}
            paths[str(server)]["packets"] = path.pn
        return {"counts": dict(self.counts), "paths": paths}

    def oldest_end(self):
        """(first END time, server, push) of the push waiting longest for its END's ACK, or
        None."""
        worst = None
        for path in self.paths.values():
            for push in path.waiting:
                if worst is None or push.first_end < worst[0]:
                    worst = (push.first_end, path.server, push)
        return worst

    def close(self):
        self.sock.close()
