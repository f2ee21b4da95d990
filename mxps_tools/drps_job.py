"""The DRPS benchmark's training job (mxps_tools.drps_bench): a click-through-style model with a
wide embedding table that lives only on the servers.

Run as every node of a job (mxps_tools.jobs); on scheduler and server nodes ``import mxps``
takes the role over.  Each step a worker draws ``batch`` samples of ``fields`` ids each,
Zipf-distributed over the table's rows, pulls those rows (``row_sparse_pull``), averages each
sample's embeddings, runs a two-layer MLP to one logit against a synthetic label (the parity
of the sample's first id), and pushes the rows' gradients (row-sparse) and the MLP's (dense).
The table is initialised from a rule (``mxps.TableInit``): no worker ever holds it.

Environment (all required but DRPS_OUT's defaults): DRPS_OUT (directory: rank<R>.json with the
step times), DRPS_ROWS, DRPS_COLS, DRPS_STEPS, DRPS_WARMUP, DRPS_BATCH, DRPS_FIELDS,
DRPS_ZIPF (exponent), DRPS_IDS (``scattered``: hot rows spread over the id space by a fixed
permutation, or ``sorted``: id = popularity rank), DRPS_MOMENTUM, DRPS_SEED; DRPS_KVSTORE
(default ``mxps``; ``dist_sync`` runs native MXNet: ``mxps`` is then not imported, worker 0
makes the whole table, uniform in the same range from its own seed, and sends it at init).
"""
import json
import os
import time


def join_cgroup():
    """DRPS_SERVER_CGROUP (a path prefix under the cgroup v1 memory controller) and
    DRPS_SERVER_MEMORY_MB: a server node puts itself, before it imports anything large, into a
    memory cgroup of its own, ``<prefix>-<pid>``, with that hard limit (page cache included);
    the bench reads and removes it."""
    prefix = os.environ.get("DRPS_SERVER_CGROUP")
    if not prefix or os.environ.get("DMLC_ROLE") != "server":
        return
    path = "%s-%d" % (prefix, os.getpid())
    os.mkdir(path)
    limit = int(float(os.environ["DRPS_SERVER_MEMORY_MB"]) * 2 ** 20)
    with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
        f.write(str(limit))
    with open(os.path.join(path, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))


def memory_log():
    """DRPS_MEMLOG (a path prefix): a server node writes, every second, its memory as the
    kernel and glibc see it to ``<prefix>-<pid>.jsonl``: RSS split into anonymous and file
    pages (/proc/self/status), and glibc's mallinfo2 (``heap``: the main arena's size,
    ``mmapped``: bytes in mmap'd chunks, ``in_use``, ``free``: free bytes the heap keeps)."""
    prefix = os.environ.get("DRPS_MEMLOG")
    if not prefix or os.environ.get("DMLC_ROLE") != "server":
        return
    import ctypes
    import threading

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks",
                                                    "hblkhd", "usmblks", "fsmblks",
                                                    "uordblks", "fordblks", "keepcost")]
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    path = "%s-%d.jsonl" % (prefix, os.getpid())

    def loop():
        t0 = time.time()
        while True:
            row = {"t": round(time.time() - t0, 2)}
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith(("VmRSS", "RssAnon", "RssFile")):
                        k, v = line.split(":")
                        row[k] = int(v.split()[0]) // 1024
            m = libc.mallinfo2()
            row.update(heap=m.arena >> 20, mmapped=m.hblkhd >> 20, in_use=m.uordblks >> 20,
                       free=m.fordblks >> 20)
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")
            time.sleep(1.0)
    threading.Thread(target=loop, daemon=True).start()


join_cgroup()
memory_log()
KVSTORE = os.environ.get("DRPS_KVSTORE", "mxps")
if KVSTORE.startswith("mxps"):
    import mxps
import mxnet as mx
import numpy as np
from mxnet import autograd

E = os.environ
OUT = E["DRPS_OUT"]
ROWS, COLS = int(E["DRPS_ROWS"]), int(E["DRPS_COLS"])
STEPS, WARMUP = int(E.get("DRPS_STEPS", "40")), int(E.get("DRPS_WARMUP", "5"))
BATCH, FIELDS = int(E.get("DRPS_BATCH", "512")), int(E.get("DRPS_FIELDS", "26"))
ZIPF = float(E.get("DRPS_ZIPF", "1.1"))
IDS = E.get("DRPS_IDS", "scattered")
MOMENTUM = float(E.get("DRPS_MOMENTUM", "0"))
SEED = int(E.get("DRPS_SEED", "1"))
HIDDEN = 256


