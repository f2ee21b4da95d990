"""Typed payloads: structured data with arrays in one frame, never pickle.

A server must not run code a peer chose, so nothing it receives is unpickled (the one exception,
MXNet's optimizer object from worker 0, is ``roles.server_state``'s business).  Migration parts
(value, optimizer state, update count, round) and optimizer states (GET_STATES replies,
SET_STATES requests) travel in this format instead:

    offset     size  field
    0          4     magic b"MXTY"
    4          4     n, the length of the description (uint32, little-endian)
    8          n     the description: JSON (UTF-8), {"bytes": <length of the data>, "value": V}
    8+n        pad   zero bytes up to a multiple of 8
    ...        bytes the data: every array's raw bytes, in the order the description names
                     them, each at its own offset (a multiple of 8) from the data's start

A value V in the description is one of

    null, true, false, an integer (int64), a float, a string     that scalar
    [V, ...]                                                     a list
    {"tuple": [V, ...]}                                          a tuple
    {"dict": [[K, V], ...]}                                      a dict; a key K is a scalar or
                                                                 a tuple of keys
    {"array": [dtype code, [shape], offset, nbytes]}             a numpy array

Dtype codes are the wire's (``frame.dtype_code``): the seven dtypes MXNet's kvstore carries, so
no object array can be described.  JSON because it is in the standard library and the
description is small next to the arrays (msgpack is not installed here).

``unpack`` checks everything before it builds anything: the magic, every size against the
frame, known dtypes, shapes that match their byte counts, arrays in order and not overlapping
(so a frame describes at most its own size in array bytes), nesting at most ``MAX_DEPTH``
deep, int64 integers, hashable and distinct dict keys.  What fails raises ``frame.WireError``
naming the problem, and nothing else: garbage in a payload is an error reply, not a crash.
Arrays come back as read-only views of the frame (no copy); copy what is kept.
"""
import json
import math
import struct

import numpy as np

from .frame import WireError, dtype_code, dtype_of

MAGIC = b"MXTY"
_PREFIX = struct.Struct("<4sI")
ALIGN = 8
MAX_DEPTH = 32          # optimizer states are tuples of tuples of arrays: a few levels at most
MAX_DIMS = 32           # numpy's own limit is 32 (1.x)
_INT_MIN, _INT_MAX = -2 ** 63, 2 ** 63 - 1
_TAGS = ("tuple", "dict", "array")


