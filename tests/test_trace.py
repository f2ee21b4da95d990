"""MXPS_TRACE: every node's trace of a job is complete and consistent, and `mxps plot` reads it.

One 2 x 2 job on loopback with MXPS_REPLAN_FORCE=1 (a new table at the re-plan point before
every round but the first, so every slice's state moves between servers every round; see
test_replan) writes PREFIX.worker<rank> and PREFIX.server<rank>.  The tests check what the
trace says against what the protocol guarantees: every request's events come once each and in
order, every request was built with the plan its worker installed for that round and goes to the
server that plan names, each server completes a round only after all W pushes and answers its
pulls only after that, and state moves only inside the re-plan point (after every worker sent
its REPLAN, before any got the answer), as many bytes as the scheduler counted.  The same job
without MXPS_TRACE writes no file and ends with the same weights.
"""
import collections
import json
import os

import numpy as np
import pytest

import cluster
from cluster import train_env
from mxps.placement import trace as trace_mod
from mxps.roles.server_state import ServerState
from mxps.wire.frame import NO_DTYPE, Header, MsgType, dtype_code
from mxps_tools import jobs as runner

W = S = 2
STEPS = 8
FORCED = dict(MXPS_REPLAN_FORCE=1, MXPS_REPLAN_INTERVAL=1, MXPS_MIN_SLICE=64, MXPS_MAX_CHUNK=300)
PUSH_STAGES = ("queued", "held", "released", "sent", "acked")
PULL_STAGES = ("queued", "sent", "answered")


def run(tmp, traced):
    """The forced-re-plan 2 x 2 job, its nodes in an empty working directory ``tmp/cwd``."""
    cwd = tmp / "cwd"
    cwd.mkdir()
    env = train_env("mxps", update_on_kvstore=True, steps=STEPS, JOB_OUT=str(tmp / "out"),
                    MXPS_TRACE=str(tmp / "trace") if traced else "", **FORCED)
    res = runner.Job([cluster.TRAIN_JOB], W, S, env=env, timeout=180,
                     log_dir=str(tmp / "logs"), cpu_interval=None, cwd=str(cwd)).run()
    res.raise_for_failure()
    return res


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("traced")
    return tmp, run(tmp, traced=True)


@pytest.fixture(scope="module")
def trace(traced):
    """{("worker" | "server", rank): {table: [row dicts]}, plus a worker's "plans"}."""
    tmp, _ = traced
    nodes = {}
    for role, rank in [("worker", r) for r in range(W)] + [("server", r) for r in range(S)]:
        path = "%s.%s%d" % (tmp / "trace", role, rank)
        assert os.path.exists(path), "%s %d wrote no trace at %s" % (role, rank, path)
        with open(path) as f:
            body = json.load(f)
        assert (body["format"], body["role"], body["rank"]) == (trace_mod.FORMAT, role, rank)
        node = {name: [dict(zip(t["columns"], r)) for r in t["rows"]]
                for name, t in body["tables"].items()}
        assert sorted(node) == sorted(trace_mod.TABLES[role])
        if role == "worker":
            node["plans"] = {int(v): t for v, t in body["plans"].items()}
        nodes[(role, rank)] = node
    return nodes


def requests(node):
    """{request id: {"op", stage: row}} of a worker's requests table."""
    out = {}
    for row in node["requests"]:
        op, stage = row["kind"].rsplit("_", 1)
        entry = out.setdefault(row["request"], {"op": op})
        assert entry["op"] == op, "request %d has %s and %s events" % (
            row["request"], entry["op"], op)
        entry[stage] = row
    return out


def answers(node):
    """[(round, plan version from then on)] of a worker's re-plan answers, in order."""
    return [(p["round"], p["new_version"]) for p in node["points"]
            if p["kind"] == "replan_answer"]


def version_at(node, r):
    version = 0
    for rnd, v in answers(node):
        if rnd <= r:
            version = v
    return version


