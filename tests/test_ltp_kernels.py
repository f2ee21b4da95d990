"""LTP's hot paths: the compiled ``mxps.kernels._ltp`` against its pure-Python twin
``mxps.kernels.ltp_py`` (the reference), on real UDP sockets on 127.0.0.1.

- ``recv_batch`` (recvmmsg) reads what a loop of ``recvfrom_into`` reads: batches of 1 to 64
  datagrams of 0 to 65507 bytes from several peers, slot by slot, nothing when nothing waits,
  a datagram longer than a slot cut to it;
- ``send_batch`` (sendmmsg) sends what a loop of ``sendmsg`` sends, each datagram gathered from
  its buffers (bytes, bytearray, a float32 gradient's memoryview), to several addresses; with a
  full send buffer it sends none or a part and says how many (a private network namespace whose
  loopback holds packets in a slow qdisc makes the buffer fill up for real);
- ``open_batch`` accepts exactly the datagrams the server's reference checks accept and decodes
  them to the same fields (hypothesis, over headers, sizes, tags, addresses, workers);
- both refuse a wrong argument with the same error, naming the message, buffer, address or
  setting, before anything is read or sent;
- the receiver and the sender behave and count the same on either implementation, and
  MXPS_PURE_PYTHON=1 selects the twins for both.
Throughput is measured by scripts/ltp_loopback.py, not here.
"""
import errno
import json
import os
import select
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from mxps.kernels import _ltp, ltp_py
from mxps.kernels import ltp_packet as pk
from mxps.ltp import receiver as receiver_mod
from mxps.ltp import sender as sender_mod
from mxps.wire.frame import Header, MsgType, WireError, dtype_code

LOOP = "127.0.0.1"
IMPLS = [pytest.param(_ltp, id="cython"), pytest.param(ltp_py, id="python")]
BOTH = (_ltp, ltp_py)
SIZES = (0, 1, 7, 52, 1472, 8972, 65507)
ITEMSIZES = {dtype_code(d): np.dtype(d).itemsize
             for d in ("float32", "float64", "float16", "uint8", "int32", "int8", "int64")}
F32 = dtype_code("float32")


def itemsize_of(code):
    return ITEMSIZES[code]          # KeyError for an unknown code, as packet.decode expects


@pytest.fixture
def socks():
    """``socks(n)``: n fresh UDP sockets on 127.0.0.1 (16 MB receive buffers), all closed
    afterwards."""
    made = []

    def make(n):
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
            s.bind((LOOP, 0))
            made.append(s)
        return made[-n:]
    yield make
    for s in made:
        s.close()


def payload_of(i, size):
    """Datagram ``i``'s bytes: distinct for every (i, size)."""
    return np.random.default_rng(i * 65537 + size).integers(0, 256, size, np.uint8).tobytes()


def read_all(impl, sock, n, slot_size=65536, max_batch=64, timeout=10.0):
    """Call ``impl.recv_batch`` until ``n`` datagrams came: [(nbytes, addr, bytes)], and the
    size of every batch."""
    ring = bytearray(b"\xee" * (slot_size * max_batch))
    out, batches = [], []
    deadline = time.monotonic() + timeout
    while len(out) < n:
        left = deadline - time.monotonic()
        assert left > 0, "only %d of %d datagrams arrived in %.0f s" % (len(out), n, timeout)
        select.select([sock], [], [], left)
        got = impl.recv_batch(sock, ring, slot_size, max_batch)
        batches.append(len(got))
        for i, (size, addr) in enumerate(got):
            slot = ring[i * slot_size:(i + 1) * slot_size]
            assert slot[size:] == b"\xee" * (slot_size - size), "written past its datagram"
            out.append((size, addr, bytes(slot[:size])))
        ring[:] = b"\xee" * len(ring)
    return out, batches


def quiet(sock, timeout=0.2):
    """Nothing arrives at ``sock`` within ``timeout`` seconds."""
    return not select.select([sock], [], [], timeout)[0]


# --- the selector -------------------------------------------------------------------------------

def test_the_selector_uses_the_compiled_module_and_the_endpoints_use_the_selector():
    from mxps import config
    from mxps.kernels import ltp
    mod = ltp_py if config.pure_python() else _ltp        # the suite may run with the twins
    assert ltp.IMPLEMENTATION == ("python" if mod is ltp_py else "cython")
    names = ("recv_batch", "send_batch", "open_batch", "send_run", "intake", "take_common",
             "encode_acks", "PathCore", "ShareCore", "RoundCore")
    assert [getattr(ltp, n) for n in names] == [getattr(mod, n) for n in names]
    for n in ("recv_batch", "intake", "take_common", "encode_acks", "send_batch"):
        assert getattr(receiver_mod, n) is getattr(ltp, n)
    assert sender_mod.send_batch is ltp.send_batch and sender_mod.recv_batch is ltp.recv_batch
    assert sender_mod.send_run is ltp.send_run
    from mxps.ltp import rounds, share
    assert issubclass(receiver_mod._Path, ltp.PathCore)
    assert issubclass(share.Share, ltp.ShareCore) and issubclass(rounds.LtpRound, ltp.RoundCore)


