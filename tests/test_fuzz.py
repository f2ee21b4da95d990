"""Garbage never kills, memory stays bounded.

Four layers, cheapest first:

- the wire parser: ``frame.unpack`` and ``frame.payload_array`` on any bytes raise
  ``WireError`` and nothing else; ``tcp.recv`` of any multipart message (any number of frames,
  any sizes, up to the transport's bound) returns a message or raises ``WireError``, and the
  next message arrives intact;
- the loops' per-message functions, in this process on loopback sockets with the job secret:
  the server's (``_serve_requests`` from workers, a peer server and strangers;
  ``_serve_scheduler``; ``_serve_peer``), the scheduler's (``_receive``/``_do`` from registered
  nodes and strangers) and a worker's I/O thread (replies and scheduler messages) get
  arbitrary multipart messages and never raise; afterwards a correct exchange still gives the
  right result (a round of pushes sums correctly, the job finishes with exit code 0);
- the protocol state machines as an authenticated member drives them: random, mutated
  (header fields, bit flips, payloads cut or grown or dropped), truncated and oversized
  messages to ``ServerState.on_request`` (as worker 0 and 1, MIGRATE as a peer server),
  ``on_scheduler``, ``on_peer_reply``, ``SchedulerState.on_message`` (as a node and as a
  stranger) and ``SchedulerLink.handle``: refusals are ERROR replies or counted drops, never an
  exception, and a correct exchange afterwards gives the right result;
- live, bounded: scripts/fuzz.py sends 5,000 frames to every server and the scheduler of a
  real 2 x 2 job while it trains, without the secret and with it from a connection that is no
  node of the job; scripts/flood.py floods one server from 4 processes for 6 s (with the secret
  from non-members, and as slow readers).  Each job must finish with exit 0 and the weights of
  an unfuzzed run (1e-6), and the flooded server's RSS must stay under +64 MB.  The full runs
  (100,000 frames, 60 s floods) are in docs/ROBUSTNESS.md.

Messages that legitimately end a job (an ABORT from the scheduler to a node, an ABORT or the
last FINISH from a worker to the scheduler) are left out of the member fuzzers: they do what
they say.
"""
import json
import os
import pickle
import secrets
import subprocess
import sys
import tempfile
import threading
import time

import mxnet as mx
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings, strategies as st

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cluster  # noqa: E402
from mxps import config  # noqa: E402
from mxps.placement.plan import Slice, table_to_json  # noqa: E402
from mxps.roles import scheduler as scheduler_loop, server as server_loop  # noqa: E402
from mxps.roles.link import SchedulerLink  # noqa: E402
from mxps.roles.scheduler_state import SchedulerState  # noqa: E402
from mxps.roles.server_state import Out, ServerState  # noqa: E402
from mxps.wire import auth, frame as wire, tcp, typed  # noqa: E402
from mxps.wire.frame import HEADER_SIZE, Header, MsgType, WireError  # noqa: E402

pytestmark = pytest.mark.slow

