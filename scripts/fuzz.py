#!/usr/bin/env python3
"""Live fuzzer: garbage at a running mxps job's scheduler and servers while it trains.

Garbage never kills: a real 2 x 2 job (tests/jobs/train_job.py, SGD with
the optimizer on the servers, the job secret set) trains while a fuzzer process sends random,
mutated, truncated and oversized messages to the scheduler's port and every server's port, in
two modes, one after the other:

- ``plain``: without the secret, as raw TCP (what anyone on the network can do): ZMTP
  greetings of the NULL mechanism (an mxps node without a secret) followed by mxps frames,
  greetings claiming CURVE followed by garbage handshakes, mutated and truncated greetings,
  frame headers claiming huge frames, plain random bytes; many connections.
- ``outsider``: with the job's secret (the scheduler's CURVE handshake passes; at a server the
  data plane's handshake refuses the name, ``worker:7``, beyond the job's ranks, though its
  token is valid) but a connection identity that is no node of the job
  (``fuzz:<n>``, ``worker:7``, ``server:01``, zmq's own random one):
  mxps messages of every type in their valid form and mutated (header fields, bit flips,
  payload cut or grown, frames dropped, added or split), truncated headers, random frames,
  frames over the transport's 1 MiB bound and payloads in several frames.  Pickled payloads
  would create a marker directory if anything unpickled them.

The job must finish (exit 0 everywhere) with the weights of an unfuzzed run of the same
configuration (same seed), compared to 1e-6 relative per parameter, having trained while the
fuzzer ran (steps are timed from the workers' results).  Printed: frames per target and mode,
the job's result, the weights check, what the nodes logged (drops, refusals, tracebacks).

    python scripts/fuzz.py                          # the full run (docs/ROBUSTNESS.md)
    python scripts/fuzz.py --frames 5000 --steps 1500 --json out.json   # bounded (CI)
    python scripts/fuzz.py attack --mode outsider --secret-file F \\
        --target sched=127.0.0.1:9000 --target s0=127.0.0.1:20001 --frames 1000

The ``attack`` command is the fuzzer process alone (the run starts one per mode).  Traffic goes
to loopback only.
"""
import argparse
import json
import os
import pickle
import random
import re
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TRAIN_JOB = os.path.join(REPO, "tests", "jobs", "train_job.py")
MODES = ("plain", "outsider")
DEFAULT_FRAMES = 100_000
DEFAULT_STEPS = 12000
RTOL = 1e-6
KINDS = ("random", "mutated", "truncated", "oversized", "valid")


# =========================================================================== the fuzzer process

