"""mxps_tools.study_wsp's arithmetic (the study itself is a benchmark: docs/WSP.md)."""
from mxps_tools import study_wsp


def test_time_to_target_is_the_first_epoch_end_that_reached_it():
    assert study_wsp.time_to([0.5, 0.96, 0.94, 0.97], [1.0, 2.0, 3.0, 4.0], 0.95) == 2.0
    assert study_wsp.time_to([0.5, 0.9], [1.0, 2.0], 0.95) is None


def test_the_summary_averages_runs_that_reached_the_target_and_counts_the_others():
    recs = [{"scenario": "compute", "system": "wsp", "seed": s, "time_to_target": t,
             "wall_seconds": 10.0 + s, "final": 0.96} for s, t in ((1, 4.0), (2, 6.0), (3, None))]
    recs.append({"scenario": "compute", "system": "bsp", "seed": 1, "error": "boom"})
    summary = study_wsp.summarise(recs, 0.95)
    (row,) = summary["rows"]
    assert (row["system"], row["runs"], row["reached"]) == ("wsp", 3, 2)
    assert row["time_to_target"] == {"mean": 5.0, "min": 4.0, "max": 6.0, "n": 2}
    assert "| compute | wsp | 5.0 (4.0-6.0) | 2/3 |" in study_wsp.format_table(summary)


class A:
    epochs, batch, lr, staleness, workers, slow, link_mbit = 3, 16, 0.02, 2, 4, "3x", 100.0


def test_a_compute_straggler_scenario_slows_the_last_workers_compute_only():
    env = study_wsp.run_env("wsp", "compute", 2, A, "/tmp/x")
    assert env["DIGITS_SLOW"] == "3:3x" and env["DIGITS_KVSTORE"] == "mxps_wsp"
    assert env["DIGITS_SCHEDULE"] == "constant"
    for scenario in ("none", "link"):
        assert "DIGITS_SLOW" not in study_wsp.run_env("bsp", scenario, 2, A, "/tmp/x")


def test_a_link_straggler_scenario_gives_the_last_worker_a_quarter_of_the_rate_and_the_server_all():
    rates = study_wsp.link_rates(A)
    assert rates.pop("w3") == 25.0
    assert rates["w0"] == rates["w1"] == rates["w2"] == 100.0
    assert rates["s0"] == rates["sched"] == 400.0       # the server carries every worker at R
