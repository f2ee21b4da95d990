"""The TCP traffic other processes receive at a server's address: what LTP's grant leaves room for.

A server's LTP grant (``share.Share``) divides the link it measures among the job's workers.
A TCP flow of someone else into the same host shares that link, and LTP, which does not take
loss for congestion, would keep the link full and leave it the drops: measured, a CUBIC flow
next to four LTP senders got a third of a fair share (docs/bench/LTP_FAIRNESS.md).  The server
cannot see other hosts' traffic, but the bottleneck of an incast is its own downlink, and what
crosses that towards other processes of its host it can count exactly: the kernel's socket
diagnostics (``NETLINK_SOCK_DIAG``, ``man 7 sock_diag``, what ``ss`` reads) report every
established TCP socket with its inode, its local address and a ``struct tcp_info`` whose
``tcpi_bytes_received`` counts the payload it received; the sockets this process holds are the
``socket:[inode]`` links of ``/proc/self/fd`` (the job's own TCP: pulls, control, small
pushes), and they do not count.

``ForeignTcp(host).sample(now)`` returns the payload rate (bytes/s) and the number of flows
(sockets that received anything since the last sample and once received ``MIN_FLOW_RATE``),
over the established TCP sockets of other processes whose local address is ``host``.  A dump
of every socket walks the kernel's whole TCP hash table (measured: 2.7 ms of CPU on this
24 GiB machine with no socket in the namespace, and the table grows with the memory), so the
sockets are found by a dump every ``DISCOVER`` seconds and sampled in between by one exact
request each (a hash lookup by address, port and cookie).  None when it cannot say: a
loopback ``host`` (everything on it is this machine's own traffic, no link to share;
``loopback=True``, for tests, counts it anyway), a kernel without sock_diag, the first
sample.  Pure parsing (``parse_dump``) is separate from the socket.
"""
import os
import socket
import struct

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 0x1
NLM_F_DUMP = 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
TCP_ESTABLISHED = 1
INET_DIAG_INFO = 2
_NLMSG = struct.Struct("=IHHII")                  # struct nlmsghdr
_REQ = struct.Struct("=BBBBI2s2s16s16sI8s")        # struct inet_diag_req_v2 (56 bytes)
_MSG = struct.Struct("=BBBB2s2s16s16sI8sIIIII")    # struct inet_diag_msg (72 bytes)
_RTA = struct.Struct("=HH")                        # struct rtattr
BYTES_RECEIVED = 128       # offsetof(struct tcp_info, tcpi_bytes_received), Linux >= 4.1
DISCOVER = 2.0             # seconds between dumps (new sockets are found this late)
#: bytes/s a socket must once move over a sample to be a flow competing for the link (1 Mbit/s:
#: a bulk TCP flow's first window, 10 segments in a 50 ms sample, passes it).  A socket that
#: never did is a trickle (a co-located scheduler's heartbeats and control, an idle ssh
#: session), which as a flow would take the grant's headroom (``share.HEADROOM``) off the job
#: for as long as it lasts; a socket that did stays a flow while it receives anything, so a
#: flow that LTP pushed into retransmission timeouts keeps its share.
MIN_FLOW_RATE = 128 * 1024
_ID = slice(4, 52)         # struct inet_diag_sockid inside struct inet_diag_msg
_U64 = struct.Struct("=Q")


def request(seq=1, sockid=None):
    """The dump request of every established IPv4 TCP socket with its tcp_info, or with
    ``sockid`` (the 48 bytes of a ``struct inet_diag_sockid`` a dump returned) the request of
    that socket alone."""
    ext = 1 << (INET_DIAG_INFO - 1)
    if sockid is None:
        body = _REQ.pack(socket.AF_INET, socket.IPPROTO_TCP, ext, 0, 1 << TCP_ESTABLISHED,
                         b"", b"", b"", b"", 0, b"")
        flags = NLM_F_REQUEST | NLM_F_DUMP
    else:
        body = _REQ.pack(socket.AF_INET, socket.IPPROTO_TCP, ext, 0, 0xFFFFFFFF,
                         b"", b"", b"", b"", 0, b"")[:8] + bytes(sockid)
        flags = NLM_F_REQUEST
    return _NLMSG.pack(_NLMSG.size + len(body), SOCK_DIAG_BY_FAMILY, flags, seq, 0) + body


