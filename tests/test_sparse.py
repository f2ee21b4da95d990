"""Row-sparse keys (docs/SPARSE.md): pushes of row_sparse gradients and row_sparse_pull.

The helpers that cut rows along slices and put them back are checked against the dense
arrays they stand for; a server's sparse rounds against MXNet's own lazy update of a full
table; whole jobs (tests/jobs/sparse_job.py: an embedding bag over digits, 2 workers x 2
servers) against a one-process reference that sums the workers' gradients and steps once, as
a synchronous parameter server does (native MXNet 1.9.1's dist_sync is no reference here: its
server crashed on this model).
"""
import pickle
import re

import mxnet as mx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from mxps.store import row_sets as sparse
from mxps.roles.server_state import ServerState
from mxps.wire import typed
from mxps.wire.frame import Header, MsgType, dtype_code

F32 = dtype_code(np.float32)
PROPS = settings(max_examples=150, deadline=None)


@st.composite
def tables(draw):
    n_rows = draw(st.integers(1, 12))
    cols = draw(st.integers(1, 5))
    ids = np.array(sorted(draw(st.sets(st.integers(0, n_rows - 1)))), np.int64)
    size = n_rows * cols
    cuts = sorted(draw(st.sets(st.integers(1, size - 1), max_size=4))) if size > 1 else []
    bounds = [0] + cuts + [size]
    values = np.arange(1, ids.size * cols + 1, dtype=np.float32).reshape(ids.size, cols)
    return n_rows, cols, ids, values, list(zip(bounds, bounds[1:]))


@PROPS
@given(tables())
def test_rows_cut_along_any_slices_and_put_back_give_the_dense_array(case):
    n_rows, cols, ids, values, slices = case
    dense = np.zeros(n_rows * cols, np.float32)
    dense.reshape(n_rows, cols)[ids] = values
    rebuilt = np.zeros_like(dense)
    for lo, hi in slices:
        sel, flat = sparse.cut(ids, values, cols, lo, hi)
        pos = sparse.positions(sel, cols, lo, hi - lo)
        assert pos.size == flat.size
        assert (pos >= 0).all() and (pos < hi - lo).all()
        rebuilt[lo:hi][pos] = flat
    np.testing.assert_array_equal(rebuilt, dense)


@PROPS
@given(tables())
def test_a_slice_s_rows_padded_to_whole_rows_and_trimmed_give_back_its_values(case):
    n_rows, cols, ids, values, slices = case
    for lo, hi in slices:
        sel, flat = sparse.cut(ids, values, cols, lo, hi)
        rows = sparse.rows_in(sel, cols, lo, hi - lo)
        assert rows.size == flat.size
        block = sparse.padded(rows, flat)
        assert block.shape == (sel.size, cols)
        # each padded row is the table's row with its elements outside the slice zeroed
        for i, r in enumerate(sel.tolist()):
            for c in range(cols):
                inside = lo <= r * cols + c < hi
                want = values[np.searchsorted(ids, r), c] if inside else 0
                assert block[i, c] == want
        np.testing.assert_array_equal(sparse.trimmed(rows, block), flat)
        np.testing.assert_array_equal(rows.positions(),
                                      sparse.positions(sel, cols, lo, hi - lo))


@PROPS
@given(st.integers(1, 4), st.integers(0, 7), st.integers(1, 20),
       st.lists(st.tuples(st.sets(st.integers(0, 11)), st.integers(1, 9)), min_size=1,
                max_size=5))
