"""Asynchronous engine operations: compiled ``mxps._engine`` unless MXPS_PURE_PYTHON=1."""
import ctypes

from ._select import implementation

_impl, IMPLEMENTATION = implementation("_engine", "engine_py", "engine.pyx")

_bound = []


def push_async(fn, const_handles, mutable_handles, priority=0, name=b"mxps"):
    """Run ``fn(completion)`` on MXNet's engine after the arrays' pending operations; the
    mutable arrays count as written when ``completion()`` is called (from any thread)."""
    if not _bound:
        from mxnet.base import _LIB
        _impl.bind(ctypes.cast(_LIB.MXEnginePushAsyncND, ctypes.c_void_p).value)
        _bound.append(True)
    _impl.push_async(fn, const_handles, mutable_handles, priority, name)
