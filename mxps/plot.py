"""``mxps plot``: PNGs from MXPS_METRICS files (one per worker).

    mxps plot /tmp/metrics-*.jsonl --out-dir plots/

writes ``steps.png``: step seconds, each server's share of the bytes, and each server's
estimated rate (MB/s), over the training steps, one line per worker (step time) or server.
"""
import json
import os


def load(paths):
    runs = {}
    for p in paths:
        with open(p) as f:
            lines = [json.loads(x) for x in f if x.strip()]
        if not lines:
            raise ValueError("%s has no metrics lines" % p)
        runs[lines[0]["rank"]] = lines
    return runs


def plot(paths, out_dir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = load(paths)
    os.makedirs(out_dir, exist_ok=True)
    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    for rank, lines in sorted(runs.items()):
        steps = [x["step"] for x in lines if x["step_seconds"] is not None]
        axes[0].plot(steps, [x["step_seconds"] for x in lines if x["step_seconds"] is not None],
                     marker=".", label="worker %d" % rank)
    lines = runs[min(runs)]
    steps = [x["step"] for x in lines]
    for s in range(len(lines[0]["servers"])):
        axes[1].plot(steps, [x["servers"][s]["share"] for x in lines], label="server %d" % s)
        axes[2].plot(steps, [(x["servers"][s]["rate_estimate"] or 0) / 1e6 for x in lines],
                     label="server %d" % s)
    versions = [x["plan_version"] for x in lines]
    for i in range(1, len(versions)):
        if versions[i] != versions[i - 1]:
            for ax in axes:
                ax.axvline(steps[i], color="red", linestyle="--", linewidth=0.8)
    axes[0].set_ylabel("s/step")
    axes[1].set_ylabel("share of bytes")
    axes[2].set_ylabel("estimated MB/s")
    axes[2].set_xlabel("step (red: plan changes)")
    for ax in axes:
        ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    path = os.path.join(out_dir, "steps.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
