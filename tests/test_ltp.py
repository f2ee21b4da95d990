"""LTP's protocol core (mxps/ltp, and its part of roles/server_state.py): packets, rounds, the
server's state under loss, the UDP endpoints, and two LTP training jobs.

Layers, each checked on its own so that a failure names its layer:
- packets (``kernels.ltp_packet``): the datagram format, the tags, the ACKs;
- one slice's round (``ltp.rounds.LtpRound``): hypothesis against a numpy reference of the sum
  under each filling;
- the server's state, in process, fed verified packets with deterministic drops: the applied
  update is the reference packet by packet, the frozen rule keeps weight and momentum, order
  and duplicates change nothing, a packet that fits no open round changes nothing, each Early
  Close reason is reached and counted;
- the receiver's and the sender's UDP sockets on 127.0.0.1 in this process (no sleeps: every
  wait is a select with a deadline; the sender's clock is passed in, so its resend timers are
  driven by the test's clock);
- end to end (tests/cluster.py): LTP without loss trains what TCP trains, to 1e-5, and with 5%
  of the packets dropped the job finishes synchronised and the servers report the loss.
The Early Close rule's properties are in test_ltp_close.py, the rate model's in
test_ltp_rate.py.
"""
import collections
import json
import math
import pickle
import random
import select
import socket
import time

import mxnet as mx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import cluster
from cluster import assert_synchronised, assert_weights_close, load_weights, train_env
from mxps.kernels import ltp_packet as pk
from mxps.ltp import rate
from mxps.ltp import close as close_rule
from mxps.ltp.close import deadline_for
from mxps.ltp.receiver import Receiver
from mxps.ltp.rounds import FILLS, RESCALE, ZERO, LtpRound
from mxps.ltp import sender as ltp_sender
from mxps.ltp.sender import Sender
from mxps.roles.server_state import LtpSettings, Out, ServerState, WspSettings
from mxps.wire.frame import Header, MsgType, dtype_code
from test_server_state import only, send, value_of, worker

F32 = dtype_code(np.float32)
FLOATS = ("float16", "float32", "float64")
ITEMSIZE = {dtype_code(d): np.dtype(d).itemsize for d in FLOATS}.__getitem__   # KeyError else
PATH_KEY = bytes(range(pk.KEY_SIZE))
TAGGER = pk.Tagger(PATH_KEY)
MTUS = (576, 1500, 9000, 65536)


def datagram(tagger=TAGGER, type_=pk.DATA, w=0, dtype=F32, pn=7, key=5, version=0, it=1,
             offset=0, length=None, seq=0, count=None, payload=b""):
    """One whole datagram (bytes): by default a DATA packet carrying ``payload`` (float32)."""
    itemsize = ITEMSIZE(dtype) if dtype in (0, 1, 2) else 4
    count = len(payload) // itemsize if count is None else count
    length = count if length is None else length
    return b"".join(bytes(b) for b in pk.encode(tagger, type_, w, dtype, pn, key, version, it,
                                                offset, length, seq, count, payload))


# --- packets ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOATS)
def test_data_and_end_packets_decode_to_what_was_encoded_for_every_float_dtype(dtype):
    code = dtype_code(dtype)
    elems = np.random.default_rng(1).standard_normal(37).astype(dtype)
    fields = dict(w=3, dtype=code, pn=2 ** 32 - 1, key=-7, version=4, it=2 ** 40, offset=1000,
                  length=500, seq=9)
    d = datagram(payload=elems.tobytes(), **fields)
    assert TAGGER.check(d)
    f, payload = pk.decode(d, ITEMSIZE)
    assert (f.type, f.worker, f.dtype, f.pn, f.key, f.plan_version, f.round, f.offset, f.length,
            f.seq, f.count) == (pk.DATA, 3, code, 2 ** 32 - 1, -7, 4, 2 ** 40, 1000, 500, 9, 37)
    assert np.frombuffer(payload, dtype).tobytes() == elems.tobytes()
    end = datagram(type_=pk.END, count=0, **dict(fields, seq=25))
    f, payload = pk.decode(end, ITEMSIZE)
    assert (f.type, f.seq, f.count, payload.nbytes) == (pk.END, 25, 0, 0)
    assert len(end) == pk.OVERHEAD


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("mtu", MTUS)
def test_a_packet_carries_whole_elements_and_fills_one_ip_packet_at_most(mtu, dtype):
    itemsize = np.dtype(dtype).itemsize
    budget = pk.payload_budget(mtu)
    epp = pk.elements_per_packet(budget, itemsize)
    assert epp * itemsize <= budget < (epp + 1) * itemsize      # whole elements, none more fit
    full = datagram(dtype=dtype_code(dtype), payload=bytes(epp * itemsize))
    assert len(full) + pk.IP_UDP <= mtu and len(full) <= pk.MAX_DATAGRAM
    # the budget is the whole room: one more byte would not fit the MTU (or UDP)
    assert min(mtu - pk.IP_UDP, pk.MAX_DATAGRAM) == budget + pk.OVERHEAD
    for length in (0, 1, epp - 1, epp, epp + 1, 7 * epp + 3):
        n = pk.packet_count(length, epp)
        assert n * epp >= length and (n - 1) * epp < max(length, 1)


def test_an_mtu_that_leaves_no_room_for_a_payload_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match="MXPS_LTP_MTU"):
        pk.payload_budget(pk.IP_UDP + pk.OVERHEAD + 10)


def test_a_payload_that_is_not_the_counted_whole_elements_does_not_decode():
    for count, payload in ((3, bytes(13)), (3, bytes(8)), (0, b""), (2, bytes(12))):
        with pytest.raises(pk.PacketError) as e:
            pk.decode(datagram(count=count, payload=payload), ITEMSIZE)
        assert e.value.reason == "size" and "payload bytes" in str(e.value)
    with pytest.raises(pk.PacketError) as e:
        pk.decode(datagram(type_=pk.END, count=0, payload=bytes(4)), ITEMSIZE)
    assert e.value.reason == "size"
    with pytest.raises(pk.PacketError) as e:
        pk.decode(datagram(dtype=9, count=1, payload=bytes(4)), ITEMSIZE)
    assert e.value.reason == "dtype" and "dtype code 9" in str(e.value)


