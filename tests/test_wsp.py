"""WSP (MXPS_MODE=wsp, mxps/roles/wsp.py and its use in server_state): a round waits for k of
W workers, a late push is folded into a later round, no gradient is more than s rounds stale.

The rules are pure functions (property tests); the server's use of them is driven message by
message: with k = W a WSP server answers exactly what a BSP server answers, and under any
arrival order hypothesis finds, every push is applied exactly once, no gradient is more than
s rounds stale, and the job never deadlocks (the workers finish and leave).
"""
import pickle

import mxnet as mx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from mxps import config
from mxps.roles import wsp
from mxps.roles.server_state import ServerState, WspSettings
from mxps.wire.frame import Header, MsgType, dtype_code

F32 = dtype_code(np.float32)
PROPS = settings(max_examples=200, deadline=None)
KEY, N = 3, 6


# --------------------------------------------------------------------------- the pure rules

intervals = st.lists(st.floats(1e-3, 10.0), min_size=1, max_size=12)


@PROPS
@given(intervals)
def test_k_waits_for_every_worker_near_the_median_and_at_least_one(xs):
    k = wsp.choose_k(xs)
    assert 1 <= k <= len(xs)
    xs_sorted = sorted(xs)
    median = float(np.median(xs))
    assert k == sum(1 for x in xs if x <= wsp.AUTO_FACTOR * median + 0.001)
    assert k >= (len(xs) + 1) // 2          # at least the faster half
    assert xs_sorted[k - 1] <= wsp.AUTO_FACTOR * median + 0.001


@PROPS
@given(intervals, st.floats(0.01, 100.0))
def test_without_slack_k_does_not_depend_on_the_time_unit(xs, c):
    assert wsp.choose_k([c * x for x in xs], slack=0) == wsp.choose_k(xs, slack=0) or \
        any(abs(x - wsp.AUTO_FACTOR * float(np.median(xs))) < 1e-6 * x for x in xs)


def test_until_every_worker_was_measured_k_is_all_of_them_and_a_straggler_is_left_out():
    assert wsp.choose_k([0.1, None, 0.1]) == 3
    assert wsp.choose_k([0.1, 0.1, 0.11, 0.3]) == 3         # 3x slower: not waited for
    assert wsp.choose_k([0.1, 0.1, 0.12, 0.14]) == 4        # jitter: waited for


@PROPS
@given(st.integers(1, 8), st.data())
def test_a_round_completes_only_with_k_contributors_and_no_one_too_stale(w, data):
    k = data.draw(st.integers(1, w))
    s = data.draw(st.integers(0, 4))
    r = data.draw(st.integers(1, 20))
    base = data.draw(st.lists(st.integers(0, r - 1), min_size=w, max_size=w))
    contributors = data.draw(st.sets(st.integers(0, w - 1)))
    gone = data.draw(st.sets(st.integers(0, w - 1)))
    ok = wsp.may_complete(r, contributors, base, k, s, gone)
    active = [x for x in range(w) if x not in gone]
    if ok:
        assert len(contributors) >= min(k, len(active))
        assert all(r - base[x] <= s for x in active if x not in contributors)
    else:
        assert len(contributors) < min(k, len(active)) or \
            any(r - base[x] > s for x in active if x not in contributors)
    if s == 0 and set(active) - set(contributors):
        assert not ok                        # s = 0 is BSP: every active worker is waited for


def test_a_push_goes_into_its_own_round_or_the_first_open_one_and_its_pull_waits_for_its_own():
    ws = wsp.SliceWsp(2)
    assert ws.place(0, 1, applied=0) == 1
    assert ws.place(0, 2, applied=0) == 2          # early: its own round
    assert ws.place(1, 1, applied=5) == 6          # late: folded into the next open round
    assert ws.place(1, 2, applied=5) == 6          # ... and so is the next: two gradients in 6
    assert ws.place(1, 7, applied=5) == 7
    # a pull waits for the round of its label, never for the later one a folded push joined
    assert ws.pull_round(1, 1) == 1 and ws.pull_round(1, 7) == 7
    assert ws.pull_round(1, 8) is None and ws.pull_round(1, 0) == 0
    with pytest.raises(ValueError, match="pushed round 7 after round 7"):
        ws.place(1, 7, applied=5)


def test_the_scale_is_the_full_rounds_expected_sum():
    assert wsp.scale(4, 4) == 1.0 and wsp.scale(4, 3) == pytest.approx(4 / 3)
    with pytest.raises(ValueError):
        wsp.scale(4, 0)


# --------------------------------------------------------------------------- the server

def sgd():
    return pickle.dumps(mx.optimizer.SGD(learning_rate=0.5, momentum=0.9))


