"""LTP's datagrams: a slice of a gradient cut into packets, and the server's selective ACKs.

A DATA packet carries whole elements of one slice of one key for one round, and says so
itself, so the server can add it into the round's accumulator in any order:

    offset size field
    0      2    magic b"LT"
    2      1    version (VERSION)
    3      1    type: DATA 1, END 2 (the worker sent the whole slice; critical), ACK 3
    4      2    worker (uint16; must match the address and key the worker registered)
    6      1    dtype (wire.frame codes)
    7      1    flags (reserved, 0)
    8      4    pn: the path's packet number (uint32, +1 per datagram on a worker -> server
                path, retransmissions included): what ACKs name and the rate model counts
    12     4    key (int32)
    16     4    plan version (uint32)
    20     8    round (int64: the worker's per-key push count, as in the TCP header)
    28     8    slice offset (uint64: the slice's first element in the key; names the slice)
    36     8    slice length (uint64, elements)
    44     4    seq: the packet's index in the slice (DATA) / packets of the slice (END)
    48     4    count: elements in this packet (DATA) / 0 (END)
    52     -    payload: ``count`` whole elements, elements [seq*E, seq*E+count) of the slice,
                where E = elements_per_packet(budget, itemsize) (no value split across packets)
    -16    16   tag: keyed BLAKE2b-128 of everything before it, with the path's key

An ACK (server -> worker) is ``magic, version, 3, worker, n, grant, start`` and then ``n``
ranges ``(first pn, how many)`` of packet numbers received, then the tag; ``grant`` (uint32,
KB/s, 0: none) is the rate the server asks this worker not to exceed (its share of what the
server receives, share.Share), ``start`` (the same unit) the rate to begin its next push at
after its path went idle (an equal share among all active workers: the grant may have been
raised while others had nothing left to send).  Each worker's key is 32
random bytes its server handed it over the job's authenticated TCP connection (LTP_HELLO), so
only a node of the job can make a packet the server accepts, a worker cannot speak for another,
and a server verifies the tag before it reads a field.  Replays change nothing: a (key, round,
seq) already counted is a duplicate, an old round is closed, another plan version is refused.

Little-endian throughout; ``encode_*``/``decode_*`` are the only places that know this layout.
"""
import hashlib
import hmac
import struct

DATA, END, ACK = 1, 2, 3
VERSION = 2
MAGIC = b"LT"
_HEADER = struct.Struct("<2sBBHBBIiIqQQII")
HEADER_SIZE = _HEADER.size           # 52
TAG_SIZE = 16
OVERHEAD = HEADER_SIZE + TAG_SIZE    # LTP's bytes per datagram beyond the payload
IP_UDP = 28                          # IPv4 + UDP headers
MAX_DATAGRAM = 65507                 # the largest UDP payload over IPv4
_ACK_HEAD = struct.Struct("<2sBBHHII")
ACK_HEADER_SIZE = _ACK_HEAD.size     # 16
_RANGE = struct.Struct("<II")
MAX_ACK_RANGES = 128
KEY_SIZE = 32
PN_MASK = 0xFFFFFFFF                 # packet numbers travel modulo 2**32


class PacketError(ValueError):
    """A datagram that is not an acceptable LTP packet; ``reason`` is the counter it goes to
    (short, magic, version, type, tag, size, ...)."""

    def __init__(self, reason, message):
        super().__init__(message)
        self.reason = reason


def payload_budget(mtu):
    """The payload bytes of one packet on a path of ``mtu`` (IP MTU, bytes): one datagram per
    IP packet (never fragmented: a lost fragment would lose the whole datagram)."""
    budget = min(int(mtu) - IP_UDP, MAX_DATAGRAM) - OVERHEAD
    if budget < 64:
        raise ValueError("an MTU of %d leaves %d payload bytes per LTP packet; at least 64 are "
                         "needed (MXPS_LTP_MTU)" % (mtu, budget))
    return budget


