"""The server microbenchmark: what one parameter server moves per core, mxps beside native.

One server, N workers, on loopback; every worker pushes and pulls ``--keys`` float32 arrays of
``--elements`` each per round with no compute (``mxps_tools.wire_job``), the server sums the
pushes.  Systems (``--systems``, every one in each repetition, the order rotated per rep):

- ``native``: MXNet dist_sync, ps-lite's server;
- ``mxps``: mxps with MXNet's placement (``MXPS_PLAN=chunked``) and a fresh job secret, as
  ``mxps launch`` runs it;
- ``mxps-plain``: the same without a secret (the secret's cost is the difference).

Per run, over the timed rounds (earliest start to latest end over the workers): ``GB`` pushed
and pulled by all workers (``2 x W x rounds x keys x elements x 4``), wall ``GB/s``, the
server's CPU-seconds and ``GB/s per server core`` = GB / server CPU-seconds (what a server
could move if it had a core of its own: on 2 cores the workers take the rest), and the
workers' CPU-seconds per GB.  Every worker must have pulled the same non-zero aggregate.

    mxps bench-server --workers 2 --keys 4 --elements 4000000 --rounds 10 --repeat 3
"""
import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
from typing import Dict, List

from . import jobs
from .bench import _table, job_secret_env, plan_runs

SYSTEMS: Dict[str, Dict] = {
    "native": {"kvstore": "dist_sync", "env": {}, "secret": False},
    "mxps": {"kvstore": "mxps", "env": {"MXPS_PLAN": "chunked"}, "secret": True},
    "mxps-plain": {"kvstore": "mxps", "env": {"MXPS_PLAN": "chunked"}, "secret": False},
}
CPU_INTERVAL = 0.1          # seconds between CPU samples of every process
JOB_TIMEOUT = 600.0


class ServerBenchError(RuntimeError):
    """A run could not be measured (a node failed, the workers pulled different sums)."""


@dataclasses.dataclass
class Options:
    workers: int = 2
    keys: int = 4
    elements: int = 4_000_000
    rounds: int = 10
    warmup: int = 2
    repeat: int = 3
    systems: List[str] = dataclasses.field(default_factory=lambda: list(SYSTEMS))
    out_dir: str = "mxps-bench-server-out"


def timed_window(results: List[dict]):
    """``(t0, t1, rounds)``: the earliest start and latest end of the workers' timed rounds and
    how many each timed; checks that every worker pulled the same non-zero aggregate."""
    if not results:
        raise ServerBenchError("no worker reported")
    sums = {r["rank"]: r["sum"] for r in results}
    if len(set(sums.values())) != 1 or not next(iter(sums.values())):
        raise ServerBenchError("the workers pulled different or zero sums %s" % sums)
    rounds = {len(r["round_start_abs"]) for r in results}
    if len(rounds) != 1 or not min(rounds):
        raise ServerBenchError("the workers timed %s rounds" % sorted(rounds))
    return (min(r["round_start_abs"][0] for r in results),
            max(r["round_end_abs"][-1] for r in results), rounds.pop())


def run_summary(results: List[dict], cpu: Dict[str, dict]) -> dict:
    """One run's figures from its workers' result lines and its nodes' CPU over the
    ``timed_window`` (``{node: {"role", "cpu_seconds_window"}}``)."""
    t0, t1, n = timed_window(results)
    gb = sum(r["round_bytes"] for r in results) * n / 1e9
    server = sum(c["cpu_seconds_window"] or 0.0 for c in cpu.values() if c["role"] == "server")
    worker = sum(c["cpu_seconds_window"] or 0.0 for c in cpu.values() if c["role"] == "worker")
    rounds_s = [e - s for r in results for s, e in zip(r["round_start_abs"],
                                                         r["round_end_abs"])]
    return {"window": [t0, t1], "rounds": n, "gb": gb, "seconds": t1 - t0,
            "gb_per_s": gb / (t1 - t0), "server_cpu_s": server, "worker_cpu_s": worker,
            "server_gb_per_core_s": gb / server if server > 0 else None,
            "worker_cpu_s_per_gb": worker / gb, "round_median_s": statistics.median(rounds_s)}


def run_one(o: Options, system: str, log_dir: str) -> dict:
    spec = SYSTEMS[system]
    env = dict(spec["env"])
    if spec["secret"]:
        env.update(job_secret_env(env))
    else:
        env.update(MXPS_SECRET="", MXPS_SECRET_FILE="")     # empty: unset
    out = os.path.join(log_dir, "result.jsonl")
    argv = ["-m", "mxps_tools.wire_job", "--kvstore", spec["kvstore"], "--keys", str(o.keys),
            "--elements", str(o.elements), "--rounds", str(o.rounds),
            "--warmup", str(o.warmup), "--out", out]
    job = jobs.Job(argv, o.workers, 1, env=env, timeout=JOB_TIMEOUT, log_dir=log_dir,
                   cpu_interval=CPU_INTERVAL)
    res = job.run()
    if not res.ok:
        raise ServerBenchError(res.describe())
    with open(out) as f:
        results = [json.loads(ln) for ln in f if ln.strip()]
    rec = {"system": system}
    t0, t1, _ = timed_window(results)
    cpu = {n.name: {"role": n.role, "cpu_seconds_window": n.cpu_seconds_between(t0, t1)}
           for n in res.nodes}
    rec.update(run_summary(results, cpu))
    rec["cpu"] = cpu
    return rec


