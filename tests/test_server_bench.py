"""The server microbenchmark (``mxps bench-server``): its figures from worker lines and CPU, and
a small live run of native and mxps (with the job secret) whose workers pull the right sums."""
import json
import subprocess
import sys

import pytest

from mxps_tools import server_bench as sb


def _worker(rank, starts, ends, round_bytes=8e8, total=3.0):
    return {"rank": rank, "round_start_abs": starts, "round_end_abs": ends,
            "round_bytes": round_bytes, "sum": total}


def test_run_summary_divides_the_bytes_of_the_timed_rounds_by_the_servers_cpu():
    workers = [_worker(0, [10.0, 11.0], [11.0, 12.0]), _worker(1, [10.5, 11.0], [11.0, 12.5])]
    cpu = {"sched": {"role": "scheduler", "cpu_seconds_window": 0.1},
           "s0": {"role": "server", "cpu_seconds_window": 1.6},
           "w0": {"role": "worker", "cpu_seconds_window": 2.0},
           "w1": {"role": "worker", "cpu_seconds_window": None}}
    s = sb.run_summary(workers, cpu)
    # 2 workers x 2 rounds x 0.8 GB over the 2.5 s from the first start to the last end
    assert s["gb"] == pytest.approx(3.2) and s["window"] == [10.0, 12.5]
    assert s["gb_per_s"] == pytest.approx(3.2 / 2.5)
    assert s["server_gb_per_core_s"] == pytest.approx(2.0)
    assert s["worker_cpu_s_per_gb"] == pytest.approx(2.0 / 3.2)
    assert s["round_median_s"] == pytest.approx(1.0)


def test_a_wrong_sum_or_unequal_rounds_is_not_measured():
    good = _worker(0, [1.0], [2.0])
    with pytest.raises(sb.ServerBenchError, match=r"different or zero sums \{0: 3.0, 1: 2.0\}"):
        sb.run_summary([good, _worker(1, [1.0], [2.0], total=2.0)], {})
    with pytest.raises(sb.ServerBenchError, match="zero"):
        sb.run_summary([_worker(0, [1.0], [2.0], total=0.0)], {})
    with pytest.raises(sb.ServerBenchError, match="timed"):
        sb.run_summary([good, _worker(1, [1.0, 2.0], [2.0, 3.0])], {})


def test_bad_options_are_refused_naming_the_option():
    p = __import__("argparse").ArgumentParser()
    sb.add_arguments(p)
    with pytest.raises(sb.ServerBenchError, match="unknown systems"):
        sb.options_from(p.parse_args(["--systems", "native,mxps-fast"]))
    with pytest.raises(sb.ServerBenchError, match="--rounds"):
        sb.options_from(p.parse_args(["--rounds", "0"]))


def test_a_small_live_run_measures_native_and_mxps_with_the_secret(tmp_path):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "mxps_tools.cli", "bench-server", "--workers", "2",
                        "--keys", "2", "--elements", "1000000", "--rounds", "5", "--warmup", "1",
                        "--repeat", "1", "--systems", "native,mxps", "--out-dir", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((out / "bench_server.json").read_text())
    # one rep: the systems in the order given (rotation per rep is bench.plan_runs')
    assert [x["system"] for x in summary["records"]] == ["native", "mxps"]
    recs = {x["system"]: x for x in summary["records"]}
    assert set(recs) == {"native", "mxps"} and all(x["ok"] for x in recs.values())
    for x in recs.values():
        # 2 workers x 5 rounds x 2 keys x 1M float32, pushed and pulled: 160 MB, enough
        # server CPU for the CPU clock's 10 ms ticks to see (at 200000 a fast run read 0)
        assert x["gb"] == pytest.approx(2 * 5 * 2 * 2 * 1000000 * 4 / 1e9)
        assert x["server_cpu_s"] > 0 and x["server_gb_per_core_s"] > 0
    assert "GB/s per server core" in r.stdout and "native" in r.stdout
