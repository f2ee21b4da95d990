"""A table's initial value as a rule, not as data (for tables larger than memory).

``TableInit(shape, scale, seed)`` stands for the array whose element ``g`` (flat index) is
uniform in ``[-scale, scale)``, computed from ``(seed, g)`` alone by the splitmix64 hash: any
part of it can be produced anywhere, in any order, with the same numbers.  ``kv.init(key,
TableInit(...))`` (worker 0 sends the rule, not 4 GB) lets each server make its slice's rows
when they are first touched (``MXPS_STORE=disk``) or at once (in RAM).  No MXNet here.
"""
import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(x):
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


class TableInit:
    """The rule for a table's initial value (see the module doc)."""

    def __init__(self, shape, dtype="float32", scale=0.01, seed=0):
        self.shape = tuple(int(d) for d in shape)
        if not self.shape or any(d < 1 for d in self.shape):
            raise ValueError("TableInit: shape %r must have positive dimensions" % (shape,))
        self.dtype = np.dtype(dtype)
        if self.dtype.kind != "f":
            raise ValueError("TableInit: dtype %s is not a float type" % self.dtype)
        self.scale = float(scale)
        if not self.scale >= 0:
            raise ValueError("TableInit: scale %r must be >= 0" % (scale,))
        self.seed = int(seed)
        if not 0 <= self.seed < 2 ** 32:
            raise ValueError("TableInit: seed %r must be in [0, 2**32)" % (seed,))
        self.size = int(np.prod(self.shape))

    def values(self, flat_index):
        """The elements at the given flat indices (an int64 array)."""
        g = np.asarray(flat_index, np.int64).astype(np.uint64)
        z = _splitmix64(g + (np.uint64(self.seed) << np.uint64(40)))
        u = (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
        return (self.scale * (2.0 * u - 1.0)).astype(self.dtype)

    def span(self, start, stop, block=1 << 17, progress=None):
        """Elements [start, stop) of the flat table, made ``block`` elements at a time (the
        hash's temporaries are 8 bytes per element: a slice of a 4 GB table at once would
        need several times its size); ``progress()`` is called after every block (a server
        making GBs keeps heartbeating: seconds of work are not a frozen node).

        The block keeps the temporaries in cache: making 32M float32 elements took 0.37 s in
        blocks of 2**17 and 1.2-5.6 s in blocks of 2**22, with up to 1.9-3.2 s between two
        ``progress()`` calls (best of 3 / first run, this project's 2-core machine): longer
        than a 1 s heartbeat timeout."""
        out = np.empty(max(0, stop - start), self.dtype)
        for a in range(start, stop, block):
            b = min(stop, a + block)
            out[a - start:b - start] = self.values(np.arange(a, b, dtype=np.int64))
            if progress is not None:
                progress()
        return out

    def describe(self):
        return {"scale": self.scale, "seed": self.seed}

    def __repr__(self):
        return "TableInit(shape=%s, dtype=%s, scale=%g, seed=%d)" % (
            self.shape, self.dtype, self.scale, self.seed)
