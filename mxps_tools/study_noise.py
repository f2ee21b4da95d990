"""The label-noise scalability study: ``mxps study noise``.

    flock /tmp/mxps-bench.lock mxps study noise --out /tmp/noise-study
    mxps study noise --quick --out /tmp/noise-quick

reruns, on MXNet + mxps, the seed study of label noise in distributed training: for every
dataset, noise kind and ratio, consistency, number of workers, ``--sync-every`` and seed, one
real parameter-server job on loopback (a scheduler, ``--servers`` servers and W workers, one
process each, ``mxps_tools.jobs``) running ``mxps_tools.noise_job`` (its docstring: the
sharding, the models, local SGD for ``--sync-every`` > 1, how bytes are counted), one job at a
time.  The noise (``mxps_tools.noise``: cross-noise pairs classes, random noise replaces labels
by a different class) applies to the training labels only; the test split stays clean.

The grid: kinds x ratios, where ratio 0 is one clean run (``none``) and ``cross`` / ``random``
run at every ratio above 0; consistency ``sync`` (kvstore ``mxps``), ``async``
(``mxps_async``), ``wsp`` (``mxps_wsp``); workers (default 1, 2, 4, 8; 1 is still one worker
and a server); ``--sync-every`` (default 1; k > 1 is local SGD with model averaging every k
steps, sync only: async and WSP cells are run at k = 1 only); seeds.  Seed s sets the initial
weights, the shuffling and which labels the noise moves; the cross pairing is fixed for the
whole study (``--pair-seed``).  Datasets: scikit-learn's digits (model ``--digits-model``,
default the MLP); MNIST and CIFAR-10 when their files are under ``--data-root`` (MXNet's
``gluon.data.vision`` layout, default ``~/.mxnet/datasets``; nothing is downloaded, an absent
one is reported and left out) with SqueezeNet 1.1 from scratch.

A run's time to target is the first epoch end at which worker 0's test accuracy reached
``--target``, in seconds of worker 0's training (evaluation excluded); the speedup of W workers
is T(1) / T(W), the mean times to target over seeds of the same dataset, kind, ratio,
consistency and k (none when a side never reached it).  Bytes moved: the kvstore bytes every
worker pushed and pulled, summed over workers.

Output in ``--out``: ``runs.jsonl`` (one record per run: settings, accuracy per epoch, wall
time, steps, bytes; a failed run has ``error``; a rerun into the same directory skips the runs
recorded, ``--retry-failed`` reruns failed ones), ``runs/<name>/`` (the job's files and logs),
``summary.json``, ``<dataset>.md`` (per dataset: test accuracy vs kind and ratio; time to
target vs workers; speedup vs workers) and ``<dataset>_accuracy.png`` (final accuracy vs ratio,
one panel per consistency, a line per kind and W) and ``<dataset>_speedup.png`` (speedup vs
workers, one panel per kind, a line per ratio).  The study imports neither MXNet nor the
runtime; the jobs import ``mxps`` as installed.
"""
import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
from typing import List, Optional

from . import jobs, noise
from .study_ltp import StudyError, csv, load_records, prepare
from .study_wsp import _stats, time_to

CONSISTENCY = {"sync": "mxps", "async": "mxps_async", "wsp": "mxps_wsp"}
DEFAULT_RATIOS = (0.0, 10.0, 20.0, 40.0)
DEFAULT_WORKERS = (1, 2, 4, 8)
DEFAULT_SEEDS = (1, 2, 3)
IMAGE_MODEL = "squeezenet"
TAIL_CHARS = 2000
#: --quick: a grid that ends in a few minutes on 2 cores (docs/NOISE.md has its timing)
QUICK = {"kinds": ["none", "cross", "random"], "ratios": [0.0, 40.0], "consistency": ["sync"],
         "workers": [1, 2], "sync_every": [1, 4], "seeds": [1], "epochs": 5,
         "datasets": ["digits"]}


