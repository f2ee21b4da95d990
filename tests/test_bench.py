"""``mxps bench``: the harness runs native and mxps on an emulated network and cleans up.

Three quick 2-worker x 2-server benches (a small MLP, few steps) are shared by the tests that
read their JSON: ``static``, the README's first command's own ``mxps bench --quick`` (the slow
link on each server rank in turn; native, native-p3, mxps-default and mxps-adaptive), run by a
newcomer's install in a fresh clone (tests/readme_run.py); ``dynamic`` by steps (mxps-default
alone, the slow link moving every 2 steps: the moves, the metrics files and the shares plot);
``dynamic`` by wall time with ``--repeat 2`` (mxps-unchunked, a move every second: each run's
clock, the aggregates over reps).  Another bench is SIGKILLed mid-way to show that
nothing survives ``emunet.cleanup_stale``.  What the report computes (mean, e2e, speedups, the
floor, the run order, one static variant per rank, 'heaviest' resolved from the model) is tested
on synthetic records or a model built in a subprocess, without jobs.  Needs root (network
namespaces).  The benches run the way a user runs them: from a directory outside this
checkout, with mxps as installed (no PYTHONPATH).
"""
import argparse
import json
import re
import os
import signal
import statistics
import subprocess
import sys
import time

import psutil
import pytest

from mxps_tools import bench, emunet, jobs

PREFIX = "mxpsbt-"        # namespaces of these tests only
SMALL = ["--quick", "--steps", "4", "--warmup", "1", "--compute-steps", "1", "--rate", "200",
         "--no-plots", "--no-progress", "--netns-prefix", PREFIX]
#: the quick MLP's elements per server rank under MXNet's placement: rank 1 is the heaviest
QUICK_HEAVIEST, QUICK_LIGHTEST = 1, 0

#: the emulated network: root (tests/conftest.py fails the test without it, naming why)
needs_root = pytest.mark.netns
pytestmark = pytest.mark.slow


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


def _run_bench(out, cmd):
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=out, timeout=400)
    wall = time.monotonic() - t0
    assert p.returncode == 0, "bench failed (rc %s):\n%s\n%s" % (p.returncode, p.stdout,
                                                               p.stderr[-4000:])
    with open(out / "bench.json") as f:
        summary = json.load(f)
    return {"summary": summary, "stdout": p.stdout, "wall": wall, "out": out}


@pytest.fixture(scope="module")
def static_run(readme_first_command):
    """The README's first command's bench: ``mxps bench --quick`` on its defaults (static, the
    slow link on each server rank in turn, every default system), run by a newcomer's install
    in a fresh clone (tests/readme_run.py)."""
    first = readme_first_command
    assert first.returncode == 0 and first.summary is not None, first.describe()
    return {"summary": first.summary, "stdout": first.stdout, "wall": first.seconds,
            "out": first.out_dir}


@pytest.fixture(scope="module")
def dynamic_run(tmp_path_factory):
    """mxps-default, dynamic, the slow link moving after timed steps 2, 4 and 6 of 9, plots on."""
    out = tmp_path_factory.mktemp("bench_dynamic")
    cmd = [sys.executable, "-m", "mxps_tools.cli", "bench", "--out-dir", str(out), "--quick",
           "--scenario", "dynamic", "--period-steps", "2", "--steps", "9", "--warmup", "1",
           "--compute-steps", "1", "--rate", "200", "--no-progress", "--netns-prefix", PREFIX,
           "--systems", "mxps-default"]
    return _run_bench(out, cmd)


@pytest.fixture(scope="module")
def timed_run(tmp_path_factory):
    """mxps-unchunked, dynamic by wall time (a move every 1 s), twice: each run its own clock."""
    out = tmp_path_factory.mktemp("bench_timed")
    cmd = [sys.executable, "-m", "mxps_tools.cli", "bench", "--out-dir", str(out), "--quick",
           "--scenario", "dynamic", "--period", "1", "--steps", "8", "--warmup", "1",
           "--compute-steps", "1", "--mlp-hidden", "256", "--rate", "200", "--repeat", "2",
           "--no-progress", "--no-plots", "--netns-prefix", PREFIX,
           "--systems", "mxps-unchunked"]
    return _run_bench(out, cmd)


def _metrics_lines(path):
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


def _parser():
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p


def _options(*argv):
    return bench.options_from_args(_parser().parse_args(list(argv)))


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



def test_dynamic_moves_by_wall_time_by_default_and_by_steps_only_when_asked():
    o = _options("--quick", "--scenario", "dynamic")
    assert o.period == bench.DEFAULT_PERIOD_SECONDS == 15.0 and o.period_steps is None
    assert o.steps == bench.DEFAULT_DYNAMIC_STEPS == 24
    assert _options("--scenario", "dynamic", "--period", "30", "--steps", "5").steps == 5
    o = _options("--scenario", "dynamic", "--period-steps", "3")
    assert o.period is None and o.steps == 12
    assert _options("--scenario", "dynamic", "--period-steps", "3", "--steps", "12").steps == 12
    with pytest.raises(bench.BenchError, match="fewer than 3 moves"):
        _options("--scenario", "dynamic", "--period-steps", "3", "--steps", "11")
    with pytest.raises(bench.BenchError, match="not both"):
        _options("--scenario", "dynamic", "--period", "3", "--period-steps", "3")
    with pytest.raises(bench.BenchError, match="--scenario dynamic"):
        _options("--scenario", "static", "--period", "3")
    with pytest.raises(bench.BenchError, match="positive"):
        _options("--scenario", "dynamic", "--period", "0")
    # static keeps its steps, on every rank by default
    o = _options("--quick")
    assert o.steps == bench.DEFAULT_STEPS == 8 and o.slow_rank == "all" and o.period is None


