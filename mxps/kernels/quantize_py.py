"""Pure-Python (numpy) twin of ``cython/quantize.pyx``: gradient compression's quantizers, the
reference (MXNet's kernels, src/kvstore/gradient_compression-inl.h, value for value in float32).

``quantize_2bit(grad, residual, out, threshold)`` adds float32 ``grad`` into ``residual`` and
writes the 2-bit codes of its n values into the first ceil(n / 4) bytes of uint8 ``out`` (four
values a byte, the first in the high bits: 11 +threshold, 10 -threshold, 00 zero), taking
what it sent from ``residual``; ``quantize_1bit`` writes ceil(n / 8) bytes (eight a byte,
1: +1, 0: -1).  ``dequantize_2bit(data, n, threshold, out)`` / ``dequantize_1bit(data, n,
out)`` write the n float32 values the codes stand for into ``out``."""
import numpy as np


def _check(grad, residual, out, per_byte):
    n = grad.shape[0]
    if residual.shape[0] != n:
        raise ValueError("a gradient of %d values and a residual of %d" % (n, residual.shape[0]))
    if out.shape[0] < -(-n // per_byte):
        raise ValueError("%d values need %d bytes of codes, the output has %d"
                         % (n, -(-n // per_byte), out.shape[0]))
    return n


def quantize_2bit(grad, residual, out, threshold):
    n = _check(grad, residual, out, 4)
    t = np.float32(threshold)
    np.add(residual, grad, out=residual)
    pos = residual >= t
    neg = residual <= -t
    residual[pos] -= t
    residual[neg] += t
    bits = np.empty((n, 2), np.bool_)
    np.logical_or(pos, neg, out=bits[:, 0])
    bits[:, 1] = pos
    packed = np.packbits(bits.reshape(-1))
    out[:packed.size] = packed


def quantize_1bit(grad, residual, out, threshold):
    _check(grad, residual, out, 8)
    t = np.float32(threshold)
    np.add(residual, grad, out=residual)
    bits = residual > t
    residual[bits] -= np.float32(1)
    residual[~bits] += np.float32(1)
    packed = np.packbits(bits)
    out[:packed.size] = packed


def dequantize_2bit(data, n, threshold, out):
    if data.shape[0] < -(-n // 4) or out.shape[0] < n:
        raise ValueError("%d values need %d bytes of codes and %d floats; got %d and %d"
                         % (n, -(-n // 4), n, data.shape[0], out.shape[0]))
    t = np.float32(threshold)
    pairs = np.unpackbits(np.asarray(data)[:-(-n // 4)])[:2 * n].reshape(-1, 2)
    lut = np.array([0, 0, -t, t], np.float32)        # 00, 01 (never sent), 10, 11
    out[:n] = lut[(pairs[:, 0] << 1) | pairs[:, 1]]


def dequantize_1bit(data, n, out):
    if data.shape[0] < -(-n // 8) or out.shape[0] < n:
        raise ValueError("%d values need %d bytes of codes and %d floats; got %d and %d"
                         % (n, -(-n // 8), n, data.shape[0], out.shape[0]))
    bits = np.unpackbits(np.asarray(data)[:-(-n // 8)])[:n]
    out[:n] = bits.astype(np.float32) * np.float32(2) - np.float32(1)
