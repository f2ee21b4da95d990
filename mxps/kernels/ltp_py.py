"""Pure-Python twin of ``cython/ltp.pyx``: LTP's batched UDP I/O, the reference for the compiled
module (MXPS_PURE_PYTHON=1 selects it).

- ``recv_batch(sock, ring, slot_size, max_batch)``: read up to ``max_batch`` waiting datagrams
  without blocking, datagram ``i`` into ``ring[i * slot_size:(i + 1) * slot_size]``; returns
  ``[(nbytes, (host, port)), ...]`` in arrival order, ``[]`` when nothing waits.  A datagram
  longer than ``slot_size`` is cut to it (as ``recvfrom_into`` does).  An error after the first
  datagram ends the batch; the next call reports it (as ``recvmmsg`` does).  With a list
  ``stamps`` (``recv_batch(..., stamps=[])``) it also appends each datagram's kernel arrival
  time (``SO_TIMESTAMPNS``, turned on by ``enable_stamps(sock)``: float seconds of
  ``time.time()``'s clock), None for a datagram that has none.
- ``send_batch(sock, msgs)``: send ``msgs``, a list of ``(buffers, (host, port))`` (one
  datagram gathered from each message's buffers, which are not copied), without blocking, in
  order; returns how many were sent: 0 when the socket's send buffer is full at the first,
  fewer than ``len(msgs)`` when it filled up (or a later datagram failed: the next call, from
  that one, reports why), as ``sendmmsg`` does.  Other errors at the first raise ``OSError``.
- ``send_run(sock, addr, tagger, worker, dtype, key, plan_version, round_, offset, length,
  data, itemsize, epp, seq, k, pn)``: DATA packets ``seq .. seq + k - 1`` of one slice, made
  (``packet.encode``) and sent (``send_batch``) in one call: the worker's pump.
- ``open_batch(view, slot_size, got, paths, itemsize_of)``: the datagrams ``recv_batch`` put
  in the ring (``view``: a byte memoryview of it; ``got``: what recv_batch returned), each
  opened if it is an LTP packet a server accepts: the worker it names has a path
  (``paths[worker]``: ``(registered address, ltp_packet.Tagger)`` or None), it came from that
  address, its tag verifies with that path's key, and it decodes (``ltp_packet.decode``, with
  ``itemsize_of``).  Returns one entry per datagram: ``(Fields, payload memoryview)``, or None
  for a datagram that fails any of these; the caller runs the reference checks on those (to
  count and log why), so this only decides which datagrams take the fast path.  ``intake``
  (the server's packet intake, the last section below) opens its datagrams with the same
  checks.
- ``PathCore``, ``ShareCore``, ``RoundCore``, ``take_common``, ``intake``, ``encode_acks``:
  the server's packet intake (see that section).

Both check their arguments here (``check_recv``, ``address``, ``check_buffers``; the compiled
module calls the same functions), so a wrong argument fails the same way in both, naming what
is wrong, before anything is read or sent.  IPv4 datagram sockets only (LTP's).
"""
import socket
import struct

import numpy as np

from . import ltp_packet as pk
from .accum import add_into

MAX_BATCH = 1024          # recvmmsg/sendmmsg take at most UIO_MAXIOV (1024) messages per call
MAX_BUFFERS = 1024        # iovecs per datagram (IOV_MAX)
# Linux's SO_TIMESTAMPNS (= SCM_TIMESTAMPNS; asm-generic value, not in Python's socket module):
# a datagram's arrival time as a struct timespec of 64-bit seconds and nanoseconds
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
STAMP_SPACE = socket.CMSG_SPACE(16)


def check_socket(sock, what):
    """``sock`` must be an IPv4 datagram socket."""
    if getattr(sock, "family", None) != socket.AF_INET \
            or getattr(sock, "type", None) != socket.SOCK_DGRAM:
        raise ValueError("%s needs an AF_INET datagram socket, not %r" % (what, sock))


