"""Run one parameter-server job: a scheduler, S servers and W workers, one process each.

The job runs either on loopback (every node on 127.0.0.1, plain subprocesses) or in an
``emunet.Topology`` (node ``sched``, ``s0..``, ``w0..`` in their own namespaces, started with
``Topology.popen``).  Every node gets the DMLC variables native ps-lite and mxps read, including
``DMLC_NODE_HOST`` (its own address) and ``DMLC_INTERFACE`` (``lo`` or ``eth0``): without them
native ps-lite binds to the first non-loopback interface.

While the job runs the runner samples each process's CPU time (utime + stime from
``/proc/<pid>/stat``) and calls ``on_poll(job)`` so the caller can follow logs and change the
network.  The first node to exit non-zero, or the timeout, ends the job: every process still
running is stopped (SIGTERM to its process group, then SIGKILL) before ``run`` returns, also on
an exception or Ctrl-C in the caller.

    job = Job(["examples/bench_job.py", "--steps", "5"], num_workers=2, num_servers=2,
              env={"MXPS_LOG_LEVEL": "INFO"}, topo=topo)
    result = job.run()
    result.raise_for_failure()
"""
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Mapping, Optional, Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOOPBACK = "127.0.0.1"
#: Port the scheduler listens on inside its namespace (each namespace has its own ports).
NAMESPACE_ROOT_PORT = 9091
#: One math thread per process: a small machine runs every node of the job.
QUIET_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MXNET_CPU_WORKER_NTHREADS": "1",
    "PYTHONUNBUFFERED": "1",
    "PYTHONDONTWRITEBYTECODE": "1",
}
SERVER_EXIT_GRACE_SECONDS = 30.0
POLL_SECONDS = 0.1
CLK_TCK = os.sysconf("SC_CLK_TCK")


