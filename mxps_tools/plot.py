"""``mxps plot``: PNGs from MXPS_METRICS files (one per worker).

    mxps plot /tmp/metrics-*.jsonl --out-dir plots/

writes ``steps.png``: step seconds, each server's share of the bytes, and each server's
estimated rate (MB/s), over the training steps, one line per worker (step time) or server.
``shares_over_time`` draws ``mxps bench``'s shares-<scenario>-<system>.png (shares against the
rate-proportional targets over wall time).

    mxps plot --trace /tmp/trace [--around WALL_TIME] [--window 10] --out-dir plots/
    mxps plot --trace /tmp/trace --summary

draw an MXPS_TRACE trace (``plot_trace``: trace.png, a timeline of every push and pull, round
completions, re-plan points and migrations) or print its per-round, per-server table
(``trace_summary``).  The trace files are read as JSON here (format: mxps.placement.trace,
docs/TRACE.md), never through the runtime, which would import MXNet.
"""
import importlib.util
import json
import os
import sys


def require_matplotlib(what):
    """Exit with a clear message (status 2) if matplotlib, which ``what`` needs, is missing.

    Checked without importing it, before a command does any work: a bench that runs for
    minutes must not fail only when it draws its plots."""
    if importlib.util.find_spec("matplotlib") is None:
        sys.stderr.write("mxps: %s needs matplotlib, which is not installed: pip install "
                         "'mxps[examples]' (or pip install matplotlib)\n" % what)
        raise SystemExit(2)


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


# ---------------------------------------------------------------------------------------------
# MXPS_TRACE: per-step timelines and the per-round summary (docs/TRACE.md)

TRACE_FORMAT = "mxps-trace/1"     # mxps.placement.trace.FORMAT (read here without the runtime)
# the phases of a push and a pull, (first stage, last stage, colour, legend)
PUSH_PHASES = (("queued", "held", "#bbbbbb", "queued for the I/O thread (push or pull)"),
               ("held", "released", "#ff8c00", "push: waiting for send credit"),
               ("released", "sent", "#ffd700", "push: waiting for room on the connection"),
               ("sent", "acked", "#1f77b4", "push: sent, until its ACK"))
PULL_PHASES = (("queued", "sent", "#bbbbbb", None),
               ("sent", "answered", "#2ca02c", "pull: sent, until answered"))


class TraceError(ValueError):
    """Trace files that are missing or not mxps traces; the message names the path."""


class Request:
    """One data request of one worker, its events gathered: ``at[stage]`` is a wall time."""

    __slots__ = ("worker", "server", "round", "key", "offset", "length", "bytes", "reply_bytes",
                 "plan_version", "request", "op", "at")

    def __init__(self, worker, row):
        self.worker = worker
        self.op = row.kind.rsplit("_", 1)[0]
        self.server, self.round, self.key = row.server, row.round, row.key
        self.offset, self.length, self.plan_version = row.offset, row.length, row.plan_version
        self.request = row.request
        self.bytes = 0
        self.reply_bytes = 0
        self.at = {}

    @property
    def start(self):
        return min(self.at.values())

    @property
    def end(self):
        return max(self.at.values())