def test_merge_rows_sums_every_element_its_pushes_carry_in_push_order(cols, offset, length,
                                                                      pushes):
    n_rows = 12
    length = min(length, n_rows * cols - offset)
    if length <= 0:
        return
    table = np.zeros(n_rows * cols, np.float64)
    first, last = offset // cols, (offset + length - 1) // cols
    parts = []
    for rows, v in pushes:
        ids = np.array(sorted(r for r in rows if first <= r <= last), np.int64)
        rs = sparse.rows_in(ids, cols, offset, length)
        flat = np.full(rs.size, float(v)) * (1 + np.arange(rs.size))
        parts.append((rs, sparse.padded(rs, flat)))
        table[offset:offset + length][rs.positions()] += flat
    rows, block = sparse.merge_rows(parts)
    touched = sorted(set().union(*[set(p[0].ids.tolist()) for p in parts]))
    assert rows.ids.tolist() == touched
    np.testing.assert_array_equal(sparse.trimmed(rows, block),
                                  table[offset:offset + length][rows.positions()])


def test_bad_row_ids_are_refused_by_name():
    with pytest.raises(ValueError, match="sorted and distinct"):
        sparse.check_ids(np.array([3, 1], np.int64), 5, "key 1")
    with pytest.raises(ValueError, match=r"key 1: row ids must lie in \[0, 5\)"):
        sparse.check_ids(np.array([1, 5], np.int64), 5, "key 1")
    with pytest.raises(ValueError, match="row 0 .* has no element in the slice"):
        sparse.positions(np.array([0], np.int64), 2, 4, 4)
    with pytest.raises(ValueError, match="row 4 .* has no element in the slice"):
        sparse.rows_in(np.array([2, 4], np.int64), 2, 4, 4)


# --------------------------------------------------------------------------- the server

ROWS, COLS, KEY = 7, 3, 9


def server(optimizer, workers=2):
    s = ServerState(0, workers, True)
    s.on_request(b"w0", Header(MsgType.SET_OPTIMIZER, sender=0), pickle.dumps(optimizer))
    init = np.linspace(-1, 1, ROWS * COLS).astype(np.float32)
    s.on_request(b"w0", Header(MsgType.INIT, key=KEY, sender=0, length=ROWS * COLS,
                               dtype=F32), init)
    return s, init


def push_rows(s, w, it, ids, values):
    body = typed.pack({"cols": COLS, "ids": np.asarray(ids, np.int64),
                       "values": np.asarray(values, np.float32).reshape(-1)})
    h = Header(MsgType.PUSH_ROWS, key=KEY, sender=w, iteration=it, length=ROWS * COLS,
               dtype=F32, request_id=100 * w + it)
    return s.on_request(b"w%d" % w, h, body)


def pull_rows(s, w, it, ids):
    h = Header(MsgType.PULL_ROWS, key=KEY, sender=w, iteration=it, length=ROWS * COLS,
               request_id=1000 + 100 * w + it)
    return s.on_request(b"w%d" % w, h, typed.pack({"cols": COLS,
                                                   "ids": np.asarray(ids, np.int64)}))


@pytest.mark.parametrize("make", [
    lambda: mx.optimizer.SGD(learning_rate=0.3, momentum=0.9, wd=0.01, rescale_grad=0.5),
    lambda: mx.optimizer.Adam(learning_rate=0.05, wd=0.01),
], ids=["sgd_momentum", "adam"])
def test_sparse_rounds_equal_mxnets_lazy_update_of_the_whole_table(make):
    s, init = server(make())
    ref_w = mx.nd.array(init.reshape(ROWS, COLS))
    ref = mx.optimizer.get_updater(make())
    rng = np.random.RandomState(0)
    for it in range(1, 5):
        grads = []
        for w in range(2):
            ids = np.sort(rng.choice(ROWS, size=rng.randint(0, 4), replace=False))
            vals = rng.randn(ids.size, COLS).astype(np.float32)
            grads.append(mx.nd.sparse.row_sparse_array((vals, ids), shape=(ROWS, COLS)))
            push_rows(s, w, it, ids, vals)
        total = mx.nd.sparse.elemwise_add(grads[0], grads[1])
        ref(KEY, total, ref_w)
        out = pull_rows(s, 0, it, np.arange(ROWS))
        got = np.array(out[-1].payload, np.float32).reshape(ROWS, COLS)
        np.testing.assert_allclose(got, ref_w.asnumpy(), rtol=1e-6, atol=1e-7)


