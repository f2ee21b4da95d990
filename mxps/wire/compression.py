"""Gradient compression as MXNet's kvstore does it: ``2bit`` and ``1bit`` quantization with a
residual per key on the worker, the quantized bits on the wire, full precision everywhere else
(pulls, the servers' sums and weights).

Parameters, defaults and errors are MXNet's (``kv.set_gradient_compression({'type': '2bit',
'threshold': 0.5})``; MXNet's src/kvstore/gradient_compression.cc): ``type`` is required,
``threshold`` defaults to 0.5, other keys are ignored, an unknown type and a 2bit threshold
that is not above 0 are refused.  The quantizers are MXNet's, value for value (float32
arithmetic in the same order), so a job compressed by mxps sums what native MXNet sums:

- ``2bit`` (16x): the gradient is added to the key's residual; a value at or above
  ``threshold`` is sent as +threshold and threshold is taken from the residual, one at or below
  -threshold as -threshold (threshold added back), anything between as 0 (it stays in the
  residual).  Each byte holds four values, the first in its two high bits: 11 +threshold, 10
  -threshold, 00 zero.
- ``1bit`` (32x; MXNet 2.0's quantizer, MXNet 1.9.1 knows only 2bit): a residual above
  ``threshold`` is sent as +1 (1 taken from the residual), any other as -1 (1 added).  Each
  byte holds eight values, the first in its high bit: 1 is +1, 0 is -1.

A compressed payload is the threshold (float32), then the packed bytes padded to whole 32-bit
words as MXNet pads them; the header's ``flags`` names the codec and its ``length`` stays the
slice's element count.  ``push_values`` is the one place a server reads a pushed gradient's
values, compressed or not.
"""
import math

import numpy as np

from ..kernels import quantize as kernels
from . import frame as wire

#: the header's ``flags`` of a compressed PUSH / PUSHPULL (0: the values as they are)
NONE, TWO_BIT, ONE_BIT = 0, 1, 2
_PREFIX = 4                         # the threshold, float32
_F32 = wire.dtype_code(np.float32)


class CompressionError(ValueError):
    """Compression parameters MXNet would refuse (the message is MXNet's)."""


class Compression:
    """One job's codec: ``encode`` (worker: gradient + residual -> payload) and ``decode``
    (server: payload -> float32 values)."""

    __slots__ = ("type", "threshold", "flag", "per_word", "_t", "_lut")

    def __init__(self, type_, threshold):
        self.type = type_
        self.threshold = float(threshold)
        self.flag = TWO_BIT if type_ == "2bit" else ONE_BIT
        self.per_word = 16 if type_ == "2bit" else 32       # values per 32-bit word
        self._t = np.float32(threshold)

    def __repr__(self):
        return "Compression(%r, threshold=%r)" % (self.type, self.threshold)

    @property
    def params(self):
        return {"type": self.type, "threshold": self.threshold}

    def nbytes(self, n):
        """Bytes of the payload of ``n`` values (threshold and padded words)."""
        return _PREFIX + 4 * -(-n // self.per_word)

    def encode(self, grad, residual):
        """The payload of float32 ``grad`` (a flat slice), updating ``residual`` (the same
        slice of the key's residual) in place."""
        n = grad.size
        out = np.empty(self.nbytes(n), np.uint8)
        out[:_PREFIX].view(np.float32)[0] = self._t
        out[_PREFIX:] = 0                       # the padding of the last word
        quantize = kernels.quantize_2bit if self.flag == TWO_BIT else kernels.quantize_1bit
        quantize(grad, residual, out[_PREFIX:], self._t)
        return out


def decode(flag, n, payload):
    """The ``n`` float32 values of a payload compressed by codec ``flag``; raises
    ``wire.WireError`` naming what does not fit."""
    per_word = {TWO_BIT: 16, ONE_BIT: 32}.get(flag)
    if per_word is None:
        raise wire.WireError("unknown compression %d in a push's flags" % flag)
    buf = np.frombuffer(payload.buffer if hasattr(payload, "buffer") else payload, np.uint8)
    want = _PREFIX + 4 * -(-n // per_word)
    if buf.size != want:
        raise wire.WireError("a %s payload of %d values has %d bytes, not %d"
                             % ("2bit" if flag == TWO_BIT else "1bit", n, buf.size, want))
    t = buf[:_PREFIX].view(np.float32)[0]
    out = np.empty(n, np.float32)
    if flag == ONE_BIT:
        kernels.dequantize_1bit(buf[_PREFIX:], n, out)
        return out
    if not (math.isfinite(t) and t > 0):
        raise wire.WireError("a 2bit payload with threshold %r" % float(t))
    kernels.dequantize_2bit(buf[_PREFIX:], n, t, out)
    return out


def push_values(h, payload):
    """A PUSH / PUSHPULL's gradient as a flat array: a view of the payload, or its values
    decoded when the header's flags name a codec (float32 only)."""
    flag = h.flags & wire.CODEC_MASK
    if not flag:
        return wire.payload_array(h, payload)
    if h.dtype != _F32:
        raise wire.WireError("key %d: a compressed push of %s values; compression carries "
                             "float32 only" % (h.key, wire.dtype_of(h.dtype)))
    if payload is None:
        raise wire.WireError("key %d: a compressed push without its payload" % h.key)
    return decode(flag, h.length, payload)


def parse(params):
    """``Compression`` from MXNet's ``compression_params``, refused as MXNet refuses them."""
    if not isinstance(params, dict):
        raise CompressionError("compression_params must be a dict such as {'type': '2bit', "
                               "'threshold': 0.5}, not %s" % type(params).__name__)
    if "type" not in params:
        raise CompressionError("Required parameter type of string is not presented "
                               "(compression_params needs 'type': '2bit' or '1bit')")
    type_ = str(params["type"])
    raw = params.get("threshold", 0.5)
    try:
        threshold = float(raw)
    except (TypeError, ValueError):
        raise CompressionError("Invalid Parameter format for threshold expect float but "
                               "value='%s'" % (raw,)) from None
    if type_ == "2bit":
        if not threshold > 0:
            raise CompressionError("threshold must be greater than 0 for two bit compression "
                                   "(got %r)" % threshold)
    elif type_ != "1bit":
        raise CompressionError("Unknown type for gradient compression %s (known: 2bit, 1bit)"
                               % type_)
    if not math.isfinite(threshold):
        raise CompressionError("threshold must be finite for gradient compression (got %r)"
                               % threshold)
    return Compression(type_, threshold)
