"""LTP's Early Close rule (mxps/ltp/close.py): properties of a pure function, by hypothesis.

``decide`` says whether a (slice, round) closes at ``now`` and when to look again.  The server
trusts it for three things, each checked here over arbitrary round states: it never waits for
nothing (a complete round closes whatever the clocks), it never gives up on a worker it has not
heard from (a straggler is not a lossy link), and its answer moves one way only (closed stays
closed as time passes or packets arrive), with ``wake`` the exact moment a quiet round's answer
flips, so that the server's single timer (``ServerState.next_wake``) is enough.  The adaptive
thresholds (``acceptance_ratio``, ``deadline_for``) get their documented bounds and monotonicity.
"""
import math

import pytest
from hypothesis import assume, given, settings, strategies as st

from mxps.ltp import close
from mxps.ltp.close import COMPLETE, DEADLINE, ENDS, RATIO, REASONS, decide

PROPS = settings(max_examples=100, deadline=None)
times = st.floats(0.0, 100.0, allow_nan=False)
maybe_time = st.none() | times


@st.composite
def rounds(draw, min_workers=1, all_heard=False):
    """A round state a server can be in: a worker it has not heard from has sent nothing and
    no END; an END comes no earlier than the worker's first packet.  ``all_heard``: every
    worker was heard (the only states that can close before every packet arrived)."""
    workers = draw(st.integers(min_workers, 5))
    expected, received, heard, ends = [], [], [], []
    for _ in range(workers):
        n = draw(st.integers(1, 40))
        h = draw(times if all_heard else maybe_time)
        expected.append(n)
        heard.append(h)
        received.append(0 if h is None else draw(st.integers(0, n)))
        ends.append(None if h is None else draw(st.none() | st.floats(h, h + 10.0)))
    return dict(expected=expected, received=received, heard=heard, ends=ends,
                ratio=draw(st.floats(0.01, 1.0)), grace=draw(st.floats(0.0, 1.0)),
                deadline=draw(st.none() | st.floats(0.0, 5.0)))


def at(now, state):
    return decide(now, **state)


# --- closing and not closing ------------------------------------------------------------------

@PROPS
@given(rounds(), times, st.data())
def test_a_round_where_every_packet_arrived_is_complete_whatever_the_clocks(state, now, data):
    state["received"] = list(state["expected"])
    # the clocks need not even be consistent: nothing is waited for
    state["heard"] = [data.draw(maybe_time) for _ in state["heard"]]
    state["ends"] = [data.draw(maybe_time) for _ in state["ends"]]
    assert at(now, state) == (COMPLETE, None)


@PROPS
@given(rounds(min_workers=2), times, st.data())
def test_a_round_never_closes_while_a_worker_is_unheard(state, now, data):
    silent = data.draw(st.integers(0, len(state["heard"]) - 1))
    state["heard"][silent] = state["ends"][silent] = None
    state["received"][silent] = 0
    # no clock and no deadline wakes it: only that worker's packet (or its death) can
    assert at(now, state) == (None, None)
    assert at(now + 1e9, state) == (None, None)


@PROPS
@given(rounds(), times)
def test_the_reason_is_one_of_the_documented_ones_and_a_closed_round_needs_no_wake(state, now):
    reason, wake = at(now, state)
    assert reason in REASONS + (None,)
    if reason is not None:
        assert wake is None
    elif wake is not None:
        assert wake > now


@PROPS
@given(rounds(all_heard=True), times, st.floats(0.0, 1e6))
def test_once_closed_a_round_stays_closed_as_time_passes(state, now, later):
    reason, _ = at(now, state)
    assume(reason is not None)
    assert at(now + later, state)[0] is not None


@PROPS
@given(rounds(all_heard=True), times, st.data())
def test_more_arrivals_never_reopen_a_closed_round(state, now, data):
    reason, _ = at(now, state)
    assume(reason is not None)
    more = dict(state, received=list(state["received"]), heard=list(state["heard"]),
                ends=list(state["ends"]))
    for w, n in enumerate(state["expected"]):
        more["received"][w] = data.draw(st.integers(state["received"][w], n))
        if more["ends"][w] is None and data.draw(st.booleans()):
            t = data.draw(st.floats(0.0, now))          # an END that came by now
            more["ends"][w] = t
            if more["heard"][w] is None or more["heard"][w] > t:
                more["heard"][w] = t
    assert at(now, more)[0] is not None


@PROPS
@given(rounds(all_heard=True), times, st.floats(0.0, 1.0))
def test_wake_is_exactly_when_a_quiet_round_closes(state, now, frac):
    reason, wake = at(now, state)
    assume(reason is None and wake is not None)
    before = math.nextafter(wake, -math.inf)
    for t in (now, now + frac * (before - now), before):
        assert at(t, state) == (None, wake), t     # open, and the same wake, until then
    closed, again = at(wake, state)
    assert closed in (ENDS, DEADLINE) and again is None
    ends_at = (max(state["ends"]) + state["grace"]
               if all(e is not None for e in state["ends"]) else math.inf)
    deadline_at = (max(state["heard"]) + state["deadline"]
                   if state["deadline"] is not None else math.inf)
    assert wake == min(ends_at, deadline_at)
    assert closed == (ENDS if ends_at <= deadline_at else DEADLINE)


