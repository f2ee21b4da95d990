"""The server's packet intake (``kernels.ltp.intake`` and the state it changes).

- The compiled cores (``_ltp.PathCore``, ``ShareCore``, ``RoundCore``) change their state
  exactly as their pure-Python twins in ``ltp_py`` do, on any sequence of inputs (hypothesis):
  a path's loss and order from its packet numbers and stamps, the grant's rate windows (both
  kinds) and the samples they give, a round's sums and counts; ``encode_acks`` makes the same
  bytes as ``packet.encode_acks``.
- The fast path is exact: a server whose receiver adds packets into open rounds in C
  (``MXPS_LTP_FAST``, the default) ends every round with the bytes, the optimizer state, the
  close reasons and the counts of a server that takes every packet through
  ``ServerState.take_packet``, on the same lossy, reordered, duplicated datagrams over real
  UDP sockets, with the compiled ``intake`` and with its twin; and most packets do take it.

Throughput is measured by scripts/ltp_intake_cpu.py, not here.
"""
import json
import pickle
import random
import select
import socket

import mxnet as mx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from mxps.kernels import _ltp, ltp_py
from mxps.kernels import ltp_packet as pk
from mxps.ltp import receiver as receiver_mod
from mxps.ltp.receiver import Receiver
from mxps.roles.server_state import LtpSettings, ServerState
from mxps.wire.frame import Header, MsgType, dtype_code
from test_server_state import only, send, value_of, worker

LOOP = "127.0.0.1"
F32 = dtype_code(np.float32)


# --- the cores against their twins --------------------------------------------------------------

pns = st.lists(st.tuples(
    st.one_of(st.integers(0, 3000), st.integers(2 ** 32 - 600, 2 ** 32 - 1),
              st.integers(0, 2 ** 32 - 1)),
    st.one_of(st.none(), st.floats(0, 10, allow_nan=False))), max_size=300)


def path_state(p):
    return (p.block, p.hi, p.hi_stamp, p.settled, p.loss, p.received)


@settings(max_examples=200, deadline=None)
@given(pns, st.booleans())
def test_a_paths_order_and_loss_are_the_same_on_either(seq, ascending):
    if ascending:       # mostly in order, as paths are: the blocks settle
        seq = [((i * 7 + pn % 5) & pk.PN_MASK, t) for i, (pn, t) in enumerate(seq)]
    a, b = _ltp.PathCore(("h", 1), None), ltp_py.PathCore(("h", 1), None)
    for pn, stamp in seq:
        assert a.note(pn, stamp) == b.note(pn, stamp)
        assert path_state(a) == path_state(b)


def recording(core):
    class Recording(core):
        def __init__(self, *args):
            super().__init__(*args)
            self.added = []

        def _add(self, now, rate):
            self.added.append((now, rate))
    return Recording


SHARE_FIELDS = ("_read_bytes", "_start", "_read", "_drained", "_bytes", "_last", "_sending",
                "_busy_workers", "_busy", "_train", "_offset", "_phase", "added")

arrivals = st.lists(st.tuples(
    st.integers(0, 3), st.integers(68, 9000), st.floats(0, 0.03), st.booleans(),
    st.one_of(st.none(), st.floats(-0.001, 0.02)), st.booleans()), max_size=200)


@settings(max_examples=200, deadline=None)
@given(arrivals, st.booleans(), st.booleans())
def test_the_grants_rate_windows_are_the_same_on_either(seq, busy_windows, stamped):
    a, b = (recording(core)(4, busy_windows) for core in (_ltp.ShareCore, ltp_py.ShareCore))
    now = t = 100.0
    for w, nbytes, dt, drained, dstamp, end in seq:
        now += dt                            # reads in time order, stamps mostly too
        arrival = None
        if stamped and dstamp is not None:
            t += dstamp
            arrival = t
        a.on_packet(w, nbytes, now, drained, arrival, end)
        b.on_packet(w, nbytes, now, drained, arrival, end)
        for name in SHARE_FIELDS:
            assert getattr(a, name) == getattr(b, name), name


def round_state(r):
    return (r.acc.tobytes(), r.counts.tobytes(), [None if s is None else bytes(s) for s in r.seen],
            r.received, r.heard, r.first, r.last, r.duplicates, r.below)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(["float32", "float64", "float16"]), st.integers(1, 60),
       st.integers(1, 9), st.floats(0, 1), st.lists(st.tuples(
           st.integers(0, 2), st.integers(-1, 10), st.integers(0, 10)), max_size=80))