class JobError(RuntimeError):
    """The job could not be started (bad arguments)."""


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def cpu_ticks(pid: int) -> Optional[int]:
    """utime + stime of ``pid`` in clock ticks (None if it is gone)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])


@dataclasses.dataclass
class Node:
    """One process of the job. ``name`` is its emunet node (``sched``, ``s0``, ``w1``)."""
    name: str
    role: str            # scheduler, server, worker
    index: int           # launch index within the role (not the ps rank)
    pid: int = 0
    out_path: str = ""
    err_path: str = ""
    started: float = 0.0
    returncode: Optional[int] = None
    seconds: float = 0.0
    killed: bool = False
    cpu: List[tuple] = dataclasses.field(default_factory=list)   # (unix time, cpu seconds)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.killed

    def read(self, which: str = "err") -> str:
        path = self.err_path if which == "err" else self.out_path
        try:
            with open(path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def cpu_seconds_between(self, t0: float, t1: float) -> Optional[float]:
        """CPU seconds used in [t0, t1], interpolated between samples."""
        if len(self.cpu) < 2:
            return None
        return _interp(self.cpu, t1) - _interp(self.cpu, t0)


def _interp(samples, t):
    """Linear interpolation of (time, value) samples at ``t`` (clamped to the ends)."""
    if t <= samples[0][0]:
        return samples[0][1]
    if t >= samples[-1][0]:
        return samples[-1][1]
    lo, hi = 0, len(samples) - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if samples[mid][0] <= t:
            lo = mid
        else:
            hi = mid
    (ta, va), (tb, vb) = samples[lo], samples[hi]
    return va if tb == ta else va + (vb - va) * (t - ta) / (tb - ta)


interpolate = _interp


@dataclasses.dataclass
class JobResult:
    nodes: List[Node]
    wall_seconds: float
    started_at: float
    reason: str = ""
    timed_out: bool = False
    log_dir: str = ""

    @property
    def ok(self) -> bool:
        return not self.reason

    @property
    def workers(self) -> List[Node]:
        return [n for n in self.nodes if n.role == "worker"]

    def describe(self, tail_chars: int = 3000) -> str:
        lines = ["job: %s (%.1f s)" % (self.reason or "ok", self.wall_seconds)]
        for n in self.nodes:
            lines.append("  %-6s %-9s pid %-7d rc=%-5s %5.1f s%s" % (
                n.name, n.role, n.pid, n.returncode, n.seconds, " (killed)" if n.killed else ""))
        bad = [n for n in self.nodes if n.returncode not in (0, None) and not n.killed] or \
              [n for n in self.nodes if n.killed]
        if bad:
            text = bad[0].read("err").strip() or bad[0].read("out").strip()
            lines.append("--- %s stderr (tail) ---" % bad[0].name)
            lines.append(text[-tail_chars:])
        return "\n".join(lines)

    def raise_for_failure(self):
        if not self.ok:
            raise RuntimeError(self.describe())
        return self


def layout(num_workers: int, num_servers: int) -> List[Node]:
    """The nodes of a job, in start order: sched, s0.., w0.."""
    return [Node("sched", "scheduler", 0)] + \
        [Node("s%d" % i, "server", i) for i in range(num_servers)] + \
        [Node("w%d" % i, "worker", i) for i in range(num_workers)]


def node_names(num_workers: int, num_servers: int) -> List[str]:
    return [n.name for n in layout(num_workers, num_servers)]


def dmlc_env(role, root_uri, root_port, num_workers, num_servers, host, interface):
    return {"DMLC_ROLE": role, "DMLC_PS_ROOT_URI": root_uri,
            "DMLC_PS_ROOT_PORT": str(root_port), "DMLC_NUM_WORKER": str(num_workers),
            "DMLC_NUM_SERVER": str(num_servers), "DMLC_NODE_HOST": host,
            "DMLC_INTERFACE": interface}


class Job:
    """One job; ``run()`` once.

    Args:
        script_argv: the script and its arguments; every node runs ``[python] + script_argv``.
        num_workers, num_servers: job size.
        env: variables for every node (on top of os.environ and QUIET_ENV).
        role_env: extra variables per role (``{'scheduler': {...}}``) or node name.
        topo: an open ``emunet.Topology`` holding nodes ``sched``, ``s<i>``, ``w<i>``; None runs
            on loopback.
        timeout: seconds for the whole job.
        log_dir: where node stdout/stderr files go (kept); default a temp dir (removed).
        on_poll: called with this Job about every POLL_SECONDS while it runs.
        cpu_interval: seconds between CPU samples of every process.
    """

    def __init__(self, script_argv: Sequence[str], num_workers: int, num_servers: int,
                 env: Optional[Mapping[str, str]] = None,
                 role_env: Optional[Mapping[str, Mapping[str, str]]] = None, topo=None,
                 timeout: float = 600.0, log_dir: Optional[str] = None,
                 on_poll: Optional[Callable[["Job"], None]] = None, cpu_interval: float = 0.25):
        if num_workers < 1 or num_servers < 1:
            raise JobError("a job needs at least one worker and one server, got %d workers "
                           "and %d servers" % (num_workers, num_servers))
        self.script_argv = [str(a) for a in script_argv]
        self.num_workers = num_workers
        self.num_servers = num_servers
        self.env = dict(env or {})
        self.role_env = {k: dict(v) for k, v in (role_env or {}).items()}
        self.topo = topo
        self.timeout = timeout
        self._own_log_dir = log_dir is None
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="mxps-job-")
        self.on_poll = on_poll
        self.cpu_interval = cpu_interval
        self.nodes = layout(num_workers, num_servers)
        self._popens: List[subprocess.Popen] = []
        self.started_at = 0.0
        if topo is not None:
            missing = [n.name for n in self.nodes if n.name not in topo.nodes]
            if missing:
                raise JobError("the topology has no nodes %s (it has %s)" % (missing, topo.nodes))

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def _node_env(self, node: Node, port: int) -> Dict[str, str]:
        env = dict(os.environ)
        env.update(QUIET_ENV)
        env["PYTHONPATH"] = os.pathsep.join(
            [REPO_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        env.update({k: str(v) for k, v in self.env.items()})
        if self.topo is None:
            env.update(dmlc_env(node.role, LOOPBACK, port, self.num_workers, self.num_servers,
                                LOOPBACK, "lo"))
        else:
            env.update(dmlc_env(node.role, self.topo.addr("sched"), port, self.num_workers,
                                self.num_servers, self.topo.addr(node.name), "eth0"))
        env.update({k: str(v) for k, v in self.role_env.get(node.role, {}).items()})
        env.update({k: str(v) for k, v in self.role_env.get(node.name, {}).items()})
        return env

    def _spawn(self, node: Node, env, fo, fe) -> subprocess.Popen:
        argv = [sys.executable] + self.script_argv
        kw = dict(env=env, stdin=subprocess.DEVNULL, stdout=fo, stderr=fe, cwd=REPO_ROOT,
                  start_new_session=True)
        if self.topo is None:
            return subprocess.Popen(argv, **kw)
        return self.topo.popen(node.name, argv, **kw)

    def _sample_cpu(self, now_wall):
        for n in self.nodes:
            if n.pid and n.returncode is None:
                t = cpu_ticks(n.pid)
                if t is not None:
                    n.cpu.append((now_wall, t / CLK_TCK))

    def run(self) -> JobResult:
        port = free_port() if self.topo is None else NAMESPACE_ROOT_PORT
        os.makedirs(self.log_dir, exist_ok=True)
        files = []
        reason, timed_out = "", False
        start = time.monotonic()
        self.started_at = time.time()
        try:
            for n in self.nodes:
                n.out_path = os.path.join(self.log_dir, n.name + ".out")
                n.err_path = os.path.join(self.log_dir, n.name + ".err")
                fo, fe = open(n.out_path, "wb"), open(n.err_path, "wb")
                files += [fo, fe]
                p = self._spawn(n, self._node_env(n, port), fo, fe)
                self._popens.append(p)
                n.pid, n.started = p.pid, time.monotonic()
            workers_done_at = None
            next_cpu = 0.0
            while True:
                now = time.monotonic()
                if now >= next_cpu:
                    self._sample_cpu(time.time())
                    next_cpu = now + self.cpu_interval
                for n, p in zip(self.nodes, self._popens):
                    if n.returncode is None and p.poll() is not None:
                        n.returncode, n.seconds = p.returncode, now - n.started
                bad = [n for n in self.nodes if n.returncode not in (None, 0)]
                if bad:
                    reason = "%s (%s) exited with code %s" % (bad[0].name, bad[0].role,
                                                             bad[0].returncode)
                    break
                if all(n.returncode is not None for n in self.nodes):
                    break
                if workers_done_at is None and all(
                        n.returncode is not None for n in self.nodes if n.role == "worker"):
                    workers_done_at = now
                if workers_done_at is not None and \
                        now - workers_done_at > SERVER_EXIT_GRACE_SECONDS:
                    reason = "workers finished but %s did not exit within %.0f s" % (
                        ", ".join(n.name for n in self.nodes if n.returncode is None),
                        SERVER_EXIT_GRACE_SECONDS)
                    break
                if now - start > self.timeout:
                    timed_out = True
                    reason = "timeout after %.0f s; still running: %s" % (
                        self.timeout,
                        ", ".join(n.name for n in self.nodes if n.returncode is None))
                    break
                if self.on_poll is not None:
                    self.on_poll(self)
                time.sleep(POLL_SECONDS)
        except BaseException as exc:
            reason = reason or "harness error: %r" % (exc,)
            raise
        finally:
            self.stop()
            for f in files:
                f.close()
        result = JobResult(nodes=self.nodes, wall_seconds=time.monotonic() - start,
                           started_at=self.started_at, reason=reason, timed_out=timed_out,
                           log_dir=self.log_dir)
        return result

    def stop(self):
        """Stop every process still running (SIGTERM to its group, then SIGKILL); reap all."""
        for n, p in zip(self.nodes, self._popens):
            if p.poll() is None:
                n.killed = True
                _kill_group(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 2.0
        for p in self._popens:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        end = time.monotonic()
        for n, p in zip(self.nodes, self._popens):
            _kill_group(p.pid, signal.SIGKILL)   # leftovers of exited nodes' groups, too
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
            if n.returncode is None:
                n.returncode, n.seconds = p.returncode, end - n.started

    def cleanup_logs(self):
        if self._own_log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)


def _kill_group(pid, sig):
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
