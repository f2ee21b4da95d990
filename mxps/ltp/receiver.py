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
into a ring of slots and taken by ``kernels.ltp.intake``: in C, each datagram's header and tag
are checked (``open_batch``'s checks), its path notes its number (``_Path.note``), the grant
counts its arrival (``share.Share.on_packet``), its number waits for the batch's ACK, and a
DATA packet that needs nothing but its add into an open round of the server (``ServerState``'s
``ltp_fast``) is added there; the others come back here, one at a time, for the server's
``take_packet``.  Measured (scripts/ltp_intake_cpu.py, 8 workers, MTU 1500, 5% of the packets
lost): 85% of the packets take that path, and a datagram costs 5.3 us of the server's CPU
against 7.0 us with every packet through ``take_packet`` (``MXPS_LTP_FAST=0``).  A datagram
that fails the checks goes through the reference checks here (``_one``), which count and log
why.

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

from ..kernels import ltp_packet as pk
from .others import ForeignTcp
from .share import Share
from ..kernels import ltp_py
from ..kernels.ltp import (PathCore, enable_stamps, encode_acks, intake, recv_batch,
                           send_batch, take_common)
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
# a path's loss blocks and the orders _Path.note tells (kernels.ltp_py.PathCore)
BLOCK, LOSS_WEIGHT = ltp_py.BLOCK, ltp_py.LOSS_WEIGHT
IN_ORDER, REORDERED, IN_HOST = ltp_py.IN_ORDER, ltp_py.REORDERED, ltp_py.IN_HOST
# intake's tally of a batch
T_PACKETS, T_BYTES, T_OUT_OF_ORDER, T_IN_HOST, T_REORDERED, T_FAST = (
    ltp_py.T_PACKETS, ltp_py.T_BYTES, ltp_py.T_OUT_OF_ORDER, ltp_py.T_IN_HOST, ltp_py.T_REORDERED,
    ltp_py.T_FAST)
_NO_TALLY = (0,) * 6


def interface_mtu(host):
    """The MTU of the interface holding address ``host`` (None if none does)."""
    import psutil      # here, not at import: once per socket, and the module stays light
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


class _Path(PathCore):
    """A registered worker's path: its address, its key's ``packet.Tagger``, the packet numbers
    to ACK, and what its packet numbers say (``note``: order and loss; kernels.ltp_py.PathCore,
    compiled in kernels._ltp)."""

    __slots__ = ()

    def __init__(self, addr, key):
        super().__init__(addr, pk.Tagger(key))


class Receiver:
    """The UDP socket of server ``rank`` and the registered paths of its workers."""

    def __init__(self, host, num_workers, mtu=0, busy_windows=True, owing=True, fair=True,
                 probe_loss=True, startup=True):
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
        self.share = Share(num_workers, busy_windows=busy_windows, owing=owing, fair=fair,
                           probe_loss=probe_loss, startup=startup)
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
                       "out_of_order_in_host": 0, "fast": 0}
        self._ring = bytearray(BATCH * SLOT)
        self._view = memoryview(self._ring)
        # per batch: the workers to ACK, and what its packets added up to (intake's tally)
        self._touched = [False] * num_workers
        self._tally = list(_NO_TALLY)

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

    def receive(self, handle, now, fast=None, plan_version=0, on_fast=None):
        """Read what is waiting (up to BATCH datagrams), hand each verified packet to
        ``handle(fields, payload, now)`` (the payload is only valid during the call), then send
        the ACKs.  Returns how many datagrams were read.

        ``fast``: the server's open rounds (``(key, offset, round)`` -> ``rounds.LtpRound``) and
        ``plan_version`` its plan: a DATA packet whose handling would come to nothing but its
        add into one of them is added here instead (``kernels.ltp.intake``; its doc says
        when), so that most packets never reach Python; ``on_fast(now)`` is then called once
        after the batch."""
        stamps = self._stamps
        stamps.clear()
        got = recv_batch(self.sock, self._ring, SLOT, BATCH, stamps)
        if not got:
            return 0
        view = self._view
        touched, tally = self._touched, self._tally
        # for the share's rate windows: whether this read emptied the socket, and each
        # packet's arrival stamp (share.on_packet)
        drained = len(got) < BATCH
        i, n = 0, len(got)
        while True:
            # every packet as far as it needs nothing of the server: opened, noted, counted for
            # the grant and the ACKs, and added into its round if that is all it takes
            i, opened = intake(view, SLOT, got, stamps, i, now, drained, self._open,
                               self.paths, self.share, _itemsize, touched, tally, fast,
                               plan_version)
            if i < n and opened is None:    # refused: the reference checks say why (or take it)
                size, addr = got[i]
                opened = self._one(view[i * SLOT:i * SLOT + size], addr)
                if opened is not None:
                    f = opened[0]
                    take_common(f.worker, f.pn, f.type == pk.END, size, stamps[i], now,
                                drained, self.paths, self.share, touched, tally)
            if tally[T_REORDERED]:     # rare: rounds then wait a grace after their ENDs
                tally[T_REORDERED] = 0
                self.reordered_at = now
            if i == n:
                break
            if opened is not None:
                handle(opened[0], opened[1], now)
            i += 1
        if tally[T_PACKETS]:
            self._now = now
            counts = self.counts
            counts["packets"] += tally[T_PACKETS]
            counts["bytes"] += tally[T_BYTES]
            counts["out_of_order"] += tally[T_OUT_OF_ORDER]
            counts["out_of_order_in_host"] += tally[T_IN_HOST]
            counts["fast"] += tally[T_FAST]
            if tally[T_FAST] and on_fast is not None:
                on_fast(now)
        tally[:] = _NO_TALLY
        if self._foreign is not None and (self._others_at is None
                                          or now - self._others_at >= OTHERS_PERIOD):
            self._others_at = now
            seen = self._foreign.sample(now)
            if seen is not None:
                self.share.others(now, *seen)
        if True in touched:
            self._send_acks(self.share.grants(self._now, self.loss))
        return n

    def _one(self, dgram, addr):
        """The reference checks of a datagram ``intake`` refused: (Fields, payload) if it
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

    def _send_acks(self, grants):
        """ACK every packet number noted since the last ACKs, to each worker that sent any
        (``_touched``), with ``grants`` (the share's grant and start rate): one or a few
        datagrams a worker, all sent with one system call if the socket takes them.  A
        datagram the full send buffer does not take is dropped and counted (``ack-full``), one
        that fails is counted and logged (``ack-error``): the worker's END is resent anyway."""
        msgs = []
        touched, paths = self._touched, self.paths
        for w in range(len(touched)):
            if touched[w]:
                touched[w] = False
                path = paths[w]
                pns, path.acks = path.acks, []
                for dgram in encode_acks(path.tagger, w, pns, *grants):
                    msgs.append(([dgram], path.addr))
        i = 0
        while i < len(msgs):
            try:
                sent = send_batch(self.sock, msgs[i:] if i else msgs)
            except OSError as e:
                self.drops("ack-error", "LTP: an ACK to %s failed: %s", msgs[i][1], e)
                sent = 0
            else:
                self.counts["acks"] += sent
                if sent == 0:
                    self.drops("ack-full", "LTP: an ACK to %s dropped (send buffer full)",
                               msgs[i][1])
            i += sent if sent else 1

    def close(self):
        self.sock.close()
        if self._foreign is not None:
            self._foreign.close()