def test_the_clock_of_timed_moves_gives_one_move_per_period_for_as_long_as_a_run_may_last():
    b = bench.Bench(bench.Options(scenario="dynamic", num_servers=3, rate=400.0, period=15.0,
                                  timeout=100.0))
    run = bench._Run(b, bench.system_by_name("native"), {"tag": "dynamic"})
    run.rank_nodes = ["s2", "s0", "s1"]
    assert b.scenario_events(run) == [(0.0, {"s2": 100.0})]        # before the start
    assert b.scenario_step_events(run) == []
    ev = b.scenario_clock_events(run)
    assert [t for t, _ in ev] == [15.0, 30.0, 45.0, 60.0, 75.0, 90.0]
    assert ev[0][1] == {"s0": 100.0, "s2": 400.0} and ev[1][1] == {"s1": 100.0, "s0": 400.0}
    assert ev[2][1] == {"s2": 100.0, "s1": 400.0}
    b.o.period, b.o.period_steps, b.o.steps = None, 2, 9
    assert b.scenario_clock_events(run) == []
    assert [k for k, _ in b.scenario_step_events(run)] == [2, 4, 6]


def test_loss_queue_and_mtu_shape_the_emulated_network_and_incast_has_a_shallow_queue():
    o = _options("--scenario", "incast", "-n", "8", "-s", "1", "--loss", "5", "--mtu", "9000")
    assert (o.loss, o.mtu, o.queue_ms) == (5.0, 9000, None)
    assert bench.Bench(o).queue_ms() == bench.INCAST_QUEUE_MS == 2.0
    assert bench.Bench(_options("--scenario", "static")).queue_ms() is None
    assert bench.Bench(_options("--scenario", "incast", "--queue-ms", "7")).queue_ms() == 7.0
    for bad, why in ((["--loss", "100"], "percentage"), (["--queue-ms", "0"], "positive"),
                     (["--network", "loopback", "--loss", "1"], "emulated network"),
                     (["--network", "loopback", "--scenario", "incast"], "emulated network")):
        with pytest.raises(bench.BenchError, match=why):
            _options(*bad)
    line = bench._options_line(dict(bench.dataclasses.asdict(o), schedule=None))
    assert "switch queue 2 ms" in line and "5% loss towards every server" in line and \
        "MTU 9000" in line


@pytest.mark.parametrize("metrics,role,rank,what", [
    ("/tmp/m-{rank}.jsonl", "worker", 3, "ltp"), ("out/m.jsonl", "server", 0, "store"),
    ("plain", "server", 12, "ltp")])
def test_the_bench_reads_a_report_where_the_node_writes_it(metrics, role, rank, what):
    from mxps.placement import metrics as node_metrics
    assert bench.report_path(metrics, role, rank, what) == \
        node_metrics.report_path(metrics, role, rank, what)


def test_ltp_reports_of_the_servers_are_summed_per_run(tmp_path):
    prefix = str(tmp_path / "metrics-run-{rank}.jsonl")
    assert bench.ltp_stats(prefix, 2) is None               # a TCP run: no report
    for r, (exp, got) in enumerate(((100, 90), (300, 290))):
        with open("%s.server%d.ltp.json" % (prefix.replace("{rank}", "x"), r), "w") as f:
            json.dump({"stats": {"rounds": 4, "close_ratio": 3, "close_ends": 1,
                                 "packets_expected": exp, "packets_received": got,
                                 "drop_late": r}, "loss_estimate": [0.1 * r],
                       "budget": 8904}, f)
    x = bench.ltp_stats(prefix, 2)
    assert x["rounds"] == 8 and x["closed"] == {"ratio": 6, "ends": 2}
    assert x["delivered"] == pytest.approx(380 / 400) and x["late"] == 1
    assert x["loss_estimate"] == [0.0, 0.1] and x["budget"] == 8904
    assert x["senders"] is None                              # no worker count asked
    assert bench.ltp_stats(prefix, 2, 3)["senders"] is None  # no worker wrote a report
    for w, (data, turns, cpu) in enumerate(((90, 30, 1.0), (290, 10, 3.0))):
        with open("%s.worker%d.ltp.json" % (prefix.replace("{rank}", "x"), w), "w") as f:
            json.dump({"worker": w, "counts": {"data": data, "acks": w + 1},
                       "io": {"turns": turns, "timeouts": 2, "cpu_s": cpu, "wall_s": 10.0}}, f)
    y = bench.ltp_stats(prefix, 2, 3)["senders"]              # worker 2 wrote none
    assert y["workers"] == 2 and y["counts"] == {"data": 380, "acks": 3}
    assert y["io_turns_mean"] == 20 and y["io_timeouts"] == 4 and y["io_cpu_s_max"] == 3.0
    assert y["io_cpu_s_mean"] == pytest.approx(2.0)
    assert y["io_cpu_share_mean"] == pytest.approx(0.2)
    assert y["data_per_turn"] == pytest.approx(380 / 40)


def test_p99_is_near_the_slowest_step():
    assert bench.p99([1.0] * 99 + [3.0]) == pytest.approx(1.02)
    assert bench.p99([2.0]) == 2.0


def test_repeat_interleaves_the_systems_rotating_their_order_every_rep():
    order = bench.plan_runs(["A", "B", "C"], [{"tag": "v"}], 4)
    assert [(rep, s) for rep, _, s in order] == [
        (0, "A"), (0, "B"), (0, "C"), (1, "B"), (1, "C"), (1, "A"),
        (2, "C"), (2, "A"), (2, "B"), (3, "A"), (3, "B"), (3, "C")]
    # static on several ranks: rep by rep, rank by rank, the rotation also moving per rank
    v0, v1 = {"tag": "static-rank0"}, {"tag": "static-rank1"}
    order = bench.plan_runs(["A", "B"], [v0, v1], 2)
    assert [(rep, v["tag"][-1], s) for rep, v, s in order] == [
        (0, "0", "A"), (0, "0", "B"), (0, "1", "B"), (0, "1", "A"),
        (1, "0", "B"), (1, "0", "A"), (1, "1", "A"), (1, "1", "B")]
    for v in (v0, v1):      # on every rank, each system runs first in one of the reps
        firsts = {next(s for rep, vv, s in order if rep == r and vv is v) for r in (0, 1)}
        assert firsts == {"A", "B"}


def _worker(starts, seconds):
    return {"step_start_abs": starts, "step_seconds": seconds,
            "step_end_abs": [a + s for a, s in zip(starts, seconds)]}