class Trace:
    """Every node's trace of one job: ``workers[rank]`` and ``servers[rank]`` are
    ``{table name: [row namedtuples]}`` (a worker's also ``"plans"``: {version: table})."""

    def __init__(self, files):
        import collections
        self.workers, self.servers, self.files = {}, {}, []
        for path in files:
            try:
                with open(path) as f:
                    body = json.load(f)
            except (OSError, ValueError) as e:
                raise TraceError("%s: not readable as an mxps trace: %s" % (path, e)) from None
            if not isinstance(body, dict) or body.get("format") != TRACE_FORMAT:
                raise TraceError("%s is not an mxps trace (format %s)" % (path, TRACE_FORMAT))
            node = {}
            for name, table in body["tables"].items():
                row = collections.namedtuple("Row", table["columns"])
                node[name] = [row(*r) for r in table["rows"]]
            if body["role"] == "worker":
                node["plans"] = {int(v): t for v, t in body.get("plans", {}).items()}
            {"worker": self.workers, "server": self.servers}[body["role"]][body["rank"]] = node
            self.files.append(path)
        times = [r.time for node in list(self.workers.values()) + list(self.servers.values())
                 for name, rows in node.items() if name != "plans" for r in rows]
        if not times:
            raise TraceError("the trace files %s hold no records" % ", ".join(files))
        self.t0, self.t1 = min(times), max(times)

    @classmethod
    def find(cls, prefixes):
        """The trace of ``prefixes``: each a file, or the MXPS_TRACE prefix of
        PREFIX.worker<rank> / PREFIX.server<rank> files."""
        import glob
        files = []
        for p in prefixes:
            if os.path.isfile(p):
                files.append(p)
                continue
            found = sorted(glob.glob(glob.escape(p) + ".worker*") +
                           glob.glob(glob.escape(p) + ".server*"))
            if not found:
                raise TraceError("no trace files at %s: MXPS_TRACE=%s writes %s.worker<rank> "
                                 "and %s.server<rank>" % (p, p, p, p))
            files += found
        return cls(files)

    def requests(self):
        """Every worker's data requests (``Request``), in the order they were queued."""
        out = []
        for w, node in sorted(self.workers.items()):
            by_id = {}
            for row in node["requests"]:
                if row.kind == "reply_unusable":
                    continue
                op, stage = row.kind.rsplit("_", 1)
                r = by_id.get(row.request)
                if r is None:
                    r = by_id[row.request] = Request(w, row)
                    out.append(r)
                r.at[stage] = row.time
                if stage in ("acked", "answered"):
                    r.reply_bytes = row.bytes
                elif stage == "queued":
                    r.bytes = row.bytes
        return out

    def points(self):
        """{round: {"start", "end", "full", "from", "to"}}: each re-plan point from the first
        worker's drain start to the last worker's answer (a light point: to its last REPLAN
        sent, as workers go on without the answer); plan version before and after."""
        out = {}
        for node in self.workers.values():
            for p in node["points"]:
                if p.kind == "round_begin":
                    continue
                pt = out.setdefault(p.round, {"start": p.time, "end": p.time, "full": None,
                                              "from": p.plan_version, "to": p.plan_version})
                pt["start"] = min(pt["start"], p.time)
                if p.kind != "replan_answer" or p.full:
                    # a light point's answer is read at the next point: not this one's time
                    pt["end"] = max(pt["end"], p.time)
                if p.kind == "replan_sent":
                    pt["full"] = bool(p.full)
                elif p.kind == "replan_answer" and p.new_version is not None:
                    pt["to"] = p.new_version
        return out

    def round_begins(self):
        """{round: [wall time of each worker's round_begin]}."""
        out = {}
        for node in self.workers.values():
            for p in node["points"]:
                if p.kind == "round_begin":
                    out.setdefault(p.round, []).append(p.time)
        return out

    def migrations(self):
        """{(server, plan version): {"start", "end", "bytes"}}: PLAN received to in place."""
        out = {}
        for s, node in self.servers.items():
            for p in node["plan"]:
                m = out.setdefault((s, p.plan_version), {"start": p.time, "end": p.time,
                                                         "bytes": 0})
                m["start"], m["end"] = min(m["start"], p.time), max(m["end"], p.time)
                if p.kind == "plan_in_place":
                    m["bytes"] = p.bytes
        return out


def _window(trace, around, window):
    """(lo, hi) wall times of the part to show: everything, or ``window`` seconds centred on
    ``around`` (wall seconds; below 1e9: seconds since the trace's first record)."""
    if around is None:
        return trace.t0, trace.t1
    centre = around + trace.t0 if around < 1e9 else around
    return centre - window / 2.0, centre + window / 2.0


