"""The row store behind DRPS (mxps/store/rows.py, docs/STORE.md): DiskRows against MemoryRows.

DiskRows is checked with caches of a few rows, so that almost every call evicts and writes
back: whatever the sequence of gathers, scatters, reads, flushes and reopenings, it must give
exactly (bit for bit) what the in-memory table gives.  Then its promises one by one: the byte
budget, dirty rows surviving eviction, resuming exactly what was flushed, each refusal of a
store that is not exactly a flushed one, and lazy initialisation of rows.
"""
import json
import os
import shutil
import tempfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mxps.store.rows import (BLOCK_BYTES, DiskRows, MemoryRows, RowLayout, StoreError)
from mxps.store.rows_cache import POLICIES


def weights(rows, cols, dtype):
    """A deterministic init: a different value per element."""
    return ((np.asarray(rows)[:, None] * cols + np.arange(cols)) % 251 * 0.5 - 60).astype(dtype)


class CountingInit:
    """An init that records which rows it was asked for."""

    def __init__(self, cols, dtype):
        self.cols, self.dtype, self.asked = cols, dtype, []

    def __call__(self, rows):
        self.asked.extend(np.asarray(rows).tolist())
        return weights(rows, self.cols, self.dtype)


def same(a, b):
    """Two gathers' results are identical."""
    assert np.array_equal(a[0], b[0])
    assert len(a[1]) == len(b[1])
    for x, y in zip(a[1], b[1]):
        assert np.array_equal(x, y)


def all_rows(store):
    return store.gather(np.arange(store.layout.n_rows))


def fill(store, rows, seed):
    """Scatter values made from ``seed`` on ``rows``; returns them."""
    rng = np.random.default_rng(seed)
    lay = store.layout
    w = rng.standard_normal((len(rows), lay.cols)).astype(lay.dtype)
    states = [rng.standard_normal((len(rows), lay.cols)).astype(lay.dtype)
              for _ in range(lay.n_states)]
    store.scatter(rows, w, states)
    return w, states


def tiny(layout, slots):
    """The cache budget of ``slots`` rows."""
    return layout.cache_bytes(slots)


@pytest.fixture
def layout():
    return RowLayout(40, 6, np.float32, 2)


# --- the model: any sequence of operations --------------------------------------------------

ROWS = st.lists(st.integers(0, 29), min_size=0, max_size=12, unique=True).map(sorted)
OPS = st.lists(st.one_of(
    st.tuples(st.just("gather"), ROWS), st.tuples(st.just("read"), ROWS),
    st.tuples(st.just("update"), ROWS), st.tuples(st.just("scatter"), ROWS),
    st.tuples(st.just("flush"), st.just(None)), st.tuples(st.just("reopen"), st.just(None)),
    st.tuples(st.just("crash"), st.just(None)), st.tuples(st.just("back"), st.just(None))),
    min_size=1, max_size=25)
KEEP = 3


def restored(layout, init, snapshot):
    """A MemoryRows holding ``snapshot`` (every row's weights and states)."""
    ref = MemoryRows(layout, init)
    ref.scatter(np.arange(layout.n_rows, dtype=np.int64), *snapshot)
    return ref


@settings(max_examples=120, deadline=None)
@given(ops=OPS, slots=st.integers(1, 5), n_states=st.integers(0, 2),
       dtype=st.sampled_from([np.float16, np.float32, np.float64]),
       policy=st.sampled_from(sorted(POLICIES)))
