# cython: language_level=3, boundscheck=False, wraparound=False
"""Asynchronous operations on MXNet's dependency engine (compiled twin of mxps/kernels/engine_py.py).

MXNet's native kvstore overlaps communication with backward by pushing an *asynchronous* engine
operation per key: the engine runs it once the gradient is ready, the operation starts the
transfer and returns at once, and the engine treats the output as written only when the transfer
calls the operation's completion callback.  MXNet 1.9.1 exposes exactly this to plugins through
``MXEnginePushAsyncND``; this module wraps it:

    push_async(fn, const_handles, mutable_handles, priority, name)

runs ``fn(completion)`` on an engine thread once every const array is readable and every mutable
array writable; ``completion()`` (callable from any thread, once) releases them.  No engine thread
is held while the transfer is in flight, so hundreds of keys can be in flight at once.

The engine hands the callback a pointer to an ``engine::CallbackOnComplete`` (three pointers,
include/mxnet/engine.h in 1.9.1) that lives only for the duration of the call; we copy it by value,
which the header explicitly allows ("use implicit copy and assign").
"""
from cpython.ref cimport PyObject, Py_INCREF, Py_DECREF
from libc.stdint cimport int32_t, uintptr_t
from libc.stdlib cimport malloc, free

cdef extern from *:
    """
    typedef struct { int32_t dev_type; int32_t dev_id; } mxps_context_t;
    typedef struct {
        void (*callback)(void *engine, void *param, const void *error);
        void *engine;
        void *param;
    } mxps_on_complete_t;
    typedef void (*mxps_async_fn)(void *rctx, void *on_complete, void *param);
    typedef void (*mxps_deleter_fn)(void *param);
    typedef int (*mxps_push_async_nd_t)(mxps_async_fn, void *, mxps_deleter_fn, void *,
                                        void **, int, void **, int, void *, int,
                                        const char *, int);
    """
    ctypedef struct mxps_context_t:
        int32_t dev_type
        int32_t dev_id
    ctypedef struct mxps_on_complete_t:
        void (*callback)(void *engine, void *param, const void *error) nogil
        void *engine
        void *param
    ctypedef void (*mxps_async_fn)(void *rctx, void *on_complete, void *param) noexcept
    ctypedef void (*mxps_deleter_fn)(void *param) noexcept
    ctypedef int (*mxps_push_async_nd_t)(mxps_async_fn, void *, mxps_deleter_fn, void *,
                                        void **, int, void **, int, void *, int,
                                        const char *, int) nogil


cdef mxps_push_async_nd_t _push_async_nd = NULL
cdef mxps_context_t _cpu_ctx


def bind(uintptr_t push_async_nd_address):
    """Give the module the address of libmxnet's ``MXEnginePushAsyncND``."""
    global _push_async_nd
    _push_async_nd = <mxps_push_async_nd_t> push_async_nd_address
    _cpu_ctx.dev_type = 1   # Context::kCPU
    _cpu_ctx.dev_id = 0


cdef class Completion:
    """Releases the engine operation it was handed to; call exactly once, from any thread."""
    cdef mxps_on_complete_t oc
    cdef readonly bint done

    def __call__(self):
        if self.done:
            raise RuntimeError("engine operation completed twice")
        self.done = True
        with nogil:
            self.oc.callback(self.oc.engine, self.oc.param, NULL)


cdef void _run(void *rctx, void *on_complete, void *param) noexcept with gil:
    cdef Completion c = Completion.__new__(Completion)
    c.oc = (<mxps_on_complete_t *> on_complete)[0]
    c.done = False
    fn = <object> param
    try:
        fn(c)
    except BaseException as exc:  # never let an exception escape into the engine thread
        import sys, traceback
        traceback.print_exc()
        sys.stderr.write("mxps: engine callback failed: %r\n" % (exc,))
        if not c.done:
            c()


cdef void _release(void *param) noexcept with gil:
    Py_DECREF(<object> param)


def push_async(fn, const_handles, mutable_handles, int priority=0, bytes name=b"mxps"):
    """Push ``fn(completion)`` as an asynchronous engine operation.

    ``const_handles`` / ``mutable_handles`` are NDArray handles (``nd.handle.value`` integers);
    the engine orders the operation after every writer of the const arrays and every reader
    and writer of the mutable ones, exactly like one of its own operators.
    """
    if _push_async_nd == NULL:
        raise RuntimeError("mxps._engine.bind() was not called")
    cdef int nc = len(const_handles), nm = len(mutable_handles)
    cdef void **consts = <void **> malloc((nc + 1) * sizeof(void *))
    cdef void **muts = <void **> malloc((nm + 1) * sizeof(void *))
    cdef int i, rc
    cdef const char *cname = name
    try:
        for i in range(nc):
            consts[i] = <void *> <uintptr_t> const_handles[i]
        for i in range(nm):
            muts[i] = <void *> <uintptr_t> mutable_handles[i]
        Py_INCREF(fn)
        rc = _push_async_nd(_run, <void *> fn, _release, <void *> &_cpu_ctx,
                            consts if nc else NULL, nc, muts if nm else NULL, nm,
                            NULL, priority, cname, 0)
    finally:
        free(consts)
        free(muts)
    if rc != 0:
        raise RuntimeError("MXEnginePushAsyncND failed with code %d" % rc)