def aggregate(records: List[dict], systems: List[str]) -> List[dict]:
    out = []
    for s in systems:
        rs = [r for r in records if r["system"] == s and r.get("ok")]
        row = {"system": s, "runs": len([r for r in records if r["system"] == s]),
               "ok_runs": len(rs)}
        for k in ("gb_per_s", "server_gb_per_core_s", "worker_cpu_s_per_gb", "round_median_s"):
            xs = [r[k] for r in rs if r.get(k) is not None]
            row[k] = statistics.fmean(xs) if xs else None
            row[k + "_range"] = [min(xs), max(xs)] if xs else None
        out.append(row)
    return out


def _cell(v, r, fmt):
    if v is None:
        return "-"
    if r and r[0] != r[1]:
        return (fmt + " (" + fmt + "-" + fmt + ")") % (v, r[0], r[1])
    return fmt % v


def format_table(summary: dict) -> str:
    o = summary["options"]
    lines = ["server microbenchmark: 1 server, %d workers, %d keys x %d float32 (%.1f MB per "
             "push), %d timed rounds, %d reps, loopback" % (
                 o["workers"], o["keys"], o["elements"], o["keys"] * o["elements"] * 4 / 1e6,
                 o["rounds"], o["repeat"]),
             "(mean over reps, min-max in brackets)"]
    headers = ["system", "GB/s", "GB/s per server core", "worker CPU s/GB", "round median s"]
    rows = [[a["system"] + ("" if a["ok_runs"] == a["runs"] else
                            " (%d/%d ok)" % (a["ok_runs"], a["runs"])),
             _cell(a["gb_per_s"], a["gb_per_s_range"], "%.2f"),
             _cell(a["server_gb_per_core_s"], a["server_gb_per_core_s_range"], "%.2f"),
             _cell(a["worker_cpu_s_per_gb"], a["worker_cpu_s_per_gb_range"], "%.2f"),
             _cell(a["round_median_s"], a["round_median_s_range"], "%.3f")]
            for a in summary["systems"]]
    lines.append(_table(rows, headers))
    for r in summary["records"]:
        if not r.get("ok"):
            lines.append("%s rep %d: FAILED: %s" % (r["system"], r["rep"], r["reason"][:500]))
    return "\n".join(lines)


def run(o: Options, out=sys.stdout) -> dict:
    os.makedirs(o.out_dir, exist_ok=True)
    records = []
    for rep, _, s in plan_runs(o.systems, [None], o.repeat):
        log_dir = tempfile.mkdtemp(prefix="%s-rep%d-" % (s, rep + 1),
                                   dir=os.path.abspath(o.out_dir))
        try:
            rec = dict(run_one(o, s, log_dir), ok=True)
        except (ServerBenchError, jobs.JobError, jobs.JobTimeout, OSError) as e:
            rec = {"system": s, "ok": False, "reason": str(e)}
        rec["rep"] = rep + 1
        records.append(rec)
        print("rep %d %s: %s" % (rep + 1, s, "%.2f GB/s, %s GB/s per server core" % (
            rec["gb_per_s"], "-" if rec["server_gb_per_core_s"] is None else
            "%.2f" % rec["server_gb_per_core_s"]) if rec["ok"] else "FAILED"),
            file=out, flush=True)
    summary = {"options": dataclasses.asdict(o), "records": records,
               "systems": aggregate(records, o.systems),
               "host": {"cpus": os.cpu_count()}}
    with open(os.path.join(o.out_dir, "bench_server.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(format_table(summary), file=out, flush=True)
    return summary


def add_arguments(p: argparse.ArgumentParser):
    d = Options()
    p.add_argument("--workers", type=int, default=d.workers)
    p.add_argument("--keys", type=int, default=d.keys)
    p.add_argument("--elements", type=int, default=d.elements, help="float32 elements per key")
    p.add_argument("--rounds", type=int, default=d.rounds, help="timed rounds per run")
    p.add_argument("--warmup", type=int, default=d.warmup, help="untimed rounds first")
    p.add_argument("--repeat", type=int, default=d.repeat, help="repetitions, interleaved")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help="comma-separated, of: %s" % ", ".join(SYSTEMS))
    p.add_argument("--out-dir", default=d.out_dir)


def options_from(args) -> Options:
    systems = [s for s in args.systems.split(",") if s]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        raise ServerBenchError("unknown systems %s; known: %s" % (unknown, ", ".join(SYSTEMS)))
    for name in ("workers", "keys", "elements", "rounds", "repeat"):
        if getattr(args, name) < 1:
            raise ServerBenchError("--%s must be at least 1" % name)
    if args.warmup < 0:
        raise ServerBenchError("--warmup must be 0 or more")
    return Options(workers=args.workers, keys=args.keys, elements=args.elements,
                   rounds=args.rounds, warmup=args.warmup, repeat=args.repeat,
                   systems=systems, out_dir=args.out_dir)


def main(args, p) -> int:
    """``mxps bench-server``: ``args`` parsed by ``p`` (``add_arguments``)."""
    try:
        o = options_from(args)
    except ServerBenchError as e:
        p.error(str(e))
    summary = run(o)
    return 0 if all(r.get("ok") for r in summary["records"]) else 1

