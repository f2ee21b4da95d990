"""The server: holds slices of parameters, sums pushes, applies the optimizer, answers pulls.

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
"""
import dataclasses
import json
import logging
import pickle
import time

import numpy as np
import zmq

from ..kernels.accum import add_into, copy_into
from ..adapter.ndview import cut_state, numpy_view
from ..placement import plan
from ..wire import frame as wire, tcp as transport
from ..wire.frame import MsgType
from . import link as control
from .link import SchedulerLink, poll_forever

log = logging.getLogger("mxps.server")


class RequestError(ValueError):
    """A request the server refuses; the text goes back to the worker."""


class _Round:
    __slots__ = ("acc", "acc_nd", "senders")

    def __init__(self, acc, acc_nd):
        self.acc = acc            # numpy view of the sum
        self.acc_nd = acc_nd      # the NDArray behind it (update on servers), or None
        self.senders = set()


class _Slot:
    """This server's slice of one key."""

    __slots__ = ("key", "offset", "length", "dtype_code", "weight_nd", "weight", "snapshot",
                 "applied", "rounds", "waiting", "free", "index")

    def __init__(self, key, offset, length, dtype_code, weight_nd, snapshot):
        self.key = key
        self.index = optimizer_index(key, offset)
        self.offset = offset
        self.length = length
        self.dtype_code = dtype_code
        self.weight_nd = weight_nd      # the stored value, an NDArray the optimizer updates
        self.weight = numpy_view(weight_nd)
        self.snapshot = snapshot        # what pulls get: the value after the last round
        self.applied = 0                # rounds completed
        self.rounds = {}                # round -> _Round
        self.waiting = []               # (ident, header) pulls waiting for a later round
        self.free = []                  # reusable (acc, acc_nd) accumulators


def optimizer_index(key, offset):
    """The optimizer's index for the slice of ``key`` starting at element ``offset``: the key
    itself for a key's first slice (as MXNet's server), a distinct index for a key's further
    slices on the same server (adaptive plans cut large slices into chunks so that one chunk's
    pull overlaps the next chunk's push).  Every slice of a key is updated once per round, so
    each index's update count equals the key's, and the updates are elementwise: the same
    numbers as one index per key."""
    return key if offset == 0 else key + (offset << 32)


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


def _to_nd(state, mx):
    if state is None:
        return None
    if isinstance(state, (tuple, list)):
        return type(state)(_to_nd(s, mx) for s in state)
    return mx.nd.array(state, dtype=state.dtype)


