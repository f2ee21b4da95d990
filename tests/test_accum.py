"""Slice accumulation: the compiled ``mxps.kernels._accum`` against its numpy twin ``mxps.kernels.accum_py``."""
import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from mxps.kernels import _accum, accum_py
from mxps.wire.frame import dtype_code

IMPLS = [pytest.param(_accum, id="cython"), pytest.param(accum_py, id="python")]
DTYPES = ["float32", "float64", "float16", "uint8", "int32", "int8", "int64"]
SIZES = [0, 1, 2, 3, 7, 17, 1023, 4097, 65537, 10 ** 6]


def _random(dt, n, rng):
    dt = np.dtype(dt)
    if dt.kind == "f":
        return (rng.standard_normal(n) * 1e3).astype(dt)
    info = np.iinfo(dt)
    # full range: sums wrap around, as numpy's do
    return rng.integers(info.min, info.max, size=n, dtype=dt, endpoint=True)


def test_the_selector_uses_the_compiled_module_by_default():
    from mxps.kernels import accum
    assert accum.IMPLEMENTATION in ("cython", "python")
    if accum.IMPLEMENTATION == "cython":
        assert accum.add_into is _accum.add_into


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_add_into_equals_the_python_twin_and_numpy_exactly(dt, n):
    rng = np.random.default_rng(n * 7 + len(dt))
    acc0, src = _random(dt, n, rng), _random(dt, n, rng)
    code = dtype_code(dt)
    with np.errstate(over="ignore"):
        expect = acc0 + src
    a_c, a_p = acc0.copy(), acc0.copy()
    assert _accum.add_into(a_c, src, code) is None
    accum_py.add_into(a_p, src, code)
    assert a_c.tobytes() == expect.tobytes()
    assert a_p.tobytes() == expect.tobytes()


@settings(max_examples=200, deadline=None)
@given(data=st.data(), dt=st.sampled_from(DTYPES), n=st.integers(0, 300))
def test_add_into_equals_the_twin_for_any_values(data, dt, n):
    if dt.startswith("float"):
        elems = st.floats(width=int(dt[5:]), allow_nan=False)   # infinities included
    else:
        elems = None
    acc0 = data.draw(hnp.arrays(dt, n, elements=elems))
    src = data.draw(hnp.arrays(dt, n, elements=elems))
    a_c, a_p = acc0.copy(), acc0.copy()
    with np.errstate(over="ignore", invalid="ignore"):
        expect = acc0 + src
        _accum.add_into(a_c, src, dtype_code(dt))
        accum_py.add_into(a_p, src, dtype_code(dt))
    assert a_c.tobytes() == a_p.tobytes() == expect.tobytes()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_copy_into_copies_the_bytes(impl, dt, n):
    rng = np.random.default_rng(n + 1)
    acc, src = _random(dt, n, rng), _random(dt, n, rng)
    assert impl.copy_into(acc, src) is None
    assert acc.tobytes() == src.tobytes()


@pytest.mark.parametrize("impl", IMPLS)
def test_repeated_adds_sum_every_worker(impl):
    rng = np.random.default_rng(3)
    slices = [rng.standard_normal(1001).astype(np.float32) for _ in range(5)]
    acc = np.empty(1001, np.float32)
    impl.copy_into(acc, slices[0])
    expect = slices[0].copy()
    for s in slices[1:]:
        impl.add_into(acc, s, 0)
        expect += s
    assert acc.tobytes() == expect.tobytes()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dt", DTYPES)
def test_a_read_only_bytes_source_adds_into_a_numpy_accumulator(impl, dt):
    # zmq frames arrive as read-only memoryviews of bytes
    rng = np.random.default_rng(5)
    acc0, src = _random(dt, 999, rng), _random(dt, 999, rng)
    frame = memoryview(src.tobytes())
    assert frame.readonly
    acc = acc0.copy()
    with np.errstate(over="ignore"):
        impl.add_into(acc, frame, dtype_code(dt))
        assert acc.tobytes() == (acc0 + src).tobytes()
    impl.copy_into(acc, frame)
    assert acc.tobytes() == src.tobytes()


