"""The sealed data plane: every message between a node and a server, under AES-256-GCM.

With a job secret the scheduler's connections stay CurveZMQ (``mxps.wire.auth``); the bulk
traffic (workers to servers, servers to servers) runs over connections whose ZMTP handshake is
PLAIN with a one-time token (``auth.DataGate``: a node without the secret is refused before any
message is delivered), and every message on them is sealed here: encrypted and authenticated
with AES-256-GCM (OpenSSL through the ``cryptography`` package), about five times CurveZMQ's
XSalsa20-Poly1305 per core and without its extra copy (docs/SECURITY.md).

A *session* is one client connection: a node (``worker:<rank>`` / ``server:<rank>``, the
DEALER's zmq identity) talking to one server process.  The client picks 16 random bytes for
it; both directions' keys are HKDF-SHA256 of the job's data key (derived from the secret),
salted with the server process's 16-byte nonce (published through the scheduler), over the
client's name and the client's random bytes.  So keys differ per session, per server process
and per job, and a message sealed for one server process opens nowhere else.

A message is one zmq multipart message:

    frame 0:  prefix || AES-GCM(header)            (the prefix is the header's associated data)
    frame i:  AES-GCM(payload part i), i = 1..n    (parts of at most FRAME_BYTES, as today)

    prefix (client to server): b"MXS1", counter (u64), n (u32), client random (16 bytes)
    prefix (server to client): b"MXS1", counter (u64), n (u32)

The 96-bit GCM nonce of frame i is the message's counter + i (little-endian), so nonces never
repeat under a key; a sender's counter grows by n + 1 per message, and a receiver takes a
message only if its counter is above every counter it has taken in that session: a replayed,
reordered or re-sent message is refused, within a session and (the keys differ) across
sessions.  The part count is in the authenticated prefix, so parts cannot be dropped or added,
and a part's nonce fixes its place, so parts cannot be swapped.  Any failure raises ``Refused``
(a ``WireError``): the caller drops the message, and nothing of it has been used.
"""
import os
import struct

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from . import frame as wire

MAGIC = b"MXS1"
TAG = 16                 # GCM tag bytes after every sealed frame
RANDOM = 16              # a session's client random, a server's nonce
_PREFIX = struct.Struct("<4sQI")
PREFIX = _PREFIX.size
CLIENT_PREFIX = PREFIX + RANDOM
_INFO = b"mxps sealed data plane v1"
SMALL = 64 * 1024        # below this a sealed part is new bytes; above, a buffer of its own
MAX_SESSIONS = 4096      # sessions a server keeps (only nodes with the secret make them)


class Refused(wire.WireError):
    """A message that is not sealed for this session (``why`` says how), dropped unused."""

    def __init__(self, message, why):
        super().__init__(message)
        self.why = why


def session_keys(data_key, client_name, client_random, server_nonce):
    """(client-to-server, server-to-client) AESGCM objects of one session."""
    okm = HKDF(hashes.SHA256(), 64, salt=server_nonce,
               info=b"\0".join((_INFO, client_name, client_random))
               ).derive(data_key)
    return AESGCM(okm[:32]), AESGCM(okm[32:])


def _nonce(counter):
    return counter.to_bytes(12, "little")


def _seal(aead, counter, prefix, header_bytes, parts):
    frames = [prefix + aead.encrypt(_nonce(counter), header_bytes, prefix)]
    for i, part in enumerate(parts, 1):
        view = memoryview(part)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B") if view.c_contiguous else memoryview(view.tobytes())
        if view.nbytes < SMALL:
            frames.append(aead.encrypt(_nonce(counter + i), view, None))
        else:
            out = np.empty(view.nbytes + TAG, np.uint8)
            aead.encrypt_into(_nonce(counter + i), view, None, out)
            frames.append(out)
    return frames


class _Payload(np.ndarray):
    """A payload in local memory with what the transport's payloads offer (a ``zmq.Frame``'s
    ``buffer``, ``bytes`` and ``len``, and a buffer itself, so it can be sent on).  Not a
    ``zmq.Frame(copy=False)``: such a frame hands its memory back through pyzmq's
    garbage-collector thread, and one freed while the interpreter exits can trip libzmq's
    assertion in that thread's signaler (SIGABRT at the end of a job)."""

    @property
    def buffer(self):
        return memoryview(self)

    @property
    def bytes(self):
        return self.tobytes()


def Payload(buffer):
    """An opened payload (``buffer``: bytes or a uint8 array), without a copy."""
    return np.frombuffer(buffer, np.uint8).view(_Payload) if isinstance(buffer, bytes) \
        else np.asarray(buffer, np.uint8).reshape(-1).view(_Payload)


def _open(aead, counter, prefix, sealed_header, parts, frame_bytes, land=None):
    """(header, payload or None) of a message whose prefix was parsed; raises Refused.

    ``land(header, nbytes)``, called once the header is authenticated, may give a writable
    uint8 array of the payload's ``nbytes``: the payload is deciphered straight into it (no
    buffer of its own, no copy after) and returned as a view of it (any other answer: the
    payload gets a buffer of its own).  Bytes of a part whose tag
    fails may be left there, but the message is refused, so they are never handed on: the
    caller's request stays unanswered until a message that verifies fills the buffer."""
    try:
        header_bytes = aead.decrypt(_nonce(counter), sealed_header, prefix)
    except InvalidTag:
        raise Refused("a message whose seal does not verify", "forged") from None
    header = wire.unpack(header_bytes)
    if not parts:
        return header, None
    sizes = [len(p) - TAG for p in parts]
    if not 0 <= sizes[-1] <= frame_bytes or (len(parts) > 1 and (
            any(s != frame_bytes for s in sizes[:-1]) or sizes[-1] == 0)):
        raise wire.WireError("%r: a payload in %d sealed parts, not cut as the transport cuts "
                             "one" % (header, len(parts)))
    total = sum(sizes)
    out = landing(land, header, total)
    try:
        if out is None:
            if len(parts) == 1 and sizes[0] < SMALL:
                return header, Payload(aead.decrypt(_nonce(counter + 1), parts[0].buffer,
                                                    None))
            out = np.empty(total, np.uint8)
        at = 0
        for i, (part, size) in enumerate(zip(parts, sizes), 1):
            aead.decrypt_into(_nonce(counter + i), part.buffer, None, out[at:at + size])
            at += size
    except InvalidTag:
        raise Refused("%r: a payload part whose seal does not verify" % (header,),
                      "forged") from None
    return header, Payload(out)


