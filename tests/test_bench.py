"""``mxps bench``: the harness runs native and mxps on an emulated network and cleans up.

One 2-worker x 2-server ``static`` run (a small MLP, few steps) of native dist_sync,
mxps-default and mxps-adaptive is shared by the tests that read its JSON; a short ``dynamic``
run of mxps-default (the slow link moving every 2 steps) is shared by the tests of the moves,
the metrics files and the shares plot; another run is SIGKILLed mid-way to show that nothing
survives ``emunet.cleanup_stale``.  Needs root (network namespaces).  The bench runs the way a
user runs it: from a directory outside this checkout, with mxps as installed (no PYTHONPATH).
"""
import json
import re
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from mxps_tools import bench, emunet, jobs

PREFIX = "mxpsbt-"        # namespaces of these tests only
SMALL = ["--quick", "--steps", "4", "--warmup", "1", "--compute-steps", "1", "--rate", "200",
         "--no-plots", "--no-progress", "--netns-prefix", PREFIX]

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")


def _bench_cmd(out_dir, *extra):
    return [sys.executable, "-m", "mxps_tools.cli", "bench", "--out-dir", str(out_dir)] + SMALL + \
        list(extra)


def _our_namespaces():
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [ln.split()[0] for ln in out.splitlines() if ln.startswith(PREFIX)]


def _alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="module")
def static_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_static")
    t0 = time.monotonic()
    p = subprocess.run(_bench_cmd(out, "--systems", "native,mxps-default,mxps-adaptive"),
                       capture_output=True, text=True, cwd=out, timeout=300)
    wall = time.monotonic() - t0
    assert p.returncode == 0, "bench failed (rc %s):\n%s\n%s" % (p.returncode, p.stdout,
                                                               p.stderr[-4000:])
    with open(out / "bench.json") as f:
        summary = json.load(f)
    return {"summary": summary, "stdout": p.stdout, "wall": wall, "out": out}


@pytest.fixture(scope="module")
def dynamic_run(tmp_path_factory):
    """mxps-default, dynamic, the slow link moving after timed steps 2, 4 and 6 of 9, plots on."""
    out = tmp_path_factory.mktemp("bench_dynamic")
    cmd = [sys.executable, "-m", "mxps_tools.cli", "bench", "--out-dir", str(out), "--quick",
           "--scenario", "dynamic", "--period-steps", "2", "--steps", "9", "--warmup", "1",
           "--compute-steps", "1", "--rate", "200", "--no-progress", "--netns-prefix", PREFIX,
           "--systems", "mxps-default"]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=out, timeout=300)
    assert p.returncode == 0, "bench failed (rc %s):\n%s\n%s" % (p.returncode, p.stdout,
                                                               p.stderr[-4000:])
    with open(out / "bench.json") as f:
        summary = json.load(f)
    return {"summary": summary, "stdout": p.stdout, "out": out}


def _metrics_lines(path):
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


# --------------------------------------------------------------------------- pure functions

def test_follow_counts_steps_from_the_first_step_that_ends_after_each_change():
    steps = [(1.0, [0.5, 0.5]), (2.0, [0.5, 0.5]),                   # before the move
             (3.0, [0.5, 0.5]), (4.0, [0.3, 0.7]), (5.0, [0.22, 0.78]),   # 1, 2, 3 after it
             (6.0, [0.8, 0.2]),                                        # after the second move
             (7.0, [0.8, 0.2])]
    changes = [(0.0, [0.5, 0.5]), (2.5, [0.2, 0.8]), (5.5, [0.5, 0.5])]
    out = bench.follow_changes(steps, changes, tolerance=1.15)
    assert [c["steps"] for c in out] == [3, None]     # 0.78 / 0.8 and 0.22 / 0.2 = 1.1
    assert out[0]["seconds"] == pytest.approx(2.5) and out[0]["ratio"] == pytest.approx(1.1)
    assert out[0]["steps_observed"] == 3 and out[1]["steps_observed"] == 2
    assert out[1]["ratio_first"] == pytest.approx(1.6)
    # a change not followed before the next one is never followed (no credit for later steps)
    out = bench.follow_changes(steps, [(0.0, None), (2.5, [0.2, 0.8]), (4.5, [0.5, 0.5])])
    assert [c["steps"] for c in out] == [None, None]
    assert bench.targets([100.0, 300.0]) == [0.25, 0.75]
    assert bench.targets([100.0, float("inf")]) is None
    assert bench.share_ratio([0.5, 0.5], [0.25, 0.75]) == pytest.approx(2.0)


