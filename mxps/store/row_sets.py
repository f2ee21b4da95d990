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
from collections import namedtuple

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


class RowSet(namedtuple("RowSet", "ids cols offset length")):
    """The rows of a sparse push or pull inside the slice [offset, offset + length): sorted
    distinct global row ids of ``cols`` elements each.  The first row's ``head`` elements and
    the last row's ``tail`` lie outside the slice; ``size`` elements lie inside, and travel
    flat in ``cut``'s order.  Servers work on whole rows (``padded``, ``trimmed``), so a round
    costs memory per row, not per element (docs/SPARSE.md)."""

    __slots__ = ()

    @property
    def head(self):
        return max(0, self.offset - int(self.ids[0]) * self.cols) if self.ids.size else 0

    @property
    def tail(self):
        if not self.ids.size:
            return 0
        return max(0, (int(self.ids[-1]) + 1) * self.cols - self.offset - self.length)

    @property
    def size(self):
        return self.ids.size * self.cols - self.head - self.tail

    def positions(self):
        """The element positions inside the slice, per element (``positions``)."""
        return positions(self.ids, self.cols, self.offset, self.length)


def rows_in(ids, cols, offset, length):
    """``ids`` as a RowSet of the slice [offset, offset + length); raises ValueError when a row
    misses the slice (the same check as ``positions``, per row)."""
    if cols <= 0:
        raise ValueError("rows need at least one element, got cols=%d" % cols)
    ids = np.asarray(ids, np.int64)
    if ids.size:
        starts = ids * cols - offset
        bad = (starts + cols <= 0) | (starts >= length)
        if bad.any():
            raise ValueError("row %d (%d elements per row) has no element in the slice [%d, %d)"
                             % (int(ids[np.argmax(bad)]), cols, offset, offset + length))
    return RowSet(ids, int(cols), int(offset), int(length))


def padded(rows, flat):
    """Flat values in ``cut``'s order as a (rows, cols) block, zeros outside the slice (a view
    of ``flat`` when no row is cut)."""
    head, tail, k = rows.head, rows.tail, rows.ids.size
    if flat.size != rows.size:
        raise ValueError("%d values for the %d elements of %d rows in the slice"
                         % (flat.size, rows.size, k))
    if not head and not tail:
        return flat.reshape(k, rows.cols)
    block = np.zeros(k * rows.cols, flat.dtype)
    block[head:block.size - tail] = flat
    return block.reshape(k, rows.cols)


def trimmed(rows, block):
    """``padded``'s inverse: the block's elements inside the slice, flat (a view)."""
    flat = block.reshape(-1)
    return flat[rows.head:flat.size - rows.tail]


def merge_rows(parts):
    """The sum of a round's sparse pushes, row by row: ``parts`` a list of (RowSet, block) of
    one slice; returns (RowSet of the union of their rows, summed block).  Every element is
    summed in push order (deterministic, as ``merge``); memory: the union's block and one id
    per row, nothing per element."""
    first = parts[0][0]
    if len(parts) == 1:
        return parts[0]
    union = np.unique(np.concatenate([r.ids for r, _ in parts]))
    block = np.zeros((union.size, first.cols), parts[0][1].dtype)
    for rows, values in parts:
        if rows.ids.size:
            block[np.searchsorted(union, rows.ids)] += values
    return RowSet(union, first.cols, first.offset, first.length), block


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
