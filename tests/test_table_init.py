"""Tables initialised from a rule (mxps.TableInit, INIT_TABLE): the same numbers wherever and
in whatever order they are made; a disk store makes a row only when it is first touched."""
import json
import os
import re
import pickle

import mxnet as mx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from mxps.roles.server_state import ServerState, StoreSettings
from mxps.store.table_init import TableInit
from mxps.wire import typed
from mxps.wire.frame import Header, MsgType, dtype_code

F32 = dtype_code(np.float32)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 5000), st.data())
def test_any_part_of_the_table_is_the_same_numbers_as_the_whole(n, data):
    rule = TableInit((n,), scale=0.25, seed=data.draw(st.integers(0, 2 ** 32 - 1)))
    whole = rule.span(0, n)
    a = data.draw(st.integers(0, n - 1))
    b = data.draw(st.integers(a + 1, n))
    np.testing.assert_array_equal(rule.span(a, b), whole[a:b])
    np.testing.assert_array_equal(rule.span(a, b, block=7), whole[a:b])     # made in blocks
    idx = np.array(data.draw(st.lists(st.integers(0, n - 1), max_size=20)), np.int64)
    np.testing.assert_array_equal(rule.values(idx), whole[idx])
    assert (np.abs(whole) <= 0.25).all()


def test_the_values_look_uniform_and_seeds_differ():
    x = TableInit((200000,), scale=1.0, seed=1).span(0, 200000)
    assert abs(x.mean()) < 0.01 and abs(x.std() - 1 / np.sqrt(3)) < 0.01
    assert not np.array_equal(x[:100], TableInit((100,), scale=1.0, seed=2).span(0, 100))


def test_bad_rules_are_refused_by_name():
    with pytest.raises(ValueError, match="shape"):
        TableInit((0, 3))
    with pytest.raises(ValueError, match="not a float type"):
        TableInit((3,), dtype="int32")
    with pytest.raises(ValueError, match="seed"):
        TableInit((3,), seed=-1)


ROWS, COLS, KEY = 500, 4, 3


def server(directory=None):
    store = None if directory is None else StoreSettings(str(directory), 20000)
    s = ServerState(0, 1, True, store=store)
    s.on_request(b"w0", Header(MsgType.SET_OPTIMIZER, sender=0),
                 pickle.dumps(mx.optimizer.SGD(learning_rate=1.0, momentum=0.5)))
    out = s.on_request(b"w0", Header(MsgType.INIT_TABLE, key=KEY, sender=0, offset=400,
                                     length=ROWS * COLS - 400, dtype=F32, iteration=COLS),
                       typed.pack({"scale": 0.5, "seed": 9}))
    assert out[0].header.type == MsgType.ACK, out[0].payload
    return s


def test_in_ram_the_slice_is_the_rules_values_and_on_disk_only_touched_rows_are_made(tmp_path):
    rule = TableInit((ROWS * COLS,), scale=0.5, seed=9)
    mem, disk = server(), server(tmp_path)
    np.testing.assert_array_equal(mem.slots[(KEY, 400)].store.snapshot,
                                  rule.span(400, ROWS * COLS))
    ids = np.array([100, 101, 450], np.int64)
    for s in (mem, disk):
        h = Header(MsgType.PUSH_ROWS, key=KEY, sender=0, iteration=1, offset=400,
                   length=ROWS * COLS - 400, dtype=F32, request_id=1)
        s.on_request(b"w0", h, typed.pack({"cols": COLS, "ids": ids,
                                           "values": np.ones(ids.size * COLS, np.float32)}))
    np.testing.assert_allclose(disk.slots[(KEY, 400)].store.snapshot,
                               mem.slots[(KEY, 400)].store.snapshot, rtol=1e-6)
    touched = disk.store_stats()["init_rows"]
    assert touched == 400          # every row of the slice: the full read above made them


def test_a_disk_table_makes_only_the_rows_a_round_touches(tmp_path):
    disk = server(tmp_path)
    h = Header(MsgType.PUSH_ROWS, key=KEY, sender=0, iteration=1, offset=400,
               length=ROWS * COLS - 400, dtype=F32, request_id=1)
    disk.on_request(b"w0", h, typed.pack({"cols": COLS, "ids": np.array([120, 300], np.int64),
                                          "values": np.ones(2 * COLS, np.float32)}))
    assert disk.store_stats()["init_rows"] == 2


def check_table_job(out, rows, cols):
    rule = TableInit((rows, cols), scale=0.5, seed=3)
    ids = np.array([0, 7, 2499, 2500, 4999])
    want = rule.values((ids[:, None] * cols + np.arange(cols)).ravel()).reshape(len(ids), cols)
    for r in range(2):
        with open(os.path.join(out, "rank%d.json" % r)) as f:
            got = json.load(f)
        assert got["ids"] == ids.tolist()
        np.testing.assert_allclose(got["before"], want, rtol=1e-6)
        after = want.copy()
        after[[1, 3]] -= 2.0          # both workers pushed ones on rows 7 and 2500, lr 1
        np.testing.assert_allclose(got["after"], after, rtol=1e-6, atol=1e-6)


def test_a_server_making_a_table_for_longer_than_the_heartbeat_timeout_is_not_taken_for_dead(
        tmp_path):
    """Each server makes 128M elements (512 MB) in RAM from the rule and copies them into its
    stored value while the heartbeat timeout is 1 s: the servers heartbeat from inside that work
    and read the scheduler's messages of meanwhile before judging its silence (without either
    the job dies).  The servers' own log shows the work took longer than the timeout, or the
    test has lost its point."""
    import cluster
    job = os.path.join(os.path.dirname(__file__), "jobs", "table_job.py")
    rows, cols, timeout = 4 << 20, 64, 1.0
    res = cluster.run_job([job], 2, 2, env={"TABLE_OUT": str(tmp_path), "TABLE_ROWS": rows,
                                            "TABLE_COLS": cols, "MXPS_HEARTBEAT_INTERVAL": 0.25,
                                            "MXPS_HEARTBEAT_TIMEOUT": timeout},
                          role_env={"server": {"MXPS_LOG_LEVEL": "INFO"}}, timeout=180)
    res.raise_for_failure()
    check_table_job(str(tmp_path), rows, cols)
    made = [float(x) for n in res.nodes if n.role == "server"
            for x in re.findall(r"from its rule in ([0-9.]+) s", n.stderr)]
    assert len(made) == 2, [n.stderr[-2000:] for n in res.nodes if n.role == "server"]
    assert min(made) > timeout, made
    print("\nslices made from the rule in %s s (heartbeat timeout %.1f s)"
          % (", ".join("%.2f" % m for m in made), timeout))


def test_a_job_inits_a_table_from_a_rule_and_pulls_and_pushes_its_rows(tmp_path):
    import cluster
    job = os.path.join(os.path.dirname(__file__), "jobs", "table_job.py")
    cluster.run_job([job], 2, 2, env={"TABLE_OUT": str(tmp_path)},
                    timeout=180).raise_for_failure()
    check_table_job(str(tmp_path), 5000, 8)
