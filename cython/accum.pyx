# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""Summing worker slices into an accumulator without the GIL (compiled twin of mxps/kernels/accum_py.py).

A server in sync mode receives one slice of a key from each of W workers and sums them; for big
slices this is the server's main CPU cost.  ``add_into(acc, src)`` does ``acc += src`` in C with
the GIL released, so the server's I/O (zmq) and other slices proceed meanwhile.  ``copy_into``
is the first push of a round (``acc[:] = src``).  Both accept any buffer (numpy arrays, zmq
frames' memoryviews) of every dtype the wire carries, typed by ``dtype_code``: float32/64,
int32/64, int8 and uint8 (wrapping, as numpy and MXNet do) in C loops; float16 through numpy's
half loop (which releases the GIL too), because MXNet's server adds halves exactly that way (each
sum in float32, rounded to float16: numpy and mshadow's half_t agree bit for bit, where a C
conversion of our own could round differently).
"""
from libc.string cimport memcpy
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t

import numpy as np

# dtype codes of mxps/kernels/dtypes.py (MXNet's type flags, the wire's too)
DEF F32 = 0
DEF F64 = 1
DEF F16 = 2
DEF U8 = 3
DEF I32 = 4
DEF I8 = 5
DEF I64 = 6


def add_into(acc, src, int dtype_code):
    """acc += src, elementwise; ``acc`` must be writable and the same byte length as ``src``."""
    cdef unsigned char[::1] a = memoryview(acc).cast("B")
    cdef const unsigned char[::1] b = memoryview(src).cast("B")
    if a.shape[0] != b.shape[0]:
        raise ValueError("accumulator has %d bytes, slice has %d" % (a.shape[0], b.shape[0]))
    cdef Py_ssize_t n, i
    cdef float *af
    cdef const float *bf
    cdef double *ad
    cdef const double *bd
    cdef int32_t *ai
    cdef const int32_t *bi
    cdef int64_t *al
    cdef const int64_t *bl
    cdef uint8_t *au
    cdef const uint8_t *bu
    cdef int8_t *ab
    cdef const int8_t *bb
    cdef Py_ssize_t itemsize
    if dtype_code == F32 or dtype_code == I32:
        itemsize = 4
    elif dtype_code == F64 or dtype_code == I64:
        itemsize = 8
    elif dtype_code == F16:
        itemsize = 2
    elif dtype_code == U8 or dtype_code == I8:
        itemsize = 1
    else:
        raise ValueError("add_into: unsupported dtype code %d" % dtype_code)
    if a.shape[0] % itemsize:
        raise ValueError("add_into: %d bytes is not a whole number of %d-byte elements"
                         % (a.shape[0], itemsize))
    if a.shape[0] == 0:
        return
    if dtype_code == F16:
        av = np.frombuffer(memoryview(acc).cast("B"), dtype=np.float16)
        with np.errstate(over="ignore", invalid="ignore"):   # inf / nan, silently, as MXNet
            np.add(av, np.frombuffer(memoryview(src).cast("B"), dtype=np.float16), out=av)
        return
    with nogil:
        if dtype_code == F32:
            n = a.shape[0] // 4
            af = <float *> &a[0]
            bf = <const float *> &b[0]
            for i in range(n):
                af[i] += bf[i]
        elif dtype_code == F64:
            n = a.shape[0] // 8
            ad = <double *> &a[0]
            bd = <const double *> &b[0]
            for i in range(n):
                ad[i] += bd[i]
        elif dtype_code == I32:
            n = a.shape[0] // 4
            ai = <int32_t *> &a[0]
            bi = <const int32_t *> &b[0]
            for i in range(n):
                ai[i] += bi[i]
        elif dtype_code == I64:
            n = a.shape[0] // 8
            al = <int64_t *> &a[0]
            bl = <const int64_t *> &b[0]
            for i in range(n):
                al[i] += bl[i]
        elif dtype_code == U8:
            n = a.shape[0]
            au = <uint8_t *> &a[0]
            bu = <const uint8_t *> &b[0]
            for i in range(n):
                au[i] = <uint8_t> (au[i] + bu[i])
        elif dtype_code == I8:
            n = a.shape[0]
            ab = <int8_t *> &a[0]
            bb = <const int8_t *> &b[0]
            for i in range(n):
                ab[i] = <int8_t> <uint8_t> (<uint8_t> ab[i] + <uint8_t> bb[i])


def copy_into(acc, src):
    """acc[:] = src (byte copy, GIL released)."""
    cdef unsigned char[::1] a = memoryview(acc).cast("B")
    cdef const unsigned char[::1] b = memoryview(src).cast("B")
    if a.shape[0] != b.shape[0]:
        raise ValueError("accumulator has %d bytes, slice has %d" % (a.shape[0], b.shape[0]))
    if a.shape[0] == 0:
        return
    with nogil:
        memcpy(&a[0], &b[0], a.shape[0])
