"""The server's protocol as a state machine: one incoming message in, the messages to send out.

``ServerState`` holds everything a server knows (its slices, their rounds, waiting pulls, the
optimizer, the re-plan in progress) and has no sockets and no clock, so every rule below can be
driven message by message in one process (tests/test_server_state.py); ``mxps.roles.server``
is the loop that feeds it from the sockets and sends what it returns (``Out``).  The one clock
is a trace's (MXPS_TRACE, ``mxps.placement.trace``): with a ``trace`` recorder the state
appends a timestamped row for each push, round, pull and migration step; hooks only, nothing
the state decides depends on them.

Numerics follow MXNet 1.9.1's KVStoreDistServer (src/kvstore/kvstore_dist_server.h):
- sync mode: the pushes of all DMLC_NUM_WORKER workers for one round of a key are summed
  (first push copied, later ones added), then either the optimizer runs once on the sum
  (``updater(key, merged, stored)``, update on kvstore) or the sum becomes the stored value
  (update on workers); pulls for that round are answered after that.
- async mode: every push is applied on arrival.
Rounds are numbered by the workers (per-key push count), so a push that arrives early (a worker
already in round r+1) waits in its own accumulator instead of corrupting round r.  The updater
gets the key's own index, so Adam's per-index update counts and lr/wd multipliers behave as in
MXNet.  A bad request gets an ERROR reply naming the key and the cause; the server keeps serving.
Live re-planning (moving slices between servers) is described in docs/REPLAN.md.

Trust: ``header.sender`` is the authenticated rank of the connection a request came on (the
loop overwrites whatever the header claimed), so the rules below can rely on it.  Data never
travels as pickle: migration parts and optimizer states are typed payloads
(``mxps.wire.typed``: a JSON description plus raw arrays, checked before use).  The one pickle
left is MXNet's optimizer object (only pickling carries it, as in MXNet's own servers): it is
read only from worker 0, by an unpickler that resolves nothing but optimizer and learning-rate
scheduler classes (``_read_optimizer``), and installed only once it is an
``mxnet.optimizer.Optimizer`` with every attribute a fresh one of its class has.  Keys are
initialised once, by worker 0.  Nothing a message holds raises out of the three entry points:
a refusal is an ERROR reply, a message that is nobody's request is dropped and counted
(``drops``), a PLAN that cannot be applied is reported to the scheduler as a failed plan.
"""
import collections
import heapq
import io
import json
import logging
import numbers
import pickle
import sys
import time

import mxnet as mx
import numpy as np

from ..kernels.ndview import cut_state, numpy_view
from ..kernels.accum import add_into, copy_into
from ..kernels import ltp_packet
from ..ltp import close as ltp_close, rounds as ltp_rounds
from ..placement import plan
from ..store.disk import DiskSlice, geometry as disk_geometry, state_template, \
    step as disk_step
from ..store.rows import RowLayout
from ..store.table_init import TableInit
from ..store.memory import MemorySlice
from ..wire import compression, frame as wire, typed
from ..wire.auth import Tally
from ..wire.frame import MsgType
from ..store import row_sets as sparse
from . import wsp as wsp_rules

log = logging.getLogger("mxps.server")


class _Drop(Exception):
    """An LTP packet that fits no open round; the argument names the counter."""


def _put_state(state, saved, lo, hi):
    """Write ``saved`` (``cut_state``'s copies) back into elements [lo, hi) of ``state``."""
    if state is None or saved is None:
        return
    if isinstance(state, (tuple, list)):
        for s, v in zip(state, saved):
            _put_state(s, v, lo, hi)
        return
    state.wait_to_read()       # the update that wrote it has finished
    numpy_view(state)[lo:hi] = saved


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


def _bytes(payload):
    """The bytes of a payload: a zmq frame from the loop, or plain bytes."""
    if payload is None:
        raise wire.WireError("the message has no payload")
    return payload.bytes if hasattr(payload, "bytes") else bytes(payload)


class _OptimizerUnpickler(pickle.Unpickler):
    """Reads MXNet's pickled optimizer resolving only what an optimizer is made of: the
    ``Optimizer`` and ``LRScheduler`` classes of modules this server has imported (MXNet's
    own, or a custom one's module imported before mxps), plain builtins and numpy's scalar
    reconstructors.  Any other global (``os.system``, ``builtins.eval``, ``subprocess.Popen``,
    a module to import) is refused before anything can call it: even worker 0's bytes run no
    code beyond an optimizer's own ``__init__``/``__setstate__``."""

    _PLAIN = {("builtins", n) for n in ("object", "set", "frozenset", "complex", "slice",
                                         "bytearray")} | {
        ("copyreg", "_reconstructor"), ("collections", "OrderedDict"), ("numpy", "dtype"),
        ("numpy", "ndarray"), ("numpy.core.multiarray", "scalar"),
        ("numpy.core.multiarray", "_reconstruct")}

    def find_class(self, module, name):
        if (module, name) in self._PLAIN:
            return super().find_class(module, name)
        obj = sys.modules.get(module)
        for part in name.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, type) and issubclass(obj, (mx.optimizer.Optimizer,
                                                      mx.lr_scheduler.LRScheduler)):
            return obj
        raise pickle.UnpicklingError(
            "%s.%s is not an optimizer or learning-rate scheduler class known to this server "
            "(a custom optimizer's module must be imported before mxps)" % (module, name))


def _read_optimizer(h, payload):
    """The optimizer of a SET_OPTIMIZER request: only worker 0 may send one (refused unread
    otherwise), and it must be an ``mxnet.optimizer.Optimizer``."""
    if h.sender != 0:
        raise RequestError("SET_OPTIMIZER from worker %d refused unread: only worker 0 sets "
                           "the optimizer" % h.sender)
    data = _bytes(payload)
    try:
        optimizer = _OptimizerUnpickler(io.BytesIO(data)).load()
    except Exception as e:
        raise RequestError("SET_OPTIMIZER from worker 0: the optimizer cannot be read (%s: %s); "
                           "nothing installed" % (type(e).__name__, e)) from None
    if not isinstance(optimizer, mx.optimizer.Optimizer):
        raise RequestError("SET_OPTIMIZER from worker 0 carries a %s, not an "
                           "mxnet.optimizer.Optimizer; nothing installed"
                           % type(optimizer).__name__)
    problem = _hollow(optimizer)
    if problem:
        raise RequestError("SET_OPTIMIZER from worker 0: the %s is not usable (%s); nothing "
                           "installed" % (type(optimizer).__name__, problem))
    return optimizer


def _blank(cls):
    """The attributes of a fresh optimizer of ``cls`` (the base class's if ``cls`` needs
    arguments): what an unpickled one must have too."""
    try:
        return vars(cls())
    except Exception:
        return vars(mx.optimizer.Optimizer())


def _hollow(optimizer):
    """What an unpickled optimizer lacks that a fresh one of its class has (an attribute, a
    dict where the fresh one has one, a number or None where it has a number), or None.  A
    corrupted pickle can still build an ``Optimizer``; installed, it would fail every update of
    every round (and GET_STATES) instead of being refused once."""
    have, blank = vars(optimizer), _blank(type(optimizer))
    missing = sorted(n for n in blank if n not in have and n != "param_dict")
    if missing:
        return "no %s" % ", ".join(missing)
    for name, fresh in blank.items():
        got = have.get(name)
        if isinstance(fresh, dict) and not isinstance(got, dict):
            return "%s is a %s, not a dict" % (name, type(got).__name__)
        if isinstance(fresh, numbers.Real) and not isinstance(fresh, bool) and \
                not isinstance(got, (numbers.Real, type(None))):
            return "%s is a %s, not a number" % (name, type(got).__name__)
    return None


# -- checking typed payloads (they come from authenticated peers, but are checked anyway) -------

def _fields(value, what, required, optional=()):
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