def test_a_rounds_adds_are_the_same_on_either(dtype, length, epp, lowest, packets):
    rounds = [core(np.zeros(length, dtype), epp, 3, dtype_code(dtype), lowest)
              for core in (_ltp.RoundCore, ltp_py.RoundCore)]
    n = pk.packet_count(length, epp)
    for i, (w, seq, count) in enumerate(packets):
        if 0 <= seq < n and count == 0:
            count = min(epp, length - seq * epp)         # mostly packets that fit the cut
        payload = np.arange(count, dtype=dtype) + i
        results = []
        for r in rounds:
            try:
                results.append(r.add(w, seq, count, payload.tobytes(), float(i)))
            except ValueError as e:
                results.append(str(e))
        assert results[0] == results[1]
        assert round_state(rounds[0]) == round_state(rounds[1])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 2 ** 32 - 1), st.integers(0, 400)), max_size=600),
       st.floats(0, 1e12), st.floats(0, 1e9))
def test_acks_are_the_same_bytes_on_either(numbers, grant, start):
    tagger = pk.Tagger(bytes(range(32)))
    assert _ltp.encode_acks(tagger, 3, numbers, grant, start) == \
        ltp_py.encode_acks(tagger, 3, numbers, grant, start)


# --- the fast path against the slow one, over UDP -----------------------------------------------

BUDGET_MTU = 576                 # 480 payload bytes: 120 float32 per packet
WORKERS = 3
KEYS = {3: 1500, 4: 333}         # key -> elements (13 and 3 packets)
SGD = dict(momentum=0.9, wd=1e-4)


class Server:
    """A receiver and a server state on 127.0.0.1, registered with the workers' sockets."""

    def __init__(self, socks, fast):
        self.rx = Receiver(LOOP, WORKERS, BUDGET_MTU)
        # no arrival stamps: the two servers must see the same order, and a stamp is when the
        # kernel took the datagram (ltp.receiver: a packet out of order by the socket only)
        self.rx.sock.setsockopt(socket.SOL_SOCKET, ltp_py.SO_TIMESTAMPNS, 0)
        self.state = ServerState(0, WORKERS, True, ltp=LtpSettings(
            self.rx.budget, loss=lambda: self.rx.loss, reordered=lambda: self.rx.reordered_at,
            share=self.rx.share, fast=fast))
        only(self.state.on_request(worker(0), Header(MsgType.SET_OPTIMIZER, sender=0),
                                   pickle.dumps(mx.optimizer.SGD(**SGD))), MsgType.ACK)
        for key, n in KEYS.items():
            only(send(self.state, MsgType.INIT, key,
                      value=np.linspace(-1, 1, n).astype(np.float32)), MsgType.ACK)
        self.taggers = []
        for w, s in enumerate(socks):
            body = json.dumps({"host": LOOP, "port": s.getsockname()[1], "mtu": BUDGET_MTU})
            reply = json.loads(self.rx.hello(w, body.encode()))
            self.taggers.append(pk.Tagger(bytes.fromhex(reply["key"])))

    def read(self, expect, now):
        """Take ``expect`` datagrams (the same batches on both servers: all of a chunk is in
        the socket before the first read)."""
        got = 0
        while got < expect:
            assert select.select([self.rx.sock], [], [], 5.0)[0], "datagrams missing"
            st = self.state
            got += self.rx.receive(st.take_packet, now, st.ltp_fast, st.plan_version,
                                   st.fast_taken)
            st.outs()

    def weights(self, it):
        return {k: value_of(only(send(self.state, MsgType.PULL, k, w=0, it=it, length=n)))
                .tobytes() for k, n in KEYS.items()}