def parse_dump(data):
    """``(rows, done)`` of netlink messages ``data``: rows ``(inode, local IPv4 address,
    bytes received or None, sockid)`` of each socket (``sockid``: the 48 bytes that name it
    in a ``request``); ``done`` once the dump's NLMSG_DONE or an exact request's answer
    came.  Raises OSError for an NLMSG_ERROR (ENOENT: the socket asked for is gone)."""
    rows, off, done = [], 0, False
    while off + _NLMSG.size <= len(data):
        length, kind, _, _, _ = _NLMSG.unpack_from(data, off)
        if length < _NLMSG.size or off + length > len(data):
            break
        if kind == NLMSG_DONE:
            done = True
        elif kind == NLMSG_ERROR:
            (err,) = struct.unpack_from("=i", data, off + _NLMSG.size)
            if err:
                raise OSError(-err, "sock_diag: %s" % os.strerror(-err))
        elif kind == SOCK_DIAG_BY_FAMILY and length >= _NLMSG.size + _MSG.size:
            m = _MSG.unpack_from(data, off + _NLMSG.size)
            local, inode = socket.inet_ntoa(m[6][:4]), m[14]
            received = None
            a = off + _NLMSG.size + _MSG.size
            while a + _RTA.size <= off + length:
                alen, atype = _RTA.unpack_from(data, a)
                if alen < _RTA.size:
                    break
                if atype == INET_DIAG_INFO and alen >= _RTA.size + BYTES_RECEIVED + 8:
                    (received,) = _U64.unpack_from(data, a + _RTA.size + BYTES_RECEIVED)
                a += (alen + 3) & ~3
            msg = off + _NLMSG.size
            rows.append((inode, local, received, bytes(data[msg + _ID.start:msg + _ID.stop])))
        off += (length + 3) & ~3
    return rows, done


def my_socket_inodes():
    """The inodes of the sockets this process holds."""
    out = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            link = os.readlink("/proc/self/fd/" + name)
        except OSError:
            continue
        if link.startswith("socket:["):
            out.add(int(link[8:-1]))
    return out


class ForeignTcp:
    """The TCP payload other processes of this host receive at ``host`` (see module doc)."""

    def __init__(self, host, loopback=False):
        self.host = host
        self._sock = None
        self._seq = 0
        self._mine = set()
        self._ids = {}             # foreign inode -> its sockid, from the last dump
        self._last = {}            # foreign inode -> bytes received at the last sample
        self._bulk = set()         # foreign inodes that once moved MIN_FLOW_RATE: flows
        self._at = None
        self._dumped = None        # when the last dump was
        if not loopback and (host.startswith("127.") or host in ("0.0.0.0", "localhost")):
            return
        try:
            self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG)
            self._sock.settimeout(0.5)
        except (OSError, AttributeError):
            self._sock = None

    @property
    def available(self):
        return self._sock is not None

    def _ask(self, sockid=None):
        """The rows a dump (``sockid`` None) or an exact request returns."""
        self._seq += 1
        self._sock.send(request(self._seq, sockid))
        rows = []
        while True:
            data = self._sock.recv(1 << 16)
            got, done = parse_dump(data)
            rows += got
            if done or not data or (sockid is not None and got):
                return rows

    def _discover(self, now):
        rows = [r for r in self._ask() if r[1] == self.host]
        if any(r[0] not in self._mine and r[0] not in self._ids for r in rows):
            self._mine = my_socket_inodes()          # a new socket: ours or someone else's
        self._ids = {r[0]: r[3] for r in rows if r[0] not in self._mine}
        self._dumped = now
        return {r[0]: r[2] for r in rows if r[0] in self._ids and r[2] is not None}

    def _lookup(self):
        counts = {}
        for inode, sockid in list(self._ids.items()):
            try:
                rows = self._ask(sockid)
            except OSError:                      # gone (ENOENT)
                self._ids.pop(inode, None)
                continue
            for i, _, received, _ in rows:
                if i == inode and received is not None:
                    counts[i] = received
        return counts

    def sample(self, now):
        """``(bytes/s, flows)`` received by other processes' TCP sockets at ``host`` since the
        last sample, or None (see module doc)."""
        if self._sock is None:
            return None
        try:
            if self._dumped is None or now - self._dumped >= DISCOVER:
                current = self._discover(now)
            else:
                current = self._lookup()
        except OSError:
            self.close()
            return None
        before, at = self._last, self._at
        self._last, self._at = current, now
        if at is None or now <= at:
            return None
        dt = now - at
        deltas = {i: b - before[i] for i, b in current.items() if i in before and b > before[i]}
        self._bulk = {i for i in self._bulk if i in current} | {
            i for i, d in deltas.items() if d / dt >= MIN_FLOW_RATE}
        return sum(deltas.values()) / dt, sum(1 for i in deltas if i in self._bulk)

    def close(self):
        if self._sock is not None:
            self._sock.close()
            self._sock = None
