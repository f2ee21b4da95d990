"""Adaptive placement: spread the keys over the servers in proportion to their bandwidths.

A pure function of (key sizes, server bandwidths, previous table); no sockets, no clocks.  Its
output is a table ``{key: (Slice, ...)}`` for ``mxps.plan.Plan(num_servers, version, table)``.

Model
-----
Server ``s`` holds ``bytes_s`` bytes and gets through them at ``b_s`` bytes/s (the bandwidth
estimator's unit: every worker pushes and pulls each held byte, so ``b_s`` is "held bytes per
second of a step"), so its communication time per step is ``bytes_s / b_s`` and the step waits
for the slowest server: the *makespan* ``max_s bytes_s / b_s``.  No placement beats the
*proportional bound* ``T = total_bytes / sum(b)`` (``lower_bound``), reached when server ``s``
holds exactly its *target* ``t_s = T * b_s``.

Rules a plan must follow (``check_table``): every element of every key on exactly one server;
a key's slices are contiguous and in order, at most one per server (a server runs the optimizer
once per key); a key is cut only into slices of at least ``min_slice`` elements, so a key of
fewer than ``2 * min_slice`` elements (*unsplittable*) is always whole.

Algorithm (``proportional_plan``)
---------------------------------
1. Unsplittable keys, largest first (ties by key id), go whole: to the server that held them
   in the previous plan if it still has room (its load stays within its target ``t_s``),
   otherwise to the server where they would finish earliest, ``min (load_s + n) / b_s``
   (LPT for machines of different speeds).  Few, large slices: small keys are never cut.
2. The remaining room ``r_s = t_s - load_s`` of the servers that have any is laid end to end
   in server order, the splittable keys end to end beside it (largest first, ties by key id),
   and each server takes what lies against its room.  Each boundary ``C_j`` (cumulative room)
   is rounded *down* to the nearest admissible cut: a key boundary, or a point inside a key at
   least ``min_slice`` from both of its ends and from an earlier cut in the same key.  A key
   thus visits servers in a fixed order, at most once each; at most ``#servers - 1`` keys are
   cut, so the table has at most ``#keys + #servers - 1`` slices, every cut slice >= min_slice.
3. Candidates from scratch: the plan from 1-2, a *spread* plan (step 1, then each splittable
   key, largest first, shared out over the servers with room in proportion to it, shares under
   ``min_slice`` dropped) and MXNet's own placement (if it fits the rules).  Without a previous
   table the smallest makespan wins (the first listed on a tie).  With one, the *budget* is the
   guarantee below, lowered to MXNet's makespan and to ``1 + slack`` (default 1%) times the
   from-scratch winner's if those are smaller, and more candidates join: the previous table
   itself (if it still fits the keys and the rules), a *stay-put* plan (like spread, but each
   key keeps its previous servers in their order while they have room, and a key that fits
   whole on its one previous server stays) and the plan from 1-2 with small keys kept in
   place.  Among all candidates within budget the one moving the fewest bytes wins, then the
   smaller makespan.  Deterministic; ``proportional_plan(k, b, previous=proportional_plan(k,
   b)) == proportional_plan(k, b)`` (the previous table is within budget and moves nothing).

Why this and not an exact solver: the problem contains PARTITION (NP-hard), but the large keys
are divisible almost anywhere, so filling the rooms with them is within one cut of perfect, and
the small keys only need a scheduling rule with an additive bound; both run in
O(K log K + K S).  The MXNet candidate makes "never worse than MXNet's placement" a theorem
rather than a hope (with few small keys and equal bandwidths a hash can be lucky, and no
polynomial rule beats every lucky hash); the spread candidate wins when the cut rounding of
step 2 bites (tiny bins, keys barely over ``2 * min_slice``).

Guarantee (tested in tests/test_adaptive_plan.py)
-------------------------------------------------
Let ``U = max_k min(n_k, 2*min_slice - 1)`` elements (``granularity``): the largest
unsplittable unit, a whole small key or a cut-rounding step.  Then

    makespan(plan) < T + U * itemsize / min_s b_s          (``guaranteed_makespan``)

Proof.  Step 1: when a key of ``n`` elements is placed, some server ``s*`` has room
``r > 0`` (the rooms sum to the unplaced bytes); the previous server is kept only if it stays
within its target; otherwise the chosen server finishes no later than ``s*`` would,
``(t_s* - r + n) / b_s* < T + n / b_s*``.  Step 2 (integers; ``m = min_slice``, large keys
have ``n >= 2m``): let ``x = floor(C_j)`` lie inside a key ``[a, e)`` and ``p <= x`` be the
previous cut.  If ``x < a + m`` or ``x < p + m`` the cut is ``max(a, p) >= x - m + 1``.  Else,
if the admissible stretch ``[max(a, p) + m, e - m]`` is not empty, the cut is
``min(x, e - m) >= x - m + 1``; if it is empty, ``p`` is inside the key with ``p >= e - 2m + 1``
and the cut is ``p >= x - 2m + 2``.  So ``x - cut <= 2m - 2 = U - 1`` (a large key makes
``U = 2m - 1``) and
``cut_j > C_j - U``; server ``j`` gets ``cut_j - cut_{j-1} < C_j - C_{j-1} + U = r_j + U``
bytes of large keys (the last server's ``total - cut`` too, as the rooms sum to at least the
total), i.e. holds ``< t_j + U`` in all.  Servers without room get no large-key bytes.  Step 3
only returns a candidate within the budget, which is at most the bound.  []

Also: the result is never worse than MXNet's placement whenever that placement follows the
rules (always when ``min_slice <= bigarray_bound / #servers``).

Stability and hysteresis
------------------------
Given ``previous``, nothing moves while the previous table is within the budget ("costs
little" = within ``slack`` of the best candidate and within the guarantee, and no worse than
MXNet): a dead band against bandwidth noise, on top of ``should_replan``.
Otherwise the candidate moving the fewest bytes within budget is returned: small keys stay
where they were while their server has room; the proportional plan keeps its key order (a small
change of bandwidths moves its boundaries a little); the stay-put plan keeps each large key on
its previous servers (leaving MXNet's placement, where every key of 1M elements or more is
spread over all servers, it moves about 39% of resnet18's bytes instead of 72%).

Re-planning to the new table or not is ``should_replan``: the per-step gain
``makespan(previous) - makespan(proposal)`` times a horizon must beat the time to move the
state, ``moved_bytes * state_copies * s_per_byte``
(weights plus optimizer state: 2 copies for SGD with momentum, 3 for Adam).
"""
import bisect
import logging
import math

