"""The accuracy study's machinery (mxps_tools/study_ltp.py, tests/jobs/digits_job.py).

The study itself (8 workers, 2 models, 27 runs each, about half an hour) is run by hand
(docs/LTP_ACCURACY.md); here: the grid and the summary on records made up for the purpose,
and one tiny live study (2 workers, 1 epoch, TCP and LTP with 10% of the packets dropped, two
jobs of about 10 s) whose outputs must have the shape the report is built from.
"""
import json
import os
import subprocess
import sys

import pytest

from mxps_tools import study_ltp as sl


# --------------------------------------------------------------------------- pure parts

def test_the_grid_runs_tcp_once_per_seed_and_ltp_at_every_loss():
    specs = sl.grid(["mlp", "cnn"], list(sl.SYSTEMS), [0, 1, 5, 10], [1, 2, 3])
    assert len(specs) == 2 * 3 * (1 + 2 * 4)
    assert {s.loss for s in specs if s.system == "tcp"} == {0.0}
    assert len({s.name for s in specs}) == len(specs)
    assert [s.seed for s in specs] == sorted(s.seed for s in specs), "whole seeds first"


def test_a_run_injects_its_loss_and_seed_only_into_ltp():
    st = sl.Settings(min_bytes=2048, mtu=1400)
    ltp = sl.run_env(sl.RunSpec("cnn", "ltp-zero", 5.0, 7), st, "/x")
    assert (ltp["MXPS_PUSH"], ltp["MXPS_LTP_FILL"], ltp["MXPS_LTP_DROP"]) == ("ltp", "zero", "0.05")
    assert ltp["MXPS_LTP_SEED"] == ltp["DIGITS_SEED"] == "7"
    assert (ltp["MXPS_LTP_MIN_BYTES"], ltp["MXPS_LTP_MTU"]) == ("2048", "1400")
    tcp = sl.run_env(sl.RunSpec("cnn", "tcp", 0.0, 7), st, "/x")
    assert tcp["MXPS_PUSH"] == "tcp" and tcp["DIGITS_SEED"] == "7"
    assert not [k for k in tcp if k.startswith("MXPS_LTP_")]


def _record(model, system, loss, seed, acc, delivered=None):
    r = {"name": sl.RunSpec(model, system, loss, seed).name, "model": model, "system": system,
         "loss": loss, "seed": seed, "accuracy": acc, "lossy_bytes": 0.99, "ltp": None}
    if delivered is not None:
        r["ltp"] = {"delivered": delivered, "close": {"ends": 3, "ratio": 1},
                    "late_dropped": 2}
    return r


def test_the_summary_measures_gaps_to_tcp_per_seed_and_checks_the_targets():
    records = [_record("mlp", "tcp", 0.0, s, a) for s, a in ((1, 0.97), (2, 0.98))] + [
        _record("mlp", "ltp-rescale", 10.0, 1, 0.96, 0.9),     # -1.0 pp against seed 1
        _record("mlp", "ltp-rescale", 10.0, 2, 0.96, 0.9),     # -2.0 pp against seed 2
        _record("mlp", "ltp-zero", 10.0, 1, 0.97, 0.9),
        _record("mlp", "ltp-zero", 10.0, 2, 0.975, 0.9),
        dict(_record("mlp", "ltp-zero", 5.0, 1, 0.0), error="worker rank 3 left no result")]
    summary = sl.summarise(records)
    rows = {(r["system"], r["loss"]): r for r in summary["rows"]}
    assert set(rows) == {("tcp", 0.0), ("ltp-rescale", 10.0), ("ltp-zero", 10.0)}
    assert rows["tcp", 0.0]["mean"] == pytest.approx(97.5)
    rescale = rows["ltp-rescale", 10.0]
    assert rescale["gap"] == pytest.approx(-1.5)
    assert (rescale["paired_gap_min"], rescale["paired_gap_max"]) == \
        (pytest.approx(-2.0), pytest.approx(-1.0))
    assert rescale["target_met"] is False and rescale["target_pp"] == 1.0
    assert rows["ltp-zero", 10.0]["target_met"] is True
    assert rows["ltp-zero", 10.0]["close"] == {"ends": 6, "ratio": 2}
    assert summary["fills"]["mlp"]["better"] == "ltp-zero"
    assert summary["fills"]["mlp"]["margin_pp"] == pytest.approx(1.25)
    assert summary["failed"] == ["mlp-ltp-zero-loss5-seed1"]
    table = sl.format_table(summary)
    assert "MISSED" in table and "FAILED runs (left out): mlp-ltp-zero-loss5-seed1" in table


def test_a_study_directory_refuses_to_resume_with_other_settings(tmp_path):
    code = {"mode": "snapshot", "fingerprint": "ab" * 32}
    sl.prepare(str(tmp_path), sl.Settings(epochs=20), {}, code)
    sl.prepare(str(tmp_path), sl.Settings(epochs=20), {}, code)     # the same: fine
    with pytest.raises(sl.StudyError, match="other settings.*settings"):
        sl.prepare(str(tmp_path), sl.Settings(epochs=5), {}, code)
    with pytest.raises(sl.StudyError, match="inherited"):
        sl.prepare(str(tmp_path), sl.Settings(epochs=20), {"MXPS_LTP_RATIO": "0.9"}, code)
    with pytest.raises(sl.StudyError, match="runtime"):
        sl.prepare(str(tmp_path), sl.Settings(epochs=20), {}, dict(code, fingerprint="cd"))


