"""Live re-planning on a server: moving slices between servers (docs/REPLAN.md).

A PLAN from the scheduler names the old and the new placement; every server sends each new
owner its part of the old slices (value, optimizer state, update count), keeps what stays,
builds each new slice once its parts are here, and tells the scheduler.  With overlapped
re-plans (MXPS_REPLAN_OVERLAP) requests of a slice still being built wait for it.
``Migrating`` is the part of ``ServerState`` that does this.
"""
import json
import logging
import zlib

import numpy as np

from ..kernels.ndview import join_state
from ..placement import failover, plan
from ..wire import compression, frame as wire, typed
from ..wire.frame import MsgType
from .optimizer_states import update_counts
from .server_requests import Out, RequestError, check_state, count_field, fields, \
    payload_bytes

log = logging.getLogger("mxps.server")


class _Incoming:
    """A new slice this server is assembling: the parts so far, how many remote ones to come."""

    __slots__ = ("slice", "expect", "parts", "lost", "source", "asked", "replica")

    def __init__(self, slice_, expect):
        self.slice = slice_
        self.expect = expect
        self.parts = []
        # MXPS_FAILOVER: a slice of a lost server; every worker's seed, worker -> (the round
        # its last pull of the slice got, its weights or None, dtype code)
        self.lost = None
        # MXPS_DIVERT: the slow server the slice comes from (its optimizer state comes in a
        # part without weights), and whether its weights were asked of it (``VALUE``)
        self.source = None
        self.asked = False
        # MXPS_DIVERT with MXPS_REPLICA: the state is the replica on the slow server's buddy;
        # None (not so), "asked" (``STATE`` sent to the buddy), "in", or "missing"
        self.replica = None


class _Migration:
    """One re-plan on this server: parts sent and not yet acknowledged, slices being built."""

    def __init__(self, version, seeds=None, lost=(), diverted=()):
        self.version = version
        self.lost = frozenset(lost)   # MXPS_FAILOVER: servers this plan leaves behind
        self.diverted = frozenset(diverted)   # MXPS_DIVERT: ... slow ones, alive
        self.reset = []           # ... lost slices whose optimizer state starts afresh
        self.stale = []           # ... or is a lazy replica's, [key, offset, length, rounds]
        # MXPS_REPLAN_SEED: (key, offset, length) -> the worker that sends those weights
        self.seeds = seeds or {}
        self.seeded = {}          # (key, offset) -> (weights a worker sent, worker)
        self.outgoing = {}        # request id -> destination server
        self.state_asks = {}      # MXPS_DIVERT: STATE request id -> (key, offset, round)
        self.incoming = {}        # key -> _Incoming
        self.next_id = 0
        self.moved = 0
        self.done = False


#: row-sparse requests (roles.row_requests): deferred as their typed bodies
_ROWS = (MsgType.PUSH_ROWS, MsgType.PULL_ROWS)

_PART_NEEDS = ("key", "target", "offset", "length", "dtype", "applied")


def read_part(h, payload):
    """A MIGRATE part from a peer server (``ServerState._cut`` made it), checked field by field
    against its header before the server uses any of it."""
    what = "MIGRATE part of key %d" % h.key
    part = fields(typed.unpack(payload), what, _PART_NEEDS,
                  ("value", "state", "count", "cols", "seeded", "crc", "diverted", "replica"))
    for f in ("key", "target", "offset", "length", "applied", "count", "cols", "seeded", "crc",
              "diverted", "replica"):
        if f in part:
            count_field(part[f], "%s: %s" % (what, f))
    if (part["key"], part["offset"], part["length"]) != (h.key, h.offset, h.length):
        raise RequestError("%s: the part is key %d [%d, +%d), its header says [%d, +%d)"
                           % (what, part["key"], part["offset"], part["length"], h.offset,
                              h.length))
    if part["target"] > part["offset"]:
        raise RequestError("%s: a part at %d cannot belong to a slice starting at %d"
                           % (what, part["offset"], part["target"]))
    dt = wire.dtype_of(count_field(part["dtype"], "%s: dtype" % what))
    value = part.get("value")
    if value is None:
        if "crc" not in part or "seeded" not in part and "diverted" not in part:
            raise RequestError("%s: no value, and no worker seeds it" % what)
    elif not (isinstance(value, np.ndarray) and value.dtype == dt and value.ndim == 1
              and value.size == part["length"]):
        raise RequestError("%s: the value is not %d elements of %s" % (what, part["length"], dt))
    check_state(part.get("state"), part["length"], what)
    return part


def part_bytes(part):
    """The numbers a part carries: its value (if any) and optimizer state."""
    def size(x):
        if x is None:
            return 0
        if isinstance(x, (tuple, list)):
            return sum(size(y) for y in x)
        return x.nbytes
    return size(part.get("value")) + size(part.get("state"))