SECRET = "fuzz-secret-" + secrets.token_hex(16)
SETTINGS = tcp.Settings(auth.Credentials(SECRET.encode()))
F32 = wire.dtype_code(np.float32)
SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
LIVE_STEPS = 6000          # long enough to train through the live fuzzers and floods
FLOOD_SECONDS = 6          # each flood's length (scripts/flood.py --seconds)
FUZZ = settings(max_examples=100, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# through real sockets each example costs round trips: fewer, larger batches
LOOP_FUZZ = settings(FUZZ, max_examples=60)

# ---------------------------------------------------------------------------------- strategies

INT32 = st.integers(-2 ** 31, 2 ** 31 - 1)
INT64 = st.integers(-2 ** 63, 2 ** 63 - 1)
UINT8 = st.integers(0, 255)
UINT32 = st.integers(0, 2 ** 32 - 1)
UINT64 = st.integers(0, 2 ** 64 - 1)
FIELDS = {"dtype": UINT8, "flags": UINT8, "key": INT32, "sender": INT32, "iteration": INT64,
          "plan_version": UINT32, "status": INT32, "offset": UINT64, "length": UINT64,
          "request_id": UINT64}
any_header = st.builds(Header, type=st.sampled_from(list(MsgType)), **FIELDS)


def _flip(data, flips):
    b = bytearray(data)
    for i, bit in flips:
        if b:
            b[i % len(b)] ^= 1 << bit
    return bytes(b)


@st.composite
def mutated(draw, corpus, allow_types=None):
    """A message of ``corpus`` ((header, payload) pairs) as it is, or broken: header fields
    changed (the type too, within ``allow_types``), bits flipped, the payload cut, grown,
    replaced or dropped, a truncated header or random bytes instead."""
    h, payload = draw(st.sampled_from(corpus))
    h = h.reply(h.type)
    for name, value in draw(st.dictionaries(st.sampled_from(sorted(FIELDS)),
                                            st.integers(-2 ** 63, 2 ** 64 - 1),
                                            max_size=3)).items():
        setattr(h, name, _clamp(name, value))
    if allow_types is not None and draw(st.booleans()):
        h.type = draw(st.sampled_from(sorted(allow_types)))
    how = draw(st.sampled_from(["as is", "flip", "cut", "grow", "replace", "drop", "huge"]))
    if payload is not None and how == "flip":
        payload = _flip(payload, draw(st.lists(st.tuples(st.integers(0, 10 ** 6),
                                                         st.integers(0, 7)),
                                               min_size=1, max_size=8)))
    elif payload is not None and how == "cut":
        payload = payload[:draw(st.integers(0, max(len(payload) - 1, 0)))]
    elif how == "grow":
        payload = (payload or b"") + draw(st.binary(min_size=1, max_size=64))
    elif how == "replace":
        payload = draw(st.binary(max_size=128))
    elif how == "drop":
        payload = None
    elif how == "huge":
        payload = bytes(tcp.FRAME_BYTES * 2 + 8)      # larger than any frame the wire carries
    return h, payload


def _clamp(name, value):
    lo, hi = {"dtype": (0, 255), "flags": (0, 255), "key": (-2 ** 31, 2 ** 31 - 1),
              "sender": (-2 ** 31, 2 ** 31 - 1), "iteration": (-2 ** 63, 2 ** 63 - 1),
              "plan_version": (0, 2 ** 32 - 1), "status": (-2 ** 31, 2 ** 31 - 1),
              "offset": (0, 2 ** 64 - 1), "length": (0, 2 ** 64 - 1),
              "request_id": (0, 2 ** 64 - 1)}[name]
    return min(max(value, lo), hi)


def _cut(payload):
    """A payload's frames as the transport cuts one (FRAME_BYTES each, the last shorter)."""
    if payload is None:
        return []
    fb = tcp.FRAME_BYTES
    return [payload[i:i + fb] for i in range(0, len(payload), fb)] or [payload]


def frames_of(draw_message):
    """Multipart messages: a (mutated) message's frames, a truncated header, random frames,
    frames added or repeated.  A payload over the frame bound travels cut as the transport
    cuts it (a frame over the bound makes zmq drop the connection: scripts/fuzz.py sends those
    on connections of their own)."""
    return st.one_of(
        draw_message.map(lambda m: [m[0].pack()] + _cut(m[1])),
        st.tuples(draw_message, st.integers(0, HEADER_SIZE - 1)).map(
            lambda x: [x[0][0].pack()[:x[1]]]),
        st.lists(st.binary(max_size=80), min_size=1, max_size=5),
        st.tuples(draw_message, st.binary(max_size=40)).map(
            lambda x: [x[0][0].pack(), x[1] + b"", x[1]]),
        st.tuples(any_header, st.binary(max_size=40)).map(lambda x: [x[0].pack(), x[1]]))


# ---------------------------------------------------------------------------------- the corpora

class _Bomb:
    """Unpickling this creates the directory ``path``: proof that a pickle was executed."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


MARKER = os.path.join(tempfile.gettempdir(), "mxps-test-fuzz-pickle-%d" % os.getpid())
SGD = pickle.dumps(mx.optimizer.SGD(learning_rate=1.0, momentum=0.0, wd=0.0))
ONES = np.ones(4, np.float32).tobytes()
PART = typed.pack({"key": 3, "target": 0, "offset": 0, "length": 4, "dtype": F32,
                   "value": np.ones(4, np.float32), "applied": 1})
STATES = typed.pack({"states": {(3, 0): np.zeros(4, np.float32)}, "counts": {3: 1},
                     "num_update": 1})
WORKER_CORPUS = [
    (Header(MsgType.INIT, key=3, length=4, dtype=F32), ONES),
    (Header(MsgType.INIT, key=11, length=4, dtype=F32), ONES),
    (Header(MsgType.PUSH, key=3, length=4, dtype=F32, iteration=1), ONES),
    (Header(MsgType.PUSHPULL, key=3, length=4, dtype=F32, iteration=2), ONES),
    (Header(MsgType.PULL, key=3, length=4, iteration=1), None),
    (Header(MsgType.SET_OPTIMIZER), SGD),
    (Header(MsgType.SET_OPTIMIZER), pickle.dumps(_Bomb(MARKER))),
    (Header(MsgType.GET_STATES), None),
    (Header(MsgType.SET_STATES), STATES),
    (Header(MsgType.PROBE), bytes(64)),
]
PEER_CORPUS = [(Header(MsgType.MIGRATE, key=3, length=4, plan_version=1), PART),
               (Header(MsgType.MIGRATE, key=3, length=4, plan_version=1),
                pickle.dumps(_Bomb(MARKER)))]
WORKER_TYPES = server_loop.ALLOWED["worker"]


def _json(x):
    return json.dumps(x).encode()


REGISTER = {"role": "worker", "host": "127.0.0.1", "port": 1, "pid": 7, "mode": "sync"}
REPLAN = {"round": 3, "traffic": {"2": [[4096, 0.01], [4096, 0.01]]}, "full": True, "force": 0,
          "min_slice": 16, "max_chunk": 0, "min_gain": 0.05, "horizon": 20,
          "keys": [[0, 64], [1, 8]], "table": {"0": [[0, 0, 64]], "1": [[1, 0, 8]]}}
SCHEDULER_CORPUS = [
    (Header(MsgType.REGISTER), _json(REGISTER)),
    (Header(MsgType.REGISTER), _json(dict(REGISTER, role="server"))),
    (Header(MsgType.HEARTBEAT), None), (Header(MsgType.BARRIER), None),
    (Header(MsgType.BANDWIDTH), _json({"bytes": [1e6, 1e6], "seconds": [0.1, 0.2]})),
    (Header(MsgType.REPLAN), _json(REPLAN)),
    (Header(MsgType.PLAN), _json({"version": 1, "moved_bytes": 0})),
    (Header(MsgType.PLAN), _json({"version": 1, "error": "a bad plan"})),
    (Header(MsgType.FINISH), None), (Header(MsgType.ABORT), b"the job is over"),
    (Header(MsgType.PUSH, key=0, length=4, dtype=F32, iteration=1), ONES)]
# what a member of the job may send in these fuzzers without ending the job on purpose
ENDS_THE_JOB = frozenset((MsgType.ABORT, MsgType.FINISH))


def _plan_body(version, old, new):
    return _json({"version": version, "old": table_to_json(old), "new": table_to_json(new)})


PLAN_CORPUS = [
    (Header(MsgType.PLAN), _plan_body(1, {3: (Slice(0, 0, 4),)}, {3: (Slice(0, 0, 2),
                                                                     Slice(1, 2, 2))})),
    (Header(MsgType.PLAN), _plan_body(1, {3: (Slice(0, 0, 4),)}, {3: (Slice(1, 0, 4),)})),
    (Header(MsgType.PLAN), _plan_body(2, {}, {})),
    (Header(MsgType.PLAN), _plan_body(1, {3: (Slice(0, 0, 4),)}, {3: (Slice(5, 0, 4),)}))]


# ---------------------------------------------------------------------------------- helpers

def _types(outs):
    return [o.header.type for o in outs]


def _server(sync=True, optimizer=True, num_servers=2):
    s = ServerState(0, 2, sync, num_servers=num_servers)
    if optimizer:
        assert _types(s.on_request(b"worker:0", Header(MsgType.SET_OPTIMIZER, sender=0),
                                   SGD)) == [MsgType.ACK]
    for key in (3, 5):
        assert _types(s.on_request(b"worker:0", Header(MsgType.INIT, key=key, sender=0,
                                                       length=4, dtype=F32),
                                   np.arange(4, dtype=np.float32).tobytes())) == [MsgType.ACK]
    return s


def _fresh_key(state):
    return max([k for k, _ in state.slots] + [100]) + 1


def a_round_sums_correctly(state):
    """On a key the fuzzer never touched: worker 0 sets an SGD (lr 1) and initialises it, both
    workers push, a pull returns value - (g0 + g1) (or g0 + g1 with the update on workers,
    value + g0 + g1 in async's two applied pushes)."""
    key, v = _fresh_key(state), state.plan_version
    if state.updater is not None or not state.sync:
        assert _types(state.on_request(b"worker:0", Header(MsgType.SET_OPTIMIZER, sender=0),
                                       SGD)) == [MsgType.ACK]
    value = np.array([10, 20, 30, 40], np.float32)
    assert _types(state.on_request(b"worker:0", Header(MsgType.INIT, key=key, sender=0,
                                                       length=4, dtype=F32),
                                   value.tobytes())) == [MsgType.ACK]
    grads = [np.array([1, 2, 3, 4], np.float32), np.array([0.5, 0.5, 0.5, 0.5], np.float32)]
    for w, g in enumerate(grads):
        outs = state.on_request(b"worker:%d" % w, Header(MsgType.PUSH, key=key, sender=w,
                                                         iteration=1, length=4, dtype=F32,
                                                         plan_version=v), g.tobytes())
        assert _types(outs) == [MsgType.ACK], [bytes(o.payload or b"") for o in outs]
    (out,) = state.on_request(b"worker:1", Header(MsgType.PULL, key=key, sender=1, iteration=1,
                                                  length=4, plan_version=v), None)
    assert out.header.type == MsgType.DATA and out.dest == b"worker:1"
    got = np.frombuffer(bytes(memoryview(out.payload)), np.float32)
    if state.updater is None:
        want = grads[0] + grads[1]
    else:
        want = value - grads[0] - grads[1]
    np.testing.assert_allclose(got, want, rtol=1e-6)


# ================================================================================ the wire parser

@settings(max_examples=1000, deadline=None)
@given(st.one_of(st.binary(max_size=120),
                 st.binary(min_size=HEADER_SIZE - 4, max_size=HEADER_SIZE - 4).map(
                     lambda b: wire.MAGIC + b),
                 st.binary(min_size=HEADER_SIZE - 5, max_size=HEADER_SIZE - 5).map(
                     lambda b: wire.MAGIC + bytes([wire.WIRE_VERSION]) + b)))
def test_unpack_of_any_bytes_raises_only_wire_error_or_returns_a_header_that_packs_back(data):
    try:
        h = wire.unpack(data)
    except WireError:
        return
    assert h.pack() == data


@settings(max_examples=1000, deadline=None)
@given(any_header, st.one_of(st.none(), st.binary(max_size=64), st.just(bytes(4096)),
                             st.binary(max_size=32).map(bytearray),
                             st.binary(max_size=32).map(memoryview),
                             st.binary(max_size=32).map(zmq.Frame)))
def test_payload_array_of_any_header_and_frame_raises_only_wire_error_or_views_it_exactly(
        h, frame):
    try:
        a = wire.payload_array(h, frame)
    except WireError:
        return
    assert a.dtype == wire.dtype_of(h.dtype) and a.size == h.length
    assert a.nbytes == len(frame.bytes if isinstance(frame, zmq.Frame) else bytes(frame))


def test_payload_array_of_a_missing_payload_names_key_type_and_size():
    with pytest.raises(WireError, match=r"key 7: PUSH without its payload \(4 x float32\)"):
        wire.payload_array(Header(MsgType.PUSH, key=7, length=4, dtype=F32), None)


@pytest.fixture(scope="module")
def pair():
    """A ROUTER and a DEALER of one job on loopback."""
    router, port = tcp.bind_router("127.0.0.1", None, SETTINGS, who="fuzz-router")
    dealer = tcp.connect_dealer("127.0.0.1", port, SETTINGS, b"worker:0")
    dealer.setsockopt(zmq.LINGER, 0)
    yield router, dealer
    dealer.close(0)
    router.close(0)


_sizes = st.sampled_from([0, 1, 55, 56, 57, tcp.FRAME_BYTES - 1, tcp.FRAME_BYTES])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(st.binary(max_size=80), any_header.map(lambda h: h.pack()),
                          _sizes.map(bytes)), min_size=1, max_size=6))
