"""DRPS's benchmark: a wide embedding on the servers' disks against the same job in
their memory.

    flock /tmp/mxps-bench.lock python -m mxps_tools.drps_bench --rows 16777216 --cols 64 \\
        --cache-mb 512 --out /tmp/drps --json docs/bench/drps.json

runs ``mxps_tools/drps_job.py`` (its docstring has the model) with ``--workers`` workers and
``--servers`` servers on loopback, once per store (``--stores``: ``memory``, ``disk`` with
``MXPS_STORE_CACHE_MB`` = ``--cache-mb`` per server; ``native``: MXNet's own ``dist_sync``, worker
0 sending the whole table at init) and repetition, the stores interleaved,
and reports per store: mean, median and p90 step time over every worker's timed steps, the
job's wall time, the servers' peak RSS (sampled every 0.25 s with psutil) against the cache
budget, and from the servers' store reports (``MXPS_METRICS``) the rows read per step, the
cache hit rate and the bytes read and written per step.  The page cache is the machine's: a
table whose file fits in free RAM is read from memory by the kernel after its first touch
(the report says how much RAM the machine has free), unless ``--server-memory-mb`` puts each
server of a disk store run in a memory cgroup (v1, /sys/fs/cgroup/memory, joined by the server
process itself before it imports MXNet; needs root) with that
hard limit, which counts the server's page cache too: then rows evicted from the cache are read
from the disk, and a server that needed more would be killed (the run fails).  The cgroups'
peak usage and failure counts are reported; they are removed after each run.  The table is made
from a rule (``mxps.TableInit``), so no worker holds it; the memory store makes it whole at init.
"""
import argparse
import glob
import json
import os
import sys
import tempfile
import time

import psutil

from . import jobs

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "drps_job.py")
CGROUP_ROOT = "/sys/fs/cgroup/memory"


class ServerCgroups:
    """The memory cgroups (v1) of a job's servers, ``limit_mb`` each: every server node makes its
    own at start-up, before importing MXNet (drps_job.join_cgroup, from the variables of
    ``env()``), so that all its memory is charged to it; ``report()`` gives each one's peak
    usage and failure count, ``remove()`` deletes them once the processes have exited."""

    def __init__(self, tag, limit_mb):
        if not os.path.isdir(CGROUP_ROOT):
            raise SystemExit("--server-memory-mb needs the cgroup v1 memory controller at %s"
                             % CGROUP_ROOT)
        self.prefix = os.path.join(CGROUP_ROOT, "mxps-drps-%d-%s" % (os.getpid(), tag))
        self.limit_mb = limit_mb

    def env(self):
        return {"DRPS_SERVER_CGROUP": self.prefix, "DRPS_SERVER_MEMORY_MB": self.limit_mb}

    def paths(self):
        return sorted(glob.glob(self.prefix + "-*"))

    @staticmethod
    def _read(path, name):
        with open(os.path.join(path, name)) as f:
            return int(f.read().strip())

    def report(self):
        return {os.path.basename(p): {
            "limit_mb": self._read(p, "memory.limit_in_bytes") / 2 ** 20,
            "max_usage_mb": self._read(p, "memory.max_usage_in_bytes") / 2 ** 20,
            "failcnt": self._read(p, "memory.failcnt")} for p in self.paths()}

    def remove(self):
        for p in self.paths():
            try:
                os.rmdir(p)
            except OSError as e:
                sys.stderr.write("could not remove cgroup %s: %s\n" % (p, e))


