"""The mxps wire format (mxps/wire.py): header layout, validation, payload views, dtype codes."""
import struct

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from mxps.wire import frame as wire
from mxps.wire.frame import HEADER_SIZE, Header, MsgType, WireError

INT32 = st.integers(-2 ** 31, 2 ** 31 - 1)
INT64 = st.integers(-2 ** 63, 2 ** 63 - 1)
UINT8 = st.integers(0, 255)
UINT32 = st.integers(0, 2 ** 32 - 1)
UINT64 = st.integers(0, 2 ** 64 - 1)

headers = st.builds(
    Header, type=st.sampled_from(list(MsgType)), key=INT32, sender=INT32, iteration=INT64,
    plan_version=UINT32, offset=UINT64, length=UINT64, request_id=UINT64, dtype=UINT8,
    flags=UINT8, status=INT32)

MXNET_TYPE_FLAGS = {"float32": 0, "float64": 1, "float16": 2, "uint8": 3, "int32": 4,
                    "int8": 5, "int64": 6}


def _valid_frame(**fields):
    return Header(MsgType.PUSH, **fields).pack()


def test_header_size_is_56_bytes():
    assert HEADER_SIZE == 56
    assert len(Header(MsgType.ACK).pack()) == 56


@settings(max_examples=300, deadline=None)
@given(headers)
def test_pack_then_unpack_returns_an_equal_header_for_any_fields(h):
    frame = h.pack()
    assert len(frame) == HEADER_SIZE
    assert frame[:4] == b"MXPS"
    back = wire.unpack(frame)
    assert back == h
    assert isinstance(back.type, int) and MsgType(back.type) == h.type
    assert back.pack() == frame


@pytest.mark.parametrize("mtype", list(MsgType))
def test_every_message_type_round_trips_with_extreme_fields(mtype):
    for ints in ((-2 ** 31, -2 ** 63, 0, 0, -2 ** 31, 0), (2 ** 31 - 1, 2 ** 63 - 1, 2 ** 32 - 1,
                                                            2 ** 64 - 1, 2 ** 31 - 1, 255)):
        i32, i64, u32, u64, status, u8 = ints
        h = Header(mtype, key=i32, sender=i32, iteration=i64, plan_version=u32, offset=u64,
                   length=u64, request_id=u64, dtype=u8, flags=u8, status=status)
        assert wire.unpack(h.pack()) == h
        # bytearray and memoryview frames decode the same way as bytes
        assert wire.unpack(bytearray(h.pack())) == h
        assert wire.unpack(memoryview(h.pack())) == h


def test_header_layout_matches_the_documented_offsets():
    h = Header(MsgType.PULL, key=7, sender=3, iteration=11, plan_version=5, offset=13,
               length=17, request_id=19, dtype=1, flags=0, status=-2)
    f = h.pack()
    assert f[4] == wire.WIRE_VERSION and f[5] == MsgType.PULL and f[6] == 1 and f[7] == 0
    assert struct.unpack_from("<i", f, 8)[0] == 7
    assert struct.unpack_from("<i", f, 12)[0] == 3
    assert struct.unpack_from("<q", f, 16)[0] == 11
    assert struct.unpack_from("<I", f, 24)[0] == 5
    assert struct.unpack_from("<i", f, 28)[0] == -2
    assert struct.unpack_from("<QQQ", f, 32) == (13, 17, 19)


def test_unpack_of_a_frame_with_bad_magic_says_it_may_be_a_native_mxnet_node():
    frame = b"PSLT" + _valid_frame()[4:]
    with pytest.raises(WireError) as e:
        wire.unpack(frame)
    msg = str(e.value)
    assert "magic" in msg and "PSLT" in msg
    assert "native MXNet" in msg


def test_unpack_of_another_wire_version_names_both_versions():
    frame = bytearray(_valid_frame())
    frame[4] = wire.WIRE_VERSION + 1
    with pytest.raises(WireError) as e:
        wire.unpack(bytes(frame))
    msg = str(e.value)
    assert "version %d" % (wire.WIRE_VERSION + 1) in msg
    assert str(wire.WIRE_VERSION) in msg


@pytest.mark.parametrize("n", [0, 1, 55, 57, 112])
def test_unpack_of_a_frame_of_the_wrong_size_names_the_size(n):
    frame = (_valid_frame() * 3)[:n]
    with pytest.raises(WireError) as e:
        wire.unpack(frame)
    assert "%d bytes" % n in str(e.value) and "56" in str(e.value)


@pytest.mark.parametrize("t", [0, 8, 9, 18, 19, 23, 255])
def test_unpack_of_an_unknown_message_type_names_the_type(t):
    frame = bytearray(_valid_frame())
    frame[5] = t
    with pytest.raises(WireError) as e:
        wire.unpack(bytes(frame))
    assert "unknown message type %d" % t in str(e.value)


def test_wire_error_is_a_value_error():
    assert issubclass(WireError, ValueError)


