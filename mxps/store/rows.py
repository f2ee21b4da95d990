"""Tables of rows and their optimizer state, as a server updates them (docs/STORE.md).

A server holds, per key slice, ``n_rows`` rows of ``cols`` elements plus ``n_states`` optimizer
state arrays shaped like the weight rows (SGD 0, momentum 1, Adam 2).  A round's update is
``w, states = store.gather(rows)``, a dense optimizer step on that block (MXNet's lazy sparse
update on those rows), ``store.scatter(rows, w, states)``; a pull is ``store.read(rows)``.
``rows`` are always sorted unique int64 ids in ``[0, n_rows)``.

``MemoryRows`` keeps the table in RAM (the reference).  ``DiskRows`` keeps it in one file with a
RAM cache of hot rows under a byte budget, so a table larger than memory can be trained, and
makes the file a checkpoint: ``flush(step)`` commits it, ``resume=True`` reopens it and refuses
anything that is not exactly a flushed store.  Neither is thread-safe: one caller at a time.
"""
import json
import os
import struct
import zlib
from collections import namedtuple

import numpy as np

from .rows_cache import GHOST, NEW, ON_DISK, POLICIES, SLOT_META_BYTES

FORMAT = "mxps-rows/1"
BLOCK_BYTES = 1 << 20          # checksum granularity of the data file
VERIFY_READ = 8 * BLOCK_BYTES  # bytes per read when checking blocks
# Longest single write: a long buffered write makes the kernel cache that range in large
# folios (seen on Linux 6.18, ext4), and every later 1-record write into such a folio costs
# about twice as much and dirties (so writes back) the whole folio; 64 KiB runs keep folios
# small (docs/STORE.md).
MAX_WRITE = 64 << 10
FLUSH_BYTES = 8 << 20         # records copied per write batch of a flush
DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


class StoreError(RuntimeError):
    """A row store that cannot be used as asked: refused at resume (named file and problem),
    or an existing store in the way of a new one."""


class RowLayout(namedtuple("RowLayout", "n_rows cols dtype n_states")):
    """The shape of a table: ``n_rows`` rows of ``cols`` elements of ``dtype`` (float16, float32
    or float64), each row with ``n_states`` optimizer state rows of the same shape.  A row's
    *record* is its weights then its states, contiguous."""

    __slots__ = ()

    def __new__(cls, n_rows, cols, dtype=np.float32, n_states=0):
        dtype = np.dtype(dtype)
        if dtype not in DTYPES:
            raise TypeError("RowLayout: dtype %s is not float16, float32 or float64" % dtype)
        if int(n_rows) < 1 or int(cols) < 1 or int(n_states) < 0:
            raise ValueError("RowLayout: n_rows=%r, cols=%r must be >= 1 and n_states=%r >= 0"
                             % (n_rows, cols, n_states))
        return super().__new__(cls, int(n_rows), int(cols), dtype, int(n_states))

    @property
    def parts(self):
        return 1 + self.n_states

    @property
    def record_items(self):
        return self.parts * self.cols

    @property
    def record_bytes(self):
        return self.record_items * self.dtype.itemsize

    @property
    def file_bytes(self):
        return self.n_rows * self.record_bytes

    @property
    def index_bytes(self):
        """RAM of DiskRows' row index: one int32 per row (its cache slot or where it is)."""
        return 4 * self.n_rows

    def cache_bytes(self, slots):
        """The ``cache_bytes`` budget that gives DiskRows ``slots`` cached rows: the row index
        plus, per slot, the record and its bookkeeping."""
        return self.index_bytes + slots * (self.record_bytes + SLOT_META_BYTES)

    def to_json(self):
        return {"n_rows": self.n_rows, "cols": self.cols, "dtype": self.dtype.str,
                "n_states": self.n_states}


def _initializer(layout, init):
    """``rows -> (k, cols) block`` of the weights of rows never written: zeros (``init`` None),
    rows of an ``(n_rows, cols)`` array, or ``init(rows)`` itself (checked)."""
    shape = (layout.n_rows, layout.cols)
    if init is None:
        return lambda rows: np.zeros((len(rows), layout.cols), layout.dtype)
    if callable(init):
        def produce(rows):
            block = np.asarray(init(rows))
            if block.shape != (len(rows), layout.cols):
                raise ValueError("row init returned shape %s for %d rows; expected %s"
                                 % (block.shape, len(rows), (len(rows), layout.cols)))
            return block.astype(layout.dtype, copy=False)
        return produce
    table = np.asarray(init)
    if table.shape != shape:
        raise ValueError("row init array has shape %s; the layout needs %s" % (table.shape, shape))
    return lambda rows: table[rows].astype(layout.dtype, copy=False)


