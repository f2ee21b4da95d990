"""LTP's accuracy study on scikit-learn's digits.

    flock /tmp/mxps-bench.lock python -m mxps_tools.study_ltp --out /tmp/ltp-study \\
        --plot docs/bench/ltp_accuracy.png --json docs/bench/ltp_accuracy.json

trains each model (``--models``, default ``mlp,cnn``) to convergence with ``--workers``
workers (default 8) and ``--servers`` servers (default 1) on loopback, once per system, loss
and seed, one job at a time, and reports the final test accuracy of each against lossless
TCP.  The job is ``tests/jobs/digits_job.py`` (``--job``; its docstring has the data split, the
models and the schedule), run by ``mxps_tools.jobs``: every node on 127.0.0.1.

Systems: ``tcp`` (``MXPS_PUSH=tcp``, the reference: run at loss 0 only, there is nothing to
inject into it), ``ltp-rescale`` and ``ltp-zero`` (``MXPS_PUSH=ltp``, ``MXPS_LTP_FILL``), at
every ``--losses`` percentage (default 0, 1, 5, 10).  The loss is injected by the sender
(``MXPS_LTP_DROP``: each DATA packet is dropped at random, as a lossy network would, with its
own generator seeded by ``MXPS_LTP_SEED``); control, ENDs, pulls and slices smaller than
``--min-bytes`` go by TCP and lose nothing.  ``--min-bytes`` defaults to 1024 (the runtime's
default is 64 KB, larger than most gradients of these small models) and ``--mtu`` to 1500, so a
slice is many packets on loopback as on Ethernet; the share of the gradient bytes that is
lossy is reported per model (``lossy_bytes``).  Seed s (``--seeds``, default 1, 2, 3) sets the
initial weights, every epoch's shuffling (``DIGITS_SEED``) and the drops (``MXPS_LTP_SEED``),
the same for every system: runs of one seed differ only by the transport.

Output in ``--out``: ``study.json`` (the settings; a later run into the same directory must
have the same, and skips the runs already recorded, so an interrupted grid resumes),
``runs.jsonl`` (one record per run: accuracy per epoch, the servers' LTP reports as written
under ``MXPS_METRICS``, seconds; a failed run's record has ``error``), ``runs/<name>/`` (the
job's outputs and logs), ``summary.json`` and ``table.md``, and the plot (``--plot``, default
``<out>/ltp_accuracy.png``: accuracy vs loss per model, TCP as a band, both fillings).
``--json`` also writes a compact copy (settings, summary, per-run accuracy and delivery) fit
for docs/bench.

The summary, per (model, system, loss): mean, min, max and standard deviation of the final
test accuracy over seeds; the gap of the mean to TCP's mean (percentage points) and the range
of the per-seed gaps (each LTP run against TCP's run of the same seed); the fraction of packets
delivered and why rounds closed (every server's report summed); whether the issue's target
holds (``TARGETS``: mean at most 0.5 pp below TCP at 1% and 5% loss, 1 pp at 10%); and, per
model and over all, which filling has the higher mean accuracy over the lossy points.  A run
that fails is recorded and left out of the summary, which lists it; the command then exits 1.
Targets missed are results, not failures.

The runtime under study: by default (``--runtime snapshot``) the study copies the installed
``mxps`` package (an editable install's checkout, compiled kernels included) into
``<out>/runtime`` when it first starts and every job imports it from there (``PYTHONPATH``):
edits to the checkout during a study of an hour, by its author or anyone else, change nothing,
and a resumed study goes on with the same code.  Its fingerprint (SHA-256 of every file) is in
``study.json`` and every worker reports the ``mxps`` it imported, which must be the snapshot's.
``--runtime installed``: the jobs import ``mxps`` as installed (as ``mxps_tools.jobs`` does for
the tests).

Every job's nodes inherit this process's environment: other ``MXPS_*`` settings in it (an
acceptance ratio, a deadline) apply to every run and are recorded in ``study.json``.  The
study imports neither MXNet nor the runtime; it reads what the jobs wrote.
"""
import argparse
import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import shutil
import sys
import time
from typing import Dict, List, Optional, Sequence

