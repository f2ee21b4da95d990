"""The README's first command, run once per test session as a newcomer runs it.

The command is taken from README.md and run verbatim by bash in a fresh ``git clone`` of this
checkout's HEAD, from the clone's root, with no virtualenv active: it builds its own ``.venv``
there (mxps from a wheel pip builds, MXNet, the examples' extras), patches that venv's MXNet and
runs ``mxps bench --quick`` on the emulated network (root: the netns tier).

It takes about three minutes, most of it the bench's runs on links of 100-400 Mbit/s, which
leave the machine's cores mostly idle.  So the session starts it in the background as soon as
the tests are collected, when a selected test uses it (``conftest.py``), and the tests that read
its result wait for it: the README test, the tests of what the install holds
(tests/test_install.py) and of the static bench's report (tests/test_bench.py).  The clone,
with its venv, is removed at the end of the session.
"""
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the whole command: the install (~45 s here) and the quick bench (~110 s)
TIMEOUT = 1500.0


def readme_commands(repo: str = REPO):
    """The shell commands of README.md's ```bash blocks, in order."""
    with open(os.path.join(repo, "README.md")) as f:
        return [b.strip() for b in re.findall(r"```bash\n(.*?)\n```", f.read(), re.S)]


def newcomer_env():
    """This environment as a new user's shell has it: no virtualenv active, nothing of the
    test run on the paths."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH")
           and not k.startswith(("DMLC_", "MXPS_", "PYTEST_"))}
    venv = os.environ.get("VIRTUAL_ENV") or sys.prefix
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p and not os.path.realpath(p).startswith(
                                      os.path.realpath(venv) + os.sep))
    return env


@dataclasses.dataclass
class FirstCommand:
    """What the README's first command left in its clone."""
    command: str
    clone: str
    returncode: Optional[int]
    stdout: str
    stderr: str
    seconds: float
    summary: Optional[dict]         # the bench's bench.json, if it wrote one

    @property
    def venv(self):
        return os.path.join(self.clone, ".venv")

    @property
    def bindir(self):
        return os.path.join(self.venv, "bin")

    @property
    def python(self):
        return os.path.join(self.bindir, "python")

    @property
    def out_dir(self):
        return os.path.join(self.clone, "mxps-bench-out")

    def describe(self):
        return "exit %s after %.0f s\n--- stdout (tail)\n%s\n--- stderr (tail)\n%s" % (
            self.returncode, self.seconds, self.stdout[-6000:], self.stderr[-6000:])


class Background:
    """The command running in a thread of this process; ``result()`` waits for it."""

    def __init__(self, repo: str = REPO):
        self.repo = repo
        self.base = tempfile.mkdtemp(prefix="mxps-readme-")
        self._proc = None
        self._result = None
        self._error = None
        self._stopped = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="readme-first-command",
                                        daemon=True)
        self._thread.start()

    def _run(self):
        try:
            self._result = self._first_command()
        except BaseException as exc:          # handed to the test that waits for it
            self._error = exc

    def _first_command(self):
        command = readme_commands(self.repo)[0]
        clone = os.path.join(self.base, "mxps")
        subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", self.repo, clone],
                       check=True, capture_output=True, timeout=120)
        t0 = time.monotonic()
        with self._lock:
            if self._stopped:
                raise RuntimeError("the session ended before the command started")
            self._proc = subprocess.Popen(
                ["bash", "-c", command], cwd=clone, env=newcomer_env(),
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True, start_new_session=True)
        try:
            stdout, stderr = self._proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            self._end_process()
            stdout, stderr = self._proc.communicate()
        summary = None
        path = os.path.join(clone, "mxps-bench-out", "bench.json")
        if os.path.exists(path):
            with open(path) as f:
                summary = json.load(f)
        return FirstCommand(command, clone, self._proc.returncode, stdout, stderr,
                            time.monotonic() - t0, summary)

    def _end_process(self):
        """SIGTERM first (the bench removes its namespaces), then SIGKILL."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def result(self) -> FirstCommand:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result

    def stop(self):
        """End the command if it still runs, and remove the clone."""
        with self._lock:
            self._stopped = True
        self._end_process()
        self._thread.join(timeout=120)
        shutil.rmtree(self.base, ignore_errors=True)