def round_packets(rng, it, loss):
    """Every worker's packets of round ``it`` of both keys, as (worker, fields, payload):
    a few lost (never resent), a few duplicated, in an order that interleaves the workers in
    runs and moves a packet now and then; the ENDs after each worker's packets."""
    epp = pk.elements_per_packet(pk.payload_budget(BUDGET_MTU), 4)
    streams = []
    for w in range(WORKERS):
        out = []
        for key, n in KEYS.items():
            grad = np.random.default_rng(100 * it + 10 * w + key).standard_normal(n) \
                .astype(np.float32)
            k = pk.packet_count(n, epp)
            for seq in range(k):
                if rng.random() < loss:
                    continue
                part = grad[seq * epp:(seq + 1) * epp]
                out.append((w, (pk.DATA, key, it, n, seq, part.size), part.tobytes()))
                if rng.random() < 0.03:
                    out.append(out[-1])
            out.append((w, (pk.END, key, it, n, k, 0), b""))
        streams.append(out)
    merged = []
    while any(streams):                    # runs of 1-6 packets a worker, as paced senders
        w = rng.choice([i for i, s in enumerate(streams) if s])
        run = rng.randint(1, 6)
        merged += streams[w][:run]
        del streams[w][:run]
    for _ in range(len(merged) // 20):     # a packet overtaken now and then
        i = rng.randrange(len(merged) - 1)
        merged[i], merged[i + 1] = merged[i + 1], merged[i]
    return merged


@pytest.fixture(params=["cython", "python"])
def intake_impl(request, monkeypatch):
    mod = _ltp if request.param == "cython" else ltp_py
    monkeypatch.setattr(receiver_mod, "intake", mod.intake)
    monkeypatch.setattr(receiver_mod, "take_common", mod.take_common)
    return request.param


@pytest.mark.parametrize("loss", [0.0, 0.05, 0.2])
def test_a_server_adding_packets_in_its_receiver_ends_every_round_as_take_packet_does(
        intake_impl, loss):
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(WORKERS)]
    servers = []
    try:
        for s in socks:
            s.bind((LOOP, 0))
        fast, slow = servers = [Server(socks, True), Server(socks, False)]
        rng = random.Random(int(loss * 1000) + 7)
        pns = [0] * WORKERS
        now = 10.0
        for it in (1, 2, 3, 4):
            packets = round_packets(rng, it, loss)
            for lo in range(0, len(packets), 40):        # chunks of at most one batch each
                chunk = packets[lo:lo + 40]
                for srv in servers:
                    for w, (type_, key, r, n, seq, count), payload in chunk:
                        dgram = b"".join(bytes(b) for b in pk.encode(
                            srv.taggers[w], type_, w, F32, pns[w] & pk.PN_MASK, key, 0, r, 0,
                            n, seq, count, payload))
                        socks[w].sendto(dgram, (LOOP, srv.rx.port))
                    srv.read(len(chunk), now)
                for w, *_ in chunk:
                    pns[w] += 1
                now += 0.001
            now += 0.5                                   # deadlines and graces pass
            for srv in servers:
                srv.state.on_tick(now)
            assert fast.weights(it) == slow.weights(it)
        for key in KEYS:
            assert fast.state.updater.states[key].asnumpy().tobytes() == \
                slow.state.updater.states[key].asnumpy().tobytes()
        assert dict(fast.state.ltp_stats) == dict(slow.state.ltp_stats)
        assert fast.state.ltp_stats["rounds"] == 4 * len(KEYS)
        counts = dict(fast.rx.counts)
        taken = counts.pop("fast")
        assert slow.rx.counts.pop("fast") == 0 and counts == dict(slow.rx.counts)
        assert taken > 0.5 * counts["packets"], (taken, counts)
        assert fast.rx.loss == slow.rx.loss
        assert fast.state.ltp_fast == {} and slow.state.ltp_fast is None
    finally:
        for srv in servers:
            srv.rx.close()
        for s in socks:
            s.close()


@pytest.mark.parametrize("mod", [_ltp, ltp_py], ids=["cython", "python"])
@pytest.mark.parametrize("worker", [-1, 3, 2 ** 40])
def test_a_worker_out_of_range_is_refused_by_name_on_either(mod, worker):
    share = recording(mod.ShareCore)(3, True)
    with pytest.raises(IndexError, match="not one of the 3 workers"):
        share.on_packet(worker, 100, 1.0, True, 1.0, False)
    rnd = mod.RoundCore(np.zeros(8, np.float32), 4, 3, F32)
    with pytest.raises(IndexError, match="not one of the 3 workers"):
        rnd.add(worker, 0, 4, np.ones(4, np.float32).tobytes(), 1.0)
    paths = [mod.PathCore(("h", 1), None) for _ in range(3)]
    with pytest.raises(IndexError, match="not one of the 3 workers"):
        mod.take_common(worker, 1, False, 100, None, 1.0, True, paths, share, [False] * 3,
                        [0] * 6)
    assert share._last == [None] * 3 and rnd.seen == [None] * 3 and not any(p.acks for p in paths)
