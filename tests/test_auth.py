"""The job secret: only the job's nodes get in, ranks belong to connections, garbage never kills.

The live part is one real 2 x 2 job on loopback (tests/jobs/train_job.py) with MXPS_SECRET set,
attacked while it runs:
- from its start, a process *without* the secret and one with a *wrong* secret try to REGISTER
  as a worker and as a server (the slots are open: the real workers are still importing MXNet);
- once the rendezvous is done, the same two try every entry point of the scheduler (REGISTER,
  BARRIER, HEARTBEAT, BANDWIDTH, REPLAN, FINISH, ABORT) and of both servers (INIT, PUSH, PULL,
  PUSHPULL, SET_OPTIMIZER, GET_STATES, SET_STATES, PROBE, MIGRATE) with the identity of worker
  0 / server 1, the pickles carrying a payload that would create a directory if unpickled;
- a real worker process with a wrong secret and one without a secret try to join;
- a peer *with* the secret sends malformed messages (bad frames, headers, bodies, identities,
  a frame over the transport's bound) to the scheduler and both servers.
The job must train to the weights of the same job without a secret (bit for bit: two workers'
sums do not depend on arrival order), the rogues must get nothing back, the refusing nodes must
log the rogues' addresses (each rogue connects from its own loopback address), the wrong
workers must fail within seconds saying why, and the nodes must log the malformed messages as
dropped.  Transport-level checks of the same (one process) are in tests/test_wire.py.
"""
import json
import os
import pickle
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pytest
import zmq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cluster  # noqa: E402
from cluster import train_env  # noqa: E402
from mxps import config  # noqa: E402
from mxps.wire import auth, frame as wire, tcp  # noqa: E402
from mxps.wire.frame import Header, MsgType  # noqa: E402
from mxps_tools import cli, jobs as runner  # noqa: E402

SECRET = "job-secret-" + secrets.token_hex(16)
WRONG = "other-secret-" + secrets.token_hex(16)
START_TIMEOUT = 150          # seconds for the job's nodes to import MXNet and meet
JOB_ENV = dict(train_env("mxps", update_on_kvstore=True))   # the reference run's settings
# rank 0's gradients of step 3 come 15 s late: the job is surely still training while the
# rogues try every entry point (checked, not assumed: see attacked_job)
DELAY = "0:3:15"
# each rogue connects from its own loopback address, so the logs can be checked for it
ROGUE_ADDR = {"plain": "127.0.0.21", "wrong": "127.0.0.22", "garbage": "127.0.0.23"}
#: network namespaces: root (tests/conftest.py fails the test without it, naming why)
NEEDS_ROOT = pytest.mark.netns