def test_mean_step_time_is_the_jobs_time_for_its_steps_over_all_workers():
    # worker 0 starts first, worker 1 ends last; one slow step (after a change) counts in full
    w0 = _worker([100.0, 101.0, 102.0, 106.0], [1.0, 1.0, 4.0, 1.0])
    w1 = _worker([100.2, 101.1, 102.1, 106.1], [0.9, 1.0, 3.9, 1.4])
    s = bench.step_summary([w0, w1])
    assert s["timed_steps"] == 4 and s["window"] == [100.0, pytest.approx(107.5)]
    assert s["mean_s"] == pytest.approx(7.5 / 4)
    times = w0["step_seconds"] + w1["step_seconds"]
    assert s["median_s"] == pytest.approx(statistics.median(times)) == pytest.approx(1.0)
    assert s["p90_s"] == pytest.approx(bench.p90(times))
    assert s["mean_s"] > s["median_s"]                 # the slow steps pull the mean up
    with pytest.raises(bench.BenchError, match=r"timed \[4, 3\] steps"):
        bench.step_summary([w0, _worker([1.0, 2.0, 3.0], [1.0, 1.0, 1.0])])


def test_end_to_end_time_runs_from_the_first_launch_to_the_last_exit():
    nodes = jobs.layout(2, 1)
    for n, (start, end) in zip(nodes, [(10.0, 40.5), (10.1, 40.2), (10.2, 38.0), (10.3, 39.0)]):
        n.started, n.exited_at = start, end
    assert bench.job_e2e_seconds(nodes) == pytest.approx(30.5)
    nodes[1].exited_at = None                     # a node the runner never saw exit
    assert bench.job_e2e_seconds(nodes) is None


def _rec(name, rep, mean, variant="v", **kw):
    return dict({"name": name, "rep": rep, "variant": variant, "ok": True, "mean_s": mean,
                 "e2e_s": 10 * mean, "median_s": mean * 0.9, "p90_s": mean * 1.2,
                 "p99_s": mean * 1.4,
                 "floor_s": 0.25, "moves": 2}, **kw)


def test_speedups_are_against_the_better_baseline_of_each_rep_and_against_native():
    recs = [_rec("native", 1, 2.0), _rec("native-p3", 1, 1.6), _rec("mxps-adaptive", 1, 0.8),
            _rec("native", 2, 2.2), _rec("native-p3", 2, 2.4), _rec("mxps-adaptive", 2, 1.1),
            _rec("mxps-default", 1, 1.0), {"name": "mxps-default", "rep": 2, "variant": "v",
                                            "ok": False, "reason": "w1 exited with code 3"}]
    bench.rep_speedups(recs)
    by = {(r["name"], r["rep"]): r for r in recs}
    # rep 1: native-p3 is faster, so it is the baseline; rep 2: native is
    assert by["mxps-adaptive", 1]["baseline"] == "native-p3"
    assert by["mxps-adaptive", 1]["speedup"] == pytest.approx(2.0)
    assert by["mxps-adaptive", 1]["speedup_vs_native"] == pytest.approx(2.5)
    assert by["mxps-adaptive", 2]["baseline"] == "native"
    assert by["mxps-adaptive", 2]["speedup"] == pytest.approx(2.0)
    assert by["native", 1]["speedup"] == pytest.approx(0.8)       # slower than the better one
    assert "speedup" not in by["mxps-default", 2]
    names = ["native", "native-p3", "mxps-default", "mxps-adaptive"]
    agg = {a["name"]: a for a in bench.aggregate_runs(recs, names)}
    # over reps: native means 2.1, native-p3 2.0: native-p3 is the better baseline by its mean
    assert agg["native-p3"]["mean_s"] == pytest.approx(2.0)
    a = agg["mxps-adaptive"]
    assert a["baseline"] == "native-p3" and a["mean_s"] == pytest.approx(0.95)
    assert a["speedup"] == pytest.approx(2.0 / 0.95)                  # ratio of the means
    assert a["speedup_vs_native"] == pytest.approx(2.1 / 0.95)
    assert a["speedup_range"] == [pytest.approx(2.0), pytest.approx(2.0)]
    assert a["speedup_vs_native_range"] == [pytest.approx(2.0), pytest.approx(2.5)]
    assert a["mean_s_min"] == 0.8 and a["mean_s_max"] == 1.1
    assert a["mean_s_stdev"] == pytest.approx(statistics.stdev([0.8, 1.1]))
    assert a["e2e_s"] == pytest.approx(9.5) and a["p90_s"] == pytest.approx(0.95 * 1.2)
    assert a["floor_share"] == pytest.approx(0.25 / 0.95) and a["moves"] == [2, 2]
    d = agg["mxps-default"]
    assert (d["runs"], d["ok_runs"], d["mean_s_stdev"]) == (2, 1, None)
    # without native-p3, native is the baseline
    recs = [_rec("native", 1, 2.0), _rec("mxps-adaptive", 1, 0.8)]
    bench.rep_speedups(recs)
    assert recs[1]["baseline"] == "native" and recs[1]["speedup"] == pytest.approx(2.5)


def test_static_over_ranks_averages_the_mean_and_the_speedup_and_keeps_its_minimum():
    variants = []
    for rank, (native, adaptive) in enumerate([(2.0, 1.0), (1.5, 1.2)]):
        recs = [_rec("native", 1, native, "r%d" % rank), _rec("mxps-adaptive", 1, adaptive,
                                                              "r%d" % rank)]
        bench.rep_speedups(recs)
        variants.append({"slow_rank": rank, "systems": bench.aggregate_runs(
            recs, ["native", "mxps-adaptive", "mxps-default"])})
    over = {r["name"]: r for r in bench.mean_over_ranks(variants, ["native", "mxps-adaptive",
                                                                  "mxps-default"])}
    a = over["mxps-adaptive"]
    assert a["ranks"] == [0, 1] and a["mean_s"] == pytest.approx(1.1)
    assert a["speedup_mean"] == pytest.approx((2.0 + 1.25) / 2)
    assert a["speedup_min"] == pytest.approx(1.25)
    assert over["native"]["speedup_mean"] == pytest.approx(1.0)
    assert over["mxps-default"]["mean_s"] is None       # no result on any rank: no mean


