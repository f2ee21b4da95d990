"""Gradient compression in real jobs: the bytes each server gets, and 1bit end to end.

(The equality with native MXNet 2bit is in test_equivalence.py: ``*-2bit-*`` cases.)

With ``2bit`` each worker's push of a slice of n float32 elements is 4 + 4 * ceil(n / 16)
bytes on the wire instead of 4n, and its pull stays 4n: the per-server bytes of every step
(MXPS_METRICS, which counts what each request and reply carried) must be exactly that.
"""
import json

import numpy as np
import pytest

import cluster
from cluster import assert_synchronised, assert_weights_close, load_weights, train_env
from mxps.placement.plan import Plan
from mxps.wire import compression


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    return cluster.job_cache(tmp_path_factory)


def _per_server(path, rank):
    return [[s["bytes"] for s in x["servers"]] for x in map(json.loads, open(
        path.format(rank=rank)))]


def test_a_2bit_job_pushes_a_sixteenth_of_the_bytes_and_pulls_them_all(tmp_path):
    bound = {"MXNET_KVSTORE_BIGARRAY_BOUND": 100000}
    path = str(tmp_path / "metrics-{rank}.jsonl")
    out = str(tmp_path / "job")
    env = train_env("mxps", model="mlp_big", steps=6, MXPS_METRICS=path,
                    JOB_COMPRESSION="2bit:0.0625", **bound)
    cluster.run_job([cluster.TRAIN_JOB], 2, 2, env=dict(env, JOB_OUT=out),
                    timeout=240).raise_for_failure()
    weights = assert_synchronised(out, 2)
    sizes = [int(np.prod(weights[k].shape)) for k in sorted(weights)]
    plan = Plan(2, bigarray_bound=100000)
    codec = compression.parse({"type": "2bit"})
    want = [0, 0]
    for key, n in enumerate(sizes):
        for s in plan.slices(key, n):
            want[s.server] += 4 * s.length + codec.nbytes(s.length)
    plain = sum(8 * n for n in sizes)
    assert plain / sum(want) > 1.85            # a push 16x smaller, the pull as it was
    for rank in (0, 1):
        steps = _per_server(path, rank)
        assert len(steps) >= 5 and all(got == want for got in steps), (steps, want)


def test_a_1bit_job_trains_the_same_by_pushpull_and_by_push_then_pull(jobs):
    """Native MXNet 1.9.1 has no 1bit: the quantizer is checked against MXNet 2.0's kernel
    (test_compression.py); here the two ways a script drives it agree exactly and differ
    from the uncompressed job."""
    one_bit = {"JOB_COMPRESSION": "1bit:0"}
    a = jobs.train(train_env("mxps", **one_bit), 2, 2)
    b = jobs.train(train_env("mxps", JOB_PUSH_PULL=1, **one_bit), 2, 2)
    plain = jobs.train(train_env("mxps", update_on_kvstore=True), 2, 2)   # test_equivalence's too
    wa, wb = assert_synchronised(a.out_dir, 2), assert_synchronised(b.out_dir, 2)
    assert_weights_close(wa, wb, rtol=0.0, what="1bit pushpull vs push then pull")
    wp = load_weights(plain.out_dir, 0)
    assert all(np.linalg.norm(wa[k] - wp[k]) > 0.05 * np.linalg.norm(wp[k]) for k in wp)


TWO_BIT = {"JOB_COMPRESSION": "2bit:0.0625"}
FORCED = dict(MXPS_REPLAN_FORCE=1, MXPS_REPLAN_INTERVAL=1, MXPS_MIN_SLICE=64,
              MXPS_MAX_CHUNK=300, MXPS_LOG_LEVEL="INFO")


@pytest.mark.parametrize("how", ["quiescent", "overlapped"])
def test_a_2bit_job_replanned_every_step_ends_with_the_fixed_plan_weights(jobs, how):
    """Every slice moves to another server before every round: the residual is the whole
    key's, so each new slice takes its part as it is (a residual cut with the slices would
    lose or repeat what quantization held back)."""
    fixed = jobs.train(train_env("mxps", steps=12, **TWO_BIT), 2, 2)
    env = dict(FORCED, MXPS_REPLAN_OVERLAP="1" if how == "overlapped" else "0")
    moving = jobs.train(train_env("mxps", steps=12, **dict(env, **TWO_BIT)), 2, 2)
    plans = [p for p in moving.result.job_info["replan_points"] if p["new_plan"]]
    assert [p["round"] for p in plans] == list(range(2, 13)), plans
    assert_weights_close(assert_synchronised(moving.out_dir, 2),
                         assert_synchronised(fixed.out_dir, 2), rtol=0.0,
                         what="2bit re-planned every step vs a fixed plan")


@pytest.mark.parametrize("feature", ["wsp_k2", "disk_store", "ltp"])
def test_a_2bit_job_with_another_feature_ends_as_the_plain_2bit_job(jobs, tmp_path, feature):
    """WSP with k = W is BSP; the disk store holds what RAM holds (the servers read every push
    through one function); under LTP every compressed push goes by TCP: each ends with the
    weights of the plain 2bit job."""
    env = {"wsp_k2": dict(MXPS_MODE="wsp", MXPS_WSP_K=2),
           "disk_store": dict(MXPS_STORE="disk", MXPS_STORE_DIR=str(tmp_path / "store"),
                              MXPS_STORE_CACHE_MB=1),
           "ltp": dict(MXPS_PUSH="ltp", MXPS_LTP_MIN_BYTES=1)}[feature]
    plain = jobs.train(train_env("mxps", steps=12, update_on_kvstore=True, **TWO_BIT), 2, 2)
    both = jobs.train(train_env("mxps", steps=12, update_on_kvstore=True,
                                **dict(env, **TWO_BIT)), 2, 2)
    assert_weights_close(assert_synchronised(both.out_dir, 2),
                         assert_synchronised(plain.out_dir, 2), rtol=0.0,
                         what="2bit with %s vs 2bit" % feature)


def test_a_2bit_async_job_of_one_worker_ends_as_the_sync_one(jobs):
    """dist_async applies each push on arrival; with one worker that is exactly sync's round
    (async has no bit-exact reference with more workers: arrival order decides)."""
    sync = jobs.train(train_env("mxps", steps=12, update_on_kvstore=True, **TWO_BIT), 1, 2)
    async_ = jobs.train(train_env("mxps_async", steps=12, **TWO_BIT), 1, 2)
    assert_weights_close(load_weights(async_.out_dir, 0), load_weights(sync.out_dir, 0),
                         rtol=0.0, what="2bit async (1 worker) vs sync")
    plain = jobs.train(train_env("mxps", steps=12, update_on_kvstore=True), 1, 2)
    wp = load_weights(plain.out_dir, 0)
    assert any(np.linalg.norm(load_weights(sync.out_dir, 0)[k] - wp[k]) > 1e-3 for k in wp)
