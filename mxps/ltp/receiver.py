"""A server's LTP endpoint: one UDP socket for every worker's packets, selective ACKs back.

A worker says hello over its authenticated TCP connection (LTP_HELLO: its UDP address and path
MTU); the server answers with its UDP port, the packet payload budget every worker of the job
uses towards this server, and a fresh random 32-byte key for that worker alone.  A datagram is
then read only if it comes from the address that worker registered and its tag verifies with
that worker's key; everything else is dropped and counted (``drops``) before a field of it is
used.  Every verified packet's number is ACKed (ranges, one or a few datagrams per worker per
batch read), whatever the state then does with it: an ACK says "arrived", which is what the
sender's rate model and its END retransmission need.

Datagrams are read BATCH at a time with one system call (``kernels.ltp.recv_batch``: recvmmsg)
into a ring of slots, and the batch's headers and tags are checked in C (``open_batch``); a
datagram that fails there goes through the reference checks here (``_one``), which count and
log why.

The loss rate of each path, which the Early Close rule adapts to, is measured here from the
packet numbers: a block of BLOCK numbers is settled once numbers two blocks later arrive
(reordering allowance) and its missing fraction is folded into an average (``loss``).  A packet
that reaches the server after a higher number of its path, by the kernel's arrival stamps,
was reordered by the network; when that last happened (``reordered_at``) decides whether a
round waits a grace after its last END (``close.grace_for``).  Packets whose stamps are in
order but which the socket delivered out of order were reordered inside this host (measured:
a few in 100 K packets, one stamped 60 us before the higher number it followed; a veth queues
a packet on the backlog of the CPU that sends it, the likely cause); they are counted apart
(``out_of_order_in_host``) and do not turn the grace on: a packet held that way behind an
END is at worst one late packet.
"""
import json
import logging
import secrets
import socket

import psutil

from . import packet as pk
from .packet import END
from .others import ForeignTcp
from .share import Share
from ..kernels.ltp import enable_stamps, open_batch, recv_batch
from ..wire.auth import Tally
from ..wire.frame import dtype_of

log = logging.getLogger("mxps.ltp")

RCVBUF = 16 << 20
# Linux's SO_RCVBUFFORCE / SO_SNDBUFFORCE (root may exceed net.core.[rw]mem_max): Python's
# socket module does not name them
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)
BATCH = 64
OTHERS_PERIOD = 0.05            # seconds between looks at other processes' TCP traffic
SLOT = pk.MAX_DATAGRAM + 64     # a ring slot holds any UDP datagram whole
BLOCK = 256
IN_ORDER, REORDERED, IN_HOST = 0, 1, 2        # _Path.note
LOSS_WEIGHT = 0.2


def interface_mtu(host):
    """The MTU of the interface holding address ``host`` (None if none does)."""
    try:
        addrs = psutil.net_if_addrs()
        stats = psutil.net_if_stats()
    except OSError:
        return None
    for name, items in addrs.items():
        if any(a.family == socket.AF_INET and a.address == host for a in items):
            st = stats.get(name)
            return st.mtu if st is not None and st.mtu else None
    return None


def big_buffer(sock, option, force_option, nbytes):
    """Ask for an ``nbytes`` socket buffer (the FORCE variant first: root may exceed
    net.core.[rw]mem_max); returns what the kernel granted."""
    for opt in (force_option, option):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, nbytes)
            break
        except OSError:
            continue
    which = socket.SO_RCVBUF if option == socket.SO_RCVBUF else socket.SO_SNDBUF
    return sock.getsockopt(socket.SOL_SOCKET, which)


def _itemsize(code):
    try:
        return dtype_of(code).itemsize
    except ValueError:                  # wire.WireError: not a dtype the wire carries
        raise KeyError(code) from None


