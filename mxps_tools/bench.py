"""``mxps bench``: native dist_sync and mxps side by side on an emulated heterogeneous network.

One invocation builds one ``emunet.Topology`` (namespaces ``sched``, ``s0..``, ``w0..``; every
server and worker link shaped both ways with tbf at ``--rate`` Mbit/s; the scheduler's link,
which carries only control traffic, unshaped) and runs every system on it with the same model,
data and seeds (``mxps_tools/bench_job.py``, one process per node, ``mxps_tools.jobs``).  Every
job gets a fresh random job secret (``MXPS_SECRET``, as ``mxps launch`` gives one; native
ignores it) unless one is set in the environment already.

Systems (``SYSTEMS``): ``native`` (MXNet dist_sync), ``native-p3`` (the same with ps-lite's P3
van, ``DMLC_PS_VAN_TYPE=p3``), ``mxps-default`` (MXNet's placement with mxps's chunks and send
window, ``MXPS_PLAN=chunked``: against it ``mxps-adaptive`` isolates placement),
``mxps-unchunked`` (MXNet's placement, one slot per server part, ``MXPS_PLAN=default``) and
``mxps-adaptive``; ``NAME:VAR=VALUE`` adds settings to a system (names are sanitised where they
become file names: anything outside ``[A-Za-z0-9._-]`` becomes ``_``).

What users feel is the headline.  Per run: the **mean step time** over all timed steps (the job's
time for its N timed steps / N: from the earliest start of the first timed step to the latest
end of the last one over all workers, slow steps after a change included), the **end-to-end**
time (launch of the first node to the exit of the last, start-up included), and the median and
p90 of the workers' step times beside them.  Speedups are by mean step time, against the better
(lower mean) of ``native`` and ``native-p3`` when both ran (a user picks the faster one), and
against ``native`` alone.

``--repeat N`` runs everything N times, interleaved and rotated (rep 1: A B C, rep 2: B C A,
...; with several static ranks the rotation also moves by one per rank, so no system always runs
first), on the same topology.  Per system the report gives the mean of the per-rep means, their
min-max and stdev, and the speedup as the ratio of those means with the range of the per-rep
ratios (rep i's system against rep i's better baseline); ``bench.json`` keeps every run's raw
record (``systems``, in run order) beside the aggregates (``variants``, ``over_ranks``).

Scenarios (the first rates are set before the job starts, on the server the job will rank as
predicted, then checked against the ranks the job reports):

- ``homogeneous``: every link at R.
- ``static``: server rank r at R/k (k = ``--slow-factor``), once per rank of ``--slow-rank``: a
  rank, ``heaviest`` / ``lightest`` (most / fewest bytes under MXNet's placement,
  ``predicted_elements``), a comma list of those, or ``all`` (the default).  Runs go rep by
  rep, rank by rank, system by system; the report has one table per rank and the mean over ranks
  (mean step time, speedup averaged over ranks and its minimum).  ``heaviest``/``lightest`` are
  resolved before any job from the model's parameter sizes, computed once by building the model
  in a subprocess (``model_param_sizes``, recorded in bench.json's ``slow_ranks``); every job's
  own ``BENCH_PARAMS`` must agree, or its run fails.
- ``dynamic``: the slow link moves to the next server rank every ``--period`` seconds (default
  15), the clock starting when worker 0 reports its first timed step (start-up is not counted
  and the moves land at arbitrary moments within steps) and stopping when it reports its last;
  the first slow link is set before the job starts.  The run has ``--steps`` timed steps
  (default 24), so a faster system sees fewer moves: the report counts each run's moves within
  its timed window (``moves``).  ``--period-steps P``
  instead moves it after every P timed steps of worker 0 (every system sees the same moves at the
  same steps); that run has max(4P, 3P + 3) timed steps unless ``--steps`` is given (at least
  3P + 3), and moves stop 3 steps before the end, so that the metrics show a step after each (a
  worker writes a step's line when the next-but-one step starts: the last two steps have none).
- ``--schedule FILE``: a JSON list of ``[t, {node: rate}]`` (t seconds from the moment the ranks
  are predicted, before the start; node a topology name such as ``s1``/``w0`` or ``rank:N`` for
  server rank N; rate Mbit/s, a ``[up, down]`` pair, or null for unshaped).

Which server has which rank is read from the job, never assumed from start order: mxps's
scheduler writes the job's ranks as data (``MXPS_JOB_INFO``, a JSON file in the job's log dir:
each server's rank, host, port and pid); native ps-lite's only record of its assignment is its
scheduler's log (``PS_VERBOSE=1``: ``assign rank=<id> to node role=server, ip=...``, server rank
= (id - 8) / 2); P3 runs the same ps-lite scheduler and logs the same lines (checked on 1.9.1).
Both order servers by address; the mapping and its source are reported per run.

The **floor** per step is ``max(compute, W*M / sum of server rates, M / slowest worker rate)``,
M the model's bytes: with full-duplex links each direction (push, pull) carries W*M over the
servers' links and M over each worker's link, no placement can do better than spreading that in
proportion to server rates, and no step is faster than its computation (compute and
communication overlap, so their sum is no floor).  Rates are those in force averaged over the
run's timed window (in the default dynamic scenario the sum of server rates is constant anyway).
``compute`` is measured in the same jobs: before the rendezvous, every worker times
``--compute-steps`` steps of a private copy of the model with no kvstore (same data, optimizer,
and the same W processes competing for the CPU); the median over workers and runs is used.  The
report gives ``floor s`` and ``% of floor`` = floor / mean step time.

**Cost per byte**: ``CPU s/GB w`` and ``CPU s/GB s`` are the CPU-seconds all workers (all
servers) spent during the timed steps per GB the workers pushed and pulled in them (``2 x W x
steps x M``, the same bytes for every system; ``cpu_per_gb``).  On a fast link a 2-core machine
is CPU-bound, and these are what separate the systems; a worker's figure includes its compute,
which is the same for every system.

Shares following the rates (mxps systems): every mxps job runs with ``MXPS_METRICS`` set, so each
worker writes one JSON line per step (``mxps.metrics``) to ``metrics-<run>-<rank>.jsonl`` in
``--out-dir`` (``<run>`` = ``<variant>[-rep<i>]-<system>``, variant ``static-rank<r>``,
``dynamic``, ``homogeneous``, ``schedule`` or ``loopback``; ``-rep<i>`` only with --repeat > 1).
From worker rank 0's lines the bench draws ``shares-<run>.png`` (each server's share of the
step's bytes against seconds since the job's start, the rate-proportional target share r_s / sum
of server rates of the rates in force dashed, rate changes and plan-version changes marked; step
seconds below) and adds a ``follow`` record to the run: for every rate change after the first,
how many steps after it the shares came within ``FOLLOW_TOLERANCE`` of the targets (max over
servers of share / target <= 1.15; step 1 is the first step that ends after the change; null if
never before the next change or the end of the run).  A step's time is when the rank-0 worker
finished it (its ``BENCH_STEP`` line), on the same clock as the rate changes.

Outputs in ``--out-dir``: ``bench.json`` (every raw step time, the rates applied, tc counters per
server before/after and sampled during each run, the predicted bytes per server under MXNet's
placement, CPU per process, the follow records; the aggregates), per variant
``step_times[-<variant>].png`` and ``bytes_per_server[-<variant>].png`` of rep 1 (the suffix
only with several variants), per mxps run the metrics files and ``shares-<run>.png``; job logs
in ``logs/<variant>[-rep<i>]/<system>/``.
"""
import argparse
import ipaddress
import dataclasses
import json
import os
import re
import secrets
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional

from . import runtime

#: The benchmark's training job ships inside the package: ``python -m mxps_tools.bench_job``.
BENCH_JOB = ["-m", "mxps_tools.bench_job"]
MODELS = ("resnet18_v1", "alexnet", "vgg11", "mlp")
SCENARIOS = ("homogeneous", "static", "dynamic", "incast")
#: incast: every link at the same rate, the switch ports' queue this shallow unless --queue-ms
INCAST_QUEUE_MS = 2.0
QDISC_SAMPLE_SECONDS = 0.5
#: A server is "following" when its share of the step's bytes is at most this times its target.
FOLLOW_TOLERANCE = 1.15
#: timed steps per run, unless --steps: static, homogeneous, --schedule, loopback
DEFAULT_STEPS = 8
#: dynamic scenario (by wall time): seconds between moves of the slow link, and timed steps
DEFAULT_PERIOD_SECONDS = 15.0
DEFAULT_DYNAMIC_STEPS = 24
#: The baselines speedups are measured against (the better of them, by mean step time).
BASELINES = ("native", "native-p3")
#: Seconds to build the model once for its parameter sizes (--slow-rank heaviest/lightest).
SIZES_TIMEOUT = 300.0


class BenchError(RuntimeError):
    """The benchmark cannot run as asked (the message says why and what to change)."""


# --------------------------------------------------------------------------- systems

@dataclasses.dataclass(frozen=True)
class System:
    """One system under test: the kvstore name the job uses and the env it adds."""
    name: str
    kvstore: str
    env: Dict[str, str]
    description: str
    unavailable: Callable[[], Optional[str]] = lambda: None   # None, or the reason


#: Data-driven: a new placement only adds an entry here.
SYSTEMS = [
    System("native", "dist_sync", {}, "MXNet dist_sync (ps-lite), MXNet's placement"),
    System("native-p3", "dist_sync", {"DMLC_PS_VAN_TYPE": "p3"},
           "MXNet dist_sync with ps-lite's P3 van (keys sliced, sent by priority)"),
    System("mxps-default", "mxps", {"MXPS_PLAN": "chunked"},
           "mxps with MXNet's placement, mxps's chunks and send window"),
    System("mxps-unchunked", "mxps", {"MXPS_PLAN": "default"},
           "mxps with MXNet's placement, one slot per server part"),
    System("mxps-adaptive", "mxps", {"MXPS_PLAN": "adaptive"},
           "mxps with bandwidth-aware placement"),
    System("mxps-ltp", "mxps", {"MXPS_PLAN": "chunked", "MXPS_PUSH": "ltp"},
           "mxps-default with LTP, the loss-tolerant push over UDP"),
    System("mxps-adaptive-ltp", "mxps", {"MXPS_PLAN": "adaptive", "MXPS_PUSH": "ltp"},
           "mxps-adaptive with LTP, the loss-tolerant push over UDP"),
]
DEFAULT_SYSTEMS = ("native", "native-p3", "mxps-default", "mxps-adaptive")


def system_by_name(name: str) -> System:
    """A system by name; ``NAME:VAR=VALUE[:VAR=VALUE...]`` is that system with these variables
    added to its jobs' environment (to compare settings side by side in one run)."""
    base, *settings = name.split(":")
    for s in SYSTEMS:
        if s.name == base:
            break
    else:
        raise BenchError("unknown system %r; known: %s (a system may be followed by "
                         ":VAR=VALUE settings)" % (base, ", ".join(s.name for s in SYSTEMS)))
    if not settings:
        return s
    env = dict(s.env)
    for item in settings:
        var, eq, value = item.partition("=")
        if not eq or not re.fullmatch(r"[A-Z][A-Z0-9_]*", var):
            raise BenchError("system %r: %r is not VAR=VALUE (an environment variable in "
                             "capitals)" % (name, item))
        env[var] = value
    return dataclasses.replace(s, name=name, env=env,
                               description="%s, with %s" % (s.description, ", ".join(settings)))