def check_recv(sock, ring, slot_size, max_batch):
    """The argument rules of ``recv_batch``; returns the ring as a writable byte memoryview."""
    check_socket(sock, "recv_batch")
    if not 1 <= max_batch <= MAX_BATCH:
        raise ValueError("recv_batch: max_batch %d is not in 1..%d" % (max_batch, MAX_BATCH))
    if slot_size < 1:
        raise ValueError("recv_batch: slot_size %d is not positive" % slot_size)
    view = memoryview(ring)
    if view.readonly:
        raise ValueError("recv_batch: the ring is read-only")
    if not view.c_contiguous:
        raise ValueError("recv_batch: the ring is not contiguous")
    view = view.cast("B")
    if view.nbytes < slot_size * max_batch:
        raise ValueError("recv_batch: the ring has %d bytes; %d slots of %d bytes need %d"
                         % (view.nbytes, max_batch, slot_size, slot_size * max_batch))
    return view


def address(addr, index):
    """Message ``index``'s destination as ``(dotted IPv4 host, port)``; ValueError naming the
    message and the address if it is not one."""
    if not isinstance(addr, tuple) or len(addr) != 2:
        raise ValueError("send_batch: message %d: the address %r is not a (host, port) tuple"
                         % (index, addr))
    host, port = addr
    if not isinstance(host, str) or not isinstance(port, int) or isinstance(port, bool):
        raise ValueError("send_batch: message %d: the address %r is not a (str host, int port)"
                         % (index, addr))
    if not 0 <= port <= 65535:
        raise ValueError("send_batch: message %d: port %d of %r is not in 0..65535"
                         % (index, port, addr))
    try:
        socket.inet_pton(socket.AF_INET, host)
        return host, port
    except OSError:
        pass
    try:
        return socket.gethostbyname(host), port
    except (OSError, UnicodeError) as e:
        raise ValueError("send_batch: message %d: host %r of %r is not an IPv4 address (%s)"
                         % (index, host, addr, e)) from None


def check_buffers(buffers, index):
    """Message ``index``'s buffers must be a list or tuple of at most MAX_BUFFERS contiguous
    bytes-like objects; returns their total size."""
    if not isinstance(buffers, (list, tuple)):
        raise ValueError("send_batch: message %d: the buffers are a %s, not a list"
                         % (index, type(buffers).__name__))
    if len(buffers) > MAX_BUFFERS:
        raise ValueError("send_batch: message %d has %d buffers; a datagram gathers at most %d"
                         % (index, len(buffers), MAX_BUFFERS))
    total = 0
    for j, b in enumerate(buffers):
        try:
            mv = memoryview(b)
        except TypeError:
            raise ValueError("send_batch: message %d, buffer %d: a %s is not a bytes-like object"
                             % (index, j, type(b).__name__)) from None
        if not mv.c_contiguous:
            raise ValueError("send_batch: message %d, buffer %d is not contiguous" % (index, j))
        total += mv.nbytes
    return total


def check_message(msg, index):
    """``(buffers, addr)`` of message ``index``, checked; returns ``(buffers, (host, port))``."""
    if not isinstance(msg, tuple) or len(msg) != 2:
        raise ValueError("send_batch: message %d is not a (buffers, (host, port)) pair" % index)
    buffers, addr = msg
    check_buffers(buffers, index)
    return buffers, address(addr, index)


def recv_batch(sock, ring, slot_size, max_batch, stamps=None):
    """Read up to ``max_batch`` datagrams into the ring's slots (see module doc).  With a list
    ``stamps``, append each datagram's arrival time: the kernel's receive timestamp
    (``SO_TIMESTAMPNS``, which ``enable_stamps`` turns on; seconds of CLOCK_REALTIME, i.e.
    ``time.time()``), or None if the datagram carried none."""
    view = check_recv(sock, ring, slot_size, max_batch)
    out = []
    flags = socket.MSG_DONTWAIT
    for i in range(max_batch):
        slot = view[i * slot_size:(i + 1) * slot_size]
        try:
            if stamps is None:
                n, addr = sock.recvfrom_into(slot, slot_size, flags)
            else:
                n, anc, _, addr = sock.recvmsg_into([slot], STAMP_SPACE, flags)
        except (BlockingIOError, InterruptedError):
            break
        except OSError:
            if out:          # the next call reports it
                break
            raise
        out.append((n, addr))
        if stamps is not None:
            stamps.append(stamp_of(anc))
    return out


