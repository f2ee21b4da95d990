#!/usr/bin/env python
"""The failure matrix: kill (SIGKILL) or freeze (SIGSTOP) one node of a 2x2 job at a chosen phase
and check how the others end.

Cells are role x phase x signal: the victim is a worker, a server or the scheduler; the phase
is ``before_register`` (the node has not registered yet: it never arrives), ``starting``
(registered, the job not started yet), ``mid_step`` (training), ``migration`` (inside a live
re-plan's migration: a server holds a MIGRATE part) or ``save_states`` (a server is answering
GET_STATES); the signal is ``kill`` or ``stop`` (a frozen peer whose sockets stay open).  The
phases are hit precisely with the test-only switch MXPS_FAULT_POINT (docs/SETTINGS.md): the
chosen node writes a marker file at that point and pauses there, and the harness signals the
victim as soon as the marker appears.

With ``--failover`` the server cells run with MXPS_FAILOVER=1 and MXPS_REPLICA=1 (the optimizer,
SGD with momentum, on the servers; 12 steps): such a trial passes when every survivor exits 0
(the job completed), the workers end with exactly the weights of the same job run without a
fault (run once per matrix), and the failover rebuilt the lost slices within 5 s of finding
the server lost (the job facts' ``failovers``).  Cells ``server/<phase>/<signal>/failover``.

Otherwise a trial passes when every survivor exits on its own with code 3 (EXIT_LOST_PEER), its stderr
names the lost node (its role and pid, the scheduler's address, or the start timeout's list of
who is missing) without a traceback, and within the cell's bound: MXPS_HEARTBEAT_TIMEOUT + 10 s
after the signal once the victim had registered; MXPS_START_TIMEOUT + 10 s for a node that
never arrived (the scheduler's start deadline); for the scheduler lost before anyone registered,
the survivors' own start timeout, which begins after their (slow) MXNet import, so + 30 s.  A
survivor still running 30 s after its bound is a hang.

    python scripts/failure_matrix.py --trials 10 [--cells worker/mid_step/kill,...]
        [--parallel 2] [--out docs/FAILURES.md] [--json results.json]

Every job runs on loopback through the one job runner (``mxps_tools.jobs.Job``) with short
timeouts (MXPS_HEARTBEAT_INTERVAL=0.5, MXPS_HEARTBEAT_TIMEOUT=3; MXPS_START_TIMEOUT=60 in the
cells about it, 150 in the others) and a tiny model (tests/jobs/fault_job.py); tests/test_failures.py runs a subset of the cells.
"""
import argparse
import concurrent.futures
import dataclasses
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from typing import Optional

import numpy as np

from mxps_tools import jobs as runner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAULT_JOB = os.path.join(ROOT, "tests", "jobs", "fault_job.py")

ROLES = ("worker", "server", "scheduler")
PHASES = ("before_register", "starting", "mid_step", "migration", "save_states")
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}

HEARTBEAT_INTERVAL = 0.5
HEARTBEAT_TIMEOUT = 3.0
# MXPS_START_TIMEOUT for the cells about it (a node that never registers, the scheduler lost
# while w1 is on its way): every node imports MXNet (~3 CPU-s) before it registers, and at
# --parallel 4 on 2 cores that is 20 processes at once, ~30 s; 20 s failed in CI
START_TIMEOUT = 60.0
# every other cell's phase comes after all nodes registered: a start deadline is not their point
LATE_START_TIMEOUT = 150.0
TRIGGER_TIMEOUT = 180.0      # for the phase to come (every node imports MXNet first)
HANG_MARGIN = 30.0           # a survivor still running this long after its bound hangs
HOLD_VICTIM = 120.0          # a victim paused at its fault point waits to be signalled
HOLD_MARKER = 1.0            # a non-victim paused at a fault point only marks the moment

BASE_ENV = {
    "FAULT_MODE": "train", "FAULT_STEP_SLEEP": "0.05", "FAULT_READY_STEPS": "2",
    "MXPS_HEARTBEAT_INTERVAL": str(HEARTBEAT_INTERVAL),
    "MXPS_HEARTBEAT_TIMEOUT": str(HEARTBEAT_TIMEOUT),
    "MXPS_TIMEOUT": "",
    "MXPS_FAULT_POINT": "", "MXPS_FAULT_HOLD": "",
}
# a live re-plan at every step that moves state between the servers (as tests/test_replan.py)
REPLAN_ENV = {"MXPS_REPLAN_FORCE": "1", "MXPS_REPLAN_INTERVAL": "1", "MXPS_MIN_SLICE": "4"}
# --failover: the job goes on without the lost server (docs/FAILOVER.md)
FAILOVER_ENV = {"MXPS_FAILOVER": "1", "MXPS_REPLICA": "1", "FAULT_ON_SERVERS": "1",
                "FAULT_MOMENTUM": "0.9", "FAULT_STEPS": "12"}
