"""WSP's time-to-accuracy study on scikit-learn's digits.

    flock /tmp/mxps-bench.lock python -m mxps_tools.study_wsp --out /tmp/wsp-study \\
        --plot docs/bench/wsp_accuracy.png --json docs/bench/wsp_study.json

trains ``tests/jobs/digits_job.py`` (the MLP, a constant learning rate) with ``--workers``
workers (default 4) and one server on loopback, for every seed (``--seeds``, default 1 2 3),
scenario and system, one job at a time, the systems of a seed and scenario run back to back in
an order rotated per seed:

- systems: ``bsp`` (``kvstore='mxps'``, dist_sync), ``asp`` (``mxps_async``) and ``wsp``
  (``mxps_wsp``: k chosen from response times, ``--staleness``);
- scenarios: ``none``; ``compute`` (the last worker's compute takes ``--slow`` times as long:
  ``3x`` by default, it sleeps twice its own forward and backward time of each step; or a
  number of seconds it sleeps per step); ``link`` (an emulated network, ``mxps_tools.emunet``,
  every worker's link at R = ``--link-mbit`` Mbit/s up and down, the last worker's at R/4,
  the server's at W x R; needs root).  ``none`` and ``compute`` run on loopback.

Worker 0 evaluates the test split after each epoch; the time to accuracy of a run is the
first epoch end at which that reached ``--target`` (default 0.95), in seconds from worker 0's
first step, and the run's wall time (launch to exit) is reported beside it.  The learning rate
is constant (``DIGITS_SCHEDULE=constant``): a schedule counts the servers' updates, and ASP
makes W times as many as BSP.

Output in ``--out``: ``runs.jsonl`` (one record per run; a rerun into the same directory skips
recorded runs), ``runs/<name>/`` (the job's files and logs), ``summary.json``, ``table.md`` and
the plot (accuracy vs time of worker 0, one panel per scenario, every seed).  The study imports
neither MXNet nor the runtime; the jobs import ``mxps`` as installed.
"""
import argparse
import json
import os
import sys
import time
from typing import Dict, List

from . import jobs

SYSTEMS = {"bsp": "mxps", "asp": "mxps_async", "wsp": "mxps_wsp"}
SCENARIOS = ("none", "compute", "link")
DEFAULT_JOB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "tests", "jobs", "digits_job.py")


def run_env(system, scenario, seed, a, run_dir) -> Dict[str, str]:
    env = {"DIGITS_OUT": run_dir, "DIGITS_MODEL": "mlp", "DIGITS_EPOCHS": a.epochs,
           "DIGITS_BATCH": a.batch, "DIGITS_LR": a.lr, "DIGITS_SEED": seed,
           "DIGITS_SCHEDULE": "constant", "DIGITS_KVSTORE": SYSTEMS[system],
           "MXPS_WSP_STALENESS": a.staleness}
    if scenario == "compute":
        env["DIGITS_SLOW"] = "%d:%s" % (a.workers - 1, a.slow)
    return {k: str(v) for k, v in env.items()}


def time_to(curve, ends, target):
    """Seconds to the first epoch end whose accuracy reached ``target`` (None: never)."""
    for acc, t in zip(curve, ends):
        if acc >= target:
            return t
    return None


def link_rates(a) -> Dict[str, float]:
    """The link scenario's rates: every worker at R = ``--link-mbit``, the last one at R/4, and
    the server and scheduler at W x R, so that the server's link carries every worker at R
    (at R it was the bottleneck of every system: the first run found all three at the same
    ~0.1 s per step, ASP's fast workers included)."""
    straggler = "w%d" % (a.workers - 1)
    return {n: (a.link_mbit / 4.0 if n == straggler else
                a.link_mbit if n.startswith("w") else a.link_mbit * a.workers)
            for n in jobs.node_names(a.workers, 1)}


def run_one(system, scenario, seed, a, topo=None) -> dict:
    name = "%s-%s-seed%d" % (scenario, system, seed)
    run_dir = os.path.join(a.out, "runs", name)
    os.makedirs(run_dir, exist_ok=True)
    rec = {"name": name, "system": system, "scenario": scenario, "seed": seed}
    t0 = time.monotonic()
    res = jobs.Job([a.job], a.workers, 1, env=run_env(system, scenario, seed, a, run_dir),
                   timeout=a.timeout, log_dir=os.path.join(run_dir, "logs"),
                   cpu_interval=None, topo=topo).run()
    rec["wall_seconds"] = time.monotonic() - t0
    if not res.ok:
        rec["error"] = res.describe()
        return rec
    ranks = []
    for r in range(a.workers):
        with open(os.path.join(run_dir, "rank%d.json" % r)) as f:
            ranks.append(json.load(f))
    w0 = ranks[0]
    rec.update(curve=w0["test_accuracy"], ends=w0["epoch_end_seconds"],
               final=w0["final_accuracy"], train_seconds=w0["train_seconds"],
               workers_seconds=[x["train_seconds"] for x in ranks],
               compute_seconds=[x.get("compute_seconds_median") for x in ranks],
               kvstore_type=w0["kvstore_type"],
               time_to_target=time_to(w0["test_accuracy"], w0["epoch_end_seconds"], a.target))
    return rec


