"""The one door from the tools to the mxps runtime.

A tool runs in a user's shell, where a job's ``DMLC_ROLE=server`` may well be set, and
``import mxps`` turns a server or scheduler process into that role (it is how MXNet's launcher
starts mxps's roles).  A tool is never a role: it imports runtime modules only through
``module``, which imports them as a worker would, and only inside the commands that need them
(importing the runtime imports MXNet).
"""
import importlib
import os


def module(name):
    """``mxps.<name>``, imported without this process taking a role."""
    saved = os.environ.pop("DMLC_ROLE", None)
    try:
        return importlib.import_module("mxps." + name)
    finally:
        if saved is not None:
            os.environ["DMLC_ROLE"] = saved