from .plan import PlanError, ProportionalRule, Slice, check_slices, mxnet_default_rule

log = logging.getLogger("mxps")

MXNET_BIGARRAY_BOUND = 1000 * 1000      # MXNET_KVSTORE_BIGARRAY_BOUND's default in 1.9.1
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


def _check_sizes(key_sizes):
    for key, n in key_sizes.items():
        if not isinstance(n, int) or n < 0:
            raise ValueError("key %r has size %r: sizes are element counts >= 0" % (key, n))


def _check_positive_int(name, value):
    if not isinstance(value, int) or value < 1:
        raise ValueError("%s must be a positive integer, got %r" % (name, value))


# --- measures -------------------------------------------------------------------------------

def granularity(key_sizes, min_slice=DEFAULT_MIN_SLICE):
    """The largest unsplittable unit, in elements: ``max_k min(n_k, 2*min_slice - 1)``."""
    _check_positive_int("min_slice", min_slice)
    return max((min(n, 2 * min_slice - 1) for n in key_sizes.values()), default=0)


def lower_bound(key_sizes, bandwidths, itemsize=4):
    """The proportional bound ``total_bytes / sum(b)``: no placement has a smaller makespan."""
    b = _check_bandwidths(bandwidths)
    _check_sizes(key_sizes)
    return sum(key_sizes.values()) * itemsize / sum(b)