def _stats(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    m = sum(xs) / len(xs)
    return {"mean": m, "min": min(xs), "max": max(xs), "n": len(xs)}


def summarise(records: List[dict], target: float) -> dict:
    out = {"target": target, "rows": []}
    for scenario in SCENARIOS:
        for system in SYSTEMS:
            rs = [r for r in records if r["scenario"] == scenario and r["system"] == system
                  and "error" not in r]
            if not rs:
                continue
            out["rows"].append({
                "scenario": scenario, "system": system, "runs": len(rs),
                "reached": sum(1 for r in rs if r["time_to_target"] is not None),
                "time_to_target": _stats([r["time_to_target"] for r in rs]),
                "wall": _stats([r["wall_seconds"] for r in rs]),
                "final": _stats([r["final"] for r in rs])})
    return out


def format_table(summary) -> str:
    lines = ["| scenario | system | time to %.0f%% s (min-max) | reached | wall s | final acc |"
             % (100 * summary["target"]), "|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        t = r["time_to_target"]
        lines.append("| %s | %s | %s | %d/%d | %.1f | %.2f%% |" % (
            r["scenario"], r["system"],
            "%.1f (%.1f-%.1f)" % (t["mean"], t["min"], t["max"]) if t else "never",
            r["reached"], r["runs"], r["wall"]["mean"], 100 * r["final"]["mean"]))
    return "\n".join(lines) + "\n"


def plot(records, path, target):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colors = {"bsp": "tab:blue", "asp": "tab:orange", "wsp": "tab:green"}
    scenarios = [x for x in SCENARIOS if any(r["scenario"] == x for r in records)]
    fig, axes = plt.subplots(1, len(scenarios), figsize=(5.5 * len(scenarios), 4), sharey=True,
                             squeeze=False)
    axes = axes[0]
    for ax, scenario in zip(axes, scenarios):
        for r in records:
            if r["scenario"] != scenario or "error" in r:
                continue
            ax.plot(r["ends"], [100 * c for c in r["curve"]], color=colors[r["system"]],
                    alpha=0.7, lw=1, label=r["system"] if r["seed"] == 1 else None)
        ax.axhline(100 * target, color="k", ls=":", lw=1)
        ax.set_title("straggler: %s" % scenario)
        ax.set_xlabel("seconds from worker 0's first step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("worker 0's test accuracy, %")
    axes[0].set_ylim(80, 100)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--staleness", type=int, default=2)
    p.add_argument("--slow", default="3x",
                   help="the compute straggler: Fx (its compute F times as long) or seconds "
                        "of sleep per step")
    p.add_argument("--link-mbit", type=float, default=24.0,
                   help="the link scenario's rate; the straggler's link is a quarter of it "
                        "(default: at 6 Mbit/s the MLP's 69 KB push takes ~90 ms, about 3x "
                        "a fast worker's whole step here, as the compute straggler's 3x)")
    p.add_argument("--target", type=float, default=0.95)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--job", default=DEFAULT_JOB)
    p.add_argument("--plot")
    p.add_argument("--json")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "runs.jsonl")
    records = []
    if os.path.exists(path):
        with open(path) as f:
            records = [json.loads(ln) for ln in f if ln.strip()]
    done = {r["name"] for r in records if "error" not in r}
    systems = list(SYSTEMS)
    topo = None
    if any("link-%s-seed%d" % (system, seed) not in done
           for system in systems for seed in a.seeds) and "link" in a.scenarios:
        from . import emunet
        emunet.check_prerequisites()
        emunet.cleanup_stale()
        topo = emunet.Topology(jobs.node_names(a.workers, 1), rates=link_rates(a))
        topo.start()
    try:
        for i, seed in enumerate(a.seeds):
            order = systems[i % 3:] + systems[:i % 3]
            for scenario in a.scenarios:
                for system in order:
                    name = "%s-%s-seed%d" % (scenario, system, seed)
                    if name in done:
                        continue
                    rec = run_one(system, scenario, seed, a,
                                  topo if scenario == "link" else None)
                    records.append(rec)
                    with open(path, "a") as f:
                        f.write(json.dumps(rec) + "\n")
                    sys.stdout.write("%s: %s\n" % (name, "FAILED" if "error" in rec else
                                                    "%.1f s to target, final %.3f, wall %.1f s"
                                                    % (rec["time_to_target"] or float("nan"),
                                                       rec["final"], rec["wall_seconds"])))
                    sys.stdout.flush()
    finally:
        if topo is not None:
            topo.close()
    summary = summarise(records, a.target)
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    table = format_table(summary)
    with open(os.path.join(a.out, "table.md"), "w") as f:
        f.write(table)
    sys.stdout.write(table)
    plot(records, a.plot or os.path.join(a.out, "wsp_accuracy.png"), a.target)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"settings": {k: v for k, v in vars(a).items()
                                    if k not in ("out", "plot", "json", "job")},
                       "summary": summary,
                       "runs": [{k: r.get(k) for k in ("name", "curve", "ends", "final",
                                                       "time_to_target", "wall_seconds",
                                                       "workers_seconds", "error")}
                                for r in records]}, f, indent=1)
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
