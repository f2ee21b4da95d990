"""The typed payload format (mxps/wire/typed.py): what replaced pickle for data between nodes.

Round trips of any nesting of scalars, lists, tuples, dicts and arrays of every wire dtype;
and the decoder's promise: whatever bytes arrive (random, a valid payload truncated, flipped
or grown, a description crafted to lie about its arrays, a pickle) it raises ``WireError``
naming the problem, and nothing else, and never builds an object array.
"""
import json
import pickle
import struct

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from mxps.wire import typed
from mxps.wire.frame import WireError, dtype_code

WIRE_DTYPES = ["float32", "float64", "float16", "uint8", "int32", "int8", "int64"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 63, 2 ** 63 - 1),
                    st.floats(allow_nan=True), st.text(max_size=8))
keys = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2 ** 63, 2 ** 63 - 1),
                              st.floats(allow_nan=False), st.text(max_size=8)),
                    lambda k: st.tuples(k, k), max_leaves=4)
arrays = st.sampled_from(WIRE_DTYPES).flatmap(
    lambda dt: hnp.arrays(dt, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0,
                                               max_side=5)))
values = st.recursive(
    st.one_of(scalars, arrays),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.lists(inner, max_size=4).map(tuple),
                            st.dictionaries(keys, inner, max_size=4)),
    max_leaves=12)


def same(a, b):
    """Equal values, the same container types, arrays equal bit for bit with the same dtype."""
    if isinstance(a, np.ndarray):
        return (isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
                and a.tobytes() == b.tobytes())
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, float):
        return a == b or (a != a and b != b)
    return a == b


def handcrafted(value, data=b"", size=None):
    """A payload with the description ``{"bytes": size, "value": value}`` (JSON text when
    ``value`` is a str) followed by ``data``."""
    text = value if isinstance(value, str) else json.dumps(value)
    desc = ('{"bytes": %d, "value": %s}' % (len(data) if size is None else size, text)).encode()
    head = struct.pack("<4sI", b"MXTY", len(desc)) + desc
    return head + bytes(-len(head) % 8) + data


def refused(payload, *patterns):
    with pytest.raises(WireError) as e:
        typed.unpack(payload)
    for p in patterns:
        assert p in str(e.value), (p, str(e.value))
    return str(e.value)


# --- round trips ------------------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(values)
def test_any_nesting_of_scalars_containers_and_arrays_round_trips_exactly(value):
    got = typed.unpack(typed.pack(value))
    assert same(got, value), (got, value)


def test_optimizer_states_and_a_migration_part_round_trip_with_their_structure():
    adam = (np.arange(5, dtype=np.float32), np.full(5, 0.25, np.float32))
    multi_precision = (np.arange(3, dtype=np.float32), (np.ones(3, np.float32), None))
    part = {"key": 7, "target": 0, "offset": 3, "length": 5, "dtype": dtype_code("float16"),
            "value": np.linspace(0, 1, 5).astype(np.float16), "applied": 12,
            "state": adam, "count": 12}
    states = {(7, 0): adam, (7, 5): multi_precision, (9, 0): None}
    for value in (part, states, [[7, 0, 5, adam]]):
        assert same(typed.unpack(typed.pack(value)), value)


def test_arrays_come_back_as_read_only_views_of_the_frame_without_a_copy():
    frame = bytearray(typed.pack({"w": np.arange(6, dtype=np.int32).reshape(2, 3)}))
    w = typed.unpack(memoryview(frame).toreadonly())["w"]
    assert np.shares_memory(w, np.frombuffer(frame, np.uint8))
    with pytest.raises(ValueError):
        w[0, 0] = 5
    assert w.shape == (2, 3) and w.dtype == np.int32


def test_every_array_starts_at_an_aligned_offset():
    payload = typed.pack([np.ones(3, np.int8), np.ones(1, np.float64), np.ones(2, np.float16)])
    n = struct.unpack_from("<I", payload, 4)[0]
    start = -(-(8 + n) // 8) * 8
    for a in typed.unpack(payload):
        assert (a.__array_interface__["data"][0] - np.frombuffer(payload, np.uint8)
                .__array_interface__["data"][0] - start) % 8 == 0


@pytest.mark.parametrize("value,problem", [
    (np.array([object()]), "cannot be sent"),
    (np.ones(2, dtype=bool), "cannot be sent"),
    ({1, 2}, "cannot carry a set"),
    ({(1, frozenset()): 0}, "dict key is a frozenset"),
    (2 ** 64, "does not fit in int64"),
])
def test_pack_refuses_what_the_format_cannot_carry(value, problem):
    with pytest.raises((TypeError, ValueError)) as e:
        typed.pack(value)
    assert problem in str(e.value)


def test_pack_refuses_nesting_deeper_than_the_decoder_accepts():
    value = 1
    for _ in range(typed.MAX_DEPTH + 1):
        value = [value]
    with pytest.raises(ValueError, match="nesting deeper than %d" % typed.MAX_DEPTH):
        typed.pack(value)
    assert typed.unpack(typed.pack(value[0])) == value[0]


# --- garbage never raises anything but WireError ----------------------------------------------

def _decode_or_wire_error(payload):
    try:
        value = typed.unpack(payload)
    except WireError:
        return None
    _no_object_arrays(value)
    return value


def _no_object_arrays(value):
    if isinstance(value, np.ndarray):
        assert value.dtype != object
    elif isinstance(value, (list, tuple)):
        for x in value:
            _no_object_arrays(x)
    elif isinstance(value, dict):
        for k, v in value.items():
            _no_object_arrays(k)
            _no_object_arrays(v)


@settings(max_examples=1000, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_raise_wire_error_and_nothing_else(data):
    _decode_or_wire_error(data)
    _decode_or_wire_error(b"MXTY" + data)
    _decode_or_wire_error(struct.pack("<4sI", b"MXTY", len(data)) + data)


@settings(max_examples=500, deadline=None)
@given(value=values, data=st.data())
def test_a_valid_payload_truncated_flipped_or_grown_raises_wire_error_or_decodes(value, data):
    good = typed.pack(value)
    cut = data.draw(st.integers(0, len(good)))
    _decode_or_wire_error(good[:cut])
    flipped = bytearray(good)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(flipped) - 1))
        flipped[i] ^= 1 << data.draw(st.integers(0, 7))
    _decode_or_wire_error(bytes(flipped))
    i = data.draw(st.integers(0, len(good)))
    _decode_or_wire_error(good[:i] + data.draw(st.binary(min_size=1, max_size=16)) + good[i:])