def point_row(node, kind, r):
    (row,) = [p for p in node["points"] if p["kind"] == kind and p["round"] == r]
    return row


def test_every_request_has_each_of_its_events_once_and_in_order(trace):
    for w in range(W):
        node = trace[("worker", w)]
        counts = collections.Counter((row["kind"], row["request"]) for row in node["requests"])
        assert set(counts.values()) == {1}, [k for k, n in counts.items() if n > 1][:5]
        reqs = requests(node)
        ops = collections.Counter(e["op"] for e in reqs.values())
        # every round's push of every slice, and at least as many pulls (plus round 0's)
        assert ops["push"] >= STEPS and ops["pull"] >= ops["push"], ops
        for rid, e in reqs.items():
            stages = PUSH_STAGES if e["op"] == "push" else PULL_STAGES
            assert sorted(e) == sorted(stages + ("op",)), (w, rid, sorted(e))
            times = [e[s]["time"] for s in stages]
            assert times == sorted(times), "worker %d request %d: %s" % (
                w, rid, list(zip(stages, times)))
            first = e["queued"]
            for s in stages:     # every event names the same request
                assert {k: e[s][k] for k in ("round", "server", "key", "offset", "length",
                                             "plan_version")} == \
                    {k: first[k] for k in ("round", "server", "key", "offset", "length",
                                           "plan_version")}
            if e["op"] == "push":
                assert first["bytes"] == 4 * first["length"] == e["sent"]["bytes"]
            else:
                assert e["answered"]["bytes"] == 4 * first["length"]


def test_every_request_uses_the_plan_its_worker_installed_for_that_round(trace):
    plans = [trace[("worker", w)]["plans"] for w in range(W)]
    assert plans[0] == plans[1], "the workers recorded different plans"
    assert sorted(plans[0]) == list(range(STEPS)), sorted(plans[0])
    for w in range(W):
        node = trace[("worker", w)]
        # a forced full point before every round but the first, each installing a new plan
        assert answers(node) == [(r, r - 1) for r in range(2, STEPS + 1)], answers(node)
        for p in node["points"]:      # the plan in force when the point was recorded
            assert p["plan_version"] == version_at(node, p["round"] - 1), (w, p)
        for rid, e in requests(node).items():
            q = e["queued"]
            v = version_at(node, q["round"])
            assert q["plan_version"] == v, "worker %d request %d of round %d used plan %d, " \
                "installed: %d" % (w, rid, q["round"], q["plan_version"], v)
            slices = plans[0][v][str(q["key"])]
            assert [q["server"], q["offset"], q["length"]] in slices, (w, q, slices)


def test_a_server_completes_a_round_after_all_pushes_and_answers_its_pulls_after_that(trace):
    for s in range(S):
        rows = trace[("server", s)]["data"]
        by = collections.defaultdict(lambda: collections.defaultdict(list))
        for i, row in enumerate(rows):
            by[(row["key"], row["offset"], row["round"])][row["kind"]].append((i, row))
        rounds = [k for k in by if k[2] >= 1]
        assert len(rounds) >= STEPS, sorted(by)
        for slot, kinds in by.items():
            pulls = sorted(r["worker"] for _, r in kinds["pull_answered"])
            assert pulls == list(range(W)), (s, slot, pulls)
            if slot[2] == 0:          # the initial broadcast's pulls: no round to wait for
                assert set(kinds) == {"pull_answered"}, (s, slot, sorted(kinds))
                continue
            pushes = sorted(r["worker"] for _, r in kinds["push_arrived"])
            assert pushes == list(range(W)), (s, slot, pushes)
            ((done_i, done),) = kinds["round_complete"]
            for i, row in kinds["push_arrived"]:
                assert i < done_i and row["time"] <= done["time"], (s, slot, row, done)
            for i, row in kinds["pull_answered"]:
                assert i > done_i and row["time"] >= done["time"], (s, slot, row, done)
            parked = {r["request"]: i for i, r in kinds["pull_parked"]}
            for i, row in kinds["pull_answered"]:
                assert parked.get(row["request"], -1) < i