def stamp_of(ancdata):
    """The SCM_TIMESTAMPNS of a datagram's ancillary data as float seconds, or None."""
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= 16:
            sec, nsec = struct.unpack_from("qq", data)
            return sec + nsec * 1e-9
    return None


def enable_stamps(sock):
    """Have the kernel stamp every datagram ``sock`` receives with its arrival time
    (``SO_TIMESTAMPNS``; ``recv_batch(..., stamps=[])`` reads the stamps)."""
    sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)


def send_batch(sock, msgs):
    """Send each ``(buffers, (host, port))`` of ``msgs`` as one datagram (see module doc)."""
    check_socket(sock, "send_batch")
    checked = [check_message(m, i) for i, m in enumerate(msgs)]
    flags = socket.MSG_DONTWAIT
    for i, (buffers, addr) in enumerate(checked):
        try:
            sock.sendmsg(buffers, [], flags, addr)
        except (BlockingIOError, InterruptedError):
            return i
        except OSError:
            if i:            # the next call, from this message, reports it
                return i
            raise
    return len(checked)


def _open(dgram, addr, paths, itemsize_of):
    """``(Fields, payload)`` of one acceptable datagram, or None (see ``open_batch``)."""
    try:
        worker = pk.peek_worker(dgram)
    except pk.PacketError:
        return None
    entry = paths[worker] if worker < len(paths) else None
    if entry is None or entry[0] != addr or not entry[1].check(dgram):
        return None
    try:
        return pk.decode(dgram, itemsize_of)
    except Exception:      # refused (or a bug): the caller's reference path says which
        return None


def check_open(view, slot_size, got):
    """The argument rules of ``open_batch``: ``got`` must fit the ring's slots."""
    nbytes = memoryview(view).nbytes
    if len(got) * slot_size > nbytes:
        raise ValueError("open_batch: %d datagrams of %d-byte slots do not fit the %d-byte ring"
                         % (len(got), slot_size, nbytes))
    for i, (size, _) in enumerate(got):
        if not 0 <= size <= slot_size:
            raise ValueError("open_batch: datagram %d has %d bytes, a slot %d"
                             % (i, size, slot_size))


def open_batch(view, slot_size, got, paths, itemsize_of):
    """Open each datagram of a ``recv_batch`` result (see module doc)."""
    check_open(view, slot_size, got)
    return [_open(view[i * slot_size:i * slot_size + size], addr, paths, itemsize_of)
            for i, (size, addr) in enumerate(got)]


def check_round_add(n, length, seq, epp, count):
    """A DATA packet ``seq`` of ``count`` elements must be one of the round's ``n`` packets and
    carry exactly the elements the slice's cut gives it (``epp`` each, the last the rest of
    ``length``); raises ValueError naming the packet otherwise."""
    if not 0 <= seq < n:
        raise ValueError("packet %d of a %d-packet slice" % (seq, n))
    want = min(epp, length - seq * epp)
    if count != want:
        raise ValueError("packet %d carries %d elements, the slice's cut gives it %d"
                         % (seq, count, want))


def round_add(acc, counts, seen, seq, epp, count, payload, dtype_code):
    """One worker's DATA packet ``seq`` into a round's accumulator (``ltp.rounds.LtpRound.add``):
    ``acc`` the round's flat sum, ``counts`` (uint16, one per packet) how many workers' packet
    arrived, ``seen`` (bytearray, one per packet) this worker's.  Adds ``payload`` at element
    ``seq * epp`` and counts it, returning True; returns False for a packet this worker already
    delivered (nothing changes); raises ValueError for one that does not fit the slice's cut
    (nothing changes)."""
    check_round_add(len(counts), acc.size, seq, epp, count)
    if seen[seq]:
        return False
    lo = seq * epp
    add_into(acc[lo:lo + count], payload, dtype_code)
    seen[seq] = 1
    counts[seq] += 1
    return True