def zipf_ranks(rng, n, a, size):
    """Popularity ranks 0..n-1 with P(rank k) ~ (k + 1)^-a (bounded Zipf, inverse CDF of the
    continuous approximation)."""
    u = rng.random_sample(size)
    lo, hi = 1.0, float(n + 1)
    x = ((hi ** (1 - a) - lo ** (1 - a)) * u + lo ** (1 - a)) ** (1.0 / (1 - a))
    return np.minimum(n - 1, np.floor(x).astype(np.int64) - 1)


def ids_of(ranks):
    if IDS == "sorted":
        return ranks
    return (ranks * 2654435761) % ROWS          # a fixed permutation (ROWS not a multiple)


def main():
    kv = mx.kv.create(KVSTORE)
    rank = kv.rank
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.05, momentum=MOMENTUM,
                                      rescale_grad=1.0 / BATCH))
    if KVSTORE.startswith("mxps"):
        kv.init("emb", mxps.TableInit((ROWS, COLS), scale=0.05, seed=7))
    else:           # native: the table itself (worker 0's is sent; the others' are ignored)
        if rank == 0:
            table = mx.nd.sparse.row_sparse_array(       # every row, built in place
                (mx.nd.random.uniform(-0.05, 0.05, (ROWS, COLS)),
                 mx.nd.arange(ROWS, dtype="int64")), shape=(ROWS, COLS))
        else:
            table = mx.nd.sparse.zeros("row_sparse", (ROWS, COLS))
        kv.init("emb", table)
        del table
    rs = np.random.RandomState(11)
    w1 = mx.nd.array(rs.randn(COLS, HIDDEN) * 0.1)
    w2 = mx.nd.array(rs.randn(HIDDEN, 1) * 0.1)
    kv.init("w1", w1)
    kv.init("w2", w2)
    kv.pull("w1", out=w1)
    kv.pull("w2", out=w2)
    rng = np.random.RandomState([SEED, rank])
    rows_out = mx.nd.sparse.zeros("row_sparse", (ROWS, COLS))
    times, losses, uniques = [], [], []
    for step in range(WARMUP + STEPS):
        t0 = time.perf_counter()
        ids = ids_of(zipf_ranks(rng, ROWS, ZIPF, BATCH * FIELDS)).reshape(BATCH, FIELDS)
        uniq, inv = np.unique(ids, return_inverse=True)
        kv.row_sparse_pull("emb", out=rows_out, row_ids=mx.nd.array(uniq, dtype="int64"))
        table = rows_out.data.copy()                    # (len(uniq), COLS), in uniq order
        table.attach_grad()
        w1.attach_grad()
        w2.attach_grad()
        label = mx.nd.array((ids[:, 0] % 2).astype(np.float32))
        idx = mx.nd.array(inv.reshape(BATCH, FIELDS))
        with autograd.record():
            emb = mx.nd.take(table, idx).mean(axis=1)
            logit = mx.nd.dot(mx.nd.relu(mx.nd.dot(emb, w1)), w2).reshape(-1)
            loss = mx.nd.relu(logit) - logit * label + mx.nd.log(1 + mx.nd.exp(-mx.nd.abs(logit)))
        loss.backward()
        grad = mx.nd.sparse.row_sparse_array((table.grad, mx.nd.array(uniq, dtype="int64")),
                                             shape=(ROWS, COLS))
        kv.push("emb", grad)
        kv.push("w1", w1.grad)
        kv.push("w2", w2.grad)
        kv.pull("w1", out=w1)
        kv.pull("w2", out=w2)
        w2.wait_to_read()
        if step >= WARMUP:
            times.append(time.perf_counter() - t0)
            losses.append(float(loss.mean().asscalar()))
            uniques.append(int(uniq.size))
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "rank%d.json" % rank), "w") as f:
        json.dump({"rank": rank, "step_seconds": times, "loss": losses,
                   "unique_rows": uniques, "pid": os.getpid()}, f)


if __name__ == "__main__":
    main()