class _Bomb:
    """Unpickling this creates the directory ``path``: proof that a pickle was executed."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


# --------------------------------------------------------------------------------------------
# the settings

def _cfg(**env):
    base = {"DMLC_ROLE": "worker", "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9000",
            "DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "1"}
    base.update(env)
    return config.from_env(base)


def test_secret_from_mxps_secret_is_bytes_and_never_in_the_config_repr():
    cfg = _cfg(MXPS_SECRET=SECRET)
    assert cfg.secret == SECRET.encode()
    assert SECRET not in repr(cfg) and SECRET not in str(cfg)


def test_no_secret_means_an_unauthenticated_job():
    assert _cfg().secret == b""
    assert not tcp.Settings.from_config(_cfg()).authenticated


def test_secret_file_contents_are_read_and_stripped(tmp_path):
    path = tmp_path / "secret"
    path.write_text("\n  %s \n" % SECRET)
    assert _cfg(MXPS_SECRET_FILE=str(path)).secret == SECRET.encode()


def test_unreadable_secret_file_is_refused_naming_the_variable_and_path(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(config.ConfigError, match="MXPS_SECRET_FILE=%s cannot be read"
                       % re.escape(missing)):
        _cfg(MXPS_SECRET_FILE=missing)


def test_empty_secret_file_is_refused_naming_the_variable(tmp_path):
    path = tmp_path / "empty"
    path.write_text(" \n")
    with pytest.raises(config.ConfigError, match="MXPS_SECRET_FILE=.* is empty"):
        _cfg(MXPS_SECRET_FILE=str(path))


def test_both_secret_variables_set_is_refused(tmp_path):
    path = tmp_path / "secret"
    path.write_text(SECRET)
    with pytest.raises(config.ConfigError, match="MXPS_SECRET and MXPS_SECRET_FILE are both"):
        _cfg(MXPS_SECRET=SECRET, MXPS_SECRET_FILE=str(path))


def test_short_secret_is_refused_naming_the_variable_and_how_to_make_one():
    with pytest.raises(config.ConfigError, match="MXPS_SECRET: .* at least 16 .*secrets"):
        _cfg(MXPS_SECRET="short")


def test_nodes_with_one_secret_derive_the_same_keys_and_another_secret_other_keys():
    a, b, c = (auth.Credentials(s.encode()) for s in (SECRET, SECRET, WRONG))
    assert (a.server_public, a.client_public) == (b.server_public, b.client_public)
    assert a.server_public != c.server_public and a.client_public != c.client_public
    assert a.server_public != a.client_public
    assert SECRET not in repr(a)


def test_node_with_a_secret_fails_fast_at_a_scheduler_without_one_saying_which_setting():
    from mxps.roles.link import CredentialsRefused, SchedulerLink
    router, port = tcp.bind_router("127.0.0.1", None, tcp.PLAIN, who="plain-scheduler")
    link = SchedulerLink(_cfg(DMLC_PS_ROOT_PORT=str(port), MXPS_SECRET=SECRET,
                              MXPS_START_TIMEOUT="200"), "worker")
    started = time.monotonic()
    try:
        with pytest.raises(CredentialsRefused, match="did not accept this node's credentials.*"
                           "MXPS_SECRET differs.*runs without a secret"):
            link.register("127.0.0.1")
        assert time.monotonic() - started < 5
        assert not router.poll(0), "the plain scheduler got a message from the CURVE node"
    finally:
        link.close()
        router.close(0)


def test_registering_node_heartbeats_and_gives_up_on_a_scheduler_that_falls_silent():
    from mxps.roles.link import PeerLostError, SchedulerLink
    sched = zmq.Context.instance().socket(zmq.ROUTER)
    port = sched.bind_to_random_port("tcp://127.0.0.1")
    link = SchedulerLink(_cfg(DMLC_PS_ROOT_PORT=str(port), MXPS_HEARTBEAT_INTERVAL="0.2",
                              MXPS_HEARTBEAT_TIMEOUT="1"), "server")
    seen = []

    def fake_scheduler():                 # answers three heartbeats, then nothing
        while len(seen) < 4 and sched.poll(5000):
            ident, header, *body = sched.recv_multipart()
            seen.append((wire.unpack(header).type, body))
            if seen[-1][0] == MsgType.HEARTBEAT:
                sched.send_multipart([ident, Header(MsgType.HEARTBEAT).pack()])

    t = threading.Thread(target=fake_scheduler)
    t.start()
    started = time.monotonic()
    try:
        with pytest.raises(PeerLostError, match="lost the scheduler at 127.0.0.1:%d during "
                           "start-up.*MXPS_HEARTBEAT_TIMEOUT=1" % port):
            link.register("127.0.0.1", 5)
        took = time.monotonic() - started
        assert 0.6 + 1.0 <= took < 5, took
    finally:
        t.join(10)
        link.close()
        sched.close(0)
    assert seen[0][0] == MsgType.REGISTER and json.loads(seen[0][1][0])["start_heartbeats"]
    assert [t for t, _ in seen[1:]] == [MsgType.HEARTBEAT] * 3


# --------------------------------------------------------------------------------------------
# connections bound to ranks (the server loop's binding, in one process)

def test_push_claiming_another_rank_counts_for_the_rank_of_its_connection():
    from mxps.roles.server import authenticate
    from mxps.roles.server_state import ServerState
    state = ServerState(0, num_workers=2, sync=True)
    init = Header(MsgType.INIT, key=3, length=4, dtype=wire.dtype_code(np.float32))
    authenticate(b"worker:0", init, 2, 1)
    assert state.on_request(b"worker:0", init, np.ones(4, np.float32).tobytes())[0].header.type \
        == MsgType.ACK
    # the outsider's trick: two pushes on one connection, claiming two different ranks
    replies = []
    for claimed in (100, 1):
        h = Header(MsgType.PUSH, key=3, sender=claimed, iteration=1, length=4,
                   dtype=wire.dtype_code(np.float32))
        authenticate(b"worker:0", h, 2, 1)
        assert h.sender == 0
        replies += state.on_request(b"worker:0", h, np.full(4, 0.5, np.float32).tobytes())
    assert [r.header.type for r in replies] == [MsgType.ACK, MsgType.ERROR], replies
    assert b"worker 0" in bytes(replies[1].payload)
    # the round is not complete: a pull of round 1 waits (no reply) ...
    pull = Header(MsgType.PULL, key=3, iteration=1, length=4)
    authenticate(b"worker:1", pull, 2, 1)
    assert state.on_request(b"worker:1", pull, None) == []
    # ... until worker 1 pushes on its own connection: then the sum of the two real pushes
    h = Header(MsgType.PUSH, key=3, sender=0, iteration=1, length=4,
               dtype=wire.dtype_code(np.float32))
    authenticate(b"worker:1", h, 2, 1)
    outs = state.on_request(b"worker:1", h, np.full(4, 0.25, np.float32).tobytes())
    data = [o for o in outs if o.header.type == MsgType.DATA]
    assert len(data) == 1 and data[0].dest == b"worker:1"
    np.testing.assert_array_equal(np.frombuffer(bytes(data[0].payload), np.float32),
                                  np.full(4, 0.75, np.float32))


@pytest.mark.parametrize("ident", [b"", b"\x00k\x8b\x45\x67", b"worker:2", b"server:1",
                                   b"worker:01", b"worker:-1", b"admin:0", b"worker:0\n",
                                   b"worker:99999999999"])
def test_connection_whose_identity_names_no_node_of_the_job_is_refused_without_a_reply(ident):
    from mxps.roles.server import Refused, authenticate
    h = Header(MsgType.PUSH, sender=0)
    with pytest.raises(Refused) as e:
        authenticate(ident, h, 2, 1)
    assert not e.value.reply and h.sender == 0


@pytest.mark.parametrize("ident,mtype", [(b"worker:1", MsgType.MIGRATE),
                                         (b"worker:0", MsgType.REGISTER),
                                         (b"server:0", MsgType.PUSH),
                                         (b"server:1", MsgType.SET_OPTIMIZER)])
def test_message_type_the_role_does_not_send_is_refused_with_an_error_naming_both(ident, mtype):
    from mxps.roles.server import Refused, authenticate
    with pytest.raises(Refused, match="%s may not send %s" % (
            ident.decode().replace(":", " "), mtype.name)) as e:
        authenticate(ident, Header(mtype), 2, 2)
    assert e.value.reply


def test_every_message_type_a_worker_or_server_sends_passes_with_its_rank():
    from mxps.roles.server import ALLOWED, authenticate
    for role, types in ALLOWED.items():
        for t in types:
            h = Header(t, sender=7)
            assert authenticate(b"%s:1" % role.encode(), h, 2, 2) == role
            assert h.sender == 1


# --------------------------------------------------------------------------------------------
# the worker's I/O thread and its scheduler link survive garbage (a fake scheduler and server)

def _send_raw(sock, ident, *frames):
    sock.send_multipart([ident] + list(frames))


def test_worker_io_thread_and_link_drop_garbage_and_keep_working():
    from mxps.roles.worker import Client
    ctx = zmq.Context.instance()
    sched, srv = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
    sport = sched.bind_to_random_port("tcp://127.0.0.1")
    vport = srv.bind_to_random_port("tcp://127.0.0.1")
    cfg = _cfg(DMLC_PS_ROOT_PORT=str(sport), DMLC_NODE_HOST="127.0.0.1", MXPS_TIMEOUT="600",
               MXPS_HEARTBEAT_TIMEOUT="600")
    welcome = {"rank": 0, "role": "worker", "servers": [["127.0.0.1", vport]], "num_workers": 1,
               "num_servers": 1, "mode": "sync"}

    def fake_scheduler():
        ident = sched.recv_multipart()[0]                  # the REGISTER
        _send_raw(sched, ident, b"abc")                     # not a header
        _send_raw(sched, ident, Header(MsgType.WELCOME).pack(), b"{not json")
        _send_raw(sched, ident, Header(MsgType.WELCOME).pack(), b'{"rank": 0}')
        _send_raw(sched, ident, Header(MsgType.WELCOME).pack(), b"1", b"2")
        _send_raw(sched, ident, Header(MsgType.WELCOME).pack(), json.dumps(welcome).encode())
        return ident

    box = {}
    t = threading.Thread(target=lambda: box.setdefault("ident", fake_scheduler()))
    t.start()
    client = Client(cfg)
    t.join(10)
    try:
        assert client.rank == 0
        assert client.link.drops.counts["malformed"] == 4
        ident = box["ident"]
        # garbage on the link after registration: bodies that do not parse
        for mtype, body in ((MsgType.BANDWIDTH, b"\xff"), (MsgType.BANDWIDTH, b'{"rates": [0]}'),
                            (MsgType.REPLAN, b"[1, 2]"), (MsgType.REPLAN, None)):
            _send_raw(sched, ident, Header(mtype).pack(), *([] if body is None else [body]))
        # a request to the fake server, answered with garbage first
        done = threading.Event()
        got = {}

        def on_reply(h, payload):
            got["value"] = wire.payload_array(h, payload).copy()   # raises on a bad size
            done.set()

        client.submit(0, Header(MsgType.PULL, key=5, length=3), None, on_reply)
        frames = srv.recv_multipart()
        assert frames[0] == b"worker:0"                    # the connection carries the rank
        req = wire.unpack(frames[1])
        data = req.reply(MsgType.DATA, dtype=wire.dtype_code(np.float32))
        for junk in ([b"xyz"], [data.pack(), b"a", b"b"],
                     [Header(MsgType.DATA, request_id=req.request_id + 99).pack()],
                     [req.reply(MsgType.PUSH).pack()],
                     [data.pack(), np.ones(2, np.float32).tobytes()]):   # wrong size
            _send_raw(srv, frames[0], *junk)
        assert not done.wait(1.0), "a malformed reply completed the request"
        _send_raw(srv, frames[0], data.pack(), np.arange(3, dtype=np.float32).tobytes())
        assert done.wait(10), "the I/O thread did not survive the garbage"
        np.testing.assert_array_equal(got["value"], [0, 1, 2])
        assert client.link.bandwidth is None and client.link.replan is None
        assert client.link.drops.total() == 4 + 4
        # the reply of the wrong size is refused before its callback sees it
        assert dict(client.drops.counts) == {"malformed": 2, "unexpected": 2, "mismatch": 1}
    finally:
        client._stopped.set()
        client._thread.join(10)
        sched.close(0)
        srv.close(0)


# --------------------------------------------------------------------------------------------
# the attacked job

def _rogue(kind, ident=None, nonce=None):
    """A DEALER without the secret ("plain") or with a wrong one ("wrong"), or with the job's
    ("garbage"), connecting from its own loopback address.  To the scheduler (``nonce`` None)
    the secret is CURVE's; to a server (``nonce``: its data-plane nonce, which is public) it
    is the data plane's token and seal, so a wrong secret makes a token the server refuses."""
    settings = {"plain": tcp.PLAIN, "wrong": tcp.Settings(auth.Credentials(WRONG.encode())),
                "garbage": tcp.Settings(auth.Credentials(SECRET.encode()))}[kind]
    if nonce is None or kind == "plain":
        sock = tcp.new_dealer(settings, ident)
    else:
        sock = tcp.new_data_dealer(settings, ident or b"worker:7", nonce)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