REBUILD_BOUND = 5.0          # seconds from finding a server lost to its slices rebuilt


@dataclasses.dataclass(frozen=True)
class Cell:
    role: str
    phase: str
    sig: str
    failover: bool = False

    @property
    def name(self):
        return "%s/%s/%s%s" % (self.role, self.phase, self.sig,
                               "/failover" if self.failover else "")

    @classmethod
    def parse(cls, text):
        parts = text.strip().split("/")
        failover = len(parts) == 4 and parts[3] == "failover"
        if failover:
            parts = parts[:3]
        if len(parts) != 3 or parts[0] not in ROLES or parts[1] not in PHASES or \
                parts[2] not in SIGNALS or failover and parts[0] != "server":
            raise ValueError("cell %r: expected role/phase/signal[/failover] with role in %s, "
                             "phase in %s, signal in %s (failover: a server)"
                             % (text, ROLES, PHASES, tuple(SIGNALS)))
        return cls(*parts, failover=failover)

    @property
    def start_timeout(self):
        """MXPS_START_TIMEOUT for the cell's job."""
        if self.phase == "before_register" or (self.phase, self.role) == ("starting",
                                                                           "scheduler"):
            return START_TIMEOUT
        return LATE_START_TIMEOUT

    @property
    def bound(self):
        """Seconds from the signal within which every survivor must have exited."""
        if self.phase == "before_register":
            return START_TIMEOUT + (30.0 if self.role == "scheduler" else 10.0)
        if self.phase == "starting" and self.role == "scheduler":
            return START_TIMEOUT + 10.0     # one worker had not registered yet (see _setup)
        return HEARTBEAT_TIMEOUT + 10.0


def all_cells(failover=False):
    if failover:
        return [Cell("server", p, s, True) for p in PHASES for s in SIGNALS]
    return [Cell(r, p, s) for r in ROLES for p in PHASES for s in SIGNALS]


@dataclasses.dataclass
class Trial:
    cell: Cell
    ok: bool = False
    codes_ok: bool = False       # every survivor exited 3
    named_ok: bool = False       # ... with a message naming the lost node, no traceback
    detection: Optional[float] = None   # seconds from the signal to the last survivor's exit
    hang: bool = False
    setup_failed: bool = False   # the phase never came (not a verdict on detection)
    completed: bool = False      # --failover: every survivor exited 0
    same_weights: bool = False   # ... with the weights of the run without a fault
    rebuild: Optional[float] = None   # ... seconds from finding the server lost to in place
    seconds: float = 0.0
    detail: str = ""


# --------------------------------------------------------------------------------------------
# one trial

def _setup(cell, out):
    """(env, role_env, trigger markers, default victim node name) for a cell."""
    env = dict(BASE_ENV, FAULT_OUT=out, MXPS_FAULT_DIR=out,
               MXPS_START_TIMEOUT=str(cell.start_timeout))
    if cell.failover:
        env.update(FAILOVER_ENV)
    role_env = {}
    victim = {"worker": "w1", "server": "s1", "scheduler": "sched"}[cell.role]

    def pause(node, point, hold):
        role_env[node] = {"MXPS_FAULT_POINT": point, "MXPS_FAULT_HOLD": str(hold)}

    if cell.phase == "before_register" and cell.role != "scheduler":
        pause(victim, "register", HOLD_VICTIM)
        return env, role_env, ["register"], None
    if cell.phase == "before_register":
        return env, role_env, [], victim            # signalled at once: nobody registered
    if cell.phase == "starting" and cell.role != "scheduler":
        pause(victim, "welcome", HOLD_VICTIM)
        return env, role_env, ["welcome"], None
    if cell.phase == "starting":
        # w0 registered (and marks it), w1 still on its way: the scheduler dies in between
        pause("w0", "welcome", 0.01)
        pause("w1", "register", 4.0)
        return env, role_env, ["welcome", "register"], victim
    if cell.phase == "mid_step":
        return env, role_env, ["ready_rank0.json", "ready_rank1.json"], victim
    point = "migrate" if cell.phase == "migration" else "get_states"
    if cell.phase == "migration":
        env.update(REPLAN_ENV)
    else:
        env["FAULT_SAVE_STATES"] = "1"
    # the first server to reach the point marks it; a server victim is that one
    hold = HOLD_VICTIM if cell.role == "server" else HOLD_MARKER
    for s in ("s0", "s1"):
        pause(s, point, hold)
    return env, role_env, [point], None if cell.role == "server" else victim


