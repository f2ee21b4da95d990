"""Who may talk to an mxps node: handshakes with keys derived from the job secret.

Every node of a job knows the secret (MXPS_SECRET or MXPS_SECRET_FILE).  From it each derives
the same two CURVE key pairs and a data key.  The scheduler's socket is a CurveZMQ server: it
proves it holds the *server* pair and every node's socket proves it holds the *client* pair.
The servers' data sockets take a PLAIN handshake whose password is a one-time token, an HMAC
under the data key (``DataGate``; the messages on them are sealed by ``mxps.wire.seal``).

On the scheduler's socket a peer without the secret cannot finish the handshake: it cannot
open the listener's boxes (so it learns nothing) and the ZAP handler here admits no client key
but the job's.  zmq delivers no message from a connection whose handshake failed, so nothing
above the transport ever sees a byte from an unauthenticated peer, and every message after the
handshake is encrypted and authenticated with per-connection keys and nonces (a replayed or
altered frame breaks the connection).  On a data socket a peer without the secret cannot make a token, so it
is refused in the same way.  Why the data plane is not CURVE: docs/SECURITY.md (measured).

Refusals are logged on the refusing side with the peer's address: ZAP requests carry it; a
handshake that fails before ZAP is consulted (wrong server key, no CURVE at all) is seen on the
listening socket's monitor, whose ACCEPTED event gives the connection's file descriptor.
"""
import collections
import hashlib
import hmac
import logging
import os
import re
import queue
import socket
import threading
import time

import zmq
import zmq.utils.z85

log = logging.getLogger("mxps.auth")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"     # fixed by the ZAP specification (RFC 27)
_PERSON_SECRET = b"mxps-job-secret"
_PERSON_SERVER = b"mxps-server-key"
_PERSON_CLIENT = b"mxps-client-key"
_PERSON_DATA = b"mxps-data-key"
_TOKEN = b"mxps data plane token v1"
_NODE = re.compile(rb"(worker|server):(0|[1-9][0-9]{0,8})\Z")

# protocol error codes libzmq reports in HANDSHAKE_FAILED_PROTOCOL events
_MECHANISM_MISMATCH = 0x11000002
_CRYPTOGRAPHIC = 0x11000001


def _derived(secret, person):
    """32 bytes of keyed BLAKE2b of the job secret, one ``person`` per use.  The secret is first
    hashed to 64 bytes (BLAKE2b's key size limit)."""
    key = hashlib.blake2b(secret, digest_size=64, person=_PERSON_SECRET).digest()
    return hashlib.blake2b(b"", key=key, digest_size=32, person=person).digest()


def _secret_key(secret, person):
    """A CURVE secret key (z85); any 32 bytes are a valid Curve25519 secret key."""
    return zmq.utils.z85.encode(_derived(secret, person))


class Credentials:
    """The job's two CURVE key pairs, derived from the secret (bytes, not empty)."""

    __slots__ = ("server_public", "server_secret", "client_public", "client_secret",
                 "client_public_raw", "domain", "data_key")

    def __init__(self, secret):
        if not secret:
            raise ValueError("a job secret is needed to derive credentials")
        self.server_secret = _secret_key(secret, _PERSON_SERVER)
        self.server_public = zmq.curve_public(self.server_secret)
        self.client_secret = _secret_key(secret, _PERSON_CLIENT)
        self.client_public = zmq.curve_public(self.client_secret)
        self.client_public_raw = zmq.utils.z85.decode(self.client_public)
        # the ZAP domain names the job's keys, so one process may serve several secrets
        # (tests); it is derived from a public key, which reveals nothing
        self.domain = b"mxps-" + self.client_public[:10]
        # the data plane's (mxps.wire.seal) tokens and session keys come from this one
        self.data_key = _derived(secret, _PERSON_DATA)

    def __repr__(self):
        return "Credentials(<derived from the job secret>)"

    def serve(self, sock):
        """Make ``sock`` (not yet bound) a CURVE server that only the job's clients reach."""
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.server_secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.server_public)
        sock.setsockopt(zmq.ZAP_DOMAIN, self.domain)

    def join(self, sock):
        """Make ``sock`` (not yet connected) a CURVE client of the job's listeners."""
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.client_secret)

    refusal = "its client key is not the job's"

    def admits(self, mechanism, credentials, address):
        """ZAP's question: may a client with these handshake credentials in?"""
        return (mechanism == b"CURVE" and len(credentials) == 1
                and hmac.compare_digest(credentials[0], self.client_public_raw))

    # -- the data plane's handshake -----------------------------------------------------------
    def token(self, name, server_nonce, random):
        """The PLAIN password of ``name``'s connection to a server process (named by its
        nonce): the session's random bytes and an HMAC of all three under the data key."""
        return random + hmac.new(self.data_key, b"\0".join(
            (_TOKEN, name, server_nonce, random)), hashlib.sha256).digest()

    def join_data(self, sock, name, server_nonce, random):
        """Make ``sock`` (a DEALER not yet connected) a client of a server's data socket."""
        sock.setsockopt(zmq.PLAIN_USERNAME, name)
        sock.setsockopt(zmq.PLAIN_PASSWORD, self.token(name, server_nonce, random))


