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
import logging
import pickle
import time

import numpy as np
import zmq

from . import control, transport, wire
from .accum import add_into, copy_into
from .control import SchedulerLink, poll_forever
from .ndview import numpy_view
from .wire import MsgType

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
                 "applied", "rounds", "waiting", "free")

    def __init__(self, key, offset, length, dtype_code, weight_nd, snapshot):
        self.key = key
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
        slot = self.slots.get(h.key)
        if slot is None:
            raise RequestError("key %d is not initialised on server %d: call init (or "
                               "broadcast) on the key before push/pull" % (h.key, self.rank))
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
        self.slots[h.key] = _Slot(h.key, h.offset, h.length, h.dtype, weight_nd, arr.copy())
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
        self.updater(slot.key, acc_nd, slot.weight_nd)
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
        self._reply(ident, h, MsgType.ACK, length=0)

    def _on_get_states(self, ident, h, payload):
        if self.updater is None:
            raise RequestError("no optimizer on server %d: optimizer states live on the "
                               "servers only with update_on_kvstore=True" % self.rank)
        states = {k: (s.offset, s.length, _to_numpy(self.updater.states.get(k)))
                  for k, s in self.slots.items() if k in self.updater.states}
        body = pickle.dumps({"states": states, "optimizer": self.updater.optimizer,
                             "keys": sorted(self.slots)})
        self._reply(ident, h, MsgType.DATA, body, dtype=wire.NO_DTYPE, length=0)

    def _on_set_states(self, ident, h, payload):
        if self.updater is None:
            raise RequestError("no optimizer on server %d to load states into" % self.rank)
        blob = pickle.loads(payload.bytes)
        for k, state in blob["states"].items():
            self.updater.states[k] = _to_nd(state, self.mx)
            self.updater.states_synced[k] = False
        self.updater.optimizer = blob["optimizer"]
        self.optimizer = blob["optimizer"]
        self._reply(ident, h, MsgType.ACK, length=0)

    def _on_probe(self, ident, h, payload):
        # echo the bytes back: the worker times both directions of its link to this server
        self._reply(ident, h, MsgType.DATA, payload, dtype=wire.NO_DTYPE, length=0)

    _HANDLERS = {
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

    def run(self):
        poller = zmq.Poller()
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
                    self.link.handle(h, p)
            self.link.tick(time.monotonic())
        self.sock.close(linger=1000)
        self.link.close()
        return 0


def run(cfg):
    try:
        return Server(cfg).run()
    except control.PeerLostError as e:
        control.fatal("server", str(e))