def server(workers, k, s, optimizer=True, clock=None, replan_every=0):
    st_ = ServerState(0, workers, True,
                      wsp=None if k is None else WspSettings(k, s, clock, replan_every))
    if optimizer:
        st_.on_request(b"w0", Header(MsgType.SET_OPTIMIZER, sender=0), sgd())
    h = Header(MsgType.INIT, key=KEY, sender=0, length=N, dtype=F32)
    st_.on_request(b"w0", h, np.arange(N, dtype=np.float32))
    return st_


def msg(st_, type_, w, it, grad=None):
    h = Header(type_, key=KEY, sender=w, iteration=it, length=N,
               dtype=F32 if grad is not None else 0, request_id=1000 * w + it)
    return st_.on_request(b"w%d" % w, h, grad)


def replies(outs):
    """What the workers are told: (worker, type, iteration, value bytes)."""
    return [(o.dest, o.header.type, o.header.iteration,
             None if o.payload is None else np.array(o.payload, np.float32).tobytes())
            for o in outs]


def gradient(w, it):
    return (np.arange(N, dtype=np.float32) * (w + 1) + it) / 8.0


@PROPS
@given(st.integers(1, 4), st.integers(0, 3), st.randoms(use_true_random=False),
       st.booleans())
def test_with_k_equal_to_w_a_wsp_server_answers_exactly_what_a_bsp_server_answers(
        w, s, rng, optimizer):
    bsp, wsp_ = server(w, None, 0, optimizer), server(w, w, s, optimizer)
    steps = {x: 0 for x in range(w)}
    todo = []                     # per worker its next messages, in its own order
    for x in range(w):
        for it in range(1, 5):
            first = [("push", it), ("pull", it)]
            if rng.random() < 0.5:          # a PUSHPULL's pull may overtake its push
                first.reverse()
            todo.append((x, first))
    queues = {x: [m for y, ms in todo if y == x for m in ms] for x in range(w)}
    while any(queues.values()):
        x = rng.choice([y for y in range(w) if queues[y]])
        kind, it = queues[x].pop(0)
        if kind == "push":
            a = msg(bsp, MsgType.PUSH, x, it, gradient(x, it))
            b = msg(wsp_, MsgType.PUSH, x, it, gradient(x, it))
        else:
            a = msg(bsp, MsgType.PULL, x, it)
            b = msg(wsp_, MsgType.PULL, x, it)
        steps[x] += 1
        assert replies(a) == replies(b)
    np.testing.assert_array_equal(bsp.slots[(KEY, 0)].store.snapshot,
                                  wsp_.slots[(KEY, 0)].store.snapshot)
    assert wsp_.wsp_stats["folded"] == 0


class Job:
    """W simulated workers against one WSP server: each pushes, pulls, waits for the value,
    computes on it, T times, then leaves.  Records for every push the round of the value it
    was computed on."""

    def __init__(self, w, k, s, steps, clock=None):
        self.w, self.s, self.steps = w, s, steps
        self.srv = server(w, k, s, optimizer=False, clock=clock)
        self.base = [0] * w          # the round of the value each worker holds
        self.done = [0] * w          # pushes made
        self.waiting = [False] * w   # a pull not yet answered
        self.left = [False] * w
        self.computed_on = {}        # (worker, label) -> round of the value
        self.grads = {}

    def handle(self, outs):
        for o in outs:
            if o.header.type == MsgType.DATA:
                x = o.header.sender
                assert self.waiting[x]
                self.waiting[x] = False
                self.base[x] = self.srv.slots[(KEY, 0)].applied
            else:
                assert o.header.type == MsgType.ACK, o

    def can_act(self, x):
        return not self.left[x] and not self.waiting[x]

    def act(self, x):
        if self.done[x] == self.steps:
            self.left[x] = True
            self.handle(self.srv.on_request(b"w%d" % x, Header(MsgType.LEAVE, sender=x), None))
            return
        it = self.done[x] = self.done[x] + 1
        g = gradient(x, it)
        self.grads[(x, it)] = g
        self.computed_on[(x, it)] = self.base[x]
        self.waiting[x] = True
        self.handle(msg(self.srv, MsgType.PUSH, x, it, g))
        self.handle(msg(self.srv, MsgType.PULL, x, it))

    def run(self, pick):
        while not all(self.left):
            ready = [x for x in range(self.w) if self.can_act(x)]
            assert ready, "deadlock: every worker waits (bases %s, applied %d)" % (
                self.base, self.srv.slots[(KEY, 0)].applied)
            self.act(pick(ready))