def path_part(name: str) -> str:
    """``name`` as one safe file-name component: anything outside [A-Za-z0-9._-] becomes '_'
    (a system's settings hold ':', '=' and '/', which break or escape paths)."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)
    return "_" + safe if safe.strip(".") == "" else safe


def job_secret_env(system_env, environ=os.environ) -> Dict[str, str]:
    """``{"MXPS_SECRET": <fresh>}`` for one job, or ``{}`` when the user chose a secret already
    (MXPS_SECRET or MXPS_SECRET_FILE in the environment or the system's settings), as ``mxps
    launch`` does: without one every mxps server warns that anyone can talk to it.  A system
    whose settings say ``MXPS_SECRET=`` (empty) runs without a secret (what the secret costs)."""
    if system_env.get("MXPS_SECRET", None) == "":
        return {}
    for env in (system_env, environ):
        if env.get("MXPS_SECRET") or env.get("MXPS_SECRET_FILE"):
            return {}
    return {"MXPS_SECRET": secrets.token_hex(32)}


# --------------------------------------------------------------------------- rank discovery

_NATIVE_ASSIGN = re.compile(r"assign rank=(\d+) to node role=server, ip=([0-9.]+), port=(\d+)")


def native_server_ranks_from_log(sched_log: str, num_servers: int) -> Optional[List[str]]:
    """Native ps-lite's server addresses ``host:port`` in rank order, from its scheduler's log
    (``PS_VERBOSE=1``), or None before the ranks 0..num_servers-1 are all logged.

    The log is the only place ps-lite tells which server got which rank (it has no other
    output); mxps's scheduler writes its ranks as data instead (``server_ranks_from_job_info``).
    P3 (``DMLC_PS_VAN_TYPE=p3``) only changes the van's data path: its scheduler logs the same
    ``assign rank`` lines (MXNet 1.9.1).
    """
    found = {}
    for m in _NATIVE_ASSIGN.finditer(sched_log):
        found[(int(m.group(1)) - 8) // 2] = "%s:%s" % (m.group(2), m.group(3))
    if sorted(found) != list(range(num_servers)):
        return None
    return [found[i] for i in range(num_servers)]


def server_ranks_from_job_info(info: Optional[dict], num_servers: int) -> Optional[List[dict]]:
    """mxps's servers (``{"rank", "host", "port", "pid"}``) in rank order, from the job info
    its scheduler writes after the rendezvous (MXPS_JOB_INFO), or None before it is written.

    Raises:
        BenchError: the file is there but its servers are not ranks 0..num_servers-1.
    """
    if not info or not info.get("servers"):
        return None
    servers = sorted(info["servers"], key=lambda s: s.get("rank", -1))
    ranks = [s.get("rank") for s in servers]
    if ranks != list(range(num_servers)):
        raise BenchError("the scheduler's job info lists server ranks %s, not 0..%d: %s"
                         % (ranks, num_servers - 1, info))
    return servers


# --------------------------------------------------------------------------- placement maths

def predicted_elements(param_sizes, num_servers, bigarray_bound=1000 * 1000):
    """Elements per server rank under MXNet's placement (keys = parameter indices)."""
    from .runtime import module
    mxnet_default_rule = module("placement.plan").mxnet_default_rule
    out = [0] * num_servers
    for key, size in enumerate(param_sizes):
        for s in mxnet_default_rule(key, size, num_servers, bigarray_bound):
            out[s.server] += s.length
    return out


def floor_seconds(compute_s, model_bytes, num_workers, server_mbit, worker_mbit):
    """The strict floor of a step: max(compute, W*M / sum(server rates), M / slowest worker
    rate); rates in Mbit/s (inf: unshaped).

    Each direction (push, pull) carries W*M over the servers' links and M over each worker's
    link; on full-duplex links the two directions overlap, and so do computation and
    communication (gradients of later layers go out while earlier ones are computed), so none
    of them adds to another: a step takes at least the longest."""
    bps = lambda mbit: mbit * 1e6 / 8.0   # noqa: E731
    return max(compute_s,
               num_workers * model_bytes / sum(bps(r) for r in server_mbit),
               model_bytes / bps(min(worker_mbit)))


def p90(xs) -> float:
    """The 90th percentile, interpolated linearly between the closest ranks (numpy's default)."""
    xs = list(xs)
    if len(xs) < 2:
        return xs[0] if xs else float("nan")
    return statistics.quantiles(xs, n=10, method="inclusive")[-1]


def p99(xs) -> float:
    """The 99th percentile, interpolated as ``p90`` (with few steps: near the slowest)."""
    xs = list(xs)
    if len(xs) < 2:
        return xs[0] if xs else float("nan")
    return statistics.quantiles(xs, n=100, method="inclusive")[-1]


_SIZES_SCRIPT = r"""
import json, sys
sys.argv = ["bench_job", "--kvstore", "local"] + sys.argv[1:]
from mxps_tools import bench_job as job
import mxnet as mx, numpy as np
a = job.ARGS
net = job.build(a.model, a.classes, a.mlp_hidden)
net.initialize(mx.init.Xavier(magnitude=2))
net(mx.nd.zeros((1, 3, a.image_size, a.image_size))).wait_to_read()
params = net.collect_params()
print("BENCH_PARAMS " + json.dumps([int(np.prod(params[k].shape)) for k in sorted(params.keys())]))
"""


def model_param_sizes(model, mlp_hidden, image_size, timeout=SIZES_TIMEOUT) -> List[int]:
    """The model's parameter sizes in kvstore key order, as the bench job prints them
    (``BENCH_PARAMS``): the job's own ``build`` in a subprocess (MXNet is never imported here),
    with no job variables (a DMLC_ROLE in the caller's shell would make MXNet's import a role).

    Raises:
        BenchError: the build failed or printed no sizes.
    """
    from . import jobs
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "MXPS_"))}
    env.update(jobs.QUIET_ENV)
    argv = runtime.python_argv(["-c", _SIZES_SCRIPT, "--model", model, "--mlp-hidden",
                                str(mlp_hidden), "--image-size", str(image_size)])
    try:
        p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise BenchError("building %s for its parameter sizes (--slow-rank heaviest/lightest) "
                         "took over %.0f s" % (model, timeout)) from None
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("BENCH_PARAMS ")]
    if p.returncode != 0 or not lines:
        raise BenchError("building %s for its parameter sizes (--slow-rank heaviest/lightest) "
                         "failed (exit %s): %s" % (model, p.returncode, p.stderr[-2000:]))
    return json.loads(lines[-1].split(" ", 1)[1])


def parse_slow_ranks(spec: str, num_servers: int) -> List:
    """``--slow-rank``: its items (rank numbers, 'heaviest', 'lightest'; 'all' expanded to every
    rank), in the order given.

    Raises:
        BenchError: an item is none of these, or a rank outside 0..num_servers-1.
    """
    out = []
    for item in (x.strip() for x in str(spec).split(",")):
        if item == "all":
            out += list(range(num_servers))
        elif item in ("heaviest", "lightest"):
            out.append(item)
        elif re.fullmatch(r"\d+", item):
            if int(item) >= num_servers:
                raise BenchError("--slow-rank %s: the job has server ranks 0..%d"
                                 % (item, num_servers - 1))
            out.append(int(item))
        else:
            raise BenchError("--slow-rank %r: expected a server rank, 'heaviest', 'lightest', "
                             "'all' or a comma list of those" % item)
    if not out:
        raise BenchError("--slow-rank %r names no server rank" % spec)
    return out


def resolve_slow_ranks(items, elements=None) -> List[dict]:
    """``[{"rank", "labels"}]``, one per distinct rank in first-mention order, 'heaviest' /
    'lightest' resolved from ``elements`` (per server rank under MXNet's placement; the lowest
    rank on ties)."""
    out = {}
    for item in items:
        label = None
        if item in ("heaviest", "lightest"):
            if elements is None:
                raise BenchError("--slow-rank %s needs the model's parameter sizes" % item)
            label, ranks = item, range(len(elements))
            item = max(ranks, key=lambda i: (elements[i], -i)) if label == "heaviest" else \
                min(ranks, key=lambda i: (elements[i], i))
        rec = out.setdefault(item, {"rank": item, "labels": []})
        if label:
            rec["labels"].append(label)
    return list(out.values())


def plan_runs(systems, variants, repeat) -> List[tuple]:
    """The run order: ``[(rep, variant, system)]``, rep by rep, variant by variant (static: rank
    by rank), the systems rotated by one per rep and per variant (rep 1: A B C, rep 2: B C A,
    ...), so that no system always runs first (the first run of a bench meets a cold machine)."""
    n = len(systems)
    out = []
    for rep in range(repeat):
        for vi, v in enumerate(variants):
            k = (rep + vi) % n if n else 0
            out += [(rep, v, s) for s in systems[k:] + systems[:k]]
    return out


# --------------------------------------------------------------------------- shares vs rates

def is_mxps(system: System) -> bool:
    return system.kvstore.startswith("mxps")


def read_metrics(path):
    """The JSON lines of one MXPS_METRICS file (a torn last line is skipped)."""
    out = []
    try:
        with open(path) as f:
            for ln in f:
                try:
                    out.append(json.loads(ln))
                except ValueError:
                    pass
    except OSError:
        return []
    return out


def step_ends_by_rank(worker_nodes):
    """{worker rank: {step index (0-based, warm-up included): unix time it ended}} from the
    workers' ``BENCH_STEP <rank> <step> <time>`` lines."""
    out = {}
    for n in worker_nodes:
        for ln in n.read("out").splitlines():
            if ln.startswith("BENCH_STEP "):
                parts = ln.split()
                if len(parts) == 4:
                    out.setdefault(int(parts[1]), {})[int(parts[2])] = float(parts[3])
    return out


def targets(rates):
    """Rate-proportional share per server (None if a rate is unknown or unshaped)."""
    if not rates or any(r is None or r == float("inf") for r in rates) or sum(rates) <= 0:
        return None
    total = float(sum(rates))
    return [r / total for r in rates]


def share_ratio(shares, target):
    """max over servers of share / target (the busiest server relative to its target)."""
    if target is None or len(target) != len(shares):
        return None
    return max((s / t) if t > 0 else (float("inf") if s > 0 else 0.0)
               for s, t in zip(shares, target))


