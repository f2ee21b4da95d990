"""Row-sparse keys (MXNet's ``row_sparse`` gradients and weights): pure helpers shared by the
worker's adapter and the server (docs/SPARSE.md).

A key of shape (R, C, ...) is a table of R rows of ``cols`` = C x ... elements.  Its slices
on the servers are the same element ranges as a dense key's (MXNet's placement, or mxps's
plans), so a row may straddle two slices.  A sparse push or pull of a slice therefore names
global row ids and carries, per row, the row's elements that fall inside the slice: whole rows
inside it, the head or tail of the first and last row when the slice cuts them.  Rows are
sorted and distinct (MXNet's row_sparse invariant, checked), so the flat values are the rows'
values concatenated and trimmed at both ends (``cut``); the server turns the ids back into
element positions inside its slice (``positions``).

A server applies a sparse round as MXNet's lazy update does: only the elements of rows that
some worker pushed change, weights and optimizer state alike; every supported optimizer is
elementwise, so it runs on the gathered elements as a flat vector.
"""
import numpy as np

#: Optimizers whose update is elementwise and whose MXNet update has a lazy (row-sparse) form;
#: others are refused for sparse pushes, naming the optimizer.
LAZY_OPTIMIZERS = ("sgd", "adam", "adagrad", "ftrl")


def check_ids(ids, n_rows, what):
    """``ids`` (int64) sorted, distinct, within [0, n_rows); raises ValueError naming ``what``."""
    if ids.ndim != 1:
        raise ValueError("%s: row ids must be one-dimensional, got shape %s" % (what, ids.shape))
    if ids.size and (ids[0] < 0 or ids[-1] >= n_rows):
        raise ValueError("%s: row ids must lie in [0, %d), got %d..%d"
                         % (what, n_rows, ids[0], ids[-1]))
    if ids.size > 1 and not (np.diff(ids) > 0).all():
        raise ValueError("%s: row ids must be sorted and distinct" % what)


def cut(ids, values, cols, lo, hi):
    """The part of a row-sparse array (sorted ``ids``, ``values`` of shape (n, cols)) inside the
    element range [lo, hi) of the flat table: ``(ids, flat values)``."""
    if cols <= 0:
        raise ValueError("rows need at least one element, got cols=%d" % cols)
    first = np.searchsorted(ids, lo // cols, side="left")
    last = np.searchsorted(ids, -(-hi // cols), side="left")
    sel = ids[first:last]
    if sel.size == 0:
        return sel, values.reshape(-1)[:0]
    flat = values[first:last].reshape(-1)
    head = max(0, lo - int(sel[0]) * cols)
    tail = max(0, (int(sel[-1]) + 1) * cols - hi)
    return sel, flat[head:flat.size - tail]


def positions(ids, cols, offset, length):
    """Element positions inside the slice [offset, offset + length) of the rows ``ids`` (the
    order ``cut`` gives their values in); raises ValueError when a row misses the slice."""
    if ids.size == 0:
        return np.zeros(0, np.int64)
    if cols <= 0:
        raise ValueError("rows need at least one element, got cols=%d" % cols)
    starts = ids.astype(np.int64) * cols - offset
    lo = np.maximum(starts, 0)
    hi = np.minimum(starts + cols, length)
    if (hi <= lo).any():
        bad = int(ids[np.argmax(hi <= lo)])
        raise ValueError("row %d (%d elements per row) has no element in the slice [%d, %d)"
                         % (bad, cols, offset, offset + length))
    counts = hi - lo
    total = int(counts.sum())
    # positions: lo[i] + 0..counts[i]-1, concatenated, without a Python loop
    base = np.repeat(lo - np.concatenate(([0], np.cumsum(counts)[:-1])), counts)
    return base + np.arange(total, dtype=np.int64)


def merge(parts):
    """The sum of a round's sparse pushes: ``parts`` a list of (positions, values) (each
    positions array distinct); returns (sorted distinct positions, summed values).  Sums in
    push order for every element (deterministic)."""
    if not parts:
        return np.zeros(0, np.int64), None
    pos = np.concatenate([p for p, _ in parts])
    vals = np.concatenate([v for _, v in parts])
    order = np.argsort(pos, kind="stable")
    pos, vals = pos[order], vals[order]
    if pos.size == 0:
        return pos, vals
    starts = np.flatnonzero(np.concatenate(([True], pos[1:] != pos[:-1])))
    summed = np.add.reduceat(vals, starts) if starts.size != pos.size else vals
    return pos[starts], summed


def state_arrays(state):
    """The NDArrays of an optimizer state (None, an NDArray, or a flat tuple/list of them), in
    order; raises ValueError for a nested state (multi-precision: a float32 master copy)."""
    if state is None:
        return []
    if isinstance(state, (tuple, list)):
        out = []
        for x in state:
            if isinstance(x, (tuple, list)):
                raise ValueError("a nested optimizer state (multi-precision) cannot be updated "
                                 "row by row")
            if x is not None:
                out.append(x)
        return out
    return [state]


def like_state(state, arrays):
    """``arrays`` in the structure of ``state`` (``state_arrays``'s inverse)."""
    if state is None:
        return None
    if isinstance(state, (tuple, list)):
        it = iter(arrays)
        return type(state)(None if x is None else next(it) for x in state)
    return arrays[0]
