"""A worker's side of failover (MXPS_FAILOVER, docs/FAILOVER.md): what a lost server left
undone goes to its successors, inside the round, without stopping the worker.

``Rerouting`` is the part of the worker's ``Client`` that, with failover on, remembers per
server and slice the round and the buffer of the last pull answered (the weights a successor
starts from) and the pushes acknowledged since (the lost server had them, the successor may
not), and, when the scheduler's FAILOVER names a lost server, on the I/O thread:

1. asks the adapter for the successor table (``on_failover``: ``Plan.without``, the same on
   every worker) and sends it to the scheduler, which gives it to the servers as a PLAN;
2. sends each successor a SEED of every lost slice: this worker's copy of its weights and the
   round its last pull of it got (none if it never pulled it); the successor builds the
   slice from the latest round any worker holds (``roles.migration``);
3. sends every request the lost server left unanswered, and every push it acknowledged of a
   round this worker has not pulled yet, to the successor, marked ``wire.RESENT`` (the
   successor drops a push of a round its slice already applied); pushes still queued for the
   lost server join the successor's queue; requests submitted later by the old plan are
   routed the same way (``route``).

The operations waiting on those requests complete from the successor's replies, so MXNet's
engine never sees the loss.  The gradient arrays of a round stay untouched until the round's
pull completes (the next backward pass needs the pulled weights), so a push sent again sends
the gradient that was sent first.
"""
import json
import logging
import time

import numpy as np

from .slow_watch import SlowWatch

from ..placement.plan import table_to_json
from ..wire import frame as wire
from ..wire.frame import Header, MsgType

log = logging.getLogger("mxps.worker")

_PUSHES = frozenset((MsgType.PUSH, MsgType.PUSHPULL))
_DATA = frozenset((MsgType.PUSH, MsgType.PULL, MsgType.PUSHPULL))


class _MustSucceed:
    """A successor's answer to a SEED or to an acknowledged push sent again: an ERROR ends the
    job (the slice cannot be built, or a round would miss the push)."""

    __slots__ = ("client", "what")

    def __init__(self, client, what):
        self.client = client
        self.what = what

    def __call__(self, h, payload):
        if h.type == MsgType.ERROR:
            self.client.link.fail("%s refused: %s" % (self.what, bytes(payload).decode(
                errors="replace")))


class _Lost:
    """The payload of an ERROR answered for a lost server (as a zmq frame has ``bytes``)."""

    __slots__ = ("bytes",)

    def __init__(self, text):
        self.bytes = text

    def __bytes__(self):
        return self.bytes


