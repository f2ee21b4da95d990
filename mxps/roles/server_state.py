"""The server's protocol as a state machine: one incoming message in, the messages to send out.

The rounds core.  A round's life is here: a push is placed in a round by the round policy
(``rounds.Bsp``, ``Wsp``, ``Async``: which round, when it completes, when a pull may be
answered), summed, and applied by the slice's store (``store.memory.MemorySlice`` or
``store.disk.DiskSlice``: the same calls), then the pulls waiting for it are answered.  The
features that feed or move rounds are parts of ``ServerState`` in files of their own: LTP's
packets (``ltp_intake``), live re-planning (``migration``), the optimizer's requests
(``optimizer_states``), row-sparse requests (``row_requests``).

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
import logging
import time

import numpy as np

from ..kernels.accum import add_into, copy_into
from ..store.disk import DiskSlice, geometry as disk_geometry
from ..store.memory import MemorySlice
from ..store.optimizer_step import state_template
from ..store.rows import RowLayout
from ..store.table_init import TableInit
from ..wire import compression, frame as wire, typed
from ..wire.auth import Tally
from ..wire.frame import MsgType
from .ltp_intake import LtpIntake
from .migration import Migrating, PlanError, read_plan
from .optimizer_states import OptimizerRequests, floating, optimizer_index
from .replica import Replicas
from .row_requests import RowRequests
from .rounds import Async, Bsp, Round, Slot, Wsp
from .server_requests import Out, RequestError, fields
from .server_settings import LtpSettings, StoreSettings, WspSettings

log = logging.getLogger("mxps.server")

# what the server process and the tests take from here
__all__ = ["ServerState", "Out", "RequestError", "LtpSettings", "StoreSettings", "WspSettings",
           "optimizer_index"]


class ServerState(LtpIntake, Migrating, OptimizerRequests, RowRequests, Replicas):
    """Everything server ``rank`` knows; ``on_request``, ``on_scheduler`` and
    ``on_peer_reply`` each take one message and return the ``Out``s it causes, in order."""

    def __init__(self, rank, num_workers, sync, num_servers=None, trace=None, ltp=None,
                 wsp=None, store=None, progress=None, replica=False, failover=False):
        self.rank = rank
        # called now and then inside work that takes seconds (a table made from its rule), so
        # that the server heartbeats meanwhile (roles/server.py); None: nobody to tell
        self.progress = progress
        self.num_workers = num_workers
        self.sync = sync
        self.num_servers = num_servers   # when known, a plan naming another server is refused
        self.slots = {}            # (key, offset) -> rounds.Slot
        self.updater = None
        self.optimizer = None
        self._aliased = set()      # optimizer indices of further slices, given their key's
        self._cache_given = {}     # (key, offset) -> the store cache a disk slice was given
        self.plan_version = 0
        # the oldest plan whose requests are still valid: a failover plan (MXPS_FAILOVER)
        # leaves the slices it does not move, and the workers' requests of the plan before
        # it for them (the workers did not stop for it)
        self.plan_floor = 0
        self.resent_dropped = 0    # pushes sent again after a failover that were in already
        self.diverted_away = set()     # MXPS_DIVERT: (key, offset) given up in the last divert
        self.diverted_dropped = 0      # ... and old requests for them, dropped
        self.migration = None      # the re-plan this server is moving state for
        self.early_parts = []      # parts of a plan whose PLAN message has not arrived yet
        self.early_seeds = []      # MXPS_REPLAN_SEED: workers' weights of such a plan
        # MXPS_REPLAN_OVERLAP: workers push by a new plan while its state still moves:
        # requests of a plan whose PLAN has not arrived yet, and requests for a slice still
        # being built (target -> [(client, header, gradient copy or None)]), wait here
        self.early_requests = []
        self._early_bytes = 0
        self.deferred = {}
        # ... and LTP packets of either (target -> [(fields, payload copy, arrival)])
        self.held_packets = {}
        self.early_packets = []
        self._held_bytes = 0
        self._out = []             # what the message being handled causes
        # MXPS_PUSH=ltp (docs/LTP.md): packets of the loss-tolerant push; LtpSettings or None
        self.ltp = ltp
        self._wakes = []           # (time, key, offset, round): when an open round may close
        self.ltp_stats = collections.Counter()
        # MXPS_MODE=wsp (docs/WSP.md): WspSettings or None (BSP); the workers that left
        self.wsp = wsp
        self.gone = set()
        self.wsp_stats = collections.Counter()
        # when a round completes and which round a push goes into (rounds.py)
        if not sync:
            self.policy = Async(num_workers)
        elif wsp is not None:
            self.policy = Wsp(wsp, num_workers, self.gone, self.wsp_stats)
        else:
            self.policy = Bsp(num_workers)
        # MXPS_REPLICA: every slice's optimizer state also on the buddy server (replica.py)
        self._init_replicas(replica)
        # MXPS_FAILOVER: the slices cut for the last plan, kept until the next one
        # ((key, offset) -> migration part), so that a move a lost server interrupts is
        # rolled back (migration._abandon)
        self.failover = failover or replica
        self.stash = {}
        # MXPS_STORE=disk: StoreSettings, or None (every slice in RAM)
        self.store = store
        self._resumed = None       # MXPS_STORE_RESUME: the round the store was flushed at
        self.checkpoints = []      # MXPS_STORE_CHECKPOINT_ROUNDS/_SECONDS: the rounds flushed
        self._marked = set()       # rounds worker 0 marked for a checkpoint (this job's count)
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
        # the compiled intake adds a packet into the round of its label; under WSP a push's
        # round is chosen at its first packet (rounds.Wsp.packet_round), so every packet
        # takes the path that looks it up
        self.ltp_fast = {} if ltp is not None and ltp.fast and self._trace is None and \
            wsp is None else None

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
            if h.type in self._DATA and self.diverted_away and self.diverted_request(h):
                self.diverted_dropped += 1
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
            version, old, new, seeds, lost, extra = read_plan(payload, self.num_servers,
                                                              self.plan_version)
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
            self._on_plan(version, old, new, seeds, lost, **extra)
        except Exception as e:
            self._plan_failed(version, e)
        out = self._flush()
        early, self.early_requests = self.early_requests, []
        self._early_bytes = 0
        for client, h, payload in early:      # in arrival order, as if they came now
            out += self.on_request(client, h, payload)
        packets, self.early_packets = self.early_packets, []
        if packets:
            self._take_held(packets)
            out += self._flush()
        return out

    def on_peer_reply(self, server_rank, h, payload=None):
        """Server ``server_rank``'s answer to a part this server sent it: an ACK, or an ERROR
        that fails the plan; or to a ``STATE`` (MXPS_DIVERT with MXPS_REPLICA): DATA with the
        state, or ACK.  A message that answers nothing in flight to that server (another
        plan's, a type that is not a reply) is dropped and counted."""
        if self.replica:
            try:
                if self._on_replica_reply(server_rank, h):
                    return self._flush()
            except RequestError as e:
                self._plan_failed(self.plan_version, e)
                return self._flush()
        mig = self.migration
        if h.type in (MsgType.ACK, MsgType.DATA) and mig is not None and \
                h.plan_version == mig.version and h.request_id in mig.state_asks and \
                mig.outgoing.get(h.request_id) == server_rank:
            try:
                self._on_state_reply(server_rank, h, payload)
            except Exception as e:
                self._plan_failed(h.plan_version, e)
            return self._flush()
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
        self.policy.answered(slot, header)
        if self._trace is not None:
            self._data_row("pull_answered", slot, header.iteration, header.sender,
                           slot.store.snapshot.nbytes, header.request_id)
        if rows is not None:       # a PULL_ROWS: its rows' elements in the slice, in order
            self._reply(client, header, MsgType.DATA, slot.store.read(rows),
                        dtype=slot.dtype_code, offset=slot.offset, length=int(rows.size))
            return
        self._reply(client, header, MsgType.DATA, slot.store.snapshot, dtype=slot.dtype_code,
                    offset=slot.offset, length=slot.length)

    # -- data plane --------------------------------------------------------------------------
    _DATA = frozenset((MsgType.PUSH, MsgType.PULL, MsgType.PUSHPULL, MsgType.PUSH_ROWS,
                       MsgType.PULL_ROWS))

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
        if h.plan_version != self.plan_version and not (
                self.plan_floor <= h.plan_version < self.plan_version
                and slot.since <= h.plan_version):
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
            floating(h.key, arr.dtype)
        cols = max(0, int(h.iteration))
        if self.store is not None:
            store = self._disk_slice(h.key, h.offset, h.length, arr.dtype, cols,
                                     None if rule is not None else arr, rule=rule,
                                     resume=self.store.resume)
        elif rule is not None:
            t0 = time.monotonic()
            store = MemorySlice(rule.span(h.offset, h.offset + h.length, progress=self.progress),
                                progress=self.progress)
            log.info("key %d: made its slice at %d (%d elements) from its rule in %.2f s",
                     h.key, h.offset, h.length, time.monotonic() - t0)
        else:
            store = MemorySlice(arr.copy(), progress=self.progress)
        slot = self.slots[(h.key, h.offset)] = Slot(h.key, h.offset, h.length, h.dtype, store)
        slot.cols = cols
        if self.updater is not None and slot.index != slot.key:
            self._alias(slot, count=True)     # states loaded before the keys were initialised
        self._reply(client, h, MsgType.ACK, length=0)

    def _on_init_table(self, client, h, payload):
        """INIT_TABLE: a slice's initial value as a rule (``store.table_init``): in RAM the
        slice is made now, on disk each row when first touched."""
        what = "INIT_TABLE of key %d" % h.key
        body = fields(typed.unpack(payload), what, ("scale", "seed"))
        dtype = wire.dtype_of(h.dtype)
        try:
            rule = TableInit((h.offset + h.length,), dtype, body["scale"], body["seed"])
        except (TypeError, ValueError) as e:
            raise RequestError("%s: %s" % (what, e)) from None
        self._on_init(client, h, None, rule=rule)

    def _disk_slice(self, key, offset, length, dtype, cols, value, rule=None, state=None,
                    resume=False):
        """A new slice in the row store (MXPS_STORE=disk): its initial ``value`` or ``rule``
        (and a moved slice's optimizer ``state``); with ``resume`` (MXPS_STORE_RESUME) its
        numbers come from the store, which must hold exactly this slice (else the INIT is
        refused)."""
        n_states, template = 0, None
        if self.updater is not None:
            index = optimizer_index(key, offset)
            try:
                template, n_states = state_template(self.updater.optimizer, index, dtype)
            except ValueError as e:
                raise RequestError("key %d: %s" % (key, e)) from None
        name = "key%d_at%d" % (key, offset)
        st = self.store
        width, _, _, _, n_rows = disk_geometry(offset, length, cols)
        layout = RowLayout(n_rows, width, dtype, n_states)
        given = st.budget(layout.cache_bytes(n_rows))
        cache = max(given, layout.cache_bytes(1))
        try:
            disk = DiskSlice(offset, length, cols, layout.dtype, n_states,
                             None if resume else value, st.directory, name, cache,
                             resume=resume, rule=None if resume else rule,
                             at=st.resume_at if resume else None, keep=st.KEEP,
                             template=template, state=state)
        except (ValueError, OSError, RuntimeError) as e:
            st.release(given)
            raise RequestError("key %d: the disk store at %s: %s"
                               % (key, st.directory, e)) from None
        self._cache_given[(key, offset)] = given
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
                                   % (key, st.directory, done, self._resumed))
            if self.updater is not None:
                index = optimizer_index(key, offset)
                self.updater.optimizer._index_update_count[index] = done
                self.updater.optimizer.num_update = max(self.updater.optimizer.num_update, done)
        return disk

    def _moved_slot(self, key, offset, length, dtype_code, cols, value, state):
        """A slice a re-plan moved here (``migration``), in this server's store: ``value``
        (a fresh array) and the optimizer ``state`` of its elements (numpy, or None)."""
        if self.store is not None:
            store = self._disk_slice(key, offset, length, value.dtype, cols, value,
                                     state=state)
        else:
            store = MemorySlice(value, progress=self.progress)
        slot = Slot(key, offset, length, dtype_code, store)
        slot.cols = cols
        if state is not None and self.updater is not None and self.store is None:
            store.take_state(self.updater, slot.index, state)
        return slot

    def _store_released(self, slot):
        """A slice moved away: its share of the store's cache is free again."""
        if self.store is not None:
            self.store.release(self._cache_given.pop((slot.key, slot.offset), 0))

    @property
    def round_base(self):
        """Rounds before this job's first: those of a resumed store."""
        return self._resumed or 0

    def flush_store(self):
        """Everything the disk store holds to disk, durable, each slice clean at the rounds it
        applied, counted from the job's start (a clean shutdown; docs/STORE.md)."""
        for slot in self.slots.values():
            slot.store.flush(self.round_base + slot.applied)

    def _maybe_checkpoint(self, slot):
        """MXPS_STORE_CHECKPOINT_ROUNDS / _SECONDS (BSP): once every slice here has applied a
        round that is a multiple of the setting, or that worker 0 marked, all of them are
        flushed at it, before the pulls that round answers go out (store.checkpoints says why
        that makes a job-wide checkpoint)."""
        st = self.store
        step = self.round_base + slot.applied
        due = st is not None and (st.every and step % st.every == 0
                                  or slot.applied in self._marked)
        if (not due or not self.policy.consistent
                or self.checkpoints and self.checkpoints[-1] == step
                or any(x.applied != slot.applied for x in self.slots.values())):
            return
        self._marked.discard(slot.applied)
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
        self._account(slot, h, grad)
        if h.type == MsgType.PUSH:
            self._reply(client, h, MsgType.ACK, length=0)
        else:
            self._on_pull(client, h)
        self._answer_waiting(slot)

    def _account(self, slot, h, grad):
        """Add a push (a dense array, or a row-sparse push's (RowSet, padded block)) to the
        round the policy places it in; complete every round the policy lets complete."""
        if self.policy.needs_optimizer and self.updater is None:
            raise RequestError("key %d: dist_async needs the optimizer on the servers "
                               "(update_on_kvstore=True / set_optimizer)" % h.key)
        if h.flags & wire.RESENT and (h.iteration <= slot.applied or h.sender in getattr(
                slot.rounds.get(h.iteration), "senders", ())):
            # MXPS_FAILOVER: a push the lost server had, of a round this slice has applied
            # (its weights came from a worker that pulled that round) or holds already
            self.resent_dropped += 1
            return
        r = self.policy.place(slot, h)
        if h.flags & wire.CHECKPOINT:       # worker 0 chose round r (store.checkpoints)
            self._marked.add(r)
        rnd = slot.rounds.get(r)
        if rnd is None:
            rnd = slot.rounds[r] = self._new_round(slot, grad)
        elif rnd.ltp is not None and rnd.parts is None and not isinstance(grad, tuple):
            # the others' packets came by LTP, this one by TCP
            if rnd.closed or not rnd.ltp.add_whole(h.sender, grad, self._ltp_now):
                raise RequestError("key %d: worker %d pushed round %d by TCP after sending "
                                   "packets of it (or after it closed)"
                                   % (h.key, h.sender, h.iteration))
            self.ltp.share.settled(h.sender)
        else:
            self._add(slot, h, rnd, grad)
        rnd.senders.add(h.sender)
        rnd.pushes += 1
        if rnd.ltp is not None:
            self._ltp_check(slot, r, rnd, self._ltp_now)
        self._complete_rounds(slot)

    def _complete_rounds(self, slot):
        policy = self.policy
        while True:          # in order: an early round waits for the ones before it
            r = slot.applied + 1
            nxt = slot.rounds.get(r)
            if nxt is not None and nxt.ltp is not None and not nxt.closed and \
                    policy.ltp_participants_only:   # WSP may let an LTP round close now
                self._ltp_check(slot, r, nxt, self._ltp_now)
            if nxt is None or not policy.ready(slot, r, nxt):
                break
            policy.completing(nxt)
            del slot.rounds[r]
            self._apply(slot, nxt)
            slot.applied = r
            if self._trace is not None:
                self._data_row("round_complete", slot, r, -1,
                               0 if nxt.acc is None else nxt.acc.nbytes)
            self._maybe_checkpoint(slot)
            self._after_round(slot)

    def _new_round(self, slot, grad):
        """A round whose first push is ``grad``: a dense array (copied into a fresh sum) or a
        row-sparse push's (RowSet, padded block)."""
        if isinstance(grad, tuple):
            return Round(None, None, [grad])
        rnd = Round(*slot.store.accumulator(grad, self.updater is not None))
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
        """A completed round into the slice's store: the sum becomes the value (update on
        workers), or the optimizer runs on it; LTP elements nobody delivered keep their weights
        and state (``rnd.frozen``)."""
        if rnd.parts is not None:
            self._apply_rows(slot, rnd)
            return
        store = slot.store
        if self.updater is None:
            store.apply_sum(rnd.acc)          # stored = merged (update on workers)
            return
        if slot.index != slot.key and slot.index not in self._aliased:
            self._alias(slot)
        store.apply_update(self.updater, slot.index, rnd.acc, rnd.acc_nd, rnd.frozen)
        # Replies come straight from the stored weights, without a copy, unless the policy
        # says a reply may still be reading them when they change (rounds.Bsp.copies)
        store.serve_weights(copy=self.policy.copies)

    def _on_pull(self, client, h):
        slot = self._slot_for(h)
        if self.policy.pull_ready(slot, h):
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
            if self.policy.pull_ready(slot, h):
                self._send_value(client, h, slot, rows)
                answered = True
            else:
                still.append((client, h, rows))
        slot.waiting = still
        if answered and self.policy.pulls_release:
            # a worker's newer value can lift the staleness bound of the next round
            applied = slot.applied
            self._complete_rounds(slot)
            if slot.applied != applied:
                self._answer_waiting(slot)

    def _on_probe(self, client, h, payload):
        # echo the bytes back: the worker times both directions of its link to this server
        self._reply(client, h, MsgType.DATA, payload, dtype=wire.NO_DTYPE, length=0)

    def _on_leave(self, client, h, payload):
        """A worker that has finished: WSP rounds stop counting on it and stop waiting for it
        (``wsp.may_complete``); the rounds it held up complete now."""
        if payload is not None and memoryview(payload).nbytes:
            raise RequestError("LEAVE from worker %d carries a payload: it has none"
                               % h.sender)
        if h.sender in self.gone:
            raise RequestError("worker %d left twice" % h.sender)
        self.gone.add(h.sender)
        for slot in list(self.slots.values()):    # WSP: rounds it held up complete now
            if slot.rounds:
                self._complete_rounds(slot)
                self._answer_waiting(slot)
        self._reply(client, h, MsgType.ACK, length=0)

    _HANDLERS = {
        MsgType.LEAVE: _on_leave,
        MsgType.INIT_TABLE: _on_init_table,
        MsgType.PUSH_ROWS: RowRequests._on_push_rows,
        MsgType.PULL_ROWS: RowRequests._on_pull_rows,
        MsgType.MIGRATE: Migrating._on_migrate,
        MsgType.SEED: Migrating._on_seed,
        MsgType.REPLICA: Replicas._on_replica,
        MsgType.VALUE: Migrating._on_value,
        MsgType.STATE: Migrating._on_state,
        MsgType.PROBE: _on_probe,
        MsgType.INIT: _on_init,
        MsgType.PUSH: _on_push,
        MsgType.PUSHPULL: _on_push,
        MsgType.PULL: lambda self, client, h, p: self._on_pull(client, h),
        MsgType.SET_OPTIMIZER: OptimizerRequests._on_set_optimizer,
        MsgType.GET_STATES: OptimizerRequests._on_get_states,
        MsgType.SET_STATES: OptimizerRequests._on_set_states,
    }
