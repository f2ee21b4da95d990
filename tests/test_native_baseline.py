"""Native MXNet 1.9.1 dist_sync on loopback: the reference mxps is measured against.

These run without mxps. They pin down what native does (synchronised weights, the big-array
split, lr_mult on servers) and that the harness itself is sound (loopback only, no kvstore
silently dropped, no process left behind).
"""
import numpy as np
import pytest

import cluster
from cluster import (assert_synchronised, assert_weights_close, load_weights, native_dist_sync,
                     train_env)

# The first Dense layer's weight, which JOB_LR_MULT=1 gives lr_mult=0.5.
LR_MULT_PARAM = "net_dense0_weight"


@pytest.fixture(scope="session")
def jobs(tmp_path_factory):
    return cluster.job_cache(tmp_path_factory)


def test_free_port_is_a_bindable_loopback_port():
    import socket
    port = cluster.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_run_job_refuses_a_non_loopback_host():
    with pytest.raises(ValueError, match="loopback"):
        cluster.run_job(["-c", "pass"], 1, 1, host="0.0.0.0")


def test_run_job_kills_the_rest_and_names_the_node_that_failed():
    script = ("import os, sys, time\n"
              "if os.environ['DMLC_ROLE'] == 'worker' and os.environ.get('FAIL') == '1':\n"
              "    sys.stderr.write('boom from the failing worker\\n'); sys.exit(3)\n"
              "time.sleep(60)\n")
    res = cluster.run_job(["-c", script], 2, 1, per_rank_env={("worker", 1): {"FAIL": "1"}},
                          timeout=30)
    assert not res.ok and not res.timed_out
    assert res.failed.name == "worker1" and res.failed.returncode == 3
    assert res.wall_seconds < 20
    assert all(p.killed for p in res.procs if p.name != "worker1")
    with pytest.raises(AssertionError, match="boom from the failing worker"):
        res.raise_for_failure()
    for p in res.procs:
        with pytest.raises(ProcessLookupError):
            import os
            os.kill(p.pid, 0)


def test_run_job_times_out_and_kills_everything():
    res = cluster.run_job(["-c", "import time; time.sleep(60)"], 1, 1, timeout=2)
    assert res.timed_out and not res.ok and "timeout" in res.reason
    assert all(p.killed for p in res.procs)


def test_native_dist_sync_workers_end_identical_and_differ_from_training_alone(jobs):
    run = native_dist_sync(jobs, 2, 2)
    synced = assert_synchronised(run.out_dir, 2, kvstore_type="dist_sync")
    # Each worker alone (no kvstore) on its own shard: what a silently dropped kvstore gives.
    for data_rank in (0, 1):
        alone = jobs.train(train_env("local", JOB_DATA_RANK=data_rank, JOB_DATA_SHARDS=2), 1, 0)
        diff = cluster.relative_difference(load_weights(alone.out_dir, 0), synced)
        assert min(diff.values()) > 1e-3, diff


def test_native_job_uses_only_loopback_sockets(jobs):
    run = native_dist_sync(jobs, 2, 2)
    socks = run.result.sockets
    assert socks, "no sockets observed while the job ran"
    assert any(s["state"] == "LISTEN" for s in socks)
    outside = [s for s in socks if not (cluster.is_loopback_address(s["local"]) and
               (s["state"] == "LISTEN" or cluster.is_loopback_address(s["peer"])))]
    assert not outside, outside


def test_native_dist_sync_splits_big_arrays_and_stays_synchronised(jobs):
    # mlp_big's first weight has 131072 elements; a bound of 100000 splits it over both
    # servers (the other parameters stay whole on one server each).
    run = native_dist_sync(jobs, 2, 2, model="mlp_big",
                           MXNET_KVSTORE_BIGARRAY_BOUND=100000)
    weights = assert_synchronised(run.out_dir, 2, kvstore_type="dist_sync")
    assert weights["net_dense0_weight"].size == 131072


def test_native_update_on_servers_matches_update_on_workers(jobs):
    # Calibrates the equivalence tolerance: the same maths done in two places (optimizer on
    # the servers vs on each worker) agrees to float rounding after 20 steps.
    on_servers = native_dist_sync(jobs, 2, 2)
    on_workers = native_dist_sync(jobs, 2, 2, update_on_kvstore=False)
    assert_synchronised(on_workers.out_dir, 2)
    diff = assert_weights_close(load_weights(on_workers.out_dir, 0),
                                load_weights(on_servers.out_dir, 0), rtol=1e-5)
    print("native servers-vs-workers relative difference: max %.2e" % max(diff.values()))


def test_native_update_on_servers_ignores_lr_mult(jobs):
    # Observed with MXNet 1.9.1: NO. With update on the servers (Trainer's default for
    # dist_sync) a Parameter's lr_mult has no effect at all: Trainer hands the optimizer to
    # the servers by pickle and Optimizer.__getstate__ drops param_dict, where lr_mult lives
    # (Trainer sets no idx2name/lr_mult dict either). With update on the workers the local
    # optimizer keeps param_dict and lr_mult applies.
    plain = native_dist_sync(jobs, 2, 2)
    servers_mult = native_dist_sync(jobs, 2, 2, lr_mult=True)
    assert_synchronised(servers_mult.out_dir, 2)
    a, b = load_weights(servers_mult.out_dir, 0), load_weights(plain.out_dir, 0)
    for name in a:   # bit for bit the run without lr_mult
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)

    workers_plain = native_dist_sync(jobs, 2, 2, update_on_kvstore=False)
    workers_mult = native_dist_sync(jobs, 2, 2, update_on_kvstore=False,
                                    lr_mult=True)
    assert_synchronised(workers_mult.out_dir, 2)
    diff = cluster.relative_difference(load_weights(workers_mult.out_dir, 0),
                                       load_weights(workers_plain.out_dir, 0))
    assert diff[LR_MULT_PARAM] > 1e-3, diff


@pytest.mark.parametrize("workers", [2, 3])
def test_one_process_simulation_of_the_workers_matches_native_dist_sync(jobs, workers):
    # The reference test_equivalence uses where native dist_sync is unreliable (Adam with
    # update on workers): W devices in one process, device i fed worker i's data, must train
    # what native dist_sync trains (SGD with momentum and wd, update on servers).
    native = native_dist_sync(jobs, workers, 2)
    sim = jobs.train(train_env("device", update_on_kvstore=False,
                               JOB_SIMULATE_WORKERS=workers), workers, 0)
    assert_weights_close(load_weights(sim.out_dir, 0), load_weights(native.out_dir, 0),
                         rtol=1e-5, what="simulated workers vs native dist_sync")