def test_a_snapshot_of_the_runtime_is_made_once_and_fingerprinted(tmp_path):
    root = sl.snapshot_runtime(str(tmp_path))
    copy = os.path.join(root, "mxps")
    assert os.path.isfile(os.path.join(copy, "ltp", "rounds.py"))
    first = sl.fingerprint(copy)
    with open(os.path.join(copy, "ltp", "rounds.py"), "a") as f:
        f.write("# changed\n")
    assert sl.fingerprint(copy) != first
    assert sl.snapshot_runtime(str(tmp_path)) == root
    assert sl.fingerprint(copy) != first, "a second start keeps the snapshot it has"


def test_the_compact_copy_is_json_with_one_rounded_line_per_run(tmp_path):
    records = [_record("mlp", "tcp", 0.0, 1, 0.975555555),
               dict(_record("mlp", "ltp-zero", 1.0, 1, 0.97333333, 0.98999),
                    curve=[0.5, 0.97333333],
                    ltp_reports=[{"server": 0}])]
    path = tmp_path / "c.json"
    sl.write_compact(str(path), {"summary": sl.summarise(records)}, records)
    data = json.loads(path.read_text())
    assert [r["accuracy"] for r in data["runs"]] == [0.9756, 0.9733]
    assert data["runs"][1]["curve"] == [0.5, 0.9733] and "ltp_reports" not in data["runs"][1]
    assert data["summary"]["rows"][1]["gap"] == -0.2222          # rounded to 4 decimals
    assert sum(1 for line in path.read_text().splitlines() if '"name"' in line) == 2


def test_the_study_imports_neither_mxnet_nor_the_runtime():
    code = ("import sys, mxps_tools.study_ltp; "
            "print(sorted(m for m in ('mxnet', 'mxps') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, DMLC_ROLE="server"))
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr


@pytest.mark.parametrize("args, says", [
    (["--models", "mlp,resnet"], "--models: resnet not among mlp, cnn"),
    (["--losses", "5,100"], "--losses: percentages in [0, 100)"),
    (["--seeds", "1,1"], "--seeds: distinct"),
    (["--workers", "0"], "--workers must be at least 1"),
    (["--job", "/nonexistent/job.py"], "--job /nonexistent/job.py: no such file")])
def test_a_bad_argument_is_refused_by_name_before_anything_runs(tmp_path, capsys, args, says):
    with pytest.raises(SystemExit) as exc:
        sl.main(["--out", str(tmp_path / "s")] + args)
    assert exc.value.code == 2 and says in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


# --------------------------------------------------------------------------- one tiny live study

def test_a_tiny_study_trains_reads_accuracy_and_ltp_reports_and_resumes(tmp_path, capsys):
    out, docs = tmp_path / "study", tmp_path / "docs.json"
    argv = ["--out", str(out), "--workers", "2", "--epochs", "1", "--models", "mlp",
            "--systems", "tcp,ltp-zero", "--losses", "10", "--seeds", "1", "--timeout", "120",
            "--json", str(docs)]
    assert sl.main(argv) == 0
    records = sl.load_records(str(out / "runs.jsonl"))
    assert [r["name"] for r in records] == ["mlp-tcp-loss0-seed1", "mlp-ltp-zero-loss10-seed1"]
    for r in records:
        assert "error" not in r, r["error"]
        assert r["kvstore_type"] and r["test_samples"] == 450
        assert len(r["curve"]) == 1 and r["accuracy"] == r["curve"][-1]
        assert r["accuracy"] > 0.5, "one epoch learns far more than chance (0.1): %s" % r
        assert r["mxps_file"].startswith(str(out / "runtime" / "mxps") + os.sep), r["mxps_file"]
    tcp, ltp = records
    assert tcp["ltp"] is None and not (out / "runs" / tcp["name"] / "metrics.server0.ltp.json")\
        .exists()
    rep = ltp["ltp"]
    assert rep["packets_expected"] > 0 and rep["rounds"] == sum(rep["close"].values())
    assert 0.7 < rep["delivered"] < 0.97, "10%% of the DATA packets were dropped: %s" % rep
    assert 0.9 < ltp["lossy_bytes"] < 1.0

    summary = json.loads((out / "summary.json").read_text())
    assert [(r["system"], r["loss"]) for r in summary["rows"]] == [("tcp", 0), ("ltp-zero", 10)]
    gap = summary["rows"][1]["gap"]
    assert gap == pytest.approx(100 * (ltp["accuracy"] - tcp["accuracy"]))
    assert summary["failed"] == []
    with open(out / "ltp_accuracy.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    compact = json.loads(docs.read_text())
    assert [r["accuracy"] for r in compact["runs"]] == \
        [pytest.approx(tcp["accuracy"], abs=1e-4), pytest.approx(ltp["accuracy"], abs=1e-4)]
    assert compact["settings"]["workers"] == 2 and "ltp_reports" not in compact["runs"][1]

    capsys.readouterr()
    assert sl.main(argv) == 0                       # everything recorded: nothing runs again
    assert "2 runs (2 recorded already)" in capsys.readouterr().out
    assert len(sl.load_records(str(out / "runs.jsonl"))) == 2
    assert sorted(os.listdir(out / "runs")) == sorted(r["name"] for r in records)