@PROPS
@given(rounds(all_heard=True), times)
def test_a_quiet_round_without_a_wake_stays_open_for_ever(state, now):
    reason, wake = at(now, state)
    assume(reason is None and wake is None)
    assert at(now + 1e9, state) == (None, None)


def test_each_reason_is_reachable_and_needs_what_the_rule_says():
    # two workers of 10 packets each, heard at 1.0 and 2.0
    base = dict(expected=[10, 10], received=[10, 6], heard=[1.0, 2.0], ends=[None, None],
                ratio=0.9, grace=0.5, deadline=None)
    assert at(3.0, base) == (None, None)
    assert at(3.0, dict(base, received=[10, 10])) == (COMPLETE, None)
    assert at(3.0, dict(base, received=[9, 9])) == (RATIO, None)
    ended = dict(base, ends=[1.5, 2.5])
    assert at(2.9, ended) == (None, 3.0)
    assert at(3.0, ended) == (ENDS, None)
    late = dict(base, deadline=4.0)
    assert at(5.9, late) == (None, 6.0)
    assert at(6.0, late) == (DEADLINE, None)


@pytest.mark.parametrize("ratio,n,got", [(0.55, 100, 55), (0.56, 25, 14), (0.68, 75, 51)])
def test_a_round_closes_by_ratio_when_every_fraction_received_equals_the_ratio(ratio, n, got):
    assert got / n >= ratio
    assert decide(1.0, [n, n], [got, got], [0.0, 0.0], [None, None], ratio, 0.01,
                  None) == (RATIO, None)


# --- the adaptive thresholds ------------------------------------------------------------------

packets = st.integers(1, 10 ** 6)
losses = st.floats(0.0, 1.0)
zs = st.floats(0.0, 4.0)
floors = st.floats(0.0, 1.0)


@PROPS
@given(packets, zs, floors)
def test_without_loss_the_acceptance_ratio_is_1(n, z, floor):
    assert close.acceptance_ratio(n, 0.0, z, floor) == 1.0


@PROPS
@given(st.integers(-5, 0), losses, zs, floors)
def test_an_empty_part_needs_everything(n, loss, z, floor):
    assert close.acceptance_ratio(n, loss, z, floor) == 1.0


@PROPS
@given(packets, losses, zs, floors)
def test_the_acceptance_ratio_lies_between_its_floor_and_1(n, loss, z, floor):
    assert floor <= close.acceptance_ratio(n, loss, z, floor) <= 1.0


@PROPS
@given(packets, losses, losses, zs, floors)
def test_the_acceptance_ratio_does_not_rise_with_loss(n, a, b, z, floor):
    lo, hi = sorted((a, b))
    # 1e-12: a 1-ulp wobble of sqrt between two nearly equal losses is not a rise
    assert close.acceptance_ratio(n, hi, z, floor) <= \
        close.acceptance_ratio(n, lo, z, floor) + 1e-12


@PROPS
@given(packets, packets, losses, zs, floors)
def test_the_acceptance_ratio_does_not_fall_with_more_packets(a, b, loss, z, floor):
    lo, hi = sorted((a, b))
    assert close.acceptance_ratio(hi, loss, z, floor) >= \
        close.acceptance_ratio(lo, loss, z, floor) - 1e-12


@PROPS
@given(packets, st.floats(1e-6, 0.5), floors)
def test_with_loss_and_z_0_the_ratio_is_what_arrives_on_average(n, loss, floor):
    assert close.acceptance_ratio(n, loss, 0.0, floor) == pytest.approx(max(floor, 1 - loss))


spans = st.lists(st.none() | st.floats(-1.0, 10.0), max_size=10)


@PROPS
@given(spans, st.floats(0.0, 0.1), st.floats(0.0, 5.0))
def test_the_deadline_needs_a_history_and_lies_between_the_spans_it_comes_from(xs, d_min,
                                                                               margin):
    valid = [s for s in xs if s is not None and s >= 0]
    d = close.deadline_for(xs, d_min, margin)
    if not valid:
        assert d is None
        return
    assert d >= d_min
    assert d_min + (1 + margin) * min(valid) - 1e-9 <= d <= \
        d_min + (1 + margin) * max(valid) + 1e-9


@PROPS
@given(st.lists(st.floats(0.0, 10.0), min_size=1, max_size=9), st.floats(0.0, 10.0))
def test_a_slower_history_never_shortens_the_deadline(xs, extra):
    slower = [x + extra for x in xs]
    assert close.deadline_for(slower) >= close.deadline_for(xs) - 1e-12


