"""The scheduler's protocol, in-process: messages in, messages out, with a driven clock.

``SchedulerState`` holds every rule of the scheduler (mxps/roles/scheduler_state.py); these
tests feed it the messages nodes send and move its clock by hand, so rendezvous, barriers,
heartbeat deadlines, aborts, shutdown, bandwidth agreement and re-plan points are checked
without starting a process.  The last tests run the real loop (mxps/roles/scheduler.py) on
loopback with zmq sockets playing the nodes, for the MXPS_JOB_INFO file it writes.
"""
import dataclasses
import json
import logging
import os
import socket
import threading

import pytest

from mxps.config import Config
from mxps.placement import adaptive
from mxps.placement.failover import successors
from mxps.placement.plan import Slice, table_from_json, table_to_json
from mxps.roles import scheduler
from mxps.roles.link import EXIT_LOST_PEER
from mxps.roles.scheduler_state import BARRIER_KEY, SchedulerState
from mxps.wire import tcp as transport
from mxps.wire.frame import Header, MsgType

T0 = 1000.0
LOOPBACK = "127.0.0.1"


def make_cfg(workers=2, servers=2, **settings):
    # the quiescent switch unless a test asks for the overlapped one (MXPS_REPLAN_OVERLAP)
    settings.setdefault("replan_overlap", False)
    return Config(role="scheduler", root_uri=LOOPBACK, root_port=9000, num_workers=workers,
                  num_servers=servers, node_host=LOOPBACK, **settings)