@settings(max_examples=500, deadline=None)
@given(st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(),
                              st.text(max_size=6)),
                    lambda j: st.one_of(st.lists(j, max_size=4),
                                        st.dictionaries(st.sampled_from(
                                            ["tuple", "dict", "array", "x"]), j, max_size=2)),
                    max_leaves=16),
       st.binary(max_size=64))
def test_any_json_description_over_any_data_raises_wire_error_or_decodes(desc, data):
    _decode_or_wire_error(handcrafted(desc, data))


# --- descriptions that lie -----------------------------------------------------------------------

F32 = dtype_code("float32")


@pytest.mark.parametrize("value,data,patterns", [
    ({"array": [F32, [4], 0, 16]}, bytes(8), ["ends past the data"]),
    ({"array": [F32, [4], 0, 12]}, bytes(16), ["has 16 bytes, not 12"]),
    ({"array": [F32, [-1], 0, -4]}, bytes(8), ["negative array dimension"]),
    ({"array": [99, [1], 0, 4]}, bytes(8), ["unknown dtype code 99"]),
    ({"array": [F32, [1], -8, 4]}, bytes(8), ["overlaps"]),
    ({"array": [F32, 4, 0, 16]}, bytes(16), ["shape is a list"]),
    ({"array": [F32, [1] * 33, 0, 4]}, bytes(8), ["at most 32"]),
    ({"array": [F32, [True], 0, 4]}, bytes(8), ["array dimension is not an integer"]),
    ({"array": [F32, [2], 0]}, bytes(8), ["[dtype code, shape, offset, nbytes]"]),
    ([{"array": [F32, [2], 0, 8]}, {"array": [F32, [2], 4, 8]}], bytes(16), ["overlaps"]),
    ({"pickle": "x"}, b"", ["an object must be one of"]),
    ({"tuple": [1], "dict": []}, b"", ["an object must be one of"]),
    ({"tuple": 5}, b"", ["a tuple holds a list"]),
    ({"dict": [[[1], 2]]}, b"", ["a dict key is a list"]),
    ({"dict": [[1, 2], [1, 3]]}, b"", ["dict key 1 appears twice"]),
    ({"dict": [[1, 2, 3]]}, b"", ["a dict entry is [key, value]"]),
    (2 ** 63, b"", ["does not fit in int64"]),
])
def test_a_lying_description_is_refused_naming_the_problem(value, data, patterns):
    refused(handcrafted(value, data), *patterns)


def test_the_declared_data_length_must_be_the_frame_exactly():
    good = typed.pack(np.ones(2, np.float32))
    refused(good + b"\0", "the frame has %d" % (len(good) + 1))
    short = handcrafted(None, b"", size=8)          # declares 8 data bytes, carries none
    refused(short, "are %d bytes, the frame has %d" % (len(short) + 8, len(short)))


def test_nesting_beyond_the_limit_is_refused_however_deep():
    refused(handcrafted("[" * 40 + "]" * 40), "nesting deeper than %d" % typed.MAX_DEPTH)
    refused(handcrafted("[" * 100000 + "]" * 100000), "nests too deeply")


def test_text_that_is_not_utf8_or_json_or_an_absurd_integer_is_refused():
    desc = b'{"bytes": 0, "value": "\xff"}'
    refused(struct.pack("<4sI", b"MXTY", len(desc)) + desc + bytes(-len(desc) % 8),
            "not JSON")
    refused(handcrafted("1" * 10000), "not JSON")
    refused(handcrafted("[1,"), "not JSON")


def test_the_top_level_must_be_exactly_bytes_and_value():
    desc = b'{"bytes": 0, "value": 1, "extra": 2}'
    refused(struct.pack("<4sI", b"MXTY", len(desc)) + desc + bytes(-len(desc) % 8),
            '{"bytes": ..., "value": ...}')


def test_a_pickle_is_refused_as_another_format_without_being_loaded(tmp_path):
    class Evil:
        def __reduce__(self):
            return (open, (str(tmp_path / "ran"), "w"))
    refused(pickle.dumps({"states": Evil()}), "not a typed payload")
    refused(None, "no payload frame")
    assert not (tmp_path / "ran").exists()
