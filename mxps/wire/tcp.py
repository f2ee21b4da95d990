"""Reliable transport: ZeroMQ over TCP (ROUTER on the listening side, DEALER per peer).

The transport moves (header, payload) messages and knows nothing about keys or placement.
Large payloads go zero-copy (``copy=False``): zmq keeps a reference to the buffer until it has
been written to the socket.  Every blocking wait in mxps goes through ``poll`` with a timeout.

Every socket is made from a ``Settings`` (``Settings.from_config``): with a job secret every
connection is authenticated, so a message from a peer without the secret never reaches
``recv``, and encrypted: the scheduler's connections by zmq CURVE (``mxps.wire.auth``), the data
plane's (a server's socket, the DEALERs to it: ``bind_data``, ``connect_data``) by a PLAIN
handshake with a one-time token and every message sealed with AES-256-GCM (``mxps.wire.seal``),
which costs a fifth of CURVE's CPU per byte.  Queues are bounded (``MXPS_HWM`` messages
per connection and direction): a listening socket never blocks on a peer that does not read
(``send`` raises ``QueueFull``: the caller drops that reply and logs it), a connecting
socket's send waits at most ``send_timeout``.  Without a secret a node that listens beyond
loopback prints one loud warning.

Frames are bounded too (zmq MAXMSGSIZE): a payload larger than ``FRAME_BYTES`` travels as
consecutive frames of exactly ``FRAME_BYTES`` (the last one shorter) and ``recv`` joins them.
zmq allocates a frame's whole claimed size when its header arrives, also during the handshake,
before it knows who is talking: with no bound one connection that will never authenticate
could make a node hold a gigabyte; with it, at most ``FRAME_BYTES``.
"""
import dataclasses
import errno
import ipaddress
import os
import socket
import sys
import threading
from typing import Optional

import numpy as np
import zmq

from ..config import MAKE_SECRET
from . import auth, frame as wire, seal

ZERO_COPY_THRESHOLD = 64 * 1024   # below this a copy is cheaper than zmq's zero-copy bookkeeping
FRAME_BYTES = 1 << 20             # the largest payload frame (a float32 chunk of MXPS_MAX_CHUNK)
MAX_FRAME = FRAME_BYTES + 128     # zmq MAXMSGSIZE: a (sealed) payload frame or the header


class TransportError(RuntimeError):
    """A peer could not be reached or spoke something that is not mxps."""


class QueueFull(TransportError):
    """A peer's queue is at its high-water mark (MXPS_HWM): it does not read what it asked for."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """How this process's sockets are made: credentials (None: unauthenticated), the queue
    bound (messages per connection and direction), and how long a connecting socket's send
    may wait at that bound."""
    credentials: Optional[auth.Credentials] = None
    hwm: int = 1000
    send_timeout: float = 120.0

    @classmethod
    def from_config(cls, cfg):
        return cls(credentials=auth.Credentials(cfg.secret) if cfg.secret else None,
                   hwm=cfg.hwm, send_timeout=cfg.timeout)

    @property
    def authenticated(self):
        return self.credentials is not None


PLAIN = Settings()


def context():
    return zmq.Context.instance()


class SealedSocket(zmq.Socket):
    """A data-plane socket whose messages are sealed (``seal``: a ``seal.ClientSeal`` on a
    DEALER, a ``seal.ServerSeal`` on a ROUTER)."""
    seal = None


def _tune(sock, settings):
    sock.setsockopt(zmq.LINGER, 2000)
    sock.setsockopt(zmq.SNDHWM, settings.hwm)
    sock.setsockopt(zmq.RCVHWM, settings.hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
    sock.setsockopt(zmq.SNDTIMEO, int(settings.send_timeout * 1000))
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    return sock


# -- the warning for unauthenticated listeners --------------------------------------------------
_warned = threading.Event()


def is_loopback(host):
    """Whether ``host`` (an address or a name) is on loopback (127.0.0.0/8, ::1) only."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback
                               for i in infos)


def warn_if_exposed(host, port, who, out=None):
    """Print one loud warning per process when ``who`` listens beyond loopback without a job
    secret (returns whether it printed)."""
    if is_loopback(host) or _warned.is_set():
        return False
    _warned.set()
    out = sys.stderr if out is None else out
    line = "mxps WARNING: " + "*" * 66 + "\n"
    out.write(line + (
        "mxps WARNING: this %s listens on %s:%s WITHOUT A JOB SECRET: anyone who can reach\n"
        "mxps WARNING: that port can join the job, read and overwrite its weights and run code\n"
        "mxps WARNING: in this process.  Give every node of the job the same secret:\n"
        "mxps WARNING:   export MXPS_SECRET=$(%s)\n"
        "mxps WARNING: (MXNet's local launcher copies the environment; with --launcher ssh put\n"
        "mxps WARNING: the secret in a file on every host and write MXPS_SECRET_FILE=/path\n"
        "mxps WARNING: before the command); `mxps launch` makes one per job. docs/SECURITY.md\n"
        % (who, host, port, MAKE_SECRET)) + line)
    out.flush()
    return True


