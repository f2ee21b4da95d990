"""A server with MXPS_STORE=disk (mxps/store/disk.py) serves what a server in RAM serves.

The same messages go to a memory server and a disk server whose cache holds a few rows (so
rows are evicted and read back all the time): dense and row-sparse keys, SGD with momentum and
Adam, in sync rounds of 2 workers; every reply and the final weights must agree to 1e-6.  A
disk store flushed at a clean stop is resumed by a new server, which then goes on exactly as
the first one would have; a store changed behind its back is refused naming the problem.
"""
import json
import os
import pickle
import signal

import mxnet as mx
import numpy as np
import pytest

from mxps.roles.server_state import ServerState, StoreSettings, WspSettings
from mxps.wire import typed
from mxps.wire.frame import Header, MsgType, dtype_code

F32 = dtype_code(np.float32)
DENSE, SPARSE = 4, 9            # keys: a 1-D dense vector, a (ROWS, COLS) table
N_DENSE, ROWS, COLS = 3000, 40, 6

OPTIMIZERS = {
    "sgd_momentum": lambda: mx.optimizer.SGD(learning_rate=0.2, momentum=0.9, wd=0.01,
                                             rescale_grad=0.5),
    "adam": lambda: mx.optimizer.Adam(learning_rate=0.03, wd=0.01),
}


def new_server(make, directory=None, cache_mb=0.004, resume=False, sync=True, workers=2,
               wsp=None):
    store = None if directory is None else \
        StoreSettings(str(directory), int(cache_mb * (1 << 20)), resume)
    s = ServerState(0, workers, sync, store=store, wsp=wsp)
    s.on_request(b"w0", Header(MsgType.SET_OPTIMIZER, sender=0), pickle.dumps(make()))
    rng = np.random.RandomState(5)
    for key, n, cols in ((DENSE, N_DENSE, 1), (SPARSE, ROWS * COLS, COLS)):
        out = s.on_request(b"w0", Header(MsgType.INIT, key=key, sender=0, length=n, dtype=F32,
                                         iteration=cols), rng.randn(n).astype(np.float32))
        assert out[0].header.type == MsgType.ACK, out[0].payload
    return s


def messages(seed, rounds, first=1):
    """Every worker's pushes and pulls of ``rounds`` rounds (dense and sparse), in order."""
    rng = np.random.RandomState(seed)
    out = []
    for it in range(first, first + rounds):
        for w in range(2):
            g = rng.randn(N_DENSE).astype(np.float32)
            out.append((w, Header(MsgType.PUSH, key=DENSE, sender=w, iteration=it,
                                  length=N_DENSE, dtype=F32, request_id=it * 10 + w), g))
            ids = np.sort(rng.choice(ROWS, size=rng.randint(0, 8), replace=False))
            body = typed.pack({"cols": COLS, "ids": ids.astype(np.int64),
                               "values": rng.randn(ids.size * COLS).astype(np.float32)})
            out.append((w, Header(MsgType.PUSH_ROWS, key=SPARSE, sender=w, iteration=it,
                                  length=ROWS * COLS, dtype=F32, request_id=it * 10 + 5 + w),
                        body))
        for w in range(2):
            out.append((w, Header(MsgType.PULL, key=DENSE, sender=w, iteration=it,
                                  length=N_DENSE, request_id=it * 100 + w), None))
            want = np.sort(rng.choice(ROWS, size=5, replace=False)).astype(np.int64)
            out.append((w, Header(MsgType.PULL_ROWS, key=SPARSE, sender=w, iteration=it,
                                  length=ROWS * COLS, request_id=it * 100 + 50 + w),
                        typed.pack({"cols": COLS, "ids": want})))
    return out


def play(s, msgs):
    replies = []
    for w, h, payload in msgs:
        for o in s.on_request(b"w%d" % w, Header(**{f: getattr(h, f) for f in (
                "type", "key", "sender", "iteration", "length", "dtype", "request_id")}),
                payload):
            assert o.header.type != MsgType.ERROR, o.payload
            if o.header.type == MsgType.DATA:
                replies.append((o.header.request_id, np.array(o.payload, np.float32)))
    return sorted(replies, key=lambda r: r[0])


