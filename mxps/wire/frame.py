"""The mxps message format.

Every message is a ZeroMQ multipart message: one fixed 56-byte header frame, optionally followed
by one payload frame (raw array bytes, sent zero-copy from numpy/NDArray memory; a JSON control
body; structured data with arrays in the typed format of ``mxps.wire.typed``; and in one place,
SET_OPTIMIZER from rank 0, MXNet's optimizer object as a pickle, which the server reads with a
restricted unpickler).  The header:

    offset size field
    0      4    magic  b"MXPS"
    4      1    version (WIRE_VERSION)
    5      1    type   (MsgType)
    6      1    dtype  (DTYPE codes below; 255 = no array payload)
    7      1    flags  (a push's: bits 0-5 its compression codec, wire.compression; bit 6
                   RESENT, sent again after a failover; bit 7 CHECKPOINT, the disk
                   store's checkpoint round, store.checkpoints)
    8      4    key    (int32, the kvstore key id)
    12     4    sender (int32, rank of the sending node in its role; -1 = unknown)
    16     8    iteration (int64: per-key push count of the sending worker, 1-based)
    24     4    plan version (uint32)
    28     4    status (int32, 0 = ok; error replies carry the error text as payload)
    32     8    offset (uint64, first element of the slice within the key's flat array)
    40     8    length (uint64, number of elements in the slice)
    48     8    request id (uint64, echoed in the reply)

Little-endian throughout.  ``pack``/``unpack`` are the only places that know this layout.
"""
import enum
import struct

import numpy as np

from ..kernels.dtypes import DTYPES

MAGIC = b"MXPS"
WIRE_VERSION = 1
_HEADER = struct.Struct("<4sBBBBiiqIiQQQ")
HEADER_SIZE = _HEADER.size
NO_DTYPE = 255

# dtype codes follow MXNet's own type flags (mshadow::TypeFlag): the kernels' table
_DTYPES = DTYPES
_CODES = {v: k for k, v in _DTYPES.items()}


class WireError(ValueError):
    """A message that is not a valid mxps message (bad magic, version, size or type)."""


#: a push's flag: worker 0 marks every push of the round the servers checkpoint
#: (MXPS_STORE_CHECKPOINT_SECONDS, store.checkpoints); the low six bits name a codec
CHECKPOINT = 0x80
#: a request sent again to a dead server's successor (MXPS_FAILOVER, docs/FAILOVER.md): a
#: push of a round the successor's slice has already applied is acknowledged and dropped
RESENT = 0x40
CODEC_MASK = 0x3F


class MsgType(enum.IntEnum):
    # control plane (node <-> scheduler)
    REGISTER = 1        # node -> scheduler: JSON {role, host, port, pid}
    WELCOME = 2         # scheduler -> node: JSON {rank, servers, num_workers, ...}
    BARRIER = 3         # worker -> scheduler; reply when every worker arrived
    HEARTBEAT = 4       # node -> scheduler (and the scheduler's echo)
    FINISH = 5          # worker -> scheduler: done, ready to shut down
    SHUTDOWN = 6        # scheduler -> node: exit cleanly
    ABORT = 7           # scheduler -> node, or node -> scheduler: exit with the error payload
    BYE = 8             # node -> scheduler: got the SHUTDOWN, leaving (the scheduler ends
                        # once every node said it, so no SHUTDOWN is lost with its socket)
    # data plane (worker <-> server)
    INIT = 10           # rank 0 -> server: initial value of a slice; `iteration` carries the
                        # key's row width (elements per index of its first axis; 0: unknown)
    PUSH = 11           # worker -> server: gradient slice (ack after it is accounted)
    PULL = 12           # worker -> server: value of a slice after `iteration` rounds
    PUSHPULL = 13       # PUSH, then reply with the value after that round (one round trip)
    SET_OPTIMIZER = 14  # rank 0 -> server: pickled optimizer (only from rank 0; restricted)
    GET_STATES = 15     # worker -> server: optimizer states of its slices (typed payload)
    SET_STATES = 16     # worker -> server: restore optimizer states (typed payload)
    PROBE = 24          # worker -> server: N bytes, answered with N bytes (bandwidth probe)
    BANDWIDTH = 25      # worker -> scheduler: JSON measured rates; scheduler -> workers: agreed
    REPLAN = 26         # worker -> scheduler: traffic of the last rounds, waits for the answer;
                        # scheduler -> workers: JSON {version, table or null} (live re-plan)
    PLAN = 27           # scheduler -> server: JSON {version, old, new tables}; server -> sched:
                        # the new plan's state is in place (every moved slice arrived)
    MIGRATE = 28        # server -> server: a moved part of a slice (value, optimizer state,
                        # update count), typed payload; answered with ACK
    LTP_HELLO = 29      # worker -> server: JSON {host, port, mtu} of the worker's UDP socket
                        # (MXPS_PUSH=ltp); answered with DATA: JSON {port, key, budget}
    LEAVE = 30          # worker -> server: this worker pushes no more (MXPS_MODE=wsp: rounds
                        # stop counting on it); answered with ACK
    PUSH_ROWS = 31      # worker -> server: a row-sparse gradient's rows inside a slice, typed
                        # payload {cols, ids, values} (docs/SPARSE.md); answered with ACK
    PULL_ROWS = 32      # worker -> server: rows of a slice after `iteration` rounds, typed
                        # payload {cols, ids}; answered with DATA (the rows' elements in it)
    INIT_TABLE = 33     # rank 0 -> server: a slice's initial value as a rule, typed payload
                        # {scale, seed} (mxps.store.table_init); `iteration`: the row width
    SEED = 34           # worker -> server: a moved part's weights from the worker's own copy
                        # (MXPS_REPLAN_SEED: they need not cross the old owner's link);
                        # answered with ACK
    FAILOVER = 35       # scheduler -> workers: JSON {version, dead}: a server is lost, its
                        # slices go to survivors; worker 0 -> scheduler: {version, dead, old,
                        # new}, the tables it computed (placement.failover); with
                        # "divert": true the server is alive and slow (MXPS_DIVERT)
    REPLICA = 36        # server -> its buddy: a slice's optimizer state after a round, typed
                        # payload {key, offset, length, applied, state, count} (MXPS_REPLICA);
                        # answered with ACK
    SLOW = 37           # worker -> scheduler: JSON {server, round, ratio}: that server's
                        # acknowledgements slowed down inside the round (MXPS_DIVERT)
    VALUE = 38          # server -> the old owner of a diverted slice: send its weights too
                        # (no worker pulled the round it applied); answered with ACK and a
                        # MIGRATE of the whole slice
    STATE = 39          # server -> the buddy of a diverted slice's slow server: its replica of
                        # the slice's optimizer state after round `iteration` (MXPS_REPLICA);
                        # answered with DATA, typed {state}, or ACK if it keeps none
    ACK = 20            # reply without payload
    DATA = 21           # reply with a slice
    ERROR = 22          # reply: request failed, payload = message (utf-8)


