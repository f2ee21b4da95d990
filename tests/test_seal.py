"""The sealed data plane (mxps.wire.seal, auth.DataGate): what opens, and everything that must not.

Sessions are driven in one process without sockets: a ``ClientSeal`` seals frames, a
``ServerSeal`` opens them under the connection's identity, and the reverse for replies.  The
frames are wrapped as zmq delivers them (``zmq.Frame``).  One test goes through real sockets:
the PLAIN handshake admits a token of the job and refuses a wrong secret's and no secret.
"""
import os
import time

import numpy as np
import pytest
import zmq
from hypothesis import given, settings as hsettings, strategies as st

from mxps.wire import auth, seal, tcp
from mxps.wire.frame import Header, MsgType, WireError as wire_error, dtype_code

pytestmark = pytest.mark.unit

CREDS = auth.Credentials(b"s" * 32)
OTHER = auth.Credentials(b"o" * 32)
F32 = dtype_code(np.float32)
FRAME = 1 << 16      # a small frame size, so multi-part payloads stay small


def _frames(raw):
    return [zmq.Frame(bytes(memoryview(f).cast("B")) if not isinstance(f, bytes) else f)
            for f in raw]


def _pair(name=b"worker:0", creds=CREDS, nonce=None):
    nonce = os.urandom(16) if nonce is None else nonce
    return (seal.ClientSeal(creds.data_key, name, nonce, FRAME),
            seal.ServerSeal(CREDS.data_key, nonce, FRAME), nonce)


def _parts(values):
    view = memoryview(values).cast("B")
    return [view[i:i + FRAME] for i in range(0, view.nbytes, FRAME)] if view.nbytes else []


def _push(n, key=1):
    values = np.arange(n, dtype=np.float32)
    return Header(MsgType.PUSH, key=key, length=n, dtype=F32, iteration=1), values


