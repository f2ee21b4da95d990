"""Finding a slow server from the ACKs of one worker's windowed pushes (MXPS_DIVERT)."""
from mxps.roles.slow_watch import SlowWatch


def feed(w, rates, rnd, t0, seconds, step=0.01):
    """ACKs from every server in ``rates`` (bytes/s, None: no backlog) for ``seconds`` from
    ``t0``, all backlogged; returns the end time."""
    t = t0
    while t < t0 + seconds - 1e-9:
        t += step
        for s, r in enumerate(rates):
            if r is not None:
                w.acked(s, rnd, r * step, t, True)
    return t


def history(w, rates, rounds=3):
    t = 0.0
    for rnd in range(1, rounds + 1):
        t = feed(w, rates, rnd, t + 0.1, 1.0)
    return t


def test_a_server_four_times_slower_than_before_while_the_others_are_not_is_reported_once():
    w = SlowWatch(3)
    t = history(w, [10e6, 10e6, 3e6])        # server 2 was slow already: its own reference
    t = feed(w, [10e6, 2.5e6, 3e6], 4, t + 0.1, 1.0)
    (got,) = w.slow(t)
    assert got[0] == 1 and 0.2 < got[1] < 0.3, got
    assert w.slow(t) == [], "reported once per round"
    t = feed(w, [10e6, 2.5e6, 3e6], 5, t, 1.0)
    assert [s for s, _ in w.slow(t)] == [1], "and again in the next round"


def test_every_server_slower_together_is_not_a_slow_server():
    # this worker's own link, its CPU, a busier machine: moving slices would not help
    w = SlowWatch(3)
    t = history(w, [10e6, 10e6, 10e6])
    t = feed(w, [2e6, 2e6, 2e6], 4, t + 0.1, 1.0)
    assert w.slow(t) == []


def test_a_stall_shorter_than_the_window_is_not_slow_and_a_server_judged_alone_is_not():
    w = SlowWatch(2)
    t = history(w, [10e6, 10e6])
    t = feed(w, [10e6, 10e6], 4, t + 0.1, 1.0)
    t = feed(w, [10e6, None], 4, t, SlowWatch.WINDOW / 4)     # server 1 silent briefly
    t = feed(w, [10e6, 10e6], 4, t, SlowWatch.WINDOW)
    assert w.slow(t) == []
    w = SlowWatch(2)
    t = history(w, [10e6, 10e6])
    w.acked(0, 4, 1e5, t + 0.05, False)                      # server 0's queue ran dry
    t = feed(w, [None, 1e6], 4, t + 0.1, 1.0)                # no other server to compare
    assert w.slow(t) == []


def test_a_server_that_stops_answering_is_slow_and_one_diverted_needs_new_history():
    w = SlowWatch(2)
    t = history(w, [10e6, 10e6])
    w.acked(1, 4, 1e5, t + 0.01, True)           # server 1's backlog starts, then silence
    t = feed(w, [10e6, None], 4, t + 0.01, 1.0)
    (got,) = w.slow(t)
    assert got == (1, 0.0)
    w.forget(1)
    t = feed(w, [10e6, 1e6], 5, t, 1.0)
    assert w.slow(t) == [], "its history is of the link it had"


def test_when_the_slow_link_leaves_a_server_the_others_do_not_look_slow_beside_it():
    w = SlowWatch(3)
    t = history(w, [2.5e6, 10e6, 10e6])
    t = feed(w, [10e6, 10e6, 10e6], 4, t + 0.1, 1.0)
    assert w.slow(t) == []
