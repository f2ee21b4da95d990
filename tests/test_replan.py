"""Live re-planning moves slices between servers without losing or double-applying an update.

MXPS_REPLAN_FORCE=1 with MXPS_REPLAN_INTERVAL=1 makes the scheduler switch to a new table before
every round (``adaptive.forced_table``: other cut points and other owners each time, so every
slice's weights, optimizer state and update count move between servers at every step). The
final weights must equal those of the same training with a fixed plan (relative L2 <= 1e-5 per
parameter, as test_equivalence), and the scheduler's job facts (MXPS_JOB_INFO, which the job
runner points into the run's log dir and reads back) must list the re-plans and the bytes they
moved. MXPS_MIN_SLICE=64 lets the small model's keys (2048 and 1024 elements) be cut.

The fixed-plan reference is native MXNet playing the W workers exactly in one process
(JOB_SIMULATE_WORKERS, checked equal to native dist_sync in test_native_baseline, and to mxps
with its fixed plans in test_equivalence): one process instead of a 2W+1-process job.
"""
import pytest

import cluster
from cluster import assert_synchronised, assert_weights_close, load_meta, train_env

RTOL = 1e-5
STEPS = 20
FORCED = dict(MXPS_REPLAN_FORCE=1, MXPS_REPLAN_INTERVAL=1, MXPS_MIN_SLICE=64, MXPS_MAX_CHUNK=300,
              MXPS_LOG_LEVEL="INFO")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    return cluster.job_cache(tmp_path_factory)


def replan_points(run):
    """The re-plan points the scheduler answered, in order (its job facts, MXPS_JOB_INFO):
    ``{round, kind, plan_version, new_plan, full_next, moved_bytes, at}``."""
    facts = run.result.job_info
    assert facts is not None, "the scheduler wrote no job facts (MXPS_JOB_INFO) in %s" % (
        run.result.log_dir)
    assert facts["exit"] == {"code": 0, "reason": "all workers finished"}, facts["exit"]
    return facts["replan_points"]


def new_plans(run):
    return [p for p in replan_points(run) if p["new_plan"]]


CASES = [("%s-%dx%d-update_on_%s" % (opt, w, s, "servers" if uok else "workers"), w, s, opt, uok)
         for w, s in ((2, 2), (3, 3)) for opt in ("sgd", "adam") for uok in (True, False)]