def run_one(store, rep, a):
    name = "%s-rep%d" % (store, rep)
    run_dir = os.path.join(a.out, name)
    os.makedirs(run_dir, exist_ok=True)
    env = {"DRPS_OUT": run_dir, "DRPS_ROWS": a.rows, "DRPS_COLS": a.cols,
           "DRPS_STEPS": a.steps, "DRPS_WARMUP": a.warmup, "DRPS_BATCH": a.batch,
           "DRPS_FIELDS": a.fields, "DRPS_ZIPF": a.zipf, "DRPS_IDS": a.ids,
           "DRPS_MOMENTUM": a.momentum, "DRPS_SEED": rep,
           "MXPS_METRICS": os.path.join(run_dir, "metrics"), "MXPS_TIMEOUT": 600,
           "DRPS_MEMLOG": os.path.join(run_dir, "memory")}
    store_dir = cgroups = None
    if store == "disk":
        store_dir = tempfile.mkdtemp(prefix="drps-store-", dir=a.store_root)
        env.update(MXPS_STORE="disk", MXPS_STORE_DIR=store_dir, MXPS_STORE_CACHE_MB=a.cache_mb)
        if a.server_memory_mb:
            cgroups = ServerCgroups(name, a.server_memory_mb)
            env.update(cgroups.env())
    elif store == "native":
        env.update(DRPS_KVSTORE="dist_sync")
        del env["MXPS_METRICS"], env["MXPS_TIMEOUT"]
    peak = {}

    def sample(job):
        for n in job.nodes:
            if n.role == "server" and n.pid and n.returncode is None:
                try:
                    rss = psutil.Process(n.pid).memory_info().rss
                except psutil.NoSuchProcess:
                    continue
                peak[n.name] = max(peak.get(n.name, 0), rss)

    t0 = time.monotonic()
    try:
        res = jobs.Job([JOB], a.workers, a.servers, env={k: str(v) for k, v in env.items()},
                       timeout=a.timeout, log_dir=os.path.join(run_dir, "logs"),
                       cpu_interval=None, on_poll=sample).run()
        rec = {"name": name, "store": store, "rep": rep, "wall_seconds": time.monotonic() - t0,
               "server_peak_rss_mb": {k: v / 2 ** 20 for k, v in sorted(peak.items())}}
        if cgroups is not None:
            rec["server_cgroups"] = cgroups.report()
        if not res.ok:
            rec["error"] = res.describe()
            return rec
        steps = []
        for r in range(a.workers):
            with open(os.path.join(run_dir, "rank%d.json" % r)) as f:
                steps.append(json.load(f))
        rec["step_seconds"] = [t for w in steps for t in w["step_seconds"]]
        rec["unique_rows_per_worker_step"] = sum(sum(w["unique_rows"]) for w in steps) / \
            max(1, sum(len(w["unique_rows"]) for w in steps))
        if store == "disk":
            stats = {}
            for s in range(a.servers):
                path = os.path.join(run_dir, "metrics.server%d.store.json" % s)
                with open(path) as f:
                    for k, v in json.load(f)["stats"].items():
                        stats[k] = stats.get(k, 0) + v
            rec["store_stats"] = stats
        return rec
    finally:
        if cgroups is not None:
            cgroups.remove()
        if store_dir is not None:
            import shutil
            shutil.rmtree(store_dir, ignore_errors=True)


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def summarise(records, a):
    rows = []
    for store in a.stores:
        rs = [r for r in records if r["store"] == store and "error" not in r]
        if not rs:
            continue
        means = [sum(r["step_seconds"]) / len(r["step_seconds"]) for r in rs]
        allt = [t for r in rs for t in r["step_seconds"]]
        row = {"store": store, "runs": len(rs), "mean_s": sum(means) / len(means),
               "mean_min": min(means), "mean_max": max(means),
               "median_s": _pct(allt, 0.5), "p90_s": _pct(allt, 0.9),
               "wall_s": sum(r["wall_seconds"] for r in rs) / len(rs),
               "peak_rss_mb": max(max(r["server_peak_rss_mb"].values() or [0]) for r in rs)}
        if store == "disk":
            st = [r["store_stats"] for r in rs]
            n_steps = (a.steps + a.warmup) * a.workers
            reads = sum(s["rows_read"] for s in st)
            row.update(hit_rate=sum(s["hits"] for s in st) / max(1, reads),
                       read_mb_per_step=sum(s["bytes_read"] for s in st) / len(st) / 2 ** 20
                       / (a.steps + a.warmup),
                       written_mb_per_step=sum(s["bytes_written"] for s in st) / len(st)
                       / 2 ** 20 / (a.steps + a.warmup),
                       rows_touched_per_worker_step=reads / len(st) / n_steps)
        rows.append(row)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--rows", type=int, default=16 * 2 ** 20)
    p.add_argument("--cols", type=int, default=64)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--fields", type=int, default=26)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--ids", choices=("scattered", "sorted"), default="scattered")
    p.add_argument("--momentum", type=float, default=0.0)
    p.add_argument("--cache-mb", type=float, default=512)
    p.add_argument("--stores", nargs="+", default=["memory", "disk"])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--store-root", default=None, help="where disk stores go (default: /tmp)")
    p.add_argument("--server-memory-mb", type=float, default=None,
                   help="a hard memory limit (cgroup) per server of disk store runs")
    p.add_argument("--json")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    table_gb = a.rows * a.cols * 4 * (2 if a.momentum else 1) / 2 ** 30
    sys.stdout.write("table %.2f GB (weights%s), cache %.0f MB per server (%.1f%% of the "
                     "table over %d servers); machine RAM available %.1f GB\n" % (
                         table_gb, " + momentum" if a.momentum else "", a.cache_mb,
                         100 * a.cache_mb * a.servers / 1024 / table_gb, a.servers,
                         psutil.virtual_memory().available / 2 ** 30))
    records = []
    for rep in range(1, a.repeat + 1):
        order = a.stores if rep % 2 else list(reversed(a.stores))
        for store in order:
            rec = run_one(store, rep, a)
            records.append(rec)
            sys.stdout.write("%s: %s\n" % (rec["name"], "FAILED\n" + rec["error"]
                                           if "error" in rec else "mean %.3f s/step, peak "
                                           "server RSS %s MB" % (
                                               sum(rec["step_seconds"]) /
                                               len(rec["step_seconds"]),
                                               {k: round(v) for k, v in
                                                rec["server_peak_rss_mb"].items()})))
            sys.stdout.flush()
    rows = summarise(records, a)
    for r in rows:
        sys.stdout.write(json.dumps(r) + "\n")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"settings": {k: v for k, v in vars(a).items() if k not in ("out",
                                                                               "json")},
                       "table_gb": table_gb, "summary": rows,
                       "runs": [{k: v for k, v in r.items() if k != "step_seconds"}
                                for r in records]}, f, indent=1)
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