class Job:
    """Drives a SchedulerState: ``send`` one node's message, ``tick`` the clock forward."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.now = T0
        self.state = SchedulerState(cfg, self.now)
        self.nodes = {}     # ident -> registration info

    def send(self, ident, type_, body=None, after=0.0):
        self.now += after
        if isinstance(body, (dict, list)):
            body = json.dumps(body).encode()
        elif isinstance(body, str):
            body = body.encode()
        return self.state.on_message(ident, Header(type_), body, self.now)

    def tick(self, after):
        self.now += after
        return self.state.tick(self.now)

    def register(self, ident, role, host=LOOPBACK, port=0, pid=None, mode="sync", after=0.0):
        info = {"role": role, "host": host, "port": port, "pid": pid or 100 + len(self.nodes),
                "mode": mode}
        self.nodes[ident] = info
        return self.send(ident, MsgType.REGISTER, info, after)

    def heartbeat_all(self, except_=(), after=0.0):
        self.now += after
        for ident in self.nodes:
            if ident not in except_:
                self.send(ident, MsgType.HEARTBEAT)


def sent(step, type_):
    """{ident: [body, ...]} of the messages of ``type_`` in ``step`` (JSON bodies decoded)."""
    out = {}
    for s in step.sends:
        if s.header.type == type_:
            body = s.body
            if body is not None:
                try:
                    body = json.loads(body)
                except ValueError:
                    body = body.decode()
            out.setdefault(s.ident, []).append(body)
    return out


def headers(step, type_):
    return {s.ident: s.header for s in step.sends if s.header.type == type_}


def started(workers=2, servers=2, **settings):
    """A job past its rendezvous: servers b"s0".. on ports 9100.., workers b"w0".. (ranks
    follow the idents' order)."""
    job = Job(make_cfg(workers, servers, **settings))
    for i in range(servers):
        job.register(b"s%d" % i, "server", port=9100 + i)
    for i in range(workers):
        step = job.register(b"w%d" % i, "worker", port=9200 + i)
    assert sent(step, MsgType.WELCOME), "the job did not start"
    return job


SERVERS = [b"s0", b"s1"]
WORKERS = [b"w0", b"w1"]
EVERYONE = SERVERS + WORKERS


# -- rendezvous ------------------------------------------------------------------------------

def test_ranks_follow_addresses_and_every_node_is_welcomed_with_the_server_list():
    job = Job(make_cfg(workers=2, servers=3))
    # registration order differs from address order; 127.0.0.10 sorts after 127.0.0.9
    steps = [job.register(b"sA", "server", host="127.0.0.10", port=7000),
             job.register(b"wA", "worker", host="127.0.0.2", port=0, pid=55),
             job.register(b"sB", "server", host="127.0.0.9", port=7001),
             job.register(b"wB", "worker", host="127.0.0.2", port=0, pid=44),
             job.register(b"sC", "server", host="127.0.0.9", port=6000)]
    assert all(not s.sends for s in steps[:-1]), "WELCOME before every node registered"
    welcome = {ident: bodies[0] for ident, bodies in sent(steps[-1], MsgType.WELCOME).items()}
    assert sorted(welcome) == [b"sA", b"sB", b"sC", b"wA", b"wB"]
    assert {i: w["rank"] for i, w in welcome.items()} == \
        {b"sC": 0, b"sB": 1, b"sA": 2, b"wB": 0, b"wA": 1}
    servers = [["127.0.0.9", 6000], ["127.0.0.9", 7001], ["127.0.0.10", 7000]]
    for ident, w in welcome.items():
        assert w["role"] == ("server" if ident.startswith(b"s") else "worker")
        assert w["servers"] == servers
        assert (w["num_workers"], w["num_servers"], w["mode"]) == (2, 3, "sync")


def test_a_third_server_is_refused_when_the_job_has_two():
    job = Job(make_cfg())
    job.register(b"s0", "server", port=1)
    job.register(b"s1", "server", port=2)
    step = job.register(b"s2", "server", port=3)
    assert sent(step, MsgType.ABORT) == {
        b"s2": ["the job already has 2 servers (DMLC_NUM_SERVER)"]}
    job.register(b"w0", "worker")
    step = job.register(b"w1", "worker")
    welcome = sent(step, MsgType.WELCOME)
    assert sorted(welcome) == sorted(EVERYONE)
    assert welcome[b"w0"][0]["servers"] == [[LOOPBACK, 1], [LOOPBACK, 2]]
    # once the job runs, a late node is refused the same way
    late = job.register(b"w2", "worker")
    assert sent(late, MsgType.ABORT) == {
        b"w2": ["the job already has 2 workers (DMLC_NUM_WORKER)"]}


def test_workers_disagreeing_on_the_mode_abort_the_job_naming_each():
    job = Job(make_cfg())
    job.register(b"s0", "server", port=1)
    job.register(b"s1", "server", port=2)
    job.register(b"w0", "worker", port=1, mode="async")
    step = job.register(b"w1", "worker", port=2, mode="sync")
    assert step.exit is not None and step.exit.code == EXIT_LOST_PEER
    assert "workers disagree on the mode: worker 0: async, worker 1: sync" in step.exit.reason
    aborts = sent(step, MsgType.ABORT)
    assert sorted(aborts) == sorted(EVERYONE)
    assert all(b == [step.exit.reason] for b in aborts.values())
    assert not sent(step, MsgType.WELCOME)


def test_nodes_missing_at_the_start_deadline_abort_the_job_naming_the_counts():
    job = Job(make_cfg(start_timeout=30.0))
    job.register(b"s0", "server")
    job.register(b"w0", "worker", after=5.0)
    assert job.tick(24.9).exit is None                  # 29.9 s after the scheduler started
    step = job.tick(0.1)
    assert step.exit.code == EXIT_LOST_PEER
    assert step.exit.reason.startswith("mxps scheduler: only 1 of 2 servers and 1 of 2 "
                                       "workers registered within 30 s (MXPS_START_TIMEOUT): ")
    # who is missing, by role and count, and who did register
    assert "1 of 2 servers missing (DMLC_NUM_SERVER=2; registered: 127.0.0.1:0 pid 100)" \
        in step.exit.reason
    assert "1 of 2 workers missing (DMLC_NUM_WORKER=2; registered: 127.0.0.1:0 pid 101)" \
        in step.exit.reason
    assert sorted(sent(step, MsgType.ABORT)) == [b"s0", b"w0"]
    # the facts name who did register (no ranks yet)
    assert step.facts["mode"] is None
    assert step.facts["servers"] == [{"rank": None, "host": LOOPBACK, "port": 0, "pid": 100}]
    assert step.facts["exit"] == {"code": EXIT_LOST_PEER, "reason": step.exit.reason}


# -- barriers --------------------------------------------------------------------------------

def test_barrier_is_released_only_when_every_worker_arrived():
    job = started(workers=3)
    assert not job.send(b"w0", MsgType.BARRIER).sends
    assert not job.send(b"w2", MsgType.BARRIER).sends
    step = job.send(b"w1", MsgType.BARRIER)
    acks = headers(step, MsgType.ACK)
    assert sorted(acks) == [b"w0", b"w1", b"w2"]
    assert all((h.key, h.iteration) == (BARRIER_KEY, 1) for h in acks.values())
    # the next barrier is a new one
    for w in (b"w2", b"w1"):
        assert not job.send(w, MsgType.BARRIER).sends
    acks = headers(job.send(b"w0", MsgType.BARRIER), MsgType.ACK)
    assert {h.iteration for h in acks.values()} == {2} and len(acks) == 3


def test_barrier_does_not_wait_for_a_finished_worker():
    job = started(workers=3)
    job.send(b"w2", MsgType.FINISH)
    job.send(b"w0", MsgType.BARRIER)
    acks = headers(job.send(b"w1", MsgType.BARRIER), MsgType.ACK)
    assert sorted(acks) == [b"w0", b"w1"]
    # a worker finishing while the others wait at a barrier releases them
    job.send(b"w0", MsgType.BARRIER)
    acks = headers(job.send(b"w1", MsgType.FINISH), MsgType.ACK)
    assert sorted(acks) == [b"w0"] and acks[b"w0"].iteration == 2


# -- liveness, aborts, shutdown --------------------------------------------------------------

def test_a_silent_node_aborts_the_job_naming_it_once_the_heartbeat_timeout_passed():
    job = started(heartbeat_timeout=10.0)
    for _ in range(10):                      # worker 1 says nothing from here on
        job.heartbeat_all(except_=[b"w1"], after=1.0)
        assert job.tick(0.0).exit is None
    assert job.tick(0.0).exit is None        # silent for exactly 10 s: not yet
    step = job.tick(0.5)
    assert step.exit.code == EXIT_LOST_PEER
    assert step.exit.reason == ("lost worker 1 (127.0.0.1:9201, pid 103): no heartbeat for "
                                "10.5 s (MXPS_HEARTBEAT_TIMEOUT=10.0); the process died or hangs")
    aborts = sent(step, MsgType.ABORT)
    assert sorted(aborts) == sorted(EVERYONE)
    assert all(b == [step.exit.reason] for b in aborts.values())
    assert not job.tick(5.0).sends, "the job ended; nothing more is sent"


def test_with_failover_a_silent_server_is_left_behind_and_the_survivors_get_its_slices():
    # MXPS_FAILOVER: server 1 goes silent; the workers are told (not aborted), the first
    # worker's successor tables go to the surviving servers as a PLAN naming the lost one,
    # their acks put the failover in the job's facts, and the job ends without waiting for
    # the lost server's BYE
    job = started(servers=3, heartbeat_timeout=10.0, failover=True)
    for _ in range(10):
        job.heartbeat_all(except_=[b"s1"], after=1.0)
    step = job.tick(0.5)
    assert step.exit is None and not sent(step, MsgType.ABORT)
    notices = sent(step, MsgType.FAILOVER)
    assert sorted(notices) == WORKERS and notices[b"w0"] == [{"version": 1, "dead": 1}]
    old = {"0": [[0, 0, 4], [1, 4, 4], [2, 8, 4]], "1": [[1, 0, 6]]}
    new = {"0": [[0, 0, 4], [0, 4, 4], [2, 8, 4]], "1": [[2, 0, 6]]}
    step = job.send(b"w1", MsgType.FAILOVER, {"version": 1, "dead": 1, "old": old, "new": new})
    plans = sent(step, MsgType.PLAN)
    assert sorted(plans) == [b"s0", b"s2"]
    assert plans[b"s0"] == [{"version": 1, "old": old, "new": new, "lost": [1]}]
    assert not sent(job.send(b"w0", MsgType.FAILOVER, {"version": 1, "dead": 1, "old": old,
                                                        "new": new}), MsgType.PLAN)
    job.send(b"s0", MsgType.PLAN, {"version": 1, "moved_bytes": 0, "reset": []})
    step = job.send(b"s2", MsgType.PLAN, {"version": 1, "moved_bytes": 0,
                                          "reset": [[1, 0, 6]]})
    (fo,) = step.facts["failovers"]
    assert (fo["server"], fo["plan_version"], fo["slices"], fo["state_reset"]) == (
        1, 1, 2, [[1, 0, 6]])
    assert fo["in_place_at"] >= fo["detected_at"] > 10.0
    assert [x.get("lost", False) for x in step.facts["servers"]] == [False, True, False]
    # the lost server, back from a freeze, is told to go
    assert sent(job.send(b"s1", MsgType.HEARTBEAT), MsgType.ABORT)[b"s1"]
    for w in WORKERS:
        step = job.send(w, MsgType.FINISH)
    assert b"s1" not in job.state.leaving and job.state.leaving
    # a second lost server leaves none to take its keys: the job ends naming it
    job = started(heartbeat_timeout=10.0, failover=True)
    job.tick(0.0)
    for _ in range(11):
        job.heartbeat_all(except_=[b"s0"], after=1.0)
        step = job.tick(0.0)
        if step.exit is not None:
            break
    job.send(b"w0", MsgType.FAILOVER, {"version": 1, "dead": 0, "old": {"0": [[0, 0, 2]]},
                                       "new": {"0": [[1, 0, 2]]}})
    for _ in range(11):
        job.heartbeat_all(except_=[b"s0", b"s1"], after=1.0)
        step = job.tick(0.0)
        if step.exit is not None:
            break
    assert step.exit.code == EXIT_LOST_PEER and "lost server 1" in step.exit.reason


def test_heartbeats_are_echoed_and_any_message_counts_as_one():
    job = started(heartbeat_timeout=10.0)
    assert sent(job.send(b"s1", MsgType.HEARTBEAT, after=6.0), MsgType.HEARTBEAT) == \
        {b"s1": [None]}
    job.send(b"s0", MsgType.HEARTBEAT)
    job.send(b"w0", MsgType.BARRIER)         # not a heartbeat, but proof of life
    job.send(b"w1", MsgType.BARRIER)
    assert job.tick(9.0).exit is None        # 15 s since the start, 9 s since each node spoke


def test_a_finished_worker_is_not_watched_for_heartbeats():
    job = started(heartbeat_timeout=10.0)
    job.send(b"w1", MsgType.FINISH)
    for _ in range(30):
        job.heartbeat_all(except_=[b"w1"], after=1.0)
        assert job.tick(0.0).exit is None


def test_an_abort_from_a_node_is_relayed_to_every_node_naming_it():
    job = started()
    step = job.send(b"w1", MsgType.ABORT, "worker 1 raised RuntimeError: boom")
    assert step.exit.code == EXIT_LOST_PEER
    want = "worker 1 (127.0.0.1:9201, pid 103) failed: worker 1 raised RuntimeError: boom"
    assert step.exit.reason == want
    assert sent(step, MsgType.ABORT) == {i: [want] for i in EVERYONE}


def finished(job):
    """Every worker's FINISH: the step of the last one."""
    job.send(b"w0", MsgType.FINISH)
    return job.send(b"w1", MsgType.FINISH)


def test_finish_from_every_worker_shuts_every_node_down_with_exit_code_0_after_every_bye():
    job = started()
    step = job.send(b"w0", MsgType.FINISH)
    assert step.exit is None and not step.sends
    step = job.send(b"w1", MsgType.FINISH)
    assert sent(step, MsgType.SHUTDOWN) == {i: [None] for i in EVERYONE}
    # the scheduler stays until every node has its SHUTDOWN (its socket alive meanwhile)
    assert step.exit is None
    for ident in EVERYONE[:-1]:
        assert job.send(ident, MsgType.BYE, after=0.01).exit is None
    assert job.send(EVERYONE[-1], MsgType.BYE).exit.code == 0
    assert job.tick(60.0).exit is None and not job.tick(0).sends


def test_the_last_bye_ends_the_job_with_its_facts():
    job = started()
    finished(job)
    for ident in (b"w1", b"s0", b"w0"):
        assert job.send(ident, MsgType.BYE).exit is None
    assert job.send(b"w0", MsgType.BYE).exit is None, "a second BYE of one node counted twice"
    step = job.send(b"s1", MsgType.BYE)
    assert step.exit == (0, "all workers finished")
    assert step.facts["exit"] == {"code": 0, "reason": "all workers finished"}


def test_a_node_heartbeating_after_the_shutdown_gets_the_shutdown_again():
    job = started()
    finished(job)
    job.send(b"w0", MsgType.BYE)
    # s1's SHUTDOWN did not arrive (a zmq reconnection loses what was in flight): its heartbeat
    # is answered with the SHUTDOWN, not the echo
    step = job.send(b"s1", MsgType.HEARTBEAT, after=1.0)
    assert [(s.ident, s.header.type) for s in step.sends] == [(b"s1", MsgType.SHUTDOWN)]
    # one that said BYE gets nothing more, whatever it sends
    assert not job.send(b"w0", MsgType.HEARTBEAT).sends
    assert not job.send(b"stranger", MsgType.HEARTBEAT).sends


def test_nodes_silent_after_the_shutdown_end_the_job_at_the_heartbeat_timeout(caplog):
    job = started()             # MXPS_HEARTBEAT_TIMEOUT 10 s
    finished(job)
    job.send(b"w0", MsgType.BYE)
    job.send(b"w1", MsgType.BYE)
    assert job.tick(9.9).exit is None
    with caplog.at_level(logging.WARNING, logger="mxps.scheduler"):
        step = job.tick(0.1)
    assert step.exit == (0, "all workers finished")
    assert "no BYE from server 0 (127.0.0.1:9100, pid 100), server 1 (127.0.0.1:9101, pid " \
        "101) within 10.0 s of the SHUTDOWN" in caplog.text


# -- bandwidth agreement ---------------------------------------------------------------------

def test_a_servers_rate_is_all_bytes_over_the_slowest_workers_time():
    job = started(workers=2, servers=2)
    assert not job.send(b"w0", MsgType.BANDWIDTH,
                        {"bytes": [100e6, 300e6], "seconds": [1.0, 4.0]}).sends
    step = job.send(b"w1", MsgType.BANDWIDTH, {"bytes": [100e6, 100e6], "seconds": [2.0, 1.0]})
    agreed = sent(step, MsgType.BANDWIDTH)
    assert sorted(agreed) == WORKERS, "rates go to the workers only"
    assert agreed[b"w0"] == agreed[b"w1"] == [{"rates": [200e6 / 2.0, 400e6 / 4.0]}]
    # the agreed rates are what the re-plan answers carry from then on
    job.send(b"w0", MsgType.REPLAN, {"round": 2})
    answer = sent(job.send(b"w1", MsgType.REPLAN, {"round": 2}), MsgType.REPLAN)
    assert answer[b"w0"][0]["rates"] == [100e6, 100e6]


# -- live re-plan points ---------------------------------------------------------------------

KEYS = [(0, 1000), (1, 500)]
OLD = {0: (Slice(0, 0, 1000),), 1: (Slice(1, 0, 500),)}


def report(round_, full=True, force=0, lead=False):
    r = {"round": round_, "traffic": {}, "full": full, "force": force, "min_slice": 64,
         "max_chunk": 0, "min_gain": 1e9, "horizon": 20}
    if lead:
        r.update(keys=[list(k) for k in KEYS], table=table_to_json(OLD))
    return r


def test_a_server_lost_during_a_move_rolls_it_back_and_fails_over_from_the_plan_before():
    # MXPS_FAILOVER: plan 1 moves state (the workers wait at the point) when server 1 goes
    # silent; the survivors get plan 2, which rolls plan 1 back and puts the lost server's
    # slices of the table before it on the others (as the workers compute from the table they
    # hold), and the point is released with that table once it is in place
    job = started(servers=3, heartbeat_timeout=10.0, failover=True)
    keys = {"keys": [list(k) for k in KEYS], "table": table_to_json(OLD)}
    job.send(b"w1", MsgType.REPLAN, report(2, force=1))
    job.send(b"w0", MsgType.REPLAN, dict(report(2, force=1), **keys))
    job.send(b"s0", MsgType.PLAN, {"version": 1, "moved_bytes": 0})
    for _ in range(10):
        job.heartbeat_all(except_=[b"s1"], after=1.0)
    step = job.tick(0.5)
    assert step.exit is None and not sent(step, MsgType.REPLAN)
    plans = sent(step, MsgType.PLAN)
    assert sorted(plans) == [b"s0", b"s2"]
    (plan,) = plans[b"s0"]
    assert (plan["version"], plan["lost"], plan["abandon"]) == (2, [1], 1)
    new, _ = successors(OLD, {1}, 3)
    assert table_from_json(plan["old"]) == OLD and table_from_json(plan["new"]) == new
    assert sent(step, MsgType.FAILOVER)[b"w0"] == [{"version": 2, "dead": 1}]
    job.send(b"s0", MsgType.PLAN, {"version": 2, "moved_bytes": 0, "reset": []})
    step = job.send(b"s2", MsgType.PLAN, {"version": 2, "moved_bytes": 0, "reset": []})
    released = sent(step, MsgType.REPLAN)
    assert sorted(released) == WORKERS
    assert table_from_json(released[b"w0"][0]["table"]) == new
    (fo,) = step.facts["failovers"]
    assert (fo["during_plan"], fo["slices"]) == (1, 1) and fo["in_place_at"] is not None


def test_a_point_takes_traffic_with_or_without_the_rounds_second_half():
    job = started()
    a, b = report(2), report(2, lead=True)
    a["traffic"] = {"1": [[1e6, 0.1], [1e6, 0.1]]}
    b["traffic"] = {"1": [[1e6, 0.1, 5e5, 0.05], [1e6, 0.1, 5e5, 0.05]]}
    job.send(b"w1", MsgType.REPLAN, a)
    step = job.send(b"w0", MsgType.REPLAN, b)
    assert sorted(sent(step, MsgType.REPLAN)) == WORKERS and job.state.malformed == 0


def test_a_point_that_keeps_the_plan_releases_every_worker_at_once():
    job = started()
    assert not job.send(b"w1", MsgType.REPLAN, report(2)).sends
    step = job.send(b"w0", MsgType.REPLAN, report(2, lead=True))
    assert not sent(step, MsgType.PLAN)
    answers = sent(step, MsgType.REPLAN)
    assert sorted(answers) == WORKERS
    assert answers[b"w0"][0] == {"version": 0, "table": None, "rates": None,
                                 "full_next": False}
    assert headers(step, MsgType.REPLAN)[b"w1"].plan_version == 0


def test_a_new_plan_goes_to_the_servers_and_workers_wait_for_every_ack():
    job = started()
    job.send(b"w1", MsgType.REPLAN, report(2, force=1))
    step = job.send(b"w0", MsgType.REPLAN, report(2, force=1, lead=True))
    assert not sent(step, MsgType.REPLAN), "workers released before the state moved"
    plans = sent(step, MsgType.PLAN)
    assert sorted(plans) == SERVERS
    plan = plans[b"s0"][0]
    assert plan["version"] == 1 and table_from_json(plan["old"]) == OLD
    new = table_from_json(plan["new"])
    assert new == adaptive.forced_table(KEYS, 2, 1, min_slice=64) and new != OLD
    assert headers(step, MsgType.PLAN)[b"s1"].plan_version == 1
    # a stale ack (another version) and one server's ack release nobody
    assert not job.send(b"s1", MsgType.PLAN, {"version": 0}).sends
    assert not job.send(b"s1", MsgType.PLAN, {"version": 1, "moved_bytes": 100}).sends
    step = job.send(b"s0", MsgType.PLAN, {"version": 1, "moved_bytes": 60})
    answers = sent(step, MsgType.REPLAN)
    assert sorted(answers) == WORKERS
    a = answers[b"w1"][0]
    assert a["version"] == 1 and table_from_json(a["table"]) == new
    # what the servers sent (values and state), and per weight that changed server, the
    # copies the planner now charges a move with
    assert a["moved_bytes"] == 160
    planned = adaptive.moved_bytes(OLD, new, 4)
    assert planned > 0 and job.state.replanner.copies == pytest.approx(160 / planned)
    assert headers(step, MsgType.REPLAN)[b"w0"].plan_version == 1


def test_with_seeds_every_changed_part_is_given_to_a_worker_and_the_release_waits_for_acks():
    # MXPS_REPLAN_SEED: every worker reported it holds the keys' weights; the PLAN names who sends
    # each part that changes server, each worker gets its own tasks at once, and the release
    # (the new table) still waits for every server's ack
    job = started()
    job.send(b"w1", MsgType.REPLAN, dict(report(2, force=1), seed=[0, 1]))
    step = job.send(b"w0", MsgType.REPLAN, dict(report(2, force=1, lead=True), seed=[0, 1]))
    plan = sent(step, MsgType.PLAN)[b"s0"][0]
    new = table_from_json(plan["new"])
    seeds = plan["seeds"]
    assert seeds and {w for *_, w in seeds} == {0, 1}          # the workers share them:
    per = [sum(n for _, _, n, w in seeds if w == r) for r in (0, 1)]   # none sends more than
    assert max(per) - min(per) <= max(n for _, _, n, _ in seeds), per  # one part's excess
    changed = sum(n for _, _, n, _ in seeds)
    assert changed * 4 == adaptive.moved_bytes(OLD, new, 4)   # every element that moves, once
    tasks = sent(step, MsgType.REPLAN)
    assert sorted(tasks) == WORKERS
    for ident, rank in ((b"w0", 0), (b"w1", 1)):
        body = tasks[ident][0]
        assert body["version"] == 1 and body.get("table") is None
        assert sorted(t[:3] for t in body["seed"]) == sorted(
            [k, o, n] for k, o, n, w in seeds if w == rank)
        for k, o, n, srv in body["seed"]:      # to the slice's new owner
            assert any(x.server == srv and x.offset <= o and o + n <= x.stop for x in new[k])
    job.send(b"s1", MsgType.PLAN, {"version": 1, "moved_bytes": 0})
    step = job.send(b"s0", MsgType.PLAN, {"version": 1, "moved_bytes": 0})
    assert table_from_json(sent(step, MsgType.REPLAN)[b"w0"][0]["table"]) == new
    # only keys every worker holds are seeded (here key 1: worker 0 does not hold key 0, as
    # a key only pulled at the start, such as BatchNorm's running statistics); a move of the
    # others carries the weights as before
    job.send(b"w1", MsgType.REPLAN, dict(report(3, force=1), seed=[0, 1]))
    step = job.send(b"w0", MsgType.REPLAN, dict(report(3, force=1, lead=True), seed=[1]))
    seeds = sent(step, MsgType.PLAN)[b"s0"][0].get("seeds", [])
    assert {k for k, *_ in seeds} <= {1}


def test_overlapped_a_new_plan_releases_the_workers_with_it_and_the_next_point_waits_for_acks():
    job = started(replan_overlap=True)
    job.send(b"w1", MsgType.REPLAN, report(2, force=1))
    step = job.send(b"w0", MsgType.REPLAN, report(2, force=1, lead=True))
    plans, answers = sent(step, MsgType.PLAN), sent(step, MsgType.REPLAN)
    assert sorted(plans) == SERVERS and sorted(answers) == WORKERS
    new = table_from_json(plans[b"s0"][0]["new"])
    assert table_from_json(answers[b"w0"][0]["table"]) == new
    # PLAN goes out before the answers (a worker's first request of the new plan finds its
    # PLAN at the server, or waits there for it)
    kinds = [x.header.type for x in step.sends]
    assert kinds.index(MsgType.PLAN) < kinds.index(MsgType.REPLAN)
    # the next point: every worker is there, but plan 1's state is still moving
    job.send(b"w1", MsgType.REPLAN, report(3, force=1))
    step = job.send(b"w0", MsgType.REPLAN, report(3, force=1, lead=True))
    assert not step.sends, "a point decided while the last plan's state was still moving"
    job.send(b"s1", MsgType.PLAN, {"version": 1})
    step = job.send(b"s0", MsgType.PLAN, {"version": 1})
    assert sent(step, MsgType.PLAN)[b"s0"][0]["version"] == 2    # now decided: plan 2
    answers = sent(step, MsgType.REPLAN)                         # the round-3 point's answer
    assert sorted(answers) == WORKERS and answers[b"w1"] == [answers[b"w1"][0]]
    assert answers[b"w1"][0]["version"] == 2
    points = job.state.points                 # recorded when the workers were released
    assert [p["plan_version"] for p in points] == [1, 2]
    assert "in_place_at" in points[0] and "in_place_at" not in points[1]


def test_overlapped_the_round_a_move_overlapped_is_not_timed():
    job = started(replan_overlap=True)
    steady = {"1": [[4e6, 0.1], [4e6, 0.1]]}
    a, b = report(2, force=1), report(2, force=1, lead=True)
    a["traffic"], b["traffic"] = steady, steady
    job.send(b"w1", MsgType.REPLAN, a)
    job.send(b"w0", MsgType.REPLAN, b)                # forced plan 1 from round 2, overlapped
    job.send(b"s0", MsgType.PLAN, {"version": 1})
    job.send(b"s1", MsgType.PLAN, {"version": 1})
    rates = list(job.state.replanner.rates)
    # round 2: server 1 received state and answered late: 10x "slower", not a link
    a, b = report(3), report(3, lead=True)
    a["traffic"] = b["traffic"] = {"2": [[4e6, 0.1], [4e6, 1.0]]}
    job.send(b"w1", MsgType.REPLAN, a)
    job.send(b"w0", MsgType.REPLAN, b)
    assert job.state.replanner.rates == rates
    # round 3 is timed again
    a, b = report(4), report(4, lead=True)
    a["traffic"] = b["traffic"] = {"3": [[4e6, 0.1], [4e6, 1.0]]}
    job.send(b"w1", MsgType.REPLAN, a)
    job.send(b"w0", MsgType.REPLAN, b)
    assert job.state.replanner.rates[1] < rates[1] / 5


def test_a_light_point_says_the_next_one_is_full_exactly_when_a_forced_plan_is_due():
    job = started()
    kinds = []
    for round_, full in ((2, True), (3, False), (4, True)):
        job.send(b"w1", MsgType.REPLAN, report(round_, full=full, force=3))
        step = job.send(b"w0", MsgType.REPLAN, report(round_, full=full, force=3, lead=True))
        answers = sent(step, MsgType.REPLAN)
        kinds.append((bool(sent(step, MsgType.PLAN)),
                      answers[b"w0"][0]["full_next"] if answers else None))
    # point 1 keeps the plan (next: light), point 2 keeps it (next: full, the forced one is
    # due), point 3 sends a new plan to the servers
    assert kinds == [(False, False), (False, True), (True, None)]


def test_workers_at_different_rounds_abort_the_job_naming_each():
    job = started()
    job.send(b"w0", MsgType.REPLAN, report(3, lead=True))
    step = job.send(b"w1", MsgType.REPLAN, report(4))
    assert step.exit.code == EXIT_LOST_PEER
    assert "workers reached the re-plan point at different rounds (worker 0: 3, worker 1: 4)" \
        in step.exit.reason
    assert sorted(sent(step, MsgType.ABORT)) == sorted(EVERYONE)


def test_workers_disagreeing_on_the_kind_of_a_point_abort_naming_each():
    job = started()
    job.send(b"w0", MsgType.REPLAN, report(3, full=True, lead=True))
    step = job.send(b"w1", MsgType.REPLAN, report(3, full=False))
    assert step.exit.code == EXIT_LOST_PEER
    assert "(worker 0: True, worker 1: False)" in step.exit.reason


def test_a_point_does_not_wait_for_a_finished_worker():
    job = started(workers=3)
    job.send(b"w0", MsgType.REPLAN, report(5, lead=True))
    job.send(b"w1", MsgType.REPLAN, report(5))
    answers = sent(job.send(b"w2", MsgType.FINISH), MsgType.REPLAN)
    assert sorted(answers) == [b"w0", b"w1"]


def test_a_server_late_with_its_plan_ack_aborts_the_job_naming_it_at_the_deadline():
    job = started(timeout=30.0, heartbeat_timeout=10.0)
    job.send(b"w1", MsgType.REPLAN, report(2, force=1))
    job.send(b"w0", MsgType.REPLAN, report(2, force=1, lead=True))
    job.send(b"s0", MsgType.PLAN, {"version": 1})
    for _ in range(30):                      # everyone alive, server 1 never acknowledges
        job.heartbeat_all(after=1.0)
        assert job.tick(0.0).exit is None
    step = job.tick(0.5)
    assert step.exit.code == EXIT_LOST_PEER
    assert step.exit.reason == ("plan 1: server 1 (127.0.0.1:9101, pid 101) did not finish "
                                "moving state within 30 s (MXPS_TIMEOUT)")
    assert sorted(sent(step, MsgType.ABORT)) == sorted(EVERYONE)


def test_a_server_that_cannot_move_state_aborts_the_job_with_its_error():
    job = started()
    job.send(b"w1", MsgType.REPLAN, report(2, force=1))
    job.send(b"w0", MsgType.REPLAN, report(2, force=1, lead=True))
    step = job.send(b"s1", MsgType.PLAN, {"version": 1, "error": "key 0 partly pushed"})
    assert step.exit.reason == ("server 1 (127.0.0.1:9101, pid 101) could not move state for "
                                "plan 1: key 0 partly pushed")


# -- the job's facts -------------------------------------------------------------------------

def test_the_facts_name_every_node_by_rank_after_the_rendezvous_and_the_points_at_the_end():
    job = Job(make_cfg())
    job.register(b"s0", "server", host="127.0.0.3", port=5, pid=31)
    job.register(b"w0", "worker", host="127.0.0.2", pid=21)
    job.register(b"s1", "server", host="127.0.0.2", port=6, pid=32)
    step = job.register(b"w1", "worker", host="127.0.0.1", pid=22)
    assert step.facts == {
        "mode": "sync",
        "servers": [{"rank": 0, "host": "127.0.0.2", "port": 6, "pid": 32},
                    {"rank": 1, "host": "127.0.0.3", "port": 5, "pid": 31}],
        "workers": [{"rank": 0, "host": "127.0.0.1", "port": 0, "pid": 22},
                    {"rank": 1, "host": "127.0.0.2", "port": 0, "pid": 21}],
        "replan_points": [], "failovers": [], "diverts": [], "resume_round": None, "exit": None}
    assert job.send(b"w0", MsgType.BARRIER).facts is None, "facts are written twice, not often"
    # w1 is rank 0 (it sends the placement); the first point keeps the plan, the second is
    # forced (force=2) 3 s later
    job.send(b"w0", MsgType.REPLAN, report(2, force=2), after=1.0)
    job.send(b"w1", MsgType.REPLAN, report(2, force=2, lead=True))
    job.send(b"w0", MsgType.REPLAN, report(3, force=2), after=3.0)
    job.send(b"w1", MsgType.REPLAN, report(3, force=2, lead=True))
    job.send(b"s0", MsgType.PLAN, {"version": 1, "moved_bytes": 24})
    job.send(b"s1", MsgType.PLAN, {"version": 1, "moved_bytes": 40}, after=0.5)
    finished(job)
    for ident in (b"s0", b"s1", b"w0"):
        job.send(ident, MsgType.BYE)
    step = job.send(b"w1", MsgType.BYE)
    moved = 24 + 40                       # what the servers sent
    assert step.facts["replan_points"] == [
        {"round": 2, "kind": "full", "plan_version": 0, "new_plan": False, "full_next": True,
         "moved_bytes": 0, "at": 1.0},
        {"round": 3, "kind": "full", "plan_version": 1, "new_plan": True, "full_next": False,
         "moved_bytes": moved, "at": 4.5}]
    assert step.facts["exit"] == {"code": 0, "reason": "all workers finished"}
    assert step.facts["servers"][0]["host"] == "127.0.0.2"


def test_the_facts_of_an_aborted_job_carry_its_exit_code_and_reason():
    job = started()
    step = job.send(b"s0", MsgType.ABORT, "out of memory")
    assert step.facts["exit"] == {"code": EXIT_LOST_PEER, "reason": step.exit.reason}
    assert "server 0 (127.0.0.1:9100, pid 100) failed: out of memory" == step.exit.reason


def test_job_info_is_replaced_atomically(tmp_path):
    path = tmp_path / "job.json"
    scheduler.write_job_info(str(path), {"a": 1})
    scheduler.write_job_info(str(path), {"a": 2})
    assert json.loads(path.read_text()) == {"a": 2}
    assert os.listdir(tmp_path) == ["job.json"], "a temporary file was left behind"
    with pytest.raises(scheduler.JobInfoError, match=r"nowhere/job.json \(MXPS_JOB_INFO\)"):
        scheduler.write_job_info(str(tmp_path / "nowhere" / "job.json"), {})


# -- the loop around it, on loopback -----------------------------------------------------------

class Node:
    """A zmq DEALER playing one node towards the scheduler loop."""

    def __init__(self, port, role, node_port, start_heartbeats=False):
        self.sock = transport.connect_dealer(LOOPBACK, port)
        body = {"role": role, "host": LOOPBACK, "port": node_port, "pid": os.getpid(),
                "mode": "sync", "start_heartbeats": start_heartbeats}
        transport.send(self.sock, Header(MsgType.REGISTER), json.dumps(body).encode())

    def expect(self, type_, seconds=10.0):
        assert self.sock.poll(int(seconds * 1000)), "no %s within %.0f s" % (type_.name, seconds)
        _, h, payload = transport.recv(self.sock)
        assert h.type == type_, h
        return None if payload is None else payload.bytes

    def close(self):
        self.sock.close(linger=0)


def free_port():
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def run_loop(cfg):
    result = {}
    t = threading.Thread(target=lambda: result.update(code=scheduler.run(cfg)), daemon=True)
    t.start()
    return t, result


def test_the_loop_writes_the_job_info_after_the_rendezvous_and_at_the_end(tmp_path):
    info = tmp_path / "job.json"
    cfg = dataclasses.replace(make_cfg(workers=1, servers=1), root_port=free_port(),
                              job_info=str(info))
    thread, result = run_loop(cfg)
    server = Node(cfg.root_port, "server", 4321)
    worker = Node(cfg.root_port, "worker", 0)
    try:
        assert json.loads(server.expect(MsgType.WELCOME))["rank"] == 0
        assert json.loads(worker.expect(MsgType.WELCOME))["servers"] == [[LOOPBACK, 4321]]
        facts = json.loads(info.read_text())     # written before the WELCOMEs went out
        assert facts["servers"] == [{"rank": 0, "host": LOOPBACK, "port": 4321,
                                     "pid": os.getpid()}]
        assert facts["exit"] is None and facts["mode"] == "sync"
        transport.send(worker.sock, Header(MsgType.FINISH))
        worker.expect(MsgType.SHUTDOWN)
        server.expect(MsgType.SHUTDOWN)
        transport.send(worker.sock, Header(MsgType.BYE))
        thread.join(0.5)
        assert thread.is_alive(), "the scheduler ended before the server's BYE"
        transport.send(server.sock, Header(MsgType.BYE))
        thread.join(10)
        assert not thread.is_alive() and result["code"] == 0
        assert json.loads(info.read_text())["exit"] == {"code": 0,
                                                        "reason": "all workers finished"}
    finally:
        server.close()
        worker.close()
        thread.join(10)


def test_the_loop_aborts_the_job_when_mxps_job_info_cannot_be_written(tmp_path):
    info = tmp_path / "missing" / "job.json"
    cfg = dataclasses.replace(make_cfg(workers=1, servers=1), root_port=free_port(),
                              job_info=str(info))
    thread, result = run_loop(cfg)
    server = Node(cfg.root_port, "server", 4321)
    worker = Node(cfg.root_port, "worker", 0)
    try:
        # the facts are written before the WELCOMEs: the nodes get the ABORT instead
        for node in (server, worker):
            reason = node.expect(MsgType.ABORT).decode()
            assert "cannot write the job's facts to %s (MXPS_JOB_INFO)" % info in reason
        thread.join(10)
        assert not thread.is_alive() and result["code"] == EXIT_LOST_PEER
    finally:
        server.close()
        worker.close()
        thread.join(10)


def test_the_loop_stays_after_an_abort_in_start_up_to_tell_a_late_node_why():
    cfg = dataclasses.replace(make_cfg(workers=1, servers=1, heartbeat_interval=0.1,
                                       heartbeat_timeout=0.5, start_timeout=60.0),
                              root_port=free_port())
    thread, result = run_loop(cfg)
    server = Node(cfg.root_port, "server", 4321, start_heartbeats=True)   # then silent
    worker = None
    try:
        assert "lost server ?" in server.expect(MsgType.ABORT).decode()
        thread.join(1.0)
        assert thread.is_alive(), "the scheduler left before the worker it expects came"
        worker = Node(cfg.root_port, "worker", 0)      # still importing MXNet at the abort
        reason = worker.expect(MsgType.ABORT).decode()
        assert "lost server ? (127.0.0.1:4321, pid %d) during start-up" % os.getpid() in reason
        thread.join(10)
        assert not thread.is_alive() and result["code"] == EXIT_LOST_PEER
    finally:
        server.close()
        if worker is not None:
            worker.close()
        thread.join(10)


# -- start-up liveness and malformed input ------------------------------------------------------

def test_a_node_that_heartbeats_while_waiting_is_lost_during_start_up_within_the_timeout():
    job = Job(make_cfg(start_timeout=300.0, heartbeat_timeout=10.0))
    job.send(b"s0", MsgType.REGISTER, {"role": "server", "host": LOOPBACK, "port": 1, "pid": 7,
                                      "mode": "sync", "start_heartbeats": True})
    # it is answered while it waits, so it can tell a dead scheduler in time too
    step = job.send(b"s0", MsgType.HEARTBEAT, after=1.0)
    assert list(sent(step, MsgType.HEARTBEAT)) == [b"s0"]
    job.register(b"w0", "worker")                       # an older node: not watched at start
    assert job.tick(9.5).exit is None                   # s0 silent for 9.5 s
    step = job.tick(1.0)
    assert step.exit.code == EXIT_LOST_PEER
    assert "lost server ? (127.0.0.1:1, pid 7) during start-up: no heartbeat for 10.5 s" \
        in step.exit.reason
    assert sorted(sent(step, MsgType.ABORT)) == [b"s0", b"w0"]


def test_nodes_arriving_after_an_abort_in_start_up_are_told_why_until_all_came_or_the_deadline():
    job = Job(make_cfg(start_timeout=60.0, heartbeat_timeout=3.0))
    for ident, port in ((b"s0", 1), (b"s1", 2)):
        job.send(ident, MsgType.REGISTER, {"role": "server", "host": LOOPBACK, "port": port,
                                           "pid": port, "mode": "sync",
                                           "start_heartbeats": True})
    job.send(b"s0", MsgType.HEARTBEAT, after=2.0)
    step = job.tick(1.5)                                # s1 silent 3.5 s: lost in start-up
    assert step.exit.code == EXIT_LOST_PEER and "lost server ?" in step.exit.reason
    reason = step.exit.reason
    # both workers are still on their way (importing MXNet): the scheduler stays for them
    assert job.state.expects_late(job.now)
    step = job.register(b"w0", "worker", after=5.0)
    assert sent(step, MsgType.ABORT) == {b"w0": [reason]} and step.exit is None
    assert sent(job.register(b"w0", "worker"), MsgType.ABORT) == {}     # told once
    assert sent(job.send(b"x", MsgType.HEARTBEAT), MsgType.ABORT) == {}   # not a registration
    assert job.state.expects_late(job.now)
    assert sent(job.register(b"w1", "worker"), MsgType.ABORT) == {b"w1": [reason]}
    assert not job.state.expects_late(job.now)          # everyone expected has been told
    assert sent(job.register(b"w9", "worker"), MsgType.ABORT) == {}    # the scheduler leaves

    # a node that never comes: the scheduler leaves at the start deadline
    job = Job(make_cfg(start_timeout=60.0, heartbeat_timeout=3.0))
    job.send(b"s0", MsgType.REGISTER, {"role": "server", "host": LOOPBACK, "port": 1, "pid": 1,
                                      "mode": "sync", "start_heartbeats": True})
    assert job.tick(3.5).exit.code == EXIT_LOST_PEER
    assert job.state.expects_late(T0 + 59.0) and not job.state.expects_late(T0 + 60.0)


def test_a_job_that_ended_after_its_start_expects_nobody():
    job = Job(make_cfg(workers=1, servers=1))
    job.register(b"s0", "server")
    job.register(b"w0", "worker")
    step = job.send(b"s0", MsgType.ABORT, "s0 failed")
    assert step.exit.code != 0 and not job.state.expects_late(job.now)
    assert sent(job.register(b"w9", "worker"), MsgType.ABORT) == {}


@pytest.mark.parametrize("body", [b"", b"\xff\xfe", b"[]", b"null", b'{"role": "worker"}',
                                  b'{"role": "worker", "host": 1, "port": "x", "pid": 2}',
                                  b"[" * 100000])
def test_a_malformed_register_is_dropped_and_the_job_still_starts(body):
    job = Job(make_cfg(workers=1, servers=1))
    step = job.state.on_message(b"junk", Header(MsgType.REGISTER), body, job.now)
    assert step.exit is None and not step.sends
    assert job.state.malformed == 1
    job.register(b"s0", "server")
    step = job.register(b"w0", "worker")
    assert sorted(sent(step, MsgType.WELCOME)) == [b"s0", b"w0"]


@pytest.mark.parametrize("type_,body", [(MsgType.BANDWIDTH, b"{}"),
                                        (MsgType.BANDWIDTH, b'{"bytes": [1], "seconds": [0]}'),
                                        (MsgType.REPLAN, b'{"round": "x"}'),
                                        (MsgType.REPLAN,            # 3 numbers: neither form
                                         b'{"round": 2, "traffic": {"1": [[1, 2, 3]]}}'),
                                        (MsgType.PLAN, b"7"), (MsgType.REPLAN, b"\x00")])
def test_a_malformed_body_from_a_member_is_dropped_not_fatal(type_, body):
    job = Job(make_cfg(workers=1, servers=1))
    job.register(b"s0", "server")
    job.register(b"w0", "worker")
    step = job.state.on_message(b"w0", Header(type_), body, job.now)
    assert step.exit is None and job.state.malformed == 1
    job.send(b"w0", MsgType.FINISH)                      # and the job still ends cleanly
    job.send(b"s0", MsgType.BYE)
    assert job.send(b"w0", MsgType.BYE).exit.code == 0
