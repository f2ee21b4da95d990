"""``kvstore='mxps'``: the worker side, an MXNet ``KVStoreBase`` plugin.

Each push/pull/pushpull of a key becomes one *asynchronous operation on MXNet's engine*
(mxps.engine), exactly like the native dist kvstore: the engine starts it when the gradient is
ready (so transfers overlap with the rest of backward, highest priority first), it hands the
slices to the I/O thread and returns; the engine sees the output written only when the last
slice's reply has been copied in.  A tiny per-key "sequence" array is written by every operation
of a key, so operations on one key run in the order they were issued (push then pull sees the
push), while different keys proceed concurrently.

Arrays on any context are taken, as MXNet's own kvstore takes them: mxps reads and writes host
memory in place, so a key's arrays on other devices (GPUs) are summed into a host buffer by
MXNet's own engine copies (pinned memory for GPUs) and a pull fills a host buffer that MXNet
then copies onto every device (``_reduce``, ``_pull_target``).

Inputs are refused here, before anything is sent, where they cannot work: dtypes the wire does
not carry, integer keys with the optimizer on the servers (MXNet's update operators are floating
point only), and a second init of a key (MXNet's local kvstore refuses it too; on the servers it
would reset the key's value and rounds).
Optimizer states travel as typed payloads (``mxps.wire.typed``); the optimizer object itself
is pickled to the servers as MXNet does, by worker 0 only.
"""
import atexit
import copy
import logging
import pickle
import sys
import threading
import traceback

import mxnet as mx
import numpy as np
from mxnet.kvstore import KVStoreBase

from .. import config
from ..kernels import engine
from ..placement import plan as plan_mod, trace as trace_mod
from ..placement.metrics import StepMetrics
from ..placement.plan import Plan, ProportionalRule, chunked_rule, mxnet_default_rule
from ..store import row_sets as sparse_rows
from ..store.checkpoints import RoundClock
from ..store.table_init import TableInit
from ..roles.link import PeerLostError, fatal
from ..roles.worker import Client, RemoteError
from ..wire import compression as compression_mod, frame as wire, typed
from ..wire.frame import Header, MsgType
from ..kernels.ndview import cut_state, handle_value, numpy_view, to_default_layout

log = logging.getLogger("mxps")


class KeyError_(KeyError):
    """Unknown key or key not initialised (a KeyError whose message is readable)."""

    def __str__(self):
        return self.args[0] if self.args else ""


class _Key:
    __slots__ = ("name", "id", "shape", "dtype", "code", "size", "slices", "pushes", "seq",
                 "reduce_buf", "pull_buf", "cols", "residual", "held", "held_round")

    def __init__(self, name, id_, shape, dtype, slices):
        self.name = name
        self.id = id_
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.code = wire.dtype_code(self.dtype)
        self.size = int(np.prod(self.shape)) if self.shape else 1
        # row-sparse pushes and pulls: a row is the elements of one index of the first axis
        self.cols = int(np.prod(self.shape[1:])) if len(self.shape) > 1 else 1
        self.slices = slices
        self.pushes = 0
        self.seq = mx.nd.zeros((1,), ctx=mx.cpu(0))
        # host buffers (made on first use): the sum of a push's arrays, and a pull's values
        # before MXNet copies them onto arrays that are not in host memory (GPUs)
        self.reduce_buf = None
        self.pull_buf = None
        # the host array the last pull filled, and the round it was of: the weights after
        # that round, unless the worker changed them since (MXPS_REPLAN_SEED)
        self.held = None
        self.held_round = -1
        # gradient compression: what quantization has not sent yet, over the whole key (so a
        # re-plan that moves the key's slices re-slices it as it is), made on the first push
        self.residual = None


# ---------------------------------------------------------------------------------------------
# one connection to the job per process (like ps-lite's Postoffice), created on first use
_runtime = {}
_runtime_lock = threading.Lock()


def _client(cfg):
    with _runtime_lock:
        c = _runtime.get("client")
        if c is None:
            logging.basicConfig(level=cfg.log_level,
                                format="%(asctime)s mxps %(levelname)s %(message)s")
            try:
                c = Client(cfg)
            except PeerLostError:
                _exit_if_uncaught()
                raise
            c = _runtime["client"] = c
            _install_exit_hooks(c)
        return c


def _exit_if_uncaught():
    """A worker that cannot join the job (scheduler lost or silent, start timeout, refused
    credentials, ABORT during start-up) gets a PeerLostError from ``mx.kv.create``, which a
    script may catch; if it does not, the process ends as every node that lost a peer does:
    a one-line message naming the lost node and exit code 3 (EXIT_LOST_PEER), not exit 1 with
    a traceback through MXNet's kvstore factory."""
    previous = sys.excepthook

    def excepthook(etype, value, tb):
        if isinstance(value, PeerLostError):
            fatal("worker", str(value))
        previous(etype, value, tb)

    sys.excepthook = excepthook


def _install_exit_hooks(client):
    failure = []
    previous = sys.excepthook

    def excepthook(etype, value, tb):
        failure.append("".join(traceback.format_exception_only(etype, value)).strip())
        previous(etype, value, tb)

    def at_exit():
        if failure:
            client.report_failure("worker %d raised %s" % (client.rank, failure[-1]))
            # MXNet's own exit handler (registered before this one, so it runs after it)
            # waits for every engine operation: fail those waiting for replies
            client.abandon()
            return
        try:
            mx.nd.waitall()
            for fn in client.at_finish:      # e.g. the metrics of the last rounds
                fn()
        finally:
            client.finish()

    sys.excepthook = excepthook
    atexit.register(at_exit)


# ---------------------------------------------------------------------------------------------
HOST_DEVICES = ("cpu", "cpu_pinned", "cpu_shared")     # contexts whose memory mxps can read


def on_host(array):
    """Whether mxps can read and write ``array`` (an NDArray) in place: host memory."""
    return array.context.device_type in HOST_DEVICES


def staging_context(arrays):
    """Where the host copy of arrays on other devices goes: pinned memory if any is on a GPU
    (what a GPU copies to and from fastest, as MXNet's own kvstore stages), else cpu(0)."""
    return mx.cpu_pinned(0) if any(a.context.device_type == "gpu" for a in arrays) \
        else mx.cpu(0)


