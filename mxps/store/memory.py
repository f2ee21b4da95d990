"""One slice of one key held in RAM (see ``mxps.store``)."""
import mxnet as mx
import numpy as np

from ..kernels.ndview import cut_state, numpy_view, to_nd
from . import row_sets as sparse
from .optimizer_step import step


class MemorySlice:
    """The numbers of one slice: ``weight_nd`` (the stored value, an NDArray the optimizer
    updates in place; ``weight`` is a numpy view of it), ``snapshot`` (what pulls are served:
    the value after the last complete round) and reusable accumulators for the rounds' sums.

    ``value`` (a flat numpy array) becomes the first snapshot as it is: the caller hands over
    an array nothing else writes.  It is copied into the stored value ``COPY_BLOCK`` elements
    at a time, ``progress()`` called after every block: a slice of GBs takes seconds to copy
    (first touch of its pages), and a server doing that keeps heartbeating."""

    __slots__ = ("weight_nd", "weight", "snapshot", "_free")

    #: 4 MB of float32 per block: ms each
    COPY_BLOCK = 1 << 20

    def __init__(self, value, progress=None):
        self.weight_nd = mx.nd.empty(value.shape, dtype=value.dtype)
        self.weight_nd.wait_to_read()
        self.weight = numpy_view(self.weight_nd)
        for a in range(0, value.size, self.COPY_BLOCK):
            self.weight[a:a + self.COPY_BLOCK] = value[a:a + self.COPY_BLOCK]
            if progress is not None:
                progress()
        self.snapshot = value
        self._free = []            # (acc, acc_nd) accumulators of completed rounds

    def accumulator(self, like, for_optimizer):
        """A buffer for one round's sum, shaped and typed as ``like``: ``(acc, acc_nd)``, the
        numpy array to sum into and, ``for_optimizer``, the NDArray behind it (handed to the
        updater, then reused).  Without an optimizer the sum itself becomes the served value,
        so it gets a fresh buffer that is never reused (a reply may still be reading the
        previous one) and no NDArray."""
        if not for_optimizer:
            return np.empty_like(like), None
        if self._free:
            return self._free.pop()
        acc_nd = mx.nd.zeros((like.size,), dtype=like.dtype)
        acc_nd.wait_to_read()
        return numpy_view(acc_nd), acc_nd

    def round_buffer(self, for_optimizer):
        """``accumulator`` for a round whose first values come in packets (LTP), zeroed."""
        acc, acc_nd = self.accumulator(self.weight, for_optimizer)
        acc[:] = 0
        return acc, acc_nd

    def recycle(self, acc, acc_nd):
        """An accumulator whose round was applied (the updater has finished reading it)."""
        self._free.append((acc, acc_nd))

    # -- what a round does (the same calls as store.disk.DiskSlice's) ------------------------
    def apply_sum(self, acc):
        """Update on workers: the round's sum is the stored value."""
        self.snapshot = acc

    def apply_update(self, updater, index, acc, acc_nd, frozen=()):
        """A dense round with the optimizer on the servers: MXNet's ``updater`` (its states
        by index) on the stored weights, in place; ``acc_nd`` is the NDArray behind the sum
        (None: the round began before the optimizer was set), recycled after.  Elements in
        the ``frozen`` ranges (an LTP round's elements nobody delivered) keep their weights and
        optimizer state."""
        kept = self._keep(updater, index, frozen) if frozen else None
        nd = acc_nd if acc_nd is not None else mx.nd.array(acc, dtype=acc.dtype)
        updater(index, nd, self.weight_nd)
        self.weight_nd.wait_to_read()       # the update (which read the sum) is done
        if kept is not None:
            state = updater.states.get(index)
            for (lo, hi), (weight, st) in zip(frozen, kept):
                self.weight[lo:hi] = weight
                _put_state(state, st, lo, hi)
        if acc_nd is not None:
            self.recycle(acc, acc_nd)

    def _keep(self, updater, index, ranges):
        """Copies of the weights and optimizer state at ``ranges`` (before an update).  In a
        key's first round the state does not exist yet: it is created here as MXNet's Updater
        would at its first call, so the frozen elements keep a fresh state too."""
        if index not in updater.states:
            updater.states[index] = updater.optimizer.create_state_multi_precision(
                index, self.weight_nd)
            updater.states_synced[index] = True
        state = updater.states.get(index)
        return [(self.weight[lo:hi].copy(), cut_state(state, lo, hi)) for lo, hi in ranges]

    def apply_rows(self, updater, index, rows, block):
        """A row-sparse round, as MXNet's lazy update: the optimizer on the pushed elements
        only (weights and state gathered, updated, put back), by the same call as the disk
        store's (``optimizer_step.step``)."""
        opt = updater.optimizer
        pos = rows.positions()
        grad = sparse.trimmed(rows, block)
        if index not in updater.states:
            updater.states[index] = opt.create_state_multi_precision(index, self.weight_nd)
            updater.states_synced[index] = True
        state = updater.states[index]
        arrays = sparse.state_arrays(state)
        for a in arrays:
            a.wait_to_read()
        views = [numpy_view(a) for a in arrays]
        new_w, new_s = step(opt, index, self.weight[pos], grad, [v[pos] for v in views], state)
        self.weight[pos] = new_w
        for v, n in zip(views, new_s):
            v[pos] = n

    def flush(self, step_no):
        """Nothing to make durable: a slice in RAM is not a checkpoint."""

    @property
    def stats(self):
        return {}

    def serve_weights(self, copy):
        """Serve the weights after an update: the weights themselves, or (``copy``, when a
        reply may still be reading the last value while the weights change) a copy."""
        self.snapshot = self.weight.copy() if copy else self.weight

    def read(self, rows):
        """The served elements of ``rows`` (a ``sparse.RowSet``: a PULL_ROWS)."""
        return self.snapshot[rows.positions()]

    # -- what a move does (roles.migration; the same calls as DiskSlice's) --------------------
    def cut(self, lo, hi):
        """A copy of the served elements [lo, hi) (slice coordinates)."""
        return np.array(self.snapshot[lo:hi])

    @staticmethod
    def cut_state(updater, index, lo, hi):
        """Copies of the optimizer state of elements [lo, hi) (None: no state yet)."""
        if updater is None or index not in updater.states:
            return None
        return cut_state(updater.states[index], lo, hi)

    @staticmethod
    def take_state(updater, index, state):
        """A moved slice's optimizer state (numpy arrays as ``cut_state`` made them) becomes
        the updater's state of ``index``."""
        updater.states[index] = to_nd(state)
        updater.states_synced[index] = False

    @staticmethod
    def release(updater, index):
        """The slice moved away: its optimizer state goes with it."""
        if updater is not None:
            updater.states.pop(index, None)
            updater.states_synced.pop(index, None)


def _put_state(state, saved, lo, hi):
    """Write ``saved`` (``cut_state``'s copies) back into elements [lo, hi) of ``state``."""
    if state is None or saved is None:
        return
    if isinstance(state, (tuple, list)):
        for s, v in zip(state, saved):
            _put_state(s, v, lo, hi)
        return
    state.wait_to_read()       # the update that wrote it has finished
    numpy_view(state)[lo:hi] = saved