@pytest.mark.parametrize("impl", IMPLS)
def test_a_zmq_frame_source_adds_into_a_numpy_accumulator(impl):
    zmq = pytest.importorskip("zmq")
    src = np.arange(100, dtype=np.float64)
    frame = zmq.Frame(src.tobytes())
    acc = np.ones(100)
    impl.add_into(acc, frame.buffer, dtype_code("float64"))
    np.testing.assert_array_equal(acc, src + 1)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fn", ["add_into", "copy_into"])
@pytest.mark.parametrize("n_acc,n_src", [(10, 9), (9, 10), (0, 1), (1, 0)])
def test_length_mismatch_raises_value_error(impl, fn, n_acc, n_src):
    acc, src = np.zeros(n_acc, np.float32), np.ones(n_src, np.float32)
    args = (acc, src, 0) if fn == "add_into" else (acc, src)
    with pytest.raises(ValueError) as e:
        getattr(impl, fn)(*args)
    assert "accumulator has %d bytes, slice has %d" % (4 * n_acc, 4 * n_src) in str(e.value)
    assert not acc.any()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("code", [7, 99, -1, 255])
def test_unsupported_dtype_raises_value_error_naming_the_code(impl, code):
    acc, src = np.zeros(8, np.float64), np.ones(8, np.float64)
    with pytest.raises(ValueError, match="unsupported dtype code %d" % code):
        impl.add_into(acc, src, code)
    assert not acc.any()


def test_unsupported_dtype_raises_for_an_empty_slice_in_both():
    e = np.empty(0, np.float32)
    with pytest.raises(ValueError):
        accum_py.add_into(e, e, 99)
    with pytest.raises(ValueError):
        _accum.add_into(e, e, 99)


def test_a_byte_length_that_is_not_whole_elements_raises_in_both():
    acc, src = bytearray(6), bytes(6)
    with pytest.raises(ValueError):
        accum_py.add_into(acc, src, 0)
    with pytest.raises(ValueError):
        _accum.add_into(acc, src, 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_read_only_accumulator_is_refused(impl):
    acc = np.zeros(4, np.float32)
    acc.flags.writeable = False
    with pytest.raises((ValueError, TypeError, BufferError)):
        impl.add_into(acc, np.ones(4, np.float32), 0)
    with pytest.raises((ValueError, TypeError, BufferError)):
        impl.copy_into(acc, np.ones(4, np.float32))
    assert not acc.any()


# --- the compiled add_into releases the GIL -----------------------------------------------------

def _progress_of_another_thread_during(call):
    """How often a sleeping Python thread woke up and ran while ``call()`` ran, and its time.

    The switch interval is raised so that the interpreter never forces the GIL away from the
    calling thread: the other thread can run during ``call`` only if ``call`` releases the GIL.
    """
    counter = [0]
    stop = threading.Event()

    def count():
        while not stop.is_set():
            time.sleep(0.0002)          # releases the GIL; wakes up needing it
            counter[0] += 1

    old = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    t = threading.Thread(target=count, daemon=True)
    try:
        t.start()
        time.sleep(0.02)
        c0 = counter[0]
        t0 = time.perf_counter()
        call()
        dt = time.perf_counter() - t0
        c1 = counter[0]
    finally:
        stop.set()
        t.join(10)
        sys.setswitchinterval(old)
    return c1 - c0, dt


def test_the_harness_sees_no_progress_during_a_call_that_holds_the_gil():
    progress, dt = _progress_of_another_thread_during(lambda: sum(range(10 ** 6)))
    assert progress == 0, (progress, dt)


def test_compiled_add_into_releases_the_gil():
    n = 8 * 10 ** 6
    acc, src = np.ones(n), np.ones(n)
    attempts = []
    for _ in range(4):
        progress, dt = _progress_of_another_thread_during(
            lambda: _accum.add_into(acc, src, dtype_code("float64")))
        attempts.append((n, round(dt, 3), progress))
        if dt >= 0.02 and progress > 0:
            break
        if dt < 0.02 and n < 64 * 10 ** 6:     # make the call long enough to be conclusive
            n *= 2
            acc, src = np.ones(n), np.ones(n)
    # conclusive: a call of >= 20 ms during which the other thread ran (a call holding the GIL
    # gives it no turn at all: the test above)
    assert attempts[-1][1] >= 0.02 and attempts[-1][2] > 0, (
        "another Python thread did not run during add_into: (elements, seconds, wake-ups) per "
        "attempt: %s" % attempts)
