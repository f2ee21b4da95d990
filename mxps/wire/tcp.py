"""Reliable transport: ZeroMQ over TCP (ROUTER on the listening side, DEALER per peer).

The transport moves (header, payload) messages and knows nothing about keys or placement.
Large payloads go zero-copy (``copy=False``): zmq keeps a reference to the buffer until it has
been written to the socket.  Every blocking wait in mxps goes through ``poll`` with a timeout.
"""
import errno
import socket

import zmq

from . import frame as wire

ZERO_COPY_THRESHOLD = 64 * 1024   # below this a copy is cheaper than zmq's zero-copy bookkeeping


class TransportError(RuntimeError):
    """A peer could not be reached or spoke something that is not mxps."""


def context():
    return zmq.Context.instance()


def _tune(sock):
    sock.setsockopt(zmq.LINGER, 2000)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    return sock


def bind_router(host, port=None):
    """A ROUTER socket listening on host:port (a free port when port is None); (sock, port)."""
    sock = _tune(context().socket(zmq.ROUTER))
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    try:
        if port is None:
            port = sock.bind_to_random_port("tcp://%s" % host, min_port=20000, max_port=60000,
                                            max_tries=200)
        else:
            sock.bind("tcp://%s:%d" % (host, port))
    except zmq.ZMQError as e:
        sock.close(0)
        raise TransportError("cannot listen on %s:%s: %s" % (host, port, e)) from None
    return sock, port


def connect_dealer(host, port, identity=None):
    sock = _tune(context().socket(zmq.DEALER))
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect("tcp://%s:%d" % (host, port))
    return sock


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


def send(sock, header, payload=None, ident=None):
    """Send one message; ``payload`` is bytes or any buffer (sent zero-copy when large)."""
    frames = [] if ident is None else [ident]
    frames.append(header.pack())
    copy = True
    if payload is not None:
        frames.append(payload)
        copy = memoryview(payload).nbytes < ZERO_COPY_THRESHOLD
    try:
        sock.send_multipart(frames, copy=copy)
    except zmq.ZMQError as e:
        if e.errno == zmq.EHOSTUNREACH:
            raise TransportError("peer %r is gone" % (ident,)) from None
        raise


def recv(sock, with_ident=False):
    """Receive one message: (ident, header, payload_frame_or_None); ident is None on DEALER."""
    frames = sock.recv_multipart(copy=False)
    ident = None
    if with_ident:
        ident = frames[0].bytes
        frames = frames[1:]
    if not frames:
        raise wire.WireError("empty message")
    header = wire.unpack(frames[0].buffer)
    payload = frames[1] if len(frames) > 1 else None
    return ident, header, payload


def is_interrupted(exc):
    return isinstance(exc, zmq.ZMQError) and exc.errno == errno.EINTR