@pytest.mark.parametrize("workers,servers,optimizer,uok", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_forced_replan_every_step_ends_with_the_fixed_plan_weights(jobs, workers, servers,
                                                                    optimizer, uok):
    fixed = jobs.train(train_env("device", optimizer=optimizer, update_on_kvstore=False,
                                 steps=STEPS, JOB_SIMULATE_WORKERS=workers), workers, 0)
    moving = jobs.train(train_env("mxps", optimizer=optimizer, update_on_kvstore=uok,
                                  steps=STEPS, **FORCED), workers, servers)
    assert load_meta(moving.out_dir, 0)["update_on_kvstore"] is uok
    done = new_plans(moving)
    # a new plan before every round but the first: rounds 2..STEPS
    assert [p["round"] for p in done] == list(range(2, STEPS + 1)), done
    assert [p["plan_version"] for p in done] == list(range(1, STEPS))
    assert all(p["moved_bytes"] > 0 and p["kind"] == "full" for p in done), done
    assert len(replan_points(moving)) == len(done), "a point without a new plan"
    want = assert_synchronised(fixed.out_dir, workers, kvstore_type="device")
    got = assert_synchronised(moving.out_dir, workers)
    assert_weights_close(got, want, rtol=RTOL, what="re-planned every step vs fixed plan")


def test_seeded_moves_take_the_weights_from_the_workers_and_end_with_the_same_weights(jobs):
    # MXPS_REPLAN_SEED=1: the new owners take the moved weights from the workers (each holds
    # what its last pull got), the old owners send only the optimizer state: with SGD's
    # momentum half the bytes of an unseeded move, and the job ends bit for bit the same
    env = dict(optimizer="sgd", update_on_kvstore=True, steps=STEPS, **FORCED)
    plain = jobs.train(train_env("mxps", **env), 2, 2)
    seeded = jobs.train(train_env("mxps", MXPS_REPLAN_SEED=1, **env), 2, 2)
    a, b = new_plans(plain), new_plans(seeded)
    assert [p["round"] for p in a] == [p["round"] for p in b] == list(range(2, STEPS + 1))
    assert [2 * p["moved_bytes"] for p in b] == [p["moved_bytes"] for p in a], (a, b)
    assert_weights_close(assert_synchronised(seeded.out_dir, 2),
                         assert_synchronised(plain.out_dir, 2), rtol=0.0,
                         what="seeded moves vs moves that carry the weights")


def test_overlapped_moves_give_the_fixed_plan_weights(jobs):
    # MXPS_REPLAN_OVERLAP=1: workers go on with each new plan while its state moves (the
    # cases above use the default, the quiescent switch)
    fixed = jobs.train(train_env("device", optimizer="sgd", update_on_kvstore=False,
                                 steps=STEPS, JOB_SIMULATE_WORKERS=2), 2, 0)
    moving = jobs.train(train_env("mxps", optimizer="sgd", update_on_kvstore=True,
                                  steps=STEPS, MXPS_REPLAN_OVERLAP="1", **FORCED), 2, 2)
    done = new_plans(moving)
    assert [p["round"] for p in done] == list(range(2, STEPS + 1)), done
    assert all("in_place_at" in p for p in done[:-1]), "the workers waited for the state"
    want = assert_synchronised(fixed.out_dir, 2, kvstore_type="device")
    got = assert_synchronised(moving.out_dir, 2)
    assert_weights_close(got, want, rtol=RTOL, what="overlapped re-plans vs fixed plan")


def test_replan_waits_for_a_push_still_in_flight_and_loses_nothing(jobs):
    # On worker 1 the gradients of step 5 (round 6) become ready 1.5 s late, so its round-6
    # pushes leave late, while neither worker waits for the engine between steps: worker 0's
    # round 6 sits summed on the servers, waiting for worker 1's half, while both workers
    # reach the re-plan point of round 7.  That plan must wait until round 6 is complete
    # everywhere (then moves the round-6 state); nothing is lost.
    fixed = jobs.train(train_env("mxps", update_on_kvstore=True, steps=STEPS), 2, 2)
    moving = jobs.train(train_env("mxps", update_on_kvstore=True, steps=STEPS,
                                  JOB_WAITALL=0, JOB_DELAY="1:5:1.5", **FORCED), 2, 2)
    done = {p["round"]: p["at"] for p in new_plans(moving)}
    assert sorted(done) == list(range(2, STEPS + 1))
    assert done[7] - done[6] >= 1.4, done      # round 7's plan waited for the late push
    assert_weights_close(assert_synchronised(moving.out_dir, 2),
                         assert_synchronised(fixed.out_dir, 2), rtol=RTOL,
                         what="re-planned around a late push vs fixed plan")


def test_light_points_between_forced_replans_change_nothing(jobs):
    # MXPS_REPLAN_FORCE=3: a forced new table at every third re-plan point.  The points between
    # are light ones (workers report and go on: mlp's per-server traffic is too small to time,
    # so no change is ever suspected), and the scheduler's answer at a light point must make
    # the next point a full one exactly when a forced plan is due there.
    fixed = jobs.train(train_env("device", update_on_kvstore=False, steps=STEPS,
                                 JOB_SIMULATE_WORKERS=2), 2, 0)
    moving = jobs.train(train_env("mxps", update_on_kvstore=True, steps=STEPS,
                                  **dict(FORCED, MXPS_REPLAN_FORCE=3, MXPS_REPLAN_LIGHT=1,
                                         MXPS_REPLAN_MIN_GAIN=1e9)), 2, 2)
    points = list(range(2, STEPS + 1))          # a point before every round but the first
    forced = points[2::3]                       # the 3rd, 6th, ... point
    got = replan_points(moving)
    assert [p["round"] for p in got] == points, got
    assert [p["round"] for p in got if p["new_plan"]] == forced, got
    kinds = {p["round"]: p["kind"] for p in got if not p["new_plan"]}
    assert kinds[points[0]] == "full"
    assert all(k == "light" for r, k in kinds.items() if r != points[0]), kinds
    # the answer at each point announces the next one's kind: full exactly before a forced one
    assert [p["full_next"] for p in got[:-1]] == [r in forced for r in points[1:]], got
    assert all(p["kind"] == ("full" if i == 0 or got[i - 1]["full_next"] else "light")
               for i, p in enumerate(got)), got
    assert_weights_close(assert_synchronised(moving.out_dir, 2),
                         assert_synchronised(fixed.out_dir, 2, kvstore_type="device"),
                         rtol=RTOL, what="light points and a forced plan every third vs fixed")