def test_floor_is_the_longest_of_compute_the_servers_and_the_slowest_worker():
    m = 1e6    # bytes; 8 Mbit
    # servers: 2 workers x 8 Mbit over 16 Mbit/s = 1 s; worker: 8 Mbit at 8 Mbit/s = 1 s
    assert bench.floor_seconds(0.5, m, 2, [8.0, 8.0], [8.0, 8.0]) == pytest.approx(1.0)
    assert bench.floor_seconds(1.5, m, 2, [8.0, 8.0], [8.0, 8.0]) == pytest.approx(1.5)
    assert bench.floor_seconds(0.0, m, 4, [8.0, 8.0], [80.0] * 4) == pytest.approx(2.0)
    assert bench.floor_seconds(0.0, m, 1, [80.0], [80.0, 4.0]) == pytest.approx(2.0)
    assert bench.floor_seconds(0.1, m, 2, [float("inf")] * 2, [float("inf")] * 2) == 0.1


def test_slow_ranks_expand_to_one_static_variant_per_rank_each_run_by_every_system():
    assert bench.parse_slow_ranks("all", 3) == [0, 1, 2]
    assert bench.parse_slow_ranks("2,heaviest, lightest", 3) == [2, "heaviest", "lightest"]
    for bad, msg in (("3", "ranks 0..2"), ("slowest", "'heaviest', 'lightest'"),
                     ("", "expected a server rank")):
        with pytest.raises(bench.BenchError, match=msg):
            bench.parse_slow_ranks(bad, 3)
    els = [5, 9, 2, 9]
    assert bench.resolve_slow_ranks(["heaviest", "lightest", 2, 0], els) == [
        {"rank": 1, "labels": ["heaviest"]}, {"rank": 2, "labels": ["lightest"]},
        {"rank": 0, "labels": []}]                        # ties: the lowest rank
    # the quick MLP (hidden 512): MXNet's rule puts more elements on server rank 1
    sizes = [512, 512 * 3072, 512, 512 * 512, 10, 10 * 512]
    b = bench.Bench(bench.Options(num_servers=2, slow_rank="lightest,heaviest,all"))
    vs = b.make_variants(param_sizes=sizes)
    assert [(v["tag"], v["slow_rank"], v["slow_rank_labels"]) for v in vs] == [
        ("static-rank%d" % QUICK_LIGHTEST, QUICK_LIGHTEST, ["lightest"]),
        ("static-rank%d" % QUICK_HEAVIEST, QUICK_HEAVIEST, ["heaviest"])]
    assert b.slow_ranks["elements_per_rank"] == bench.predicted_elements(sizes, 2)
    assert b.expected_sizes == sizes
    runs = bench.plan_runs(["native", "mxps-default"], vs, 1)
    assert [(v["slow_rank"], s) for _, v, s in runs] == [
        (QUICK_LIGHTEST, "native"), (QUICK_LIGHTEST, "mxps-default"),
        (QUICK_HEAVIEST, "mxps-default"), (QUICK_HEAVIEST, "native")]
    # the static rates slow exactly the variant's rank, wherever the job puts it
    run = bench._Run(b, bench.system_by_name("native"), vs[1])
    run.rank_nodes = ["s1", "s0"]
    assert b.scenario_events(run) == [(0.0, {run.rank_nodes[QUICK_HEAVIEST]: 100.0})]
    # no 'heaviest'/'lightest': nothing is built; other scenarios have one variant
    b = bench.Bench(bench.Options(num_servers=3))
    assert [v["slow_rank"] for v in b.make_variants()] == [0, 1, 2] and b.expected_sizes is None
    assert bench.Bench(bench.Options(scenario="dynamic")).make_variants() == [
        {"tag": "dynamic", "scenario": "dynamic"}]
    assert bench.Bench(bench.Options(network="loopback")).make_variants()[0]["tag"] == "loopback"


def test_system_names_with_settings_become_safe_file_names():
    assert bench.path_part("mxps-adaptive:MXPS_TRACE=/tmp/x") == "mxps-adaptive_MXPS_TRACE__tmp_x"
    assert bench.path_part("..") == "_.." and bench.path_part("native-p3") == "native-p3"
    b = bench.Bench(bench.Options(out_dir="/tmp/out", repeat=2))
    s = bench.system_by_name("mxps-adaptive:MXPS_TRACE=/tmp/x:MXPS_SEND_WINDOW=1 2")
    p = b.run_paths({"tag": "static-rank1"}, 1, s)
    assert p["log_dir"] == "/tmp/out/logs/static-rank1-rep2/" \
        "mxps-adaptive_MXPS_TRACE__tmp_x_MXPS_SEND_WINDOW_1_2"
    for key in ("metrics", "shares_png"):
        d, base = os.path.split(p[key])
        assert d == "/tmp/out" and re.fullmatch(r"[A-Za-z0-9._{}-]+", base), p[key]
    assert os.path.basename(p["metrics"]) == "metrics-static-rank1-rep2-mxps-adaptive_" \
        "MXPS_TRACE__tmp_x_MXPS_SEND_WINDOW_1_2-{rank}.jsonl"
    # one rep: no rep in the names (as before --repeat)
    p = bench.Bench(bench.Options(out_dir="/o")).run_paths({"tag": "dynamic"}, 0,
                                                           bench.system_by_name("mxps-default"))
    assert p["shares_png"] == "/o/shares-dynamic-mxps-default.png"
    # two systems that would share a file name are refused
    with pytest.raises(bench.BenchError, match="twice"):
        _options("--systems", "native,mxps-default:MXPS_TRACE=/a,mxps-default:MXPS_TRACE=_a")
    with pytest.raises(bench.BenchError, match="twice"):
        _options("--systems", "native,native")


