"""What a server's request handlers share: the refusal that goes back to the worker
(``RequestError``), the messages a handler causes (``Out``), and the checks of typed payloads
(they come from authenticated peers, but are checked anyway)."""
import numpy as np

from ..wire import frame as wire


class RequestError(ValueError):
    """A request the server refuses; the text goes back to the worker."""


class Out:
    """One message to send: ``to`` is ``CLIENT`` (``dest`` is the identity of the connection
    the request came on: a worker, or a peer server sending a part), ``PEER`` (``dest`` is a
    server rank: the loop opens a connection to it) or ``SCHEDULER`` (``dest`` is None; only
    the header's type and the payload matter, the link fills in the rest)."""

    CLIENT, PEER, SCHEDULER = "client", "peer", "scheduler"
    __slots__ = ("to", "dest", "header", "payload")

    def __init__(self, to, dest, header, payload=None):
        self.to = to
        self.dest = dest
        self.header = header
        self.payload = payload

    def __repr__(self):
        return "Out(%s %r %r)" % (self.to, self.dest, self.header)


def payload_bytes(payload):
    """The bytes of a payload: a zmq frame from the loop, or plain bytes."""
    if payload is None:
        raise wire.WireError("the message has no payload")
    return payload.bytes if hasattr(payload, "bytes") else bytes(payload)


def fields(value, what, required, optional=()):
    """``value`` as a dict with the ``required`` string keys and maybe the ``optional`` ones."""
    if not isinstance(value, dict):
        raise RequestError("%s is a %s, not a dict" % (what, type(value).__name__))
    missing = [f for f in required if f not in value]
    unknown = [repr(f) for f in value if f not in required and f not in optional]
    if missing or unknown:
        raise RequestError("%s: %s" % (what, "; ".join(
            x for x in ("missing %s" % ", ".join(missing) if missing else "",
                        "unknown %s" % ", ".join(unknown) if unknown else "") if x)))
    return value


def count_field(value, what):
    """A non-negative integer field (a key, an offset, a round, an update count)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RequestError("%s must be a non-negative integer, got %r" % (what, value))
    return value


def check_state(state, length, what):
    """An optimizer state as it travels: None, a flat float array of the slice's ``length``
    elements, or a tuple/list of states (Adam's mean and variance, multi-precision pairs)."""
    if state is None:
        return
    if isinstance(state, (tuple, list)):
        for x in state:
            check_state(x, length, what)
        return
    if not (isinstance(state, np.ndarray) and state.ndim == 1 and state.dtype.kind == "f"
            and state.size == length):
        desc = ("a %s array of shape %s" % (state.dtype, state.shape)
                if isinstance(state, np.ndarray) else "a %s" % type(state).__name__)
        raise RequestError("%s: an optimizer state is None, a float array of the slice's %d "
                           "elements or a tuple of states, got %s" % (what, length, desc))


def floating(key, dtype):
    """With the optimizer on the servers a key must be floating point (MXNet's update
    operators refuse integers: "This operation only support floating point types")."""
    if np.dtype(dtype).kind != "f":
        raise RequestError("key %d has dtype %s: the optimizer on the servers updates "
                           "floating-point keys only" % (key, np.dtype(dtype)))