from . import jobs

SYSTEMS = ("tcp", "ltp-rescale", "ltp-zero")
MODELS = ("mlp", "cnn")
DEFAULT_LOSSES = (0.0, 1.0, 5.0, 10.0)
DEFAULT_SEEDS = (1, 2, 3)
#: loss % -> how far (percentage points) LTP's mean may fall below TCP's
TARGETS = {1.0: 0.5, 5.0: 0.5, 10.0: 1.0}
DEFAULT_JOB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "tests", "jobs", "digits_job.py")
#: the settings a resumed study must share with the runs already recorded
SETTING_KEYS = ("workers", "servers", "epochs", "batch", "lr", "mtu", "min_bytes")
TAIL_CHARS = 2000
#: what every run sets itself (and the secret, never recorded): not "inherited"
OWN_VARIABLES = ("MXPS_PUSH", "MXPS_METRICS", "MXPS_LTP_FILL", "MXPS_LTP_DROP", "MXPS_LTP_SEED",
                 "MXPS_LTP_MTU", "MXPS_LTP_MIN_BYTES", "MXPS_SECRET")


class StudyError(RuntimeError):
    """A run's outputs are missing or inconsistent, or the study cannot go on as asked."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """What every run of a study shares (the defaults are the issue's: 8 workers, 1 server,
    and a schedule that converges on digits over TCP)."""
    workers: int = 8
    servers: int = 1
    epochs: int = 20
    batch: int = 16
    lr: float = 0.03
    mtu: int = 1500
    min_bytes: int = 1024
    timeout: float = 300.0
    job: str = DEFAULT_JOB
    runtime: str = ""       # a directory holding a snapshot of the mxps package, or "" (installed)

    def recorded(self) -> dict:
        return {k: getattr(self, k) for k in SETTING_KEYS}


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One job of the grid."""
    model: str
    system: str
    loss: float          # percent of DATA packets dropped (LTP only)
    seed: int

    @property
    def name(self) -> str:
        return "%s-%s-loss%g-seed%d" % (self.model, self.system, self.loss, self.seed)

    @property
    def push(self) -> str:
        return "tcp" if self.system == "tcp" else "ltp"

    @property
    def fill(self) -> Optional[str]:
        return self.system.split("-", 1)[1] if self.push == "ltp" else None


def grid(models: Sequence[str], systems: Sequence[str], losses: Sequence[float],
         seeds: Sequence[int]) -> List[RunSpec]:
    """Every run, seed by seed (a partial grid has whole seeds), TCP at loss 0 only."""
    specs = []
    for seed in seeds:
        for model in models:
            for system in systems:
                for loss in ([0.0] if system == "tcp" else losses):
                    specs.append(RunSpec(model, system, float(loss), seed))
    return specs


