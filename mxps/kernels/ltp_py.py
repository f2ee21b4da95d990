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
  (``paths[worker]``: ``(registered address, ltp.packet.Tagger)`` or None), it came from that
  address, its tag verifies with that path's key, and it decodes (``ltp.packet.decode``, with
  ``itemsize_of``).  Returns one entry per datagram: ``(Fields, payload memoryview)``, or None
  for a datagram that fails any of these; the caller runs the reference checks on those (to
  count and log why), so this only decides which datagrams take the fast path.

Both check their arguments here (``check_recv``, ``address``, ``check_buffers``; the compiled
module calls the same functions), so a wrong argument fails the same way in both, naming what
is wrong, before anything is read or sent.  IPv4 datagram sockets only (LTP's).
"""
import socket
import struct

from ..ltp import packet as pk
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
