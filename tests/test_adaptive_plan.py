"""Adaptive placement (mxps/placement/adaptive.py): the live proposal (split_table), the measures
(makespan, moved bytes), the cost of a move, and the Replanner's estimate and decision."""
import pytest
from hypothesis import given, settings, strategies as st

from mxps.placement.adaptive import (bytes_per_server, check_table, makespan, moved_bytes,
                                     replan_gain, split_table, forced_table, Replanner)
from mxps.placement.plan import Plan, PlanError, Slice, check_slices

M = 16384      # the default min_slice: 64 KB of float32


def resnet18_sizes():
    """The 62 trainable arrays of Gluon's resnet18_v1 (ImageNet), in Trainer order."""
    sizes = [64 * 3 * 7 * 7, 64, 64]                              # conv0, bn0

    def stage(cin, c, downsample):
        out = [c * cin * 9, c, c, c * c * 9, c, c]
        if downsample:
            out += [c * cin, c, c]
        return out + [c * c * 9, c, c, c * c * 9, c, c]

    sizes += stage(64, 64, False) + stage(64, 128, True) + stage(128, 256, True) \
        + stage(256, 512, True)
    sizes += [512 * 1000, 1000]                                   # dense
    return dict(enumerate(sizes))


def mlp_sizes():
    return dict(enumerate([784 * 4096, 4096, 4096 * 4096, 4096, 4096 * 4096, 4096, 4096 * 10,
                           10]))


RESNET18 = resnet18_sizes()
MLP = mlp_sizes()


def test_resnet18_fixture_is_resnet18():
    assert len(RESNET18) == 62
    assert sum(RESNET18.values()) == 11689512
    assert min(RESNET18.values()) == 64 and max(RESNET18.values()) == 2359296


def assert_follows_the_rules(table, sizes, num_servers, min_slice):
    check_table(table, sizes, num_servers, min_slice)
    for key, n in sizes.items():
        slices = table[key]
        check_slices(key, n, slices, num_servers)
        assert len({s.server for s in slices}) == len(slices) <= num_servers
        if n < 2 * min_slice:
            assert len(slices) == 1
        else:
            assert len(slices) == 1 or all(s.length >= min_slice for s in slices)
    Plan(num_servers, version=7, table=table)          # validates every key again


# --- strategies -------------------------------------------------------------------------------

SIZE = st.one_of(st.integers(0, 300), st.integers(0, 3 * M), st.integers(0, 3 * 10 ** 6))
SIZES = st.dictionaries(st.integers(0, 10 ** 6), SIZE, max_size=70)
MIN_SLICE = st.sampled_from([1, 2, 3, 100, 1000, M])


@st.composite
def bandwidths(draw, max_servers=12):
    n = draw(st.integers(1, max_servers))
    if draw(st.booleans()):
        return [draw(st.floats(0.5, 1e9))] * n                   # equal
    lo = draw(st.floats(1e3, 1e9))
    return [lo * draw(st.floats(1.0, 20.0)) for _ in range(n)]   # ratios up to 1:20


REAL_MODELS = st.sampled_from([RESNET18, MLP])


# --- the rules -----------------------------------------------------------------------------------


# --- the guarantee -------------------------------------------------------------------------------


# --- against MXNet's placement -----------------------------------------------------------------


# --- stability -----------------------------------------------------------------------------------


def test_moved_bytes_counts_elements_whose_server_changes():
    old = {1: (Slice(0, 0, 10), Slice(1, 10, 10)), 2: (Slice(0, 0, 5),)}
    new = {1: (Slice(0, 0, 15), Slice(1, 15, 5)), 2: (Slice(1, 0, 5),), 3: (Slice(0, 0, 9),)}
    assert moved_bytes(old, new, itemsize=1) == 5 + 5
    assert moved_bytes(old, new) == 40
    assert moved_bytes(new, new) == 0
    with pytest.raises(PlanError, match="key 2 has 5 elements in the old table and 6"):
        moved_bytes(old, {2: (Slice(0, 0, 6),)})


