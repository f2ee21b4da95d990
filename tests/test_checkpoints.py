"""Job-wide checkpoints of the disk store (mxps/store/checkpoints.py): which round a resumed job
starts from, and how the scheduler tells every node (a made-up clock, no processes)."""
import pickle

import mxnet as mx
import numpy as np
import pytest

from mxps.roles.scheduler_state import SchedulerState
from mxps.roles.server_state import ServerState, StoreSettings
from mxps.store import checkpoints
from mxps.store.rows import DiskRows, RowLayout, reachable_steps
from mxps.wire import frame as wire
from mxps.wire.frame import Header, MsgType, dtype_code
from test_scheduler_state import Job, make_cfg, sent

LAYOUT = RowLayout(8, 2, np.float32, 1)


def table(directory, name, steps, then_write=False):
    disk = DiskRows(LAYOUT, directory, name, LAYOUT.cache_bytes(1), keep=2)
    for s in steps:
        w = np.full((8, 2), s, np.float32)
        disk.scatter(np.arange(8, dtype=np.int64), w, [w])
        disk.flush(s)
    if then_write:              # killed mid-epoch: rows written back after the last flush
        w = np.ones((8, 2), np.float32)
        disk.scatter(np.arange(8, dtype=np.int64), w, [w])
    del disk


def test_held_is_what_every_table_of_each_server_directory_can_return_to(tmp_path):
    table(tmp_path / "server0", "a", [3, 6, 9])
    table(tmp_path / "server0", "b", [3, 6], then_write=True)     # died before flushing 9
    table(tmp_path / "server1", "a", [6, 9])
    (tmp_path / "server2").mkdir()
    (tmp_path / "other").mkdir()
    assert checkpoints.held(str(tmp_path)) == {0: [6], 1: [6, 9], 2: []}
    assert checkpoints.held(str(tmp_path / "nothing")) == {}


def test_agree_picks_the_newest_round_every_server_holds_or_names_what_is_missing():
    assert checkpoints.agree([{0: [6, 9], 1: [6, 9]}, {0: [6, 9], 1: [6, 9]}], 2) == 9
    assert checkpoints.agree([{0: [3, 6]}, {1: [6, 9]}], 2) == 6
    with pytest.raises(checkpoints.NoCommonCheckpoint, match=r"no server holds the store of "
                       r"server 1 \(server1 under MXPS_STORE_DIR\)"):
        checkpoints.agree([{0: [3]}, {0: [3]}], 2)
    with pytest.raises(checkpoints.NoCommonCheckpoint, match=r"no round in common: server 0: "
                       r"\[3\]; server 1: \[6, 9\]"):
        checkpoints.agree([{0: [3]}, {1: [6, 9]}], 2)


def register_resuming(job, held_by):
    for i, held in enumerate(held_by):
        info = {"role": "server", "host": "127.0.0.1", "port": 9100 + i, "pid": 100 + i,
                "mode": "sync", "checkpoints": {str(k): v for k, v in held.items()}}
        job.send(b"s%d" % i, MsgType.REGISTER, info)
    job.register(b"w0", "worker", port=9200)
    return job.register(b"w1", "worker", port=9201)


def test_the_scheduler_welcomes_every_node_with_the_agreed_round_and_ranks_servers_by_store():
    job = Job(make_cfg(2, 2))
    # the server with the lower address holds server1's store only: it gets rank 1
    step = register_resuming(job, [{1: [6, 9]}, {0: [6]}])
    welcome = {i: b[0] for i, b in sent(step, MsgType.WELCOME).items()}
    assert {i: w["resume_round"] for i, w in welcome.items()} == dict.fromkeys(welcome, 6)
    assert (welcome[b"s0"]["rank"], welcome[b"s1"]["rank"]) == (1, 0)
    assert job.state.facts()["resume_round"] == 6
    fresh = Job(make_cfg(2, 2))
    for i in range(2):
        fresh.register(b"s%d" % i, "server", port=9100 + i)
    fresh.register(b"w0", "worker", port=9200)
    step = fresh.register(b"w1", "worker", port=9201)
    assert all(b[0]["resume_round"] is None for b in sent(step, MsgType.WELCOME).values())


def test_stores_with_no_common_round_abort_the_job_naming_each_server():
    job = Job(make_cfg(2, 2))
    step = register_resuming(job, [{0: [3]}, {1: [9]}])
    aborts = sent(step, MsgType.ABORT)
    assert sorted(aborts) == [b"s0", b"s1", b"w0", b"w1"]
    assert "cannot resume the disk store (MXPS_STORE_RESUME=1): the servers' stores hold no " \
        "round in common: server 0: [3]; server 1: [9]" in aborts[b"w0"][0]


def test_a_register_with_malformed_checkpoints_is_dropped():
    job = Job(make_cfg(2, 2))
    info = {"role": "server", "host": "127.0.0.1", "port": 9100, "pid": 1, "mode": "sync",
            "checkpoints": {"zero": [1]}}
    job.send(b"s0", MsgType.REGISTER, info)
    assert job.state.malformed == 1 and not job.state.nodes
    assert isinstance(job.state, SchedulerState)


def test_worker_0_marks_every_push_of_the_first_round_it_starts_once_the_seconds_passed():
    t = [0.0]
    clock = checkpoints.RoundClock(10.0, clock=lambda: t[0])
    marked = []
    for r in range(1, 9):
        t[0] = 4.0 * r                      # round r starts at 4r s; its keys' pushes follow
        marked.append([clock.marks(r) for _ in range(3)])
        t[0] += 1.0
        assert clock.marks(r) == marked[-1][0]      # a later key's push of the same round
    assert [r for r, m in enumerate(marked, 1) if all(m)] == [3, 6]   # 12 s, then 24 s
    assert all(not any(m) for r, m in enumerate(marked, 1) if r not in (3, 6))


def test_a_server_checkpoints_the_round_worker_0_marked_and_no_other(tmp_path):
    s = ServerState(0, 2, True, store=StoreSettings(str(tmp_path), 1 << 20))
    s.on_request(b"w0", Header(MsgType.SET_OPTIMIZER, sender=0),
                 pickle.dumps(mx.optimizer.SGD(learning_rate=0.1)))
    f32 = dtype_code(np.float32)
    for key in (1, 2):
        s.on_request(b"w0", Header(MsgType.INIT, key=key, sender=0, length=50, dtype=f32),
                     np.zeros(50, np.float32))
    for r in range(1, 6):
        for key in (1, 2):
            for w in (0, 1):
                flags = wire.CHECKPOINT if (w, r) == (0, 3) else 0
                out = s.on_request(b"w%d" % w, Header(MsgType.PUSH, key=key, sender=w,
                                                      iteration=r, length=50, dtype=f32,
                                                      flags=flags),
                                   np.ones(50, np.float32))
                assert out[0].header.type == MsgType.ACK, out[0].payload
    assert s.checkpoints == [3]
    tables = reachable_steps(str(tmp_path))
    assert sorted(tables) == ["key1_at0", "key2_at0"]
    assert all(steps == [0, 3] for steps in tables.values()), tables