def guaranteed_makespan(key_sizes, bandwidths, min_slice=DEFAULT_MIN_SLICE, itemsize=4):
    """What ``proportional_plan`` promises: ``lower_bound + granularity * itemsize / min(b)``.

    The makespan of its result is strictly below this (see the module docstring)."""
    b = _check_bandwidths(bandwidths)
    return (lower_bound(key_sizes, b, itemsize)
            + granularity(key_sizes, min_slice) * itemsize / min(b))


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


def default_table(key_sizes, num_servers, bigarray_bound=MXNET_BIGARRAY_BOUND):
    """MXNet 1.9.1's placement of every key (``mxnet_default_rule``)."""
    return {k: mxnet_default_rule(k, n, num_servers, bigarray_bound)
            for k, n in key_sizes.items()}


# --- the planner ----------------------------------------------------------------------------

def _whole_on(previous, key, n, num_servers):
    """The server that held the whole key ``key`` of ``n`` elements in ``previous``, or None."""
    if not previous:
        return None
    old = previous.get(key)
    if old is None or len(old) != 1:
        return None
    s = old[0]
    if s.offset != 0 or s.length != n or not 0 <= s.server < num_servers:
        return None
    return s.server


def _best_cut(x, p, starts, sizes, total, m):
    """The largest admissible cut in ``[p, x]`` given the previous cut ``p`` (see step 2)."""
    if x <= p:
        return p
    if x >= total:
        return total
    i = bisect.bisect_right(starts, x) - 1
    a = starts[i]
    if x == a:
        return x                            # a key boundary
    e = a + sizes[i]
    lo, hi = a + m, e - m
    if a < p:                               # p is a cut inside this key
        lo = max(lo, p + m)
    if lo <= hi and x >= lo:
        return min(x, hi)
    return max(a, p)


def _place_small(key_sizes, b, previous, min_slice, target):
    """Step 1: unsplittable keys whole; returns (table, load in elements)."""
    S = len(b)
    load = [0] * S
    table = {}
    small = sorted(((n, k) for k, n in key_sizes.items() if n < 2 * min_slice),
                   key=lambda nk: (-nk[0], nk[1]))
    for n, key in small:
        s = _whole_on(previous, key, n, S)
        if s is None or load[s] + n > target[s]:
            s = min(range(S), key=lambda i: ((load[i] + n) / b[i], i))
        load[s] += n
        table[key] = (Slice(s, 0, n),)
    return table, load


def _targets(key_sizes, b):
    total = sum(key_sizes.values())
    bsum = sum(b)
    return [total * r / bsum for r in b]            # elements


def _big_keys(key_sizes, min_slice):
    return sorted(((n, k) for k, n in key_sizes.items() if n >= 2 * min_slice),
                  key=lambda nk: (-nk[0], nk[1]))


def _construct(key_sizes, b, previous, min_slice):
    """Steps 1 and 2: the proportional plan (the one the guarantee is about)."""
    S = len(b)
    target = _targets(key_sizes, b)
    table, load = _place_small(key_sizes, b, previous, min_slice, target)
    big = _big_keys(key_sizes, min_slice)
    if not big:
        return table
    sizes = [n for n, _ in big]
    starts = []
    pos = 0
    for n in sizes:
        starts.append(pos)
        pos += n
    big_total = pos
    bins = [s for s in range(S) if target[s] - load[s] > 0]
    if not bins:                                    # float dust: everyone at target
        bins = [min(range(S), key=lambda i: (load[i] / b[i], i))]
    cuts = []
    p, c = 0, 0.0
    for s in bins[:-1]:
        c += target[s] - load[s]
        p = _best_cut(min(math.floor(c), big_total), p, starts, sizes, big_total, min_slice)
        cuts.append(p)
    cuts.append(big_total)

    j = 0                                           # first bin that may overlap key i
    lo_j = 0                                        # start of bin j
    for i, (n, key) in enumerate(big):
        a, e = starts[i], starts[i] + n
        while cuts[j] <= a:                         # bin j ends before the key starts
            lo_j = cuts[j]
            j += 1
        pieces = []
        jj, lo = j, lo_j
        while lo < e:
            hi = min(cuts[jj], e)
            start = max(lo, a)
            if hi > start:
                pieces.append(Slice(bins[jj], start - a, hi - start))
            lo = cuts[jj]
            jj += 1
        table[key] = tuple(pieces)
    return table