def trace_summary(trace, around=None, window=10.0):
    """Rows of the per-round, per-server summary (the table ``mxps plot --summary`` prints):
    times are seconds since the trace's first record."""
    lo, hi = _window(trace, around, window)
    reqs = [r for r in trace.requests() if r.end >= lo and r.start <= hi]
    points = trace.points()
    begins = trace.round_begins()
    migrations = trace.migrations()
    per = {}
    for r in reqs:
        c = per.setdefault((r.round, r.server), {"bytes": 0, "first": None, "last": None,
                                                  "credit": 0.0})
        c["bytes"] += r.bytes + r.reply_bytes
        sent = r.at.get("sent")
        if sent is not None:
            c["first"] = sent if c["first"] is None else min(c["first"], sent)
        done = r.at.get("acked", r.at.get("answered"))
        if done is not None:
            c["last"] = done if c["last"] is None else max(c["last"], done)
        if "held" in r.at and "released" in r.at:
            c["credit"] = max(c["credit"], r.at["released"] - r.at["held"])
    rows = []
    for (rnd, s), c in sorted(per.items()):
        pt = points.get(rnd)
        mig = migrations.get((s, pt["to"])) if pt and pt["to"] != pt["from"] else None
        step = None
        if rnd in begins and rnd + 1 in begins:
            step = max(begins[rnd + 1]) - max(begins[rnd])
        rows.append({
            "round": rnd, "server": s, "bytes": c["bytes"],
            "first_send": None if c["first"] is None else c["first"] - trace.t0,
            "last_reply": None if c["last"] is None else c["last"] - trace.t0,
            "busy": None if c["first"] is None or c["last"] is None else c["last"] - c["first"],
            "max_credit_wait": c["credit"],
            "replan": None if pt is None else pt["end"] - pt["start"],
            "plan": None if pt is None else pt["to"],
            "moved_bytes": None if mig is None else mig["bytes"],
            "step": step})
    return rows


SUMMARY_COLUMNS = (("round", "round", "%d"), ("server", "server", "%d"),
                   ("bytes", "bytes", "%d"), ("first_send", "first send s", "%.4f"),
                   ("last_reply", "last ack/answer s", "%.4f"), ("busy", "busy s", "%.4f"),
                   ("max_credit_wait", "max credit wait s", "%.4f"),
                   ("replan", "re-plan point s", "%.4f"), ("plan", "plan", "%d"),
                   ("moved_bytes", "moved bytes", "%d"), ("step", "step s", "%.4f"))


def format_summary(trace, rows):
    """The summary table as text (tabulate), with a header naming the trace."""
    from tabulate import tabulate
    body = [["" if x[c] is None else fmt % x[c] for c, _, fmt in SUMMARY_COLUMNS]
            for x in rows]
    head = ("mxps trace: %d workers, %d servers, %.3f s from wall time %.6f (times below are "
            "seconds since then)\nper round and server: bytes pushed + pulled; first send, last "
            "ACK or answer; the longest wait of a push for send credit; the round's re-plan "
            "point (first drain start to last answer, every worker); bytes the server sent for "
            "the plan adopted there; step (round begin to the next, slowest worker)\n"
            % (len(trace.workers), len(trace.servers), trace.t1 - trace.t0, trace.t0))
    return head + tabulate(body, headers=[h for _, h, _ in SUMMARY_COLUMNS],
                           disable_numparse=True, stralign="right")