def test_any_sequence_on_a_tiny_cache_gives_exactly_what_memory_gives(ops, slots, n_states,
                                                                       dtype, policy):
    layout = RowLayout(30, 3, dtype, n_states)
    init = lambda rows: weights(rows, layout.cols, dtype)       # noqa: E731
    budget = tiny(layout, slots)
    ref = MemoryRows(layout, init)
    flushed = []                # (step, every row) at each flush: the checkpoints
    with tempfile.TemporaryDirectory() as d:
        disk = DiskRows(layout, d, "t", budget, init=init, policy=policy, keep=KEEP)
        for step, (op, rows) in enumerate(ops):
            rows = None if rows is None else np.array(rows, np.int64)
            if op == "gather":
                same(disk.gather(rows), ref.gather(rows))
            elif op == "read":
                assert np.array_equal(disk.read(rows), ref.read(rows))
            elif op == "update":            # the server's round: gather, step, scatter
                w, states = disk.gather(rows)
                same((w, states), ref.gather(rows))
                w = (w * 0.5 + step).astype(dtype)
                states = [(s + w * (i + 1)).astype(dtype) for i, s in enumerate(states)]
                disk.scatter(rows, w, states)
                ref.scatter(rows, w, states)
            elif op == "scatter":
                fill(ref, rows, step)
                fill(disk, rows, step)
            elif op in ("flush", "reopen"):
                disk.flush(step)
                flushed.append((step, all_rows(ref)))
                if op == "reopen":          # a checkpoint, then a new process resumes it
                    disk.close()
                    disk = DiskRows(layout, d, "t", budget, init=init, resume=True,
                                    policy=policy, keep=KEEP)
                    assert disk.step == step
            elif flushed:                   # killed (no flush, no close): a new process
                del disk                    # resumes the last checkpoint, or the oldest kept
                flushed = flushed[-KEEP:] if op == "crash" else flushed[-KEEP:][:1]
                disk = DiskRows(layout, d, "t", budget, init=init, resume=True, policy=policy,
                                keep=KEEP, at=flushed[-1][0])
                ref = restored(layout, init, flushed[-1][1])
            assert disk.checkpoints() == [s for s, _ in flushed[-KEEP:]]
            assert disk.stats["cache_bytes_used"] <= budget
        same(all_rows(disk), all_rows(ref))
        disk.close()


# --- the cache ------------------------------------------------------------------------------

def test_eviction_keeps_the_cache_within_its_byte_budget_and_dirty_rows_survive(tmp_path,
                                                                                  layout):
    budget = tiny(layout, 3)
    disk = DiskRows(layout, tmp_path, "t", budget)
    written = {}
    for r in range(layout.n_rows):          # one dirty row at a time: each evicts another
        written[r] = fill(disk, np.array([r]), seed=r)
        assert disk.stats["cache_bytes_used"] <= budget
    stats = disk.stats
    assert stats["evictions"] == layout.n_rows - 3
    assert stats["writebacks"] == layout.n_rows - 3
    assert stats["bytes_written"] == (layout.n_rows - 3) * layout.record_bytes
    for r, (w, states) in written.items():
        same(disk.gather(np.array([r])), (w, states))
        assert disk.stats["cache_bytes_used"] <= budget
    disk.close()


def test_a_batch_larger_than_the_cache_passes_through_it(tmp_path, layout):
    ref = MemoryRows(layout, lambda r: weights(r, layout.cols, np.float32))
    disk = DiskRows(layout, tmp_path, "t", tiny(layout, 2),
                    init=lambda r: weights(r, layout.cols, np.float32))
    rows = np.arange(0, 40, 3)
    same(disk.gather(rows), ref.gather(rows))
    fill(disk, rows, 7)
    fill(ref, rows, 7)
    same(all_rows(disk), all_rows(ref))
    assert disk.stats["cache_bytes_used"] <= tiny(layout, 2)


def test_the_budget_must_hold_the_row_index_and_one_record(tmp_path, layout):
    with pytest.raises(ValueError, match="cache_bytes=%d is below the minimum %d"
                       % (layout.index_bytes, layout.cache_bytes(1))):
        DiskRows(layout, tmp_path, "t", layout.index_bytes)


# --- resume ---------------------------------------------------------------------------------

def test_resume_after_flush_gives_exactly_the_flushed_rows_and_states_and_writes_go_on(
        tmp_path, layout):
    init = lambda r: weights(r, layout.cols, np.float32)      # noqa: E731
    ref = MemoryRows(layout, init)
    disk = DiskRows(layout, tmp_path, "t", tiny(layout, 4), init=init)
    for seed in range(5):
        rows = np.arange(seed, 40, 5 + seed)
        fill(disk, rows, seed)
        fill(ref, rows, seed)
    disk.flush(17)
    disk.close()
    disk = DiskRows(layout, tmp_path, "t", tiny(layout, 4), init=init, resume=True)
    assert disk.step == 17
    same(all_rows(disk), all_rows(ref))
    fill(disk, np.array([0, 1, 39]), 99)
    fill(ref, np.array([0, 1, 39]), 99)
    disk.flush(18)
    disk.close()
    disk = DiskRows(layout, tmp_path, "t", tiny(layout, 1), init=init, resume=True)
    assert disk.step == 18
    same(all_rows(disk), all_rows(ref))
    assert sorted(os.listdir(tmp_path)) == ["t.manifest.json", "t.meta.2", "t.rows"]


