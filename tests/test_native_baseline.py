"""Native MXNet 1.9.1 dist_sync on loopback: the reference mxps is measured against.

These run without mxps. They pin down what native does (synchronised weights, the big-array
split, lr_mult on servers) and that the harness itself is sound (loopback only, no kvstore
silently dropped, no process left behind).
"""
import json
import os
import signal
import time

import numpy as np
import psutil
import pytest

import cluster
from cluster import (assert_synchronised, assert_weights_close, load_weights, native_dist_sync,
                     train_env)
from mxps_tools import jobs as runner

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
    with pytest.raises(runner.JobError, match="loopback"):
        runner.Job(["-c", "pass"], 1, 1, host="0.0.0.0")


def test_run_job_kills_the_rest_and_names_the_node_that_failed():
    script = ("import os, sys, time\n"
              "if os.environ['DMLC_ROLE'] == 'worker' and os.environ.get('FAIL') == '1':\n"
              "    sys.stderr.write('boom from the failing worker\\n'); sys.exit(3)\n"
              "time.sleep(60)\n")
    res = cluster.run_job(["-c", script], 2, 1, role_env={"w1": {"FAIL": "1"}}, timeout=30)
    assert not res.ok and not res.timed_out
    assert res.failed.name == "w1" and res.failed.returncode == 3
    assert res.reason == "w1 (worker) exited with code 3"
    assert res.wall_seconds < 20
    assert all(n.killed for n in res.nodes if n.name != "w1")
    with pytest.raises(runner.JobFailed, match="boom from the failing worker"):
        res.raise_for_failure()
    for n in res.nodes:
        with pytest.raises(ProcessLookupError):
            os.kill(n.pid, 0)


def test_run_job_times_out_and_kills_everything():
    res = cluster.run_job(["-c", "import time; time.sleep(60)"], 1, 1, timeout=2)
    assert res.timed_out and not res.ok and "timeout" in res.reason
    assert all(n.killed for n in res.nodes)


def test_the_stacks_of_a_hung_jobs_mxps_nodes_land_in_their_stderr():
    # every process that imported mxps writes its threads' stacks on SIGUSR1 (a faulthandler
    # dump, mxps.roles.takeover) and goes on; the runner asks the nodes still running for
    # them when a job times out (Job.dump_stacks): a hang tells where each node waits.  A
    # node that does not catch the signal is left alone (it would end it).
    script = "import mxps, time\ntime.sleep(60)"     # scheduler and server: take over
    with runner.Job(["-c", script], 1, 1) as job:
        job.wait(lambda: all(runner._catches(n.pid, runner.STACKS_SIGNAL) for n in job.nodes),
                 60, "a stacks handler in every node")
        assert job.dump_stacks(grace=2.0) == ["sched", "s0", "w0"]
        assert job.all_exited() is False            # the dump ends nothing
    for n in job.result.nodes:
        assert "most recent call first" in n.stderr, (n.name, n.stderr[-2000:])
    assert 'File "<string>", line ' in job.result.node("w0").stderr      # the script's frame
    plain = runner.Job(["-c", "import time; time.sleep(60)"], 1, 1)
    with plain:
        assert plain.dump_stacks(grace=0) == []
        assert not any(n.returncode is not None for n in plain.nodes)


def test_run_job_starts_nodes_in_the_callers_cwd_without_the_checkout_on_pythonpath(
        tmp_path, monkeypatch):
    # the runner works wherever mxps is installed: it neither changes directory to a source
    # tree nor adds one to PYTHONPATH (the nodes import mxps as installed)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    script = ("import json, os, sys\n"
              "print(json.dumps([os.getcwd(), os.environ.get('PYTHONPATH'), sys.path[1:]]))\n")
    res = cluster.run_job(["-c", script], 1, 1, timeout=60).raise_for_failure()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for n in res.nodes:     # read after the runner removed its temporary log dir
        cwd, pythonpath, path = json.loads(n.stdout)
        assert cwd == str(tmp_path) and pythonpath is None, (n.name, cwd, pythonpath)
        assert here not in path, (n.name, path)


def test_only_the_scheduler_gets_mxps_job_info_and_the_result_holds_what_it_wrote(tmp_path):
    script = ("import json, os\n"
              "path = os.environ.get('MXPS_JOB_INFO')\n"
              "print(json.dumps(path))\n"
              "if path:\n"
              "    json.dump({'servers': [{'rank': 0, 'pid': os.getpid()}]}, open(path, 'w'))\n")
    log_dir = tmp_path / "logs"
    res = cluster.run_job(["-c", script], 1, 1, timeout=60, log_dir=str(log_dir))
    res.raise_for_failure()
    paths = {n.name: json.loads(n.stdout) for n in res.nodes}
    assert paths == {"sched": str(log_dir / runner.JOB_INFO_FILE), "s0": None, "w0": None}
    assert res.job_info == {"servers": [{"rank": 0, "pid": res.node("sched").pid}]}


def test_an_observed_job_records_exits_as_they_happen_and_is_stopped_on_leaving_the_block(
        tmp_path):
    script = ("import os, sys, time\n"
              "open(os.path.join(sys.argv[1], os.environ['DMLC_ROLE'] + str(os.getpid())), "
              "'w').close()\n"
              "time.sleep(60)\n")
    job = runner.Job(["-c", script, str(tmp_path)], 2, 1)
    with job:
        job.wait(lambda: len(os.listdir(tmp_path)) == 4, 60, "a file from every node")
        assert not any(n.returncode is not None for n in job.nodes), job.result.describe()
        killed_at = time.monotonic()
        job.kill("w1")
        job.wait(lambda: job.node("w1").returncode is not None, 10, "the exit of w1")
        # seen at once (a pidfd wakes the runner), while the other nodes keep running
        assert job.node("w1").exited_at - killed_at < runner.POLL_SECONDS + 0.5
        assert job.node("w1").returncode == -signal.SIGKILL and not job.node("w1").killed
        with pytest.raises(runner.JobTimeout, match="no exit of w0 within 1 s"):
            job.wait(lambda: job.node("w0").returncode is not None, 1, "exit of w0")
    assert [n.name for n in job.nodes if n.killed] == ["sched", "s0", "w0"]
    assert "w1" in job.result.describe() and not job.result.ok
    for n in job.nodes:
        assert not psutil.pid_exists(n.pid), n
    with pytest.raises(runner.JobError, match="runs once"):
        job.start()


def test_the_runner_samples_each_nodes_cpu_time(tmp_path):
    spin = ("import os, time\n"
            "t = time.process_time()\n"
            "while os.environ['DMLC_ROLE'] == 'worker' and time.process_time() - t < 0.6:\n"
            "    pass\n"
            "time.sleep(0.5)\n")
    res = runner.Job(["-c", spin], 1, 1, cpu_interval=0.05).run().raise_for_failure()
    w0, s0 = res.node("w0"), res.node("s0")
    start, end = w0.cpu[0][0], w0.cpu[-1][0]
    assert 0.3 < w0.cpu_seconds_between(start, end) < 1.0, w0.cpu
    assert s0.cpu_seconds_between(start, end) < 0.2, s0.cpu


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
