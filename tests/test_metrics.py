"""Per-step metrics (MXPS_METRICS) and the bandwidth estimate they carry.

Every finished step of every worker is one JSON line whose per-server bytes are exactly what
the plan puts on that server (each worker pushes and pulls every element it holds once per
step: 2 x 4 bytes per float32 element), with positive rates and shares that sum to one.
"""
import json

import numpy as np
import pytest

import cluster
from cluster import train_env
from mxps.placement.metrics import BandwidthEstimate
from mxps.placement.plan import Plan


def test_estimate_smooths_and_resists_one_wild_round():
    est = BandwidthEstimate(2, alpha=0.5)
    assert est.update([100.0, None]) == [100.0, None]
    assert est.update([200.0, 50.0]) == [150.0, 50.0]
    # a round 100x off moves the estimate at most to 3x the old value, then half way
    assert est.update([15000.0, 50.0])[0] == pytest.approx(0.5 * 150 + 0.5 * 450)


def test_metrics_lines_carry_the_bytes_the_plan_places(tmp_path):
    out, path = str(tmp_path / "job"), str(tmp_path / "metrics-{rank}.jsonl")
    env = train_env("mxps", model="mlp_big", steps=8, MXPS_METRICS=path,
                    MXNET_KVSTORE_BIGARRAY_BOUND=100000)
    cluster.run_job([cluster.TRAIN_JOB], 2, 2, env=dict(env, JOB_OUT=out),
                    timeout=240).raise_for_failure()
    weights = cluster.load_weights(out, 0)
    # Trainer numbers the parameters by sorted name; the default plan places them by that index
    sizes = [int(np.prod(weights[k].shape)) for k in sorted(weights)]
    plan = Plan(2, bigarray_bound=100000)
    for key, n in enumerate(sizes):
        plan.slices(key, n)
    want = [8 * e for e in plan.elements_per_server()]
    for rank in (0, 1):
        lines = [json.loads(x) for x in open(path.format(rank=rank))]
        assert [x["step"] for x in lines] == list(range(1, len(lines) + 1)) and len(lines) >= 5
        for x in lines:
            assert x["rank"] == rank and x["plan_version"] == 0
            got = [s["bytes"] for s in x["servers"]]
            assert got == want, (x, want)
            assert sum(s["share"] for s in x["servers"]) == pytest.approx(1.0)
            assert all(s["rate"] is None or s["rate"] > 0 for s in x["servers"])
        # the last step has no next one to time it (written at exit)
        assert all(x["step_seconds"] > 0 for x in lines[:-1])
        assert all(s["rate_estimate"] > 0 for s in lines[-1]["servers"])
    # mxps plot turns them into a PNG
    from mxps_tools import cli
    assert cli.main(["plot", path.format(rank=0), path.format(rank=1),
                     "--out-dir", str(tmp_path / "plots")]) == 0
    with open(tmp_path / "plots" / "steps.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