class DataGate:
    """Who may connect to one server's data socket (the ZAP side of its PLAIN handshake): a
    node of the job (``worker:<rank>``, ``server:<rank>``, the rank below the job's count of
    that role when ``job`` gives the counts) whose token verifies under the job's data key for
    this server process.  A token is taken again only from the address that first used it
    (zmq reconnects with the same one after a network hiccup), so one seen on the wire does
    not let anyone else in.  A name beyond the job is refused before its token is checked: a
    holder of the secret cannot open sessions the server would only drop message by message
    (whose queues, at MXPS_HWM messages each, are what a flood of them fills)."""

    BAD_TOKEN = "its token does not verify (a different MXPS_SECRET?)"

    def __init__(self, creds, server_nonce, job=None):
        self.creds = creds
        self.server_nonce = server_nonce
        self.domain = b"mxps-data-" + server_nonce.hex().encode()
        self.used = {}                       # token random -> the address that used it
        # {b"worker": DMLC_NUM_WORKER, b"server": DMLC_NUM_SERVER}, or None: any rank
        self.job = None if job is None else {k.encode(): int(v) for k, v in job.items()}
        self.refusal = self.BAD_TOKEN        # why the last refused handshake was refused

    def serve(self, sock):
        """Make ``sock`` (not yet bound) a PLAIN server asking this gate."""
        sock.setsockopt(zmq.PLAIN_SERVER, 1)
        sock.setsockopt(zmq.ZAP_DOMAIN, self.domain)

    def admits(self, mechanism, credentials, address):
        if mechanism != b"PLAIN" or len(credentials) != 2:
            self.refusal = "it offered no name and token (mechanism %s)" % (
                mechanism.decode(errors="replace"))
            return False
        name, password = credentials
        node = _NODE.match(name)
        if node is None or len(password) != 48:
            self.refusal = self.BAD_TOKEN
            return False
        if self.job is not None and int(node.group(2)) >= self.job[node.group(1)]:
            self.refusal = "it names %s, no node of this job (%d workers, %d servers)" % (
                name.decode(), self.job[b"worker"], self.job[b"server"])
            return False
        random = password[:16]
        want = self.creds.token(name, self.server_nonce, random)
        if not hmac.compare_digest(password, want):
            self.refusal = self.BAD_TOKEN
            return False
        first = self.used.setdefault(random, address)
        if first != address:
            self.refusal = "its token was first used from another address (a replay?)"
            return False
        return True


class Tally:
    """Counts events by kind and logs them rate-limited: the first of a kind at once, then at
    most one line per ``interval`` seconds with how many came since.  A flood of garbage or of
    refused connections must neither fill the log nor go unnoticed, nor grow memory: beyond
    ``max_kinds`` distinct kinds (kinds may name a peer) new ones are counted as ``OTHER``."""

    OTHER = "(other)"

    def __init__(self, logger, interval=10.0, max_kinds=256):
        self.logger = logger
        self.interval = interval
        self.max_kinds = max_kinds
        self.counts = collections.Counter()
        self._since = collections.Counter()
        self._last = {}
        self._lock = threading.Lock()

    def __call__(self, kind, message, *args):
        now = time.monotonic()
        with self._lock:
            if kind not in self.counts and len(self.counts) >= self.max_kinds:
                kind = self.OTHER
            self.counts[kind] += 1
            self._since[kind] += 1
            last = self._last.get(kind)
            if last is not None and now - last < self.interval:
                return
            self._last[kind] = now
            n, self._since[kind] = self._since[kind], 0
        suffix = "" if n == 1 else " (%d times in the last %.0f s, %d in all)" % (
            n, self.interval, self.counts[kind])
        self.logger.warning(message + suffix, *args)

    def total(self):
        with self._lock:
            return sum(self.counts.values())