def _connect_from(sock, kind, port):
    sock.connect("tcp://%s:0;127.0.0.1:%d" % (ROGUE_ADDR[kind], port))
    return sock


def _entry_points(marker):
    """(target, identity, header, payload) of every entry point; the pickled payloads would
    create ``marker`` if unpickled."""
    bomb = pickle.dumps(_Bomb(marker))
    f32 = wire.dtype_code(np.float32)
    ones = np.ones(4, np.float32).tobytes()
    register = json.dumps({"role": "worker", "host": "127.0.0.1", "port": 0, "pid": 999999,
                           "mode": "sync"}).encode()
    sched = [(MsgType.REGISTER, register), (MsgType.BARRIER, None), (MsgType.HEARTBEAT, None),
             (MsgType.BANDWIDTH, b'{"seconds": [1], "bytes": [1]}'),
             (MsgType.REPLAN, b'{"round": 1}'), (MsgType.FINISH, None), (MsgType.BYE, None),
             (MsgType.ABORT, b"a rogue says the job is over")]
    server = [(MsgType.INIT, ones, dict(dtype=f32, length=4)),
              (MsgType.PUSH, ones, dict(dtype=f32, length=4, iteration=1)),
              (MsgType.PULL, None, dict(length=4, iteration=1)),
              (MsgType.PUSHPULL, ones, dict(dtype=f32, length=4, iteration=1)),
              (MsgType.SET_OPTIMIZER, bomb, {}), (MsgType.GET_STATES, None, {}),
              (MsgType.SET_STATES, bomb, {}), (MsgType.PROBE, bytes(1024), {}),
              (MsgType.MIGRATE, bomb, dict(plan_version=1))]
    points = [("sched", None, Header(t), body) for t, body in sched]
    for s in ("s0", "s1"):
        for t, body, fields in server:
            ident = b"server:1" if t == MsgType.MIGRATE else b"worker:0"
            points.append((s, ident, Header(t, key=0, **fields), body))
    return points


