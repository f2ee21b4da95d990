"""Adaptive placement: split the keys over the servers in proportion to their rates, and
decide live when a new split pays off.  Pure functions and one small class; no sockets, clocks
or MXNet.

Model.  Server ``s`` holds ``bytes_s`` bytes of the model and gets through them at ``b_s``
bytes/s ("held bytes per second of a step": every worker pushes and pulls each held byte), so
its communication time per step is ``bytes_s / b_s`` and a synchronous step waits for the
slowest server: the *makespan* ``max_s bytes_s / b_s`` (``makespan``).  No placement beats
``total_bytes / sum(b)``, reached when each server holds its share ``b_s / sum(b)``.

Proposal (``split_table``).  ``plan.ProportionalRule``: every key of at least ``2 * min_slice``
elements is cut over all servers in proportion to what each lacks of its share, smaller keys go
whole to the server furthest below its share; with ``max_chunk`` each server's part is cut
further into chunks (one chunk's pull overlaps the next one's push).  Cutting every large key
over every server spreads each server's traffic over the whole step, so the step waits for no
single server's queue of whole keys, and each server's measured rate reflects its link.

Decision (``Replanner``, the scheduler's side).  Rates are estimated from the workers' training
traffic (all workers' bytes through a server over the slowest worker's busy span, median of the
last rounds, rounds before a change of a link forgotten); a proposal is adopted when its
modelled gain per step beats ``min_gain`` of the current makespan and, over a horizon of steps,
the time to move the state that changes server (``replan_gain``).  See docs/REPLAN.md.
"""
import logging
import math

from .plan import PlanError, ProportionalRule, Slice, check_slices

log = logging.getLogger("mxps")

DEFAULT_MIN_SLICE = 16384               # elements: 64 KB of float32


# --- inputs ---------------------------------------------------------------------------------

def _check_bandwidths(bandwidths):
    b = [float(x) for x in bandwidths]
    if not b:
        raise ValueError("no server bandwidths given: need one positive rate per server")
    for s, x in enumerate(b):
        if not (x > 0 and math.isfinite(x)):
            raise ValueError("server %d has bandwidth %r: every bandwidth must be a positive, "
                             "finite number of bytes/s" % (s, bandwidths[s]))
    return b


# --- measures -------------------------------------------------------------------------------

def bytes_per_server(table, num_servers, itemsize=4):
    """Bytes each server holds under ``table``."""
    out = [0] * num_servers
    for key, slices in table.items():
        for s in slices:
            if not 0 <= s.server < num_servers:
                raise PlanError("key %r: slice on server %d, only %d servers"
                                % (key, s.server, num_servers))
            out[s.server] += s.length * itemsize
    return out


def makespan(table, key_sizes, bandwidths, itemsize=4):
    """``max_s bytes_s / b_s``: the slowest server's time for the bytes it holds.

    Raises:
        PlanError: ``table`` misses a key of ``key_sizes`` or places a different size.
    """
    b = _check_bandwidths(bandwidths)
    for key, n in key_sizes.items():
        slices = table.get(key)
        if slices is None:
            raise PlanError("key %r (%d elements) is not in the table" % (key, n))
        placed = sum(s.length for s in slices)
        if placed != n:
            raise PlanError("key %r has %d elements, the table places %d" % (key, n, placed))
    loads = bytes_per_server({k: table[k] for k in key_sizes}, len(b), itemsize)
    return max(x / r for x, r in zip(loads, b))


def moved_bytes(old_table, new_table, itemsize=4):
    """Bytes whose server differs between the two tables (keys in both; a key in only one of
    them has nothing to move).

    Raises:
        PlanError: a key has different sizes in the two tables.
    """
    moved = 0
    for key, new in new_table.items():
        old = old_table.get(key)
        if old is None:
            continue
        old = sorted(old, key=lambda s: s.offset)
        new = sorted(new, key=lambda s: s.offset)
        n_old = sum(s.length for s in old)
        n_new = sum(s.length for s in new)
        if n_old != n_new:
            raise PlanError("key %r has %d elements in the old table and %d in the new one"
                            % (key, n_old, n_new))
        i = j = 0
        while i < len(old) and j < len(new):
            lo = max(old[i].offset, new[j].offset)
            hi = min(old[i].stop, new[j].stop)
            if hi > lo and old[i].server != new[j].server:
                moved += hi - lo
            if old[i].stop <= new[j].stop:
                i += 1
            else:
                j += 1
    return moved * itemsize