def test_transport_recv_of_any_multipart_message_returns_it_or_raises_wire_error(pair, frames):
    router, dealer = pair
    dealer.send_multipart(frames)
    tcp.send(dealer, Header(MsgType.PROBE, key=123), b"sentinel")
    results = []
    for _ in range(2):
        assert router.poll(10000), "the message did not arrive"
        try:
            results.append(tcp.recv(router, with_ident=True))
        except WireError:
            results.append(None)
    got, sentinel = results
    assert sentinel is not None and sentinel[1].key == 123 and sentinel[2].bytes == b"sentinel"
    if got is not None:
        ident, h, payload = got
        assert ident == b"worker:0" and h.pack() == frames[0]
        joined = b"".join(frames[1:])
        assert (payload.bytes if payload is not None else b"") == joined


# ================================================================================ the loops

def _sealed(sock, frames, ident=None):
    """``frames`` (any bytes) as a node of the job sends them on the data plane: sealed for the
    session of ``sock`` (a DEALER's; a ROUTER's with ``ident``), so the garbage reaches what
    is behind the seal."""
    if ident is None:
        return sock.seal.seal(frames[0], frames[1:])
    return [ident] + sock.seal.seal(ident, frames[0], frames[1:])


class FakeScheduler:
    """A ROUTER playing the scheduler for one node: answers its REGISTER with ``welcome``
    (a function of the REGISTER body) and records the node's identity."""

    def __init__(self, welcome):
        self.sock, self.port = tcp.bind_router("127.0.0.1", None, SETTINGS, who="fake-sched")
        self.sock.setsockopt(zmq.LINGER, 0)
        self.ident = None
        self._welcome = welcome
        self._thread = threading.Thread(target=self._answer, daemon=True)
        self._thread.start()

    def _answer(self):
        if not self.sock.poll(60000):
            return
        ident, h, payload = tcp.recv(self.sock, with_ident=True)
        assert h.type == MsgType.REGISTER
        self.ident = ident
        tcp.send(self.sock, Header(MsgType.WELCOME), _json(self._welcome(json.loads(
            payload.bytes))), ident=ident)

    def joined(self):
        self._thread.join(60)
        return self.ident is not None

    def send_raw(self, frames):
        self.sock.send_multipart([self.ident] + list(frames))

    def close(self):
        self.sock.close(0)


def _node_cfg(role, port, **env):
    base = {"DMLC_ROLE": role, "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(port),
            "DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "2", "DMLC_NODE_HOST": "127.0.0.1",
            "MXPS_SECRET": SECRET, "MXPS_HEARTBEAT_TIMEOUT": "600", "MXPS_TIMEOUT": "600",
            "MXPS_START_TIMEOUT": "60"}
    base.update(env)
    return config.from_env(base)


def _ends_a_node(frames):
    """Whether a scheduler message is an ABORT (a node leaves when told to, by design)."""
    try:
        return wire.unpack(frames[0]).type == MsgType.ABORT
    except WireError:
        return False


def _serve_once(srv, ms):
    """One turn of the server loop (``Server.run`` without the heartbeats): whatever of its
    sockets is readable within ``ms`` milliseconds is served; whether any was."""
    poller = zmq.Poller()
    for sock in [srv.sock, srv.link.sock] + list(srv.peers.values()):
        poller.register(sock, zmq.POLLIN)
    events = dict(poller.poll(ms))
    if srv.sock in events:
        srv._serve_requests()
    if srv.link.sock in events:
        srv._serve_scheduler()
    for rank, sock in list(srv.peers.items()):
        if sock in events:
            srv._serve_peer(rank, sock)
    return bool(events)


