"""mxps.placement.rows: placing a sparse table's rows by bandwidth and by cache."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from mxps.placement import rows as pr

PROPS = settings(max_examples=200, deadline=None)


@st.composite
def problems(draw):
    n = draw(st.integers(1, 60))
    s = draw(st.integers(1, 4))
    freq = np.array(draw(st.lists(st.floats(0, 100), min_size=n, max_size=n)))
    rates = draw(st.lists(st.floats(0.5, 10), min_size=s, max_size=s))
    cache = draw(st.lists(st.integers(0, n), min_size=s, max_size=s))
    io = draw(st.sampled_from([0.0, 0.01, 1.0]))
    return freq, rates, cache, io


@PROPS
@given(problems())
def test_the_placement_is_a_permutation_into_contiguous_ranges_hot_rows_first(p):
    freq, rates, cache, io = p
    perm, counts, assign, _ = pr.place_rows(freq, rates, cache, io)
    assert sorted(perm.tolist()) == list(range(len(freq)))
    assert sum(counts) == len(freq)
    starts = np.concatenate(([0], np.cumsum(counts)))
    for s in range(len(rates)):
        mine = np.flatnonzero(assign == s)
        assert sorted(perm[mine].tolist()) == list(range(starts[s], starts[s + 1]))
        by_pos = mine[np.argsort(perm[mine])]
        assert (np.diff(freq[by_pos]) <= 1e-12).all()          # decreasing frequency


@PROPS
@given(problems())
def test_it_is_never_slower_than_the_contiguous_split_mxps_uses_without_it(p):
    freq, rates, cache, io = p
    _, _, assign, _ = pr.place_rows(freq, rates, cache, io)
    base = pr.contiguous(len(freq), rates)
    assert pr.cost(assign, freq, rates, cache, io) <= pr.cost(base, freq, rates, cache, io) + 1e-9


@PROPS
@given(st.lists(st.floats(0, 100), min_size=1, max_size=80),
       st.lists(st.floats(0.5, 10), min_size=1, max_size=4))
def test_without_disk_cost_each_server_is_within_one_row_of_the_balanced_time(freq, rates):
    """List scheduling: the slowest server exceeds the ideal (all traffic spread exactly in
    proportion to the rates) by at most one row's time on the slowest link."""
    freq = np.array(freq)
    big = [len(freq)] * len(rates)
    _, _, assign, _ = pr.place_rows(freq, rates, big, 0.0)
    ideal = freq.sum() / sum(rates)
    assert pr.cost(assign, freq, rates, big) <= ideal + freq.max() / min(rates) + 1e-9


def test_zipf_rows_with_ids_in_frequency_order_are_spread_instead_of_piled_on_one_server():
    """The case that motivates it: ids numbered by frequency (a vocabulary), two equal servers:
    the contiguous split gives server 0 nearly all the traffic."""
    n = 10000
    freq = 1.0 / np.arange(1, n + 1) ** 1.1
    perm, counts, assign, chosen = pr.place_rows(freq, [1.0, 1.0], [1000, 1000], 0.001)
    base = pr.contiguous(n, [1.0, 1.0])
    assert chosen == "greedy"
    assert pr.cost(assign, freq, [1, 1], [1000, 1000], 0.001) < \
        0.6 * pr.cost(base, freq, [1, 1], [1000, 1000], 0.001)
    shares = [freq[assign == s].sum() / freq.sum() for s in (0, 1)]
    assert abs(shares[0] - 0.5) < 0.01


def test_a_faster_server_gets_a_larger_share_of_the_traffic():
    freq = np.ones(3000)
    _, counts, assign, _ = pr.place_rows(freq, [3.0, 1.0], [3000, 3000], 0.0)
    assert abs(counts[0] / 3000 - 0.75) < 0.01


def test_bad_input_is_refused_by_name():
    with pytest.raises(ValueError, match="non-negative"):
        pr.place_rows([1, -1], [1.0], [1])
    with pytest.raises(ValueError, match="one positive rate and one cache size per server"):
        pr.place_rows([1, 1], [1.0, 0.0], [1, 1])
