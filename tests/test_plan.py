"""Placement (mxps/placement/plan.py): MXNet 1.9.1's EncodeKey rule, slice checks, the Plan table.

The reference below is written from MXNet 1.9.1 src/kvstore/kvstore_dist.h (EncodeDefaultKey):

    if (size < bigarray_bound_) server = (key * 9973) % num_servers;        // whole array
    else part_size(i) = round((double)size / num_servers * (i + 1))
                      - round((double)size / num_servers * i);            // on server i

with C's ``round`` (halfway cases away from zero), done here exactly with ``decimal``.
"""
from decimal import ROUND_HALF_UP, Decimal

import pytest
from hypothesis import assume, example, given, settings, strategies as st

from mxps.placement.plan import Plan, PlanError, Slice, check_slices, mxnet_default_rule

# key * 9973 must fit a C int, as it does in MXNet (larger keys overflow there)
KEYS = st.integers(0, (2 ** 31 - 1) // 9973)


def c_round(x):
    """C's round() of a double, exactly: Decimal(x) is the double's exact value."""
    return int(Decimal(x).quantize(Decimal(1), rounding=ROUND_HALF_UP))


def mxnet_encode_key(key, size, num_servers, bound):
    """[(server, offset, length)] as MXNet 1.9.1 places it, zero-length parts dropped."""
    if size < bound:
        return [((key * 9973) % num_servers, 0, size)]
    out = []
    for i in range(num_servers):
        lo = c_round(float(size) / num_servers * i)
        hi = c_round(float(size) / num_servers * (i + 1))
        if hi > lo:
            out.append((i, lo, hi - lo))
    return out


def as_tuples(slices):
    return [(s.server, s.offset, s.length) for s in slices]


# --- mxnet_default_rule == MXNet's EncodeKey ---------------------------------------------------

@settings(max_examples=500, deadline=None)
@given(key=KEYS, size=st.integers(1, 10 ** 9), num_servers=st.integers(1, 64),
       bound=st.integers(1, 2 * 10 ** 6))
def test_default_rule_reproduces_mxnet_encode_key(key, size, num_servers, bound):
    # size >= num_servers: every array MXNet splits in practice (bound >> servers); tiny
    # splits are covered by test_default_rule_rounds_a_tiny_split_like_c below.
    assume(size >= num_servers or size < bound)
    got = mxnet_default_rule(key, size, num_servers, bound)
    assert as_tuples(got) == mxnet_encode_key(key, size, num_servers, bound)


@settings(max_examples=300, deadline=None)
@given(key=KEYS, half=st.integers(0, 10 ** 8), num_servers=st.sampled_from([2, 4, 8, 16, 32]))
def test_default_rule_rounds_halfway_boundaries_away_from_zero(key, half, num_servers):
    # size = odd multiple of num_servers / 2: boundary i=1 sits exactly on .5
    size = (2 * half + 1) * num_servers // 2
    assume(size >= num_servers)
    got = mxnet_default_rule(key, size, num_servers, 1)
    assert as_tuples(got) == mxnet_encode_key(key, size, num_servers, 1)


def test_default_rule_differs_from_bankers_rounding_on_a_halfway_boundary():
    # 1000001 elements on 2 servers: the boundary is 500000.5. C rounds it up (MXNet puts
    # 500001 elements on server 0); Python's round() would give 500000.
    assert round(1000001 / 2) == 500000
    assert c_round(1000001 / 2) == 500001
    got = mxnet_default_rule(0, 1000001, 2, 10 ** 6)
    assert got == (Slice(0, 0, 500001), Slice(1, 500001, 500000))
    # and a small one: 5 elements on 2 servers, boundary 2.5 -> 3
    assert mxnet_default_rule(0, 5, 2, 1) == (Slice(0, 0, 3), Slice(1, 3, 2))


def test_default_rule_rounds_a_tiny_split_like_c():
    x = 1.0 / 98 * 49
    assert x == 0.49999999999999994 and c_round(x) == 0
    assert as_tuples(mxnet_default_rule(0, 1, 98, 1)) == mxnet_encode_key(0, 1, 98, 1) \
        == [(49, 0, 1)]


@pytest.mark.parametrize("key,servers,expect", [(0, 3, 0), (1, 3, 9973 % 3), (5, 4, 49865 % 4),
                                                (123, 7, (123 * 9973) % 7)])
def test_small_array_goes_whole_to_key_times_9973_mod_servers(key, servers, expect):
    assert mxnet_default_rule(key, 10, servers, 11) == (Slice(expect, 0, 10),)


def test_array_of_exactly_the_bound_is_split():
    assert len(mxnet_default_rule(1, 1000, 4, 1000)) == 4
    assert len(mxnet_default_rule(1, 999, 4, 1000)) == 1


@settings(max_examples=300, deadline=None)
@given(key=KEYS, size=st.integers(10 ** 6, 10 ** 10), num_servers=st.integers(1, 128))
def test_big_arrays_are_split_evenly(key, size, num_servers):
    lengths = [s.length for s in mxnet_default_rule(key, size, num_servers, 10 ** 6)]
    assert len(lengths) == num_servers
    assert max(lengths) - min(lengths) <= 1
    assert sum(lengths) == size


# --- every element placed exactly once ----------------------------------------------------------

@settings(max_examples=500, deadline=None)
@given(key=KEYS, size=st.integers(1, 10 ** 9), num_servers=st.integers(1, 64),
       bound=st.integers(0, 2 * 10 ** 6))
def test_default_rule_places_every_element_once_in_order_one_slice_per_server(
        key, size, num_servers, bound):
    slices = mxnet_default_rule(key, size, num_servers, bound)
    check_slices(key, size, slices, num_servers)        # raises PlanError otherwise
    pos = 0
    for s in slices:
        assert s.offset == pos and s.length > 0 and 0 <= s.server < num_servers
        pos = s.stop
    assert pos == size
    assert len({s.server for s in slices}) == len(slices)


@pytest.mark.parametrize("slices,problem", [
    ((Slice(0, 0, 5), Slice(1, 6, 4)), "does not continue at element 5"),      # a gap
    ((Slice(0, 0, 5), Slice(1, 4, 6)), "does not continue at element 5"),      # overlap
    ((Slice(1, 5, 5), Slice(0, 0, 5)), "does not continue at element 0"),      # out of order
    ((Slice(0, 0, 5), Slice(0, 5, 5)), "two slices on server 0"),
    ((Slice(0, 0, 5), Slice(2, 5, 5)), "slice on server 2, only 2 servers"),
    ((Slice(-1, 0, 10),), "slice on server -1"),
    ((Slice(0, 0, 4), Slice(1, 4, 0)), "does not continue"),                   # empty slice
    ((Slice(0, 0, 4), Slice(1, 4, 5)), "slices cover 9 of 10 elements"),
    ((), "slices cover 0 of 10 elements"),
])
def test_check_slices_rejects_bad_placements_naming_the_key(slices, problem):
    with pytest.raises(PlanError) as e:
        check_slices("fc1_weight", 10, slices, 2)
    assert "key 'fc1_weight'" in str(e.value)
    assert problem in str(e.value)


def test_check_slices_wants_one_empty_slice_for_an_empty_key():
    check_slices(3, 0, (Slice(1, 0, 0),), 2)       # an empty key still has an owner
    for bad in ((), (Slice(1, 0, 0), Slice(0, 0, 0)), (Slice(2, 0, 0),), (Slice(1, 0, 1),)):
        with pytest.raises(PlanError, match="key 3"):
            check_slices(3, 0, bad, 2)


# --- Plan -------------------------------------------------------------------------------------

def test_plan_caches_the_slices_of_a_key():
    calls = []

    def rule(key, size, num_servers, bound):
        calls.append(key)
        return mxnet_default_rule(key, size, num_servers, bound)

    p = Plan(3, bigarray_bound=100, rule=rule)
    first = p.slices(7, 1000)
    assert p.slices(7, 1000) is first
    assert calls == [7]
    assert list(p.keys()) == [7]


def test_plan_rejects_a_size_change_of_a_known_key_naming_the_key():
    p = Plan(2)
    p.slices(12, 100)
    with pytest.raises(PlanError) as e:
        p.slices(12, 101)
    assert "key 12" in str(e.value) and "101" in str(e.value) and "100" in str(e.value)


def test_plan_rejects_a_size_that_disagrees_with_a_given_table():
    p = Plan(2, version=3, table={5: (Slice(1, 0, 4), Slice(0, 4, 6))})
    assert p.slices(5, 10) == (Slice(1, 0, 4), Slice(0, 4, 6))
    assert p.version == 3
    with pytest.raises(PlanError, match="key 5"):
        p.slices(5, 11)


def test_plan_checks_what_its_rule_returns():
    p = Plan(2, rule=lambda key, size, n, bound: (Slice(0, 0, size - 1),))
    with pytest.raises(PlanError, match="key 4: slices cover 9 of 10"):
        p.slices(4, 10)
    assert 4 not in p.keys()


def test_plan_needs_a_server():
    with pytest.raises(PlanError, match="got 0"):
        Plan(0)


def test_plan_uses_its_bigarray_bound():
    assert len(Plan(4, bigarray_bound=50).slices(1, 50)) == 4
    assert len(Plan(4, bigarray_bound=51).slices(1, 50)) == 1


@settings(max_examples=100, deadline=None)
@given(sizes=st.dictionaries(KEYS, st.integers(1, 5 * 10 ** 6), max_size=30),
       num_servers=st.integers(1, 16), bound=st.integers(1, 10 ** 6))
def test_elements_per_server_sums_every_placed_element(sizes, num_servers, bound):
    p = Plan(num_servers, bigarray_bound=bound)
    expect = [0] * num_servers
    for key, size in sizes.items():
        for server, _, length in mxnet_encode_key(key, size, num_servers, bound):
            expect[server] += length
        p.slices(key, size)
    per = p.elements_per_server()
    assert sum(per) == sum(sizes.values())
    if all(s >= num_servers or s < bound for s in sizes.values()):
        assert per == expect


def test_plan_places_an_empty_array():
    p = Plan(4)
    check_slices(3, 0, p.slices(3, 0), 4)


# --- ProportionalRule: the online, bandwidth-proportional placement (MXPS_PLAN=adaptive) -------

from mxps.placement.plan import ProportionalRule  # noqa: E402


@settings(max_examples=150, deadline=None)
@given(sizes=st.lists(st.integers(0, 3_000_000), min_size=1, max_size=60),
       rates=st.lists(st.floats(0.5, 20.0), min_size=1, max_size=6),
       min_slice=st.sampled_from([1, 1024, 16384]))
@example(sizes=[257479], rates=[12.0, 0.5, 0.5, 0.75], min_slice=16384)
def test_proportional_rule_places_every_element_once_with_loads_near_the_rate_shares(
        sizes, rates, min_slice):
    plan = Plan(len(rates), rule=ProportionalRule(rates, min_slice))
    for key, n in enumerate(sizes):
        check_slices(key, n, plan.slices(key, n), len(rates))     # once, in order, <=1/server
    loads = plan.elements_per_server()
    total = sum(sizes)
    # every server within one unsplittable unit of its rate share: a whole key under
    # 2*min_slice, or, for a cut key, the parts of the servers whose slice would fall under
    # min_slice (+1 for rounding), which go to the others: up to (servers-1) of them
    # (hypothesis found rates [12, .5, .5, .75]: three such parts, 32769 elements together,
    # all on server 0, for one key of 257479 at min_slice 16384)
    cut_unit = (len(rates) - 1) * (min_slice + 1)
    unit = max([n if n < 2 * min_slice else cut_unit for n in sizes] + [0]) + len(sizes)
    for s, load in enumerate(loads):
        assert abs(load - total * rates[s] / sum(rates)) <= unit + 1, (s, loads, rates)


def test_proportional_rule_gives_the_slow_server_its_share_of_resnet18_like_keys():
    sizes = [64] * 40 + [1728, 36864, 147456, 589824, 2359296] * 4
    rates = [1.0, 4.0, 4.0, 4.0]
    plan = Plan(4, rule=ProportionalRule(rates, 16384))
    for key, n in enumerate(sizes):
        plan.slices(key, n)
    share = plan.elements_per_server()[0] / sum(sizes)
    assert abs(share - 1 / 13) < 0.002
    # and the same inputs give the same plan on every worker
    again = Plan(4, rule=ProportionalRule(rates, 16384))
    assert all(again.slices(k, n) == plan.slices(k, n) for k, n in enumerate(sizes))


def test_proportional_rule_refuses_non_positive_rates():
    with pytest.raises(PlanError, match="positive"):
        ProportionalRule([1.0, 0.0])


@settings(max_examples=200, deadline=None)
@given(key=st.integers(0, 10 ** 6), size=st.integers(0, 5 * 10 ** 6),
       num_servers=st.integers(1, 8), chunk=st.integers(1, 300000))
def test_chunked_rule_holds_mxnets_elements_on_mxnets_servers_in_chunks(key, size, num_servers,
                                                                        chunk):
    from mxps.placement.plan import chunked_rule
    size = min(size, chunk * 5000)  # at most 5000 chunks: millions of 1-element chunks test
    bound = 1000 * 1000             # nothing more and took most of a minute
    default = mxnet_default_rule(key, size, num_servers, bound)
    chunks = chunked_rule(chunk)(key, size, num_servers, bound)
    check_slices(key, size, chunks, num_servers, one_per_server=False)
    assert all(c.length <= chunk for c in chunks if size)

    def owner(slices, i):
        return next(s.server for s in slices if s.offset <= i < s.stop)
    for s in default:      # every element stays on MXNet's server
        for i in (s.offset, s.offset + s.length // 2, s.stop - 1):
            if s.length:
                assert owner(chunks, i) == s.server


def test_the_default_chunk_holds_2_mb_over_all_workers_between_256_kb_and_1_mb():
    """MXPS_MAX_CHUNK's default follows the workers: W copies of a chunk make 2 MB of
    float32, within [64 Ki, 256 Ki] elements; a value set by the user wins, 0 included."""
    from mxps import config
    base = {"DMLC_ROLE": "worker", "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9000",
            "DMLC_NUM_SERVER": "2"}
    got = {w: config.from_env(dict(base, DMLC_NUM_WORKER=str(w))).max_chunk
           for w in (1, 2, 3, 4, 5, 8, 9, 64)}
    assert got == {1: 262144, 2: 262144, 3: 174762, 4: 131072, 5: 104857, 8: 65536, 9: 65536,
                   64: 65536}
    for w, chunk in got.items():
        assert 65536 <= chunk <= 262144
        assert chunk == 65536 or chunk == 262144 or chunk * w <= 524288 < (chunk + 1) * w
    for w in (2, 8):
        for v in ("0", "300", "1000000"):
            env = dict(base, DMLC_NUM_WORKER=str(w), MXPS_MAX_CHUNK=v)
            assert config.from_env(env).max_chunk == int(v)
    with pytest.raises(config.ConfigError, match="MXPS_MAX_CHUNK"):
        config.from_env(dict(base, DMLC_NUM_WORKER="8", MXPS_MAX_CHUNK="-1"))


def test_a_lost_servers_slices_go_whole_to_the_least_loaded_survivors_and_later_keys_avoid_it():
    # MXPS_FAILOVER (placement.failover): every worker computes the same successor table
    p = Plan(3, table={1: (Slice(0, 0, 10), Slice(1, 10, 30), Slice(2, 40, 10)),
                       2: (Slice(1, 0, 5),), 3: (Slice(2, 0, 8),)})
    q, moved = p.without(4, [1])
    assert q.version == 4 and q.lost == {1}
    # server 0 holds 10 elements, server 2 18: key 1's lost slice (30) goes to server 0, then
    # key 2's (5) to server 2 (18 < 40); the survivors' slices stay where they were
    assert q.table() == {1: (Slice(0, 0, 10), Slice(0, 10, 30), Slice(2, 40, 10)),
                         2: (Slice(2, 0, 5),), 3: (Slice(2, 0, 8),)}
    assert moved == {(1, 10): 0, (2, 0): 2}
    assert q.without(5, [1])[1] == {}, "losing it twice moves nothing"
    # a key placed after the loss by the rule puts nothing on the lost server
    big = q.slices(9, 3 * 1000 * 1000)
    assert sum(x.length for x in big) == 3 * 1000 * 1000 and all(x.server != 1 for x in big)
    assert q.replaced(6, {}).lost == {1}
    with pytest.raises(ValueError, match="no server survives"):
        q.without(7, [0, 2])


def test_with_replicas_a_lost_servers_slices_go_to_its_buddy_the_next_server_alive():
    p = Plan(3, table={1: (Slice(0, 0, 10), Slice(1, 10, 30), Slice(2, 40, 10))})
    q, moved = p.without(1, [2], buddies=True)
    assert moved == {(1, 40): 0}                       # server 2's buddy: 0 (cyclic)
    r, moved = q.without(2, [0], buddies=True)
    assert moved == {(1, 0): 1, (1, 40): 1}            # server 0's buddy, 2 being lost: 1