class Bomb:
    """Unpickling this creates the directory ``path``: proof that a pickle was executed."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


class Corpus:
    """Valid mxps messages (lists of frames) for a target, and ways to break them.

    Built from the runtime's own wire modules (``mxps.wire``), so the messages are what real
    nodes send; everything is seeded."""

    def __init__(self, rng, marker, wire, typed, frame_bytes):
        self.rng = rng
        self.wire = wire
        self.frame_bytes = frame_bytes
        H, T = wire.Header, wire.MsgType
        f32 = wire.dtype_code("float32")
        ones = struct.pack("<4f", 1, 1, 1, 1)
        bomb = pickle.dumps(Bomb(marker))
        import numpy as np
        part = typed.pack({"key": 0, "target": 0, "offset": 0, "length": 4, "dtype": f32,
                           "value": np.ones(4, np.float32), "applied": 1})
        states = typed.pack({"states": {(0, 0): np.zeros(4, np.float32)}, "counts": {0: 1},
                             "num_update": 1})
        register = {"role": "worker", "host": "127.0.0.1", "port": 1, "pid": 99999,
                    "mode": "sync", "start_heartbeats": True}
        replan = {"round": 3, "traffic": {"2": [[4096, 0.01], [4096, 0.01]]}, "full": True,
                  "force": 0, "min_slice": 16, "max_chunk": 0, "min_gain": 0.05, "horizon": 20,
                  "keys": [[0, 2048], [1, 32]], "table": {"0": [[0, 0, 2048]], "1": [[1, 0, 32]]}}

        def j(x):
            return json.dumps(x).encode()

        self.server = [
            (H(T.INIT, key=0, length=4, dtype=f32), ones),
            (H(T.PUSH, key=0, length=4, dtype=f32, iteration=1), ones),
            (H(T.PUSHPULL, key=0, length=4, dtype=f32, iteration=1), ones),
            (H(T.PULL, key=0, length=4, iteration=1), None),
            (H(T.SET_OPTIMIZER), bomb),
            (H(T.GET_STATES), None),
            (H(T.SET_STATES), states),
            (H(T.SET_STATES), bomb),
            (H(T.PROBE), bytes(256)),
            (H(T.MIGRATE, key=0, length=4, plan_version=1), part),
            (H(T.MIGRATE, key=0, length=4, plan_version=1), bomb),
            (H(T.HEARTBEAT), None),
            (H(T.REGISTER), j(register)),
        ]
        self.scheduler = [
            (H(T.REGISTER), j(register)),
            (H(T.REGISTER), j(dict(register, role="server"))),
            (H(T.HEARTBEAT), None),
            (H(T.BARRIER), None),
            (H(T.BANDWIDTH), j({"bytes": [1e6, 1e6], "seconds": [0.1, 0.2]})),
            (H(T.REPLAN), j(replan)),
            (H(T.PLAN), j({"version": 1, "moved_bytes": 0})),
            (H(T.FINISH), None),
            (H(T.ABORT), b"a stranger says the job is over"),
            (H(T.WELCOME), j({"rank": 0})),
            (H(T.PUSH, key=0, length=4, dtype=f32, iteration=1), ones),
        ]

    # -- pieces ---------------------------------------------------------------------------
    def _bytes(self, n):
        return self.rng.getrandbits(8 * n).to_bytes(n, "little") if n else b""

    def _size(self):
        r = self.rng.random()
        if r < 0.5:
            return self.rng.randint(0, 64)
        if r < 0.8:
            return self.rng.choice([55, 56, 57, 63, 64, 255, 256, 1024])
        return self.rng.randint(65, 8192)

    _FIELDS = {"dtype": 8, "flags": 8, "key": -32, "sender": -32, "iteration": -64,
               "plan_version": 32, "status": -32, "offset": 64, "length": 64,
               "request_id": 64}

    def _field_value(self, bits):
        signed = bits < 0
        bits = abs(bits)
        lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
        v = self.rng.choice([lo, hi, 0, 1, 2, 3, 4, 7, 255, 1 << 20, hi // 2,
                             self.rng.randint(lo, hi)])
        return min(max(v, lo), hi)

    def _mutated_header(self, h):
        h = h.reply(h.type)
        for _ in range(self.rng.randint(1, 3)):
            name = self.rng.choice(list(self._FIELDS) + ["type"])
            if name == "type":
                h.type = self.rng.choice(list(self.wire.MsgType))
            else:
                setattr(h, name, self._field_value(self._FIELDS[name]))
        return h.pack()

    def _flip(self, data, flips=None):
        b = bytearray(data)
        for _ in range(flips or self.rng.randint(1, 4)):
            if b:
                i = self.rng.randrange(len(b))
                b[i] ^= 1 << self.rng.randrange(8)
        return bytes(b)

    # -- messages -------------------------------------------------------------------------
    def message(self, target, kind):
        """One message (a list of frames) of ``kind`` for a "sched" or a server target."""
        h, payload = self.rng.choice(self.scheduler if target == "sched" else self.server)
        frames = [h.pack()] + ([payload] if payload is not None else [])
        if kind == "valid":
            return frames
        if kind == "random":
            return [self._bytes(self._size()) for _ in range(self.rng.randint(1, 4))]
        if kind == "truncated":
            cut = self.rng.randint(0, self.wire.HEADER_SIZE - 1)
            if payload is not None and self.rng.random() < 0.5:
                return [frames[0], payload[:self.rng.randrange(len(payload) or 1)]]
            return [frames[0][:cut]] + frames[1:]
        if kind == "oversized":
            return self._oversized(frames)
        return self._mutated(h, frames)

    def _mutated(self, h, frames):
        r = self.rng.random()
        if r < 0.35:
            frames[0] = self._mutated_header(h)
        elif r < 0.5:
            frames[0] = self._flip(frames[0])
        elif r < 0.7 and len(frames) > 1:
            frames[1] = self._flip(frames[1], self.rng.randint(1, 16))
        elif r < 0.8 and len(frames) > 1:
            frames[1] = frames[1] + self._bytes(self.rng.randint(1, 64))
        elif r < 0.85:
            frames = frames[:1]                              # the payload dropped
        elif r < 0.9:
            frames.append(self._bytes(self._size()))         # a frame too many
        elif r < 0.95:
            frames = [frames[0]] + frames                    # the header twice
        else:
            frames.insert(1, b"")                            # an empty frame
        return frames

    def _oversized(self, frames):
        fb = self.frame_bytes
        r = self.rng.random()
        if r < 0.4:                       # one frame over the transport's bound (MAXMSGSIZE)
            return [frames[0], bytes(fb + self.rng.choice([65, 1024, fb]))]
        if r < 0.7:                       # a payload as the transport cuts it, claimed by
            n = self.rng.randint(fb + 1, 3 * fb)         # a header that may not match it
            data = bytes(n)
            return [frames[0]] + [data[i:i + fb] for i in range(0, n, fb)]
        # frames cut wrongly: a short frame before a full one
        return [frames[0], bytes(self.rng.randint(1, fb - 1)), bytes(fb)]


# -- ZMTP 3 by hand (the plain mode speaks raw TCP) ------------------------------------------

def zmtp_greeting(mechanism=b"NULL", as_server=0, major=3, minor=0):
    return (b"\xff" + bytes(8) + b"\x7f" + bytes([major, minor]) + mechanism.ljust(20, b"\0")
            + bytes([as_server]) + bytes(31))


def zmtp_frame(data, more=False, command=False):
    flags = (0x01 if more else 0) | (0x04 if command else 0)
    if len(data) > 255:
        return bytes([flags | 0x02]) + struct.pack(">Q", len(data)) + data
    return bytes([flags, len(data)]) + data


def zmtp_ready(identity=b"", socket_type=b"DEALER"):
    props = b""
    for k, v in ((b"Socket-Type", socket_type), (b"Identity", identity)):
        props += bytes([len(k)]) + k + struct.pack(">I", len(v)) + v
    return zmtp_frame(b"\x05READY" + props, command=True)


def zmtp_message(frames):
    return b"".join(zmtp_frame(f, more=i < len(frames) - 1) for i, f in enumerate(frames))


class Tally:
    """Counts per target: messages, frames and bytes handed over, by kind."""

    def __init__(self, targets):
        self.t = {name: {"messages": 0, "frames": 0, "bytes": 0, "connections": 0,
                         "answers": 0, "stalls": 0, "by_kind": {k: 0 for k in KINDS}}
                  for name in targets}

    def sent(self, target, kind, frames):
        t = self.t[target]
        t["messages"] += 1
        t["frames"] += len(frames)
        t["bytes"] += sum(len(f) for f in frames)
        t["by_kind"][kind] += 1


def _pick_kind(rng, oversized_share):
    r = rng.random()
    if r < oversized_share:
        return "oversized"
    r = rng.random()
    return "random" if r < 0.25 else "truncated" if r < 0.4 else "valid" if r < 0.5 \
        else "mutated"


def attack_plain(targets, frames_per_target, corpus, rng, tally, deadline):
    """Without the secret: raw TCP connections, each one scenario, until every target got
    ``frames_per_target`` frames written."""
    def short():
        return [n for n in targets if tally.t[n]["frames"] < frames_per_target]

    while short() and time.monotonic() < deadline:
        for name in short():
            host, port = targets[name]
            _plain_connection(name, host, port, corpus, rng, tally)


def _plain_connection(name, host, port, corpus, rng, tally):
    """One connection: a greeting of some sort, then mxps messages framed as ZMTP, counted
    as they are written (until the listener closes the connection)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(2.0)
    try:
        s.connect((host, port))
        tally.t[name]["connections"] += 1
        scenario = rng.random()
        ident = b"worker:%d" % rng.randint(2, 9)
        if scenario < 0.45:             # an mxps node without a secret (NULL mechanism)
            s.sendall(zmtp_greeting(b"NULL") + zmtp_ready(ident))
        elif scenario < 0.6:            # claims CURVE, then a garbage HELLO
            s.sendall(zmtp_greeting(b"CURVE") + zmtp_frame(
                b"\x05HELLO" + corpus._bytes(194), command=True))
        elif scenario < 0.75:           # a mutated or truncated greeting
            g = zmtp_greeting(rng.choice([b"NULL", b"CURVE", b"PLAIN", b"XXXX"]),
                              major=rng.choice([1, 2, 3, 4, 255]))
            g = corpus._flip(g) if rng.random() < 0.5 else g[:rng.randint(0, len(g))]
            s.sendall(g)
        elif scenario < 0.85:           # a frame claiming 2^40 bytes after a NULL greeting
            s.sendall(zmtp_greeting(b"NULL") + zmtp_ready(ident) + b"\x02"
                      + struct.pack(">Q", 1 << 40) + bytes(1024))
            tally.sent(name, "oversized", [bytes(1024)])
        else:                           # random bytes
            junk = corpus._bytes(rng.randint(1, 4096))
            s.sendall(junk)
            tally.sent(name, "random", [junk])
        for _ in range(rng.randint(1, 40)):
            kind = _pick_kind(rng, 0.0)
            frames = corpus.message(name, kind)
            s.sendall(zmtp_message(frames))
            tally.sent(name, kind, frames)
    except OSError:
        pass                            # the listener closed the connection: expected
    finally:
        if rng.random() < 0.5:          # half close with a reset, half politely
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()