def _reshape(key_sizes, b, previous, min_slice):
    """The stay-put candidate: every splittable key keeps the servers (and their order) it had
    in ``previous`` as far as they have room, its cuts moved to share it in proportion to that
    room; a key that fits whole on its one previous server stays whole.  No bound of its own:
    it is used only when its makespan is within the guarantee (``proportional_plan``)."""
    S = len(b)
    target = _targets(key_sizes, b)
    table, load = _place_small(key_sizes, b, previous, min_slice, target)
    room = [t - x for t, x in zip(target, load)]
    order = []
    for n, key in _big_keys(key_sizes, min_slice):
        old = previous.get(key) if previous else None
        if old is not None and (sum(s.length for s in old) != n
                                or any(not 0 <= s.server < S for s in old)):
            old = None
        order.append((old is None or len(old) != 1, n, key, old))
    order.sort(key=lambda x: (x[0], -x[1], x[2]))
    for _, n, key, old in order:
        olds = [s.server for s in sorted(old, key=lambda s: s.offset)] if old else []
        if len(olds) == 1 and room[olds[0]] >= n:
            room[olds[0]] -= n
            table[key] = (Slice(olds[0], 0, n),)
            continue
        seq = [s for s in olds if room[s] > 0]
        if sum(room[s] for s in seq) < n:
            seq += [s for s in range(S) if room[s] > 0 and s not in seq]
        if not seq:
            seq = [max(range(S), key=lambda i: (room[i], -i))]
        while len(seq) > 1:                         # drop shares under min_slice
            r = sum(max(room[s], 0) for s in seq)
            want = [n * max(room[s], 0) / r for s in seq]
            low = min(range(len(seq)), key=lambda i: (want[i], -i))
            if want[low] >= min_slice + 1:
                break
            del seq[low]
        r = sum(max(room[s], 0) for s in seq) or 1.0
        pieces, pos, acc = [], 0, 0.0
        for i, s in enumerate(seq):
            acc += max(room[s], 0)
            stop = n if i == len(seq) - 1 else min(n, int(round(n * acc / r)))
            if stop > pos:
                pieces.append(Slice(s, pos, stop - pos))
                room[s] -= stop - pos
                pos = stop
        table[key] = tuple(pieces)
    return table


