"""mxps trains exactly what native MXNet dist_sync trains.

Same model, seeds, per-worker data and 20 steps as tests/jobs/train_job.py; the final weights of
an mxps job must match the native job's. Each native configuration runs once per session
(shared with test_native_baseline.py through cluster.job_cache).

Tolerance: per parameter, ||w_mxps - w_native|| / ||w_native|| <= 1e-5. A relative norm, not an
elementwise rtol: entries that pass through zero (biases, small weights) would fail an
elementwise rtol on one ulp of rounding of their larger neighbours. 1e-5 is far above float32
rounding accumulated over 20 steps (native update-on-servers vs update-on-workers agree bit for
bit, see test_native_baseline) and far below any real difference: dropping one worker's
gradient, a wrong rescale (x num_workers) or a missing lr_mult changes weights by >1e-3.

If mxps cannot be imported (or does not register kvstore 'mxps') every test here FAILS with
that message, on purpose: a missing plugin must not look like a pass or a skip. (A check that
fails at collection time would abort the whole pytest session, native tests included, so the
check is a module-scoped autouse fixture that runs once.)

EQUIV_KVSTORE=dist_sync runs every case with native as the candidate: a check of the harness,
the cases and the tolerance (3 workers sum in arrival order on native servers, so those runs
are not bit-identical run to run).
"""
import os
import sys

import pytest

import cluster
from cluster import (assert_synchronised, assert_weights_close, load_meta, load_weights,
                     train_env)

RTOL = 1e-5
# The kvstore under test. EQUIV_KVSTORE=dist_sync checks this file and its tolerance against
# native itself (every candidate job is a fresh native run with explicit settings).
CANDIDATE = os.environ.get("EQUIV_KVSTORE", "mxps")
BIG_BOUND = {"MXNET_KVSTORE_BIGARRAY_BOUND": 100000}   # splits mlp_big's 131072-element weight

_CHECK = ("import mxps, mxnet as mx\n"
          "reg = getattr(mx.kv.KVStoreBase, 'kv_registry', {})\n"
          "assert 'mxps' in reg, 'kvstore mxps not registered; registered: %s' % sorted(reg)\n")
_mxps_problem = []


@pytest.fixture(scope="module", autouse=True)
def mxps_is_importable():
    if not CANDIDATE.startswith("mxps"):
        return
    if not _mxps_problem:
        try:
            cluster.run_single(["-c", _CHECK], timeout=120)
            _mxps_problem.append("")
        except AssertionError as exc:
            _mxps_problem.append(str(exc))
    if _mxps_problem[0]:
        pytest.fail("mxps cannot be used (import mxps; kvstore 'mxps' registered) by %s:\n%s"
                    % (sys.executable, _mxps_problem[0]), pytrace=False)


@pytest.fixture(scope="session")
def jobs(tmp_path_factory):
    return cluster.job_cache(tmp_path_factory)


# (id, workers, servers, native config, mxps config). lr_mult cases compare against native with
# update on the workers, the only native mode that honours lr_mult (see test_native_baseline);
# mxps honours it in both modes. CAVEAT: native Adam with update on workers sometimes ends with
# desynchronised workers (see the retry below), so those cases can fail on the reference.
CASES = []
for _w, _s in ((2, 2), (3, 2)):
    for _uok, _mode in ((True, "servers"), (False, "workers")):
        # native: Trainer's default for dist_sync is update on servers (shares the run
        # with test_native_baseline); mxps: asked for explicitly.
        CASES.append(("sgd-%dx%d-update_on_%s" % (_w, _s, _mode), _w, _s,
                      dict(update_on_kvstore=None if _uok else False),
                      dict(update_on_kvstore=_uok)))
        # native dist_sync honours lr_mult only with update on workers, and there native Adam
        # is unreliable (workers end with different weights, see below): the reference is
        # native MXNet playing the W workers exactly in one process (JOB_SIMULATE_WORKERS).
        CASES.append(("adam_lrmult-%dx%d-update_on_%s" % (_w, _s, _mode), _w, _s,
                      dict(optimizer="adam", lr_mult=True, simulate=True),
                      dict(optimizer="adam", lr_mult=True, update_on_kvstore=_uok)))