def _pump(srv, until, what, timeout=30.0):
    """Run the server loop until ``until()``; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, "no %s within %.0f s" % (what, timeout)
        _serve_once(srv, 50)


def _idle(srv, ms=300):
    """Serve until nothing arrived for ``ms`` milliseconds (loopback delivers well within):
    what strangers sent, unordered with the workers' messages, is read too."""
    while _serve_once(srv, ms):
        pass


def _arrivals(sock, keep, with_ident=False):
    """(list, check): ``check()`` moves every message waiting on ``sock`` for which
    ``keep(ident, header, payload)`` into the list and says whether it holds any."""
    got = []

    def check():
        while sock.poll(0):
            try:
                msg = tcp.recv(sock, with_ident=with_ident)
            except WireError:
                continue
            if keep(*msg):
                got.append(msg)
        return bool(got)

    return got, check


def _request(srv, socks, ident, h, payload=None):
    """A request to the server through its loop, from the connection ``ident``; the reply's
    (header, payload frame)."""
    h.request_id = int.from_bytes(os.urandom(6), "little")
    tcp.send(socks[ident], h, payload)
    got, arrived = _arrivals(socks[ident], lambda _, r, p: r.request_id == h.request_id)
    _pump(srv, arrived, "reply to %r" % h)
    return got[0][1:]


STRANGERS = (b"worker:2", b"server:7")       # a node's form, beyond the job of 2 x 2
STRANGERS_AND_NODES = (b"worker:0", b"worker:1", b"server:1") + STRANGERS


@pytest.fixture(scope="module")
def live_server():
    """A real ``Server`` (rank 0 of 2) registered with a fake scheduler, its peer server 1 a
    bare data socket, and DEALERs for worker 0, worker 1, server 1 and strangers (names of a
    node's form beyond the job, with valid tokens: the server's handshake refuses them)."""
    peer, peer_port, peer_nonce = tcp.bind_data("127.0.0.1", SETTINGS, who="fake-peer")
    peer.setsockopt(zmq.LINGER, 0)
    sched = FakeScheduler(lambda reg: {
        "rank": 0, "role": "server", "servers": [["127.0.0.1", reg["port"]],
                                                 ["127.0.0.1", peer_port]],
        "seals": [reg["seal"], peer_nonce.hex()],
        "num_workers": 2, "num_servers": 2, "mode": "sync"})
    srv = server_loop.Server(_node_cfg("server", sched.port))
    assert sched.joined()
    nonce = srv.sock.seal.nonce
    socks = {}
    for ident in STRANGERS_AND_NODES:
        d = tcp.connect_data("127.0.0.1", srv.port, SETTINGS, ident, nonce)
        d.setsockopt(zmq.LINGER, 0)
        socks[ident] = d
    yield srv, sched, peer, socks
    for d in socks.values():
        d.close(0)
    for sock in srv.peers.values():
        sock.close(0)
    srv.sock.close(0)
    srv.link.close()
    peer.close(0)
    sched.close()


def _init(srv, socks, value=ONES):
    key = 1000 + len(srv.state.slots) + 10 * srv.state.plan_version
    while any(k == key for k, _ in srv.state.slots):
        key += 1
    h, p = _request(srv, socks, b"worker:0",
                    Header(MsgType.INIT, key=key, length=4, dtype=F32), value)
    assert h.type == MsgType.ACK, p and p.bytes
    return key


def a_round_through_the_loop_sums_correctly(srv, socks):
    h, _ = _request(srv, socks, b"worker:0", Header(MsgType.SET_OPTIMIZER), SGD)
    assert h.type == MsgType.ACK
    key = _init(srv, socks, np.array([10, 20, 30, 40], np.float32).tobytes())
    v = srv.state.plan_version
    for w, g in ((0, [1, 2, 3, 4]), (1, [0.5] * 4)):
        # the rank a header claims is overwritten with the connection's
        h, p = _request(srv, socks, b"worker:%d" % w, Header(
            MsgType.PUSH, key=key, sender=7, iteration=1, length=4, dtype=F32, plan_version=v),
            np.array(g, np.float32).tobytes())
        assert h.type == MsgType.ACK, p and p.bytes
    h, p = _request(srv, socks, b"worker:1", Header(MsgType.PULL, key=key, iteration=1,
                                                    length=4, plan_version=v))
    assert h.type == MsgType.DATA
    np.testing.assert_allclose(wire.payload_array(h, p), [8.5, 17.5, 26.5, 35.5], rtol=1e-6)


SERVER_FRAMES = frames_of(mutated(WORKER_CORPUS + PEER_CORPUS, allow_types=list(MsgType)))


@LOOP_FUZZ
@given(st.lists(st.tuples(st.sampled_from(STRANGERS_AND_NODES), SERVER_FRAMES),
                min_size=1, max_size=12))
def test_the_server_loop_survives_any_message_from_any_connection(live_server, batch):
    srv, _, _, socks = live_server
    for ident, frames in batch:
        try:
            socks[ident].send_multipart(_sealed(socks[ident], frames), flags=zmq.DONTWAIT)
        except zmq.Again:
            # a stranger's queue is full (never read: its handshake was refused); a node's
            # never is, its loop reads everything
            assert ident in STRANGERS, ident
    # a PROBE from each worker after its garbage: answered, so everything before it was read
    for ident in (b"worker:0", b"worker:1"):
        h, p = _request(srv, socks, ident, Header(MsgType.PROBE), b"still serving")
        assert h.type == MsgType.DATA and p.bytes == b"still serving"
    _idle(srv, 10)          # the strangers' messages, if here already (the rest: next time)


def test_after_the_fuzzing_a_round_through_the_server_loop_sums_correctly(live_server):
    srv, _, _, socks = live_server
    _idle(srv)
    a_round_through_the_loop_sums_correctly(srv, socks)
    assert srv.drops.total() > 0, "the fuzzer's garbage was not counted as dropped"
    assert not os.path.exists(MARKER), "a pickle from a connection was executed"


SCHEDULER_TO_SERVER = frames_of(mutated(PLAN_CORPUS + SCHEDULER_CORPUS + [
    (Header(MsgType.ACK, key=-2, iteration=1), None), (Header(MsgType.SHUTDOWN), None),
    (Header(MsgType.BANDWIDTH), _json({"rates": [1.0, 2.0]}))],
    allow_types=[t for t in MsgType if t != MsgType.ABORT])).filter(
    lambda frames: not _ends_a_node(frames))