def attack_outsider(targets, frames_per_target, corpus, rng, tally, deadline, settings, zmq,
                    members, tcp, nonces):
    """With the secret, as connections that are no node of the job: rotating identities,
    oversized messages on a connection of their own (the listener drops a connection whose
    frame is over its bound, and zmq reconnects it)."""
    ctx = zmq.Context()
    socks = {}
    n_ident = [0]

    def fresh(name):
        host, port = targets[name]
        n_ident[0] += 1
        ident = _stranger(rng, n_ident[0], members)
        if name in nonces:
            # a server's data plane: names of a node's form beyond the job, with valid
            # tokens: its handshake refuses them (the name, not the token), each logged
            ident = rng.choice([b"worker:", b"server:"]) + str(rng.randint(2, 99)).encode()
            sock = tcp.new_data_dealer(settings, ident, nonces[name])
        else:
            sock = ctx.socket(zmq.DEALER)
            if ident is not None:
                sock.setsockopt(zmq.IDENTITY, ident)
            settings.credentials.join(sock)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 1000)
        sock.connect("tcp://%s:%d" % (host, port))
        tally.t[name]["connections"] += 1
        return sock

    try:
        for name in targets:
            socks[name] = [fresh(name), fresh(name), 0]
        left = {name: frames_per_target for name in targets}
        while any(n > 0 for n in left.values()) and time.monotonic() < deadline:
            for name in targets:
                if left[name] <= 0:
                    continue
                entry = socks[name]
                kind = _pick_kind(rng, 0.01)
                frames = corpus.message(name, kind)
                sock = entry[1] if kind == "oversized" else entry[0]
                if isinstance(sock, tcp.SealedSocket):
                    frames = sock.seal.seal(frames[0], frames[1:])
                # a server refuses these connections in the handshake: their queues only fill
                # (MXPS_HWM messages) and a full one is replaced by a new connection at once
                wait_ms = 0 if kind == "oversized" or isinstance(sock, tcp.SealedSocket) \
                    else 2000
                if _send(sock, frames, zmq, wait_ms=wait_ms):
                    tally.sent(name, kind, frames)
                    left[name] -= len(frames)
                else:
                    tally.t[name]["stalls"] += 1
                    slot = 1 if kind == "oversized" else 0
                    entry[slot].close(0)
                    entry[slot] = fresh(name)
                entry[2] += 1
                if entry[2] % 500 == 0:        # a new identity now and then
                    entry[0].close(linger=2000)
                    entry[0] = fresh(name)
                tally.t[name]["answers"] += _drain(entry[0], zmq)
        for entry in socks.values():
            for sock in entry[:2]:
                sock.close(linger=3000)        # let what is queued reach the targets
        socks.clear()
    finally:
        for entry in socks.values():
            for sock in entry[:2]:
                sock.close(0)
        ctx.term()