def run_env(spec: RunSpec, st: Settings, run_dir: str) -> Dict[str, str]:
    """The variables of one job (on top of this process's environment)."""
    env = {"DIGITS_OUT": run_dir, "DIGITS_MODEL": spec.model, "DIGITS_EPOCHS": st.epochs,
           "DIGITS_BATCH": st.batch, "DIGITS_LR": st.lr, "DIGITS_SEED": spec.seed,
           "DIGITS_KVSTORE": "mxps", "MXPS_PUSH": spec.push,
           "MXPS_METRICS": os.path.join(run_dir, "metrics")}
    if st.runtime:
        env["PYTHONPATH"] = os.pathsep.join(
            [st.runtime] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    if spec.push == "ltp":
        env.update({"MXPS_LTP_FILL": spec.fill, "MXPS_LTP_DROP": "%.6g" % (spec.loss / 100.0),
                    "MXPS_LTP_SEED": spec.seed, "MXPS_LTP_MTU": st.mtu,
                    "MXPS_LTP_MIN_BYTES": st.min_bytes})
    return {k: str(v) for k, v in env.items()}


def lossy_bytes(params: Dict[str, dict], min_bytes: int) -> float:
    """The share of a step's gradient bytes in keys of at least ``min_bytes`` (those go by
    LTP; a key is one slice as long as MXNet's big-array bound does not cut it, true of these
    models)."""
    total = sum(p["bytes"] for p in params.values())
    return sum(p["bytes"] for p in params.values() if p["bytes"] >= min_bytes) / total


# --------------------------------------------------------------------------- one run

def installed_runtime() -> str:
    """The directory of the installed ``mxps`` package, found without importing it (importing
    it in a shell with a job's ``DMLC_ROLE`` would take that role)."""
    spec = importlib.util.find_spec("mxps")
    if spec is None or not spec.submodule_search_locations:
        raise StudyError("mxps is not installed (pip install -e . in the checkout)")
    return list(spec.submodule_search_locations)[0]


def fingerprint(package_dir: str) -> str:
    """SHA-256 of every file of a package (relative paths and contents; caches left out)."""
    h = hashlib.sha256()
    for root, dirs, files in os.walk(package_dir):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(f for f in files if not f.endswith(".pyc")):
            path = os.path.join(root, name)
            h.update(os.path.relpath(path, package_dir).encode() + b"\0")
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def snapshot_runtime(out: str) -> str:
    """``<out>/runtime`` holding a copy of the installed mxps package (made once: a resumed
    study keeps the copy it started with).  Returns the directory to put on PYTHONPATH."""
    root = os.path.join(out, "runtime")
    if not os.path.isdir(os.path.join(root, "mxps")):
        tmp = root + ".tmp"
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
        shutil.copytree(installed_runtime(), os.path.join(tmp, "mxps"),
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        os.replace(tmp, root)
    return root


def read_ranks(run_dir: str, workers: int, runtime: str = "") -> List[dict]:
    """Every worker's rank<R>.json; they must have trained one model together (with the
    snapshot of the runtime at ``runtime``, if given)."""
    out = []
    for r in range(workers):
        path = os.path.join(run_dir, "rank%d.json" % r)
        try:
            with open(path) as f:
                out.append(json.load(f))
        except (OSError, ValueError) as e:
            raise StudyError("worker rank %d left no result (%s): %s" % (r, path, e)) from None
    for d in out:
        if d["num_workers"] != workers:
            raise StudyError("rank %d saw %d workers, the job had %d"
                             % (d["rank"], d["num_workers"], workers))
        if runtime and not os.path.realpath(d.get("mxps_file") or "").startswith(
                os.path.realpath(runtime) + os.sep):
            raise StudyError("rank %d imported mxps from %s, not from the study's snapshot %s"
                             % (d["rank"], d.get("mxps_file"), runtime))
    digests = {d["weights_sha256"] for d in out}
    if len(digests) != 1:
        raise StudyError("the workers ended with different weights (%d distinct digests): "
                         "they did not train one model" % len(digests))
    return out


def read_ltp_reports(run_dir: str, servers: int) -> List[dict]:
    """Each server's LTP report (``<MXPS_METRICS>.server<r>.ltp.json``)."""
    out = []
    for r in range(servers):
        path = os.path.join(run_dir, "metrics.server%d.ltp.json" % r)
        try:
            with open(path) as f:
                out.append(json.load(f))
        except (OSError, ValueError) as e:
            raise StudyError("server %d wrote no LTP report (%s): %s" % (r, path, e)) from None
    return out


def ltp_summary(reports: List[dict]) -> dict:
    """The servers' reports summed: rounds, why they closed, packets expected / received, the
    delivered fraction, late packets dropped, the servers' loss estimates."""
    stats: Dict[str, int] = {}
    for rep in reports:
        for k, v in rep["stats"].items():
            stats[k] = stats.get(k, 0) + v
    expected = stats.get("packets_expected", 0)
    estimates = [x for rep in reports for x in (rep.get("loss_estimate") or [])]
    return {"rounds": stats.get("rounds", 0),
            "close": {k[len("close_"):]: v for k, v in sorted(stats.items())
                      if k.startswith("close_")},
            "packets_expected": expected, "packets_received": stats.get("packets_received", 0),
            "delivered": stats.get("packets_received", 0) / expected if expected else None,
            "packets_nobody": stats.get("packets_nobody", 0),
            "late_dropped": stats.get("drop_late", 0),
            "loss_estimate": sum(estimates) / len(estimates) if estimates else None}


def run_one(spec: RunSpec, st: Settings, run_dir: str) -> dict:
    """Run one job to completion and return its record (``error`` set if it failed)."""
    if os.path.exists(run_dir):
        shutil.rmtree(run_dir)          # an interrupted attempt's leftovers
    os.makedirs(run_dir)
    record = dict(dataclasses.asdict(spec), name=spec.name, push=spec.push, fill=spec.fill)
    job = jobs.Job([st.job], st.workers, st.servers, env=run_env(spec, st, run_dir),
                   timeout=st.timeout, log_dir=os.path.join(run_dir, "logs"),
                   cpu_interval=None)
    result = job.run()
    record["wall_seconds"] = round(result.wall_seconds, 2)
    if not result.ok:
        record["error"] = result.describe()[-TAIL_CHARS:]
        return record
    try:
        ranks = read_ranks(run_dir, st.workers, st.runtime)
        reports = read_ltp_reports(run_dir, st.servers) if spec.push == "ltp" else []
    except StudyError as e:
        record["error"] = str(e)
        return record
    r0 = ranks[0]
    record.update(accuracy=r0["final_accuracy"], curve=r0["test_accuracy"],
                  train_loss=r0["train_loss"], test_samples=r0["test_samples"],
                  kvstore_type=r0["kvstore_type"], update_on_kvstore=r0["update_on_kvstore"],
                  mxps_file=r0.get("mxps_file"),
                  lossy_bytes=lossy_bytes(r0["params"], st.min_bytes),
                  train_seconds=round(max(d["train_seconds"] for d in ranks), 2),
                  ltp=ltp_summary(reports) if reports else None, ltp_reports=reports)
    return record


# --------------------------------------------------------------------------- the summary

def _mean(xs):
    return sum(xs) / len(xs)


def _std(xs):
    """Sample standard deviation (0 for one value)."""
    if len(xs) < 2:
        return 0.0
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def summarise(records: List[dict], targets: Dict[float, float] = TARGETS) -> dict:
    """Rows per (model, system, loss) with the gap to TCP and the targets; the better filling
    per model and over all; the failed runs.  Accuracies in percent."""
    ok = [r for r in records if "error" not in r]
    groups: Dict[tuple, List[dict]] = {}
    for r in ok:
        groups.setdefault((r["model"], r["system"], r["loss"]), []).append(r)
    tcp = {m: {r["seed"]: 100.0 * r["accuracy"] for r in rs}
           for (m, s, _), rs in groups.items() if s == "tcp"}
    rows = []
    def order(item):
        (model, system, loss), _ = item
        return (MODELS.index(model) if model in MODELS else len(MODELS), model,
                SYSTEMS.index(system) if system in SYSTEMS else len(SYSTEMS), system, loss)

    for (model, system, loss), rs in sorted(groups.items(), key=order):
        acc = [100.0 * r["accuracy"] for r in sorted(rs, key=lambda r: r["seed"])]
        row = {"model": model, "system": system, "loss": loss, "runs": len(rs),
               "seeds": sorted(r["seed"] for r in rs), "mean": _mean(acc), "min": min(acc),
               "max": max(acc), "std": _std(acc), "gap": None, "paired_gap_min": None,
               "paired_gap_max": None, "target_pp": None, "target_met": None,
               "delivered": None, "delivered_min": None, "close": None,
               "late_dropped": None}
        base = tcp.get(model)
        if system != "tcp" and base:
            row["gap"] = row["mean"] - _mean(list(base.values()))
            paired = [100.0 * r["accuracy"] - base[r["seed"]] for r in rs if r["seed"] in base]
            if paired:
                row["paired_gap_min"], row["paired_gap_max"] = min(paired), max(paired)
            if loss in targets:
                row["target_pp"] = targets[loss]
                row["target_met"] = row["gap"] >= -targets[loss]
        lt = [r["ltp"] for r in rs if r.get("ltp")]
        if lt:
            delivered = [x["delivered"] for x in lt if x["delivered"] is not None]
            row["delivered"], row["delivered_min"] = _mean(delivered), min(delivered)
            close: Dict[str, int] = {}
            for x in lt:
                for k, v in x["close"].items():
                    close[k] = close.get(k, 0) + v
            row["close"] = close
            row["late_dropped"] = sum(x["late_dropped"] for x in lt)
        rows.append(row)
    return {"rows": rows, "fills": compare_fills(rows),
            "lossy_bytes": {r["model"]: r["lossy_bytes"] for r in ok if "lossy_bytes" in r},
            "failed": sorted(r["name"] for r in records if "error" in r)}


def compare_fills(rows: List[dict]) -> dict:
    """Mean accuracy over the lossy points (loss > 0) of each filling, per model and over all
    models (only points that every filling has), and which is higher."""
    fills = sorted({r["system"] for r in rows if r["system"].startswith("ltp-")})
    out = {}
    for model in sorted({r["model"] for r in rows}) + [None]:
        pts = {}
        for r in rows:
            if r["system"] in fills and r["loss"] > 0 and (model is None or r["model"] == model):
                pts.setdefault((r["model"], r["loss"]), {})[r["system"]] = r["mean"]
        common = [p for p in pts.values() if len(p) == len(fills)]
        if not common or len(fills) < 2:
            continue
        means = {f: _mean([p[f] for p in common]) for f in fills}
        best = max(means, key=means.get)
        out[model or "all"] = {"points": len(common), "mean": means, "better": best,
                               "margin_pp": means[best] - min(means.values())}
    return out


def _pct(x, digits=2):
    return "-" if x is None else "%.*f" % (digits, x)


def format_table(summary: dict) -> str:
    """The summary as a Markdown table (accuracy in %, gaps in percentage points)."""
    lines = ["| model | system | loss % | runs | mean acc % | min-max % | gap to TCP pp "
             "(per-seed range) | delivered: mean (min) | rounds closed by | target |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        gap = "-" if r["gap"] is None else "%+.2f (%+.2f..%+.2f)" % (
            r["gap"], r["paired_gap_min"], r["paired_gap_max"])
        target = "-" if r["target_met"] is None else "%s (>= -%.1f)" % (
            "met" if r["target_met"] else "MISSED", r["target_pp"])
        close = "-" if not r["close"] else ", ".join(
            "%s %d" % kv for kv in sorted(r["close"].items(), key=lambda kv: -kv[1]))
        lines.append("| %s | %s | %g | %d | %s | %s-%s | %s | %s | %s | %s |" % (
            r["model"], r["system"], r["loss"], r["runs"], _pct(r["mean"]), _pct(r["min"]),
            _pct(r["max"]), gap, "-" if r["delivered"] is None else "%.2f%% (%.2f%%)" % (
                100 * r["delivered"], 100 * r["delivered_min"]), close, target))
    for key, f in summary["fills"].items():
        lines.append("")
        lines.append("Fillings, %s (%d lossy points): %s; higher: %s by %.2f pp" % (
            key, f["points"], ", ".join("%s %.2f%%" % kv for kv in sorted(f["mean"].items())),
            f["better"], f["margin_pp"]))
    if summary["lossy_bytes"]:
        lines.append("")
        lines.append("Share of gradient bytes pushed by LTP: %s" % ", ".join(
            "%s %.1f%%" % (m, 100 * v) for m, v in sorted(summary["lossy_bytes"].items())))
    if summary["failed"]:
        lines.append("")
        lines.append("FAILED runs (left out): %s" % ", ".join(summary["failed"]))
    return "\n".join(lines)


# --------------------------------------------------------------------------- the plot

def sample_note(records: List[dict]) -> str:
    """What one test sample is worth, in percentage points (the resolution of an accuracy)."""
    n = {r["test_samples"] for r in records if r.get("test_samples")}
    return "one test sample = %.2f pp" % (100.0 / min(n)) if n else ""


def plot(summary: dict, path: str, title: str = "") -> str:
    """Final test accuracy vs injected loss, one panel per model: TCP's seeds as a band (min
    to max) around its mean, each filling's mean with min-max bars, the target floors."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["rows"]
    models = [m for m in MODELS if any(r["model"] == m for r in rows)] + sorted(
        {r["model"] for r in rows} - set(MODELS))
    if not models:
        raise StudyError("nothing to plot: no run succeeded")
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4.2), squeeze=False)
    styles = {"ltp-rescale": ("tab:blue", "o", -0.15), "ltp-zero": ("tab:orange", "s", 0.15)}
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model]
        losses = sorted({r["loss"] for r in mine if r["system"] != "tcp"}) or [0.0]
        tcp = next((r for r in mine if r["system"] == "tcp"), None)
        if tcp is not None:
            ax.axhspan(tcp["min"], tcp["max"], color="0.85",
                       label="TCP, min-max of %d seeds" % tcp["runs"])
            ax.axhline(tcp["mean"], color="0.4", linewidth=1.2, label="TCP mean")
            floors = [(x, tcp["mean"] - TARGETS[x]) for x in losses if x in TARGETS]
            for i, (x, y) in enumerate(floors):
                ax.hlines(y, x - 0.45, x + 0.45, colors="red", linestyles="dotted",
                          label="target floor" if i == 0 else None)
        for system in [s for s in SYSTEMS if s != "tcp"] + sorted(
                {r["system"] for r in mine} - set(SYSTEMS)):
            pts = sorted((r for r in mine if r["system"] == system), key=lambda r: r["loss"])
            if not pts:
                continue
            color, marker, dx = styles.get(system, ("tab:green", "^", 0.0))
            ax.errorbar([r["loss"] + dx for r in pts], [r["mean"] for r in pts],
                        yerr=[[r["mean"] - r["min"] for r in pts],
                              [r["max"] - r["mean"] for r in pts]],
                        color=color, marker=marker, capsize=3, linewidth=1.2,
                        label="%s (mean, min-max)" % system)
        ax.set_xticks(losses)
        ax.set_xlim(min(losses) - 1, max(losses) + 1)
        ax.set_xlabel("packets dropped at random (%)")
        ax.set_ylabel("final test accuracy (%)")
        ax.set_title(model)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower left")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- the study

def load_records(path: str) -> List[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def prepare(out: str, st: Settings, inherited: Dict[str, str], runtime: dict) -> None:
    """Write ``study.json``, or check that the one there has the same settings."""
    path = os.path.join(out, "study.json")
    mine = {"settings": st.recorded(), "inherited": inherited, "runtime": runtime}
    if os.path.exists(path):
        with open(path) as f:
            theirs = json.load(f)
        if theirs != mine:
            diff = sorted(k for k in set(theirs) | set(mine) if theirs.get(k) != mine.get(k))
            raise StudyError("%s holds a study with other settings (%s: %s, now %s); use "
                             "another --out" % (path, ", ".join(diff),
                                                {k: theirs.get(k) for k in diff},
                                                {k: mine.get(k) for k in diff}))
        return
    os.makedirs(out, exist_ok=True)
    with open(path, "w") as f:
        json.dump(mine, f, indent=1)


def _rounded(x, digits=4):
    if isinstance(x, float):
        return round(x, digits)
    if isinstance(x, dict):
        return {k: _rounded(v, digits) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v, digits) for v in x]
    return x


def compact(records: List[dict]) -> List[dict]:
    """What docs/bench keeps of each run (numbers to 4 decimals)."""
    keep = ("name", "model", "system", "loss", "seed", "accuracy", "curve", "wall_seconds",
            "train_seconds", "ltp", "error")
    out = []
    for r in records:
        c = _rounded({k: r[k] for k in keep if k in r})
        if "error" in c:
            c["error"] = c["error"][-300:]
        out.append(c)
    return out


def write_compact(path: str, head: dict, records: List[dict]) -> None:
    """``head`` (indented) and one line per run: small, and a diff shows which runs changed."""
    text = json.dumps(_rounded(head), indent=1)
    runs = ",\n  ".join(json.dumps(r) for r in compact(records))
    with open(path, "w") as f:
        f.write(text[:-2] + ',\n "runs": [\n  %s\n ]\n}\n' % runs)


def run_study(out: str, specs: List[RunSpec], st: Settings, retry_failed: bool = False,
              log=print) -> List[dict]:
    """Run every spec not recorded yet in ``<out>/runs.jsonl``, strictly one at a time;
    returns the records of ``specs`` (earlier ones included)."""
    path = os.path.join(out, "runs.jsonl")
    done = {r["name"]: r for r in load_records(path)}
    if retry_failed:
        done = {k: r for k, r in done.items() if "error" not in r}
    todo = [s for s in specs if s.name not in done]
    log("%d runs (%d recorded already), %d workers, %d server(s)" % (
        len(specs), len(specs) - len(todo), st.workers, st.servers))
    for i, spec in enumerate(todo, 1):
        t0 = time.monotonic()
        rec = run_one(spec, st, os.path.join(out, "runs", spec.name))
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        done[spec.name] = rec
        if "error" in rec:
            log("[%d/%d] %s FAILED: %s" % (i, len(todo), spec.name,
                                           rec["error"].splitlines()[0]))
        else:
            lt = rec["ltp"]
            log("[%d/%d] %s: %.2f%%%s (%.0f s)" % (
                i, len(todo), spec.name, 100 * rec["accuracy"],
                "" if not lt else ", %.2f%% delivered, closed %s" % (
                    100 * lt["delivered"], lt["close"]), time.monotonic() - t0))
    return [done[s.name] for s in specs]


def csv(kind):
    """An argparse type: a comma-separated list of ``kind`` (shared by the studies)."""
    return lambda text: [kind(x) for x in text.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser):
    d = Settings()
    p.add_argument("--out", required=True, help="directory of the study (resumed if present)")
    p.add_argument("--models", type=csv(str), default=list(MODELS),
                   help="comma-separated, from %s (default all)" % ", ".join(MODELS))
    p.add_argument("--systems", type=csv(str), default=list(SYSTEMS),
                   help="comma-separated, from %s (default all)" % ", ".join(SYSTEMS))
    p.add_argument("--losses", type=csv(float), default=list(DEFAULT_LOSSES),
                   help="percent of DATA packets dropped (default 0,1,5,10)")
    p.add_argument("--seeds", type=csv(int), default=list(DEFAULT_SEEDS))
    p.add_argument("--workers", type=int, default=d.workers)
    p.add_argument("--servers", type=int, default=d.servers)
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--batch", type=int, default=d.batch, help="samples per worker per step")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--mtu", type=int, default=d.mtu, help="MXPS_LTP_MTU")
    p.add_argument("--min-bytes", type=int, default=d.min_bytes, help="MXPS_LTP_MIN_BYTES")
    p.add_argument("--timeout", type=float, default=d.timeout, help="seconds per job")
    p.add_argument("--job", default=d.job, help="the training job script")
    p.add_argument("--runtime", choices=("snapshot", "installed"), default="snapshot",
                   help="snapshot (default): the jobs import a copy of mxps made in <out> when "
                        "the study starts; installed: mxps as installed")
    p.add_argument("--retry-failed", action="store_true",
                   help="run again the runs recorded as failed")
    p.add_argument("--plot", help="the PNG (default <out>/ltp_accuracy.png)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--json", help="also write the compact results here (for docs/bench)")


def check(p: argparse.ArgumentParser, args) -> Settings:
    """Settings from the arguments; a bad one ends the command naming it."""
    for name, allowed in (("models", MODELS), ("systems", SYSTEMS)):
        bad = [x for x in getattr(args, name) if x not in allowed]
        if bad or not getattr(args, name):
            p.error("--%s: %s not among %s" % (name, ", ".join(bad) or "none given",
                                                 ", ".join(allowed)))
    if not args.losses or any(not 0 <= x < 100 for x in args.losses):
        p.error("--losses: percentages in [0, 100), got %s" % args.losses)
    if not args.seeds or len(set(args.seeds)) != len(args.seeds) or min(args.seeds) < 0:
        p.error("--seeds: distinct non-negative integers, got %s" % args.seeds)
    for name in ("workers", "servers", "epochs", "batch"):
        if getattr(args, name) < 1:
            p.error("--%s must be at least 1, got %d" % (name, getattr(args, name)))
    if not os.path.isfile(args.job):
        p.error("--job %s: no such file (the default is tests/jobs/digits_job.py of a source "
                "checkout)" % args.job)
    if not args.no_plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            p.error("the plot needs matplotlib (pip install matplotlib), or pass --no-plot")
    return Settings(args.workers, args.servers, args.epochs, args.batch, args.lr, args.mtu,
                    args.min_bytes, args.timeout, os.path.abspath(args.job))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mxps_tools.study_ltp",
                                description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p, p.parse_args(argv))


def run(p: argparse.ArgumentParser, args) -> int:
    """The study of ``args`` (parsed by a parser that ``add_arguments`` filled: ``p``, which
    reports bad arguments).  Returns the exit code: 1 if a run failed."""
    st = check(p, args)
    out = os.path.abspath(args.out)
    inherited = {k: v for k, v in sorted(os.environ.items())
                 if k.startswith("MXPS_") and k not in OWN_VARIABLES}
    try:
        if args.runtime == "snapshot":
            os.makedirs(out, exist_ok=True)
            st = dataclasses.replace(st, runtime=snapshot_runtime(out))
            runtime = {"mode": "snapshot",
                       "fingerprint": fingerprint(os.path.join(st.runtime, "mxps"))}
        else:
            runtime = {"mode": "installed", "path": installed_runtime()}
        prepare(out, st, inherited, runtime)
    except StudyError as e:
        p.error(str(e))
    specs = grid(args.models, args.systems, args.losses, args.seeds)
    records = run_study(out, specs, st, args.retry_failed)
    summary = summarise(records)
    table = format_table(summary)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    if not args.no_plot and summary["rows"]:
        print(plot(summary, args.plot or os.path.join(out, "ltp_accuracy.png"),
                   "%d workers, %d server(s), %d epochs, LTP slices >= %d B, MTU %d; %s" % (
                       st.workers, st.servers, st.epochs, st.min_bytes, st.mtu,
                       sample_note(records))))
    if args.json:
        write_compact(args.json, {
            "settings": st.recorded(), "inherited": inherited, "runtime": runtime,
            "models": args.models, "systems": args.systems, "losses": args.losses,
            "seeds": args.seeds, "targets_pp": {"%g" % k: v for k, v in TARGETS.items()},
            "summary": summary}, records)
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