@pytest.mark.parametrize("n", [0, 3, 20000, 3 * FRAME // 4, 3 * FRAME // 4 + 5])
def test_a_sealed_message_opens_to_its_header_and_payload_both_ways(n):
    client, server, _ = _pair()
    h, values = _push(n)
    got_h, got_p = server.open(b"worker:0", _frames(client.seal(h.pack(), _parts(values))))
    assert got_h == h
    if n:
        assert np.array_equal(np.frombuffer(got_p.buffer, np.float32), values)
    else:
        assert got_p is None
    reply = h.reply(MsgType.DATA)
    back_h, back_p = client.open(_frames(server.seal(b"worker:0", reply.pack(), _parts(values))))
    assert back_h == reply
    assert (back_p is None) == (n == 0)


def test_the_wire_carries_no_plaintext():
    client, _, _ = _pair()
    h, values = _push(4096)
    marker = np.frombuffer(b"WEIGHTS!" * 2048, np.float32)
    wire = b"".join(bytes(memoryview(f).cast("B")) for f in client.seal(h.pack(), _parts(marker)))
    assert b"WEIGHTS!" not in wire and h.pack()[8:] not in wire


@pytest.mark.parametrize("where", ["prefix counter", "prefix random", "header", "part 0",
                                   "part 1 tag"])
def test_a_changed_byte_anywhere_is_refused_and_nothing_is_taken(where):
    client, server, _ = _pair()
    h, values = _push(3 * FRAME // 4 + 5)
    frames = [bytearray(memoryview(f).cast("B")) for f in client.seal(h.pack(), _parts(values))]
    index, at = {"prefix counter": (0, 5), "prefix random": (0, seal.PREFIX + 3),
                 "header": (0, seal.CLIENT_PREFIX + 10), "part 0": (1, 100),
                 "part 1 tag": (2, -1)}[where]
    frames[index][at] ^= 1
    with pytest.raises(seal.Refused):
        server.open(b"worker:0", _frames([bytes(f) for f in frames]))
    # the session was not moved on by the forgery: the next real message opens
    h2, v2 = _push(7, key=2)
    assert server.open(b"worker:0", _frames(client.seal(h2.pack(), _parts(v2))))[0] == h2


def test_a_replayed_or_reordered_message_is_refused():
    client, server, _ = _pair()
    first = _frames(client.seal(_push(8)[0].pack(), _parts(_push(8)[1])))
    second = _frames(client.seal(_push(9)[0].pack(), _parts(_push(9)[1])))
    server.open(b"worker:0", second)
    with pytest.raises(seal.Refused, match="replayed or reordered") as e:
        server.open(b"worker:0", first)            # older than one already taken
    assert e.value.why == "replayed"
    with pytest.raises(seal.Refused, match="replayed"):
        server.open(b"worker:0", second)           # the same one again
    # a reply replayed to the client is refused as well
    reply = _frames(server.seal(b"worker:0", Header(MsgType.ACK).pack(), []))
    client.open(reply)
    with pytest.raises(seal.Refused, match="replayed"):
        client.open(reply)


def test_parts_dropped_added_or_swapped_are_refused():
    client, server, _ = _pair()
    h, values = _push(3 * FRAME // 4 + 5)       # 4 parts
    frames = _frames(client.seal(h.pack(), _parts(values)))
    with pytest.raises(seal.Refused, match="parts"):
        server.open(b"worker:0", frames[:-1])
    with pytest.raises(seal.Refused, match="parts"):
        server.open(b"worker:0", frames + frames[-1:])
    with pytest.raises(seal.Refused, match="does not verify"):
        server.open(b"worker:0", [frames[0], frames[2], frames[1]] + frames[3:])


def test_a_message_opens_only_for_its_sender_its_server_process_and_the_jobs_secret():
    client, server, nonce = _pair()
    h, values = _push(10)
    frames = _frames(client.seal(h.pack(), _parts(values)))
    with pytest.raises(seal.Refused, match="does not verify"):
        server.open(b"worker:1", frames)        # another node's connection
    other_process = seal.ServerSeal(CREDS.data_key, os.urandom(16), FRAME)
    with pytest.raises(seal.Refused, match="does not verify"):
        other_process.open(b"worker:0", frames)
    wrong, server2, _ = _pair(creds=OTHER, nonce=nonce)
    with pytest.raises(seal.Refused, match="does not verify") as e:
        server2.open(b"worker:0", _frames(wrong.seal(h.pack(), _parts(values))))
    assert e.value.why == "forged"
    assert server.open(b"worker:0", frames)[0] == h      # and the real one still opens


def test_an_unsealed_message_is_refused_saying_so():
    _, server, _ = _pair()
    h, values = _push(4)
    with pytest.raises(seal.Refused) as e:
        server.open(b"worker:0", _frames([h.pack(), values.tobytes()]))
    assert e.value.why == "unsealed"
    with pytest.raises(seal.Refused):
        server.open(b"worker:0", _frames([b"\x01\x02\x03"]))


def test_replies_go_under_the_newest_session_and_an_old_sessions_replay_stays_refused():
    nonce = os.urandom(16)
    server = seal.ServerSeal(CREDS.data_key, nonce, FRAME)
    old = seal.ClientSeal(CREDS.data_key, b"worker:0", nonce, FRAME)
    recorded = _frames(old.seal(Header(MsgType.PULL, key=1).pack(), []))
    server.open(b"worker:0", recorded)
    new = seal.ClientSeal(CREDS.data_key, b"worker:0", nonce, FRAME)   # the process restarted
    server.open(b"worker:0", _frames(new.seal(Header(MsgType.PULL, key=2).pack(), [])))
    reply = _frames(server.seal(b"worker:0", Header(MsgType.ACK, key=2).pack(), []))
    assert new.open(reply)[0].key == 2
    with pytest.raises(seal.Refused, match="replayed"):
        server.open(b"worker:0", recorded)
    with pytest.raises(seal.Refused, match="no session"):
        server.seal(b"worker:5", Header(MsgType.ACK).pack(), [])


def test_a_token_admits_its_node_once_per_address_and_a_wrong_secrets_never():
    nonce = os.urandom(16)
    gate = auth.DataGate(CREDS, nonce)
    random = os.urandom(16)
    token = CREDS.token(b"worker:0", nonce, random)
    assert gate.admits(b"PLAIN", [b"worker:0", token], b"10.0.0.1")
    assert gate.admits(b"PLAIN", [b"worker:0", token], b"10.0.0.1")     # its reconnection
    assert not gate.admits(b"PLAIN", [b"worker:0", token], b"10.0.0.9")  # seen, replayed
    assert not gate.admits(b"PLAIN", [b"worker:1", token], b"10.0.0.1")  # another name
    assert not gate.admits(b"PLAIN", [b"worker:0", OTHER.token(b"worker:0", nonce, random)],
                           b"10.0.0.1")
    other_process = auth.DataGate(CREDS, os.urandom(16))
    assert not other_process.admits(b"PLAIN", [b"worker:0", token], b"10.0.0.1")
    assert not gate.admits(b"CURVE", [token], b"10.0.0.1")
    assert not gate.admits(b"PLAIN", [b"admin", CREDS.token(b"admin", nonce, random)],
                           b"10.0.0.1")


def test_a_gate_that_knows_the_job_refuses_names_beyond_it_naming_why():
    nonce = os.urandom(16)
    gate = auth.DataGate(CREDS, nonce, job={"worker": 2, "server": 3})

    def token(name):
        return CREDS.token(name, nonce, os.urandom(16))

    for name in (b"worker:0", b"worker:1", b"server:0", b"server:2"):
        assert gate.admits(b"PLAIN", [name, token(name)], b"10.0.0.1"), name
    for name in (b"worker:2", b"worker:100", b"server:3"):
        assert not gate.admits(b"PLAIN", [name, token(name)], b"10.0.0.1"), name
        assert gate.refusal == "it names %s, no node of this job (2 workers, 3 servers)" % (
            name.decode())
    assert not gate.admits(b"PLAIN", [b"worker:1", OTHER.token(b"worker:1", nonce,
                                                                os.urandom(16))], b"10.0.0.1")
    assert gate.refusal == auth.DataGate.BAD_TOKEN
    assert not gate.admits(b"CURVE", [b"x" * 32], b"10.0.0.1")
    assert gate.refusal == "it offered no name and token (mechanism CURVE)"
    # without the job's counts (a socket of its own, as the fuzzers bind) any rank is a name
    assert auth.DataGate(CREDS, nonce).admits(b"PLAIN", [b"worker:100", token(b"worker:100")],
                                              b"10.0.0.1")


def test_over_sockets_only_the_jobs_nodes_get_a_message_through():
    settings = tcp.Settings(CREDS)
    server, port, nonce = tcp.bind_data("127.0.0.1", settings, job={"worker": 1, "server": 1})
    socks = []
    try:
        values = np.arange(600000, dtype=np.float32)           # three frames
        # another secret; no secret; the job's secret as worker 1 of a job of one worker
        for creds, plain in ((OTHER, False), (None, True), (CREDS, False)):
            s = (tcp.connect_dealer("127.0.0.1", port, tcp.PLAIN, b"worker:1") if plain else
                 tcp.connect_data("127.0.0.1", port, tcp.Settings(creds), b"worker:1", nonce))
            socks.append(s)
            try:
                tcp.send(s, Header(MsgType.PULL, key=1), None, block=False)
            except tcp.QueueFull:
                pass                # the refused handshake closed its queue
        good = tcp.connect_data("127.0.0.1", port, settings, b"worker:0", nonce)
        socks.append(good)
        h = Header(MsgType.PUSH, key=3, length=values.size, dtype=F32)
        tcp.send(good, h, values)
        assert server.poll(10000)
        ident, got, payload = tcp.recv(server, with_ident=True)
        assert ident == b"worker:0" and got == h
        assert np.array_equal(np.frombuffer(payload.buffer, np.float32), values)
        tcp.send(server, got.reply(MsgType.ACK), None, ident=ident)
        assert good.poll(10000) and tcp.recv(good)[1].type == MsgType.ACK
        time.sleep(0.3)
        assert not server.poll(0), "a message of a node without the job's secret came through"
    finally:
        for s in socks:
            s.close(0)
        server.close(0)


# --------------------------------------------------------------------------------------------
# any bytes at all: only a WireError, and nothing is taken

@hsettings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=200), min_size=1, max_size=5), st.integers(0, 4))
def test_any_frames_at_a_server_or_a_client_raise_only_wire_error(frames, mutate):
    client, server, _ = _pair()
    real = client.seal(_push(8)[0].pack(), _parts(_push(8)[1]))
    raw = [bytes(memoryview(f).cast("B")) for f in real]
    # random frames, and the real message with one frame replaced by random bytes
    candidates = [frames, raw[:mutate % len(raw)] + frames[:1] + raw[mutate % len(raw) + 1:]]
    for cand in candidates:
        for open_ in (lambda f: server.open(b"worker:0", f), client.open):
            try:
                open_(_frames(cand))
            except wire_error:
                pass
    # none of it moved the session on: the real message still opens
    assert server.open(b"worker:0", _frames(raw))[0].key == 1


def test_once_the_jobs_nodes_are_known_a_strangers_message_is_refused_unopened():
    client, server, nonce = _pair(name=b"worker:7")
    h, values = _push(10)
    server.members = frozenset([b"worker:0", b"worker:1", b"server:0"])
    with pytest.raises(seal.Refused, match="b'worker:7' is not a node of this job") as e:
        server.open(b"worker:7", _frames(client.seal(h.pack(), _parts(values))))
    assert e.value.why == "stranger" and not server._sessions
    member, _, _ = _pair(name=b"worker:1", nonce=nonce)
    assert server.open(b"worker:1", _frames(member.seal(h.pack(), _parts(values))))[0] == h



def _reply(n):
    """A client, and a DATA reply of ``n`` float32 values sealed by the server it talks to."""
    client, server, _ = _pair()
    h, values = _push(n)
    server.open(b"worker:0", _frames(client.seal(h.pack(), _parts(values))))
    reply = h.reply(MsgType.DATA)
    return client, reply, values, server.seal(b"worker:0", reply.pack(), _parts(values))


@pytest.mark.parametrize("n", [3, 20000, 3 * FRAME // 4 + 5])
def test_a_reply_is_deciphered_into_the_buffer_land_gives_once_its_header_verifies(n):
    client, reply, values, sealed = _reply(n)
    target = np.zeros(4 * n, np.uint8)
    asked = []
    got_h, got_p = client.open(_frames(sealed),
                               land=lambda hh, nbytes: asked.append((hh, nbytes)) or target)
    assert got_h == reply and asked == [(reply, 4 * n)]
    assert np.frombuffer(got_p.buffer, np.float32).ctypes.data == target.ctypes.data
    assert np.array_equal(target.view(np.float32), values)


def test_a_forged_reply_is_refused_before_land_is_asked_or_after_and_never_handed_on():
    client, reply, values, sealed = _reply(3 * FRAME // 4 + 5)
    good = [bytes(memoryview(f).cast("B")) for f in sealed]
    asked = []

    def land(hh, nbytes):
        asked.append(hh)
        return np.zeros(nbytes, np.uint8)
    bad_header = [bytearray(f) for f in good]
    bad_header[0][seal.PREFIX + 10] ^= 1
    with pytest.raises(seal.Refused):
        client.open(_frames([bytes(f) for f in bad_header]), land=land)
    assert asked == []                      # an unverified header never names a buffer
    bad_part = [bytearray(f) for f in good]
    bad_part[2][50] ^= 1
    with pytest.raises(seal.Refused, match="does not verify"):
        client.open(_frames([bytes(f) for f in bad_part]), land=land)
    assert asked == [reply]
    # the session was not moved on: the real message still opens, into its buffer
    target = np.zeros(values.nbytes, np.uint8)
    got_h, _ = client.open(_frames(good), land=lambda hh, nb: target)
    assert got_h == reply and np.array_equal(target.view(np.float32), values)


def _read_only(n):
    a = np.zeros(n, np.uint8)
    a.flags.writeable = False
    return a


@pytest.mark.parametrize("target", [np.zeros(11, np.uint8), np.zeros(13, np.uint8),
                                    np.zeros(3, np.float32), np.zeros((2, 6), np.uint8),
                                    np.zeros(24, np.uint8)[::2], _read_only(12), None,
                                    "twelve bytes"],
                         ids=["short", "long", "float32", "2-d", "strided", "read-only",
                              "none", "str"])
def test_a_buffer_that_does_not_fit_the_payload_is_passed_over_for_its_own(target):
    client, reply, values, sealed = _reply(3)                  # 12 bytes
    got_h, got_p = client.open(_frames(sealed), land=lambda hh, nbytes: target)
    assert got_h == reply
    assert np.array_equal(np.frombuffer(got_p.buffer, np.float32), values)
    if isinstance(target, np.ndarray):
        assert not target.any()