@dataclasses.dataclass(frozen=True)
class Settings:
    """What every run of a study shares."""
    servers: int = 1
    epochs: int = 10
    batch: int = 16
    lr: float = 0.02
    momentum: float = 0.9
    target: float = 0.85
    pair_seed: int = 0
    digits_model: str = "mlp"
    data_root: Optional[str] = None
    limit: int = 0
    timeout: float = 600.0

    def recorded(self) -> dict:
        """What a resumed study must share with the runs already recorded (the target and
        the timeout only change the summary and the patience)."""
        return {k: v for k, v in dataclasses.asdict(self).items()
                if k not in ("target", "timeout")}


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One job of the grid (ratio in percent)."""
    dataset: str
    kind: str
    ratio: float
    consistency: str
    workers: int
    sync_every: int
    seed: int

    @property
    def name(self) -> str:
        return "%s-%s%g-%s-k%d-w%d-seed%d" % (self.dataset, self.kind, self.ratio,
                                              self.consistency, self.sync_every, self.workers,
                                              self.seed)


def grid(datasets, kinds, ratios, consistency, workers, sync_every, seeds) -> List[RunSpec]:
    """Every run, seed by seed: ratio 0 once (kind none), cross/random above 0; k > 1 with
    sync only."""
    cells = [("none", 0.0)] if "none" in kinds and 0 in ratios else []
    cells += [(k, float(r)) for k in kinds if k != "none" for r in ratios if r > 0]
    return [RunSpec(d, k, r, c, w, s, seed) for seed in seeds for d in datasets
            for (k, r) in cells for c in consistency for s in sync_every
            if s == 1 or c == "sync" for w in workers]


def model_of(dataset: str, st: Settings) -> str:
    return st.digits_model if dataset == "digits" else IMAGE_MODEL


def job_argv(spec: RunSpec, st: Settings, run_dir: str) -> List[str]:
    argv = ["-m", "mxps_tools.noise_job", "--out", run_dir, "--kvstore",
            CONSISTENCY[spec.consistency], "--dataset", spec.dataset,
            "--model", model_of(spec.dataset, st), "--kind", spec.kind,
            "--ratio", "%.6g" % (spec.ratio / 100.0), "--noise-seed", spec.seed,
            "--pair-seed", st.pair_seed, "--seed", spec.seed, "--epochs", st.epochs,
            "--batch", st.batch, "--lr", st.lr, "--momentum", st.momentum,
            "--sync-every", spec.sync_every, "--limit", st.limit]
    if st.data_root:
        argv += ["--data-root", st.data_root]
    return [str(a) for a in argv]


def read_ranks(run_dir: str, spec: RunSpec) -> List[dict]:
    """Every worker's rank<R>.json; a synchronous run's workers must end with one model."""
    out = []
    for r in range(spec.workers):
        path = os.path.join(run_dir, "rank%d.json" % r)
        try:
            with open(path) as f:
                out.append(json.load(f))
        except (OSError, ValueError) as e:
            raise StudyError("worker rank %d left no result (%s): %s" % (r, path, e)) from None
    if spec.consistency == "sync" and len({d["weights_sha256"] for d in out}) != 1:
        raise StudyError("the workers of a synchronous run ended with different weights")
    return out


def run_one(spec: RunSpec, st: Settings, run_dir: str) -> dict:
    """Run one job to completion and return its record (``error`` set if it failed)."""
    if os.path.exists(run_dir):
        shutil.rmtree(run_dir)          # an interrupted attempt's leftovers
    os.makedirs(run_dir)
    rec = dict(dataclasses.asdict(spec), name=spec.name, model=model_of(spec.dataset, st),
               epochs=st.epochs, batch=st.batch, lr=st.lr, servers=st.servers,
               target=st.target)
    result = jobs.Job(job_argv(spec, st, run_dir), spec.workers, st.servers,
                      timeout=st.timeout, log_dir=os.path.join(run_dir, "logs"),
                      cpu_interval=None).run()
    rec["wall_seconds"] = round(result.wall_seconds, 2)
    if not result.ok:
        # the first line (why, and where the logs are: on a timeout, every node's stderr ends
        # with its threads' stacks) and the tail of the failed node's stderr
        text = result.describe()
        head = text.split("\n", 1)[0]
        tail = text[-TAIL_CHARS:]
        rec["error"] = tail if tail.startswith(head) else head + "\n...\n" + tail
        return rec
    try:
        ranks = read_ranks(run_dir, spec)
    except StudyError as e:
        rec["error"] = str(e)
        return rec
    w0 = ranks[0]
    rec.update(curve=w0["test_accuracy"], ends=w0["epoch_end_seconds"],
               final=w0["test_accuracy"][-1], train_seconds=w0["train_seconds"],
               train_loss=w0["train_loss"], steps=w0["steps"],
               steps_per_epoch=w0["steps_per_epoch"], averagings=w0["averagings"],
               changed_labels=w0["noise"]["changed"], train_samples=w0["train_samples"],
               bytes_pushed=sum(d["bytes_pushed"] for d in ranks),
               bytes_pulled=sum(d["bytes_pulled"] for d in ranks),
               kvstore_type=w0["kvstore_type"],
               time_to_target=time_to(w0["test_accuracy"], w0["epoch_end_seconds"], st.target))
    rec["bytes_moved"] = rec["bytes_pushed"] + rec["bytes_pulled"]
    return rec


# --------------------------------------------------------------------------- the summary

def _cell(r) -> tuple:
    return (r["dataset"], r["consistency"], r["sync_every"], r["kind"], r["ratio"])


def summarise(records: List[dict], target: float) -> dict:
    """Per (dataset, consistency, k, kind, ratio, workers): final accuracy, time to target,
    wall time and bytes over seeds; the speedup T(1) / T(W) of the mean times to target."""
    ok = [r for r in records if "error" not in r]
    rows = []
    for key in sorted({_cell(r) + (r["workers"],) for r in ok}):
        rs = [r for r in ok if _cell(r) + (r["workers"],) == key]
        rows.append(dict(zip(("dataset", "consistency", "sync_every", "kind", "ratio",
                              "workers"), key),
                         runs=len(rs), reached=sum(r["time_to_target"] is not None for r in rs),
                         final=_stats([r["final"] for r in rs]),
                         time_to_target=_stats([r["time_to_target"] for r in rs]),
                         wall=_stats([r["wall_seconds"] for r in rs]),
                         bytes_moved=_stats([r["bytes_moved"] for r in rs])))
    for row in rows:
        base = [x for x in rows if x["workers"] == 1 and _cell(x) == _cell(row)]
        t1 = base[0]["time_to_target"] if base else None
        tw = row["time_to_target"]
        row["speedup"] = t1["mean"] / tw["mean"] if t1 and tw and tw["mean"] > 0 else None
    return {"target": target, "rows": rows,
            "failed": [r["name"] for r in records if "error" in r]}


def _pct(s):
    return "%.1f (%.1f-%.1f)" % (100 * s["mean"], 100 * s["min"], 100 * s["max"]) if s else "-"


def _label(row):
    """A row's setting besides kind and ratio: consistency, k, W."""
    return "%s%s" % (row["consistency"], "" if row["sync_every"] == 1 else
                     ", k=%d" % row["sync_every"])


