"""Gradient compression (``mxps.wire.compression``): MXNet's quantizers value for value, its
parameters and errors, the bytes on the wire, and the kvstore's refusals.

The reference quantizers below transliterate MXNet's kernels (src/kvstore/
gradient_compression-inl.h: ``quantize_2bit``, ``dequantize_2bit``, ``quantize_1bit``,
``dequantize_1bit``) element by element in float32; the codec must produce the same bytes and
leave the same residual, bit for bit.
"""
import math

import mxnet as mx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from mxps.kernels import _quantize, quantize_py
from mxps.wire import compression as C
from mxps.wire.frame import Header, MsgType, WireError, dtype_code

pytestmark = pytest.mark.unit

F32 = np.float32


def mxnet_quantize(kind, grad, residual, threshold):
    """MXNet's kernels, one element at a time: (the compressed bytes, the new residual)."""
    n = grad.size
    per_word = 16 if kind == "2bit" else 32
    out = bytearray(4 * -(-n // per_word))
    residual = residual.copy()
    t = F32(threshold)
    for i in range(n):
        residual[i] = F32(residual[i] + grad[i])
        if kind == "2bit":
            if residual[i] >= t:
                out[i >> 2] |= (0xc0, 0x30, 0x0c, 0x03)[i & 3]
                residual[i] = F32(residual[i] - t)
            elif residual[i] <= -t:
                out[i >> 2] |= (0x80, 0x20, 0x08, 0x02)[i & 3]
                residual[i] = F32(residual[i] - F32(-t))
        else:
            if residual[i] > t:
                out[i >> 3] |= (0x80, 0x40, 0x20, 0x10, 0x08, 0x04, 0x02, 0x01)[i & 7]
                residual[i] = F32(residual[i] - F32(1))
            else:
                residual[i] = F32(residual[i] + F32(1))
    return bytes(out), residual


def mxnet_dequantize(kind, data, n, threshold):
    out = np.zeros(n, F32)
    for i in range(n):
        byte = data[i >> 2] if kind == "2bit" else data[i >> 3]
        if kind == "2bit":
            mask, neg = (0xc0, 0x30, 0x0c, 0x03)[i & 3], (0x80, 0x20, 0x08, 0x02)[i & 3]
            out[i] = threshold if byte & mask == mask else \
                (-threshold if byte & mask == neg else 0)
        else:
            bit = (0x80, 0x40, 0x20, 0x10, 0x08, 0x04, 0x02, 0x01)[i & 7]
            out[i] = 1 if byte & bit else -1
    return out


def _values(rng, n, threshold):
    """Gradients with values exactly at +-threshold and at 0 among them."""
    g = rng.randn(n).astype(F32) * F32(threshold * 1.5)
    if n:
        g[rng.randint(0, n, max(1, n // 5))] = F32(threshold)
        g[rng.randint(0, n, max(1, n // 5))] = -F32(threshold)
        g[rng.randint(0, n, max(1, n // 8))] = 0
    return g


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(["2bit", "1bit"]), n=st.integers(0, 150),
       threshold=st.sampled_from([0.5, 0.0625, 0.1, 1.0, 0.0, -0.3]), seed=st.integers(0, 99),
       rounds=st.integers(1, 3))
def test_the_codec_sends_and_keeps_what_mxnets_kernels_do_bit_for_bit(kind, n, threshold, seed,
                                                                     rounds):
    if kind == "2bit" and threshold <= 0:
        threshold = 0.25
    codec = C.parse({"type": kind, "threshold": threshold})
    kernels = C.kernels
    try:
        for impl in (_quantize, quantize_py):   # the compiled kernels and their twin
            C.kernels = impl
            rng = np.random.RandomState(seed)
            residual = np.zeros(n, F32)
            ref_residual = residual.copy()
            for _ in range(rounds):                     # the residual carries over rounds
                grad = _values(rng, n, abs(threshold) or 0.5)
                payload = codec.encode(grad, residual)
                want, ref_residual = mxnet_quantize(kind, grad, ref_residual, threshold)
                assert payload[4:].tobytes() == want, impl
                assert payload[:4].view(F32)[0] == F32(threshold)
                np.testing.assert_array_equal(residual.view(np.uint32),
                                              ref_residual.view(np.uint32))
                got = C.decode(codec.flag, n, payload)
                assert got.dtype == F32
                np.testing.assert_array_equal(got, mxnet_dequantize(kind, want, n,
                                                                    F32(threshold)))
    finally:
        C.kernels = kernels


@pytest.mark.parametrize("impl", [_quantize, quantize_py], ids=["cython", "python"])
def test_the_kernels_refuse_buffers_of_the_wrong_size_naming_them(impl):
    g, r = np.ones(10, F32), np.zeros(10, F32)
    with pytest.raises(ValueError, match="a gradient of 10 values and a residual of 9"):
        impl.quantize_2bit(g, r[:9], np.zeros(3, np.uint8), 0.5)
    with pytest.raises(ValueError, match="10 values need 3 bytes of codes, the output has 2"):
        impl.quantize_2bit(g, r, np.zeros(2, np.uint8), 0.5)
    with pytest.raises(ValueError, match="10 values need 2 bytes of codes, the output has 1"):
        impl.quantize_1bit(g, r, np.zeros(1, np.uint8), 0.5)
    with pytest.raises(ValueError, match="10 values need 3 bytes of codes and 10 floats"):
        impl.dequantize_2bit(np.zeros(2, np.uint8), 10, 0.5, np.zeros(10, F32))
    with pytest.raises(ValueError, match="10 values need 2 bytes of codes and 10 floats"):
        impl.dequantize_1bit(np.zeros(2, np.uint8), 10, np.zeros(9, F32))
    assert not r.any()                          # refused before anything was written


def test_the_compiled_kernels_are_the_ones_a_job_uses():
    from mxps.kernels import quantize
    assert quantize.IMPLEMENTATION == "cython" and C.kernels is quantize


@pytest.mark.parametrize("kind,factor", [("2bit", 16), ("1bit", 32)])
def test_a_push_is_16_or_32_times_smaller_on_the_wire_padded_to_words_as_mxnet_pads(kind,
                                                                                 factor):
    codec = C.parse({"type": kind})
    for n in (1, factor - 1, factor, factor + 1, 1000003):
        assert codec.nbytes(n) == 4 + 4 * math.ceil(n / factor)
        assert codec.encode(np.ones(n, F32), np.zeros(n, F32)).size == codec.nbytes(n)
    assert 4 * 1000003 / codec.nbytes(1000003) == pytest.approx(factor, rel=1e-4)


def test_push_values_decodes_a_compressed_push_and_views_a_plain_one():
    codec = C.parse({"type": "2bit", "threshold": 0.5})
    grad = np.array([0.7, -0.2, -0.9, 0.5, 0.1], F32)
    payload = codec.encode(grad, np.zeros(5, F32))
    h = Header(MsgType.PUSH, key=3, length=5, dtype=dtype_code(F32), flags=C.TWO_BIT)
    np.testing.assert_array_equal(C.push_values(h, payload), [0.5, 0, -0.5, 0.5, 0])
    plain = Header(MsgType.PUSH, key=3, length=5, dtype=dtype_code(F32))
    assert C.push_values(plain, grad.tobytes()).tolist() == grad.tolist()


@pytest.mark.parametrize("changes,payload,message", [
    (dict(flags=7), None, "unknown compression 7"),
    (dict(), b"\x00" * 7, "has 7 bytes, not 8"),
    (dict(dtype=dtype_code(np.float16)), None, "float32 only"),
    (dict(), "nan", "threshold nan"),
    (dict(), "negative", "threshold -0.5"),
    (dict(), "missing", "without its payload"),
])
def test_a_compressed_push_that_does_not_fit_raises_wire_error_naming_what(changes, payload,
                                                                          message):
    h = Header(MsgType.PUSH, key=3, length=5, dtype=dtype_code(F32), flags=C.TWO_BIT)
    for k, v in changes.items():
        setattr(h, k, v)
    good = C.parse({"type": "2bit"}).encode(np.ones(5, F32), np.zeros(5, F32))
    if payload is None:
        payload = good
    elif payload in ("nan", "negative"):
        bad = good.copy()
        bad[:4].view(F32)[0] = np.nan if payload == "nan" else -0.5
        payload = bad
    elif payload == "missing":
        payload = None
    with pytest.raises(WireError, match=message):
        C.push_values(h, payload)


def test_parameters_default_and_are_refused_as_mxnet_refuses_them():
    c = C.parse({"type": "2bit"})
    assert (c.type, c.threshold, c.flag) == ("2bit", 0.5, C.TWO_BIT)
    c = C.parse({"type": "1bit", "threshold": "0", "unknown_key": 1})   # MXNet ignores it
    assert (c.type, c.threshold, c.flag) == ("1bit", 0.0, C.ONE_BIT)
    for params, message in [
            ({"threshold": 0.5}, "Required parameter type"),
            ({"type": "3bit"}, "Unknown type for gradient compression 3bit"),
            ({"type": "none"}, "Unknown type for gradient compression none"),
            ({"type": "2bit", "threshold": 0}, "threshold must be greater than 0 for two bit"),
            ({"type": "2bit", "threshold": -1}, "threshold must be greater than 0"),
            ({"type": "2bit", "threshold": "abc"}, "expect float but value='abc'"),
            ({"type": "1bit", "threshold": float("inf")}, "threshold must be finite"),
            ("2bit", "must be a dict")]:
        with pytest.raises(C.CompressionError, match=message):
            C.parse(params)


# -- the kvstore ---------------------------------------------------------------------------------

def _kv(keys=(("w", np.float32),)):
    """An mxps kvstore that never joined a job (as test_input_guards' ``bare_kvstore``): a
    call a check lets through fails on the missing connection instead."""
    from mxps.adapter.kvstore import MXPS, _Key
    from mxps.placement.plan import Plan
    kv = MXPS.__new__(MXPS)
    kv._keys, kv._str_ids, kv._ids = {}, {}, {}
    kv._optimizer = kv._compression = None
    kv._plan = Plan(1)
    for name, dtype in keys:
        kv._keys[name] = _Key(name, kv._key_id(name), (4,), dtype, kv._plan.slices(0, 4))
    return kv


def test_the_kvstore_refuses_bad_parameters_with_mxnets_error_and_keeps_its_codec():
    kv = _kv()
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.25})
    assert kv._compression.params == {"type": "2bit", "threshold": 0.25}
    with pytest.raises(mx.base.MXNetError, match="Unknown type for gradient compression 4bit"):
        kv.set_gradient_compression({"type": "4bit"})
    assert kv._compression.params == {"type": "2bit", "threshold": 0.25}


@pytest.mark.parametrize("op", ["push", "pushpull"])
def test_a_compressed_push_of_a_key_that_is_not_float32_is_refused_naming_the_key(op):
    kv = _kv(keys=(("h", np.float16),))
    kv.set_gradient_compression({"type": "2bit"})
    value = mx.nd.zeros((4,), dtype=np.float16)
    with pytest.raises(mx.base.MXNetError, match="key 'h': Gradient compression is only "
                                                 "supported for float32"):
        if op == "push":
            kv.push("h", value)
        else:
            kv.pushpull("h", value, out=mx.nd.zeros((4,), dtype=np.float16))
    assert kv._keys["h"].pushes == 0            # refused before anything was counted


def test_a_compressed_row_sparse_push_is_refused_as_mxnet_refuses_it():
    kv = _kv()
    kv.set_gradient_compression({"type": "2bit"})
    rows = mx.nd.sparse.row_sparse_array((mx.nd.ones((1,)), [1]), shape=(4,))
    with pytest.raises(mx.base.MXNetError, match="row sparse storage type is not supported"):
        kv.push("w", rows)