def test_every_job_gets_a_fresh_secret_unless_the_user_chose_one():
    a, b = bench.job_secret_env({}, {}), bench.job_secret_env({}, {"PATH": "/bin"})
    assert re.fullmatch(r"[0-9a-f]{64}", a["MXPS_SECRET"]) and a != b
    assert bench.job_secret_env({}, {"MXPS_SECRET": "mine"}) == {}
    assert bench.job_secret_env({}, {"MXPS_SECRET_FILE": "/k"}) == {}
    assert bench.job_secret_env({"MXPS_SECRET": "x"}, {}) == {}
    # a system set to run without one (what the secret costs), even where the user has one
    assert bench.job_secret_env({"MXPS_SECRET": ""}, {"MXPS_SECRET": "mine"}) == {}


def test_the_systems_are_native_p3_and_mxps_default_chunked_by_default():
    assert _options().systems == ["native", "native-p3", "mxps-default", "mxps-adaptive"]
    p3 = bench.system_by_name("native-p3")
    assert p3.kvstore == "dist_sync" and p3.env == {"DMLC_PS_VAN_TYPE": "p3"}
    assert bench.system_by_name("mxps-default").env == {"MXPS_PLAN": "chunked"}
    assert bench.system_by_name("mxps-unchunked").env == {"MXPS_PLAN": "default"}


def _cpu(share):
    roles = {"sched": "scheduler", "s0": "server", "s1": "server", "w0": "worker",
             "w1": "worker"}
    return {n: {"role": r, "pid": 1, "cpu_share_window": share} for n, r in roles.items()}


def _summary(records, variants, names, repeat=1, scenario="static"):
    bench.rep_speedups(records)
    vs = [dict(v, systems=bench.aggregate_runs([r for r in records if r["variant"] == v["tag"]],
                                               names)) for v in variants]
    return {"options": {"network": "emunet", "schedule": None, "scenario": scenario,
                        "num_workers": 2, "num_servers": 2, "model": "mlp", "rate": 200.0,
                        "slow_factor": 4.0, "slow_rank": "all", "period": 15.0,
                        "period_steps": None, "steps": 8, "repeat": repeat},
            "model": {"bytes": 2.5e6}, "compute_seconds_median": 0.0123, "host": {"cpus": 2},
            "systems": records, "variants": vs,
            "over_ranks": bench.mean_over_ranks(vs, names) if len(vs) > 1 else None}


def _lines_of(text, name):
    return [ln.split() for ln in text.splitlines() if ln.split()[:1] == [name]]


def test_report_puts_mean_e2e_median_p90_first_per_rank_then_the_mean_over_ranks():
    extra = dict(cpu=_cpu(0.5), cpu_machine_share=0.7, rank_source="scheduler log",
                 cpu_per_gb={"gb_moved": 2.0, "worker": 1.5, "server": 0.75},
                 rate_log=[[1.0, "s1", 50.0, 50.0]],
                 bytes_per_server=[{"rank": 0, "node": "s1", "in_per_step": 2e6,
                                    "out_per_step": 2.1e6, "predicted_per_step": 2.2e6}])
    recs = [_rec("native", 1, 0.5, "static-rank0", **extra),
            _rec("mxps-adaptive", 1, 0.25, "static-rank0", **dict(
                extra, cpu=_cpu(None), cpu_machine_share=0.9, rank_source="job info",
                cpu_per_gb={"gb_moved": 2.0, "worker": 0.5, "server": 0.25},
                bytes_per_server=[], follow={"changes": [{"steps": 2, "steps_observed": 4},
                                                         {"steps": None, "steps_observed": 3}],
                                             "final_ratio": 1.6, "plan_versions": [0, 1]})),
            _rec("native", 1, 0.4, "static-rank1", **extra),
            _rec("mxps-adaptive", 1, 0.4, "static-rank1", **extra),
            {"name": "mxps-default", "rep": 1, "variant": "static-rank0", "ok": False,
             "available": True, "run_id": "static-rank0-mxps-default",
             "reason": "w1 (worker) exited with code 3"}]
    variants = [{"tag": "static-rank0", "scenario": "static", "slow_rank": 0,
                 "slow_rank_labels": ["lightest"]},
                {"tag": "static-rank1", "scenario": "static", "slow_rank": 1,
                 "slow_rank_labels": []}]
    text = bench.format_table(_summary(recs, variants, ["native", "mxps-default",
                                                        "mxps-adaptive"]))
    assert "scenario static: 2 workers x 2 servers, mlp" in text and "(R/4)" in text
    assert "compute-only step (median) 0.012 s" in text
    assert "static, server rank 0 slow (lightest); speedup against native" in text
    header = next(ln.split() for ln in text.splitlines() if ln.startswith("system  "))
    assert header[:11] == ["system", "mean", "s", "e2e", "s", "median", "s", "p90", "s", "p99",
                           "s"]
    assert "floor" in header and "serial" not in text and "moves" not in header
    native, adaptive = _lines_of(text, "native"), _lines_of(text, "mxps-adaptive")
    # mean, e2e, median, p90, p99, speedup, vs native, floor, % of floor (floor / mean),
    # CPU-seconds per GB moved of the workers and of the servers
    assert header[-6:] == ["CPU", "s/GB", "w", "CPU", "s/GB", "s"]
    assert native[0] == ["native", "0.500", "5.0", "0.450", "0.600", "0.700", "1.00x", "1.00x",
                         "0.250", "50%", "1.50", "0.75"]
    assert adaptive[0] == ["mxps-adaptive", "0.250", "2.5", "0.225", "0.300", "0.350", "2.00x",
                           "2.00x", "0.250", "100%", "0.50", "0.25"]
    assert adaptive[1][:2] == ["mxps-adaptive", "0.400"] and adaptive[1][6] == "1.00x"
    lines = text.splitlines()
    mean_over = next(i for i, ln in enumerate(lines) if "mean over server ranks 0, 1" in ln)
    # over ranks: mean 0.325 s, speedup mean (2 + 1) / 2, minimum 1
    assert next(ln.split() for ln in lines[mean_over:] if ln.startswith("mxps-adaptive")) == \
        adaptive[2] == [
        "mxps-adaptive", "0.325", "1.50x", "1.00x", "1.50x", "1.00x"]
    assert _lines_of(text, "mxps-default") == [["mxps-default", "-", "-", "-", "-", "-"]]
    assert "static-rank0-mxps-default: FAILED: w1 (worker) exited with code 3" in text
    # rep 1's details per rank: bytes (rank 0 on s1, changed: *), shares, CPU
    assert native[3] == ["native", "0", "s1*", "2.0", "2.1", "2.2", "scheduler", "log"]
    assert native[4] == ["native", "50", "50", "50", "50", "50", "70%"]
    assert "within 15% of target" in text
    assert adaptive[3] == ["mxps-adaptive", "[2,", "never/3]", "1.60", "0-1"]
    assert adaptive[4] == ["mxps-adaptive", "-", "-", "-", "-", "-", "90%"]
    assert text.index("--- static-rank0, rep 1 ---") < text.index("--- static-rank1, rep 1 ---")


