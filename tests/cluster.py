"""Start a parameter-server job by hand on loopback, the way MXNet's launcher does.

``run_job`` starts one scheduler, S servers and W workers, each a separate process running
``[sys.executable] + script_argv`` with the DMLC variables native ps-lite (and mxps) reads.
Every node is pinned to 127.0.0.1: ``DMLC_PS_ROOT_URI``/``DMLC_NODE_HOST`` are loopback and
``DMLC_INTERFACE=lo``, so no socket uses this machine's external address.

Output goes to files (a full pipe would block a node), processes run in their own process
groups, and whatever happens (timeout, a node failing, an exception in the harness) every
process group is killed before ``run_job`` returns.

    result = run_job(["tests/jobs/train_job.py"], num_workers=2, num_servers=2,
                     env={"JOB_KVSTORE": "dist_sync", "JOB_OUT": str(out)})
    result.raise_for_failure()

``assert_synchronised(result_dir, num_workers)`` checks what ``tests/jobs/train_job.py`` wrote:
every worker ended with the same weights, ranks are distinct, a distributed kvstore was used.
"""
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOBS_DIR = os.path.join(REPO_ROOT, "tests", "jobs")
TRAIN_JOB = os.path.join(JOBS_DIR, "train_job.py")

LOOPBACK = "127.0.0.1"

# One math thread per process, as the package's own job runner does.
from mxps_tools.jobs import QUIET_ENV, free_port  # noqa: E402  (also re-exported for the tests)

# After the last worker exits cleanly, servers and the scheduler get this long to exit.
SERVER_EXIT_GRACE_SECONDS = 30.0
POLL_SECONDS = 0.05
STDERR_TAIL_CHARS = 3000


@dataclass
class ProcResult:
    """One node of a job: its role, index within the role, and what it did."""
    role: str                 # 'scheduler', 'server' or 'worker'
    index: int                # launch index within the role (not the ps rank: ranks are assigned)
    pid: int
    returncode: Optional[int] = None
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0
    killed: bool = False      # the harness killed it (timeout, or another node failed)

    @property
    def name(self) -> str:
        return "%s%d" % (self.role, self.index)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.killed

    def tail(self, chars: int = STDERR_TAIL_CHARS) -> str:
        text = self.stderr.strip() or self.stdout.strip()
        return text[-chars:]


@dataclass
class JobResult:
    """What ``run_job`` observed. ``ok`` means every process exited 0 on its own in time."""
    procs: List[ProcResult]
    wall_seconds: float
    port: int
    timed_out: bool = False
    reason: str = ""          # why the job is not ok, empty if it is
    sockets: List[dict] = field(default_factory=list)   # see watch_sockets in run_job

    @property
    def ok(self) -> bool:
        return not self.reason

    @property
    def workers(self) -> List[ProcResult]:
        return [p for p in self.procs if p.role == "worker"]

    @property
    def failed(self) -> Optional[ProcResult]:
        """The first node that failed on its own (non-zero exit), else the first one killed."""
        bad = [p for p in self.procs if p.returncode not in (0, None) and not p.killed]
        bad = bad or [p for p in self.procs if p.killed]
        return bad[0] if bad else None

    def describe(self) -> str:
        lines = ["job on port %d: %s (%.1f s)" % (self.port, self.reason or "ok",
                                                   self.wall_seconds)]
        for p in self.procs:
            lines.append("  %-10s pid %-7d rc=%-5s %5.1f s%s" % (
                p.name, p.pid, p.returncode, p.seconds, " (killed)" if p.killed else ""))
        node = self.failed
        if node is not None:
            lines.append("--- %s stderr (tail) ---" % node.name)
            lines.append(node.tail())
        return "\n".join(lines)

    def raise_for_failure(self):
        """Raise AssertionError naming the failing node, with its stderr tail."""
        if not self.ok:
            raise AssertionError(self.describe())
        return self