@LOOP_FUZZ
@given(st.lists(SCHEDULER_TO_SERVER, min_size=1, max_size=10))
def test_the_server_loop_survives_any_message_from_the_scheduler(live_server, batch):
    srv, sched, _, socks = live_server
    for frames in batch:
        sched.send_raw(frames)
    # agreed rates no message of the batch carries mark its end
    mark = {"rates": [float(int.from_bytes(os.urandom(4), "little") + 3)]}
    sched.send_raw([Header(MsgType.BANDWIDTH).pack(), _json(mark)])
    _pump(srv, lambda: srv.link.bandwidth == mark, "the end of the batch")
    srv.link.shutdown = False               # a SHUTDOWN in the batch: this test goes on
    h, p = _request(srv, socks, b"worker:1", Header(MsgType.PROBE), b"still serving")
    assert h.type == MsgType.DATA and p.bytes == b"still serving"


def _move_a_key_to_the_peer(srv, sched, peer, socks):
    """A real re-plan: a fresh key of server 0 moves to server 1 (the bare ROUTER); returns
    the plan's version and the part as server 1 received it (identity, header)."""
    key = _init(srv, socks)
    v = srv.state.plan_version + 1
    sched.send_raw([Header(MsgType.PLAN, plan_version=v).pack(), _plan_body(
        v, {key: (Slice(0, 0, 4),)}, {key: (Slice(1, 0, 4),)})])
    parts, arrived = _arrivals(peer, lambda i, h, p: h.type == MsgType.MIGRATE and
                               h.plan_version == v and h.key == key, True)
    _pump(srv, arrived, "the moved part at server 1")
    ident, h, _ = parts[0]
    assert ident == b"server:0"
    return v, ident, h


def _plan_reports(sched, version):
    """(list, check) of the reports of plan ``version`` reaching the fake scheduler (those of
    plans the fuzzers sent before are skipped)."""
    return _arrivals(sched.sock, lambda i, h, p: h.type == MsgType.PLAN and
                     json.loads(p.bytes).get("version") == version, True)


@LOOP_FUZZ
@given(st.lists(frames_of(mutated([(Header(MsgType.ACK, plan_version=1, request_id=1), None),
                                   (Header(MsgType.ERROR, plan_version=1, request_id=1),
                                    b"refused")], allow_types=list(MsgType))),
                min_size=1, max_size=10))
def test_the_server_loop_survives_any_reply_of_a_peer_server_and_finishes_its_plan(
        live_server, batch):
    srv, sched, peer, socks = live_server
    v, ident, part = _move_a_key_to_the_peer(srv, sched, peer, socks)
    reports, arrived = _plan_reports(sched, v)
    for frames in batch:
        try:                        # server 1 refusing the part fails the plan, by design
            h = wire.unpack(frames[0])
            if (h.type, h.plan_version, h.request_id) == (MsgType.ERROR, v, part.request_id):
                continue
        except WireError:
            pass
        peer.send_multipart(_sealed(peer, frames, ident))
    tcp.send(peer, part.reply(MsgType.ACK, length=0), ident=ident)
    _pump(srv, arrived, "the plan's report")
    assert [json.loads(r[2].bytes) for r in reports] == [{"version": v, "moved_bytes": 16}]


def test_a_plan_naming_a_server_beyond_the_job_fails_the_plan_and_the_server_goes_on(
        live_server):
    srv, sched, _, socks = live_server
    key = _init(srv, socks)
    v = srv.state.plan_version + 1
    reports, arrived = _plan_reports(sched, v)
    sched.send_raw([Header(MsgType.PLAN, plan_version=v).pack(), _plan_body(
        v, {key: (Slice(0, 0, 4),)}, {key: (Slice(5, 0, 4),)})])
    _pump(srv, arrived, "the plan's report")
    report = json.loads(reports[0][2].bytes)
    assert report["version"] == v and "slice on server 5, only 2 servers" in report["error"]
    a_round_through_the_loop_sums_correctly(srv, socks)


@pytest.fixture(scope="module")
def live_scheduler():
    """A real ``Scheduler`` on loopback with two servers and two workers registered (DEALERs
    of the job), and two strangers (the job's secret, never registered)."""
    port = cluster.free_port()
    sched = scheduler_loop.Scheduler(_node_cfg("scheduler", port, MXPS_START_TIMEOUT="600"))
    nodes = {}
    for name in ("s0", "s1", "w0", "w1", "x0", "x1"):
        d = tcp.connect_dealer("127.0.0.1", port, SETTINGS)
        d.setsockopt(zmq.LINGER, 0)
        nodes[name] = d
    for i, name in enumerate(("s0", "s1", "w0", "w1")):
        tcp.send(nodes[name], Header(MsgType.REGISTER), _json(dict(
            REGISTER, role="server" if name[0] == "s" else "worker", port=9100 + i)))
    assert _serve_scheduler(sched, lambda: sched.state.started_at is not None,
                            "the rendezvous") == []
    for name in ("s0", "s1", "w0", "w1"):
        assert nodes[name].poll(10000)
        _, h, _ = tcp.recv(nodes[name])
        assert h.type == MsgType.WELCOME
    yield sched, nodes
    for d in nodes.values():
        d.close(0)
    sched.sock.close(0)


def _serve_scheduler(sched, until=None, what="", timeout=30.0, idle_ms=300):
    """Run the scheduler loop's receive function (and carry out its answers) until
    ``until()`` (None: until nothing arrived for ``idle_ms``) or the job ends; the exit
    codes of the job's end."""
    deadline = time.monotonic() + timeout
    while until is None or not until():
        assert time.monotonic() < deadline, "no %s within %.0f s" % (what, timeout)
        if not sched.sock.poll(50 if until else idle_ms):
            if until is None:
                return []
            continue
        while sched.sock.poll(0):
            step = sched._receive()
            code = None if step is None else sched._do(step)
            if code is not None:
                return [code]
    return []


SCHEDULER_FRAMES = frames_of(mutated(SCHEDULER_CORPUS, allow_types=list(MsgType)))


@LOOP_FUZZ
@given(st.lists(st.tuples(st.sampled_from(["w1", "s0", "x0", "x1"]), SCHEDULER_FRAMES),
                min_size=1, max_size=12))
def test_the_scheduler_loop_survives_any_message_from_nodes_and_strangers(live_scheduler,
                                                                          batch):
    sched, nodes = live_scheduler
    for name, frames in batch:
        if name[0] != "x":
            try:                   # a member's ABORT or FINISH ends the job by design
                if wire.unpack(frames[0]).type in ENDS_THE_JOB:
                    continue
            except WireError:
                pass
        nodes[name].send_multipart(frames)
    assert _serve_scheduler(sched, idle_ms=20) == [], "the job ended: %s" % (
        sched.state.exit,)