_FIELDS = (("worker", 0, 0xFFFF), ("dtype", 0, 0xFF), ("key", -2 ** 31, 2 ** 31 - 1),
           ("plan version", 0, 2 ** 32 - 1), ("round", -2 ** 63, 2 ** 63 - 1),
           ("offset", 0, 2 ** 64 - 1), ("length", 0, 2 ** 64 - 1))


def check_fields(worker, dtype, key, plan_version, round_, offset, length):
    """The header fields of ``send_run`` must be integers that fit their fields."""
    for (name, lo, hi), v in zip(_FIELDS, (worker, dtype, key, plan_version, round_, offset,
                                           length)):
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise ValueError("send_run: the %s %r does not fit its header field (%d..%d)"
                             % (name, v, lo, hi))


def check_run(sock, addr, data, itemsize, epp, length, seq, k, pn):
    """The argument rules of ``send_run``; returns ``(byte memoryview of data, (host, port))``."""
    check_socket(sock, "send_run")
    try:
        view = memoryview(data)
    except TypeError:
        raise ValueError("send_run: the data is a %s, not a bytes-like object"
                         % type(data).__name__) from None
    if not view.c_contiguous:
        raise ValueError("send_run: the data is not contiguous")
    view = view.cast("B")
    if itemsize < 1 or epp < 1:
        raise ValueError("send_run: itemsize %d and elements per packet %d must be positive"
                         % (itemsize, epp))
    if length < 0 or view.nbytes != length * itemsize:
        raise ValueError("send_run: %d bytes of data for a slice of %d elements of %d bytes"
                         % (view.nbytes, length, itemsize))
    n = pk.packet_count(length, epp)
    if k < 0 or seq < 0 or seq + k > n:
        raise ValueError("send_run: packets %d..%d of a %d-packet slice" % (seq, seq + k - 1, n))
    if not 0 <= pn <= 0xFFFFFFFFFFFFFFFF:
        raise ValueError("send_run: packet number %d is not an unsigned 64-bit integer" % pn)
    return view, address(addr, 0)


def send_run(sock, addr, tagger, worker, dtype, key, plan_version, round_, offset, length, data,
             itemsize, epp, seq, k, pn):
    """Send DATA packets ``seq .. seq + k - 1`` of one slice (``data``: the slice's ``length``
    elements of ``itemsize`` bytes, ``epp`` per packet) to ``addr``, packet ``seq + i`` with
    packet number ``pn + i`` (modulo 2**32 on the wire) and ``tagger``'s tag: the datagrams
    ``packet.encode`` makes, sent as ``send_batch`` sends them (the same return value and
    errors).  The worker's hot path: its compiled twin builds and tags the datagrams in C."""
    check_fields(worker, dtype, key, plan_version, round_, offset, length)
    view, addr = check_run(sock, addr, data, itemsize, epp, length, seq, k, pn)
    msgs = []
    for i in range(k):
        s = seq + i
        count = min(epp, length - s * epp)
        lo = s * epp * itemsize
        msgs.append((pk.encode(tagger, pk.DATA, worker, dtype, (pn + i) & pk.PN_MASK, key,
                               plan_version, round_, offset, length, s, count,
                               view[lo:lo + count * itemsize]), addr))
    return send_batch(sock, msgs)


# ===================================================================== the server's packet intake
# A server under LTP takes ~35 K datagrams a second into one process (400 Mbit/s at MTU 1500).
# Per datagram it notes the path's order and loss (``PathCore.note``), the grant's arrival
# windows (``ShareCore.on_packet``), the packet number to ACK, and hands the packet to the round
# it belongs to (``ServerState.take_packet``).  ``intake`` does all of that for a batch, and
# adds a DATA packet of a round the server registered as open (``fast``) straight into it
# (``RoundCore.add``) when the Early Close rule cannot change its answer at that packet; every
# other packet (an END, a worker's first packet of a round, a duplicate, a packet of a closed or
# unknown round, another plan version) is handed back to the caller, which takes it the slow
# way.  The classes below hold the state those steps change; ``ltp.receiver``, ``ltp.share`` and
# ``ltp.rounds`` build on them.  The compiled module does the same in C, on the same state.

