"""Pairs of features in one job, each ending with the weights of the job without one of them
(docs/COMPOSITION.md; the references are test_equivalence.py's mxps jobs, equal to native).

Every pair here is bit-identical to its reference: the second feature changes where or how
the values travel, never the sums (two workers' sums do not depend on arrival order).
"""
import pytest

import cluster
from cluster import assert_synchronised, assert_weights_close, train_env

FORCED = dict(MXPS_REPLAN_FORCE=1, MXPS_REPLAN_INTERVAL=1, MXPS_MIN_SLICE=64,
              MXPS_MAX_CHUNK=300)
LTP = dict(MXPS_PUSH="ltp", MXPS_LTP_MIN_BYTES=1)          # every dense push by LTP
DISK = dict(MXPS_STORE="disk", MXPS_STORE_CACHE_MB=1)

# (pair, the reference's settings, the pair's settings)
CASES = [
    ("replan_every_step+ltp", dict(update_on_kvstore=True),
     dict(update_on_kvstore=True, **FORCED, **LTP)),
    ("overlapped_moves+update_on_workers", dict(update_on_kvstore=False),
     dict(update_on_kvstore=False, MXPS_REPLAN_OVERLAP=1, **FORCED)),
    ("ltp+2_devices", dict(devices=2), dict(devices=2, **LTP)),
    ("wsp_k2+disk_store", dict(update_on_kvstore=True),
     dict(update_on_kvstore=True, MXPS_MODE="wsp", MXPS_WSP_K=2, **DISK)),
    ("disk_store+update_on_workers", dict(update_on_kvstore=False),
     dict(update_on_kvstore=False, **DISK)),
    ("ltp+disk_store", dict(update_on_kvstore=True),
     dict(update_on_kvstore=True, **LTP, **DISK)),
    ("overlapped_moves+ltp", dict(update_on_kvstore=True),
     dict(update_on_kvstore=True, MXPS_REPLAN_OVERLAP=1, **FORCED, **LTP)),
    ("replan_every_step+disk_store", dict(update_on_kvstore=True),
     dict(update_on_kvstore=True, **FORCED, **DISK)),
]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    return cluster.job_cache(tmp_path_factory)


@pytest.mark.parametrize("reference,pair", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_job_with_both_features_ends_with_the_weights_of_the_job_without_one(
        jobs, tmp_path, reference, pair):
    if "MXPS_STORE" in pair:
        pair = dict(pair, MXPS_STORE_DIR=str(tmp_path / "store"))
    ref = jobs.train(train_env("mxps", **reference), 2, 2)
    both = jobs.train(train_env("mxps", **pair), 2, 2)
    assert_weights_close(assert_synchronised(both.out_dir, 2),
                         assert_synchronised(ref.out_dir, 2), rtol=0.0,
                         what="%s vs %s" % (sorted(pair), sorted(reference)))
    if "MXPS_REPLAN_FORCE" in pair:         # the re-plans moved state
        moved = [p["moved_bytes"] for p in both.result.job_info["replan_points"]
                 if p["new_plan"]]
        assert len(moved) >= 5 and min(moved) > 0, moved
