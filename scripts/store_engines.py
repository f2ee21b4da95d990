#!/usr/bin/env python3
"""Which storage engine and which cache policy ``mxps.store.rows.DiskRows`` uses, measured
(results in docs/STORE.md).

``engines``: one table of ~1 GiB (rows of 64 float32 plus 2 optimizer states, Adam's shape:
768-byte records, 1.4 M rows) behind the same RAM cache (``CachedRows``, 1/8 of the table,
S3-FIFO) over each engine: ``memory`` (``MemoryRows``, the whole table in RAM: the reference),
``pread`` (``DiskRows``: one file, records at ``row * record_bytes``,
``os.preadv``/``os.pwrite`` per run of consecutive ids), ``madvise`` (DiskRows' file mapped,
numpy fancy indexing, the mapping's pages dropped after every call), ``memmap`` (the same file
through ``numpy.memmap``: fancy indexing reads and writes the mapping, nothing dropped),
``lmdb`` (one key per row, big-endian id; ``getmulti`` and ``putmulti`` per batch, synced at
flush) and ``rocksdict`` (RocksDB, one key per row, multi-get and a write batch per batch). The
table is first written in full (rows in order, chunks of 16k rows through ``scatter``, then
``flush``), then Zipf(1.1)-distributed batches of 8192 ids (unique'd, sorted; the ids are a
fixed random permutation of the Zipf ranks, so hot rows are spread over the file) each do
``gather``, a small dense update, ``scatter``, for ``--seconds`` after ``--warmup`` batches.
Reported per engine: rows/s (unique rows gathered and scattered per second of store time), MB/s
of records through the store (rows/s x record bytes, both directions) and to/from the engine,
hit rate, engine calls per batch, the process's peak RSS during the measured phase split into
anonymous memory and mapped file pages, and the time to write the table; RSS over start is the
peak less the process's RSS before the store was made (Python, numpy, the MXNet that ``import
mxps`` loads, and the id generator). Each engine runs in a child process of its own (its own
RSS); the files live under ``--dir`` and are deleted after each engine.

The page cache is warm (the machine is shared: dropping it would disturb others; the table
fits in RAM): what is measured is the cost per row of each engine's code path (system calls,
copies, B-tree or LSM work) and its resident memory, which is what ranks them once the disk
is as fast as the page cache; with a cold cache every engine adds the same device reads for
the same misses (LMDB and RocksDB more, for their own page/block overhead).

``policies``: hit rates of cache policies on the same trace (no I/O): per-access simulators
of LRU, CLOCK, GCLOCK (counters to 3), 2Q and S3-FIFO, the static best (the most popular rows
pinned: the optimum for independent draws), and the store's own batch implementations
(``mxps.store.rows_cache``: lru, clock, gclock, s3fifo) driven through ``DiskRows`` with tiny
records.  Needs no lock (hit counts do not depend on the machine's load).

    flock /tmp/mxps-bench.lock python scripts/store_engines.py engines
    python scripts/store_engines.py policies
    python scripts/store_engines.py engines --gb 0.25 --seconds 5 --engines pread,memmap

lmdb and rocksdict are not dependencies of mxps: ``pip install lmdb rocksdict`` to measure
them (an engine whose module is missing is reported as skipped).
"""
import argparse
import collections
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from mxps.store.rows import BLOCK_BYTES, CachedRows, DiskRows, MemoryRows, RowLayout

COLS, STATES, DTYPE = 64, 2, np.float32
ZIPF_S = 1.1
BATCH = 8192
FILL_CHUNK = 16384
ENGINES = ("memory", "pread", "madvise", "memmap", "lmdb", "rocksdict")


# --- workload --------------------------------------------------------------------------------

class Zipf:
    """Batches of ``batch`` Zipf(s) draws over ``n`` rows, unique'd and sorted; rank i is row
    ``perm[i]`` (a fixed random permutation)."""

    def __init__(self, n, s=ZIPF_S, seed=1, batch=BATCH):
        self.rng = np.random.default_rng(seed)
        self.perm = self.rng.permutation(n)
        cdf = np.cumsum(1.0 / np.arange(1, n + 1) ** s)
        self.cdf = cdf / cdf[-1]
        self.batch = batch

    def next(self):
        return np.unique(self.perm[np.searchsorted(self.cdf, self.rng.random(self.batch))])