@PROPS
@given(st.integers(1, 5), st.data(), st.randoms(use_true_random=False))
def test_under_any_arrival_order_every_push_is_applied_once_and_none_is_too_stale(w, data, rng):
    k = data.draw(st.integers(1, w), label="k")
    s = data.draw(st.integers(0, 3), label="s")
    # some workers much slower: they are picked less often
    weights = data.draw(st.lists(st.sampled_from([1, 1, 1, 0.2]), min_size=w, max_size=w))
    job = Job(w, k, s, steps=6)
    job.run(lambda ready: rng.choices(ready, [weights[x] for x in ready])[0])
    slot = job.srv.slots[(KEY, 0)]
    assert not slot.rounds and not slot.waiting            # nothing left behind
    landed = {}
    for (x, it), b in job.computed_on.items():
        r = slot.wsp.placed[x].get(it)
        if r is None:                                      # pruned: recompute from labels
            continue
        landed[(x, it)] = r
        assert wsp.staleness_of(r, b) <= s, (x, it, r, b)
    # without an optimizer the served value is the last round's scaled sum: rebuild it
    rounds = {}
    for (x, it), r in landed.items():
        rounds.setdefault(r, []).append(job.grads[(x, it)])
    if len(landed) == len(job.grads):
        assert sorted(rounds) == list(range(1, slot.applied + 1))   # every round had pushes
        last = rounds[slot.applied]
        want = sum(last) * np.float32(wsp.scale(w, len(last)))
        np.testing.assert_allclose(slot.store.snapshot, want, rtol=1e-6)
        assert sum(len(v) for v in rounds.values()) == w * 6          # each push once


def test_a_slow_worker_is_folded_in_and_the_fast_ones_do_not_wait_for_it_beyond_s():
    job = Job(3, k=2, s=2, steps=12)
    turn = [0]

    def pick(ready):             # worker 2 gets one turn in five while the others can go
        turn[0] += 1
        fast = [x for x in ready if x != 2]
        if 2 in ready and (turn[0] % 5 == 0 or not fast):
            return 2
        return fast[turn[0] % len(fast)]

    job.run(pick)
    slot = job.srv.slots[(KEY, 0)]
    assert job.srv.wsp_stats["folded"] > 0
    assert job.srv.wsp_stats["rounds"] == slot.applied
    assert job.srv.wsp_stats["contributions"] == 36
    assert slot.applied > 12                     # rounds without the slow worker happened


def test_the_round_before_a_replan_point_waits_for_every_workers_own_push():
    # points before rounds 4, 7, ... (MXPS_REPLAN_INTERVAL=3): round 3 takes worker 2's late
    # push of round 2 and still waits for its push of round 3; then no round is partly pushed
    srv = server(3, 2, 3, replan_every=3)
    slot = srv.slots[(KEY, 0)]
    for it in (1, 2, 3):
        for w in (0, 1):
            msg(srv, MsgType.PUSH, w, it, gradient(w, it))
    assert slot.applied == 2                      # rounds 1 and 2 without worker 2 (k = 2)
    msg(srv, MsgType.PUSH, 2, 1, gradient(2, 1))  # folded into round 3
    msg(srv, MsgType.PUSH, 2, 2, gradient(2, 2))  # folded into round 3
    assert slot.applied == 2 and srv.wsp_stats["folded"] == 2
    msg(srv, MsgType.PUSH, 2, 3, gradient(2, 3))
    assert slot.applied == 3 and not slot.rounds
    # without the point, round 3 completes with its first k pushes
    free = server(3, 2, 3)
    for it in (1, 2, 3):
        for w in (0, 1):
            msg(free, MsgType.PUSH, w, it, gradient(w, it))
    assert free.slots[(KEY, 0)].applied == 3


def test_auto_k_leaves_a_worker_with_a_three_times_longer_push_interval_out():
    t = [0.0]
    job = Job(3, k=0, s=5, steps=30, clock=lambda: t[0])
    for tick in range(1, 31):
        t[0] = float(tick)
        for x in (0, 1):
            if job.can_act(x) and job.done[x] < 30:
                job.act(x)
        if tick % 3 == 0 and job.can_act(2):
            job.act(2)
    ws = job.srv.slots[(KEY, 0)].wsp
    fast, slow = ws.intervals()[0], ws.intervals()[2]
    assert slow >= 2 * fast, ws.intervals()
    assert wsp.choose_k(ws.intervals()) == 2
    # the fast pair ran ahead: more rounds than the slow worker's pushes
    assert job.srv.slots[(KEY, 0)].applied > job.done[2] + 5


