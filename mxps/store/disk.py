"""One slice of one key in a row store (``MXPS_STORE=disk``; docs/STORE.md).

A server slice covers elements [offset, offset + length) of a key whose rows (indices of its
first axis) have ``cols`` elements.  On disk it is a table of whole rows: the rows the slice
touches, from the one holding its first element (``base``, a row boundary of the key) to the
one holding its last, each row a record with its optimizer state (``mxps.store.rows``).  A
row the slice shares with its neighbour is stored by both, each using its own elements only.
A key without rows (1-D) gets rows of ``PAGE`` elements: its I/O granularity.

The slice answers what the server asks of it: apply a dense round (every row gathered, the
optimizer run on the slice's elements, the rows put back), apply a row-sparse round (the rows
holding the pushed elements only: MXNet's lazy update), serve a pull (all of the slice, or
some elements), and take an update-on-workers sum as its value.  Each runs the optimizer with
``optimizer_step.step`` on flat arrays, as the memory store's row-sparse rounds do, so the disk
and memory stores give the same numbers.
"""
import numpy as np

from . import row_sets as sparse
from .optimizer_step import step
from .rows import DiskRows, MemoryRows, RowLayout

#: rows of a 1-D key's table (elements): its I/O granularity
PAGE = 1024


def geometry(offset, length, cols):
    """(row width, first table element, the slice's [lo, hi) inside the table, rows) of a
    slice [offset, offset + length) of a key with rows of ``cols`` elements (0 or 1: none)."""
    width = int(cols) if cols and cols > 1 else PAGE
    base = (offset // width) * width if cols and cols > 1 else offset
    lo = offset - base
    hi = lo + length
    return width, base, lo, hi, max(1, -(-hi // width))


def _rule_rows(rule, base, width):
    """A TableInit as the row store's ``init``: rows made from the rule when first touched."""
    def init(rows):
        idx = (base + np.asarray(rows, np.int64)[:, None] * width
               + np.arange(width, dtype=np.int64)[None, :])
        return rule.values(idx.reshape(-1)).reshape(len(rows), width)
    return init


#: rows written per batch when a new table takes its initial value
INIT_BATCH_BYTES = 8 << 20


class DiskSlice:
    """A server slice kept in a row store (see the module doc)."""

    def __init__(self, offset, length, cols, dtype, n_states, value, directory=None,
                 name=None, cache_bytes=0, resume=False, rule=None, at=None, keep=1,
                 template=None, state=None):
        self.offset, self.length = int(offset), int(length)
        self.cols, self.base, self.lo, self.hi, n_rows = geometry(self.offset, self.length,
                                                                 cols)
        self.layout = RowLayout(n_rows, self.cols, dtype, n_states)
        self.dtype = np.dtype(dtype)
        # the optimizer's state for one element (optimizer_step.state_template), or None
        # without an optimizer on the servers
        self.template = template
        init = None if rule is None else _rule_rows(rule, self.base, self.cols)
        if directory is None:
            self.rows = MemoryRows(self.layout, init)
        else:
            self.rows = DiskRows(self.layout, directory, name, cache_bytes, resume=resume,
                                 overwrite=not resume, init=init, at=at, keep=keep)
        if value is not None:
            self._take(np.asarray(value, self.dtype), self._state_arrays(state))

    def _state_arrays(self, state):
        """A moved slice's optimizer state (``cut_state``'s arrays) in the table's order, each
        of the slice's length; None: zeros."""
        if state is None:
            return None
        arrays = sparse.state_arrays(state)
        if len(arrays) != self.layout.n_states or any(
                np.asarray(a).size != self.length for a in arrays):
            raise ValueError("a moved optimizer state of %d arrays of %s elements, the table "
                             "holds %d of %d" % (len(arrays), [np.asarray(a).size
                                                               for a in arrays],
                                                 self.layout.n_states, self.length))
        return [np.asarray(a, self.dtype) for a in arrays]

    def _take(self, value, states=None):
        """The initial value (and, for a moved slice, its optimizer state; else zeros),
        written through the store in batches of rows (so a table larger than the cache is not
        held twice), then flushed clean at round 0."""
        per = max(1, INIT_BATCH_BYTES // (self.cols * self.dtype.itemsize))
        n = self.layout.n_rows
        for a in range(0, n, per):
            b = min(n, a + per)
            block = np.zeros((b - a) * self.cols, self.dtype)
            lo, hi = max(self.lo, a * self.cols), min(self.hi, b * self.cols)
            fresh = [np.zeros((b - a) * self.cols, self.dtype)
                     for _ in range(self.layout.n_states)]
            if hi > lo:
                block[lo - a * self.cols:hi - a * self.cols] = value[lo - self.lo:hi - self.lo]
                for f, s in zip(fresh, states or ()):
                    f[lo - a * self.cols:hi - a * self.cols] = s[lo - self.lo:hi - self.lo]
            self.rows.scatter(np.arange(a, b, dtype=np.int64), block.reshape(b - a, self.cols),
                              [f.reshape(b - a, self.cols) for f in fresh])
        self.rows.flush(0)

    @property
    def all_rows(self):
        """Every row id of the table (made when asked: 8 bytes per row of a table that is
        usually only read row by row)."""
        return np.arange(self.layout.n_rows, dtype=np.int64)

    # -- what the server asks -----------------------------------------------------------------
    @property
    def snapshot(self):
        """The slice's served value (a fresh array): every row read."""
        return self.rows.read(self.all_rows).reshape(-1)[self.lo:self.hi].copy()

    def _table_rows(self, rows):
        """The table rows of a ``sparse.RowSet`` of this slice, or None when the table's rows
        are not the key's (a 1-D key's pages)."""
        if rows.cols != self.cols or rows.offset != self.offset:
            return None
        return rows.ids - self.base // self.cols

    def read(self, rows):
        """The served values of ``rows`` (a ``sparse.RowSet``: a PULL_ROWS), in order."""
        t = self._table_rows(rows)
        if t is None:
            t, flat = self._locate(rows.positions())
            return self.rows.read(t).reshape(-1)[flat]
        return np.ascontiguousarray(sparse.trimmed(rows, self.rows.read(t)))

    def accumulator(self, like, for_optimizer):
        return np.empty(self.length, self.dtype), None

    def round_buffer(self, for_optimizer):
        """``accumulator`` for a round whose first values come in packets (LTP), zeroed."""
        return np.zeros(self.length, self.dtype), None

    def recycle(self, acc, acc_nd):
        pass

    def apply_sum(self, acc):
        """Update on workers: the round's sum becomes the value."""
        w, states = self.rows.gather(self.all_rows)
        w.reshape(-1)[self.lo:self.hi] = acc
        self.rows.scatter(self.all_rows, w, states)

    def apply_update(self, updater, index, grad, grad_nd=None, frozen=()):
        """A dense round: the optimizer (``updater.optimizer``) on every row of the slice;
        elements in the ``frozen`` ranges (an LTP round's elements nobody delivered) keep their
        weights and state."""
        w, states = self.rows.gather(self.all_rows)
        sl = slice(self.lo, self.hi)
        new_w, new_s = step(updater.optimizer, index, w.reshape(-1)[sl], grad,
                            [s.reshape(-1)[sl] for s in states], self.template)
        for lo, hi in frozen:           # the gathered rows still hold the old values
            new_w[lo:hi] = w.reshape(-1)[sl][lo:hi]
            for s, n in zip(states, new_s):
                n[lo:hi] = s.reshape(-1)[sl][lo:hi]
        w.reshape(-1)[sl] = new_w
        for s, n in zip(states, new_s):
            s.reshape(-1)[sl] = n
        self.rows.scatter(self.all_rows, w, states)

    def serve_weights(self, copy):
        """Pulls read the rows (fresh copies): nothing to do after an update."""

    def apply_rows(self, updater, index, rows, block):
        """A row-sparse round: the summed ``block`` (``sparse.padded``) of ``rows`` (a
        ``sparse.RowSet``).  Whole rows are updated, weights and state alike: their elements
        outside the slice get a zero gradient but are never served (each slice serves its
        own), so no per-element index is made."""
        t = self._table_rows(rows)
        if t is not None:
            w, states = self.rows.gather(t)
            shape = w.shape
            new_w, new_s = step(updater.optimizer, index, w.reshape(-1), block.reshape(-1),
                                [s.reshape(-1) for s in states], self.template)
            del w, states
            self.rows.scatter(t, new_w.reshape(shape), [n.reshape(shape) for n in new_s])
            return
        pos, grad = rows.positions(), sparse.trimmed(rows, block)
        rows, flat = self._locate(pos)
        w, states = self.rows.gather(rows)
        new_w, new_s = step(updater.optimizer, index, w.reshape(-1)[flat], grad,
                            [s.reshape(-1)[flat] for s in states], self.template)
        w.reshape(-1)[flat] = new_w
        for s, n in zip(states, new_s):
            s.reshape(-1)[flat] = n
        self.rows.scatter(rows, w, states)

    def _locate(self, pos):
        """The table rows holding slice positions ``pos`` and the positions' places in those
        rows' concatenation."""
        t = np.asarray(pos, np.int64) + self.lo
        row = t // self.cols
        rows = np.unique(row)
        flat = np.searchsorted(rows, row) * self.cols + t % self.cols
        return rows, flat

    # -- what a move does (roles.migration; the same calls as MemorySlice's) ------------------
    def _span(self, lo, hi):
        """The table rows holding slice elements [lo, hi) and where those elements start in
        their concatenation."""
        first = (self.lo + lo) // self.cols
        last = -(-(self.lo + hi) // self.cols)
        return np.arange(first, last, dtype=np.int64), self.lo + lo - first * self.cols

    def cut(self, lo, hi):
        """A copy of the served elements [lo, hi) (slice coordinates)."""
        rows, at = self._span(lo, hi)
        return self.rows.read(rows).reshape(-1)[at:at + hi - lo].copy()

    def cut_state(self, updater, index, lo, hi):
        """Copies of the optimizer state of elements [lo, hi), in the optimizer's structure
        (``template``); None without an optimizer or state (the table keeps it beside the rows,
        so ``updater`` and ``index`` are not needed)."""
        if self.template is None or not self.layout.n_states:
            return None
        rows, at = self._span(lo, hi)
        _, states = self.rows.gather(rows)
        return sparse.like_state(self.template, [s.reshape(-1)[at:at + hi - lo].copy()
                                                 for s in states])

    def release(self, updater, index):
        """The slice moved away: its table is closed and its files deleted."""
        remove = getattr(self.rows, "remove", None)       # MemoryRows: nothing on disk
        (remove or self.rows.close)()

    def flush(self, step_no):
        self.rows.flush(step_no)

    def close(self):
        self.rows.close()

    @property
    def stats(self):
        return self.rows.stats
