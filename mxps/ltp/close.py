"""Early Close: when a server stops waiting for a (slice, round)'s packets.  Pure functions.

A round of one slice expects ``n`` packets from each of W workers.  Each worker ends its part
with an END (critical: retransmitted until ACKed) saying it sent everything.  The round closes at
the first of:

1. ``complete``: every packet of every worker arrived;
2. ``ends``: every worker's END arrived, and ``grace`` has passed since the last one (packets
   sent before an END may still be behind it; whatever has not come by then was lost).  The
   grace is ``grace_for``: nothing while the server's paths keep order (a path that delivers
   in order can have nothing behind an END: whatever is missing was lost), the configured
   grace once a packet came out of order on one of them, for ``REORDER_MEMORY`` seconds;
3. ``ratio``: every worker's received fraction reached the acceptance ratio (the rest, lost or
   late, is not waited for);
4. ``deadline``: ``deadline`` seconds after the last worker was first heard from (its first
   packet or END): a slow path's tail is not waited for.

A worker from which nothing has arrived holds the round open: a worker that computes slowly is
a straggler, not a lossy link, and LTP does not drop stragglers (that is WSP's business);
its END is reliable, so it is heard as soon as it has sent, and if it is dead the
scheduler's heartbeat check ends the job.

Both thresholds adapt to what the server measured:
- ``acceptance_ratio(n, loss)``: the fraction a worker's part reaches when nothing is late,
  less ``z`` standard deviations of the binomial loss of its ``n`` packets at the path's
  measured loss rate, never below ``floor``.  Without loss it is 1 (wait for everything).
  With z = 1 the rule fires at the very end of a part whose loss was about average; the END
  rule (2) covers the rest: a lower ratio would close while packets are still arriving and
  add their loss to the network's.
- ``deadline_for(spans, backoff)``: ``backoff`` times (``d_min`` plus ``(1 + margin)`` times the
  median of this slice's last rounds' spans, from the last worker heard to the last packet), so
  a round gets about three times as long as recent rounds took; None (no deadline) until there
  is a history.  Every close adds its span, a deadline close too (there the span is cut short,
  a lower bound), and ``next_backoff`` doubles the factor at a deadline close (up to ``cap``)
  and halves it (down to 1) at any other.  Without the backoff a lasting slowdown locked the
  deadline in: rounds closed by the deadline recorded no span, so the deadline never learnt
  that rounds had become longer and kept cutting every round short (measured by
  scripts/ltp_fairness.py; docs/LTP.md).  A deadline close is evidence of lateness, not loss:
  the END is reliable, so a worker whose END has not come is still sending (or its END is
  being resent); a lost tail closes the round by ``ends``.  After a k-fold lasting slowdown
  the deadline closes about log2(k) + 1 rounds, then rounds complete again
  (tests/test_ltp_close.py).
"""
import collections
import math

COMPLETE, ENDS, RATIO, DEADLINE = "complete", "ends", "ratio", "deadline"
REASONS = (COMPLETE, ENDS, RATIO, DEADLINE)
# seconds a packet seen out of order keeps the grace after an END on (receiver.Receiver)
REORDER_MEMORY = 10.0


def grace_for(grace, reordered_at, now, memory=REORDER_MEMORY):
    """The wait after the last END (seconds): ``grace`` if a packet arrived out of order (after
    one with a higher packet number on its path) at ``reordered_at`` within ``memory`` seconds
    of ``now``, else 0.  ``reordered_at`` None: order not watched, the grace always holds.
    As RACK's reordering window (RFC 8985; Linux's tcp_rack_reo_wnd is 0 until reordering is
    seen): the grace waits for packets behind an END, and on a path that keeps order (one
    queue, FIFO: this project's emulated switch, most single-path networks) there are none, so
    at every round with a loss a fixed grace was pure delay (2 ms: a quarter of an 8 x 50 KB
    round at 400 Mbit/s; docs/bench/ltp_push_alone_grace_copies_grant.json)."""
    if reordered_at is None:
        return grace
    return grace if now - reordered_at < memory else 0.0


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


def deadline_for(spans, d_min=0.010, margin=2.0, backoff=1.0):
    """Seconds after the last worker is heard before the round closes anyway, from the spans
    (seconds) of this slice's recent rounds and the backoff factor; None without history."""
    xs = sorted(s for s in spans if s is not None and s >= 0)
    if not xs:
        return None
    mid = len(xs) // 2
    median = xs[mid] if len(xs) % 2 else 0.5 * (xs[mid - 1] + xs[mid])
    return max(1.0, float(backoff)) * (d_min + (1.0 + margin) * median)


def next_backoff(backoff, reason, cap=64.0):
    """The deadline's factor after a round closed for ``reason``: doubled (to ``cap``) by a
    deadline close, halved (to 1) by any other."""
    b = max(1.0, float(backoff))
    return min(float(cap), 2.0 * b) if reason == DEADLINE else max(1.0, 0.5 * b)


class Deadline:
    """One slice's deadline state: its recent spans and backoff factor (see module doc)."""

    __slots__ = ("spans", "backoff", "d_min", "margin", "_value")

    def __init__(self, history=8, d_min=0.010, margin=2.0):
        self.spans = collections.deque(maxlen=history)
        self.backoff = 1.0
        self.d_min = d_min
        self.margin = margin
        self._value = None

    def value(self):
        """The deadline for the next look (seconds), None without history.  It changes only
        when a round closes: computed then, not at every look (a server looks per packet)."""
        return self._value

    def closed(self, reason, span):
        """A round closed for ``reason`` after ``span`` seconds from its last worker heard to
        its last packet (None: no packet)."""
        if span is not None:
            self.spans.append(max(0.0, float(span)))
        self.backoff = next_backoff(self.backoff, reason)
        self._value = deadline_for(self.spans, self.d_min, self.margin, self.backoff)


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