CASES += [
    ("sgd-2x2-2devices", 2, 2, dict(devices=2), dict(devices=2)),
    ("sgd-2x2-kvstore_object", 2, 2, dict(), dict(kv_object=True)),
    # the pure-Python twins of the Cython hot paths (engine bridge, accumulation), end to end
    ("sgd-2x2-pure_python", 2, 2, dict(), dict(MXPS_PURE_PYTHON=1)),
    ("mlp_big-2x2-split", 2, 2, dict(model="mlp_big", **BIG_BOUND),
     dict(model="mlp_big", **BIG_BOUND)),
    ("module-2x2", 2, 2, dict(api="module"), dict(api="module")),
    # bandwidth-proportional placement (start-up probe): other slices, the same training
    ("mlp_big-3x2-adaptive_plan", 3, 2, dict(model="mlp_big", **BIG_BOUND),
     dict(model="mlp_big", MXPS_PLAN="adaptive", MXPS_MIN_SLICE=1024, **BIG_BOUND)),
    # WSP with k = W waits for every worker: BSP exactly (docs/WSP.md)
    ("sgd-3x2-wsp_k3", 3, 2, dict(), dict(update_on_kvstore=True, MXPS_MODE="wsp",
                                          MXPS_WSP_K=3)),
    ("adam_lrmult-2x2-wsp_k2-update_on_workers", 2, 2,
     dict(optimizer="adam", lr_mult=True, simulate=True),
     dict(optimizer="adam", lr_mult=True, update_on_kvstore=False, MXPS_MODE="wsp",
          MXPS_WSP_K=2)),
]
# Gradient compression (2bit): native MXNet 1.9.1 refuses it in pushpull, so the reference
# pushes then pulls (JOB_PUSH_PULL); mxps compresses both ways.  The threshold is a power of
# two so that the servers' sums of +-threshold are exact whatever order the pushes arrive in.
TWO_BIT = {"JOB_COMPRESSION": "2bit:0.0625"}
CASES += [
    ("sgd-2x2-2bit-push_then_pull", 2, 2, dict(JOB_PUSH_PULL=1, **TWO_BIT),
     dict(JOB_PUSH_PULL=1, **TWO_BIT)),
    ("sgd-2x2-2bit-pushpull", 2, 2, dict(JOB_PUSH_PULL=1, **TWO_BIT), dict(**TWO_BIT)),
    ("sgd-2x2-2devices-2bit", 2, 2, dict(devices=2, JOB_PUSH_PULL=1, **TWO_BIT),
     dict(devices=2, **TWO_BIT)),
    ("sgd-3x2-2bit-update_on_workers", 3, 2,
     dict(update_on_kvstore=False, JOB_PUSH_PULL=1, **TWO_BIT),
     dict(update_on_kvstore=False, **TWO_BIT)),
    ("mlp_big-3x2-2bit-adaptive_plan", 3, 2,
     dict(model="mlp_big", JOB_PUSH_PULL=1, **BIG_BOUND, **TWO_BIT),
     dict(model="mlp_big", MXPS_PLAN="adaptive", MXPS_MIN_SLICE=1024, **BIG_BOUND, **TWO_BIT)),
]


@pytest.mark.parametrize("workers,servers,native_cfg,mxps_cfg",
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_mxps_final_weights_equal_native_dist_sync(jobs, workers, servers, native_cfg,
                                                   mxps_cfg):
    # A native reference must be sound (cluster.native_dist_sync: synchronised, and with update
    # on workers equal to the one-process simulation; re-run up to 4 times, logged in
    # jobs.retried); the candidate gets no retry. (Native Adam with update on workers left
    # workers with different weights in 3 of 4 runs here; SGD in about 1 of 8.)
    native_cfg = dict(native_cfg)
    if native_cfg.pop("simulate", False):
        native = jobs.train(train_env("device", update_on_kvstore=False,
                                      JOB_SIMULATE_WORKERS=workers, **native_cfg), workers, 0)
        native_cfg["update_on_kvstore"] = False
        kind = "device"
    else:
        native = cluster.native_dist_sync(jobs, workers, servers, **native_cfg)
        kind = "dist_sync"
    mine = jobs.train(train_env(CANDIDATE, **mxps_cfg), workers, servers)
    reference = assert_synchronised(native.out_dir, workers, kvstore_type=kind)
    got = assert_synchronised(mine.out_dir, workers)
    for cfg, run in ((native_cfg, native), (mxps_cfg, mine)):
        meta = load_meta(run.out_dir, 0)
        want = cfg.get("update_on_kvstore")
        want = True if want is None and cfg.get("api", "gluon") == "gluon" else want
        if want is not None:
            assert meta["update_on_kvstore"] == want, \
                "%s ran with update_on_kvstore=%s, asked %s" % (
                    meta["kvstore_requested"], meta["update_on_kvstore"], want)
    assert_weights_close(got, reference, rtol=RTOL, what="mxps vs native dist_sync")
    for r in range(1, workers):   # per rank too: rank r trained on the same shard in both
        assert_weights_close(load_weights(mine.out_dir, r), load_weights(native.out_dir, r),
                             rtol=RTOL, what="rank %d mxps vs native" % r)


def test_mxps_job_uses_only_loopback_sockets(jobs):
    run = jobs.train(train_env(CANDIDATE, update_on_kvstore=True), 2, 2)
    assert any(s["state"] == "LISTEN" for s in run.result.sockets), run.result.sockets
    outside = [s for s in run.result.sockets if not (
        cluster.is_loopback_address(s["local"]) and
        (s["state"] == "LISTEN" or cluster.is_loopback_address(s["peer"])))]
    assert not outside, outside