IN_ORDER, REORDERED, IN_HOST = 0, 1, 2     # PathCore.note
BLOCK = 256                 # packet numbers per loss sample (a path's loss: PathCore.note)
LOSS_WEIGHT = 0.2           # the weight of a new block's loss in the path's average
# the grant's rate windows (ltp.share, which documents them)
WINDOW = 0.01               # seconds per rate sample
IDLE_GAP = 4 * WINDOW       # seconds without a packet after which the link was idle anyway
TRAIN_SKIP = 0.001          # seconds at the start of a busy time not counted
# the ACKs of a batch (the compiled twin packs them in C)
encode_acks = pk.encode_acks
# ``intake``'s tally: what the batch's packets added up to (the receiver adds it to its counts)
T_PACKETS, T_BYTES, T_OUT_OF_ORDER, T_IN_HOST, T_REORDERED, T_FAST = range(6)


def check_worker(worker, n):
    """``worker`` must index one of ``n`` workers (a negative index is not one)."""
    if not 0 <= worker < n:
        raise IndexError("worker %r is not one of the %d workers" % (worker, n))


class PathCore:
    """One worker's path into a server: its registered address and ``packet.Tagger``, the
    packet numbers to ACK after the batch (``acks``), and what its packet numbers say (``note``):
    how many arrived (``received``), the loss estimate (``loss``: blocks of BLOCK numbers,
    settled once numbers two blocks later arrive, averaged with LOSS_WEIGHT; ``settled``
    blocks), the highest number seen (``hi``) and its arrival stamp (``hi_stamp``)."""

    __slots__ = ("addr", "tagger", "acks", "block", "block_seen", "hi", "hi_stamp", "settled",
                 "loss", "received")

    def __init__(self, addr, tagger):
        self.addr = addr
        self.tagger = tagger
        self.acks = []
        self.block = None          # the oldest unsettled block index
        self.block_seen = {}       # block index -> distinct packet numbers seen
        self.hi = -1
        self.hi_stamp = None       # the arrival stamp of the packet numbered ``hi``
        self.settled = 0
        self.loss = 0.0
        self.received = 0

    def note(self, pn, stamp=None):
        """Count packet number ``pn`` (arrival stamp ``stamp``, None if unknown) towards the
        loss estimate (duplicates are rare and only make the path look a little better).
        Returns IN_ORDER, or REORDERED if it came after a higher number of this path
        (reordered by the network, or a duplicate of an older one), or IN_HOST if it did only
        by the socket, not by the stamps (ltp.receiver's module doc)."""
        self.received += 1
        order = IN_ORDER
        if self.hi >= 0:      # numbers travel modulo 2**32: unwrap near the highest seen
            pn = self.hi + (((pn - self.hi) + (1 << 31)) & pk.PN_MASK) - (1 << 31)
            if pn < self.hi:
                order = IN_HOST if (stamp is not None and self.hi_stamp is not None
                                    and stamp < self.hi_stamp) else REORDERED
        b = pn // BLOCK
        if self.block is None:
            self.block = b
        if b < self.block:
            return order
        self.block_seen[b] = self.block_seen.get(b, 0) + 1
        if pn > self.hi:
            self.hi, self.hi_stamp = pn, stamp
        while self.hi // BLOCK >= self.block + 2:
            seen = min(self.block_seen.pop(self.block, 0), BLOCK)
            missing = 1.0 - seen / BLOCK
            self.loss = missing if not self.settled else (
                (1 - LOSS_WEIGHT) * self.loss + LOSS_WEIGHT * missing)
            self.settled += 1
            self.block += 1
        return order


