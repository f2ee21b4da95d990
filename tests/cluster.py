"""Multi-process test jobs on loopback: the runner is ``mxps_tools.jobs``, these are the tests'
helpers around it.

``run_job`` runs one scheduler, S servers and W workers to completion (``mxps_tools.jobs.Job``):
every node is pinned to 127.0.0.1 (``DMLC_PS_ROOT_URI``/``DMLC_NODE_HOST`` loopback,
``DMLC_INTERFACE=lo``), runs in its own process group with output to files, the first node to
exit non-zero or the timeout ends the job, and every process group is killed before it returns.
The nodes import mxps as installed (``pip install -e .``): nothing puts this checkout on their
PYTHONPATH.

    result = run_job([TRAIN_JOB], num_workers=2, num_servers=2,
                     env={"JOB_KVSTORE": "dist_sync", "JOB_OUT": str(out)})
    result.raise_for_failure()

``assert_synchronised(result_dir, num_workers)`` checks what ``tests/jobs/train_job.py`` wrote:
every worker ended with the same weights, ranks are distinct, a distributed kvstore was used.
"""
import glob
import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np

# the module as `runner`: the tests call the session's JobCache `jobs`
from mxps_tools import jobs as runner
from mxps_tools.jobs import LOOPBACK, QUIET_ENV, free_port  # noqa: F401  (for the tests)

JOBS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jobs")
TRAIN_JOB = os.path.join(JOBS_DIR, "train_job.py")


def address_host(addr: str) -> str:
    """'127.0.0.1:9000' -> '127.0.0.1'; '[::ffff:127.0.0.1]:9000' -> '::ffff:127.0.0.1'."""
    host = addr.rsplit(":", 1)[0]
    return host.strip("[]").split("%")[0]


def is_loopback_address(addr: str) -> bool:
    """``host:port`` on loopback (IPv4, IPv6, or IPv4 loopback mapped into IPv6)."""
    try:
        ip = ipaddress.ip_address(address_host(addr))
    except ValueError:          # '*', a wildcard peer
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def run_job(script_argv, num_workers: int, num_servers: int, env=None, role_env=None,
            timeout: float = 180, log_dir: Optional[str] = None,
            watch_sockets: bool = False) -> runner.JobResult:
    """Run the job to completion on loopback (``mxps_tools.jobs.Job.run``).

    ``role_env``: extra variables by role (``"worker"``) or node (``"w1"``); ``log_dir``: keep
    the nodes' output there (else a temp dir, removed); ``watch_sockets``: the sockets the nodes
    owned land in ``.sockets``.  A worker still running is never killed for another worker's
    clean exit; servers and the scheduler get ``runner.SERVER_EXIT_GRACE_SECONDS`` after the last
    worker exits.
    """
    return runner.Job(script_argv, num_workers, num_servers, env=env, role_env=role_env,
                      timeout=timeout, log_dir=log_dir, watch_sockets=watch_sockets,
                      cpu_interval=None).run()


def run_single(script_argv, env=None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the script as one plain process (no DMLC variables): e.g. ``JOB_KVSTORE=local``.
    Raises AssertionError with its output if it fails or outlives ``timeout``."""
    penv = {k: v for k, v in os.environ.items() if not k.startswith("DMLC_")}
    penv.update(QUIET_ENV)
    penv.update({k: str(v) for k, v in (env or {}).items()})
    argv = [sys.executable] + list(script_argv)
    p = subprocess.Popen(argv, env=penv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
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
    done = subprocess.CompletedProcess(argv, p.returncode, out.decode(errors="replace"),
                                       err.decode(errors="replace"))
    if killed or done.returncode != 0:
        tail = (done.stderr.strip() or done.stdout.strip())[-runner.TAIL_CHARS:]
        raise AssertionError("single process failed (rc=%s%s):\n%s" % (
            done.returncode, ", killed after %.0f s" % timeout if killed else "", tail))
    return done


def _kill_group(proc: subprocess.Popen, sig=signal.SIGKILL):
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


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
    result: Optional[runner.JobResult]
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
        except (AssertionError, runner.JobFailed) as exc:
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