# -- sockets -------------------------------------------------------------------------------------
def bind_router(host, port=None, settings=PLAIN, who="node", _data=None):
    """A ROUTER socket listening on host:port (a free port when port is None); (sock, port).

    With credentials only the job's nodes can connect; refused connections are logged with
    their address (``auth.Gatekeeper``).  ``who`` names this node in those lines.  ``_data``
    (``bind_data``'s): (the handshake's guard instead of the job's CURVE keys, the socket's
    ``seal.ServerSeal``)."""
    sealed = _data is not None
    sock = _tune(context().socket(zmq.ROUTER, socket_class=SealedSocket if sealed
                                  else zmq.Socket), settings)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    # a node's connection that comes back (zmq reconnects after a network hiccup) takes its
    # identity over; without this the ROUTER ignores it while the old one looks alive
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    if settings.credentials is not None:
        guard = _data[0] if sealed else settings.credentials
        gate = auth.Gatekeeper.for_context(context())
        gate.admit(guard)
        guard.serve(sock)
        gate.watch(sock, who)
        if sealed:
            sock.seal = _data[1]
    try:
        if port is None:
            port = sock.bind_to_random_port("tcp://%s" % host, min_port=20000, max_port=60000,
                                            max_tries=200)
        else:
            sock.bind("tcp://%s:%d" % (host, port))
    except zmq.ZMQError as e:
        sock.close(0)
        raise TransportError("cannot listen on %s:%s: %s" % (host, port, e)) from None
    if settings.credentials is None:
        warn_if_exposed(host, port, who)
    return sock, port


def bind_data(host, settings, who="server", job=None):
    """A server's data socket: (sock, port, nonce).  With credentials it is a PLAIN server
    admitting the job's tokens for this process (``auth.DataGate``; with ``job``,
    ``{"worker": n, "server": m}``, only the names of the job's nodes; refusals are logged
    with their address) and every message is sealed (``seal.ServerSeal``); ``nonce`` (16
    random bytes, b"" without a secret) goes to the clients through the scheduler."""
    if settings.credentials is None:
        sock, port = bind_router(host, None, settings, who)
        return sock, port, b""
    nonce = os.urandom(seal.RANDOM)
    sock, port = bind_router(host, None, settings, who, _data=(
        auth.DataGate(settings.credentials, nonce, job),
        seal.ServerSeal(settings.credentials.data_key, nonce, FRAME_BYTES)))
    return sock, port, nonce


def new_data_dealer(settings, name, server_nonce):
    """A DEALER for a server's data socket, as node ``name`` (not yet connected): sealed with
    a session of its own when the job has a secret (``server_nonce`` from the scheduler)."""
    if settings.credentials is None:
        return new_dealer(settings, name)
    sock = _tune(context().socket(zmq.DEALER, socket_class=SealedSocket), settings)
    sock.setsockopt(zmq.IDENTITY, name)
    sock.seal = seal.ClientSeal(settings.credentials.data_key, name, server_nonce, FRAME_BYTES)
    settings.credentials.join_data(sock, name, server_nonce, sock.seal.random)
    return sock


def connect_data(host, port, settings, name, server_nonce):
    return connect(new_data_dealer(settings, name, server_nonce), host, port)


def new_dealer(settings=PLAIN, identity=None):
    """A DEALER socket, not yet connected (attach a ``HandshakeWatch`` before ``connect``)."""
    sock = _tune(context().socket(zmq.DEALER), settings)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if settings.credentials is not None:
        settings.credentials.join(sock)
    return sock


def connect(sock, host, port):
    sock.connect("tcp://%s:%d" % (host, port))
    return sock


def connect_dealer(host, port, settings=PLAIN, identity=None):
    return connect(new_dealer(settings, identity), host, port)


