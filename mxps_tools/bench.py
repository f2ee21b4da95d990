"""``mxps bench``: native dist_sync and mxps side by side on an emulated heterogeneous network.

One invocation builds one ``emunet.Topology`` (namespaces ``sched``, ``s0..``, ``w0..``; every
server and worker link shaped both ways with tbf at ``--rate`` Mbit/s; the scheduler's link,
which carries only control traffic, unshaped) and runs every system in turn on it with the same
model, data and seeds (``mxps_tools/bench_job.py``, one process per node, ``mxps_tools.jobs``).

Scenarios (applied as soon as the scheduler has ranked the servers, i.e. before the first step):

- ``homogeneous``: every link at R.
- ``static``: server *rank* ``--slow-rank`` at R/k (k = ``--slow-factor``).
- ``dynamic``: the slow link moves to the next server rank every ``--period-steps`` P timed
  steps (default 8) of worker 0: the bench applies each move when worker 0 reports the step
  (``BENCH_STEP``), so every system, however fast, sees the same moves at the same steps; the
  run has max(4P, 3P + 3) timed steps unless ``--steps`` is given (at least 3P + 3).  Moves
  stop 3 steps before the end, so that the metrics show a step after each (a worker writes a
  step's line when the next-but-one step starts: the last two steps have none).
  ``--period SECONDS`` instead moves it every that many seconds from the start (the run still
  ends after ``--steps`` steps, so a fast system may see fewer moves, and moves during the
  start-up are seen by no step).
- ``--schedule FILE``: a JSON list of ``[t, {node: rate}]`` (t seconds from that moment; node a
  topology name such as ``s1``/``w0`` or ``rank:N`` for server rank N; rate Mbit/s, a
  ``[up, down]`` pair, or null for unshaped).

Which server has which rank is read from the job, never assumed from start order: mxps's
scheduler writes the job's ranks as data (``MXPS_JOB_INFO``, a JSON file in the job's log dir:
each server's rank, host, port and pid); native ps-lite's only record of its assignment is its
scheduler's log (``PS_VERBOSE=1``: ``assign rank=<id> to node role=server, ip=...``, server rank
= (id - 8) / 2).  Both order servers by address; the mapping and its source are reported per
system.

The bandwidth-optimal bound per step is ``compute + max(W*M / sum of server rates, M / worker
rate)``, M the model's bytes: with full-duplex links each direction (push, pull) carries W*M over
the servers' links and M over each worker's link, and no placement can do better than spreading
that in proportion to server rates.  ``compute`` is measured in the same jobs: before the
rendezvous, every worker times ``--compute-steps`` steps of a private copy of the model with no
kvstore (same data, optimizer, and the same W processes competing for the CPU); the median over
workers and systems is used.

Shares following the rates (mxps systems): every mxps job runs with ``MXPS_METRICS`` set, so each
worker writes one JSON line per step (``mxps.metrics``) to
``metrics-<scenario>-<system>-<rank>.jsonl`` in ``--out-dir``.  From worker rank 0's lines the
bench draws ``shares-<scenario>-<system>.png`` (each server's share of the step's bytes against
seconds since the job's start, the rate-proportional target share r_s / sum of server rates of
the rates in force dashed, rate changes and plan-version changes marked; step seconds below) and
adds a ``follow`` record to the system: for every rate change after the first, how many steps
after it the shares came within ``FOLLOW_TOLERANCE`` of the targets (max over servers of share /
target <= 1.15; step 1 is the first step that ends after the change; null if never before the
next change or the end of the run).  A step's time is when the rank-0 worker finished it
(its ``BENCH_STEP`` line), on the same clock as the rate changes.

Outputs in ``--out-dir``: ``bench.json`` (every raw step time, the rates applied, tc counters per
server before/after and sampled during each run, the predicted bytes per server under MXNet's
placement, CPU per process, the follow records), ``step_times.png``, ``bytes_per_server.png``,
and per mxps system the metrics files and ``shares-<scenario>-<system>.png``.
"""
import argparse
import ipaddress
import dataclasses
import json
import os
import re
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