def test_cpu_per_gb_divides_each_kinds_window_cpu_by_the_bytes_every_worker_pushed_and_pulled():
    cpu = {"sched": {"role": "scheduler", "cpu_seconds_window": 0.1},
           "s0": {"role": "server", "cpu_seconds_window": 2.0},
           "s1": {"role": "server", "cpu_seconds_window": 1.0},
           "w0": {"role": "worker", "cpu_seconds_window": 5.0},
           "w1": {"role": "worker", "cpu_seconds_window": None}}     # not sampled: left out
    # 2 workers x 10 steps x (2 x 25e6 float32 = 100 MB each way): 4 GB pushed and pulled
    got = bench.cpu_per_gb(cpu, [20_000_000, 5_000_000], 2, 10)
    assert got["gb_moved"] == pytest.approx(4.0)
    assert got["server"] == pytest.approx(0.75) and got["worker"] == pytest.approx(1.25)
    assert got["scheduler"] == pytest.approx(0.025)
    assert bench.cpu_per_gb(cpu, [0], 2, 10) == {"gb_moved": 0.0}


def test_report_over_reps_gives_the_spread_and_for_dynamic_the_moves():
    recs = [_rec("native", 1, 2.0, "dynamic", moves=3), _rec("mxps-adaptive", 1, 1.0, "dynamic",
                                                              moves=4),
            _rec("mxps-adaptive", 2, 1.5, "dynamic", moves=3), _rec("native", 2, 2.0, "dynamic",
                                                                    moves=3)]
    s = _summary(recs, [{"tag": "dynamic", "scenario": "dynamic"}], ["native", "mxps-adaptive"],
                 repeat=2, scenario="dynamic")
    text = bench.format_table(s)
    assert "every 15 s from worker 0's first timed step" in text and "2 reps" in text
    header = next(ln for ln in text.splitlines() if ln.startswith("system  "))
    assert "mean min-max" in header and header.split()[-1] == "moves"
    row = _lines_of(text, "mxps-adaptive")[0]
    assert row[:4] == ["mxps-adaptive", "1.250", "12.5", "1.125"]
    assert row[6:8] == ["1.000-1.500", "%.3f" % statistics.stdev([1.0, 1.5])]
    assert row[8:10] == ["1.60x", "(1.33-2.00)"] and row[-1] == "3-4"
    assert _lines_of(text, "native")[0][-1] == "3"

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


def test_predicted_elements_follow_mxnets_rule_over_sorted_keys():
    # key 0 is big (split), keys 1 and 3 small: (key * 9973) % 2 -> server 1 for odd keys
    assert bench.predicted_elements([2_000_000, 10, 20, 30], 2) == [1_000_000 + 20,
                                                                    1_000_000 + 10 + 30]


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

STATIC_SYSTEMS = ["native", "native-p3", "mxps-default", "mxps-adaptive"]


def _slow_node(r):
    """The node of the server rank the run's static variant slowed."""
    return r["server_ranks"][r["slow_rank"]]["node"]


def test_heaviest_is_resolved_before_any_job_from_the_model_built_in_a_subprocess():
    b = bench.Bench(bench.Options(num_servers=2, model="mlp", mlp_hidden=512,
                                  slow_rank="heaviest"))
    vs = b.make_variants()
    sizes = b.expected_sizes
    el = bench.predicted_elements(sizes, 2)
    assert el[QUICK_HEAVIEST] > el[QUICK_LIGHTEST]
    assert b.slow_ranks["resolved"] == [{"rank": QUICK_HEAVIEST, "labels": ["heaviest"]}]
    assert b.slow_ranks["elements_per_rank"] == el
    assert "subprocess" in b.slow_ranks["param_sizes_from"]
    assert [v["tag"] for v in vs] == ["static-rank%d" % QUICK_HEAVIEST]
    # the quick MLP: 64 -> 512 -> 512 -> 10 on 3x32x32 images, weights and biases by key order
    assert sorted(sizes) == sorted([512, 512 * 3072, 512, 512 * 512, 10, 10 * 512])


