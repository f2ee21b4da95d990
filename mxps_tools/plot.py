"""``mxps plot``: PNGs from MXPS_METRICS files (one per worker).

    mxps plot /tmp/metrics-*.jsonl --out-dir plots/

writes ``steps.png``: step seconds, each server's share of the bytes, and each server's
estimated rate (MB/s), over the training steps, one line per worker (step time) or server.
``shares_over_time`` draws ``mxps bench``'s shares-<scenario>-<system>.png (shares against the
rate-proportional targets over wall time).
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


def shares_over_time(path, t, shares, step_seconds, targets=(), rate_changes=(),
                     plan_changes=(), labels=None, title=""):
    """``mxps bench``'s shares plot: one PNG at ``path``.

    Top: each server's share of a step's bytes (solid, one point per step at ``t``, seconds
    since the job's start) and its target share (dashed, a step function: ``targets`` is
    ``[(t, [share per server] or None), ...]`` in time order, each in force until the next);
    rate changes (red dotted, ``rate_changes``: ``[(t, label)]``) and plan-version changes
    (black dashed, ``plan_changes``: ``[t]``, the start of the first step under the new plan)
    marked on both panels.  Bottom: step seconds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(shares[0]) if shares else 0
    labels = labels or ["server %d" % s for s in range(n)]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(11.5, 6.5), sharex=True,
                                  gridspec_kw={"height_ratios": [2, 1]})
    t_end = max(list(t) + [tt for tt, _ in targets] + [0.0])
    for s in range(n):
        line, = ax.plot(t, [x[s] for x in shares], ".-", label="share " + labels[s])
        pts = [(tt, tg) for tt, tg in targets if tg is not None]
        if pts:
            xs = [tt for tt, _ in pts] + [t_end]
            ys = [tg[s] for _, tg in pts]
            ax.step(xs, ys + ys[-1:], where="post", ls="--", color=line.get_color(),
                    label="target " + labels[s])
    for i, (tt, label) in enumerate(rate_changes):
        for a in (ax, ax2):
            a.axvline(tt, color="red", ls=":", lw=1.0,
                      label="rate change" if (a is ax and i == 0) else None)
        ax.annotate(label, (tt, 1.0), xycoords=("data", "axes fraction"), fontsize=6,
                    color="red", rotation=90, va="top", ha="right", annotation_clip=True)
    for i, tt in enumerate(plan_changes):
        for a in (ax, ax2):
            a.axvline(tt, color="black", ls="--", lw=0.6, alpha=0.6,
                      label="plan change" if (a is ax and i == 0) else None)
    ax.set_ylim(0, 1)
    ax.set_ylabel("share of the step's bytes")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    pts = [(tt, s) for tt, s in zip(t, step_seconds) if s is not None]
    ax2.plot([p[0] for p in pts], [p[1] for p in pts], ".-", color="gray")
    ax2.set_ylabel("step seconds")
    ax2.set_xlabel("seconds since the job's start (start-up before the first step not shown)")
    if len(t) > 1:
        # the job's start-up (imports, compute timing, probe) has no steps: start the axis
        # a little before the first step
        gap = max(b - a for a, b in zip(t, t[1:]))
        ax.set_xlim(max(0.0, min(t) - 2 * gap), max(t) + 0.5 * gap)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