def _stranger(rng, n, members):
    """A connection identity that names no node of the job (None: zmq picks a random one)."""
    while True:
        r = rng.random()
        if r < 0.2:
            return None
        if r < 0.5:
            ident = b"fuzz:%d" % n
        elif r < 0.7:
            ident = rng.choice([b"worker:", b"server:"]) + str(rng.randint(2, 99)).encode()
        elif r < 0.8:
            ident = rng.choice([b"worker:01", b"server:00", b"worker:-1", b"worker:0 ",
                                b"WORKER:0", b"worker:0\n", b"server:1x"])
        else:
            ident = bytes([rng.randint(1, 255)]) + bytes(
                rng.getrandbits(8) for _ in range(rng.randint(0, 40)))
        if ident not in members:
            return ident


def _send(sock, frames, zmq, wait_ms):
    try:
        sock.send_multipart(frames, flags=zmq.DONTWAIT)
        return True
    except zmq.Again:
        if wait_ms and sock.poll(wait_ms, zmq.POLLOUT):
            try:
                sock.send_multipart(frames, flags=zmq.DONTWAIT)
                return True
            except zmq.Again:
                pass
        return False


def _drain(sock, zmq):
    n = 0
    while sock.poll(0):
        sock.recv_multipart()
        n += 1
    return n


