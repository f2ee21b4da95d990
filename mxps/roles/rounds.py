"""A server's rounds: a slice (``Slot``), one round's sum (``Round``), and the seam that decides
which round a push goes into and when a round completes (the round policies).

``ServerState`` runs every round the same way: a push is placed in a round by the policy
(``place``), summed into it, and rounds complete in order once the policy says so (``ready``);
a completed round is applied by the slice's store and the pulls waiting for it are answered
(``pull_ready``).  The policies:

- ``Bsp``: a round completes with all W workers' pushes (an LTP round when Early Close closed
  it: ``Round.complete``); a pull of round r waits for round r.
- ``Wsp`` (MXPS_MODE=wsp, docs/WSP.md): a round completes with k of W workers within the
  staleness bound, scaled to a full round; a late worker's push folds into a later round.
- ``Async`` (dist_async): every push is a round of its own, applied on arrival; pulls never
  wait.
"""
from ..ltp import close as ltp_close
from . import wsp as wsp_rules
from .optimizer_states import optimizer_index
from .server_requests import RequestError


class Round:
    __slots__ = ("acc", "acc_nd", "senders", "ltp", "closed", "frozen", "wake", "parts",
                 "scale", "pushes", "rescaled")

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
        self.rescaled = False     # WSP + LTP: the filling scaled each packet to W already

    def complete(self, num_workers):
        return self.closed if self.ltp is not None else len(self.senders) >= num_workers


class Slot:
    """This server's slice of one key: where it is, its rounds, and its numbers (``store``: a
    ``store.memory.MemorySlice`` or ``store.disk.DiskSlice``)."""

    __slots__ = ("key", "offset", "length", "dtype_code", "store", "applied", "rounds",
                 "waiting", "index", "spans", "wsp", "cols", "since", "replicated")

    def __init__(self, key, offset, length, dtype_code, store):
        self.key = key
        self.index = optimizer_index(key, offset)
        self.offset = offset
        self.length = length
        self.dtype_code = dtype_code
        self.store = store
        self.applied = 0                # rounds completed
        self.rounds = {}                # round -> Round
        self.waiting = []               # (client, header, RowSet or None) pulls waiting for
                                        # a later round (RowSet: a PULL_ROWS)
        self.spans = ltp_close.Deadline()           # LTP: recent rounds' spans, backoff
        self.wsp = None                 # MXPS_MODE=wsp: the slice's wsp.SliceWsp
        self.cols = 0                   # the key's row width (INIT), 0: unknown
        self.since = 0                  # the plan version that placed the slice here
        self.replicated = 0             # MXPS_REPLICA: the last round the buddy holds


class Bsp:
    """Bulk-synchronous rounds: all W workers' pushes, or Early Close for an LTP round."""

    #: replies of round r may be served from the weights themselves: round r + 1 completes
    #: only once every worker pushed it, after its pull of round r was answered
    copies = False
    #: every slice of a server has applied the same rounds when any round-r+1 push arrives
    #: (store.checkpoints)
    consistent = True
    #: answering a pull can let a round complete
    pulls_release = False
    #: a push needs the optimizer on the servers
    needs_optimizer = False

    def __init__(self, num_workers):
        self.num_workers = num_workers

    def place(self, slot, h):
        if h.iteration <= slot.applied:
            raise RequestError("key %d: worker %d pushed round %d, but round %d is already "
                               "complete" % (h.key, h.sender, h.iteration, slot.applied))
        rnd = slot.rounds.get(h.iteration)
        if rnd is not None and h.sender in rnd.senders:
            raise RequestError("key %d: worker %d pushed round %d twice"
                               % (h.key, h.sender, h.iteration))
        return h.iteration

    def ready(self, slot, r, rnd):
        return rnd.complete(self.num_workers)

    def completing(self, rnd):
        pass

    def pull_ready(self, slot, h):
        return h.iteration <= slot.applied

    def answered(self, slot, h):
        pass

    def moved(self, slot):
        pass

    # -- LTP rounds (roles.ltp_intake) --------------------------------------------------------
    #: Early Close decides over the workers in the round only (WSP), not over all W
    ltp_participants_only = False

    def packet_round(self, slot, worker, label, now):
        """The round an LTP packet of ``worker``'s push ``label`` goes into."""
        return label

    def ltp_may_close(self, slot, r, rnd, participants):
        """Whether an LTP round whose packets Early Close would close may close now."""
        return True


class Async(Bsp):
    """dist_async: every push is a round of its own, applied at once; pulls never wait."""

    copies = True           # a push may change the weights while a reply reads them
    consistent = False
    needs_optimizer = True  # the sum of one push is no value to serve

    def place(self, slot, h):
        return slot.applied + 1

    def ready(self, slot, r, rnd):
        return True

    def pull_ready(self, slot, h):
        return True


