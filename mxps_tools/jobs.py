"""Run one parameter-server job: a scheduler, S servers and W workers, one process each.

The one job runner of mxps: ``mxps bench`` and the tests start their jobs here.  A job runs
either on loopback (every node on 127.0.0.1, plain subprocesses) or in an ``emunet.Topology``
(node ``sched``, ``s0..``, ``w0..`` in their own namespaces, started with ``Topology.popen``).
Every node gets the DMLC variables native ps-lite and mxps read, including ``DMLC_NODE_HOST``
(its own address) and ``DMLC_INTERFACE`` (``lo`` or ``eth0``): without them native ps-lite
binds to the first non-loopback interface.  The scheduler also gets ``MXPS_JOB_INFO``, where
mxps's scheduler writes the job's rank assignment (``Job.job_info``).

Nodes run ``[python] + script_argv`` in ``cwd`` (default: the caller's current directory) with
the caller's environment: the runner never puts a source tree on PYTHONPATH, so what the nodes
import (mxps, the bench job) must be installed, as it is for a user; a ``-m``/``-c`` job runs
with ``python -P`` (``runtime.python_argv``), so a checkout's root as the current directory
cannot shadow the installed package.  Every node is the leader
of its own process group and writes stdout/stderr to ``<log_dir>/<node>.out|.err`` (a pipe that
nobody reads would block it).

Two ways to use it.  To completion: the first node to exit non-zero, the timeout, or servers
that outlive the workers by ``SERVER_EXIT_GRACE_SECONDS`` end the job::

    result = Job(["-m", "mxps_tools.bench_job", "--steps", "5"], num_workers=2,
                 num_servers=2, env={"MXPS_LOG_LEVEL": "INFO"}, topo=topo).run()
    result.raise_for_failure()

Observed: the caller decides what ends the job (a failure test watches how the other nodes
react to one it kills)::

    with Job([fault_job], 2, 1, env=env) as job:          # started here
        job.wait(lambda: os.path.exists(ready), 60, "the ready file")
        job.kill("s0")
        job.wait(job.all_exited, 30, "the exit of every node")
    print(job.result.describe())                          # stopped on leaving the block

While it is followed (``run``, ``wait``) the runner records exits as they happen (a pidfd per
node wakes it), samples every process's CPU time (psutil), optionally the sockets they own, and
calls ``on_poll(job)`` about every ``POLL_SECONDS`` so the caller can follow logs and change the
network.  Whatever happens (a timeout, a failure, an exception or Ctrl-C in the caller) every
process group is killed (SIGTERM, then SIGKILL) before ``run`` returns or the ``with`` block is
left.
"""
import dataclasses
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Union

import psutil

from .runtime import python_argv

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
#: After the last worker exits cleanly, servers and the scheduler get this long to exit.
SERVER_EXIT_GRACE_SECONDS = 30.0
#: Longest wait between two looks at the job (exits wake the runner at once).
POLL_SECONDS = 0.1
#: Between SIGTERM to the process groups still running and SIGKILL.
STOP_GRACE_SECONDS = 2.0
SOCKET_INTERVAL_SECONDS = 0.25
#: On a timeout: the signal on which every mxps node writes its threads' stacks to its stderr
#: (``mxps.roles.takeover.STACKS_SIGNAL``), and how long the runner then waits for them.
STACKS_SIGNAL = signal.SIGUSR1
STACKS_GRACE_SECONDS = 1.0
#: In the log dir: the scheduler's job info (MXPS_JOB_INFO).
JOB_INFO_FILE = "job-info.json"
TAIL_CHARS = 3000


class JobError(RuntimeError):
    """The job cannot be run as asked (bad arguments, used twice, unknown node)."""


class JobFailed(RuntimeError):
    """``JobResult.raise_for_failure``: the job did not end well (the message describes it)."""


class JobTimeout(RuntimeError):
    """``Job.wait``: what was awaited did not happen in time (the message describes the job)."""


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def dmlc_env(role, root_uri, root_port, num_workers, num_servers, host, interface):
    """The DMLC variables one node needs (what dmlc_tracker's launchers set)."""
    return {"DMLC_ROLE": role, "DMLC_PS_ROOT_URI": root_uri,
            "DMLC_PS_ROOT_PORT": str(root_port), "DMLC_NUM_WORKER": str(num_workers),
            "DMLC_NUM_SERVER": str(num_servers), "DMLC_NODE_HOST": host,
            "DMLC_INTERFACE": interface}