def attack_main(args):
    """The fuzzer process: one mode, every target, ``--frames`` frames each."""
    from mxps_tools import runtime
    wire = runtime.module("wire.frame")
    typed = runtime.module("wire.typed")
    tcp = runtime.module("wire.tcp")
    auth = runtime.module("wire.auth")
    import zmq
    targets = {}
    for spec in args.target:
        name, addr = spec.split("=", 1)
        host, port = addr.rsplit(":", 1)
        targets[name] = (host, int(port))
    rng = random.Random(args.seed)
    corpus = Corpus(rng, args.marker, wire, typed, tcp.FRAME_BYTES)
    tally = Tally(targets)
    members = {b"%s:%d" % (role, r) for role, n in ((b"worker", args.num_workers),
                                                    (b"server", args.num_servers))
               for r in range(n)}
    started = time.time()
    deadline = time.monotonic() + args.max_seconds
    if args.mode == "plain":
        attack_plain(targets, args.frames, corpus, rng, tally, deadline)
    else:
        secret = open(args.secret_file, "rb").read().strip()
        settings = tcp.Settings(auth.Credentials(secret))
        nonces = dict((n, bytes.fromhex(h)) for n, h in (s.split("=", 1) for s in args.nonce))
        attack_outsider(targets, args.frames, corpus, rng, tally, deadline, settings, zmq,
                        members, tcp, nonces)
    out = {"mode": args.mode, "started": started, "ended": time.time(),
           "targets": tally.t, "timed_out": time.monotonic() >= deadline}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    return 0