class Wsp:
    """WSP rounds (docs/WSP.md): ``settings`` (``server_settings.WspSettings``: k, the
    staleness bound, the clock), the workers that left (``gone``, shared with the state) and
    the state's ``wsp_stats`` counter."""

    copies = True
    consistent = False
    pulls_release = True    # a worker's newer value can lift the staleness bound
    needs_optimizer = False

    def __init__(self, settings, num_workers, gone, stats):
        self.settings = settings
        self.num_workers = num_workers
        self.gone = gone
        self.stats = stats

    def _now(self):
        clock = self.settings.clock
        return clock() if clock else None

    def of(self, slot):
        if slot.wsp is None:
            slot.wsp = wsp_rules.SliceWsp(self.num_workers)
        return slot.wsp

    def place(self, slot, h):
        """The round ``wsp.SliceWsp.place`` gives a push: the round it was computed for, or a
        later one if that completed without it."""
        try:
            r = self.of(slot).place(h.sender, h.iteration, slot.applied, self._now())
        except ValueError as e:
            raise RequestError("key %d: worker %d %s" % (h.key, h.sender, e)) from None
        if r != h.iteration:
            self.stats["folded"] += 1
        return r

    def ready(self, slot, r, rnd):
        """Whether round ``r`` may complete now (``wsp.may_complete``); an LTP round once
        it closed (``ltp_may_close`` let it)."""
        if rnd.ltp is not None:
            return rnd.closed
        return bool(rnd.senders) and self._may_complete(slot, r, rnd.senders)

    def _may_complete(self, slot, r, contributors):
        """WSP's rule for round ``r`` with these contributors: k of them within the staleness
        bound, or, before a re-plan point, every worker's own push."""
        ws = self.of(slot)
        if wsp_rules.before_point(r, self.settings.replan_every):
            return all(ws.latest[w] >= r for w in range(self.num_workers)
                       if w not in self.gone)
        k = self.settings.k
        if k <= 0:
            active = [w for w in range(self.num_workers) if w not in self.gone]
            times = ws.intervals()
            k = wsp_rules.choose_k([times[w] for w in active])
        return wsp_rules.may_complete(r, contributors, ws.base, min(k, self.num_workers),
                                      self.settings.staleness, self.gone)

    def moved(self, slot):
        """A slice a re-plan built here (``migration``), at a point where every worker is at
        round ``slot.applied``."""
        slot.wsp = wsp_rules.SliceWsp.settled(self.num_workers, slot.applied)

    # -- LTP rounds (MXPS_PUSH=ltp; docs/WSP.md) ----------------------------------------------
    ltp_participants_only = True

    def packet_round(self, slot, worker, label, now):
        """A push's packets go into one round, chosen at its first packet as a TCP push's is
        (``wsp.SliceWsp.place``), but never a round that already holds a push of the same
        worker (an LTP round counts one part per worker): then the next one.  Raises
        ValueError for a packet of a push older than the worker's last (its round is gone)."""
        ws = self.of(slot)
        if worker < 0 or worker >= self.num_workers:
            raise ValueError("no worker %d" % worker)
        r = ws.placed[worker].get(label) if label <= ws.latest[worker] else None
        if r is not None:
            return r
        r = ws.place(worker, label, slot.applied, now)
        while True:
            rnd = slot.rounds.get(r)
            if rnd is None or not (worker in rnd.senders or rnd.ltp is not None and
                                   rnd.ltp.heard[worker] is not None):
                break
            r += 1
        ws.placed[worker][label] = r
        if r != label:
            self.stats["folded"] += 1
        return r

    def ltp_may_close(self, slot, r, rnd, participants):
        """The round's participants (the workers whose packets are in it) are a round WSP
        may complete (``ready``'s rule with them as the contributors)."""
        return self._may_complete(slot, r, set(participants))

    def completing(self, rnd):
        """A round of n gradients is scaled to the expected sum of a full one."""
        n = rnd.pushes
        self.stats["rounds"] += 1
        self.stats["contributions"] += n
        if n != self.num_workers and not rnd.rescaled:
            rnd.scale = wsp_rules.scale(self.num_workers, n)
            if rnd.parts is None:
                rnd.acc *= rnd.acc.dtype.type(rnd.scale)

    def pull_ready(self, slot, h):
        """The round the worker's push of that label went into is complete."""
        r = self.of(slot).pull_round(h.sender, h.iteration)
        return r is not None and r <= slot.applied

    def answered(self, slot, h):
        if 0 <= h.sender < self.num_workers:
            self.of(slot).received(h.sender, slot.applied, self._now())