def values(s):
    return {k: np.array(slot.store.snapshot) for k, slot in s.slots.items()}


def assert_same(a, b):
    assert [r for r, _ in a] == [r for r, _ in b]
    for (_, x), (_, y) in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_disk_server_with_a_tiny_cache_answers_what_a_memory_server_answers(tmp_path, name,
                                                                             sync):
    """Dense and row-sparse pushes of 2 workers and their pulls; async: every push applied on
    arrival (the same order to both servers)."""
    mem = new_server(OPTIMIZERS[name], sync=sync)
    disk = new_server(OPTIMIZERS[name], tmp_path, sync=sync)
    msgs = messages(1, 6)
    assert_same(play(mem, msgs), play(disk, msgs))
    for k, v in values(mem).items():
        np.testing.assert_allclose(values(disk)[k], v, rtol=1e-6, atol=1e-7)
    stats = disk.store_stats()
    assert stats["evictions"] > 0 and stats["misses"] > 0      # the cache really was small


@pytest.mark.parametrize("store", ["memory", "disk"])
def test_async_of_one_worker_answers_as_sync_with_dense_and_row_sparse_keys(tmp_path, store):
    """With one worker a sync round completes at its push: async (every push applied on
    arrival) must give the same replies, dense pushes and row-sparse ones alike."""
    directory = None if store == "memory" else tmp_path
    msgs = [m for m in messages(6, 5) if m[0] == 0]
    got = play(new_server(OPTIMIZERS["adam"], directory and directory / "a", sync=False,
                          workers=1), msgs)
    want = play(new_server(OPTIMIZERS["adam"], directory and directory / "s", workers=1), msgs)
    assert len(got) == 10
    assert_same(got, want)


@pytest.mark.parametrize("store", ["memory", "disk"])
def test_wsp_with_k_equal_to_w_answers_dense_and_row_sparse_keys_as_bsp(tmp_path, store):
    # k = W: every round waits for every worker, so WSP's rounds are BSP's (docs/WSP.md), row
    # pushes included
    directory = (lambda name: tmp_path / name) if store == "disk" else (lambda name: None)
    msgs = messages(11, 4)
    bsp = play(new_server(OPTIMIZERS["adam"], directory("bsp")), msgs)
    wsp = play(new_server(OPTIMIZERS["adam"], directory("wsp"), wsp=WspSettings(2, 2)), msgs)
    assert_same(wsp, bsp)


def test_a_flushed_store_resumes_exactly_where_an_uninterrupted_server_would_be(tmp_path):
    make = OPTIMIZERS["adam"]          # Adam: the update count matters (bias correction)
    whole = new_server(make)
    first, then = messages(2, 4), messages(3, 3)
    play(whole, first)
    want = play(whole, messages(3, 3, first=5))     # rounds 5..7 of the uninterrupted run
    a = new_server(make, tmp_path)
    play(a, first)
    a.flush_store()
    b = new_server(make, tmp_path, resume=True)     # a new job: its workers count from 1
    got = play(b, then)
    assert len(got) == len(want) == 12
    for (_, x), (_, y) in zip(want, got):
        np.testing.assert_allclose(y, x, rtol=1e-6, atol=1e-7)


def test_a_store_changed_behind_its_back_is_refused_at_resume_naming_the_file(tmp_path):
    make = OPTIMIZERS["sgd_momentum"]
    a = new_server(make, tmp_path)
    play(a, messages(4, 2))
    a.flush_store()
    path = os.path.join(str(tmp_path), "key%d_at0.rows" % SPARSE)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 8)
    s = ServerState(0, 2, True, store=StoreSettings(str(tmp_path), 1 << 20, True))
    s.on_request(b"w0", Header(MsgType.SET_OPTIMIZER, sender=0), pickle.dumps(make()))
    out = s.on_request(b"w0", Header(MsgType.INIT, key=SPARSE, sender=0, length=ROWS * COLS,
                                     dtype=F32, iteration=COLS),
                       np.zeros(ROWS * COLS, np.float32))
    assert out[0].header.type == MsgType.ERROR
    text = out[0].payload.decode()
    assert text.startswith("key 9: the disk store at") and "key9_at0.rows" in text


