"""What ``import mxps`` does in a scheduler or server process: run mxps's role, then exit.

MXNet's launcher starts the *same* command for every role and tells them apart by DMLC_ROLE.
``import mxnet`` in a process whose DMLC_ROLE is server or scheduler starts MXNet's native
ps-lite node and never returns (mxnet/kvstore/kvstore_server.py).  So mxps takes over first:
``import mxps`` (before ``import mxnet``) runs mxps's scheduler or server in that process and
exits with its status.  The server needs MXNet for the optimizer; it imports it with DMLC_ROLE
reading "worker" so that MXNet does not start its own server.
"""
import contextlib
import faulthandler
import logging
import signal
import sys

from .. import config

#: Modules a server's ``import mxnet`` leaves out.  mxnet/model.py imports scikit-learn, when it
#: is installed, only to give the deprecated ``FeedForward`` a base class (``BaseEstimator``, or
#: ``object`` on ImportError); that pulls in scipy and pandas: 0.4 s of CPU of a server's
#: 2.2 s import of mxnet on this project's 2-core machine (``/usr/bin/time``; 0.7 s under
#: ``python -X importtime``).  A server process runs mxps's server and exits: no
#: user code runs in it after ``import mxps``, and mxps's server never touches ``FeedForward``.
SERVER_SKIPS = ("sklearn",)


@contextlib.contextmanager
def imports_refused(names):
    """Within the block ``import NAME`` raises ImportError for each of ``names`` that is not
    imported yet (``sys.modules[NAME] = None``, Python's own way); the refusal is lifted on
    exit, so a later import works.  Modules already imported stay as they are."""
    refused = [n for n in names if n not in sys.modules]
    for n in refused:
        sys.modules[n] = None
    try:
        yield refused
    finally:
        for n in refused:
            if n in sys.modules and sys.modules[n] is None:
                del sys.modules[n]


def _import_mxnet_quietly():
    if "mxnet" in sys.modules:
        return sys.modules["mxnet"]
    with config.role_hidden(), imports_refused(SERVER_SKIPS):
        import mxnet
    return mxnet


#: The signal on which every mxps process writes the Python stack of each of its threads to
#: its stderr (``faulthandler``) and goes on: what a hung node is doing.  The job runner
#: (``mxps_tools.jobs``) sends it to every node still running when a job times out.
STACKS_SIGNAL = signal.SIGUSR1


def stacks_on_signal(sig=STACKS_SIGNAL):
    """Write every thread's stack to stderr (fd 2) on ``sig``, unless the process already
    handles ``sig`` (a script's own handler is kept).  Returns whether it was registered."""
    try:
        if signal.getsignal(sig) is not signal.SIG_DFL:
            return False
        faulthandler.register(sig, file=2, all_threads=True)
    except (ValueError, OSError, RuntimeError):   # not the main thread, no such signal
        return False
    return True


def take_over(env=None):
    """Run this process's mxps role if it is a server or scheduler; returns for workers."""
    role = config.role_from_env(env)
    stacks_on_signal()
    if role == "worker":
        return
    cfg = config.from_env(env)
    logging.basicConfig(level=cfg.log_level,
                        format="%(asctime)s mxps " + role + " %(levelname)s %(message)s")
    if role == "scheduler":
        from . import scheduler
        code = scheduler.run(cfg)
    else:
        _import_mxnet_quietly()
        from . import server
        code = server.run(cfg)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)