# =========================================================================== the whole run

def _job_env(steps, out, secret_file):
    env = {"JOB_KVSTORE": "mxps", "JOB_OPTIMIZER": "sgd", "JOB_API": "gluon", "JOB_MODEL": "mlp",
           "JOB_DEVICES": "1", "JOB_STEPS": str(steps), "JOB_LR_MULT": "0",
           "JOB_KV_OBJECT": "0", "JOB_UPDATE_ON_KVSTORE": "1", "JOB_OUT": out,
           "MXPS_SECRET_FILE": secret_file}
    return env


def load_weights(out_dir, rank=0):
    import numpy as np
    with np.load(os.path.join(out_dir, "weights_rank%d.npz" % rank)) as z:
        return {k: z[k] for k in z.files}


def relative_differences(a, b):
    """Per parameter ||a - b|| / ||b||; None when the parameter sets differ."""
    import numpy as np
    if sorted(a) != sorted(b):
        return None
    return {k: float(np.linalg.norm(a[k].astype(np.float64) - b[k].astype(np.float64))
                     / max(np.linalg.norm(b[k].astype(np.float64)), 1e-30)) for k in a}


def step_timeline(out_dir, rank=0):
    """(start, end) wall times of each training step of ``rank``: the steps' durations
    (meta_rank*.json) counted back from when its results were written (the file's mtime; the
    weights are written right after the last step)."""
    path = os.path.join(out_dir, "meta_rank%d.json" % rank)
    with open(path) as f:
        seconds = json.load(f)["step_seconds"]
    end = os.path.getmtime(path)
    spans = []
    for s in reversed(seconds):
        spans.append((end - s, end))
        end -= s
    return spans[::-1]


def steps_within(spans, t0, t1):
    """Steps that ended within [t0, t1]."""
    return sum(1 for _, end in spans if t0 <= end <= t1)


def log_summary(text):
    """What a node's stderr says about garbage: drop and refusal lines (rate-limited lines
    carry counts), tracebacks, fatal errors."""
    counted = 0
    for m in re.finditer(r"\((\d+) times in the last", text):
        counted += int(m.group(1))
    return {"drop_lines": len(re.findall(r"dropped|ignored|refused|refusing", text)),
            "dropped_at_least": counted + len(re.findall(
                r"dropped|ignored|refused a message", text)),
            "refused_connections": len(re.findall(r"refused a connection from", text)),
            "tracebacks": text.count("Traceback"), "fatal": text.count("fatal:")}


def run_job(jobs, steps, out, secret_file, log_dir, timeout):
    return jobs.Job([TRAIN_JOB], 2, 2, env=_job_env(steps, out, secret_file), log_dir=log_dir,
                    cpu_interval=None, timeout=timeout)


def spawn_attack(mode, targets, frames, secret_file, marker, seed, json_path, max_seconds,
                 nonces=None):
    argv = [sys.executable, os.path.abspath(__file__), "attack", "--mode", mode,
            "--frames", str(frames), "--secret-file", secret_file, "--marker", marker,
            "--seed", str(seed), "--json", json_path, "--max-seconds", str(max_seconds)]
    for name, (host, port) in targets.items():
        argv += ["--target", "%s=%s:%d" % (name, host, port)]
    for name, nonce in (nonces or {}).items():
        argv += ["--nonce", "%s=%s" % (name, nonce)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "MXPS_"))}
    return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)


