"""mxps: a bandwidth-aware parameter server for Apache MXNet, as ``kvstore='mxps'``.

    import mxps                      # before `import mxnet`
    import mxnet as mx
    trainer = gluon.Trainer(params, 'sgd', {...}, kvstore='mxps')

launched like native dist_sync with MXNet's own launcher (mxnet/tools/launch.py).  In scheduler
and server processes ``import mxps`` runs mxps's role and exits (mxps.roles.takeover); in workers it
registers the kvstore names ``mxps`` (sync; MXPS_MODE=async or wsp for the others),
``mxps_sync``, ``mxps_async`` and ``mxps_wsp``, and applies the in-process fixes MXNet 1.9.1 needs (mxps.adapter.fixes).
"""
from ._version import __version__

REQUIRED_MXNET = "1.9.1"


def _check_mxnet_version():
    # without importing mxnet: in server/scheduler processes that import never returns
    from importlib import metadata
    try:
        have = metadata.version("mxnet")
    except metadata.PackageNotFoundError:
        raise ImportError("mxps needs mxnet==%s, which is not installed "
                          "(pip install mxnet==%s 'numpy<1.24')"
                          % (REQUIRED_MXNET, REQUIRED_MXNET)) from None
    if have != REQUIRED_MXNET:
        raise ImportError(
            "mxps needs mxnet==%s but mxnet %s is installed: mxps drives MXNet internals "
            "(its engine's async operations, kvstore plugin hooks, the launcher) and patches "
            "exactly that version (see patches/). Install it with: pip install mxnet==%s"
            % (REQUIRED_MXNET, have, REQUIRED_MXNET))


_check_mxnet_version()

from .roles import takeover as _takeover  # noqa: E402

_takeover.take_over()

# a worker from here on
from . import config as _config  # noqa: E402
from .adapter import fixes as _fixes  # noqa: E402

_fixes.apply_runtime_fixes(_config.role_from_env(), _config.mxnet_update_on_kvstore)

from .adapter.kvstore import MXPS, MXPS_Async, MXPS_Sync  # noqa: E402,F401
from .config import ConfigError  # noqa: E402,F401
from .store.table_init import TableInit  # noqa: E402,F401
from .adapter.resume import resume_round, resume_trainer  # noqa: E402,F401
from .roles.worker import RemoteError  # noqa: E402,F401
from .roles.link import PeerLostError  # noqa: E402,F401

__all__ = ["MXPS", "MXPS_Async", "MXPS_Sync", "TableInit", "resume_trainer", "resume_round",
           "ConfigError",
           "RemoteError", "PeerLostError", "__version__"]
