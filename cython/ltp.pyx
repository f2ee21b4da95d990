# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""LTP's batched UDP I/O: one system call for many datagrams (compiled twin of
mxps/kernels/ltp_py.py, which is the reference and documents the API).

A server under MXPS_PUSH=ltp reads every worker's gradient packets from one UDP socket, and a
worker sends its packets paced in bursts; one ``recvfrom_into`` or ``sendmsg`` per datagram costs
a system call and a trip through the interpreter each.  ``recv_batch`` reads up to ``max_batch``
datagrams with one ``recvmmsg`` into the slots of a preallocated ring (no allocation per
datagram but the address tuple, cached per peer); ``send_batch`` sends a list of datagrams with
one ``sendmmsg``, each gathered by iovecs from its buffers (header, the gradient's memoryview,
tag: the gradient is not copied before the kernel copies it into the packet).  Both run without
the GIL during the system call and never block (MSG_DONTWAIT).  ``open_batch`` takes a received
batch through a server's checks (header, registered address, the keyed BLAKE2b tag by hashlib's
object, the sizes) and decodes the headers in C: a datagram it cannot accept is left to the
caller's reference checks, which count and log why.

Measured at 1500-byte datagrams (CPU time per datagram; scripts/ltp_loopback.py for the whole
server path): reading 0.6 us batched against 1.5-3.5 us one by one; sending 2.7 us against 5.1
us (loopback: both include the kernel's delivery); opening 2.5 us against 3.9 us, of which the
BLAKE2b of the datagram itself is 2.0 us.  ``send_run`` makes a run of one slice's DATA packets
and sends them in one call (header in C, the payload copied next to it so the tag is one
update of the keyed BLAKE2b state, sendmmsg): the worker's whole send path, rate model
included, went from 12.8-13.1 to 7.7-8.4 us of CPU per 1500-byte datagram and from 26.4-28.6
to 24.0-24.7 us at 9000 (scripts/ltp_send_cpu.py, 3 reps each, interleaved): the hash (2.1 us
per 1.4 KB, 10 us per 9 KB) and the kernel's send are most of what is left.

The argument rules live in the twin (``check_recv``, ``check_message``, ...): this module calls
them on anything it does not take on its fast path, so both fail the same way, naming the
message, buffer or address that is wrong, before anything is read or sent.
"""
from cpython.buffer cimport (PyBUF_READ, PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release,
                             PyObject_GetBuffer)
from cpython.exc cimport PyErr_CheckSignals, PyErr_SetFromErrno
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.memoryview cimport PyMemoryView_FromMemory
from libc.errno cimport EAGAIN, EINTR, errno
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free
from libc.string cimport memcpy, memset
from posix.uio cimport iovec

from . import ltp_py as _twin
from . import ltp_packet as _pk


cdef extern from "<sys/socket.h>" nogil:
    ctypedef unsigned int socklen_t

    struct msghdr:
        void *msg_name
        socklen_t msg_namelen
        iovec *msg_iov
        size_t msg_iovlen
        void *msg_control
        size_t msg_controllen
        int msg_flags

    struct mmsghdr:
        msghdr msg_hdr
        unsigned int msg_len

    struct cmsghdr:
        size_t cmsg_len
        int cmsg_level
        int cmsg_type

    cmsghdr *CMSG_FIRSTHDR(msghdr *msg)
    cmsghdr *CMSG_NXTHDR(msghdr *msg, cmsghdr *cmsg)
    unsigned char *CMSG_DATA(cmsghdr *cmsg)
    enum: SOL_SOCKET
    enum: SCM_TIMESTAMPNS

    int recvmmsg(int fd, mmsghdr *msgvec, unsigned int vlen, int flags, void *timeout)
    int sendmmsg(int fd, mmsghdr *msgvec, unsigned int vlen, int flags)
    enum: MSG_DONTWAIT
    enum: AF_INET


cdef extern from "<netinet/in.h>" nogil:
    struct in_addr:
        uint32_t s_addr

    struct sockaddr_in:
        unsigned short sin_family
        uint16_t sin_port
        in_addr sin_addr

    uint16_t ntohs(uint16_t)
    uint16_t htons(uint16_t)
    uint32_t ntohl(uint32_t)


cdef extern from "<arpa/inet.h>" nogil:
    int inet_pton(int af, const char *src, void *dst)
    const char *inet_ntop(int af, const void *src, char *dst, socklen_t size)


cdef enum:
    MAX_BATCH = 1024        # messages per recvmmsg / sendmmsg call (UIO_MAXIOV)
    MAX_BUFFERS = 1024      # iovecs per datagram (IOV_MAX)
    CACHE_SIZE = 4096       # addresses remembered each way

# peer address <-> Python (host, port) tuple, both ways: a server sees the same few workers'
# addresses over and over (bounded: cleared when full)
cdef dict _peers = {}          # (ip << 16 | port) -> (host, port)
cdef dict _sockaddrs = {}      # (host, port) -> 16 bytes of struct sockaddr_in


cdef object _peer(const sockaddr_in *sa):
    cdef uint32_t ip = ntohl(sa.sin_addr.s_addr)
    cdef uint16_t port = ntohs(sa.sin_port)
    cdef object k = (<unsigned long long> ip << 16) | port
    cdef object addr = _peers.get(k)
    cdef char text[16]
    if addr is None:
        inet_ntop(AF_INET, &sa.sin_addr, text, 16)
        addr = (text.decode("ascii"), port)
        if len(_peers) >= CACHE_SIZE:
            _peers.clear()
        _peers[k] = addr
    return addr


cdef int _raise_errno(int err) except -1:
    global errno
    errno = err
    PyErr_SetFromErrno(OSError)
    return -1


DEF STAMP_SPACE = 64            # control bytes per message: CMSG_SPACE(16) is 32 on Linux

# The last socket the twin's ``check_socket`` passed (a socket's family and type never change):
# a worker or a server calls these functions on one socket, thousands of times a second, and
# the check reads ``sock.family`` and ``sock.type`` through Python's enum conversions (measured
# with cProfile: 5% of a worker's I/O thread).
cdef object _ok_socket = None


cdef int _check_socket(sock, what) except -1:
    global _ok_socket
    if sock is not _ok_socket:
        _twin.check_socket(sock, what)
        _ok_socket = sock
    return 0


def recv_batch(sock, ring, Py_ssize_t slot_size, int max_batch, list stamps=None):
    """Read up to ``max_batch`` waiting datagrams, datagram i into
    ``ring[i * slot_size:(i + 1) * slot_size]``; ``[(nbytes, (host, port)), ...]``.  With a
    list ``stamps``, each datagram's SO_TIMESTAMPNS arrival time (float seconds) or None is
    appended to it."""
    cdef Py_buffer view
    if not 1 <= max_batch <= MAX_BATCH or slot_size < 1:
        _twin.check_recv(sock, ring, slot_size, max_batch)      # raises, naming the argument
    _check_socket(sock, "recv_batch")
    try:
        PyObject_GetBuffer(ring, &view, PyBUF_WRITABLE)
    except (TypeError, BufferError, ValueError):
        _twin.check_recv(sock, ring, slot_size, max_batch)      # raises, naming the ring
        raise
    if view.len < slot_size * max_batch:
        PyBuffer_Release(&view)
        _twin.check_recv(sock, ring, slot_size, max_batch)      # raises, naming the ring
    cdef int fd = sock.fileno()
    cdef char *base = <char *> view.buf
    cdef mmsghdr *msgs = <mmsghdr *> calloc(max_batch, sizeof(mmsghdr))
    cdef iovec *iov = <iovec *> calloc(max_batch, sizeof(iovec))
    cdef sockaddr_in *names = <sockaddr_in *> calloc(max_batch, sizeof(sockaddr_in))
    cdef char *control = NULL
    cdef int i, r = -1, err = 0
    cdef const sockaddr_in *prev = NULL
    cdef cmsghdr *cm
    cdef int64_t *ts
    cdef object addr = None
    cdef object stamp
    cdef list out = []
    try:
        if msgs == NULL or iov == NULL or names == NULL:
            raise MemoryError()
        if stamps is not None:
            control = <char *> calloc(max_batch, STAMP_SPACE)
            if control == NULL:
                raise MemoryError()
        for i in range(max_batch):
            iov[i].iov_base = base + i * slot_size
            iov[i].iov_len = slot_size
            msgs[i].msg_hdr.msg_name = &names[i]
            msgs[i].msg_hdr.msg_namelen = sizeof(sockaddr_in)
            msgs[i].msg_hdr.msg_iov = &iov[i]
            msgs[i].msg_hdr.msg_iovlen = 1
            if control != NULL:
                msgs[i].msg_hdr.msg_control = control + i * STAMP_SPACE
                msgs[i].msg_hdr.msg_controllen = STAMP_SPACE
        with nogil:
            r = recvmmsg(fd, msgs, max_batch, MSG_DONTWAIT, NULL)
            if r < 0:
                err = errno
        if r < 0:
            if err == EAGAIN:                 # (EWOULDBLOCK on Linux)
                return out
            if err == EINTR:
                PyErr_CheckSignals()       # a handler's exception propagates
                return out
            _raise_errno(err)
        for i in range(r):
            if prev == NULL or prev.sin_addr.s_addr != names[i].sin_addr.s_addr \
                    or prev.sin_port != names[i].sin_port:
                addr = _peer(&names[i])
                prev = &names[i]
            out.append((msgs[i].msg_len, addr))
            if control != NULL:
                stamp = None
                cm = CMSG_FIRSTHDR(&msgs[i].msg_hdr)
                while cm != NULL:
                    if cm.cmsg_level == SOL_SOCKET and cm.cmsg_type == SCM_TIMESTAMPNS:
                        ts = <int64_t *> CMSG_DATA(cm)
                        stamp = ts[0] + ts[1] * 1e-9
                        break
                    cm = CMSG_NXTHDR(&msgs[i].msg_hdr, cm)
                stamps.append(stamp)
        return out
    finally:
        free(msgs)
        free(iov)
        free(names)
        free(control)
        PyBuffer_Release(&view)


cdef int _refuse(list items) except -1:
    """Raise the error the twin raises for ``items`` (its checks, message by message)."""
    for i, msg in enumerate(items):
        _twin.check_message(msg, i)
    raise AssertionError("send_batch: the twin accepts messages the compiled module refused")


cdef object _sockaddr_of(object addr):
    """16 bytes of ``struct sockaddr_in`` for ``addr`` (cached), or None if it is not an IPv4
    (host, port) the twin accepts."""
    cdef object packed
    if type(addr) is tuple and len(<tuple> addr) == 2 and type((<tuple> addr)[0]) is str \
            and type((<tuple> addr)[1]) is int:
        packed = _sockaddrs.get(addr)
        if packed is not None:
            return packed
    else:
        return None
    try:
        host, port = _twin.address(addr, 0)
    except ValueError:
        return None
    cdef sockaddr_in sa
    memset(&sa, 0, sizeof(sockaddr_in))
    sa.sin_family = AF_INET
    sa.sin_port = htons(<uint16_t> port)
    if inet_pton(AF_INET, host.encode("ascii"), &sa.sin_addr) != 1:
        return None
    packed = PyBytes_FromStringAndSize(<char *> &sa, sizeof(sockaddr_in))
    if len(_sockaddrs) >= CACHE_SIZE:
        _sockaddrs.clear()
    _sockaddrs[addr] = packed
    return packed


cdef Py_ssize_t _send_all(int fd, mmsghdr *hdrs, Py_ssize_t n) except -1:
    """sendmmsg the ``n`` messages at ``hdrs`` without blocking, as many calls as needed; how
    many were sent (fewer when the send buffer filled up or a later datagram failed: the next
    call reports it); an error at the first raises OSError."""
    cdef Py_ssize_t sent = 0
    cdef int r = 0, err = 0
    while sent < n:
        with nogil:
            r = sendmmsg(fd, hdrs + sent, <unsigned int> min(n - sent, MAX_BATCH), MSG_DONTWAIT)
            if r < 0:
                err = errno
        if r > 0:
            sent += r
            continue
        if r == 0:                                 # pragma: no cover - not on Linux
            break
        if err == EINTR:
            PyErr_CheckSignals()                   # a handler's exception propagates
            continue
        if err == EAGAIN or sent:                  # (EWOULDBLOCK on Linux)
            break
        _raise_errno(err)
    return sent


def send_batch(sock, msgs):
    """Send each ``(buffers, (host, port))`` of ``msgs`` as one datagram gathered from its
    buffers; returns how many were sent (0: the send buffer is full)."""
    _check_socket(sock, "send_batch")
    if not isinstance(msgs, list):
        msgs = list(msgs)
    cdef list items = <list> msgs
    cdef Py_ssize_t n = len(items), nbuf = 0, i, j, k = 0, m
    cdef object msg, bufs
    for i in range(n):
        msg = items[i]
        if type(msg) is not tuple or len(<tuple> msg) != 2:
            _refuse(items)
        bufs = (<tuple> msg)[0]
        if type(bufs) is not list and type(bufs) is not tuple or len(bufs) > MAX_BUFFERS:
            _refuse(items)
        nbuf += len(bufs)
    if n == 0:
        return 0
    cdef int fd = sock.fileno()
    cdef mmsghdr *hdrs = <mmsghdr *> calloc(n, sizeof(mmsghdr))
    cdef sockaddr_in *names = <sockaddr_in *> calloc(n, sizeof(sockaddr_in))
    cdef iovec *iov = <iovec *> calloc(nbuf if nbuf else 1, sizeof(iovec))
    cdef Py_buffer *views = <Py_buffer *> calloc(nbuf if nbuf else 1, sizeof(Py_buffer))
    cdef Py_ssize_t held = 0
    cdef object packed
    cdef object b
    try:
        if hdrs == NULL or names == NULL or iov == NULL or views == NULL:
            raise MemoryError()
        for i in range(n):
            msg = items[i]
            bufs = (<tuple> msg)[0]
            hdrs[i].msg_hdr.msg_name = &names[i]
            hdrs[i].msg_hdr.msg_namelen = sizeof(sockaddr_in)
            hdrs[i].msg_hdr.msg_iov = &iov[k]
            m = len(bufs)
            hdrs[i].msg_hdr.msg_iovlen = m
            for j in range(m):
                b = bufs[j]
                try:
                    PyObject_GetBuffer(b, &views[k], PyBUF_SIMPLE)
                except (TypeError, BufferError):
                    _refuse(items)
                    raise
                held += 1
                iov[k].iov_base = views[k].buf
                iov[k].iov_len = views[k].len
                k += 1
            packed = _sockaddr_of((<tuple> msg)[1])
            if packed is None:
                _refuse(items)
            memcpy(&names[i], PyBytes_AS_STRING(packed), sizeof(sockaddr_in))
        return _send_all(fd, hdrs, n)
    finally:
        for i in range(held):
            PyBuffer_Release(&views[i])
        free(views)
        free(iov)
        free(names)
        free(hdrs)


# ---------------------------------------------------------------------------------- open_batch
# kernels/ltp_packet.py's layout (little-endian): magic 0, version 2, type 3, worker 4, dtype 6,
# pn 8, key 12, plan version 16, round 20, offset 28, length 36, seq 44, count 48; payload 52;
# tag -16
cdef enum:
    HEADER = 52
    TAG = 16
    OVERHEAD = 68

assert _pk.HEADER_SIZE == HEADER and _pk.TAG_SIZE == TAG and _pk.MAGIC == b"LT", \
    "mxps/kernels/_ltp is out of date with mxps/kernels/ltp_packet.py: rebuild it (pip install .)"

cdef int _VERSION = _pk.VERSION
cdef int _DATA = _pk.DATA
cdef int _END = _pk.END
cdef object _Fields = _pk.Fields


cdef inline uint64_t _u(const uint8_t *p, int n) noexcept nogil:
    """An ``n``-byte little-endian unsigned integer."""
    cdef uint64_t v = 0
    cdef int i
    for i in range(n - 1, -1, -1):
        v = (v << 8) | p[i]
    return v


cdef struct _Head:
    # a verified packet's header (kernels/ltp_packet.py's fields)
    int type_
    Py_ssize_t worker
    int dtype
    int itemsize
    uint32_t pn
    int32_t key
    uint32_t plan_version
    int64_t round_
    uint64_t offset
    uint64_t length
    uint32_t seq
    uint32_t count


cdef bint _check(const uint8_t *p, Py_ssize_t size, object addr, list paths,
                 object itemsize_of, int *itemsizes, _Head *h) except -1:
    """Whether the datagram at ``p`` is one a server accepts (``open_batch``'s checks); if so
    its header is decoded into ``h``."""
    if size < OVERHEAD or p[0] != 76 or p[1] != 84 or p[2] != _VERSION:      # b"LT"
        return False
    cdef Py_ssize_t worker = p[4] | (p[5] << 8)
    if worker >= len(paths):
        return False
    entry = paths[worker]
    if entry is None:
        return False
    registered, tagger = entry
    if registered is not addr and registered != addr:
        return False
    hs = tagger._base.copy()          # packet.Tagger's keyed BLAKE2b state
    hs.update(PyMemoryView_FromMemory(<char *> p, size - TAG, PyBUF_READ))
    digest = hs.digest()
    cdef const uint8_t *d = <const uint8_t *> PyBytes_AS_STRING(digest)
    cdef uint8_t diff = 0
    cdef int i
    for i in range(TAG):                     # constant time, as hmac.compare_digest
        diff |= d[i] ^ p[size - TAG + i]
    if diff:
        return False
    cdef int type_ = p[3], dtype = p[6], itemsize = 0
    cdef uint64_t count = _u(p + 48, 4)
    cdef Py_ssize_t payload = size - OVERHEAD
    if type_ == _DATA:
        itemsize = itemsizes[dtype]
        if itemsize == -2:                   # not asked yet in this batch
            try:
                itemsize = itemsizes[dtype] = itemsize_of(dtype)
            except Exception:                # refused: the reference path says how
                itemsize = itemsizes[dtype] = -1
        if itemsize < 0 or count == 0 or <uint64_t> payload != count * <uint64_t> itemsize:
            return False
    elif type_ == _END:
        if payload or count:
            return False
    else:
        return False
    h.type_ = type_
    h.worker = worker
    h.dtype = dtype
    h.itemsize = itemsize
    h.pn = <uint32_t> _u(p + 8, 4)
    h.key = <int32_t> _u(p + 12, 4)
    h.plan_version = <uint32_t> _u(p + 16, 4)
    h.round_ = <int64_t> _u(p + 20, 8)
    h.offset = _u(p + 28, 8)
    h.length = _u(p + 36, 8)
    h.seq = <uint32_t> _u(p + 44, 4)
    h.count = <uint32_t> count
    return True


cdef object _opened(const _Head *h, object view, Py_ssize_t lo, Py_ssize_t size):
    """``(Fields, payload)`` of a checked datagram of ``size`` bytes at ``view[lo:]``."""
    f = _Fields(h.type_, h.worker, h.dtype, h.pn, h.key, h.plan_version, h.round_, h.offset,
                h.length, h.seq, h.count)
    return f, view[lo + HEADER:lo + size - TAG]


cdef object _open(const uint8_t *p, Py_ssize_t size, object addr, list paths, object view,
                  Py_ssize_t lo, object itemsize_of, int *itemsizes):
    """(Fields, payload) of one acceptable datagram at ``p``, or None."""
    cdef _Head h
    if not _check(p, size, addr, paths, itemsize_of, itemsizes, &h):
        return None
    return _opened(&h, view, lo, size)


def open_batch(view, Py_ssize_t slot_size, list got, list paths, itemsize_of):
    """Open each datagram of a ``recv_batch`` result: ``(Fields, payload)`` or None each."""
    cdef Py_buffer buf
    PyObject_GetBuffer(view, &buf, PyBUF_SIMPLE)
    cdef list out = []
    cdef Py_ssize_t i, size, n = len(got)
    cdef int itemsizes[256]
    for i in range(256):
        itemsizes[i] = -2
    try:
        if n * slot_size > buf.len:
            _twin.check_open(view, slot_size, got)            # raises, naming the problem
        for i in range(n):
            size, addr = got[i]
            if not 0 <= size <= slot_size:
                _twin.check_open(view, slot_size, got)        # raises, naming the datagram
            out.append(_open(<const uint8_t *> buf.buf + i * slot_size, size, addr, paths,
                             view, i * slot_size, itemsize_of, itemsizes))
        return out
    finally:
        PyBuffer_Release(&buf)


# ------------------------------------------------------------------------------------ send_run
cdef inline void _put(uint8_t *p, uint64_t v, int n) noexcept nogil:
    """``v`` as ``n`` little-endian bytes at ``p``."""
    cdef int i
    for i in range(n):
        p[i] = <uint8_t> (v & 0xFF)
        v >>= 8


cdef bint _fields_ok(worker, dtype, key, plan_version, round_, offset, length):
    """The twin's ``check_fields`` where it passes (exact ints within their fields)."""
    cdef int64_t lo
    cdef uint64_t hi
    if not (type(worker) is int and type(dtype) is int and type(key) is int
            and type(plan_version) is int and type(round_) is int and type(offset) is int
            and type(length) is int):
        return False
    try:
        lo = round_                            # int64: the round's whole field
        hi = offset                            # uint64: offset and length
        hi = length
        lo = key
        if not -2 ** 31 <= lo < 2 ** 31:
            return False
        hi = plan_version
        if hi > 0xFFFFFFFF:
            return False
        hi = worker
        if hi > 0xFFFF:
            return False
        hi = dtype
        return hi <= 0xFF
    except OverflowError:
        return False


def send_run(sock, addr, tagger, worker, dtype, key, plan_version, round_, offset, length, data,
             Py_ssize_t itemsize, Py_ssize_t epp, Py_ssize_t seq, Py_ssize_t k, pn):
    """DATA packets ``seq .. seq + k - 1`` of one slice, made and sent with one ``sendmmsg``:
    the twin's ``send_run`` (the datagrams ``packet.encode`` makes; ``send_batch``'s return
    value and errors).  Each datagram is laid out whole in one buffer (header, a copy of its
    payload, tag), so its tag is one update of ``tagger``'s keyed BLAKE2b state."""
    # the twin's argument rules, checked in C where they hold (the twin's check_* on anything
    # else: it raises, naming what is wrong)
    if not _fields_ok(worker, dtype, key, plan_version, round_, offset, length):
        _twin.check_fields(worker, dtype, key, plan_version, round_, offset, length)
    cdef object packed = _sockaddr_of(addr)
    cdef Py_buffer view
    cdef uint64_t n_len = 0, u_pn = 0
    cdef bint held = False
    try:
        _check_socket(sock, "send_run")
        PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
        held = True
        n_len, u_pn = length, pn
        ok = (packed is not None and itemsize >= 1 and epp >= 1
              and <uint64_t> view.len == n_len * <uint64_t> itemsize
              and seq >= 0 and k >= 0 and seq + k <= <Py_ssize_t> ((n_len + epp - 1) // epp))
    except (TypeError, ValueError, BufferError, OverflowError):
        ok = False
    if not ok:
        if held:
            PyBuffer_Release(&view)
        _twin.check_run(sock, addr, data, itemsize, epp, length, seq, k, pn)
        raise AssertionError("send_run: the twin accepts arguments the compiled module refused")
    if k == 0:
        PyBuffer_Release(&view)
        return 0
    cdef int fd = sock.fileno()
    cdef Py_ssize_t slot = HEADER + epp * itemsize + TAG
    cdef uint8_t *buf = <uint8_t *> calloc(k, slot)
    cdef mmsghdr *hdrs = <mmsghdr *> calloc(k, sizeof(mmsghdr))
    cdef iovec *iov = <iovec *> calloc(k, sizeof(iovec))
    cdef sockaddr_in name
    cdef Py_ssize_t i, s, count, size
    cdef uint8_t *p
    memcpy(&name, PyBytes_AS_STRING(packed), sizeof(sockaddr_in))
    base = tagger._base
    cls = type(base)
    copy, update, digest = cls.copy, cls.update, cls.digest
    try:
        if buf == NULL or hdrs == NULL or iov == NULL:
            raise MemoryError()
        # the header fields every packet of the run shares, once
        p = buf
        p[0] = 76
        p[1] = 84                                          # b"LT"
        p[2] = <uint8_t> _VERSION
        p[3] = <uint8_t> _DATA
        _put(p + 4, <uint64_t> worker, 2)
        p[6] = <uint8_t> dtype
        p[7] = 0
        _put(p + 12, <uint64_t> (<int64_t> key), 4)
        _put(p + 16, <uint64_t> plan_version, 4)
        _put(p + 20, <uint64_t> (<int64_t> round_), 8)
        _put(p + 28, <uint64_t> offset, 8)
        _put(p + 36, n_len, 8)
        for i in range(k):
            s = seq + i
            count = min(<uint64_t> epp, n_len - <uint64_t> s * epp)
            size = HEADER + count * itemsize + TAG
            p = buf + i * slot
            if i:
                memcpy(p, buf, HEADER)
            _put(p + 8, (u_pn + i) & 0xFFFFFFFF, 4)
            _put(p + 44, <uint64_t> s, 4)
            _put(p + 48, <uint64_t> count, 4)
            memcpy(p + HEADER, <char *> view.buf + s * epp * itemsize, count * itemsize)
            h = copy(base)
            update(h, PyMemoryView_FromMemory(<char *> p, size - TAG, PyBUF_READ))
            memcpy(p + size - TAG, PyBytes_AS_STRING(digest(h)), TAG)
            iov[i].iov_base = p
            iov[i].iov_len = size
            hdrs[i].msg_hdr.msg_name = &name
            hdrs[i].msg_hdr.msg_namelen = sizeof(sockaddr_in)
            hdrs[i].msg_hdr.msg_iov = &iov[i]
            hdrs[i].msg_hdr.msg_iovlen = 1
        return _send_all(fd, hdrs, k)
    finally:
        PyBuffer_Release(&view)
        free(iov)
        free(hdrs)
        free(buf)


from .accum import add_into as _add_into

DEF _F32 = 0
DEF _F64 = 1


ctypedef fused _real:
    float
    double


cdef inline void _add_run(_real *a, const _real *b, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        a[i] += b[i]


def round_add(acc, unsigned short[::1] counts, unsigned char[::1] seen, Py_ssize_t seq,
              Py_ssize_t epp, Py_ssize_t count, payload, int dtype_code):
    """One worker's DATA packet into a round's accumulator: the twin's ``round_add``, float32
    and float64 summed here, other dtypes by ``kernels.accum.add_into``."""
    cdef Py_ssize_t n = counts.shape[0], length = acc.size, want, lo, size
    cdef Py_buffer a, b
    if seq < 0 or seq >= n:
        _twin.check_round_add(n, length, seq, epp, count)          # raises, naming the packet
    want = min(epp, length - seq * epp)
    if count != want:
        _twin.check_round_add(n, length, seq, epp, count)
    if seen.shape[0] < n:
        raise ValueError("round_add: %d seen flags for %d packets" % (seen.shape[0], n))
    if seen[seq]:
        return False
    lo = seq * epp
    if dtype_code == _F32 or dtype_code == _F64:
        size = 4 if dtype_code == _F32 else 8
        PyObject_GetBuffer(acc, &a, PyBUF_WRITABLE)
        try:
            PyObject_GetBuffer(payload, &b, PyBUF_SIMPLE)
            try:
                if a.len != length * size or b.len != count * size:
                    raise ValueError("round_add: %d accumulator and %d payload bytes for %d and "
                                     "%d float%d" % (a.len, b.len, length, count, 8 * size))
                with nogil:
                    if dtype_code == _F32:
                        _add_run((<float *> a.buf) + lo, <const float *> b.buf, count)
                    else:
                        _add_run((<double *> a.buf) + lo, <const double *> b.buf, count)
            finally:
                PyBuffer_Release(&b)
        finally:
            PyBuffer_Release(&a)
    else:
        _add_into(acc[lo:lo + count], payload, dtype_code)
    seen[seq] = 1
    counts[seq] += 1
    return True


# ============================================================== the server's packet intake
# The twin's ``PathCore``, ``ShareCore``, ``RoundCore``, ``take_common`` and ``intake`` (ltp_py
# says what they do and why): the same state, changed the same way, typed so that ``intake``
# takes a batch of datagrams in C and hands back only those a server must look at itself.
from libc.math cimport isnan, NAN
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE
from cpython.list cimport PyList_GET_ITEM
from cpython.buffer cimport PyBUF_C_CONTIGUOUS

import numpy as np

cdef int _IN_ORDER = _twin.IN_ORDER
cdef int _REORDERED = _twin.REORDERED
cdef int _IN_HOST = _twin.IN_HOST
cdef int64_t _BLOCK = _twin.BLOCK
cdef double _LOSS_WEIGHT = _twin.LOSS_WEIGHT
cdef double _WINDOW = _twin.WINDOW
cdef double _IDLE_GAP = _twin.IDLE_GAP
cdef double _TRAIN_SKIP = _twin.TRAIN_SKIP
cdef int64_t _PN_MASK = _pk.PN_MASK
DEF _NTALLY = 6
assert (_twin.T_PACKETS, _twin.T_BYTES, _twin.T_OUT_OF_ORDER, _twin.T_IN_HOST, _twin.T_REORDERED,
        _twin.T_FAST) == (0, 1, 2, 3, 4, 5)


cdef inline int64_t _floordiv(int64_t a, int64_t b) noexcept nogil:
    """Python's ``a // b`` for ``b`` > 0."""
    cdef int64_t q = a // b
    if (a % b) != 0 and a < 0:
        q -= 1
    return q


cdef inline object _opt(double x):
    """A float, or None for NaN (the cores' "not yet")."""
    return None if isnan(x) else x


cdef inline double _unopt(object x) except? -1.0:
    return NAN if x is None else <double> x


cdef class PathCore:
    """The twin's ``PathCore``: the same attributes (``block_seen`` is the two counters of the
    two blocks that can be unsettled) and ``note``."""
    cdef public object addr
    cdef public object tagger
    cdef public list acks
    cdef public int64_t hi, settled, received
    cdef public double loss
    cdef int64_t _block, _seen0, _seen1
    cdef bint _has_block
    cdef double _hi_stamp

    def __init__(self, addr, tagger):
        self.addr = addr
        self.tagger = tagger
        self.acks = []
        self._has_block = False
        self._block = self._seen0 = self._seen1 = 0
        self.hi = -1
        self._hi_stamp = NAN
        self.settled = 0
        self.loss = 0.0
        self.received = 0

    @property
    def block(self):
        return self._block if self._has_block else None

    @property
    def hi_stamp(self):
        return _opt(self._hi_stamp)

    def note(self, pn, stamp=None):
        return self._note(pn, _unopt(stamp))

    cdef int _note(self, int64_t pn, double stamp) except -1:
        cdef int order = _IN_ORDER
        cdef int64_t b, seen
        cdef double missing
        self.received += 1
        if self.hi >= 0:
            pn = self.hi + (((pn - self.hi) + (<int64_t> 1 << 31)) & _PN_MASK) \
                - (<int64_t> 1 << 31)
            if pn < self.hi:
                order = _IN_HOST if (not isnan(stamp) and not isnan(self._hi_stamp)
                                     and stamp < self._hi_stamp) else _REORDERED
        b = _floordiv(pn, _BLOCK)
        if not self._has_block:
            self._block, self._has_block = b, True
        if b < self._block:
            return order
        if pn > self.hi:
            self.hi, self._hi_stamp = pn, stamp
        while _floordiv(self.hi, _BLOCK) >= self._block + 2:
            seen = min(self._seen0, _BLOCK)
            missing = 1.0 - <double> seen / _BLOCK
            self.loss = missing if not self.settled else (
                (1 - _LOSS_WEIGHT) * self.loss + _LOSS_WEIGHT * missing)
            self.settled += 1
            self._block += 1
            self._seen0, self._seen1 = self._seen1, 0
        # the twin counts b before settling; b is never settled by this call (b >= hi // BLOCK
        # - 1 once the loop is done), so counting it now is the same
        if b == self._block:
            self._seen0 += 1
        else:
            self._seen1 += 1
        return order


cdef class ShareCore:
    """The twin's ``ShareCore``: the same attributes and ``on_packet``; ``_add`` is the
    subclass's."""
    cdef public Py_ssize_t n
    cdef public bint busy_windows
    cdef public double _read_bytes
    cdef public bint _drained
    cdef public int64_t _bytes
    cdef public list _last, _sending
    cdef public Py_ssize_t _busy_workers
    cdef public double _busy
    cdef double _start_t, _read_t, _train_t, _offset_t
    cdef int64_t _phase_v
    cdef bint _has_phase

    def __init__(self, num_workers, busy_windows=True):
        self.n = num_workers
        self.busy_windows = busy_windows
        self._read_bytes = 0.0
        self._start_t = self._read_t = self._train_t = self._offset_t = NAN
        self._drained = True
        self._bytes = 0
        self._last = [None] * num_workers
        self._sending = [False] * num_workers
        self._busy_workers = 0
        self._busy = 0.0
        self._has_phase = False
        self._phase_v = 0

    @property
    def _start(self):
        return _opt(self._start_t)

    @_start.setter
    def _start(self, v):
        self._start_t = _unopt(v)

    @property
    def _read(self):
        return _opt(self._read_t)

    @_read.setter
    def _read(self, v):
        self._read_t = _unopt(v)

    @property
    def _train(self):
        return _opt(self._train_t)

    @_train.setter
    def _train(self, v):
        self._train_t = _unopt(v)

    @property
    def _offset(self):
        return _opt(self._offset_t)

    @_offset.setter
    def _offset(self, v):
        self._offset_t = _unopt(v)

    @property
    def _phase(self):
        return self._phase_v if self._has_phase else None

    @_phase.setter
    def _phase(self, v):
        self._has_phase = v is not None
        self._phase_v = v if v is not None else 0

    def on_packet(self, worker, nbytes, now, drained=True, arrival=None, end=False):
        if not 0 <= worker < self.n:          # (this module indexes lists unchecked)
            _twin.check_worker(worker, self.n)
        self._on_packet(worker, nbytes, now, drained, _unopt(arrival), end)

    cdef int _on_packet(self, Py_ssize_t worker, int64_t nbytes, object now, bint drained,
                        double arrival, bint end) except -1:
        cdef double t_now, prev, span
        cdef bint prev_drained
        self._last[worker] = now
        self._read_bytes += nbytes
        t_now = now
        if not isnan(arrival):
            if self.busy_windows:
                self._arrival(worker, nbytes, arrival, t_now, end)
                return 0
            t_now, drained = arrival, True
            if not isnan(self._read_t) and t_now < self._read_t:
                self._read_t, self._start_t, self._bytes = t_now, t_now, 0
                return 0
        if isnan(self._read_t):
            self._read_t, self._drained = t_now, drained
            self._start_t = t_now if drained else NAN
            return 0
        if t_now != self._read_t:
            prev, prev_drained = self._read_t, self._drained
            self._read_t, self._drained = t_now, drained
            if not isnan(self._start_t) and prev - self._start_t >= _WINDOW:
                span = prev - self._start_t
                if span < 4 * _WINDOW:
                    self._add(prev, self._bytes / span)
                self._start_t = NAN
            if t_now - prev >= 4 * _WINDOW:
                self._start_t, self._bytes = (t_now if drained else NAN), 0
            elif isnan(self._start_t):
                self._start_t, self._bytes = (prev if prev_drained else NAN), 0
        elif not drained:
            self._drained = False
        if not isnan(self._start_t) and t_now > self._start_t:
            self._bytes += nbytes
        return 0

    cdef int _arrival(self, Py_ssize_t worker, int64_t nbytes, double t, double now,
                      bint end) except -1:
        cdef double prev = self._read_t
        cdef bint busy
        cdef int64_t phase
        self._read_t = t
        if isnan(self._offset_t) or (not isnan(prev) and t < prev):
            self._offset_t, self._has_phase, self._busy, self._bytes = t - now, False, 0.0, 0
            prev = NAN
        busy = self._busy_workers > 0 and not isnan(prev) and t - prev < _IDLE_GAP
        if not busy:
            self._train_t = t
        sending = <object> PyList_GET_ITEM(self._sending, worker)
        if end:
            if sending:
                self._sending[worker] = False
                self._busy_workers -= 1
        elif not sending:
            self._sending[worker] = True
            self._busy_workers += 1
        phase = <int64_t> ((t - self._offset_t) / _WINDOW)
        if not self._has_phase or phase != self._phase_v:
            if self._busy >= _WINDOW / 2:
                self._add(t, self._bytes / self._busy)
            self._has_phase, self._phase_v, self._busy, self._bytes = True, phase, 0.0, 0
        if busy and t - self._train_t >= _TRAIN_SKIP:
            self._busy += t - prev
            self._bytes += nbytes
        return 0


cdef class RoundCore:
    """The twin's ``RoundCore``: the same attributes and ``add``; ``acc`` and ``counts`` keep
    a pointer to their memory for ``intake``."""
    cdef public Py_ssize_t length, epp, n, workers
    cdef public int dtype
    cdef public list seen, received, heard, ends
    cdef public object first, last
    cdef public Py_ssize_t duplicates, below
    cdef public double need
    cdef public int64_t plan_version
    cdef public bint live
    cdef object _acc, _counts
    cdef Py_buffer _acc_view
    cdef bint _has_acc_view
    cdef unsigned short[::1] _counts_mv
    cdef int _fast_size          # bytes per element intake adds in C (4, 8), 0: none

    def __init__(self, acc, epp, num_workers, dtype_code, lowest=0.0):
        self.acc = acc
        self.length = acc.size
        self.epp = epp
        self.n = _pk.packet_count(self.length, epp)
        self.workers = num_workers
        self.dtype = dtype_code
        self.counts = np.zeros(self.n, dtype=np.uint16)
        self.seen = [None] * num_workers
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
        self._refresh()

    def __dealloc__(self):
        if self._has_acc_view:
            PyBuffer_Release(&self._acc_view)

    cdef _refresh(self):
        """Whether ``intake`` can add into ``acc`` in C: float32 or float64, one writable C
        array of ``length`` elements (``_fast_size``)."""
        self._fast_size = 0
        if self._has_acc_view:
            PyBuffer_Release(&self._acc_view)
            self._has_acc_view = False
        if self._acc is None or self._counts_mv is None or (self.dtype != _F32
                                                            and self.dtype != _F64):
            return
        try:
            PyObject_GetBuffer(self._acc, &self._acc_view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS)
        except (TypeError, BufferError, ValueError):
            return
        self._has_acc_view = True
        size = 4 if self.dtype == _F32 else 8
        if self._acc_view.len == self.length * size and \
                self._counts_mv.shape[0] == self.n:
            self._fast_size = size

    @property
    def acc(self):
        return self._acc

    @acc.setter
    def acc(self, value):
        if value is not self._acc:
            self._acc = value
            self._refresh()

    @property
    def counts(self):
        return self._counts

    @counts.setter
    def counts(self, value):
        if value is not self._counts:
            self._counts = value
            try:
                self._counts_mv = value
            except (TypeError, ValueError, BufferError):
                self._counts_mv = None
            self._refresh()

    def _hear(self, worker, now):
        if self.heard[worker] is None:
            self.heard[worker] = now
        if self.first is None:
            self.first = now

    def add(self, worker, seq, count, payload, now):
        if not 0 <= worker < self.workers:
            _twin.check_worker(worker, self.workers)
        seen = self.seen[worker]
        if seen is None:
            seen = bytearray(self.n)
        if not round_add(self._acc, self._counts, seen, seq, self.epp, count, payload,
                         self.dtype):
            self.duplicates += 1
            return False
        self.seen[worker] = seen
        r = self.received[worker] = self.received[worker] + 1
        if r - 1 < self.need <= r:
            self.below -= 1
        if self.heard[worker] is None:
            self._hear(worker, now)
        self.last = now
        return True


cdef int _take_common(Py_ssize_t worker, int64_t pn, bint end, int64_t nbytes, double stamp,
                      object now, bint drained, list paths, ShareCore share, list touched,
                      int64_t *tally) except -1:
    cdef PathCore path = <PathCore?> paths[worker]
    cdef int order = path._note(pn, stamp)
    if order == _REORDERED:
        tally[4] = 1
        tally[2] += 1
    elif order == _IN_HOST:
        tally[3] += 1
    path.acks.append(pn)
    share._on_packet(worker, nbytes, now, drained, stamp, end)
    touched[worker] = True
    tally[0] += 1
    tally[1] += nbytes
    return 0


cdef int _fold(list tally, int64_t *t) except -1:
    cdef int k
    for k in range(_NTALLY):
        if t[k]:
            tally[k] = (tally[k] | t[k]) if k == 4 else tally[k] + t[k]
    return 0


def take_common(worker, pn, end, nbytes, stamp, now, drained, list paths, ShareCore share,
                list touched, list tally):
    """The twin's ``take_common``."""
    if not 0 <= worker < min(len(paths), len(touched)):
        _twin.check_worker(worker, min(len(paths), len(touched)))
    cdef int64_t t[_NTALLY]
    memset(t, 0, sizeof(t))
    _take_common(worker, pn, end, nbytes, _unopt(stamp), now, drained, paths, share, touched,
                 t)
    _fold(tally, t)


cdef bint _fast_add(const _Head *h, const uint8_t *payload, object now, dict fast,
                    int64_t plan_version) except -1:
    """The twin's ``_fast_add`` on a checked header and its payload in the ring."""
    cdef object found = fast.get((h.key, h.offset, h.round_))
    if found is None or not isinstance(found, RoundCore):
        return False
    cdef RoundCore rnd = <RoundCore> found
    if not rnd.live or h.plan_version != plan_version or rnd.plan_version != plan_version \
            or h.dtype != rnd.dtype or rnd._fast_size == 0 or h.itemsize != rnd._fast_size \
            or h.length != <uint64_t> rnd.length or h.worker >= rnd.workers:
        return False
    cdef Py_ssize_t w = h.worker, seq = h.seq, lo
    cdef object seen = <object> PyList_GET_ITEM(rnd.seen, w)
    if type(seen) is not bytearray or PyByteArray_GET_SIZE(seen) < rnd.n \
            or <object> PyList_GET_ITEM(rnd.heard, w) is None or seq >= rnd.n:
        return False
    cdef char *s = PyByteArray_AS_STRING(seen)
    if s[seq] or h.count != min(rnd.epp, rnd.length - seq * rnd.epp):
        return False
    cdef object r_obj = <object> PyList_GET_ITEM(rnd.received, w)
    cdef Py_ssize_t r = r_obj
    cdef bint crossing = r < rnd.need <= r + 1       # the part reaches the lowest ratio
    if rnd.below - crossing <= 0:
        return False
    lo = seq * rnd.epp
    with nogil:
        if rnd._fast_size == 4:
            _add_run((<float *> rnd._acc_view.buf) + lo, <const float *> payload, h.count)
        else:
            _add_run((<double *> rnd._acc_view.buf) + lo, <const double *> payload, h.count)
    s[seq] = 1
    rnd._counts_mv[seq] += 1
    rnd.received[w] = r + 1
    rnd.below -= crossing
    rnd.last = now
    return True


def intake(view, Py_ssize_t slot_size, list got, list stamps, Py_ssize_t start, now,
           bint drained, list opened_paths, list paths, ShareCore share, itemsize_of,
           list touched, list tally, dict fast=None, plan_version=0):
    """The twin's ``intake``."""
    cdef Py_buffer buf
    cdef Py_ssize_t i, n = len(got), size
    cdef int itemsizes[256]
    cdef int64_t t[_NTALLY]
    cdef int64_t pv = plan_version
    cdef _Head h
    cdef const uint8_t *p
    cdef object stamp, entry
    cdef double st
    memset(t, 0, sizeof(t))
    for i in range(256):
        itemsizes[i] = -2
    PyObject_GetBuffer(view, &buf, PyBUF_SIMPLE)
    try:
        if n * slot_size > buf.len:
            _twin.check_open(view, slot_size, got)            # raises, naming the problem
        for i in range(start, n):
            entry = got[i]
            size = entry[0]
            if not 0 <= size <= slot_size:
                _twin.check_open(view, slot_size, got)        # raises, naming the datagram
            p = <const uint8_t *> buf.buf + i * slot_size
            if not _check(p, size, entry[1], opened_paths, itemsize_of, itemsizes, &h):
                return i, None
            stamp = stamps[i] if stamps else None
            st = NAN if stamp is None else <double> stamp
            _take_common(h.worker, h.pn, h.type_ == _END, size, st, now, drained, paths, share,
                         touched, t)
            if h.type_ != _DATA or fast is None or not _fast_add(&h, p + HEADER, now, fast, pv):
                return i, _opened(&h, view, i * slot_size, size)
            t[5] += 1
        return n, None
    finally:
        PyBuffer_Release(&buf)
        _fold(tally, t)


# --------------------------------------------------------------------------------- encode_acks
from libc.stdlib cimport qsort

cdef int _ACK = _pk.ACK
cdef Py_ssize_t _MAX_ACK_RANGES = _pk.MAX_ACK_RANGES
DEF ACK_HEAD = 16
assert _pk.ACK_HEADER_SIZE == ACK_HEAD


cdef int _cmp_u32(const void *a, const void *b) noexcept nogil:
    cdef uint32_t x = (<const uint32_t *> a)[0], y = (<const uint32_t *> b)[0]
    return (x > y) - (x < y)


cdef inline uint64_t _kbps(double rate):
    if rate > 0:
        return min(<uint64_t> (rate / 1000.0), <uint64_t> 0xFFFFFFFF)
    return 0


def encode_acks(tagger, worker, pns, grant=0.0, start=0.0):
    """``packet.encode_acks``: ACK datagrams naming every packet number in ``pns`` (each
    below 2**32), with the rates ``grant`` and ``start``."""
    cdef list items = pns if type(pns) is list else list(pns)
    cdef Py_ssize_t n = len(items), i, m = 0, r, k, lo, hi, chunk
    cdef uint32_t *v = <uint32_t *> calloc(n if n else 1, sizeof(uint32_t))
    cdef uint32_t *first = NULL
    cdef uint32_t *count = NULL
    cdef uint64_t kbps = _kbps(grant), start_kbps = _kbps(start)
    cdef uint8_t *p
    cdef list out = []
    if v == NULL:
        raise MemoryError()
    try:
        for i in range(n):
            v[i] = <uint32_t> items[i]
        with nogil:
            qsort(v, n, sizeof(uint32_t), _cmp_u32)
        first = <uint32_t *> calloc(n if n else 1, sizeof(uint32_t))
        count = <uint32_t *> calloc(n if n else 1, sizeof(uint32_t))
        if first == NULL or count == NULL:
            raise MemoryError()
        for i in range(n):             # sorted runs of distinct numbers
            if m and (<uint64_t> first[m - 1]) + count[m - 1] == v[i]:
                count[m - 1] += 1
            elif not (m and (<uint64_t> first[m - 1]) + count[m - 1] > v[i]):
                first[m], count[m] = v[i], 1
                m += 1
        base = tagger._base
        for lo in range(0, m, _MAX_ACK_RANGES):
            hi = min(m, lo + _MAX_ACK_RANGES)
            chunk = hi - lo
            body = PyBytes_FromStringAndSize(NULL, ACK_HEAD + 8 * chunk)
            p = <uint8_t *> PyBytes_AS_STRING(body)
            p[0] = 76
            p[1] = 84
            p[2] = <uint8_t> _VERSION
            p[3] = <uint8_t> _ACK
            _put(p + 4, <uint64_t> worker, 2)
            _put(p + 6, <uint64_t> chunk, 2)
            _put(p + 8, kbps, 4)
            _put(p + 12, start_kbps, 4)
            for r in range(chunk):
                _put(p + ACK_HEAD + 8 * r, first[lo + r], 4)
                _put(p + ACK_HEAD + 8 * r + 4, count[lo + r], 4)
            h = base.copy()
            h.update(body)
            out.append(body + h.digest())
        return out
    finally:
        free(v)
        free(first)
        free(count)