def init_rows(rows):
    """Weights of rows never written: cheap, deterministic, different per row."""
    return ((rows[:, None] * COLS + np.arange(COLS)) % 1000 * 1e-3).astype(DTYPE)


def update(w, states):
    """A dense Adam-shaped step on the block (its cost is not the store's)."""
    g = w * 1e-3
    states[0] *= 0.9
    states[0] += 0.1 * g
    states[1] *= 0.999
    states[1] += 0.001 * g * g
    w -= 1e-3 * states[0] / (np.sqrt(states[1]) + 1e-8)
    return w, states


# --- engines behind the same cache ------------------------------------------------------------

class MemmapRows(CachedRows):
    """The same file layout as DiskRows, through numpy.memmap (its pages count in RSS)."""

    def __init__(self, layout, directory, cache_bytes, init):
        super().__init__(layout, cache_bytes, init)
        path = os.path.join(directory, "t.memmap")
        self._mm = np.memmap(path, layout.dtype, "w+", shape=(layout.n_rows, layout.record_items))

    def _load(self, rows):
        self._stats["io_calls"] += 1
        self._stats["bytes_read"] += len(rows) * self.layout.record_bytes
        return self._mm[rows]

    def _store(self, rows, recs):
        self._mm[rows] = recs
        self._stats["io_calls"] += 1
        self._stats["bytes_written"] += len(rows) * self.layout.record_bytes

    def flush(self, step):
        self._write_dirty()
        self._mm.flush()

    def close(self):
        del self._mm