class PlanError(RequestError):
    """A PLAN whose body is not a plan; ``version`` is its version when that could be read."""

    def __init__(self, message, version=None):
        super().__init__(message)
        self.version = version


def read_table(obj, what, num_servers):
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


def read_plan(payload, num_servers, current):
    """(version, old table, new table) of a PLAN body; raises ``PlanError``."""
    try:
        body = json.loads(payload_bytes(payload))
    except (ValueError, RecursionError, wire.WireError) as e:
        raise PlanError("the PLAN body is not JSON: %s" % e) from None
    version = body.get("version") if isinstance(body, dict) else None
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise PlanError("the PLAN body has no version: %.80r" % (body,))
    if version <= current:
        raise PlanError("plan %d, but this server is at plan %d already" % (version, current),
                        version)
    try:
        old = read_table(body.get("old"), "the old table", num_servers)
        new = read_table(body.get("new"), "the new table", num_servers)
    except (ValueError, TypeError, plan.PlanError) as e:
        raise PlanError("plan %d: %s" % (version, e), version) from None
    for key, slices in new.items():
        if key in old and sum(x.length for x in old[key]) != sum(x.length for x in slices):
            raise PlanError("plan %d: key %d has %d elements in the old table and %d in the "
                            "new" % (version, key, sum(x.length for x in old[key]),
                                     sum(x.length for x in slices)), version)
    seeds = body.get("seeds") or []
    if not isinstance(seeds, list) or not all(
            isinstance(x, list) and len(x) == 4 and all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in x)
            for x in seeds):
        raise PlanError("plan %d: seeds are [key, offset, length, worker] counts" % version,
                        version)
    lost = body.get("lost") or []
    if not isinstance(lost, list) or not all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in lost):
        raise PlanError("plan %d: lost is not a list of server ranks" % version, version)
    for key, slices in new.items():
        if any(x.server in lost for x in slices):
            raise PlanError("plan %d: key %d placed on a lost server" % (version, key), version)
    abandon = body.get("abandon")
    if abandon is not None and (not isinstance(abandon, int) or isinstance(abandon, bool)
                                or not lost):
        raise PlanError("plan %d: abandon is the version of the plan a failover rolls back"
                        % version, version)
    diverted = body.get("diverted") or []
    if not isinstance(diverted, list) or not all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 and (
                num_servers is None or x < num_servers) for x in diverted) or (diverted and abandon is not None):
        raise PlanError("plan %d: diverted is not a list of server ranks" % version, version)
    for key, slices in new.items():
        if any(x.server in diverted for x in slices):
            raise PlanError("plan %d: key %d placed on a diverted server" % (version, key),
                            version)
    return version, old, new, {(k, o, n): w for k, o, n, w in seeds}, lost, \
        {"abandon": abandon, "diverted": diverted}