def _kill_group(proc: subprocess.Popen, sig=signal.SIGKILL):
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _read(path: str) -> str:
    try:
        with open(path, "r", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


_SS_LINE = re.compile(r"^(\S+)\s+\d+\s+\d+\s+(\S+)\s+(\S+)\s+(.*)$")


def sockets_of(pids) -> List[dict]:
    """TCP and UDP sockets owned by ``pids``, from ``ss -tanpH`` and ``ss -uanpH``."""
    pids = set(int(p) for p in pids)
    out = ""
    for flags in ("-tanpH", "-uanpH"):
        try:
            out += subprocess.run(["ss", flags], capture_output=True, text=True,
                                  timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            pass
    found = []
    for line in out.splitlines():
        m = _SS_LINE.match(line.strip())
        if not m:
            continue
        owners = set(int(x) for x in re.findall(r"pid=(\d+)", m.group(4)))
        if owners & pids:
            found.append({"state": m.group(1), "local": m.group(2), "peer": m.group(3),
                          "pids": sorted(owners & pids)})
    return found


def address_host(addr: str) -> str:
    """'127.0.0.1:9000' -> '127.0.0.1'; '[::ffff:127.0.0.1]:9000' -> '::ffff:127.0.0.1'."""
    host = addr.rsplit(":", 1)[0]
    return host.strip("[]").split("%")[0]


def is_loopback_address(addr: str) -> bool:
    host = address_host(addr)
    if host.startswith("::ffff:"):
        host = host[len("::ffff:"):]
    return host.startswith("127.") or host in ("::1",)


def node_env(role: str, port: int, num_workers: int, num_servers: int,
             host: str = LOOPBACK) -> Dict[str, str]:
    """The DMLC variables one node needs (what dmlc_tracker's local launcher sets, on loopback)."""
    return {
        "DMLC_ROLE": role,
        "DMLC_PS_ROOT_URI": host,
        "DMLC_PS_ROOT_PORT": str(port),
        "DMLC_NUM_WORKER": str(num_workers),
        "DMLC_NUM_SERVER": str(num_servers),
        "DMLC_NODE_HOST": host,
        "DMLC_INTERFACE": "lo",
    }


def run_job(script_argv, num_workers: int, num_servers: int, env=None, per_rank_env=None,
            timeout: float = 180, host: str = LOOPBACK, log_dir: Optional[str] = None,
            watch_sockets: bool = False) -> JobResult:
    """Run one scheduler, ``num_servers`` servers and ``num_workers`` workers to completion.

    Args:
        script_argv: the script and its arguments; each node runs ``[sys.executable] + argv``.
        env: extra variables for every node (on top of os.environ and ``QUIET_ENV``).
        per_rank_env: extra variables for some nodes, keyed by ``(role, index)`` or by role.
        timeout: seconds for the whole job; then every node is killed and the job fails.
        host: the address every node uses; must be loopback on this machine.
        log_dir: keep stdout/stderr files there (else a temp dir, removed afterwards).
        watch_sockets: sample ``ss`` while the job runs; the sockets land in ``.sockets``.

    The first node to exit non-zero fails the job: the others are killed at once. A worker
    that is still running is never killed for another worker's clean exit; servers and the
    scheduler get ``SERVER_EXIT_GRACE_SECONDS`` after the last worker exits.
    """
    if not host.startswith("127."):
        raise ValueError("run_job host %r is not loopback: jobs must stay on 127.0.0.0/8" % host)
    port = free_port(host)
    own_tmp = log_dir is None
    log_dir = tempfile.mkdtemp(prefix="mxps-job-") if own_tmp else log_dir
    os.makedirs(log_dir, exist_ok=True)
    per_rank_env = per_rank_env or {}

    base = dict(os.environ)
    base.update(QUIET_ENV)
    base["PYTHONPATH"] = os.pathsep.join(
        [REPO_ROOT] + [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p])
    base.update({k: str(v) for k, v in (env or {}).items()})

    layout = [("scheduler", 0)] + [("server", i) for i in range(num_servers)] + \
             [("worker", i) for i in range(num_workers)]
    procs, popens, files, started = [], [], [], []
    sockets, seen = [], set()
    timed_out, reason = False, ""
    start = time.monotonic()
    try:
        for role, index in layout:
            penv = dict(base)
            penv.update(node_env(role, port, num_workers, num_servers, host))
            penv.update({k: str(v) for k, v in per_rank_env.get(role, {}).items()})
            penv.update({k: str(v) for k, v in per_rank_env.get((role, index), {}).items()})
            out_path = os.path.join(log_dir, "%s%d.out" % (role, index))
            err_path = os.path.join(log_dir, "%s%d.err" % (role, index))
            fo, fe = open(out_path, "wb"), open(err_path, "wb")
            files.append((fo, fe, out_path, err_path))
            p = subprocess.Popen([sys.executable] + list(script_argv), env=penv,
                                 stdin=subprocess.DEVNULL, stdout=fo, stderr=fe,
                                 cwd=REPO_ROOT, start_new_session=True)
            popens.append(p)
            started.append(time.monotonic())
            procs.append(ProcResult(role=role, index=index, pid=p.pid))
        workers_done_at = None
        next_watch = 0.0
        while True:
            now = time.monotonic()
            for i, p in enumerate(popens):
                if procs[i].returncode is None and p.poll() is not None:
                    procs[i].returncode = p.returncode
                    procs[i].seconds = now - started[i]
            bad = [pr for pr in procs if pr.returncode not in (None, 0)]
            if bad:
                reason = "%s exited with code %s" % (bad[0].name, bad[0].returncode)
                break
            if all(pr.returncode is not None for pr in procs):
                break
            if workers_done_at is None and all(
                    pr.returncode is not None for pr in procs if pr.role == "worker"):
                workers_done_at = now
            if workers_done_at is not None and now - workers_done_at > SERVER_EXIT_GRACE_SECONDS:
                left = [pr.name for pr in procs if pr.returncode is None]
                reason = "workers finished but %s did not exit within %.0f s" % (
                    ", ".join(left), SERVER_EXIT_GRACE_SECONDS)
                break
            if now - start > timeout:
                timed_out = True
                left = [pr.name for pr in procs if pr.returncode is None]
                reason = "timeout after %.0f s; still running: %s" % (timeout, ", ".join(left))
                break
            if watch_sockets and now >= next_watch:
                for s in sockets_of(pr.pid for pr in procs if pr.returncode is None):
                    key = (s["local"], s["peer"])
                    if key not in seen:
                        seen.add(key)
                        sockets.append(s)
                next_watch = now + 0.25
            time.sleep(POLL_SECONDS)
    except BaseException as exc:   # harness error or KeyboardInterrupt: still clean up
        reason = reason or "harness error: %r" % (exc,)
        raise
    finally:
        # Kill every group still alive (and the groups of nodes that exited: children they
        # may have left behind), then reap.
        for i, p in enumerate(popens):
            if p.poll() is None:
                procs[i].killed = True
                _kill_group(p, signal.SIGTERM)
        deadline = time.monotonic() + 2.0
        for p in popens:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in popens:
            _kill_group(p, signal.SIGKILL)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        end = time.monotonic()
        for i, p in enumerate(popens):
            if procs[i].returncode is None:
                procs[i].returncode = p.returncode
                procs[i].seconds = end - started[i]
        for i, (fo, fe, out_path, err_path) in enumerate(files):
            fo.close()
            fe.close()
            if i < len(procs):
                procs[i].stdout = _read(out_path)
                procs[i].stderr = _read(err_path)
        if own_tmp:
            shutil.rmtree(log_dir, ignore_errors=True)
    return JobResult(procs=procs, wall_seconds=time.monotonic() - start, port=port,
                     timed_out=timed_out, reason=reason, sockets=sockets)


def run_single(script_argv, env=None, timeout: float = 120) -> ProcResult:
    """Run the script as one plain process (no DMLC variables): e.g. ``JOB_KVSTORE=local``."""
    penv = dict(os.environ)
    for k in list(penv):
        if k.startswith("DMLC_"):
            del penv[k]
    penv.update(QUIET_ENV)
    penv["PYTHONPATH"] = os.pathsep.join(
        [REPO_ROOT] + [p for p in penv.get("PYTHONPATH", "").split(os.pathsep) if p])
    penv.update({k: str(v) for k, v in (env or {}).items()})
    start = time.monotonic()
    p = subprocess.Popen([sys.executable] + list(script_argv), env=penv, cwd=REPO_ROOT,
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, start_new_session=True)
    killed = False
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        killed = True
        _kill_group(p)
        out, err = p.communicate()
    finally:
        if p.poll() is None:
            _kill_group(p)
            p.wait()
    res = ProcResult(role="single", index=0, pid=p.pid, returncode=p.returncode,
                     stdout=out.decode(errors="replace"), stderr=err.decode(errors="replace"),
                     seconds=time.monotonic() - start, killed=killed)
    if not res.ok:
        raise AssertionError("single process failed (rc=%s%s):\n%s" % (
            res.returncode, ", killed after timeout" if killed else "", res.tail()))
    return res


# --------------------------------------------------------------------------- results of train_job

def load_weights(result_dir: str, rank: int) -> Dict[str, np.ndarray]:
    with np.load(os.path.join(result_dir, "weights_rank%d.npz" % rank)) as z:
        return {k: z[k] for k in z.files}


def load_meta(result_dir: str, rank: int) -> dict:
    with open(os.path.join(result_dir, "meta_rank%d.json" % rank)) as f:
        return json.load(f)


def relative_difference(a: Dict[str, np.ndarray], b: Dict[str, np.ndarray]) -> Dict[str, float]:
    """Per parameter: ||a - b|| / max(||b||, tiny). The names must match."""
    assert sorted(a) == sorted(b), "parameter names differ: %s vs %s" % (sorted(a), sorted(b))
    out = {}
    for k in a:
        x, y = a[k].astype(np.float64), b[k].astype(np.float64)
        assert x.shape == y.shape, "%s: shape %s vs %s" % (k, x.shape, y.shape)
        out[k] = float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))
    return out


