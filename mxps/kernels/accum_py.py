"""Pure-Python (numpy) twin of ``cython/accum.pyx``: the reference for summing worker slices,
for every dtype the wire carries (float32/64/16, uint8, int32, int8, int64)."""
import numpy as np

from .dtypes import DTYPES


def add_into(acc, src, dtype_code):
    """acc += src, elementwise; ``acc`` must be writable and the same byte length as ``src``."""
    a = memoryview(acc).cast("B")
    b = memoryview(src).cast("B")
    if a.nbytes != b.nbytes:
        raise ValueError("accumulator has %d bytes, slice has %d" % (a.nbytes, b.nbytes))
    if dtype_code not in (0, 1, 2, 3, 4, 5, 6):
        raise ValueError("add_into: unsupported dtype code %d" % dtype_code)
    dt = DTYPES[dtype_code]
    if a.nbytes % dt.itemsize:
        raise ValueError("add_into: %d bytes is not a whole number of %d-byte elements"
                         % (a.nbytes, dt.itemsize))
    av = np.frombuffer(a, dtype=dt)
    # integers wrap around; float16 is added as MXNet's server adds it (each sum computed in
    # float32 and rounded to float16: numpy's half loop and mshadow's half_t agree bit for bit)
    with np.errstate(over="ignore", invalid="ignore"):      # inf / nan, silently, as MXNet
        np.add(av, np.frombuffer(b, dtype=dt), out=av)


def copy_into(acc, src):
    """acc[:] = src (byte copy)."""
    a = memoryview(acc).cast("B")
    b = memoryview(src).cast("B")
    if a.nbytes != b.nbytes:
        raise ValueError("accumulator has %d bytes, slice has %d" % (a.nbytes, b.nbytes))
    a[:] = b
