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
from ..ltp import packet as _pk


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


def recv_batch(sock, ring, Py_ssize_t slot_size, int max_batch, list stamps=None):
    """Read up to ``max_batch`` waiting datagrams, datagram i into
    ``ring[i * slot_size:(i + 1) * slot_size]``; ``[(nbytes, (host, port)), ...]``.  With a
    list ``stamps``, each datagram's SO_TIMESTAMPNS arrival time (float seconds) or None is
    appended to it."""
    _twin.check_recv(sock, ring, slot_size, max_batch)
    cdef int fd = sock.fileno()
    cdef Py_buffer view
    PyObject_GetBuffer(ring, &view, PyBUF_WRITABLE)
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
    _twin.check_socket(sock, "send_batch")
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
# ltp/packet.py's layout (little-endian): magic 0, version 2, type 3, worker 4, dtype 6, pn 8,
# key 12, plan version 16, round 20, offset 28, length 36, seq 44, count 48; payload 52; tag -16
cdef enum:
    HEADER = 52
    TAG = 16
    OVERHEAD = 68

assert _pk.HEADER_SIZE == HEADER and _pk.TAG_SIZE == TAG and _pk.MAGIC == b"LT", \
    "mxps/kernels/_ltp is out of date with mxps/ltp/packet.py: rebuild it (pip install .)"

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


cdef object _open(const uint8_t *p, Py_ssize_t size, object addr, list paths, object view,
                  Py_ssize_t lo, object itemsize_of, int *itemsizes):
    """(Fields, payload) of one acceptable datagram at ``p``, or None."""
    if size < OVERHEAD or p[0] != 76 or p[1] != 84 or p[2] != _VERSION:      # b"LT"
        return None
    cdef Py_ssize_t worker = p[4] | (p[5] << 8)
    if worker >= len(paths):
        return None
    entry = paths[worker]
    if entry is None:
        return None
    registered, tagger = entry
    if registered is not addr and registered != addr:
        return None
    h = tagger._base.copy()           # packet.Tagger's keyed BLAKE2b state
    h.update(PyMemoryView_FromMemory(<char *> p, size - TAG, PyBUF_READ))
    digest = h.digest()
    cdef const uint8_t *d = <const uint8_t *> PyBytes_AS_STRING(digest)
    cdef uint8_t diff = 0
    cdef int i
    for i in range(TAG):                     # constant time, as hmac.compare_digest
        diff |= d[i] ^ p[size - TAG + i]
    if diff:
        return None
    cdef int type_ = p[3], dtype = p[6], itemsize
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
            return None
    elif type_ == _END:
        if payload or count:
            return None
    else:
        return None
    f = _Fields(type_, worker, dtype, _u(p + 8, 4), <int32_t> _u(p + 12, 4), _u(p + 16, 4),
                <int64_t> _u(p + 20, 8), _u(p + 28, 8), _u(p + 36, 8), _u(p + 44, 4), count)
    return f, view[lo + HEADER:lo + size - TAG]


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


def send_run(sock, addr, tagger, worker, dtype, key, plan_version, round_, offset, length, data,
             Py_ssize_t itemsize, Py_ssize_t epp, Py_ssize_t seq, Py_ssize_t k, pn):
    """DATA packets ``seq .. seq + k - 1`` of one slice, made and sent with one ``sendmmsg``:
    the twin's ``send_run`` (the datagrams ``packet.encode`` makes; ``send_batch``'s return
    value and errors).  Each datagram is laid out whole in one buffer (header, a copy of its
    payload, tag), so its tag is one update of ``tagger``'s keyed BLAKE2b state."""
    _twin.check_fields(worker, dtype, key, plan_version, round_, offset, length)
    _twin.check_run(sock, addr, data, itemsize, epp, length, seq, k, pn)
    if k == 0:
        return 0
    cdef object packed = _sockaddr_of(addr)
    if packed is None:                                   # pragma: no cover - check_run refuses
        _twin.address(addr, 0)
        raise ValueError("send_run: the address %r is not IPv4" % (addr,))
    cdef int fd = sock.fileno()
    cdef Py_ssize_t slot = HEADER + epp * itemsize + TAG
    cdef uint64_t n_len = length, u_pn = pn
    cdef uint8_t *buf = <uint8_t *> calloc(k, slot)
    cdef mmsghdr *hdrs = <mmsghdr *> calloc(k, sizeof(mmsghdr))
    cdef iovec *iov = <iovec *> calloc(k, sizeof(iovec))
    cdef sockaddr_in name
    cdef Py_buffer view
    cdef Py_ssize_t i, s, count, size
    cdef uint8_t *p
    memcpy(&name, PyBytes_AS_STRING(packed), sizeof(sockaddr_in))
    base = tagger._base
    cls = type(base)
    copy, update, digest = cls.copy, cls.update, cls.digest
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
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