def assert_weights_close(a, b, rtol=1e-5, what="weights"):
    """Every parameter of ``a`` within ``rtol`` relative (L2 norm) of ``b``."""
    diff = relative_difference(a, b)
    bad = {k: v for k, v in diff.items() if not v <= rtol}
    assert not bad, "%s differ beyond relative %.1e: %s" % (
        what, rtol, ", ".join("%s=%.3e" % kv for kv in sorted(bad.items())))
    return diff


def assert_synchronised(result_dir: str, num_workers: int, kvstore_type: Optional[str] = None,
                        rtol: float = 0.0):
    """The workers of one train_job run trained one model together.

    Checks: one weights file per rank 0..W-1 (ranks distinct, so data was different per worker),
    every worker reports a kvstore (not silently dropped) with ``num_workers`` workers, and all
    workers hold the same weights (bit-identical by default: they all pulled the same values).
    Returns rank 0's weights.
    """
    files = sorted(glob.glob(os.path.join(result_dir, "weights_rank*.npz")))
    ranks = sorted(int(re.search(r"rank(\d+)", f).group(1)) for f in files)
    assert ranks == list(range(num_workers)), \
        "expected weights from ranks 0..%d, found ranks %s in %s (duplicate ranks mean the " \
        "kvstore was not distributed)" % (num_workers - 1, ranks, result_dir)
    for r in ranks:
        meta = load_meta(result_dir, r)
        assert meta["kvstore_type"], \
            "rank %d trained without a kvstore (requested %r): it was silently dropped" % (
                r, meta.get("kvstore_requested"))
        if kvstore_type is not None:
            assert meta["kvstore_type"] == kvstore_type, (r, meta["kvstore_type"])
        assert meta["num_workers"] == num_workers, \
            "rank %d sees %s workers, expected %d" % (r, meta["num_workers"], num_workers)
    ref = load_weights(result_dir, 0)
    for r in ranks[1:]:
        other = load_weights(result_dir, r)
        if rtol == 0.0:
            for k in ref:
                assert np.array_equal(ref[k], other[k]), \
                    "rank %d and rank 0 disagree on %s (max abs diff %.3e)" % (
                        r, k, float(np.max(np.abs(ref[k] - other[k]))))
        else:
            assert_weights_close(other, ref, rtol, what="rank %d vs rank 0" % r)
    return ref