@needs_root
def test_static_runs_every_system_on_every_rank_in_turn(static_run):
    s = static_run["summary"]
    steps = s["options"]["steps"]
    for key in ("options", "model", "compute_seconds_median", "systems", "addresses",
                "floor_formula", "host", "variants", "over_ranks", "run_order", "slow_ranks"):
        assert key in s, key
    assert s["options"]["slow_rank"] == "all" and s["options"]["repeat"] == 1
    assert s["slow_ranks"]["resolved"] == [{"rank": 0, "labels": []}, {"rank": 1, "labels": []}]
    tags = ["static-rank0", "static-rank1"]
    assert [v["tag"] for v in s["variants"]] == tags
    # one rep: each variant runs every system once, the order rotated between variants
    assert [(r, t) for r, t, _ in s["run_order"]] == [(1, t) for t in tags for _ in
                                                      STATIC_SYSTEMS]
    for t in tags:
        assert sorted(n for _, v, n in s["run_order"] if v == t) == sorted(STATIC_SYSTEMS)
    assert len(s["systems"]) == 8
    assert [x["name"] for x in s["over_ranks"]] == STATIC_SYSTEMS
    for r in s["systems"]:
        assert r["ok"], (r["run_id"], r.get("failure"))
        for key in ("mean_s", "e2e_s", "median_s", "p90_s", "speedup", "speedup_vs_native",
                    "baseline", "floor_s", "floor_share", "rate_log", "qdisc_before",
                    "qdisc_after", "qdisc_samples", "bytes_per_server", "cpu", "server_ranks",
                    "workers", "window", "cpu_per_gb"):
            assert key in r, (r["run_id"], key)
        assert len(r["workers"]) == 2
        assert all(len(w["step_seconds"]) == steps for w in r["workers"])
        t0, t1 = r["window"]
        assert r["mean_s"] == pytest.approx((t1 - t0) / steps)
        assert t0 == min(w["step_start_abs"][0] for w in r["workers"])
        assert r["e2e_s"] > t1 - t0 and r["e2e_s"] <= r["wall_seconds"] + 0.5
        # the floor is a floor: no run beats it
        assert 0 < r["floor_s"] <= r["mean_s"] and r["floor_share"] <= 1.0
        # ranks as data from mxps's scheduler; ps-lite's only record (P3's too) is its log
        assert r["rank_source"] == ("job info" if r["name"].startswith("mxps") else
                                    "scheduler log"), r["name"]
        assert sorted(x["node"] for x in r["server_ranks"]) == ["s0", "s1"]
        # the static scenario slowed exactly the node holding the variant's server rank
        assert r["variant"] == "static-rank%d" % r["slow_rank"]
        assert [e[1] for e in r["rate_log"]] == [_slow_node(r)] and r["rate_log"][0][2] == \
            s["options"]["rate"] / s["options"]["slow_factor"]
        assert r["moves"] == 0
        assert {"s0", "s1", "w0", "w1", "sched"} <= set(r["cpu"])
        assert all(c["cpu_seconds_window"] is not None for c in r["cpu"].values())
        assert r["cpu_per_gb"]["worker"] > 0 and r["cpu_per_gb"]["server"] > 0
        by = {x["name"]: x for x in s["systems"] if x["variant"] == r["variant"]}
        best = min(("native", "native-p3"), key=lambda n: by[n]["mean_s"])
        assert r["baseline"] == best
        assert r["speedup"] == pytest.approx(by[best]["mean_s"] / r["mean_s"])
    assert next(r for r in s["systems"] if r["name"] == "native-p3")["env"] == \
        {"DMLC_PS_VAN_TYPE": "p3"}
    out = static_run["stdout"]
    for v in s["variants"]:
        for a in v["systems"]:
            r = next(x for x in s["systems"]
                     if x["name"] == a["name"] and x["variant"] == v["tag"])
            assert a["ok_runs"] == 1 and a["mean_s"] == r["mean_s"] and a["speedup"] == \
                pytest.approx(r["speedup"])
        best = min(v["systems"][:2], key=lambda a: a["mean_s"])["name"]
        assert "static, server rank %d slow; speedup against %s" % (v["slow_rank"], best) \
            in out, out
    # the mean over ranks: each system's mean step time over the two variants
    for x in s["over_ranks"]:
        means = [r["mean_s"] for r in s["systems"] if r["name"] == x["name"]]
        assert x["ranks"] == [0, 1] and x["mean_s"] == pytest.approx(sum(means) / 2)
    assert "mean over server ranks 0, 1" in out
    assert all(name in out for name in STATIC_SYSTEMS)
    print("static bench (the README's): %.0f s with the install, 8 runs" % static_run["wall"])


@needs_root
def test_every_job_has_a_secret_so_no_mxps_server_warns(static_run):
    raw = json.dumps(static_run["summary"])
    assert "MXPS_SECRET" not in raw          # fresh per job, never written down
    for r in static_run["summary"]["systems"]:
        if r["name"].startswith("mxps"):
            for node in ("s0", "s1"):
                with open(os.path.join(r["log_dir"], node + ".err")) as f:
                    err = f.read()
                assert "WITHOUT A JOB SECRET" not in err, (r["run_id"], node, err[-2000:])


@needs_root
def test_adaptive_placement_puts_fewer_bytes_on_the_slow_server(static_run):
    def slow_server_share(r):
        # per timed step (the whole job's totals include the start-up probe's echoes)
        total = sum(b["in_per_step"] for b in r["bytes_per_server"])
        return sum(b["in_per_step"] for b in r["bytes_per_server"]
                   if b["node"] == _slow_node(r)) / total

    for v in static_run["summary"]["variants"]:
        by = {r["name"]: r for r in static_run["summary"]["systems"]
              if r["variant"] == v["tag"]}
        default = slow_server_share(by["mxps-default"])
        adaptive = slow_server_share(by["mxps-adaptive"])
        # the slow link has 1/4 of the others' rate: a proportional share is 1/5 of the bytes,
        # MXNet's placement gives the heaviest ~0.57 here; the probe's estimate is good to
        # ~±20%
        assert adaptive < 0.32 < default, (v["tag"], default, adaptive)


@needs_root
def test_mxps_default_moves_the_bytes_mxnets_placement_predicts(static_run):
    """Measured tc bytes per server (whole job: init + every step) within 10% of
    MXNet's rule over the model's parameter sizes and the real rank->server mapping: the chunks
    of mxps-default cut each server's part, they do not move it."""
    for r in static_run["summary"]["systems"]:
        if r["name"] not in ("native", "mxps-default"):
            continue
        for b in r["bytes_per_server"]:
            for d in ("in", "out"):
                got, want = b["%s_total" % d], b["predicted_%s_total" % d]
                assert want * 0.98 <= got <= want * 1.10, (r["run_id"], b["rank"], d, got, want)


@needs_root
def test_a_finished_run_leaves_no_namespace_or_process(static_run):
    # the README's bench used the default prefix, which other runs may use at the same time:
    # what it left would belong to a process that is gone
    left = [n for n in emunet._list_netns() if emunet._parse_base(n, emunet.DEFAULT_PREFIX)
            and not emunet._owner_alive(*emunet._parse_base(n, emunet.DEFAULT_PREFIX))]
    assert left == []
    for r in static_run["summary"]["systems"]:
        for c in r.get("cpu", {}).values():
            assert not _alive(c["pid"]), c