from . import jobs

#: The benchmark's training job ships inside the package: ``python -m mxps_tools.bench_job``.
BENCH_JOB = ["-m", "mxps_tools.bench_job"]
MODELS = ("resnet18_v1", "alexnet", "vgg11", "mlp")
SCENARIOS = ("homogeneous", "static", "dynamic")
QDISC_SAMPLE_SECONDS = 0.5
#: A server is "following" when its share of the step's bytes is at most this times its target.
FOLLOW_TOLERANCE = 1.15
#: dynamic scenario: timed steps between moves of the slow link, unless --period (seconds)
DEFAULT_PERIOD_STEPS = 8


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
    System("mxps-default", "mxps", {}, "mxps with MXNet's placement rule"),
    System("mxps-adaptive", "mxps", {"MXPS_PLAN": "adaptive"},
           "mxps with bandwidth-aware placement (issue #4)"),
]


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


# --------------------------------------------------------------------------- rank discovery

_NATIVE_ASSIGN = re.compile(r"assign rank=(\d+) to node role=server, ip=([0-9.]+), port=(\d+)")


def native_server_ranks_from_log(sched_log: str, num_servers: int) -> Optional[List[str]]:
    """Native ps-lite's server addresses ``host:port`` in rank order, from its scheduler's log
    (``PS_VERBOSE=1``), or None before the ranks 0..num_servers-1 are all logged.

    The log is the only place ps-lite tells which server got which rank (it has no other
    output); mxps's scheduler writes its ranks as data instead (``server_ranks_from_job_info``).
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


def bound_seconds(compute_s, model_bytes, num_workers, server_mbit, worker_mbit, directions=1):
    """compute + directions * max(W*M / sum(server rates), M / slowest worker rate).

    ``directions=1``: push and pull overlap perfectly on full-duplex links (the strict lower
    bound); ``directions=2``: push, then pull (what a step costs when one key dominates, since a
    key's pull waits for every push of it).  Rates in Mbit/s."""
    bps = lambda mbit: mbit * 1e6 / 8.0   # noqa: E731
    comm = max(num_workers * model_bytes / sum(bps(r) for r in server_mbit),
               model_bytes / bps(min(worker_mbit)))
    return compute_s + directions * comm


def p90(xs) -> float:
    """The 90th percentile, interpolated linearly between the closest ranks (numpy's default)."""
    xs = list(xs)
    if len(xs) < 2:
        return xs[0] if xs else float("nan")
    return statistics.quantiles(xs, n=10, method="inclusive")[-1]


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


# --------------------------------------------------------------------------- one system run

class _Run:
    """Follows one system's job: progress, rank discovery, scenario, tc counter samples."""

    def __init__(self, bench, system):
        self.b = bench
        self.system = system
        self.ranks = None              # server addresses in rank order
        self.rank_nodes = None         # node name per server rank
        self.rank_source = None
        self.scenario_applied_at = None
        self.schedule = None           # the scenario's timed schedule (None: not applied yet)
        self._schedules = []           # (RateSchedule, its events sorted by time)
        self.step_events = []          # (timed steps of worker 0 done, {node: rate}) pending
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
        if self.param_sizes is None or b.pbar is not None or self.step_events:
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
        self._fire_step_events()

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
        b = self.b
        events = b.scenario_events(self)
        self.step_events = b.scenario_step_events(self)
        self.scenario_applied_at = time.time()
        if events:
            self.schedule = self._start_schedule(events)

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
        if errors:
            raise BenchError("rate schedule failed: %s" % errors[0])


# --------------------------------------------------------------------------- the benchmark

@dataclasses.dataclass
class Options:
    network: str = "emunet"          # emunet | loopback
    scenario: str = "static"
    systems: List[str] = dataclasses.field(
        default_factory=lambda: ["native", "mxps-default", "mxps-adaptive"])
    num_workers: int = 4
    num_servers: int = 4
    model: str = "resnet18_v1"
    mlp_hidden: int = 4096
    batch_size: int = 16
    image_size: int = 32
    steps: int = 8
    warmup: int = 2
    compute_steps: int = 3
    rate: float = 400.0
    slow_factor: float = 4.0
    slow_rank: str = "0"             # a rank, or "heaviest" (most bytes under MXNet's rule)
    period: Optional[float] = None   # dynamic: seconds between moves; None: by steps
    period_steps: int = DEFAULT_PERIOD_STEPS
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

    # ---- network ------------------------------------------------------------------------
    def server_nodes(self):
        return ["s%d" % i for i in range(self.o.num_servers)]

    def server_counters(self):
        out = {}
        for n in self.server_nodes():
            st = self.topo.qdisc_stats(n)
            out[n] = {"up": st["up"]["bytes"], "down": st["down"]["bytes"]}
        return out

    def base_rates(self):
        r = {n: self.o.rate for n in jobs.node_names(self.o.num_workers, self.o.num_servers)}
        r["sched"] = None
        return r

    def reset_rates(self):
        for n, r in self.base_rates().items():
            self.topo.set_rate(n, r)

    def scenario_events(self, run: _Run):
        o = self.o
        if o.schedule is not None:
            return [(float(t), {run.node_of(n): r for n, r in ch.items()})
                    for t, ch in o.schedule]
        if o.scenario == "homogeneous":
            return []
        slow = o.rate / o.slow_factor
        if o.scenario == "static":
            return [(0.0, {run.rank_nodes[self.slow_rank(run)]: slow})]
        if o.period is None:      # step-driven: the first rates now, the moves by steps
            return [(0.0, self._dynamic_move(run, 0))]
        events, i = [], 0
        while i * o.period <= o.timeout:
            events.append((i * o.period, self._dynamic_move(run, i)))
            i += 1
        return events

    def scenario_step_events(self, run: _Run):
        """dynamic without --period: [(timed steps of worker 0 done, {node: rate})], the
        slow link's moves after every --period-steps timed steps."""
        o = self.o
        if o.schedule is not None or o.scenario != "dynamic" or o.period is not None:
            return []
        P = o.period_steps
        return [(i * P, self._dynamic_move(run, i)) for i in range(1, (o.steps - 3) // P + 1)]

    def _dynamic_move(self, run: _Run, i):
        """The i-th rates of the dynamic scenario: server rank i mod S slow, the previous one
        back at the full rate."""
        o = self.o
        S = o.num_servers
        ch = {run.rank_nodes[i % S]: o.rate / o.slow_factor}
        if i and S > 1:
            ch[run.rank_nodes[(i - 1) % S]] = o.rate
        return ch

    def slow_rank(self, run: _Run):
        if self.o.slow_rank != "heaviest":
            r = int(self.o.slow_rank)
            if not 0 <= r < self.o.num_servers:
                raise BenchError("--slow-rank %d: the job has servers 0..%d"
                                 % (r, self.o.num_servers - 1))
            return r
        if run.param_sizes is None:
            return 0
        el = predicted_elements(run.param_sizes, self.o.num_servers, self.bigarray_bound())
        return max(range(len(el)), key=lambda i: el[i])

    @staticmethod
    def bigarray_bound():
        return int(os.environ.get("MXNET_KVSTORE_BIGARRAY_BOUND", 1000 * 1000))

    # ---- jobs ---------------------------------------------------------------------------
    def job_argv(self, system):
        o = self.o
        return BENCH_JOB + ["--kvstore", system.kvstore, "--model", o.model,
                "--mlp-hidden", o.mlp_hidden, "--batch-size", o.batch_size,
                "--image-size", o.image_size, "--steps", o.steps, "--warmup", o.warmup,
                "--compute-steps", o.compute_steps, "--progress"]

    def run_system(self, system: System):
        o = self.o
        rec = {"name": system.name, "kvstore": system.kvstore, "env": dict(system.env),
               "description": system.description}
        why = system.unavailable()
        if why:
            rec.update(available=False, ok=False, reason=why)
            return rec
        rec["available"] = True
        # PS_VERBOSE: native's rank assignment is only in its scheduler's log; mxps's
        # scheduler logs its rendezvous and placement decisions at INFO (for the reader)
        role_env = {"scheduler": {"PS_VERBOSE": "1", "MXPS_LOG_LEVEL": "INFO"}}
        run = _Run(self, system)
        log_dir = os.path.join(o.out_dir, "logs", system.name)
        env = dict(system.env)
        metrics_files = []
        if is_mxps(system):
            # one JSON line per step and worker (mxps.metrics); the files are appended to
            pattern = os.path.join(os.path.abspath(o.out_dir), "metrics-%s-%s-{rank}.jsonl"
                                   % (self.scenario_tag(), system.name))
            metrics_files = [pattern.format(rank=r) for r in range(o.num_workers)]
            for f in metrics_files:
                if os.path.exists(f):
                    os.remove(f)
            env["MXPS_METRICS"] = pattern
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
                   job_started_at=res.started_at, log_dir=log_dir)
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
        rec["server_ranks"] = [{"rank": i, "addr": a, "node": nd} for i, (a, nd) in
                               enumerate(zip(run.ranks or [], run.rank_nodes or []))]
        rec["rank_source"] = run.rank_source
        rec["scenario_applied_at"] = run.scenario_applied_at
        rec["rate_log"] = run.rate_log
        rec["rate_events"] = [[t, ch] for t, ch in run.rate_events]
        self._step_stats(rec, workers)
        self._cpu_stats(rec, res, workers)
        if self.topo is not None:
            rec["qdisc_before"], rec["qdisc_after"] = before, after
            rec["qdisc_samples"] = [[t, c] for t, c in run.samples]
            self._byte_stats(rec, workers, run, before, after)
        if metrics_files:
            self._follow_stats(rec, res, metrics_files)
        return rec

    def scenario_tag(self):
        o = self.o
        if o.network != "emunet":
            return "loopback"
        return "schedule" if o.schedule is not None else o.scenario

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

    def _follow_stats(self, rec, res, metrics_files):
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
            path = os.path.join(self.o.out_dir, "shares-%s-%s.png" % (self.scenario_tag(),
                                                                     rec["name"]))
            target_steps = []
            if have_rates:
                for wall in [t_ref] + [w for w, _ in rec.get("rate_events", [])]:
                    target_steps.append((max(wall, t_ref) - t_ref,
                                         targets(self.server_rates_at(rec, wall))))
            plotmod.shares_over_time(
                path, title="%s, %s: each server's share of the bytes per step (worker rank "
                            "0) and the rate-proportional target" % (rec["name"],
                                                                     self.scenario_tag()),
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

    def _step_stats(self, rec, workers):
        steps = [t for w in workers for t in w["step_seconds"]]
        rec["median_s"] = statistics.median(steps)
        rec["p90_s"] = p90(steps)
        rec["window"] = [min(w["step_start_abs"][0] for w in workers),
                         max(w["step_end_abs"][-1] for w in workers)]
        rec["compute_seconds"] = [t for w in workers for t in w.get("compute_seconds", [])]

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
        rec["cpu_window_seconds"] = t1 - t0
        rec["cpu_machine_share"] = total / (t1 - t0) / (os.cpu_count() or 1)

    def _byte_stats(self, rec, workers, run, before, after):
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
        from . import emunet
        o = self.o
        systems = [system_by_name(n) for n in o.systems]
        os.makedirs(o.out_dir, exist_ok=True)
        if o.network == "emunet":
            emunet.check_prerequisites()
            emunet.cleanup_stale(o.netns_prefix)
        if o.progress:
            from tqdm import tqdm
            n_avail = sum(1 for s in systems if not s.unavailable())
            self.pbar = tqdm(total=n_avail * (o.warmup + o.steps), unit="step",
                             desc="mxps bench", file=sys.stderr)
        t_start = time.time()
        try:
            if o.network == "emunet":
                nodes = jobs.node_names(o.num_workers, o.num_servers)
                with emunet.Topology(nodes, rates=self.base_rates(),
                                     prefix=o.netns_prefix) as topo:
                    self.topo = topo
                    self.addresses = {n: topo.addr(n) for n in nodes}
                    for s in systems:
                        self._one(s)
                    self.topo = None
            else:
                self.addresses = {}
                for s in systems:
                    self._one(s)
        finally:
            if self.pbar is not None:
                self.pbar.close()
        self.summary = self._summarise(time.time() - t_start)
        return self.summary

    def _one(self, s):
        if self.pbar is not None:
            self.pbar.set_postfix_str(s.name)
        self.results.append(self.run_system(s))

    def _summarise(self, wall):
        o = self.o
        ok = [r for r in self.results if r.get("ok")]
        compute = [t for r in ok for t in r.get("compute_seconds", [])]
        compute_s = statistics.median(compute) if compute else None
        model_bytes = ok[0]["workers"][0]["bytes"] if ok else None
        native = next((r for r in ok if r["name"] == "native"), None)
        for r in ok:
            r["speedup_vs_native"] = (native["median_s"] / r["median_s"]) if native else None
            if o.network == "emunet" and compute_s is not None:
                srv, wrk = self._average_rates(r)
                r["bound_s"] = bound_seconds(compute_s, model_bytes, o.num_workers, srv, wrk)
                r["bound_serial_s"] = bound_seconds(compute_s, model_bytes, o.num_workers, srv,
                                                    wrk, directions=2)
                r["bound_rates_mbit"] = {"servers": srv, "workers_min": min(wrk)}
                r["bound_share"] = r["bound_s"] / r["median_s"]
        return {
            "version": 1, "options": dataclasses.asdict(o), "wall_seconds": wall,
            "host": {"cpus": os.cpu_count(), "loadavg_end": os.getloadavg()},
            "addresses": getattr(self, "addresses", {}),
            "model": {"name": o.model, "bytes": model_bytes,
                      "param_sizes": ok[0]["workers"][0]["param_sizes"] if ok else None},
            "compute_seconds_median": compute_s,
            "bound_formula": "compute + max(W*M/sum(server rates), M/min(worker rate)) (push and "
                             "pull overlapped; bound_serial_s: x2 for push then pull), rates "
                             "time-averaged over each system's timed window",
            "systems": self.results}

    def _average_rates(self, rec):
        """Time-averaged server rates and worker rates (Mbit/s, one direction: the lower of
        up/down) over the timed window, from the base rates and the applied rate log."""
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


def format_table(summary) -> str:
    """The bench's report: the scenario, then per system step times against the bound, bytes
    per server, how the shares followed the rates, CPU per process (tables)."""
    o = summary["options"]
    emu = o["network"] == "emunet"
    lines = []
    if emu:
        sc = "--schedule" if o["schedule"] is not None else o["scenario"]
        lines.append("scenario %s: %d workers x %d servers, %s, links %g Mbit/s%s%s"
                     % (sc, o["num_workers"], o["num_servers"], o["model"], o["rate"],
                        "" if sc == "homogeneous" else
                        ", slow link %g Mbit/s (R/%g)" % (o["rate"] / o["slow_factor"],
                                                          o["slow_factor"]),
                        "" if sc != "dynamic" else
                        ", moving every %g s" % o["period"] if o.get("period") is not None
                        else ", moving every %d timed steps" % o.get("period_steps", 0)))
    else:
        lines.append("loopback (127.0.0.1, no shaping): %d workers x %d servers, %s"
                     % (o["num_workers"], o["num_servers"], o["model"]))
    mb = summary["model"]["bytes"]
    if mb:
        lines.append("model %.1f MB; compute-only step (median) %s s"
                     % (mb / 1e6, _fmt("%.3f", summary["compute_seconds_median"])))
    ok = [r for r in summary["systems"] if r.get("ok")]
    lines.append("")
    lines.append(_table([[r["name"], "%.3f" % r["median_s"], "%.3f" % r["p90_s"],
                          _fmt("%.2fx", r.get("speedup_vs_native")),
                          _fmt("%.3f", r.get("bound_s")),
                          _fmt("%.0f%%", 100 * r["bound_share"] if r.get("bound_share")
                               else None),
                          _fmt("%.3f", r.get("bound_serial_s"))] for r in ok],
                        ["system", "median s", "p90 s", "speedup", "bound s", "share",
                         "serial s"]))
    for r in summary["systems"]:
        if not r.get("available", True):
            lines.append("%s: not available: %s" % (r["name"], r["reason"]))
        elif not r.get("ok"):
            lines.append("%s: FAILED: %s" % (r["name"], r["reason"]))
    if emu and ok:
        lines.append("")
        lines.append("bytes per server per step, MB into (push) / out of (pull) each server")
        lines.append("(predicted: W x bytes under MXNet's placement; *: link changed by the "
                     "scenario)")
        rows = []
        for r in ok:
            changed = {e[1] for e in r.get("rate_log", [])}
            for b in r.get("bytes_per_server", []):
                rows.append([r["name"], b["rank"], b["node"] + ("*" if b["node"] in changed
                                                                else ""),
                             "%.1f" % (b["in_per_step"] / 1e6), "%.1f" % (b["out_per_step"] / 1e6),
                             "%.1f" % (b["predicted_per_step"] / 1e6), r.get("rank_source")])
        lines.append(_table([[str(c) for c in row] for row in rows],
                            ["system", "rank", "node", "in MB", "out MB", "predicted MB",
                             "rank read from"]))
    fol = [r for r in ok if r.get("follow")]
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
    if ok:
        lines.append("")
        lines.append("CPU during the timed steps, %% of one core per process; all: %% of the "
                     "machine's %d cores" % (summary["host"]["cpus"] or 0))
        names = [n for n in ok[0]["cpu"]]
        order = {"scheduler": 0, "server": 1, "worker": 2}
        names.sort(key=lambda n: (order.get(ok[0]["cpu"][n]["role"], 3), len(n), n))
        rows = []
        for r in ok:
            shares = [r["cpu"].get(n, {}).get("cpu_share_window") for n in names]
            rows.append([r["name"]] + [_fmt("%.0f", None if s is None else 100 * s)
                                       for s in shares]
                        + ["%.0f%%" % (100 * r["cpu_machine_share"])])
        lines.append(_table(rows, ["system"] + names + ["all"]))
    return "\n".join(lines)


def plot(summary, out_dir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [r for r in summary["systems"] if r.get("ok")]
    if not ok:
        return []
    paths = []
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
        if r.get("bound_s"):
            ax.axhline(r["bound_s"], color="gray", ls=":", label="bound")
        ax.set_title("%s: step time over wall time" % r["name"], fontsize=9)
        ax.set_xlabel("seconds since job start")
        ax.set_ylabel("s/step")
        ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    p = os.path.join(out_dir, "step_times.png")
    fig.savefig(p, dpi=90)
    plt.close(fig)
    paths.append(p)
    have_bytes = [r for r in ok if r.get("qdisc_samples")]
    if have_bytes:
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
            ax.set_title("%s: bytes into each server per step (dotted: MXNet placement "
                         "prediction)" % r["name"], fontsize=9)
            ax.set_xlabel("timed step (worker 0)")
            ax.set_ylabel("MB")
            ax.legend(fontsize=7)
        fig.tight_layout()
        p = os.path.join(out_dir, "bytes_per_server.png")
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
    p.add_argument("--systems", default="native,mxps-default,mxps-adaptive",
                   help="comma-separated, from: %s" % ", ".join(s.name for s in SYSTEMS))
    p.add_argument("-n", "--num-workers", type=int, default=4)
    p.add_argument("-s", "--num-servers", type=int, default=4)
    p.add_argument("--model", choices=MODELS, default="resnet18_v1")
    p.add_argument("--mlp-hidden", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps per system (default 8; dynamic: 4 x --period-steps)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--compute-steps", type=int, default=3,
                   help="compute-only steps per worker (for the bound)")
    p.add_argument("--rate", type=float, default=400.0, help="link rate R, Mbit/s")
    p.add_argument("--slow-factor", type=float, default=4.0, help="k: the slow link is R/k")
    p.add_argument("--slow-rank", default="0", help="server rank made slow (static), or "
                   "'heaviest' (most bytes under MXNet's placement)")
    p.add_argument("--period-steps", type=int, default=DEFAULT_PERIOD_STEPS,
                   help="dynamic: the slow link moves to the next server rank after every this "
                        "many timed steps of worker 0 (every system sees the same moves at the "
                        "same steps), until 3 steps before the end; the run has 4x this many "
                        "timed steps (at least 3x + 3: three moves) unless --steps is given")
    p.add_argument("--period", type=float, default=None, metavar="SECONDS",
                   help="dynamic: move the slow link every SECONDS from the job's start instead "
                        "(the run still ends after --steps steps, so a fast system may see "
                        "fewer than 3 moves)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per system")
    p.add_argument("--out-dir", default="mxps-bench-out")
    p.add_argument("--netns-prefix", default="mxps-", help=argparse.SUPPRESS)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--quick", action="store_true",
                   help="2 workers x 2 servers, static, a small MLP, few steps (< 3 min; "
                        "with --scenario dynamic 4 x --period-steps steps)")


def options_from_args(a) -> Options:
    o = Options(network=a.network, scenario=a.scenario,
                systems=[s.strip() for s in a.systems.split(",") if s.strip()],
                num_workers=a.num_workers, num_servers=a.num_servers, model=a.model,
                mlp_hidden=a.mlp_hidden, batch_size=a.batch_size, image_size=a.image_size,
                steps=Options.steps if a.steps is None else a.steps, warmup=a.warmup,
                compute_steps=a.compute_steps, rate=a.rate,
                slow_factor=a.slow_factor, slow_rank=a.slow_rank, period=a.period,
                period_steps=a.period_steps,
                timeout=a.timeout, out_dir=a.out_dir, netns_prefix=a.netns_prefix,
                progress=not a.no_progress, plots=not a.no_plots)
    if a.quick:
        # quick values replace the defaults only: explicit options still win
        quick = dict(num_workers=2, num_servers=2, scenario="static", model="mlp",
                     mlp_hidden=512, steps=8, warmup=2, compute_steps=2, timeout=120.0)
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
    by_steps = o.scenario == "dynamic" and o.schedule is None and o.period is None
    if by_steps:
        if o.period_steps < 1:
            raise BenchError("--period-steps must be at least 1")
        if a.steps is None:
            o.steps = max(4 * o.period_steps, 3 * o.period_steps + 3)
        elif o.steps < 3 * o.period_steps + 3:
            raise BenchError("dynamic: --steps %d gives fewer than 3 moves of the slow link "
                             "with --period-steps %d; use --steps %d or more (or a smaller "
                             "--period-steps)" % (o.steps, o.period_steps,
                                                  3 * o.period_steps + 3))
    if o.period is not None and o.period <= 0:
        raise BenchError("--period must be positive seconds")
    for s in o.systems:
        system_by_name(s)
    if o.num_workers < 1 or o.num_servers < 1 or o.steps < 1:
        raise BenchError("need at least 1 worker, 1 server and 1 step")
    if o.rate <= 0 or o.slow_factor <= 0:
        raise BenchError("--rate and --slow-factor must be positive")
    return o


def main(a) -> int:
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
    for r in summary["systems"]:
        if r.get("available", True) and not r.get("ok"):
            sys.stderr.write("\n%s failed: %s\n%s\n" % (r["name"], r["reason"],
                                                        r.get("failure", "")))
    failed = [r for r in summary["systems"] if r.get("available", True) and not r.get("ok")]
    return 1 if failed else 0