class Server:
    def __init__(self, cfg):
        import mxnet as mx   # imported with DMLC_ROLE hidden by mxps.roles
        self.mx = mx
        self.cfg = cfg
        host = cfg.node_host or transport.local_address_towards(cfg.root_uri, cfg.root_port)
        self.sock, self.port = transport.bind_router(host, None)
        self.link = SchedulerLink(cfg, "server")
        welcome = self.link.register(host, self.port)
        self.cfg = dataclasses.replace(cfg, mode=welcome["mode"])   # the workers' choice
        self.rank = welcome["rank"]
        self.num_workers = welcome["num_workers"]
        self.slots = {}
        self.updater = None
        self.optimizer = None
        self._aliased = set()      # optimizer indices of further slices, given their key's
        self.plan_version = 0
        self.peer_addrs = welcome["servers"]
        self.peers = {}            # server rank -> DEALER (opened at the first migration)
        self.migration = None      # the re-plan this server is moving state for
        self.early_parts = []      # parts of a plan whose PLAN message has not arrived yet
        self.poller = None
        log.info("server %d listening on %s:%d", self.rank, host, self.port)

    # -- replies -----------------------------------------------------------------------------
    def _reply(self, ident, header, type_, payload=None, **fields):
        try:
            transport.send(self.sock, header.reply(type_, **fields), payload, ident=ident)
        except transport.TransportError:
            log.warning("worker connection %r is gone; reply to %r dropped", ident, header)

    def _error(self, ident, header, message):
        log.warning("server %d: refusing %r: %s", self.rank, header, message)
        self._reply(ident, header, MsgType.ERROR, message.encode(), dtype=wire.NO_DTYPE,
                    length=0)

    def _send_value(self, ident, header, slot):
        self._reply(ident, header, MsgType.DATA, slot.snapshot, dtype=slot.dtype_code,
                    offset=slot.offset, length=slot.length)

    # -- data plane --------------------------------------------------------------------------
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

    def _on_init(self, ident, h, payload):
        arr = wire.payload_array(h, payload)
        mx = self.mx
        weight_nd = mx.nd.array(arr, dtype=arr.dtype)
        weight_nd.wait_to_read()
        slot = self.slots[(h.key, h.offset)] = _Slot(h.key, h.offset, h.length, h.dtype,
                                                     weight_nd, arr.copy())
        if self.updater is not None and slot.index != slot.key:
            self._alias(slot, count=True)     # states loaded before the keys were initialised
        self._reply(ident, h, MsgType.ACK, length=0)

    def _on_push(self, ident, h, payload):
        slot = self._slot_for(h)
        if h.dtype != slot.dtype_code:
            raise RequestError("key %d: pushed dtype %s differs from the initialised dtype %s"
                               % (h.key, wire.dtype_of(h.dtype), wire.dtype_of(slot.dtype_code)))
        grad = wire.payload_array(h, payload)
        if not self.cfg.sync:
            if self.updater is None:
                raise RequestError("key %d: dist_async needs the optimizer on the servers "
                                   "(update_on_kvstore=True / set_optimizer)" % h.key)
            rnd = self._new_round(slot, grad)
            copy_into(rnd.acc, grad)
            self._apply(slot, rnd)
            slot.applied += 1
        else:
            if h.iteration <= slot.applied:
                raise RequestError("key %d: worker %d pushed round %d, but round %d is already "
                                   "complete" % (h.key, h.sender, h.iteration, slot.applied))
            rnd = slot.rounds.get(h.iteration)
            if rnd is None:
                rnd = slot.rounds[h.iteration] = self._new_round(slot, grad)
                copy_into(rnd.acc, grad)
            elif h.sender in rnd.senders:
                raise RequestError("key %d: worker %d pushed round %d twice"
                                   % (h.key, h.sender, h.iteration))
            else:
                add_into(rnd.acc, grad, h.dtype)
            rnd.senders.add(h.sender)
            # complete every round that has all pushes, in order
            while True:
                nxt = slot.rounds.get(slot.applied + 1)
                if nxt is None or len(nxt.senders) < self.num_workers:
                    break
                del slot.rounds[slot.applied + 1]
                self._apply(slot, nxt)
                slot.applied += 1
        if h.type == MsgType.PUSH:
            self._reply(ident, h, MsgType.ACK, length=0)
        else:
            self._on_pull(ident, h)
        self._answer_waiting(slot)

    def _new_round(self, slot, grad):
        if self.updater is None:        # the sum becomes the stored value: a fresh buffer
            return _Round(np.empty_like(grad), None)
        if slot.free:
            acc, acc_nd = slot.free.pop()
        else:
            acc_nd = self.mx.nd.zeros((slot.length,), dtype=grad.dtype)
            acc_nd.wait_to_read()
            acc = numpy_view(acc_nd)
        return _Round(acc, acc_nd)

    def _apply(self, slot, rnd):
        if self.updater is None:
            slot.snapshot = rnd.acc          # stored = merged (update on workers)
            return
        acc_nd = rnd.acc_nd
        if acc_nd is None:                   # the round began before set_optimizer
            acc_nd = self.mx.nd.array(rnd.acc, dtype=rnd.acc.dtype)
        if slot.index != slot.key and slot.index not in self._aliased:
            self._alias(slot)
        self.updater(slot.index, acc_nd, slot.weight_nd)
        slot.weight_nd.wait_to_read()        # the update (which read acc_nd) is done
        if rnd.acc_nd is not None:
            slot.free.append((rnd.acc, rnd.acc_nd))
        # Sync mode replies straight from the stored weights, without a copy: round r+1 can
        # only complete once every worker pushed r+1, and a worker pushes r+1 of a key only
        # after its pull of round r was answered, so no reply of round r is still being sent
        # when the weights change.  Async mode applies pushes any time: replies get a copy.
        slot.snapshot = slot.weight if self.cfg.sync else slot.weight.copy()

    def _on_pull(self, ident, h):
        slot = self._slot_for(h)
        if not self.cfg.sync or h.iteration <= slot.applied:
            self._send_value(ident, h, slot)
        else:
            slot.waiting.append((ident, h))

    def _answer_waiting(self, slot):
        if not slot.waiting:
            return
        still = []
        for ident, h in slot.waiting:
            if h.iteration <= slot.applied:
                self._send_value(ident, h, slot)
            else:
                still.append((ident, h))
        slot.waiting = still

    # -- optimizer ---------------------------------------------------------------------------
    def _on_set_optimizer(self, ident, h, payload):
        optimizer = pickle.loads(payload.bytes)   # as MXNet's own server does (trusted peers)
        self.optimizer = optimizer
        self.updater = self.mx.optimizer.get_updater(optimizer)
        _counts(optimizer)
        self._aliased = set()
        self._reply(ident, h, MsgType.ACK, length=0)

    def _on_get_states(self, ident, h, payload):
        if self.updater is None:
            raise RequestError("no optimizer on server %d: optimizer states live on the "
                               "servers only with update_on_kvstore=True" % self.rank)
        counts = _counts(self.updater.optimizer)
        states = [(k, x.offset, x.length, _to_numpy(self.updater.states[x.index]))
                  for (k, _), x in self.slots.items() if x.index in self.updater.states]
        body = pickle.dumps({"states": states, "optimizer": self.updater.optimizer,
                             "counts": {k: counts[x.index] for (k, _), x in self.slots.items()
                                        if x.index in counts}})
        self._reply(ident, h, MsgType.DATA, body, dtype=wire.NO_DTYPE, length=0)

    def _on_set_states(self, ident, h, payload):
        if self.updater is None:
            raise RequestError("no optimizer on server %d to load states into" % self.rank)
        blob = pickle.loads(payload.bytes)
        for (k, offset), state in blob["states"].items():
            i = optimizer_index(k, offset)
            self.updater.states[i] = _to_nd(state, self.mx)
            self.updater.states_synced[i] = False
        self.updater.optimizer = blob["optimizer"]
        self.optimizer = blob["optimizer"]
        _counts(self.optimizer)
        self._aliased = set()
        for slot in self.slots.values():
            if slot.index != slot.key:
                self._alias(slot, count=True)
        self._reply(ident, h, MsgType.ACK, length=0)

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

    def _on_probe(self, ident, h, payload):
        # echo the bytes back: the worker times both directions of its link to this server
        self._reply(ident, h, MsgType.DATA, payload, dtype=wire.NO_DTYPE, length=0)

    # -- live re-planning: moving slices between servers (docs/REPLAN.md) ---------------------
    def _on_plan(self, body):
        """The scheduler's new plan.  Every worker has stopped with nothing in flight, so every
        round is complete: send each new owner its part of this server's old slices (value,
        optimizer state, update count), keep the part that stays, and build each new slice once
        all of its parts are here; then tell the scheduler."""
        version = body["version"]
        old, new = plan.table_from_json(body["old"]), plan.table_from_json(body["new"])
        mig = self.migration = _Migration(version)
        self.plan_version = version
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
                "dtype": slot.dtype_code, "value": np.array(slot.snapshot[a:b]),
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
        if self.updater is not None:
            self.updater.states.pop(slot.index, None)
            self.updater.states_synced.pop(slot.index, None)
            _counts(self.updater.optimizer).pop(slot.index, None)

    def _send_part(self, mig, dest, part):
        sock = self.peers.get(dest)
        if sock is None:
            host, port = self.peer_addrs[dest]
            sock = self.peers[dest] = transport.connect_dealer(host, port)
            self.poller.register(sock, zmq.POLLIN)
        mig.next_id += 1
        mig.outgoing[mig.next_id] = dest
        mig.moved += part["value"].nbytes
        h = wire.Header(MsgType.MIGRATE, key=part["key"], sender=self.rank,
                        plan_version=mig.version, offset=part["offset"],
                        length=part["length"], request_id=mig.next_id)
        transport.send(sock, h, pickle.dumps(part, protocol=5))

    def _on_migrate(self, ident, h, payload):
        part = pickle.loads(payload.bytes)
        mig = self.migration
        if mig is not None and mig.version == h.plan_version:
            self._reply(ident, h, MsgType.ACK, length=0)
            try:
                self._add_part(mig, part, remote=True)
                self._maybe_done(mig)
            except Exception as e:
                self._plan_failed(mig.version, e)
        elif h.plan_version > self.plan_version:
            self.early_parts.append((h.plan_version, part))   # its PLAN is on the way
            self._reply(ident, h, MsgType.ACK, length=0)
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
        mx = self.mx
        value = np.concatenate([p["value"] for p in parts]) if len(parts) > 1 \
            else parts[0]["value"]
        weight_nd = mx.nd.array(value, dtype=value.dtype)
        weight_nd.wait_to_read()
        slot = _Slot(key, want.offset, want.length, parts[0]["dtype"], weight_nd, value)
        slot.applied = applied.pop()
        if self.updater is not None:
            slot.snapshot = slot.weight if self.cfg.sync else slot.weight.copy()
            states = [p.get("state") for p in parts]
            if any(x is not None for x in states):
                if any(x is None for x in states):
                    raise RequestError("plan %d: some parts of key %d lack optimizer state"
                                       % (mig.version, key))
                self.updater.states[slot.index] = _to_nd(_join_state(states), mx)
                self.updater.states_synced[slot.index] = False
            if slot.index != key:
                self._alias(slot)
            counts = {p["count"] for p in parts if "count" in p}
            if counts:
                opt = self.updater.optimizer
                _counts(opt)[slot.index] = max(counts)
                opt.num_update = max(opt.num_update, max(counts))
        self.slots[target] = slot

    def _on_migrate_reply(self, h):
        mig = self.migration
        if h.type == MsgType.ERROR or mig is None:
            raise RequestError("plan %d: a moved part of key %d was refused" % (
                h.plan_version, h.key))
        mig.outgoing.pop(h.request_id, None)
        self._maybe_done(mig)

    def _maybe_done(self, mig):
        if mig.done or mig.outgoing or mig.incoming:
            return
        mig.done = True
        self.link.send(MsgType.PLAN, json.dumps({"version": mig.version,
                                                 "moved_bytes": mig.moved}).encode())
        log.info("server %d: plan %d in place (%d bytes sent)", self.rank, mig.version,
                 mig.moved)

    _HANDLERS = {
        MsgType.MIGRATE: _on_migrate,
        MsgType.PROBE: _on_probe,
        MsgType.INIT: _on_init,
        MsgType.PUSH: _on_push,
        MsgType.PUSHPULL: _on_push,
        MsgType.PULL: lambda self, ident, h, p: self._on_pull(ident, h),
        MsgType.SET_OPTIMIZER: _on_set_optimizer,
        MsgType.GET_STATES: _on_get_states,
        MsgType.SET_STATES: _on_set_states,
    }

    def _on_request(self, ident, h, payload):
        handler = self._HANDLERS.get(h.type)
        try:
            if handler is None:
                raise RequestError("server cannot handle %s" % MsgType(h.type).name)
            handler(self, ident, h, payload)
        except (RequestError, wire.WireError) as e:
            self._error(ident, h, str(e))
        except Exception as e:   # a bug or an optimizer failure: report it, keep serving
            log.exception("server %d: request %r failed", self.rank, h)
            self._error(ident, h, "server %d failed on %s: %s: %s"
                        % (self.rank, MsgType(h.type).name, type(e).__name__, e))

    def _on_scheduler(self, h, payload):
        if h.type != MsgType.PLAN:
            self.link.handle(h, payload)
            return
        self.link.last_heard = time.monotonic()
        body = json.loads(payload.bytes)
        try:
            self._on_plan(body)
        except Exception as e:
            self._plan_failed(body.get("version"), e)

    def _plan_failed(self, version, error):
        # the job cannot go on with a broken placement: the scheduler ends it with this reason
        log.error("server %d: plan %s failed: %r", self.rank, version, error)
        self.link.send(MsgType.PLAN, json.dumps({
            "version": version, "error": "%s: %s" % (type(error).__name__, error)}).encode())

    def _on_peer_reply(self, sock):
        while sock.poll(0):
            _, h, _ = transport.recv(sock)
            try:
                self._on_migrate_reply(h)
            except Exception as e:
                self._plan_failed(h.plan_version, e)

    def run(self):
        poller = self.poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.link.sock, zmq.POLLIN)
        wait_ms = int(self.cfg.heartbeat_interval * 1000 / 2)
        while not self.link.shutdown:
            events = poll_forever(poller, wait_ms)
            if self.sock in events:
                for _ in range(64):
                    if not self.sock.poll(0):
                        break
                    try:
                        ident, h, payload = transport.recv(self.sock, with_ident=True)
                    except wire.WireError as e:
                        log.warning("server %d: dropped a malformed message: %s", self.rank, e)
                        continue
                    self._on_request(ident, h, payload)
            if self.link.sock in events:
                while self.link.sock.poll(0):
                    _, h, p = transport.recv(self.link.sock)
                    self._on_scheduler(h, p)
            for sock in self.peers.values():
                if sock in events:
                    self._on_peer_reply(sock)
            self.link.tick(time.monotonic())
        for sock in self.peers.values():
            sock.close(linger=0)
        self.sock.close(linger=1000)
        self.link.close()
        return 0


def run(cfg):
    try:
        return Server(cfg).run()
    except control.PeerLostError as e:
        control.fatal("server", str(e))