def _rogue_send(sock, header, body=None):
    """Queue one message on a rogue's socket without waiting.  A refused handshake can leave
    the socket's queue closed (ZeroMQ's EAGAIN: ``QueueFull``): the message then never leaves
    the rogue, which is the gate working, so it is not an error of the test."""
    try:
        tcp.send(sock, header, body, block=False)
    except tcp.QueueFull:
        pass


def _attack(ports, nonces, marker):
    """Both rogues try every entry point, one connection each; how many of each kind's got
    any answer."""
    socks = []
    for kind in ("plain", "wrong"):
        for target, ident, h, body in _entry_points(marker):
            sock = _connect_from(_rogue(kind, ident, nonces.get(target)), kind, ports[target])
            _rogue_send(sock, h, body)
            socks.append((kind, sock))
    answered = {"plain": 0, "wrong": 0}
    deadline = time.monotonic() + 2.0
    for kind, sock in socks:
        if sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            answered[kind] += 1
        sock.close(0)
    return answered


def _until_logged(job, node, kind, port, nonce, tries=20):
    """Connect as the rogue ``kind`` until ``node`` has logged a refusal naming its address.
    (The address of a refused connection is read when the gatekeeper's thread sees it accepted;
    a connection refused faster than that is logged as "an unknown address": docs/SECURITY.md.)
    Returns how many more connections it took."""
    line = "refused a connection from %s:" % ROGUE_ADDR[kind]
    for extra in range(tries):
        if line in job.node(node).read("err"):
            return extra
        sock = _connect_from(_rogue(kind, None, nonce), kind, port)
        _rogue_send(sock, Header(MsgType.HEARTBEAT))
        time.sleep(0.3)
        sock.close(0)
    return tries


