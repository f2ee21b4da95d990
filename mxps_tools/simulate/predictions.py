"""``mxps simulate --predictions OUT_DIR``: the questions a user sizing a cluster asks, answered
by the model (docs/SIMULATE.md shows the plots this draws).

- Scale and link rate: W x S of 32 x 8, 64 x 16 and 256 x 32 at 10, 25 and 100 Gbit/s, on an
  even network, with 10% of the servers at a quarter of the rate, with a quarter-rate link
  moving to the next server every 3 steps, and with 1% and 5% of the packets towards the
  servers lost: each
  system's mean step and its speedup over the better of native and P3.
- How many servers a model needs: 64 workers at 25 Gbit/s, 2 to 64 servers.

Every node is its own machine (one core for its communication, ``--node-cores``), compute is
the bench's measured compute-only step scaled by the model's bytes (``run.compute_seconds``).
"""
import json
import os
import time

from . import scenarios
from .run import simulate

SCALES = ((32, 8), (64, 16), (256, 32))
RATES = (10000.0, 25000.0, 100000.0)
CONDITIONS = {
    "even": dict(scenario="homogeneous"),
    "10% of servers at R/4": dict(scenario="homogeneous", slow_servers=0.1),
    "R/4 link moving every 3 steps": dict(scenario="dynamic", period_steps=3),
    "1% loss": dict(scenario="homogeneous", loss=1.0),
    "5% loss": dict(scenario="homogeneous", loss=5.0),
}
SYSTEMS = ("native", "native-p3", "mxps-default", "mxps-adaptive", "mxps-adaptive-ltp")
MODEL = "resnet50_v1"
STEPS = 12


def grid(model=MODEL, steps=STEPS, progress=print):
    rows = []
    for cond, kw in CONDITIONS.items():
        for w, s in SCALES:
            for rate in RATES:
                o = scenarios.Options(num_workers=w, num_servers=s, model=model, rate=rate,
                                      steps=steps, systems=SYSTEMS, **kw)
                if kw.get("period_steps"):
                    o.steps = None          # the dynamic default: max(4P, 3P + 3) steps
                t0 = time.time()
                summ = simulate(o)
                for a in summ["variants"][0]["systems"]:
                    rows.append({"condition": cond, "workers": w, "servers": s, "rate": rate,
                                 "system": a["name"], "mean_s": a["mean_s"],
                                 "speedup": a["speedup"], "floor_s": a["floor_s"]})
                progress("%-28s %3d x %-2d %6g Mbit/s: %s (%.1f s)" % (
                    cond, w, s, rate, " ".join("%s %.3f" % (a["name"], a["mean_s"])
                                               for a in summ["variants"][0]["systems"]),
                    time.time() - t0))
    return rows


def servers_needed(model=MODEL, workers=64, rate=25000.0, steps=STEPS,
                   servers=(2, 4, 8, 16, 32, 64)):
    rows = []
    for s in servers:
        o = scenarios.Options(scenario="homogeneous", num_workers=workers, num_servers=s,
                              model=model, rate=rate, steps=steps, systems=SYSTEMS)
        summ = simulate(o)
        for a in summ["variants"][0]["systems"]:
            rows.append({"servers": s, "system": a["name"], "mean_s": a["mean_s"],
                         "floor_s": a["floor_s"]})
    return rows


def plot(rows, needed, out_dir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    paths = []
    conds = list(CONDITIONS)
    fig, axes = plt.subplots(len(conds), len(RATES), figsize=(13, 3.0 * len(conds)),
                             squeeze=False, sharey="row")
    labels = ["%dx%d" % ws for ws in SCALES]
    for i, cond in enumerate(conds):
        for j, rate in enumerate(RATES):
            ax = axes[i][j]
            for sysname in SYSTEMS:
                ys = [next(r["mean_s"] for r in rows if r["condition"] == cond and
                           r["rate"] == rate and r["system"] == sysname and
                           (r["workers"], r["servers"]) == ws) for ws in SCALES]
                ax.plot(labels, ys, "o-", label=sysname)
            fl = [next(r["floor_s"] for r in rows if r["condition"] == cond and
                       r["rate"] == rate and (r["workers"], r["servers"]) == ws)
                  for ws in SCALES]
            ax.plot(labels, fl, "k:", label="floor")
            ax.set_title("%s, %g Gbit/s" % (cond, rate / 1000), fontsize=9)
            ax.set_ylabel("mean s/step")
            ax.set_ylim(bottom=0)
            if i == 0 and j == 0:
                ax.legend(fontsize=7)
    fig.suptitle("%s, simulated: mean step time by workers x servers" % MODEL, fontsize=10)
    fig.tight_layout()
    p = os.path.join(out_dir, "predictions_step.png")
    fig.savefig(p, dpi=80)
    plt.close(fig)
    paths.append(p)
    fig, ax = plt.subplots(figsize=(7, 4))
    ss = sorted({r["servers"] for r in needed})
    for sysname in SYSTEMS:
        ax.plot(ss, [next(r["mean_s"] for r in needed if r["servers"] == s and
                          r["system"] == sysname) for s in ss], "o-", label=sysname)
    ax.plot(ss, [next(r["floor_s"] for r in needed if r["servers"] == s) for s in ss], "k:",
            label="floor")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("servers (64 workers, 25 Gbit/s)")
    ax.set_ylabel("mean s/step")
    ax.set_title("%s, simulated: how many servers" % MODEL, fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    p = os.path.join(out_dir, "predictions_servers.png")
    fig.savefig(p, dpi=80)
    plt.close(fig)
    paths.append(p)
    return paths


def main(out_dir):
    from ..plot import require_matplotlib
    require_matplotlib("mxps simulate --predictions")
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.time()
    rows = grid()
    needed = servers_needed()
    with open(os.path.join(out_dir, "predictions.json"), "w") as f:
        json.dump({"model": MODEL, "steps": STEPS, "grid": rows, "servers_needed": needed,
                   "seconds": time.time() - t0}, f, indent=1)
    for p in plot(rows, needed, out_dir):
        print(p)
    return 0
