"""The one door from the tools to the mxps runtime.

A tool runs in a user's shell, where a job's ``DMLC_ROLE=server`` may well be set, and
``import mxps`` turns a server or scheduler process into that role (it is how MXNet's launcher
starts mxps's roles).  A tool is never a role: it imports runtime modules only through
``module``, which imports them as a worker would, and only inside the commands that need them
(importing the runtime imports MXNet).
"""
import importlib
import os
import sys


def module(name):
    """``mxps.<name>``, imported without this process taking a role."""
    saved = os.environ.pop("DMLC_ROLE", None)
    try:
        return importlib.import_module("mxps." + name)
    finally:
        if saved is not None:
            os.environ["DMLC_ROLE"] = saved


def python_argv(args):
    """The command line of a Python process a tool starts: ``python <args>``, importing the
    *installed* mxps whatever the current directory.

    ``python -m module`` and ``python -c code`` put the current directory first on
    ``sys.path``: started from a checkout's root, the checkout's uncompiled ``mxps/`` would
    shadow the installed package and its compiled kernels.  ``-P`` (Python 3.11's safe path)
    leaves the current directory off.  It is a flag of this one process, not an environment
    variable (``PYTHONSAFEPATH`` would reach every process the job starts, and take a user's
    script's own directory off its path too), and it keeps the job's working directory the
    caller's, where relative paths like ``--out`` are meant.  A script (``python
    path/to/train.py``) keeps its own directory on its path, as Python gives it.
    """
    args = [str(a) for a in args]
    if args and args[0] in ("-m", "-c"):
        return [sys.executable, "-P"] + args
    return [sys.executable] + args
