"""Asynchronous operations on MXNet's engine: ``mxps._engine`` and its ctypes twin ``engine_py``.

Every test runs against both implementations. Waits on the engine are bounded (a hung engine
fails the test instead of hanging the session).
"""
import ctypes
import gc
import threading
import time
import weakref

import mxnet as mx
import numpy as np
import pytest

from mxps.kernels import _engine, engine_py
from mxps.kernels import ndview
from mxps.kernels.ndview import numpy_view

PUSH_ASYNC_ND = ctypes.cast(mx.base._LIB.MXEnginePushAsyncND, ctypes.c_void_p).value
TIMEOUT = 60.0


@pytest.fixture(params=[_engine, engine_py], ids=["cython", "python"])
def eng(request):
    request.param.bind(PUSH_ASYNC_ND)
    return request.param


def bounded(fn, what, timeout=TIMEOUT):
    """fn() in a helper thread; fails (instead of hanging) if it does not return in time."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # re-raised in the test thread
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        pytest.fail("%s did not finish within %.0f s: the engine hangs" % (what, timeout))
    if "error" in box:
        raise box["error"]
    return box["value"]


def later(delay, *steps):
    """Run ``steps`` (callables) one after another on a new thread after ``delay`` seconds."""
    def run():
        time.sleep(delay)
        for s in steps:
            s()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def ready(*arrays):
    for a in arrays:
        a.wait_to_read()


def test_a_delayed_write_from_another_thread_is_seen_by_a_later_engine_read(eng):
    b = mx.nd.zeros((1000,))
    ready(b)
    written = threading.Event()

    def write():
        numpy_view(b)[:] = 41
        written.set()

    def op(done):
        later(0.3, write, done)

    t0 = time.perf_counter()
    eng.push_async(op, [], [b.handle.value], 0, b"test_delayed_write")
    assert time.perf_counter() - t0 < 0.25     # push returns at once
    out = bounded(lambda: (b + 1).asnumpy(), "(b + 1).asnumpy()")
    waited = time.perf_counter() - t0
    assert written.is_set()
    assert waited >= 0.28, "the read did not wait for completion (%.3f s)" % waited
    np.testing.assert_array_equal(out, np.full(1000, 42.0, np.float32))


def test_an_op_with_a_const_input_runs_after_a_slow_dot_writing_it(eng):
    n = 1000
    a = mx.nd.ones((n, n))
    y = mx.nd.zeros((n, n))
    out = mx.nd.zeros((n * n,))
    ready(a, y, out)
    seen = {}

    def op(done):
        seen["y"] = numpy_view(y).copy()
        numpy_view(out)[:] = numpy_view(y)
        done()

    for _ in range(3):
        mx.nd.dot(a, a, out=y)           # pending writes to y
    eng.push_async(op, [y.handle.value], [out.handle.value], 0, b"test_const_after_dot")
    res = bounded(out.asnumpy, "out.asnumpy()")
    assert (seen["y"] == n).all(), "the op read y before the dot finished writing it"
    assert (res == n).all()


def test_an_op_with_a_const_input_waits_for_a_pending_async_write_to_it(eng):
    # the writer holds no engine thread, so only dependency tracking can hold the reader back
    y = mx.nd.zeros((100,))
    out = mx.nd.zeros((100,))
    ready(y, out)
    order = []

    def writer(done):
        def write():
            numpy_view(y)[:] = 7
            order.append("write")
        later(0.3, write, done)

    def reader(done):
        order.append("read")
        numpy_view(out)[:] = numpy_view(y) * 2
        done()

    eng.push_async(writer, [], [y.handle.value], 0, b"test_writer")
    eng.push_async(reader, [y.handle.value], [out.handle.value], 0, b"test_reader")
    res = bounded(out.asnumpy, "out.asnumpy()")
    assert order == ["write", "read"]
    np.testing.assert_array_equal(res, np.full(100, 14.0, np.float32))


def test_a_mutable_op_waits_for_pending_reads_of_its_array(eng):
    # write-after-read: the writer must not overwrite x while an earlier reader holds it
    x = mx.nd.full((100,), 3.0)
    copy = mx.nd.zeros((100,))
    ready(x, copy)
    order = []

    def reader(done):
        def read():
            numpy_view(copy)[:] = numpy_view(x)
            order.append("read")
        later(0.3, read, done)

    def writer(done):
        order.append("write")
        numpy_view(x)[:] = -1
        done()

    eng.push_async(reader, [x.handle.value], [copy.handle.value], 0, b"test_reader")
    eng.push_async(writer, [], [x.handle.value], 0, b"test_writer")
    bounded(mx.nd.waitall, "waitall")
    assert order == ["read", "write"]
    assert (copy.asnumpy() == 3).all() and (x.asnumpy() == -1).all()


def test_hundreds_of_ops_in_flight_at_once_all_complete(eng):
    n = 320
    arrays = [mx.nd.zeros((4,)) for _ in range(n)]
    ready(*arrays)
    started = []
    lock = threading.Lock()

    def make(i):
        def op(done):
            numpy_view(arrays[i])[:] = i
            with lock:
                started.append(done)
        return op

    for i in range(n):
        eng.push_async(make(i), [], [arrays[i].handle.value], 0, b"test_in_flight")
    deadline = time.monotonic() + TIMEOUT
    while len(started) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    # every op started although none has completed: no engine thread is held by one
    assert len(started) == n
    for done in started:
        done()
    values = bounded(lambda: [a.asnumpy() for a in arrays], "reading %d arrays" % n)
    for i, v in enumerate(values):
        assert (v == i).all()


@pytest.mark.parametrize("priority", [-1000, -1, 0, 5, 1000])
def test_priority_is_accepted(eng, priority):
    b = mx.nd.zeros((3,))
    ready(b)

    def op(done):
        numpy_view(b)[:] = priority
        done()

    eng.push_async(op, [], [b.handle.value], priority=priority, name=b"test_priority")
    assert (bounded(b.asnumpy, "b.asnumpy()") == priority).all()


def test_an_op_with_no_arrays_runs(eng):
    ran = threading.Event()

    def op(done):
        ran.set()
        done()

    eng.push_async(op, [], [], 0, b"test_no_arrays")
    bounded(mx.nd.waitall, "waitall")
    assert ran.is_set()


@pytest.mark.parametrize("complete_first", [False, True], ids=["raises", "completes_then_raises"])
def test_an_exception_in_the_callback_completes_the_op_and_is_printed(eng, capfd, complete_first):
    b = mx.nd.zeros((5,))
    ready(b)

    def op(done):
        numpy_view(b)[:] = 1
        if complete_first:
            done()
        raise ValueError("boom from test_engine")

    eng.push_async(op, [], [b.handle.value], 0, b"test_raises")
    out = bounded(lambda: (b + 1).asnumpy(), "(b + 1).asnumpy() after a failing op")
    assert (out == 2).all()
    bounded(mx.nd.waitall, "waitall")
    err = capfd.readouterr().err
    assert "mxps: engine callback failed" in err
    assert "boom from test_engine" in err
    assert "completed twice" not in err


def test_completion_called_twice_raises_runtime_error(eng):
    b = mx.nd.zeros((2,))
    ready(b)
    result = {}

    def op(done):
        assert not done.done
        done()
        assert done.done
        try:
            done()
        except RuntimeError as exc:
            result["error"] = str(exc)

    eng.push_async(op, [], [b.handle.value], 0, b"test_twice")
    bounded(b.asnumpy, "b.asnumpy()")
    bounded(mx.nd.waitall, "waitall")
    assert result.get("error") == "engine operation completed twice"


def test_completion_called_twice_from_another_thread_raises_runtime_error(eng):
    b = mx.nd.zeros((2,))
    ready(b)
    holder = []

    def op(done):
        holder.append(done)

    eng.push_async(op, [], [b.handle.value], 0, b"test_twice_thread")
    deadline = time.monotonic() + TIMEOUT
    while not holder and time.monotonic() < deadline:
        time.sleep(0.01)
    assert holder, "the op never ran"
    holder[0]()
    with pytest.raises(RuntimeError, match="completed twice"):
        holder[0]()
    bounded(b.asnumpy, "b.asnumpy()")


def test_the_engine_releases_the_callback_after_completion(eng):
    class Op:
        def __call__(self, done):
            done()

    b = mx.nd.zeros((2,))
    ready(b)
    op = Op()
    ref = weakref.ref(op)
    eng.push_async(op, [], [b.handle.value], 0, b"test_release")
    del op
    bounded(mx.nd.waitall, "waitall")
    deadline = time.monotonic() + 10
    while ref() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert ref() is None, "the callback is still referenced after the op completed"


def test_the_selector_pushes_through_the_default_implementation():
    from mxps.kernels import engine
    assert engine.IMPLEMENTATION in ("cython", "python")
    b = mx.nd.zeros((3,))
    ready(b)

    def op(done):
        numpy_view(b)[:] = 9
        later(0.05, done)

    engine.push_async(op, [], [b.handle.value])
    assert (bounded(b.asnumpy, "b.asnumpy()") == 9).all()


def _weight_in_a_onednn_layout():
    """A convolution weight after an inference-mode forward: MXNet built with oneDNN caches it
    in a oneDNN layout (skips the test on a build without oneDNN)."""
    net = mx.gluon.nn.Conv2D(8, 3, in_channels=2)
    net.initialize(mx.init.Uniform())
    w = net.weight.data()
    assert not ndview.in_onednn_layout(w)
    net(mx.nd.ones((1, 2, 6, 6)))
    mx.nd.waitall()
    if not ndview.in_onednn_layout(w):
        pytest.skip("this MXNet keeps no array in a oneDNN layout")
    return w


def test_an_operation_holding_an_array_in_a_onednn_layout_views_it_in_the_default_one(eng):
    # MXNDArrayGetData (numpy_view) would convert it with an engine operation and wait for it:
    # from inside an operation holding the array, that wait never ends; engine_view converts
    # it in place, as the operation that holds it
    w = _weight_in_a_onednn_layout()
    values = w.asnumpy()
    seen = {}

    def op(done):
        seen["view"] = ndview.engine_view(w).copy()
        seen["converted"] = not ndview.in_onednn_layout(w)
        done()

    eng.push_async(op, [], [w.handle.value], 0, b"test_onednn")
    bounded(mx.nd.waitall, "waitall")
    assert seen["converted"]
    np.testing.assert_array_equal(seen["view"].reshape(values.shape), values)
    np.testing.assert_array_equal(w.asnumpy(), values)


def test_arrays_in_the_default_layout_are_left_as_they_are():
    a = mx.nd.arange(6)
    assert not ndview.in_onednn_layout(a) and not ndview.to_default_layout(a)
    assert not ndview.in_onednn_layout(mx.nd.zeros((4, 4))[1:3])