@pytest.mark.parametrize("name", sorted(MXNET_TYPE_FLAGS))
def test_dtype_codes_are_mxnets_type_flags(name):
    code = MXNET_TYPE_FLAGS[name]
    assert wire.dtype_code(np.dtype(name)) == code
    assert wire.dtype_code(name) == code
    assert wire.dtype_of(code) == np.dtype(name)


def test_dtype_codes_agree_with_mxnets_own_table():
    from mxnet.ndarray import ndarray as mx_nd
    table = getattr(mx_nd, "_DTYPE_NP_TO_MX", None)
    if table is None:
        import mxnet.base as mx_base
        table = getattr(mx_base, "_DTYPE_NP_TO_MX", None)
    assert table is not None, "mxnet has no _DTYPE_NP_TO_MX table to compare with"
    for np_type, flag in table.items():
        if np_type is None or flag < 0:
            continue
        dt = np.dtype(np_type)
        if dt.fields is not None or dt == np.bool_:
            continue    # bfloat16 and bool: not carried by mxps
        assert wire.dtype_code(dt) == flag, dt


@pytest.mark.parametrize("dt", ["bool", "complex64", "uint16", "uint32", "float128", ">f4",
                                "U3"])
def test_unsupported_dtype_raises_naming_the_dtype(dt):
    with pytest.raises(WireError) as e:
        wire.dtype_code(np.dtype(dt))
    assert str(np.dtype(dt)) in str(e.value)
    assert "float32" in str(e.value)   # lists what is supported


@pytest.mark.parametrize("code", [7, 12, 254, wire.NO_DTYPE])
def test_unknown_dtype_code_raises(code):
    with pytest.raises(WireError, match="unknown dtype code %d" % code):
        wire.dtype_of(code)


@pytest.mark.parametrize("name", sorted(MXNET_TYPE_FLAGS))
def test_payload_array_is_a_zero_copy_view_of_the_frame(name):
    dt = np.dtype(name)
    src = (np.arange(11) % 7).astype(dt)
    frame = bytearray(src.tobytes())
    h = Header(MsgType.DATA, key=4, length=11, dtype=wire.dtype_code(dt))
    arr = wire.payload_array(h, frame)
    assert arr.dtype == dt and arr.shape == (11,)
    np.testing.assert_array_equal(arr, src)
    # shares memory with the frame: a change to the frame shows in the array
    frame[0:dt.itemsize] = np.array([5], dtype=dt).tobytes()
    assert arr[0] == 5
    assert np.shares_memory(arr, np.frombuffer(frame, dtype=np.uint8))


def test_payload_array_views_a_zmq_frame_without_copying():
    zmq = pytest.importorskip("zmq")
    data = np.arange(6, dtype=np.float64).tobytes()
    frame = zmq.Frame(data)
    h = Header(MsgType.PUSH, length=6, dtype=wire.dtype_code("float64"))
    arr = wire.payload_array(h, frame)
    np.testing.assert_array_equal(arr, np.arange(6.0))
    assert np.shares_memory(arr, np.frombuffer(frame.buffer, dtype=np.uint8))


def test_payload_array_of_an_empty_slice_is_empty():
    h = Header(MsgType.DATA, length=0, dtype=0)
    assert wire.payload_array(h, b"").shape == (0,)


@pytest.mark.parametrize("nbytes", [0, 39, 41, 44])
def test_payload_array_rejects_a_byte_length_that_disagrees_with_the_header(nbytes):
    h = Header(MsgType.DATA, key=42, length=10, dtype=wire.dtype_code("float32"))
    with pytest.raises(WireError) as e:
        wire.payload_array(h, bytes(nbytes))
    msg = str(e.value)
    assert "key 42" in msg and "%d bytes" % nbytes in msg and "10 x float32" in msg


def test_payload_array_rejects_a_header_without_a_dtype():
    h = Header(MsgType.DATA, length=0)
    with pytest.raises(WireError, match="dtype code 255"):
        wire.payload_array(h, b"")


def test_reply_keeps_request_id_key_slice_and_iteration():
    req = Header(MsgType.PUSHPULL, key=9, sender=2, iteration=31, plan_version=4,
                 offset=1000, length=250, request_id=2 ** 64 - 1, dtype=0)
    rep = req.reply(MsgType.DATA)
    assert rep.type == MsgType.DATA
    for f in ("key", "sender", "iteration", "plan_version", "offset", "length", "request_id",
              "dtype", "flags", "status"):
        assert getattr(rep, f) == getattr(req, f), f
    assert req.type == MsgType.PUSHPULL     # the request is unchanged


def test_reply_applies_changes_and_round_trips():
    req = Header(MsgType.PULL, key=3, offset=8, length=2, request_id=77, dtype=1)
    rep = req.reply(MsgType.ERROR, status=5, dtype=wire.NO_DTYPE, length=0)
    assert (rep.status, rep.dtype, rep.length) == (5, wire.NO_DTYPE, 0)
    assert (rep.key, rep.offset, rep.request_id) == (3, 8, 77)
    assert wire.unpack(rep.pack()) == rep


def test_repr_names_the_message_type():
    assert "PUSHPULL" in repr(Header(MsgType.PUSHPULL, key=1))