def _garbage(ports, nonces):
    """Malformed messages from a peer that has the secret; the nodes must drop them.  To a
    server, ``raw`` frames are not sealed (refused by the seal) and ``sealed`` ones are.  A
    server's handshake admits only the names of the job's nodes: the garbage goes under names
    of this job that no node uses here (servers connect to each other only to move state,
    which this job never does), one connection per name and server (zmq refuses a second
    connection under a name in use), and one name beyond the job is refused in the handshake."""
    socks = {}

    def sock_for(target, ident):
        if target == "sched" or (target, ident) not in socks:
            sock = _connect_from(_rogue("garbage", ident, nonces.get(target)), "garbage",
                                 ports[target])
            socks[(target, ident) if target != "sched" else len(socks)] = sock
            return sock
        return socks[(target, ident)]

    def raw(target, ident, *frames):
        sock_for(target, ident).send_multipart(list(frames))

    def sealed(target, ident, header, payload=None):
        tcp.send(sock_for(target, ident), header, payload)

    bad_magic = b"XXXX" + Header(MsgType.PUSH).pack()[4:]
    for target, ident in (("sched", None), ("s0", b"server:1"), ("s1", b"server:1")):
        raw(target, ident, b"\x01\x02\x03")                       # a 3-byte frame
        raw(target, ident, bad_magic)
        raw(target, ident, Header(MsgType.PULL).pack(), b"x", b"y")  # three frames
    raw("sched", None, Header(MsgType.REGISTER).pack(), b"\xff\xfe not json")
    raw("sched", None, Header(MsgType.REGISTER).pack(), b"[1, 2, 3]")
    raw("sched", None, Header(MsgType.REGISTER).pack())            # no body at all
    sealed("s0", b"worker:8", Header(MsgType.PULL, key=0, length=4))   # no such worker
    sealed("s1", b"server:0", Header(MsgType.PUSH, key=0))     # a server may not push
    sealed("s1", b"server:1", Header(MsgType.MIGRATE, key=0, plan_version=99), b"\x00 not a part")
    # a frame over the bound: zmq drops the connection (last on it)
    raw("s0", b"server:1", Header(MsgType.PUSH, key=0).pack(), bytes(2 * tcp.FRAME_BYTES))
    for sock in socks.values():
        sock.close(linger=10000)   # zmq delivers what is queued, then closes