def read_job_info(path: str) -> Optional[dict]:
    """The job info mxps's scheduler writes to ``path`` (MXPS_JOB_INFO), or None while there is
    none: not written yet, or not completely (a torn file does not parse)."""
    try:
        with open(path) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


# --------------------------------------------------------------------------- observing processes

def cpu_seconds(proc: psutil.Process) -> Optional[float]:
    """User + system CPU seconds of ``proc`` (its own, not its children's); None if it is gone."""
    try:
        t = proc.cpu_times()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return t.user + t.system


def _address(addr) -> str:
    """psutil's (ip, port) as ``ip:port`` (``[ip]:port`` for IPv6); ``*:*`` for none."""
    if not addr:
        return "*:*"
    return ("[%s]:%d" if ":" in addr.ip else "%s:%d") % (addr.ip, addr.port)


def sockets_of(pids) -> List[dict]:
    """TCP and UDP sockets owned by ``pids``: ``{"type", "state", "local", "peer", "pids"}``
    (state as psutil names it: LISTEN, ESTABLISHED, ..., NONE for UDP)."""
    found: Dict[tuple, dict] = {}
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for c in conns:
            kind = "tcp" if c.type == socket.SOCK_STREAM else "udp"
            key = (kind, _address(c.laddr), _address(c.raddr))
            entry = found.setdefault(key, {"type": kind, "state": c.status, "local": key[1],
                                           "peer": key[2], "pids": []})
            if pid not in entry["pids"]:
                entry["pids"].append(pid)
    return list(found.values())


def interpolate(samples, t):
    """Linear interpolation of (time, value) samples, in time order, at ``t`` (clamped to the
    ends)."""
    import numpy as np
    return float(np.interp(t, [s[0] for s in samples], [s[1] for s in samples]))


# --------------------------------------------------------------------------- nodes and results