def test_makespan_names_a_missing_or_resized_key():
    with pytest.raises(PlanError, match="key 5 .* not in the table"):
        makespan({}, {5: 10}, [1.0])
    with pytest.raises(PlanError, match="key 5 has 10 elements, the table places 9"):
        makespan({5: (Slice(0, 0, 9),)}, {5: 10}, [1.0])


# --- hysteresis ----------------------------------------------------------------------------------


# --- speed ---------------------------------------------------------------------------------------


# --- live re-planning: the proposal, the forced tables, the scheduler's Replanner -----------

@settings(max_examples=150, deadline=None)
@given(sizes=SIZES, b=bandwidths(), min_slice=MIN_SLICE)
def test_split_table_follows_the_rules_and_keeps_shares_within_one_small_key(sizes, b,
                                                                             min_slice):
    keys = sorted(sizes.items())
    table = split_table(keys, b, min_slice)
    assert set(table) == set(sizes)
    assert_follows_the_rules(table, sizes, len(b), min_slice)
    loads = bytes_per_server(table, len(b), 1)
    total = sum(sizes.values())
    unit = max([min(n, 2 * min_slice) for n in sizes.values()] + [0])
    for s, load in enumerate(loads):   # within one unsplittable unit per server of its share
        assert abs(load - total * b[s] / sum(b)) <= unit * len(b) + 1, (s, loads)


@settings(max_examples=100, deadline=None)
@given(sizes=SIZES, num_servers=st.integers(2, 6), version=st.integers(1, 10 ** 6),
       min_slice=MIN_SLICE)
def test_forced_tables_follow_the_rules_and_move_something_every_version(sizes, num_servers,
                                                                         version, min_slice):
    keys = sorted(sizes.items())
    a = forced_table(keys, num_servers, version, min_slice)
    b = forced_table(keys, num_servers, version + 1, min_slice)
    for t in (a, b):
        assert_follows_the_rules(t, sizes, num_servers, min_slice)
    assert forced_table(keys, num_servers, version, min_slice) == a      # deterministic
    if sum(sizes.values()):
        assert moved_bytes(a, b) > 0


def traffic(per_server_bytes_seconds, rounds, first=1):
    """One worker's report: the same [bytes, seconds] per server in every round."""
    return {r: [list(x) for x in per_server_bytes_seconds] for r in range(first, first + rounds)}


def test_replanner_rate_is_all_workers_bytes_over_the_slowest_span():
    rp = Replanner(2, 2)
    rates = rp.observe([traffic([(4e6, 1.0), (4e6, 0.5)], 1),
                        traffic([(2e6, 0.5), (4e6, 1.0)], 1)])
    assert rates == [6e6, 8e6]


def test_replanner_one_noisy_round_does_not_move_the_estimate_a_real_change_does_at_once():
    rp = Replanner(2, 1)
    rp.observe([traffic([(1e6, 0.1), (1e6, 0.1)], 2)])            # 10 MB/s each
    rp.observe([{3: [[1e6, 0.14], [1e6, 0.1]]}])                   # server 0 1.4x slower once
    assert rp.rates == [1e7, 1e7]
    rp.observe([{4: [[1e6, 0.1], [1e6, 0.1]]}])
    rp.observe([{5: [[1e6, 1.0], [1e6, 0.1]]}])                    # 10x slower: a change,
    assert rp.rates == pytest.approx([1e6, 1e7])                   # taken in this round


def test_without_one_round_detection_a_change_needs_two_rounds_as_before_issue_10():
    rp = Replanner(2, 1, one_round=False)          # MXPS_REPLAN_ONE_ROUND=0 (ablations)
    rp.observe([traffic([(1e6, 0.1), (1e6, 0.1)], 3)])            # 10 MB/s each
    rp.observe([{4: [[1e6, 1.0, 5e5, 0.9], [1e6, 0.1]]}])          # 10x slower once
    assert rp.rates == [1e7, 1e7]
    rp.observe([{5: [[1e6, 1.0, 5e5, 0.9], [1e6, 0.1]]}])          # twice: a change,
    assert rp.rates == pytest.approx([1e6, 1e7])                   # whole rounds, no tails