def test_the_optimizer_must_come_before_the_keys_and_states_files_are_refused(tmp_path):
    s = ServerState(0, 2, True, store=StoreSettings(str(tmp_path), 1 << 20))
    s.on_request(b"w0", Header(MsgType.INIT, key=1, sender=0, length=4, dtype=F32),
                 np.zeros(4, np.float32))
    out = s.on_request(b"w0", Header(MsgType.SET_OPTIMIZER, sender=0),
                       pickle.dumps(OPTIMIZERS["adam"]()))
    assert b"the optimizer must be set first" in out[0].payload
    out = s.on_request(b"w0", Header(MsgType.GET_STATES, sender=0), None)
    assert b"the store is the checkpoint" in out[0].payload


# --------------------------------------------------------------------------- whole jobs

@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    import cluster
    return cluster.job_cache(tmp_path_factory)


@pytest.mark.parametrize("optimizer", ["adam"])    # SGD: message by message above
def test_a_2x2_job_with_the_disk_store_ends_with_the_memory_stores_weights(jobs, tmp_path,
                                                                           optimizer):
    import cluster
    env = dict(update_on_kvstore=True, optimizer=optimizer, model="mlp_big",
               MXNET_KVSTORE_BIGARRAY_BOUND=100000)
    mem = jobs.train(cluster.train_env("mxps", **env), 2, 2)
    disk = jobs.train(cluster.train_env("mxps", MXPS_STORE="disk",
                                        MXPS_STORE_DIR=str(tmp_path / "store"),
                                        MXPS_STORE_CACHE_MB=1, **env), 2, 2)
    want = cluster.assert_synchronised(mem.out_dir, 2)
    got = cluster.assert_synchronised(disk.out_dir, 2)
    cluster.assert_weights_close(got, want, rtol=1e-6, what="disk store vs memory store")
    # every server flushed its tables at the clean stop
    for server in (0, 1):
        names = os.listdir(str(tmp_path / "store" / ("server%d" % server)))
        assert any(n.endswith(".manifest.json") for n in names), names


def test_a_job_restarted_from_its_store_ends_with_the_weights_of_an_uninterrupted_job(
        jobs, tmp_path):
    """2x2, Adam on the servers: 10 steps in one job, against 5 steps, a clean stop (the store
    flushed) and a new job with MXPS_STORE_RESUME=1 on the same directory training steps 5-9:
    the same weights (Adam's moments and its update count came back from the disk)."""
    import cluster
    env = dict(update_on_kvstore=True, optimizer="adam", model="mlp_big",
               MXNET_KVSTORE_BIGARRAY_BOUND=100000, MXPS_STORE="disk", MXPS_STORE_CACHE_MB=1)
    whole = jobs.train(cluster.train_env("mxps", steps=10, MXPS_STORE_DIR=str(tmp_path / "a"),
                                         **env), 2, 2)
    store = str(tmp_path / "b")
    first = jobs.train(cluster.train_env("mxps", steps=5, MXPS_STORE_DIR=store, **env), 2, 2)
    second = jobs.train(cluster.train_env("mxps", steps=10, JOB_FIRST_STEP=5,
                                          MXPS_STORE_DIR=store, MXPS_STORE_RESUME=1, **env),
                        2, 2)
    want = cluster.assert_synchronised(whole.out_dir, 2)
    half = cluster.assert_synchronised(first.out_dir, 2)
    got = cluster.assert_synchronised(second.out_dir, 2)
    cluster.assert_weights_close(got, want, rtol=1e-6, what="resumed vs uninterrupted")
    with pytest.raises(AssertionError):          # the second job did train on
        cluster.assert_weights_close(half, want, rtol=1e-6, what="after 5 steps")