def test_rows_nobody_pushed_keep_their_weight_and_momentum():
    s, init = server(mx.optimizer.SGD(learning_rate=1.0, momentum=0.9))
    push_rows(s, 0, 1, [2], np.ones((1, COLS)))
    push_rows(s, 1, 1, [], np.zeros((0, COLS)))
    w = s.slots[(KEY, 0)].store.weight.reshape(ROWS, COLS)
    mom = s.updater.states[KEY].asnumpy().reshape(ROWS, COLS)
    untouched = [r for r in range(ROWS) if r != 2]
    np.testing.assert_array_equal(w[untouched], init.reshape(ROWS, COLS)[untouched])
    assert (mom[untouched] == 0).all() and (mom[2] != 0).all()


def test_a_pull_of_rows_waits_for_its_round_and_answers_only_those_rows():
    s, init = server(mx.optimizer.SGD(learning_rate=1.0))
    push_rows(s, 0, 1, [1], np.ones((1, COLS)))
    assert pull_rows(s, 0, 1, [1, 4]) == []              # round 1 is not complete
    outs = push_rows(s, 1, 1, [4], np.ones((1, COLS)))
    data = [o for o in outs if o.header.type == MsgType.DATA]
    got = np.array(data[0].payload, np.float32).reshape(2, COLS)
    want = init.reshape(ROWS, COLS)[[1, 4]] - 1.0
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("body,match", [
    ({"cols": COLS, "ids": np.array([3, 1], np.int64), "values": np.zeros(6, np.float32)},
     "sorted and distinct"),
    ({"cols": COLS, "ids": np.array([1], np.int64), "values": np.zeros(2, np.float32)},
     "2 values for the 3 elements of 1 rows"),
    ({"cols": 0, "ids": np.array([1], np.int64), "values": np.zeros(3, np.float32)},
     "cols must be a positive integer"),
    ({"cols": COLS, "ids": np.array([1], np.int32), "values": np.zeros(3, np.float32)},
     "ids must be an int64 array"),
    ({"cols": COLS, "ids": np.array([1], np.int64)}, "missing values"),
])
def test_a_malformed_sparse_push_is_refused_naming_the_key_and_changes_nothing(body, match):
    s, init = server(mx.optimizer.SGD(learning_rate=1.0))
    h = Header(MsgType.PUSH_ROWS, key=KEY, sender=0, iteration=1, length=ROWS * COLS,
               dtype=F32, request_id=5)
    out = s.on_request(b"w0", h, typed.pack(body))
    assert out[0].header.type == MsgType.ERROR
    text = out[0].payload.decode()
    assert text.startswith("key 9: PUSH_ROWS") and re.search(match, text)
    assert not s.slots[(KEY, 0)].rounds
    np.testing.assert_array_equal(s.slots[(KEY, 0)].store.weight, init)


def test_sparse_pushes_without_an_optimizer_on_the_servers_or_mixed_with_dense_are_refused():
    s = ServerState(0, 2, True)
    s.on_request(b"w0", Header(MsgType.INIT, key=KEY, sender=0, length=ROWS * COLS, dtype=F32),
                 np.zeros(ROWS * COLS, np.float32))
    out = push_rows(s, 0, 1, [1], np.ones((1, COLS)))
    assert b"row-sparse pushes need the optimizer on the servers" in out[0].payload
    s, _ = server(mx.optimizer.SGD(learning_rate=1.0))
    push_rows(s, 0, 1, [1], np.ones((1, COLS)))
    h = Header(MsgType.PUSH, key=KEY, sender=1, iteration=1, length=ROWS * COLS, dtype=F32,
               request_id=77)
    out = s.on_request(b"w1", h, np.ones(ROWS * COLS, np.float32))
    assert b"worker 1 pushed round 1 dense, the others row-sparse" in out[0].payload