def follow_changes(steps, changes, tolerance=FOLLOW_TOLERANCE):
    """For every change after the first: steps after it until max share/target <= tolerance.

    ``steps``: [(time the step ended, shares per server)] in step order; ``changes``: [(time,
    target shares per server, or None)] in time order, the first being the scenario's initial
    rates.  Step 1 after a change is the first step that ends after it; a change not followed
    before the next change (or the end of the run) gets ``steps`` None."""
    out = []
    for i in range(1, len(changes)):
        t, tg = changes[i]
        t_next = changes[i + 1][0] if i + 1 < len(changes) else float("inf")
        after = [(t_end, sh) for t_end, sh in steps if t_end > t]
        seen = [(t_end, sh) for t_end, sh in after if t_end <= t_next]
        rec = {"t": t, "targets": tg, "steps": None, "seconds": None,
               "steps_observed": len(seen),
               "ratio_first": share_ratio(after[0][1], tg) if after else None}
        if tg is not None:
            for k, (t_end, sh) in enumerate(seen, 1):
                r = share_ratio(sh, tg)
                if r is not None and r <= tolerance:
                    rec.update(steps=k, seconds=t_end - t, ratio=r)
                    break
        out.append(rec)
    return out


# --------------------------------------------------------------------------- what users feel

def report_path(metrics, role, rank, what):
    """Where a node writes its shutdown report ``what`` with MXPS_METRICS=``metrics``: the rule
    of ``mxps.placement.metrics.report_path`` (tests/test_bench.py holds the two equal), repeated
    here because importing ``mxps`` in a process that carries a job's DMLC_ROLE runs that role:
    ``mxps bench`` must run anywhere (tests/test_install.py holds that)."""
    return "%s.%s%d.%s.json" % (metrics.replace("{rank}", "x"), role, rank, what)


def _ltp_reports(metrics, role, count) -> List[dict]:
    """The LTP shutdown reports ``<metrics>.<role><r>.ltp.json`` of ranks 0 .. count - 1 that
    exist and parse."""
    reports = []
    for r in range(count):
        path = report_path(metrics, role, r, "ltp")
        try:
            with open(path) as f:
                reports.append(json.load(f))
        except (OSError, ValueError):
            continue
    return reports


def _summed(reports, field) -> dict:
    """The counters under ``field`` of every report, added up by name."""
    total = {}
    for rep in reports:
        for k, v in rep.get(field, {}).items():
            total[k] = total.get(k, 0) + v
    return total


def _worker_ltp(metrics, num_workers) -> Optional[dict]:
    """The workers' LTP reports of one run (``<metrics>.worker<r>.ltp.json``): the datagrams
    they sent and the ACKs they read, summed, and what their I/O threads cost: loop turns and
    CPU seconds per worker (mean, max), data packets per turn.  None without reports."""
    reports = _ltp_reports(metrics, "worker", num_workers)
    if not reports:
        return None
    counts = _summed(reports, "counts")
    io = [rep.get("io", {}) for rep in reports]
    turns = [x.get("turns", 0) for x in io]
    cpu = [x.get("cpu_s", 0.0) for x in io]
    wall = [x.get("wall_s", 0.0) for x in io]
    return {"workers": len(reports), "counts": counts,
            "io_turns_mean": _mean(turns), "io_timeouts": sum(x.get("timeouts", 0) for x in io),
            "io_cpu_s_mean": _mean(cpu), "io_cpu_s_max": max(cpu),
            "io_cpu_share_mean": _mean(c / w for c, w in zip(cpu, wall) if w > 0),
            "data_per_turn": counts.get("data", 0) / sum(turns) if sum(turns) else None}


def ltp_stats(metrics, num_servers, num_workers=0) -> Optional[dict]:
    """The servers' LTP reports of one run (``<metrics>.server<r>.ltp.json``, written at a
    clean shutdown with MXPS_PUSH=ltp), summed: rounds, why they closed, the fraction of the
    gradient packets delivered in time; with ``num_workers``, the workers' reports too
    (``_worker_ltp``, key ``senders``).  None when no server wrote one (TCP runs)."""
    reports = _ltp_reports(metrics, "server", num_servers)
    if not reports:
        return None
    total = _summed(reports, "stats")
    expected = total.get("packets_expected", 0)
    return {"servers": len(reports), "rounds": total.get("rounds", 0),
            "closed": {k[len("close_"):]: v for k, v in total.items() if k.startswith("close_")},
            "delivered": total.get("packets_received", 0) / expected if expected else None,
            "late": total.get("drop_late", 0), "stats": total,
            "loss_estimate": [x for rep in reports for x in rep.get("loss_estimate", [])],
            "budget": reports[0].get("budget"),
            "senders": _worker_ltp(metrics, num_workers) if num_workers else None}


def step_summary(workers) -> dict:
    """Step times of one run from its workers' result lines (``step_seconds``,
    ``step_start_abs``, ``step_end_abs``): ``mean_s`` = the job's time for its N timed steps / N
    (earliest start of the first timed step to the latest end of the last, over all workers),
    ``median_s`` and ``p90_s`` of every worker's step times, the ``window`` and N.

    Raises:
        BenchError: workers timed different numbers of steps, or none.
    """
    counts = {len(w["step_seconds"]) for w in workers}
    if len(counts) != 1 or not min(counts):
        raise BenchError("the workers timed %s steps (%s): expected the same number, at "
                         "least 1" % ([len(w["step_seconds"]) for w in workers],
                                      ", ".join(w.get("node", "?") for w in workers)))
    n = counts.pop()
    t0 = min(w["step_start_abs"][0] for w in workers)
    t1 = max(w["step_end_abs"][-1] for w in workers)
    steps = [t for w in workers for t in w["step_seconds"]]
    return {"timed_steps": n, "window": [t0, t1], "mean_s": (t1 - t0) / n,
            "median_s": statistics.median(steps), "p90_s": p90(steps), "p99_s": p99(steps)}


#: bytes per element of the bench job's parameters and gradients (float32)
ELEMENT_BYTES = 4


def cpu_per_gb(cpu, param_sizes, num_workers, timed_steps):
    """CPU-seconds per GB moved during the timed steps, per process kind (``worker``,
    ``server``, ``scheduler``): the kind's CPU-seconds in the window (``cpu``: node name ->
    ``{"role", "cpu_seconds_window"}``) over the gigabytes (1e9 bytes) the workers pushed and
    pulled in it (every worker pushes and pulls the whole model every step: ``2 x W x steps x
    model bytes``, whatever the placement).  Every system moves the same bytes, so the figures
    compare cost per byte; a worker's includes its compute, the same for every system."""
    gb = 2.0 * num_workers * timed_steps * sum(param_sizes) * ELEMENT_BYTES / 1e9
    out = {"gb_moved": gb}
    for n in cpu.values():
        s = n.get("cpu_seconds_window")
        if s is None or gb <= 0:
            continue
        out[n["role"]] = out.get(n["role"], 0.0) + s / gb
    return out


def job_e2e_seconds(nodes) -> Optional[float]:
    """Launch of the first node to the exit of the last (``jobs.Node.started`` / ``exited_at``,
    monotonic): what the job costs its user, start-up and shut-down included; None if a node
    never started or was not seen exiting."""
    if not nodes or any(not n.started or n.exited_at is None for n in nodes):
        return None
    return max(n.exited_at for n in nodes) - min(n.started for n in nodes)


def better_baseline(by_name) -> Optional[str]:
    """The name of the baseline a user would pick (lowest ``mean_s``) among the BASELINES in
    ``{name: record}``; None if none of them is there."""
    have = [by_name[b] for b in BASELINES if by_name.get(b) and by_name[b].get("mean_s")]
    return min(have, key=lambda r: r["mean_s"])["name"] if have else None


def rep_speedups(records) -> None:
    """Per run (ok records, in place): ``baseline`` (the better baseline of the same rep and
    variant), ``speedup`` = its mean step time / the run's, ``speedup_vs_native``."""
    groups = {}
    for r in records:
        if r.get("ok"):
            groups.setdefault((r["rep"], r["variant"]), {})[r["name"]] = r
    for by in groups.values():
        best = better_baseline(by)
        native = by.get("native")
        for r in by.values():
            r["baseline"] = best
            r["speedup"] = by[best]["mean_s"] / r["mean_s"] if best else None
            r["speedup_vs_native"] = native["mean_s"] / r["mean_s"] if native else None


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def aggregate_runs(records, names) -> List[dict]:
    """One variant's runs (every rep) summed up per system, in ``names`` order (records after
    ``rep_speedups``): the mean over ok reps of each run's mean / e2e / median / p90 step time,
    the min, max and stdev of the means, the mean floor and its share of the mean, the moves
    seen per rep, and the speedup as the ratio of the means (against the better baseline by
    mean over reps, and against native) with the range of the per-rep ratios."""
    out = []
    for name in names:
        runs = [r for r in records if r["name"] == name]
        ok = [r for r in runs if r.get("ok")]
        means = [r["mean_s"] for r in ok]
        a = {"name": name, "runs": len(runs), "ok_runs": len(ok),
             "mean_s": _mean(means), "mean_s_min": min(means) if means else None,
             "mean_s_max": max(means) if means else None,
             "mean_s_stdev": statistics.stdev(means) if len(means) > 1 else None,
             "e2e_s": _mean(r.get("e2e_s") for r in ok),
             "median_s": _mean(r["median_s"] for r in ok),
             "p90_s": _mean(r["p90_s"] for r in ok),
             "p99_s": _mean(r.get("p99_s") for r in ok),
             "floor_s": _mean(r.get("floor_s") for r in ok),
             "moves": [r.get("moves") for r in ok],
             "cpu_per_gb": {k: _mean(r["cpu_per_gb"].get(k) for r in ok
                                     if r.get("cpu_per_gb"))
                            for k in ("worker", "server")}}
        a["floor_share"] = a["floor_s"] / a["mean_s"] if a["floor_s"] and a["mean_s"] else None
        ltp = [r["ltp"] for r in ok if r.get("ltp")]
        if ltp:
            closed = {}
            for x in ltp:
                for k, v in x["closed"].items():
                    closed[k] = closed.get(k, 0) + v
            a["ltp"] = {"delivered": _mean(x["delivered"] for x in ltp), "closed": closed,
                        "rounds": sum(x["rounds"] for x in ltp)}
            senders = [x["senders"] for x in ltp if x.get("senders")]
            if senders:
                a["ltp"]["senders"] = {k: _mean(x[k] for x in senders) for k in (
                    "io_turns_mean", "io_cpu_s_mean", "io_cpu_share_mean", "data_per_turn")}
        for key in ("speedup", "speedup_vs_native"):
            xs = [r[key] for r in ok if r.get(key) is not None]
            a[key + "_range"] = [min(xs), max(xs)] if xs else None
        out.append(a)
    by = {a["name"]: a for a in out}
    best = better_baseline(by)
    native = by.get("native")
    for a in out:
        a["baseline"] = best
        a["speedup"] = by[best]["mean_s"] / a["mean_s"] if best and a["mean_s"] else None
        a["speedup_vs_native"] = native["mean_s"] / a["mean_s"] \
            if native and native["mean_s"] and a["mean_s"] else None
    return out