def test_every_round_of_every_key_reaches_the_server_its_plan_names_from_each_worker(trace):
    plans = trace[("worker", 0)]["plans"]
    seen = {}
    for s in range(S):
        for row in trace[("server", s)]["data"]:
            seen.setdefault((s, row["kind"], row["key"], row["offset"], row["round"]),
                            []).append(row)
    for w in range(W):
        node = trace[("worker", w)]
        for r in range(1, STEPS + 1):
            v = version_at(node, r)
            for key, slices in plans[v].items():
                for server, offset, length in slices:
                    where = (server, int(key), offset, r)
                    arrived = [x for x in seen.get((server, "push_arrived") + where[1:], [])
                               if x["worker"] == w]
                    assert len(arrived) == 1 and arrived[0]["plan_version"] == v, \
                        "round %d of key %s [%d, +%d): server %d has %r from worker %d " \
                        "under plan %d" % (r, key, offset, length, server, arrived, w, v)
                    assert len(seen.get((server, "round_complete") + where[1:], [])) == 1
                    assert any(x["worker"] == w for x in
                               seen.get((server, "pull_answered") + where[1:], [])), where


def test_state_moves_only_inside_the_replan_point_and_as_much_as_the_scheduler_counted(
        trace, traced):
    _, res = traced
    moved = {p["plan_version"]: p["moved_bytes"] for p in res.job_info["replan_points"]
             if p["new_plan"]}
    assert sorted(moved) == list(range(1, STEPS)), moved
    workers = [trace[("worker", w)] for w in range(W)]
    plan_rows = {s: trace[("server", s)]["plan"] for s in range(S)}
    versions = {row["plan_version"] for rows in plan_rows.values() for row in rows}
    assert versions == set(moved), versions
    for r in range(2, STEPS + 1):
        v = r - 1
        lo = max(point_row(n, "replan_sent", r)["time"] for n in workers)
        # the quiescent switch (MXPS_REPLAN_OVERLAP=0, the default) moves state inside the
        # point; the overlapped one from the point on, and the next point waits for it
        hi = min(point_row(n, "replan_answer", r + 1)["time"] for n in workers) \
            if r < STEPS else float("inf")
        in_place = 0
        for s, rows in plan_rows.items():
            mine = [x for x in rows if x["plan_version"] == v]
            kinds = collections.Counter(x["kind"] for x in mine)
            assert kinds["plan_received"] == 1 and kinds["plan_in_place"] == 1, (s, v, kinds)
            for x in mine:
                assert lo <= x["time"] <= hi, "server %d: %s of plan %d at %.6f, outside " \
                    "[re-plan point of round %d, answer to the next one] = [%.6f, %.6f]" \
                    % (s, x["kind"], v, x["time"], r, lo, hi)
            # a slice being built completes no round before it is built
            data = trace[("server", s)]["data"]
            for x in mine:
                if x["kind"] != "slice_built":
                    continue
                done = [y["time"] for y in data if y["kind"] == "round_complete" and
                        (y["key"], y["offset"]) == (x["key"], x["offset"]) and y["round"] >= r]
                assert done and min(done) >= x["time"], (s, x, done[:1])
            in_place += sum(x["bytes"] for x in mine if x["kind"] == "plan_in_place")
            # every part sent arrived at its peer, which acknowledged it
            for x in mine:
                if x["kind"] != "part_sent":
                    continue
                got = [y for y in plan_rows[x["peer"]] if y["kind"] == "part_received" and
                       (y["plan_version"], y["peer"], y["part"]) == (v, s, x["part"])]
                assert len(got) == 1 and got[0]["bytes"] == x["bytes"], (s, x, got)
                assert sum(1 for y in mine if y["kind"] == "part_acked" and
                           (y["peer"], y["part"]) == (x["peer"], x["part"])) == 1, (s, x)
        assert in_place == moved[v] > 0, (v, in_place, moved[v])