class MadviseRows(DiskRows):
    """DiskRows' file (and durability) with its engine swapped for a shared mapping: numpy
    fancy indexing reads and writes the records, and after every call the mapping's pages are
    dropped from the process (``MADV_DONTNEED``: the data stays in the page cache and the
    file), so its RSS stays bounded."""

    def __init__(self, layout, directory, cache_bytes, init):
        super().__init__(layout, directory, "t", cache_bytes, init=init)
        self._mm = mmap.mmap(self._fd, layout.file_bytes)
        self._arr = np.frombuffer(self._mm, layout.dtype).reshape(layout.n_rows, -1)

    def _load(self, rows):
        recs = self._arr[rows]
        self._mm.madvise(mmap.MADV_DONTNEED)
        self._stats["io_calls"] += 1
        self._stats["bytes_read"] += len(rows) * self.layout.record_bytes
        return recs

    def _store(self, rows, recs):
        if self._clean:
            self._commit_manifest(clean=False)
        self._arr[rows] = recs
        self._mm.madvise(mmap.MADV_DONTNEED)
        rb = self.layout.record_bytes
        self._mark_changed(rows * rb // BLOCK_BYTES, ((rows + 1) * rb - 1) // BLOCK_BYTES)
        self._stats["io_calls"] += 1
        self._stats["bytes_written"] += len(rows) * rb

    def flush(self, step):
        self._write_dirty()
        self._mm.flush()
        super().flush(step)

    def close(self):
        del self._arr
        self._mm.close()
        super().close()


def _keys(rows):
    raw = rows.astype(">u8").tobytes()
    return [raw[i:i + 8] for i in range(0, len(raw), 8)]


class LmdbRows(CachedRows):
    """One LMDB key per row (big-endian id, so key order is row order), synced at flush."""

    def __init__(self, layout, directory, cache_bytes, init):
        import lmdb
        super().__init__(layout, cache_bytes, init)
        self._env = lmdb.open(os.path.join(directory, "t.lmdb"), map_size=3 * layout.file_bytes,
                              sync=False, metasync=False, readahead=False)

    def _load(self, rows):
        with self._env.begin() as txn:
            values = [v for _, v in txn.cursor().getmulti(_keys(rows))]
        self._stats["io_calls"] += 1
        self._stats["bytes_read"] += len(rows) * self.layout.record_bytes
        return np.frombuffer(b"".join(values), self.layout.dtype).reshape(len(rows), -1)

    def _store(self, rows, recs):
        view = memoryview(recs).cast("B")
        rb = self.layout.record_bytes
        with self._env.begin(write=True) as txn:
            txn.cursor().putmulti(zip(_keys(rows), (view[i * rb:(i + 1) * rb]
                                                    for i in range(len(rows)))))
        self._stats["io_calls"] += 1
        self._stats["bytes_written"] += len(rows) * rb

    def flush(self, step):
        self._write_dirty()
        self._env.sync(True)

    def close(self):
        self._env.close()


class RocksRows(CachedRows):
    """One RocksDB key per row (rocksdict, raw bytes), multi-get and one write batch per call."""

    def __init__(self, layout, directory, cache_bytes, init):
        from rocksdict import Options, Rdict
        super().__init__(layout, cache_bytes, init)
        self._db = Rdict(os.path.join(directory, "t.rocks"), Options(raw_mode=True))

    def _load(self, rows):
        values = self._db[_keys(rows)]
        self._stats["io_calls"] += 1
        self._stats["bytes_read"] += len(rows) * self.layout.record_bytes
        return np.frombuffer(b"".join(values), self.layout.dtype).reshape(len(rows), -1)

    def _store(self, rows, recs):
        from rocksdict import WriteBatch
        raw = recs.tobytes()
        rb = self.layout.record_bytes
        batch = WriteBatch(raw_mode=True)
        for i, k in enumerate(_keys(rows)):
            batch.put(k, raw[i * rb:(i + 1) * rb])
        self._db.write(batch)
        self._stats["io_calls"] += 1
        self._stats["bytes_written"] += len(rows) * rb

    def flush(self, step):
        self._write_dirty()
        self._db.flush(True)
        self._db.flush_wal(True)

    def close(self):
        self._db.close()


def make_store(engine, layout, directory, cache_bytes):
    if engine == "memory":
        return MemoryRows(layout, init_rows)
    if engine == "pread":
        return DiskRows(layout, directory, "t", cache_bytes, init=init_rows)
    cls = {"madvise": MadviseRows, "memmap": MemmapRows, "lmdb": LmdbRows,
           "rocksdict": RocksRows}[engine]
    return cls(layout, directory, cache_bytes, init_rows)


# --- one engine, in a child process ----------------------------------------------------------

def rss():
    """(VmRSS, RssAnon, RssFile) of this process, bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "RssAnon", "RssFile"):
                out[k] = int(v.split()[0]) * 1024
    return out["VmRSS"], out["RssAnon"], out["RssFile"]


def run_one(engine, gb, seconds, warmup, directory):
    n_rows = int(gb * 2 ** 30) // (COLS * (1 + STATES) * np.dtype(DTYPE).itemsize)
    layout = RowLayout(n_rows, COLS, DTYPE, STATES)
    cache_bytes = layout.file_bytes // 8
    zipf = Zipf(n_rows)                     # its 2 arrays of n_rows are not the store's RSS
    base = rss()
    t = time.perf_counter()
    store = make_store(engine, layout, directory, cache_bytes)
    for lo in range(0, n_rows, FILL_CHUNK):
        rows = np.arange(lo, min(n_rows, lo + FILL_CHUNK))
        w = init_rows(rows)
        store.scatter(rows, w, [np.zeros_like(w) for _ in range(STATES)])
    store.flush(0)
    fill_s = time.perf_counter() - t
    filled = rss()
    for _ in range(warmup):
        rows = zipf.next()
        store.scatter(rows, *update(*store.gather(rows)))
    before = dict(store.stats)
    peak = [0, 0, 0]
    busy = rows_done = batches = 0
    cpu0 = time.process_time()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        rows = zipf.next()
        t = time.perf_counter()
        w, states = store.gather(rows)
        w, states = update(w, states)
        store.scatter(rows, w, states)
        busy += time.perf_counter() - t
        rows_done += len(rows)
        batches += 1
        peak = [max(a, b) for a, b in zip(peak, rss())]
    cpu = time.process_time() - cpu0
    after = store.stats
    delta = {k: after[k] - before[k] for k in before if k != "cache_bytes_used"}
    resume_s = None
    if engine == "pread":
        store.flush(1)
        store.close()
        t = time.perf_counter()
        DiskRows(layout, directory, "t", cache_bytes, init=init_rows, resume=True).close()
        resume_s = time.perf_counter() - t
    else:
        store.close()
    rb = layout.record_bytes
    lookups = delta["hits"] + delta["misses"]
    return {
        "engine": engine, "table_MB": layout.file_bytes / 2 ** 20, "rows": n_rows,
        "record_bytes": rb, "cache_MB": cache_bytes / 2 ** 20, "batches": batches,
        "rows_per_batch": rows_done / max(1, batches),
        "rows_per_s": rows_done / busy, "store_MB_per_s": 2 * rows_done * rb / busy / 2 ** 20,
        "engine_MB_per_s": (delta["bytes_read"] + delta["bytes_written"]) / busy / 2 ** 20,
        "hit_rate": delta["hits"] / lookups if lookups and engine != "memory" else None,
        "io_calls_per_batch": delta["io_calls"] / max(1, batches),
        "cpu_per_wall": cpu / max(busy, 1e-9),
        "rss_MB": peak[0] / 2 ** 20, "rss_anon_MB": peak[1] / 2 ** 20,
        "rss_file_MB": peak[2] / 2 ** 20, "rss_base_MB": base[0] / 2 ** 20,
        "rss_base_anon_MB": base[1] / 2 ** 20, "rss_base_file_MB": base[2] / 2 ** 20,
        "rss_filled_MB": filled[0] / 2 ** 20,
        "fill_s": fill_s, "resume_verify_s": resume_s,
    }


def engines(args):
    names = args.engines.split(",")
    results = []
    for engine in names:
        directory = tempfile.mkdtemp(prefix="store-%s-" % engine, dir=args.dir)
        cmd = [sys.executable, os.path.abspath(__file__), "_one", engine, "--gb", str(args.gb),
               "--seconds", str(args.seconds), "--warmup", str(args.warmup), "--dir", directory]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True,
                               timeout=args.seconds + 240)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        if p.returncode != 0:
            missing = "ModuleNotFoundError" in p.stderr
            results.append({"engine": engine, "skipped": "module missing" if missing
                            else p.stderr.strip().splitlines()[-1]})
        else:
            results.append(json.loads(p.stdout.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), file=sys.stderr)
    print(engine_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def engine_table(results):
    head = ("engine", "rows/s", "store MB/s", "engine MB/s", "hit rate", "engine calls/batch",
            "peak RSS MB (anon + file)", "RSS over start MB", "fill s")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        if "skipped" in r:
            lines.append("| %s | skipped: %s |" % (r["engine"], r["skipped"]) + " |" * 7)
            continue
        hit = "-" if r["hit_rate"] is None else "%.3f" % r["hit_rate"]
        row = (r["engine"], r["rows_per_s"], r["store_MB_per_s"], r["engine_MB_per_s"], hit,
               r["io_calls_per_batch"], r["rss_MB"], r["rss_anon_MB"], r["rss_file_MB"],
               r["rss_MB"] - r["rss_base_MB"], r["fill_s"])
        lines.append("| %s | %.0f | %.0f | %.0f | %s | %.0f | %.0f (%.0f + %.0f) | %.0f | %.1f |"
                     % row)
    return "\n".join(lines)


# --- cache policies --------------------------------------------------------------------------

def sim_lru(cap):
    d = collections.OrderedDict()

    def access(x):
        if x in d:
            d.move_to_end(x)
            return True
        if len(d) >= cap:
            d.popitem(last=False)
        d[x] = None
        return False
    return access


def sim_gclock(cap, max_count):
    slot_of, rows, count, state = {}, [None] * cap, [0] * cap, {"hand": 0, "used": 0}

    def access(x):
        s = slot_of.get(x)
        if s is not None:
            count[s] = min(count[s] + 1, max_count)
            return True
        if state["used"] < cap:
            s = state["used"]
            state["used"] += 1
        else:
            h = state["hand"]
            while count[h] > 0:
                count[h] -= 1
                h = (h + 1) % cap
            s, state["hand"] = h, (h + 1) % cap
            del slot_of[rows[s]]
        rows[s], slot_of[x], count[s] = x, s, 0
        return False
    return access


def sim_2q(cap):
    """Full 2Q (Johnson & Shasha): A1in FIFO 25%, A1out ghost 50%, Am LRU."""
    kin, kout = max(1, cap // 4), cap // 2
    a1in, a1out, am = (collections.OrderedDict() for _ in range(3))

    def access(x):
        if x in am:
            am.move_to_end(x)
            return True
        if x in a1in:
            return True
        if len(a1in) + len(am) >= cap:
            if len(a1in) > kin or not am:
                y, _ = a1in.popitem(last=False)
                a1out[y] = None
                if len(a1out) > kout:
                    a1out.popitem(last=False)
            else:
                am.popitem(last=False)
        if x in a1out:
            del a1out[x]
            am[x] = None
        else:
            a1in[x] = None
        return False
    return access


def sim_s3fifo(cap):
    """S3-FIFO as in the paper: S 10%, M with reinsertion, ghost of |M| ids."""
    small, main, ghost = collections.deque(), collections.deque(), collections.OrderedDict()
    freq = {}
    s_cap = max(1, cap // 10)
    m_cap = cap - s_cap

    def evict_main():
        while main:
            t = main.popleft()
            if freq[t] > 0:
                freq[t] -= 1
                main.append(t)
            else:
                del freq[t]
                return

    def evict_small():
        while small:
            t = small.popleft()
            if freq[t] > 0:
                freq[t] = 0
                main.append(t)
                if len(main) > m_cap:
                    evict_main()
            else:
                del freq[t]
                ghost[t] = None
                if len(ghost) > m_cap:
                    ghost.popitem(last=False)
                return

    def access(x):
        if x in freq:
            freq[x] = min(freq[x] + 1, 3)
            return True
        while len(freq) >= cap:
            if len(small) >= s_cap or not main:
                evict_small()
            else:
                evict_main()
        if x in ghost:
            del ghost[x]
            main.append(x)
        else:
            small.append(x)
        freq[x] = 0
        return False
    return access


def policies(args):
    n, cap = args.rows, int(args.rows * args.cache)
    sims = {"LRU": sim_lru(cap), "CLOCK": sim_gclock(cap, 1), "GCLOCK-3": sim_gclock(cap, 3),
            "2Q": sim_2q(cap), "S3-FIFO": sim_s3fifo(cap)}
    tiny = RowLayout(n, 1, np.float32, 0)
    directory = tempfile.mkdtemp(prefix="store-policies-", dir=args.dir)
    try:
        stores = {"store lru": "lru", "store clock": "clock", "store gclock": "gclock",
                  "store s3fifo": "s3fifo"}
        stores = {k: DiskRows(tiny, directory, v, tiny.cache_bytes(cap), policy=v)
                  for k, v in stores.items()}
        zipf = Zipf(n)
        best = np.zeros(n, bool)
        best[zipf.perm[:cap]] = True
        hits = collections.Counter()
        total = 0
        t0 = time.perf_counter()
        for i in range(args.batches):
            rows = zipf.next()
            counted = i >= args.warmup
            for name, access in sims.items():
                h = sum(access(x) for x in rows.tolist())
                hits[name] += h if counted else 0
            for name, store in stores.items():
                h0 = store.stats["hits"]
                store.scatter(rows, store.read(rows), [])
                hits[name] += store.stats["hits"] - h0 if counted else 0
            if counted:
                total += len(rows)
                hits["static best"] += int(best[rows].sum())
        for store in stores.values():
            store.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print("%d rows, cache %d rows (%.3g of the table), Zipf(%.2g), batches of %d draws "
          "(%.0f unique rows on average), %d batches, hit rates over the last %d (%.0f s)"
          % (n, cap, args.cache, ZIPF_S, BATCH, total / (args.batches - args.warmup),
             args.batches, args.batches - args.warmup, time.perf_counter() - t0))
    print("| policy | hit rate | miss rate |\n|---|---|---|")
    for name in list(sims) + list(stores) + ["static best"]:
        rate = hits[name] / total
        print("| %s | %.4f | %.4f |" % (name, rate, 1 - rate))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("engines")
    e.add_argument("--engines", default=",".join(ENGINES))
    e.add_argument("--json")
    one = sub.add_parser("_one")
    one.add_argument("engine", choices=ENGINES)
    for p in (e, one):
        p.add_argument("--gb", type=float, default=1.0, help="table size, GiB")
        p.add_argument("--seconds", type=float, default=20.0, help="measured time per engine")
        p.add_argument("--warmup", type=int, default=60, help="batches before measuring")
        p.add_argument("--dir", default=None, help="where the tables go (default: $TMPDIR)")
    p = sub.add_parser("policies")
    p.add_argument("--rows", type=int, default=(2 ** 30) // (COLS * (1 + STATES) * 4))
    p.add_argument("--cache", type=float, default=0.125, help="cache size / table size")
    p.add_argument("--batches", type=int, default=600)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--dir", default=None)
    args = ap.parse_args()
    if args.cmd == "_one":
        print(json.dumps(run_one(args.engine, args.gb, args.seconds, args.warmup, args.dir)))
    elif args.cmd == "engines":
        engines(args)
    else:
        policies(args)


if __name__ == "__main__":
    main()