def test_mxps_pure_python_makes_the_receiver_and_the_sender_use_the_twins():
    code = ("import json; from mxps.kernels import ltp; from mxps.ltp import receiver, sender; "
            "from mxps.ltp import rounds, share; "
            "print(json.dumps([ltp.IMPLEMENTATION] + [f.__module__ for f in (receiver.recv_batch,"
            " receiver.intake, receiver.take_common, sender.send_batch, sender.recv_batch, "
            "sender.send_run, receiver._Path.__base__, share.Share.__base__, "
            "rounds.LtpRound.__base__)]))")
    env = dict(os.environ, MXPS_PURE_PYTHON="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert json.loads(out) == ["python"] + ["mxps.kernels.ltp_py"] * 9


# --- recv_batch ---------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 5, 17, 63, 64, 100])
@pytest.mark.parametrize("max_batch", [1, 7, 64])
def test_recv_batch_reads_what_a_loop_of_recvfrom_into_reads(socks, n, max_batch):
    rx, *peers = socks(4)
    results = []
    for impl in BOTH:
        for i in range(n):
            peers[i % 3].sendto(payload_of(i, SIZES[i % len(SIZES)]), rx.getsockname())
        got, batches = read_all(impl, rx, n, max_batch=max_batch)
        assert all(1 <= b <= max_batch for b in batches[:-1]) and batches[-1] <= max_batch
        results.append(got)
    expect = [(SIZES[i % len(SIZES)], peers[i % 3].getsockname(),
               payload_of(i, SIZES[i % len(SIZES)])) for i in range(n)]
    assert results[0] == expect and results[1] == expect


@pytest.mark.parametrize("impl", IMPLS)
def test_recv_batch_returns_nothing_when_nothing_waits(socks, impl):
    rx, = socks(1)
    assert impl.recv_batch(rx, bytearray(4 * 100), 100, 4) == []
    rx.setblocking(True)                  # MSG_DONTWAIT: still returns at once
    assert impl.recv_batch(rx, bytearray(4 * 100), 100, 4) == []


@pytest.mark.parametrize("impl", IMPLS)
def test_a_datagram_longer_than_its_slot_is_cut_to_the_slot(socks, impl):
    rx, tx = socks(2)
    tx.sendto(payload_of(1, 300), rx.getsockname())
    tx.sendto(payload_of(2, 10), rx.getsockname())
    got, _ = read_all(impl, rx, 2, slot_size=100, max_batch=4)
    assert got == [(100, tx.getsockname(), payload_of(1, 300)[:100]),
                   (10, tx.getsockname(), payload_of(2, 10))]


@pytest.mark.parametrize("impl", IMPLS)
def test_recv_batch_fills_a_numpy_ring_too(socks, impl):
    rx, tx = socks(2)
    tx.sendto(np.arange(4, dtype=np.float32).tobytes(), rx.getsockname())
    ring = np.zeros((2, 8), np.float32)
    assert select.select([rx], [], [], 5.0)[0]
    assert impl.recv_batch(rx, ring, 32, 2) == [(16, tx.getsockname())]
    assert ring[0].tolist() == [0, 1, 2, 3, 0, 0, 0, 0]


def stamps_running(rx, tx, impl, ring, timeout=10.0):
    """Wait until the kernel stamps ``rx``'s datagrams as they arrive.  Linux turns receive
    stamps on for the whole stack lazily (a static key flipped by a deferred work item): a
    datagram that comes before then is stamped when it is read (seen in CI: the first of five
    datagrams sent 10 ms apart carried its read time, 90 ms after the others)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tx.sendto(b"probe", rx.getsockname())
        assert select.select([rx], [], [], 5.0)[0]
        time.sleep(0.02)
        read_at, stamps = time.time(), []
        assert [n for n, _ in impl.recv_batch(rx, ring, 200, 64, stamps)] == [5]
        if stamps[0] is not None and stamps[0] < read_at - 0.01:
            return
    pytest.fail("no datagram was stamped at its arrival within %.0f s" % timeout)


@pytest.mark.parametrize("impl", IMPLS)
def test_recv_batch_gives_each_datagram_its_kernel_arrival_time_when_stamps_are_on(socks, impl):
    rx, tx, off = socks(3)
    ltp_py.enable_stamps(rx)
    stamps_running(rx, tx, impl, bytearray(64 * 200))
    before = time.time()
    for i in range(5):
        tx.sendto(payload_of(i, 100 + i), rx.getsockname())
        time.sleep(0.01)
    time.sleep(0.05)                    # they arrived long before they are read
    read_at = time.time()
    stamps, ring = [], bytearray(64 * 200)
    got = impl.recv_batch(rx, ring, 200, 64, stamps)
    assert [n for n, _ in got] == [100, 101, 102, 103, 104]
    assert len(stamps) == 5 and all(isinstance(t, float) for t in stamps), stamps
    assert before - 0.01 <= stamps[0] and stamps[-1] < read_at - 0.04, (before, stamps, read_at)
    assert all(b - a >= 0.009 for a, b in zip(stamps, stamps[1:])), stamps   # 10 ms apart
    # a socket without the option: the datagrams come, their stamps are None
    tx.sendto(b"x", off.getsockname())
    assert select.select([off], [], [], 5.0)[0]
    none = []
    assert impl.recv_batch(off, ring, 200, 64, none) == [(1, tx.getsockname())] and none == [None]


# --- send_batch ---------------------------------------------------------------------------------

def gathered(i):
    """Message i's buffers: header bytes, a float32 gradient slice's memoryview (not a copy),
    a bytearray tag; sometimes empty pieces."""
    grad = np.arange(1000, dtype=np.float32) * (i + 1)
    view = memoryview(grad).cast("B")[4 * i:4 * (i + 3 * i)]
    return [b"H%03d" % i, view, bytearray(b"tag"), b""][:1 + i % 4]


@pytest.mark.parametrize("n", [1, 2, 31, 32, 64, 200])
def test_send_batch_sends_what_a_loop_of_sendmsg_sends_gathering_each_datagram(socks, n):
    a, b, tx = socks(3)
    for impl in BOTH:
        msgs = [(gathered(i), (a if i % 3 else b).getsockname()) for i in range(n)]
        assert impl.send_batch(tx, msgs) == n
        for dest in (a, b):
            want = [b"".join(bytes(x) for x in m) for m, addr in msgs
                    if addr == dest.getsockname()]
            got, _ = read_all(ltp_py, dest, len(want))
            assert [g[2] for g in got] == want
            assert {g[1] for g in got} <= {tx.getsockname()}


@pytest.mark.parametrize("impl", IMPLS)
def test_send_batch_of_nothing_sends_nothing(socks, impl):
    rx, tx = socks(2)
    assert impl.send_batch(tx, []) == 0
    assert quiet(rx)


@pytest.mark.parametrize("impl", IMPLS)
def test_send_batch_resolves_a_host_name_and_sends_an_empty_datagram(socks, impl):
    rx, tx = socks(2)
    assert impl.send_batch(tx, [([], ("localhost", rx.getsockname()[1]))]) == 1
    got, _ = read_all(ltp_py, rx, 1)
    assert got == [(0, tx.getsockname(), b"")]


def test_an_oversized_datagram_raises_first_and_ends_the_batch_later(socks):
    rx, tx = socks(2)
    big = [bytes(40000), bytes(30000)]           # 70000 bytes: more than UDP carries
    for impl in BOTH:
        with pytest.raises(OSError) as e:
            impl.send_batch(tx, [(big, rx.getsockname()), ([b"x"], rx.getsockname())])
        assert e.value.errno == errno.EMSGSIZE
        msgs = [([b"a"], rx.getsockname()), ([b"b"], rx.getsockname()),
                (big, rx.getsockname()), ([b"c"], rx.getsockname())]
        assert impl.send_batch(tx, msgs) == 2      # the error of datagram 2 is the next call's
        with pytest.raises(OSError):
            impl.send_batch(tx, msgs[2:])
        assert impl.send_batch(tx, msgs[3:]) == 1
        got, _ = read_all(ltp_py, rx, 3)
        assert [g[2] for g in got] == [b"a", b"b", b"c"]


# --- wrong arguments: the same error from both, naming the problem, nothing sent or read ------

class Odd:
    """Not a buffer."""


BAD_SENDS = [
    ("not_a_pair", lambda dest: [([b"x"], dest), b"xx"], "message 1 is not a (buffers"),
    ("buffers_not_a_list", lambda dest: [(b"xyz", dest)], "message 0: the buffers are a bytes"),
    ("not_bytes", lambda dest: [([b"x"], dest), ([b"ok", Odd()], dest)],
     "message 1, buffer 1: a Odd is not a bytes-like object"),
    ("not_contiguous", lambda dest: [([memoryview(bytes(10))[::2]], dest)],
     "message 0, buffer 0 is not contiguous"),
    ("too_many_buffers", lambda dest: [([b"x"] * 1025, dest)],
     "message 0 has 1025 buffers; a datagram gathers at most 1024"),
    ("port", lambda dest: [([b"x"], dest), ([b"x"], (LOOP, 70000))],
     "message 1: port 70000 of ('127.0.0.1', 70000) is not in 0..65535"),
    ("address_not_a_tuple", lambda dest: [([b"x"], [LOOP, dest[1]])],
     "message 0: the address ['127.0.0.1',"),
    ("port_not_an_int", lambda dest: [([b"x"], (LOOP, "80"))],
     "message 0: the address ('127.0.0.1', '80') is not a (str host, int port)"),
    ("host", lambda dest: [([b"x"], ("no such host.invalid", 80))],
     "message 0: host 'no such host.invalid'"),
]


@pytest.mark.parametrize("case,make,problem", BAD_SENDS, ids=[c[0] for c in BAD_SENDS])
def test_a_wrong_message_is_refused_by_both_naming_it_before_anything_is_sent(
        socks, case, make, problem):
    rx, tx = socks(2)
    errors = []
    for impl in BOTH:
        with pytest.raises(ValueError) as e:
            impl.send_batch(tx, make(rx.getsockname()))
        errors.append(str(e.value))
    assert errors[0] == errors[1] and problem in errors[0], errors
    assert quiet(rx)


BAD_RECVS = [
    ("ring_too_small", lambda s: (s, bytearray(99), 10, 10),
     "the ring has 99 bytes; 10 slots of 10 bytes need 100"),
    ("ring_read_only", lambda s: (s, bytes(100), 10, 10), "the ring is read-only"),
    ("batch_zero", lambda s: (s, bytearray(100), 10, 0), "max_batch 0 is not in 1..1024"),
    ("batch_too_big", lambda s: (s, bytearray(10 * 2000), 10, 2000),
     "max_batch 2000 is not in 1..1024"),
    ("slot_zero", lambda s: (s, bytearray(100), 0, 10), "slot_size 0 is not positive"),
    ("tcp_socket", lambda s: (socket.socket(), bytearray(100), 10, 10),
     "recv_batch needs an AF_INET datagram socket"),
    ("ipv6_socket", lambda s: (socket.socket(socket.AF_INET6, socket.SOCK_DGRAM),
                               bytearray(100), 10, 10),
     "recv_batch needs an AF_INET datagram socket"),
]


@pytest.mark.parametrize("case,make,problem", BAD_RECVS, ids=[c[0] for c in BAD_RECVS])
def test_a_wrong_ring_or_socket_is_refused_by_both_naming_it_before_anything_is_read(
        socks, case, make, problem):
    rx, tx = socks(2)
    tx.sendto(b"keep me", rx.getsockname())
    errors = []
    for impl in BOTH:
        args = make(rx)
        try:
            with pytest.raises(ValueError) as e:
                impl.recv_batch(*args)
        finally:
            if args[0] is not rx:
                args[0].close()
        errors.append(str(e.value))
    assert errors[0] == errors[1] and problem in errors[0], errors
    assert read_all(ltp_py, rx, 1)[0] == [(7, tx.getsockname(), b"keep me")]


# --- round_add: a packet into a round's sum ----------------------------------------------------

@settings(max_examples=80, deadline=None)
@given(st.sampled_from([np.float32, np.float64, np.float16, np.int32]), st.integers(1, 40),
       st.integers(1, 9), st.lists(st.tuples(st.integers(-2, 12), st.integers(0, 3)),
                                   max_size=30))
def test_round_add_sums_counts_and_refuses_exactly_as_its_twin(dtype, length, epp, packets):
    """The compiled round_add and its twin: same sums (bit for bit), counts, seen flags,
    duplicate answers and refusals, for any sequence of packets of a few workers, the
    out-of-range and miscounted ones included."""
    n = -(-length // epp)
    state = {}
    for impl in (_ltp, ltp_py):
        acc = np.zeros(length, dtype)
        counts = np.zeros(n, np.uint16)
        seen = [bytearray(n) for _ in range(4)]
        answers = []
        for seq, w in packets:
            count = min(epp, length - seq * epp) if 0 <= seq < n else epp
            if w == 3:
                count += 1                      # miscounted
            payload = (np.arange(max(count, 0)) * 0.37 + seq + w).astype(dtype)
            try:
                answers.append(impl.round_add(acc, counts, seen[w], seq, epp, count,
                                              memoryview(payload.tobytes()),
                                              dtype_code(np.dtype(dtype))))
            except ValueError as e:
                answers.append(str(e))
        state[impl] = (acc.tobytes(), counts.tolist(), [bytes(x) for x in seen], answers)
    assert state[_ltp] == state[ltp_py]


@pytest.mark.parametrize("impl", IMPLS)
def test_send_batch_refuses_a_socket_that_is_not_ipv4_udp(impl):
    with socket.socket() as tcp:
        with pytest.raises(ValueError, match="send_batch needs an AF_INET datagram socket"):
            impl.send_batch(tcp, [([b"x"], (LOOP, 9))])


@pytest.mark.parametrize("impl", IMPLS)
def test_a_closed_socket_raises_oserror(socks, impl):
    rx, = socks(1)
    rx.close()
    with pytest.raises(OSError) as e:
        impl.recv_batch(rx, bytearray(100), 10, 10)
    assert e.value.errno == errno.EBADF
    with pytest.raises(OSError) as e:
        impl.send_batch(rx, [([b"x"], (LOOP, 9))])
    assert e.value.errno == errno.EBADF


# --- a full send buffer (a private network namespace, its loopback behind a slow qdisc) --------

def _fresh_slow_qdisc():
    """Loopback behind a tbf of 8 bit/s, its tokens fresh (a new qdisc each time)."""
    subprocess.run(["tc", "qdisc", "replace", "dev", "lo", "root", "pfifo_fast"], check=True)
    subprocess.run(["tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate", "8bit",
                    "burst", "1600", "limit", "100000000"], check=True)


def _tiny_sender():
    """A UDP socket on loopback with the smallest send buffer."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((LOOP, 0))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1)
    return s


def _full_buffer_scenario():
    """Run inside ``unshare -n``: a loopback whose qdisc holds packets (8 bit/s), so the
    sockets' send buffers (the minimum, 4608 bytes) fill up; what each implementation and the
    Sender on it do then, as JSON (each after a fresh qdisc, so its tokens start the same)."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    out = {}
    for impl in BOTH:
        _fresh_slow_qdisc()
        rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        rx.bind((LOOP, 0))
        s = _tiny_sender()
        msgs = [([bytes(1000)], rx.getsockname())] * 10
        batches = [impl.send_batch(s, msgs), impl.send_batch(s, msgs)]
        _fresh_slow_qdisc()
        s2 = _tiny_sender()
        grad = np.ones(2500, np.float32)
        runs = [impl.send_run(s2, rx.getsockname(), pk.Tagger(bytes(32)), 0, F32, 1, 0, 1, 0,
                              2500, grad, 4, 250, seq, 10 - seq, seq) for seq in (0, 0)]
        s2.close()
        sender_mod.send_batch = impl.send_batch
        sender_mod.send_run = impl.send_run
        tx = sender_mod.Sender(0, LOOP)
        tx.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1)
        reply = json.dumps({"port": rx.getsockname()[1], "key": bytes(32).hex(),
                            "budget": 1000}).encode()
        tx.add_path(0, LOOP, reply, 0.0, initial_rate=1e12)
        h = Header(MsgType.PUSH, key=1, sender=0, iteration=1, length=25000, dtype=F32)
        tx.enqueue(0, h, np.ones(25000, np.float32), 4, "done")
        t = 0.0
        while tx.counts["data"] < 100:       # the push's 100 packets, on a clock that paces
            t = max(t, tx.pump(t) or t)
        out[impl.__name__] = {"batches": batches, "runs": runs, "sender": dict(tx.counts)}
        for sock in (rx, s, tx.sock):
            sock.close()
    print(json.dumps(out))


@pytest.mark.netns
def test_a_full_send_buffer_sends_none_or_a_part_and_the_sender_counts_the_rest_as_lost():
    """send_batch and send_run into a full send buffer send a part, then none, and say how
    many; the Sender on either implementation counts the rest as lost, the same (in a private
    network namespace: ``unshare -n``)."""
    run = subprocess.run(["unshare", "-n", sys.executable, os.path.abspath(__file__),
                          "full-buffer"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    kernel, twin = out[_ltp.__name__], out[ltp_py.__name__]
    first, again = kernel["batches"]
    assert 0 < first < 10 and again == 0           # a part, then none: EAGAIN at the first
    assert twin["batches"] == [first, again]
    first, again = kernel["runs"]                  # send_run into a full buffer: the same
    assert 0 < first < 10 and again == 0
    assert twin["runs"] == [first, again]
    assert kernel["sender"] == twin["sender"], (kernel, twin)
    counts = kernel["sender"]
    tried = counts["data"] + counts.get("end", 0)
    assert counts["data"] == 100 and tried - 10 < counts["sndbuf_full"] < tried
    assert "send_error" not in counts


# --- open_batch ---------------------------------------------------------------------------------

KEYS = [bytes([w + 1]) * pk.KEY_SIZE for w in range(3)]
PEERS = [(LOOP, 40000 + w) for w in range(3)]
PATHS = [(PEERS[0], pk.Tagger(KEYS[0])), (PEERS[1], pk.Tagger(KEYS[1])), None]

header = st.fixed_dictionaries({
    "type_": st.sampled_from([pk.DATA, pk.DATA, pk.END, pk.ACK, 0, 9]),
    "worker": st.sampled_from([0, 1, 1, 2, 3, 300]),
    "dtype": st.sampled_from(sorted(ITEMSIZES) + [7, 200]),
    "pn": st.integers(0, 2 ** 32 - 1), "key": st.integers(-2 ** 31, 2 ** 31 - 1),
    "plan_version": st.integers(0, 2 ** 32 - 1), "round_": st.integers(-2 ** 63, 2 ** 63 - 1),
    "offset": st.integers(0, 2 ** 64 - 1), "length": st.integers(0, 2 ** 64 - 1),
    "seq": st.integers(0, 2 ** 32 - 1),
    "count": st.one_of(st.integers(0, 40), st.just(2 ** 32 - 1)),
})
datagrams = st.fixed_dictionaries({
    "h": header,
    "fit": st.booleans(),                 # the payload is count whole elements
    "extra": st.integers(0, 40),
    "tag": st.sampled_from(["good", "good", "good", "flipped", "other_key"]),
    "sender": st.sampled_from(["registered", "registered", "registered", "other"]),
    "cut": st.sampled_from([None, None, None, None, 0, 1, 51, 67, 68]),
    "magic": st.sampled_from([b"LT", b"LT", b"LT", b"LX"]),
    "version": st.sampled_from([pk.VERSION] * 5 + [0, 2]),
})


def build(d, rng):
    """One datagram (bytes) and the address it comes from, from a drawn description."""
    h = d["h"]
    size = ITEMSIZES.get(h["dtype"], 4)
    nbytes = h["count"] * size if d["fit"] and h["count"] < 100 else d["extra"]
    payload = rng.integers(0, 256, nbytes, np.uint8).tobytes()
    w = h["worker"]
    key = KEYS[w % 3] if d["tag"] != "other_key" else KEYS[(w + 1) % 3]
    head = bytearray(pk.encode_header(h["type_"], w, h["dtype"], h["pn"], h["key"],
                                      h["plan_version"], h["round_"], h["offset"], h["length"],
                                      h["seq"], h["count"]))
    head[0:2] = d["magic"]
    head[2] = d["version"]
    dgram = bytearray(bytes(head) + payload + pk.Tagger(key).tag(bytes(head), payload))
    if d["tag"] == "flipped":
        dgram[int(rng.integers(0, len(dgram)))] ^= 1 << int(rng.integers(0, 8))
    if d["cut"] is not None:
        dgram = dgram[:d["cut"]]
    addr = PEERS[w] if d["sender"] == "registered" and w < 3 else (LOOP, 9)
    return bytes(dgram), addr


def opened(impl, dgrams, itemsize=itemsize_of, slot_size=512):
    ring = bytearray(slot_size * max(1, len(dgrams)))
    got = []
    for i, (dgram, addr) in enumerate(dgrams):
        ring[i * slot_size:i * slot_size + len(dgram)] = dgram
        got.append((len(dgram), addr))
    out = impl.open_batch(memoryview(ring), slot_size, got, PATHS, itemsize)
    assert len(out) == len(dgrams)
    return [None if o is None else
            ({s: getattr(o[0], s) for s in pk.Fields.__slots__}, bytes(o[1])) for o in out]


@settings(max_examples=200, deadline=None)
@given(ds=st.lists(datagrams, min_size=1, max_size=8), seed=st.integers(0, 2 ** 32 - 1))
def test_open_batch_accepts_and_decodes_exactly_what_the_reference_checks_do(ds, seed):
    rng = np.random.default_rng(seed)
    dgrams = [build(d, rng) for d in ds]
    compiled, twin = opened(_ltp, dgrams), opened(ltp_py, dgrams)
    assert compiled == twin
    for (dgram, addr), o in zip(dgrams, twin):      # the twin is the server's reference checks
        ok = True
        try:
            w = pk.peek_worker(dgram)
            ok = w < 3 and PATHS[w] is not None and PATHS[w][0] == addr \
                and PATHS[w][1].check(dgram)
            f, payload = pk.decode(dgram, itemsize_of) if ok else (None, None)
        except pk.PacketError:
            ok = False
        assert (o is not None) == ok
        if ok:
            assert o == ({s: getattr(f, s) for s in pk.Fields.__slots__}, bytes(payload))


def test_open_batch_accepts_a_good_packet_of_each_dtype_and_names_its_fields():
    rng = np.random.default_rng(5)
    dgrams = []
    for code, size in sorted(ITEMSIZES.items()):
        d = {"h": {"type_": pk.DATA, "worker": 1, "dtype": code, "pn": 2 ** 32 - 1, "key": -3,
                   "plan_version": 7, "round_": -2, "offset": 2 ** 64 - 1, "length": 99,
                   "seq": 12, "count": 5}, "fit": True, "extra": 0, "tag": "good",
             "sender": "registered", "cut": None, "magic": b"LT", "version": pk.VERSION}
        dgrams.append(build(d, rng))
    for impl in BOTH:
        out = opened(impl, dgrams)
        for (code, size), o in zip(sorted(ITEMSIZES.items()), out):
            fields, payload = o
            assert fields == {"type": pk.DATA, "worker": 1, "dtype": code, "pn": 2 ** 32 - 1,
                              "key": -3, "plan_version": 7, "round": -2, "offset": 2 ** 64 - 1,
                              "length": 99, "seq": 12, "count": 5}
            assert len(payload) == 5 * size


@pytest.mark.parametrize("impl", IMPLS)
def test_an_itemsize_lookup_that_raises_leaves_the_packet_to_the_reference_path(impl):
    d = {"h": {"type_": pk.DATA, "worker": 0, "dtype": 200, "pn": 1, "key": 1,
               "plan_version": 0, "round_": 1, "offset": 0, "length": 4, "seq": 0, "count": 4},
         "fit": True, "extra": 0, "tag": "good", "sender": "registered", "cut": None,
         "magic": b"LT", "version": pk.VERSION}
    dgram = build(d, np.random.default_rng(0))

    def wire_error(code):               # what receiver._itemsize does today (wire.dtype_of)
        raise WireError("unknown dtype code %d" % code)
    assert opened(impl, [dgram], itemsize=wire_error) == [None]
    assert opened(impl, [dgram]) == [None]


@pytest.mark.parametrize("impl", IMPLS)
def test_open_batch_refuses_a_batch_that_does_not_fit_its_ring_naming_it(impl):
    with pytest.raises(ValueError, match="3 datagrams of 100-byte slots do not fit the 200"):
        impl.open_batch(memoryview(bytearray(200)), 100, [(1, PEERS[0])] * 3, PATHS,
                        itemsize_of)
    with pytest.raises(ValueError, match="datagram 1 has 101 bytes, a slot 100"):
        impl.open_batch(memoryview(bytearray(200)), 100, [(1, PEERS[0]), (101, PEERS[0])],
                        PATHS, itemsize_of)


# --- the endpoints on either implementation -----------------------------------------------------

@pytest.fixture(params=["cython", "python"])
def impl(request, monkeypatch):
    """Make the receiver and the sender use one implementation."""
    mod = _ltp if request.param == "cython" else ltp_py
    monkeypatch.setattr(receiver_mod, "recv_batch", mod.recv_batch)
    monkeypatch.setattr(receiver_mod, "intake", mod.intake)
    monkeypatch.setattr(receiver_mod, "take_common", mod.take_common)
    monkeypatch.setattr(receiver_mod, "encode_acks", mod.encode_acks)
    monkeypatch.setattr(receiver_mod, "send_batch", mod.send_batch)
    monkeypatch.setattr(sender_mod, "recv_batch", mod.recv_batch)
    monkeypatch.setattr(sender_mod, "send_batch", mod.send_batch)
    monkeypatch.setattr(sender_mod, "send_run", mod.send_run)
    return request.param


def test_the_receiver_hands_over_counts_drops_and_acks_the_same_on_either(socks, impl):
    rx = receiver_mod.Receiver(LOOP, 3, mtu=1500)
    try:
        w0, w1, stranger = socks(3)
        keys = []
        for w, s in enumerate((w0, w1)):
            body = json.dumps({"host": LOOP, "port": s.getsockname()[1], "mtu": 1500})
            keys.append(bytes.fromhex(json.loads(rx.hello(w, body.encode()))["key"]))
        t0, t1 = pk.Tagger(keys[0]), pk.Tagger(keys[1])

        def data(tagger, w, pn, n, dtype=F32):
            body = np.arange(n, dtype=np.float32).tobytes()
            return b"".join(bytes(b) for b in pk.encode(tagger, pk.DATA, w, dtype, pn, 3, 0, 1,
                                                        0, 1000, pn, n, body))
        good0 = data(t0, 0, 5, 10)
        bad_tag = bytearray(data(t0, 0, 8, 5))
        bad_tag[-1] ^= 1        # (setting it to 0 left it as it was once in 256 keys)
        bad_tag = bytes(bad_tag)
        flipped = bytearray(good0)
        flipped[60] ^= 4
        sends = [(w0, good0), (w1, data(t1, 1, 0, 351)), (stranger, data(t0, 0, 6, 3)),
                 (w0, bytes(flipped)), (w0, good0[:40]), (w1, data(t0, 1, 1, 2)),
                 (w0, data(t0, 2, 1, 2)), (w0, b"XX" + good0[2:]), (w0, data(t0, 0, 7, 1)),
                 (w1, b"".join(bytes(b) for b in pk.encode(t1, pk.END, 1, F32, 2, 3, 0, 1, 0,
                                                           1000, 1, 0))),
                 (w0, bad_tag)]
        for s, dgram in sends:
            s.sendto(dgram, (LOOP, rx.port))
        handed = []
        deadline = time.monotonic() + 10
        while rx.counts["packets"] + rx.drops.total() < len(sends):
            assert time.monotonic() < deadline, (rx.counts, rx.drops.counts)
            select.select([rx.sock], [], [], 1.0)
            rx.receive(lambda f, p, now: handed.append((f.worker, f.type, f.pn, f.count,
                                                        bytes(p))), time.monotonic())
        accepted = [sends[i][1] for i in (0, 1, 8, 9)]
        assert sorted(handed) == sorted([
            (0, pk.DATA, 5, 10, good0[52:-16]),
            (1, pk.DATA, 0, 351, np.arange(351, dtype=np.float32).tobytes()),
            (0, pk.DATA, 7, 1, np.zeros(1, np.float32).tobytes()), (1, pk.END, 2, 0, b"")])
        assert dict(rx.drops.counts) == {"address": 2, "tag": 3, "short": 1, "magic": 1}
        assert rx.counts["packets"] == 4 and rx.counts["bytes"] == sum(map(len, accepted))
        acked = {0: set(), 1: set()}
        for s, tagger, w, want in ((w0, t0, 0, {5, 7}), (w1, t1, 1, {0, 2})):
            while acked[w] != want:
                got, _ = read_all(ltp_py, s, 1)
                acked[w] |= {pn for a, k in pk.decode_ack(got[0][2], tagger, w)
                             for pn in range(a, a + k)}
        assert rx.counts["acks"] >= 2 and quiet(w0, 0.05) and quiet(w1, 0.05)
    finally:
        rx.close()


def test_a_ring_slot_holds_the_largest_datagram_each_endpoint_can_be_sent():
    pns = range(0, 4 * pk.MAX_ACK_RANGES, 2)                 # every range a single packet
    biggest_ack = max(map(len, pk.encode_acks(pk.Tagger(KEYS[0]), 0, pns, 1e9)))
    assert biggest_ack <= sender_mod.ACK_SLOT
    assert receiver_mod.SLOT >= pk.MAX_DATAGRAM


def test_a_pumped_push_arrives_whole_and_its_end_ack_completes_it_on_either(impl):
    rx = receiver_mod.Receiver(LOOP, 1, mtu=1500)
    tx = sender_mod.Sender(0, LOOP)
    try:
        reply = rx.hello(0, tx.hello_body(LOOP, rx.port))
        tx.add_path(0, LOOP, reply, time.monotonic(), initial_rate=1e9)
        grad = np.random.default_rng(2).standard_normal(40000).astype(np.float32)
        h = Header(MsgType.PUSH, key=4, sender=0, iteration=1, length=grad.size, dtype=F32)
        tx.enqueue(0, h, grad, 4, "done")
        got = np.zeros_like(grad)
        epp = pk.elements_per_packet(rx.budget, 4)
        seqs = []

        def handle(f, payload, now):
            if f.type == pk.DATA:
                seqs.append(f.seq)
                got[f.seq * epp:f.seq * epp + f.count] = np.frombuffer(payload, np.float32)
        done, deadline = [], time.monotonic() + 20
        while not done:
            now = time.monotonic()
            assert now < deadline, dict(tx.counts)
            wake = tx.pump(now)
            wait = 0.05 if wake is None else min(0.05, max(0.0, wake - now))
            ready, _, _ = select.select([tx.sock, rx.sock], [], [], wait)
            if rx.sock in ready:
                rx.receive(handle, time.monotonic())
            if tx.sock in ready:
                done = tx.receive(time.monotonic())
        n = pk.packet_count(grad.size, epp)
        assert [p.on_done for p in done] == ["done"] and sorted(seqs) == list(range(n))
        assert got.tobytes() == grad.tobytes()
        assert tx.counts["data"] == n and "sndbuf_full" not in tx.counts
    finally:
        tx.close()
        rx.close()


if __name__ == "__main__" and sys.argv[1:] == ["full-buffer"]:
    _full_buffer_scenario()


# --- send_run -----------------------------------------------------------------------------------

RUN_DTYPES = {"float32": 4, "float64": 8, "float16": 2, "int8": 1}


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(sorted(RUN_DTYPES)), length=st.integers(0, 3000),
       epp=st.integers(1, 700), data=st.data(),
       pn=st.sampled_from([0, 7, 2 ** 32 - 3, 2 ** 40 + 5]),
       fields=st.tuples(st.integers(0, 0xFFFF), st.integers(-2 ** 31, 2 ** 31 - 1),
                        st.integers(0, 2 ** 32 - 1), st.integers(-2 ** 63, 2 ** 63 - 1),
                        st.integers(0, 2 ** 64 - 1)))
def test_send_run_sends_the_datagrams_packet_encode_makes_each_packet_its_elements(
        dtype, length, epp, data, pn, fields):
    """Both implementations send, datagram for datagram, what ``packet.encode`` makes for
    packets seq .. seq + k - 1 of the slice (pn + i modulo 2**32 on the wire), and each decodes
    to its own elements of the slice."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as rx, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx:
        rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
        rx.bind((LOOP, 0))
        tx.bind((LOOP, 0))
        _check_send_run(rx, tx, dtype, length, epp, data, pn, fields)


def _check_send_run(rx, tx, dtype, length, epp, data, pn, fields):
    n = pk.packet_count(length, epp)
    seq = data.draw(st.integers(0, n))
    k = data.draw(st.integers(0, min(n - seq, 64)))
    worker, key, plan, round_, offset = fields
    itemsize = RUN_DTYPES[dtype]
    grad = np.random.default_rng(length * 7919 + epp).integers(
        0, 256, length * itemsize, np.uint8).view(np.dtype(dtype))
    tagger = pk.Tagger(bytes(range(32)))
    code = dtype_code(dtype)
    want = [b"".join(bytes(x) for x in pk.encode(
        tagger, pk.DATA, worker, code, (pn + i) & pk.PN_MASK, key, plan, round_, offset,
        length, seq + i, min(epp, length - (seq + i) * epp),
        memoryview(grad).cast("B")[(seq + i) * epp * itemsize:
                                  (seq + i) * epp * itemsize
                                  + min(epp, length - (seq + i) * epp) * itemsize]))
        for i in range(k)]
    for impl in BOTH:
        assert impl.send_run(tx, rx.getsockname(), tagger, worker, code, key, plan, round_,
                             offset, length, grad, itemsize, epp, seq, k, pn) == k
        got, _ = read_all(ltp_py, rx, k) if k else ([], [])
        assert [g[2] for g in got] == want, impl.__name__
        assert quiet(rx, 0.05)
    for i, dgram in enumerate(want):
        assert tagger.check(dgram)
        f, payload = pk.decode(dgram, lambda c: itemsize)
        assert (f.seq, f.pn, f.length, f.worker) == (seq + i, (pn + i) & pk.PN_MASK, length,
                                                    worker)
        lo = f.seq * epp
        assert bytes(payload) == grad[lo:lo + f.count].tobytes()


def _run_args(rx, grad, **over):
    args = dict(sock=None, addr=rx.getsockname(), tagger=pk.Tagger(bytes(32)), worker=1,
                dtype=F32, key=3, plan_version=1, round_=5, offset=0, length=grad.size,
                data=grad, itemsize=4, epp=100, seq=0, k=2, pn=0)
    args.update(over)
    return args


@pytest.mark.parametrize("over,message", [
    (dict(seq=9, k=2), r"packets 9\.\.10 of a 10-packet slice"),
    (dict(k=-1), r"packets 0\.\.-2 of a 10-packet slice"),
    (dict(length=999), r"4000 bytes of data for a slice of 999 elements of 4 bytes"),
    (dict(epp=0), r"elements per packet 0 must be positive"),
    (dict(worker=70000), r"the worker 70000 does not fit its header field"),
    (dict(key=2 ** 31), r"the key 2147483648 does not fit"),
    (dict(round_=1.5), r"the round 1\.5 does not fit"),
    (dict(pn=-1), r"packet number -1 is not an unsigned 64-bit integer"),
    (dict(addr=("no such host.invalid", 9)), r"host 'no such host\.invalid'"),
    (dict(data="text"), r"the data is a str, not a bytes-like object"),
])
def test_send_run_refuses_a_wrong_argument_in_both_naming_it_before_sending(socks, over,
                                                                           message):
    rx, tx = socks(2)
    grad = np.zeros(1000, np.float32)
    for impl in BOTH:
        args = _run_args(rx, grad, **over)
        args["sock"] = tx
        with pytest.raises(ValueError, match=message):
            impl.send_run(*args.values())
    assert quiet(rx)

