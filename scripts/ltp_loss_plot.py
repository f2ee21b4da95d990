"""Step time vs loss for the systems of an `mxps bench --scenario incast` series.

    python scripts/ltp_loss_plot.py OUT.png DIR_LOSS0 DIR_LOSS0.1 ... [--json SUMMARY.json]

Each DIR is an `mxps bench --out-dir` whose bench.json ran one loss level (options.loss);
``DIR:SYSTEM,SYSTEM`` takes only those systems from it (a bench that added a system to a
loss level another bench measured the rest of).
Plots every system's mean step time (mean of the repetitions, bars: min-max over them) and
p99 against the loss, with the strict floor; writes a small summary JSON if asked.
"""
import argparse
import json
import os

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(dirs):
    rows = []
    for d in dirs:
        d, _, only = d.partition(":")
        only = set(only.split(",")) if only else None
        with open(os.path.join(d, "bench.json")) as f:
            b = json.load(f)
        loss = b["options"]["loss"] or 0.0
        for v in b["variants"]:
            for s in v["systems"]:
                if not s.get("ok_runs") or (only is not None and s["name"] not in only):
                    continue
                rows.append({"loss": loss, "system": s["name"], "runs": s["runs"],
                             "ok_runs": s["ok_runs"], "mean_s": s["mean_s"],
                             "min_s": s["mean_s_min"], "max_s": s["mean_s_max"],
                             "median_s": s["median_s"], "p90_s": s["p90_s"],
                             "p99_s": s["p99_s"], "e2e_s": s["e2e_s"], "floor_s": s["floor_s"],
                             "bench": os.path.basename(os.path.normpath(d))})
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("dirs", nargs="+")
    p.add_argument("--json")
    p.add_argument("--title", default="incast 8 -> 1, 400 Mbit/s, 2 ms queue, MTU 9000")
    a = p.parse_args()
    rows = load(a.dirs)
    systems = sorted({r["system"] for r in rows}, key=lambda n: ["native", "native-p3",
                                                                  "mxps-default",
                                                                  "mxps-ltp"].index(n)
                     if n in ("native", "native-p3", "mxps-default", "mxps-ltp") else 9)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in systems:
        rs = sorted((r for r in rows if r["system"] == name), key=lambda r: r["loss"])
        xs = [r["loss"] for r in rs]
        ys = [r["mean_s"] for r in rs]
        err = [[r["mean_s"] - r["min_s"] for r in rs], [r["max_s"] - r["mean_s"] for r in rs]]
        axes[0].errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=name)
        axes[1].plot(xs, [r["p99_s"] for r in rs], marker="o", label=name)
    floor = max(r["floor_s"] for r in rows)
    for ax, what in zip(axes, ("mean step time, s (bars: min-max of reps)", "p99 step time, s")):
        ax.axhline(floor, color="k", ls=":", lw=1, label="floor %.3f s" % floor)
        ax.set_xscale("symlog", linthresh=0.1)
        ax.set_xlim(-0.02, 1.3 * max(r["loss"] for r in rows))
        ax.set_xticks(sorted({r["loss"] for r in rows}))
        ax.set_xticklabels(["%g" % x for x in sorted({r["loss"] for r in rows})])
        ax.set_xlabel("random loss towards the server, %")
        ax.set_ylabel(what)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(a.title)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
