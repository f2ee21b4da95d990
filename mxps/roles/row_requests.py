"""Row-sparse requests on a server (docs/SPARSE.md): PUSH_ROWS and PULL_ROWS, and a
row-sparse round applied as MXNet's lazy update.  ``RowRequests`` is the part of
``ServerState`` that handles them."""
import numpy as np

from ..store import row_sets as sparse
from ..wire import frame as wire, typed
from ..wire.frame import MsgType
from .server_requests import RequestError, fields


class RowRequests:
    """PUSH_ROWS, PULL_ROWS and row-sparse rounds (a part of ``ServerState``)."""

    def _apply_rows(self, slot, rnd):
        """A row-sparse round, as MXNet's lazy update: the pushed elements' sum, the optimizer
        run on those elements only (the slice's store: ``apply_rows``); the others do not
        change.  The key's update count advances as for any round."""
        rows, block = sparse.merge_rows(rnd.parts)
        rnd.parts = None
        if slot.index != slot.key and slot.index not in self._aliased:
            self._alias(slot)
        if rows.size == 0:
            self.updater.optimizer._update_count(slot.index)
        else:
            if rnd.scale != 1.0:
                block = block * block.dtype.type(rnd.scale)
            slot.store.apply_rows(self.updater, slot.index, rows, block)
        slot.store.serve_weights(copy=self.policy.copies)

    def _on_push_rows(self, client, h, payload):
        """A row-sparse push (docs/SPARSE.md): the rows' elements inside this slice."""
        self._take_rows(h, payload)
        self._reply(client, h, MsgType.ACK, length=0)
        self._answer_waiting(self._slot_for(h))

    def _take_rows(self, h, payload):
        """A row-sparse push summed into its round (acknowledged by the caller)."""
        slot = self._slot_for(h)
        if h.dtype != slot.dtype_code:
            raise RequestError("key %d: pushed dtype %s differs from the initialised dtype %s"
                               % (h.key, wire.dtype_of(h.dtype), wire.dtype_of(slot.dtype_code)))
        if self.updater is None:
            raise RequestError("key %d: row-sparse pushes need the optimizer on the servers "
                               "(update_on_kvstore=True, as MXNet requires for sparse "
                               "gradients)" % h.key)
        name = type(self.updater.optimizer).__name__.lower()
        if name not in sparse.LAZY_OPTIMIZERS:
            raise RequestError("key %d: row-sparse pushes with optimizer %s are not supported "
                               "(supported: %s)" % (h.key, name,
                                                    ", ".join(sparse.LAZY_OPTIMIZERS)))
        rows, values = self._read_rows(h, payload, slot, with_values=True)
        grad = (rows, sparse.padded(rows, np.array(values, dtype=wire.dtype_of(
            slot.dtype_code))))
        self._account(slot, h, grad)

    def _on_pull_rows(self, client, h, payload):
        """A pull of some rows: answered, like a pull, once its round is complete."""
        slot = self._slot_for(h)
        rows, _ = self._read_rows(h, payload, slot, with_values=False)
        if self.policy.pull_ready(slot, h):
            self._send_value(client, h, slot, rows)
        else:
            slot.waiting.append((client, h, rows))

    def _read_rows(self, h, payload, slot, with_values):
        """The typed payload of PUSH_ROWS / PULL_ROWS: the rows inside the slice (a
        ``sparse.RowSet``) and the values; a bad one raises RequestError naming the key."""
        what = "key %d: %s" % (h.key, MsgType(h.type).name)
        try:
            body = typed.unpack(payload)
            fields(body, what, ("cols", "ids", "values") if with_values else ("cols", "ids"))
            cols, ids = body["cols"], body["ids"]
            if not isinstance(cols, int) or cols <= 0:
                raise ValueError("cols must be a positive integer, got %r" % (cols,))
            if slot.cols and cols != slot.cols:
                raise ValueError("rows of %d elements, but the key was initialised with rows "
                                 "of %d" % (cols, slot.cols))
            if not isinstance(ids, np.ndarray) or ids.dtype != np.int64:
                raise ValueError("ids must be an int64 array")
            sparse.check_ids(ids, -(-(slot.offset + slot.length) // cols), what)
            rows = sparse.rows_in(ids, cols, slot.offset, slot.length)
            values = None
            if with_values:
                values = body["values"]
                if not isinstance(values, np.ndarray) or values.ndim != 1 or \
                        values.dtype != wire.dtype_of(slot.dtype_code):
                    raise ValueError("values must be a flat %s array"
                                     % wire.dtype_of(slot.dtype_code))
                if values.size != rows.size:
                    raise ValueError("%d values for the %d elements of %d rows in the slice"
                                     % (values.size, rows.size, ids.size))
        except (ValueError, wire.WireError) as e:
            msg = str(e)
            raise RequestError(msg if msg.startswith(what) else "%s: %s" % (what, msg)) \
                from None
        return rows, values