def test_a_job_whose_server_is_killed_resumes_from_its_last_checkpoint(jobs, tmp_path):
    """2x2, Adam on the servers, a table bigger than the store's cache (rows are written back
    in place between checkpoints, under undo logs), a checkpoint every 2 rounds: the server of
    rank 1, frozen (SIGSTOP) while rows it wrote after the checkpoint of round 4 are in its
    file, is killed with SIGKILL (the job ends: a lost server); a new job
    with MXPS_STORE_RESUME=1 returns every table to the newest round all servers flushed, the
    workers go on from that step (mxps.resume_round), and the job ends with the weights of
    the uninterrupted one."""
    import cluster
    from mxps.store.checkpoints import held
    from mxps_tools import jobs as runner
    env = cluster.train_env("mxps", steps=10, update_on_kvstore=True, optimizer="adam",
                            model="mlp_big", MXNET_KVSTORE_BIGARRAY_BOUND=100000,
                            MXPS_STORE="disk", MXPS_STORE_CACHE_MB=0.25,
                            MXPS_STORE_CHECKPOINT_ROUNDS=2)
    whole = jobs.train(dict(env, MXPS_STORE_DIR=str(tmp_path / "a")), 2, 2)
    store, out = tmp_path / "b", tmp_path / "crashed"
    job = runner.Job([cluster.TRAIN_JOB], 2, 2, env=dict(env, JOB_SLOW="0:0.25",
                                                         MXPS_STORE_DIR=str(store),
                                                         JOB_OUT=str(out)),
                     log_dir=str(tmp_path / "logs"), cpu_interval=None, timeout=240)
    def open_after_4():
        """Server 1 checkpointed round 4 and has written rows in place since."""
        if 4 not in held(str(store)).get(1, ()):
            return False
        try:
            ms = [json.loads(p.read_text()) for p in store.glob("server1/*.manifest.json")]
        except (OSError, ValueError):       # a manifest being replaced
            return False
        return any(not m["clean"] for m in ms)

    with job:
        job.wait(lambda: (job.job_info() or {}).get("servers"), 150, "the job's start")
        pid = [n["pid"] for n in job.job_info()["servers"] if n["rank"] == 1][0]
        victim = job.by_pid(pid)                    # the server of rank 1 (server1/)
        for _ in range(20):     # frozen while rows are written in place, then killed
            job.wait(open_after_4, 150, "server 1's writes after the checkpoint of round 4")
            job.kill(victim, signal.SIGSTOP)
            if open_after_4():
                break
            job.kill(victim, signal.SIGCONT)
        job.kill(victim)
        job.wait(job.all_exited, 60, "the job's end after a server was killed")
        assert not os.path.exists(out / "weights_rank0.npz"), "the job finished before the kill"
    manifests = [json.loads(p.read_text()) for p in store.glob("server1/*.manifest.json")]
    # rows were written in place after the last checkpoint: only the undo logs give it back
    assert any(not m["clean"] and m["undo"] for m in manifests), manifests
    resumed = jobs.train(dict(env, JOB_FIRST_STEP="auto", MXPS_STORE_DIR=str(store),
                              MXPS_STORE_RESUME=1), 2, 2)
    first = cluster.load_meta(resumed.out_dir, 0)["first_step"]
    assert first in (4, 6, 8), first         # a checkpoint round, and the job had more to do
    want = cluster.assert_synchronised(whole.out_dir, 2)
    got = cluster.assert_synchronised(resumed.out_dir, 2)
    cluster.assert_weights_close(got, want, rtol=1e-6, what="resumed after a kill vs "
                                 "uninterrupted")
    info = runner.read_job_info(os.path.join(resumed.out_dir, "logs", runner.JOB_INFO_FILE))
    assert info["resume_round"] == first