def proportional_plan(key_sizes, bandwidths, previous=None, min_slice=DEFAULT_MIN_SLICE,
                      itemsize=4, bigarray_bound=MXNET_BIGARRAY_BOUND, slack=0.01):
    """A table ``{key: (Slice, ...)}`` placing ``key_sizes`` (elements per key) on
    ``len(bandwidths)`` servers with makespan ``< guaranteed_makespan(...)``, by the rules of
    ``check_table``; see the module docstring for the algorithm and the proof.

    ``previous``: the table in force, if any; slices stay where they are when that costs
    little: a makespan within ``1 + slack`` of the best candidate's and within the guarantee
    (compare ``moved_bytes`` and ``should_replan`` before adopting the result).
    ``bigarray_bound``: MXNet's placement with this bound is a candidate (None: not tried).
    ``itemsize`` only scales bytes; the placement does not depend on it.

    Raises:
        ValueError: a bandwidth is not positive, a size is negative, min_slice < 1, slack < 0.
    """
    if not slack >= 0:
        raise ValueError("slack must be >= 0 (a fraction of the makespan), got %r" % (slack,))
    b = _check_bandwidths(bandwidths)
    _check_sizes(key_sizes)
    _check_positive_int("min_slice", min_slice)
    _check_positive_int("itemsize", itemsize)
    S = len(b)

    def score(candidates):
        out = []
        for name, table in candidates:
            if name != "proportional":          # the construction follows the rules by design
                try:
                    check_table(table, key_sizes, S, min_slice)
                except PlanError:
                    continue
            out.append((makespan(table, key_sizes, b, itemsize), name, table))
        return out

    # from scratch: the smallest makespan (the first listed on a tie)
    fresh = [("proportional", _construct(key_sizes, b, None, min_slice)),
             ("spread", _reshape(key_sizes, b, None, min_slice))]
    if bigarray_bound is not None:
        fresh.append(("mxnet", default_table(key_sizes, S, bigarray_bound)))
    fresh = score(fresh)
    span, _, name, table = min((x[0], i, x[1], x[2]) for i, x in enumerate(fresh))
    if previous is None:
        log.debug("adaptive plan: %s candidate, makespan %.6g s (bound %.6g s)",
                  name, span, lower_bound(key_sizes, b, itemsize))
        return table

    # with a previous table: the fewest moved bytes within budget
    budget = min([guaranteed_makespan(key_sizes, b, min_slice, itemsize), span * (1 + slack)]
                 + [x[0] for x in fresh if x[1] == "mxnet"])
    budget = max(budget, span)
    stay = score([("previous", {k: tuple(previous[k]) for k in key_sizes if k in previous}),
                  ("stay-put", _reshape(key_sizes, b, previous, min_slice)),
                  ("proportional", _construct(key_sizes, b, previous, min_slice))])
    moved, span, _, name, table = min(
        (moved_bytes(previous, x[2], itemsize), x[0], i, x[1], x[2])
        for i, x in enumerate(stay + fresh) if x[0] <= budget * (1 + 1e-12))
    log.debug("adaptive plan: %s candidate, makespan %.6g s (bound %.6g s, budget %.6g s), "
              "moves %d bytes", name, span, lower_bound(key_sizes, b, itemsize), budget, moved)
    return table


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


def should_replan(previous, proposal, bandwidths, move_cost_s_per_byte, horizon_steps,
                  itemsize=4, state_copies=2):
    """True when adopting ``proposal`` pays off within ``horizon_steps`` steps:
    ``gain_per_step * horizon_steps > move_cost`` (``replan_gain``) with a positive gain.
    With no ``previous`` table there is nothing to keep: True.
    """
    if previous is None:
        return True
    if horizon_steps < 0:
        raise ValueError("horizon_steps must be >= 0, got %r" % (horizon_steps,))
    gain, cost = replan_gain(previous, proposal, bandwidths, move_cost_s_per_byte, itemsize,
                             state_copies)
    return gain > 0 and gain * horizon_steps > cost


# --- live re-planning -----------------------------------------------------------------------