class _Path:
    __slots__ = ("addr", "tagger", "acks", "block", "block_seen", "hi", "hi_stamp", "settled",
                 "loss", "received")

    def __init__(self, addr, key):
        self.addr = addr
        self.tagger = pk.Tagger(key)
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
        by the socket, not by the stamps (see the module doc)."""
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


class Receiver:
    """The UDP socket of server ``rank`` and the registered paths of its workers."""

    def __init__(self, host, num_workers, mtu=0, busy_windows=True, owing=True, fair=True):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.rcvbuf = big_buffer(self.sock, socket.SO_RCVBUF,
                                 SO_RCVBUFFORCE, RCVBUF)
        self.sock.bind((host, 0))
        self.sock.setblocking(False)
        self.host = host
        self.port = self.sock.getsockname()[1]
        self.mtu = mtu or interface_mtu(host) or 1500
        self.budget = pk.payload_budget(self.mtu)
        self.paths = [None] * num_workers
        # the ACKs' rate grant (ltp.share)
        self.share = Share(num_workers, busy_windows=busy_windows, owing=owing, fair=fair)
        # other processes' TCP traffic into this host, which the grant leaves its share
        self._foreign = ForeignTcp(host) if fair else None
        self._others_at = None
        # the kernel stamps each datagram with its arrival (SO_TIMESTAMPNS): the share's rate
        # windows use those times, not when the server got round to reading them
        self._stamps = []
        try:
            enable_stamps(self.sock)
        except OSError as e:        # no timestamps: windows from read times (share.on_packet)
            log.warning("LTP: no receive timestamps on this socket (%s): the grant's rate "
                        "windows use read times", e)
        self._now = 0.0
        # when the network last delivered a packet out of order on any path (-inf: never),
        # for the grace after the last END (close.grace_for)
        self.reordered_at = float("-inf")
        self._open = [None] * num_workers     # per worker: (registered address, Tagger)
        self._by_addr = {}
        self.drops = Tally(log)
        self.counts = {"packets": 0, "bytes": 0, "acks": 0, "out_of_order": 0,
                       "out_of_order_in_host": 0}
        self._ring = bytearray(BATCH * SLOT)
        self._view = memoryview(self._ring)

    @property
    def loss(self):
        """Each worker's path loss estimate (0 before any block settled)."""
        return [p.loss if p is not None else 0.0 for p in self.paths]

    def hello(self, worker, payload):
        """Register worker ``worker``'s UDP address from its LTP_HELLO body; returns the reply
        body.  Raises ValueError naming what is wrong with the body."""
        try:
            body = json.loads(bytes(payload))
            host, port, mtu = str(body["host"]), int(body["port"]), int(body["mtu"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError("LTP_HELLO from worker %d: the body is not JSON {host, port, mtu} "
                             "(%s)" % (worker, e)) from None
        if not 0 < port < 65536:
            raise ValueError("LTP_HELLO from worker %d: port %d" % (worker, port))
        if mtu - pk.IP_UDP - pk.OVERHEAD < self.budget:
            raise ValueError("LTP_HELLO from worker %d: its path MTU %d is below this server's "
                             "packet size (MTU %d); set MXPS_LTP_MTU=%d for the job"
                             % (worker, mtu, self.mtu, mtu))
        old = self.paths[worker]
        if old is not None:
            self._by_addr.pop(old.addr, None)
        key = secrets.token_bytes(pk.KEY_SIZE)
        path = self.paths[worker] = _Path((host, port), key)
        self._open[worker] = (path.addr, path.tagger)
        self._by_addr[path.addr] = worker
        return json.dumps({"port": self.port, "key": key.hex(), "budget": self.budget}).encode()

    def receive(self, handle, now):
        """Read what is waiting (up to BATCH datagrams), hand each verified packet to
        ``handle(fields, payload, now)`` (the payload is only valid during the call), then send
        the ACKs.  Returns how many datagrams were read."""
        stamps = self._stamps
        stamps.clear()
        got = recv_batch(self.sock, self._ring, SLOT, BATCH, stamps)
        if not got:
            return 0
        view = self._view
        touched = set()
        # for the share's rate windows: whether this read emptied the socket, and each
        # packet's arrival stamp (share.on_packet)
        drained = len(got) < BATCH
        # per packet this loop is the server's hot path: the counts are added once per batch
        paths, on_packet, add = self.paths, self.share.on_packet, touched.add
        packets = nbytes = 0
        for i, opened in enumerate(open_batch(view, SLOT, got, self._open, _itemsize)):
            size, addr = got[i]
            if opened is None:         # refused: the reference checks say why (or take it)
                opened = self._one(view[i * SLOT:i * SLOT + size], addr)
                if opened is None:
                    continue
            f, payload = opened
            w, pn = f.worker, f.pn
            path = paths[w]
            order = path.note(pn, stamps[i])
            if order:                  # rare: reordered (rounds then wait a grace after ENDs)
                if order == REORDERED:
                    self.reordered_at = now
                    self.counts["out_of_order"] += 1
                else:
                    self.counts["out_of_order_in_host"] += 1
            path.acks.append(pn)
            on_packet(w, size, now, drained, stamps[i], f.type == END)
            add(w)
            packets += 1
            nbytes += size
            handle(f, payload, now)
        if packets:
            self._now = now
            self.counts["packets"] += packets
            self.counts["bytes"] += nbytes
        if self._foreign is not None and (self._others_at is None
                                          or now - self._others_at >= OTHERS_PERIOD):
            self._others_at = now
            seen = self._foreign.sample(now)
            if seen is not None:
                self.share.others(now, *seen)
        if touched:
            grants = self.share.grants(self._now)
            for w in touched:
                self._ack(w, grants)
        return len(got)

    def _one(self, dgram, addr):
        """The reference checks of a datagram ``open_batch`` refused: (Fields, payload) if it
        passes them after all, else None (dropped, counted and logged with the reason)."""
        try:
            worker = pk.peek_worker(dgram)
        except pk.PacketError as e:
            self.drops(e.reason, "LTP: dropped a datagram from %s: %s", addr, e)
            return None
        path = self.paths[worker] if worker < len(self.paths) else None
        if path is None or path.addr != addr:
            self.drops("address", "LTP: dropped a datagram claiming worker %d from %s, which is "
                       "not that worker's registered address", worker, addr)
            return None
        if not path.tagger.check(dgram):
            self.drops("tag", "LTP: dropped a datagram from %s (worker %d) with a bad tag",
                       addr, worker)
            return None
        try:
            return pk.decode(dgram, _itemsize)
        except pk.PacketError as e:
            self.drops(e.reason, "LTP: dropped a packet of worker %d: %s", worker, e)
            return None

    def _ack(self, worker, grants):
        path = self.paths[worker]
        pns, path.acks = path.acks, []
        for dgram in pk.encode_acks(path.tagger, worker, pns, *grants):
            try:
                self.sock.sendto(dgram, path.addr)
                self.counts["acks"] += 1
            except (BlockingIOError, InterruptedError):
                self.drops("ack-full", "LTP: an ACK to worker %d dropped (send buffer full)",
                           worker)
            except OSError as e:
                self.drops("ack-error", "LTP: an ACK to worker %d failed: %s", worker, e)

    def close(self):
        self.sock.close()
        if self._foreign is not None:
            self._foreign.close()