def check_table(table, key_sizes, num_servers, min_slice=DEFAULT_MIN_SLICE):
    """Raise PlanError unless ``table`` places exactly the keys of ``key_sizes`` by the rules:
    ``check_slices`` for each key, and a key cut in several slices has every slice of at least
    ``min_slice`` elements (so a key under ``2 * min_slice`` elements is whole)."""
    extra = set(table) - set(key_sizes)
    if extra:
        raise PlanError("the table places keys %s that have no size" % sorted(extra)[:5])
    for key, n in key_sizes.items():
        slices = table.get(key)
        if slices is None:
            raise PlanError("key %r (%d elements) is not in the table" % (key, n))
        slices = tuple(slices)
        check_slices(key, n, slices, num_servers)
        if len(slices) > 1:
            short = [s for s in slices if s.length < min_slice]
            if short:
                raise PlanError("key %r is cut into a slice of %d elements, under min_slice=%d"
                                % (key, short[0].length, min_slice))


# --- hysteresis -----------------------------------------------------------------------------

def replan_gain(previous, proposal, bandwidths, move_cost_s_per_byte, itemsize=4,
                state_copies=2):
    """``(gain_s_per_step, move_cost_s)`` of switching from ``previous`` to ``proposal``.

    gain: ``makespan(previous) - makespan(proposal)`` (the key sizes are read off
    ``proposal``); move cost: ``moved_bytes * state_copies * move_cost_s_per_byte``, where
    ``state_copies`` counts the weights plus the optimizer state per weight (2 for SGD with
    momentum, 3 for Adam).

    Raises:
        PlanError: ``previous`` does not place the keys of ``proposal`` with the same sizes.
    """
    if move_cost_s_per_byte < 0 or state_copies < 0:
        raise ValueError("move_cost_s_per_byte (%r) and state_copies (%r) must be >= 0"
                         % (move_cost_s_per_byte, state_copies))
    sizes = {k: sum(s.length for s in v) for k, v in proposal.items()}
    gain = (makespan(previous, sizes, bandwidths, itemsize)
            - makespan(proposal, sizes, bandwidths, itemsize))
    cost = moved_bytes(previous, proposal, itemsize) * state_copies * move_cost_s_per_byte
    return gain, cost


# --- live re-planning -----------------------------------------------------------------------

def split_table(keys, bandwidths, min_slice=DEFAULT_MIN_SLICE, max_chunk=0):
    """The table ``ProportionalRule`` builds for ``keys`` (``[(key, elements), ...]`` in the
    order the workers initialised them) with these bandwidths: every key of at least
    ``2 * min_slice`` elements cut over the servers in proportion to what each lacks of its
    share, smaller keys whole on the server furthest below its share.

    This is the live re-planner's proposal: every large key over all servers (a key's push
    and pull then go to every server at once, so each server's traffic is spread over the
    whole step and its measured rate reflects its link rather than when its keys' gradients
    happen to be ready).

    With ``max_chunk`` each server's part of a key is cut further into chunks of at most that
    many elements (``ProportionalRule``), so that the table may hold several consecutive slices
    of a key on one server.
    """
    b = _check_bandwidths(bandwidths)
    rule = ProportionalRule(b, min_slice, max_chunk)
    return {key: rule(key, n, len(b), None) for key, n in keys}


def forced_table(keys, num_servers, version, min_slice=DEFAULT_MIN_SLICE, max_chunk=0):
    """A table that differs from the one of ``version - 1`` (for tests of live re-planning):
    a split by pseudo-random bandwidths drawn from ``version`` (so cut points change), its
    servers rotated so that the first element of the first non-empty key sits on server
    ``version % num_servers`` (so with two servers or more, something moves every version)."""
    import random
    rng = random.Random(version)
    table = split_table(keys, [rng.uniform(1.0, 4.0) for _ in range(num_servers)], min_slice,
                        max_chunk)
    first = next((table[k][0].server for k, n in keys if n > 0), 0)
    shift = (version - first) % num_servers
    return {k: tuple(Slice((s.server + shift) % num_servers, s.offset, s.length)
                     for s in slices) for k, slices in table.items()}


