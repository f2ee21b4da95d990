"""What ``import mxps`` does in a scheduler or server process: run mxps's role, then exit.

MXNet's launcher starts the *same* command for every role and tells them apart by DMLC_ROLE.
``import mxnet`` in a process whose DMLC_ROLE is server or scheduler starts MXNet's native
ps-lite node and never returns (mxnet/kvstore/kvstore_server.py).  So mxps takes over first:
``import mxps`` (before ``import mxnet``) runs mxps's scheduler or server in that process and
exits with its status.  The server needs MXNet for the optimizer; it imports it with DMLC_ROLE
reading "worker" so that MXNet does not start its own server.
"""
import logging
import sys

from .. import config


def _import_mxnet_quietly():
    if "mxnet" in sys.modules:
        return sys.modules["mxnet"]
    with config.role_hidden():
        import mxnet
    return mxnet


def take_over(env=None):
    """Run this process's mxps role if it is a server or scheduler; returns for workers."""
    role = config.role_from_env(env)
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