def mean_over_ranks(variants, names) -> List[dict]:
    """Static over several ranks, per system: the mean over ranks of the mean step time, and the
    speedup (and vs native) averaged over ranks and its minimum; None where a rank has no
    result for the system (a mean over some ranks only would flatter it)."""
    out = []
    for name in names:
        per = [next((a for a in v["systems"] if a["name"] == name), None) for v in variants]
        row = {"name": name, "ranks": [v["slow_rank"] for v in variants]}
        complete = all(a is not None and a["mean_s"] is not None for a in per)
        row["mean_s"] = statistics.fmean(a["mean_s"] for a in per) if complete else None
        for key in ("speedup", "speedup_vs_native"):
            xs = [a[key] for a in per if a is not None and a[key] is not None] if complete else []
            ok = complete and len(xs) == len(per)
            row[key + "_mean"] = statistics.fmean(xs) if ok else None
            row[key + "_min"] = min(xs) if ok else None
        out.append(row)
    return out


# --------------------------------------------------------------------------- one system run

class _Run:
    """Follows one run's job: progress, rank discovery, scenario, tc counter samples."""

    def __init__(self, bench, system, variant=None):
        self.b = bench
        self.system = system
        self.variant = variant or {}    # the scenario variant (static: its slow rank)
        self.ranks = None              # server addresses in rank order
        self.rank_nodes = None         # node name per server rank
        self.rank_source = None
        self.scenario_applied_at = None
        self.schedule = None           # the scenario's timed schedule (None: not applied yet)
        self._schedules = []           # (RateSchedule, its events sorted by time)
        self.step_events = []          # (timed steps of worker 0 done, {node: rate}) pending
        self.clock_events = None       # [(seconds, {node: rate})] from worker 0's 1st timed step
        self.clock_started_at = None   # unix time worker 0 reported its first timed step
        self._clock_schedule = None
        self.rate_log = []             # (wall, node, up, down)
        self.rate_events = []          # (wall of its first change, {node: [up, down]})
        self.param_sizes = None
        self.samples = []              # (wall, {node: {'up': bytes, 'down': bytes}})
        self._next_sample = 0.0
        self._seen_steps = 0
        self._out_pos = 0

    def on_poll(self, job):
        b = self.b
        now = time.time()
        clock = self.clock_events or (self._clock_schedule is not None and
                                      not self._clock_schedule.done)
        if self.param_sizes is None or b.pbar is not None or self.step_events or clock:
            self._follow_worker(job)
        if self.ranks is None:
            predicted = self.rank_nodes
            if self.discover_ranks(job):
                if predicted is not None and predicted != self.rank_nodes:
                    raise BenchError(
                        "%s: the scheduler gave server ranks to %s, not %s as predicted when "
                        "the scenario's first rates were set before the start"
                        % (self.system.name, self.rank_nodes, predicted))
                if b.topo is not None and self.scenario_applied_at is None:
                    self._apply_scenario()
        if b.topo is not None and now >= self._next_sample:
            self.samples.append((now, b.server_counters()))
            self._next_sample = now + QDISC_SAMPLE_SECONDS

    def _follow_worker(self, job):
        w0 = job.node("w0")
        try:
            with open(w0.out_path) as f:
                f.seek(self._out_pos)
                chunk = f.read()
        except OSError:
            return
        cut = chunk.rfind("\n") + 1
        self._out_pos += len(chunk[:cut].encode())
        for line in chunk[:cut].splitlines():
            if line.startswith("BENCH_PARAMS ") and self.param_sizes is None:
                self.param_sizes = json.loads(line.split(" ", 1)[1])
            elif line.startswith("BENCH_STEP "):
                self._seen_steps += 1
                if self.b.pbar is not None:
                    self.b.pbar.update(1)
                if self._seen_steps == self.b.o.warmup + 1 and self.clock_events is not None:
                    self._start_clock(float(line.split()[3]))
                if self._seen_steps == self.b.o.warmup + self.b.o.steps and \
                        self._clock_schedule is not None:
                    # no moves after the last timed step: they would change nothing measured
                    self._clock_schedule.stop(raise_errors=False)
        self._fire_step_events()

    def _start_clock(self, t_first):
        """dynamic (by wall time): start the moves' clock at ``t_first``, when worker 0 ended
        its first timed step (the line is read up to a poll later: the offsets make up for
        it); the moves stop when worker 0 ends its last timed step."""
        lag = max(0.0, time.time() - t_first)
        events = [(max(0.0, t - lag), ch) for t, ch in self.clock_events]
        self.clock_events, self.clock_started_at = None, t_first
        if events:
            self._clock_schedule = self._start_schedule(events)

    def _fire_step_events(self):
        """dynamic (step-driven): apply the moves due after worker 0's timed steps so far."""
        timed = self._seen_steps - self.b.o.warmup
        while self.step_events and self.step_events[0][0] <= timed:
            _, changes = self.step_events.pop(0)
            self._start_schedule([(0.0, changes)])

    def predict_ranks(self):
        """Server nodes in rank order, before the job starts: mxps's scheduler ranks servers by
        ascending address, ps-lite's (native) by descending address (seen on 1.9.1; checked
        against the ranks the job reports once it runs, ``discover_ranks``).  Setting the
        scenario's rates before the start matters: mxps's adaptive placement measures the links
        at start-up."""
        topo = self.b.topo
        if topo is None:
            return
        servers = sorted((n for n in topo.nodes if n.startswith("s") and n != "sched"),
                         key=lambda n: ipaddress.ip_address(topo.addr(n)))
        if self.system.kvstore.startswith("dist"):
            servers.reverse()
        self.rank_nodes = servers
        self._apply_scenario()

    def discover_ranks(self, job) -> bool:
        """Which server has which rank, read from the running job (``ranks``, ``rank_nodes``,
        ``rank_source``); False while the job has not told yet."""
        if is_mxps(self.system):
            servers = server_ranks_from_job_info(job.job_info(), job.num_servers)
            if servers is None:
                return False
            by_pid = {n.pid: n.name for n in job.nodes if n.role == "server"}
            self.ranks = ["%s:%s" % (s["host"], s["port"]) for s in servers]
            self.rank_nodes = [by_pid.get(s.get("pid")) or self._node_at(s["host"])
                               for s in servers]
            self.rank_source = "job info"
        else:
            ranks = native_server_ranks_from_log(job.node("sched").read("err"),
                                                 job.num_servers)
            if ranks is None:
                return False
            self.ranks = ranks
            self.rank_nodes = [self._node_at(a.rsplit(":", 1)[0]) for a in ranks]
            self.rank_source = "scheduler log"
        return True

    def _node_at(self, host):
        """The topology node at address ``host`` (None on loopback, where every node is)."""
        topo = self.b.topo
        if topo is None:
            return None
        return {topo.addr(n): n for n in topo.nodes}.get(host)

    def node_of(self, spec):
        if isinstance(spec, str) and spec.startswith("rank:"):
            r = int(spec.split(":", 1)[1])
            if not 0 <= r < len(self.rank_nodes):
                raise BenchError("schedule names %s but there are %d servers"
                                 % (spec, len(self.rank_nodes)))
            return self.rank_nodes[r]
        return spec

    def _apply_scenario(self):
        """The scenario's rates: those due now are applied before this returns (before the job
        starts: mxps's adaptive placement measures the links at start-up), later ones by a
        schedule, worker 0's steps (``step_events``) or the clock (``clock_events``)."""
        b = self.b
        events = b.scenario_events(self)
        self.step_events = b.scenario_step_events(self)
        self.clock_events = b.scenario_clock_events(self) or None
        self.scenario_applied_at = time.time()
        if events:
            self.schedule = self._start_schedule(events)
            if all(t == 0 for t, _ in events):
                self.schedule.join(30.0)

    def _start_schedule(self, events):
        events = sorted(events, key=lambda e: e[0])      # as RateSchedule orders them
        sched = self.b.topo.run_schedule(events)
        self._schedules.append((sched, events))
        return sched

    def finish(self):
        errors = []
        for sched, events in self._schedules:
            sched.stop(raise_errors=False)
            errors += sched.errors
            # the log has one entry per node changed, event by event: cut it back into events
            log, pos = list(sched.log), 0
            for _, changes in events:
                chunk = log[pos:pos + len(changes)]
                pos += len(changes)
                if chunk:
                    self.rate_events.append((chunk[0][0], {n: [u, d] for _, n, u, d in chunk}))
            self.rate_log += [list(e) for e in log]
        self.rate_log.sort(key=lambda e: e[0])
        self.rate_events.sort(key=lambda e: e[0])
        self.step_events = []
        self.clock_events = None
        if errors:
            raise BenchError("rate schedule failed: %s" % errors[0])


# --------------------------------------------------------------------------- the benchmark

@dataclasses.dataclass
class Options:
    network: str = "emunet"          # emunet | loopback
    scenario: str = "static"
    systems: List[str] = dataclasses.field(default_factory=lambda: list(DEFAULT_SYSTEMS))
    num_workers: int = 4
    num_servers: int = 4
    model: str = "resnet18_v1"
    mlp_hidden: int = 4096
    batch_size: int = 16
    image_size: int = 32
    steps: int = DEFAULT_STEPS
    warmup: int = 2
    compute_steps: int = 3
    rate: float = 400.0
    slow_factor: float = 4.0
    slow_rank: str = "all"           # ranks, 'heaviest', 'lightest', a comma list, or 'all'
    period: Optional[float] = None   # dynamic: seconds between moves (from the 1st timed step)
    period_steps: Optional[int] = None   # dynamic: timed steps between moves instead
    repeat: int = 1
    loss: float = 0.0                # percent of packets dropped towards every server
    queue_ms: Optional[float] = None   # switch queue (None: emunet's default; incast 2 ms)
    mtu: int = 1500
    schedule: Optional[list] = None
    timeout: float = 900.0
    out_dir: str = "mxps-bench-out"
    netns_prefix: str = "mxps-"
    progress: bool = True
    plots: bool = True