def _check_rows(layout, rows):
    """``rows`` as int64, or an error naming what is wrong with them."""
    rows = np.asarray(rows)
    if rows.ndim != 1 or (rows.size and rows.dtype.kind not in "iu"):
        raise TypeError("rows must be a 1-D integer array, got %s of shape %s"
                        % (rows.dtype, rows.shape))
    rows = rows.astype(np.int64, copy=False)
    if rows.size:
        if rows[0] < 0 or rows[-1] >= layout.n_rows:
            bad = rows[(rows < 0) | (rows >= layout.n_rows)]
            raise IndexError("row ids %s outside [0, %d)" % (bad[:5].tolist(), layout.n_rows))
        if rows.size > 1 and not (rows[1:] > rows[:-1]).all():
            raise ValueError("row ids must be sorted and unique")
    return rows


def _records(layout, rows, w, states):
    """The records ``(k, parts * cols)`` of a scatter's block, shapes checked."""
    k, cols = len(rows), layout.cols
    if len(states) != layout.n_states:
        raise ValueError("scatter: %d state arrays given, the layout has n_states=%d"
                         % (len(states), layout.n_states))
    recs = np.empty((k, layout.parts, cols), layout.dtype)
    for i, part in enumerate([w] + list(states)):
        part = np.asarray(part)
        if part.shape != (k, cols):
            raise ValueError("scatter: %s has shape %s for %d rows; expected %s"
                             % ("weights" if i == 0 else "state %d" % (i - 1), part.shape, k,
                                (k, cols)))
        recs[:, i] = part
    return recs.reshape(k, layout.record_items)


def _split(layout, recs):
    """``(w, [states])`` of records, each a contiguous ``(k, cols)`` array of its own."""
    if layout.n_states == 0:
        return recs, []
    k = len(recs)
    parts = np.ascontiguousarray(recs.reshape(k, layout.parts, layout.cols).transpose(1, 0, 2))
    return parts[0], list(parts[1:])


def _new_stats():
    return dict(gathers=0, reads=0, scatters=0, rows_read=0, rows_written=0, hits=0, misses=0,
                init_rows=0, evictions=0, writebacks=0, bytes_read=0, bytes_written=0,
                io_calls=0, flushes=0, cache_bytes_used=0, undo_bytes=0)


class MemoryRows:
    """The whole table and its states in RAM: the reference ``DiskRows`` is tested against,
    and the store of tables that fit."""

    def __init__(self, layout, init=None):
        self.layout = layout
        self._w = np.array(_initializer(layout, init)(np.arange(layout.n_rows)),
                           dtype=layout.dtype, copy=True)
        self._states = [np.zeros_like(self._w) for _ in range(layout.n_states)]
        self.step = None
        self._stats = _new_stats()
        self._stats["cache_bytes_used"] = self._w.nbytes * layout.parts

    @property
    def stats(self):
        return dict(self._stats)

    def gather(self, rows):
        rows = _check_rows(self.layout, rows)
        self._count("gathers", rows)
        return self._w[rows], [s[rows] for s in self._states]

    def read(self, rows):
        rows = _check_rows(self.layout, rows)
        self._count("reads", rows)
        return self._w[rows]

    def scatter(self, rows, w, states):
        rows = _check_rows(self.layout, rows)
        recs = _records(self.layout, rows, w, states).reshape(len(rows), self.layout.parts,
                                                            self.layout.cols)
        self._w[rows] = recs[:, 0]
        for i, s in enumerate(self._states):
            s[rows] = recs[:, 1 + i]
        self._stats["scatters"] += 1
        self._stats["rows_written"] += len(rows)

    def _count(self, op, rows):
        self._stats[op] += 1
        self._stats["rows_read"] += len(rows)
        self._stats["hits"] += len(rows)

    def flush(self, step):
        self.step = step
        self._stats["flushes"] += 1

    def close(self):
        self._w = self._states = None