def test_a_sparse_job_with_the_disk_store_replanned_every_step_equals_the_reference(tmp_path):
    """The embedding's rows, Adam's state beside them, in tables of a 50 KB cache; a new plan
    before every step moves slices (their tables) between the two servers."""
    import cluster
    from test_sparse import SPARSE_JOB
    env = {"SPARSE_WEIGHT": "weight", "SPARSE_OPTIMIZER": "adam",
           "MXNET_KVSTORE_BIGARRAY_BOUND": "1000"}
    cluster.run_single([SPARSE_JOB], env=dict(env, SPARSE_KVSTORE="local", SPARSE_SIMULATE=2,
                                              SPARSE_OUT=str(tmp_path / "ref")), timeout=300)
    result = cluster.run_job([SPARSE_JOB], 2, 2, env=dict(
        env, SPARSE_OUT=str(tmp_path / "job"), MXPS_STORE="disk",
        MXPS_STORE_DIR=str(tmp_path / "store"), MXPS_STORE_CACHE_MB="0.05",
        MXPS_PLAN="adaptive", MXPS_REPLAN_FORCE="1", MXPS_REPLAN_INTERVAL="1",
        MXPS_MIN_SLICE="64", MXPS_MAX_CHUNK="300"), timeout=300)
    result.raise_for_failure()
    want = cluster.load_weights(str(tmp_path / "ref"), 0)
    for r in range(2):
        cluster.assert_weights_close(cluster.load_weights(str(tmp_path / "job"), r), want,
                                     rtol=1e-5, what="rank %d, disk store" % r)
    moved = [p["moved_bytes"] for p in result.job_info["replan_points"] if p["new_plan"]]
    assert len(moved) >= 10 and min(moved) > 0, moved


def test_store_settings_are_read_and_bad_ones_refused_by_name():
    from mxps import config
    base = {"DMLC_ROLE": "server", "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9000",
            "DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1"}
    cfg = config.from_env(dict(base, MXPS_STORE="disk", MXPS_STORE_DIR="/x",
                               MXPS_STORE_CACHE_MB="64", MXPS_STORE_RESUME="1"))
    assert (cfg.store, cfg.store_dir, cfg.store_cache_mb, cfg.store_resume) == \
        ("disk", "/x", 64.0, True)
    assert config.from_env(base).store == "memory"
    # the disk store moves its tables with a live re-plan (roles.migration)
    assert config.from_env(dict(base, MXPS_STORE="disk", MXPS_STORE_DIR="/x",
                                MXPS_PLAN="adaptive")).replanning
    assert config.from_env(dict(base, MXPS_STORE="disk", MXPS_STORE_DIR="/x",
                                MXPS_STORE_CHECKPOINT_ROUNDS="5")).store_checkpoint_rounds == 5
    for extra, match in ((dict(MXPS_STORE="ssd"), "MXPS_STORE='ssd': use memory or disk"),
                         (dict(MXPS_STORE="disk"), "MXPS_STORE=disk needs MXPS_STORE_DIR"),
                         (dict(MXPS_STORE_RESUME="1"), "MXPS_STORE_RESUME=1 resumes a disk"),
                         (dict(MXPS_STORE_CHECKPOINT_ROUNDS="3"),
                          "MXPS_STORE_CHECKPOINT_ROUNDS=3 checkpoints a disk store"),
                         (dict(MXPS_STORE="disk", MXPS_STORE_DIR="/x",
                               MXPS_STORE_CHECKPOINT_ROUNDS="-1"), "must be at least 0"),
                         (dict(MXPS_STORE_CHECKPOINT_SECONDS="5"),
                          "MXPS_STORE_CHECKPOINT_SECONDS=5 checkpoints a disk store"),
                         (dict(MXPS_STORE="disk", MXPS_STORE_DIR="/x",
                               MXPS_STORE_CHECKPOINT_SECONDS="-2"), "must be at least 0"),
                         (dict(MXPS_STORE="disk", MXPS_STORE_DIR="/x", MXPS_PLAN="adaptive",
                               MXPS_STORE_CHECKPOINT_ROUNDS="2"),
                          "MXPS_STORE_CHECKPOINT_\\* and live re-planning"),
                         (dict(MXPS_STORE="disk", MXPS_STORE_DIR="/x", MXPS_PLAN="adaptive",
                               MXPS_STORE_RESUME="1"), "a checkpoint holds the tables")):
        with pytest.raises(config.ConfigError, match=match):
            config.from_env(dict(base, **extra))