@dataclasses.dataclass(eq=False)
class Node:
    """One process of the job. ``name`` is its emunet node (``sched``, ``s0``, ``w1``)."""
    name: str
    role: str                        # scheduler, server, worker
    index: int                       # launch index within the role (not the ps rank)
    pid: int = 0
    out_path: str = ""
    err_path: str = ""
    started: float = 0.0             # time.monotonic() at its start
    exited_at: Optional[float] = None   # time.monotonic() when the runner saw it exit
    returncode: Optional[int] = None
    killed: bool = False             # stopped by the runner (timeout, a failure, stop())
    cpu: List[tuple] = dataclasses.field(default_factory=list)   # (unix time, cpu seconds)
    kept: Optional[Dict[str, str]] = dataclasses.field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.killed

    @property
    def seconds(self) -> Optional[float]:
        """How long it ran (so far, if it still runs); None before its start."""
        if not self.started:
            return None
        return (self.exited_at if self.exited_at is not None else time.monotonic()) - \
            self.started

    def read(self, which: str = "err") -> str:
        """Its stderr (``err``) or stdout (``out``) so far."""
        if self.kept is not None:
            return self.kept[which]
        path = self.err_path if which == "err" else self.out_path
        try:
            with open(path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    @property
    def stderr(self) -> str:
        return self.read("err")

    @property
    def stdout(self) -> str:
        return self.read("out")

    def tail(self, chars: int = TAIL_CHARS) -> str:
        text = self.stderr.strip() or self.stdout.strip()
        return text[-chars:]

    def cpu_seconds_between(self, t0: float, t1: float) -> Optional[float]:
        """CPU seconds used in [t0, t1] (unix times), interpolated between samples."""
        if len(self.cpu) < 2:
            return None
        return interpolate(self.cpu, t1) - interpolate(self.cpu, t0)


@dataclasses.dataclass
class JobResult:
    """What the runner observed; the job's ``result``, kept up to date while it is followed.
    ``ok`` means every node exited 0 on its own in time."""
    nodes: List[Node]
    port: int = 0
    log_dir: str = ""                # empty once a temporary log dir is removed
    started_at: float = 0.0          # unix time of the start
    wall_seconds: float = 0.0
    reason: str = ""                 # why the job is not ok (run()); empty if it is
    timed_out: bool = False
    sockets: List[dict] = dataclasses.field(default_factory=list)   # watch_sockets
    job_info: Optional[dict] = None  # the scheduler's MXPS_JOB_INFO file, read at the end

    @property
    def ok(self) -> bool:
        return not self.reason and all(n.ok for n in self.nodes)

    @property
    def workers(self) -> List[Node]:
        return [n for n in self.nodes if n.role == "worker"]

    @property
    def failed(self) -> Optional[Node]:
        """The first node that failed on its own (non-zero exit), else the first one killed."""
        bad = sorted((n for n in self.nodes if n.returncode not in (0, None) and not n.killed),
                     key=lambda n: n.exited_at)
        bad = bad or [n for n in self.nodes if n.killed]
        return bad[0] if bad else None

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise JobError("the job has no node %r (nodes: %s)"
                       % (name, ", ".join(n.name for n in self.nodes)))

    def by_pid(self, pid: int) -> Node:
        for n in self.nodes:
            if n.pid == pid:
                return n
        raise JobError("pid %s is not a node of this job\n%s" % (pid, self.describe()))

    def describe(self, since: Optional[float] = None, tails: str = "failed",
                 tail_chars: int = TAIL_CHARS) -> str:
        """Every node's pid, exit code and time; the stderr tail of the failed node
        (``tails="all"``: of every node).  ``since``: a time.monotonic() to report exits
        relative to (the moment a test made something happen)."""
        lines = ["job on port %d: %s (%.1f s)%s" % (
            self.port, self.reason or ("ok" if self.ok else "not ended ok"), self.wall_seconds,
            "; logs in %s" % self.log_dir if self.log_dir else "")]
        for n in self.nodes:
            secs = n.seconds
            when = "" if since is None or n.exited_at is None else \
                ", exited %.1f s after the event" % (n.exited_at - since)
            lines.append("  %-6s %-9s pid %-7d rc=%-5s %s%s%s" % (
                n.name, n.role, n.pid, n.returncode,
                "%5.1f s" % secs if secs is not None else "not started", when,
                " (killed by the runner)" if n.killed else ""))
        shown = self.nodes if tails == "all" else [n for n in [self.failed] if n is not None]
        for n in shown:
            text = n.tail(tail_chars)
            if text:
                lines.append("--- %s stderr (tail) ---" % n.name)
                lines.append(text)
        return "\n".join(lines)

    def raise_for_failure(self) -> "JobResult":
        """Raise JobFailed naming the failing node, with its stderr tail."""
        if not self.ok:
            raise JobFailed(self.describe())
        return self


def layout(num_workers: int, num_servers: int) -> List[Node]:
    """The nodes of a job, in start order: sched, s0.., w0.."""
    return [Node("sched", "scheduler", 0)] + \
        [Node("s%d" % i, "server", i) for i in range(num_servers)] + \
        [Node("w%d" % i, "worker", i) for i in range(num_workers)]


def node_names(num_workers: int, num_servers: int) -> List[str]:
    return [n.name for n in layout(num_workers, num_servers)]


# --------------------------------------------------------------------------- the runner

class Job:
    """One job: ``run()`` it to completion, or start it (``with``) and observe it.

    Args:
        script_argv: the script and its arguments; every node runs ``[python] + script_argv``.
        num_workers, num_servers: job size.
        env: variables for every node (on top of os.environ and QUIET_ENV).
        role_env: extra variables per role (``{'scheduler': {...}}``) or node name (``'w1'``).
        topo: an open ``emunet.Topology`` holding nodes ``sched``, ``s<i>``, ``w<i>``; None runs
            on loopback.
        timeout: seconds for the whole job (``run``).
        log_dir: where node stdout/stderr files (and the job info) go, kept; default a temp dir,
            removed when the job stops (the outputs are kept in memory, ``Node.read``).
        on_poll: called with this Job about every POLL_SECONDS while it is followed.
        cpu_interval: seconds between CPU samples of every process (None: no samples).
        cwd: the nodes' working directory; default the caller's.
        host: the loopback address every node uses (loopback jobs only).
        watch_sockets: sample the sockets of the nodes into ``result.sockets``.
    """

    def __init__(self, script_argv: Sequence[str], num_workers: int, num_servers: int,
                 env: Optional[Mapping[str, str]] = None,
                 role_env: Optional[Mapping[str, Mapping[str, str]]] = None, topo=None,
                 timeout: float = 600.0, log_dir: Optional[str] = None,
                 on_poll: Optional[Callable[["Job"], None]] = None,
                 cpu_interval: Optional[float] = 0.25, cwd: Optional[str] = None,
                 host: str = LOOPBACK, watch_sockets: bool = False):
        if num_workers < 1 or num_servers < 1:
            raise JobError("a job needs at least one worker and one server, got %d workers "
                           "and %d servers" % (num_workers, num_servers))
        if topo is None and not host.startswith("127."):
            raise JobError("host %r is not a loopback address: jobs outside a topology must "
                           "stay on 127.0.0.0/8" % host)
        self.script_argv = [str(a) for a in script_argv]
        self.num_workers = num_workers
        self.num_servers = num_servers
        self.env = {k: str(v) for k, v in (env or {}).items()}
        self.role_env = {k: {kk: str(vv) for kk, vv in v.items()}
                         for k, v in (role_env or {}).items()}
        self.topo = topo
        self.timeout = timeout
        self.host = host
        self.cwd = os.path.abspath(cwd or os.getcwd())
        self._own_log_dir = log_dir is None
        self.log_dir = None if log_dir is None else os.path.abspath(log_dir)
        self.on_poll = on_poll
        self.cpu_interval = cpu_interval
        self.watch_sockets = watch_sockets
        self.nodes = layout(num_workers, num_servers)
        self.result = JobResult(nodes=self.nodes)
        self.port = 0
        self.job_info_path = ""
        self._procs: Dict[str, subprocess.Popen] = {}
        self._ps: Dict[str, psutil.Process] = {}
        self._exits = _ExitWatch()
        self._state = "new"
        self._t0 = 0.0
        self._next_cpu = 0.0
        self._next_sockets = 0.0
        if topo is not None:
            missing = [n.name for n in self.nodes if n.name not in topo.nodes]
            if missing:
                raise JobError("the topology has no nodes %s (it has %s)" % (missing, topo.nodes))

    # ---- nodes --------------------------------------------------------------------------
    def node(self, name: str) -> Node:
        return self.result.node(name)

    def by_pid(self, pid: int) -> Node:
        return self.result.by_pid(pid)

    def all_exited(self) -> bool:
        return all(n.returncode is not None for n in self.nodes)

    def job_info(self) -> Optional[dict]:
        """The job info mxps's scheduler wrote (None before it did, or for native jobs)."""
        return read_job_info(self.job_info_path) if self.job_info_path else None

    def kill(self, node: Union[str, Node], sig: int = signal.SIGKILL) -> Node:
        """Send ``sig`` to one node's process (not its group); the runner does not count it as
        killed by itself (``Node.killed``)."""
        n = node if isinstance(node, Node) else self.node(node)
        if n.returncode is None:
            try:
                os.kill(n.pid, sig)
            except ProcessLookupError:
                pass
        return n

    # ---- lifecycle ----------------------------------------------------------------------
    def __enter__(self) -> "Job":
        return self.start()

    def __exit__(self, *exc_info):
        self.stop()

    def start(self) -> "Job":
        """Start every node (sched, servers, workers, in this order)."""
        if self._state != "new":
            raise JobError("the job was already started; a Job runs once")
        self._state = "running"
        try:
            self.port = free_port(self.host) if self.topo is None else NAMESPACE_ROOT_PORT
            if self.log_dir is None:
                self.log_dir = tempfile.mkdtemp(prefix="mxps-job-")
            os.makedirs(self.log_dir, exist_ok=True)
            self.job_info_path = os.path.join(self.log_dir, JOB_INFO_FILE)
            if os.path.exists(self.job_info_path):      # a previous job's, in a reused dir
                os.remove(self.job_info_path)
            self.result.port, self.result.log_dir = self.port, self.log_dir
            self.result.started_at = time.time()
            self._t0 = time.monotonic()
            for n in self.nodes:
                self._spawn(n)
        except BaseException:
            self.stop()
            raise
        return self

    def _node_env(self, node: Node) -> Dict[str, str]:
        env = dict(os.environ)
        env.update(QUIET_ENV)
        env.update(self.env)
        if self.topo is None:
            env.update(dmlc_env(node.role, self.host, self.port, self.num_workers,
                                self.num_servers, self.host, "lo"))
        else:
            env.update(dmlc_env(node.role, self.topo.addr("sched"), self.port,
                                self.num_workers, self.num_servers, self.topo.addr(node.name),
                                "eth0"))
        if node.role == "scheduler":
            env["MXPS_JOB_INFO"] = self.job_info_path
        env.update(self.role_env.get(node.role, {}))
        env.update(self.role_env.get(node.name, {}))
        return env

    def _spawn(self, node: Node):
        node.out_path = os.path.join(self.log_dir, node.name + ".out")
        node.err_path = os.path.join(self.log_dir, node.name + ".err")
        argv = python_argv(self.script_argv)
        with open(node.out_path, "wb") as fo, open(node.err_path, "wb") as fe:
            kw = dict(env=self._node_env(node), cwd=self.cwd, stdin=subprocess.DEVNULL,
                      stdout=fo, stderr=fe, start_new_session=True)
            if self.topo is None:
                p = subprocess.Popen(argv, **kw)
            else:
                p = self.topo.popen(node.name, argv, **kw)
        self._procs[node.name] = p
        node.pid, node.started = p.pid, time.monotonic()
        self._exits.add(p.pid)
        try:
            self._ps[node.name] = psutil.Process(p.pid)
        except psutil.NoSuchProcess:
            pass

    def poll(self) -> List[Node]:
        """Record the exit of every node that exited since the last look; returns those."""
        now = time.monotonic()
        done = []
        for n in self.nodes:
            p = self._procs.get(n.name)
            if p is not None and n.returncode is None and p.poll() is not None:
                n.returncode, n.exited_at = p.returncode, now
                self._exits.discard(n.pid)
                done.append(n)
        return done

    def _sample(self):
        now = time.monotonic()
        if self.cpu_interval is not None and now >= self._next_cpu:
            wall = time.time()
            for n in self.nodes:
                ps = self._ps.get(n.name)
                if ps is not None and n.returncode is None:
                    c = cpu_seconds(ps)
                    if c is not None:
                        n.cpu.append((wall, c))
            self._next_cpu = now + self.cpu_interval
        if self.watch_sockets and now >= self._next_sockets:
            seen = {(s["type"], s["local"], s["peer"]) for s in self.result.sockets}
            for s in sockets_of(n.pid for n in self.nodes if n.returncode is None and n.pid):
                if (s["type"], s["local"], s["peer"]) not in seen:
                    self.result.sockets.append(s)
            self._next_sockets = now + SOCKET_INTERVAL_SECONDS

    def _follow(self, until: Callable[[], bool], deadline: float) -> bool:
        """Watch the job until ``until()`` is true (True) or the monotonic ``deadline``
        (False): record exits, sample, call on_poll; exits wake the wait at once."""
        if self._state != "running":
            raise JobError("the job is %s: start it first" % self._state)
        while True:
            self.poll()
            self._sample()
            self.result.wall_seconds = time.monotonic() - self._t0
            if until():
                return True
            now = time.monotonic()
            if now >= deadline:
                return False
            if self.on_poll is not None:
                self.on_poll(self)
            self._exits.wait(min(POLL_SECONDS, max(0.0, deadline - time.monotonic())))

    def wait(self, until: Callable[[], bool], timeout: float, what: str) -> None:
        """Follow the running job until ``until()`` is true.

        Raises:
            JobTimeout: naming ``what`` and describing the job, after ``timeout`` seconds.
        """
        if not self._follow(until, time.monotonic() + timeout):
            self.dump_stacks()
            raise JobTimeout("no %s within %.0f s\n%s"
                             % (what, timeout, self.result.describe(tails="all")))

    def run(self) -> JobResult:
        """Start the job, follow it to its end (see the module doc), stop it; the result.  On
        a timeout the nodes still running first write their threads' stacks to their stderr
        (``dump_stacks``)."""
        with self:
            if not self._follow(self._ended, self._t0 + self.timeout):
                self.result.timed_out = True
                self.result.reason = "timeout after %.0f s; still running: %s" % (
                    self.timeout, ", ".join(n.name for n in self.nodes if n.returncode is None))
                dumped = self.dump_stacks()
                if dumped:
                    self.result.reason += " (their stacks: %s)" % ", ".join(
                        "%s.err" % n for n in dumped)
        return self.result

    def dump_stacks(self, grace: float = STACKS_GRACE_SECONDS) -> List[str]:
        """Ask every node still running that catches STACKS_SIGNAL (every mxps node: a
        ``faulthandler`` dump) for its threads' stacks, written to its stderr, and wait
        ``grace`` seconds for them; a node that does not catch it is left alone (the signal
        would end it).  Returns the names of the nodes asked."""
        asked = []
        for n in self.nodes:
            if n.pid and n.returncode is None and _catches(n.pid, STACKS_SIGNAL):
                try:
                    os.kill(n.pid, STACKS_SIGNAL)
                except ProcessLookupError:
                    continue
                asked.append(n.name)
        if asked:
            time.sleep(grace)
            self.poll()
        return asked

    def _ended(self) -> bool:
        """run()'s end: a node failed (the reason names it), every node exited, or the servers
        outlived the workers by SERVER_EXIT_GRACE_SECONDS."""
        bad = sorted((n for n in self.nodes if n.returncode not in (None, 0)),
                     key=lambda n: n.exited_at)
        if bad:
            self.result.reason = "%s (%s) exited with code %s" % (bad[0].name, bad[0].role,
                                                                 bad[0].returncode)
            return True
        if self.all_exited():
            return True
        workers = self.result.workers
        if all(n.returncode is not None for n in workers):
            last = max(n.exited_at for n in workers)
            if time.monotonic() - last > SERVER_EXIT_GRACE_SECONDS:
                self.result.reason = "workers finished but %s did not exit within %.0f s" % (
                    ", ".join(n.name for n in self.nodes if n.returncode is None),
                    SERVER_EXIT_GRACE_SECONDS)
                return True
        return False

    def stop(self) -> JobResult:
        """Stop every node still running (SIGTERM to its process group, SIGKILL after
        STOP_GRACE_SECONDS), kill what exited nodes left in their groups, reap every node.
        Idempotent."""
        if self._state == "stopped":
            return self.result
        self._state = "stopped"
        try:
            self._stop_processes()
        finally:
            self._exits.close()
            if self._t0:
                self.result.wall_seconds = time.monotonic() - self._t0
            if self.job_info_path:
                self.result.job_info = read_job_info(self.job_info_path)
            if self._own_log_dir and self.log_dir:
                for n in self.nodes:
                    n.kept = {"out": n.read("out"), "err": n.read("err")}
                shutil.rmtree(self.log_dir, ignore_errors=True)
                self.result.log_dir = ""
        return self.result

    def _stop_processes(self):
        self.poll()
        for n in self.nodes:
            if n.name in self._procs and n.returncode is None:
                n.killed = True
                _kill_group(n.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for p in self._procs.values():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in self._procs.values():
            _kill_group(p.pid, signal.SIGKILL)   # leftovers of exited nodes' groups, too
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.poll()


class _ExitWatch:
    """Pidfds of the running nodes: ``wait`` returns as soon as one of them exits."""

    def __init__(self):
        self._poller = select.poll()
        self._fds: Dict[int, int] = {}       # pid -> pidfd

    def add(self, pid: int):
        try:
            fd = os.pidfd_open(pid)
        except (OSError, AttributeError):     # gone already, or no pidfds: ticks find it
            return
        self._fds[pid] = fd
        self._poller.register(fd, select.POLLIN)

    def discard(self, pid: int):
        fd = self._fds.pop(pid, None)
        if fd is not None:
            self._poller.unregister(fd)
            os.close(fd)

    def wait(self, seconds: float):
        """Up to ``seconds``; a pidfd that fired is dropped (``Job.poll`` records the exit)."""
        for fd, _ in self._poller.poll(seconds * 1000):
            pid = next((p for p, f in self._fds.items() if f == fd), None)
            if pid is not None:
                self.discard(pid)

    def close(self):
        for pid in list(self._fds):
            self.discard(pid)


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (the SigCgt mask of /proc/PID/status);
    False if it is gone or the mask cannot be read."""
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (int(sig) - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _kill_group(pid, sig):
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
