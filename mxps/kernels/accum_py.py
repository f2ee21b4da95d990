"""Pure-Python (numpy) twin of ``cython/accum.pyx``: the reference for summing worker slices."""
import numpy as np

from ..wire.frame import dtype_of


def add_into(acc, src, dtype_code):
    """acc += src, elementwise; ``acc`` must be writable and the same byte length as ``src``."""
    a = memoryview(acc).cast("B")
    b = memoryview(src).cast("B")
    if a.nbytes != b.nbytes:
        raise ValueError("accumulator has %d bytes, slice has %d" % (a.nbytes, b.nbytes))
    if dtype_code not in (0, 1, 4, 6):
        raise ValueError("add_into: unsupported dtype code %d" % dtype_code)
    dt = dtype_of(dtype_code)
    av = np.frombuffer(a, dtype=dt)
    np.add(av, np.frombuffer(b, dtype=dt), out=av)


def copy_into(acc, src):
    """acc[:] = src (byte copy)."""
    a = memoryview(acc).cast("B")
    b = memoryview(src).cast("B")
    if a.nbytes != b.nbytes:
        raise ValueError("accumulator has %d bytes, slice has %d" % (a.nbytes, b.nbytes))
    a[:] = b