def split_table(keys, bandwidths, min_slice=DEFAULT_MIN_SLICE, max_chunk=0):
    """The table ``ProportionalRule`` builds for ``keys`` (``[(key, elements), ...]`` in the
    order the workers initialised them) with these bandwidths: every key of at least
    ``2 * min_slice`` elements cut over the servers in proportion to what each lacks of its
    share, smaller keys whole on the server furthest below its share.

    This is the live re-planner's proposal.  Unlike ``proportional_plan`` it cuts every large
    key over all servers rather than placing keys whole: a key's push and pull then go to
    every server at once, so each server's traffic is spread over the whole step (the step
    waits for no single server's queue of whole keys) and each server's measured rate reflects
    its link rather than when its keys' gradients happen to be ready.

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
    round cannot move it); two rounds in a row beyond 1.5x of the round before them, on the
    same side, are a change of the link: the rounds before the change are forgotten, so the
    estimate is the two new rounds' mean, not a median half made of the old network; a server
    whose link got faster is taken as fast as the median of the others (under-used, it would
    measure its small share's throughput).  Until a server is timed it keeps its start-up
    probe rate (``rates``), or the lowest known rate.

    ``decide`` proposes ``split_table`` with the estimated rates and adopts it when the
    modelled gain per step exceeds ``min_gain`` of the current plan's makespan and, over
    ``horizon`` steps, the time to move the state (``replan_gain``: the bytes that change
    server, times 3 copies for weights and optimizer state, over half the slowest rate: a
    server's rate counts both directions).
    """

    MIN_BYTES = 64 * 1024

    def __init__(self, num_servers, num_workers, rates=None, window=3):
        import collections
        self.num_servers = num_servers
        self.num_workers = num_workers
        self.rates = list(rates) if rates else None
        self.window = collections.deque(maxlen=window)
        self.last = None        # (makespan before, after, move cost, adopted) of the last decide

    def observe(self, reports):
        per_round = {}
        for rep in reports:
            for r, per in rep.items():
                per_round.setdefault(int(r), []).append(per)
        for r in sorted(per_round):
            per = per_round[r]
            if len(per) != len(reports):
                continue            # not every worker reported this round
            rates = []
            for s in range(self.num_servers):
                nbytes = sum(p[s][0] for p in per)
                span = max(p[s][1] for p in per)
                rates.append(nbytes / span if nbytes >= self.MIN_BYTES and span > 0 else None)
            self.window.append(rates)
            self._forget_before_a_change()
        est = list(self.rates) if self.rates else [None] * self.num_servers
        for s in range(self.num_servers):
            xs = sorted(w[s] for w in self.window if w[s] is not None)
            if xs:
                m = len(xs) // 2
                est[s] = xs[m] if len(xs) % 2 else 0.5 * (xs[m - 1] + xs[m])
        known = [x for x in est if x]
        if known:
            self.rates = [x if x else min(known) for x in est]
        return self.rates

    def _forget_before_a_change(self, factor=1.5):
        # two rounds in a row that put a server's rate beyond ``factor`` of the oldest round's,
        # on the same side, are a change of the link, not noise: forget what came before them
        if len(self.window) < 3:
            return
        old, a, b = self.window[-3], self.window[-2], self.window[-1]
        up = [s for s in range(self.num_servers) if None not in (old[s], a[s], b[s]) and
              a[s] > factor * old[s] and b[s] > factor * old[s]]
        down = [s for s in range(self.num_servers) if None not in (old[s], a[s], b[s]) and
                a[s] * factor < old[s] and b[s] * factor < old[s]]
        if not up and not down:
            return
        for _ in range(len(self.window) - 2):
            self.window.popleft()
        # A server whose link got faster still holds the small share of its slow days, and a
        # server with little to do measures its throughput, not its link (module docstring):
        # it would climb back one re-plan at a time.  Take it as fast as the median of the
        # other servers instead; if it is slower than that, its next (loaded) rounds say so.
        # (A link changes mid-round, so the first new round may be only partly faster: the
        # latest one decides, once some server's change is certain.)
        for s in range(self.num_servers):
            if None in (old[s], b[s]) or b[s] <= factor * old[s]:
                continue
            for w in (a, b):
                others = sorted(x for i, x in enumerate(w) if i != s and x is not None)
                if others:
                    w[s] = max(w[s], others[len(others) // 2])

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
        gain, cost = replan_gain(old, proposal, b, 2.0 / min(self.rates), 4, 3)
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
        the first half of a change looks like (``_forget_before_a_change`` needs two rounds
        beyond 1.5x; the lower factor here errs on the side of looking once more)."""
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