def test_dynamic_runs_by_steps_with_three_moves_unless_given_seconds():
    import argparse
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    o = bench.options_from_args(p.parse_args(["--quick", "--scenario", "dynamic"]))
    assert o.period is None and o.steps == 4 * bench.DEFAULT_PERIOD_STEPS
    o = bench.options_from_args(p.parse_args(["--scenario", "dynamic", "--period-steps", "3",
                                              "--steps", "12"]))
    assert o.steps == 12
    with pytest.raises(bench.BenchError, match="fewer than 3 moves"):
        bench.options_from_args(p.parse_args(["--scenario", "dynamic", "--period-steps", "3",
                                              "--steps", "11"]))
    o = bench.options_from_args(p.parse_args(["--scenario", "dynamic", "--period", "30"]))
    assert o.period == 30.0 and o.steps == 8
    # static keeps its steps
    assert bench.options_from_args(p.parse_args(["--quick"])).steps == 8


def test_native_server_ranks_are_read_from_ps_lites_scheduler_log():
    native = ("[x] van.cc:70: assign rank=9 to node role=worker, ip=198.18.0.4, port=1, x\n"
              "[x] van.cc:70: assign rank=10 to node role=server, ip=198.18.0.2, port=5, x\n"
              "[x] van.cc:70: assign rank=8 to node role=server, ip=198.18.0.3, port=7, x\n")
    assert bench.native_server_ranks_from_log(native, 2) == ["198.18.0.3:7", "198.18.0.2:5"]
    # not every server's line logged yet: no answer rather than a partial one
    assert bench.native_server_ranks_from_log(native.rsplit("[x]", 1)[0], 2) is None
    assert bench.native_server_ranks_from_log(native, 3) is None
    assert bench.native_server_ranks_from_log("nothing yet", 2) is None


def _job_info(servers):
    return {"mode": "sync", "servers": servers, "replan_points": [], "exit": None,
            "workers": [{"rank": 0, "host": "127.0.0.1", "port": 4100, "pid": 103},
                        {"rank": 1, "host": "127.0.0.1", "port": 4101, "pid": 104}]}


def test_mxps_server_ranks_and_their_nodes_are_read_from_the_schedulers_job_info(tmp_path):
    # a job whose nodes (sched, s0, s1, w0, w1) have these pids; not started: the file below
    # stands in for the one mxps's scheduler writes at MXPS_JOB_INFO after the rendezvous
    job = jobs.Job(["-c", "pass"], 2, 2)
    for n, pid in zip(job.nodes, (100, 101, 102, 103, 104)):
        n.pid = pid
    job.job_info_path = str(tmp_path / jobs.JOB_INFO_FILE)
    run = bench._Run(bench.Bench(bench.Options(network="loopback")),
                     bench.system_by_name("mxps-adaptive"))
    assert not run.discover_ranks(job) and run.ranks is None          # not written yet
    with open(job.job_info_path, "w") as f:
        f.write('{"mode": "sync", "servers": [{"rank": 0, "ho')        # being written
    assert not run.discover_ranks(job) and run.ranks is None
    # rank order is the file's, not the start order: rank 0 is s1 (pid 102)
    servers = [{"rank": 1, "host": "127.0.0.1", "port": 4001, "pid": 101},
               {"rank": 0, "host": "127.0.0.1", "port": 4002, "pid": 102}]
    with open(job.job_info_path, "w") as f:
        json.dump(_job_info(servers), f)
    assert run.discover_ranks(job)
    assert run.ranks == ["127.0.0.1:4002", "127.0.0.1:4001"]
    assert run.rank_nodes == ["s1", "s0"] and run.rank_source == "job info"
    with open(job.job_info_path, "w") as f:
        json.dump(_job_info([dict(servers[0], rank=2), servers[1]]), f)
    with pytest.raises(bench.BenchError, match=r"server ranks \[0, 2\]"):
        run.discover_ranks(job)


def test_p90_interpolates_between_the_closest_ranks_like_numpy():
    import numpy as np
    for xs in ([3.0, 1.0], [0.5, 0.1, 0.9, 0.3, 0.7], list(range(1, 12)), [2.0] * 4):
        assert bench.p90(xs) == pytest.approx(float(np.percentile(xs, 90)))
    assert bench.p90([0.25]) == 0.25


def _cpu(share):
    roles = {"sched": "scheduler", "s0": "server", "s1": "server", "w0": "worker",
             "w1": "worker"}
    return {n: {"role": r, "pid": 1, "cpu_share_window": share} for n, r in roles.items()}


