"""Other processes' TCP traffic into a server's host (mxps.ltp.others), which LTP's grant leaves
its share: the kernel's socket diagnostics, parsed and read live."""
import socket
import struct
import subprocess
import sys
import time

import pytest

from mxps.ltp import others
from mxps.ltp.others import ForeignTcp, parse_dump

SINK = r"""
import socket, sys, time
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
c = socket.create_connection(srv.getsockname()); a, _ = srv.accept()
c.setblocking(False)
print(a.getsockname()[1], flush=True)
end = time.monotonic() + float(sys.argv[1]); chunk = b"x" * int(sys.argv[2])
pause = float(sys.argv[3])
while time.monotonic() < end:
    try: c.send(chunk)
    except BlockingIOError: pass
    try:
        while a.recv(1 << 20, socket.MSG_DONTWAIT): pass
    except BlockingIOError: pass
    time.sleep(pause)
"""
BULK = ["3", "65536", "0.002"]          # ~30 MB/s: 64 KB every 2 ms
TRICKLE = ["3", "200", "0.05"]          # 4 KB/s: a heartbeat's traffic


def _msg(kind, body):
    return struct.pack("=IHHII", 16 + len(body), kind, 0, 1, 0) + body + bytes(-len(body) % 4)


def _sock_msg(inode, local, received=None):
    sockid = (struct.pack(">HH", 5000, 6000) + socket.inet_aton(local) + bytes(12)
              + socket.inet_aton("198.18.0.9") + bytes(12) + struct.pack("=I", 0) + bytes(8))
    body = struct.pack("=BBBB", socket.AF_INET, 1, 0, 0) + sockid + struct.pack(
        "=IIIII", 0, 0, 0, 0, inode)
    if received is not None:
        info = bytes(others.BYTES_RECEIVED) + struct.pack("=Q", received) + bytes(24)
        body += struct.pack("=HH", 4 + len(info), others.INET_DIAG_INFO) + info
    return _msg(others.SOCK_DIAG_BY_FAMILY, body), sockid


def test_a_dump_parses_to_each_sockets_inode_address_bytes_and_name():
    one, id1 = _sock_msg(11, "198.18.0.1", 12345)
    two, id2 = _sock_msg(12, "198.18.0.2")            # no tcp_info attribute
    rows, done = parse_dump(one + two)
    assert rows == [(11, "198.18.0.1", 12345, id1), (12, "198.18.0.2", None, id2)]
    assert not done
    rows, done = parse_dump(one + _msg(others.NLMSG_DONE, struct.pack("=i", 0)))
    assert len(rows) == 1 and done
    with pytest.raises(OSError) as e:
        parse_dump(_msg(others.NLMSG_ERROR, struct.pack("=i", -2) + bytes(16)))
    assert e.value.errno == 2
    # a truncated message is not read past its end
    assert parse_dump(one[:-8]) == ([], False)


def test_a_loopback_server_looks_at_nothing():
    assert not ForeignTcp("127.0.0.1").available
    assert ForeignTcp("127.0.0.1").sample(1.0) is None


def test_another_processes_tcp_flow_is_counted_and_this_ones_is_not():
    f = ForeignTcp("127.0.0.1", loopback=True)
    assert f.available, "no NETLINK_SOCK_DIAG: every Linux this project runs on has it"
    mine = socket.socket()
    mine.bind(("127.0.0.1", 0))
    mine.listen(1)
    own = socket.create_connection(mine.getsockname())
    peer, _ = mine.accept()
    p = subprocess.Popen([sys.executable, "-c", SINK] + BULK, stdout=subprocess.PIPE, text=True)
    try:
        p.stdout.readline()                                 # its flow is up
        assert f.sample(time.monotonic()) is None           # the first look: a baseline
        rates = []
        for _ in range(6):
            time.sleep(0.2)
            own.sendall(b"y" * 200000)                      # this process's own flow
            peer.recv(1 << 20)
            rates.append(f.sample(time.monotonic()))
        # the other process's flow moves ~30 MB/s (64 KB every 2 ms); ours 1 MB/s is not in it
        assert all(r is not None and r[1] == 1 and r[0] > 3e6 for r in rates), rates
        assert f._mine and not set(f._last) & f._mine
    finally:
        p.kill()
        p.wait()
        for s in (own, peer, mine):
            s.close()
        f.close()


def test_a_trickle_of_another_process_is_no_flow():
    # a co-located scheduler's heartbeats: counted as a flow, they would take the grant's
    # headroom off the job for as long as the job runs
    f = ForeignTcp("127.0.0.1", loopback=True)
    p = subprocess.Popen([sys.executable, "-c", SINK] + TRICKLE, stdout=subprocess.PIPE,
                         text=True)
    try:
        p.stdout.readline()
        assert f.sample(time.monotonic()) is None
        rates = []
        for _ in range(5):
            time.sleep(0.2)
            rates.append(f.sample(time.monotonic()))
        assert all(r is not None and r[1] == 0 for r in rates), rates
        assert sum(r[0] for r in rates) > 0, rates          # its bytes were seen
        assert all(r[0] < others.MIN_FLOW_RATE for r in rates), rates
    finally:
        p.kill()
        p.wait()
        f.close()


def test_a_socket_that_once_moved_bulk_stays_a_flow_and_a_trickle_never_is_one():
    f = ForeignTcp("127.0.0.1", loopback=True)
    f.close()                                    # no kernel: the counts are given below
    f._sock = object()                           # sample() only asks whether there is one
    counts = {}
    f._dumped = 0.0
    f._lookup = lambda: dict(counts)
    bulk, trickle = 11, 12
    got = []
    for t, b, tr in ((0.05, 0, 0), (0.10, 200000, 100), (0.15, 200000, 200),
                     (0.20, 201000, 300), (0.25, 201000, 300)):
        counts = {bulk: b, trickle: tr}
        got.append(f.sample(t))
    f._sock = None
    assert got[0] is None                        # the baseline
    assert got[1][1] == 1                        # 4 MB/s over 50 ms: a flow
    assert got[2][1] == 0                        # it received nothing: not a flow now
    assert got[3][1] == 1                        # 20 KB/s, but it was bulk once: still a flow
    assert got[4] == (0.0, 0)                    # nobody received anything
    # the trickle (2 KB/s, every sample) is never a flow, though its bytes are in the rate
    assert got[2][0] == pytest.approx(100 / 0.05)
