"""Early Close: when a server stops waiting for a (slice, round)'s packets.  Pure functions.

A round of one slice expects ``n`` packets from each of W workers.  Each worker ends its part
with an END (critical: retransmitted until ACKed) saying it sent everything.  The round closes at
the first of:

1. ``complete``: every packet of every worker arrived;
2. ``ends``: every worker's END arrived, and ``grace`` has passed since the last one (packets
   sent before an END may still be behind it; whatever has not come by then was lost);
3. ``ratio``: every worker's received fraction reached the acceptance ratio (the rest, lost or
   late, is not waited for);
4. ``deadline``: ``deadline`` seconds after the last worker was first heard from (its first
   packet or END): a slow path's tail is not waited for.

A worker from which nothing has arrived holds the round open: a worker that computes slowly is
a straggler, not a lossy link, and LTP does not drop stragglers (that is WSP's business,
issue #12); its END is reliable, so it is heard as soon as it has sent, and if it is dead the
scheduler's heartbeat check ends the job.

Both thresholds adapt to what the server measured:
- ``acceptance_ratio(n, loss)``: the fraction a worker's part reaches when nothing is late,
  less ``z`` standard deviations of the binomial loss of its ``n`` packets at the path's
  measured loss rate, never below ``floor``.  Without loss it is 1 (wait for everything).
  With z = 1 the rule fires at the very end of a part whose loss was about average; the END
  rule (2) covers the rest: a lower ratio would close while packets are still arriving and
  add their loss to the network's.
- ``deadline_for(spans)``: ``d_min`` plus ``(1 + margin)`` times the median of this slice's
  last rounds' spans (from the last worker heard to the last packet, rounds that closed by
  ``complete`` or ``ends``), so a round gets about twice as long as such rounds take; None
  (no deadline) until there is a history.
"""
import math

COMPLETE, ENDS, RATIO, DEADLINE = "complete", "ends", "ratio", "deadline"
REASONS = (COMPLETE, ENDS, RATIO, DEADLINE)


def acceptance_ratio(n, loss, z=1.0, floor=0.8):
    """The fraction of ``n`` packets a worker's part must reach (see module doc); ``loss`` is
    the path's measured loss rate in [0, 1]."""
    if n <= 0:
        return 1.0
    p = min(max(float(loss), 0.0), 1.0)
    if p == 0.0:
        return 1.0
    r = 1.0 - p - z * math.sqrt(p * (1.0 - p) / n)
    return min(1.0, max(floor, r))


def deadline_for(spans, d_min=0.010, margin=2.0):
    """Seconds after the last worker is heard before the round closes anyway, from the spans
    (seconds) of this slice's recent rounds; None without history."""
    xs = sorted(s for s in spans if s is not None and s >= 0)
    if not xs:
        return None
    mid = len(xs) // 2
    median = xs[mid] if len(xs) % 2 else 0.5 * (xs[mid - 1] + xs[mid])
    return d_min + (1.0 + margin) * median


def decide(now, expected, received, heard, ends, ratio, grace, deadline):
    """Whether a round closes at ``now`` and why, and when to look again.

    ``expected``: packets per worker (one int per worker); ``received[w]``: distinct packets of
    worker w so far; ``heard[w]``: when worker w's first packet or END came (None: not yet);
    ``ends[w]``: when its END came (None: not yet); ``ratio``: the acceptance ratio in (0, 1];
    ``grace``: seconds after the last END; ``deadline``: seconds after the last worker was heard,
    or None for no deadline.

    Returns ``(reason, wake)``: ``reason`` one of REASONS, or None if the round stays open;
    ``wake`` the time at which, with no new packet, the answer would change (None: only a
    packet can change it)."""
    w = len(expected)
    if all(received[i] >= expected[i] for i in range(w)):
        return COMPLETE, None
    if any(h is None for h in heard):
        return None, None
    if all(received[i] * (1 + 1e-12) >= ratio * expected[i] for i in range(w)):
        return RATIO, None
    wake = None
    if all(e is not None for e in ends):
        at = max(ends) + grace
        if now >= at:
            return ENDS, None
        wake = at
    if deadline is not None:
        at = max(heard) + deadline
        if now >= at:
            return DEADLINE, None
        wake = at if wake is None else min(wake, at)
    return None, wake