class ShareCore:
    """The arrival side of a server's grant (``ltp.share.Share``, which documents the rules and
    adds the rest): who sent last when (``_last``), the bytes read (``_read_bytes``) and the
    rate windows, on the kernel's arrival stamps over the link's busy time (``busy_windows``,
    ``_arrival``) or on read times (``on_packet``).  A finished window's rate goes to
    ``self._add(time, bytes/s)``, which the subclass defines."""

    def __init__(self, num_workers, busy_windows=True):
        self.n = num_workers
        self.busy_windows = busy_windows
        self._read_bytes = 0.0
        self._start = None              # the window: reads in (start, read]; None: no window
        #                                 (waiting for a read that drains the socket)
        self._read = None               # the time of the last read (its packets share it)
        self._drained = True            # ... and whether it emptied the socket
        self._bytes = 0
        self._last = [None] * num_workers
        # stamped arrivals (_arrival): who is sending, and the window's busy time
        self._sending = [False] * num_workers
        self._busy_workers = 0
        self._busy = 0.0
        self._train = None              # when the current busy time began
        self._offset = None             # stamp clock - read clock, at the first stamp
        self._phase = None              # the gain phase the busy time and bytes are of

    def _add(self, now, rate):          # pragma: no cover - the subclass's
        raise NotImplementedError

    def on_packet(self, worker, nbytes, now, drained=True, arrival=None, end=False):
        """A packet of ``nbytes`` from ``worker`` was read at ``now`` (the packets of one
        batch read share their ``now``); ``drained``: that read emptied the socket (it returned
        fewer datagrams than it could take); ``end``: it is an END (the worker has sent its
        push whole).  A window runs from one read to a later one and
        holds the bytes of the reads after its start: those arrived within it, provided the
        read at its start drained the socket.  So a window starts only at a draining read: after
        a read that left datagrams behind (a server behind its link), the next reads hold what
        came before it, and counting that backlog measured how fast the server caught up, not
        the link (measured: 72 MB/s of capacity on a 50 MB/s link, 13-17% of the packets
        dropped by its queue with no random loss).  A batch read after a pause does not count
        the pause's bytes in the next window either.

        ``arrival``: the kernel's arrival time of the packet (SO_TIMESTAMPNS, another clock
        than ``now``; None if there is none).  With it the windows are the link's own schedule,
        whenever the server read them (``now`` still says when the worker was last active),
        and they count only the link's busy time (``_arrival``)."""
        check_worker(worker, self.n)
        self._last[worker] = now
        self._read_bytes += nbytes
        if arrival is not None:
            if self.busy_windows:
                self._arrival(worker, nbytes, arrival, now, end)
                return
            now, drained = arrival, True        # each packet its own read at its arrival
            if self._read is not None and now < self._read:
                # a clock step back (the realtime clock was set): start over from here
                self._read, self._start, self._bytes = now, now, 0
                return
        if self._read is None:
            self._read, self._drained = now, drained
            self._start = now if drained else None
            return
        if now != self._read:           # the first packet of a new read
            prev, prev_drained = self._read, self._drained
            self._read, self._drained = now, drained
            if self._start is not None and prev - self._start >= WINDOW:
                span = prev - self._start
                if span < 4 * WINDOW:   # a gap (nothing arrived) is not a rate sample
                    self._add(prev, self._bytes / span)
                self._start = None
            if now - prev >= 4 * WINDOW:
                # after a gap this read holds bytes that came at some time in it: a window
                # may start here (if it drained), its bytes not counted
                self._start, self._bytes = (now if drained else None), 0
            elif self._start is None:
                self._start, self._bytes = (prev if prev_drained else None), 0
        elif not drained:
            self._drained = False
        if self._start is not None and now > self._start:
            self._bytes += nbytes

    def _arrival(self, worker, nbytes, t, now, end):
        """A packet that arrived at ``t`` (the kernel's stamp), read at ``now``.

        A rate sample is one phase of the grant's gain (a ``WINDOW`` of the read clock, which
        ``t`` is mapped to by the offset between the clocks at the first stamp), over the link's
        busy time in it: the time between consecutive arrivals while some worker was sending,
        i.e. had a packet of its push here and not yet its END (and for at most ``IDLE_GAP``
        without a packet: an END lost and being resent, a worker gone); a phase with less than
        half a window of it gives no sample.
        - Busy time, not all of it: the time after every worker's END until the next packet is
          the link idle, not carrying less.  Counted, it made every window of a job of small
          pushes a mix of both (rounds of 8 x 50 KB with the round trip between them: a
          capacity of 75-92% of the link), and the grant cut from it made the next rounds
          longer still.
        - The first ``TRAIN_SKIP`` of a busy time does not count (its first packet was sent
          before its stamp): a link idle for a while lets a burst through at once (a token
          bucket full of tokens, a NIC's coalesced interrupt; the emulated switch's tbf:
          10 kB), which counted made the capacity 3% more than the link could carry (50.0
          MB/s where LTP's datagrams fill a 400 Mbit/s link at 48.6: 3% of the packets dropped
          by the queue with no random loss).
        - One sample per gain phase: random loss before the bottleneck delivers 1 - p of what
          is sent, so only a probe phase's sample can raise the capacity when the link is not
          full (1.15 of it: the probe sends 1 / (1 - p) more, ``share.probe_gain``); a window
          across phases averages the gains to 1 and the capacity sank to 65% of the link at
          10% loss."""
        sending = self._sending
        prev, self._read = self._read, t
        if self._offset is None or (prev is not None and t < prev):
            # the first stamp, or a clock step back (the realtime clock was set): start over
            self._offset, self._phase, self._busy, self._bytes = t - now, None, 0.0, 0
            prev = None
        busy = self._busy_workers > 0 and prev is not None and t - prev < IDLE_GAP
        if not busy:
            self._train = t
        if end:
            if sending[worker]:
                sending[worker] = False
                self._busy_workers -= 1
        elif not sending[worker]:
            sending[worker] = True
            self._busy_workers += 1
        phase = int((t - self._offset) / WINDOW)
        if phase != self._phase:
            if self._busy >= WINDOW / 2:
                self._add(t, self._bytes / self._busy)
            self._phase, self._busy, self._bytes = phase, 0.0, 0
        if busy and t - self._train >= TRAIN_SKIP:
            self._busy += t - prev
            self._bytes += nbytes