def test_tracing_off_writes_no_file_and_changes_no_weight(tmp_path, traced):
    tmp, _ = traced
    run(tmp_path, traced=False)
    assert os.listdir(tmp_path / "cwd") == []
    assert sorted(os.listdir(tmp_path)) == ["cwd", "logs", "out"]
    assert not [f for f in os.listdir(tmp_path / "out") if "trace" in f or
                f.startswith(".")], os.listdir(tmp_path / "out")
    for w in range(W):
        a = cluster.load_weights(str(tmp_path / "out"), w)
        b = cluster.load_weights(str(tmp / "out"), w)
        for k in a:
            assert np.array_equal(a[k], b[k]), "rank %d: %s differs with MXPS_TRACE" % (w, k)


def test_mxps_plot_draws_the_trace_and_prints_its_summary(traced, trace, tmp_path, capsys):
    from mxps_tools import cli, plot
    tmp, _ = traced
    prefix = str(tmp / "trace")
    assert cli.main(["plot", "--trace", prefix, "--out-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "trace.png")
    with open(tmp_path / "trace.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    t0 = plot.Trace.find([prefix]).t0
    assert cli.main(["plot", "--trace", prefix, "--around", "%.6f" % (t0 + 0.05), "--window",
                     "0.05", "--out-dir", str(tmp_path)]) == 0
    assert os.path.exists(capsys.readouterr().out.strip())
    assert cli.main(["plot", "--trace", prefix, "--summary"]) == 0
    out = capsys.readouterr().out
    assert "max credit wait s" in out and "re-plan point s" in out
    # one line per round and server, whose bytes are every request's of the trace
    want = collections.Counter()
    for w in range(W):
        for e in requests(trace[("worker", w)]).values():
            q = e["queued"]
            want[(q["round"], q["server"])] += q["bytes"] + (
                e["answered"]["bytes"] if "answered" in e else 0)
    got = {}
    for line in out.splitlines():
        cells = line.split()
        if len(cells) >= 3 and cells[0].isdigit():
            got[(int(cells[0]), int(cells[1]))] = int(cells[2])
    assert got == dict(want)
    with pytest.raises(SystemExit, match="no trace files"):
        cli.main(["plot", "--trace", str(tmp_path / "nothing"), "--summary"])


def test_the_server_state_records_a_round_in_the_order_it_happens():
    ticks = iter(range(1000))
    rec = trace_mod.Recorder("server", 0, now=lambda: float(next(ticks)))
    state = ServerState(0, 2, sync=True, trace=rec)
    f32 = dtype_code(np.float32)

    def send(type_, w, rid, value=None):
        h = Header(type_, key=7, sender=w, iteration=1 if type_ != MsgType.INIT else 0,
                   length=3, request_id=rid, dtype=f32 if value is not None else NO_DTYPE)
        return state.on_request(b"w%d" % w, h, None if value is None else
                                np.asarray(value, dtype=np.float32))

    send(MsgType.INIT, 0, 1, [0, 0, 0])
    send(MsgType.PULL, 0, 2)
    send(MsgType.PUSH, 1, 3, [1, 2, 3])
    send(MsgType.PUSH, 0, 4, [1, 1, 1])
    send(MsgType.PULL, 1, 5)
    got = [(r[0], r[1], r[6], r[9]) for r in rec.rows["data"]]
    assert got == [("pull_parked", 0.0, 0, 2), ("push_arrived", 1.0, 1, 3),
                   ("push_arrived", 2.0, 0, 4), ("round_complete", 3.0, -1, -1),
                   ("pull_answered", 4.0, 0, 2), ("pull_answered", 5.0, 1, 5)], got
    assert rec.rows["plan"] == []