def check_compressible(name, dtype):
    """Gradient compression quantizes float32 values only (as in MXNet)."""
    if np.dtype(dtype) != np.float32:
        raise mx.base.MXNetError("mxps: key %r: Gradient compression is only supported for "
                                 "float32 type of parameters, not %s" % (name, np.dtype(dtype)))


def check_floating(name, dtype, why):
    """With the optimizer on the servers every key must be floating point."""
    if np.dtype(dtype).kind != "f":
        raise ValueError("mxps: %s: key %r has dtype %s, but the optimizer on the servers "
                         "updates floating-point keys only (MXNet's update operators refuse "
                         "integers): keep it off the kvstore or use update_on_kvstore=False"
                         % (why, name, np.dtype(dtype)))


def _as_list(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _group(key, value):
    """Pair keys with per-key value lists, as MXNet's kvstore accepts them."""
    if isinstance(key, (list, tuple)):
        values = _as_list(value)
        if len(values) != len(key):
            raise ValueError("mxps: %d keys but %d values" % (len(key), len(values)))
        return [(k, _as_list(v)) for k, v in zip(key, values)]
    return [(key, _as_list(value))]


class _Countdown:
    """Completes an engine operation when the last of n slice replies arrived (I/O thread)."""

    __slots__ = ("n", "done", "what", "lock", "link")

    def __init__(self, n, done, what, link):
        self.n = n
        self.done = done
        self.what = what
        self.lock = threading.Lock()
        self.link = link

    def __call__(self, header, payload):
        if header.type == MsgType.ERROR:
            # nothing to raise into: the training thread may be blocked in MXNet waiting for
            # this op; end the job with the server's message
            self.link.fail("%s failed: %s" % (self.what, payload.bytes.decode()))
        with self.lock:
            self.n -= 1
            last = self.n == 0
        if last:
            self.done()


class _Fill:
    """The callback of one operation's requests: a DATA reply's values go into the pulled
    array ``dview`` (or None) at the slice the reply names, then ``countdown`` counts it.
    ``land`` tells the worker's I/O thread where a reply's payload belongs, so that it lands
    there directly (``Client._lander``) and needs no copy here."""
    __slots__ = ("dview", "countdown")

    def __init__(self, dview, countdown):
        self.dview = dview
        self.countdown = countdown

    def land(self, h):
        if self.dview is None:
            return None
        return self.dview[h.offset:h.offset + h.length].view(np.uint8)

    def __call__(self, h, payload):
        if self.dview is not None and h.type == MsgType.DATA:
            got = wire.payload_array(h, payload)
            dst = self.dview[h.offset:h.offset + h.length]
            if got.ctypes.data != dst.ctypes.data:      # not landed in place
                np.copyto(dst, got)
        self.countdown(h, payload)


class _EngineOp:
    """One mxps operation on MXNet's engine: completed once, by its last reply or, when the
    script failed, by ``Client.abandon``."""

    __slots__ = ("client", "completion", "after", "lock", "finished")

    def __init__(self, client, completion, after):
        self.client = client
        self.completion = completion
        self.after = after
        self.lock = threading.Lock()
        self.finished = False

    def finish(self):
        with self.lock:
            if self.finished:
                return
            self.finished = True
        self.client.end_op(self)
        self.completion()
        self.after()


@KVStoreBase.register
class MXPS(KVStoreBase):
    """The mxps parameter server as an MXNet kvstore (``kvstore='mxps'``, sync by default)."""

    _mode = None   # None: MXPS_MODE decides; subclasses pin it

    def __init__(self):
        self._cfg = config.from_env(mode=self._mode)
        if self._cfg.role != "worker":
            raise RuntimeError("mxps kvstore created in a %s process" % self._cfg.role)
        self._client = _client(self._cfg)
        if self._client.cfg.mode != self._cfg.mode:
            raise RuntimeError("mxps: this process already joined the job in %s mode; a %s "
                               "kvstore cannot join it too" % (self._client.cfg.mode,
                                                               self._cfg.mode))
        rule = mxnet_default_rule
        if self._cfg.plan == "chunked":
            rule = chunked_rule(self._cfg.max_chunk)
        self.server_rates = None
        if self._cfg.plan == "adaptive":
            # bandwidth-proportional placement: the first plan from a start-up probe; live
            # re-plan points follow it (``_replan_point``)
            self.server_rates = self._client.agree_rates(self._cfg.probe_bytes)
            rule = ProportionalRule(self.server_rates, self._cfg.min_slice, self._cfg.max_chunk)
            log.info("worker %d: server rates (MB/s) %s", self.rank,
                     " ".join("%.1f" % (r / 1e6) for r in self.server_rates))
        self._plan = Plan(self._client.num_servers, bigarray_bound=self._cfg.bigarray_bound,
                          rule=rule)
        if self._cfg.failover or self._cfg.divert:   # docs/FAILOVER.md, roles.reroute
            self._client.on_failover = self._failover
            self._client.route = self._route
        path = self._cfg.metrics
        if path:
            path = path.format(rank=self.rank) if "{rank}" in path else \
                "%s.worker%d" % (path, self.rank)
        self._metrics = StepMetrics(self._client, path, self._plan.version, self.server_rates,
                                    keep=self._cfg.replanning)
        if path:
            self._client.at_finish.append(lambda: self._metrics.flush(self._round + 1))
        # live re-planning: every MXPS_REPLAN_INTERVAL rounds, before the round's first
        # operation, this worker waits until it has nothing in flight and asks the scheduler
        self._round = 0
        self._next_replan = 1 + self._cfg.replan_interval if self._cfg.replanning else None
        self._full_next = True      # the first point is a full one; then the scheduler says
        self._ticket = None         # the scheduler's answer to a light point, still to read
        self._ticket_round = None   # ... and the round of that point
        # MXPS_TRACE: this worker's round boundaries and re-plan points, and every plan's
        # table (placement.trace); None when off
        trace = self._client.trace
        self._trace = trace.rows["points"] if trace is not None else None
        self._trace_plans = trace.plans if trace is not None else None
        self._inflight = 0
        self._idle = threading.Condition()
        self._keys = {}
        self._str_ids = {}
        self._ids = {}
        self._optimizer = None
        self._updater = None
        self._compression = None    # set_gradient_compression's codec
        # MXPS_STORE_CHECKPOINT_SECONDS: worker 0 marks the rounds the servers checkpoint
        self._checkpoints = RoundClock(self._cfg.store_checkpoint_seconds) \
            if self._cfg.store_checkpoint_seconds and self.rank == 0 else None

    # -- properties MXNet reads --------------------------------------------------------------
    @property
    def type(self):
        return "dist_sync" if self._cfg.sync else "dist_async"

    @property
    def rank(self):
        return self._client.rank

    @property
    def num_workers(self):
        return self._client.num_workers

    @property
    def resume_round(self):
        """mxps's own: the rounds a job resumed from a disk store (MXPS_STORE_RESUME=1) has
        behind it, the checkpoint all servers returned to; 0 for a new job."""
        return self._client.resume_round or 0

    @staticmethod
    def is_capable(capability):
        if capability.lower() == KVStoreBase.OPTIMIZER:
            return True
        raise ValueError("Unknown capability: {}".format(capability))

    # -- keys --------------------------------------------------------------------------------
    def _key_id(self, name):
        if isinstance(name, (int, np.integer)):
            if not 0 <= int(name) < 2 ** 31:
                raise ValueError("mxps: key %r out of range [0, 2**31)" % (name,))
            id_ = int(name)
        elif isinstance(name, str):
            # string keys get ids in first-seen order, as MXNet does (every worker inits the
            # same keys in the same order); Module uses parameter names as keys
            id_ = self._str_ids.setdefault(name, len(self._str_ids))
        else:
            raise TypeError("mxps: a key is an int or a str, got %r" % (name,))
        owner = self._ids.setdefault(id_, name)
        if owner != name:
            raise ValueError("mxps: key %r and key %r map to the same id %d: do not mix int and "
                             "str keys" % (name, owner, id_))
        return id_

    def _meta(self, name, what):
        k = self._keys.get(name)
        if k is None:
            raise KeyError_("mxps: %s of key %r before it was initialised: call init (or "
                            "broadcast / the Trainer's first step) on the key first"
                            % (what, name))
        return k

    @staticmethod
    def _check(k, arrays, what):
        for a in arrays:
            if not isinstance(a, mx.nd.NDArray):
                raise TypeError("mxps: %s of key %r: expected NDArray, got %s"
                                % (what, k.name, type(a).__name__))
            if a.stype != "default":
                raise TypeError("mxps: %s of key %r: sparse storage (%s) is not supported"
                                % (what, k.name, a.stype))
            if tuple(a.shape) != k.shape:
                raise ValueError("mxps: %s of key %r: shape %s differs from the shape %s it was "
                                 "initialised with" % (what, k.name, tuple(a.shape), k.shape))
            if np.dtype(a.dtype) != k.dtype:
                raise ValueError("mxps: %s of key %r: dtype %s differs from the dtype %s it was "
                                 "initialised with" % (what, k.name, np.dtype(a.dtype), k.dtype))

    # -- init / broadcast --------------------------------------------------------------------
    def init(self, key, value):
        """Initialise keys from rank 0's values (every worker calls it; a barrier follows).
        Every key is checked before any is sent; a key is initialised once."""
        groups = _group(key, value)
        names = [n for n, _ in groups]
        for name, vals in groups:
            if isinstance(vals[0], TableInit):
                if len(vals) != 1:
                    raise TypeError("mxps: init of key %r: one TableInit, not a list" % (name,))
                self._check_table(name, vals[0], names)
                continue
            self._check_init(name, vals, names)
        keys = []
        for name, vals in groups:
            v = vals[0]
            id_ = self._key_id(name)
            size = int(np.prod(v.shape)) if v.shape else 1
            keys.append((_Key(name, id_, v.shape, v.dtype, self._plan.slices(id_, size)), v))
        if self._trace_plans is not None:
            self._trace_plans[self._plan.version] = plan_mod.table_to_json(self._plan.table())
        for k, v in keys:
            name = k.name
            self._keys[name] = k
            if self.rank == 0 and isinstance(v, TableInit):
                body = typed.pack(v.describe())      # the rule, not the values
                for s in k.slices:
                    self._client.call(s.server, Header(
                        MsgType.INIT_TABLE, key=k.id, plan_version=self._plan.version,
                        offset=s.offset, length=s.length, dtype=k.code, iteration=k.cols),
                        body, what="init of key %r" % (name,))
            elif self.rank == 0:
                flat = v.asnumpy().reshape(-1)
                for s in k.slices:
                    self._client.call(s.server, Header(
                        MsgType.INIT, key=k.id, plan_version=self._plan.version,
                        offset=s.offset, length=s.length, dtype=k.code, iteration=k.cols),
                        flat[s.offset:s.stop], what="init of key %r" % (name,))
        self._client.barrier()

    def _check_table(self, name, rule, names):
        try:
            wire.dtype_code(rule.dtype)
        except wire.WireError as e:
            raise TypeError("mxps: init of key %r: %s" % (name, e)) from None
        if name in self._keys or names.count(name) > 1:
            raise ValueError("mxps: init of key %r: the key is already initialised" % (name,))

    def _check_init(self, name, vals, names):
        for v in vals:
            if not isinstance(v, mx.nd.NDArray):
                raise TypeError("mxps: init of key %r: expected NDArray, got %s"
                                % (name, type(v).__name__))
        try:
            wire.dtype_code(vals[0].dtype)
        except wire.WireError as e:
            raise TypeError("mxps: init of key %r: %s" % (name, e)) from None
        if name in self._keys or names.count(name) > 1:
            raise ValueError("mxps: init of key %r: the key is already initialised; a key is "
                             "initialised once (as in MXNet's kvstores: a second init would "
                             "reset its value and rounds on the servers): push to change its "
                             "value, or init a new key" % (name,))
        if self._optimizer is not None:
            check_floating(name, vals[0].dtype, "init")

    def broadcast(self, key, value, out, priority=0):
        """Initialise from rank 0 and pull the value into ``out`` on every worker."""
        self.init(key, value)
        self.pull(key, out=out, priority=priority)

    # -- the data path -----------------------------------------------------------------------
    def _reduce(self, k, vals):
        """The sum of a key's per-device arrays in host memory (engine operations: MXNet's
        copies from each device, then its sum); one array in host memory: the array itself."""
        if len(vals) == 1 and on_host(vals[0]):
            return vals[0]
        if k.reduce_buf is None:
            k.reduce_buf = mx.nd.zeros(k.shape, ctx=staging_context(vals), dtype=k.dtype)
        buf = k.reduce_buf
        if len(vals) == 1:
            vals[0].copyto(buf)
            return buf
        srcs = [v if v.context == buf.context else v.as_in_context(buf.context) for v in vals]
        mx.nd.add_n(*srcs, out=buf)
        return buf

    def _pull_target(self, k, outs):
        """(the host array a pull fills, the arrays MXNet then copies it onto): the first
        output if it is in host memory, else the key's pull buffer."""
        if on_host(outs[0]):
            return outs[0], outs[1:]
        if k.pull_buf is None:
            k.pull_buf = mx.nd.zeros(k.shape, ctx=staging_context(outs), dtype=k.dtype)
        return k.pull_buf, outs

    def _launch(self, k, msg, src, dst, priority):
        """One engine op for key k: send ``src`` slices (PUSH/PUSHPULL), fill ``dst`` (PULL)."""
        client = self._client
        it = k.pushes
        if it:
            self._metrics.on_round(it)
        what = "%s of key %r" % (MsgType(msg).name.lower(), k.name)
        plan_version = self._plan.version
        slices = k.slices              # the placement when the op is issued, not when it runs
        sync = self._cfg.sync
        codec = self._compression if msg != MsgType.PULL and src is not None else None
        mark = wire.CHECKPOINT if msg != MsgType.PULL and self._marks(it) else 0
        if codec is not None and k.residual is None:
            k.residual = np.zeros(k.size, np.float32)
        residual = k.residual

        def run(completion):
            op = _EngineOp(client, completion, self._op_done)
            if not client.begin_op(op):       # the script failed: nothing more is sent
                op.finish()
                return
            # an array in a oneDNN layout first: numpy_view would have MXNet convert it by an
            # engine operation that waits for this one (ndview.to_default_layout)
            for a in (src, dst):
                if a is not None and to_default_layout(a):
                    log.debug("worker %d: %s: converted an array oneDNN had left in its own "
                              "layout", client.rank, what)
            sview = numpy_view(src) if src is not None else None
            dview = numpy_view(dst) if dst is not None else None
            done = op.finish

            # sync: a PUSHPULL goes as a PULL (answered when the round is complete) and a
            # PUSH that waits its turn in the I/O thread's per-server priority queue
            split = msg == MsgType.PUSHPULL and sync
            countdown = _Countdown(len(slices) * (2 if split else 1), done, what, client.link)

            on_reply = _Fill(dview, countdown)

            for s in slices:
                if split:
                    client.submit(s.server, Header(
                        MsgType.PULL, key=k.id, iteration=it, plan_version=plan_version,
                        offset=s.offset, length=s.length, dtype=k.code), None, on_reply)
                # a PULL names the dtype it expects back: a reply of another is refused
                h = Header(MsgType.PUSH if split else msg, key=k.id, iteration=it,
                           plan_version=plan_version, offset=s.offset, length=s.length,
                           dtype=k.code, flags=mark)
                payload = sview[s.offset:s.stop] if sview is not None else None
                if codec is not None:
                    # the engine runs one operation of a key at a time (its seq), so the
                    # residual is this operation's alone
                    h.flags |= codec.flag
                    payload = codec.encode(payload, residual[s.offset:s.stop])
                client.submit(s.server, h, payload, on_reply,
                              priority if sync and h.type == MsgType.PUSH else None)

        with self._idle:
            self._inflight += 1
        # every array the operation views is held mutable, so that it may convert one that a
        # oneDNN operator left in its own layout in place (ndview.to_default_layout); a source
        # that is not mxps's own buffer may be such an array (a weight pushed for averaging)
        read = [] if src is None or src is dst else [handle_value(src)]
        consts = read if src is k.reduce_buf else []
        muts = [handle_value(k.seq)] + ([handle_value(dst)] if dst is not None else []) + \
            ([] if src is k.reduce_buf else read)
        engine.push_async(run, consts, muts, priority, b"mxps_" + MsgType(msg).name.encode())

    def _marks(self, round_):
        """Whether this worker marks its pushes of ``round_`` as the servers' checkpoint."""
        return self._checkpoints is not None and round_ > 0 and self._checkpoints.marks(round_)

    def _op_done(self):
        with self._idle:
            self._inflight -= 1
            if not self._inflight:
                self._idle.notify_all()

    # -- live re-planning (docs/REPLAN.md) ---------------------------------------------------
    def _point(self, kind, r, new_version=None, full=None):
        """One trace row of this worker's points table (placement.trace)."""
        self._trace.append((kind, trace_mod.clock(), r, self._plan.version, new_version, full))

    def _next_push(self, k):
        k.pushes += 1
        if k.pushes > self._round:
            self._round = k.pushes
            if self._trace is not None:
                self._point("round_begin", self._round)
            if self._next_replan is not None and self._round >= self._next_replan:
                self._next_replan = self._round + self._cfg.replan_interval
                self._replan(self._round)

    def _replan(self, r):
        """Round ``r`` is about to start: wait until this worker has nothing in flight (every
        round before r is complete on the servers once all workers are here), report the
        traffic of the last rounds, and install the plan the scheduler answers with, if any.
        A light point (the scheduler's answer to the last point said no plan change is in
        view, ``MXPS_REPLAN_LIGHT``) only reports and goes on."""
        tracing = self._trace is not None
        if tracing:
            self._point("drain_start", r)
        with self._idle:
            while self._inflight:
                self._idle.wait(1.0)
        if tracing:
            self._point("drain_end", r)
        self._metrics.flush(r)
        if self._ticket is not None:
            answer = self._client.replan_answer(self._ticket)
            self._ticket = None
            if tracing:
                self._point("replan_answer", self._ticket_round, self._plan.version, 0)
            self._metrics.agreed = answer.get("rates")
            self._full_next = answer.get("full_next", True)
        full = self._full_next or not self._cfg.replan_light
        report = {"round": r, "traffic": self._metrics.take_recent(), "full": full,
                  "seed": self._seedable(r),
                  "force": self._cfg.replan_force, "min_slice": self._cfg.min_slice,
                  "max_chunk": self._cfg.max_chunk,
                  "min_gain": self._cfg.replan_min_gain, "horizon": self._cfg.replan_horizon}
        if self.rank == 0:
            ids = [k.id for k in self._keys.values()]
            report["keys"] = [[k.id, k.size] for k in self._keys.values()]
            table = self._plan.table()
            report["table"] = plan_mod.table_to_json({i: table[i] for i in ids})
        if tracing:
            self._point("replan_sent", r, None, int(full))
        if not full:
            self._ticket = self._client.replan(report, wait=False)
            self._ticket_round = r
            return
        answer = self._client.replan(report)
        if answer.get("seed") is not None:
            # MXPS_REPLAN_SEED: send the new owners the weights asked of this worker, then wait
            # for the answer that releases it (the servers have the state in place)
            ticket = self._client.link.replans
            self._send_seeds(answer["version"], answer["seed"])
            answer = self._client.replan_answer(ticket)
        if tracing:
            self._point("replan_answer", r, self._plan.version if answer.get("table") is None
                        else answer["version"], 1)
        self._metrics.agreed = answer.get("rates")
        self._full_next = answer.get("full_next", True)
        if answer.get("table") is None:
            return
        self._plan = self._plan.replaced(answer["version"],
                                         plan_mod.table_from_json(answer["table"]))
        for k in self._keys.values():
            k.slices = self._plan.slices(k.id, k.size)
        if self._trace_plans is not None:
            self._trace_plans[self._plan.version] = plan_mod.table_to_json(self._plan.table())
        self._metrics.new_plan(r, self._plan.version, answer.get("moved_bytes", 0))
        log.info("worker %d: plan %d from round %d", self.rank, self._plan.version, r)

    def _check_failover(self, k):
        """MXPS_FAILOVER rebuilds a lost slice from the weights the workers pulled: a push
        with the update on the workers (the servers hold each round's sum) is refused."""
        if (self._cfg.failover or self._cfg.divert) and self._optimizer is None:
            raise ValueError("mxps: push of key %r: %s=1 needs the optimizer on "
                             "the servers (update_on_kvstore=True, or set_optimizer before "
                             "pushing): with the update on the workers a moved server's round "
                             "sums cannot be rebuilt" % (k.name, "MXPS_FAILOVER"
                                                         if self._cfg.failover else
                                                         "MXPS_DIVERT"))

    def _failover(self, version, dead, divert=False, avoid=()):
        """Server ``dead`` is lost (the I/O thread, at the scheduler's FAILOVER), or slow
        (``divert``, MXPS_DIVERT): the plan of ``version`` puts its slices on the others but
        ``avoid`` (servers found slow earlier) (``Plan.without``).  Returns (the old table, the new one, {(key, offset): (successor,
        length)})."""
        if self._optimizer is None:
            self._client.link.fail(
                "server %d was %s and its keys cannot be rebuilt: MXPS_FAILOVER and "
                "MXPS_DIVERT need the optimizer on the servers (update_on_kvstore / "
                "set_optimizer); with the update on the workers the servers hold only each "
                "round's sum" % (dead, "slow" if divert else "lost"))
        old = self._plan.table()
        if self._trace is not None:
            self._point("divert" if divert else "failover", self._round, version)
        # a lost server's slices go to its buddy, which holds their state (MXPS_REPLICA); a
        # slow one's are spread by elements, each successor asking the buddy for the state
        self._plan, moved = self._plan.without(version, [dead, *avoid],
                                               buddies=self._cfg.replica and not divert,
                                               alive=divert)
        for k in list(self._keys.values()):
            k.slices = self._plan.slices(k.id, k.size)
        if self._trace_plans is not None:
            self._trace_plans[version] = plan_mod.table_to_json(self._plan.table())
        lengths = {(key, x.offset): x.length for key, slices in old.items() for x in slices}
        return old, self._plan.table(), {part: (to, lengths[part])
                                         for part, to in moved.items()}

    def _route(self, key, offset):
        """(server, plan version) of the slice of ``key`` at ``offset`` in the plan in force
        (server None: it has no slice there)."""
        plan = self._plan
        for x in plan.table().get(key, ()):
            if x.offset == offset:
                return x.server, plan.version
        return None, plan.version

    def _seedable(self, r):
        """The keys whose weights this worker holds as the servers do at the point before round
        ``r`` (MXPS_REPLAN_SEED): in sync mode with the optimizer on the servers, a key whose
        last pull was of round r - 1 has them in the array that pull filled (Gluon and Module
        do not write weights the servers update).  A key pulled only at the start (Gluon's
        BatchNorm running statistics, which the forward pass changes on the worker) or only by
        row_sparse_pull is not one."""
        if not (self._cfg.replan_seed and self._cfg.mode == "sync" and self._optimizer):
            return []
        return sorted(k.id for k in self._keys.values()
                      if k.held is not None and k.held_round >= r - 1)

    def _send_seeds(self, version, tasks):
        """Each task [key, offset, length, server]: that part of the key's held weights to
        that server (the old owner checks them against its own: a checksum)."""
        by_id = {k.id: k for k in self._keys.values()}
        for key, offset, length, server in tasks:
            k = by_id.get(key)
            if k is None or k.held is None or offset + length > k.size:
                raise RuntimeError("mxps: the scheduler asked worker %d for key %d [%d, +%d), "
                                   "which it does not hold" % (self.rank, key, offset, length))
            values = numpy_view(k.held).reshape(-1)[offset:offset + length]
            self._client.call(server, Header(
                MsgType.SEED, key=key, sender=self.rank, plan_version=version, offset=offset,
                length=length, dtype=k.code), np.ascontiguousarray(values), what="seed")

    def push(self, key, value, priority=0):
        for name, vals in _group(key, value):
            k = self._meta(name, "push")
            if any(isinstance(v, mx.nd.NDArray) and v.stype == "row_sparse" for v in vals):
                self._push_rows(k, vals, priority)
                continue
            self._check(k, vals, "push")
            if self._compression is not None:
                check_compressible(k.name, k.dtype)
            self._check_failover(k)
            grad = self._reduce(k, vals)
            self._next_push(k)
            self._launch(k, MsgType.PUSH, grad, None, priority)

    def pull(self, key, out=None, priority=0, ignore_sparse=True):
        if out is None:
            raise ValueError("mxps: pull needs `out`")
        for name, outs in _group(key, out):
            k = self._meta(name, "pull")
            if any(isinstance(o, mx.nd.NDArray) and o.stype != "default" for o in outs):
                if ignore_sparse:       # MXNet's pull skips sparse outputs the same way
                    outs = [o for o in outs if o.stype == "default"]
                    if not outs:
                        continue
                else:
                    raise TypeError("mxps: pull of key %r into %s storage: use "
                                    "row_sparse_pull(key, out, row_ids=...)"
                                    % (name, ", ".join(sorted({o.stype for o in outs}))))
            self._check(k, outs, "pull")
            dst, rest = self._pull_target(k, outs)
            self._launch(k, MsgType.PULL, None, dst, priority)
            k.held, k.held_round = dst, k.pushes
            self._copy_out(dst, rest)

    def pushpull(self, key, value, out=None, priority=0):
        groups = _group(key, value)
        outs_groups = [vals for _, vals in groups] if out is None else \
            [o for _, o in _group(key, out)]
        for (name, vals), outs in zip(groups, outs_groups):
            k = self._meta(name, "pushpull")
            if any(isinstance(v, mx.nd.NDArray) and v.stype == "row_sparse" for v in vals):
                self._push_rows(k, vals, priority)           # then a pull, as MXNet does
                self.pull(name, out=outs, priority=priority, ignore_sparse=False)
                continue
            self._check(k, vals, "push")
            self._check(k, outs, "pull")
            if self._compression is not None:
                check_compressible(k.name, k.dtype)
            self._check_failover(k)
            grad = self._reduce(k, vals)
            dst, rest = self._pull_target(k, outs)
            self._next_push(k)
            self._launch(k, MsgType.PUSHPULL, grad, dst, priority)
            k.held, k.held_round = dst, k.pushes
            self._copy_out(dst, rest)

    @staticmethod
    def _copy_out(dst, rest):
        """The pulled value onto the other devices (MXNet's copies, engine operations).  Not
        recorded by autograd: Gluon may pull inside a forward pass (its deferred
        ``_init_params`` broadcast, from ``row_sparse_data``), where the outputs are already
        in the graph and a recorded copy into them is refused; MXNet's own kvstore copies in
        C++, outside the recording, too."""
        if rest:
            with mx.autograd.pause():
                for o in rest:
                    dst.copyto(o)

    # -- row-sparse keys (docs/SPARSE.md) ----------------------------------------------------
    def _check_rows(self, k, arrays, what, stype):
        for a in arrays:
            if not isinstance(a, mx.nd.NDArray):
                raise TypeError("mxps: %s of key %r: expected NDArray, got %s"
                                % (what, k.name, type(a).__name__))
            if a.stype != stype:
                raise TypeError("mxps: %s of key %r: expected %s storage, got %s (every "
                                "device's array must have the same storage)"
                                % (what, k.name, stype, a.stype))
            if tuple(a.shape) != k.shape or np.dtype(a.dtype) != k.dtype:
                raise ValueError("mxps: %s of key %r: %s %s differs from the %s %s it was "
                                 "initialised with" % (what, k.name, tuple(a.shape),
                                                       np.dtype(a.dtype), k.shape, k.dtype))

    def _push_rows(self, k, vals, priority):
        """A row-sparse push: each slice gets the rows' elements inside it (an empty push if
        none: every worker pushes every slice every round, so rounds still count).  The
        gradient is read here, in the calling thread (it waits for backward), and sent by the
        I/O thread; the key's next pull waits for the round on the server, as for a dense
        push."""
        if self._compression is not None:
            raise mx.base.MXNetError("mxps: push of key %r: Gradient compression for row "
                                     "sparse storage type is not supported" % (k.name,))
        self._check_rows(k, vals, "push", "row_sparse")
        grad = vals[0]
        for v in vals[1:]:                  # several devices: their sum, still row-sparse
            grad = mx.nd.sparse.elemwise_add(grad, v.as_in_context(grad.context))
        ids = grad.indices.asnumpy().astype(np.int64)
        data = grad.data.asnumpy().reshape(ids.size, k.cols)
        self._next_push(k)
        it = k.pushes
        mark = wire.CHECKPOINT if self._marks(it) else 0
        what = "push of key %r" % (k.name,)
        with self._idle:
            self._inflight += 1
        countdown = _Countdown(len(k.slices), self._op_done, what, self._client.link)
        for s in k.slices:
            sel, flat = sparse_rows.cut(ids, data, k.cols, s.offset, s.stop)
            body = typed.pack({"cols": k.cols, "ids": np.ascontiguousarray(sel),
                               "values": np.ascontiguousarray(flat)})
            self._client.submit(s.server, Header(
                MsgType.PUSH_ROWS, key=k.id, iteration=it, plan_version=self._plan.version,
                offset=s.offset, length=s.length, dtype=k.code, flags=mark), body, countdown,
                priority if self._cfg.sync else None)

    def row_sparse_pull(self, key, out=None, priority=0, row_ids=None):
        """Fill each row-sparse ``out`` with the rows ``row_ids`` of the key (duplicates and
        order do not matter), after this worker's last push of it, as MXNet does.  Waits for
        the rows (deadline MXPS_TIMEOUT)."""
        if out is None or row_ids is None:
            raise ValueError("mxps: row_sparse_pull needs `out` and `row_ids`")
        for (name, outs), ids_list in zip(_group(key, out), self._row_id_groups(key, row_ids)):
            k = self._meta(name, "row_sparse_pull")
            self._check_rows(k, outs, "row_sparse_pull", "row_sparse")
            if len(ids_list) == 1 and len(outs) > 1:
                ids_list = ids_list * len(outs)
            if len(ids_list) != len(outs):
                raise ValueError("mxps: row_sparse_pull of key %r: %d outputs but %d row_ids"
                                 % (name, len(outs), len(ids_list)))
            for o, rid in zip(outs, ids_list):
                rows = self._pull_rows(k, rid)
                # Gluon pulls rows inside its forward pass (Parameter.row_sparse_data):
                # filling `out` is the kvstore's business, not an operation to differentiate
                with mx.autograd.pause():
                    rows.copyto(o)

    @staticmethod
    def _row_id_groups(key, row_ids):
        if isinstance(key, (list, tuple)):
            groups = _as_list(row_ids)
            if len(groups) != len(key):
                raise ValueError("mxps: row_sparse_pull: %d keys but %d row_ids"
                                 % (len(key), len(groups)))
            return [_as_list(g) for g in groups]
        return [_as_list(row_ids)]

    def _pull_rows(self, k, rid):
        """The rows ``rid`` (an NDArray of row ids) of key k as a RowSparseNDArray."""
        if not isinstance(rid, mx.nd.NDArray):
            raise TypeError("mxps: row_sparse_pull of key %r: row_ids must be NDArrays, got %s"
                            % (k.name, type(rid).__name__))
        ids = np.unique(rid.asnumpy().astype(np.int64).reshape(-1))
        n_rows = k.shape[0] if k.shape else 1
        if ids.size and (ids[0] < 0 or ids[-1] >= n_rows):
            raise ValueError("mxps: row_sparse_pull of key %r: row ids must lie in [0, %d), "
                             "got %d..%d" % (k.name, n_rows, ids[0], ids[-1]))
        flat = np.empty(ids.size * k.cols, dtype=k.dtype)
        done = threading.Event()
        errors = []
        wanted = []
        for s in k.slices:
            first = int(np.searchsorted(ids, s.offset // k.cols))
            last = int(np.searchsorted(ids, -(-s.stop // k.cols)))
            if first == last:
                continue
            head = max(0, s.offset - int(ids[first]) * k.cols)
            tail = max(0, (int(ids[last - 1]) + 1) * k.cols - s.stop)
            wanted.append((s, ids[first:last], first * k.cols + head, last * k.cols - tail))
        left = [len(wanted)]
        lock = threading.Lock()

        def on_reply(lo, hi):
            def fill(h, payload):
                try:
                    if h.type == MsgType.ERROR:
                        errors.append(payload.bytes.decode())
                    else:
                        got = wire.payload_array(h, payload)
                        if got.size != hi - lo:
                            raise ValueError("%d elements for %d" % (got.size, hi - lo))
                        flat[lo:hi] = got
                except Exception as e:          # noqa: BLE001  (reported below)
                    errors.append("%s: %s" % (type(e).__name__, e))
                with lock:
                    left[0] -= 1
                    if not left[0]:
                        done.set()
            return fill

        if not wanted:
            done.set()
        for s, sel, lo, hi in wanted:
            self._client.submit(s.server, Header(
                MsgType.PULL_ROWS, key=k.id, iteration=k.pushes, plan_version=self._plan.version,
                offset=s.offset, length=s.length), typed.pack({"cols": k.cols, "ids": sel}),
                on_reply(lo, hi))
        if not done.wait(self._cfg.timeout):
            raise TimeoutError("mxps: row_sparse_pull of key %r got no answer within %.0f s "
                               "(MXPS_TIMEOUT)" % (k.name, self._cfg.timeout))
        if errors:
            raise RuntimeError("mxps: row_sparse_pull of key %r failed: %s"
                               % (k.name, errors[0]))
        return mx.nd.sparse.row_sparse_array(
            (flat.reshape((ids.size,) + k.shape[1:]), ids), shape=k.shape, dtype=k.dtype)

    def set_gradient_compression(self, compression_params):
        """Compress every later push of a float32 key as MXNet's dist kvstore does
        (``{'type': '2bit', 'threshold': 0.5}`` or ``'1bit'``; ``mxps.wire.compression``):
        a residual per key on this worker, the quantized bits on the wire, pulls in full
        precision.  Unlike native MXNet 1.9.1, pushpull (Gluon's Trainer) compresses too."""
        try:
            codec = compression_mod.parse(compression_params)
        except compression_mod.CompressionError as e:
            raise mx.base.MXNetError("mxps: %s" % e) from None
        self._compression = codec
        log.info("mxps: gradient compression %s, threshold %g", codec.type, codec.threshold)

    # -- optimizer on the servers ------------------------------------------------------------
    def set_optimizer(self, optimizer):
        """Run ``optimizer`` on the servers (rank 0 sends it; every worker waits for it)."""
        for k in self._keys.values():
            check_floating(k.name, k.dtype, "set_optimizer")
        self._optimizer = optimizer
        self._updater = mx.optimizer.get_updater(optimizer)
        if self.rank == 0:
            body = pickle.dumps(self._server_copy(optimizer))
            self._call_live(Header(MsgType.SET_OPTIMIZER), body, "set_optimizer")
        self._client.barrier()

    def _call_live(self, header, body, what):
        """Call every server not lost; one lost meanwhile (MXPS_FAILOVER) is skipped: its keys
        are on the others now, rebuilt from the workers."""
        for s in self._client.live_servers():
            try:
                self._client.call(s, Header(header.type), body, what=what)
            except RemoteError:
                if s not in self._client.lost:
                    raise

    @staticmethod
    def _server_copy(optimizer):
        # MXNet pickles the optimizer without param_dict (Optimizer.__getstate__), so the
        # native servers lose every Parameter's lr_mult/wd_mult; mxps carries them over as
        # the optimizer's index-keyed multipliers, which _get_lrs/_get_wds consult next.
        o = copy.copy(optimizer)
        o.lr_mult = dict(optimizer.lr_mult)
        o.wd_mult = dict(optimizer.wd_mult)
        for idx, p in (optimizer.param_dict or {}).items():
            o.lr_mult[idx] = p.lr_mult
            o.wd_mult[idx] = p.wd_mult
        return o

    def save_optimizer_states(self, fname, dump_optimizer=False):
        """Gather the optimizer states from the servers into MXNet's Updater file format."""
        if self._optimizer is None:
            raise RuntimeError("mxps: no optimizer on the servers (call set_optimizer, or "
                               "use update_on_kvstore=True)")
        mx.nd.waitall()
        by_id = {k.id: k for k in self._keys.values()}
        while True:
            # a server lost meanwhile (MXPS_FAILOVER): its slices are on the others now, and
            # some of those answered before they had them; ask the servers left again
            seen = len(self._client.failovers)
            try:
                parts, counts, num_update = self._gather_states(by_id)
            except RemoteError:
                if len(self._client.failovers) == seen:
                    raise
                continue
            if len(self._client.failovers) == seen:
                break
        states = {}
        for key, pieces in parts.items():
            pieces.sort(key=lambda p: p[0])
            states[key] = _join_states([p[1] for p in pieces], by_id[key].shape)
        # the servers send numbers, not their optimizer: the file gets this worker's optimizer
        # (as sent to the servers) with the servers' update counts
        optimizer = self._server_copy(self._optimizer)
        optimizer.idx2name = dict(optimizer.idx2name)
        # the dict MXNet's Updater uses is device 0's (see roles.server_state._counts)
        optimizer._index_update_count = dict(counts)
        optimizer._all_index_update_counts = {0: optimizer._index_update_count}
        optimizer.num_update = max(counts.values(), default=num_update)
        data = pickle.dumps((states, optimizer) if dump_optimizer else states)
        with open(fname, "wb") as f:
            f.write(data)

    def _gather_states(self, by_id):
        parts, counts, num_update = {}, {}, 0
        for s in self._client.live_servers():
            _, payload = self._client.call(s, Header(MsgType.GET_STATES), what="save states")
            reply = read_states_reply(s, payload, by_id)
            for key, off, _, state in reply["states"]:
                parts.setdefault(key, []).append((off, state))
            counts.update(reply["counts"])
            num_update = max(num_update, reply["num_update"])
        return parts, counts, num_update

    def load_optimizer_states(self, fname):
        """Load states saved by ``save_optimizer_states`` into the servers."""
        if self._optimizer is None:
            raise RuntimeError("mxps: no optimizer on the servers to load states into")
        with open(fname, "rb") as f:
            data = f.read()          # this worker's own file: MXNet's Updater format (pickle)
        updater = mx.optimizer.get_updater(self._optimizer)
        updater.set_states(data)
        self._updater = updater
        self._optimizer = updater.optimizer
        if self.rank == 0:
            by_id = {k.id: k for k in self._keys.values()}
            per_server = [dict() for _ in range(self._client.num_servers)]
            for key, state in updater.states.items():
                k = by_id.get(key)
                if k is None:
                    raise KeyError_("mxps: optimizer states for key id %r, which this kvstore "
                                    "does not hold" % (key,))
                for s in k.slices:
                    per_server[s.server][(key, s.offset)] = cut_state(state, s.offset, s.stop)
            # the file's optimizer (hyperparameters) goes as MXNet's pickle, the one pickle on
            # the wire; the states, update counts and update number as data
            opt = updater.optimizer
            body = pickle.dumps(self._server_copy(opt))
            counts = {i: int(c) for i, c in opt._index_update_count.items()
                      if isinstance(i, int) and i >= 0}
            for s, states in enumerate(per_server):
                if s in self._client.lost:
                    continue
                self._client.call(s, Header(MsgType.SET_OPTIMIZER), body, what="load states")
                self._client.call(s, Header(MsgType.SET_STATES), typed.pack(
                    {"states": states, "counts": counts, "num_update": int(opt.num_update)}),
                    what="load states")
        self._client.barrier()

    # -- misc --------------------------------------------------------------------------------
    def barrier(self):
        """Wait until every worker reaches this barrier."""
        mx.nd.waitall()
        self._client.barrier()

    _barrier = barrier

    def _send_command_to_servers(self, head, body):
        raise NotImplementedError("mxps: server commands are not supported")


def read_states_reply(server, payload, by_id):
    """Server ``server``'s GET_STATES reply, checked: ``{"states": [[key, offset, length,
    state], ...], "counts": {key: count}, "num_update": n}`` for keys this worker holds."""
    try:
        reply = typed.unpack(payload)
    except wire.WireError as e:
        raise RuntimeError("mxps: server %d's optimizer states cannot be read: %s"
                           % (server, e)) from None

    def bad(why):
        return RuntimeError("mxps: server %d's optimizer states: %s" % (server, why))

    if not isinstance(reply, dict) or set(reply) != {"counts", "num_update", "states"}:
        raise bad("not {states, counts, num_update}")
    if not isinstance(reply["states"], list) or not isinstance(reply["counts"], dict):
        raise bad("states is not a list or counts not a dict")
    for entry in reply["states"]:
        if not (isinstance(entry, list) and len(entry) == 4 and
                all(isinstance(x, int) for x in entry[:3]) and entry[0] in by_id):
            raise bad("an entry is not [key held by this worker, offset, length, state]")
        if not _state_of(entry[3], entry[2]):
            raise bad("the state of key %d at %d is not arrays of its %d elements"
                      % tuple(entry[:3]))
    if not all(isinstance(x, int) for kv in reply["counts"].items() for x in kv) or \
            not isinstance(reply["num_update"], int):
        raise bad("update counts are not integers")
    return reply


def _state_of(state, length):
    if state is None:
        return True
    if isinstance(state, (tuple, list)):
        return all(_state_of(x, length) for x in state)
    return isinstance(state, np.ndarray) and state.dtype.kind == "f" and state.size == length


def _join_states(pieces, shape):
    first = pieces[0]
    if first is None:
        return None
    if isinstance(first, (tuple, list)):
        return type(first)(_join_states([p[i] for p in pieces], shape)
                           for i in range(len(first)))
    return mx.nd.array(np.concatenate([np.asarray(p).reshape(-1) for p in pieces])
                       .reshape(shape), dtype=first.dtype)


@KVStoreBase.register
class MXPS_Async(MXPS):
    """``kvstore='mxps_async'``: asynchronous SGD (every push applied on arrival)."""

    _mode = "async"


@KVStoreBase.register
class MXPS_Sync(MXPS):
    """``kvstore='mxps_sync'``: synchronous, whatever MXPS_MODE says."""

    _mode = "sync"


@KVStoreBase.register
class MXPS_Wsp(MXPS):
    """``kvstore='mxps_wsp'``: WSP rounds (docs/WSP.md), whatever MXPS_MODE says."""

    _mode = "wsp"
