"""Optimizer state replicated on a buddy server (MXPS_REPLICA, docs/FAILOVER.md).

The workers hold a slice's weights after every pull, but its optimizer state (SGD's momentum,
Adam's mean and variance) lives on its server only.  With MXPS_REPLICA=1 a server sends its
buddy (the next server in rank order that is not lost) the state of a slice each time it
applies a round (a REPLICA: key, slice, round, state, update count), and answers the round's
pulls only once the buddy acknowledged it (``Replicated``, the round policy's wrapper).  So
when a worker holds the weights of round r, the buddy holds the state of round r: a failover
(``placement.failover`` gives a lost server's slices to its buddy) rebuilds a lost slice with
both, and the job goes on with the weights of an uninterrupted run.

The buddy keeps the last two rounds of each slice (a round may be applied and replicated before
any worker pulled it).  After a failover that lost a server's buddy, every slice is replicated
to the new buddy at once.  ``Replicas`` is the part of ``ServerState`` that does this.

MXPS_REPLICA=K > 1 is the lazy replica: every K-th round, and pulls do not wait for it.  It
costs a K-th of the bytes and nothing on a step's path; a failover then restores a lost
slice's state as of the newest replicated round, up to K rounds before the weights the workers
hold (the job facts list those slices and how many rounds old their state is).
"""
import logging

from ..wire import frame as wire, typed
from ..wire.frame import MsgType
from .optimizer_states import update_counts
from .server_requests import Out, RequestError, check_state, count_field, fields

log = logging.getLogger("mxps.server")


class Replicated:
    """A round policy whose pulls also wait for the round's state to be on the buddy."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def pull_ready(self, slot, h):
        return self.inner.pull_ready(slot, h) and h.iteration <= slot.replicated


def read_replica(h, payload):
    what = "REPLICA of key %d" % h.key
    body = fields(typed.unpack(payload), what, ("key", "offset", "length", "applied"),
                  ("state", "count"))
    for f in ("key", "offset", "length", "applied", "count"):
        if f in body:
            count_field(body[f], "%s: %s" % (what, f))
    if (body["key"], body["offset"], body["length"], body["applied"]) != (
            h.key, h.offset, h.length, h.iteration):
        raise RequestError("%s: the body names key %d [%d, +%d) round %d, the header key %d "
                           "[%d, +%d) round %d" % (what, body["key"], body["offset"],
                                                   body["length"], body["applied"], h.key,
                                                   h.offset, h.length, h.iteration))
    check_state(body.get("state"), body["length"], what)
    return body


class Replicas:
    """Part of ``ServerState``: sending its slices' state to its buddy, keeping its
    predecessor's."""

    KEEP = 2      # rounds of a slice's state a buddy keeps

    def _init_replicas(self, every):
        self.replica = int(every)      # 0: none; 1: every round, current; K: every K rounds
        self.replicas = {}         # (key, offset, length) -> {round: (state, count)}
        self.lost_servers = set()
        self._replica_out = {}     # request id -> (key, offset, round)
        self._replica_ids = 0
        self.replica_bytes = 0     # state bytes sent to the buddy
        if self.replica == 1:
            self.policy = Replicated(self.policy)

    def buddy(self):
        """The next server after this one (in rank order, cyclic) that is not lost."""
        n = self.num_servers or 0
        for i in range(1, n):
            r = (self.rank + i) % n
            if r not in self.lost_servers:
                return r
        return None

    def _after_round(self, slot):
        """Slot ``slot`` applied a round: its state to the buddy."""
        if self.replica and slot.applied % self.replica == 0:
            self._replicate(slot)

    def _replicate(self, slot):
        to = self.buddy()
        if to is None or self.updater is None:
            slot.replicated = slot.applied      # nobody to keep it: pulls need not wait
            return
        body = {"key": slot.key, "offset": slot.offset, "length": slot.length,
                "applied": slot.applied}
        state = slot.store.cut_state(self.updater, slot.index, 0, slot.length)
        if state is not None:
            body["state"] = state
            self.replica_bytes += sum(x.nbytes for x in state) if isinstance(
                state, (tuple, list)) else state.nbytes
        count = update_counts(self.updater.optimizer).get(slot.index)
        if count is not None:
            body["count"] = count
        self._replica_ids += 1
        self._replica_out[self._replica_ids] = (slot.key, slot.offset, slot.applied)
        h = wire.Header(MsgType.REPLICA, key=slot.key, sender=self.rank,
                        iteration=slot.applied, offset=slot.offset, length=slot.length,
                        request_id=self._replica_ids, plan_version=self.plan_version)
        self._out.append(Out(Out.PEER, to, h, typed.pack(body)))

    def _on_replica(self, client, h, payload):
        """REPLICA from the server whose buddy this one is: keep the last rounds."""
        body = read_replica(h, payload)
        kept = self.replicas.setdefault((body["key"], body["offset"], body["length"]), {})
        kept[body["applied"]] = (body.get("state"), body.get("count"))
        for r in sorted(kept)[:-self.KEEP]:
            del kept[r]
        self._reply(client, h, MsgType.ACK, length=0)

    def _on_replica_reply(self, server_rank, h):
        """The buddy's ACK: the round's pulls may be answered.  True if it was one."""
        got = self._replica_out.get(h.request_id) if h.type in (MsgType.ACK,
                                                                 MsgType.ERROR) else None
        if got is None or h.key != got[0] or h.offset != got[1]:
            return False
        del self._replica_out[h.request_id]
        if h.type == MsgType.ERROR:
            raise RequestError("server %d refused the replica of key %d [%d, ...) round %d"
                               % (server_rank, *got))
        slot = self.slots.get((got[0], got[1]))
        if slot is not None and got[2] > slot.replicated:
            slot.replicated = got[2]
            self._answer_waiting(slot)
        return True

    def replica_of(self, key, offset, length, round_):
        """(state, update count, rounds it is behind ``round_``) the buddy keeps of a slice:
        after ``round_`` itself, or (a lazy replica) the newest round before it; or None."""
        kept = self.replicas.get((key, offset, length), {})
        if round_ in kept:
            return kept[round_] + (0,)
        older = [r for r in kept if r < round_]
        if self.replica > 1 and older:
            return kept[max(older)] + (round_ - max(older),)
        return None

    def _prune_replicas(self, old, new):
        """A plan from ``old`` to ``new``: keep the replicas of the slices of either table (a
        move a lost server interrupts is rolled back to ``old``), forget the others."""
        keep = {(k, x.offset, x.length) for t in (old, new) for k, xs in t.items() for x in xs}
        for part in [p for p in self.replicas if p[0] in new and p not in keep]:
            del self.replicas[part]

    def _lost(self, lost):
        """A failover plan left ``lost`` behind: if the buddy was among them, every slice goes
        to the new one now (what was on its way to the lost one never arrives)."""
        before = self.buddy()
        self.lost_servers |= set(lost)
        if self.replica and self.buddy() != before:
            self._replica_out.clear()
            for slot in list(self.slots.values()):
                self._replicate(slot)
                self._answer_waiting(slot)     # with no buddy left, pulls wait no more