def dtype_code(dtype):
    """The wire code of a numpy dtype; raises WireError for dtypes mxps does not carry."""
    try:
        return _CODES[np.dtype(dtype)]
    except KeyError:
        raise WireError("dtype %s cannot be sent by mxps (supported: %s)"
                        % (np.dtype(dtype), ", ".join(str(d) for d in _CODES))) from None


def dtype_of(code):
    """The numpy dtype of a wire code."""
    try:
        return _DTYPES[code]
    except KeyError:
        raise WireError("unknown dtype code %d" % code) from None


def _type_name(type_):
    return MsgType(type_).name if type_ in MsgType._value2member_map_ else str(type_)


class Header:
    """A decoded header; plain attributes, cheap to build."""

    __slots__ = ("type", "dtype", "flags", "key", "sender", "iteration", "plan_version",
                 "status", "offset", "length", "request_id")

    def __init__(self, type, key=0, sender=-1, iteration=0, plan_version=0, offset=0,
                 length=0, request_id=0, dtype=NO_DTYPE, flags=0, status=0):
        self.type = type
        self.dtype = dtype
        self.flags = flags
        self.key = key
        self.sender = sender
        self.iteration = iteration
        self.plan_version = plan_version
        self.status = status
        self.offset = offset
        self.length = length
        self.request_id = request_id

    def pack(self):
        return _HEADER.pack(MAGIC, WIRE_VERSION, int(self.type), self.dtype, int(self.flags),
                            self.key, self.sender, self.iteration, self.plan_version,
                            self.status, self.offset, self.length, self.request_id)

    def reply(self, type, **changes):
        """A header answering this one (same key, slice, iteration and request id)."""
        h = Header(type, self.key, self.sender, self.iteration, self.plan_version, self.offset,
                   self.length, self.request_id, self.dtype, self.flags, self.status)
        for k, v in changes.items():
            setattr(h, k, v)
        return h

    def __eq__(self, other):
        return isinstance(other, Header) and all(
            getattr(self, s) == getattr(other, s) for s in self.__slots__)

    def __repr__(self):
        name = _type_name(self.type)
        return ("Header(%s key=%d sender=%d iter=%d plan=%d off=%d len=%d req=%d)"
                % (name, self.key, self.sender, self.iteration, self.plan_version, self.offset,
                   self.length, self.request_id))


def unpack(buf):
    """Decode a header frame; raises WireError naming what is wrong."""
    b = memoryview(buf)
    if b.nbytes != HEADER_SIZE:
        raise WireError("header frame has %d bytes, expected %d" % (b.nbytes, HEADER_SIZE))
    (magic, version, type_, dtype, flags, key, sender, iteration, plan_version, status,
     offset, length, request_id) = _HEADER.unpack(b)
    if magic != MAGIC:
        raise WireError("bad magic %r: not an mxps peer (is a native MXNet node listening on "
                        "this port?)" % (magic,))
    if version != WIRE_VERSION:
        raise WireError("wire version %d, this mxps speaks %d: mixed mxps versions in one job"
                        % (version, WIRE_VERSION))
    if type_ not in MsgType._value2member_map_:
        raise WireError("unknown message type %d" % type_)
    return Header(type_, key, sender, iteration, plan_version, offset, length, request_id,
                  dtype, flags, status)


def payload_array(header, frame):
    """View a DATA/PUSH payload frame as a flat numpy array (no copy); checks its size.
    Raises WireError, and nothing else, for any frame that does not fit the header (none at
    all, a wrong size, a dtype code mxps does not know)."""
    dt = dtype_of(header.dtype)
    if frame is None:
        raise WireError("key %d: %s without its payload (%d x %s)"
                        % (header.key, _type_name(header.type), header.length, dt))
    try:
        buf = memoryview(frame.buffer if hasattr(frame, "buffer") else frame)
    except TypeError as e:
        raise WireError("key %d: the payload is not a buffer (%s)" % (header.key, e)) from None
    if buf.nbytes != header.length * dt.itemsize:
        raise WireError("key %d: payload has %d bytes, header says %d x %s"
                        % (header.key, buf.nbytes, header.length, dt))
    return np.frombuffer(buf, dtype=dt)
