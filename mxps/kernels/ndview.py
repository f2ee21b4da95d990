"""Zero-copy numpy views of MXNet NDArray memory (CPU, dense).

A view bypasses MXNet's engine: read it only when every write to the array has completed, and
write it only when nothing reads or writes it (inside an engine operation that holds the array,
or after ``wait_to_read``/``wait_to_write``).
"""
import ctypes

import numpy as np
from mxnet.base import _LIB, check_call
from mxnet.ndarray import array as _nd_array


def data_pointer(nd):
    ptr = ctypes.c_void_p()
    check_call(_LIB.MXNDArrayGetData(nd.handle, ctypes.byref(ptr)))
    return ptr.value


def _onednn_chunk_methods():
    """libmxnet's ``NDArray::Chunk::IsMKLDNN`` and ``NDArray::Chunk::Reorder2Default`` (C++,
    exported by MXNet 1.9.1 built with oneDNN, as the pip wheels are), or None without oneDNN."""
    try:
        is_onednn = _LIB._ZNK5mxnet7NDArray5Chunk8IsMKLDNNEv
        reorder = _LIB._ZN5mxnet7NDArray5Chunk15Reorder2DefaultEv
    except AttributeError:
        return None
    is_onednn.restype, is_onednn.argtypes = ctypes.c_bool, [ctypes.c_void_p]
    reorder.restype, reorder.argtypes = None, [ctypes.c_void_p]
    return is_onednn, reorder


_ONEDNN = _onednn_chunk_methods()


def _chunk(nd):
    """The ``NDArray::Chunk *`` of ``nd``: an NDArrayHandle is an ``NDArray *`` whose first
    member is ``std::shared_ptr<Chunk> ptr_`` (MXNet 1.9.1), the Chunk pointer first."""
    return ctypes.c_void_p.from_address(nd.handle.value).value


def in_onednn_layout(nd):
    """Whether ``nd``'s memory holds oneDNN-layout data (always False without oneDNN)."""
    if _ONEDNN is None or nd.stype != "default":
        return False
    chunk = _chunk(nd)
    return bool(chunk) and _ONEDNN[0](chunk)


def to_default_layout(nd):
    """Inside an engine operation that holds ``nd`` as a *mutable* array: convert its memory
    to the default layout in place if oneDNN left it in one of its own; True if it did.

    MXNet built with oneDNN keeps some arrays in a oneDNN layout: an inference-mode forward
    of a convolution caches its weight that way (``MKLDNNDataReorderAsync``), a training-mode
    forward converts it back with an engine operation it pushes *when it runs*.  For such an
    array ``MXNDArrayGetData`` pushes a conversion on the array (a write) and waits for it:
    called from an engine operation that holds the array, the conversion waits for the
    operation and the operation for the conversion, for ever (the flaky hang of a SqueezeNet
    job whose Trainer pulled into weights the first forward had left in a oneDNN layout).
    The conversion here is the one that engine operation would run (``Chunk::
    Reorder2Default``), done by the operation that already holds the array exclusively."""
    if not in_onednn_layout(nd):
        return False
    _ONEDNN[1](_chunk(nd))
    return True


def engine_view(nd):
    """``numpy_view`` for an engine operation that holds ``nd`` as a mutable array (never
    ``numpy_view`` there: see ``to_default_layout``)."""
    to_default_layout(nd)
    return numpy_view(nd)


def numpy_view(nd):
    """A flat numpy array sharing memory with the CPU NDArray ``nd``.  Outside an engine
    operation only (an array in a oneDNN layout is converted by an engine operation it waits
    for); inside one, ``engine_view``."""
    if nd.stype != "default":
        raise TypeError("mxps handles dense arrays only, got storage type %r" % nd.stype)
    dt = np.dtype(nd.dtype)
    n = int(np.prod(nd.shape)) if nd.shape else 1
    if n == 0:
        return np.empty(0, dtype=dt)
    ptr = data_pointer(nd)
    buf = (ctypes.c_char * (n * dt.itemsize)).from_address(ptr)
    return np.frombuffer(buf, dtype=dt)


def handle_value(nd):
    return nd.handle.value


def cut_state(state, lo, hi):
    """Elements [lo, hi) of an optimizer state (an NDArray, a tuple or list of them, or None)
    as flat numpy copies, in the same structure."""
    if state is None:
        return None
    if isinstance(state, (tuple, list)):
        return type(state)(cut_state(x, lo, hi) for x in state)
    return state.asnumpy().reshape(-1)[lo:hi].copy()


def join_state(parts):
    """The inverse of ``ndview.cut_state`` over consecutive parts."""
    first = parts[0]
    if first is None:
        return None
    if isinstance(first, (tuple, list)):
        return type(first)(join_state([p[i] for p in parts]) for i in range(len(first)))
    return np.concatenate(parts) if len(parts) > 1 else first


def to_numpy(state):
    """An optimizer state (NDArrays) as numpy arrays, in the same structure."""
    if state is None:
        return None
    if isinstance(state, (tuple, list)):
        return type(state)(to_numpy(s) for s in state)
    return state.asnumpy()


def to_nd(state):
    """``to_numpy``'s inverse: numpy arrays as NDArrays, in the same structure."""
    if state is None:
        return None
    if isinstance(state, (tuple, list)):
        return type(state)(to_nd(s) for s in state)
    return _nd_array(state, dtype=state.dtype)