# --------------------------------------------------------------------------- whole jobs

SPARSE_JOB = __import__("os").path.join(__import__("os").path.dirname(__file__), "jobs",
                                        "sparse_job.py")


@pytest.mark.parametrize("weight,optimizer,push", [("grad", "sgd", "tcp"),
                                                    ("weight", "adam", "2_devices"),
                                                    ("grad", "sgd", "ltp"),
                                                    ("weight", "adam", "overlapped_moves")])
def test_a_sparse_model_trained_by_two_workers_equals_the_one_process_reference(
        tmp_path, weight, optimizer, push):
    """2 workers x 2 servers (the embedding's rows cut across both servers, so rows straddle
    the cut), 12 steps: the final weights of every worker equal the reference's to 1e-5 and
    the loss went down.  Under LTP (every slice big enough for it) the row pushes go by TCP
    and the dense ones by LTP.  Re-planned every step (forced, slices of 64 elements or more)
    with overlapped moves, every slice's rows, Adam's state and update count move between the
    servers while the workers already push and pull rows by the new plan.  With 2 devices per
    worker (the reference: 4), each worker sums its devices' row gradients before the push and
    the rows are pulled onto both (Gluon's deferred broadcast runs inside the forward pass)."""
    import cluster
    env = {"SPARSE_WEIGHT": weight, "SPARSE_OPTIMIZER": optimizer,
           "MXNET_KVSTORE_BIGARRAY_BOUND": "1000"}
    if push == "ltp":
        env.update(MXPS_PUSH="ltp", MXPS_LTP_MIN_BYTES="1")
    devices = 2 if push == "2_devices" else 1
    if devices > 1:
        env["SPARSE_DEVICES"] = str(devices)
    replanned = push == "overlapped_moves"
    if replanned:
        env.update(MXPS_PLAN="adaptive", MXPS_REPLAN_FORCE="1", MXPS_REPLAN_INTERVAL="1",
                   MXPS_MIN_SLICE="64", MXPS_MAX_CHUNK="300", MXPS_REPLAN_OVERLAP="1")
    ref_dir, job_dir = tmp_path / "ref", tmp_path / "job"
    cluster.run_single([SPARSE_JOB], env=dict(env, SPARSE_KVSTORE="local",
                                              SPARSE_SIMULATE=2 * devices,
                                              SPARSE_OUT=str(ref_dir)), timeout=300)
    result = cluster.run_job([SPARSE_JOB], 2, 2, env=dict(env, SPARSE_OUT=str(job_dir)),
                             timeout=300)
    result.raise_for_failure()
    want = cluster.load_weights(str(ref_dir), 0)
    for r in range(2):
        cluster.assert_weights_close(cluster.load_weights(str(job_dir), r), want, rtol=1e-5,
                                     what="rank %d vs the one-process reference" % r)
    losses = cluster.load_meta(str(job_dir), 0)["losses"]
    assert losses[-1] < losses[0]
    if replanned:
        points = [p for p in result.job_info["replan_points"] if p["new_plan"]]
        assert len(points) >= 10 and all(p["moved_bytes"] > 0 for p in points), points


def test_rows_of_another_width_than_the_key_was_initialised_with_are_refused():
    s = ServerState(0, 2, True)
    s.on_request(b"w0", Header(MsgType.SET_OPTIMIZER, sender=0),
                 pickle.dumps(mx.optimizer.SGD(learning_rate=1.0)))
    s.on_request(b"w0", Header(MsgType.INIT, key=KEY, sender=0, length=ROWS * COLS, dtype=F32,
                               iteration=COLS + 1), np.zeros(ROWS * COLS, np.float32))
    out = push_rows(s, 0, 1, [1], np.ones((1, COLS)))
    assert out[0].header.type == MsgType.ERROR
    assert b"rows of 3 elements, but the key was initialised with rows of 4" in out[0].payload