def elements_per_packet(budget, itemsize):
    """E: how many whole elements of ``itemsize`` bytes a packet carries."""
    return max(1, budget // itemsize)


def packet_count(length, epp):
    """How many packets a slice of ``length`` elements takes at ``epp`` elements each (an empty
    slice still sends its END)."""
    return -(-length // epp)


class Tagger:
    """Keyed BLAKE2b-128 with one path key: ``tag(*parts)`` and ``check(datagram)``."""

    __slots__ = ("_base",)

    def __init__(self, key):
        if len(key) != KEY_SIZE:
            raise ValueError("an LTP path key has %d bytes, not %d" % (KEY_SIZE, len(key)))
        self._base = hashlib.blake2b(key=key, digest_size=TAG_SIZE)

    def tag(self, *parts):
        h = self._base.copy()
        for p in parts:
            h.update(p)
        return h.digest()

    def check(self, datagram):
        """True if the datagram's last TAG_SIZE bytes are the tag of the rest."""
        mv = memoryview(datagram)
        if mv.nbytes < TAG_SIZE:
            return False
        h = self._base.copy()
        h.update(mv[:-TAG_SIZE])
        return hmac.compare_digest(h.digest(), mv[-TAG_SIZE:])


class Fields:
    """A decoded DATA or END packet's header."""

    __slots__ = ("type", "worker", "dtype", "pn", "key", "plan_version", "round", "offset",
                 "length", "seq", "count")

    def __init__(self, type, worker, dtype, pn, key, plan_version, round, offset, length, seq,
                 count):
        self.type = type
        self.worker = worker
        self.dtype = dtype
        self.pn = pn
        self.key = key
        self.plan_version = plan_version
        self.round = round
        self.offset = offset
        self.length = length
        self.seq = seq
        self.count = count

    def __repr__(self):
        return ("<LTP %s w%d pn=%d key=%d r=%d v=%d slice=[%d+%d) seq=%d count=%d>"
                % ({DATA: "DATA", END: "END"}.get(self.type, self.type), self.worker, self.pn,
                   self.key, self.round, self.plan_version, self.offset, self.length, self.seq,
                   self.count))


def encode_header(type_, worker, dtype, pn, key, plan_version, round_, offset, length, seq,
                  count):
    return _HEADER.pack(MAGIC, VERSION, type_, worker, dtype, 0, pn, key, plan_version, round_,
                        offset, length, seq, count)


def encode(tagger, type_, worker, dtype, pn, key, plan_version, round_, offset, length, seq,
           count, payload=b""):
    """One packet as the buffers of one datagram ``[header, payload, tag]`` (the payload is not
    copied: ``socket.sendmsg`` gathers them)."""
    header = encode_header(type_, worker, dtype, pn, key, plan_version, round_, offset, length,
                           seq, count)
    return [header, payload, tagger.tag(header, payload)]


def peek_worker(datagram):
    """The worker a datagram claims to come from (to pick its key), or raise PacketError."""
    mv = memoryview(datagram)
    if mv.nbytes < OVERHEAD:
        raise PacketError("short", "a %d-byte datagram is shorter than an LTP packet's %d "
                          "bytes of header and tag" % (mv.nbytes, OVERHEAD))
    if mv[:2] != MAGIC:
        raise PacketError("magic", "not an LTP datagram (magic %r)" % bytes(mv[:2]))
    if mv[2] != VERSION:
        raise PacketError("version", "LTP version %d, this node speaks %d" % (mv[2], VERSION))
    return mv[4] | (mv[5] << 8)


def decode(datagram, itemsize_of):
    """A verified DATA/END datagram (tag already checked) -> (Fields, payload memoryview).
    ``itemsize_of(dtype code)`` gives the element size (raises KeyError for an unknown dtype).
    Raises PacketError if the sizes do not add up."""
    mv = memoryview(datagram)
    (_, _, type_, worker, dtype, _, pn, key, plan_version, round_, offset, length, seq,
     count) = _HEADER.unpack_from(mv)
    f = Fields(type_, worker, dtype, pn, key, plan_version, round_, offset, length, seq, count)
    payload = mv[HEADER_SIZE:mv.nbytes - TAG_SIZE]
    if type_ == DATA:
        try:
            size = itemsize_of(dtype)
        except KeyError:
            raise PacketError("dtype", "%r: unknown dtype code %d" % (f, dtype)) from None
        if payload.nbytes != count * size or count == 0:
            raise PacketError("size", "%r carries %d payload bytes, not %d x %d"
                              % (f, payload.nbytes, count, size))
    elif type_ == END:
        if payload.nbytes or count:
            raise PacketError("size", "%r: an END carries no payload" % f)
    else:
        raise PacketError("type", "LTP packet type %d is not DATA or END" % type_)
    return f, payload


def to_ranges(pns):
    """Sorted ``(first, n)`` runs of the packet numbers ``pns`` (an iterable of ints)."""
    out = []
    for pn in sorted(set(pns)):
        if out and out[-1][0] + out[-1][1] == pn:
            out[-1][1] += 1
        else:
            out.append([pn, 1])
    return [tuple(r) for r in out]


def _kbps(rate):
    return min(int(rate / 1000.0), 0xFFFFFFFF) if rate > 0 else 0


def encode_acks(tagger, worker, pns, grant=0.0, start=0.0):
    """ACK datagrams (bytes) naming every packet number in ``pns``, with the rates ``grant``
    and ``start`` (bytes/s; 0: none)."""
    ranges = to_ranges(pns)
    out = []
    kbps, start_kbps = _kbps(grant), _kbps(start)
    for i in range(0, len(ranges), MAX_ACK_RANGES):
        chunk = ranges[i:i + MAX_ACK_RANGES]
        body = _ACK_HEAD.pack(MAGIC, VERSION, ACK, worker, len(chunk), kbps,
                              start_kbps) + b"".join(
            _RANGE.pack(a, n) for a, n in chunk)
        out.append(body + tagger.tag(body))
    return out


def decode_ack(datagram, tagger, worker):
    """The packet numbers a verified ACK names, as a list of (first, n); PacketError if the
    datagram is not an ACK for ``worker`` with a good tag."""
    return decode_ack_grant(datagram, tagger, worker)[0]


def decode_ack_grant(datagram, tagger, worker):
    """``(ranges, grant, start)`` of a verified ACK: ``decode_ack``'s ranges and the server's
    rate grant and start rate in bytes/s (0: none)."""
    mv = memoryview(datagram)
    if mv.nbytes < _ACK_HEAD.size + TAG_SIZE:
        raise PacketError("short", "a %d-byte datagram is too short for an ACK" % mv.nbytes)
    if not tagger.check(mv):
        raise PacketError("tag", "an ACK with a bad tag")
    magic, version, type_, w, n, kbps, start_kbps = _ACK_HEAD.unpack_from(mv)
    if magic != MAGIC or version != VERSION or type_ != ACK:
        raise PacketError("type", "not an LTP ACK")
    if w != worker:
        raise PacketError("worker", "an ACK for worker %d reached worker %d" % (w, worker))
    if mv.nbytes != _ACK_HEAD.size + n * _RANGE.size + TAG_SIZE:
        raise PacketError("size", "an ACK of %d ranges has %d bytes" % (n, mv.nbytes))
    return ([_RANGE.unpack_from(mv, _ACK_HEAD.size + i * _RANGE.size) for i in range(n)],
            kbps * 1000.0, start_kbps * 1000.0)