@PROPS
@given(st.floats(1.0, 64.0), st.sampled_from(close.REASONS))
def test_the_backoff_doubles_at_a_deadline_close_and_halves_at_any_other(b, reason):
    nb = close.next_backoff(b, reason)
    assert 1.0 <= nb <= 64.0
    if reason == close.DEADLINE:
        assert nb == pytest.approx(min(64.0, 2 * b))
    else:
        assert nb == pytest.approx(max(1.0, b / 2))


@PROPS
@given(st.lists(st.floats(0.0, 10.0), min_size=1, max_size=9), st.floats(1.0, 64.0))
def test_the_backoff_multiplies_the_deadline(xs, b):
    assert close.deadline_for(xs, backoff=b) == pytest.approx(b * close.deadline_for(xs))


def _slowdown(span_before, span_after, rounds=60):
    """Rounds of one slice whose packets take ``span_before`` then, for ever, ``span_after``
    seconds after the last worker is heard: each closes complete if the deadline lets it, or by
    the deadline (a late tail, cut: its span is the deadline).  The reasons, in order."""
    d = close.Deadline()
    for _ in range(8):
        d.closed(close.COMPLETE, span_before)
    out = []
    for _ in range(rounds):
        dl = d.value()
        if dl >= span_after:
            d.closed(close.COMPLETE, span_after)
            out.append(close.COMPLETE)
        else:
            d.closed(close.DEADLINE, dl)
            out.append(close.DEADLINE)
    return out


@PROPS
@given(st.floats(0.001, 0.05), st.floats(1.0, 300.0))
def test_after_a_lasting_slowdown_the_deadline_catches_up_in_log_rounds(before, factor):
    """The defect this fixes: closed by the deadline, rounds added no span, so after a lasting
    slowdown every round closed by the deadline for ever.  Now the deadline closes at most
    log2(factor) + 2 rounds, all near the start, and then never again."""
    after = before * factor
    reasons = _slowdown(before, after)
    cut = [i for i, r in enumerate(reasons) if r == close.DEADLINE]
    assert len(cut) <= math.log2(factor) + 2
    assert not cut or cut[-1] < 2 * (math.log2(factor) + 2)
    assert reasons[-10:] == [close.COMPLETE] * 10


@PROPS
@given(st.lists(st.tuples(st.sampled_from(close.REASONS), st.none() | st.floats(0.0, 1.0)),
                max_size=20))
def test_a_deadline_is_the_rule_of_its_spans_and_backoff_after_any_closes(closes):
    """``Deadline.value`` is computed when a round closes, not at each look: it must still be
    exactly ``deadline_for`` of the spans and backoff at every moment."""
    d = close.Deadline()
    assert d.value() is None
    for reason, span in closes:
        d.closed(reason, span)
        assert d.value() == close.deadline_for(d.spans, d.d_min, d.margin, d.backoff)


def test_a_single_late_round_costs_the_next_ones_nothing_lasting():
    d = close.Deadline()
    for _ in range(8):
        d.closed(close.COMPLETE, 0.01)
    base = d.value()
    d.closed(close.DEADLINE, base)           # one straggler cut short
    assert d.value() > base                   # the next round gets longer
    for _ in range(3):
        d.closed(close.COMPLETE, 0.01)
    assert d.value() == pytest.approx(base)   # and it is forgotten


# --- the grace after the last END ---------------------------------------------------------

@PROPS
@given(st.floats(0.0, 1.0), times, st.floats(0.0, 50.0))
def test_the_grace_holds_only_within_the_memory_of_a_packet_out_of_order(grace, now, ago):
    g = close.grace_for(grace, now - ago, now, memory=10.0)
    assert g == (grace if ago < 10.0 else 0.0)
    # never seen out of order: a path that keeps order has nothing behind an END
    assert close.grace_for(grace, -math.inf, now) == 0.0
    # order not watched (no receiver to say): the configured grace always holds
    assert close.grace_for(grace, None, now) == grace


@PROPS
@given(rounds(all_heard=True), st.floats(0.0, 1.0), st.data())
def test_without_reordering_a_round_whose_ends_all_came_closes_at_the_last_end(state, grace,
                                                                               data):
    # every END came, a packet is missing (below any ratio), no deadline
    state["ends"] = [h + data.draw(st.floats(0.0, 10.0)) for h in state["heard"]]
    state["received"][0] = state["expected"][0] - 1
    state["ratio"], state["deadline"] = 1.0, None
    last = max(state["ends"])
    state["grace"] = close.grace_for(grace, -math.inf, last)
    assert at(last, state)[0] == ENDS
    state["grace"] = close.grace_for(grace, last - 1.0, last)      # reordered a second ago
    if grace > 0:
        assert at(math.nextafter(last + grace, 0), state)[0] is None
        assert at(last + grace, state)[0] == ENDS