def _peer_of(fd):
    """``host:port`` of the TCP peer on file descriptor ``fd`` (which zmq owns), or None when
    the connection is already closed.  Works on a duplicate, so zmq's descriptor is untouched."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        s = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None
    try:
        host, port = s.getpeername()[:2]
        return ("[%s]:%d" if ":" in host else "%s:%d") % (host, port)
    except (OSError, ValueError):
        return None
    finally:
        s.close()


def _handshake_reason(event, value):
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == _MECHANISM_MISMATCH:
        return "it does not use the job's authentication (no MXPS_SECRET on that node?)"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == _CRYPTOGRAPHIC:
        return "its keys do not match (a different MXPS_SECRET?)"
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return "its client key is not the job's"
    return "it broke off the handshake (no MXPS_SECRET on that node, or a different MXPS_SECRET?)"


class Gatekeeper:
    """The ZAP handler of one zmq context, and the watcher of its listening sockets.

    One thread answers every ZAP request of the context (admitting only the job's client key
    for the request's domain) and reads the monitors of the listening sockets it was asked to
    ``watch``, logging every refused connection with the peer's address (``refusals``
    counts them).  Started by ``for_context``; the thread is a daemon and waits on its sockets
    only (no timeouts to poll)."""

    _instances = {}
    _instances_lock = threading.Lock()

    @classmethod
    def for_context(cls, ctx):
        with cls._instances_lock:
            gate = cls._instances.get(id(ctx))
            if gate is None:
                gate = cls._instances[id(ctx)] = cls(ctx)
            return gate

    def __init__(self, ctx):
        self.ctx = ctx
        self.domains = {}                    # ZAP domain -> Credentials
        self.refusals = Tally(log)
        self.admitted = 0
        self._zap = ctx.socket(zmq.REP)
        self._zap.setsockopt(zmq.LINGER, 0)
        self._zap.bind(ZAP_ENDPOINT)
        self._commands = queue.Queue()
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="mxps-gatekeeper", daemon=True)
        self._thread.start()

    def admit(self, creds):
        """Let the job of ``creds`` in (at the ZAP domain its listening sockets carry)."""
        self.domains[creds.domain] = creds

    def watch(self, sock, name):
        """Log refused connections of the listening socket ``sock`` (not yet bound), calling
        it ``name`` (e.g. "scheduler").  The monitor is attached here, in the socket's own
        thread, before the socket can accept anything; the gatekeeper's thread reads it."""
        events = (zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
                  | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                  | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        monitor = sock.get_monitor_socket(events)
        self._command(("watch", monitor, name))

    def _command(self, cmd):
        self._commands.put(cmd)
        os.write(self._wake_w, b"x")

    # -- the thread ---------------------------------------------------------------------------
    def _run(self):
        poller = zmq.Poller()
        poller.register(self._zap, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        watched = {}                          # monitor socket -> _Watch
        while True:
            try:
                events = dict(poller.poll())
            except zmq.ZMQError:
                return                        # the context is being terminated
            if self._wake_r in events:
                os.read(self._wake_r, 4096)
                while not self._commands.empty():
                    _, monitor, name = self._commands.get()
                    watched[monitor] = _Watch(name, self.refusals)
                    poller.register(monitor, zmq.POLLIN)
            if self._zap in events:
                self._answer_zap()
            for monitor, w in watched.items():
                if monitor in events:
                    batch = []
                    while monitor.poll(0):
                        batch.append(monitor.recv_multipart())
                    w.on_events(batch)

    def _answer_zap(self):
        try:
            frames = self._zap.recv_multipart()
        except zmq.ZMQError:
            return
        if len(frames) < 6:                   # not a ZAP request; a REP socket must answer
            self._zap.send_multipart([b"1.0", b"", b"400", b"malformed ZAP request", b"", b""])
            return
        version, request_id, domain, address, _identity, mechanism = frames[:6]
        creds = self.domains.get(domain)
        ok = creds is not None and creds.admits(mechanism, frames[6:], address)
        if ok:
            self.admitted += 1
        else:
            self.refusals("zap:%s" % address.decode(errors="replace"),
                          "refused a connection from %s: %s", address.decode(errors="replace"),
                          creds.refusal if creds is not None else
                          _handshake_reason(zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400))
        self._zap.send_multipart([version, request_id, b"200" if ok else b"400",
                                  b"OK" if ok else b"not a node of this job", b"", b""])


class _Watch:
    """The monitor of one listening socket: remembers each accepted connection's peer address
    and logs the connections whose handshake failed.  With one zmq I/O thread a failed
    handshake's event is followed at once by the DISCONNECTED event of the same connection,
    which names its descriptor.

    The address is read from the descriptor an ACCEPTED event names, but only while that
    connection is surely still open: events are read in batches, and a descriptor closed later
    in the same batch may already be another connection's (the kernel reuses numbers at once),
    so it is not read.  A handshake can also fail (on loopback within ~100 us) before this
    thread reads its ACCEPTED event.  Either way the refusal is logged as from "an unknown
    address" rather than from a wrong one (a node with a wrong secret retries every 100 ms, so
    its address shows within a few attempts)."""

    def __init__(self, name, refusals):
        self.name = name
        self.refusals = refusals
        self.peers = {}                       # fd -> "host:port" (None: not known)
        self.failure = None                   # the last handshake failure, awaiting its fd

    def on_events(self, batch):
        events = []
        for frames in batch:
            if len(frames) != 2 or len(frames[0]) != 6:
                continue
            events.append((int.from_bytes(frames[0][:2], "little"),
                           int.from_bytes(frames[0][2:], "little")))
        # the descriptors still open at the end of the batch, and their peers
        open_at_end = {}
        for event, value in events:
            if event == zmq.EVENT_ACCEPTED:
                open_at_end[value] = True
            elif event == zmq.EVENT_DISCONNECTED:
                open_at_end[value] = False
        known = {fd: _peer_of(fd) for fd, is_open in open_at_end.items() if is_open}
        last_accept = {value: i for i, (event, value) in enumerate(events)
                       if event == zmq.EVENT_ACCEPTED}
        for i, (event, value) in enumerate(events):
            if event == zmq.EVENT_ACCEPTED:
                self.peers[value] = known.get(value) if last_accept[value] == i else None
            else:
                self._on_event(event, value)

    def _on_event(self, event, value):
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.failure = None
        elif event in (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                       zmq.EVENT_HANDSHAKE_FAILED_AUTH):
            self.failure = (event, value)
        elif event == zmq.EVENT_DISCONNECTED:
            peer = self.peers.pop(value, None)
            failure, self.failure = self.failure, None
            if failure is None:
                return
            # a ZAP refusal was logged with its address by the ZAP handler already
            if failure[0] != zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                host = peer.rsplit(":", 1)[0] if peer else "?"
                self.refusals("%s:%s" % (self.name, host),
                              "%s refused a connection from %s: %s", self.name,
                              peer or "an unknown address", _handshake_reason(*failure))


class HandshakeWatch:
    """Whether a connecting socket's handshakes succeed: attach before ``connect``, then feed
    ``on_readable`` when ``sock`` polls readable.  ``failures`` counts handshakes that failed
    since the last success; ``succeeded`` tells whether one ever did; ``refused`` whether the
    listener said no in so many words (a mechanism mismatch or a ZAP refusal: libzmq does not
    try again after those), rather than just closing the connection (a wrong server key: it
    cannot answer, and libzmq reconnects every 100 ms)."""

    EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
              | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)

    def __init__(self, dealer):
        self._dealer = dealer
        self.sock = dealer.get_monitor_socket(self.EVENTS)
        self.failures = 0
        self.first_failure = None
        self.succeeded = False
        self.reason = None

    def on_readable(self):
        while self.sock.poll(0):
            frames = self.sock.recv_multipart()
            if len(frames) != 2 or len(frames[0]) != 6:
                continue
            event = int.from_bytes(frames[0][:2], "little")
            value = int.from_bytes(frames[0][2:], "little")
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.succeeded = True
                self.failures = 0
                self.first_failure = None
                self.reason = None
            else:
                self.failures += 1
                if self.first_failure is None:
                    self.first_failure = time.monotonic()
                self.reason = (event, value)

    @property
    def refused(self):
        return self.reason is not None and self.reason[0] in (
            zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_AUTH)

    def close(self):
        """Stop watching (idempotent; the watched socket may be closed already)."""
        if self.sock.closed:
            return
        try:
            self._dealer.disable_monitor()
        except zmq.ZMQError:
            pass
        self.sock.close(linger=0)


__all__ = ["Credentials", "DataGate", "Gatekeeper", "HandshakeWatch", "Tally", "ZAP_ENDPOINT"]