def _message_re(cell, victim, port):
    if cell.role == "scheduler":
        return r"scheduler\b[^\n]* at 127\.0\.0\.1:%d\b" % port
    if cell.phase == "before_register":
        return r"1 of 2 %ss missing \(DMLC_NUM_%s=2" % (cell.role, cell.role.upper())
    return r"lost %s [0-9?]+ \([^)]*pid %d\)" % (cell.role, victim.pid)


def _marker_victim(job, out, markers):
    """The node that paused at the cell's fault point (its marker names its pid)."""
    with open(os.path.join(out, markers[0])) as f:
        return job.by_pid(json.load(f)["pid"])


def run_trial(cell, keep_logs=False):
    """Run one trial of ``cell``; the Trial (never raises for what the job does)."""
    trial = Trial(cell)
    started = time.monotonic()
    log_dir = tempfile.mkdtemp(prefix="mxps-matrix-%s-" % cell.name.replace("/", "-"))
    out = os.path.join(log_dir, "out")
    os.makedirs(out)
    env, role_env, markers, victim_name = _setup(cell, out)
    job = runner.Job([FAULT_JOB], 2, 2, env=env, role_env=role_env, log_dir=log_dir,
                     cpu_interval=None, timeout=TRIGGER_TIMEOUT + 120)
    try:
        with job:
            _trial(job, cell, trial, out, markers, victim_name)
    except Exception as e:      # the harness's own failure is a failed trial, with the job
        trial.ok = False
        trial.detail = "harness: %s: %s\n%s" % (type(e).__name__, e, job.result.describe(
            tails="all", tail_chars=1500))
    finally:
        trial.seconds = time.monotonic() - started
        if not keep_logs:
            shutil.rmtree(log_dir, ignore_errors=True)
    return trial


def _trial(job, cell, trial, out, markers, victim_name):
    def phase_reached():
        dead = [n for n in job.nodes if n.returncode is not None]
        if dead:
            raise runner.JobError("%s exited (rc=%s) before the phase %s" % (
                dead[0].name, dead[0].returncode, cell.phase))
        return all(os.path.exists(os.path.join(out, m)) for m in markers)

    try:
        job.wait(phase_reached, TRIGGER_TIMEOUT, "phase %s (markers %s)" % (cell.phase, markers))
    except (runner.JobTimeout, runner.JobError) as e:
        trial.setup_failed = True
        trial.detail = "setup: %s\n%s" % (e, job.result.describe(tails="all", tail_chars=1500))
        return
    victim = job.node(victim_name) if victim_name else _marker_victim(job, out, markers)
    signalled = time.monotonic()
    job.kill(victim, SIGNALS[cell.sig])
    survivors = [n for n in job.nodes if n is not victim]
    try:
        job.wait(lambda: all(n.returncode is not None for n in survivors),
                 cell.bound + HANG_MARGIN + (60 if cell.failover else 0),
                 "exit of every survivor")
    except runner.JobTimeout:
        trial.hang = True
    if cell.failover:
        _judge_failover(job, cell, trial, victim, survivors, signalled, out)
    else:
        _judge(job, cell, trial, victim, survivors, signalled)


_REFERENCE = {}
_REFERENCE_LOCK = threading.Lock()


def _weights(out):
    got = []
    for r in (0, 1):
        path = os.path.join(out, "weights_rank%d.npz" % r)
        got.append(dict(np.load(path)) if os.path.exists(path) else None)
    return got


def reference_weights():
    """The weights of the --failover job run without a fault (once per process)."""
    with _REFERENCE_LOCK:
        if "w" not in _REFERENCE:
            log_dir = tempfile.mkdtemp(prefix="mxps-matrix-reference-")
            out = os.path.join(log_dir, "out")
            os.makedirs(out)
            env = dict(BASE_ENV, FAULT_OUT=out, MXPS_START_TIMEOUT=str(LATE_START_TIMEOUT),
                       **FAILOVER_ENV)
            try:
                result = runner.Job([FAULT_JOB], 2, 2, env=env, log_dir=log_dir,
                                    cpu_interval=None, timeout=TRIGGER_TIMEOUT + 120).run()
                if not result.ok:
                    raise RuntimeError("the reference job failed: %s" % result.describe(
                        tails="all", tail_chars=1500))
                _REFERENCE["w"] = _weights(out)
            finally:
                shutil.rmtree(log_dir, ignore_errors=True)
        return _REFERENCE["w"]


