"""Pure-Python (ctypes) twin of ``cython/engine.pyx``: asynchronous operations on MXNet's engine.

Same API and semantics as the compiled module (see its docstring); used as the reference in tests
and as the fallback when ``MXPS_PURE_PYTHON=1``.  The only difference is that ``Completion()``
here calls the engine while holding the GIL.
"""
import ctypes
import sys
import threading
import traceback


class _OnComplete(ctypes.Structure):
    # engine::CallbackOnComplete in include/mxnet/engine.h (MXNet 1.9.1): three pointers.
    _fields_ = [("callback", ctypes.c_void_p), ("engine", ctypes.c_void_p),
                ("param", ctypes.c_void_p)]


class _Context(ctypes.Structure):
    _fields_ = [("dev_type", ctypes.c_int32), ("dev_id", ctypes.c_int32)]


_ASYNC_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
_DELETER_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_CALLBACK_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)

_state = {}
_live = {}            # id -> fn, kept alive until the engine deletes the operation
_live_lock = threading.Lock()
_next_id = [1]


def bind(push_async_nd_address):
    """Give the module the address of libmxnet's ``MXEnginePushAsyncND``."""
    proto = ctypes.CFUNCTYPE(ctypes.c_int, _ASYNC_FN, ctypes.c_void_p, _DELETER_FN,
                             ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                             ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_void_p,
                             ctypes.c_int, ctypes.c_char_p, ctypes.c_bool)
    _state["push"] = proto(push_async_nd_address)
    _state["ctx"] = _Context(1, 0)   # Context::kCPU, device 0


class Completion:
    """Releases the engine operation it was handed to; call exactly once, from any thread."""

    __slots__ = ("_oc", "done")

    def __init__(self, oc):
        self._oc = oc
        self.done = False

    def __call__(self):
        if self.done:
            raise RuntimeError("engine operation completed twice")
        self.done = True
        _CALLBACK_FN(self._oc.callback)(self._oc.engine, self._oc.param, None)


def _run(rctx, on_complete, param):
    oc = _OnComplete.from_buffer_copy(ctypes.string_at(on_complete, ctypes.sizeof(_OnComplete)))
    c = Completion(oc)
    with _live_lock:
        fn = _live[param]
    try:
        fn(c)
    except BaseException as exc:  # never let an exception escape into the engine thread
        traceback.print_exc()
        sys.stderr.write("mxps: engine callback failed: %r\n" % (exc,))
        if not c.done:
            c()


def _release(param):
    with _live_lock:
        _live.pop(param, None)


_RUN = _ASYNC_FN(_run)
_RELEASE = _DELETER_FN(_release)


def push_async(fn, const_handles, mutable_handles, priority=0, name=b"mxps"):
    """Push ``fn(completion)`` as an asynchronous engine operation (see cython/engine.pyx)."""
    if "push" not in _state:
        raise RuntimeError("mxps.engine_py.bind() was not called")
    with _live_lock:
        key = _next_id[0]
        _next_id[0] += 1
        _live[key] = fn
    consts = (ctypes.c_void_p * max(1, len(const_handles)))(*const_handles)
    muts = (ctypes.c_void_p * max(1, len(mutable_handles)))(*mutable_handles)
    rc = _state["push"](_RUN, ctypes.c_void_p(key), _RELEASE, ctypes.byref(_state["ctx"]),
                        consts if const_handles else None, len(const_handles),
                        muts if mutable_handles else None, len(mutable_handles),
                        None, priority, name, False)
    if rc != 0:
        raise RuntimeError("MXEnginePushAsyncND failed with code %d" % rc)