# --------------------------------------------------------------------------- cached train_job runs

def train_env(kvstore, optimizer="sgd", update_on_kvstore=None, lr_mult=False, devices=1,
              model="mlp", api="gluon", kv_object=False, steps=20, **extra) -> Dict[str, str]:
    """The JOB_* variables of one tests/jobs/train_job.py configuration (extra: raw vars)."""
    env = {"JOB_KVSTORE": kvstore, "JOB_OPTIMIZER": optimizer, "JOB_API": api,
           "JOB_MODEL": model, "JOB_DEVICES": str(devices), "JOB_STEPS": str(steps),
           "JOB_LR_MULT": "1" if lr_mult else "0", "JOB_KV_OBJECT": "1" if kv_object else "0",
           "JOB_UPDATE_ON_KVSTORE": "" if update_on_kvstore is None
           else ("1" if update_on_kvstore else "0")}
    env.update({k: str(v) for k, v in extra.items()})
    return env


@dataclass
class TrainRun:
    out_dir: str
    result: Optional[JobResult]
    seconds: float


class JobCache:
    """Runs each distinct train_job configuration once per test session (shared by modules).

    ``train(env, num_workers, num_servers)`` returns a TrainRun whose ``out_dir`` holds the
    workers' weights; a failed job raises (and is remembered, so it is not re-run).
    ``num_servers=0`` runs a single plain process (e.g. ``JOB_KVSTORE=local``).
    """

    def __init__(self, base_dir: str):
        self.base_dir = base_dir
        self.runs: Dict[tuple, object] = {}
        self.retried: List[str] = []     # runs that failed ``validate`` once (see train)
        self._count = 0

    def train(self, env: Dict[str, str], num_workers: int, num_servers: int,
              timeout: float = 150, validate=None, retries: int = 0) -> TrainRun:
        """Run (or reuse) one configuration. ``validate(out_dir)`` may raise AssertionError;
        then the job is re-run up to ``retries`` times (for a *reference* run only: see the
        native flakiness note in test_equivalence), and every retry is logged in ``retried``."""
        key = (num_workers, num_servers, tuple(sorted(env.items())))
        if key not in self.runs:
            for attempt in range(retries + 1):
                self.runs[key] = self._run(env, num_workers, num_servers, timeout)
                if validate is None or isinstance(self.runs[key], AssertionError):
                    break
                try:
                    validate(self.runs[key].out_dir)
                    break
                except AssertionError as exc:
                    note = "%dx%d %s attempt %d: %s" % (num_workers, num_servers, env,
                                                        attempt + 1, str(exc)[:300])
                    self.retried.append(note)
                    sys.stderr.write("JobCache: validation failed, %s\n" % note)
                    self.runs[key] = AssertionError(note)
        run = self.runs[key]
        if isinstance(run, AssertionError):
            raise run
        return run

    def _run(self, env, num_workers, num_servers, timeout):
        out = os.path.join(self.base_dir, "run%03d" % self._count)
        self._count += 1
        job_env = dict(env, JOB_OUT=out)
        t0 = time.monotonic()
        try:
            if num_servers == 0:
                run_single([TRAIN_JOB], env=job_env, timeout=timeout)
                return TrainRun(out, None, time.monotonic() - t0)
            res = run_job([TRAIN_JOB], num_workers, num_servers, env=job_env,
                          timeout=timeout, log_dir=os.path.join(out, "logs"),
                          watch_sockets=True)
            res.raise_for_failure()
            return TrainRun(out, res, res.wall_seconds)
        except AssertionError as exc:
            return AssertionError(
                "%dx%d job with %s failed:\n%s" % (num_workers, num_servers, env, exc))


