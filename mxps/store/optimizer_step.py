"""One optimizer update of flat numpy arrays, as the row stores and the memory store's
row-sparse rounds run it (so both give the same numbers): MXNet's optimizer on NDArrays made
from the arrays, the results as numpy views."""
import mxnet as mx
import numpy as np

from ..kernels.ndview import numpy_view
from . import row_sets as sparse


def state_template(optimizer, index, dtype):
    """The optimizer's state for one element: its structure, and how many arrays it has.
    Refuses a state that does not start at zero (the row store creates zeros) or is nested."""
    template = optimizer.create_state_multi_precision(index, mx.nd.zeros((1,), dtype=dtype))
    arrays = sparse.state_arrays(template)
    for a in arrays:
        if a.asnumpy().any():
            raise ValueError("the %s's state does not start at zero; the disk store cannot "
                             "create it row by row" % type(optimizer).__name__)
    return template, len(arrays)


def step(optimizer, index, w, g, states, template):
    """One optimizer update of flat numpy ``w`` (weights) with gradient ``g`` and ``states``
    (flat numpy arrays in the order of ``template``'s arrays); returns the new (w, states):
    numpy views of the NDArrays the optimizer updated (one copy of each input, none back)."""
    dtype = w.dtype
    w_nd = mx.nd.array(w, dtype=dtype)
    g_nd = mx.nd.array(g, dtype=dtype)
    s_nd = sparse.like_state(template, [mx.nd.array(s, dtype=s.dtype) for s in states])
    optimizer.update_multi_precision(index, w_nd, g_nd, s_nd)
    out = [w_nd] + sparse.state_arrays(s_nd)
    for a in out:
        a.wait_to_read()
    views = [_held_view(a) for a in out]
    return views[0], views[1:]


class _Held(np.ndarray):
    """A numpy view that keeps its NDArray alive."""


def _held_view(nd):
    v = numpy_view(nd).view(_Held)
    v.nd = nd
    return v