def _table(header, lines):
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] +
                     ["| " + " | ".join(x) + " |" for x in lines]) + "\n"


def format_tables(summary: dict, dataset: str) -> str:
    """The markdown of one dataset: accuracy vs kind and ratio (a column per workers count),
    time to target vs workers, speedup vs workers."""
    rows = [r for r in summary["rows"] if r["dataset"] == dataset]
    workers = sorted({r["workers"] for r in rows})
    cells = sorted({_cell(r) for r in rows},
                   key=lambda c: (list(CONSISTENCY).index(c[1]), c[2], c[4], c[3]))
    pick = {(_cell(r), r["workers"]): r for r in rows}
    acc, ttt, spd = [], [], []
    for c in cells:
        some = next(pick[(c, w)] for w in workers if (c, w) in pick)
        lead = [_label(some), c[3], "%g%%" % c[4]]
        got = [pick.get((c, w)) for w in workers]
        acc.append(lead + [_pct(r["final"]) if r else "" for r in got])
        ttt.append(lead + ["" if r is None else "never (0/%d)" % r["runs"]
                           if not r["time_to_target"] else "%.2f (%d/%d)" % (
                               r["time_to_target"]["mean"], r["reached"], r["runs"])
                           for r in got])
        spd.append(lead + ["" if r is None else "-" if r["speedup"] is None else
                           "%.2f" % r["speedup"] for r in got])
    head = ["consistency", "kind", "ratio"]
    w_head = ["W=%d" % w for w in workers]
    return ("## %s\n\nFinal test accuracy of worker 0, %% (mean, min-max over seeds):\n\n%s\n"
            "Seconds to %.0f%% test accuracy (mean over the seeds that reached it; reached/runs):"
            "\n\n%s\nSpeedup T(1) / T(W) of the mean times to target:\n\n%s" % (
                dataset, _table(head + w_head, acc), 100 * summary["target"],
                _table(head + w_head, ttt), _table(head + w_head, spd)))