def test_a_flush_writes_a_big_cache_in_bounded_batches_and_resumes_exactly(tmp_path, layout,
                                                                          monkeypatch):
    from mxps.store import rows as rows_mod
    monkeypatch.setattr(rows_mod, "FLUSH_BYTES", 3 * layout.record_bytes)
    ref = MemoryRows(layout)
    disk = DiskRows(layout, tmp_path, "t", layout.cache_bytes(layout.n_rows))   # all cached
    rows = np.arange(0, 40, 3)
    fill(disk, rows, 1)
    fill(ref, rows, 1)
    batches = []
    store = disk._store
    monkeypatch.setattr(disk, "_store", lambda r, recs: (batches.append(len(r)), store(r, recs)))
    disk.flush(3)
    assert sum(batches) == len(rows) and max(batches) == 3
    disk.close()
    disk = DiskRows(layout, tmp_path, "t", tiny(layout, 2), resume=True)
    same(all_rows(disk), all_rows(ref))


def test_a_meta_file_left_by_a_flush_cut_short_is_removed_at_resume(tmp_path, layout):
    flushed_store(tmp_path, layout)
    (tmp_path / "t.meta.2").write_bytes(b"written, but the manifest never named it")
    resume(tmp_path, layout).close()
    assert sorted(os.listdir(tmp_path)) == ["t.manifest.json", "t.meta.1", "t.rows"]


def test_writes_still_in_the_cache_at_a_crash_leave_the_last_flush_intact(tmp_path, layout):
    disk = DiskRows(layout, tmp_path, "t", tiny(layout, 8))
    flushed = fill(disk, np.array([3, 4]), 1)
    disk.flush(5)
    fill(disk, np.array([3, 4]), 2)         # dirty in the cache, nothing written to the file
    assert disk.stats["bytes_written"] == 2 * layout.record_bytes
    del disk                                # the process stops: no flush, no close
    disk = DiskRows(layout, tmp_path, "t", tiny(layout, 8), resume=True)
    assert disk.step == 5
    same(disk.gather(np.array([3, 4])), flushed)


# --- refusals -------------------------------------------------------------------------------

def flushed_store(path, layout, rows=np.arange(0, 40, 2)):
    disk = DiskRows(layout, path, "t", tiny(layout, 3))
    fill(disk, rows, 3)
    disk.flush(9)
    disk.close()


def resume(path, layout):
    return DiskRows(layout, path, "t", tiny(layout, 3), resume=True)


def test_a_truncated_data_file_is_refused(tmp_path, layout):
    flushed_store(tmp_path, layout)
    with open(tmp_path / "t.rows", "r+b") as f:
        f.truncate(layout.file_bytes - 100)
    with pytest.raises(StoreError, match=r"t\.rows: cannot resume: the data file is %d bytes, "
                       r"the layout needs %d \(truncated\)" % (layout.file_bytes - 100,
                                                               layout.file_bytes)):
        resume(tmp_path, layout)


def test_a_flipped_byte_in_a_block_is_refused_naming_the_block(tmp_path):
    layout = RowLayout(3000, 100, np.float32, 1)          # 2.4 MB: three checksum blocks
    flushed_store(tmp_path, layout, rows=np.arange(0, 3000, 7))
    at = BLOCK_BYTES + 12345
    with open(tmp_path / "t.rows", "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(StoreError, match=r"block 1 \(bytes %d\.\.%d\) has CRC-32 .* torn or "
                       "corrupted" % (BLOCK_BYTES, 2 * BLOCK_BYTES)):
        resume(tmp_path, layout)


def test_a_missing_manifest_is_refused(tmp_path, layout):
    flushed_store(tmp_path, layout)
    os.unlink(tmp_path / "t.manifest.json")
    with pytest.raises(StoreError, match=r"no manifest t\.manifest\.json"):
        resume(tmp_path, layout)


@pytest.mark.parametrize("edit, problem", [
    (lambda m: m["layout"].update(cols=7), r"the stored layout .*cols=7.* is not the one asked"),
    (lambda m: m["layout"].update(dtype="<f8"), r"stored layout .*float64.* is not the one"),
    (lambda m: m.pop("step"), r"incomplete or malformed"),
    (lambda m: m["meta"].update(crc32=m["meta"]["crc32"] ^ 1), r"meta file .* does not match"),
    (lambda m: m.update(clean=False), r"is marked open .* names no undo log"),
    (lambda m: m.update(older=[{"step": 1}]), r"incomplete or malformed"),
])
def test_an_edited_manifest_is_refused(tmp_path, layout, edit, problem):
    flushed_store(tmp_path, layout)
    path = tmp_path / "t.manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match=problem):
        resume(tmp_path, layout)


def test_a_manifest_that_is_not_json_is_refused(tmp_path, layout):
    flushed_store(tmp_path, layout)
    (tmp_path / "t.manifest.json").write_text('{"format": "mxps-rows/1", "lay')
    with pytest.raises(StoreError, match="is not valid JSON"):
        resume(tmp_path, layout)


