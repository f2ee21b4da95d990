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
    plain = jobs.train(train_env("mxps"), 2, 2)
    wa, wb = assert_synchronised(a.out_dir, 2), assert_synchronised(b.out_dir, 2)
    assert_weights_close(wa, wb, rtol=0.0, what="1bit pushpull vs push then pull")
    wp = load_weights(plain.out_dir, 0)
    assert all(np.linalg.norm(wa[k] - wp[k]) > 0.05 * np.linalg.norm(wp[k]) for k in wp)
