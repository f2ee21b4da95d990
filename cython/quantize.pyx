# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""Gradient compression's quantizers in one pass without the GIL (compiled twin of
mxps/kernels/quantize_py.py, which is the reference and documents the API).

A worker compressing resnet18_v1's 11.7 M gradients with numpy makes about ten passes over
them (add, two comparisons, two masked updates, the bit interleave, the pack); here each value
is read, added to its residual, compared and coded in one loop, as MXNet's own kernel does.
"""
from libc.stdint cimport uint8_t
from libc.string cimport memcpy


cdef inline Py_ssize_t _bytes(Py_ssize_t n, Py_ssize_t per_byte) nogil:
    return (n + per_byte - 1) // per_byte


def quantize_2bit(const float[::1] grad, float[::1] residual, uint8_t[::1] out,
                  float threshold):
    cdef Py_ssize_t n = grad.shape[0], i
    cdef float r, t = threshold, nt = -threshold
    cdef uint8_t code, byte = 0
    cdef bint pos, neg
    if residual.shape[0] != n:
        raise ValueError("a gradient of %d values and a residual of %d" % (n, residual.shape[0]))
    if out.shape[0] < _bytes(n, 4):
        raise ValueError("%d values need %d bytes of codes, the output has %d"
                         % (n, _bytes(n, 4), out.shape[0]))
    with nogil:
        for i in range(n):
            r = residual[i] + grad[i]
            # branch-free (random signs would defeat the branch predictor): code 11 / 10 / 00
            pos = r >= t
            neg = r <= nt
            # exactly MXNet's r - t / r - (-t) / r: 1 * t + 0 * nt is t, 0 * t + 0 * nt is 0
            residual[i] = r - (pos * t + neg * nt)
            code = <uint8_t> ((pos * 3) | (neg * 2))
            if i & 3 == 0:
                byte = code << 6
            else:
                byte = byte | (code << (6 - 2 * (i & 3)))
            if i & 3 == 3 or i == n - 1:
                out[i >> 2] = byte


def quantize_1bit(const float[::1] grad, float[::1] residual, uint8_t[::1] out,
                  float threshold):
    cdef Py_ssize_t n = grad.shape[0], i
    cdef float r, t = threshold
    cdef uint8_t byte = 0
    cdef bint pos
    if residual.shape[0] != n:
        raise ValueError("a gradient of %d values and a residual of %d" % (n, residual.shape[0]))
    if out.shape[0] < _bytes(n, 8):
        raise ValueError("%d values need %d bytes of codes, the output has %d"
                         % (n, _bytes(n, 8), out.shape[0]))
    with nogil:
        for i in range(n):
            r = residual[i] + grad[i]
            pos = r > t
            residual[i] = r - (<float> 1 if pos else <float> -1)
            if i & 7 == 0:
                byte = pos << 7
            else:
                byte = byte | (pos << (7 - (i & 7)))
            if i & 7 == 7 or i == n - 1:
                out[i >> 3] = byte


def dequantize_2bit(const uint8_t[::1] data, Py_ssize_t n, float threshold, float[::1] out):
    cdef Py_ssize_t i, j, whole = n >> 2
    cdef float lut[256][4]
    cdef float values[4]
    cdef uint8_t code
    if data.shape[0] < _bytes(n, 4) or out.shape[0] < n:
        raise ValueError("%d values need %d bytes of codes and %d floats; got %d and %d"
                         % (n, _bytes(n, 4), n, data.shape[0], out.shape[0]))
    values[0] = 0
    values[1] = 0                  # 01: never sent; MXNet reads it as zero
    values[2] = -threshold
    values[3] = threshold
    with nogil:
        for i in range(256):       # the four values of every byte
            for j in range(4):
                lut[i][j] = values[(i >> (6 - 2 * j)) & 3]
        for i in range(whole):
            memcpy(&out[4 * i], &lut[data[i]][0], 4 * sizeof(float))
        for i in range(4 * whole, n):
            code = (data[i >> 2] >> (6 - 2 * (i & 3))) & 3
            out[i] = values[code]


def dequantize_1bit(const uint8_t[::1] data, Py_ssize_t n, float[::1] out):
    cdef Py_ssize_t i, j, whole = n >> 3
    cdef float lut[256][8]
    if data.shape[0] < _bytes(n, 8) or out.shape[0] < n:
        raise ValueError("%d values need %d bytes of codes and %d floats; got %d and %d"
                         % (n, _bytes(n, 8), n, data.shape[0], out.shape[0]))
    with nogil:
        for i in range(256):
            for j in range(8):
                lut[i][j] = 1 if i & (0x80 >> j) else -1
        for i in range(whole):
            memcpy(&out[8 * i], &lut[data[i]][0], 8 * sizeof(float))
        for i in range(8 * whole, n):
            out[i] = 1 if data[i >> 3] & (0x80 >> (i & 7)) else -1