def test_report_tabulates_each_system_its_bytes_per_server_shares_and_cpu():
    common = {"ok": True, "available": True, "bound_s": 0.2, "bound_serial_s": 0.3}
    summary = {
        "options": {"network": "emunet", "schedule": None, "scenario": "static",
                    "num_workers": 2, "num_servers": 2, "model": "mlp", "rate": 200.0,
                    "slow_factor": 4.0, "period": None, "period_steps": 8},
        "model": {"bytes": 2.5e6}, "compute_seconds_median": 0.0123, "host": {"cpus": 2},
        "systems": [
            dict(common, name="native", median_s=0.5, p90_s=0.61, speedup_vs_native=1.0,
                 bound_share=0.4, rate_log=[[1.0, "s1", 50.0, 50.0]], cpu=_cpu(0.5),
                 cpu_machine_share=0.7, rank_source="scheduler log",
                 bytes_per_server=[{"rank": 0, "node": "s1", "in_per_step": 2e6,
                                    "out_per_step": 2.1e6, "predicted_per_step": 2.2e6}]),
            dict(common, name="mxps-adaptive", median_s=0.25, p90_s=0.3, speedup_vs_native=2.0,
                 bound_share=0.8, rate_log=[], cpu=_cpu(None), cpu_machine_share=0.9,
                 rank_source="job info", bytes_per_server=[],
                 follow={"changes": [{"steps": 2, "steps_observed": 4},
                                     {"steps": None, "steps_observed": 3}],
                         "final_ratio": 1.6, "plan_versions": [0, 1]}),
            {"name": "mxps-default", "ok": False, "available": True,
             "reason": "w1 (worker) exited with code 3"}]}
    text = bench.format_table(summary)
    rows = {ln.split()[0]: ln.split() for ln in text.splitlines() if ln.strip()}
    assert "scenario static: 2 workers x 2 servers, mlp" in text and "(R/4)" in text
    assert "compute-only step (median) 0.012 s" in text
    header = next(ln.split() for ln in text.splitlines() if ln.startswith("system  "))
    assert header[:4] == ["system", "median", "s", "p90"]
    native = [ln.split() for ln in text.splitlines() if ln.startswith("native ")]
    assert native[0] == ["native", "0.500", "0.610", "1.00x", "0.200", "40%", "0.300"]
    # bytes: rank 0 on s1, whose link the scenario changed (*), MB in / out / predicted
    assert native[1] == ["native", "0", "s1*", "2.0", "2.1", "2.2", "scheduler", "log"]
    assert native[2] == ["native", "50", "50", "50", "50", "50", "70%"]       # CPU
    adaptive = [ln.split() for ln in text.splitlines() if ln.startswith("mxps-adaptive ")]
    assert adaptive[0][:4] == ["mxps-adaptive", "0.250", "0.300", "2.00x"]
    assert "within 15% of target" in text
    assert adaptive[1] == ["mxps-adaptive", "[2,", "never/3]", "1.60", "0-1"]
    assert adaptive[2] == ["mxps-adaptive", "-", "-", "-", "-", "-", "90%"]
    assert rows["mxps-default:"] == "mxps-default: FAILED: w1 (worker) exited with code 3".split()
    cpu_header = [ln.split() for ln in text.splitlines() if ln.split()[:2] == ["system", "sched"]]
    assert cpu_header == [["system", "sched", "s0", "s1", "w0", "w1", "all"]]


def test_predicted_elements_follow_mxnets_rule_over_sorted_keys():
    # key 0 is big (split), keys 1 and 3 small: (key * 9973) % 2 -> server 1 for odd keys
    assert bench.predicted_elements([2_000_000, 10, 20, 30], 2) == [1_000_000 + 20,
                                                                    1_000_000 + 10 + 30]


def test_bound_is_compute_plus_the_slower_of_server_and_worker_links():
    m = 1e6    # bytes; 8 Mbit
    assert bench.bound_seconds(0.5, m, 2, [8.0, 8.0], [8.0, 8.0]) == pytest.approx(1.5)
    assert bench.bound_seconds(0.0, m, 4, [8.0, 8.0], [80.0] * 4) == pytest.approx(2.0)
    assert bench.bound_seconds(0.0, m, 1, [80.0], [8.0], directions=2) == pytest.approx(2.0)


def test_unknown_system_is_refused_with_the_known_names():
    with pytest.raises(bench.BenchError, match="native"):
        bench.system_by_name("nope")