def test_a_leave_lets_the_remaining_worker_finish_alone():
    job = Job(2, k=2, s=3, steps=3)
    for _ in range(3):
        job.act(0)               # worker 0 pushes and waits for round 1
        job.act(1)
    job.act(0)                   # leaves
    assert job.left[0]
    job.act(1)
    assert job.left[1] and not job.srv.slots[(KEY, 0)].rounds


def test_a_second_leave_and_a_repeated_label_are_refused_naming_the_worker():
    s = server(2, 2, 1)
    s.on_request(b"w1", Header(MsgType.LEAVE, sender=1), None)
    out = s.on_request(b"w1", Header(MsgType.LEAVE, sender=1), None)
    assert out[0].header.type == MsgType.ERROR and b"worker 1 left twice" in out[0].payload
    msg(s, MsgType.PUSH, 0, 1, gradient(0, 1))
    out = msg(s, MsgType.PUSH, 0, 1, gradient(0, 1))
    assert out[0].header.type == MsgType.ERROR
    assert b"key 3: worker 0 pushed round 1 after round 1" in out[0].payload


# --------------------------------------------------------------------------- a real job

@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    import cluster
    return cluster.job_cache(tmp_path_factory)


def test_a_job_with_a_straggler_ends_and_its_fast_workers_do_not_wait_for_it_every_step(jobs):
    """3 workers, rank 2 sleeping 0.15 s in every step, k = 2, s = 2: the fast workers finish
    their 20 steps while the straggler is still at about a third of its own (so they wait
    for it only when the staleness bound says so), the straggler finishes alone (the others'
    LEAVE), and every worker ends with a finite model."""
    import cluster
    run = jobs.train(cluster.train_env("mxps", update_on_kvstore=True, MXPS_MODE="wsp",
                                       MXPS_WSP_K=2, MXPS_WSP_STALENESS=2,
                                       JOB_SLOW="2:0.15"), 3, 1)
    metas = [cluster.load_meta(run.out_dir, r) for r in range(3)]
    took = [sum(m["step_seconds"]) for m in metas]
    assert max(took[0], took[1]) < 0.75 * took[2], took
    for r in range(3):
        for name, w in cluster.load_weights(run.out_dir, r).items():
            assert np.isfinite(w).all(), (r, name)


def test_a_wsp_job_with_a_straggler_replanned_every_other_step_moves_its_slices_and_ends(jobs):
    """3 workers x 2 servers, rank 2 sleeping 0.1 s in every step, k = 2: a forced re-plan
    before every second round moves slices (weights, momentum, WSP bookkeeping) between the
    servers while rounds in between may complete without the straggler; the job ends and its
    model is finite (WSP's rounds depend on timing: no bit-exact reference)."""
    import cluster
    run = jobs.train(cluster.train_env(
        "mxps", update_on_kvstore=True, MXPS_MODE="wsp", MXPS_WSP_K=2, MXPS_WSP_STALENESS=2,
        JOB_SLOW="2:0.1", MXPS_REPLAN_FORCE=1, MXPS_REPLAN_INTERVAL=2, MXPS_MIN_SLICE=64,
        MXPS_MAX_CHUNK=300), 3, 2)
    moved = [p["moved_bytes"] for p in run.result.job_info["replan_points"] if p["new_plan"]]
    assert len(moved) >= 5 and min(moved) > 0, moved
    weights = [cluster.load_weights(run.out_dir, r) for r in range(3)]
    for name, w in weights[0].items():
        assert np.isfinite(w).all(), name


# --------------------------------------------------------------------------- settings

def env(**kw):
    base = {"DMLC_ROLE": "worker", "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9000",
            "DMLC_NUM_WORKER": "4", "DMLC_NUM_SERVER": "1"}
    base.update(kw)
    return base


def test_wsp_settings_are_read_and_bad_ones_refused_by_name():
    cfg = config.from_env(env(MXPS_MODE="wsp", MXPS_WSP_K="3", MXPS_WSP_STALENESS="1"))
    assert (cfg.mode, cfg.sync, cfg.wsp_k, cfg.wsp_staleness) == ("wsp", True, 3, 1)
    assert config.from_env(env(MXPS_MODE="wsp")).wsp_k == 0        # auto
    with pytest.raises(config.ConfigError, match="MXPS_WSP_K=5 exceeds DMLC_NUM_WORKER=4"):
        config.from_env(env(MXPS_MODE="wsp", MXPS_WSP_K="5"))
    with pytest.raises(config.ConfigError, match="MXPS_WSP_STALENESS"):
        config.from_env(env(MXPS_MODE="wsp", MXPS_WSP_STALENESS="-1"))
    assert config.from_env(env(MXPS_MODE="wsp", MXPS_PUSH="ltp")).push == "ltp"
    assert config.from_env(env(MXPS_MODE="wsp", MXPS_PLAN="adaptive")).replanning