def plot(summary: dict, dataset: str, out_dir: str) -> List[str]:
    """``<dataset>_accuracy.png`` and ``<dataset>_speedup.png``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in summary["rows"] if r["dataset"] == dataset]
    clean = {(r["consistency"], r["sync_every"], r["workers"]): r for r in rows
             if r["kind"] == "none"}
    groups = sorted({(r["consistency"], r["sync_every"]) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
    for ax, (cons, k) in zip(axes[0], groups):
        for kind, ls in (("cross", "-"), ("random", "--")):
            for i, w in enumerate(sorted({r["workers"] for r in rows})):
                pts = [r for r in rows if (r["consistency"], r["sync_every"], r["kind"],
                                           r["workers"]) == (cons, k, kind, w)]
                base = clean.get((cons, k, w))
                pts = ([base] if base else []) + sorted(pts, key=lambda r: r["ratio"])
                if pts and any(p["kind"] == kind for p in pts):
                    ax.plot([p["ratio"] for p in pts], [100 * p["final"]["mean"] for p in pts],
                            ls, color="C%d" % i, marker="o", label="%s, W=%d" % (kind, w))
        ax.set_title("%s%s" % (cons, "" if k == 1 else ", sync every %d" % k))
        ax.set_xlabel("noise ratio, % of training labels")
        ax.set_ylabel("final test accuracy, %")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    paths = [os.path.join(out_dir, "%s_accuracy.png" % dataset)]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)
    kinds = [k for k in noise.KINDS if any(r["kind"] == k for r in rows)]
    fig, axes = plt.subplots(1, len(kinds), figsize=(5 * len(kinds), 4), squeeze=False,
                             sharey=True)
    for ax, kind in zip(axes[0], kinds):
        for cell in sorted({_cell(r) for r in rows if r["kind"] == kind}):
            pts = sorted((r for r in rows if _cell(r) == cell and r["speedup"] is not None),
                         key=lambda r: r["workers"])
            if pts:
                ax.plot([p["workers"] for p in pts], [p["speedup"] for p in pts], marker="o",
                        label="%g%%, %s" % (cell[4], _label(pts[0])))
        ax.set_title("noise: %s" % kind)
        ax.set_xlabel("workers")
        ax.set_ylabel("speedup in time to %.0f%%" % (100 * summary["target"]))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no run reached the target", ha="center",
                    transform=ax.transAxes)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "%s_speedup.png" % dataset))
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths


# --------------------------------------------------------------------------- the study

def describe(rec: dict) -> str:
    if "error" in rec:
        return "FAILED: %s" % (rec["error"].strip().splitlines() or ["?"])[-1]
    t = rec["time_to_target"]
    return "final %.1f%%, %s to target, %.1f MB moved, wall %.1f s" % (
        100 * rec["final"], "never" if t is None else "%.2f s" % t, rec["bytes_moved"] / 1e6,
        rec["wall_seconds"])


def run_study(out: str, specs: List[RunSpec], st: Settings, retry_failed: bool = False,
              log=print) -> List[dict]:
    """Run every spec not recorded yet in ``<out>/runs.jsonl``, one at a time; returns the
    records of ``specs`` (earlier ones included)."""
    path = os.path.join(out, "runs.jsonl")
    done = {r["name"]: r for r in load_records(path)}
    if retry_failed:
        done = {k: r for k, r in done.items() if "error" not in r}
    todo = [s for s in specs if s.name not in done]
    log("%d runs (%d recorded already, %d to run), %d server(s), %d epochs"
        % (len(specs), len(specs) - len(todo), len(todo), st.servers, st.epochs))
    for i, spec in enumerate(todo, 1):
        rec = run_one(spec, st, os.path.join(out, "runs", spec.name))
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        done[spec.name] = rec
        log("run %d of %d: %s: %s" % (i, len(todo), spec.name, describe(rec)))
    return [done[s.name] for s in specs]


def add_arguments(p: argparse.ArgumentParser):
    d = Settings()
    p.add_argument("--out", required=True, help="directory of the study (resumed if present)")
    p.add_argument("--quick", action="store_true",
                   help="a small grid (digits; none, cross 40%%, random 40%%; sync, every "
                        "step and every 4; 1 and 2 workers; 1 seed; 5 epochs): a few minutes "
                        "on 2 cores; options given explicitly still apply")
    p.add_argument("--datasets", type=csv(str), default=None,
                   help="comma-separated from %s (default: digits and whichever of mnist, "
                        "cifar10 are present)" % ", ".join(noise.DATASETS))
    p.add_argument("--data-root", default=None,
                   help="MNIST / CIFAR-10 files in MXNet's layout (default ~/.mxnet/datasets)")
    p.add_argument("--kinds", type=csv(str), default=list(noise.KINDS))
    p.add_argument("--ratios", type=csv(float), default=list(DEFAULT_RATIOS),
                   help="percent of training labels (default 0,10,20,40)")
    p.add_argument("--consistency", type=csv(str), default=list(CONSISTENCY),
                   help="comma-separated from sync, async, wsp (default all)")
    p.add_argument("--workers", type=csv(int), default=list(DEFAULT_WORKERS))
    p.add_argument("--sync-every", type=csv(int), default=[1],
                   help="local steps between model averagings, e.g. 1,4 (k > 1: sync only)")
    p.add_argument("--seeds", type=csv(int), default=list(DEFAULT_SEEDS))
    p.add_argument("--servers", type=int, default=d.servers)
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--batch", type=int, default=d.batch, help="samples per worker per step")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--target", type=float, default=d.target, help="test accuracy, 0-1")
    p.add_argument("--pair-seed", type=int, default=d.pair_seed,
                   help="seed of the cross-noise class pairing (fixed for the study)")
    p.add_argument("--digits-model", choices=("mlp", "cnn"), default=d.digits_model)
    p.add_argument("--limit", type=int, default=d.limit,
                   help="MNIST/CIFAR-10: first N training and test samples (0: all)")
    p.add_argument("--timeout", type=float, default=d.timeout, help="seconds per job")
    p.add_argument("--retry-failed", action="store_true")
    p.add_argument("--no-plot", action="store_true")


def pick_datasets(p, args, log=print) -> List[str]:
    """The datasets asked for (default: digits and whatever of MNIST / CIFAR-10 is present);
    one asked for but absent is reported and left out (digits instead if none is left)."""
    asked = args.datasets or list(noise.DATASETS)
    bad = [x for x in asked if x not in noise.DATASETS]
    if bad:
        p.error("--datasets: %s not among %s" % (", ".join(bad), ", ".join(noise.DATASETS)))
    got = []
    for name in asked:
        if noise.locate(name, args.data_root) is not None:
            got.append(name)
        else:
            log("dataset %s: no files under %s (nothing is downloaded): left out" % (
                name, " or ".join(noise._dataset_dirs(name, args.data_root))))
    if not got:
        log("no dataset asked for is present: using digits")
        got = ["digits"]
    return got


def check(p: argparse.ArgumentParser, args) -> Settings:
    """Settings from the arguments; a bad one ends the command naming it."""
    if args.quick:                      # the quick grid, where the command line left defaults
        for k, v in QUICK.items():
            if getattr(args, k) == p.get_default(k):
                setattr(args, k, v)
    for name, allowed in (("kinds", noise.KINDS), ("consistency", CONSISTENCY)):
        bad = [x for x in getattr(args, name) if x not in allowed]
        if bad or not getattr(args, name):
            p.error("--%s: %s not among %s" % (name, ", ".join(bad) or "none given",
                                                 ", ".join(allowed)))
    if not args.ratios or any(not 0 <= x <= 100 for x in args.ratios):
        p.error("--ratios: percentages in [0, 100], got %s" % args.ratios)
    for name in ("workers", "sync_every", "seeds"):
        vals = getattr(args, name)
        if not vals or len(set(vals)) != len(vals) or min(vals) < (0 if name == "seeds" else 1):
            p.error("--%s: distinct integers of at least %d, got %s" % (
                name.replace("_", "-"), 0 if name == "seeds" else 1, vals))
    if max(args.sync_every) > 1 and "sync" not in args.consistency:
        p.error("--sync-every > 1 (model averaging) needs synchronous rounds: add sync to "
                "--consistency (async and wsp cells run at k = 1 only)")
    for name in ("servers", "epochs", "batch"):
        if getattr(args, name) < 1:
            p.error("--%s must be at least 1, got %d" % (name, getattr(args, name)))
    if not 0 < args.target <= 1:
        p.error("--target is a test accuracy in (0, 1], got %s" % args.target)
    if not args.no_plot:
        from .plot import require_matplotlib
        require_matplotlib("mxps study noise (without --no-plot)")
    return Settings(args.servers, args.epochs, args.batch, args.lr, Settings.momentum,
                    args.target, args.pair_seed, args.digits_model, args.data_root, args.limit,
                    args.timeout)


def run(p: argparse.ArgumentParser, args, log=print) -> int:
    """The study of ``args`` (parsed by a parser ``add_arguments`` filled).  Returns the exit
    code: 1 if a run failed."""
    st = check(p, args)
    datasets = pick_datasets(p, args, log)
    out = os.path.abspath(args.out)
    try:
        prepare(out, st, {k: v for k, v in sorted(os.environ.items())
                          if k.startswith("MXPS_") and k != "MXPS_SECRET"},
                {"mode": "installed"})
    except StudyError as e:
        p.error(str(e))
    specs = grid(datasets, args.kinds, args.ratios, args.consistency, args.workers,
                 args.sync_every, args.seeds)
    if not specs:
        p.error("the grid is empty (kinds %s at ratios %s)" % (args.kinds, args.ratios))
    t0 = time.monotonic()
    records = run_study(out, specs, st, args.retry_failed, log)
    summary = summarise(records, st.target)
    summary["settings"] = dataclasses.asdict(st)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    for d in datasets:
        text = format_tables(summary, d)
        with open(os.path.join(out, "%s.md" % d), "w") as f:
            f.write(text)
        log(text)
        if not args.no_plot and any(r["dataset"] == d for r in summary["rows"]):
            log("plots: %s" % ", ".join(plot(summary, d, out)))
    log("%d runs in %.0f s; %d failed" % (len(records), time.monotonic() - t0,
                                          len(summary["failed"])))
    return 1 if summary["failed"] else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mxps_tools.study_noise",
                                description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