def landing(land, header, nbytes):
    """The buffer ``land(header, nbytes)`` gives, if it is a uint8 array of ``nbytes``."""
    if land is None:
        return None
    out = land(header, nbytes)
    if isinstance(out, np.ndarray) and out.dtype == np.uint8 and out.ndim == 1 \
            and out.size == nbytes and out.flags.writeable and out.flags.c_contiguous:
        return out
    return None


def _prefix(frame0, size):
    buf = frame0.buffer
    if len(buf) < size + TAG + wire.HEADER_SIZE:
        if bytes(buf[:4]) == wire.MAGIC:
            raise Refused("an unsealed mxps message", "unsealed")
        raise Refused("a message too short to be sealed (%d bytes)" % len(buf), "garbage")
    magic, counter, n = _PREFIX.unpack_from(buf)
    if magic != MAGIC:
        raise Refused("not a sealed mxps message", "unsealed" if magic == wire.MAGIC
                      else "garbage")
    return buf, counter, n


def _check_counter(counter, n, seen):
    if counter <= seen:
        raise Refused("a replayed or reordered message (counter %d, already at %d)"
                      % (counter, seen), "replayed")
    if counter + n >= 1 << 64:
        raise Refused("a counter at its end", "garbage")


class ClientSeal:
    """One session, at the client (a DEALER to one server)."""

    def __init__(self, data_key, name, server_nonce, frame_bytes):
        self.name = name
        self.random = os.urandom(RANDOM)
        self._out, self._in = session_keys(data_key, name, self.random, server_nonce)
        self.frame_bytes = frame_bytes
        self._sent = 0            # the next counter this side seals with
        self._seen = -1           # the last counter taken from the server

    def seal(self, header_bytes, parts):
        counter = self._sent
        self._sent += 1 + len(parts)
        prefix = _PREFIX.pack(MAGIC, counter, len(parts)) + self.random
        return _seal(self._out, counter, prefix, header_bytes, parts)

    def open(self, frames, land=None):
        """(header, payload) of a message from the server; ``land`` as ``_open``'s."""
        buf, counter, n = _prefix(frames[0], PREFIX)
        if n != len(frames) - 1:
            raise Refused("a message of %d parts whose prefix says %d" % (len(frames) - 1, n),
                          "forged")
        _check_counter(counter, n, self._seen)
        header, payload = _open(self._in, counter, bytes(buf[:PREFIX]), buf[PREFIX:],
                                frames[1:], self.frame_bytes, land)
        self._seen = counter + n
        return header, payload


class _Session:
    __slots__ = ("to_server", "to_client", "sent", "seen")

    def __init__(self, to_server, to_client):
        self.to_server = to_server
        self.to_client = to_client
        self.sent = 0
        self.seen = -1


class ServerSeal:
    """Every session of one server's listening socket.  A session is made at its first message
    that opens under its keys; replies go under the newest session of the node they are for."""

    def __init__(self, data_key, nonce, frame_bytes):
        self.data_key = data_key
        self.nonce = nonce
        self.frame_bytes = frame_bytes
        self._sessions = {}       # (node name, client random) -> _Session
        self._current = {}        # node name -> its newest _Session
        # the names of the job's nodes, once known (the WELCOME): a message from any other
        # connection is refused before a byte of it is deciphered
        self.members = None

    def open(self, ident, frames):
        """(header, payload) of a message from the connection named ``ident``."""
        if self.members is not None and ident not in self.members:
            raise Refused("a connection with identity %r is not a node of this job" % (ident,),
                          "stranger")
        buf, counter, n = _prefix(frames[0], CLIENT_PREFIX)
        if n != len(frames) - 1:
            raise Refused("a message of %d parts whose prefix says %d" % (len(frames) - 1, n),
                          "forged")
        random = bytes(buf[PREFIX:CLIENT_PREFIX])
        session = self._sessions.get((ident, random))
        fresh = session is None
        if fresh:
            if len(self._sessions) >= MAX_SESSIONS:
                raise Refused("a new session beyond %d" % MAX_SESSIONS, "garbage")
            session = _Session(*session_keys(self.data_key, ident, random, self.nonce))
        _check_counter(counter, n, session.seen)
        header, payload = _open(session.to_server, counter, bytes(buf[:CLIENT_PREFIX]),
                                buf[CLIENT_PREFIX:], frames[1:], self.frame_bytes)
        session.seen = counter + n
        if fresh:
            self._sessions[(ident, random)] = session
        self._current[ident] = session
        return header, payload

    def seal(self, ident, header_bytes, parts):
        session = self._current.get(ident)
        if session is None:
            raise Refused("no session with %r" % (ident,), "unknown")
        counter = session.sent
        session.sent += 1 + len(parts)
        return _seal(session.to_client, counter, _PREFIX.pack(MAGIC, counter, len(parts)),
                     header_bytes, parts)