def test_a_flipped_bit_anywhere_in_header_payload_or_tag_fails_the_tag_check():
    d = bytearray(datagram(payload=np.arange(10, dtype=np.float32).tobytes()))
    assert TAGGER.check(d)
    for bit in range(8 * len(d)):
        d[bit // 8] ^= 1 << (bit % 8)
        assert not TAGGER.check(d), "bit %d flipped and the tag still checks" % bit
        d[bit // 8] ^= 1 << (bit % 8)
    assert TAGGER.check(d)
    assert not TAGGER.check(d[:-1]) and not TAGGER.check(d[:5])


def test_another_workers_key_does_not_check_and_a_key_has_32_bytes():
    d = datagram(payload=bytes(8))
    assert not pk.Tagger(bytes(pk.KEY_SIZE)).check(d)
    with pytest.raises(ValueError, match="32"):
        pk.Tagger(bytes(16))


@st.composite
def packet_numbers(draw):
    """A few packet numbers anywhere, or many in runs and gaps (several ACK datagrams)."""
    if draw(st.booleans()):
        return draw(st.sets(st.integers(0, 2 ** 32 - 1), max_size=40))
    rng = random.Random(draw(st.integers(0, 2 ** 32 - 1)))
    start, pns = rng.randrange(2 ** 31), set()
    for _ in range(draw(st.integers(pk.MAX_ACK_RANGES, 3 * pk.MAX_ACK_RANGES))):
        start += rng.randint(2, 9)                       # a gap: a new range
        pns.update(range(start, start + rng.randint(1, 4)))
        start += 4
    return pns


@settings(max_examples=60, deadline=None)
@given(packet_numbers())
def test_acks_name_exactly_the_packets_received_split_into_bounded_datagrams(pns):
    acks = pk.encode_acks(TAGGER, 4, pns)
    ranges = [r for a in acks for r in pk.decode_ack(a, TAGGER, 4)]
    named = [pn for first, n in ranges for pn in range(first, first + n)]
    assert sorted(named) == sorted(pns)                      # each once, none missing
    assert len(ranges) == len(pk.to_ranges(pns))              # runs are merged
    assert len(acks) == -(-len(ranges) // pk.MAX_ACK_RANGES)
    for a in acks:
        assert len(a) <= pk.ACK_HEADER_SIZE + 8 * pk.MAX_ACK_RANGES + pk.TAG_SIZE


def test_an_ack_carries_the_servers_rate_grant_and_start_rate_in_kilobytes_per_second():
    (ack,) = pk.encode_acks(TAGGER, 1, [5, 6], grant=12.5e6, start=3.25e6)
    assert pk.decode_ack_grant(ack, TAGGER, 1) == ([(5, 2)], 12.5e6, 3.25e6)
    (ack,) = pk.encode_acks(TAGGER, 1, [5])
    assert pk.decode_ack_grant(ack, TAGGER, 1) == ([(5, 1)], 0.0, 0.0)


def test_an_ack_for_another_worker_or_with_a_bad_tag_is_refused():
    (ack,) = pk.encode_acks(TAGGER, 1, [5, 6, 9])
    assert pk.decode_ack(ack, TAGGER, 1) == [(5, 2), (9, 1)]
    with pytest.raises(pk.PacketError) as e:
        pk.decode_ack(ack, TAGGER, 2)
    assert e.value.reason == "worker" and "worker 1" in str(e.value)
    bad = bytearray(ack)
    bad[8] ^= 1
    for d, reason in ((bad, "tag"), (ack[:10], "short"),
                      (pk.encode_acks(pk.Tagger(bytes(32)), 1, [5])[0], "tag"),
                      (datagram(payload=bytes(4)), "type")):
        with pytest.raises(pk.PacketError) as e:
            pk.decode_ack(d, TAGGER, 1)
        assert e.value.reason == reason, d


@pytest.mark.parametrize("dgram,reason", [
    (b"", "short"), (b"LT\x01", "short"), (bytes(pk.OVERHEAD - 1), "short"),
    (bytes(pk.OVERHEAD), "magic"), (b"XX" + bytes(100), "magic"),
    (b"LT" + bytes([pk.VERSION + 1]) + bytes(100), "version"),
    (b"LT\x00" + bytes(100), "version")])
def test_peek_worker_refuses_short_and_foreign_datagrams_with_a_reason(dgram, reason):
    with pytest.raises(pk.PacketError) as e:
        pk.peek_worker(dgram)
    assert e.value.reason == reason and str(e.value)


def test_peek_worker_reads_the_claimed_worker_before_any_check():
    for w in (0, 1, 258, 65535):
        assert pk.peek_worker(datagram(w=w, payload=bytes(4))) == w


# --- one slice's round ------------------------------------------------------------------------

@st.composite
def deliveries(draw):
    """A slice, its workers' gradients and which packets of which worker arrive, in which
    order, with duplicates."""
    workers = draw(st.integers(1, 4))
    epp = draw(st.integers(1, 9))
    length = draw(st.integers(0, 60))
    n = pk.packet_count(length, epp)
    got = [draw(st.sets(st.integers(0, n - 1))) if n else set() for _ in range(workers)]
    order = [(w, s) for w in range(workers) for s in sorted(got[w])]
    order = draw(st.permutations(order))
    dups = draw(st.lists(st.sampled_from(order), max_size=8)) if order else []
    for d in dups:
        order.insert(draw(st.integers(0, len(order))), d)
    return dict(workers=workers, epp=epp, length=length, got=got, order=order,
                dtype=draw(st.sampled_from(FLOATS)), seed=draw(st.integers(0, 2 ** 32 - 1)))


def reference(grads, got, epp, fill):
    """The expected sum (float64) packet by packet, and the mask of elements nobody sent."""
    workers, length = len(grads), grads[0].size
    total, count = np.zeros(length), np.zeros(length, dtype=int)
    for w, g in enumerate(grads):
        for seq in got[w]:
            block = slice(seq * epp, (seq + 1) * epp)
            total[block] += g[block]
            count[block] += 1
    if fill == RESCALE:
        some = count > 0
        total[some] *= workers / count[some]
    return total, count == 0


def runs(mask):
    """[lo, hi) runs of True in ``mask``."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], mask.astype(int), [0]))))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


@settings(max_examples=150, deadline=None)
@given(deliveries(), st.sampled_from(FILLS))
def test_a_rounds_sum_is_the_reference_under_either_filling_in_any_order(case, fill):
    dtype, epp, workers = np.dtype(case["dtype"]), case["epp"], case["workers"]
    rng = np.random.default_rng(case["seed"])
    # small integers: every sum is exact in every dtype, whatever the order of the additions
    grads = [rng.integers(-8, 9, case["length"]).astype(dtype) for _ in range(workers)]
    rnd = LtpRound(np.zeros(case["length"], dtype), epp, workers, dtype_code(dtype))
    added = []
    for t, (w, seq) in enumerate(case["order"]):
        part = grads[w][seq * epp:(seq + 1) * epp]
        added.append(rnd.add(w, seq, part.size, part.tobytes(), float(t)))
    assert added.count(False) == rnd.duplicates == len(case["order"]) - len(set(case["order"]))
    assert rnd.received == [len(g) for g in case["got"]]
    assert [h is not None for h in rnd.heard] == [bool(g) for g in case["got"]]
    frozen = rnd.fill(fill)
    want, nobody = reference(grads, case["got"], epp, fill)
    np.testing.assert_allclose(rnd.acc.astype(np.float64), want, rtol=2 * np.finfo(dtype).eps,
                               atol=0)
    assert frozen == runs(nobody)
    assert not rnd.acc[nobody].any()


def small_round(workers=2, length=10, epp=4):
    return LtpRound(np.zeros(length, np.float32), epp, workers, F32)


def test_a_whole_push_after_packets_of_the_same_worker_is_refused_and_changes_nothing():
    rnd = small_round()
    assert rnd.add(0, 1, 4, np.ones(4, np.float32).tobytes(), 1.0)
    before = rnd.acc.copy()
    assert not rnd.add_whole(0, np.full(10, 5, np.float32), 2.0)
    np.testing.assert_array_equal(rnd.acc, before)
    assert rnd.received == [1, 0] and rnd.counts.tolist() == [0, 1, 0]
    # another worker's whole push counts for every packet
    assert rnd.add_whole(1, np.full(10, 2, np.float32), 3.0)
    assert rnd.counts.tolist() == [1, 2, 1] and rnd.received == [1, 3]
    np.testing.assert_array_equal(rnd.acc, [2, 2, 2, 2, 3, 3, 3, 3, 2, 2])
    assert not rnd.add_whole(1, np.full(10, 2, np.float32), 4.0)       # once


def test_an_end_must_count_the_slices_packets_and_the_first_end_is_kept():
    rnd = small_round()
    with pytest.raises(ValueError, match="END for 2 packets, the slice has 3"):
        rnd.end(0, 2, 1.0)
    assert rnd.ends == [None, None] and rnd.heard == [None, None]
    rnd.end(0, 3, 1.0)
    rnd.end(0, 3, 2.0)
    assert rnd.ends == [1.0, None] and rnd.heard == [1.0, None]
    assert not rnd.add_whole(0, np.zeros(10, np.float32), 3.0)     # it sent its part already


@pytest.mark.parametrize("seq,count", [(3, 2), (-1, 4), (0, 3), (2, 4), (2, 1)])
def test_a_packet_that_does_not_fit_the_slices_cut_raises_and_changes_nothing(seq, count):
    rnd = small_round()
    with pytest.raises(ValueError):
        rnd.add(0, seq, count, np.ones(max(count, 0), np.float32).tobytes(), 1.0)
    assert not rnd.acc.any() and not rnd.counts.any() and rnd.heard == [None, None]
    assert rnd.seen == [None, None]          # a whole TCP push of worker 0 is still welcome
    with pytest.raises(ValueError, match="filling"):
        rnd.fill("average")


# --- the server's state, fed packets ------------------------------------------------------------

BUDGET = 64                 # payload bytes per packet here: 16 float32 elements
EPP = BUDGET // 4
KEY, N = 3, 200             # 13 packets, the last of 8 elements
NP = pk.packet_count(N, EPP)
SGD = dict(momentum=0.9, wd=1e-4)


def ltp_server(workers, optimizer=None, value=None, store=None, wsp=None, **settings):
    """A server taking LTP packets of ``BUDGET`` bytes, key KEY initialised by worker 0
    (``store``: a StoreSettings, MXPS_STORE=disk; ``wsp``: WspSettings, MXPS_MODE=wsp)."""
    s = ServerState(0, workers, True, ltp=LtpSettings(BUDGET, **settings), store=store,
                    wsp=wsp)
    if optimizer is not None:
        only(s.on_request(worker(0), Header(MsgType.SET_OPTIMIZER, sender=0),
                          pickle.dumps(mx.optimizer.SGD(**optimizer))), MsgType.ACK)
    value = np.linspace(-1, 1, N).astype(np.float32) if value is None else value
    only(send(s, MsgType.INIT, KEY, value=value), MsgType.ACK)
    return s


def push_packets(grad, w, it, key=KEY, offset=0, version=0, dtype=F32):
    """Worker ``w``'s push of ``grad`` as verified packets: ({seq: packet}, END); a packet is
    (Fields, payload) as the receiver hands them to the state."""
    raw = np.ascontiguousarray(grad)
    n = pk.packet_count(raw.size, EPP)

    def make(type_, seq, part):
        d = datagram(type_=type_, w=w, dtype=dtype, key=key, version=version, it=it,
                     offset=offset, length=raw.size, seq=seq,
                     count=0 if type_ == pk.END else part.size, payload=part.tobytes())
        return pk.decode(d, ITEMSIZE)
    return ({seq: make(pk.DATA, seq, raw[seq * EPP:(seq + 1) * EPP]) for seq in range(n)},
            make(pk.END, n, raw[:0]))


class Clock:
    """The packets' arrival times: 10 us apart."""

    def __init__(self, t=1.0):
        self.t = t

    def __call__(self):
        self.t += 1e-5
        return self.t


def feed(s, packets, clock):
    outs = []
    for f, payload in packets:
        outs += s.on_packet(f, payload, clock())
    return outs


def tick(s):
    """Run the state's timer as the server loop does: at ``next_wake()``, if any."""
    wake = s.next_wake()
    return s.on_tick(wake) if wake is not None else []


def play(s, grads, it, drops, clock, order=None, dups=0):
    """Round ``it``: every worker's packets but its ``drops``, in ``order`` (a Random; None:
    in order) with ``dups`` duplicates, then the ENDs, then the timer.  The Outs."""
    data, ends = [], []
    for w, g in enumerate(grads):
        pkts, end = push_packets(g, w, it)
        data += [p for seq, p in sorted(pkts.items()) if seq not in drops[w]]
        ends.append(end)
    if order is not None:         # ENDs too may overtake packets sent before them
        data += [order.choice(data) for _ in range(dups)] + ends + \
            [order.choice(ends) for _ in range(dups)]
        order.shuffle(data)
        ends = []
    return feed(s, data + ends, clock) + tick(s)


def drops_for(rng, workers, nobody, p=0.3):
    """Per worker the packets it loses: all of ``nobody``, and each other packet with
    probability ``p``, never by every worker."""
    drops = [{s for s in range(NP) if rng.random() < p} | set(nobody) for _ in range(workers)]
    for seq in range(NP):
        if seq not in nobody and all(seq in d for d in drops):
            drops[rng.randrange(workers)].discard(seq)
    return drops


def pull(s, it, w=0):
    return value_of(only(send(s, MsgType.PULL, KEY, w=w, it=it, length=N)))


def momentum(s):
    return s.updater.states[KEY].asnumpy()


def packet_mask(drops):
    """Per element: how many workers' packets carried it."""
    got = np.zeros(N, dtype=int)
    for d in drops:
        for seq in range(NP):
            if seq not in d:
                got[seq * EPP:(seq + 1) * EPP] += 1
    return got


@pytest.mark.parametrize("optimizer", [None, SGD], ids=["sum_served", "sgd_momentum_on_server"])
@pytest.mark.parametrize("fill", FILLS)
def test_with_packets_dropped_the_update_is_the_reference_sum_under_the_filling(fill, optimizer):
    workers = 3
    s = ltp_server(workers, optimizer, fill=fill)
    ref_update = mx.optimizer.get_updater(mx.optimizer.SGD(**SGD)) if optimizer else None
    ref_weight = mx.nd.array(np.linspace(-1, 1, N).astype(np.float32))
    rng, clock = random.Random(11), Clock()
    # round 1: partial losses only; then whole packets lost by everyone, adjacent ones and the
    # short last one among them
    for it, nobody in ((1, ()), (2, (0, 5, 6)), (3, (NP - 1, 4))):
        grads = [np.random.default_rng(100 * it + w).integers(-9, 10, N).astype(np.float32)
                 for w in range(workers)]
        drops = drops_for(rng, workers, nobody)
        before_w = pull(s, it - 1) if it > 1 else None
        before_m = momentum(s) if optimizer and it > 1 else None
        play(s, grads, it, drops, clock)
        assert s.slots[(KEY, 0)].applied == it, "round %d did not close" % it
        want, frozen = reference(grads, [set(range(NP)) - d for d in drops], EPP, fill)
        assert frozen.sum() == sum(min(EPP, N - q * EPP) for q in nobody)
        got = pull(s, it)
        if optimizer is None:           # the server serves the round's sum
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
            assert not got[frozen].any()
            continue
        # reference: MXNet's SGD of the reference sum; frozen elements keep weight and momentum
        prev_w = ref_weight.asnumpy()
        prev_m = ref_update.states[KEY].asnumpy() if KEY in ref_update.states else np.zeros(N)
        ref_update(KEY, mx.nd.array(want.astype(np.float32)), ref_weight)
        w_np, m_np = ref_weight.asnumpy(), ref_update.states[KEY].asnumpy()
        w_np[frozen], m_np[frozen] = prev_w[frozen], prev_m[frozen]
        ref_weight[:] = w_np
        ref_update.states[KEY][:] = m_np
        np.testing.assert_allclose(got, w_np, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(momentum(s), m_np, rtol=1e-5, atol=1e-9)
        if before_w is not None:        # bit for bit, not merely close
            assert got[frozen].tobytes() == before_w[frozen].tobytes()
            assert momentum(s)[frozen].tobytes() == before_m[frozen].tobytes()
            assert (got[~frozen] != before_w[~frozen]).all()
    assert s.ltp_stats["close_ends"] == 3 and s.ltp_stats["rounds"] == 3
    assert s.ltp_stats["packets_nobody"] == 5


@pytest.mark.parametrize("fill", FILLS)
def test_a_disk_store_takes_lossy_ltp_rounds_as_the_memory_store_does(tmp_path, fill):
    """MXPS_STORE=disk with LTP: the same packets, some lost by some workers and some by all
    (frozen: weight and momentum kept), give the disk server the memory server's weights, and
    its frozen elements stay bit for bit as they were."""
    from mxps.roles.server_state import StoreSettings
    mem = ltp_server(3, SGD, fill=fill)
    disk = ltp_server(3, SGD, fill=fill, store=StoreSettings(str(tmp_path), 4096))
    rng, clock = random.Random(7), Clock()
    for it, nobody in ((1, (3,)), (2, ()), (3, (0, NP - 1))):
        grads = [np.random.default_rng(10 * it + w).integers(-9, 10, N).astype(np.float32)
                 for w in range(3)]
        drops = drops_for(rng, 3, nobody)
        before = pull(disk, it - 1) if it > 1 else None
        for s in (mem, disk):
            play(s, grads, it, drops, clock)
            assert s.slots[(KEY, 0)].applied == it
        got, want = pull(disk, it), pull(mem, it)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
        frozen = packet_mask(drops) == 0
        assert frozen.sum() == sum(min(EPP, N - q * EPP) for q in nobody)
        if before is not None:
            assert got[frozen].tobytes() == before[frozen].tobytes()
    assert disk.store_stats()["scatters"] >= 3       # every round went through the row store


def test_in_a_keys_first_round_elements_nobody_delivered_keep_a_fresh_momentum():
    s = ltp_server(2, SGD, fill=ZERO)
    grads = [np.ones(N, np.float32)] * 2
    play(s, grads, 1, [{2}, {2}], Clock())
    assert s.slots[(KEY, 0)].applied == 1
    frozen = packet_mask([{2}, {2}]) == 0
    assert frozen.sum() == EPP
    assert momentum(s)[~frozen].all()
    np.testing.assert_array_equal(momentum(s)[frozen], 0)


@pytest.mark.parametrize("fill", FILLS)
def test_reordered_and_duplicated_packets_give_bit_identical_results(fill):
    # two workers: 0 + a + b == 0 + b + a in floating point, so the arrival order of the two
    # workers' packets cannot change a bit (with three it could, by rounding)
    in_order, shuffled = (ltp_server(2, SGD, fill=fill) for _ in range(2))
    rng, c1, c2 = random.Random(5), Clock(), Clock()
    for it in (1, 2, 3):
        grads = [np.random.default_rng(10 * it + w).standard_normal(N).astype(np.float32)
                 for w in range(2)]
        drops = drops_for(rng, 2, (7,) if it > 1 else ())
        play(in_order, grads, it, drops, c1)
        play(shuffled, grads, it, drops, c2, order=random.Random(it), dups=12)
        assert pull(in_order, it).tobytes() == pull(shuffled, it).tobytes()
        assert momentum(in_order).tobytes() == momentum(shuffled).tobytes()
    assert in_order.ltp_stats["drop_duplicate"] == 0
    assert shuffled.ltp_stats["drop_duplicate"] == 3 * 12
    assert shuffled.ltp_stats["duplicates"] == shuffled.ltp_stats["drop_duplicate"]
    stats = dict(shuffled.ltp_stats)
    for k in ("drop_duplicate", "duplicates"):
        del stats[k]
    assert stats == {k: v for k, v in in_order.ltp_stats.items() if "dup" not in k}


def bad_packet(kind, grad):
    """A packet of round 2 (or 1, for ``late``) that fits no open round, of kind ``kind``
    (``plan``: of a plan after the next, which no server waits for)."""
    part = grad[:EPP]
    common = dict(w=0, it=2, key=KEY, length=N, seq=0, count=EPP, payload=part.tobytes())
    changes = {
        "late": dict(it=1), "plan": dict(version=2), "slice_key": dict(key=KEY + 1),
        "slice_offset": dict(offset=EPP), "slice_length": dict(length=N + 1),
        "dtype": dict(dtype=dtype_code(np.float64), payload=part.astype(np.float64).tobytes()),
        "cut_seq": dict(seq=NP), "cut_count": dict(count=EPP - 1, payload=part[1:].tobytes()),
        "cut_end": dict(type_=pk.END, seq=NP + 1, count=0, payload=b""),
        "worker": dict(w=2)}[kind]
    return pk.decode(datagram(**dict(common, **changes)), ITEMSIZE)


@pytest.mark.parametrize("kind", ["late", "plan", "slice_key", "slice_offset", "slice_length",
                                  "dtype", "cut_seq", "cut_count", "cut_end", "worker"])
def test_a_packet_that_fits_no_open_round_is_dropped_counted_and_changes_nothing(kind):
    grads = [np.random.default_rng(w).standard_normal(N).astype(np.float32) for w in (0, 1)]
    drops = [{1}, {1, 4}]
    clean, hit = (ltp_server(2, SGD) for _ in range(2))
    for s in (clean, hit):
        c = Clock()
        play(s, grads, 1, [set(), set()], c)
        if s is hit:        # first in round 2: before worker 0's own packet 0
            assert s.on_packet(*bad_packet(kind, grads[0]), c()) == []
        play(s, grads, 2, drops, c)
    want = {"slice_key": "slice", "slice_offset": "slice", "slice_length": "slice",
            "cut_seq": "cut", "cut_count": "cut", "cut_end": "cut"}.get(kind, kind)
    assert hit.ltp_stats.pop("drop_" + want) == 1, dict(hit.ltp_stats)
    assert dict(hit.ltp_stats) == dict(clean.ltp_stats)
    assert pull(hit, 2).tobytes() == pull(clean, 2).tobytes()
    assert momentum(hit).tobytes() == momentum(clean).tobytes()


def test_packets_of_the_next_plan_wait_for_its_plan_and_are_taken_when_it_comes():
    # overlapped re-plans: a worker sends by plan 1 before the server has PLAN 1
    grads = [np.random.default_rng(w).standard_normal(N).astype(np.float32) for w in (0, 1)]
    clean, early = (ltp_server(2, SGD) for _ in range(2))
    table = json.dumps({"version": 1, "old": {str(KEY): [[0, 0, N]]},
                        "new": {str(KEY): [[0, 0, N]]}}).encode()
    clean.on_scheduler(Header(MsgType.PLAN), table)
    for s in (clean, early):
        pushes = [push_packets(g, w, 1, version=1) for w, g in enumerate(grads)]
        feed(s, [p for data, end in pushes for p in (*data.values(), end)], Clock())
    assert early.slots[(KEY, 0)].applied == 0 and not early.slots[(KEY, 0)].rounds
    assert early.ltp_stats["held"] == 2 * (NP + 1)
    early.on_scheduler(Header(MsgType.PLAN), table)
    assert not early.early_packets and early._held_bytes == 0
    assert early.slots[(KEY, 0)].applied == clean.slots[(KEY, 0)].applied == 1
    assert not any(k.startswith("drop_") for k in early.ltp_stats)
    got, want = (value_of(only(send(s, MsgType.PULL, KEY, it=1, length=N, version=1)))
                 for s in (early, clean))
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("fill", FILLS)
def test_under_wsp_a_push_s_packets_go_into_the_round_wsp_gives_it_and_rounds_close_with_k(
        fill):
    # W = 3, k = 2, the update on the workers (a round's value is its scaled sum): the rounds
    # close with the k workers whose packets are in them, scaled by W / n; a late push goes
    # into the next open round, and never into one that holds a push of the same worker
    srv = ltp_server(3, wsp=WspSettings(2, 3), fill=fill)
    slot = srv.slots[(KEY, 0)]
    g = {(w, i): np.random.default_rng(10 * w + i).standard_normal(N).astype(np.float32)
         for w in range(3) for i in (1, 2)}
    clock = Clock()

    def push(w, label):
        data, end = push_packets(g[(w, label)], w, label)
        feed(srv, [*data.values(), end], clock)

    push(0, 1)
    push(1, 1)
    assert slot.applied == 1
    np.testing.assert_allclose(slot.store.snapshot, 1.5 * (g[(0, 1)] + g[(1, 1)]), rtol=1e-6)
    push(2, 1)                    # round 1 is complete: into round 2, alone there (k = 2)
    push(2, 2)                    # round 2 holds worker 2's push already: into round 3
    assert slot.applied == 1 and sorted(slot.rounds) == [2, 3]
    push(0, 2)                    # round 2: workers 2 and 0
    assert slot.applied == 2
    np.testing.assert_allclose(slot.store.snapshot, 1.5 * (g[(2, 1)] + g[(0, 2)]), rtol=1e-6)
    push(1, 2)                    # round 2 is complete: into round 3, with worker 2's
    assert slot.applied == 3 and not slot.rounds
    np.testing.assert_allclose(slot.store.snapshot, 1.5 * (g[(2, 2)] + g[(1, 2)]), rtol=1e-6)
    assert srv.wsp_stats["folded"] == 3 and srv.wsp_stats["contributions"] == 6
    assert not any(k.startswith("drop_") for k in srv.ltp_stats), dict(srv.ltp_stats)


def test_an_end_repeated_after_its_round_closed_is_counted_but_not_a_drop():
    s = ltp_server(2)
    grads = [np.ones(N, np.float32)] * 2
    play(s, grads, 1, [{0}, set()], Clock())
    assert s.slots[(KEY, 0)].applied == 1
    assert s.on_packet(*push_packets(grads[0], 0, 1)[1], 5.0) == []
    assert s.ltp_stats["end_after_close"] == 1
    assert not any(k.startswith("drop_") for k in s.ltp_stats)


def open_round(s, grads, drops, clock, ends=True):
    """Round 1's packets but ``drops``, and the ENDs if asked; no timer."""
    data, last = [], []
    for w, g in enumerate(grads):
        pkts, end = push_packets(g, w, 1)
        data += [p for q, p in sorted(pkts.items()) if q not in drops[w]]
        last.append(end)
    return feed(s, data + (last if ends else []), clock)


def closes_at(s, when, reason):
    """Nothing happens just before ``when``; the round closes at ``when`` for ``reason``."""
    assert s.next_wake() == pytest.approx(when, abs=1e-12)
    assert s.on_tick(math.nextafter(when, 0)) == []
    assert s.slots[(KEY, 0)].applied == 0
    s.on_tick(s.next_wake())
    assert s.slots[(KEY, 0)].applied == 1
    assert {k: v for k, v in s.ltp_stats.items() if k.startswith("close_")} == \
        {"close_" + reason: 1}


GRADS2 = [np.full(N, 2.0, np.float32), np.full(N, 3.0, np.float32)]


def test_a_round_with_every_packet_closes_complete_at_the_last_packet():
    s = ltp_server(2)
    open_round(s, GRADS2, [set(), set()], Clock(), ends=False)
    assert s.slots[(KEY, 0)].applied == 1 and s.next_wake() is None
    assert s.ltp_stats["close_complete"] == 1 and s.ltp_stats["rounds"] == 1
    np.testing.assert_array_equal(pull(s, 1), 5.0)


def test_a_round_with_every_end_closes_ends_a_grace_after_the_last_end():
    s = ltp_server(2, grace=0.003)
    clock = Clock()
    open_round(s, GRADS2, [{3}, {3, 9}], clock)
    closes_at(s, clock.t + 0.003, "ends")
    got = pull(s, 1)
    np.testing.assert_array_equal(got[9 * EPP:10 * EPP], 2.0 * 2)   # rescaled: 2 workers / 1
    np.testing.assert_array_equal(got[8 * EPP:9 * EPP], 5.0)
    assert not got[3 * EPP:4 * EPP].any()


def test_a_round_without_ends_closes_at_the_deadline_after_the_last_worker_was_heard():
    s = ltp_server(2, deadline=0.05)
    clock = Clock()
    p0, _ = push_packets(GRADS2[0], 0, 1)
    p1, _ = push_packets(GRADS2[1], 1, 1)
    feed(s, [p for q, p in p0.items() if q != 5], clock)
    assert s.next_wake() is None            # worker 1 unheard: no deadline runs yet
    feed(s, [p1[4]], clock)
    heard = clock.t                         # the last worker's first packet
    feed(s, [p1[q] for q in range(5, NP)], clock)
    closes_at(s, heard + 0.05, "deadline")


def test_a_round_closes_by_ratio_as_soon_as_every_worker_reached_it():
    s = ltp_server(2, ratio=0.5)
    clock = Clock()
    p0, _ = push_packets(GRADS2[0], 0, 1)
    p1, _ = push_packets(GRADS2[1], 1, 1)
    half = -(-NP // 2)
    feed(s, [p0[q] for q in range(NP)] + [p1[q] for q in range(half - 1)], clock)
    assert s.slots[(KEY, 0)].applied == 0
    feed(s, [p1[half - 1]], clock)
    assert s.slots[(KEY, 0)].applied == 1
    assert s.ltp_stats["close_ratio"] == 1
    assert s.ltp_stats["packets_received"] == NP + half
    # late packets of the closed round are dropped and counted
    feed(s, [p1[half]], clock)
    assert s.ltp_stats["drop_late"] == 1


def test_no_look_at_the_rule_while_a_workers_part_is_below_the_lowest_ratio(monkeypatch):
    """A DATA packet can close a round only once every part reached the lowest acceptance
    ratio: before, the server does not look (the look was 11% of its time at 5% loss)."""
    s = ltp_server(2, ratio=0.5)
    looks = []
    check = s._ltp_check
    monkeypatch.setattr(s, "_ltp_check", lambda *a: looks.append(a[1]) or check(*a))
    clock = Clock()
    p0, _ = push_packets(GRADS2[0], 0, 1)
    p1, _ = push_packets(GRADS2[1], 1, 1)
    half = -(-NP // 2)
    feed(s, [p1[0]] + [p0[q] for q in range(NP)], clock)   # worker 1 at 1 packet: below
    assert looks == [1, 1]                                   # the two first packets only
    lt = s.slots[(KEY, 0)].rounds[1].ltp
    assert lt.below == 1 and lt.need == pytest.approx(0.5 * NP)
    feed(s, [p1[q] for q in range(1, half - 1)], clock)
    assert len(looks) == 2 and s.slots[(KEY, 0)].applied == 0
    feed(s, [p1[half - 1]], clock)                           # the last part reaches it
    assert len(looks) == 3 and lt.below == 0
    assert s.slots[(KEY, 0)].applied == 1 and s.ltp_stats["close_ratio"] == 1


def test_a_part_pushed_whole_by_tcp_counts_as_past_the_lowest_ratio():
    rnd = LtpRound(np.zeros(10, np.float32), 2, 3, F32, lowest=0.8)
    assert (rnd.n, rnd.below) == (5, 3)
    assert rnd.add_whole(1, np.ones(10, np.float32), 0.0)
    assert rnd.below == 2
    for seq in range(4):                                     # 4 of 5: 0.8 reached
        assert rnd.add(0, seq, 2, np.ones(2, np.float32).tobytes(), 0.0)
    assert rnd.below == 1
    assert rnd.add(0, 4, 2, np.ones(2, np.float32).tobytes(), 0.0)
    assert rnd.below == 1                                    # counted once
    assert LtpRound(np.zeros(10, np.float32), 2, 3, F32).below == 0   # no lowest: none


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.sampled_from([0.0, 0.3, 0.5, 0.8, 1.0]), st.integers(0, 2 ** 31),
       st.floats(0.0, 0.4))
def test_a_round_closes_at_exactly_the_packet_after_which_the_rule_says_so(workers, ratio,
                                                                           seed, loss):
    """The server looks at the Early Close rule only at the packets that can change its
    answer (a worker first heard, or its part at the lowest acceptance ratio); it must close
    at the same packet as a look after every packet would (no deadline, no ENDs)."""
    rng = random.Random(seed)
    s = ltp_server(workers, ratio=ratio, deadline=0.0, loss=lambda: [0.0] * workers)
    grads = [np.full(N, w + 1.0, np.float32) for w in range(workers)]
    data = []
    for w, g in enumerate(grads):
        pkts, _ = push_packets(g, w, 1)
        data += [p for q, p in pkts.items() if rng.random() >= loss]
    rng.shuffle(data)
    st_ = s.ltp
    lowest = ratio if ratio > 0 else close_rule.acceptance_ratio(NP, 0.0, st_.z, st_.floor)
    received = [0] * workers
    want = None
    for i, (f, _) in enumerate(data):
        received[f.worker] += 1
        if want is None and all(r * (1 + 1e-12) >= lowest * NP for r in received):
            want = i
    clock = Clock()
    for i, (f, payload) in enumerate(data):
        s.on_packet(f, payload, clock())
        assert s.slots[(KEY, 0)].applied == (1 if want is not None and i >= want else 0), i
    if want is None:
        assert s.ltp_stats["rounds"] == 0


def test_a_silent_worker_holds_the_round_open_whatever_the_deadline():
    s = ltp_server(2, deadline=0.01, ratio=0.5)
    p0, end0 = push_packets(GRADS2[0], 0, 1)
    feed(s, list(p0.values()) + [end0], Clock())
    assert s.next_wake() is None
    s.on_tick(1e9)
    assert s.slots[(KEY, 0)].applied == 0 and s.ltp_stats["rounds"] == 0


def test_the_adaptive_deadline_comes_from_earlier_rounds_spans():
    s = ltp_server(2, grace=0.002)         # deadline=-1: adaptive
    clock = Clock()
    open_round(s, GRADS2, [{1}, set()], clock)
    assert s.next_wake() == pytest.approx(clock.t + 0.002)       # no history: no deadline
    tick(s)
    (span,) = s.slots[(KEY, 0)].spans.spans
    assert span > 0
    p0, _ = push_packets(GRADS2[0], 0, 2)
    p1, _ = push_packets(GRADS2[1], 1, 2)
    feed(s, [p0[0], p1[0]], clock)
    assert s.next_wake() == pytest.approx(clock.t + deadline_for([span]))


def test_a_round_cut_by_the_deadline_lengthens_the_next_ones_deadline():
    """The lock-in this prevents: rounds closed by the deadline used to add no span, so after a
    lasting slowdown the deadline never grew and cut every round short."""
    s = ltp_server(2, grace=0.002)
    clock = Clock()
    open_round(s, GRADS2, [{1}, set()], clock)
    tick(s)                                         # closes by the ENDs: a history
    dl = s.slots[(KEY, 0)].spans
    assert dl.backoff == 1 and len(dl.spans) == 1
    base = deadline_for(dl.spans)
    p0, _ = push_packets(GRADS2[0], 0, 2)
    p1, _ = push_packets(GRADS2[1], 1, 2)
    feed(s, [p0[0], p1[0]], clock)                  # round 2: a tail still to come, no END
    heard = clock.t
    assert s.next_wake() == pytest.approx(heard + base)
    tick(s)
    assert s.ltp_stats["close_deadline"] == 1
    assert dl.backoff == 2 and len(dl.spans) == 2   # the cut round counts too
    q0, _ = push_packets(GRADS2[0], 0, 3)
    q1, _ = push_packets(GRADS2[1], 1, 3)
    feed(s, [q0[0], q1[0]], clock)
    assert s.next_wake() == pytest.approx(clock.t + 2 * deadline_for(dl.spans))


def test_a_pull_of_a_round_is_answered_only_once_the_round_closed():
    s = ltp_server(2, grace=0.002)
    clock = Clock()
    assert send(s, MsgType.PULL, KEY, w=1, it=1, length=N) == []
    open_round(s, GRADS2, [{0}, {0, 2}], clock)
    assert s.next_wake() is not None and s.slots[(KEY, 0)].applied == 0
    out = only(tick(s), MsgType.DATA)
    assert out.to == Out.CLIENT and out.dest == worker(1) and out.header.iteration == 1
    got = value_of(out)
    assert not got[:EPP].any()
    np.testing.assert_array_equal(got[EPP:2 * EPP], 5.0)
    np.testing.assert_allclose(got[2 * EPP:3 * EPP], 2.0 * 2)     # rescaled: 2 workers / 1


def test_packets_taken_in_a_batch_answer_a_waiting_pull_as_on_packet_does_one_by_one():
    """The server reads packets in batches: ``take_packet`` per packet, ``outs()`` after the
    batch, the same answers (with ratio 1 the last packet closes the round and answers the
    pull) as ``on_packet``'s per packet, and nothing twice."""
    one, batch = ltp_server(2, ratio=1.0), ltp_server(2, ratio=1.0)
    c1, c2 = Clock(), Clock()
    for s in (one, batch):
        assert send(s, MsgType.PULL, KEY, w=1, it=1, length=N) == []
    packets = []
    for w, g in enumerate(GRADS2):
        pkts, end = push_packets(g, w, 1)
        packets += [p for _, p in sorted(pkts.items())] + [end]
    want = feed(one, packets, c1)
    assert [o.header.type for o in want] == [MsgType.DATA]
    for f, payload in packets:
        assert batch.take_packet(f, payload, c2()) is None
    got = batch.outs()
    assert batch.outs() == []
    assert [(o.to, o.dest, o.header.type, o.header.iteration) for o in got] == \
        [(o.to, o.dest, o.header.type, o.header.iteration) for o in want]
    assert value_of(got[0]).tobytes() == value_of(want[0]).tobytes()
    assert batch.slots[(KEY, 0)].applied == one.slots[(KEY, 0)].applied == 1


@pytest.mark.parametrize("tcp_first", [True, False], ids=["tcp_first", "packets_first"])
def test_a_tcp_push_of_one_worker_and_packets_of_the_other_make_one_round(tcp_first):
    s = ltp_server(2, SGD)
    ref = ltp_server(2, SGD)
    clock, c2 = Clock(), Clock()
    grads = [np.random.default_rng(w).integers(-5, 6, N).astype(np.float32) for w in (0, 1)]
    drops = [set(), {2, 8}]
    pkts, end = push_packets(grads[1], 1, 1)

    def tcp():
        only(send(s, MsgType.PUSH, KEY, w=0, it=1, value=grads[0]), MsgType.ACK)
    if tcp_first:
        tcp()
    feed(s, [p for q, p in pkts.items() if q not in drops[1]] + [end], clock)
    if not tcp_first:
        tcp()
    tick(s)
    play(ref, grads, 1, drops, c2)              # the same round, all by packets
    assert s.slots[(KEY, 0)].applied == 1
    assert pull(s, 1).tobytes() == pull(ref, 1).tobytes()
    assert momentum(s).tobytes() == momentum(ref).tobytes()


def test_a_tcp_push_of_a_worker_that_sent_packets_of_the_round_is_refused():
    s = ltp_server(2)
    pkts, _ = push_packets(GRADS2[0], 0, 1)
    feed(s, [pkts[0]], Clock())
    msg = only(send(s, MsgType.PUSH, KEY, w=0, it=1, value=GRADS2[0]),
               MsgType.ERROR).payload.decode()
    assert "key %d" % KEY in msg and "worker 0" in msg and "round 1" in msg


# --- the receiver's socket: who may speak -------------------------------------------------------

LOOP = "127.0.0.1"


def udp():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((LOOP, 0))
    return s


@pytest.fixture
def endpoint():
    """A 2-worker Receiver (MTU 1500) with both workers' sockets registered: (rx, socks,
    keys); every socket is closed afterwards."""
    rx = Receiver(LOOP, 2, mtu=1500)
    socks, keys = [udp(), udp()], []
    try:
        for w, sock in enumerate(socks):
            body = json.dumps({"host": LOOP, "port": sock.getsockname()[1], "mtu": 1500})
            reply = json.loads(rx.hello(w, body.encode()))
            assert reply["port"] == rx.port and reply["budget"] == rx.budget
            keys.append(bytes.fromhex(reply["key"]))
        assert keys[0] != keys[1] and all(len(k) == pk.KEY_SIZE for k in keys)
        yield rx, socks, keys
    finally:
        rx.close()
        for sock in socks:
            sock.close()


def settle(rx, handle, seen, timeout=5.0):
    """Read ``rx`` until ``seen`` datagrams were either handed over or dropped."""
    deadline = time.monotonic() + timeout
    while rx.counts["packets"] + rx.drops.total() < seen:
        left = deadline - time.monotonic()
        assert left > 0, "only %d of %d datagrams reached the receiver in %.0f s" % (
            rx.counts["packets"] + rx.drops.total(), seen, timeout)
        select.select([rx.sock], [], [], left)
        rx.receive(handle, time.monotonic())


def recv_within(sock, timeout=5.0):
    ready, _, _ = select.select([sock], [], [], timeout)
    assert ready, "nothing arrived within %.0f s" % timeout
    return sock.recvfrom(65536)


def test_a_registered_workers_packet_is_handed_over_and_acked_with_its_key(endpoint):
    rx, socks, keys = endpoint
    got = []
    payload = np.arange(8, dtype=np.float32)
    socks[1].sendto(datagram(pk.Tagger(keys[1]), w=1, pn=41, payload=payload.tobytes()),
                    (LOOP, rx.port))
    settle(rx, lambda f, p, now: got.append((f, bytes(p))), 1)
    ((f, body),) = got
    assert (f.worker, f.pn, f.seq, f.count) == (1, 41, 0, 8) and body == payload.tobytes()
    ack, addr = recv_within(socks[1])
    assert addr == (LOOP, rx.port)
    assert pk.decode_ack(ack, pk.Tagger(keys[1]), 1) == [(41, 1)]
    with pytest.raises(pk.PacketError):
        pk.decode_ack(ack, pk.Tagger(keys[0]), 1)
    assert rx.counts["acks"] == 1 and not rx.drops.counts


def forged(kind, socks, keys):
    """(socket to send from, datagram) of a forgery of kind ``kind`` against worker 0."""
    payload = bytes(16)
    good = datagram(pk.Tagger(keys[0]), w=0, payload=payload)
    stranger = udp()
    flipped = bytearray(good)
    flipped[20] ^= 0x10
    return {
        "stranger_address": (stranger, good),
        "bad_tag": (socks[0], bytes(flipped)),
        "other_workers_id": (socks[0], datagram(pk.Tagger(keys[1]), w=1, payload=payload)),
        "other_workers_key": (socks[1], datagram(pk.Tagger(keys[0]), w=1, payload=payload)),
        "unregistered_worker": (socks[0], datagram(pk.Tagger(keys[0]), w=7, payload=payload)),
        "short": (socks[0], good[:pk.OVERHEAD - 1]),
        "truncated": (socks[0], good[:-4]),
        "garbage": (socks[0], bytes(random.Random(3).getrandbits(8) for _ in range(200))),
        "old_version": (socks[0], good[:2] + b"\x00" + good[3:]),
        "sizes_disagree": (socks[0], datagram(pk.Tagger(keys[0]), w=0, count=5,
                                              payload=payload)),
    }[kind], stranger


@pytest.mark.parametrize("kind,reason", [
    ("stranger_address", "address"), ("bad_tag", "tag"), ("other_workers_id", "address"),
    ("other_workers_key", "tag"), ("unregistered_worker", "address"), ("short", "short"),
    ("truncated", "tag"), ("garbage", "magic"), ("old_version", "version"),
    ("sizes_disagree", "size")])
def test_a_datagram_not_from_a_registered_worker_is_dropped_before_decoding_and_counted(
        endpoint, kind, reason):
    rx, socks, keys = endpoint
    (sock, dgram), stranger = forged(kind, socks, keys)
    try:
        sock.sendto(dgram, (LOOP, rx.port))
        handed = []
        settle(rx, lambda *a: handed.append(a), 1)
    finally:
        stranger.close()
    assert handed == [] and rx.counts["packets"] == 0 and rx.counts["acks"] == 0
    assert dict(rx.drops.counts) == {reason: 1}


def test_an_authenticated_packet_with_an_unknown_dtype_code_is_dropped_and_counted(endpoint):
    rx, socks, keys = endpoint
    socks[0].sendto(datagram(pk.Tagger(keys[0]), w=0, dtype=200, payload=bytes(16)),
                    (LOOP, rx.port))
    handed = []
    settle(rx, lambda *a: handed.append(a), 1)
    assert handed == [] and dict(rx.drops.counts) == {"dtype": 1}


@pytest.mark.parametrize("body,problem", [
    (b"not json", "not JSON"), (b"[1, 2]", "not JSON"), (b'{"host": "127.0.0.1"}', "not JSON"),
    (b'{"host": "127.0.0.1", "port": "x", "mtu": 1500}', "not JSON"),
    (b'{"host": "127.0.0.1", "port": 0, "mtu": 1500}', "port 0"),
    (b'{"host": "127.0.0.1", "port": 70000, "mtu": 1500}', "port 70000"),
    (b'{"host": "127.0.0.1", "port": 4000, "mtu": 1400}', "MTU 1400 is below")])
def test_an_ltp_hello_that_does_not_parse_or_fit_is_refused_naming_the_problem(body, problem):
    rx = Receiver(LOOP, 2, mtu=1500)
    try:
        with pytest.raises(ValueError) as e:
            rx.hello(1, body)
        assert problem in str(e.value) and "worker 1" in str(e.value), str(e.value)
        assert rx.paths == [None, None]
    finally:
        rx.close()


def test_a_second_hello_moves_a_worker_to_its_new_address_and_key(endpoint):
    rx, socks, keys = endpoint
    new = udp()
    try:
        reply = json.loads(rx.hello(0, json.dumps(
            {"host": LOOP, "port": new.getsockname()[1], "mtu": 9000}).encode()))
        key = bytes.fromhex(reply["key"])
        assert key != keys[0]
        old = datagram(pk.Tagger(keys[0]), w=0, payload=bytes(4))
        socks[0].sendto(old, (LOOP, rx.port))                    # the old address
        new.sendto(old, (LOOP, rx.port))                         # the new one, the old key
        new.sendto(datagram(pk.Tagger(key), w=0, payload=bytes(4)), (LOOP, rx.port))
        handed = []
        settle(rx, lambda *a: handed.append(a), 3)
        assert len(handed) == 1 and dict(rx.drops.counts) == {"address": 1, "tag": 1}
    finally:
        new.close()


def test_a_packet_after_a_higher_number_by_its_stamp_is_out_of_order_and_not_by_socket_alone():
    from mxps.ltp.receiver import IN_HOST, IN_ORDER, REORDERED, _Path
    p = _Path((LOOP, 1), bytes(32))
    assert [p.note(pn, t) for pn, t in ((0, 1.0), (1, 1.1), (3, 1.2))] == [IN_ORDER] * 3
    assert p.note(2, 1.3) == REORDERED            # came after 3 at the host too
    assert p.note(2, 1.35) == REORDERED           # a duplicate of an older number
    assert p.note(4, 1.4) == IN_ORDER
    assert p.note(6, 1.6) == IN_ORDER
    assert p.note(5, 1.55) == IN_HOST             # stamped before 6: reordered in this host
    assert p.note(7, None) == IN_ORDER and p.note(6, None) == REORDERED   # no stamps: by order
    # numbers wrap modulo 2**32: the first after the wrap is in order, the last before it not
    q = _Path((LOOP, 1), bytes(32))
    assert q.note(pk.PN_MASK - 1, 1.0) == IN_ORDER and q.note(1, 1.1) == IN_ORDER
    assert q.note(pk.PN_MASK, 1.2) == REORDERED


def test_a_reordered_packet_turns_the_grace_after_the_last_end_on_and_order_keeps_it_off(
        endpoint):
    rx, socks, keys = endpoint
    handed = []
    for pn in (10, 11, 12):
        socks[0].sendto(datagram(pk.Tagger(keys[0]), w=0, pn=pn, payload=bytes(4)),
                        (LOOP, rx.port))
    settle(rx, lambda *a: handed.append(a), 3)
    assert rx.reordered_at == -math.inf and rx.counts["out_of_order"] == 0
    assert close_rule.grace_for(0.002, rx.reordered_at, time.monotonic()) == 0.0
    socks[1].sendto(datagram(pk.Tagger(keys[1]), w=1, pn=5, payload=bytes(4)), (LOOP, rx.port))
    socks[1].sendto(datagram(pk.Tagger(keys[1]), w=1, pn=4, payload=bytes(4)), (LOOP, rx.port))
    before = time.monotonic()
    settle(rx, lambda *a: handed.append(a), 5)
    assert rx.counts["out_of_order"] == 1 and rx.reordered_at >= before
    assert close_rule.grace_for(0.002, rx.reordered_at, time.monotonic()) == 0.002


def test_a_server_without_reordering_closes_a_round_at_its_last_end():
    s = ltp_server(2, grace=0.003, reordered=lambda: -math.inf)
    clock = Clock()
    open_round(s, GRADS2, [{3}, {3, 9}], clock)
    assert s.slots[(KEY, 0)].applied == 1 and s.ltp_stats["close_ends"] == 1
    s = ltp_server(2, grace=0.003, reordered=lambda: clock.t)      # reordered just now
    open_round(s, GRADS2, [{3}, {3, 9}], clock)
    closes_at(s, clock.t + 0.003, "ends")


# --- sender and receiver on loopback ----------------------------------------------------------

class Link:
    """A Sender (worker 0) with a path to a Receiver (MTU 1500) in this process, and what the
    receiver handed over, reassembled."""

    def __init__(self, length, drop=0.0, end_rto="rtt"):
        self.rx = Receiver(LOOP, 1, mtu=1500)
        self.tx = Sender(0, LOOP, drop=drop, seed=1, end_rto=end_rto)
        reply = self.rx.hello(0, self.tx.hello_body(LOOP, self.rx.port))
        self.key = bytes.fromhex(json.loads(reply)["key"])
        self.tx.add_path(0, LOOP, reply, time.monotonic())
        self.epp = pk.elements_per_packet(self.rx.budget, 4)
        self.got = np.zeros(length, np.float32)
        self.seqs, self.ends = [], []

    def handle(self, f, payload, now):
        if f.type == pk.END:
            self.ends.append(f.seq)
        else:
            self.seqs.append(f.seq)
            lo = f.seq * self.epp
            self.got[lo:lo + f.count] = np.frombuffer(payload, np.float32)

    def push(self, grad, done="push"):
        h = Header(MsgType.PUSH, key=9, sender=0, iteration=1, length=grad.size, dtype=F32)
        self.tx.enqueue(0, h, grad, 4, done)

    def run(self, timeout=20.0):
        """Pump, receive and read ACKs until a push is done; its on_done values."""
        deadline = time.monotonic() + timeout
        while True:
            now = time.monotonic()
            assert now < deadline, "the push did not complete in %.0f s: %s" % (
                timeout, dict(self.tx.counts))
            wake = self.tx.pump(now)
            wait = deadline - now if wake is None else min(max(0.0, wake - now),
                                                           deadline - now)
            ready, _, _ = select.select([self.tx.sock, self.rx.sock], [], [], wait)
            if self.rx.sock in ready:
                self.rx.receive(self.handle, time.monotonic())
            if self.tx.sock in ready:
                done = self.tx.receive(time.monotonic())
                if done:
                    return [p.on_done for p in done]

    def close(self):
        self.tx.close()
        self.rx.close()


@pytest.fixture
def link_factory():
    made = []

    def make(*a, **kw):
        made.append(Link(*a, **kw))
        return made[-1]
    yield make
    for link in made:
        link.close()


MB4 = 1 << 20            # float32 elements: 4 MB


@pytest.mark.parametrize("drop", [0.0, 0.2])
def test_what_a_path_delivered_is_counted_for_its_round_as_acks_come_not_when_queued(
        link_factory, drop):
    """The placement's rate of an LTP push: the payload bytes the server acknowledged, at the
    ACKs' arrival, for the push's round; with packets dropped on purpose (never delivered)
    the count falls short of the push by what was dropped."""
    grad = np.ones(MB4 // 4, np.float32)
    link = link_factory(grad.size, drop=drop)
    link.push(grad)
    assert link.tx.take_delivered() == []        # nothing counts when queued
    link.run()
    got = link.tx.take_delivered()
    assert got and {(server, rnd) for server, rnd, _ in got} == {(0, 1)}
    total = sum(n for _, _, n in got)
    dropped = link.tx.counts["dropped_on_purpose"]
    budget = link.rx.budget
    # each delivered datagram counts its payload share (headers and tag excluded); the END
    # and partial last packet make up the rest
    expect = (pk.packet_count(grad.size, link.epp) - dropped) * budget
    assert abs(total - expect) <= 2 * budget, (total, expect, dropped)
    if drop:
        assert dropped > 0 and total < grad.nbytes - dropped * budget // 2
    assert link.tx.take_delivered() == []        # taken once


def test_a_push_of_a_few_mb_arrives_whole_and_the_ack_of_its_end_completes_it(link_factory):
    grad = np.random.default_rng(0).standard_normal(MB4).astype(np.float32)
    link = link_factory(MB4)
    link.push(grad, done="4MB")
    assert link.tx.busy
    assert link.run() == ["4MB"]
    n = pk.packet_count(MB4, link.epp)
    # an END may be resent on a busy machine (its ACK later than the RTO): the same END
    assert sorted(link.seqs) == list(range(n)) and set(link.ends) == {n}
    assert 1 <= len(link.ends) <= 1 + link.tx.counts["end_resent"]
    assert link.got.tobytes() == grad.tobytes()
    assert not link.tx.busy and link.tx.oldest_end() is None
    assert link.tx.counts["data"] == n and link.rx.counts["packets"] == n + len(link.ends)
    assert not link.rx.drops.counts


def test_with_a_tenth_of_the_packets_dropped_the_end_still_completes_and_90_percent_arrive(
        link_factory):
    grad = np.random.default_rng(1).standard_normal(MB4).astype(np.float32)
    link = link_factory(MB4, drop=0.1)
    link.push(grad)
    assert link.run() == ["push"]
    n = pk.packet_count(MB4, link.epp)
    arrived = len(set(link.seqs))
    sd = (n * 0.1 * 0.9) ** 0.5
    assert abs(arrived - 0.9 * n) < 5 * sd, (arrived, n)
    assert arrived == len(link.seqs) == link.tx.counts["data"]
    assert link.tx.counts["dropped_on_purpose"] == n - arrived
    for q in set(link.seqs):      # what arrived is right where it belongs
        lo = q * link.epp
        assert link.got[lo:lo + link.epp].tobytes() == grad[lo:lo + link.epp].tobytes()
    # the receiver's loss estimate (which Early Close adapts to) sees the 10%
    assert 0.05 < link.rx.loss[0] < 0.15, link.rx.loss
    # so does the sender's, and its END went as copies (all of them lost: 1 in 1000 or less)
    path = link.tx.paths[0]
    assert 0.05 < path.loss < 0.15, path.loss
    assert len(link.ends) >= ltp_sender.end_copies(path.loss) >= 3


@settings(max_examples=200, deadline=None)
@given(st.floats(0.0, 1.0), st.sampled_from([1e-2, 1e-3, 1e-4]), st.integers(1, 6))
def test_an_end_goes_as_the_fewest_copies_whose_loss_together_is_unlikely(loss, target, cap):
    k = ltp_sender.end_copies(loss, target, cap)
    assert 1 <= k <= cap
    if k < cap:
        assert loss ** k <= target * (1 + 1e-9)
    if k > 1:
        assert loss ** (k - 1) > target


def test_a_push_on_an_idle_path_begins_at_the_servers_start_rate_not_a_raised_grant(
        link_factory):
    link = link_factory(1000)
    path = link.tx.paths[0]
    path.rate.cap(40e6)                     # a grant raised while the others were done
    path.start_rate = 5e6                   # the equal share the ACKs said
    link.push(np.ones(1000, np.float32))
    assert path.rate.max_rate == 5e6 and path.rate.pacing_rate <= 5e6
    path.rate.cap(40e6)                     # the next ACK's grant, while the path is busy
    link.push(np.ones(1000, np.float32), done="second")
    assert path.rate.max_rate == 40e6       # a busy path keeps the grant it has
    done = link.run()
    if len(done) == 1:                      # the two ENDs' ACKs read apart
        done += link.run()
    assert sorted(done) == ["push", "second"]


def drain_acks(link, pns, timeout=5.0):
    """Read (and so lose) the ACK datagrams at the sender's socket until the packet numbers
    ``pns`` were all named; {datagram: the packet numbers it names}."""
    tagger, lost = pk.Tagger(link.key), {}
    while not set(pns) <= set().union(*lost.values()):
        ack, _ = recv_within(link.tx.sock, timeout)
        lost[ack] = {pn for a, n in pk.decode_ack(ack, tagger, 0) for pn in range(a, a + n)}
    return lost


def send_end(link, length, t=None):
    """Pump a push of ``length`` ones until its END is out, on the test's clock (the sender
    takes ``now`` from its caller: timers run without sleeping) from ``t`` (default: now); the
    END's time and due."""
    link.push(np.ones(length, np.float32))
    t = time.monotonic() if t is None else t
    ends = link.tx.counts["end"]
    while True:
        wake = link.tx.pump(t)
        if link.tx.counts["end"] > ends:
            return t, wake
        t = max(t, wake)


@pytest.mark.parametrize("which", ["latest", "first"])
def test_an_end_whose_acks_are_lost_is_resent_with_backoff_until_one_ack_arrives(
        link_factory, which):
    link = link_factory(1000)
    sent_at, due = send_end(link, 1000)
    n = pk.packet_count(1000, link.epp)
    settle(link.rx, link.handle, n + 1)
    lost = drain_acks(link, range(n + 1))       # the DATA packets' and the END's ACKs: lost
    intervals, path, ends = [], link.tx.paths[0], 1
    for resend in (1, 2, 3):
        assert link.tx.pump(math.nextafter(due, 0)) == due        # not a moment early
        assert link.tx.counts["end_resent"] == resend - 1
        first = path.pn
        link.tx.pump(due)
        assert link.tx.counts["end_resent"] == resend
        # lost ACKs can look like a lossy path to the sender: its END then goes as copies
        copies = list(range(first, path.pn))
        assert len(copies) == ltp_sender.end_copies(path.loss)
        ends += len(copies)
        intervals.append(due - sent_at)
        sent_at, due = due, link.tx.pump(due)
        settle(link.rx, link.handle, n + ends)
        if resend < 3 or which == "first":
            lost.update(drain_acks(link, copies))
    assert intervals[1] == pytest.approx(2 * intervals[0])
    assert intervals[2] == pytest.approx(2 * intervals[1])
    assert link.tx.busy and link.ends == [n] * ends
    if which == "first":        # a late ACK of the first END still completes the push
        first = next(a for a, pns in lost.items() if n in pns)
        link.rx.sock.sendto(first, link.tx.sock.getsockname())
    assert select.select([link.tx.sock], [], [], 5.0)[0], "no ACK came"
    done = link.tx.receive(due)
    assert [p.on_done for p in done] == ["push"]
    assert not link.tx.busy and link.tx.oldest_end() is None
    # another ACK of one of its ENDs changes nothing
    link.rx.sock.sendto(next(iter(lost)), link.tx.sock.getsockname())
    assert select.select([link.tx.sock], [], [], 5.0)[0]
    assert link.tx.receive(due) == []


def push_acked_after(link, delay, t):
    """One push of 1000 ones on the test's clock from ``t``: its ACKs are read ``delay`` s after
    its END went out (the RTT samples the path's model takes); the time they were read."""
    before = link.rx.counts["packets"] + link.rx.drops.total()
    t, _ = send_end(link, 1000, t)
    settle(link.rx, link.handle, before + pk.packet_count(1000, link.epp) + 1)
    t += delay
    while True:
        assert select.select([link.tx.sock], [], [], 5.0)[0], "no ACK came"
        if link.tx.receive(t):
            return t


@pytest.mark.parametrize("rule", ltp_sender.END_TIMEOUTS)
def test_an_ends_first_timeout_follows_the_rule_of_the_paths_measured_rtt(link_factory, rule):
    link = link_factory(1000, end_rto=rule)
    path = link.tx.paths[0]
    assert ltp_sender.end_timeout(path.rate, rule) == 4 * ltp_sender.MIN_RTO   # no sample yet
    t = time.monotonic()
    for delay in (0.030, 0.040, 0.002):        # ACKs late (a busy receiver), then one prompt
        t = push_acked_after(link, delay, t)
    m = path.rate
    assert m.min_rtt < 0.0025 and m.srtt > 0.025 and m.rttvar > 0.005
    want = {"rtt": m.srtt + 4 * m.rttvar, "min_rtt": max(ltp_sender.MIN_RTO, 4 * m.min_rtt)}
    assert ltp_sender.end_timeout(m, rule) == pytest.approx(want[rule])
    assert want["rtt"] > 0.05 and want["min_rtt"] < 0.011       # the rules tell apart
    sent_at, due = send_end(link, 1000, t)
    assert due - sent_at == pytest.approx(want[rule], rel=1e-9, abs=1e-9)


def test_an_unknown_end_timeout_rule_is_refused_by_name():
    with pytest.raises(ValueError, match="END timeout rule 'srtt': one of rtt, min_rtt"):
        Sender(0, LOOP, end_rto="srtt")


def test_the_pump_that_resends_an_end_says_when_the_next_resend_is_due(link_factory):
    link = link_factory(1000)
    _, due = send_end(link, 1000)
    wake = link.tx.pump(due)
    assert link.tx.counts["end_resent"] == 1
    assert wake is not None and wake > due


@pytest.mark.parametrize("pace", [5e6, 100e6])
def test_a_paced_path_is_pumped_a_quantum_apart_and_keeps_its_rate(pace):
    """The I/O loop pumps at the wake ``pump`` returns; a path held back by its pacing asks
    for the next pump a quantum (1 ms, or half its pacing credit if shorter) later, not when
    its next packet is due, and the credit sends the quantum's packets in one go: the rate
    is kept (simulated time; the datagrams go to a socket nobody reads)."""
    sink = udp()
    tx = Sender(0, LOOP)
    try:
        t = 100.0
        body = json.dumps({"port": sink.getsockname()[1], "key": bytes(32).hex(),
                           "budget": pk.payload_budget(1500)})
        tx.add_path(0, LOOP, body.encode(), t, initial_rate=pace)
        path = tx.paths[0]
        path.rate.cap(pace)
        n = 1 << 23                      # 32 MB: more than 0.2 s at 100 MB/s
        h = Header(MsgType.PUSH, key=9, sender=0, iteration=1, length=n, dtype=F32)
        tx.enqueue(0, h, np.zeros(n, np.float32), 4, "push")
        quantum = min(0.001, path.rate.credit / 2)     # MXPS_LTP_QUANTUM's default
        start, gaps = t, []
        while t < start + 0.2:
            before = tx.counts["data"]
            wake = tx.pump(t)
            assert wake is not None and wake > t
            if tx.counts["data"] > before:
                gaps.append(wake - t)
            t = wake
            sink.setblocking(False)
            try:
                while True:
                    sink.recv(65536)
            except BlockingIOError:
                pass
        rate_now = path.rate.pacing_rate         # the cap, less the model's pacing margin
        assert 0.95 * pace <= rate_now <= pace
        sent = path.rate.sent_bytes / (t - start)
        assert 0.95 * rate_now <= sent <= 1.05 * rate_now, (sent, rate_now)
        # every pump that sent asks for the next no sooner than the quantum (without it: the
        # next packet's time, 0.3 ms at 5 MB/s)
        assert min(gaps) >= quantum * (1 - 1e-9), (min(gaps), quantum)
        assert len(gaps) <= 1.05 * 0.2 / quantum + 1
    finally:
        tx.close()
        sink.close()


def test_the_pacing_quantum_is_read_from_its_setting_and_a_bad_one_refused_by_name():
    from mxps import config
    base = {"DMLC_ROLE": "worker", "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9000",
            "DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1", "MXPS_PUSH": "ltp"}
    assert config.from_env(base).ltp_quantum == 0.001
    assert config.from_env(dict(base, MXPS_LTP_QUANTUM="0")).ltp_quantum == 0.0
    assert config.from_env(dict(base, MXPS_LTP_QUANTUM="0.004")).ltp_quantum == 0.004
    for bad in ("-0.001", "2", "fast"):
        with pytest.raises(config.ConfigError, match="MXPS_LTP_QUANTUM"):
            config.from_env(dict(base, MXPS_LTP_QUANTUM=bad))


def test_the_ablation_settings_of_the_grace_end_copies_and_grant_parse_and_refuse_by_name():
    from mxps import config
    base = {"DMLC_ROLE": "worker", "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9000",
            "DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1", "MXPS_PUSH": "ltp"}
    cfg = config.from_env(base)
    assert (cfg.ltp_grace_always, cfg.ltp_end_copies, cfg.ltp_busy_windows, cfg.ltp_owing,
            cfg.ltp_fair, cfg.ltp_end_rto, cfg.ltp_probe_loss, cfg.ltp_startup) == (
                False, 4, True, True, True, "rtt", True, True)
    cfg = config.from_env(dict(base, MXPS_LTP_GRACE_ALWAYS="1", MXPS_LTP_END_COPIES="1",
                               MXPS_LTP_BUSY_WINDOWS="0", MXPS_LTP_OWING="0", MXPS_LTP_FAIR="0",
                               MXPS_LTP_END_RTO="MIN_RTT", MXPS_LTP_PROBE_LOSS="0",
                               MXPS_LTP_STARTUP="0"))
    assert (cfg.ltp_grace_always, cfg.ltp_end_copies, cfg.ltp_busy_windows, cfg.ltp_owing,
            cfg.ltp_fair, cfg.ltp_end_rto, cfg.ltp_probe_loss, cfg.ltp_startup) == (
                True, 1, False, False, False, "min_rtt", False, False)
    for name, bad in (("MXPS_LTP_END_COPIES", "0"), ("MXPS_LTP_END_COPIES", "two"),
                      ("MXPS_LTP_END_RTO", "srtt"),
                      ("MXPS_LTP_OWING", "maybe"), ("MXPS_LTP_BUSY_WINDOWS", "2"),
                      ("MXPS_LTP_PROBE_LOSS", "2"), ("MXPS_LTP_STARTUP", "yes please")):
        with pytest.raises(config.ConfigError, match=name):
            config.from_env(dict(base, **{name: bad}))


def test_with_one_end_copy_a_lossy_path_sends_its_end_once(link_factory):
    link = link_factory(MB4, drop=0.1)
    link.tx.end_copies = 1
    link.push(np.ones(MB4, np.float32))
    assert link.run() == ["push"]
    assert link.tx.paths[0].loss > 0.05 and link.tx.counts["end_copies"] == 0


def test_packet_numbers_wrap_around_instead_of_failing_the_send(link_factory):
    link = link_factory(1000)
    link.tx.paths[0].pn = 2 ** 32 - 2
    link.push(np.ones(1000, np.float32))
    assert link.run() == ["push"]


# --- end to end: training jobs on loopback ------------------------------------------------------

BIG = dict(model="mlp_big", MXNET_KVSTORE_BIGARRAY_BOUND=100000)   # as test_equivalence
LTP_EXACT = dict(MXPS_PUSH="ltp", MXPS_LTP_RATIO=1, MXPS_LTP_DEADLINE="off",
                 MXPS_LTP_MIN_BYTES=4096)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    return cluster.job_cache(tmp_path_factory)


def ltp_reports(metrics, servers=2):
    out = []
    for r in range(servers):
        with open("%s.server%d.ltp.json" % (metrics, r)) as f:
            out.append(json.load(f))
    return out


def test_ltp_without_loss_and_with_ratio_1_trains_exactly_what_tcp_trains(jobs,
                                                                         tmp_path_factory):
    metrics = str(tmp_path_factory.mktemp("ltp_exact") / "m")
    tcp = jobs.train(train_env("mxps", **BIG), 2, 2)          # shared with test_equivalence
    ltp = jobs.train(train_env("mxps", MXPS_METRICS=metrics, **dict(BIG, **LTP_EXACT)), 2, 2)
    assert_weights_close(assert_synchronised(ltp.out_dir, 2), assert_synchronised(tcp.out_dir, 2),
                         rtol=1e-5, what="mxps LTP vs mxps TCP")
    for r in (0, 1):
        assert_weights_close(load_weights(ltp.out_dir, r), load_weights(tcp.out_dir, r),
                             rtol=1e-5, what="rank %d LTP vs TCP" % r)
    for rep in ltp_reports(metrics):         # the gradients did go by LTP, every packet
        stats = rep["stats"]
        assert stats["rounds"] > 0 and stats["rounds"] == stats["close_complete"], rep
        assert stats["packets_received"] == stats["packets_expected"] > 0, rep
        assert not rep["drops"] and not any(k.startswith("drop_") for k in stats), rep
        assert type(rep["starting"]) is bool, rep         # the grant's startup, reported
    # and the workers' reports say the same from the sending side: every DATA packet they
    # sent was received (none resent, none refused by a full buffer), ACKs came back, and
    # each I/O thread counted its turns and its CPU time
    senders = []
    for w in (0, 1):
        with open("%s.worker%d.ltp.json" % (metrics, w)) as f:
            senders.append(json.load(f))
    assert [x["worker"] for x in senders] == [0, 1]
    received = sum(rep["stats"]["packets_received"] for rep in ltp_reports(metrics))
    assert sum(x["counts"]["data"] for x in senders) == received, senders
    for x in senders:
        c, io = x["counts"], x["io"]
        assert c["acks"] > 0 and c["send_calls"] > 0 and "sndbuf_full" not in c, x
        assert 0 < io["timeouts"] < io["turns"] and 0 < io["cpu_s"] <= io["wall_s"], x
        assert sorted(x["paths"]) == ["0", "1"], x
        for p in x["paths"].values():
            assert p["delivered_bytes"] > 0 and p["packets"] > 0, x


def test_ltp_with_5_percent_of_packets_dropped_finishes_synchronised_and_reports_it(
        jobs, tmp_path_factory):
    metrics = str(tmp_path_factory.mktemp("ltp_lossy") / "m")
    traced = str(tmp_path_factory.mktemp("ltp_trace") / "t")
    # MXPS_SEND_WINDOW=1: a server's pushes go one by one (two in flight), in priority order;
    # MXPS_PUSH_GATHER=1: a round's first push waits (up to 1 s) for the canonical first one
    run = jobs.train(train_env("mxps", MXPS_PUSH="ltp", MXPS_LTP_DROP=0.05, MXPS_LTP_MTU=1500,
                               MXPS_LTP_MIN_BYTES=4096, MXPS_METRICS=metrics, MXPS_TRACE=traced,
                               MXPS_SEND_WINDOW=1, MXPS_PUSH_GATHER=1, steps=10, **BIG),
                     2, 2)
    weights = assert_synchronised(run.out_dir, 2)
    # MXPS_LTP_CRITICAL_FIRST: a push that goes by TCP (under MXPS_LTP_MIN_BYTES: mlp_big's
    # last bias and weights, the lowest priorities) never waits in the queue; it overtakes
    # LTP pushes to its server that were waiting for the window before it came
    overtook = 0
    for rank in (0, 1):
        with open(traced + ".worker%d" % rank) as f:
            table = json.load(f)["tables"]["requests"]
        rows = [dict(zip(table["columns"], r)) for r in table["rows"]]
        stage = collections.defaultdict(dict)
        for r in rows:
            if r["kind"].startswith("push_"):
                stage[r["request"]][r["kind"][5:]] = r
        tcp = [e for e in stage.values() if e["held"]["bytes"] < 4096]
        big = [e for e in stage.values() if e["held"]["bytes"] >= 4096]
        assert len(tcp) >= 3 * 9 and big, "expected mlp_big's three small keys every round"
        for e in tcp:
            assert e["released"]["time"] - e["held"]["time"] < 0.002, e
            overtook += any(b["held"]["server"] == e["held"]["server"]
                            and b["held"]["time"] < e["held"]["time"]
                            and b["released"]["time"] > e["released"]["time"] for b in big)
        # MXPS_PUSH_GATHER: from the second round on, every worker's first push to a server
        # is the highest-ranked of that round's queued ones (Gluon's priority -index: the
        # lowest key), whatever order backward produced the gradients in
        firsts = collections.defaultdict(list)
        for e in big:
            h = e["held"]
            firsts[(h["round"], h["server"])].append(
                (e["released"]["time"], (h["key"], h["offset"])))
        for (rnd, server), pushes in firsts.items():
            if rnd >= 2:
                assert min(pushes)[1] == min(k for _, k in pushes), (rank, rnd, server, pushes)
    assert overtook > 0, "no small push came while an LTP push waited: the check shows nothing"
    # the trace samples every path's rate model (table paths): each path sent, was ACKed, was
    # paced, and its counters only grow
    for rank in (0, 1):
        with open(traced + ".worker%d" % rank) as f:
            table = json.load(f)["tables"]["paths"]
        rows = [dict(zip(table["columns"], r)) for r in table["rows"]]
        for server in (0, 1):
            mine = [r for r in rows if r["server"] == server]
            assert len(mine) >= 2 and all(r["kind"] == "ltp_path" for r in mine), table
            for a, b in zip(mine, mine[1:]):
                assert b["time"] >= a["time"] and b["sent_bytes"] >= a["sent_bytes"]
                assert b["delivered_bytes"] >= a["delivered_bytes"]
            last = mine[-1]
            assert 0 < last["delivered_bytes"] <= last["sent_bytes"], last
            # paced, and held to the server's grant once one came: the ceiling left the
            # model's default (no grant yet) and the pacing never exceeded it
            assert all(0 < r["pacing_rate"] <= r["ceiling"] for r in mine), mine
            assert last["ceiling"] < rate.DEFAULT_MAX_RATE, last
    assert all(np.isfinite(v).all() for v in weights.values())
    expected = received = late = 0
    for rep in ltp_reports(metrics):
        stats = rep["stats"]
        closed = sum(stats.get("close_" + r, 0) for r in ("complete", "ends", "ratio",
                                                          "deadline"))
        assert stats["rounds"] > 0 and closed == stats["rounds"], rep
        assert rep["mtu"] == 1500 and rep["budget"] == pk.payload_budget(1500), rep
        assert not rep["drops"], rep                 # nothing forged, nothing malformed
        assert {k for k in stats if k.startswith("drop_")} <= {"drop_late"}, rep
        expected += stats["packets_expected"]
        received += stats["packets_received"]
        late += stats.get("drop_late", 0)
    # what the network delivered: 95% of the DATA packets (binomial sd ~0.2% here); what the
    # rounds took: short of that by the packets that came after their round closed by ratio
    # or deadline, and above the acceptance ratio's floor (0.8)
    arrived, accepted = (received + late) / expected, received / expected
    assert 0.93 < arrived < 0.97, (arrived, expected)
    assert 0.85 < accepted <= arrived, (accepted, arrived)