def test_after_the_fuzzing_the_scheduler_still_ends_the_job_cleanly(live_scheduler):
    sched, nodes = live_scheduler
    assert _serve_scheduler(sched) == [], "the job ended: %s" % (sched.state.exit,)
    assert sched.state.malformed + sched.state.strangers + sched.drops.total() > 0
    for name in ("w0", "w1"):
        tcp.send(nodes[name], Header(MsgType.FINISH))
    assert _serve_scheduler(sched, lambda: sched.state.leaving is not None,
                            "the SHUTDOWN") == []
    for name in ("s0", "s1", "w0", "w1"):
        # the fuzzing leaves answers queued ahead of the SHUTDOWN (a fuzzed HEARTBEAT's echo):
        # read until the SHUTDOWN or 10 s without it, never stopping at an empty queue, which
        # on a busy machine comes before ZeroMQ's I/O thread delivered the rest (CI, 6f34b93)
        types, deadline = [], time.monotonic() + 10.0
        while MsgType.SHUTDOWN not in types and time.monotonic() < deadline:
            if nodes[name].poll(100):
                try:
                    types.append(tcp.recv(nodes[name])[1].type)
                except WireError:
                    pass
        assert MsgType.SHUTDOWN in types, (name, types)
        tcp.send(nodes[name], Header(MsgType.BYE))
    codes = _serve_scheduler(sched, lambda: False, "the end of the job")
    assert codes == [0] and sched.state.exit.reason == "all workers finished"


@pytest.fixture(scope="module")
def live_worker():
    """A worker's ``Client`` registered with a fake scheduler, its one server a bare data
    socket (which seals what the tests send raw: ``_sealed``)."""
    from mxps.roles.worker import Client
    srv, srv_port, nonce = tcp.bind_data("127.0.0.1", SETTINGS, who="fake-server")
    srv.setsockopt(zmq.LINGER, 0)
    sched = FakeScheduler(lambda reg: {
        "rank": 0, "role": "worker", "servers": [["127.0.0.1", srv_port]],
        "seals": [nonce.hex()], "num_workers": 1,
        "num_servers": 1, "mode": "sync"})
    client = Client(_node_cfg("worker", sched.port, DMLC_NUM_WORKER="1", DMLC_NUM_SERVER="1"))
    assert sched.joined()
    yield client, sched, srv
    client._stopped.set()
    client._thread.join(10)
    srv.close(0)
    sched.close()


def _completes(frames, req):
    """Whether ``frames`` are a reply that rightly completes ``req``: a valid DATA reply, or
    an ERROR (the server refused it; the worker hands it to the request's callback)."""
    try:
        h = wire.unpack(frames[0])
        if h.request_id != req.request_id:
            return False
        if h.type == MsgType.ERROR:
            return True
        return (h.type == MsgType.DATA and len(frames) == 2
                and wire.payload_array(h, frames[1]).size == 3)
    except WireError:
        return False


REPLIES = st.tuples(st.booleans(), frames_of(mutated([
    (Header(MsgType.DATA, key=5, length=3, dtype=F32), np.arange(3, dtype=np.float32).tobytes()),
    (Header(MsgType.ERROR, key=5), b"refused"), (Header(MsgType.ACK, key=5), None)],
    allow_types=list(MsgType))))


@LOOP_FUZZ
@given(st.lists(REPLIES, max_size=8), st.lists(SCHEDULER_TO_SERVER, max_size=6))
def test_the_worker_io_thread_survives_any_reply_and_scheduler_message(live_worker, replies,
                                                                       control):
    client, sched, srv = live_worker
    for frames in control:
        sched.send_raw(frames)
    done = threading.Event()
    got = {}

    def on_reply(h, payload):
        got["value"] = wire.payload_array(h, payload).copy()     # raises on a bad size
        done.set()

    client.submit(0, Header(MsgType.PULL, key=5, length=3), None, on_reply)
    assert srv.poll(10000)
    ident, req, _ = tcp.recv(srv, with_ident=True)
    for claims_the_request, frames in replies:
        if claims_the_request and _parses(frames[0]):          # garbage for this very request
            h = wire.unpack(frames[0])
            h.request_id = req.request_id
            frames = [h.pack()] + frames[1:]
        if not _completes(frames, req):
            srv.send_multipart(_sealed(srv, frames, ident))
    good = req.reply(MsgType.DATA, dtype=F32)
    srv.send_multipart(_sealed(srv, [good.pack(), np.arange(3, dtype=np.float32).tobytes()],
                               ident))
    assert done.wait(10), "the worker's request was not completed by its reply"
    assert client._thread.is_alive(), "the worker's I/O thread died"
    np.testing.assert_array_equal(got["value"], [0, 1, 2])


def test_the_worker_refuses_a_reply_that_does_not_match_its_request_and_keeps_it_pending(
        live_worker):
    client, _, srv = live_worker
    done = threading.Event()
    got = []
    client.submit(0, Header(MsgType.PULL, key=5, offset=2, length=3, dtype=F32), None,
                  lambda h, payload: (got.append(bytes(payload)), done.set()))
    assert srv.poll(10000)
    ident, req, _ = tcp.recv(srv, with_ident=True)
    before = client.drops.counts["mismatch"]
    three = np.arange(3, dtype=np.float32).tobytes()
    for changes, payload in [
            (dict(length=0), b""),                                   # no values at all
            (dict(key=6), three),                                    # another key
            (dict(offset=1), three),                                 # other elements
            (dict(dtype=wire.dtype_code(np.float64)),
             np.arange(3, dtype=np.float64).tobytes()),             # another dtype
            (dict(), three[:8])]:                                    # fewer bytes than named
        srv.send_multipart(_sealed(srv, [req.reply(MsgType.DATA, **changes).pack(), payload],
                                   ident))
    assert not done.wait(1.0), "a reply that does not match its request completed it"
    assert client.drops.counts["mismatch"] - before == 5
    srv.send_multipart(_sealed(srv, [req.reply(MsgType.DATA).pack(), three], ident))
    assert done.wait(10), "the matching reply did not complete the request"
    assert got == [three]


def _parses(frame):
    try:
        wire.unpack(frame)
        return True
    except WireError:
        return False


# ================================================================================ state machines

@pytest.mark.parametrize("sync,optimizer", [(True, True), (True, False), (False, True)],
                         ids=["sync-optimizer_on_servers", "sync-update_on_workers", "async"])