class Bench:
    def __init__(self, opts: Options):
        self.o = opts
        self.topo = None
        self.pbar = None
        self.results = []
        self.variants = None
        self.slow_ranks = None         # how --slow-rank was resolved (bench.json)
        self.expected_sizes = None     # parameter sizes the slow ranks were resolved from

    # ---- network ------------------------------------------------------------------------
    def queue_ms(self):
        """The switch queue in ms (None: emunet's default): --queue-ms, else 2 ms for incast."""
        if self.o.queue_ms is not None:
            return self.o.queue_ms
        return INCAST_QUEUE_MS if self.o.scenario == "incast" else None

    def server_nodes(self):
        return ["s%d" % i for i in range(self.o.num_servers)]

    def server_counters(self):
        out = {}
        for n in self.server_nodes():
            st = self.topo.qdisc_stats(n)
            out[n] = {"up": st["up"]["bytes"], "down": st["down"]["bytes"]}
        return out

    def base_rates(self):
        from . import jobs
        r = {n: self.o.rate for n in jobs.node_names(self.o.num_workers, self.o.num_servers)}
        r["sched"] = None
        return r

    def reset_rates(self):
        for n, r in self.base_rates().items():
            self.topo.set_rate(n, r)

    # ---- scenarios ----------------------------------------------------------------------
    def scenario_events(self, run: _Run):
        """The rates set when the ranks are predicted, before the job starts (and, for
        --schedule, its later events, timed from then)."""
        o = self.o
        if o.schedule is not None:
            return [(float(t), {run.node_of(n): r for n, r in ch.items()})
                    for t, ch in o.schedule]
        if o.scenario in ("homogeneous", "incast"):
            return []
        if o.scenario == "static":
            return [(0.0, {run.rank_nodes[run.variant["slow_rank"]]: o.rate / o.slow_factor})]
        return [(0.0, self._dynamic_move(run, 0))]

    def scenario_step_events(self, run: _Run):
        """dynamic with --period-steps P: [(timed steps of worker 0 done, {node: rate})], the
        slow link's moves after every P timed steps, the last one at least 3 steps before the
        end."""
        o = self.o
        if o.schedule is not None or o.scenario != "dynamic" or o.period_steps is None:
            return []
        P = o.period_steps
        return [(i * P, self._dynamic_move(run, i)) for i in range(1, (o.steps - 3) // P + 1)]

    def scenario_clock_events(self, run: _Run):
        """dynamic by wall time: [(seconds from worker 0's first timed step, {node: rate})], a
        move every --period seconds for as long as the run may last (the schedule is stopped
        when the job ends)."""
        o = self.o
        if o.schedule is not None or o.scenario != "dynamic" or o.period_steps is not None \
                or o.period is None:
            return []
        return [(i * o.period, self._dynamic_move(run, i))
                for i in range(1, int(o.timeout // o.period) + 1)]

    def _dynamic_move(self, run: _Run, i):
        """The i-th rates of the dynamic scenario: server rank i mod S slow, the previous one
        back at the full rate."""
        o = self.o
        S = o.num_servers
        ch = {run.rank_nodes[i % S]: o.rate / o.slow_factor}
        if i and S > 1:
            ch[run.rank_nodes[(i - 1) % S]] = o.rate
        return ch

    @staticmethod
    def bigarray_bound():
        return int(os.environ.get("MXNET_KVSTORE_BIGARRAY_BOUND", 1000 * 1000))

    def make_variants(self, param_sizes=None) -> List[dict]:
        """The scenario's variants, each run by every system in every rep: static has one per
        slow rank (``--slow-rank``; 'heaviest'/'lightest' from ``param_sizes``, built here with
        ``model_param_sizes`` when not given), every other scenario one.  Sets ``variants``
        and, for static, ``slow_ranks`` (what was resolved, from what)."""
        o = self.o
        if o.network != "emunet":
            self.variants = [{"tag": "loopback", "scenario": "loopback"}]
        elif o.schedule is not None:
            self.variants = [{"tag": "schedule", "scenario": "schedule"}]
        elif o.scenario != "static":
            self.variants = [{"tag": o.scenario, "scenario": o.scenario}]
        else:
            items = parse_slow_ranks(o.slow_rank, o.num_servers)
            elements, source = None, None
            if any(isinstance(x, str) for x in items):
                if param_sizes is None:
                    param_sizes = model_param_sizes(o.model, o.mlp_hidden, o.image_size)
                    source = "the model built once in a subprocess (model_param_sizes)"
                else:
                    source = "given"
                self.expected_sizes = list(param_sizes)
                elements = predicted_elements(param_sizes, o.num_servers, self.bigarray_bound())
            resolved = resolve_slow_ranks(items, elements)
            self.slow_ranks = {"spec": o.slow_rank, "resolved": resolved,
                               "elements_per_rank": elements, "param_sizes_from": source}
            self.variants = [{"tag": "static-rank%d" % x["rank"], "scenario": "static",
                              "slow_rank": x["rank"], "slow_rank_labels": x["labels"]}
                             for x in resolved]
        return self.variants

    # ---- jobs ---------------------------------------------------------------------------
    def job_argv(self, system):
        o = self.o
        return BENCH_JOB + ["--kvstore", system.kvstore, "--model", o.model,
                "--mlp-hidden", o.mlp_hidden, "--batch-size", o.batch_size,
                "--image-size", o.image_size, "--steps", o.steps, "--warmup", o.warmup,
                "--compute-steps", o.compute_steps, "--progress"]

    def run_paths(self, variant, rep, system) -> dict:
        """Where one run's files go (every name component sanitised, ``path_part``): its job
        logs, its metrics files (``{rank}`` left to format) and its shares plot."""
        o = self.o
        out = os.path.abspath(o.out_dir)
        block = variant["tag"] + ("-rep%d" % (rep + 1) if o.repeat > 1 else "")
        run_id = "%s-%s" % (block, path_part(system.name))
        return {"run_id": run_id,
                "log_dir": os.path.join(out, "logs", path_part(block), path_part(system.name)),
                "metrics": os.path.join(out, "metrics-%s-{rank}.jsonl" % path_part(run_id)),
                "shares_png": os.path.join(out, "shares-%s.png" % path_part(run_id))}

    def run_system(self, system: System, variant=None, rep=0):
        from . import jobs
        o = self.o
        variant = variant or self.make_variants()[0]
        paths = self.run_paths(variant, rep, system)
        rec = {"name": system.name, "kvstore": system.kvstore, "env": dict(system.env),
               "description": system.description, "rep": rep + 1, "variant": variant["tag"],
               "slow_rank": variant.get("slow_rank"), "run_id": paths["run_id"]}
        why = system.unavailable()
        if why:
            rec.update(available=False, ok=False, reason=why)
            return rec
        rec["available"] = True
        # PS_VERBOSE: native's rank assignment is only in its scheduler's log; mxps's
        # scheduler logs its rendezvous and placement decisions at INFO (for the reader)
        role_env = {"scheduler": {"PS_VERBOSE": "1", "MXPS_LOG_LEVEL": "INFO"}}
        run = _Run(self, system, variant)
        log_dir = paths["log_dir"]
        env = dict(system.env)
        env.update(job_secret_env(system.env))       # never into rec: bench.json is shared
        metrics_files = []
        if is_mxps(system):
            # one JSON line per step and worker (mxps.metrics); the files are appended to
            metrics_files = [paths["metrics"].format(rank=r) for r in range(o.num_workers)]
            for f in metrics_files:
                if os.path.exists(f):
                    os.remove(f)
            env["MXPS_METRICS"] = paths["metrics"]
        if self.topo is not None:
            self.reset_rates()
            before = self.server_counters()
        run.predict_ranks()
        job = jobs.Job(self.job_argv(system), o.num_workers, o.num_servers,
                       env=env, role_env=role_env, topo=self.topo,
                       timeout=o.timeout, log_dir=log_dir, on_poll=run.on_poll)
        try:
            res = job.run()
        finally:
            run.finish()
        after = self.server_counters() if self.topo is not None else None
        rec.update(ok=res.ok, reason=res.reason, wall_seconds=res.wall_seconds,
                   e2e_s=job_e2e_seconds(res.nodes), job_started_at=res.started_at,
                   log_dir=log_dir, clock_started_at=run.clock_started_at)
        if not res.ok:
            rec["failure"] = res.describe()
            return rec
        if run.ranks is None and not run.discover_ranks(job):
            rec.update(ok=False, reason="%s: server ranks unknown: %s" % (
                system.name, "the scheduler wrote no job info at %s (MXPS_JOB_INFO)"
                % job.job_info_path if is_mxps(system) else
                "no 'assign rank' lines for every server in ps-lite's scheduler log %s "
                "(PS_VERBOSE=1)" % job.node("sched").err_path))
            return rec
        workers = []
        for n in res.workers:
            lines = [ln for ln in n.read("out").splitlines() if ln.startswith("{")]
            if not lines:
                rec.update(ok=False, reason="%s wrote no result line" % n.name)
                return rec
            d = json.loads(lines[-1])
            d["node"] = n.name
            workers.append(d)
        rec["workers"] = workers
        if self.expected_sizes is not None and workers[0]["param_sizes"] != self.expected_sizes:
            rec.update(ok=False, reason="the job's parameter sizes (BENCH_PARAMS) differ from "
                       "those --slow-rank %s was resolved from: %s, not %s"
                       % (o.slow_rank, workers[0]["param_sizes"], self.expected_sizes))
            return rec
        rec["server_ranks"] = [{"rank": i, "addr": a, "node": nd} for i, (a, nd) in
                               enumerate(zip(run.ranks or [], run.rank_nodes or []))]
        rec["rank_source"] = run.rank_source
        rec["scenario_applied_at"] = run.scenario_applied_at
        rec["rate_log"] = run.rate_log
        rec["rate_events"] = [[t, ch] for t, ch in run.rate_events]
        try:
            rec.update(step_summary(workers))
        except BenchError as exc:
            rec.update(ok=False, reason=str(exc))
            return rec
        rec["compute_seconds"] = [t for w in workers for t in w.get("compute_seconds", [])]
        t0, t1 = rec["window"]
        # moves of the slow link the timed steps saw (the first rates were set before them)
        rec["moves"] = sum(1 for t, _ in run.rate_events if t0 < t <= t1)
        self._cpu_stats(rec, res, workers)
        if self.topo is not None:
            rec["qdisc_before"], rec["qdisc_after"] = before, after
            rec["qdisc_samples"] = [[t, c] for t, c in run.samples]
            self._byte_stats(rec, workers, run, before, after)
        if metrics_files:
            self._follow_stats(rec, res, metrics_files, paths["shares_png"])
            rec["ltp"] = ltp_stats(paths["metrics"], o.num_servers, o.num_workers)
        return rec

    def server_rates_at(self, rec, t):
        """Each server rank's rate (Mbit/s, the lower of up/down; inf if unshaped) in force at
        wall time ``t``: the base rate, then the rate changes applied up to ``t``."""
        nodes = [x["node"] for x in rec["server_ranks"]]
        cur = {n: self.o.rate for n in nodes}
        for wall, ch in rec.get("rate_events", []):
            if wall > t:
                break
            for n, (up, down) in ch.items():
                if n in cur:
                    vals = [v for v in (up, down) if v is not None]
                    cur[n] = min(vals) if vals else float("inf")
        return [cur[n] for n in nodes]

    def _follow_stats(self, rec, res, metrics_files, png):
        """Shares per step (worker rank 0's metrics) against the rate-proportional targets."""
        t_ref = rec["job_started_at"]
        follow = {"tolerance": FOLLOW_TOLERANCE, "metrics_files": metrics_files,
                  "steps_after_change": [], "changes": [], "shares_png": None}
        rec["follow"] = follow
        present = [f for f in metrics_files if os.path.exists(f)]
        follow["metrics_files_found"] = len(present)
        lines = read_metrics(metrics_files[0]) if metrics_files[0] in present else []
        if not lines:
            follow["error"] = "worker rank 0 wrote no metrics lines (%s)" % metrics_files[0]
            return
        ends = step_ends_by_rank(res.workers).get(0, {})
        steps = []
        for x in lines:
            # training step j (1-based, warm-up included) is BENCH_STEP j-1 of rank 0; its
            # duration from the step ends (the metrics' step_seconds leave out the re-plan
            # barrier and are null for some steps)
            t_end, t_prev = ends.get(x["step"] - 1), ends.get(x["step"] - 2)
            steps.append({"step": x["step"], "t": (t_end if t_end is not None else x["wall"]),
                          "wall": x["wall"], "step_seconds": x["step_seconds"],
                          "duration": (t_end - t_prev) if t_end is not None and
                          t_prev is not None else x["step_seconds"],
                          "plan_version": x["plan_version"],
                          "migration_bytes": x.get("migration_bytes", 0),
                          "shares": [sv["share"] for sv in sorted(x["servers"],
                                                                 key=lambda sv: sv["server"])]})
        follow["time_source"] = "rank 0's step ends" if ends else "metrics line wall time"
        sums = [sum(st["shares"]) for st in steps]
        follow["share_sums"] = [min(sums), max(sums)]
        follow["steps"] = len(steps)
        follow["plan_versions"] = sorted({st["plan_version"] for st in steps})
        # a new plan is in force from a step on (the workers switch at its first push): mark
        # it at that step's start, the end of the step before
        follow["plan_changes"] = [a["t"] - t_ref for a, st in zip(steps, steps[1:])
                                  if st["plan_version"] != a["plan_version"]]
        have_rates = self.topo is not None and rec.get("server_ranks") and \
            len(rec["server_ranks"]) == len(steps[0]["shares"])
        if have_rates:
            changes = [(wall, targets(self.server_rates_at(rec, wall)))
                       for wall, _ in rec.get("rate_events", [])]
            res_changes = follow_changes([(st["t"], st["shares"]) for st in steps],
                                         changes, FOLLOW_TOLERANCE)
            for c in res_changes:
                c["t"] -= t_ref
            follow["changes"] = res_changes
            follow["steps_after_change"] = [c["steps"] for c in res_changes]
            last = steps[-1]
            tg = targets(self.server_rates_at(rec, last["t"]))
            follow["final_ratio"] = share_ratio(last["shares"], tg)
        rec["shares_per_step"] = {
            "columns": ["step", "t", "seconds", "plan_version", "migration_bytes", "shares"],
            "rows": [[st["step"], st["t"] - t_ref, st["duration"], st["plan_version"],
                      st["migration_bytes"], st["shares"]] for st in steps]}
        if self.o.plots:
            from . import plot as plotmod
            path = png
            target_steps = []
            if have_rates:
                for wall in [t_ref] + [w for w, _ in rec.get("rate_events", [])]:
                    target_steps.append((max(wall, t_ref) - t_ref,
                                         targets(self.server_rates_at(rec, wall))))
            plotmod.shares_over_time(
                path, title="%s: each server's share of the bytes per step (worker rank 0) "
                            "and the rate-proportional target" % rec["run_id"],
                t=[st["t"] - t_ref for st in steps], shares=[st["shares"] for st in steps],
                step_seconds=[st["duration"] for st in steps],
                targets=target_steps,
                rate_changes=[(w - t_ref, ", ".join(
                    "%s %s" % (n, "%g" % min(v for v in ud if v is not None)
                               if any(v is not None for v in ud) else "unshaped")
                    for n, ud in sorted(ch.items()))) for w, ch in rec.get("rate_events", [])],
                plan_changes=follow["plan_changes"],
                labels=["rank %d (%s)" % (x["rank"], x["node"]) for x in rec["server_ranks"]]
                if have_rates else None)
            follow["shares_png"] = path

    def _cpu_stats(self, rec, res, workers):
        t0, t1 = rec["window"]
        cpu = {}
        total = 0.0
        for n in res.nodes:
            s = n.cpu_seconds_between(t0, t1)
            life = n.cpu[-1][1] if n.cpu else None
            cpu[n.name] = {"role": n.role, "pid": n.pid, "cpu_seconds_window": s,
                           "cpu_share_window": None if s is None else s / (t1 - t0),
                           "cpu_seconds_total": life}
            total += s or 0.0
        rec["cpu"] = cpu
        rec["cpu_per_gb"] = cpu_per_gb(cpu, workers[0]["param_sizes"], len(workers),
                                       rec["timed_steps"])
        rec["cpu_window_seconds"] = t1 - t0
        rec["cpu_machine_share"] = total / (t1 - t0) / (os.cpu_count() or 1)

    def _byte_stats(self, rec, workers, run, before, after):
        from . import jobs
        o = self.o
        sizes = workers[0]["param_sizes"]
        el = predicted_elements(sizes, o.num_servers, self.bigarray_bound())
        nsteps = o.steps
        samples = run.samples + [(time.time(), after)]
        t0, t1 = rec["window"]
        per_rank = []
        for r, node in enumerate(run.rank_nodes or []):
            if node is None:
                continue
            ups = [(t, c[node]["up"]) for t, c in samples]
            downs = [(t, c[node]["down"]) for t, c in samples]
            pred = 4 * o.num_workers * el[r]
            per_rank.append({
                "rank": r, "node": node,
                "in_total": after[node]["down"] - before[node]["down"],
                "out_total": after[node]["up"] - before[node]["up"],
                "in_per_step": (jobs.interpolate(downs, t1) - jobs.interpolate(downs, t0))
                / nsteps,
                "out_per_step": (jobs.interpolate(ups, t1) - jobs.interpolate(ups, t0)) / nsteps,
                "predicted_per_step": pred,
                # init: rank 0 pushes every key once, every worker pulls it once
                "predicted_in_total": 4 * el[r] * (1 + o.num_workers * (o.warmup + o.steps)),
                "predicted_out_total": 4 * el[r] * o.num_workers * (1 + o.warmup + o.steps),
                "predicted_elements": el[r]})
        rec["bytes_per_server"] = per_rank


    # ---- whole run ----------------------------------------------------------------------
    def run(self):
        from . import jobs
        from . import emunet
        o = self.o
        systems = [system_by_name(n) for n in o.systems]
        os.makedirs(o.out_dir, exist_ok=True)
        if o.network == "emunet":
            emunet.check_prerequisites()
            emunet.cleanup_stale(o.netns_prefix)
        variants = self.make_variants()
        self.run_order = plan_runs(systems, variants, o.repeat)
        if o.progress:
            from tqdm import tqdm
            n_avail = sum(1 for _, _, s in self.run_order if not s.unavailable())
            self.pbar = tqdm(total=n_avail * (o.warmup + o.steps), unit="step",
                             desc="mxps bench", file=sys.stderr)
        t_start = time.time()
        try:
            if o.network == "emunet":
                nodes = jobs.node_names(o.num_workers, o.num_servers)
                shape = {"mtu": o.mtu}
                if self.queue_ms() is not None:
                    shape["queue_ms"] = self.queue_ms()
                if o.loss:
                    shape["loss"] = {n: o.loss for n in self.server_nodes()}
                with emunet.Topology(nodes, rates=self.base_rates(),
                                     prefix=o.netns_prefix, **shape) as topo:
                    self.topo = topo
                    self.addresses = {n: topo.addr(n) for n in nodes}
                    for rep, v, s in self.run_order:
                        self._one(rep, v, s)
                    self.topo = None
            else:
                self.addresses = {}
                for rep, v, s in self.run_order:
                    self._one(rep, v, s)
        finally:
            if self.pbar is not None:
                self.pbar.close()
        self.summary = self._summarise(time.time() - t_start)
        return self.summary

    def _one(self, rep, variant, s):
        if self.pbar is not None:
            self.pbar.set_postfix_str("%s %s%s" % (s.name, variant["tag"], " rep %d" % (rep + 1)
                                                   if self.o.repeat > 1 else ""))
        rec = self.run_system(s, variant, rep)
        rec["order"] = len(self.results)
        self.results.append(rec)

    def _summarise(self, wall):
        o = self.o
        ok = [r for r in self.results if r.get("ok")]
        compute = [t for r in ok for t in r.get("compute_seconds", [])]
        compute_s = statistics.median(compute) if compute else None
        model_bytes = ok[0]["workers"][0]["bytes"] if ok else None
        for r in ok:
            if o.network == "emunet" and compute_s is not None:
                srv, wrk = self._average_rates(r)
                r["floor_s"] = floor_seconds(compute_s, model_bytes, o.num_workers, srv, wrk)
                r["floor_rates_mbit"] = {"servers": srv, "workers_min": min(wrk)}
                r["floor_share"] = r["floor_s"] / r["mean_s"]
        rep_speedups(self.results)
        names = list(dict.fromkeys(o.systems))
        variants = [dict(v, systems=aggregate_runs(
            [r for r in self.results if r["variant"] == v["tag"]], names))
            for v in self.variants or []]
        static = [v for v in variants if v["scenario"] == "static"]
        return {
            "version": 2, "options": dataclasses.asdict(o), "wall_seconds": wall,
            "host": {"cpus": os.cpu_count(), "loadavg_end": os.getloadavg()},
            "addresses": getattr(self, "addresses", {}),
            "model": {"name": o.model, "bytes": model_bytes,
                      "param_sizes": ok[0]["workers"][0]["param_sizes"] if ok else None},
            "compute_seconds_median": compute_s,
            "floor_formula": "max(compute, W*M/sum(server rates), M/min(worker rate)), rates "
                             "time-averaged over each run's timed window",
            "slow_ranks": self.slow_ranks,
            "run_order": [[r["rep"], r["variant"], r["name"]] for r in self.results],
            "systems": self.results,
            "variants": variants,
            "over_ranks": mean_over_ranks(static, names) if len(static) > 1 else None}

    def _average_rates(self, rec):
        """Time-averaged server rates and worker rates (Mbit/s, one direction: the lower of
        up/down) over the timed window, from the base rates and the applied rate log."""
        from . import jobs
        o = self.o
        t0, t1 = rec["window"]
        base = {n: o.rate for n in jobs.node_names(o.num_workers, o.num_servers) if n != "sched"}
        changes = sorted(rec.get("rate_log", []))
        pts = 200
        acc = {n: 0.0 for n in base}
        for k in range(pts):
            t = t0 + (t1 - t0) * (k + 0.5) / pts
            cur = dict(base)
            for wall, node, up, down in changes:
                if wall <= t and node in cur:
                    vals = [v for v in (up, down) if v is not None]
                    cur[node] = min(vals) if vals else float("inf")
            for n in acc:
                acc[n] += cur[n] / pts
        srv = [acc["s%d" % i] for i in range(o.num_servers)]
        wrk = [acc["w%d" % i] for i in range(o.num_workers)]
        return srv, wrk


# --------------------------------------------------------------------------- report

def _table(rows, headers):
    """Right-aligned text columns (cells formatted by the caller; the first column left)."""
    from tabulate import tabulate
    return tabulate(rows, headers=headers, disable_numparse=True, stralign="right",
                    colalign=("left",) + ("right",) * (len(headers) - 1))


def _fmt(fmt, value):
    return "-" if value is None else fmt % value


def _speedup_cell(value, rng, repeat):
    if value is None:
        return "-"
    if repeat > 1 and rng:
        return "%.2fx (%.2f-%.2f)" % (value, rng[0], rng[1])
    return "%.2fx" % value


def _moves_cell(moves):
    moves = [m for m in moves if m is not None]
    if not moves:
        return "-"
    return str(moves[0]) if min(moves) == max(moves) else "%d-%d" % (min(moves), max(moves))


def _options_line(o) -> str:
    if o["network"] != "emunet":
        return "loopback (127.0.0.1, no shaping): %d workers x %d servers, %s" % (
            o["num_workers"], o["num_servers"], o["model"])
    sc = "--schedule" if o["schedule"] is not None else o["scenario"]
    text = "scenario %s: %d workers x %d servers, %s, links %g Mbit/s" % (
        sc, o["num_workers"], o["num_servers"], o["model"], o["rate"])
    queue = o.get("queue_ms")
    if queue is None and sc == "incast":
        queue = INCAST_QUEUE_MS
    if queue is not None:
        text += ", switch queue %g ms" % queue
    if o.get("loss"):
        text += ", %g%% loss towards every server" % o["loss"]
    if o.get("mtu", 1500) != 1500:
        text += ", MTU %d" % o["mtu"]
    if sc in ("static", "dynamic"):
        text += ", slow link %g Mbit/s (R/%g)" % (o["rate"] / o["slow_factor"], o["slow_factor"])
    if sc == "static":
        text += " on each server rank of --slow-rank %s in turn" % o["slow_rank"]
    elif sc == "dynamic" and o.get("period_steps") is not None:
        text += ", moving to the next server rank every %d timed steps" % o["period_steps"]
    elif sc == "dynamic":
        text += ", moving to the next server rank every %g s from worker 0's first timed " \
                "step" % o["period"]
    return text


def _variant_title(v, aggs) -> str:
    if v["scenario"] == "static":
        labels = v.get("slow_rank_labels") or []
        title = "static, server rank %d slow%s" % (
            v["slow_rank"], " (%s)" % ", ".join(labels) if labels else "")
    elif v["scenario"] == "dynamic":
        title = "dynamic (moves: how many the timed steps saw; a faster run sees fewer when " \
                "they are timed in seconds)"
    else:
        title = v["tag"]
    base = next((a["baseline"] for a in aggs if a.get("baseline")), None)
    return title + ("; speedup against %s" % base if base else "; no baseline ran")


def _variant_table(v, repeat) -> str:
    headers = ["system", "mean s", "e2e s", "median s", "p90 s", "p99 s"]
    if repeat > 1:
        headers += ["mean min-max", "sd"]
    headers += ["speedup", "vs native", "floor s", "% of floor", "CPU s/GB w", "CPU s/GB s"]
    dynamic = v["scenario"] == "dynamic"
    if dynamic:
        headers.append("moves")
    rows = []
    for a in v["systems"]:
        if not a["ok_runs"]:
            continue
        row = [a["name"] + ("" if a["ok_runs"] == a["runs"] else
                            " (%d/%d ok)" % (a["ok_runs"], a["runs"])),
               "%.3f" % a["mean_s"], _fmt("%.1f", a["e2e_s"]), "%.3f" % a["median_s"],
               "%.3f" % a["p90_s"], _fmt("%.3f", a.get("p99_s"))]
        if repeat > 1:
            row += ["%.3f-%.3f" % (a["mean_s_min"], a["mean_s_max"]),
                    _fmt("%.3f", a["mean_s_stdev"])]
        row += [_speedup_cell(a["speedup"], a["speedup_range"], repeat),
                _speedup_cell(a["speedup_vs_native"], a["speedup_vs_native_range"], repeat),
                _fmt("%.3f", a["floor_s"]),
                _fmt("%.0f%%", None if a["floor_share"] is None else 100 * a["floor_share"])]
        per_gb = a.get("cpu_per_gb") or {}
        row += [_fmt("%.2f", per_gb.get("worker")), _fmt("%.2f", per_gb.get("server"))]
        if dynamic:
            row.append(_moves_cell(a["moves"]))
        rows.append(row)
    return _table(rows, headers)


def _details(runs, cpus) -> List[str]:
    """Bytes per server, shares following the rates and CPU per process of some runs."""
    lines = []
    if runs and runs[0].get("bytes_per_server") is not None:
        lines.append("bytes per server per step, MB into (push) / out of (pull) each server")
        lines.append("(predicted: W x bytes under MXNet's placement, which native-p3 and "
                     "mxps-adaptive do not follow; *: link changed by the scenario)")
        rows = []
        for r in runs:
            changed = {e[1] for e in r.get("rate_log", [])}
            for b in r.get("bytes_per_server", []):
                rows.append([r["name"], b["rank"], b["node"] + ("*" if b["node"] in changed
                                                                else ""),
                             "%.1f" % (b["in_per_step"] / 1e6), "%.1f" % (b["out_per_step"] / 1e6),
                             "%.1f" % (b["predicted_per_step"] / 1e6), r.get("rank_source")])
        lines.append(_table([[str(c) for c in row] for row in rows],
                            ["system", "rank", "node", "in MB", "out MB", "predicted MB",
                             "rank read from"]))
    fol = [r for r in runs if r.get("follow")]
    if fol:
        lines.append("")
        lines.append("shares of the bytes per step vs rate-proportional targets (worker rank "
                     "0's metrics):")
        lines.append("steps after each rate change until within %.0f%% of target (max "
                     "share/target <= %g; never/N: not in the N steps before the next change)"
                     % (100 * (FOLLOW_TOLERANCE - 1), FOLLOW_TOLERANCE))
        rows = []
        for r in fol:
            f = r["follow"]
            if f.get("error"):
                lines.append("%s: %s" % (r["name"], f["error"]))
                continue
            rows.append([r["name"], "[%s]" % ", ".join(
                "never/%d" % c["steps_observed"] if c["steps"] is None else str(c["steps"])
                for c in f["changes"]),
                _fmt("%.2f", f.get("final_ratio")),
                "-".join(str(v) for v in f["plan_versions"])])
        if rows:
            lines.append(_table(rows, ["system", "steps after each change",
                                       "share/target at the end", "plan versions"]))
    runs = [r for r in runs if r.get("cpu")]
    if runs:
        lines.append("")
        lines.append("CPU during the timed steps, %% of one core per process; all: %% of the "
                     "machine's %d cores" % cpus)
        names = [n for n in runs[0]["cpu"]]
        order = {"scheduler": 0, "server": 1, "worker": 2}
        names.sort(key=lambda n: (order.get(runs[0]["cpu"][n]["role"], 3), len(n), n))
        rows = []
        for r in runs:
            shares = [r["cpu"].get(n, {}).get("cpu_share_window") for n in names]
            rows.append([r["name"]] + [_fmt("%.0f", None if s is None else 100 * s)
                                       for s in shares]
                        + ["%.0f%%" % (100 * r["cpu_machine_share"])])
        lines.append(_table(rows, ["system"] + names + ["all"]))
    return lines


def format_table(summary) -> str:
    """The bench's report: the scenario; per variant (static: per slow rank) each system's mean
    step time, end-to-end time, median and p90, speedups and the floor (over reps when
    --repeat); static over several ranks, the mean over ranks; failed runs; then rep 1's bytes
    per server, how the shares followed the rates and CPU per process, per variant."""
    o = summary["options"]
    repeat = o.get("repeat", 1)
    lines = [_options_line(o)]
    mb = summary["model"]["bytes"]
    if mb:
        lines.append("model %.1f MB; compute-only step (median) %s s; %d timed steps per run%s"
                     % (mb / 1e6, _fmt("%.3f", summary["compute_seconds_median"]), o["steps"],
                        "; %d reps, systems interleaved, their order rotated" % repeat
                        if repeat > 1 else ""))
    lines.append("mean s: the job's time for its timed steps / their number (every worker, "
                 "slow steps included); e2e s: launch to exit; speedup: by mean step time, "
                 "against the better of %s%s; %% of floor: floor / mean" % (
                     " and ".join(BASELINES),
                     " (ranges: per-rep ratios)" if repeat > 1 else ""))
    for v in summary["variants"]:
        lines.append("")
        lines.append(_variant_title(v, v["systems"]))
        lines.append(_variant_table(v, repeat))
        for a in v["systems"]:
            if a.get("ltp"):
                x = a["ltp"]
                lines.append("%s: %s of the gradient packets in time; rounds closed: %s" % (
                    a["name"], _fmt("%.1f%%", None if x["delivered"] is None
                                    else 100 * x["delivered"]),
                    ", ".join("%s %d" % kv for kv in sorted(x["closed"].items()))))
                y = x.get("senders")
                if y:
                    lines.append("%s: a worker's I/O thread %s turns, %s CPU s (%s of a core), "
                                 "%s data packets a turn" % (
                                     a["name"], _fmt("%.0f", y["io_turns_mean"]),
                                     _fmt("%.1f", y["io_cpu_s_mean"]),
                                     _fmt("%.0f%%", None if y["io_cpu_share_mean"] is None
                                          else 100 * y["io_cpu_share_mean"]),
                                     _fmt("%.1f", y["data_per_turn"])))
    over = summary.get("over_ranks")
    if over:
        lines.append("")
        lines.append("static, mean over server ranks %s (speedups: mean and minimum over ranks)"
                     % ", ".join(str(r) for r in over[0]["ranks"]))
        rows = [[r["name"], _fmt("%.3f", r["mean_s"]),
                 _fmt("%.2fx", r["speedup_mean"]), _fmt("%.2fx", r["speedup_min"]),
                 _fmt("%.2fx", r["speedup_vs_native_mean"]),
                 _fmt("%.2fx", r["speedup_vs_native_min"])] for r in over]
        lines.append(_table(rows, ["system", "mean s", "speedup", "min", "vs native", "min"]))
    bad = [r for r in summary["systems"] if not r.get("ok")]
    if bad:
        lines.append("")
    for r in bad:
        what = r.get("run_id", r["name"])
        if not r.get("available", True):
            lines.append("%s: not available: %s" % (what, r["reason"]))
        else:
            lines.append("%s: FAILED: %s" % (what, r["reason"]))
    for v in summary["variants"]:
        runs = [r for r in summary["systems"] if r.get("ok") and r.get("variant") == v["tag"]
                and r.get("rep", 1) == 1]
        if runs:
            lines.append("")
            lines.append("--- %s, rep 1 ---" % v["tag"])
            lines += _details(runs, summary["host"]["cpus"] or 0)
    return "\n".join(lines)


def _plot_name(base, v, variants):
    return "%s.png" % base if len(variants) == 1 else "%s-%s.png" % (base, path_part(v["tag"]))


def plot(summary, out_dir):
    """Per variant, rep 1: step times over wall time per system, bytes into each server per
    step (``step_times[-<variant>].png``, ``bytes_per_server[-<variant>].png``)."""
    from . import jobs
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    paths = []
    for v in summary["variants"]:
        ok = [r for r in summary["systems"] if r.get("ok") and r.get("variant") == v["tag"]
              and r.get("rep", 1) == 1]
        if not ok:
            continue
        fig, axes = plt.subplots(len(ok), 1, figsize=(9, 2.8 * len(ok)), squeeze=False)
        for ax, r in zip(axes[:, 0], ok):
            t_ref = r["job_started_at"]
            for w in r["workers"]:
                ax.plot([t - t_ref for t in w["step_end_abs"]], w["step_seconds"], ".-",
                        label=w["node"], alpha=0.7)
            for wall, node, up, down in r.get("rate_log", []):
                ax.axvline(wall - t_ref, color="red", ls="--", lw=0.8)
                ax.annotate("%s %s" % (node, "%g" % up if up else "unshaped"),
                            (wall - t_ref, ax.get_ylim()[1]), fontsize=7, color="red",
                            rotation=90, va="top")
            ax.axhline(r["mean_s"], color="black", ls="-", lw=0.8, label="mean")
            if r.get("floor_s"):
                ax.axhline(r["floor_s"], color="gray", ls=":", label="floor")
            ax.set_title("%s, %s: step time over wall time" % (r["name"], v["tag"]), fontsize=9)
            ax.set_xlabel("seconds since job start")
            ax.set_ylabel("s/step")
            ax.legend(fontsize=7, loc="upper right")
        fig.tight_layout()
        p = os.path.join(out_dir, _plot_name("step_times", v, summary["variants"]))
        fig.savefig(p, dpi=90)
        plt.close(fig)
        paths.append(p)
        have_bytes = [r for r in ok if r.get("qdisc_samples")]
        if not have_bytes:
            continue
        fig, axes = plt.subplots(len(have_bytes), 1, figsize=(9, 2.8 * len(have_bytes)),
                                 squeeze=False)
        for ax, r in zip(axes[:, 0], have_bytes):
            w0 = r["workers"][0]
            bounds = [w0["step_start_abs"][0]] + w0["step_end_abs"]
            for b in r["bytes_per_server"]:
                pts = [(t, c[b["node"]]["down"]) for t, c in r["qdisc_samples"]] + \
                      [(r["window"][1] + 60, r["qdisc_after"][b["node"]]["down"])]
                vals = [jobs.interpolate(pts, t) for t in bounds]
                per = [(vals[i + 1] - vals[i]) / 1e6 for i in range(len(vals) - 1)]
                ax.plot(range(1, len(per) + 1), per, "o-",
                        label="rank %d (%s)" % (b["rank"], b["node"]))
                ax.axhline(b["predicted_per_step"] / 1e6, ls=":", lw=0.8,
                           color=ax.lines[-1].get_color())
            ax.set_title("%s, %s: bytes into each server per step (dotted: MXNet placement "
                         "prediction)" % (r["name"], v["tag"]), fontsize=9)
            ax.set_xlabel("timed step (worker 0)")
            ax.set_ylabel("MB")
            ax.legend(fontsize=7)
        fig.tight_layout()
        p = os.path.join(out_dir, _plot_name("bytes_per_server", v, summary["variants"]))
        fig.savefig(p, dpi=90)
        plt.close(fig)
        paths.append(p)
    return paths


# --------------------------------------------------------------------------- command line

def add_arguments(p: argparse.ArgumentParser):
    p.add_argument("--network", choices=("emunet", "loopback"), default="emunet",
                   help="emunet: namespaces with shaped links (root); loopback: 127.0.0.1, "
                        "no shaping")
    p.add_argument("--scenario", choices=SCENARIOS, default="static")
    p.add_argument("--schedule", metavar="FILE",
                   help="JSON [[t, {node|rank:N: Mbit/s}], ...]; replaces the scenario")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help="comma-separated, from: %s (NAME:VAR=VALUE adds settings; "
                        "NAME:MXPS_SECRET= runs it without the job secret)"
                        % ", ".join(s.name for s in SYSTEMS))
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="run everything N times, the systems interleaved and their order "
                        "rotated per rep; the report gives mean, min-max and stdev over reps")
    p.add_argument("-n", "--num-workers", type=int, default=4)
    p.add_argument("-s", "--num-servers", type=int, default=4)
    p.add_argument("--model", choices=MODELS, default="resnet18_v1")
    p.add_argument("--mlp-hidden", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps per run (default %d; dynamic: %d, or with --period-steps "
                        "P: max(4P, 3P + 3))" % (DEFAULT_STEPS, DEFAULT_DYNAMIC_STEPS))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--compute-steps", type=int, default=3,
                   help="compute-only steps per worker (for the floor)")
    p.add_argument("--rate", type=float, default=400.0, help="link rate R, Mbit/s")
    p.add_argument("--slow-factor", type=float, default=4.0, help="k: the slow link is R/k")
    p.add_argument("--slow-rank", default="all",
                   help="static: the server rank made slow, 'heaviest' / 'lightest' (most / "
                        "fewest bytes under MXNet's placement), a comma list of those, or "
                        "'all' (default): the scenario runs once per rank")
    p.add_argument("--period", type=float, default=None, metavar="SECONDS",
                   help="dynamic: the slow link moves to the next server rank every SECONDS "
                        "(default %g), from worker 0's first timed step; a faster system sees "
                        "fewer moves in its --steps" % DEFAULT_PERIOD_SECONDS)
    p.add_argument("--period-steps", type=int, default=None, metavar="P",
                   help="dynamic: move the slow link after every P timed steps of worker 0 "
                        "instead (every system sees the same moves at the same steps), until 3 "
                        "steps before the end; the run has max(4P, 3P + 3) timed steps unless "
                        "--steps is given (at least 3P + 3: three moves)")
    p.add_argument("--loss", type=float, default=0.0, metavar="PCT",
                   help="random loss, percent of the packets towards every server (an nft rule "
                        "in the switch; every scenario)")
    p.add_argument("--queue-ms", type=float, default=None, metavar="MS",
                   help="switch queue per port, ms at the link rate (default: emunet's 50 ms; "
                        "incast %g ms)" % INCAST_QUEUE_MS)
    p.add_argument("--mtu", type=int, default=1500, help="MTU of every link (9000: jumbo)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    p.add_argument("--out-dir", default="mxps-bench-out")
    p.add_argument("--netns-prefix", default="mxps-", help=argparse.SUPPRESS)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--quick", action="store_true",
                   help="2 workers x 2 servers, a small MLP, few steps (static on both ranks: "
                        "< 3 min; with --scenario dynamic %d steps, a move every %g s)"
                        % (DEFAULT_DYNAMIC_STEPS, DEFAULT_PERIOD_SECONDS))


def _check_systems(names):
    """Every name is a system; no two runs share a name or, once sanitised, a file name."""
    for s in names:
        system_by_name(s)
    seen = {}
    for s in names:
        other = seen.setdefault(path_part(s), s)
        if other != s or names.count(s) > 1:
            raise BenchError("--systems names %s twice%s: give every system once, with "
                             "distinct settings" % (s, "" if other == s else
                                                    " (as %r, in file names)" % other))


def options_from_args(a) -> Options:
    o = Options(network=a.network, scenario=a.scenario,
                systems=[s.strip() for s in a.systems.split(",") if s.strip()],
                num_workers=a.num_workers, num_servers=a.num_servers, model=a.model,
                mlp_hidden=a.mlp_hidden, batch_size=a.batch_size, image_size=a.image_size,
                steps=DEFAULT_STEPS if a.steps is None else a.steps, warmup=a.warmup,
                compute_steps=a.compute_steps, rate=a.rate,
                slow_factor=a.slow_factor, slow_rank=a.slow_rank, period=a.period,
                period_steps=a.period_steps, repeat=a.repeat,
                loss=a.loss, queue_ms=a.queue_ms, mtu=a.mtu,
                timeout=a.timeout, out_dir=a.out_dir, netns_prefix=a.netns_prefix,
                progress=not a.no_progress, plots=not a.no_plots)
    if a.quick:
        # quick values replace the defaults only: explicit options still win
        quick = dict(num_workers=2, num_servers=2, model="mlp", mlp_hidden=512, warmup=2,
                     compute_steps=2, timeout=120.0)
        default = Options()
        for k, v in quick.items():
            if getattr(o, k) == getattr(default, k):
                setattr(o, k, v)
    if a.schedule:
        try:
            with open(a.schedule) as f:
                o.schedule = json.load(f)
            assert isinstance(o.schedule, list)
            for t, ch in o.schedule:
                assert isinstance(ch, dict)
        except (OSError, ValueError, AssertionError, TypeError) as exc:
            raise BenchError("--schedule %s: expected a JSON list of [t, {node: Mbit/s}] "
                             "(%s)" % (a.schedule, exc)) from None
    dynamic = o.scenario == "dynamic" and o.schedule is None and o.network == "emunet"
    if (o.period is not None or o.period_steps is not None) and not dynamic:
        raise BenchError("--period and --period-steps move the slow link of --scenario dynamic "
                         "(on --network emunet, without --schedule)")
    if o.period is not None and o.period_steps is not None:
        raise BenchError("dynamic: give --period SECONDS or --period-steps P, not both")
    if dynamic and o.period_steps is not None:
        if o.period_steps < 1:
            raise BenchError("--period-steps must be at least 1")
        if a.steps is None:
            o.steps = max(4 * o.period_steps, 3 * o.period_steps + 3)
        elif o.steps < 3 * o.period_steps + 3:
            raise BenchError("dynamic: --steps %d gives fewer than 3 moves of the slow link "
                             "with --period-steps %d; use --steps %d or more (or a smaller "
                             "--period-steps)" % (o.steps, o.period_steps,
                                                  3 * o.period_steps + 3))
    elif dynamic:
        if o.period is None:
            o.period = DEFAULT_PERIOD_SECONDS
        if o.period <= 0:
            raise BenchError("--period must be positive seconds")
        if a.steps is None:
            o.steps = DEFAULT_DYNAMIC_STEPS
    _check_systems(o.systems)
    if not o.systems:
        raise BenchError("--systems names no system")
    if o.num_workers < 1 or o.num_servers < 1 or o.steps < 1:
        raise BenchError("need at least 1 worker, 1 server and 1 step")
    if o.repeat < 1:
        raise BenchError("--repeat must be at least 1")
    if o.rate <= 0 or o.slow_factor <= 0:
        raise BenchError("--rate and --slow-factor must be positive")
    if not 0 <= o.loss < 100:
        raise BenchError("--loss %g: a percentage in [0, 100)" % o.loss)
    if (o.loss or o.queue_ms is not None or o.mtu != 1500 or o.scenario == "incast") and \
            o.network != "emunet":
        raise BenchError("--loss, --queue-ms, --mtu and --scenario incast shape the emulated "
                         "network (--network emunet)")
    if o.queue_ms is not None and o.queue_ms <= 0:
        raise BenchError("--queue-ms must be positive")
    if o.scenario == "static":
        parse_slow_ranks(o.slow_rank, o.num_servers)
    return o


def main(a) -> int:
    from . import jobs
    from . import emunet
    try:
        opts = options_from_args(a)
        bench = Bench(opts)
        summary = bench.run()
    except (BenchError, emunet.EmunetError, jobs.JobError) as exc:
        sys.stderr.write("mxps bench: %s\n" % exc)
        return 2
    path = os.path.join(opts.out_dir, "bench.json")
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
    plots = plot(summary, opts.out_dir) if opts.plots else []
    print(format_table(summary))
    plots += [r["follow"]["shares_png"] for r in summary["systems"]
              if r.get("follow", {}).get("shares_png")]
    print("\nraw data: %s%s" % (path, "".join("\nplot: " + p for p in plots)))
    failed = [r for r in summary["systems"] if r.get("available", True) and not r.get("ok")]
    for r in failed:
        sys.stderr.write("\n%s failed: %s\n%s\n" % (r.get("run_id", r["name"]), r["reason"],
                                                    r.get("failure", "")))
    return 1 if failed else 0