# --------------------------------------------------------------------------- several keys

class MultiJob:
    """W simulated workers, several keys over one or two servers, as Gluon drives a kvstore:
    a step pushes every key and pulls every key (in an order of the worker's own, delivered
    one message at a time, interleaved with the other workers' messages), and the next step
    starts only when every pull of this one was answered.  Records for every push the round of
    the value it was computed on (per key)."""

    def __init__(self, w, k, s, steps, keys, servers, clock=None):
        self.w, self.s, self.steps, self.keys = w, s, steps, keys
        self.srvs = []
        for r in range(servers):
            st_ = ServerState(r, w, True, wsp=WspSettings(k, s, clock))
            self.srvs.append(st_)
        for key in range(keys):
            h = Header(MsgType.INIT, key=key, sender=0, length=N, dtype=F32)
            self.srv_of(key).on_request(b"w0", h, np.zeros(N, np.float32))
        self.base = {}               # (worker, key) -> round of the value it holds
        self.done = [0] * w
        self.queue = [[] for _ in range(w)]
        self.open_pulls = [set() for _ in range(w)]
        self.left = [False] * w
        self.computed_on = {}        # (worker, key, label) -> round of the value

    def srv_of(self, key):
        return self.srvs[key % len(self.srvs)]

    def slot(self, key):
        return self.srv_of(key).slots[(key, 0)]

    def can_act(self, x):
        return not self.left[x] and (self.queue[x] or not self.open_pulls[x])

    def act(self, x, rng):
        if not self.queue[x]:
            if self.done[x] == self.steps:
                self.left[x] = True
                for srv in self.srvs:
                    srv.on_request(b"w%d" % x, Header(MsgType.LEAVE, sender=x), None)
                return
            it = self.done[x] = self.done[x] + 1
            keys = list(range(self.keys))
            rng.shuffle(keys)
            pushes = [("push", key) for key in keys]
            pulls = [("pull", key) for key in keys]
            # Gluon pushes every key, then pulls every key; a PUSHPULL pairs them
            self.queue[x] = pushes + pulls if rng.random() < 0.5 else \
                [m for key in keys for m in (("push", key), ("pull", key))]
            for key in keys:
                self.computed_on[(x, key, it)] = self.base.get((x, key), 0)
            self.open_pulls[x] = set(keys)
        kind, key = self.queue[x].pop(0)
        it = self.done[x]
        h = Header(MsgType.PUSH if kind == "push" else MsgType.PULL, key=key, sender=x,
                   iteration=it, length=N, dtype=F32 if kind == "push" else 0,
                   request_id=1000 * x + it)
        srv = self.srv_of(key)
        outs = srv.on_request(b"w%d" % x, h, gradient(x, it) if kind == "push" else None)
        self.handle(srv, outs)

    def handle(self, srv, outs):
        for o in outs:
            if o.header.type == MsgType.DATA:
                x, key = o.header.sender, o.header.key
                assert key in self.open_pulls[x]
                self.open_pulls[x].discard(key)
                self.base[(x, key)] = srv.slots[(key, 0)].applied
            else:
                assert o.header.type == MsgType.ACK, o

    def run(self, pick, rng):
        while not all(self.left):
            ready = [x for x in range(self.w) if self.can_act(x)]
            assert ready, "deadlock: every worker waits (open pulls %s, applied %s)" % (
                self.open_pulls, [self.slot(key).applied for key in range(self.keys)])
            self.act(pick(ready), rng)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 5), st.integers(2, 4), st.integers(1, 2), st.data(),
       st.randoms(use_true_random=False))
def test_with_several_keys_and_servers_no_arrival_order_deadlocks_or_goes_too_stale(
        w, keys, servers, data, rng):
    k = data.draw(st.integers(1, w), label="k")
    s = data.draw(st.integers(0, 3), label="s")
    weights = data.draw(st.lists(st.sampled_from([1, 1, 1, 0.2]), min_size=w, max_size=w))
    job = MultiJob(w, k, s, steps=6, keys=keys, servers=servers)
    job.run(lambda ready: rng.choices(ready, [weights[x] for x in ready])[0], rng)
    for key in range(keys):
        slot = job.slot(key)
        assert not slot.rounds and not slot.waiting
        for (x, kk, it), b in job.computed_on.items():
            if kk == key:
                r = slot.wsp.placed[x].get(it)
                if r is not None:
                    assert wsp.staleness_of(r, b) <= s, (x, key, it, r, b)