class RoundCore:
    """One slice's round at a server under LTP (``ltp.rounds.LtpRound``, which documents it and
    adds the rest): the accumulator ``acc`` (zeroed), ``epp`` elements per packet, ``n``
    packets, per packet the workers whose copy arrived (``counts``), per worker its packets
    (``seen``: a bytearray once it sent one), how many (``received``), when it was first
    heard and its END came (``heard``, ``ends``), the round's first and last packet times, the
    duplicates, and ``below``: how many workers' parts are below ``need`` packets (the lowest
    acceptance ratio the round can close at; while any is, no DATA packet can close it).
    ``plan_version`` and ``live`` are the server's: the plan the round belongs to, and whether
    ``intake`` may still add to it (False once it closed)."""

    def __init__(self, acc, epp, num_workers, dtype_code, lowest=0.0):
        self.acc = acc
        self.length = acc.size
        self.epp = epp
        self.n = pk.packet_count(self.length, epp)
        self.workers = num_workers
        self.dtype = dtype_code
        self.counts = np.zeros(self.n, dtype=np.uint16)
        self.seen = [None] * num_workers      # per worker: bytearray(n) once it sent a packet
        self.received = [0] * num_workers
        self.heard = [None] * num_workers
        self.ends = [None] * num_workers
        self.first = None
        self.last = None
        self.duplicates = 0
        self.need = lowest * self.n
        self.below = num_workers if self.need > 0 else 0
        self.plan_version = 0
        self.live = False

    def _hear(self, worker, now):
        if self.heard[worker] is None:
            self.heard[worker] = now
        if self.first is None:
            self.first = now

    def add(self, worker, seq, count, payload, now):
        """Add DATA packet ``seq`` of ``worker``.  Returns False for a duplicate (nothing
        changes); raises ValueError for a packet that does not fit the slice.  The check, the
        scatter-add and the counting are one ``round_add``."""
        check_worker(worker, self.workers)
        seen = self.seen[worker]
        if seen is None:                # kept only once a packet was added
            seen = bytearray(self.n)
        if not round_add(self.acc, self.counts, seen, seq, self.epp, count, payload,
                         self.dtype):
            self.duplicates += 1
            return False
        self.seen[worker] = seen
        r = self.received[worker] = self.received[worker] + 1
        if r - 1 < self.need <= r:           # one more part at the lowest ratio
            self.below -= 1
        if self.heard[worker] is None:
            self._hear(worker, now)
        self.last = now
        return True