def run(args):
    from mxps_tools import jobs
    work = tempfile.mkdtemp(prefix="mxps-fuzz-")
    secret_file = os.path.join(work, "secret")
    with open(secret_file, "w") as f:
        f.write(secrets.token_hex(32))
    os.chmod(secret_file, 0o600)
    marker = os.path.join(work, "pickle-was-executed")
    result = {"frames_per_target": args.frames, "steps": args.steps, "modes": list(args.modes),
              "attacks": {}, "windows": {}, "alive_after": {}, "steps_during": {}}
    procs = []
    try:
        ref_dir = args.reference
        if ref_dir is None:
            ref_dir = os.path.join(work, "reference")
            t0 = time.monotonic()
            res = run_job(jobs, args.steps, ref_dir, secret_file, os.path.join(work, "ref-logs"),
                          args.timeout).run()
            result["reference_seconds"] = time.monotonic() - t0
            if not res.ok:
                raise SystemExit("the reference job failed: %s" % res.describe())
        out = os.path.join(work, "fuzzed")
        log_dir = os.path.join(work, "logs")
        with run_job(jobs, args.steps, out, secret_file, log_dir, args.timeout) as job:
            job.wait(lambda: (job.job_info() or {}).get("servers"), args.timeout,
                     "the rendezvous")
            info = job.job_info()
            targets = {"sched": (jobs.LOOPBACK, job.port)}
            nonces = {}
            for s in info["servers"]:
                targets["s%d" % s["rank"]] = (s["host"], s["port"])
                if s.get("seal"):
                    nonces["s%d" % s["rank"]] = s["seal"]
            result["targets"] = {k: "%s:%d" % v for k, v in targets.items()}
            warm = time.monotonic() + args.warmup        # let the training get going
            job.wait(lambda: time.monotonic() >= warm or job.all_exited(), args.warmup + 5,
                     "the warm-up")
            for i, mode in enumerate(args.modes):
                path = os.path.join(work, "attack-%s.json" % mode)
                p = spawn_attack(mode, targets, args.frames, secret_file, marker,
                                 args.seed + i, path, args.max_seconds, nonces)
                procs.append(p)
                job.wait(lambda: p.poll() is not None or job.all_exited(), args.max_seconds + 60,
                         "the %s fuzzer's end" % mode)
                output = p.communicate()[0].decode(errors="replace")
                job.poll()
                result["alive_after"][mode] = sorted(n.name for n in job.nodes
                                                     if n.returncode is None)
                if p.returncode != 0 or not os.path.exists(path):
                    raise SystemExit("the %s fuzzer failed (rc %s):\n%s"
                                     % (mode, p.returncode, output[-3000:]))
                with open(path) as f:
                    result["attacks"][mode] = json.load(f)
                result["windows"][mode] = [result["attacks"][mode]["started"],
                                           result["attacks"][mode]["ended"]]
            job.wait(job.all_exited, args.timeout, "the end of the fuzzed job")
        res = job.result
        result["job"] = {"ok": res.ok, "codes": {n.name: n.returncode for n in res.nodes},
                         "reason": res.reason, "seconds": res.wall_seconds}
        result["logs"] = {n.name: log_summary(n.read("err")) for n in res.nodes}
        result["log_tails"] = {n.name: n.read("err")[-1500:] for n in res.nodes
                               if n.returncode != 0 or "Traceback" in n.read("err")}
        if res.ok:
            diffs = [relative_differences(load_weights(out, r), load_weights(ref_dir, r))
                     for r in (0, 1)]
            result["max_relative_difference"] = None if None in diffs else max(
                max(d.values()) for d in diffs)
            result["weights_equal"] = result["max_relative_difference"] is not None and \
                result["max_relative_difference"] <= RTOL
            spans = step_timeline(out)
            result["steps_total"] = len(spans)
            result["training"] = [spans[0][0], spans[-1][1]]
            for mode, (t0, t1) in result["windows"].items():
                result["steps_during"][mode] = steps_within(spans, t0, t1)
        else:
            result["weights_equal"] = False
        result["pickle_executed"] = os.path.exists(marker)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        if args.keep:
            print("kept %s" % work)
        else:
            shutil.rmtree(work, ignore_errors=True)
    return result