def _start_rogue_worker(job, secret, log_dir, name):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "MXPS_"))}
    env.update(runner.QUIET_ENV)
    env.update(JOB_ENV)
    env.update(runner.dmlc_env("worker", runner.LOOPBACK, job.port, 2, 2, runner.LOOPBACK, "lo"))
    env.update(JOB_OUT=os.path.join(log_dir, name), MXPS_START_TIMEOUT="200")
    if secret:
        env["MXPS_SECRET"] = secret
    with open(os.path.join(log_dir, name + ".err"), "wb") as err:
        proc = subprocess.Popen([sys.executable, cluster.TRAIN_JOB], env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                start_new_session=True)
    return proc, time.monotonic()


@pytest.fixture(scope="module")
def attacked_job():
    log_dir = tempfile.mkdtemp(prefix="mxps-auth-")
    out = os.path.join(log_dir, "out")
    marker = os.path.join(log_dir, "pickle-was-executed")
    env = dict(JOB_ENV, JOB_OUT=out, JOB_DELAY=DELAY, MXPS_SECRET=SECRET)
    found = {"marker": marker, "log_dir": log_dir, "out": out}
    rogue_workers = []
    try:
        with runner.Job([cluster.TRAIN_JOB], 2, 2, env=env, log_dir=log_dir,
                        cpu_interval=None, timeout=START_TIMEOUT + 120) as job:
            # at once: rogues ask for the open slots (the real workers are importing MXNet)
            registers = {}
            for kind in ("plain", "wrong"):
                for role in ("worker", "server"):
                    sock = _connect_from(_rogue(kind), kind, job.port)
                    _rogue_send(sock, Header(MsgType.REGISTER), json.dumps(
                        {"role": role, "host": ROGUE_ADDR[kind], "port": 1, "pid": 999999,
                         "mode": "sync"}).encode())
                    registers[(kind, role)] = sock
            rogue_workers = [(name,) + _start_rogue_worker(job, secret, log_dir, name)
                             for name, secret in (("rogue-wrong", WRONG), ("rogue-none", ""))]
            job.wait(lambda: (job.job_info() or {}).get("workers"), START_TIMEOUT,
                     "the rendezvous")
            info = job.job_info()
            found["register_answers"] = {k: s.poll(0) for k, s in registers.items()}
            for s in registers.values():
                s.close(0)
            ports = {"sched": job.port}
            ports.update((job.by_pid(s["pid"]).name, s["port"]) for s in info["servers"])
            # the servers' data-plane nonces (public: the scheduler's job facts carry them)
            nonces = {job.by_pid(s["pid"]).name: bytes.fromhex(s["seal"])
                      for s in info["servers"]}
            found["answered"] = _attack(ports, nonces, marker)
            _garbage(ports, nonces)
            found["extra_tries"] = {(node, kind): _until_logged(job, node, kind, port,
                                                                nonces.get(node))
                                    for node, port in ports.items()
                                    for kind in ("plain", "wrong")}
            job.poll()
            found["alive_after_attacks"] = [n.name for n in job.nodes if n.returncode is None]
            found["info"] = info
            found["pids"] = {n.name: n.pid for n in job.nodes}
            for name, proc, started in rogue_workers:
                try:
                    proc.wait(START_TIMEOUT)
                except subprocess.TimeoutExpired:
                    pass
                found[name] = (proc.poll(), time.monotonic() - started)
            job.wait(job.all_exited, START_TIMEOUT, "the end of the attacked job")
            found["result"] = job.result
    finally:
        for _, proc, _ in rogue_workers:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    found["logs"] = {name: open(os.path.join(log_dir, name + ".err"), errors="replace").read()
                     for name in ("sched", "s0", "s1", "rogue-wrong", "rogue-none")}
    yield found
    shutil.rmtree(log_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same job without a secret (shared with test_equivalence through the cache)."""
    return cluster.job_cache(tmp_path_factory).train(JOB_ENV, 2, 2)


def test_attacked_job_with_a_secret_finishes(attacked_job):
    res = attacked_job["result"]
    assert res.ok, res.describe(tails="all")
    # the attacks happened while every node was still running
    assert sorted(attacked_job["alive_after_attacks"]) == ["s0", "s1", "sched", "w0", "w1"], \
        res.describe()


def test_job_with_a_secret_trains_to_the_weights_of_the_job_without(attacked_job, reference):
    got = cluster.assert_synchronised(attacked_job["out"], 2)
    ref = cluster.assert_synchronised(reference.out_dir, 2)
    for k in ref:
        assert np.array_equal(got[k], ref[k]), "%s differs (max abs %.3e)" % (
            k, float(np.max(np.abs(got[k] - ref[k]))))


def test_registration_slots_go_only_to_the_jobs_own_nodes(attacked_job):
    info, pids = attacked_job["info"], attacked_job["pids"]
    assert sorted(w["pid"] for w in info["workers"]) == sorted([pids["w0"], pids["w1"]])
    assert sorted(s["pid"] for s in info["servers"]) == sorted([pids["s0"], pids["s1"]])
    assert not any(attacked_job["register_answers"].values()), attacked_job["register_answers"]


@pytest.mark.parametrize("kind", ["plain", "wrong"])
def test_rogue_gets_no_answer_from_any_entry_point(attacked_job, kind):
    assert attacked_job["answered"][kind] == 0


@pytest.mark.parametrize("node", ["sched", "s0", "s1"])
@pytest.mark.parametrize("kind,why", [("plain", "no MXPS_SECRET"),
                                      ("wrong", "a different MXPS_SECRET")])
def test_refused_connections_are_logged_with_the_rogues_address(attacked_job, node, kind, why):
    assert attacked_job["extra_tries"][(node, kind)] < 20
    lines = [line for line in attacked_job["logs"][node].splitlines()
             if "refused a connection from %s:" % ROGUE_ADDR[kind] in line]
    assert any(why in line for line in lines), attacked_job["logs"][node][-3000:]


def test_crafted_pickle_from_a_rogue_never_executes(attacked_job):
    assert not os.path.exists(attacked_job["marker"])


@pytest.mark.parametrize("name,says", [
    ("rogue-wrong", "did not accept this node's credentials .*MXPS_SECRET differs"),
    ("rogue-none", "requires a job secret and this node has none")])
def test_worker_with_a_wrong_or_no_secret_fails_fast_saying_why(attacked_job, name, says):
    rc, seconds = attacked_job[name]
    err = attacked_job["logs"][name]
    assert rc not in (0, None), (rc, err[-2000:])
    found = re.search(r"scheduler at 127\.0\.0\.1:\d+ .*?\(\d+ failed handshakes? within "
                      r"([0-9.]+) s\)", err)
    assert found and re.search(says, err), err[-2000:]
    assert float(found.group(1)) < 5.0
    assert seconds < 100, "took %.0f s (MXPS_START_TIMEOUT=200)" % seconds


@pytest.mark.parametrize("node,what", [
    ("sched", "dropped a malformed message"),
    ("sched", "dropped .*REGISTER"),       # a body that does not parse
    ("s0", "dropped a malformed message"), ("s1", "dropped a malformed message"),
    ("s0", r"refused a connection from 127\.0\.0\.23: it names worker:8, no node of this job "
           r"\(2 workers, 2 servers\)"),
    ("s1", "server 0 may not send PUSH")])
def test_garbage_from_a_node_with_the_secret_is_dropped_and_logged(attacked_job, node, what):
    assert re.search(what, attacked_job["logs"][node]), attacked_job["logs"][node][-3000:]


# --------------------------------------------------------------------------------------------
# the warning for a job without a secret

_BIND = ("import os, sys\n"
         "from mxps.wire import auth, tcp\n"
         "secret = os.environ.get('MXPS_SECRET', '').encode()\n"
         "settings = tcp.Settings(auth.Credentials(secret)) if secret else tcp.PLAIN\n"
         "for _ in range(2):\n"
         "    sock, port = tcp.bind_router(sys.argv[1], None, settings, who='server')\n"
         "    sock.close(0)\n")


def test_no_warning_when_listening_on_loopback_without_a_secret():
    done = cluster.run_single(["-c", _BIND, "127.0.0.1"])
    assert "WARNING" not in done.stderr, done.stderr


@NEEDS_ROOT
def test_listening_beyond_loopback_without_a_secret_warns_once_saying_how_to_set_one():
    from mxps_tools import emunet
    emunet.cleanup_stale()
    with emunet.Topology(["node"]) as topo:
        addr = topo.addr("node")
        runs = {}
        for secret in ("", SECRET):
            env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "MXPS_"))}
            if secret:
                env["MXPS_SECRET"] = secret
            p = topo.popen("node", [sys.executable, "-c", _BIND, addr], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            _, err = p.communicate(timeout=120)
            runs[bool(secret)] = (p.returncode, err.decode(errors="replace"))
    rc, err = runs[False]
    assert rc == 0, err
    assert err.count("WITHOUT A JOB SECRET") == 1, err
    assert "server listens on %s:" % addr in err and "export MXPS_SECRET=" in err, err
    assert "MXPS_SECRET_FILE=/path" in err and "--launcher ssh" in err, err
    rc, err = runs[True]
    assert rc == 0 and "WARNING" not in err, err


# --------------------------------------------------------------------------------------------
# mxps launch makes a secret per job

_RECORD = """
import json, os, sys, time
secret = os.environ.get("MXPS_SECRET", "")
on_argv = []
pid = os.getpid()
while pid > 1:                       # this process and every ancestor up to init
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            if secret and secret.encode() in f.read():
                on_argv.append(pid)
        with open("/proc/%d/stat" % pid) as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        break
role = os.environ.get("DMLC_ROLE")
path = os.path.join(sys.argv[1], "%s-%d.json" % (role, os.getpid()))
with open(path + ".tmp", "w") as f:
    json.dump({"secret": secret, "on_argv": on_argv}, f)
os.replace(path + ".tmp", path)
# MXNet's launcher lives as long as the scheduler: it waits for the others' records
nodes = 1 + int(os.environ["DMLC_NUM_SERVER"]) + int(os.environ["DMLC_NUM_WORKER"])
deadline = time.monotonic() + 120
while role == "scheduler" and time.monotonic() < deadline and \
        sum(n.endswith(".json") for n in os.listdir(sys.argv[1])) < nodes:
    time.sleep(0.05)
"""


def test_launch_env_keeps_a_secret_the_user_set():
    assert cli.launch_env({"MXPS_SECRET": SECRET})["MXPS_SECRET"] == SECRET
    env = cli.launch_env({"MXPS_SECRET_FILE": "/some/file"})
    assert "MXPS_SECRET" not in env and env["MXPS_SECRET_FILE"] == "/some/file"


@NEEDS_ROOT
def test_mxps_launch_gives_each_job_a_fresh_secret_in_the_environment_never_on_argv(tmp_path):
    script = tmp_path / "record.py"
    script.write_text(_RECORD)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "MXPS_"))}
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    seen = []
    for run in range(2):
        out = tmp_path / ("run%d" % run)
        out.mkdir()
        argv = [sys.executable, "-m", "mxps_tools.cli", "launch", "-n", "1", "-s", "1", "--",
                "python", str(script), str(out)]
        p = subprocess.run(argv, env=env, cwd=str(tmp_path), capture_output=True, timeout=180)
        assert p.returncode == 0, p.stderr.decode(errors="replace")[-3000:]
        records = [json.loads(f.read_text()) for f in out.iterdir()]
        roles = sorted(f.name.split("-")[0] for f in out.iterdir())
        assert roles == ["scheduler", "server", "worker"], roles
        assert len({r["secret"] for r in records}) == 1
        secret = records[0]["secret"]
        assert re.fullmatch("[0-9a-f]{64}", secret), secret
        assert not any(r["on_argv"] for r in records), records
        seen.append(secret)
    assert seen[0] != seen[1]