def take_common(worker, pn, end, nbytes, stamp, now, drained, paths, share, touched, tally):
    """What the server does with every verified packet before it looks at its round: the path
    notes its number (order, loss) and will ACK it, the grant counts its arrival, and the
    batch's ``tally`` counts it (``T_*``; ``touched[worker]``: the worker gets an ACK)."""
    check_worker(worker, min(len(paths), len(touched)))
    path = paths[worker]
    order = path.note(pn, stamp)
    if order == REORDERED:
        tally[T_REORDERED] = 1
        tally[T_OUT_OF_ORDER] += 1
    elif order == IN_HOST:
        tally[T_IN_HOST] += 1
    path.acks.append(pn)
    share.on_packet(worker, nbytes, now, drained, stamp, end)
    touched[worker] = True
    tally[T_PACKETS] += 1
    tally[T_BYTES] += nbytes


def _fast_add(f, payload, now, fast, plan_version):
    """Add DATA packet ``f`` into its round if ``fast`` holds that round open and the server's
    rules for the packet come to nothing but the add: the plan version, dtype and cut are
    right, the worker was heard in the round before and has not sent this packet, and the add
    leaves a worker's part below the lowest acceptance ratio (so Early Close has no look to
    take).  True if it was added; False leaves the packet to the server."""
    rnd = fast.get((f.key, f.offset, f.round))
    if rnd is None or not rnd.live or f.plan_version != plan_version \
            or rnd.plan_version != plan_version or f.dtype != rnd.dtype \
            or f.dtype > 1 or f.length != rnd.length or f.worker >= rnd.workers:
        return False
    w, seq = f.worker, f.seq
    seen = rnd.seen[w]
    if seen is None or rnd.heard[w] is None or not 0 <= seq < rnd.n or seen[seq] \
            or f.count != min(rnd.epp, rnd.length - seq * rnd.epp):
        return False
    r = rnd.received[w]
    if rnd.below - (1 if r < rnd.need <= r + 1 else 0) <= 0:
        return False
    return rnd.add(w, seq, f.count, payload, now)


def intake(view, slot_size, got, stamps, start, now, drained, opened_paths, paths, share,
           itemsize_of, touched, tally, fast=None, plan_version=0):
    """Take the datagrams ``start, start + 1, ...`` of a ``recv_batch`` result (``view``,
    ``slot_size``, ``got``, ``stamps`` as ``open_batch`` and ``recv_batch`` have them), as far
    as they need nothing of the caller: each opened (``open_batch``'s checks, ``opened_paths``)
    and taken by ``take_common`` (``paths``: the ``PathCore`` of each worker, ``share``: a
    ``ShareCore``; ``now``, ``drained``: the read's time and whether it emptied the socket),
    then, if it is a DATA packet ``fast`` (``(key, offset, round)`` -> ``RoundCore``, or None)
    can add (``_fast_add``), added (``tally[T_FAST]`` counts it).  Returns ``(i, opened)`` at
    the first datagram the caller must handle: ``opened`` None for one the checks refused
    (nothing done with it: the caller's reference checks say why, or take it after all), else
    its ``(Fields, payload)``, taken in common but not added; ``(len(got), None)`` at the
    end."""
    for i in range(start, len(got)):
        size, addr = got[i]
        lo = i * slot_size
        opened = _open(view[lo:lo + size], addr, opened_paths, itemsize_of)
        if opened is None:
            return i, None
        f, payload = opened
        take_common(f.worker, f.pn, f.type == pk.END, size, stamps[i] if stamps else None,
                    now, drained, paths, share, touched, tally)
        if f.type != pk.DATA or fast is None or not _fast_add(f, payload, now, fast,
                                                               plan_version):
            return i, opened
        tally[T_FAST] += 1
    return len(got), None