class Migrating:
    """The server's side of a re-plan (a part of ``ServerState``)."""

    #: requests of the next plan held until its PLAN arrives (a worker's are a few slices:
    #: it is released only after the scheduler sent the PLAN; the bound is against garbage)
    EARLY_BYTES = 256 << 20

    def _to_scheduler(self, body):
        self._out.append(Out(Out.SCHEDULER, None, wire.Header(MsgType.PLAN, sender=self.rank),
                             json.dumps(body).encode()))

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
        if h.type in (MsgType.PUSH, MsgType.PUSHPULL):
            grad = np.array(compression.push_values(h, payload), copy=True)
        elif h.type in _ROWS:              # its typed body, read when the slice is built
            grad = bytes(memoryview(payload)) if payload is not None else b""
        if h.type in (MsgType.PUSH, MsgType.PUSH_ROWS):
            self._reply(client, h, MsgType.ACK, length=0)
        self.deferred.setdefault(target, []).append((client, h, grad))
        if self._trace is not None:
            self._trace.append(("request_deferred", self._now(), h.iteration, h.key,
                                h.offset, h.length, h.sender, 0 if grad is None else
                                memoryview(grad).nbytes, self.plan_version,
                                h.request_id))
        return True

    def _hold_packet(self, f, payload, now):
        """An LTP packet (``ltp_packet.Fields``) of a slice of plan v still being built, or of
        plan v + 1 before its PLAN is here (overlapped re-plans: the workers send by plan v as
        soon as the scheduler sent it): kept, a copy, and taken when the slice is built or the
        PLAN comes (``LtpIntake._take_held``), as pushes by TCP wait (``_defer``).  True if
        kept; a packet beyond ``EARLY_BYTES`` held is not (the caller drops it: LTP tolerates
        its loss)."""
        mig = self.migration_open()
        inc = mig.incoming.get((f.key, f.offset)) if mig is not None and \
            f.plan_version == mig.version else None
        early = f.plan_version == self.plan_version + 1
        if inc is None and not early or inc is not None and inc.slice.length != f.length:
            return False
        n = payload.nbytes
        if self._held_bytes + n > self.EARLY_BYTES:
            return False
        self._held_bytes += n
        held = (f, memoryview(bytes(payload)), now)
        if early:
            self.early_packets.append(held)
        else:
            self.held_packets.setdefault((f.key, f.offset), []).append(held)
        self.ltp_stats["held"] += 1
        return True

    def migration_open(self):
        """The re-plan whose slices are still being built here, or None."""
        mig = self.migration
        return mig if mig is not None and mig.incoming else None

    def _replay(self, target):
        """The slice ``target`` is built: run the requests (and take the LTP packets) that
        waited for it, in order."""
        packets = self.held_packets.pop(target, ())
        if packets:
            self._take_held(packets)
        waiting = self.deferred.pop(target, ())
        if not waiting:
            return
        slot = self.slots[target]
        for client, h, grad in waiting:
            try:
                if h.type == MsgType.PUSH_ROWS:     # acknowledged when it arrived
                    self._take_rows(h, grad)
                    continue
                if h.type == MsgType.PULL_ROWS:
                    self._on_pull_rows(client, h, grad)
                    continue
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
                self._account(slot, h, grad)
                if h.type != MsgType.PUSH:
                    self._on_pull(client, h)
            except RequestError as e:
                self._error(client, h, str(e))
        self._answer_waiting(slot)

    def _on_plan(self, version, old, new, seeds=None, lost=(), abandon=None, diverted=()):
        """The scheduler's new plan.  Every worker has stopped with nothing in flight, so every
        round is complete: send each new owner its part of this server's old slices (value,
        optimizer state, update count), keep the part that stays, and build each new slice once
        all of its parts are here; then tell the scheduler.  A failover plan (``lost``
        servers) moves only the lost servers' slices, each whole to one successor, while the
        workers go on: requests of the plan before it stay valid for the slices it leaves.
        A failover during a move (``abandon``: that plan's version) first rolls that move
        back (``_abandon``); ``old`` is then the table before it.  A divert (``diverted``,
        MXPS_DIVERT) moves a slow server's slices as a failover moves a lost one's, but the
        slow server sends each successor the slice's optimizer state (``_divert_part``)."""
        gone = set(lost) | set(diverted)
        if abandon is not None:
            self._abandon(abandon)
        elif not lost:
            self.stash = {}            # the slices cut for the last plan: that one is in place
            if not diverted:
                self._prune_replicas(old, new)
        self.diverted_away = set()     # MXPS_DIVERT: slices this server gave up mid-round
        mig = self.migration = _Migration(version, seeds, gone, diverted)
        self.plan_version = version
        if not gone:
            self.plan_floor = version
        self._unfast()
        parts = []                         # (destination server, part)
        for key, slices in new.items():
            before = tuple(old.get(key) or ())
            if before == slices:
                continue
            empty = sum(x.length for x in slices) == 0
            # a failover moves only the lost slices: this server's stay as they are, their
            # rounds in progress too
            stay = set(before) & set(slices) if mig.lost else ()
            for o in before:
                if o.server != self.rank or o in stay:
                    continue
                slot = self.slots.get((key, o.offset))
                if slot is None or slot.length != o.length:
                    raise RequestError("plan %d: server %d does not hold key %d as %s"
                                       % (version, self.rank, key, o))
                if self.rank in mig.diverted:
                    # its round in progress goes on at the successor: every push it had is
                    # sent there again and every pull it owed is asked there again
                    self.diverted_away.add((key, o.offset))
                    slot.rounds.clear()
                    slot.waiting = []
                if slot.rounds or slot.waiting:
                    raise RequestError(
                        "plan %d: key %d has rounds %s partly pushed on server %d; workers "
                        "push keys unequally" % (version, key, sorted(slot.rounds), self.rank))
                for x in slices:
                    lo, hi = max(x.offset, o.offset), min(x.stop, o.stop)
                    if hi > lo or empty:
                        part = self._cut(slot, lo, hi, x.offset)
                        if self.rank in mig.diverted:
                            part = self._divert_part(part, slot)
                        parts.append((x.server, part))
                if self.failover:
                    # MXPS_FAILOVER: kept until the next plan, in case this one is rolled back
                    self.stash[(key, o.offset)] = self._cut(slot, o.offset, o.stop, o.offset)
                self._drop(slot)
            for n in slices:
                if n.server == self.rank and n not in stay:
                    over = [x for x in before if x.server != self.rank and
                            (min(x.stop, n.stop) > max(x.offset, n.offset) or empty)]
                    inc = _Incoming(n, sum(1 for x in over if x.server not in lost))
                    if any(x.server in mig.lost for x in over):
                        if len(over) != 1 or (over[0].offset, over[0].length) != (n.offset,
                                                                                  n.length):
                            raise RequestError("plan %d: key %d's slice at %d does not take "
                                               "a lost slice whole" % (version, key, n.offset))
                        inc.lost = {}
                        if over[0].server in mig.diverted:
                            inc.source = over[0].server
                    mig.incoming[(key, n.offset)] = inc
        for dest, part in parts:           # what stays here first, then what arrived early
            if dest == self.rank:
                self._add_part(mig, part, remote=False)
        for target in [t for t, inc in mig.incoming.items()
                       if inc.expect == 0 and inc.lost is None]:
            self._install(mig, target)
        early, self.early_parts = self.early_parts, []
        for v, part in early:
            if v == version:
                self._add_part(mig, part, remote=True)
        early, self.early_seeds = self.early_seeds, []
        for v, h, value in early:
            if v == version:
                self._take_seed(mig, h, value)
        for dest, part in parts:
            if dest != self.rank:
                self._send_part(mig, dest, part)
        if lost:
            self._lost(lost)
        self._maybe_done(mig)

    def _abandon(self, version):
        """Roll plan ``version`` back (a server was lost during its move, while every worker
        waited at the point): forget its slices being built, its parts on their way and what
        came early for it, drop the slices it built here, and put back the ones this server
        cut for it, from their copies (value, optimizer state, update count, round)."""
        mig = self.migration
        if mig is not None and mig.version == version:
            mig.incoming.clear()
            mig.outgoing.clear()
            mig.seeded.clear()
            mig.done = True
        self.early_parts = [(v, p) for v, p in self.early_parts if v != version]
        self.early_seeds = [x for x in self.early_seeds if x[0] != version]
        self.deferred.clear()
        self.held_packets.clear()
        for slot in [x for x in self.slots.values() if x.since == version]:
            self._drop(slot)
        stash, self.stash = self.stash, {}
        for (key, offset), part in stash.items():
            slot = self._moved_slot(key, offset, part["length"], part["dtype"], part["cols"],
                                    np.array(part["value"], copy=True), part.get("state"))
            slot.applied = part["applied"]
            self.policy.moved(slot)
            if self.updater is not None:
                slot.store.serve_weights(copy=self.policy.copies)
                if slot.index != key:
                    self._alias(slot)
                if "count" in part:
                    update_counts(self.updater.optimizer)[slot.index] = part["count"]
            self.slots[(key, offset)] = slot
            self._unfast()
            self._after_round(slot)
        log.warning("server %d: plan %d rolled back (%d slices put back)", self.rank, version,
                    len(stash))

    def _cut(self, slot, lo, hi, target):
        """The elements [lo, hi) of ``slot`` (key coordinates) as a migration part of the new
        slice starting at ``target``."""
        a, b = lo - slot.offset, hi - slot.offset
        part = {"key": slot.key, "target": target, "offset": lo, "length": hi - lo,
                "dtype": slot.dtype_code, "value": slot.store.cut(a, b),
                "applied": slot.applied, "cols": slot.cols}
        if self.updater is not None:
            state = slot.store.cut_state(self.updater, slot.index, a, b)
            if state is not None:
                part["state"] = state
            count = update_counts(self.updater.optimizer).get(slot.index)
            if count is not None:
                part["count"] = count
        return part

    def _drop(self, slot):
        self.slots.pop((slot.key, slot.offset), None)
        self._unfast()
        slot.store.release(self.updater, slot.index)
        self._store_released(slot)
        if self.updater is not None:
            update_counts(self.updater.optimizer).pop(slot.index, None)

    def _send_part(self, mig, dest, part):
        worker = mig.seeds.get((part["key"], part["offset"], part["length"]))
        if worker is not None:
            # a worker sends the weights (it holds exactly these since its last pull): only
            # the optimizer state and counts cross from here, with a checksum of the weights
            value = part.pop("value")
            part["crc"] = zlib.crc32(memoryview(np.ascontiguousarray(value)).cast("B"))
            part["seeded"] = worker
        mig.next_id += 1
        mig.outgoing[mig.next_id] = dest
        mig.moved += part_bytes(part)
        h = wire.Header(MsgType.MIGRATE, key=part["key"], sender=self.rank,
                        plan_version=mig.version, offset=part["offset"],
                        length=part["length"], request_id=mig.next_id)
        if self._trace is not None:
            self._plan_row("part_sent", mig.version, h.key, h.offset, h.length, dest,
                           part_bytes(part), mig.next_id)
        self._out.append(Out(Out.PEER, dest, h, typed.pack(part)))

    def _on_migrate(self, client, h, payload):
        part = read_part(h, payload)
        if self._trace is not None:
            self._plan_row("part_received", h.plan_version, h.key, h.offset, h.length,
                           h.sender, part_bytes(part), h.request_id)
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
        if inc.source is not None:
            self._diverted_part(mig, inc, part)
            return
        inc.parts.append(part)
        if "value" not in part:
            got = mig.seeded.pop((part["key"], part["offset"]), None)
            if got is not None:
                self._seed_part(mig, part, *got)
        if remote:
            inc.expect -= 1
            self._maybe_install(mig, target)

    def _maybe_install(self, mig, target):
        inc = mig.incoming.get(target)
        if inc is not None and inc.expect == 0 and all("value" in p for p in inc.parts) \
                and (inc.lost is None or inc.parts):
            self._install(mig, target)

    def _seed_part(self, mig, part, value, worker):
        """A worker's weights for a part that came without them; checked against the old
        owner's checksum."""
        if value.size != part["length"] or value.dtype != wire.dtype_of(part["dtype"]):
            raise RequestError("plan %d: worker %d sent %d elements of %s for key %d [%d, +%d)"
                               % (mig.version, worker, value.size, value.dtype, part["key"],
                                  part["offset"], part["length"]))
        crc = zlib.crc32(memoryview(np.ascontiguousarray(value)).cast("B"))
        if crc != part["crc"]:
            raise RequestError("plan %d: the weights worker %d sent for key %d [%d, +%d) are "
                               "not the ones its old owner holds (checksum %08x, not %08x): "
                               "the worker's copy changed since its last pull"
                               % (mig.version, worker, part["key"], part["offset"],
                                  part["length"], crc, part["crc"]))
        part["value"] = value

    def _on_seed(self, client, h, payload):
        """SEED (MXPS_REPLAN_SEED): a worker's copy of a moved part's weights."""
        if h.dtype == wire.NO_DTYPE and (payload is None or not payload_bytes(payload)):
            value = None      # MXPS_FAILOVER: this worker never pulled the lost slice
        else:
            value = np.array(wire.payload_array(h, payload), copy=True)
        if h.plan_version == self.plan_version + 1 and (
                self.migration is None or self.migration.version != h.plan_version):
            if sum(v.nbytes for _, _, v in self.early_seeds if v is not None) + (
                    0 if value is None else value.nbytes) > self.EARLY_BYTES:
                raise RequestError("key %d: more than %d MB of seeds of plan %d before its "
                                   "PLAN arrived" % (h.key, self.EARLY_BYTES >> 20,
                                                     h.plan_version))
            self.early_seeds.append((h.plan_version, h, value))
        else:
            mig = self.migration
            if mig is None or mig.version != h.plan_version:
                raise RequestError("a seed of key %d for plan %d, but server %d is at plan %d"
                                   % (h.key, h.plan_version, self.rank, self.plan_version))
            try:
                self._take_seed(mig, h, value)
            except RequestError as e:
                self._plan_failed(mig.version, e)
                raise
        self._reply(client, h, MsgType.ACK, length=0)

    def _take_seed(self, mig, h, value):
        inc = mig.incoming.get((h.key, h.offset))
        if inc is not None and inc.lost is not None:
            self._take_lost_seed(mig, inc, h, value)
            return
        if value is None:
            raise RequestError("plan %d: worker %d sent no weights for key %d [%d, +%d)"
                               % (mig.version, h.sender, h.key, h.offset, h.length))
        if mig.seeds.get((h.key, h.offset, h.length)) != h.sender:
            raise RequestError("plan %d: worker %d sent weights of key %d [%d, +%d), which "
                               "the plan does not ask of it" % (mig.version, h.sender, h.key,
                                                                h.offset, h.length))
        for target, inc in list(mig.incoming.items()):
            for part in inc.parts:
                if (part["key"], part["offset"]) == (h.key, h.offset) and "value" not in part:
                    self._seed_part(mig, part, value, h.sender)
                    self._maybe_install(mig, target)
                    self._maybe_done(mig)
                    return
        mig.seeded[(h.key, h.offset)] = (value, h.sender)

    def _take_lost_seed(self, mig, inc, h, value):
        """MXPS_FAILOVER: one worker's copy of a lost slice (None: it never pulled it) and the
        round its last pull of it got.  With every worker's in, the slice is built from the
        latest: a worker that pulled round r got the lost server's weights after r rounds,
        and every push of a later round comes again (``wire.RESENT``)."""
        n = inc.slice
        if h.length != n.length:
            raise RequestError("plan %d: worker %d sent %d elements for key %d's lost slice "
                               "[%d, +%d)" % (mig.version, h.sender, h.length, h.key,
                                              n.offset, n.length))
        if h.sender in inc.lost:
            raise RequestError("plan %d: worker %d sent key %d's lost slice at %d twice"
                               % (mig.version, h.sender, h.key, n.offset))
        inc.lost[h.sender] = (h.iteration, value, h.dtype)
        if len(inc.lost) < self.num_workers:
            return
        if inc.source is not None:
            self._resolve_divert(mig, inc)
            return
        held = [(r, w) for w, (r, v, _) in inc.lost.items() if v is not None]
        if not held:
            raise RequestError("plan %d: no worker holds key %d [%d, +%d) of the lost server: "
                               "its weights are lost (no worker pulled it)"
                               % (mig.version, h.key, n.offset, n.length))
        r, w = max(held)
        _, value, dtype = inc.lost[w]
        part = {"key": h.key, "target": n.offset, "offset": n.offset, "length": n.length,
                "dtype": dtype, "value": value, "applied": r, "cols": 0}
        inc.parts = [part]
        kept = self.replica_of(h.key, n.offset, n.length, r)    # MXPS_REPLICA
        if kept is not None:
            if kept[0] is not None:
                part["state"] = kept[0]
            if kept[1] is not None:
                part["count"] = kept[1] + kept[2]
            if kept[2]:
                mig.stale.append([h.key, n.offset, n.length, kept[2]])
        elif self.updater is not None and self._stateful(value):
            mig.reset.append([h.key, n.offset, n.length])
        log.warning("server %d: plan %d: key %d [%d, +%d) of a lost server rebuilt from "
                    "worker %d's weights after round %d%s", self.rank, mig.version, h.key,
                    n.offset, n.length, w, r, ", its optimizer state reset"
                    if mig.reset and mig.reset[-1][:2] == [h.key, n.offset] else "")
        self._maybe_install(mig, (h.key, n.offset))
        self._maybe_done(mig)

    # -- MXPS_DIVERT: the slow server sends state, the workers the weights ----------------------
    def _divert_part(self, part, slot):
        """On the slow server: a whole slice it gives up, as the part it sends its successor
        (the optimizer state, update count and round, with a checksum of the weights, which the
        workers send), and its copy kept for a ``VALUE`` (``stash``).  With MXPS_REPLICA the
        state stays here too: the part names the newest round whose replica the buddy
        acknowledged, and the successor asks the buddy for it (``STATE``)."""
        self.stash[(part["key"], part["offset"])] = dict(part)
        value = part.pop("value")
        part["crc"] = zlib.crc32(memoryview(np.ascontiguousarray(value)).cast("B"))
        part["diverted"] = self.rank
        if self.replica and part.get("state") is not None and slot.replicated > 0:
            del part["state"]
            part["replica"] = slot.replicated
        return part

    def _diverted_part(self, mig, inc, part):
        """On a successor: the slow server's part of a diverted slice: its state (or, with
        MXPS_REPLICA, the word that its buddy holds it), or (the answer to a ``VALUE``) the
        whole slice."""
        if "value" in part:
            if not inc.asked:
                raise RequestError("plan %d: server %d sent key %d's slice at %d whole, "
                                   "unasked" % (mig.version, inc.source, part["key"],
                                                part["offset"]))
            # the whole slice, its own state with it: a stale replica's is not used
            mig.stale = [x for x in mig.stale if x[:3] != [part["key"], part["offset"],
                                                           part["length"]]]
            inc.parts = [part]
            self._maybe_install(mig, (part["key"], part["target"]))
            self._maybe_done(mig)
            return
        if inc.parts:
            raise RequestError("plan %d: key %d's slice at %d came twice from server %d"
                               % (mig.version, part["key"], part["offset"], inc.source))
        inc.parts.append(part)
        inc.expect -= 1
        self._resolve_divert(mig, inc)

    def _resolve_divert(self, mig, inc):
        """With the slow server's part and every worker's seed in: the weights are the
        seeds' if the latest round a worker pulled is the one the state is of and they are
        the slow server's (its checksum); otherwise the slow server is asked for them
        (``VALUE``): no worker pulled that round yet (its replies were still on the slow
        link), or the workers' copy changed since (Gluon's BatchNorm running statistics,
        pulled once and changed by the forward pass).

        With MXPS_REPLICA, when the workers hold the slow server's round, the state is the
        replica its buddy holds of that round (``STATE``): nothing crosses the slow link.  A
        lazy replica's state may be older (``stale``).  A round no worker pulled yet still
        comes whole from the slow server (``VALUE``): rebuilding it one round back from the
        buddy's state and the pushes sent again is not done (docs/REPLAN.md)."""
        if inc.expect or not inc.parts or len(inc.lost) < self.num_workers or inc.asked \
                or inc.replica == "asked":
            return
        part = inc.parts[0]
        n = inc.slice
        held = [(r, w) for w, (r, v, _) in inc.lost.items() if v is not None]
        r, w = max(held) if held else (-1, None)
        if r > part["applied"]:
            raise RequestError("plan %d: worker %d pulled round %d of key %d [%d, +%d), but "
                               "server %d applied round %d" % (
                                   mig.version, w, r, part["key"], n.offset, n.length,
                                   inc.source, part["applied"]))
        same = r == part["applied"] and self._is_servers(inc.lost[w], part)
        if "replica" in part and inc.replica is None and same:
            self._ask_state(mig, inc, r)
            if inc.replica == "asked":
                return
        if inc.replica == "in" or "replica" not in part and same:
            part["value"] = inc.lost[w][1]
            self._maybe_install(mig, (part["key"], part["target"]))
            self._maybe_done(mig)
            return
        why = "no worker pulled round %d yet" % part["applied"]
        if inc.replica == "missing":
            why = "its buddy holds no replica of its state after round %d" % r
        elif r == part["applied"]:
            why = "worker %d's copy is not the server's (changed since its pull)" % w
        inc.asked = True
        mig.next_id += 1
        mig.outgoing[mig.next_id] = inc.source
        h = wire.Header(MsgType.VALUE, key=part["key"], sender=self.rank,
                        plan_version=mig.version, offset=n.offset, length=n.length,
                        request_id=mig.next_id)
        self._out.append(Out(Out.PEER, inc.source, h, None))
        log.info("server %d: plan %d: key %d [%d, +%d): %s; its weights asked of server %d",
                 self.rank, mig.version, part["key"], n.offset, n.length, why, inc.source)

    @staticmethod
    def _is_servers(seed, part):
        """Whether a worker's seed (round, weights, dtype) is the weights the slow server's
        part has the checksum of."""
        _, value, dtype = seed
        return dtype == part["dtype"] and value.size == part["length"] and zlib.crc32(
            memoryview(np.ascontiguousarray(value)).cast("B")) == part["crc"]

    # -- MXPS_DIVERT with MXPS_REPLICA: the state from the slow server's buddy ---------------
    def _ask_state(self, mig, inc, round_):
        """Ask the slow server's buddy for its replica of the slice's state after ``round_``
        (``STATE``), or take it here if this server is the buddy."""
        n = inc.slice
        holder = failover.buddy(inc.source, self.lost_servers, self.num_servers)
        if holder == self.rank:
            self._take_replica(mig, inc, round_, self.replica_of(
                inc.parts[0]["key"], n.offset, n.length, round_))
            return
        inc.replica = "asked"
        mig.next_id += 1
        mig.outgoing[mig.next_id] = holder
        mig.state_asks[mig.next_id] = (inc.parts[0]["key"], n.offset, round_)
        h = wire.Header(MsgType.STATE, key=inc.parts[0]["key"], sender=self.rank,
                        plan_version=mig.version, offset=n.offset, length=n.length,
                        iteration=round_, request_id=mig.next_id)
        self._out.append(Out(Out.PEER, holder, h, None))

    def _take_replica(self, mig, inc, round_, kept):
        """The buddy's replica of a diverted slice's state, (state, count, rounds it is behind
        ``round_``: ``Replicas.replica_of``), for the workers' ``round_`` (None: it holds none,
        and the slow server is asked for the slice whole).  A lazy replica's state may be rounds older: the job facts list the slice
        (``stale``) and its count goes on from the workers' round."""
        part, n = inc.parts[0], inc.slice
        if kept is None or kept[0] is None:
            inc.replica = "missing"
            return
        state, count, behind = kept
        inc.replica = "in"
        if count is not None:
            part["count"] = count + behind
        part["state"] = state
        if behind:
            mig.stale.append([part["key"], n.offset, n.length, behind])

    def _on_state_reply(self, server_rank, h, payload):
        """The buddy's answer to a ``STATE``: DATA with {state, count, applied} (typed), or
        ACK: it keeps none."""
        mig = self.migration
        del mig.outgoing[h.request_id]
        key, offset, round_ = mig.state_asks.pop(h.request_id)
        inc = mig.incoming.get((key, offset))
        if inc is None or inc.replica != "asked":
            raise RequestError("plan %d: server %d sent the state of key %d [%d, ...) unasked"
                               % (mig.version, server_rank, key, offset))
        kept = None
        if h.type == MsgType.DATA:
            what = "STATE reply of key %d" % key
            body = fields(typed.unpack(payload), what, ("state", "applied"), ("count",))
            check_state(body["state"], inc.slice.length, what)
            for f in ("applied", "count"):
                if f in body:
                    count_field(body[f], "%s: %s" % (what, f))
            if body["applied"] > round_:
                raise RequestError("%s: round %d, asked for %d or before"
                                   % (what, body["applied"], round_))
            kept = (body["state"], body.get("count"), round_ - body["applied"])
        self._take_replica(mig, inc, round_, kept)
        self._resolve_divert(mig, inc)
        self._maybe_done(mig)

    def _on_state(self, client, h, payload):
        """STATE from a successor of a diverted slice: this server's replica of its state after
        round ``h.iteration`` or the newest before it (it is the slow server's buddy), or ACK
        if it keeps none."""
        size = 0 if payload is None else len(payload_bytes(payload))
        if size:
            raise RequestError("STATE of key %d from server %d carries %d bytes: it carries "
                               "none" % (h.key, h.sender, size))
        kept = self.replica_of(h.key, h.offset, h.length, h.iteration)
        if kept is None or kept[0] is None:
            log.info("server %d: no replica of key %d [%d, +%d) round %d for server %d",
                     self.rank, h.key, h.offset, h.length, h.iteration, h.sender)
            self._reply(client, h, MsgType.ACK, length=0)
            return
        body = {"state": kept[0], "applied": h.iteration - kept[2]}
        if kept[1] is not None:
            body["count"] = kept[1]
        self._reply(client, h, MsgType.DATA, typed.pack(body), dtype=wire.NO_DTYPE, length=0)

    def _on_value(self, client, h, payload):
        """VALUE from a successor: the whole slice this server gave up in a divert."""
        mig = self.migration
        part = self.stash.get((h.key, h.offset))
        if mig is None or mig.version != h.plan_version or self.rank not in mig.diverted \
                or part is None or part["length"] != h.length:
            raise RequestError("VALUE of key %d [%d, +%d) for plan %d: server %d did not give "
                               "that slice up in that plan" % (h.key, h.offset, h.length,
                                                               h.plan_version, self.rank))
        self._reply(client, h, MsgType.ACK, length=0)
        self._send_part(mig, h.sender, dict(part))

    def diverted_request(self, h):
        """A data request of an older plan for a slice this server gave up in a divert: the
        worker sent it to the successor too, so it is dropped without an answer."""
        return (h.key, h.offset) in self.diverted_away and h.plan_version < self.plan_version

    def _stateful(self, value):
        """Whether the optimizer keeps state for a slice like ``value`` (what a lost slice's
        successor starts afresh)."""
        import mxnet as mx
        try:
            return self.updater.optimizer.create_state(
                0, mx.nd.zeros((1,), dtype=value.dtype)) is not None
        except Exception:
            return True

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
        states = [p.get("state") for p in parts]
        if any(x is not None for x in states) and any(x is None for x in states):
            raise RequestError("plan %d: some parts of key %d lack optimizer state"
                               % (mig.version, key))
        state = None if states[0] is None else join_state(states)
        cols = max(p.get("cols", 0) for p in parts)
        slot = self._moved_slot(key, want.offset, want.length, parts[0]["dtype"], cols,
                                value, state)
        slot.applied = applied.pop()
        self.policy.moved(slot)
        if self.updater is not None:
            slot.store.serve_weights(copy=self.policy.copies)
            if slot.index != key:
                self._alias(slot)
            counts = {p["count"] for p in parts if "count" in p}
            if counts:
                opt = self.updater.optimizer
                update_counts(opt)[slot.index] = max(counts)
                opt.num_update = max(opt.num_update, max(counts))
        slot.since = mig.version
        self.slots[target] = slot
        self._unfast()
        self._after_round(slot)          # MXPS_REPLICA: its state to the buddy
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
        ack = {"version": mig.version, "moved_bytes": mig.moved}
        if mig.lost:
            ack["reset"] = mig.reset
            if mig.stale:
                ack["stale"] = mig.stale
        self._to_scheduler(ack)
        log.info("server %d: plan %d in place (%d bytes sent)", self.rank, mig.version,
                 mig.moved)

    def _plan_failed(self, version, error):
        # the job cannot go on with a broken placement: the scheduler ends it with this reason
        log.error("server %d: plan %s failed: %r", self.rank, version, error)
        if self._trace is not None:
            self._plan_row("plan_failed", version if isinstance(version, int) else -1)
        self._to_scheduler({"version": version,
                            "error": "%s: %s" % (type(error).__name__, error)})