def test_resuming_with_another_layout_is_refused(tmp_path, layout):
    flushed_store(tmp_path, layout)
    other = RowLayout(layout.n_rows, layout.cols, np.float16, layout.n_states)
    with pytest.raises(StoreError, match=r"stored layout .*float32.* is not the one asked for, "
                       r".*float16"):
        resume(tmp_path, other)


def test_a_store_killed_after_writes_past_its_flush_resumes_at_that_flush(tmp_path, layout):
    disk = DiskRows(layout, tmp_path, "t", tiny(layout, 2))
    fill(disk, np.arange(10), 1)
    disk.flush(4)
    want = all_rows(disk)
    for r in range(0, 20):                  # each scatter evicts a dirty row to the file
        fill(disk, np.array([r]), r + 7)
    assert disk.stats["writebacks"] >= 17 and disk.stats["undo_bytes"] > 0
    assert json.loads((tmp_path / "t.manifest.json").read_text())["clean"] is False
    del disk                                # a crash: no flush, no close
    back = resume(tmp_path, layout)
    assert back.step == 4 and back.checkpoints() == [4]
    assert [n for n in os.listdir(tmp_path) if ".undo." in n] == []     # undone, removed
    same(all_rows(back), want)


def test_an_undo_log_cut_short_by_the_crash_is_taken_up_to_its_last_whole_batch(tmp_path,
                                                                                layout):
    disk = DiskRows(layout, tmp_path, "t", tiny(layout, 2))
    fill(disk, np.arange(10), 1)
    disk.flush(4)
    want = all_rows(disk)
    for r in range(10):
        fill(disk, np.array([r]), r + 7)
    log = [n for n in os.listdir(tmp_path) if ".undo." in n]
    del disk
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path, copy, ignore=shutil.ignore_patterns("copy"))
    data = (tmp_path / log[0]).read_bytes()
    # a last batch half written (its count garbled too: a log is read a batch at a time, never
    # as much as a count claims): the crash came before its data writes
    (tmp_path / log[0]).write_bytes(data + b"\xff\xff\xff\x7f" + data[24:28 + 8 + 8])
    same(all_rows(resume(tmp_path, layout)), want)
    # a batch that fails its checksum with more after it is corruption
    (copy / log[0]).write_bytes(data[:30] + bytes([data[30] ^ 1]) + data[31:] + data[20:])
    with pytest.raises(StoreError, match=r"undo log .* corrupted batch at byte 20"):
        resume(copy, layout)


def test_older_checkpoints_are_kept_as_asked_and_a_step_not_kept_is_refused(tmp_path, layout):
    disk = DiskRows(layout, tmp_path, "t", tiny(layout, 2), keep=2)
    seen = {}
    for step in (3, 6, 9):
        fill(disk, np.arange(0, 40, step), step)
        disk.flush(step)
        seen[step] = all_rows(disk)
    assert disk.checkpoints() == [6, 9]
    fill(disk, np.arange(5, 25), 11)        # and killed mid-epoch
    del disk
    with pytest.raises(StoreError, match=r"step 3 is not among the checkpoints it keeps "
                       r"\(6, 9\)"):
        DiskRows(layout, tmp_path, "t", tiny(layout, 2), resume=True, at=3, keep=2)
    back = DiskRows(layout, tmp_path, "t", tiny(layout, 2), resume=True, at=6, keep=2)
    assert back.checkpoints() == [6]
    assert sorted(os.listdir(tmp_path)) == ["t.manifest.json", "t.meta.2", "t.rows"]
    same(all_rows(back), seen[6])


def test_a_flush_at_the_step_of_the_last_one_replaces_it(tmp_path, layout):
    disk = DiskRows(layout, tmp_path, "t", tiny(layout, 2), keep=3)
    for step in (3, 6):
        fill(disk, np.arange(0, 40, step), step)
        disk.flush(step)
    fill(disk, np.arange(0, 40, 5), 7)
    disk.flush(6)
    want = all_rows(disk)
    assert disk.checkpoints() == [3, 6]
    del disk
    same(all_rows(DiskRows(layout, tmp_path, "t", tiny(layout, 2), resume=True, at=6,
                           keep=3)), want)


def test_a_store_never_flushed_is_refused(tmp_path, layout):
    disk = DiskRows(layout, tmp_path, "t", tiny(layout, 2))
    fill(disk, np.arange(10), 1)
    disk.close()
    with pytest.raises(StoreError, match=r"names no checkpoint: the store was never flushed"):
        resume(tmp_path, layout)