def local_address_towards(host, port):
    """The local address this machine uses to reach host:port (no packet is sent)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect((host, port))
        return s.getsockname()[0]
    except OSError as e:
        raise TransportError("no route to the scheduler at %s:%d: %s" % (host, port, e)) from None
    finally:
        s.close()


def _payload_frames(payload):
    """The frames of a payload: itself up to FRAME_BYTES, else consecutive FRAME_BYTES views."""
    view = memoryview(payload)
    if view.nbytes <= FRAME_BYTES:
        return [payload]
    if not view.c_contiguous:
        view = memoryview(view.tobytes())
    view = view.cast("B")
    return [view[i:i + FRAME_BYTES] for i in range(0, view.nbytes, FRAME_BYTES)]


def send(sock, header, payload=None, ident=None, block=True):
    """Send one message; ``payload`` is bytes or any buffer (sent zero-copy when large).

    On a ROUTER (``ident`` given) a send never waits: a peer whose queue is full raises
    ``QueueFull``, a peer that is gone ``TransportError``.  On a DEALER it waits up to the
    settings' ``send_timeout`` for room in the queue (``block=False``: not at all), then
    raises ``QueueFull``."""
    if isinstance(sock, SealedSocket):
        return _send_sealed(sock, header, payload, ident, block)
    frames = [] if ident is None else [ident]
    frames.append(header.pack())
    copy = True
    if payload is not None:
        parts = _payload_frames(payload)
        frames.extend(parts)
        copy = len(parts) == 1 and memoryview(payload).nbytes < ZERO_COPY_THRESHOLD
    _send_frames(sock, frames, ident, block, copy)


def _send_sealed(sock, header, payload, ident, block):
    parts = [] if payload is None else _payload_frames(payload)
    if ident is None:
        frames = sock.seal.seal(header.pack(), parts)
    else:
        try:
            frames = [ident] + sock.seal.seal(ident, header.pack(), parts)
        except seal.Refused:
            raise TransportError("no sealed session with %s" % (_describe(ident),)) from None
    copy = len(frames[-1]) < ZERO_COPY_THRESHOLD
    _send_frames(sock, frames, ident, block, copy)


def _send_frames(sock, frames, ident, block, copy):
    flags = zmq.DONTWAIT if ident is not None or not block else 0
    try:
        sock.send_multipart(frames, flags=flags, copy=copy)
    except zmq.Again:
        raise QueueFull("the queue to %s is full (MXPS_HWM messages unread)"
                        % (_describe(ident),)) from None
    except zmq.ZMQError as e:
        if e.errno == zmq.EHOSTUNREACH:
            raise TransportError("peer %s is gone" % (_describe(ident),)) from None
        raise


def _describe(ident):
    if ident is None:
        return "the peer"
    try:
        text = ident.decode("ascii")
        if text.isprintable():
            return text
    except UnicodeDecodeError:
        pass
    return "connection %s" % ident.hex()


def recv(sock, with_ident=False, land=None):
    """Receive one message: (ident, header, payload_frame_or_None); ident is None on DEALER.

    A payload that came in several frames is joined into one frame.  ``land(header, nbytes)``
    (a DEALER's) may give a writable uint8 array of the payload's size once the header is read
    (and, sealed, authenticated): the payload is then deciphered or copied straight into it,
    and the payload returned is a view of it.  Raises ``wire.WireError`` for anything that is
    not one header frame followed by a payload as ``send`` cuts it; the message is consumed
    either way, so the caller drops it and goes on."""
    frames = sock.recv_multipart(copy=False)
    ident = None
    if with_ident:
        ident = frames[0].bytes
        frames = frames[1:]
    if not frames:
        raise wire.WireError("empty message")
    if isinstance(sock, SealedSocket):
        try:
            if ident is None:
                header, payload = sock.seal.open(frames, land)
            else:
                header, payload = sock.seal.open(ident, frames)
        except seal.Refused as e:
            e.ident = ident
            raise
        return ident, header, payload
    header = wire.unpack(frames[0].buffer)
    parts = frames[1:]
    if len(parts) > 1 and (any(len(p) != FRAME_BYTES for p in parts[:-1])
                           or not 0 < len(parts[-1]) <= FRAME_BYTES):
        raise wire.WireError("%r: a payload in %d frames, not cut as the transport cuts one "
                             "(every frame but the last of %d bytes)" % (header, len(parts),
                                                                         FRAME_BYTES))
    out = seal.landing(land, header, sum(len(p) for p in parts)) if parts else None
    if out is not None:
        at = 0
        for p in parts:
            n = len(p)
            out[at:at + n] = np.frombuffer(p.buffer, np.uint8)
            at += n
        return ident, header, seal.Payload(out)
    if len(parts) <= 1:
        return ident, header, parts[0] if parts else None
    return ident, header, zmq.Frame(b"".join(p.buffer for p in parts))


def is_interrupted(exc):
    return isinstance(exc, zmq.ZMQError) and exc.errno == errno.EINTR


Tally = auth.Tally
HandshakeWatch = auth.HandshakeWatch
