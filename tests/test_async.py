"""dist_async semantics through mxps: `kvstore='mxps_async'` (and MXPS_MODE=async).

Asynchronous SGD has no bit-exact reference (the order in which the servers apply the
workers' pushes decides the result), so this checks what async must do: the kvstore reports
`dist_async` (so Trainer updates on the servers), and the servers apply every push on its own
(their optimizer's update counts: W x steps per key, against steps in sync mode).
"""
import os
import pickle

import pytest

import cluster
from cluster import load_meta, train_env


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    return cluster.job_cache(tmp_path_factory)


@pytest.mark.parametrize("how", ["name", "mode_env"])
def test_async_kvstore_reports_dist_async_and_trainer_updates_on_the_servers(jobs, how):
    env = train_env("mxps_async") if how == "name" else train_env("mxps", MXPS_MODE="async")
    mine = jobs.train(env, 2, 2)
    for r in (0, 1):
        assert load_meta(mine.out_dir, r)["kvstore_type"] == "dist_async"
        assert load_meta(mine.out_dir, r)["update_on_kvstore"] is True


# forced: a new placement before every round (tests/test_replan.py), so the keys' slices, their
# optimizer state and update counts move between the servers at every step
FORCED = {"MXPS_REPLAN_FORCE": "1", "MXPS_REPLAN_INTERVAL": "1", "MXPS_MIN_SLICE": "4",
          "MXPS_MAX_CHUNK": "20"}


@pytest.mark.parametrize("kvstore,updates,extra", [
    ("mxps_async", 2 * 10, {}), ("mxps", 10, {}),
    ("mxps_async", 2 * 10, FORCED), ("mxps", 10, FORCED),
    ("mxps_async", 2 * 10, dict(FORCED, MXPS_REPLAN_OVERLAP="1"))],
    ids=["async", "sync", "async-replanned", "sync-replanned", "async-overlapped-moves"])
def test_async_applies_every_push_on_its_own_sync_once_per_round(tmp_path, kvstore, updates,
                                                                 extra):
    # 2 workers x 10 steps: the servers' optimizer counts one update per push in async mode
    # (20 per key), one per summed round in sync mode (10): read from the saved states.
    # Re-planned every step, no push may be lost or applied twice on the way.
    out = str(tmp_path / "job")
    cluster.run_job([os.path.join(cluster.JOBS_DIR, "states_job.py")], 2, 2, timeout=240, env=dict(
        {"STATES_KVSTORE": kvstore, "STATES_OPTIMIZER": "sgd", "STATES_START": 0,
         "STATES_STOP": 10, "STATES_OUT": out}, **extra)).raise_for_failure()
    with open(os.path.join(out, "trainer.states"), "rb") as f:
        states, optimizer = pickle.loads(f.read())
    assert optimizer._index_update_count == {0: updates, 1: updates}