def test_replanner_takes_two_rounds_of_a_moderate_drift_as_a_change():
    rp = Replanner(2, 1)
    rp.observe([traffic([(1e6, 0.1), (1e6, 0.1)], 3)])            # 10 MB/s each
    rp.observe([{4: [[1e6, 0.16], [1e6, 0.1]]}])                   # 1.6x slower: not yet
    assert rp.rates == [1e7, 1e7]
    rp.observe([{5: [[1e6, 0.17], [1e6, 0.1]]}])                   # again: a change
    assert rp.rates == pytest.approx([(1e7 / 1.6 + 1e7 / 1.7) / 2, 1e7])


def test_a_link_that_changed_mid_round_is_taken_at_the_rate_of_the_rounds_second_half():
    rp = Replanner(2, 1)
    rp.observe([traffic([(1e6, 0.1), (1e6, 0.1)], 3)])            # 10 MB/s each
    # round 4: server 0's first half at 10 MB/s, its second half at 2.5 MB/s (0.05 s +
    # 0.2 s): the whole round says 4 MB/s, its second half the new rate
    rp.observe([{4: [[1e6, 0.25, 5e5, 0.2], [1e6, 0.1, 5e5, 0.05]]}])
    assert rp.rates == pytest.approx([2.5e6, 1e7])
    # without a change, the second half is not used (a server's tail also waits for the
    # slowest worker's pushes: noise, not a link)
    rp = Replanner(2, 1)
    rp.observe([traffic([(1e6, 0.1), (1e6, 0.1)], 3)])
    rp.observe([{4: [[1e6, 0.12, 5e5, 0.1], [1e6, 0.1, 5e5, 0.05]]}])
    assert rp.rates == pytest.approx([1e7, 1e7])


def test_tail_of_is_the_second_half_of_a_rounds_bytes_over_its_time():
    from mxps.placement.metrics import tail_of
    marks = [(0.0, 250), (0.1, 500), (0.2, 750), (1.0, 1000)]
    assert tail_of(marks, 1000, 1.0) == (500, pytest.approx(0.9))
    assert tail_of([], 0, None) == (0, 0.0)
    assert tail_of([(0.0, 1000)], 1000, 0.0) == (0, 0.0)


def test_replanner_keeps_the_probe_rate_of_a_server_it_cannot_time():
    rp = Replanner(2, 1, rates=[5e6, 5e6])
    rp.observe([traffic([(1e6, 0.1), (1000, 0.1)], 3)])           # server 1: too few bytes
    assert rp.rates == [1e7, 5e6]


def test_replanner_moves_bytes_off_a_slow_server_and_keeps_a_balanced_plan():
    sizes = resnet18_sizes()
    keys = list(sizes.items())
    rp = Replanner(4, 4, rates=[4e7] * 4)
    even = split_table(keys, [1.0] * 4)
    assert rp.decide(keys, even, 1) is None                       # balanced: keep
    rp.rates = [1e7, 4e7, 4e7, 4e7]                               # server 0 at a quarter
    new = rp.decide(keys, even, 1)
    assert new is not None
    before, after, _, ok = rp.last
    assert ok and after < 0.5 * before
    loads = bytes_per_server(new, 4)
    assert loads[0] < 0.1 * sum(loads)                            # ~1/13 of the bytes
    assert rp.decide(keys, new, 2) is None                        # in place: keep


def test_replanner_hysteresis_ignores_a_gain_under_min_gain():
    sizes = resnet18_sizes()
    keys = list(sizes.items())
    even = split_table(keys, [1.0] * 4)
    rp = Replanner(4, 4, rates=[3.9e7, 4e7, 4e7, 4e7])            # 2.5% slower: noise
    assert rp.decide(keys, even, 1, min_gain=0.05) is None
    assert rp.decide(keys, even, 1, min_gain=0.001) is not None
    # a real gain that moving the state would not pay back within the horizon: keep
    rp.rates = [2e7, 4e7, 4e7, 4e7]
    assert rp.decide(keys, even, 1, horizon=1) is None
    assert rp.decide(keys, even, 1, horizon=20) is not None


