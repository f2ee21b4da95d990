"""MXPS_PUSH_GATHER (mxps.roles.push_gate): a round's first pushes leave in the canonical order.

The gate is driven here as the worker's I/O thread drives it: pushes enter a heap ordered by
rank (-priority, key, offset) as they arrive, and the head leaves when the gate says 0.
"""
import heapq

import pytest
from hypothesis import given, settings, strategies as st

from mxps.config import ConfigError, from_env
from mxps.roles.push_gate import PushGate


def drive(gate, rounds, window=1):
    """Run ``rounds`` ([(round, [(arrival time, rank)])]) through ``gate``; returns per round
    [(release time, rank)].  At most ``window`` pushes are in flight, each acked 1 ms after it
    leaves (so the order is the heap's, as under a full send window)."""
    out = []
    for rnd, arrivals in rounds:
        pending = sorted(arrivals)
        held, inflight, released = [], [], []
        now = 0.0
        while pending or held:
            for t, rank in [p for p in pending if p[0] <= now]:
                gate.arrived(rnd, t)
                heapq.heappush(held, rank)
                pending.remove((t, rank))
            inflight = [t for t in inflight if t > now]
            while held and len(inflight) < window:
                wait = gate.wait(held[0], rnd, now)
                if wait > 0:
                    break
                rank = heapq.heappop(held)
                gate.sent(rank, rnd)
                released.append((now, rank))
                inflight.append(now + 0.001)
            now = round(now + 0.0005, 6)
        out.append(released)
    return out


ranks = st.lists(st.tuples(st.integers(-3, 0), st.integers(0, 5), st.integers(0, 4)),
                 min_size=1, max_size=12, unique=True)


@settings(max_examples=200, deadline=None)
@given(ranks, st.data())
def test_pushes_that_arrive_within_the_hold_leave_in_rank_order_from_the_second_round(rs, data):
    hold = 0.01
    orders = [data.draw(st.permutations(rs)) for _ in range(3)]
    times = [sorted(data.draw(st.lists(st.floats(0, hold * 0.9), min_size=len(rs),
                                       max_size=len(rs)))) for _ in range(3)]
    rounds = [(r + 1, list(zip(times[r], orders[r]))) for r in range(3)]
    out = drive(PushGate(hold), rounds)
    for released in out[1:]:
        assert [rank for _, rank in released] == sorted(rs)
    # and the first push leaves no later than the canonical first arrives (or the hold ends)
    for (_, arrivals), released in zip(rounds[1:], out[1:]):
        first_canonical = min(t for t, rank in arrivals if rank == min(rs))
        assert released[0][0] <= first_canonical + 0.0005 + 1e-9


def test_the_first_round_and_a_zero_hold_never_wait():
    arrivals = [(0.0, (0, 5, 0)), (0.002, (0, 4, 0)), (0.004, (0, 0, 0))]
    (first,) = drive(PushGate(0.01), [(1, arrivals)])
    assert [r for _, r in first] == [(0, 5, 0), (0, 4, 0), (0, 0, 0)]
    assert first[0][0] == 0.0
    out = drive(PushGate(0.0), [(1, arrivals), (2, arrivals)])
    assert [r for _, r in out[1]] == [(0, 5, 0), (0, 4, 0), (0, 0, 0)]


def test_a_push_that_never_comes_holds_the_others_for_the_hold_only():
    gate = PushGate(0.01)
    a, b, c = (0, 0, 0), (0, 1, 0), (0, 2, 0)
    drive(gate, [(1, [(0.0, a), (0.0, b), (0.0, c)])])
    # round 2: ``a`` (the canonical first) is not pushed any more (a new plan, say)
    (released,) = drive(gate, [(2, [(0.001, c), (0.002, b)])])
    assert [r for _, r in released] == [b, c]
    assert 0.0105 <= released[0][0] <= 0.012      # the round's first arrival + the hold
    # round 3 expects only what round 2 had: nothing waits once b arrives
    (released,) = drive(gate, [(3, [(0.0, c), (0.003, b)])])
    assert [r for _, r in released] == [b, c]
    assert released[0][0] == pytest.approx(0.003)


def test_a_skipped_round_or_an_older_push_is_not_held():
    gate = PushGate(0.01)
    a, b = (0, 0, 0), (0, 1, 0)
    drive(gate, [(1, [(0.0, a), (0.0, b)])])
    (released,) = drive(gate, [(3, [(0.0, b), (0.005, a)])])   # round 2 never seen here
    assert [r for _, r in released] == [b, a]
    assert gate.wait(b, 2, 0.0) == 0.0


def test_mxps_push_gather_is_read_and_checked():
    base = dict(DMLC_ROLE="worker", DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT="9000",
                DMLC_NUM_WORKER="2", DMLC_NUM_SERVER="1")
    assert from_env(base).push_gather == 0.01
    assert from_env(dict(base, MXPS_PUSH_GATHER="0")).push_gather == 0.0
    assert from_env(dict(base, MXPS_PUSH_GATHER="0.002")).push_gather == 0.002
    for bad in ("-0.5", "2", "soon"):
        with pytest.raises(ConfigError, match="MXPS_PUSH_GATHER"):
            from_env(dict(base, MXPS_PUSH_GATHER=bad))
    with pytest.raises(ValueError, match="hold"):
        PushGate(-1)