@needs_root
def test_mxps_runs_write_metrics_and_a_follow_record(static_run):
    runs = static_run["summary"]["systems"]
    o = static_run["summary"]["options"]
    assert all("follow" not in r for r in runs if r["name"].startswith("native"))
    for r in runs:
        if not r["name"].startswith("mxps"):
            continue
        f = r["follow"]
        assert f["metrics_files_found"] == 2 and "error" not in f, f
        for rank, path in enumerate(f["metrics_files"]):
            assert os.path.basename(path) == "metrics-%s-%d.jsonl" % (r["run_id"], rank)
            lines = _metrics_lines(path)
            # one line per finished step (the last steps are written once the next starts)
            assert 1 <= len(lines) <= o["warmup"] + o["steps"]
            assert all(x["rank"] == rank for x in lines)
            for x in lines:
                assert sum(s["share"] for s in x["servers"]) == pytest.approx(1.0)
                assert sorted(s["server"] for s in x["servers"]) == [0, 1]
        assert f["share_sums"][0] == pytest.approx(1.0) and f["share_sums"][1] == \
            pytest.approx(1.0)
        # static: one rate setting before the first step, so no change to follow
        assert f["steps_after_change"] == [] and f["changes"] == []
        assert f["final_ratio"] >= 1.0
        with open(f["shares_png"], "rb") as fh:                       # plots on by default
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
        assert f["time_source"] == "rank 0's step ends"
        if r["name"] == "mxps-default":
            # MXNet's placement puts 0.43 (rank 0) or 0.57 (rank 1) of the bytes on the slow
            # server (target 0.2)
            assert f["final_ratio"] > 1.5, (r["run_id"], f["final_ratio"])
    assert "within 15% of target" in static_run["stdout"]


@needs_root
def test_dynamic_moves_the_slow_link_by_steps_and_plots_the_shares(dynamic_run):
    s = dynamic_run["summary"]
    r = s["systems"][0]
    assert r["ok"], r.get("failure")
    assert s["options"]["steps"] == 9 and len(r["workers"][0]["step_seconds"]) == 9
    assert s["options"]["period_steps"] == 2 and s["options"]["period"] is None
    nodes = [x["node"] for x in r["server_ranks"]]
    # the first rates before the start, then three moves: rank 1, 0, 1 slow in turn
    ev = r["rate_events"]
    assert [sorted(n for n, ud in ch.items() if ud[0] == 50.0) for _, ch in ev] == \
        [[nodes[0]], [nodes[1]], [nodes[0]], [nodes[1]]]
    assert r["moves"] == 3
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
def test_timed_moves_start_at_worker_0s_first_timed_step_of_every_rep(timed_run):
    s = timed_run["summary"]
    assert s["options"]["period"] == 1.0 and s["options"]["repeat"] == 2
    assert s["run_order"] == [[1, "dynamic", "mxps-unchunked"], [2, "dynamic", "mxps-unchunked"]]
    for r in s["systems"]:
        assert r["ok"], (r["run_id"], r.get("failure"))
        assert r["log_dir"].endswith(os.path.join("logs", "dynamic-rep%d" % r["rep"],
                                                  r["name"]))
        w0 = next(w for w in r["workers"] if w["node"] == "w0")
        # the clock starts when worker 0 ends its first timed step, not at the job's start
        assert r["clock_started_at"] == pytest.approx(w0["step_end_abs"][0], abs=0.01)
        ev = [t for t, _ in r["rate_events"]]
        assert ev[0] < r["job_started_at"]              # the first slow link: before the start
        assert len(ev) >= 3, r["rate_events"]
        for k, t in enumerate(ev[1:], 1):
            assert t - r["clock_started_at"] == pytest.approx(k * 1.0, abs=0.3), (k, ev)
        # and stops when worker 0 ends its last timed step (the bench reads it within a poll)
        assert ev[-1] < w0["step_end_abs"][-1] + 0.5, (ev, w0["step_end_abs"])
        t0, t1 = r["window"]
        assert r["moves"] == sum(1 for t in ev if t0 < t <= t1) >= 1
    v = s["variants"][0]
    for a in v["systems"]:
        means = [r["mean_s"] for r in s["systems"] if r["name"] == a["name"]]
        assert a["ok_runs"] == 2 and a["mean_s"] == pytest.approx(sum(means) / 2)
        assert a["mean_s_stdev"] == pytest.approx(statistics.stdev(means))
        assert a["moves"] == [r["moves"] for r in s["systems"] if r["name"] == a["name"]]
    assert "moves" in timed_run["stdout"] and "2 reps" in timed_run["stdout"]


@needs_root
def test_a_killed_bench_leaves_nothing_after_cleanup_stale(tmp_path):
    p = subprocess.Popen(_bench_cmd(tmp_path, "--systems", "native", "--slow-rank", "0"),
                         cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    err = tmp_path / "logs" / "static-rank0" / "native" / "w1.err"
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


def test_report_says_what_the_ltp_senders_io_threads_cost():
    def ltp(turns, cpu_share, per_turn):
        return {"delivered": 0.95, "closed": {"ratio": 3}, "rounds": 3,
                "senders": {"io_turns_mean": turns, "io_cpu_s_mean": 10 * cpu_share,
                            "io_cpu_share_mean": cpu_share, "data_per_turn": per_turn}}
    recs = [_rec("native", 1, 2.0), _rec("mxps-ltp", 1, 1.0, ltp=ltp(1000, 0.1, 4.0)),
            _rec("native", 2, 2.0), _rec("mxps-ltp", 2, 1.0, ltp=ltp(3000, 0.3, 2.0)),
            _rec("mxps-default", 1, 1.5, ltp=dict(ltp(0, 0, 0), senders=None))]
    text = bench.format_table(_summary(recs, [{"tag": "v", "scenario": "incast"}],
                                       ["native", "mxps-default", "mxps-ltp"], repeat=2,
                                       scenario="incast"))
    lines = [ln for ln in text.splitlines() if "I/O thread" in ln]
    # the mean over reps; a run whose workers wrote no report adds no line
    assert lines == ["mxps-ltp: a worker's I/O thread 2000 turns, 2.0 CPU s (20% of a core), "
                     "3.0 data packets a turn"], text
