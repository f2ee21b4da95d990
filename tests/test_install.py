"""The installed commands: never a parameter-server role; and mxps as a newcomer installs it.

A tool runs in a shell where a job's ``DMLC_ROLE=server`` may well be set, and ``import mxps``
(or ``import mxnet``) in such a process starts that role. So the installed console scripts
(``mxps``, ``mxps-patch`` next to ``sys.executable``, as pip generated them) are run with a
job's DMLC_* variables, the scheduler's address pointing at a port this test listens on: each
command must exit as it should, nothing may connect to that port, and the commands that need no
MXNet must import neither ``mxnet`` nor the ``mxps`` runtime (seen with
PYTHONPROFILEIMPORTTIME, which makes the interpreter log every import).

Then the README's first command, taken from README.md and run verbatim by bash in a fresh
clone of this checkout's HEAD, from the clone's root, with no virtualenv active, as a newcomer
runs it (tests/readme_run.py; the session starts it in the background): it builds its own
``.venv`` from a wheel pip makes of the clone and runs ``mxps bench --quick`` on the emulated
network (the netns tier).  Every system of the quick bench must have produced step times.  That
install is then used from a temporary directory, with nothing of the clone on the path: it holds
the compiled kernels, the patches and the console scripts and nothing of the tests or sources;
``mxps-patch`` reverts and applies that venv's MXNet; the compiled kernels are the ones used;
and a small loopback bench runs native dist_sync and mxps (the job ships as ``python -m
mxps_tools.bench_job``), whose workers end with the same losses.

Marked ``slow``.
"""
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time

import pytest

from mxps_tools import patching
from readme_run import readme_commands

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
#: The smallest bench that runs both systems on more than one server and worker.
SMALL_BENCH = ["bench", "--network", "loopback", "-n", "2", "-s", "2", "--model", "mlp",
               "--mlp-hidden", "64", "--steps", "2", "--warmup", "1", "--compute-steps", "1",
               "--systems", "native,mxps-default", "--timeout", "120", "--no-progress"]


# --------------------------------------------------------------------------- helpers

def job_vars(role, port):
    """The variables MXNet's launcher gives one node of a job, the scheduler at ``port``."""
    return {"DMLC_ROLE": role, "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(port),
            "DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "1", "DMLC_NODE_HOST": "127.0.0.1",
            "DMLC_INTERFACE": "lo"}