class Replanner:
    """The scheduler's side of live re-planning: estimate each server's rate from the workers'
    training traffic, and decide at each re-plan point whether a new table pays off.

    ``observe`` takes, per worker, ``{round: per server [bytes, busy seconds]}`` (what a worker
    moved through each server in a round, and from its first request to its last reply).  A
    round's rate of a server is the bytes all workers moved through it over the slowest
    worker's busy span (as the start-up probe); rounds where a server moved under 64 KB are
    not timed.  The estimate is the median of the last ``window`` timed rounds (one noisy
    round cannot move it); one round beyond 2x of the estimate before it (``JUMP``), or two
    rounds in a row beyond 1.5x of the round before them on the same side (``DRIFT``), are a
    change of the link: the rounds before the change are forgotten, so the estimate is the
    new rounds', not a median half made of the old network; a server whose link got faster
    is taken as fast as the median of the others (under-used, it would measure its small
    share's throughput).  Until a server is timed it keeps its start-up
    probe rate (``rates``), or the lowest known rate.

    ``decide`` proposes ``split_table`` with the estimated rates and adopts it when the
    modelled gain per step exceeds ``min_gain`` of the current plan's makespan and, over
    ``horizon`` steps, the time to move the state (``replan_gain``: the bytes that change
    server, times the copies a move sends per weight, over half the slowest rate: a server's
    rate counts both directions).  The copies are measured (``moved``: what the servers sent
    for the last move over the bytes that changed server): 1 for the weights, one more per
    optimizer state array (1 with the update on the workers); 3 until the first move
    (weights and Adam's two states, the most there is).
    """

    #: copies per weight a move sends, until one was measured
    COPIES = 3.0

    MIN_BYTES = 64 * 1024

    def __init__(self, num_servers, num_workers, rates=None, window=3, one_round=True):
        import collections
        # one_round=False: a change needs two rounds (DRIFT) and the changed round is not
        # measured by its second half (the earlier rule; kept for ablations)
        self.jump = self.JUMP if one_round else math.inf
        self.num_servers = num_servers
        self.num_workers = num_workers
        self.rates = list(rates) if rates else None
        self.window = collections.deque(maxlen=window)
        self.recent = collections.deque(maxlen=3)     # the estimates of the last points
        self.last = None        # (makespan before, after, move cost, adopted) of the last decide
        self.copies = self.COPIES

    def moved(self, planned, sent):
        """A move is in place: ``planned`` bytes of weights changed server, the servers sent
        ``sent`` bytes for them (values and optimizer state)."""
        if planned > 0:
            self.copies = sent / float(planned)

    def diverted(self, server, ratio):
        """Server ``server``'s link slowed to ``ratio`` of its rate of the last rounds inside a
        round, and its slices left it (MXPS_DIVERT): plan with that rate from now on (it holds
        nothing to be timed by until a plan gives it a share).  The rate of the last rounds
        is the highest estimate of the last three points (a point may have seen the change's
        first half already and lowered it)."""
        if not self.rates:
            return
        before = max([r[server] for r in self.recent if r and r[server]] or
                     [self.rates[server]])
        self.rates[server] = min(self.rates[server], before * max(ratio, 0.01))
        self.window.clear()
        self.window.append(list(self.rates))

    def observe(self, reports):
        per_round = {}
        for rep in reports:
            for r, per in rep.items():
                per_round.setdefault(int(r), []).append(per)
        for r in sorted(per_round):
            per = per_round[r]
            if len(per) != len(reports):
                continue            # not every worker reported this round
            rates, tails = [], []
            for s in range(self.num_servers):
                nbytes = sum(p[s][0] for p in per)
                span = max(p[s][1] for p in per)
                rates.append(nbytes / span if nbytes >= self.MIN_BYTES and span > 0 else None)
                tb = sum(p[s][2] for p in per if len(p[s]) > 2)
                ts = max((p[s][3] for p in per if len(p[s]) > 2), default=0.0)
                tails.append(tb / ts if tb >= self.MIN_BYTES / 2 and ts > 0 else None)
            self.window.append(rates)
            self._forget_before_a_change(tails)
        est = list(self.rates) if self.rates else [None] * self.num_servers
        for s in range(self.num_servers):
            xs = sorted(w[s] for w in self.window if w[s] is not None)
            if xs:
                m = len(xs) // 2
                est[s] = xs[m] if len(xs) % 2 else 0.5 * (xs[m - 1] + xs[m])
        known = [x for x in est if x]
        if known:
            self.rates = [x if x else min(known) for x in est]
            self.recent.append(list(self.rates))
        return self.rates

    #: one round this far off the estimate before it is a change of the link, at once
    JUMP = 2.0
    #: two rounds in a row this far off the round before them are a change too
    DRIFT = 1.5

    def _forget_before_a_change(self, tails=None):
        """Keep in the window only the rounds of the network as it is now.

        A link that moves in the middle of a round makes that round partly slow (or fast):
        a 4x drop half-way through a round makes it ~2.5x slower, one late in the round
        ~1.3x.  So: the newest round this far off the estimate before it (``JUMP``, the
        median of the older rounds) is a change on its own, and the next round plans with it
        (waiting for a second round cost every move one more step at the old, wrong plan:
        measured, 4-6 s steps for every move of a link; docs/REPLAN.md); a smaller drift
        (``DRIFT``) needs two rounds in a row, so noise of one round moves nothing.  After a
        change the rounds before it are forgotten, and a server that changed in the newest
        round is taken at the rate of that round's second half (``tails``, see
        ``metrics.tail_of``) if that is further from the old estimate: a link that moved
        mid-round shows its new rate there, and planning with the whole round's mixed rate
        would need a second move one round later."""
        w = self.window
        if len(w) < 2:
            return
        b = w[-1]
        ref = []                # per server: the estimate before the newest round
        for s in range(self.num_servers):
            xs = sorted(x[s] for x in list(w)[:-1] if x[s] is not None)
            ref.append(xs[len(xs) // 2] if xs else None)

        def off(x, y, factor):
            return None not in (x, y) and (y > factor * x or y * factor < x)
        jumped = [s for s in range(self.num_servers) if off(ref[s], b[s], self.jump)]
        if jumped:
            keep = 1
            for s in jumped:
                t = tails[s] if tails else None
                if t is not None and (t < b[s] if b[s] < ref[s] else t > b[s]):
                    b[s] = t
        elif len(w) >= 3 and any(off(w[-3][s], w[-2][s], self.DRIFT) and
                                 off(w[-3][s], b[s], self.DRIFT) and
                                 (w[-2][s] > w[-3][s]) == (b[s] > w[-3][s])
                                 for s in range(self.num_servers)):
            keep, ref = 2, list(w[-3])
        else:
            return
        for _ in range(len(w) - keep):
            w.popleft()
        # A server whose link got faster still holds the small share of its slow days, and a
        # server with little to do measures its throughput, not its link (module docstring):
        # it would climb back one re-plan at a time.  Take it as fast as the median of the
        # other servers instead, if it now measures at least a third of that (a server
        # still far below the others is taken as measured: a share grown after a re-plan
        # also raises a slow server's throughput, and must not pass for a faster link); if
        # it is slower than that, its next (loaded) rounds say so.  The latest round decides.
        for s in range(self.num_servers):
            if None in (ref[s], b[s]) or b[s] <= self.DRIFT * ref[s]:
                continue
            for r in list(w):
                others = sorted(x for i, x in enumerate(r) if i != s and x is not None)
                if others and r[s] is not None and r[s] * 3 >= others[len(others) // 2]:
                    r[s] = max(r[s], others[len(others) // 2])

    def _evaluate(self, keys, old, min_slice, min_gain, horizon, max_chunk):
        """(proposal, adopt?, makespan before, gain, move cost), or None if nothing to weigh."""
        if not self.rates or not keys:
            return None
        # held bytes per second: every worker pushes and pulls every byte a server holds
        b = [r / (2.0 * self.num_workers) for r in self.rates]
        proposal = split_table(keys, b, min_slice, max_chunk)
        if proposal == {k: tuple(old[k]) for k in proposal if k in old}:
            return None
        try:
            before = makespan(old, dict(keys), b)
        except PlanError:
            return None         # the old table does not place these keys: keep it
        gain, cost = replan_gain(old, proposal, b, 2.0 / min(self.rates), 4, self.copies)
        ok = gain > min_gain * before and gain * horizon > cost
        return proposal, ok, before, gain, cost

    def decide(self, keys, old, version, round_=0, min_slice=DEFAULT_MIN_SLICE, force=False,
               min_gain=0.05, horizon=20, max_chunk=0):
        """The table to switch to at this point, or None to keep ``old``.  ``keys``:
        ``[(key, elements), ...]`` in initialisation order; ``version``: the new plan's."""
        if force:
            log.info("re-plan %d at round %d (forced)", version, round_)
            return forced_table(keys, self.num_servers, version, min_slice, max_chunk)
        ev = self._evaluate(keys, old, min_slice, min_gain, horizon, max_chunk)
        if ev is None:
            return None
        proposal, ok, before, gain, cost = ev
        self.last = (before, before - gain, cost, ok)
        log.info("round %d: rates (MB/s) %s; makespan %.3f s -> %.3f s, moving costs %.3f s: %s",
                 round_, " ".join("%.1f" % (r / 1e6) for r in self.rates), before,
                 before - gain, cost, "re-plan %d" % version if ok else "keep")
        return proposal if ok else None

    def suspects_change(self, factor=1.3):
        """The last timed round put some server beyond ``factor`` of the round before it: what
        the first half of a change looks like (``_forget_before_a_change`` needs one round
        beyond 2x or two beyond 1.5x; the lower factor here errs on the side of looking once
        more)."""
        if len(self.window) < 2:
            return False
        a, b = self.window[-2], self.window[-1]
        return any(x is not None and y is not None and (y > factor * x or y * factor < x)
                   for x, y in zip(a, b))

    def wants_point(self, keys, old, min_slice=DEFAULT_MIN_SLICE, min_gain=0.05, horizon=20,
                    max_chunk=0):
        """Whether the next re-plan point must be a full one (every worker stopped, nothing in
        flight) because it may switch plans: a change of a link is suspected, or ``decide``
        would adopt a new table on the present estimates.  Otherwise a point is a light one:
        workers report and go on (docs/REPLAN.md)."""
        if self.suspects_change():
            return True
        ev = self._evaluate(keys, old, min_slice, min_gain, horizon, max_chunk)
        return ev is not None and ev[1]