def test_an_existing_store_is_an_error_unless_overwrite_is_asked(tmp_path, layout):
    flushed_store(tmp_path, layout)
    with pytest.raises(StoreError, match=r"t\.rows: a row store already exists here .*"
                       r"resume=True .* overwrite=True"):
        DiskRows(layout, tmp_path, "t", tiny(layout, 3))
    disk = DiskRows(layout, tmp_path, "t", tiny(layout, 3), overwrite=True)
    same(all_rows(disk), all_rows(MemoryRows(layout)))      # a fresh table of zeros
    disk.flush(0)
    assert sorted(os.listdir(tmp_path)) == ["t.manifest.json", "t.meta.1", "t.rows"]


# --- lazy initialisation --------------------------------------------------------------------

def test_a_table_bigger_than_the_cache_initialises_only_the_rows_asked_for_once(tmp_path):
    layout = RowLayout(200_000, 16, np.float32, 1)          # 25.6 MB, a cache of 50 rows
    init = CountingInit(layout.cols, np.float32)
    disk = DiskRows(layout, tmp_path, "t", layout.cache_bytes(50), init=init)
    batches = [np.arange(0, 200_000, 5000), np.arange(100, 400, 3), np.arange(1, 200_000, 7919)]
    for rows in batches:
        w, states = disk.gather(rows)
        assert np.array_equal(w, weights(rows, layout.cols, np.float32))
        assert all(not s.any() for s in states)               # optimizer state starts at 0
        disk.scatter(rows, w + 1, states)
    again = np.arange(0, 200_000, 5000)                       # evicted long ago: from disk
    assert np.array_equal(disk.read(again), weights(again, layout.cols, np.float32) + 1)
    asked = np.concatenate(batches)
    assert sorted(init.asked) == sorted(set(asked.tolist()))  # each row once, no other row
    assert disk.stats["init_rows"] == len(set(asked.tolist()))
    disk.scatter(np.array([7, 8]), np.ones((2, 16)), [np.ones((2, 16))])   # written, never
    assert 7 not in init.asked and 8 not in init.asked                      # initialised
    disk.flush(1)
    disk.close()
    assert os.stat(tmp_path / "t.rows").st_blocks * 512 < layout.file_bytes // 10   # sparse
    init2 = CountingInit(layout.cols, np.float32)
    disk = DiskRows(layout, tmp_path, "t", layout.cache_bytes(50), init=init2, resume=True)
    rows = np.array([7, 100, 101, 150_002])       # written, written, never, never
    w, _ = disk.gather(rows)
    assert init2.asked == [101, 150_002]
    assert np.array_equal(w[[2, 3]], weights([101, 150_002], layout.cols, np.float32))
    assert np.array_equal(w[0], np.ones(16)) and np.array_equal(
        w[1], weights([100], layout.cols, np.float32)[0] + 1)


# --- the interface's checks -----------------------------------------------------------------

@pytest.mark.parametrize("rows, error, message", [
    ([3, 2], ValueError, "sorted and unique"),
    ([2, 2], ValueError, "sorted and unique"),
    ([0, 40], IndexError, r"row ids \[40\] outside \[0, 40\)"),
    ([[1, 2]], TypeError, "1-D integer array"),
    ([1.0], TypeError, "1-D integer array"),
])
def test_rows_that_are_not_sorted_unique_ids_of_the_table_are_refused(tmp_path, layout, rows,
                                                                      error, message):
    for store in (MemoryRows(layout), DiskRows(layout, tmp_path, "t", tiny(layout, 3))):
        with pytest.raises(error, match=message):
            store.gather(np.array(rows))


def test_a_scatter_of_the_wrong_shape_names_the_part(tmp_path, layout):
    disk = DiskRows(layout, tmp_path, "t", tiny(layout, 3))
    rows = np.array([1, 2])
    with pytest.raises(ValueError, match=r"state 1 has shape \(2, 5\) for 2 rows; expected "
                       r"\(2, 6\)"):
        disk.scatter(rows, np.zeros((2, 6)), [np.zeros((2, 6)), np.zeros((2, 5))])
    with pytest.raises(ValueError, match="1 state arrays given, the layout has n_states=2"):
        disk.scatter(rows, np.zeros((2, 6)), [np.zeros((2, 6))])


def test_a_closed_store_says_so(tmp_path, layout):
    disk = DiskRows(layout, tmp_path, "t", tiny(layout, 3))
    disk.close()
    with pytest.raises(StoreError, match="t.rows is closed"):
        disk.read(np.array([1]))