class Rerouting:
    """Part of the worker's ``Client`` (see the module docstring)."""

    def _init_rerouting(self, cfg):
        # MXPS_DIVERT moves a live, slow server's slices the same way (``divert`` below)
        self.failover = cfg.failover or cfg.divert
        n = len(self.servers)
        # per server: (key, offset) -> (round, the reply callback whose buffer the pull
        # filled, dtype code) of the last pull answered
        self._pulled = [{} for _ in range(n)]
        # per server: (key, offset) -> [(header, payload)] of pushes it acknowledged of rounds
        # this worker has not pulled from it yet
        self._acked = [{} for _ in range(n)]
        # per key: [offset, stop, round, the reply callback whose buffer the pull filled,
        # dtype code] of its recent pulls from any server, of any plan (a slice re-cut at a
        # re-plan point was pulled as other slices: ``_held_copy``)
        self._pulls = {}
        # per server: (key, offset) -> (payload, dtype code) of an INIT it acknowledged, until
        # this worker's first pull of the slice (a successor's seed before any pull)
        self._inits = [{} for _ in range(n)]
        self.lost = set()
        # MXPS_DIVERT: server -> the plan version that moved its slices away; a data request
        # of an older plan submitted for it goes where its slice is now
        self.diverted = {}
        # request ids sent again elsewhere after a divert: the slow server's late replies
        # to them are dropped without a word
        self._moved_ids = set()
        # the adapter's: (version, lost server) -> (old table, new table, {(key, offset):
        # (successor, length)}); and (key, offset) -> (server, plan version) of the plan in
        # force, for requests submitted by an older plan to a lost server
        self.on_failover = None
        self.route = None
        self.failovers = []       # (version, lost server, seconds the rerouting took)
        # MXPS_DIVERT: the ACK rates that find a slow server inside a round (``SlowWatch``);
        # MXPS_DIVERT_FORCE (tests): (round, server) worker 0 reports slow at that round
        self._watch = SlowWatch(len(self.servers)) if cfg.divert else None
        self._next_watch = 0.0
        self._force_slow = cfg.divert_force if cfg.divert and self.rank == 0 else ()
        self.diverts = []         # ... of slow servers (MXPS_DIVERT)

    def _remember(self, server, request, h, on_reply, payload):
        """A reply of ``server`` was taken (I/O thread; failover on)."""
        if request.type in _PUSHES and h.type == MsgType.ACK:
            pulled = self._pulled[server].get((request.key, request.offset))
            if pulled is not None and pulled[0] >= request.iteration:
                # a push sent again after a failover or divert, acknowledged after this
                # worker pulled its round (the slice was rebuilt at that round): nothing to
                # keep (kept, it would outlive its slice's plan)
                return
            acked = self._acked[server].setdefault((request.key, request.offset), [])
            acked.append((request, payload))
            if len(acked) > 2:      # a key pushed and not pulled: its last rounds only
                del acked[0]
        if request.type == MsgType.INIT and h.type == MsgType.ACK:
            self._inits[server][(request.key, request.offset)] = (payload, request.dtype)
        if request.type in (MsgType.PULL, MsgType.PUSHPULL) and h.type == MsgType.DATA:
            part = (request.key, request.offset)
            self._pulled[server][part] = (h.iteration, on_reply, h.dtype)
            self._pulled_range(request, h, on_reply)
            self._inits[server].pop(part, None)
            acked = self._acked[server].get(part)
            if acked:
                acked[:] = [(q, p) for q, p in acked if q.iteration > h.iteration]

    KEEP_PULLS = 3      # rounds of pulls per key kept for ``_held_copy``

    def _pulled_range(self, request, h, on_reply):
        pulls = self._pulls.setdefault(request.key, [])
        stop = request.offset + request.length
        pulls[:] = [p for p in pulls if (p[0], p[1]) != (request.offset, stop)
                    and p[2] > h.iteration - self.KEEP_PULLS]
        pulls.append([request.offset, stop, h.iteration, on_reply, h.dtype])

    def _held_copy(self, key, offset, length):
        """(round, reply callback, dtype) of this worker's copy of key ``key``'s elements
        [offset, offset + length): each element holds what the latest pull that wrote it got;
        the round is the oldest of those (a seed older than the server's round is not
        used).  None if some element was not pulled lately."""
        stop = offset + length
        pulls = [p for p in self._pulls.get(key, ()) if p[0] < stop and offset < p[1]]
        cuts = sorted({offset, stop} | {x for p in pulls for x in p[:2] if offset < x < stop})
        oldest, best = None, None
        for a, b in zip(cuts, cuts[1:]):
            cover = [p for p in pulls if p[0] <= a and b <= p[1]]
            if not cover:
                return None
            latest = max(cover, key=lambda p: p[2])
            if oldest is None or latest[2] < oldest:
                oldest, best = latest[2], latest
        return None if best is None else (oldest, best[3], best[4])

    def _take_failovers(self):
        while self.link.failovers:
            body = self.link.failovers.pop(0)
            self._fail_over(body["version"], body["dead"], body.get("divert", False),
                            body.get("avoid", ()))

    def _fail_over(self, version, dead, divert=False, avoid=()):
        """Server ``dead`` is lost, or (``divert``, MXPS_DIVERT) alive and slow: its slices
        go to successors now, inside the round.  A slow server keeps its control requests
        (it will answer them); its data requests go to the successors as a lost one's do,
        and its replies to them, when they come, are dropped."""
        t0 = time.monotonic()
        if dead in self.lost or self.diverted.get(dead) == version:
            return
        if self.on_failover is None:
            self.link.fail("server %d was lost before this worker's kvstore existed" % dead)
        if not 0 <= dead < len(self.servers):
            self.link.fail("the scheduler named server %d lost; the job has %d"
                           % (dead, len(self.servers)))
        old, new, moved = self.on_failover(version, dead, divert, avoid)
        if divert:
            self.diverted[dead] = version
            self._moved_ids.clear()     # an earlier divert's: long answered or never will be
            if self._watch is not None:
                self._watch.forget(dead)
        else:
            self.lost.add(dead)
        self.link.send(MsgType.FAILOVER, json.dumps(
            {"version": version, "dead": dead, "old": table_to_json(old),
             "new": table_to_json(new)}).encode())
        # 0. an INIT the lost server did not answer: the successor builds the slice from its
        #    value (the seed below), so it is done
        inits = self._inits[dead]
        for rid, entry in list(self._pending.items()):
            on_reply, _, server, h, _, payload = entry
            if server == dead and h.type == MsgType.INIT and (h.key, h.offset) in moved:
                del self._pending[rid]
                inits[(h.key, h.offset)] = (payload, h.dtype)
                on_reply(h.reply(MsgType.ACK, length=0), None)
        # 1. the successors' seeds: this worker's copy of each lost slice
        pulled = self._pulled[dead]
        for (key, offset), (to, length) in sorted(moved.items()):
            got = pulled.get((key, offset)) or self._held_copy(key, offset, length)
            what = "SEED of key %d [%d, +%d) to server %d" % (key, offset, length, to)
            init = inits.get((key, offset))
            if got is None and init is not None and init[0] is not None:
                # initialised, never pulled: the value this worker initialised it with
                h = Header(MsgType.SEED, key=key, plan_version=version, offset=offset,
                           length=length, dtype=init[1], iteration=0)
                payload = np.array(init[0], copy=True).reshape(-1)
            elif got is None or getattr(got[1], "dview", None) is None:
                h = Header(MsgType.SEED, key=key, plan_version=version, offset=offset,
                           length=length, dtype=wire.NO_DTYPE, iteration=0)
                payload = None
            else:
                r, fill, dtype = got
                h = Header(MsgType.SEED, key=key, plan_version=version, offset=offset,
                           length=length, dtype=dtype, iteration=r)
                payload = fill.dview[offset:offset + length].copy()
            h.request_id = next(self._ids)
            h.sender = self.rank
            self._send(to, h, payload, _MustSucceed(self, what), 0)
        # 2. the requests the lost server left unanswered, and the pushes it acknowledged
        #    of rounds this worker has not pulled from it
        again = 0
        for rid, entry in list(self._pending.items()):
            on_reply, _, server, h, held, payload = entry
            if server != dead or divert and h.type not in _DATA:
                continue
            del self._pending[rid]
            if divert:
                self._moved_ids.add(rid)
            if held:
                self._unacked[dead] -= held
                self._unacked_count[dead] -= 1
            if h.type not in _DATA:
                # a control request (GET_STATES, SET_OPTIMIZER, ...): answered here with an
                # ERROR saying the server is lost; its caller asks the servers left
                # (``live_servers``) again
                on_reply(h.reply(MsgType.ERROR, dtype=wire.NO_DTYPE, length=0), _Lost(
                    b"server %d was lost (MXPS_FAILOVER)" % dead))
                continue
            to = self._successor(moved, h)
            if held:
                self._unacked[to] += held
                self._unacked_count[to] += 1
            if h.type in _PUSHES:
                h.flags |= wire.RESENT
            self._send(to, h, payload, on_reply, held)
            again += 1
        for (key, offset), pushes in self._acked[dead].items():
            for h, payload in pushes:
                to = self._successor(moved, h)
                h.flags |= wire.RESENT
                h.request_id = next(self._ids)
                self._send(to, h, payload, _MustSucceed(self, "push of key %d sent again to "
                                                      "server %d" % (key, to)), 0)
                again += 1
        # 3. pushes still queued for it join their successors' queues
        queued = self._held[dead]
        self._held[dead] = []
        self._outbox[dead].clear()
        for item in queued:
            h = item[4]
            to = self._successor(moved, h)
            self._held[to].append(item)
            again += 1
        for q in self._held:
            q.sort()
        self._pulled[dead] = {}
        self._acked[dead] = {}
        self._inits[dead] = {}
        took = time.monotonic() - t0
        if divert:
            self.diverts.append((version, dead, took))
        else:
            self.failovers.append((version, dead, took))
        (log.info if divert else log.warning)(
            "worker %d: server %d %s; %d slices go to %s (plan %d), %d requests sent again "
            "(%.3f s)", self.rank, dead, "slow" if divert else "lost", len(moved),
            sorted({to for to, _ in moved.values()}), version, again, took)

    WATCH_EVERY = 0.02      # seconds between two looks for a slow server (MXPS_DIVERT)

    def _watch_slow(self, now):
        if now < self._next_watch:
            return
        self._next_watch = now + self.WATCH_EVERY
        for s, ratio in self._watch.slow(now):
            if s not in self.lost:
                self._report_slow(s, self._watch.round[s], ratio)

    def _report_slow(self, server, rnd, ratio, forced=False):
        """Tell the scheduler server ``server`` slowed down in round ``rnd`` to ``ratio`` of its
        last rounds' rate while the others kept theirs (MXPS_DIVERT); it decides whether its
        slices move.  ``forced``: MXPS_DIVERT_FORCE's report (tests)."""
        log.info("worker %d: server %d's acknowledgements at %.2fx of their last rounds' rate "
                 "in round %s", self.rank, server, ratio, rnd)
        body = {"server": server, "round": int(rnd or 0), "ratio": float(ratio)}
        if forced:
            body["forced"] = True
        self.link.send(MsgType.SLOW, json.dumps(body).encode())

    def live_servers(self):
        """The ranks of the servers not lost to a failover."""
        return [s for s in range(len(self.servers)) if s not in self.lost]

    def _successor(self, moved, h):
        """The successor of request ``h``'s slice, with ``h`` set to the plan in force."""
        got = moved.get((h.key, h.offset))
        if got is None:
            to, version = self._route(h)
        else:
            to, version = got[0], self.route(h.key, h.offset)[1]
        h.plan_version = version
        return to

    def _route(self, h):
        to, version = self.route(h.key, h.offset)
        if to is None:
            self.link.fail("%r cannot be sent again: key %d has no slice at %d in plan %d"
                           % (h, h.key, h.offset, version))
        return to, version

    def _rerouted(self, server, h):
        """The server a request submitted for ``server`` goes to: itself unless lost (an
        operation issued by the plan before a failover)."""
        if h.type in _DATA and (server in self.lost or
                                h.plan_version < self.diverted.get(server, 0)):
            to, h.plan_version = self._route(h)
            return to
        return server

    def moved_reply(self, server, h):
        """Whether ``h`` is a slow server's late reply to a request sent again elsewhere
        after a divert (dropped without a word)."""
        if h.request_id in self._moved_ids and server in self.diverted:
            entry = self._pending.get(h.request_id)
            if entry is None or entry[2] != server:
                if entry is None:
                    self._moved_ids.discard(h.request_id)
                return True
        return False