class CachedRows:
    """A table behind a RAM cache of whole records, over a storage engine given by a subclass
    (``_load(rows) -> records`` and ``_store(rows, records)``, rows sorted unique).

    The cache is ``slots`` records in one array (the slab), a slot -> row table, dirty flags,
    the eviction policy's state, and the row index: one int32 per row of the table, the row's
    slot or a code (``ON_DISK``, ``GHOST``: on disk and recently evicted, ``NEW``: never
    written).  All of it is counted in ``cache_bytes`` (``RowLayout.cache_bytes``).  Rows
    missing from the cache are loaded in one batch per call and admitted, evicting what the
    policy picks; dirty victims are written back in one sorted batch.  A row never written is
    produced by ``init`` on its first touch, once: it enters the cache dirty and reaches the
    file when evicted or flushed."""

    def __init__(self, layout, cache_bytes, init=None, policy="s3fifo"):
        if policy not in POLICIES:
            raise ValueError("unknown cache policy %r (one of %s)" % (policy, sorted(POLICIES)))
        self.layout = layout
        self.cache_bytes = int(cache_bytes)
        per_slot = layout.record_bytes + SLOT_META_BYTES
        slots = min(layout.n_rows, (self.cache_bytes - layout.index_bytes) // per_slot)
        if slots < 1:
            raise ValueError(
                "cache_bytes=%d is below the minimum %d for %s: the row index takes %d bytes "
                "(4 per row) and one cached record %d" % (self.cache_bytes, layout.cache_bytes(1),
                                                          layout, layout.index_bytes, per_slot))
        self.slots = int(slots)
        self._produce = _initializer(layout, init)
        self._slab = np.empty((self.slots, layout.record_items), layout.dtype)
        self._row_of = np.full(self.slots, -1, np.int64)
        self._dirty = np.zeros(self.slots, bool)
        self._used = 0
        self._codes = np.full(layout.n_rows, NEW, np.int32)
        self._policy = POLICIES[policy](self.slots, self._codes, self._row_of)
        self._stats = _new_stats()

    def _check(self, rows):
        if self._codes is None:
            raise StoreError("row store %s is closed" % getattr(self, "path", self.layout))
        return _check_rows(self.layout, rows)

    @property
    def stats(self):
        out = dict(self._stats)
        out["cache_bytes_used"] = self.layout.cache_bytes(self._used) if self._used else 0
        return out

    def gather(self, rows):
        rows = self._check(rows)
        self._stats["gathers"] += 1
        return _split(self.layout, self._fetch(rows))

    def read(self, rows):
        rows = self._check(rows)
        self._stats["reads"] += 1
        recs = self._fetch(rows)
        return recs if self.layout.n_states == 0 else np.array(recs[:, :self.layout.cols])

    def scatter(self, rows, w, states):
        rows = self._check(rows)
        recs = _records(self.layout, rows, w, states)
        where = self._codes[rows]
        hit = where >= 0
        slots = where[hit]
        self._slab[slots] = recs[hit]
        self._dirty[slots] = True
        miss = ~hit
        if miss.any():
            self._admit(rows[miss], recs[miss], np.ones(int(miss.sum()), bool),
                        where[miss] == GHOST)
        self._stats["scatters"] += 1
        self._stats["rows_written"] += len(rows)

    def _fetch(self, rows):
        """The records of ``rows`` (a new array), the misses loaded and admitted."""
        recs = np.empty((len(rows), self.layout.record_items), self.layout.dtype)
        where = self._codes[rows]
        hit = where >= 0
        slots = where[hit]
        recs[hit] = self._slab[slots]
        self._policy.hit(slots)
        miss = np.flatnonzero(~hit)
        if len(miss):
            codes = where[miss]
            new = codes == NEW
            if not new.all():
                recs[miss[~new]] = self._load(rows[miss[~new]])
            if new.any():
                recs[miss[new]] = self._fresh(rows[miss[new]])
            self._admit(rows[miss], recs[miss], new, codes == GHOST)
        self._stats["rows_read"] += len(rows)
        self._stats["hits"] += len(slots)
        self._stats["misses"] += len(miss)
        return recs

    def _fresh(self, rows):
        """Records of rows never written: ``init``'s weights, zero states."""
        recs = np.zeros((len(rows), self.layout.record_items), self.layout.dtype)
        recs[:, :self.layout.cols] = self._produce(rows)
        self._stats["init_rows"] += len(rows)
        return recs

    def _admit(self, rows, recs, dirty, ghost):
        """Place rows (not cached, sorted) in slots: free ones first, then the policy's
        victims.  Rows beyond the cache's size pass through (written if dirty)."""
        over = len(rows) - self.slots
        if over > 0:
            passing = np.flatnonzero(dirty[:over])
            if len(passing):
                self._write(rows[passing], recs[passing])
            rows, recs, dirty, ghost = rows[over:], recs[over:], dirty[over:], ghost[over:]
        free = min(len(rows), self.slots - self._used)
        if free:                            # free slots first (only until the cache is full)
            self._place(rows[:free], recs[:free], dirty[:free], ghost[:free],
                        np.arange(self._used, self._used + free))
            self._used += free
        if len(rows) > free:                # then slots the policy frees
            self._place(rows[free:], recs[free:], dirty[free:], ghost[free:],
                        self._evict(len(rows) - free))

    def _place(self, rows, recs, dirty, ghost, slots):
        self._codes[rows] = slots
        self._row_of[slots] = rows
        self._slab[slots] = recs
        self._dirty[slots] = dirty
        self._policy.admit(slots, ghost)

    def _evict(self, n):
        """Free ``n`` slots the policy picks, writing their dirty rows back in one batch."""
        slots = self._policy.victims(n)
        rows = self._row_of[slots]
        dirty = np.flatnonzero(self._dirty[slots])
        if len(dirty):
            order = dirty[np.argsort(rows[dirty])]
            self._write(rows[order], self._slab[slots[order]])
        self._codes[rows] = ON_DISK
        self._policy.evicted()
        self._dirty[slots] = False
        self._row_of[slots] = -1
        self._stats["evictions"] += n
        self._stats["writebacks"] += len(dirty)
        return slots

    def _write(self, rows, recs):
        self._store(rows, np.ascontiguousarray(recs))
        self._codes[rows] = np.where(self._codes[rows] >= 0, self._codes[rows], ON_DISK)

    def _write_dirty(self):
        """Every dirty cached row to the engine, in sorted batches of at most FLUSH_BYTES of
        records (a flush of a full cache would otherwise copy all of it at once: +250 MB of
        RSS per server in the DRPS bench); the cache stays."""
        slots = np.flatnonzero(self._dirty[:self._used])
        if len(slots):
            rows = self._row_of[slots]
            order = np.argsort(rows)
            rows, slots = rows[order], slots[order]
            per = max(1, FLUSH_BYTES // self.layout.record_bytes)
            for a in range(0, len(rows), per):
                self._write(rows[a:a + per], self._slab[slots[a:a + per]])
            self._dirty[slots] = False

    def _drop_cache(self):
        self._slab = self._row_of = self._dirty = self._codes = None


def _runs(rows):
    """``(starts, ends)``: index ranges of ``rows`` (sorted) that are consecutive ids."""
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    return np.r_[0, breaks].tolist(), np.r_[breaks, len(rows)].tolist()


def _fsync_dir(directory):
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _generation(meta_file):
    return int(str(meta_file).rsplit(".", 1)[-1])


class _UndoLog:
    """The records an epoch (the writes since a checkpoint) overwrote, as that checkpoint left
    them: ``<name>.undo.<token>``.  A header (``UNDO_MAGIC``, record bytes, rows), then batches:
    ``count`` (u32), CRC-32 of the rest (u32), ``count`` row ids (int64), their records.  Each
    batch is fsynced before the data it covers is written, so a batch cut short by a crash
    (the last one, failing its length or CRC) covers no write and is ignored; a bad batch
    with more after it is corruption and refused.  Applying every batch puts the data file
    back as the checkpoint left it (rows are logged once per epoch: order does not matter)."""

    def __init__(self, path, fd):
        self.path, self.fd = path, fd
        self.file = os.path.basename(path)

    @classmethod
    def create(cls, directory, name, layout):
        path = os.path.join(directory, "%s.undo.%s" % (name, os.urandom(6).hex()))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        os.write(fd, _UNDO_HEAD.pack(UNDO_MAGIC, layout.record_bytes, layout.n_rows))
        os.fsync(fd)
        _fsync_dir(directory)
        return cls(path, fd)

    def append(self, rows, recs):
        body = np.ascontiguousarray(rows, "<i8").tobytes() + np.ascontiguousarray(recs).tobytes()
        data = _UNDO_BATCH.pack(len(rows), zlib.crc32(body)) + body
        done = 0
        while done < len(data):
            done += os.write(self.fd, data[done:])
        os.fsync(self.fd)
        return len(data)

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def remove(self):
        self.close()
        os.unlink(self.path)

    @staticmethod
    def apply(table, file):
        """Write every logged record of ``file`` back into ``table``'s data file, one batch
        in memory at a time (a log can be as large as the table)."""
        path = os.path.join(table.directory, file)
        rb = table.layout.record_bytes
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            table._refuse("the undo log %s is missing" % file)
        with f:
            total = os.fstat(f.fileno()).st_size
            if f.read(_UNDO_HEAD.size) != _UNDO_HEAD.pack(UNDO_MAGIC, rb, table.layout.n_rows):
                table._refuse("the undo log %s is not this table's" % file)
            pos = _UNDO_HEAD.size
            while True:
                head = f.read(_UNDO_BATCH.size)
                if len(head) < _UNDO_BATCH.size:
                    break                   # the end, or a batch header cut short
                count, crc = _UNDO_BATCH.unpack(head)
                size = count * (8 + rb)
                if pos + _UNDO_BATCH.size + size > total:
                    break                   # cut short by the crash: nothing written yet
                body = f.read(size)
                if zlib.crc32(body) != crc:
                    if not f.read(1):
                        break               # the last batch, torn: nothing written yet
                    table._refuse("the undo log %s has a corrupted batch at byte %d"
                                  % (file, pos))
                rows = np.frombuffer(body[:8 * count], "<i8")
                if count and (rows.min() < 0 or rows.max() >= table.layout.n_rows):
                    table._refuse("the undo log %s names rows outside the table" % file)
                recs = memoryview(body)[8 * count:]
                starts, ends = _runs(rows)
                for a, e in zip(starts, ends):
                    table._pwrite(recs[a * rb:e * rb], int(rows[a]) * rb)
                pos += _UNDO_BATCH.size + len(body)


UNDO_MAGIC = b"MXPSUNDO"
_UNDO_HEAD = struct.Struct("<8sIQ")
_UNDO_BATCH = struct.Struct("<II")


def reachable_steps(directory):
    """{table name: the steps it can be resumed at} for every table manifest in
    ``directory`` (a server's part of a job's store); {} when there is none."""
    out = {}
    if not os.path.isdir(directory):
        return out
    for f in sorted(os.listdir(directory)):
        if not f.endswith(".manifest.json"):
            continue
        try:
            with open(os.path.join(directory, f), "rb") as fh:
                m = json.loads(fh.read())
            steps = [e["step"] for e in m.get("older", [])] + \
                ([] if m["step"] is None else [m["step"]])
        except (OSError, ValueError, KeyError, TypeError):
            steps = []
        out[f[:-len(".manifest.json")]] = steps
    return out


def _write_atomic(path, data):
    """``data`` at ``path`` or, after a crash, the old file there: temp, fsync, rename."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


class DiskRows(CachedRows):
    """The table in one file, ``<directory>/<name>.rows``: record of row r at byte
    ``r * record_bytes`` (MXNet's row ids are dense 0..n_rows-1, so the index is that product),
    read and written with ``os.preadv``/``os.pwrite``, one call per run of consecutive ids; a
    RAM cache of ``cache_bytes`` in front (``CachedRows``).

    Beside it, ``<name>.manifest.json`` (layout, the checkpoint's step and meta file, clean
    flag, the open epoch's undo log, the older checkpoints kept), ``<name>.meta.<gen>`` (a
    CRC-32 per MiB block of the data file, and the bitmap of rows written) and
    ``<name>.undo.<token>`` (``_UndoLog``: the records an epoch overwrote, as its checkpoint
    left them).  ``flush(step)`` writes every dirty row, fsyncs, writes a new meta file and then
    commits the manifest atomically, clean at ``step``.  Before the first write to the data
    file after a flush the manifest is committed as open, naming a new undo log, and every
    record is logged there (fsynced) before it is first overwritten in place; so a process
    killed at any moment leaves a store that ``resume=True`` returns to its last flush.
    ``keep`` checkpoints stay reachable (each older one through the undo log of the epoch
    after it): ``resume=True, at=step`` returns to any of them (``checkpoints()``).
    ``resume`` refuses (``StoreError`` naming the file and the problem) a missing or
    unreadable manifest, one never flushed, a step not kept, a missing or foreign undo log, a
    layout or dtype other than ``layout``, a data file of the wrong size, or a block whose
    checksum is not the checkpoint's after the undo logs were applied.  Without ``resume``, an
    existing store at that place is an error unless ``overwrite=True`` (which deletes it).

    ``close()`` releases the file and the cache without writing: what was not flushed is lost
    (the file is the last flush, or returns to it at resume)."""

    def __init__(self, layout, directory, name, cache_bytes, init=None, resume=False,
                 overwrite=False, policy="s3fifo", at=None, keep=1):
        if resume and overwrite:
            raise ValueError("DiskRows: resume=True and overwrite=True exclude each other")
        if int(keep) < 1:
            raise ValueError("DiskRows: keep=%r must be >= 1 (checkpoints kept reachable)"
                             % (keep,))
        if at is not None and not resume:
            raise ValueError("DiskRows: at=%r is a step to resume at: it needs resume=True"
                             % (at,))
        if not name or os.sep in name or name.startswith("."):
            raise ValueError("DiskRows: bad table name %r" % (name,))
        super().__init__(layout, cache_bytes, init, policy)
        self.directory = os.path.abspath(directory)
        self.name = name
        self.path = os.path.join(self.directory, name + ".rows")
        self.manifest_path = os.path.join(self.directory, name + ".manifest.json")
        self._fd = None
        n_blocks = -(-layout.file_bytes // BLOCK_BYTES)
        self._changed_blocks = np.zeros(n_blocks, bool)
        self.step = None
        self.keep = int(keep)
        self._older = []            # checkpoints before ``step`` still reachable, oldest first
        self._undo = None           # this epoch's undo log (an _UndoLog) once it wrote
        self._logged = np.zeros(layout.n_rows, bool)   # rows whose before-image is logged
        self._meta_file, self._meta_gen = None, 0
        if resume:
            self._resume(at)
        else:
            self._create(overwrite)

    # --- the engine: records at r * record_bytes -------------------------------------------

    def _load(self, rows):
        rb, fd, preadv = self.layout.record_bytes, self._fd, os.preadv
        recs = np.empty((len(rows), self.layout.record_items), self.layout.dtype)
        view = memoryview(recs).cast("B")
        starts, ends = _runs(rows)
        for s, e, r in zip(starts, ends, rows[starts].tolist()):
            part = view[s * rb:e * rb]
            if preadv(fd, [part], r * rb) != len(part):       # short read: finish it
                self._pread(part, r * rb)
        self._stats["io_calls"] += len(starts)
        self._stats["bytes_read"] += len(rows) * rb
        return recs

    def _store(self, rows, recs):
        if self._clean:
            if self.step is not None:
                self._undo = _UndoLog.create(self.directory, self.name, self.layout)
            self._commit_manifest(clean=False)
        fresh = rows[~self._logged[rows]] if self._undo is not None else rows[:0]
        if len(fresh):     # their records as the last checkpoint left them, durable first
            self._stats["undo_bytes"] += self._undo.append(fresh, self._load(fresh))
            self._logged[fresh] = True
        rb, fd, pwrite = self.layout.record_bytes, self._fd, os.pwrite
        view = memoryview(recs).cast("B")
        starts, ends = _runs(rows)
        first = rows[starts]
        for s, e, r in zip(starts, ends, first.tolist()):
            part = view[s * rb:e * rb]
            if len(part) > MAX_WRITE or pwrite(fd, part, r * rb) != len(part):
                self._pwrite(part, r * rb)
        last = rows[np.asarray(ends) - 1]
        self._mark_changed(first * rb // BLOCK_BYTES, ((last + 1) * rb - 1) // BLOCK_BYTES)
        self._stats["io_calls"] += len(starts)
        self._stats["bytes_written"] += len(rows) * rb

    def _mark_changed(self, lo, hi):
        """Blocks [lo[i], hi[i]] were written: their checksums are due at the next flush."""
        edges = np.zeros(len(self._changed_blocks) + 1, np.int64)
        np.add.at(edges, lo, 1)
        np.add.at(edges, hi + 1, -1)
        self._changed_blocks |= np.cumsum(edges[:-1]) > 0

    def _advise_random(self):
        """Rows are read one run at a time, anywhere: no readahead (it would read, and cache,
        neighbours nobody asked for)."""
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)

    def _pread(self, view, offset):
        got = 0
        while got < len(view):
            n = os.preadv(self._fd, [view[got:]], offset + got)
            if n == 0:
                raise StoreError("%s: the file ends at byte %d, inside a record the layout puts "
                                 "there (truncated while open?)" % (self.path, offset + got))
            got += n

    def _pwrite(self, view, offset):
        done = 0
        while done < len(view):
            done += os.pwrite(self._fd, view[done:done + MAX_WRITE], offset + done)

    # --- durability ------------------------------------------------------------------------

    def flush(self, step):
        """Every dirty row to the file, fsync, checksums of the blocks written, a new meta file,
        then the manifest committed clean at ``step``: the file is now a checkpoint.  The
        checkpoint before it stays reachable (``keep``) through this epoch's undo log."""
        self._check([])
        self._write_dirty()
        previous = None if self.step is None else {
            "step": self.step, "meta": self._meta_entry(), "undo": None}
        if not self._clean:
            os.fsync(self._fd)
            for b in np.flatnonzero(self._changed_blocks).tolist():
                self._crcs[b] = self._block_crc(b)
            self._changed_blocks[:] = False
            self._write_meta()
            if previous is not None:
                previous["undo"] = self._undo.file
        if previous is not None and previous["step"] != step:   # the same step: replaced
            self._older.append(previous)
        dropped = self._older[:max(0, len(self._older) - (self.keep - 1))]
        self._older = self._older[len(dropped):]
        undo, self._undo = self._undo, None
        self.step = step
        self._commit_manifest(clean=True)
        self._logged[:] = False
        if undo is not None:
            undo.close()
            if undo.file not in [e["undo"] for e in self._older]:
                undo.remove()
        self._remove_unreferenced()
        self._stats["flushes"] += 1

    def checkpoints(self):
        """The steps this table can be resumed at, oldest first."""
        return [e["step"] for e in self._older] + ([] if self.step is None else [self.step])

    def _meta_entry(self):
        return None if self._meta_file is None else {
            "file": self._meta_file, "bytes": self._meta_bytes, "crc32": self._meta_crc}

    def _remove_unreferenced(self):
        """Meta files and undo logs that no kept checkpoint names (a flush cut short, a
        checkpoint dropped, the epochs undone at resume)."""
        keep = {self._meta_file} | {e["meta"]["file"] for e in self._older} | \
            {e["undo"] for e in self._older}
        if self._undo is not None:
            keep.add(self._undo.file)
        for path in self._own_files()[2:]:
            if os.path.basename(path) not in keep:
                os.unlink(path)

    def close(self):
        """The file closed and the cache dropped, nothing written (see the class doc)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._drop_cache()

    def remove(self):
        """Close the table and delete its files (a slice that moved to another server)."""
        self.close()
        for path in self._own_files():
            if os.path.exists(path):
                os.unlink(path)

    def __del__(self):
        # the descriptor only, as the system does for a process that stops: nothing written
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _block_crc(self, b):
        lo = b * BLOCK_BYTES
        buf = bytearray(min(BLOCK_BYTES, self.layout.file_bytes - lo))
        self._pread(memoryview(buf), lo)
        return zlib.crc32(buf)

    def _write_meta(self):
        """The checksums and the bitmap of rows written, as a new generation of meta file."""
        self._meta_gen = max([self._meta_gen] + [_generation(e["meta"]["file"])
                                                 for e in self._older]) + 1
        self._meta_file = "%s.meta.%d" % (self.name, self._meta_gen)
        written = np.packbits(self._codes != NEW, bitorder="little")
        data = self._crcs.astype("<u4").tobytes() + written.tobytes()
        _write_atomic(os.path.join(self.directory, self._meta_file), data)
        self._meta_crc = zlib.crc32(data)
        self._meta_bytes = len(data)

    def _commit_manifest(self, clean):
        manifest = {"format": FORMAT, "layout": self.layout.to_json(),
                    "record_bytes": self.layout.record_bytes,
                    "file_bytes": self.layout.file_bytes, "block_bytes": BLOCK_BYTES,
                    "clean": clean, "step": self.step, "meta": self._meta_entry(),
                    "undo": None if clean or self._undo is None else self._undo.file,
                    "older": self._older}
        _write_atomic(self.manifest_path, json.dumps(manifest, indent=1).encode())
        self._clean = clean

    def _create(self, overwrite):
        os.makedirs(self.directory, exist_ok=True)
        there = [p for p in self._own_files() if os.path.exists(p)]
        if there and not overwrite:
            raise StoreError("%s: a row store already exists here (%s); pass resume=True to "
                             "reopen it or overwrite=True to replace it"
                             % (self.path, ", ".join(os.path.basename(p) for p in there)))
        for p in there:
            os.unlink(p)
        self._meta_file, self._meta_gen = None, 0
        self._commit_manifest(clean=False)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        os.ftruncate(self._fd, self.layout.file_bytes)
        self._advise_random()
        # a new file reads as zeros: every block's checksum is that of zeros
        n_blocks = len(self._changed_blocks)
        self._crcs = np.full(n_blocks, zlib.crc32(bytes(min(BLOCK_BYTES, self.layout.file_bytes))),
                             np.uint32)
        self._crcs[-1] = zlib.crc32(bytes(self.layout.file_bytes - (n_blocks - 1) * BLOCK_BYTES))

    def _own_files(self):
        prefixes = (self.name + ".meta.", self.name + ".undo.")
        metas = [os.path.join(self.directory, f) for f in sorted(os.listdir(self.directory))
                 if f.startswith(prefixes) and not f.endswith(".tmp")] \
            if os.path.isdir(self.directory) else []
        return [self.path, self.manifest_path] + metas

    def _refuse(self, problem):
        raise StoreError("%s: cannot resume: %s" % (self.path, problem))

    def _resume(self, at):
        manifest = self._read_manifest()
        name = os.path.basename(self.manifest_path)
        try:
            size = os.path.getsize(self.path)
        except FileNotFoundError:
            self._refuse("the data file is missing")
        if size != self.layout.file_bytes:
            self._refuse("the data file is %d bytes, the layout needs %d (%s)"
                         % (size, self.layout.file_bytes,
                            "truncated" if size < self.layout.file_bytes else "too long"))
        older = manifest["older"]
        steps = [e["step"] for e in older] + [manifest["step"]]
        if manifest["step"] is None or not isinstance(manifest["meta"], dict):
            self._refuse("%s names no checkpoint: the store was never flushed" % name)
        if at is not None and at not in steps:
            self._refuse("step %s is not among the checkpoints it keeps (%s)"
                         % (at, ", ".join(map(str, steps))))
        undo = []           # the undo logs to apply, newest first
        if not manifest["clean"]:
            if not manifest["undo"]:
                self._refuse("%s is marked open (written after its last flush, step %s) and "
                             "names no undo log to return to that flush" % (name,
                                                                          manifest["step"]))
            undo.append(manifest["undo"])
        target, meta = manifest["step"], manifest["meta"]
        kept = list(older)
        while at is not None and target != at:
            e = kept.pop()
            if e["undo"]:
                undo.append(e["undo"])
            target, meta = e["step"], e["meta"]
        self._read_meta(meta)
        self._fd = os.open(self.path, os.O_RDWR)
        for u in undo:          # each log holds the records its epoch overwrote
            _UndoLog.apply(self, u)
        if undo:
            os.fsync(self._fd)
        self._verify_blocks()
        self._advise_random()
        self.step, self._older, self._clean = target, kept, True
        if undo or not manifest["clean"]:
            self._commit_manifest(clean=True)
        self._remove_unreferenced()

    def _read_manifest(self):
        name = os.path.basename(self.manifest_path)
        try:
            with open(self.manifest_path, "rb") as f:
                manifest = json.loads(f.read())
        except FileNotFoundError:
            self._refuse("no manifest %s (never flushed here, or deleted)" % name)
        except ValueError as e:
            self._refuse("manifest %s is not valid JSON (%s)" % (name, e))
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            self._refuse("manifest %s is not a %s manifest" % (name, FORMAT))
        try:
            stored = RowLayout(**manifest["layout"])
            fields = [manifest[k] for k in ("clean", "step", "meta", "record_bytes",
                                           "file_bytes", "block_bytes")]
            manifest.setdefault("undo", None)
            older = manifest.setdefault("older", [])
            if not isinstance(older, list) or not all(
                    isinstance(e, dict) and isinstance(e["meta"], dict)
                    and isinstance(e["undo"], (str, type(None))) for e in older):
                raise ValueError("'older' is not a list of checkpoints")
            for e in older:
                e["step"]
        except (KeyError, TypeError, ValueError) as e:
            self._refuse("manifest %s is incomplete or malformed (%s)" % (name, e))
        if stored != self.layout:
            self._refuse("the stored layout %s is not the one asked for, %s"
                         % (stored, self.layout))
        if fields[3:] != [self.layout.record_bytes, self.layout.file_bytes, BLOCK_BYTES]:
            self._refuse("manifest %s: record/file/block sizes %s do not match the layout's %s"
                         % (name, fields[3:], [self.layout.record_bytes,
                                              self.layout.file_bytes, BLOCK_BYTES]))
        return manifest

    def _read_meta(self, meta):
        """Checksums and the written-rows bitmap from the manifest's meta file, checked."""
        path = os.path.join(self.directory, str(meta.get("file")))
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            self._refuse("the meta file %s is missing" % path)
        n_blocks = len(self._changed_blocks)
        if (len(data) != meta.get("bytes") or zlib.crc32(data) != meta.get("crc32")
                or len(data) != 4 * n_blocks + -(-self.layout.n_rows // 8)):
            self._refuse("the meta file %s does not match the manifest (size or checksum)" % path)
        gen = str(meta["file"]).rsplit(".", 1)[-1]
        if meta["file"] != "%s.meta.%s" % (self.name, gen) or not gen.isdigit():
            self._refuse("the manifest names %r, not a meta file of table %r" % (meta["file"],
                                                                                 self.name))
        self._meta_file, self._meta_bytes, self._meta_crc = meta["file"], len(data), meta["crc32"]
        self._meta_gen = max(self._meta_gen, int(gen))
        self._crcs = np.frombuffer(data[:4 * n_blocks], "<u4").astype(np.uint32)
        written = np.unpackbits(np.frombuffer(data[4 * n_blocks:], np.uint8),
                                count=self.layout.n_rows, bitorder="little").astype(bool)
        self._codes[written] = ON_DISK

    def _verify_blocks(self):
        """Every block's CRC-32 against the manifest's: a torn or corrupted block is refused."""
        buf = bytearray(VERIFY_READ)
        view = memoryview(buf)
        total = self.layout.file_bytes
        for lo in range(0, total, VERIFY_READ):
            n = min(VERIFY_READ, total - lo)
            self._pread(view[:n], lo)
            for off in range(0, n, BLOCK_BYTES):
                b = (lo + off) // BLOCK_BYTES
                crc = zlib.crc32(view[off:min(off + BLOCK_BYTES, n)])
                if crc != self._crcs[b]:
                    end = min((b + 1) * BLOCK_BYTES, total)
                    self._refuse("block %d (bytes %d..%d) has CRC-32 %08x, the manifest's meta "
                                 "says %08x: torn or corrupted" % (b, b * BLOCK_BYTES, end, crc,
                                                                 self._crcs[b]))