def test_a_system_with_settings_adds_them_to_its_env_and_keeps_its_own():
    s = bench.system_by_name("mxps-adaptive:MXPS_SEND_WINDOW=2097152:MXPS_MAX_CHUNK=131072")
    assert s.name == "mxps-adaptive:MXPS_SEND_WINDOW=2097152:MXPS_MAX_CHUNK=131072"
    assert s.kvstore == "mxps"
    assert s.env == {"MXPS_PLAN": "adaptive", "MXPS_SEND_WINDOW": "2097152",
                     "MXPS_MAX_CHUNK": "131072"}
    assert bench.system_by_name("mxps-adaptive").env == {"MXPS_PLAN": "adaptive"}
    for bad in ("mxps-default:MXPS_SEND_WINDOW", "native:lower=1", "nope:A=1"):
        with pytest.raises(bench.BenchError, match=re.escape(bad.split(":")[0]
                                                             if bad.startswith("nope")
                                                             else bad.split(":")[1])):
            bench.system_by_name(bad)


# --------------------------------------------------------------------------- real runs

@needs_root
def test_static_run_of_both_systems_completes_and_its_json_has_every_field(static_run):
    s = static_run["summary"]
    for key in ("options", "model", "compute_seconds_median", "systems", "addresses",
                "bound_formula", "host"):
        assert key in s, key
    by = {r["name"]: r for r in s["systems"]}
    for name in ("native", "mxps-default", "mxps-adaptive"):
        r = by[name]
        assert r["ok"], r.get("failure")
        for key in ("median_s", "p90_s", "speedup_vs_native", "bound_s", "bound_share",
                    "rate_log", "qdisc_before", "qdisc_after", "qdisc_samples",
                    "bytes_per_server", "cpu", "server_ranks", "workers", "window"):
            assert key in r, (name, key)
        assert len(r["workers"]) == 2
        assert all(len(w["step_seconds"]) == 4 for w in r["workers"])
        # ranks as data from mxps's scheduler; ps-lite's only record is its scheduler's log
        assert r["rank_source"] == ("scheduler log" if name == "native" else "job info")
        assert sorted(x["node"] for x in r["server_ranks"]) == ["s0", "s1"]
        # the static scenario slowed exactly the node holding server rank 0
        assert [e[1] for e in r["rate_log"]] == [r["server_ranks"][0]["node"]]
        assert r["rate_log"][0][2] == 50.0
        assert {"s0", "s1", "w0", "w1", "sched"} <= set(r["cpu"])
        assert all(c["cpu_seconds_window"] is not None for c in r["cpu"].values())
    assert "native" in static_run["stdout"] and "mxps-default" in static_run["stdout"]
    assert "mxps-adaptive" in static_run["stdout"]


@needs_root
def test_adaptive_placement_puts_fewer_bytes_on_the_slow_server(static_run):
    by = {r["name"]: r for r in static_run["summary"]["systems"]}

    def slow_server_share(r):
        # per timed step (the whole job's totals include the start-up probe's echoes)
        slow = r["server_ranks"][0]["node"]          # the static scenario slows rank 0
        total = sum(b["in_per_step"] for b in r["bytes_per_server"])
        return sum(b["in_per_step"] for b in r["bytes_per_server"] if b["node"] == slow) / total

    default = slow_server_share(by["mxps-default"])
    adaptive = slow_server_share(by["mxps-adaptive"])
    # the slow link has 1/4 of the others' rate: a proportional share is 1/5 of the bytes,
    # MXNet's placement gives it ~0.43 here; the probe's estimate is good to ~±20%
    assert adaptive < 0.32 < default, (default, adaptive)


@needs_root
def test_mxps_default_moves_the_bytes_mxnets_placement_predicts(static_run):
    """Measured tc bytes per server (whole job: init + every step) within 10% of
    MXNet's rule over the model's parameter sizes and the real rank->server mapping."""
    for r in static_run["summary"]["systems"]:
        if r["name"] not in ("native", "mxps-default"):
            continue
        for b in r["bytes_per_server"]:
            for d in ("in", "out"):
                got, want = b["%s_total" % d], b["predicted_%s_total" % d]
                assert want * 0.98 <= got <= want * 1.10, (r["name"], b["rank"], d, got, want)


@needs_root
def test_a_finished_run_leaves_no_namespace_or_process(static_run):
    assert _our_namespaces() == []
    for r in static_run["summary"]["systems"]:
        for c in r.get("cpu", {}).values():
            assert not _alive(c["pid"]), c


