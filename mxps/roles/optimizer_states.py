"""The optimizer on a server and its states as they travel (SET_OPTIMIZER, GET_STATES,
SET_STATES; docs/SECURITY.md for the unpickler).

MXNet's optimizer object is the one pickle left: it is read only from worker 0, by an
unpickler that resolves nothing but optimizer and learning-rate scheduler classes
(``read_optimizer``), and installed only once it is an ``mxnet.optimizer.Optimizer`` with
every attribute a fresh one of its class has.  States travel as typed payloads.
``OptimizerRequests`` is the part of ``ServerState`` that answers those requests.
"""
import io
import numbers
import pickle
import sys

import mxnet as mx

from ..kernels.ndview import to_nd, to_numpy
from ..wire import frame as wire, typed
from ..wire.frame import MsgType
from .server_requests import RequestError, check_state, count_field, fields, floating, \
    payload_bytes


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


def read_optimizer(h, payload):
    """The optimizer of a SET_OPTIMIZER request: only worker 0 may send one (refused unread
    otherwise), and it must be an ``mxnet.optimizer.Optimizer``."""
    if h.sender != 0:
        raise RequestError("SET_OPTIMIZER from worker %d refused unread: only worker 0 sets "
                           "the optimizer" % h.sender)
    data = payload_bytes(payload)
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


def optimizer_index(key, offset):
    """The optimizer's index for the slice of ``key`` starting at element ``offset``: the key
    itself for a key's first slice (as MXNet's server), a distinct index for a key's further
    slices on the same server (adaptive plans cut large slices into chunks so that one chunk's
    pull overlaps the next chunk's push).  Every slice of a key is updated once per round, so
    each index's update count equals the key's, and the updates are elementwise: the same
    numbers as one index per key."""
    return key if offset == 0 else key + (offset << 32)


def update_counts(opt):
    """The optimizer's update counts, the dict its updates will use.  MXNet keeps one dict per
    device (``_all_index_update_counts``) and the Updater switches ``_index_update_count`` to
    device 0's on every call; an optimizer that was unpickled with a replaced
    ``_index_update_count`` (e.g. from a states file) would lose its counts at the first
    update, so make that dict device 0's."""
    d = opt._index_update_count
    if opt._all_index_update_counts.get(0) is not d:
        opt._all_index_update_counts[0] = d
    return d


class OptimizerRequests:
    """SET_OPTIMIZER, GET_STATES and SET_STATES, and the aliases of a key's further slices
    (a part of ``ServerState``: it uses the state's ``slots``, ``updater``, ``store``)."""

    def _on_set_optimizer(self, client, h, payload):
        optimizer = read_optimizer(h, payload)
        for slot in self.slots.values():
            floating(slot.key, wire.dtype_of(slot.dtype_code))
        try:
            update_counts(optimizer)
            updater = mx.optimizer.get_updater(optimizer)
        except (AttributeError, TypeError) as e:
            raise RequestError("SET_OPTIMIZER from worker 0: the %s is not usable (%s); nothing "
                               "installed" % (type(optimizer).__name__, e)) from None
        if self.store is not None and self.slots:
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
        counts = update_counts(opt)
        states = [[k, x.offset, x.length, to_numpy(self.updater.states[x.index])]
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
        blob = fields(typed.unpack(payload), "SET_STATES", ("states", "counts", "num_update"))
        states, counts = blob["states"], blob["counts"]
        if not isinstance(states, dict) or not isinstance(counts, dict):
            raise RequestError("SET_STATES: states and counts are dicts")
        slots = []
        for target, state in states.items():
            slot = self.slots.get(target) if isinstance(target, tuple) else None
            if slot is None:
                raise RequestError("SET_STATES: states for %r, a slice server %d does not hold"
                                   % (target, self.rank))
            check_state(state, slot.length, "SET_STATES for key %d at %d" % target)
            slots.append((slot, state))
        for k, c in counts.items():
            count_field(k, "SET_STATES: a key")
            count_field(c, "SET_STATES: the update count of key %s" % k)
        num_update = count_field(blob["num_update"], "SET_STATES: num_update")
        for slot, state in slots:
            self.updater.states[slot.index] = to_nd(state)
            self.updater.states_synced[slot.index] = False
        opt = self.updater.optimizer
        table = update_counts(opt)
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
        counts = update_counts(opt)
        if count and k in counts:
            counts[i] = counts[k]
        self._aliased.add(i)
