"""Asynchronous engine operations: compiled ``mxps._engine`` unless MXPS_PURE_PYTHON=1."""
import ctypes
import os

if os.environ.get("MXPS_PURE_PYTHON", "0") in ("1", "true", "yes", "on"):
    from . import engine_py as _impl
    IMPLEMENTATION = "python"
else:
    try:
        from . import _engine as _impl
        IMPLEMENTATION = "cython"
    except ImportError as e:  # pragma: no cover - a broken install
        raise ImportError(
            "mxps's compiled extension mxps/_engine is missing (%s). Reinstall with "
            "`pip install .` from the mxps checkout (it builds cython/engine.pyx), or set "
            "MXPS_PURE_PYTHON=1 to use the slower pure-Python path." % e) from None

_bound = []


def push_async(fn, const_handles, mutable_handles, priority=0, name=b"mxps"):
    """Run ``fn(completion)`` on MXNet's engine after the arrays' pending operations; the
    mutable arrays count as written when ``completion()`` is called (from any thread)."""
    if not _bound:
        from mxnet.base import _LIB
        _impl.bind(ctypes.cast(_LIB.MXEnginePushAsyncND, ctypes.c_void_p).value)
        _bound.append(True)
    _impl.push_async(fn, const_handles, mutable_handles, priority, name)
