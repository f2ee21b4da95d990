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


def numpy_view(nd):
    """A flat numpy array sharing memory with the CPU NDArray ``nd``."""
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