def _count(value, what):
    """A non-negative integer field (a key, an offset, a round, an update count)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RequestError("%s must be a non-negative integer, got %r" % (what, value))
    return value


def _check_state(state, length, what):
    """An optimizer state as it travels: None, a flat float array of the slice's ``length``
    elements, or a tuple/list of states (Adam's mean and variance, multi-precision pairs)."""
    if state is None:
        return
    if isinstance(state, (tuple, list)):
        for x in state:
            _check_state(x, length, what)
        return
    if not (isinstance(state, np.ndarray) and state.ndim == 1 and state.dtype.kind == "f"
            and state.size == length):
        desc = ("a %s array of shape %s" % (state.dtype, state.shape)
                if isinstance(state, np.ndarray) else "a %s" % type(state).__name__)
        raise RequestError("%s: an optimizer state is None, a float array of the slice's %d "
                           "elements or a tuple of states, got %s" % (what, length, desc))


def optimizer_index(key, offset):
    """The optimizer's index for the slice of ``key`` starting at element ``offset``: the key
    itself for a key's first slice (as MXNet's server), a distinct index for a key's further
    slices on the same server (adaptive plans cut large slices into chunks so that one chunk's
    pull overlaps the next chunk's push).  Every slice of a key is updated once per round, so
    each index's update count equals the key's, and the updates are elementwise: the same
    numbers as one index per key."""
    return key if offset == 0 else key + (offset << 32)


class _Round:
    __slots__ = ("acc", "acc_nd", "senders", "ltp", "closed", "frozen", "wake", "parts",
                 "scale", "pushes")

    def __init__(self, acc, acc_nd, parts=None):
        self.acc = acc            # numpy view of the sum
        self.acc_nd = acc_nd      # the NDArray behind it (update on servers), or None
        self.parts = parts        # a row-sparse round: its pushes' (RowSet, padded block)
        self.scale = 1.0          # WSP: W / gradients
        self.pushes = 0           # WSP: gradients in it (a late worker's can be two)
        self.senders = set()
        self.ltp = None           # MXPS_PUSH=ltp: the packets' accounting (ltp.rounds.LtpRound)
        self.closed = False       # ... and whether Early Close ended it
        self.frozen = ()          # element ranges no worker delivered (kept as they are)
        self.wake = None          # the earliest look at it already scheduled (on_tick)

    def complete(self, num_workers):
        return self.closed if self.ltp is not None else len(self.senders) >= num_workers


class WspSettings:
    """What a server's WSP rounds follow (docs/WSP.md): ``k`` workers per round (0: chosen from
    the measured push intervals, ``wsp.choose_k``), the staleness bound ``staleness``, and the
    clock push times are read from (needed for k = 0)."""

    def __init__(self, k=0, staleness=2, clock=None):
        if k == 0 and clock is None:
            raise ValueError("WSP with k chosen from push intervals needs a clock")
        self.k = k
        self.staleness = staleness
        self.clock = clock


class StoreSettings:
    """MXPS_STORE=disk (docs/STORE.md): where this server's tables go (``directory``), the
    RAM its caches may use (``cache_bytes``, shared out as keys arrive: a table that fits in
    an eighth of the budget is cached whole, a larger one gets what is left but an eighth),
    whether to reopen what a previous job flushed there (``resume``) and at which round
    (``resume_at``, agreed by the scheduler; None: the newest), and every how many rounds to
    checkpoint (``every``; 0: at the clean stop only)."""

    #: checkpoints each table keeps reachable (store.checkpoints: the newest common one)
    KEEP = 2

    def __init__(self, directory, cache_bytes, resume=False, every=0, resume_at=None):
        self.directory = directory
        self.cache_bytes = int(cache_bytes)
        self.resume = resume
        self.every = int(every)
        self.resume_at = resume_at if resume else None
        self.left = int(cache_bytes)

    def budget(self, table_bytes):
        """The cache of a new table of ``table_bytes`` (records and index)."""
        if table_bytes <= self.cache_bytes // 8 and table_bytes <= self.left:
            give = table_bytes
        else:
            give = max(0, self.left - self.cache_bytes // 8)
        self.left -= give
        return give


class _NoShare:
    """A server state without a receiver (tests): nobody to tell who owes a round."""

    def opened(self, workers):
        pass

    def settled(self, worker):
        pass


class LtpSettings:
    """What a server's LTP rounds follow (docs/LTP.md): the filling, the acceptance ratio (0:
    adaptive), the deadline (-1: adaptive, 0: none), the grace after the last END, the packet
    payload budget, ``loss()``: each worker path's measured loss rate, ``reordered()``:
    when a packet last came out of order (``close.grace_for``; None: the grace always
    holds), ``share``: the receiver's grant (``ltp.share.Share``), told which workers
    owe an open round their push, and ``fast``: whether the receiver adds the packets that need
    nothing else into their rounds itself (``ServerState.ltp_fast``)."""

    def __init__(self, budget, fill="rescale", ratio=0.0, deadline=-1.0, grace=0.002, z=1.0,
                 floor=0.8, loss=None, reordered=None, share=None, fast=True):
        if fill not in ltp_rounds.FILLS:
            raise ValueError("unknown filling %r" % fill)
        self.budget = budget
        self.fill = fill
        self.ratio = ratio
        self.deadline = deadline
        self.grace = grace
        self.z = z
        self.floor = floor
        self.loss = loss or (lambda: None)
        self.reordered = reordered or (lambda: None)
        # the grant's account of who owes an open round its push (ltp.share.Share), or none
        self.share = share or _NoShare()
        # whether the receiver may add a packet that needs nothing else into its open round
        # itself (ServerState.ltp_fast; MXPS_LTP_FAST, for ablations)
        self.fast = fast


class _Slot:
    """This server's slice of one key: where it is, its rounds, and its numbers (``store``)."""

    __slots__ = ("key", "offset", "length", "dtype_code", "store", "applied", "rounds",
                 "waiting", "index", "spans", "wsp", "cols")

    def __init__(self, key, offset, length, dtype_code, store):
        self.key = key
        self.index = optimizer_index(key, offset)
        self.offset = offset
        self.length = length
        self.dtype_code = dtype_code
        self.store = store              # a MemorySlice
        self.applied = 0                # rounds completed
        self.rounds = {}                # round -> _Round
        self.waiting = []               # (client, header, RowSet or None) pulls waiting for
                                        # a later round (RowSet: a PULL_ROWS)
        self.spans = ltp_close.Deadline()           # LTP: recent rounds' spans, backoff
        self.wsp = None                 # MXPS_MODE=wsp: the slice's wsp.SliceWsp
        self.cols = 0                   # the key's row width (INIT), 0: unknown


class _Incoming:
    """A new slice this server is assembling: the parts so far, how many remote ones to come."""

    __slots__ = ("slice", "expect", "parts")

    def __init__(self, slice_, expect):
        self.slice = slice_
        self.expect = expect
        self.parts = []


class _Migration:
    """One re-plan on this server: parts sent and not yet acknowledged, slices being built."""

    def __init__(self, version):
        self.version = version
        self.outgoing = {}        # request id -> destination server
        self.incoming = {}        # key -> _Incoming
        self.next_id = 0
        self.moved = 0
        self.done = False


def _counts(opt):
    """The optimizer's update counts, the dict its updates will use.  MXNet keeps one dict per
    device (``_all_index_update_counts``) and the Updater switches ``_index_update_count`` to
    device 0's on every call; an optimizer that was unpickled with a replaced
    ``_index_update_count`` (e.g. from a states file) would lose its counts at the first
    update, so make that dict device 0's."""
    d = opt._index_update_count
    if opt._all_index_update_counts.get(0) is not d:
        opt._all_index_update_counts[0] = d
    return d


def _floating(key, dtype):
    """With the optimizer on the servers a key must be floating point (MXNet's update
    operators refuse integers: "This operation only support floating point types")."""
    if np.dtype(dtype).kind != "f":
        raise RequestError("key %d has dtype %s: the optimizer on the servers updates "
                           "floating-point keys only" % (key, np.dtype(dtype)))


_PART = ("key", "target", "offset", "length", "dtype", "value", "applied")


def _read_part(h, payload):
    """A MIGRATE part from a peer server (``ServerState._cut`` made it), checked field by field
    against its header before the server uses any of it."""
    what = "MIGRATE part of key %d" % h.key
    part = _fields(typed.unpack(payload), what, _PART, ("state", "count"))
    for f in ("key", "target", "offset", "length", "applied", "count"):
        if f in part:
            _count(part[f], "%s: %s" % (what, f))
    if (part["key"], part["offset"], part["length"]) != (h.key, h.offset, h.length):
        raise RequestError("%s: the part is key %d [%d, +%d), its header says [%d, +%d)"
                           % (what, part["key"], part["offset"], part["length"], h.offset,
                              h.length))
    if part["target"] > part["offset"]:
        raise RequestError("%s: a part at %d cannot belong to a slice starting at %d"
                           % (what, part["offset"], part["target"]))
    dt = wire.dtype_of(_count(part["dtype"], "%s: dtype" % what))
    value = part["value"]
    if not (isinstance(value, np.ndarray) and value.dtype == dt and value.ndim == 1
            and value.size == part["length"]):
        raise RequestError("%s: the value is not %d elements of %s" % (what, part["length"], dt))
    _check_state(part.get("state"), part["length"], what)
    return part


class PlanError(RequestError):
    """A PLAN whose body is not a plan; ``version`` is its version when that could be read."""

    def __init__(self, message, version=None):
        super().__init__(message)
        self.version = version


def _read_table(obj, what, num_servers):
    """A plan table as the scheduler sends it (``plan.table_to_json``), checked: every key's
    slices cover its elements once, in order, on servers of this job (when known)."""
    if not isinstance(obj, dict):
        raise ValueError("%s is not a table" % what)
    for slices in obj.values():
        if not isinstance(slices, list) or not all(
                isinstance(x, list) and len(x) == 3 and all(
                    isinstance(v, int) and not isinstance(v, bool) for v in x) for x in slices):
            raise ValueError("%s: slices are [server, offset, length] integers" % what)
    table = plan.table_from_json(obj)
    for key, slices in table.items():
        if any(x.length < 0 for x in slices):
            raise ValueError("%s: key %d has a slice of negative length" % (what, key))
        size = sum(x.length for x in slices)
        bound = num_servers if num_servers is not None else \
            max([x.server for x in slices] + [0]) + 1
        plan.check_slices(key, size, slices, bound, one_per_server=False)
    return table


def _read_plan(payload, num_servers, current):
    """(version, old table, new table) of a PLAN body; raises ``PlanError``."""
    try:
        body = json.loads(_bytes(payload))
    except (ValueError, RecursionError, wire.WireError) as e:
        raise PlanError("the PLAN body is not JSON: %s" % e) from None
    version = body.get("version") if isinstance(body, dict) else None
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise PlanError("the PLAN body has no version: %.80r" % (body,))
    if version <= current:
        raise PlanError("plan %d, but this server is at plan %d already" % (version, current),
                        version)
    try:
        old = _read_table(body.get("old"), "the old table", num_servers)
        new = _read_table(body.get("new"), "the new table", num_servers)
    except (ValueError, TypeError, plan.PlanError) as e:
        raise PlanError("plan %d: %s" % (version, e), version) from None
    for key, slices in new.items():
        if key in old and sum(x.length for x in old[key]) != sum(x.length for x in slices):
            raise PlanError("plan %d: key %d has %d elements in the old table and %d in the "
                            "new" % (version, key, sum(x.length for x in old[key]),
                                     sum(x.length for x in slices)), version)
    return version, old, new


def _join_state(parts):
    """The inverse of ``ndview.cut_state`` over consecutive parts."""
    first = parts[0]
    if first is None:
        return None
    if isinstance(first, (tuple, list)):
        return type(first)(_join_state([p[i] for p in parts]) for i in range(len(first)))
    return np.concatenate(parts) if len(parts) > 1 else first


def _to_numpy(state):
    if state is None:
        return None
    if isinstance(state, (tuple, list)):
        return type(state)(_to_numpy(s) for s in state)
    return state.asnumpy()


def _to_nd(state):
    if state is None:
        return None
    if isinstance(state, (tuple, list)):
        return type(state)(_to_nd(s) for s in state)
    return mx.nd.array(state, dtype=state.dtype)


class ServerState:
    """Everything server ``rank`` knows; ``on_request``, ``on_scheduler`` and
    ``on_peer_reply`` each take one message and return the ``Out``s it causes, in order."""

    def __init__(self, rank, num_workers, sync, num_servers=None, trace=None, ltp=None,
                 wsp=None, store=None, progress=None):
        self.rank = rank
        # called now and then inside work that takes seconds (a table made from its rule), so
        # that the server heartbeats meanwhile (roles/server.py); None: nobody to tell
        self.progress = progress
        self.num_workers = num_workers
        self.sync = sync
        self.num_servers = num_servers   # when known, a plan naming another server is refused
        self.slots = {}            # (key, offset) -> _Slot
        self.updater = None
        self.optimizer = None
        self._aliased = set()      # optimizer indices of further slices, given their key's
        self.plan_version = 0
        self.migration = None      # the re-plan this server is moving state for
        self.early_parts = []      # parts of a plan whose PLAN message has not arrived yet
        # MXPS_REPLAN_OVERLAP: workers push by a new plan while its state still moves:
        # requests of a plan whose PLAN has not arrived yet, and requests for a slice still
        # being built (target -> [(client, header, gradient copy or None)]), wait here
        self.early_requests = []
        self._early_bytes = 0
        self.deferred = {}
        self._out = []             # what the message being handled causes
        # MXPS_PUSH=ltp (docs/LTP.md): packets of the loss-tolerant push; LtpSettings or None
        self.ltp = ltp
        self._wakes = []           # (time, key, offset, round): when an open round may close
        self.ltp_stats = collections.Counter()
        # MXPS_MODE=wsp (docs/WSP.md): WspSettings or None (BSP); the workers that left
        self.wsp = wsp
        self.gone = set()
        # MXPS_STORE=disk: StoreSettings, or None (every slice in RAM); optimizer state
        # templates by optimizer index (store.disk.state_template)
        self.store = store
        self._templates = {}
        self._resumed = None       # MXPS_STORE_RESUME: the round the store was flushed at
        self.checkpoints = []      # MXPS_STORE_CHECKPOINT_ROUNDS: the rounds flushed
        self.wsp_stats = collections.Counter()
        # messages that are nobody's request (stray peer replies, PLANs that do not parse):
        # dropped, counted and logged rate-limited
        self.drops = Tally(log)
        # MXPS_TRACE: a placement.trace.Recorder's "data" and "plan" rows, or None (off)
        self._trace = self._trace_plan = None
        if trace is not None:
            self._trace, self._trace_plan = trace.rows["data"], trace.rows["plan"]
            self._now = trace.clock
        # MXPS_PUSH=ltp: the open LTP rounds, (key, offset, round) -> LtpRound, into which the
        # receiver adds the DATA packets that need nothing else (ltp.receiver.Receiver.receive,
        # kernels.ltp.intake); None: every packet comes through take_packet (no LTP, or a
        # trace, which records every packet)
        self.ltp_fast = {} if ltp is not None and ltp.fast and self._trace is None else None

    def _data_row(self, kind, slot, rnd, worker, nbytes, request=-1):
        self._trace.append((kind, self._now(), rnd, slot.key, slot.offset, slot.length, worker,
                            nbytes, self.plan_version, request))

    def _plan_row(self, kind, version, key=-1, offset=-1, length=0, peer=-1, nbytes=0,
                  part=-1):
        self._trace_plan.append((kind, self._now(), version, key, offset, length, peer, nbytes,
                                 part))

    def _flush(self):
        out, self._out = self._out, []
        return out

    # -- the three entry points --------------------------------------------------------------
    def on_request(self, client, h, payload):
        """A request from a worker (or a MIGRATE from a peer server) on connection ``client``.
        A refused request gets an ERROR reply naming the key and the cause; nothing a request
        does can stop the server."""
        handler = self._HANDLERS.get(h.type)
        try:
            if handler is None:
                raise RequestError("server cannot handle %s" % MsgType(h.type).name)
            if h.type in self._DATA and self._defer(client, h, payload):
                return self._flush()
            handler(self, client, h, payload)
        except (RequestError, wire.WireError) as e:
            self._error(client, h, str(e))
        except Exception as e:   # a bug or an optimizer failure: report it, keep serving
            log.exception("server %d: request %r failed", self.rank, h)
            self._error(client, h, "server %d failed on %s: %s: %s"
                        % (self.rank, MsgType(h.type).name, type(e).__name__, e))
        return self._flush()

    def on_scheduler(self, h, payload):
        """A PLAN from the scheduler (its other messages are the link's business).  A PLAN
        whose body does not hold a plan changes nothing: it is reported to the scheduler as a
        failed plan when its version can be read (the scheduler ends the job naming this
        server, rather than wait for MXPS_TIMEOUT), else dropped and counted (``drops``)."""
        if h.type != MsgType.PLAN:
            self.drops("scheduler:%d" % h.type, "server %d: dropped %r from the scheduler: "
                       "only PLAN is the server state's", self.rank, h)
            return []
        try:
            version, old, new = _read_plan(payload, self.num_servers, self.plan_version)
        except PlanError as e:
            version = e.version
            if version is None:
                self.drops("plan", "server %d: dropped a PLAN that does not parse: %s",
                           self.rank, e)
                return []
            self._plan_failed(version, e)
            return self._flush()
        if self._trace is not None:
            self._plan_row("plan_received", version)
        try:
            self._on_plan(version, old, new)
        except Exception as e:
            self._plan_failed(version, e)
        out = self._flush()
        early, self.early_requests = self.early_requests, []
        self._early_bytes = 0
        for client, h, payload in early:      # in arrival order, as if they came now
            out += self.on_request(client, h, payload)
        return out

    def on_peer_reply(self, server_rank, h):
        """Server ``server_rank``'s answer to a part this server sent it: an ACK, or an ERROR
        that fails the plan.  A message that answers no part in flight to that server (another
        plan's, a type that is not a reply) is dropped and counted."""
        mig = self.migration
        if h.type not in (MsgType.ACK, MsgType.ERROR) or mig is None or \
                h.plan_version != mig.version or mig.outgoing.get(h.request_id) != server_rank:
            self.drops("peer:%d" % server_rank, "server %d: dropped %r from server %d: not a "
                       "reply to a part in flight to it", self.rank, h, server_rank)
            return []
        if self._trace is not None:
            self._plan_row("part_acked" if h.type == MsgType.ACK else "part_refused",
                           h.plan_version, h.key, h.offset, h.length, server_rank,
                           part=h.request_id)
        try:
            self._on_migrate_reply(h)
        except Exception as e:
            self._plan_failed(h.plan_version, e)
        return self._flush()

    # -- replies -----------------------------------------------------------------------------
    def _reply(self, client, header, type_, payload=None, **fields):
        self._out.append(Out(Out.CLIENT, client, header.reply(type_, **fields), payload))

    def _error(self, client, header, message):
        log.warning("server %d: refusing %r: %s", self.rank, header, message)
        self._reply(client, header, MsgType.ERROR, message.encode(), dtype=wire.NO_DTYPE,
                    length=0)

    def _send_value(self, client, header, slot, rows=None):
        if self.wsp is not None and 0 <= header.sender < self.num_workers:
            clock = self.wsp.clock
            self._wsp_of(slot).received(header.sender, slot.applied, clock() if clock else None)
        if self._trace is not None:
            self._data_row("pull_answered", slot, header.iteration, header.sender,
                           slot.store.snapshot.nbytes, header.request_id)
        if rows is not None:       # a PULL_ROWS: its rows' elements in the slice, in order
            self._reply(client, header, MsgType.DATA, slot.store.read(rows),
                        dtype=slot.dtype_code, offset=slot.offset, length=int(rows.size))
            return
        self._reply(client, header, MsgType.DATA, slot.store.snapshot, dtype=slot.dtype_code,
                    offset=slot.offset, length=slot.length)

    def _to_scheduler(self, body):
        self._out.append(Out(Out.SCHEDULER, None, wire.Header(MsgType.PLAN, sender=self.rank),
                             json.dumps(body).encode()))

    # -- data plane --------------------------------------------------------------------------
    _DATA = frozenset((MsgType.PUSH, MsgType.PULL, MsgType.PUSHPULL))
    #: requests of the next plan held until its PLAN arrives (a worker's are a few slices:
    #: it is released only after the scheduler sent the PLAN; the bound is against garbage)
    EARLY_BYTES = 256 << 20

    def _defer(self, client, h, payload):
        """With overlapped re-plans (MXPS_REPLAN_OVERLAP) workers use plan v as soon as the
        scheduler sent PLAN v to the servers, while its state is still moving.  A request of
        plan v before PLAN v is here waits for it (the scheduler sends PLAN v + 1 only once
        every server installed v, so nothing comes from further ahead).  A request for a slice
        of plan v still being built waits for the slice; a push is acknowledged at once (a
        copy of its gradient waits), so the worker's send window keeps moving, and it is summed
        into its round when the slice is built.  True if the request waits."""
        if h.plan_version == self.plan_version + 1:
            n = memoryview(payload).nbytes if payload is not None else 0
            if self._early_bytes + n > self.EARLY_BYTES:
                raise RequestError("key %d: more than %d MB of requests of plan %d before its "
                                   "PLAN arrived" % (h.key, self.EARLY_BYTES >> 20,
                                                     h.plan_version))
            self._early_bytes += n
            self.early_requests.append((client, h, payload))
            return True
        mig = self.migration_open()
        if mig is None or h.plan_version != mig.version:
            return False
        target = (h.key, h.offset)
        inc = mig.incoming.get(target)
        if inc is None:
            return False
        if inc.slice.length != h.length:
            raise RequestError("key %d: request for elements [%d, %d) but server %d is "
                               "building [%d, %d)" % (h.key, h.offset, h.offset + h.length,
                                                      self.rank, inc.slice.offset,
                                                      inc.slice.stop))
        grad = None
        if h.type != MsgType.PULL:
            grad = np.array(compression.push_values(h, payload), copy=True)
            if h.type == MsgType.PUSH:
                self._reply(client, h, MsgType.ACK, length=0)
        self.deferred.setdefault(target, []).append((client, h, grad))
        if self._trace is not None:
            self._trace.append(("request_deferred", self._now(), h.iteration, h.key,
                                h.offset, h.length, h.sender, 0 if grad is None else
                                grad.nbytes, self.plan_version, h.request_id))
        return True

    def migration_open(self):
        """The re-plan whose slices are still being built here, or None."""
        mig = self.migration
        return mig if mig is not None and mig.incoming else None

    def _replay(self, target):
        """The slice ``target`` is built: run the requests that waited for it, in order."""
        waiting = self.deferred.pop(target, ())
        if not waiting:
            return
        slot = self.slots[target]
        for client, h, grad in waiting:
            try:
                if h.dtype != slot.dtype_code and grad is not None:
                    raise RequestError("key %d: pushed dtype %s differs from the slice's %s"
                                       % (h.key, wire.dtype_of(h.dtype),
                                          wire.dtype_of(slot.dtype_code)))
                if grad is None:
                    self._on_pull(client, h)
                    continue
                if self._trace is not None:
                    self._data_row("push_arrived", slot, h.iteration, h.sender, grad.nbytes,
                                   h.request_id)
                if not self.sync:
                    rnd = self._new_round(slot, grad)
                    self._apply(slot, rnd)
                    slot.applied += 1
                else:
                    self._account(slot, h, grad)
                if h.type != MsgType.PUSH:
                    self._on_pull(client, h)
            except RequestError as e:
                self._error(client, h, str(e))
        self._answer_waiting(slot)

    def _slot_for(self, h):
        slot = self.slots.get((h.key, h.offset))
        if slot is None:
            if not any(k == h.key for k, _ in self.slots):
                raise RequestError("key %d is not initialised on server %d: call init (or "
                                   "broadcast) on the key before push/pull" % (h.key, self.rank))
            held = sorted((x.offset, x.offset + x.length) for (k, _), x in self.slots.items()
                          if k == h.key)
            raise RequestError("key %d: request for elements [%d, %d) but server %d holds %s: "
                               "workers disagree on the placement plan or on the key's size"
                               % (h.key, h.offset, h.offset + h.length, self.rank,
                                  ", ".join("[%d, %d)" % x for x in held)))
        if h.plan_version != self.plan_version:
            raise RequestError("key %d: request of plan version %d, but server %d is at plan "
                               "%d" % (h.key, h.plan_version, self.rank, self.plan_version))
        if slot.offset != h.offset or slot.length != h.length:
            raise RequestError("key %d: request for elements [%d, %d) but server %d holds "
                               "[%d, %d): workers disagree on the placement plan or on the "
                               "key's size" % (h.key, h.offset, h.offset + h.length, self.rank,
                                               slot.offset, slot.offset + slot.length))
        return slot

    def _on_init(self, client, h, payload, rule=None):
        if h.sender != 0:
            raise RequestError("INIT of key %d from worker %d refused: worker 0 initialises the "
                               "keys" % (h.key, h.sender))
        stop = h.offset + h.length
        for (k, _), x in self.slots.items():
            if k == h.key and x.offset < stop and h.offset < x.offset + x.length or \
                    (k, x.offset) == (h.key, h.offset):
                raise RequestError(
                    "key %d is already initialised on server %d (elements [%d, %d)): a key is "
                    "initialised once, and a second init would reset its value and rounds; "
                    "push to change it, or init a new key"
                    % (h.key, self.rank, x.offset, x.offset + x.length))
        if rule is None:
            arr = wire.payload_array(h, payload)
        else:       # a dtype-only stand-in: the values come from the rule
            arr = np.zeros(0, wire.dtype_of(h.dtype))
        if self.updater is not None:
            _floating(h.key, arr.dtype)
        cols = max(0, int(h.iteration))
        if self.store is not None:
            store = self._disk_slice(h, arr, cols, rule)
        elif rule is not None:
            t0 = time.monotonic()
            store = MemorySlice(rule.span(h.offset, h.offset + h.length, progress=self.progress),
                                progress=self.progress)
            log.info("key %d: made its slice at %d (%d elements) from its rule in %.2f s",
                     h.key, h.offset, h.length, time.monotonic() - t0)
        else:
            store = MemorySlice(arr.copy(), progress=self.progress)
        slot = self.slots[(h.key, h.offset)] = _Slot(h.key, h.offset, h.length, h.dtype, store)
        slot.cols = cols
        if self.updater is not None and slot.index != slot.key:
            self._alias(slot, count=True)     # states loaded before the keys were initialised
        self._reply(client, h, MsgType.ACK, length=0)

    def _on_init_table(self, client, h, payload):
        """INIT_TABLE: a slice's initial value as a rule (``store.table_init``): in RAM the
        slice is made now, on disk each row when first touched."""
        what = "INIT_TABLE of key %d" % h.key
        body = _fields(typed.unpack(payload), what, ("scale", "seed"))
        dtype = wire.dtype_of(h.dtype)
        try:
            rule = TableInit((h.offset + h.length,), dtype, body["scale"], body["seed"])
        except (TypeError, ValueError) as e:
            raise RequestError("%s: %s" % (what, e)) from None
        self._on_init(client, h, None, rule=rule)

    def _disk_slice(self, h, arr, cols, rule=None):
        """A new slice in the row store (MXPS_STORE=disk); with MXPS_STORE_RESUME its numbers
        come from the store, which must hold exactly this slice (else the INIT is refused)."""
        n_states = 0
        if self.updater is not None:
            index = optimizer_index(h.key, h.offset)
            try:
                n_states = self._template(index, arr.dtype)[1]
            except ValueError as e:
                raise RequestError("key %d: %s" % (h.key, e)) from None
        name = "key%d_at%d" % (h.key, h.offset)
        st = self.store
        width, _, _, _, n_rows = disk_geometry(h.offset, h.length, cols)
        layout = RowLayout(n_rows, width, arr.dtype, n_states)
        if rule is not None:
            arr = None
        cache = max(st.budget(layout.cache_bytes(n_rows)), layout.cache_bytes(1))
        try:
            disk = DiskSlice(h.offset, h.length, cols, layout.dtype, n_states,
                             None if st.resume else arr, st.directory, name, cache,
                             resume=st.resume, rule=None if st.resume else rule,
                             at=st.resume_at, keep=st.KEEP)
        except (ValueError, OSError, RuntimeError) as e:
            raise RequestError("key %d: the disk store at %s: %s"
                               % (h.key, st.directory, e)) from None
        if st.resume:
            # every slice of a job's store was flushed at the same point (a clean shutdown);
            # the optimizer made one update per round, so its count resumes from there
            done = disk.rows.step
            if self._resumed is None:
                self._resumed = done
            elif done != self._resumed:
                disk.close()
                raise RequestError("key %d: the disk store at %s holds this slice at round %s "
                                   "but others at round %s: not one job's clean stop"
                                   % (h.key, st.directory, done, self._resumed))
            if self.updater is not None:
                index = optimizer_index(h.key, h.offset)
                self.updater.optimizer._index_update_count[index] = done
                self.updater.optimizer.num_update = max(self.updater.optimizer.num_update, done)
        return disk

    def _template(self, index, dtype):
        t = self._templates.get(index)
        if t is None:
            t = self._templates[index] = state_template(self.updater.optimizer, index, dtype)
        return t

    @property
    def round_base(self):
        """Rounds before this job's first: those of a resumed store."""
        return self._resumed or 0

    def flush_store(self):
        """Everything the disk store holds to disk, durable, each slice clean at the rounds it
        applied, counted from the job's start (a clean shutdown; docs/STORE.md)."""
        for slot in self.slots.values():
            if isinstance(slot.store, DiskSlice):
                slot.store.flush(self.round_base + slot.applied)

    def _maybe_checkpoint(self, slot):
        """MXPS_STORE_CHECKPOINT_ROUNDS (BSP): once every slice here has applied a round that
        is a multiple of the setting, all of them are flushed at it, before the pulls that
        round answers go out (store.checkpoints says why that makes a job-wide checkpoint)."""
        st = self.store
        step = self.round_base + slot.applied
        if (st is None or not st.every or step % st.every or not self.sync
                or self.wsp is not None or self.checkpoints and self.checkpoints[-1] == step
                or any(x.applied != slot.applied for x in self.slots.values())):
            return
        t0 = time.monotonic()
        for x in self.slots.values():
            x.store.flush(step)
        self.checkpoints.append(step)
        log.info("server %d: checkpoint of round %d (%d slices) in %.3f s", self.rank, step,
                 len(self.slots), time.monotonic() - t0)

    def store_stats(self):
        """The disk store's counters summed over this server's slices."""
        total = collections.Counter()
        for slot in self.slots.values():
            if isinstance(slot.store, DiskSlice):
                total.update(slot.store.stats)
        return dict(total)

    def _on_push(self, client, h, payload):
        slot = self._slot_for(h)
        if h.dtype != slot.dtype_code:
            raise RequestError("key %d: pushed dtype %s differs from the initialised dtype %s"
                               % (h.key, wire.dtype_of(h.dtype), wire.dtype_of(slot.dtype_code)))
        grad = compression.push_values(h, payload)
        if self._trace is not None:
            self._data_row("push_arrived", slot, h.iteration, h.sender, grad.nbytes,
                           h.request_id)
        if not self.sync:
            if self.updater is None:
                raise RequestError("key %d: dist_async needs the optimizer on the servers "
                                   "(update_on_kvstore=True / set_optimizer)" % h.key)
            rnd = self._new_round(slot, grad)
            self._apply(slot, rnd)
            slot.applied += 1
            if self._trace is not None:
                self._data_row("push_applied", slot, h.iteration, h.sender, grad.nbytes,
                               h.request_id)
        elif self.wsp is not None:
            self._account_wsp(slot, h, grad)
        else:
            self._account(slot, h, grad)
        if h.type == MsgType.PUSH:
            self._reply(client, h, MsgType.ACK, length=0)
        else:
            self._on_pull(client, h)
        self._answer_waiting(slot)

    def _account(self, slot, h, grad):
        """Add a sync push to its round's sum; complete every round that has all pushes."""
        if h.iteration <= slot.applied:
            raise RequestError("key %d: worker %d pushed round %d, but round %d is already "
                               "complete" % (h.key, h.sender, h.iteration, slot.applied))
        rnd = slot.rounds.get(h.iteration)
        if rnd is None:
            rnd = slot.rounds[h.iteration] = self._new_round(slot, grad)
        elif h.sender in rnd.senders:
            raise RequestError("key %d: worker %d pushed round %d twice"
                               % (h.key, h.sender, h.iteration))
        elif rnd.parts is not None or isinstance(grad, tuple):
            self._add(slot, h, rnd, grad)
        elif rnd.ltp is not None:        # the others' packets came by LTP, this one by TCP
            if rnd.closed or not rnd.ltp.add_whole(h.sender, grad, self._ltp_now):
                raise RequestError("key %d: worker %d pushed round %d by TCP after sending "
                                   "packets of it (or after it closed)"
                                   % (h.key, h.sender, h.iteration))
            self.ltp.share.settled(h.sender)
        else:
            add_into(rnd.acc, grad, h.dtype)
        rnd.senders.add(h.sender)
        if rnd.ltp is not None:
            self._ltp_check(slot, h.iteration, rnd, self._ltp_now)
        self._complete_rounds(slot)

    def _account_wsp(self, slot, h, grad):
        """WSP: a push goes into the round ``wsp.SliceWsp.place`` gives it (the round it was
        computed for, or a later one if that completed without it); rounds complete by
        ``_wsp_ready``."""
        ws = self._wsp_of(slot)
        clock = self.wsp.clock
        try:
            r = ws.place(h.sender, h.iteration, slot.applied, clock() if clock else None)
        except ValueError as e:
            raise RequestError("key %d: worker %d %s" % (h.key, h.sender, e)) from None
        if r != h.iteration:
            self.wsp_stats["folded"] += 1
        rnd = slot.rounds.get(r)
        if rnd is None:
            rnd = slot.rounds[r] = self._new_round(slot, grad)
        else:
            self._add(slot, h, rnd, grad)
        rnd.senders.add(h.sender)
        rnd.pushes += 1
        self._complete_rounds(slot)

    def _wsp_of(self, slot):
        if slot.wsp is None:
            slot.wsp = wsp_rules.SliceWsp(self.num_workers)
        return slot.wsp

    def _wsp_ready(self, slot, r, rnd):
        """Whether WSP round ``r`` may complete now (``wsp.may_complete``)."""
        ws = self._wsp_of(slot)
        k = self.wsp.k
        if k <= 0:
            active = [w for w in range(self.num_workers) if w not in self.gone]
            times = ws.intervals()
            k = wsp_rules.choose_k([times[w] for w in active])
        return wsp_rules.may_complete(r, rnd.senders, ws.base, min(k, self.num_workers),
                                      self.wsp.staleness, self.gone)

    def _complete_rounds(self, slot):
        while True:          # in order: an early round waits for the ones before it
            nxt = slot.rounds.get(slot.applied + 1)
            if nxt is None:
                break
            if self.wsp is None:
                if not nxt.complete(self.num_workers):
                    break
            elif not nxt.senders or not self._wsp_ready(slot, slot.applied + 1, nxt):
                break
            else:
                n = nxt.pushes
                self.wsp_stats["rounds"] += 1
                self.wsp_stats["contributions"] += n
                if n != self.num_workers:     # the expected sum of a full round
                    nxt.scale = wsp_rules.scale(self.num_workers, n)
                    if nxt.parts is None:
                        nxt.acc *= nxt.acc.dtype.type(nxt.scale)
            del slot.rounds[slot.applied + 1]
            self._apply(slot, nxt)
            slot.applied += 1
            if self._trace is not None:
                self._data_row("round_complete", slot, slot.applied, -1,
                               0 if nxt.acc is None else nxt.acc.nbytes)
            self._maybe_checkpoint(slot)

    def _new_round(self, slot, grad):
        """A round whose first push is ``grad``: a dense array (copied into a fresh sum) or a
        row-sparse push's (RowSet, padded block)."""
        if isinstance(grad, tuple):
            return _Round(None, None, [grad])
        rnd = _Round(*slot.store.accumulator(grad, self.updater is not None))
        copy_into(rnd.acc, grad)
        return rnd

    def _add(self, slot, h, rnd, grad):
        """Add a later push to a round; dense and row-sparse pushes do not mix."""
        if (rnd.parts is not None) != isinstance(grad, tuple):
            raise RequestError("key %d: worker %d pushed round %d %s, the others %s"
                               % (h.key, h.sender, h.iteration,
                                  "row-sparse" if isinstance(grad, tuple) else "dense",
                                  "row-sparse" if rnd.parts is not None else "dense"))
        if rnd.parts is not None:
            rnd.parts.append(grad)
        else:
            add_into(rnd.acc, grad, h.dtype)

    def _apply(self, slot, rnd):
        store = slot.store
        if rnd.parts is not None:
            self._apply_rows(slot, rnd)
            return
        if isinstance(store, DiskSlice):
            if self.updater is None:
                store.apply_sum(rnd.acc)
                return
            if slot.index != slot.key and slot.index not in self._aliased:
                self._alias(slot)
            store.apply_dense(self.updater.optimizer, slot.index, rnd.acc,
                              self._template(slot.index, rnd.acc.dtype)[0])
            return
        if self.updater is None:
            store.serve_sum(rnd.acc)          # stored = merged (update on workers)
            return
        acc_nd = rnd.acc_nd
        if acc_nd is None:                   # the round began before set_optimizer
            acc_nd = mx.nd.array(rnd.acc, dtype=rnd.acc.dtype)
        if slot.index != slot.key and slot.index not in self._aliased:
            self._alias(slot)
        kept = self._keep(slot, rnd.frozen) if rnd.frozen else None
        self.updater(slot.index, acc_nd, store.weight_nd)
        store.weight_nd.wait_to_read()       # the update (which read acc_nd) is done
        if kept is not None:
            self._restore(slot, rnd.frozen, kept)
        if rnd.acc_nd is not None:
            store.recycle(rnd.acc, rnd.acc_nd)
        # Sync mode replies straight from the stored weights, without a copy: round r+1 can
        # only complete once every worker pushed r+1, and a worker pushes r+1 of a key only
        # after its pull of round r was answered, so no reply of round r is still being sent
        # when the weights change.  Async mode applies pushes any time: replies get a copy.
        store.serve_weights(copy=not self.sync or self.wsp is not None)

    def _apply_rows(self, slot, rnd):
        """A row-sparse round, as MXNet's lazy update: the pushed elements' sum, the optimizer
        run on those elements only (weights and state gathered, updated, put back); the
        others do not change.  The key's update count advances as for any round."""
        rows, block = sparse.merge_rows(rnd.parts)
        rnd.parts = None
        updater, store = self.updater, slot.store
        opt = updater.optimizer
        if slot.index != slot.key and slot.index not in self._aliased:
            self._alias(slot)
        if rows.size == 0:
            opt._update_count(slot.index)
        elif isinstance(store, DiskSlice):
            if rnd.scale != 1.0:
                block = block * block.dtype.type(rnd.scale)
            store.apply_rows(opt, slot.index, rows, block, self._template(slot.index,
                                                                         block.dtype)[0])
            return
        else:
            pos = rows.positions()
            grad = sparse.trimmed(rows, block)
            if rnd.scale != 1.0:
                grad = grad * grad.dtype.type(rnd.scale)
            if slot.index not in updater.states:
                updater.states[slot.index] = opt.create_state_multi_precision(
                    slot.index, store.weight_nd)
                updater.states_synced[slot.index] = True
            state = updater.states[slot.index]
            arrays = sparse.state_arrays(state)
            for a in arrays:
                a.wait_to_read()
            views = [numpy_view(a) for a in arrays]
            # the same optimizer call as the disk store's (store.disk.step): both stores give
            # the same numbers
            new_w, new_s = disk_step(opt, slot.index, store.weight[pos], grad,
                                     [v[pos] for v in views], state)
            store.weight[pos] = new_w
            for v, n in zip(views, new_s):
                v[pos] = n
        store.serve_weights(copy=not self.sync or self.wsp is not None)

    def _on_push_rows(self, client, h, payload):
        """A row-sparse push (docs/SPARSE.md): the rows' elements inside this slice."""
        slot = self._slot_for(h)
        if h.dtype != slot.dtype_code:
            raise RequestError("key %d: pushed dtype %s differs from the initialised dtype %s"
                               % (h.key, wire.dtype_of(h.dtype), wire.dtype_of(slot.dtype_code)))
        if self.updater is None:
            raise RequestError("key %d: row-sparse pushes need the optimizer on the servers "
                               "(update_on_kvstore=True, as MXNet requires for sparse "
                               "gradients)" % h.key)
        name = type(self.updater.optimizer).__name__.lower()
        if name not in sparse.LAZY_OPTIMIZERS:
            raise RequestError("key %d: row-sparse pushes with optimizer %s are not supported "
                               "(supported: %s)" % (h.key, name,
                                                    ", ".join(sparse.LAZY_OPTIMIZERS)))
        rows, values = self._read_rows(h, payload, slot, with_values=True)
        grad = (rows, sparse.padded(rows, np.array(values, dtype=wire.dtype_of(
            slot.dtype_code))))
        if not self.sync:
            rnd = _Round(None, None, [grad])
            self._apply(slot, rnd)
            slot.applied += 1
        elif self.wsp is not None:
            self._account_wsp(slot, h, grad)
        else:
            self._account(slot, h, grad)
        self._reply(client, h, MsgType.ACK, length=0)
        self._answer_waiting(slot)

    def _on_pull_rows(self, client, h, payload):
        """A pull of some rows: answered, like a pull, once its round is complete."""
        slot = self._slot_for(h)
        rows, _ = self._read_rows(h, payload, slot, with_values=False)
        if not self.sync or self._pull_ready(slot, h):
            self._send_value(client, h, slot, rows)
        else:
            slot.waiting.append((client, h, rows))

    def _read_rows(self, h, payload, slot, with_values):
        """The typed payload of PUSH_ROWS / PULL_ROWS: the rows inside the slice (a
        ``sparse.RowSet``) and the values; a bad one raises RequestError naming the key."""
        what = "key %d: %s" % (h.key, MsgType(h.type).name)
        try:
            body = typed.unpack(payload)
            _fields(body, what, ("cols", "ids", "values") if with_values else ("cols", "ids"))
            cols, ids = body["cols"], body["ids"]
            if not isinstance(cols, int) or cols <= 0:
                raise ValueError("cols must be a positive integer, got %r" % (cols,))
            if slot.cols and cols != slot.cols:
                raise ValueError("rows of %d elements, but the key was initialised with rows "
                                 "of %d" % (cols, slot.cols))
            if not isinstance(ids, np.ndarray) or ids.dtype != np.int64:
                raise ValueError("ids must be an int64 array")
            sparse.check_ids(ids, -(-(slot.offset + slot.length) // cols), what)
            rows = sparse.rows_in(ids, cols, slot.offset, slot.length)
            values = None
            if with_values:
                values = body["values"]
                if not isinstance(values, np.ndarray) or values.ndim != 1 or \
                        values.dtype != wire.dtype_of(slot.dtype_code):
                    raise ValueError("values must be a flat %s array"
                                     % wire.dtype_of(slot.dtype_code))
                if values.size != rows.size:
                    raise ValueError("%d values for the %d elements of %d rows in the slice"
                                     % (values.size, rows.size, ids.size))
        except (ValueError, wire.WireError) as e:
            msg = str(e)
            raise RequestError(msg if msg.startswith(what) else "%s: %s" % (what, msg)) \
                from None
        return rows, values

    def _pull_ready(self, slot, h):
        """Whether a sync pull can be answered now: its round is complete (WSP: the round the
        worker's push of that label went into)."""
        if self.wsp is None:
            return h.iteration <= slot.applied
        r = self._wsp_of(slot).pull_round(h.sender, h.iteration)
        return r is not None and r <= slot.applied

    def _on_pull(self, client, h):
        slot = self._slot_for(h)
        if not self.sync or self._pull_ready(slot, h):
            self._send_value(client, h, slot)
        else:
            slot.waiting.append((client, h, None))
            if self._trace is not None:
                self._data_row("pull_parked", slot, h.iteration, h.sender, 0, h.request_id)

    def _answer_waiting(self, slot):
        if not slot.waiting:
            return
        still = []
        answered = False
        for client, h, rows in slot.waiting:
            if self._pull_ready(slot, h):
                self._send_value(client, h, slot, rows)
                answered = True
            else:
                still.append((client, h, rows))
        slot.waiting = still
        if answered and self.wsp is not None:
            # a worker's newer value can lift the staleness bound of the next round
            applied = slot.applied
            self._complete_rounds(slot)
            if slot.applied != applied:
                self._answer_waiting(slot)

    # -- LTP: the loss-tolerant push (docs/LTP.md) -------------------------------------------
    _ltp_now = 0.0     # the time of the last packet or tick (a TCP push into an LTP round)

    def on_packet(self, f, payload, now):
        """A verified LTP packet (``ltp_packet.Fields``, its payload) at ``now``; returns the
        ``Out``s it causes (answers to pulls of rounds it closed).  A packet that fits no open
        round is dropped and counted in ``ltp_stats`` (``drop_<why>``), never an error: the
        sender is not waiting for an answer to it."""
        self.take_packet(f, payload, now)
        return self._flush()

    def fast_taken(self, now):
        """The receiver added packets into ``ltp_fast``'s rounds at ``now`` (as ``take_packet``
        would have: the time of the last packet)."""
        self._ltp_now = now

    def _unfast(self):
        """No packet goes into an open round past ``take_packet`` any more (the plan or the
        slices changed); the rounds that stay open come back as their next packets do."""
        fast = self.ltp_fast
        if fast:
            for lt in fast.values():
                lt.live = False
            fast.clear()

    def take_packet(self, f, payload, now):
        """``on_packet`` without handing back the ``Out``s: a server that reads its packets in
        batches calls ``outs()`` once after each batch, not a flush and a send per packet
        (with the receiver's loop made inline, 2.8% of a packet's server time at MTU 1500:
        scripts/ltp_loopback.py)."""
        self._ltp_now = now
        try:
            self._on_packet(f, payload, now)
        except _Drop as e:
            self.ltp_stats["drop_" + e.args[0]] += 1
            if self._trace is not None:
                self._trace.append(("packet_dropped_" + e.args[0], self._now(), f.round, f.key,
                                    f.offset, f.length, f.worker, payload.nbytes,
                                    f.plan_version, f.seq))
        except Exception:   # a bug: log it, keep serving
            log.exception("server %d: LTP packet %r failed", self.rank, f)
            self.ltp_stats["drop_error"] += 1

    def outs(self):
        """The ``Out``s of the ``take_packet`` calls since the last call (answers to pulls of
        the rounds they closed), in order."""
        return self._flush()

    def on_tick(self, now):
        """Close the LTP rounds whose deadline or grace has passed by ``now``."""
        self._ltp_now = now
        while self._wakes and self._wakes[0][0] <= now:
            _, key, offset, r = heapq.heappop(self._wakes)
            slot = self.slots.get((key, offset))
            rnd = slot.rounds.get(r) if slot is not None else None
            if rnd is not None and rnd.ltp is not None and not rnd.closed:
                self._ltp_check(slot, r, rnd, now)
                self._complete_rounds(slot)
                self._answer_waiting(slot)
        return self._flush()

    def next_wake(self):
        """When ``on_tick`` next has something to do (None: nothing scheduled)."""
        return self._wakes[0][0] if self._wakes else None

    def _on_packet(self, f, payload, now):
        st = self.ltp
        if st is None or not self.sync:
            raise _Drop("not_ltp")
        slot = self.slots.get((f.key, f.offset))
        if slot is None or slot.length != f.length:
            raise _Drop("slice")
        if f.plan_version != self.plan_version:
            raise _Drop("plan")
        if f.dtype != slot.dtype_code:
            raise _Drop("dtype")
        r = f.round
        rnd = slot.rounds.get(r)
        if r <= slot.applied or (rnd is not None and rnd.closed):
            if f.type == ltp_packet.END:       # its packets made the round: nothing is late
                self.ltp_stats["end_after_close"] += 1
                return
            raise _Drop("late")
        if rnd is None:
            acc, acc_nd = slot.store.accumulator(slot.store.snapshot, self.updater is not None)
            acc[:] = 0
            rnd = slot.rounds[r] = _Round(acc, acc_nd)
        if rnd.ltp is None:
            itemsize = wire.dtype_of(slot.dtype_code).itemsize
            epp = ltp_packet.elements_per_packet(st.budget, itemsize)
            # the lowest acceptance ratio there is: the fixed ratio, or the adaptive rule's
            # floor (LtpRound.below)
            lowest = st.ratio if st.ratio > 0 else st.floor
            rnd.ltp = ltp_rounds.LtpRound(rnd.acc, epp, self.num_workers, slot.dtype_code,
                                          lowest)
            if self.ltp_fast is not None:
                rnd.ltp.plan_version = self.plan_version
                rnd.ltp.live = True
                self.ltp_fast[(slot.key, slot.offset, r)] = rnd.ltp
            st.share.opened(w for w in range(self.num_workers) if w not in rnd.senders)
            for w in rnd.senders:      # whole pushes (TCP) already in the sum
                rnd.ltp.seen[w] = bytearray(b"\x01") * rnd.ltp.n
                rnd.ltp.counts += 1
                rnd.ltp.credit(w, rnd.ltp.n)
                rnd.ltp.ends[w] = rnd.ltp.heard[w] = now
        if f.worker >= self.num_workers or f.worker in rnd.senders:
            raise _Drop("worker")
        try:
            lt = rnd.ltp
            if f.type == ltp_packet.DATA:
                first = lt.heard[f.worker] is None
                if not lt.add(f.worker, f.seq, f.count, payload, now):
                    raise _Drop("duplicate")
                if self._trace is not None:
                    self._data_row("packet_added", slot, f.round, f.worker, payload.nbytes,
                                   f.seq)
                # the rule can only change its answer at a DATA packet when a worker is
                # first heard (the deadline starts) or once every worker's part has reached
                # the lowest acceptance ratio there is (the fixed ratio, or the adaptive
                # rule's floor): while any is below it a packet needs no look (measured: the
                # look is a quarter of a packet's server time at MTU 1500; looking only at
                # the packets of parts past it still cost 11% of the server's samples at
                # 5% loss); deadlines and grace are the wakes' business
                if not first and lt.below:
                    return
            else:
                first = lt.ends[f.worker] is None
                lt.end(f.worker, f.seq, now)
                if first:
                    st.share.settled(f.worker)
        except ValueError:
            raise _Drop("cut") from None
        self._ltp_check(slot, r, rnd, now)
        self._complete_rounds(slot)
        self._answer_waiting(slot)

    def _ltp_check(self, slot, r, rnd, now):
        """Apply the Early Close rule to round ``r`` of ``slot``; close it, or schedule a look."""
        lt, st = rnd.ltp, self.ltp
        if st.ratio > 0:
            ratio = st.ratio
        else:
            loss = st.loss() or ()
            worst = max(loss) if loss else 0.0
            ratio = ltp_close.acceptance_ratio(lt.n, worst, st.z, st.floor)
        if st.deadline < 0:
            deadline = slot.spans.value()
        else:
            deadline = st.deadline or None
        grace = ltp_close.grace_for(st.grace, st.reordered(), now)
        reason, wake = ltp_close.decide(now, [lt.n] * lt.workers, lt.received, lt.heard,
                                        lt.ends, ratio, grace, deadline)
        if reason is None:
            if wake is not None and (rnd.wake is None or wake < rnd.wake
                                     or rnd.wake <= now):
                rnd.wake = wake
                heapq.heappush(self._wakes, (wake, slot.key, slot.offset, r))
            return
        rnd.closed = True
        if lt.live:
            lt.live = False
            self.ltp_fast.pop((slot.key, slot.offset, r), None)
        for w in range(lt.workers):
            if lt.ends[w] is None:          # its END did not come: it owes the round no more
                st.share.settled(w)
        rnd.frozen = lt.fill(st.fill)
        slot.spans.closed(reason, None if lt.last is None else lt.last - max(lt.heard))
        stats = self.ltp_stats
        stats["rounds"] += 1
        stats["close_" + reason] += 1
        stats["packets_expected"] += lt.n * lt.workers
        stats["packets_received"] += sum(lt.received)
        stats["packets_nobody"] += int((lt.counts == 0).sum())
        stats["duplicates"] += lt.duplicates
        if self._trace is not None:
            self._data_row("round_closed_" + reason, slot, r, -1,
                           int(1e6 * lt.delivered()))

    def _keep(self, slot, ranges):
        """Copies of the weights and optimizer state at ``ranges`` (before an update).  In a
        key's first round the state does not exist yet: it is created here as MXNet's Updater
        would at its first call, so the frozen elements keep a fresh state too."""
        updater = self.updater
        if slot.index not in updater.states:
            updater.states[slot.index] = updater.optimizer.create_state_multi_precision(
                slot.index, slot.store.weight_nd)
            updater.states_synced[slot.index] = True
        state = updater.states.get(slot.index)
        return [(slot.store.weight[lo:hi].copy(), cut_state(state, lo, hi))
                for lo, hi in ranges]

    def _restore(self, slot, ranges, kept):
        """Put back what ``_keep`` copied: those elements did not take part in the round."""
        state = self.updater.states.get(slot.index)
        for (lo, hi), (weight, st) in zip(ranges, kept):
            slot.store.weight[lo:hi] = weight
            _put_state(state, st, lo, hi)

    # -- optimizer ---------------------------------------------------------------------------
    def _on_set_optimizer(self, client, h, payload):
        optimizer = _read_optimizer(h, payload)
        for slot in self.slots.values():
            _floating(slot.key, wire.dtype_of(slot.dtype_code))
        try:
            _counts(optimizer)
            updater = mx.optimizer.get_updater(optimizer)
        except (AttributeError, TypeError) as e:
            raise RequestError("SET_OPTIMIZER from worker 0: the %s is not usable (%s); nothing "
                               "installed" % (type(optimizer).__name__, e)) from None
        if self.store is not None and any(isinstance(x.store, DiskSlice) for x in
                                          self.slots.values()):
            raise RequestError("SET_OPTIMIZER after keys were initialised: with MXPS_STORE=disk "
                               "a key's optimizer state lives beside its rows, so the optimizer "
                               "must be set first (Gluon's Trainer does)")
        self.optimizer = optimizer
        self.updater = updater
        self._aliased = set()
        self._templates = {}
        self._reply(client, h, MsgType.ACK, length=0)

    def _on_get_states(self, client, h, payload):
        """This server's optimizer states, update counts (by key) and update number, as data:
        the worker writes them into MXNet's states file with its own optimizer object."""
        if self.store is not None:
            raise RequestError("server %d keeps optimizer states in its disk store "
                               "(MXPS_STORE=disk): the store is the checkpoint (docs/STORE.md)"
                               % self.rank)
        if self.updater is None:
            raise RequestError("no optimizer on server %d: optimizer states live on the "
                               "servers only with update_on_kvstore=True" % self.rank)
        opt = self.updater.optimizer
        counts = _counts(opt)
        states = [[k, x.offset, x.length, _to_numpy(self.updater.states[x.index])]
                  for (k, _), x in self.slots.items() if x.index in self.updater.states]
        body = typed.pack({"states": states, "num_update": int(opt.num_update),
                           "counts": {k: counts[x.index] for (k, _), x in self.slots.items()
                                      if x.index in counts}})
        self._reply(client, h, MsgType.DATA, body, dtype=wire.NO_DTYPE, length=0)

    def _on_set_states(self, client, h, payload):
        """Optimizer states from a states file (worker 0, after it sent the file's optimizer
        with SET_OPTIMIZER): ``{"states": {(key, offset): state}, "counts": {key: count},
        "num_update": n}``, all checked before anything changes."""
        if h.sender != 0:
            raise RequestError("SET_STATES from worker %d refused unread: only worker 0 loads "
                               "optimizer states" % h.sender)
        if self.store is not None:
            raise RequestError("server %d keeps optimizer states in its disk store "
                               "(MXPS_STORE=disk): resume from the store (MXPS_STORE_RESUME=1) "
                               "instead of loading a states file" % self.rank)
        if self.updater is None:
            raise RequestError("no optimizer on server %d to load states into" % self.rank)
        blob = _fields(typed.unpack(payload), "SET_STATES", ("states", "counts", "num_update"))
        states, counts = blob["states"], blob["counts"]
        if not isinstance(states, dict) or not isinstance(counts, dict):
            raise RequestError("SET_STATES: states and counts are dicts")
        slots = []
        for target, state in states.items():
            slot = self.slots.get(target) if isinstance(target, tuple) else None
            if slot is None:
                raise RequestError("SET_STATES: states for %r, a slice server %d does not hold"
                                   % (target, self.rank))
            _check_state(state, slot.length, "SET_STATES for key %d at %d" % target)
            slots.append((slot, state))
        for k, c in counts.items():
            _count(k, "SET_STATES: a key")
            _count(c, "SET_STATES: the update count of key %s" % k)
        num_update = _count(blob["num_update"], "SET_STATES: num_update")
        for slot, state in slots:
            self.updater.states[slot.index] = _to_nd(state)
            self.updater.states_synced[slot.index] = False
        opt = self.updater.optimizer
        table = _counts(opt)
        table.clear()
        table.update(counts)
        opt.num_update = num_update
        self._aliased = set()
        for slot in self.slots.values():
            if slot.index != slot.key:
                self._alias(slot, count=True)
        self._reply(client, h, MsgType.ACK, length=0)

    def _alias(self, slot, count=False):
        """Give a further slice's optimizer index its key's multipliers and name (and with
        ``count``, its update count: for states loaded from a file, which counts by key)."""
        opt = self.updater.optimizer
        k, i = slot.key, slot.index
        for table in (opt.lr_mult, opt.wd_mult, opt.idx2name):
            if k in table:
                table[i] = table[k]
        counts = _counts(opt)
        if count and k in counts:
            counts[i] = counts[k]
        self._aliased.add(i)

    def _on_probe(self, client, h, payload):
        # echo the bytes back: the worker times both directions of its link to this server
        self._reply(client, h, MsgType.DATA, payload, dtype=wire.NO_DTYPE, length=0)

    # -- live re-planning: moving slices between servers (docs/REPLAN.md) ---------------------
    def _on_plan(self, version, old, new):
        """The scheduler's new plan.  Every worker has stopped with nothing in flight, so every
        round is complete: send each new owner its part of this server's old slices (value,
        optimizer state, update count), keep the part that stays, and build each new slice once
        all of its parts are here; then tell the scheduler."""
        mig = self.migration = _Migration(version)
        self.plan_version = version
        self._unfast()
        parts = []                         # (destination server, part)
        for key, slices in new.items():
            before = tuple(old.get(key) or ())
            if before == slices:
                continue
            empty = sum(x.length for x in slices) == 0
            for o in before:
                if o.server != self.rank:
                    continue
                slot = self.slots.get((key, o.offset))
                if slot is None or slot.length != o.length:
                    raise RequestError("plan %d: server %d does not hold key %d as %s"
                                       % (version, self.rank, key, o))
                if slot.rounds or slot.waiting:
                    raise RequestError(
                        "plan %d: key %d has rounds %s partly pushed on server %d; workers "
                        "push keys unequally" % (version, key, sorted(slot.rounds), self.rank))
                for x in slices:
                    lo, hi = max(x.offset, o.offset), min(x.stop, o.stop)
                    if hi > lo or empty:
                        parts.append((x.server, self._cut(slot, lo, hi, x.offset)))
                self._drop(slot)
            for n in slices:
                if n.server == self.rank:
                    expect = sum(1 for x in before if x.server != self.rank and
                                 (min(x.stop, n.stop) > max(x.offset, n.offset) or empty))
                    mig.incoming[(key, n.offset)] = _Incoming(n, expect)
        for dest, part in parts:           # what stays here first, then what arrived early
            if dest == self.rank:
                self._add_part(mig, part, remote=False)
        for target in [t for t, inc in mig.incoming.items() if inc.expect == 0]:
            self._install(mig, target)
        early, self.early_parts = self.early_parts, []
        for v, part in early:
            if v == version:
                self._add_part(mig, part, remote=True)
        for dest, part in parts:
            if dest != self.rank:
                self._send_part(mig, dest, part)
        self._maybe_done(mig)

    def _cut(self, slot, lo, hi, target):
        """The elements [lo, hi) of ``slot`` (key coordinates) as a migration part of the new
        slice starting at ``target``."""
        a, b = lo - slot.offset, hi - slot.offset
        part = {"key": slot.key, "target": target, "offset": lo, "length": hi - lo,
                "dtype": slot.dtype_code, "value": slot.store.cut(a, b),
                "applied": slot.applied}
        if self.updater is not None:
            if slot.index in self.updater.states:
                part["state"] = cut_state(self.updater.states[slot.index], a, b)
            count = _counts(self.updater.optimizer).get(slot.index)
            if count is not None:
                part["count"] = count
        return part

    def _drop(self, slot):
        self.slots.pop((slot.key, slot.offset), None)
        self._unfast()
        if self.updater is not None:
            self.updater.states.pop(slot.index, None)
            self.updater.states_synced.pop(slot.index, None)
            _counts(self.updater.optimizer).pop(slot.index, None)

    def _send_part(self, mig, dest, part):
        mig.next_id += 1
        mig.outgoing[mig.next_id] = dest
        mig.moved += part["value"].nbytes
        h = wire.Header(MsgType.MIGRATE, key=part["key"], sender=self.rank,
                        plan_version=mig.version, offset=part["offset"],
                        length=part["length"], request_id=mig.next_id)
        if self._trace is not None:
            self._plan_row("part_sent", mig.version, h.key, h.offset, h.length, dest,
                           part["value"].nbytes, mig.next_id)
        self._out.append(Out(Out.PEER, dest, h, typed.pack(part)))

    def _on_migrate(self, client, h, payload):
        part = _read_part(h, payload)
        if self._trace is not None:
            self._plan_row("part_received", h.plan_version, h.key, h.offset, h.length,
                           h.sender, part["value"].nbytes, h.request_id)
        mig = self.migration
        if mig is not None and mig.version == h.plan_version:
            self._reply(client, h, MsgType.ACK, length=0)
            try:
                self._add_part(mig, part, remote=True)
                self._maybe_done(mig)
            except Exception as e:
                self._plan_failed(mig.version, e)
        elif h.plan_version == self.plan_version + 1:
            # its PLAN is on the way (the scheduler sends plan v + 1 once every server has
            # installed v, so no part can be for a plan further ahead); a part sent again
            # replaces the first, so they hold at most one copy of each slice
            self.early_parts = [(v, p) for v, p in self.early_parts
                                if (p["key"], p["offset"]) != (part["key"], part["offset"])]
            self.early_parts.append((h.plan_version, part))
            self._reply(client, h, MsgType.ACK, length=0)
        else:
            raise RequestError("a part of key %d for plan %d, but server %d is at plan %d"
                               % (h.key, h.plan_version, self.rank, self.plan_version))

    def _add_part(self, mig, part, remote):
        """Keep a part of a new slice; with the last remote part in, build the slice."""
        target = (part["key"], part["target"])
        inc = mig.incoming.get(target)
        if inc is None:
            raise RequestError("plan %d: server %d got a part of key %d for a slice at %d it "
                               "does not hold" % (mig.version, self.rank, *target))
        inc.parts.append(part)
        if remote:
            inc.expect -= 1
            if inc.expect == 0:
                self._install(mig, target)

    def _install(self, mig, target):
        """Build this server's new slice ``target`` (key, offset) from its parts."""
        inc = mig.incoming.pop(target)
        key = target[0]
        want, parts = inc.slice, inc.parts
        parts.sort(key=lambda p: p["offset"])
        pos = want.offset
        for p in parts:
            if p["offset"] != pos:
                raise RequestError("plan %d: parts of key %d leave a gap at element %d"
                                   % (mig.version, key, pos))
            pos += p["length"]
        if pos != want.stop:
            raise RequestError("plan %d: parts of key %d end at %d, the slice at %d"
                               % (mig.version, key, pos, want.stop))
        applied = {p["applied"] for p in parts}
        if len(applied) != 1:
            raise RequestError("plan %d: parts of key %d come from different rounds %s"
                               % (mig.version, key, sorted(applied)))
        # a copy: a received part's value is a read-only view of its frame
        value = np.concatenate([p["value"] for p in parts])
        slot = _Slot(key, want.offset, want.length, parts[0]["dtype"],
                     MemorySlice(value, progress=self.progress))
        slot.applied = applied.pop()
        if self.updater is not None:
            slot.store.serve_weights(copy=not self.sync)
            states = [p.get("state") for p in parts]
            if any(x is not None for x in states):
                if any(x is None for x in states):
                    raise RequestError("plan %d: some parts of key %d lack optimizer state"
                                       % (mig.version, key))
                self.updater.states[slot.index] = _to_nd(_join_state(states))
                self.updater.states_synced[slot.index] = False
            if slot.index != key:
                self._alias(slot)
            counts = {p["count"] for p in parts if "count" in p}
            if counts:
                opt = self.updater.optimizer
                _counts(opt)[slot.index] = max(counts)
                opt.num_update = max(opt.num_update, max(counts))
        self.slots[target] = slot
        self._unfast()
        if self._trace is not None:
            self._plan_row("slice_built", mig.version, key, want.offset, want.length,
                           nbytes=value.nbytes)
        self._replay(target)

    def _on_migrate_reply(self, h):
        mig = self.migration
        if h.type == MsgType.ERROR or mig is None:
            raise RequestError("plan %d: a moved part of key %d was refused" % (
                h.plan_version, h.key))
        del mig.outgoing[h.request_id]
        self._maybe_done(mig)

    def _maybe_done(self, mig):
        if mig.done or mig.outgoing or mig.incoming:
            return
        mig.done = True
        if self._trace is not None:
            self._plan_row("plan_in_place", mig.version, nbytes=mig.moved)
        self._to_scheduler({"version": mig.version, "moved_bytes": mig.moved})
        log.info("server %d: plan %d in place (%d bytes sent)", self.rank, mig.version,
                 mig.moved)

    def _plan_failed(self, version, error):
        # the job cannot go on with a broken placement: the scheduler ends it with this reason
        log.error("server %d: plan %s failed: %r", self.rank, version, error)
        if self._trace is not None:
            self._plan_row("plan_failed", version if isinstance(version, int) else -1)
        self._to_scheduler({"version": version,
                            "error": "%s: %s" % (type(error).__name__, error)})

    def _on_leave(self, client, h, payload):
        """A worker that has finished: WSP rounds stop counting on it and stop waiting for it
        (``wsp.may_complete``); the rounds it held up complete now."""
        if payload is not None and memoryview(payload).nbytes:
            raise RequestError("LEAVE from worker %d carries a payload: it has none"
                               % h.sender)
        if h.sender in self.gone:
            raise RequestError("worker %d left twice" % h.sender)
        self.gone.add(h.sender)
        if self.wsp is not None:
            for slot in list(self.slots.values()):
                if slot.rounds:
                    self._complete_rounds(slot)
                    self._answer_waiting(slot)
        self._reply(client, h, MsgType.ACK, length=0)

    _HANDLERS = {
        MsgType.LEAVE: _on_leave,
        MsgType.INIT_TABLE: _on_init_table,
        MsgType.PUSH_ROWS: _on_push_rows,
        MsgType.PULL_ROWS: _on_pull_rows,
        MsgType.MIGRATE: _on_migrate,
        MsgType.PROBE: _on_probe,
        MsgType.INIT: _on_init,
        MsgType.PUSH: _on_push,
        MsgType.PUSHPULL: _on_push,
        MsgType.PULL: lambda self, client, h, p: self._on_pull(client, h),
        MsgType.SET_OPTIMIZER: _on_set_optimizer,
        MsgType.GET_STATES: _on_get_states,
        MsgType.SET_STATES: _on_set_states,
    }
