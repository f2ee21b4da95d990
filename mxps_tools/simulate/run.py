"""``mxps simulate``: the bench's scenarios on the model, reported as ``mxps bench`` reports.

Each system runs once per variant (the model is deterministic: repetitions would repeat it);
the summary has the bench's shape (``bench.format_table`` prints it, ``bench.plot`` draws the
step times), with ``e2e`` left out (start-up is not modelled).
"""
import json
import os
import statistics
import time

from .. import bench
from . import models, scenarios
from .calibration import Calibration
from .job import Job
from .systems import system as sim_system

#: the compute-only step (s) of the bench's models on this machine, when --compute is not
#: given: the bench's own measurement in the validated runs (docs/bench, the median over the
#: jobs' workers, W processes sharing 2 cores); other models scale it by their bytes
COMPUTE_S = {"resnet18_v1": 0.13}


def compute_seconds(o, model):
    if o.compute is not None:
        return float(o.compute)
    if o.model in COMPUTE_S:
        return COMPUTE_S[o.model]
    return COMPUTE_S["resnet18_v1"] * model.bytes / models.load("resnet18_v1").bytes


def simulate(o, calib=None, model=None):
    """Run every system of ``o`` on every variant; the bench-shaped summary."""
    calib = calib or Calibration.load()
    model = model or models.load(o.model, o.mlp_hidden)
    systems = [sim_system(n) for n in o.systems]
    compute = compute_seconds(o, model)
    steps = scenarios.default_steps(o)
    elements = None
    if "heaviest" in str(o.slow_rank) or "lightest" in str(o.slow_rank):
        elements = bench.predicted_elements(model.keys, o.num_servers)
    variants = scenarios.variants(o, elements)
    t_wall = time.time()
    records, out_variants = [], []
    for v in variants:
        for s in systems:
            t0 = time.time()
            job = Job(s, model, scenarios.worker_classes(o, compute), v.server_rates, calib,
                      loss_pct=o.loss, mtu=o.mtu, incast=(o.scenario == "incast"),
                      shared_cores=o.shared_cores, node_cores=o.node_cores, warmup=o.warmup,
                      steps=steps, changes=v.changes, step_changes=v.step_changes)
            job.run()
            records.append(_record(job, s.name, v, o, model, compute, time.time() - t0))
        bench.rep_speedups(records)
        names = [s.name for s in systems]
        aggs = bench.aggregate_runs([r for r in records if r["variant"] == v.tag], names)
        out_variants.append({"tag": v.tag, "scenario": v.scenario, "slow_rank": v.slow_rank,
                             "systems": aggs})
    over = None
    if len(out_variants) > 1 and all(v["scenario"] == "static" for v in out_variants):
        over = bench.mean_over_ranks(out_variants, [s.name for s in systems])
    return {"simulated": True, "options": _bench_options(o, steps), "model": {
                "name": model.name, "bytes": model.bytes, "keys": len(model.keys)},
            "compute_seconds_median": compute, "variants": out_variants,
            "over_ranks": over, "systems": records, "host": {"cpus": o.shared_cores},
            "wall_seconds": time.time() - t_wall}


def _bench_options(o, steps):
    return {"network": "emunet", "scenario": o.scenario, "num_workers": o.num_workers,
            "num_servers": o.num_servers, "model": o.model, "rate": o.rate,
            "slow_factor": o.slow_factor, "slow_rank": o.slow_rank, "period": o.period,
            "period_steps": o.period_steps, "schedule": o.schedule, "loss": o.loss,
            "mtu": o.mtu, "queue_ms": o.queue_ms, "steps": steps, "repeat": 1,
            "systems": list(o.systems)}


def _record(job, name, v, o, model, compute, wall):
    t = job.step_times()
    n = job.steps
    t0 = min(x[0][0] for x in t)
    t1 = max(x[-1][1] for x in t)
    steps = [e - s for x in t for s, e in x]
    # the floor with the rates in force over the timed window (time-weighted)
    rates = _average_rates(job, v, t0, t1)
    floor = bench.floor_seconds(compute, model.bytes, job.W,
                                [r * 8 / 1e6 for r in rates], [o.rate])
    moves = None
    if v.scenario == "dynamic":
        moves = sum(1 for tt, _, _ in job.rate_log if t0 <= tt <= t1) // 2 or 0
    workers = [{"node": "w%d" % i, "step_seconds": [e - s for s, e in x],
                "step_end_abs": [e for s, e in x], "step_start_abs": [s for s, e in x]}
               for i, x in enumerate(t)]
    return {"name": name, "variant": v.tag, "rep": 1, "ok": True, "mean_s": (t1 - t0) / n,
            "median_s": statistics.median(steps), "p90_s": bench.p90(steps),
            "p99_s": bench.p99(steps), "e2e_s": None, "floor_s": floor, "moves": moves,
            "window": [t0, t1], "workers": workers, "job_started_at": 0.0,
            "rate_log": [(tt, node, r * 8 / 1e6, r * 8 / 1e6)
                         for tt, node, r in job.rate_log],
            "cpu_per_gb": job.cpu_per_gb(), "plan_moves": job.moves, "sim_seconds": wall,
            "sim_events": job.net.events}


def _average_rates(job, v, t0, t1):
    cur = list(v.server_rates)
    log = sorted(job.rate_log)
    acc = [0.0] * len(cur)
    last = t0
    for tt, node, r in log:
        s = int(node.split(":")[1])
        if tt <= t0:
            cur[s] = r
            continue
        if tt >= t1:
            break
        for i in range(len(cur)):
            acc[i] += cur[i] * (tt - last)
        last = tt
        cur[s] = r
    for i in range(len(cur)):
        acc[i] += cur[i] * (t1 - last)
    span = max(t1 - t0, 1e-12)
    return [a / span for a in acc]


def write(summary, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "simulate.json")
    with open(path, "w") as f:
        json.dump(summary, f, indent=1, default=str)
    return path