def native_dist_sync(jobs: JobCache, num_workers: int, num_servers: int, retries: int = 4,
                     **cfg) -> TrainRun:
    """A native dist_sync run of train_env(**cfg) fit to be a reference, from the cache.

    Native MXNet 1.9.1 dist_sync with update on the workers is unreliable: measured here, 2 of
    15 identical 2x2 SGD runs ended with the workers disagreeing on the last layer (max abs diff
    2.403 both times) and one CI run ended synchronised but 1.0 (relative) away from every other
    run. So a reference must be synchronised and, with update on the workers, equal (1e-5) to
    native MXNet playing the workers in one process (JOB_SIMULATE_WORKERS, itself tested
    against native update on servers); a failed run is re-run up to ``retries`` times and
    logged in ``jobs.retried`` (under CI's load 2 of the 3 such configurations needed a re-run
    in one session, so the failure rate there is well above 2 in 15: four re-runs keep a
    false CI failure under ~1%). Every caller of one configuration gets the same run.
    """
    env = train_env("dist_sync", **cfg)
    on_workers = env["JOB_UPDATE_ON_KVSTORE"] == "0"
    sim = None
    if on_workers:
        sim_cfg = dict(cfg, update_on_kvstore=False, JOB_SIMULATE_WORKERS=num_workers)
        sim = load_weights(jobs.train(train_env("device", **sim_cfg), num_workers, 0).out_dir, 0)

    def validate(out_dir):
        weights = assert_synchronised(out_dir, num_workers, kvstore_type="dist_sync")
        if sim is not None:
            assert_weights_close(weights, sim, rtol=1e-5,
                                 what="native dist_sync (update on workers) vs one process")

    return jobs.train(env, num_workers, num_servers, validate=validate, retries=retries)


_JOB_CACHE: Optional[JobCache] = None


def job_cache(tmp_path_factory) -> JobCache:
    """The session's JobCache (one per pytest session, whichever test module asks first)."""
    global _JOB_CACHE
    if _JOB_CACHE is None:
        _JOB_CACHE = JobCache(str(tmp_path_factory.mktemp("train_jobs")))
    return _JOB_CACHE