def _aligned(n):
    return -(-n // ALIGN) * ALIGN


# ---------------------------------------------------------------------------------- encoding

class _Writer:
    __slots__ = ("chunks", "size")

    def __init__(self):
        self.chunks = []      # (offset, contiguous array)
        self.size = 0

    def array(self, a):
        if not a.flags.c_contiguous:
            a = a.copy(order="C")         # (np.ascontiguousarray makes 0-d arrays 1-d)
        code = dtype_code(a.dtype)
        offset = _aligned(self.size)
        self.chunks.append((offset, a))
        self.size = offset + a.nbytes
        return {"array": [code, list(a.shape), offset, a.nbytes]}


def _describe(value, out, depth):
    if depth > MAX_DEPTH:
        raise ValueError("typed payload: nesting deeper than %d levels" % MAX_DEPTH)
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        value = int(value)
        if not _INT_MIN <= value <= _INT_MAX:
            raise ValueError("typed payload: integer %d does not fit in int64" % value)
        return value
    if isinstance(value, (float, np.floating)):
        return float(value)
    if isinstance(value, np.ndarray):
        return out.array(value)
    if isinstance(value, list):
        return [_describe(v, out, depth + 1) for v in value]
    if isinstance(value, tuple):
        return {"tuple": [_describe(v, out, depth + 1) for v in value]}
    if isinstance(value, dict):
        pairs = []
        for k, v in value.items():
            _check_key(k, TypeError)
            pairs.append([_describe(k, out, depth + 1), _describe(v, out, depth + 1)])
        return {"dict": pairs}
    raise TypeError("typed payload: cannot carry a %s (scalars, lists, tuples, dicts and numpy "
                    "arrays only)" % type(value).__name__)


def pack(value):
    """``value`` (None, bools, int64 integers, floats, strings, lists, tuples, dicts with scalar
    or tuple keys, numpy arrays of the wire's dtypes, nested up to ``MAX_DEPTH``) as one typed
    payload (bytes)."""
    out = _Writer()
    tree = _describe(value, out, 0)
    desc = json.dumps({"bytes": out.size, "value": tree}, separators=(",", ":")).encode()
    start = _aligned(_PREFIX.size + len(desc))
    parts = [_PREFIX.pack(MAGIC, len(desc)), desc, bytes(start - _PREFIX.size - len(desc))]
    pos = 0
    for offset, a in out.chunks:
        parts.append(bytes(offset - pos))
        parts.append(memoryview(a).cast("B") if a.nbytes else b"")
        pos = offset + a.nbytes
    return b"".join(parts)


# ---------------------------------------------------------------------------------- decoding

class _Object:
    """A JSON object as its list of pairs (so that tags are checked, not merged)."""

    __slots__ = ("pairs",)

    def __init__(self, pairs):
        self.pairs = pairs


def _check_key(k, error=WireError):
    """A dict key must be a scalar or a tuple of keys (hashable, comparable as sent)."""
    if k is None or isinstance(k, (bool, int, float, str, np.integer, np.floating)):
        return
    if isinstance(k, tuple):
        for x in k:
            _check_key(x, error)
        return
    raise error("typed payload: a dict key is a %s (scalars or tuples of them only)"
                % type(k).__name__)


class _Reader:
    __slots__ = ("data", "cursor")

    def __init__(self, data):
        self.data = data      # memoryview of the data section
        self.cursor = 0       # end of the last array read: the next one starts at or after it

    def array(self, spec):
        if not isinstance(spec, list) or len(spec) != 4:
            raise WireError("typed payload: an array is described by [dtype code, shape, "
                            "offset, nbytes], got %s" % _show(spec))
        code, shape, offset, nbytes = spec
        dt = dtype_of(_int(code, "dtype code"))
        if not isinstance(shape, list) or len(shape) > MAX_DIMS:
            raise WireError("typed payload: an array shape is a list of at most %d sizes, got %s"
                            % (MAX_DIMS, _show(shape)))
        dims = [_int(d, "array dimension") for d in shape]
        if any(d < 0 for d in dims):
            raise WireError("typed payload: negative array dimension in %s" % (dims,))
        offset, nbytes = _int(offset, "array offset"), _int(nbytes, "array byte count")
        count = math.prod(dims)
        if count * dt.itemsize != nbytes:
            raise WireError("typed payload: a %s array of shape %s has %d bytes, not %d"
                            % (dt, tuple(dims), count * dt.itemsize, nbytes))
        if offset < self.cursor:
            raise WireError("typed payload: an array at byte %d overlaps the one before it "
                            "(ending at %d)" % (offset, self.cursor))
        if offset + nbytes > self.data.nbytes:
            raise WireError("typed payload: an array of %d bytes at byte %d ends past the "
                            "data (%d bytes)" % (nbytes, offset, self.data.nbytes))
        self.cursor = offset + nbytes
        a = np.frombuffer(self.data, dtype=dt, count=count, offset=offset)
        try:
            return a.reshape(dims)
        except ValueError as e:          # e.g. dimensions too large for numpy
            raise WireError("typed payload: array shape %s: %s" % (tuple(dims), e)) from None


def _show(x, limit=60):
    text = repr(x if not isinstance(x, _Object) else dict(x.pairs))
    return text if len(text) <= limit else text[:limit] + "..."


def _int(x, what):
    if isinstance(x, bool) or not isinstance(x, int):
        raise WireError("typed payload: %s is not an integer: %s" % (what, _show(x)))
    if not _INT_MIN <= x <= _INT_MAX:
        raise WireError("typed payload: %s %d does not fit in int64" % (what, x))
    return x


def _value(node, reader, depth):
    if depth > MAX_DEPTH:
        raise WireError("typed payload: nesting deeper than %d levels" % MAX_DEPTH)
    if node is None or isinstance(node, (bool, str, float)):
        return node
    if isinstance(node, int):
        return _int(node, "integer")
    if isinstance(node, list):
        return [_value(x, reader, depth + 1) for x in node]
    if not isinstance(node, _Object) or len(node.pairs) != 1 or node.pairs[0][0] not in _TAGS:
        raise WireError("typed payload: an object must be one of {%s: ...}, got %s"
                        % (", ".join('"%s"' % t for t in _TAGS), _show(node)))
    tag, content = node.pairs[0]
    if tag == "array":
        return reader.array(content)
    if not isinstance(content, list):
        raise WireError("typed payload: a %s holds a list, got %s" % (tag, _show(content)))
    if tag == "tuple":
        return tuple(_value(x, reader, depth + 1) for x in content)
    out = {}
    for pair in content:
        if not isinstance(pair, list) or len(pair) != 2:
            raise WireError("typed payload: a dict entry is [key, value], got %s" % _show(pair))
        k = _value(pair[0], reader, depth + 1)
        _check_key(k)
        if k in out:
            raise WireError("typed payload: dict key %s appears twice" % _show(k))
        out[k] = _value(pair[1], reader, depth + 1)
    return out


def _buffer(payload):
    if payload is None:
        raise WireError("typed payload missing: the message has no payload frame")
    buf = payload.buffer if hasattr(payload, "buffer") else payload
    try:
        return memoryview(buf).cast("B")
    except TypeError as e:
        raise WireError("typed payload: not a buffer (%s)" % e) from None


def unpack(payload):
    """The value in a typed payload (bytes, a buffer or a zmq frame); raises ``WireError``
    naming what is wrong, and nothing else."""
    buf = _buffer(payload)
    if buf.nbytes < _PREFIX.size:
        raise WireError("typed payload of %d bytes is shorter than its %d-byte prefix"
                        % (buf.nbytes, _PREFIX.size))
    magic, n = _PREFIX.unpack(buf[:_PREFIX.size])
    if magic != MAGIC:
        raise WireError("not a typed payload (magic %r, expected %r): a peer sent another "
                        "format" % (bytes(magic), MAGIC))
    start = _aligned(_PREFIX.size + n)
    if start > buf.nbytes:
        raise WireError("typed payload: a %d-byte description (padded to byte %d) does not "
                        "fit in %d bytes" % (n, start, buf.nbytes))
    try:
        top = json.loads(str(buf[_PREFIX.size:_PREFIX.size + n], "utf-8"),
                         object_pairs_hook=_Object)
    except RecursionError:
        raise WireError("typed payload: the description nests too deeply") from None
    except ValueError as e:       # JSONDecodeError, UnicodeDecodeError, huge integer literals
        raise WireError("typed payload: the description is not JSON: %s" % e) from None
    if not isinstance(top, _Object) or sorted(k for k, _ in top.pairs) != ["bytes", "value"]:
        raise WireError('typed payload: the description is not {"bytes": ..., "value": ...}: '
                        "%s" % _show(top))
    fields = dict(top.pairs)
    size = _int(fields["bytes"], "data length")
    if start + size != buf.nbytes:
        raise WireError("typed payload: description + data are %d bytes, the frame has %d"
                        % (start + size, buf.nbytes))
    return _value(fields["value"], _Reader(buf[start:]), 0)