def plot_trace(prefixes, out_dir, around=None, window=10.0):
    """``mxps plot --trace``: one timeline PNG of the trace (or of ``window`` seconds around
    ``around``) in ``out_dir``; returns its path.  Rows: one per (worker, server) pair (pushes
    in the upper half of the row, pulls in the lower) and one per server (round-complete
    ticks and migrations above its line, pulls parked until their round completes below);
    shaded: re-plan points
    (first drain start to last answer); dotted: each round's begin on worker 0."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trace = prefixes if isinstance(prefixes, Trace) else Trace.find(prefixes)
    lo, hi = _window(trace, around, window)
    t0 = trace.t0
    W, S = sorted(trace.workers), sorted(trace.servers)
    pairs = [(w, s) for w in W for s in range(max(S + [-1]) + 1)]
    lane = {p: i for i, p in enumerate(pairs)}
    server_lane = {s: len(pairs) + i for i, s in enumerate(S)}
    n = len(pairs) + len(S)
    fig, ax = plt.subplots(figsize=(14, max(3.0, 0.45 * n + 1.5)))
    bars = {}            # (lane, y offset, colour) -> [(x, width)]

    def bar(y, dy, colour, a, b):
        if a is not None and b is not None and b >= lo and a <= hi:
            bars.setdefault((y, dy, colour), []).append((a - t0, max(b - a, 1e-6)))

    labels = {}
    for r in trace.requests():
        y = lane.get((r.worker, r.server))
        if y is None:
            continue
        phases = PUSH_PHASES if r.op == "push" else PULL_PHASES
        for a, b, colour, legend in phases:
            bar(y, -0.4 if r.op == "push" else 0.0, colour, r.at.get(a), r.at.get(b))
            if legend:
                labels[colour] = legend
    for s in S:
        y = server_lane[s]
        parked = {}
        ticks = []
        for row in trace.servers[s]["data"]:
            if row.kind == "pull_parked":
                parked[(row.worker, row.request)] = row.time
            elif row.kind == "pull_answered" and (row.worker, row.request) in parked:
                bar(y, 0.0, "#9467bd", parked.pop((row.worker, row.request)), row.time)
                labels["#9467bd"] = "server: pull parked until its round completes"
            elif row.kind == "round_complete" and lo <= row.time <= hi:
                ticks.append(row.time - t0)
        if ticks:
            ax.scatter(ticks, [y - 0.2] * len(ticks), marker="|", color="black", s=40,
                       linewidths=0.6, label="server: round complete" if s == S[0] else None)
    for (s, version), m in trace.migrations().items():
        bar(server_lane[s], -0.4, "#d62728", m["start"], m["end"])
        labels["#d62728"] = "server: PLAN received to plan in place"
    for (y, dy, colour), xs in sorted(bars.items()):
        ax.broken_barh(xs, (y + dy + 0.02, 0.36), facecolors=colour, edgecolor="none",
                       label=labels.pop(colour, None))
    first = True
    for rnd, pt in sorted(trace.points().items()):
        if pt["end"] >= lo and pt["start"] <= hi:
            ax.axvspan(pt["start"] - t0, pt["end"] - t0, color="red", alpha=0.12, lw=0,
                       label="re-plan point (drain to answer)" if first else None)
            first = False
    first = True
    for rnd, times in sorted(trace.round_begins().items()):
        t = min(times)
        if lo <= t <= hi:
            ax.axvline(t - t0, color="gray", ls=":", lw=0.7,
                       label="round begins (first push issued)" if first else None)
            first = False
    if around is not None:
        centre = (around + t0 if around < 1e9 else around) - t0
        ax.axvline(centre, color="red", lw=1.0, label="--around")
    ax.set_yticks([i + 0.0 for i in range(n)])
    ax.set_yticklabels(["w%d - s%d" % p for p in pairs] + ["server %d" % s for s in S],
                       fontsize=7)
    ax.set_ylim(-0.6, n - 0.2)
    ax.invert_yaxis()
    ax.set_xlim(lo - t0, hi - t0)
    ax.set_xlabel("seconds since the trace's first record (wall time %.6f); in each worker "
                  "row pushes above the line, pulls below" % t0)
    ax.set_title("mxps trace: %s" % ", ".join(os.path.basename(f) for f in trace.files[:4])
                 + (" ..." if len(trace.files) > 4 else ""), fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    os.makedirs(out_dir, exist_ok=True)
    name = "trace.png" if around is None else "trace-around-%s.png" % ("%.3f" % around)
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