def table(result):
    from tabulate import tabulate
    rows = []
    for mode, att in result["attacks"].items():
        for target, t in att["targets"].items():
            rows.append([mode, target, t["frames"], t["messages"], t["connections"],
                         " ".join("%s %d" % (k, v) for k, v in t["by_kind"].items() if v),
                         t["answers"]])
    text = tabulate(rows, headers=["mode", "target", "frames sent", "messages", "connections",
                                   "messages by kind", "answers"], tablefmt="github")
    job = result.get("job", {})
    steps = ", ".join("%s: %d" % kv for kv in result["steps_during"].items())
    logs = result.get("logs", {})
    summary = [
        ["job result", "ok (every node exit 0)" if job.get("ok") else
         "FAILED: %s" % job.get("reason")],
        ["weights equal to the unfuzzed run (%.0e)" % RTOL,
         "%s (max relative difference %s)" % ("yes" if result.get("weights_equal") else "NO",
                                              result.get("max_relative_difference"))],
        ["training steps completed while each fuzzer ran", steps or "-"],
        ["nodes alive after each fuzzer", ", ".join(
            "%s: %s" % (m, " ".join(a)) for m, a in result["alive_after"].items())],
        ["pickles executed", "yes" if result.get("pickle_executed") else "none"],
        ["tracebacks / fatal errors logged", ", ".join(
            "%s %d/%d" % (n, v["tracebacks"], v["fatal"]) for n, v in sorted(logs.items()))],
        ["garbage logged as dropped (at least)", ", ".join(
            "%s %d" % (n, v["dropped_at_least"]) for n, v in sorted(logs.items())
            if v["dropped_at_least"])],
        ["refused connections logged", ", ".join(
            "%s %d" % (n, v["refused_connections"]) for n, v in sorted(logs.items())
            if v["refused_connections"])],
    ]
    return text + "\n\n" + tabulate(summary, tablefmt="github")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command")
    a = sub.add_parser("attack", help="the fuzzer process alone")
    a.add_argument("--mode", choices=MODES, required=True)
    a.add_argument("--target", action="append", required=True, help="name=host:port")
    a.add_argument("--nonce", action="append", default=[],
                   help="name=hex: a server's data-plane nonce (the job's facts carry it)")
    a.add_argument("--frames", type=int, default=DEFAULT_FRAMES, help="per target")
    a.add_argument("--secret-file", help="the job's secret (mode outsider)")
    a.add_argument("--marker", default=os.path.join(tempfile.gettempdir(), "mxps-fuzz-marker"))
    a.add_argument("--seed", type=int, default=1)
    a.add_argument("--num-workers", type=int, default=2)
    a.add_argument("--num-servers", type=int, default=2)
    a.add_argument("--max-seconds", type=float, default=900)
    a.add_argument("--json", required=True)
    for p in (ap,):
        p.add_argument("--frames", type=int, default=DEFAULT_FRAMES,
                       help="frames per target and mode (default %(default)d)")
        p.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                       help="training steps of the job (default %(default)d)")
        p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
        p.add_argument("--seed", type=int, default=1)
        p.add_argument("--warmup", type=float, default=2.0,
                       help="seconds of training before the first fuzzer starts")
        p.add_argument("--max-seconds", type=float, default=900,
                       help="longest a fuzzer may run")
        p.add_argument("--timeout", type=float, default=1800, help="for each job")
        p.add_argument("--reference", help="an unfuzzed run's JOB_OUT (else one is run)")
        p.add_argument("--json", help="write the result here")
        p.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args(argv)
    if args.command == "attack":
        if args.mode == "outsider" and not args.secret_file:
            ap.error("mode outsider needs --secret-file")
        return attack_main(args)
    result = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(table(result))
    ok = (result.get("job", {}).get("ok") and result.get("weights_equal")
          and not result.get("pickle_executed"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