class SchedulerPort:
    """A listening port on 127.0.0.1 standing in for a job's scheduler.

    A process that became a server would connect to it (a connection stays in the accept
    queue even after its client exits); one that became a scheduler could not bind it."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]

    def connections(self):
        """How many connections were made since the last call (each is closed)."""
        n = 0
        while True:
            try:
                conn, _ = self.sock.accept()
            except BlockingIOError:
                return n
            conn.close()
            n += 1


@pytest.fixture
def scheduler_port():
    port = SchedulerPort()
    yield port
    port.sock.close()


@dataclasses.dataclass
class Ran:
    argv: list
    returncode: int
    stdout: str
    stderr: str             # without PYTHONPROFILEIMPORTTIME's lines
    imported: set           # every module the interpreter imported (when profiled)

    def describe(self):
        return "%s -> exit %s\nstdout:\n%s\nstderr:\n%s" % (
            " ".join(map(str, self.argv)), self.returncode, self.stdout[-3000:],
            self.stderr[-3000:])


def run(argv, env_extra=None, cwd=None, timeout=60.0, profile_imports=True):
    """Run a command with a clean environment (no PYTHONPATH, no DMLC_*) plus ``env_extra``.

    A command still running after ``timeout`` seconds (e.g. one that became a parameter-server
    role and waits for its job) is killed with its process group and fails the test."""
    env = {k: v for k, v in os.environ.items()
           if k != "PYTHONPATH" and not k.startswith("DMLC_")}
    env.update(env_extra or {})
    if profile_imports:
        env["PYTHONPROFILEIMPORTTIME"] = "1"
    proc = subprocess.Popen([str(a) for a in argv], env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        ran = _ran(argv, None, out, err)
        pytest.fail("did not exit within %.0f s (did it become a parameter-server role?): %s"
                    % (timeout, ran.describe()))
    return _ran(argv, proc.returncode, out, err)


def _ran(argv, returncode, out, err):
    timing = [ln for ln in err.splitlines() if ln.startswith("import time:")]
    rest = "\n".join(ln for ln in err.splitlines() if not ln.startswith("import time:"))
    imported = {ln.rsplit("|", 1)[-1].strip() for ln in timing}
    return Ran(list(argv), returncode, out, rest, imported)


def runtime_imports(ran):
    """The modules of MXNet and of the mxps runtime a command imported (mxps_tools is fine)."""
    return sorted(m for m in ran.imported
                  if m.split(".")[0] in ("mxnet", "mxps") or m == "dmlc_tracker")


def assert_not_a_role(ran, port, needs_mxnet=False):
    """Nothing connected to the job's scheduler port and, unless the command needs MXNet, neither
    MXNet nor the runtime was imported."""
    assert port.connections() == 0, "connected to the job's scheduler port (became a role): " \
        + ran.describe()
    if not needs_mxnet:
        assert ran.imported, "no import log: PYTHONPROFILEIMPORTTIME was not honoured"
        assert runtime_imports(ran) == [], ran.describe()


def installed_script(name, bindir=BIN):
    """A console script as pip installed it (``<venv>/bin/<name>``)."""
    path = os.path.join(bindir, name)
    if not os.access(path, os.X_OK):
        pytest.fail("console script %s is not installed next to %s (pip install -e '.[test]' "
                    "installs it)" % (name, sys.executable))
    return path


def write_metrics(path, rank=0, steps=3, servers=2):
    """A small MXPS_METRICS file as a worker writes it (mxps.placement.metrics)."""
    with open(path, "w") as f:
        for step in range(1, steps + 1):
            f.write(json.dumps({
                "step": step, "wall": 1000.0 + step, "rank": rank, "step_seconds": 0.1 * step,
                "plan_version": 0 if step < 3 else 1, "migration_bytes": 0,
                "servers": [{"server": s, "bytes": 100, "busy_seconds": 0.01, "rate": 1e6,
                             "share": 1.0 / servers, "rate_estimate": 1e6 * (s + 1)}
                            for s in range(servers)]}) + "\n")
    return path


def copy_patched_files(site_packages, dest):
    """A directory laid out like site-packages holding (copies of) the files the patches touch."""
    for p in patching.load_patches():
        for f in p.files:
            target = os.path.join(dest, *f.path.split("/"))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copy2(os.path.join(site_packages, *f.path.split("/")), target)
    return dest


def snapshot(root):
    out = {}
    for d, _, files in os.walk(root):
        for n in files:
            with open(os.path.join(d, n), "rb") as f:
                out[os.path.relpath(os.path.join(d, n), root)] = f.read()
    return out


# --------------------------------------------------------------------------- console scripts

def test_the_tool_modules_import_neither_mxnet_nor_the_runtime_in_a_server_process(
        scheduler_port):
    code = ("import importlib, sys\n"
            "for m in ('cli', 'patching', 'bench', 'jobs', 'emunet', 'plot', 'runtime'):\n"
            "    importlib.import_module('mxps_tools.' + m)\n"
            "print(sorted(n for n in sys.modules if n.split('.')[0] in ('mxnet', 'mxps')))\n")
    ran = run([sys.executable, "-c", code], job_vars("server", scheduler_port.port),
              cwd=REPO, profile_imports=False)
    assert ran.returncode == 0, ran.describe()
    assert ran.stdout.strip() == "[]", ran.describe()
    assert scheduler_port.connections() == 0


@pytest.mark.parametrize("role", ["server", "scheduler"])
def test_mxps_commands_that_need_no_mxnet_run_normally_with_a_jobs_variables_set(
        role, scheduler_port, tmp_path):
    mxps = installed_script("mxps")
    env = job_vars(role, scheduler_port.port)
    metrics = write_metrics(tmp_path / "metrics-0.jsonl")
    patched = patching.check()
    cases = [
        (["--help"], 0, "usage: mxps"),
        (["launch", "--help"], 0, "usage: mxps launch"),
        (["bench", "--help"], 0, "--network"),
        (["plot", metrics, "--out-dir", tmp_path / "plots"], 0, str(tmp_path / "plots")),
        # no training command: refused before any namespace or launcher is started
        (["launch"], 1, "give the training command" if patched else "mxps-patch apply"),
    ]
    for args, code, text in cases:
        ran = run([mxps] + args, env, cwd=str(tmp_path))
        assert ran.returncode == code, ran.describe()
        assert text in ran.stdout + ran.stderr, ran.describe()
        assert_not_a_role(ran, scheduler_port)
    with open(tmp_path / "plots" / "steps.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("role", ["server", "scheduler"])
def test_mxps_patch_checks_applies_and_reverts_with_a_jobs_variables_set(
        role, scheduler_port, tmp_path):
    tool = installed_script("mxps-patch")
    env = job_vars(role, scheduler_port.port)
    real = patching.find_site_packages()
    sp = copy_patched_files(real, str(tmp_path / "site-packages"))
    n = len(patching.load_patches())

    def mxps_patch(*args, code):
        ran = run([tool] + list(args), env, cwd=str(tmp_path))
        assert ran.returncode == code, ran.describe()
        assert_not_a_role(ran, scheduler_port)
        return ran.stdout

    mxps_patch("revert", "--site-packages", sp, code=0)      # the copies as MXNet shipped them
    pristine = snapshot(sp)
    assert mxps_patch("check", "--site-packages", sp, code=1).count("not applied") == n
    out = mxps_patch("apply", "--site-packages", sp, code=0)
    assert out.count("applied") == n and "already" not in out
    assert snapshot(sp) != pristine
    assert mxps_patch("apply", "--site-packages", sp, code=0).count("already applied") == n
    assert mxps_patch("check", "--site-packages", sp, code=0).count("applied") == n
    assert mxps_patch("status", "--site-packages", sp, code=0).count("applied") == n
    mxps_patch("revert", "--site-packages", sp, code=0)
    assert snapshot(sp) == pristine
    # the real environment, found without importing mxnet (read only)
    out = mxps_patch("status", code=0 if patching.check() else 1)
    assert out.count(real) == n, out


# --------------------------------------------------------------------------- a newcomer's install

def _must(ran, what):
    assert ran.returncode == 0, "%s failed:\n%s" % (what, ran.describe())
    return ran


def _installed(first):
    """The clone venv's site-packages and mxps's installed files (its dist-info RECORD: what
    the wheel pip built from the clone held)."""
    assert first.returncode == 0, first.describe()
    sp = run([first.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
             profile_imports=False).stdout.strip()
    info = [n for n in os.listdir(sp) if n.startswith("mxps-") and n.endswith(".dist-info")]
    assert len(info) == 1, info
    with open(os.path.join(sp, info[0], "RECORD")) as f:
        names = [line.split(",")[0] for line in f if line.strip()]
    with open(os.path.join(sp, info[0], "entry_points.txt")) as f:
        entry_points = f.read()
    return sp, names, entry_points


@pytest.mark.netns
def test_the_readmes_first_command_runs_verbatim_in_a_fresh_clone_from_its_root(
        readme_first_command):
    first = readme_first_command
    assert first.command == readme_commands()[0]
    assert first.returncode == 0, first.describe()
    assert first.summary is not None, "no bench.json:\n" + first.describe()
    names = [r["name"] for r in first.summary["systems"]]
    assert {"native", "native-p3", "mxps-default", "mxps-adaptive"} <= set(names), names
    for r in first.summary["systems"]:
        assert r["ok"], "%s: %s\n%s" % (r["name"], r.get("reason"), first.describe())
        assert r["workers"] and all(w["step_seconds"] for w in r["workers"]), (
            r, first.describe())
    assert "mxps-adaptive" in first.stdout, first.describe()
    print("README's first command: %.0f s from a fresh clone" % first.seconds)


@pytest.mark.netns
def test_the_install_holds_the_compiled_kernels_the_patches_and_the_console_scripts(
        readme_first_command):
    _, names, entry_points = _installed(readme_first_command)
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    for ext in ("_accum", "_engine"):
        assert "mxps/kernels/%s%s" % (ext, suffix) in names, names
    for p in patching.load_patches():
        assert "mxps_tools/_patches/" + p.name in names, names
    assert "mxps_tools/bench_job.py" in names
    assert not [n for n in names if n.startswith(("tests/", "cython/", "patches/"))], names
    assert "mxps = mxps_tools.cli:main" in entry_points
    assert "mxps-patch = mxps_tools.patching:main" in entry_points


@pytest.mark.netns
def test_installed_mxps_patch_reverts_and_applies_and_a_small_bench_runs_from_anywhere(
        readme_first_command, scheduler_port, tmp_path):
    first = readme_first_command
    sp, _, _ = _installed(first)
    cwd = str(tmp_path)                   # not the clone: nothing of it is importable
    env = job_vars("server", scheduler_port.port)

    # the tools and their patch files come from the venv, and importing them starts no role
    ran = _must(run([first.python, "-c", "import mxps_tools.patching as p; print(p.__file__); "
                     "print(p.patches_dir())"], env, cwd=cwd), "import of the installed tools")
    assert_not_a_role(ran, scheduler_port)
    for path in ran.stdout.split():
        assert os.path.realpath(path).startswith(os.path.realpath(sp)), ran.stdout

    # the README's command patched the venv's MXNet; mxps-patch reverts and applies it again,
    # from any directory, each time saying which files
    mxps_patch = installed_script("mxps-patch", first.bindir)
    ran = _must(run([mxps_patch, "check"], env, cwd=cwd), "mxps-patch check")
    assert ran.stdout.count(sp) == 2, ran.describe()
    _must(run([mxps_patch, "revert"], env, cwd=cwd), "mxps-patch revert")
    ran = run([mxps_patch, "check"], env, cwd=cwd)
    assert ran.returncode == 1 and ran.stdout.count("not applied") == 2, ran.describe()
    assert_not_a_role(ran, scheduler_port)
    ran = _must(run([mxps_patch, "apply"], env, cwd=cwd), "mxps-patch apply")
    assert ran.stdout.count("applied") == 2 and "already" not in ran.stdout, ran.describe()
    assert_not_a_role(ran, scheduler_port)
    assert_not_a_role(_must(run([mxps_patch, "check"], env, cwd=cwd), "mxps-patch check"),
                      scheduler_port)

    # a worker uses the compiled kernels of the install
    ran = _must(run([first.python, "-c", "import mxps, mxps.kernels.accum as a, "
                     "mxps.kernels.engine as e; print(a.IMPLEMENTATION, e.IMPLEMENTATION); "
                     "print(mxps.__file__, a._impl.__file__, e._impl.__file__)"],
                    cwd=cwd, profile_imports=False), "import mxps in a worker")
    impls, files = ran.stdout.splitlines()[-2:]
    assert impls.split() == ["cython", "cython"], ran.describe()
    for path in files.split():
        assert os.path.realpath(path).startswith(os.path.realpath(sp)), files

    # the bench: native dist_sync and mxps, both from the venv, with a job's variables set
    mxps = installed_script("mxps", first.bindir)
    t0 = time.monotonic()
    ran = run([mxps] + SMALL_BENCH + ["--no-plots", "--out-dir", "out"], env, cwd=cwd,
              timeout=400, profile_imports=False)
    bench_seconds = time.monotonic() - t0
    assert ran.returncode == 0, ran.describe()
    assert_not_a_role(ran, scheduler_port, needs_mxnet=True)
    with open(os.path.join(cwd, "out", "bench.json")) as f:
        summary = json.load(f)
    systems = {r["name"]: r for r in summary["systems"]}
    assert sorted(systems) == ["mxps-default", "native"]
    losses = {}
    for name, r in systems.items():
        assert r["ok"], "%s: %s\n%s" % (name, r.get("reason"), r.get("failure", ""))
        assert sorted(w["rank"] for w in r["workers"]) == [0, 1], r["workers"]
        assert all(len(w["step_seconds"]) == 2 for w in r["workers"]), r["workers"]
        losses[name] = {w["rank"]: w["loss"] for w in r["workers"]}
    # the same synchronous SGD on the same data: each rank ends with the same loss
    for rank, loss in losses["native"].items():
        assert losses["mxps-default"][rank] == pytest.approx(loss, rel=1e-5), losses
    for rank in (0, 1):
        assert os.path.isfile(os.path.join(
            cwd, "out", "metrics-loopback-mxps-default-%d.jsonl" % rank))
    print("small bench from the install: %.1f s" % bench_seconds)


def test_without_matplotlib_plots_are_refused_up_front_not_after_a_run(scheduler_port,
                                                                        tmp_path):
    """The wheel does not bring matplotlib (the examples' extra does): a bench that would plot
    and ``mxps plot`` say so before any job starts."""
    code = ("import sys; sys.modules['matplotlib'] = None; "
            "from mxps_tools.cli import main; sys.exit(main(sys.argv[1:]))")
    env = job_vars("server", scheduler_port.port)
    for args in (SMALL_BENCH + ["--out-dir", "refused"], ["plot", "m.jsonl"]):
        ran = run([sys.executable, "-c", code] + args, env, cwd=str(tmp_path))
        assert ran.returncode == 2 and "needs matplotlib" in ran.stderr, ran.describe()
        assert_not_a_role(ran, scheduler_port)
    assert not os.path.exists(tmp_path / "refused")


# --------------------------------------------------------------------------- the README

def test_readme_opens_with_the_two_commands_and_ci_runs_the_second():
    first, second = readme_commands()[:2]
    assert first.endswith("mxps bench --quick") and "pip install '.[examples]'" in first
    assert second.startswith("bash scripts/test-deps.sh && ") and second.endswith(
        "python -m pytest -q tests")
    with open(os.path.join(REPO, ".ci", "run")) as f:
        ci = f.read()
    assert "blocks[1]" in ci and 'bash -c "$cmd"' in ci, ci