@FUZZ
@given(data=st.data())
def test_server_state_survives_any_request_of_a_member_and_still_sums_rounds(sync, optimizer,
                                                                             data):
    s = _server(sync, optimizer)
    installed = s.optimizer
    batch = data.draw(st.lists(st.one_of(
        st.tuples(st.sampled_from([0, 1]), mutated(WORKER_CORPUS, allow_types=WORKER_TYPES)),
        st.tuples(st.just("peer"), mutated(PEER_CORPUS))), min_size=1, max_size=25))
    for who, (h, payload) in batch:
        client = b"server:1" if who == "peer" else b"worker:%d" % who
        h.sender = 1 if who == "peer" else who          # as the loop sets it
        outs = s.on_request(client, h, payload)
        for o in outs:
            if o.to == Out.SCHEDULER:                    # a part accepted, its plan failing
                continue
            assert o.to == Out.CLIENT and o.dest == client, o
            assert o.header.type in (MsgType.ACK, MsgType.DATA, MsgType.ERROR), o
            if o.header.type == MsgType.ERROR and s.optimizer is installed:
                # a rule's refusal, never a caught crash (a mutated optimizer that got in may
                # fail updates: that is its own fault, reported to the worker)
                assert b"failed on" not in bytes(o.payload), bytes(o.payload)
    assert not os.path.exists(MARKER)
    a_round_sums_correctly(s)


@FUZZ
@given(st.lists(mutated(PLAN_CORPUS + [(Header(MsgType.HEARTBEAT), None)],
                        allow_types=[MsgType.PLAN, MsgType.SHUTDOWN]), min_size=1, max_size=8))
def test_server_state_survives_any_plan_and_reports_what_it_cannot_take(batch):
    s = _server()
    for h, payload in batch:
        for o in s.on_scheduler(h, payload):
            assert o.to in (Out.SCHEDULER, Out.PEER), o
            if o.to == Out.PEER:
                assert 0 <= o.dest < 2 and o.dest != s.rank, o
            else:
                report = json.loads(o.payload)
                assert isinstance(report["version"], int), report
    a_round_sums_correctly(s)


@FUZZ
@given(st.lists(st.tuples(st.integers(-1, 3), any_header), min_size=1, max_size=20))
def test_server_state_drops_any_peer_reply_that_answers_no_part_in_flight(batch):
    s = _server()
    for rank, h in batch:
        assert s.on_peer_reply(rank, h) == []
    assert s.drops.total() == len(batch)
    a_round_sums_correctly(s)


def _started_scheduler():
    cfg = config.Config(role="scheduler", root_uri="127.0.0.1", root_port=9000, num_workers=2,
                        num_servers=2, node_host="127.0.0.1")
    state = SchedulerState(cfg, 1000.0)
    for i, ident in enumerate((b"s0", b"s1", b"w0", b"w1")):
        step = state.on_message(ident, Header(MsgType.REGISTER), _json(dict(
            REGISTER, role="server" if ident[0:1] == b"s" else "worker", port=9100 + i)),
            1000.0)
    assert step.sends and state.started_at is not None
    return state


@FUZZ
@given(st.lists(st.tuples(st.sampled_from([b"w1", b"s0", b"s1", b"stranger", b"\x00ab"]),
                          mutated(SCHEDULER_CORPUS, allow_types=list(MsgType))),
                min_size=1, max_size=25))
def test_scheduler_state_survives_any_message_of_a_node_or_stranger_and_ends_cleanly(batch):
    state = _started_scheduler()
    now = 1000.0
    for ident, (h, payload) in batch:
        if ident in state.nodes and h.type in ENDS_THE_JOB:
            continue
        now += 0.01
        step = state.on_message(ident, h, payload, now)
        assert step.exit is None, step.exit
        for send in step.sends:                  # strangers get nothing but a refusal
            if ident not in state.nodes:
                assert send.ident == ident and send.header.type == MsgType.ABORT, send
    assert state.on_message(b"w0", Header(MsgType.HEARTBEAT), None, now).sends[0].ident == b"w0"
    state.on_message(b"w0", Header(MsgType.FINISH), None, now)
    step = state.on_message(b"w1", Header(MsgType.FINISH), None, now)
    assert sorted(s.ident for s in step.sends if s.header.type == MsgType.SHUTDOWN) == \
        [b"s0", b"s1", b"w0", b"w1"]
    for ident in (b"s0", b"s1", b"w0"):
        assert state.on_message(ident, Header(MsgType.BYE), None, now).exit is None
    step = state.on_message(b"w1", Header(MsgType.BYE), None, now)
    assert step.exit is not None and step.exit.code == 0, step.exit


def test_scheduler_state_refuses_messages_a_role_does_not_send_and_a_second_barrier():
    state = _started_scheduler()
    for ident, t in ((b"s0", MsgType.BARRIER), (b"s1", MsgType.REPLAN),
                     (b"s0", MsgType.BANDWIDTH), (b"w0", MsgType.PLAN),
                     (b"w0", MsgType.REGISTER)):
        assert state.on_message(ident, Header(t), b'{"round": 1}', 1000.0).sends == []
    assert state.malformed == 5
    assert state.on_message(b"w0", Header(MsgType.BARRIER), None, 1000.0).sends == []
    assert state.on_message(b"w0", Header(MsgType.BARRIER), None, 1000.0).sends == []
    assert state.malformed == 6                   # a barrier counts each worker once
    step = state.on_message(b"w1", Header(MsgType.BARRIER), None, 1000.0)
    assert sorted(s.ident for s in step.sends) == [b"w0", b"w1"]


@pytest.mark.parametrize("report,problem", [
    (dict(REPLAN, traffic={"2": [[1, 0.1]]}), "traffic of round '2'"),
    (dict(REPLAN, table={"0": [[7, 0, 64]], "1": [[1, 0, 8]]}), "slice on server 7"),
    (dict(REPLAN, keys=[[0, 65], [1, 8]]), "key 0 has 65 elements"),
    (dict(REPLAN, horizon="20"), "'horizon' is not a non-negative integer"),
    (dict(REPLAN, full=None), "'full' is not true or false")])
def test_a_replan_report_that_does_not_fit_is_dropped_naming_the_problem(report, problem,
                                                                        caplog):
    state = _started_scheduler()
    step = state.on_message(b"w0", Header(MsgType.REPLAN), _json(report), 1000.0)
    assert step.sends == [] and state.malformed == 1 and state.replan_reports == {}
    assert problem in caplog.text


@pytest.mark.parametrize("body", [{"bytes": "12", "seconds": "34"},
                                  {"bytes": [1, 2], "seconds": [1, float("inf")]},
                                  {"bytes": [True, 2], "seconds": [1, 1]},
                                  {"bytes": [1, 2], "seconds": [0, 1]}])
def test_a_bandwidth_report_that_is_not_two_lists_of_numbers_is_dropped(body):
    state = _started_scheduler()
    payload = json.dumps(body).encode()
    assert state.on_message(b"w0", Header(MsgType.BANDWIDTH), payload, 1000.0).sends == []
    assert state.malformed == 1 and state.rate_reports == {}