def test_replanner_forgets_the_rounds_before_a_change_of_the_link():
    rp = Replanner(2, 1)
    rp.observe([{r: [[1e6, 0.1], [1e6, 0.1]] for r in (1, 2, 3)}])        # 10 MB/s each
    rp.observe([{4: [[1e6, 0.4], [1e6, 0.1]], 5: [[1e6, 0.5], [1e6, 0.1]]}])
    # server 0 dropped to 2.5 and 2 MB/s: the estimate is their mean, not a median with the
    # old 10 MB/s round
    assert rp.rates == pytest.approx([2.25e6, 1e7])


@settings(max_examples=80, deadline=None)
@given(sizes=SIZES, b=bandwidths(), min_slice=MIN_SLICE, max_chunk=st.integers(M // 2, 5 * M))
def test_chunks_cut_each_servers_part_without_changing_the_shares(sizes, b, min_slice,
                                                                  max_chunk):
    keys = sorted(sizes.items())
    whole = split_table(keys, b, min_slice)
    chunked = split_table(keys, b, min_slice, max_chunk)
    assert bytes_per_server(chunked, len(b)) == bytes_per_server(whole, len(b))
    for key, n in sizes.items():
        slices = chunked[key]
        check_slices(key, n, slices, len(b), one_per_server=False)
        Plan(len(b), 1, {key: slices})                  # the workers' plan takes it
        if len(whole[key]) > 1 or n >= 2 * min_slice:
            assert all(s.length <= max_chunk for s in slices), slices
        # a server's chunks are consecutive and together are its part of the key
        for part in whole[key]:
            if not part.length:
                assert slices == whole[key]                 # an empty key: one empty slice
                continue
            mine = [s for s in slices if part.offset <= s.offset < part.stop]
            assert {s.server for s in mine} == {part.server}
            assert sum(s.length for s in mine) == part.length


def test_split_never_rounds_a_cut_slice_under_min_slice():
    # 41 elements over 9 equal servers wants 4.56 each: rounding each slice on its own gave
    # eight slices of 5 and one of 1; cumulative rounding gives 4s and 5s
    table = split_table([(0, 41)], [1.0] * 9, min_slice=2)
    assert sorted({s.length for s in table[0]}) == [4, 5]
    check_table(table, {0: 41}, 9, min_slice=2)


def test_a_light_point_asks_for_a_full_one_when_a_change_is_suspected_or_a_plan_pays():
    sizes = resnet18_sizes()
    keys = list(sizes.items())
    even = split_table(keys, [1.0] * 4)
    rp = Replanner(4, 4)
    steady = [[4e6, 0.1]] * 4                                     # 40 MB/s each
    rp.observe([{r: steady for r in (1, 2, 3)}])
    assert not rp.suspects_change()
    assert not rp.wants_point(keys, even)                         # balanced, steady: light
    noisy = Replanner(4, 4)
    noisy.observe([{r: steady for r in (1, 2, 3)}])
    noisy.observe([{4: [[4e6, 0.12]] + steady[1:]}])              # 20% slower: noise
    assert not noisy.suspects_change() and not noisy.wants_point(keys, even)
    rp.observe([{4: steady}])
    rp.observe([{5: [[4e6, 0.14]] + steady[1:]}])                 # 1.4x slower than round 4
    assert rp.suspects_change()
    assert rp.rates[0] > 3e7               # the median has not moved: decide would keep...
    assert rp.decide(keys, even, 1) is None
    assert rp.wants_point(keys, even)      # ...but the next point must be able to switch
    rp.observe([{6: [[4e6, 0.4]] + steady[1:]}])                  # 4x slower: a change
    assert rp.rates[0] == pytest.approx(1e7)
    assert rp.wants_point(keys, even)                             # now the plan pays
    new = rp.decide(keys, even, 1)
    assert new is not None
    rp.observe([{7: [[4e6, 0.4]] + steady[1:]}])
    assert not rp.suspects_change() and not rp.wants_point(keys, new)   # in place: light
    # a faster link is suspected just the same
    rp.observe([{8: [[4e6, 0.3]] + steady[1:]}])
    assert rp.suspects_change()


def test_a_server_whose_link_got_faster_is_taken_as_fast_as_the_others_at_once():
    # server 0 was slow and held a small share: after its link recovers it moves its few bytes
    # at a throughput well under its link's; waiting for it to climb back would take a
    # re-plan per step
    rp = Replanner(3, 1)
    rp.observe([{r: [[1e6, 0.1], [4e6, 0.1], [4e6, 0.1]] for r in (1, 2, 3)}])   # 10, 40, 40
    assert rp.rates == [1e7, 4e7, 4e7]
    rp.observe([{4: [[1e6, 0.04], [4e6, 0.1], [4e6, 0.1]]}])                      # 25 MB/s
    assert rp.rates == pytest.approx([4e7, 4e7, 4e7])
    # ... and if it is really slower than the others, its loaded rounds pull it down
    rp.observe([{5: [[4e6, 0.2], [4e6, 0.1], [4e6, 0.1]]}])                       # 20 MB/s
    rp.observe([{6: [[4e6, 0.2], [4e6, 0.1], [4e6, 0.1]]}])
    assert rp.rates == pytest.approx([2e7, 4e7, 4e7])
    # a server still far below the others is taken as measured, even after a jump (a slow
    # server's throughput also rises when a re-plan gives it more bytes)
    rp = Replanner(3, 1)
    rp.observe([{r: [[1e5, 0.1], [4e6, 0.1], [4e6, 0.1]] for r in (1, 2, 3)}])   # 1, 40, 40
    rp.observe([{4: [[4e5, 0.1], [4e6, 0.1], [4e6, 0.1]]}])                       # 4 MB/s
    assert rp.rates == pytest.approx([4e6, 4e7, 4e7])
    # the link changes mid-round: server 1 drops at once (4x) while server 0's first faster
    # round is only partly faster (1.2x); its next round, 2x faster, decides
    rp = Replanner(3, 1)
    rp.observe([{r: [[1e6, 0.1], [4e6, 0.1], [4e6, 0.1]] for r in (1, 2, 3)}])   # 10, 40, 40
    rp.observe([{4: [[1e6, 0.083], [4e6, 0.4], [4e6, 0.1]]}])                     # 12, 10, 40
    assert rp.rates == pytest.approx([1.2e7, 1e7, 4e7], rel=0.01)
    rp.observe([{5: [[1e6, 0.04], [4e6, 0.4], [4e6, 0.1]]}])                      # 25, 10, 40
    assert rp.rates == pytest.approx([4e7, 1e7, 4e7], rel=0.01)


def test_replan_gain_is_the_makespan_difference_and_the_cost_scales_with_state_copies():
    keys = [(0, 4 * M), (1, 4 * M)]
    old = split_table(keys, [1.0, 1.0], M)          # even split
    new = split_table(keys, [3.0, 1.0], M)          # three quarters on server 0
    b = [3e6, 1e6]
    sizes = dict(keys)
    gain, cost1 = replan_gain(old, new, b, 1e-9, 4, 1)
    assert gain == pytest.approx(makespan(old, sizes, b) - makespan(new, sizes, b))
    assert gain > 0
    _, cost3 = replan_gain(old, new, b, 1e-9, 4, 3)
    assert cost1 == pytest.approx(moved_bytes(old, new, 4) * 1e-9) and cost1 > 0
    assert cost3 == pytest.approx(3 * cost1)
    # no change, no gain and nothing to move
    assert replan_gain(old, old, b, 1e-9) == (0.0, 0.0)


def test_replan_gain_refuses_a_negative_cost_naming_it():
    t = split_table([(0, 10)], [1.0])
    with pytest.raises(ValueError, match="move_cost_s_per_byte"):
        replan_gain(t, t, [1.0], -1.0)



def test_a_diverted_server_is_planned_at_its_rate_before_the_change_times_the_fall():
    # MXPS_DIVERT: a point already saw half of the change (26 of 80 MB/s); the worker saw the
    # server's ACKs at 0.25 of its last rounds': 80 x 0.25 = 20, not 26 x 0.25
    r = Replanner(3, 2, rates=[80e6, 80e6, 80e6])
    r.recent.extend([[80e6, 80e6, 80e6], [80e6, 80e6, 26e6]])
    r.rates = [80e6, 80e6, 26e6]
    r.diverted(2, 0.25)
    assert r.rates == [80e6, 80e6, 20e6]
    assert list(r.window) == [[80e6, 80e6, 20e6]]