@needs_root
def test_mxps_runs_write_metrics_and_a_follow_record(static_run):
    by = {r["name"]: r for r in static_run["summary"]["systems"]}
    assert "follow" not in by["native"]
    for name in ("mxps-default", "mxps-adaptive"):
        f = by[name]["follow"]
        assert f["metrics_files_found"] == 2 and "error" not in f, f
        for rank, path in enumerate(f["metrics_files"]):
            lines = _metrics_lines(path)
            # one line per finished step (the last steps are written once the next starts)
            assert 1 <= len(lines) <= 1 + 4 and all(x["rank"] == rank for x in lines)
            for x in lines:
                assert sum(s["share"] for s in x["servers"]) == pytest.approx(1.0)
                assert sorted(s["server"] for s in x["servers"]) == [0, 1]
        assert f["share_sums"][0] == pytest.approx(1.0) and f["share_sums"][1] == \
            pytest.approx(1.0)
        # static: one rate setting before the first step, so no change to follow
        assert f["steps_after_change"] == [] and f["changes"] == []
        assert f["final_ratio"] >= 1.0 and f["shares_png"] is None     # --no-plots
        assert f["time_source"] == "rank 0's step ends"
    # MXNet's placement puts ~0.43 of the bytes on the slow server, whose target is 0.2
    assert by["mxps-default"]["follow"]["final_ratio"] > 1.5
    assert "within 15% of target" in static_run["stdout"]


@needs_root
def test_dynamic_moves_the_slow_link_by_steps_and_plots_the_shares(dynamic_run):
    s = dynamic_run["summary"]
    r = s["systems"][0]
    assert r["ok"], r.get("failure")
    assert s["options"]["steps"] == 9 and len(r["workers"][0]["step_seconds"]) == 9
    nodes = [x["node"] for x in r["server_ranks"]]
    # the first rates before the start, then three moves: rank 1, 0, 1 slow in turn
    ev = r["rate_events"]
    assert [sorted(n for n, ud in ch.items() if ud[0] == 50.0) for _, ch in ev] == \
        [[nodes[0]], [nodes[1]], [nodes[0]], [nodes[1]]]
    f = r["follow"]
    assert len(f["steps_after_change"]) == 3 and len(f["changes"]) == 3
    # every move lands after timed step 2k of worker 0, before the next step ends (the
    # metrics have every step but the last two: training steps 1..8 here)
    rows = {row[0]: row[1] for row in r["shares_per_step"]["rows"]}
    warmup = s["options"]["warmup"]
    assert sorted(rows)[:8] == list(range(1, 9))
    for k, c in enumerate(f["changes"], 1):
        assert rows[warmup + 2 * k] < c["t"] < rows[warmup + 2 * k + 1], (k, c, rows)
        assert c["steps_observed"] >= 1
        assert c["targets"] == pytest.approx([0.8, 0.2] if k % 2 else [0.2, 0.8])
    # MXNet's placement does not move: it never comes within 15% of a moved target
    assert f["steps_after_change"] == [None, None, None]
    assert f["plan_versions"] == [0] and f["plan_changes"] == []
    for path in f["metrics_files"]:
        for x in _metrics_lines(path):
            assert sum(sv["share"] for sv in x["servers"]) == pytest.approx(1.0)
    for row in r["shares_per_step"]["rows"]:
        assert sum(row[-1]) == pytest.approx(1.0) and (row[2] is None or row[2] > 0)
    png = f["shares_png"]
    assert os.path.basename(png) == "shares-dynamic-mxps-default.png"
    with open(png, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.exists(dynamic_run["out"] / "step_times.png")
    assert "never/" in dynamic_run["stdout"] and png in dynamic_run["stdout"]


@needs_root
def test_a_killed_bench_leaves_nothing_after_cleanup_stale(tmp_path):
    p = subprocess.Popen(_bench_cmd(tmp_path, "--systems", "native"), cwd=tmp_path,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    err = tmp_path / "logs" / "native" / "w1.err"
    deadline = time.monotonic() + 90
    while not err.exists() and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.2)
    assert err.exists(), "the bench never started its job"
    time.sleep(2)
    spaces = _our_namespaces()
    pids = []
    for ns in spaces:
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
        pids += [int(x) for x in out.split()]
    p.send_signal(signal.SIGKILL)
    p.wait(10)
    assert spaces and pids, "expected a live topology with job processes before the kill"
    removed = emunet.cleanup_stale(PREFIX)
    assert set(spaces) <= set(removed)
    assert _our_namespaces() == []
    time.sleep(0.5)
    assert [q for q in pids if _alive(q)] == []


def test_running_without_root_says_root_is_needed(tmp_path, monkeypatch, capsys):
    # (this machine's interpreter lives under /root, so a real unprivileged subprocess cannot
    # even start it; the check itself reads os.geteuid)
    from mxps_tools import cli
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    rc = cli.main(["bench", "--out-dir", str(tmp_path / "out")] + SMALL)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "mxps bench:" in err and "needs root" in err and "uid 1000" in err