def _judge_failover(job, cell, trial, victim, survivors, signalled, out):
    problems = []
    times = []
    for n in survivors:
        if n.returncode is None:
            problems.append("%s still running" % n.name)
            continue
        times.append(n.exited_at - signalled)
        if n.returncode != 0:
            problems.append("%s exited %s, not 0" % (n.name, n.returncode))
    trial.detection = max(times) if times else None     # here: the job's end after the signal
    trial.completed = not problems
    ref, got = reference_weights(), _weights(out)
    same = all(g is not None and sorted(g) == sorted(r) and all(
        np.array_equal(g[k], r[k]) for k in r) for g, r in zip(got, ref))
    trial.same_weights = same
    if not same:
        diff = [(k, float(np.abs(g[k] - r[k]).max())) for g, r in zip(got, ref)
                if g is not None for k in r]
        problems.append("weights differ from the run without a fault: %s" % (diff or "missing"))
    info = runner.read_job_info(os.path.join(job.result.log_dir, "job-info.json")) or {}
    fos = info.get("failovers") or []
    if not fos:
        problems.append("the job facts record no failover")
    for fo in fos:
        if fo.get("server") is not None:
            if fo.get("in_place_at") is None:
                problems.append("the failover of server %s never was in place" % fo["server"])
                continue
            trial.rebuild = max(trial.rebuild or 0.0, fo["in_place_at"] - fo["detected_at"])
            if trial.rebuild > REBUILD_BOUND:
                problems.append("the failover took %.1f s (bound %.0f s)"
                                % (trial.rebuild, REBUILD_BOUND))
    trial.ok = not problems
    if problems:
        trial.detail = "%s (victim %s pid %d): %s\n%s" % (
            cell.name, victim.name, victim.pid, "; ".join(problems),
            job.result.describe(since=signalled, tails="all", tail_chars=1500))


def _judge(job, cell, trial, victim, survivors, signalled):
    pattern = _message_re(cell, victim, job.port)
    problems = []
    times = []
    for n in survivors:
        if n.returncode is None:
            problems.append("%s still running %.0f s after the signal" % (
                n.name, cell.bound + HANG_MARGIN))
            continue
        took = n.exited_at - signalled
        times.append(took)
        if n.returncode != 3:
            problems.append("%s exited %s, not 3" % (n.name, n.returncode))
        if not re.search(pattern, n.stderr) or "Traceback" in n.stderr:
            problems.append("%s's stderr does not name the lost node (%r) or has a traceback"
                            % (n.name, pattern))
        if took > cell.bound:
            problems.append("%s exited %.1f s after the signal (bound %.0f s)" % (
                n.name, took, cell.bound))
    trial.detection = max(times) if times else None
    trial.codes_ok = all(n.returncode == 3 for n in survivors)
    trial.named_ok = not any("name the lost node" in p for p in problems) and \
        all(n.returncode is not None for n in survivors)
    trial.ok = not problems
    if problems:
        trial.detail = "%s (victim %s pid %d): %s\n%s" % (
            cell.name, victim.name, victim.pid, "; ".join(problems),
            job.result.describe(since=signalled, tails="all", tail_chars=1500))


# --------------------------------------------------------------------------------------------
# the matrix

def run_matrix(cells, trials, parallel=1, progress=None, deadline=None):
    """Every cell ``trials`` times (``parallel`` jobs at once), round after round (a run cut
    short has as many trials of every cell, give or take one); the list of Trials.  No trial
    starts after ``deadline`` (a time.time()), so a run with a time budget ends near it."""
    work = [c for _ in range(trials) for c in cells]

    def trial(cell):
        if deadline is not None and time.time() >= deadline:
            return None
        return run_trial(cell)

    results = []
    with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
        for t in pool.map(trial, work):
            if t is None:
                continue
            results.append(t)
            if progress is not None:
                progress(t)
    return results