def test_scheduler_link_handles_any_message_but_abort_without_raising():
    link = SchedulerLink(_node_cfg("worker", cluster.free_port()), "worker")
    try:
        @FUZZ
        @given(mutated(SCHEDULER_CORPUS + [(Header(MsgType.REPLAN), _json(
            {"version": 1, "table": None, "rates": [1.0, 2.0], "full_next": True})),
            (Header(MsgType.BANDWIDTH), _json({"rates": [1.0, 2.0]}))],
            allow_types=[t for t in MsgType if t != MsgType.ABORT]))
        def check(message):
            h, payload = message
            if h.type == MsgType.ABORT:
                return
            assert link.handle(h, payload) in (h.type, None)

        check()
        assert link.drops.total() > 0
    finally:
        link.close()


# ================================================================================ live

def _run_script(name, args, timeout):
    p = subprocess.run([sys.executable, os.path.join(SCRIPTS, name)] + args,
                       stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout,
                       start_new_session=True)
    return p.returncode, p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An unfuzzed run of the scripts' job (the session's job cache)."""
    env = cluster.train_env("mxps", update_on_kvstore=True, steps=LIVE_STEPS)
    return cluster.job_cache(tmp_path_factory).train(env, 2, 2, timeout=600).out_dir


@pytest.fixture(scope="module")
def fuzzed(reference, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("fuzz") / "result.json")
    rc, stdout, stderr = _run_script("fuzz.py", [
        "--frames", "5000", "--steps", str(LIVE_STEPS), "--reference", reference,
        "--json", out], timeout=900)
    assert os.path.exists(out), "scripts/fuzz.py failed (rc %s):\n%s\n%s" % (
        rc, stdout[-3000:], stderr[-3000:])
    with open(out) as f:
        return json.load(f), rc, stdout


def test_live_fuzzing_sends_5000_frames_to_every_server_and_the_scheduler_in_both_modes(
        fuzzed):
    result, _, table = fuzzed
    for mode in ("plain", "outsider"):
        targets = result["attacks"][mode]["targets"]
        assert sorted(targets) == ["s0", "s1", "sched"], table
        for name, t in targets.items():
            assert t["frames"] >= 5000, (mode, name, table)
            assert all(t["by_kind"][k] > 0 for k in ("random", "mutated", "truncated",
                                                    "oversized")), (mode, name, table)


def test_live_fuzzed_job_trains_through_it_and_ends_with_the_weights_of_an_unfuzzed_run(
        fuzzed):
    result, rc, table = fuzzed
    assert result["job"]["ok"], "%s\n%s" % (result["job"], result.get("log_tails"))
    for mode in ("plain", "outsider"):
        assert result["alive_after"][mode] == ["s0", "s1", "sched", "w0", "w1"], table
        assert result["steps_during"][mode] > 0, table   # it trained while being fuzzed
    assert result["weights_equal"], table
    assert result["max_relative_difference"] <= 1e-6
    assert not result["pickle_executed"]
    assert rc == 0, table


def test_live_fuzzed_nodes_log_the_garbage_without_a_traceback(fuzzed):
    result, _, table = fuzzed
    logs = result["logs"]
    for name in ("sched", "s0", "s1"):
        assert logs[name]["tracebacks"] == 0 and logs[name]["fatal"] == 0, result["log_tails"]
        assert logs[name]["refused_connections"] > 0, table     # the plain mode, by address
        assert logs[name]["drop_lines"] > 0, table               # the outsider mode
    for name in ("w0", "w1"):
        assert logs[name]["tracebacks"] == 0, result["log_tails"]


@pytest.fixture(scope="module")
def flooded(reference, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("flood") / "result.json")
    # both phases must end before the job's LIVE_STEPS do: unflooded they take ~21 s here
    # (283 steps/s; 4000 steps ended inside the second flood), a flood slows them to 65-106
    # steps/s, and 2 x 6 s of flood (with the flooders' start-up) leave a margin
    rc, stdout, stderr = _run_script("flood.py", [
        "--seconds", str(FLOOD_SECONDS), "--modes", "outsider", "slow", "--warmup", "1",
        "--gap", "1", "--steps", str(LIVE_STEPS), "--reference", reference, "--json", out],
        timeout=900)
    assert os.path.exists(out), "scripts/flood.py failed (rc %s):\n%s\n%s" % (
        rc, stdout[-3000:], stderr[-3000:])
    with open(out) as f:
        return json.load(f), rc, stdout


def test_a_server_flooded_by_non_members_and_slow_readers_stays_under_64_mb_more(flooded):
    result, _, table = flooded
    assert [p["mode"] for p in result["phases"]] == ["outsider", "slow"], table
    for phase in result["phases"]:
        assert phase["seconds"] >= FLOOD_SECONDS - 1, table
        assert sum(s["messages"] for s in phase["senders"]) > 1000, table
        rss = phase["rss"]["server 0"]
        assert rss["samples"] >= 2 * FLOOD_SECONDS - 2, table      # one every 0.5 s
        assert rss["growth"] < 64 << 20, table
        assert sum(s["answers"] for s in phase["senders"]) == 0, table   # nothing to read


def test_a_flooded_job_keeps_training_and_ends_with_the_weights_of_an_unflooded_run(flooded):
    result, rc, table = flooded
    assert result["job"]["ok"], "%s\n%s" % (result["job"], result.get("log_tails"))
    for phase in result["phases"]:
        assert phase["trained_throughout"] and phase["steps_during"] > 0, table
    assert result["weights_equal"], table
    assert rc == 0, table


def test_a_reply_lands_in_the_buffer_its_callback_names_only_when_it_answers_the_request(
        live_worker):
    client, _, srv = live_worker
    done = threading.Event()
    target = np.zeros(3, np.float32)
    got = []

    class Fill:
        def land(self, h):
            return target.view(np.uint8)

        def __call__(self, h, payload):
            got.append(wire.payload_array(h, payload).ctypes.data)
            done.set()

    client.submit(0, Header(MsgType.PULL, key=5, offset=2, length=3, dtype=F32), None, Fill())
    assert srv.poll(10000)
    ident, req, _ = tcp.recv(srv, with_ident=True)
    seven = np.full(3, 7, np.float32).tobytes()
    for changes in [dict(key=6), dict(offset=1), dict(request_id=req.request_id + 1)]:
        srv.send_multipart(_sealed(srv, [req.reply(MsgType.DATA, **changes).pack(), seven],
                                   ident))
    srv.send_multipart(_sealed(srv, [req.reply(MsgType.ACK).pack()], ident))
    assert not done.wait(1.0), "a reply that does not answer the request completed it"
    assert not target.any(), "a reply that does not answer the request was landed"
    srv.send_multipart(_sealed(srv, [req.reply(MsgType.DATA).pack(),
                                     np.arange(3, dtype=np.float32).tobytes()], ident))
    assert done.wait(10), "the matching reply did not complete the request"
    np.testing.assert_array_equal(target, [0, 1, 2])
    assert got == [target.ctypes.data]                   # deciphered in place, not copied
