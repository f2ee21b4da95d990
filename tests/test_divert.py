"""A slow server's slices leave it inside the round (MXPS_DIVERT, docs/REPLAN.md).

MXPS_DIVERT_FORCE=R:S has worker 0 report server S slow as it sends its first push of round R:
the scheduler moves every slice of S to the other servers in the middle of that round (the
workers send the weights, S only its optimizer state), the round goes on there, and the next
re-plan points place on S again.  Wherever the round stood on each worker and server, the job
must end with the weights of a fixed plan, and the job facts must list the divert.
"""
import pytest

import cluster
from cluster import assert_synchronised, assert_weights_close, train_env

RTOL = 1e-5
STEPS = 12
DIVERT = dict(MXPS_PLAN="adaptive", MXPS_DIVERT=1, MXPS_MIN_SLICE=64, MXPS_MAX_CHUNK=300,
              MXPS_LOG_LEVEL="INFO")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    return cluster.job_cache(tmp_path_factory)


def facts(run):
    info = run.result.job_info
    assert info is not None, "the scheduler wrote no job facts in %s" % run.result.log_dir
    assert info["exit"] == {"code": 0, "reason": "all workers finished"}, info["exit"]
    return info


@pytest.mark.parametrize("optimizer,at,replica", [("sgd", "4:1", 0), ("adam", "6:0", 0),
                                                 ("sgd", "4:1", 1)],
                         ids=["sgd", "adam", "sgd-state-from-the-replica"])
def test_a_divert_in_mid_round_ends_with_the_weights_of_a_fixed_plan(jobs, optimizer, at,
                                                                     replica):
    # with MXPS_REPLICA=1 the momentum comes from the slow server's buddy where the workers
    # hold the slow server's round, else whole from the slow server: weights exact either way
    workers, servers = 2, 3
    fixed = jobs.train(train_env("device", optimizer=optimizer, update_on_kvstore=False,
                                 steps=STEPS, JOB_SIMULATE_WORKERS=workers), workers, 0)
    extra = dict(MXPS_REPLICA=replica) if replica else {}
    moving = jobs.train(train_env("mxps", optimizer=optimizer, update_on_kvstore=True,
                                  steps=STEPS, MXPS_DIVERT_FORCE=at, **DIVERT, **extra),
                        workers, servers)
    info = facts(moving)
    (d,) = info["diverts"]
    rnd, server = map(int, at.split(":"))
    assert (d["server"], d["round"], d["reported_by"]) == (server, rnd, 0), d
    assert d["slices"] > 0 and d["in_place_at"] >= d["detected_at"], d
    # without a replica the momentum crossed from the slow server
    assert replica or d["moved_bytes"] > 0, d
    assert "state_stale" not in d, d
    # re-planning goes on after it
    assert any(p["at"] > d["in_place_at"] for p in info["replan_points"]), info
    want = assert_synchronised(fixed.out_dir, workers, kvstore_type="device")
    got = assert_synchronised(moving.out_dir, workers)
    assert_weights_close(got, want, rtol=RTOL, what="diverted in mid-round vs fixed plan")