def summarize(results):
    """Per cell: trials, passed, survivors' codes right, named, max detection, hangs, setup
    failures."""
    rows = {}
    for t in results:
        r = rows.setdefault(t.cell.name, {"cell": t.cell.name, "bound": t.cell.bound,
                                          "trials": 0, "passed": 0, "codes": 0, "named": 0,
                                          "max_detection": None, "hangs": 0, "setup_failed": 0})
        r["trials"] += 1
        r["passed"] += t.ok
        r["codes"] += t.codes_ok
        r["named"] += t.named_ok
        r["hangs"] += t.hang
        r["setup_failed"] += t.setup_failed
        if t.detection is not None:
            r["max_detection"] = max(r["max_detection"] or 0.0, t.detection)
        r["completed"] = r.get("completed", 0) + t.completed
        r["same_weights"] = r.get("same_weights", 0) + t.same_weights
        if t.rebuild is not None:
            r["max_rebuild"] = max(r.get("max_rebuild") or 0.0, t.rebuild)
    return [rows[c.name] for c in all_cells() + all_cells(True) if c.name in rows]


def failover_table(rows):
    lines = ["| cell (victim/phase/signal) | trials | job completed | weights = uninterrupted "
             "run | max failover in place after detection (s) | max job end after the "
             "signal (s) | hangs | phase not reached |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append("| %s | %d | %d | %d | %s | %s | %d | %d |" % (
            r["cell"], r["trials"], r["completed"], r["same_weights"],
            "-" if r.get("max_rebuild") is None else "%.3f" % r["max_rebuild"],
            "-" if r["max_detection"] is None else "%.1f" % r["max_detection"],
            r["hangs"], r["setup_failed"]))
    return "\n".join(lines)


def table(rows):
    failover = [r for r in rows if r["cell"].endswith("/failover")]
    rows = [r for r in rows if not r["cell"].endswith("/failover")]
    if failover:
        return "\n\n".join(([table(rows)] if rows else []) + [failover_table(failover)])
    lines = ["| cell (victim/phase/signal) | trials | passed | survivors exit 3 | message names "
             "the node | max detection (s) | bound (s) | hangs | phase not reached |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append("| %s | %d | %d | %d | %d | %s | %.0f | %d | %d |" % (
            r["cell"], r["trials"], r["passed"], r["codes"], r["named"],
            "-" if r["max_detection"] is None else "%.1f" % r["max_detection"], r["bound"],
            r["hangs"], r["setup_failed"]))
    return "\n".join(lines)


def _to_json(t):
    return dict(dataclasses.asdict(t), cell=t.cell.name)


def _from_json(d):
    d = dict(d, cell=Cell.parse(d["cell"]))
    return Trial(**d)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--cells", default="", help="comma-separated role/phase/signal[/failover] "
                    "(default: all)")
    ap.add_argument("--failover", action="store_true", help="the server cells with "
                    "MXPS_FAILOVER=1 (the default cells: all of them)")
    ap.add_argument("--parallel", type=int, default=1, help="jobs at once (each is 5 processes)")
    ap.add_argument("--minutes", type=float, default=0.0, help="start no trial after this "
                    "many minutes (0: no limit); the table says how many trials ran")
    ap.add_argument("--out", default="", help="write the table (markdown) to this file")
    ap.add_argument("--json", default="", help="write every trial (JSON) to this file")
    ap.add_argument("--jsonl", default="", help="append each trial (a JSON line) to this file "
                    "as it ends (a run cut short keeps what ran; --table-from reads it)")
    ap.add_argument("--table-from", default="", help="print the table of a --jsonl file, run "
                    "nothing")
    args = ap.parse_args(argv)
    if args.table_from:
        with open(args.table_from) as f:
            results = [_from_json(json.loads(line)) for line in f if line.strip()]
        print(table(summarize(results)))
        return 0
    cells = [Cell.parse(c) for c in args.cells.split(",") if c.strip()] or \
        all_cells(args.failover)
    t0 = time.monotonic()

    def progress(t):
        print("%-36s %s  detection %s  %.0f s" % (
            t.cell.name, "ok  " if t.ok else ("SETUP" if t.setup_failed else "FAIL"),
            "-" if t.detection is None else "%.1f s" % t.detection, t.seconds), flush=True)
        if not t.ok:
            print("    " + t.detail.replace("\n", "\n    ")[:4000], flush=True)
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                f.write(json.dumps(_to_json(t)) + "\n")

    results = run_matrix(cells, args.trials, args.parallel, progress,
                         deadline=time.time() + args.minutes * 60 if args.minutes else None)
    wall = time.monotonic() - t0
    text = table(summarize(results))
    print("\n%s\n\n%d trials of %d cells in %.0f s (%d at once)" % (
        text, len(results), len(cells), wall, args.parallel))
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([_to_json(t) for t in results], f, indent=1)
    return 0 if all(t.ok for t in results) else 1


if __name__ == "__main__":
    sys.exit(main())
