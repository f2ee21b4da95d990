"""Inputs refused where they cannot work, and every dtype that can work, working.

The worker refuses before anything is sent: a dtype the wire does not carry, an integer key
with the optimizer on the servers (MXNet's update operators are floating point only), a second
init of a key (it would reset the key's value and rounds on the servers; MXNet's local kvstore
refuses it too).  These run on a kvstore that never joined a job: had a check let the call
through, it would fail on the missing connection instead of raising the error asserted.

Arrays on a GPU are taken (this CPU build of MXNet cannot make them: ``OnGpu`` is a CPU array
that reports gpu(0), so every decision is taken as for a GPU and every copy is MXNet's own):
a push sums them into pinned host memory, a pull fills a pinned buffer MXNet copies onto each.

End to end (tests/jobs/dtype_job.py): 2 workers push and pull keys of all seven dtypes MXNet's
dist kvstore carries through 2 servers (every key cut over both) and get exactly what MXNet's
local kvstore playing the 2 workers in one process gets: the sums (float16 as MXNet adds
halves, integers wrapping), and with SGD on the servers the updated weights of the floating
keys (float16 with a float32 master copy).
"""
import json
import os
import types

import mxnet as mx
import numpy as np
import pytest

import cluster
from mxps.adapter.kvstore import MXPS, _Key, on_host
from mxps.kernels.ndview import numpy_view
from mxps.placement.plan import Plan

JOB = os.path.join(cluster.JOBS_DIR, "dtype_job.py")


class OnGpu(mx.nd.NDArray):
    """A CPU array that reports a GPU context: this MXNet build cannot make GPU arrays."""

    __slots__ = ()

    @property
    def context(self):
        return mx.gpu(0)


def on_gpu(shape=(4,)):
    a = mx.nd.zeros(shape)
    a.__class__ = OnGpu
    return a


def bare_kvstore(keys=(), optimizer=None):
    """An mxps kvstore that never joined a job (no connection, one server's plan)."""
    kv = MXPS.__new__(MXPS)
    kv._cfg = types.SimpleNamespace(failover=False, divert=False)
    kv._keys, kv._str_ids, kv._ids = {}, {}, {}
    kv._optimizer = optimizer
    kv._compression = None
    kv._plan = Plan(1)
    for name, dtype in keys:
        kv._keys[name] = _Key(name, kv._key_id(name), (4,), dtype, kv._plan.slices(0, 4))
    return kv


# --- contexts: arrays off the host are staged through host buffers ---------------------------

class Served:
    """Stands in for the network: ``_launch`` as an engine operation that reads the pushed
    host array and fills the pulled one with ``value`` (what the servers would answer)."""

    def __init__(self, kv, value):
        self.value, self.pushed = value, []
        kv._launch = self.launch

    def launch(self, k, msg, src, dst, priority):
        if src is not None:
            assert src.context.device_type in ("cpu", "cpu_pinned"), src.context
            self.pushed.append((src.context, src.asnumpy().copy()))
        if dst is not None:
            assert dst.context.device_type in ("cpu", "cpu_pinned"), dst.context
            dst[:] = self.value


def staging_kvstore():
    kv = bare_kvstore(keys=[("w", np.float32)])
    kv._round, kv._trace, kv._next_replan = 0, None, None
    return kv


def test_a_push_from_gpus_sums_them_into_pinned_host_memory_by_mxnets_copies():
    kv = staging_kvstore()
    served = Served(kv, 0)
    a, b = on_gpu(), on_gpu()
    a[:] = 1
    b[:] = 2
    kv.push("w", [a, b])
    kv.push("w", a)                                # one device: copied, not read in place
    mx.nd.waitall()
    assert [(c, v.tolist()) for c, v in served.pushed] == [
        (mx.cpu_pinned(0), [3.0] * 4), (mx.cpu_pinned(0), [1.0] * 4)]
    assert kv._keys["w"].pushes == 2


@pytest.mark.parametrize("op", ["pull", "pushpull", "pushpull_in_place"])
def test_a_pull_onto_gpus_fills_a_pinned_buffer_that_mxnet_copies_onto_each(op):
    kv = staging_kvstore()
    Served(kv, 7)
    outs = [on_gpu(), on_gpu()]
    if op == "pull":
        kv.pull("w", out=outs)
    elif op == "pushpull":
        kv.pushpull("w", [on_gpu(), on_gpu()], out=outs)
    else:
        kv.pushpull("w", outs)                     # out=None: the gradients get the values
    mx.nd.waitall()
    assert [o.asnumpy().tolist() for o in outs] == [[7.0] * 4] * 2
    assert kv._keys["w"].pull_buf.context == mx.cpu_pinned(0)


def test_arrays_in_host_memory_are_read_and_written_in_place_without_a_buffer():
    kv = staging_kvstore()
    served = Served(kv, 5)
    out = mx.nd.zeros((4,), ctx=mx.cpu(2))
    kv.pushpull("w", mx.nd.ones((4,)), out=out)
    mx.nd.waitall()
    assert out.asnumpy().tolist() == [5.0] * 4 and served.pushed[0][0] == mx.cpu(0)
    k = kv._keys["w"]
    assert k.reduce_buf is None and k.pull_buf is None


@pytest.mark.parametrize("ctx", [mx.cpu(0), mx.cpu(3), mx.cpu_pinned(0),
                                 mx.Context("cpu_shared", 0)])
def test_every_host_memory_context_is_read_in_place(ctx):
    a = mx.nd.array(np.arange(6, dtype=np.float32), ctx=ctx)
    assert on_host(a) and not on_host(on_gpu())
    a.wait_to_read()
    view = numpy_view(a)
    np.testing.assert_array_equal(view, np.arange(6))
    view[0] = 42                                   # the pull path writes the array in place
    assert a.asnumpy()[0] == 42


# --- dtypes -------------------------------------------------------------------------------

def test_a_dtype_the_wire_does_not_carry_is_refused_at_init_naming_key_and_dtype():
    kv = bare_kvstore()
    with pytest.raises(TypeError) as e:
        kv.init(101, mx.nd.ones((4,), dtype=np.bool_))
    assert str(e.value) == ("mxps: init of key 101: dtype bool cannot be sent by mxps "
                            "(supported: float32, float64, float16, uint8, int32, int8, int64)")
    assert kv._keys == {}


@pytest.mark.parametrize("dtype", ["uint8", "int8", "int32", "int64"])
def test_an_integer_key_with_the_optimizer_on_the_servers_is_refused_at_init(dtype):
    kv = bare_kvstore(optimizer=mx.optimizer.SGD())
    with pytest.raises(ValueError) as e:
        kv.init("steps", mx.nd.zeros((4,), dtype=dtype))
    assert str(e.value) == (
        "mxps: init: key 'steps' has dtype %s, but the optimizer on the servers updates "
        "floating-point keys only (MXNet's update operators refuse integers): keep it off the "
        "kvstore or use update_on_kvstore=False" % dtype)
    assert kv._keys == {}


def test_set_optimizer_with_an_integer_key_held_is_refused_before_anything_is_sent():
    kv = bare_kvstore(keys=[("w", np.float16), ("steps", np.int64)])
    with pytest.raises(ValueError, match="mxps: set_optimizer: key 'steps' has dtype int64"):
        kv.set_optimizer(mx.optimizer.SGD())
    assert kv._optimizer is None


# --- a second init ------------------------------------------------------------------------------

SECOND_INIT = ("mxps: init of key %r: the key is already initialised; a key is initialised once "
               "(as in MXNet's kvstores: a second init would reset its value and rounds on the "
               "servers): push to change its value, or init a new key")


def test_a_second_init_of_a_key_is_refused_naming_the_key_and_what_to_do():
    kv = bare_kvstore(keys=[("w", np.float32)])
    before = kv._keys["w"]
    with pytest.raises(ValueError) as e:
        kv.init("w", mx.nd.ones((4,)))
    assert str(e.value) == SECOND_INIT % "w"
    assert kv._keys["w"] is before


def test_a_key_twice_in_one_init_is_refused_and_no_key_of_the_call_is_registered():
    kv = bare_kvstore()
    with pytest.raises(ValueError) as e:
        kv.init([3, 4, 3], [mx.nd.ones((2,))] * 3)
    assert str(e.value) == SECOND_INIT % 3
    assert kv._keys == {}


def test_mxnets_local_kvstore_also_refuses_a_second_init():
    # the behaviour mxps follows (for dist_sync MXNet would silently treat it as a push)
    kv = mx.kv.create("local")
    kv.init(3, mx.nd.ones((2,)))
    with pytest.raises(mx.base.MXNetError, match="duplicate init of key 3"):
        kv.init(3, mx.nd.ones((2,)))


# --- every dtype, end to end with 2 workers --------------------------------------------------

def _reference(tmp_path, mode, workers=2):
    out = tmp_path / ("local-" + mode)
    cluster.run_single([JOB], env={"DTYPE_KVSTORE": "local", "DTYPE_WORKERS": workers,
                                   "DTYPE_MODE": mode, "DTYPE_OUT": str(out)})
    with np.load(out / "pulled_rank0.npz") as z:
        return {k: z[k] for k in z.files}


def _mxps(tmp_path, mode, servers):
    out = tmp_path / ("mxps-%s-%d" % (mode, servers))
    cluster.run_job([JOB], num_workers=2, num_servers=servers, timeout=150, env={
        "DTYPE_KVSTORE": "mxps", "DTYPE_MODE": mode, "DTYPE_OUT": str(out),
        "MXNET_KVSTORE_BIGARRAY_BOUND": 16}).raise_for_failure()
    pulled = []
    for r in (0, 1):
        with np.load(out / ("pulled_rank%d.npz" % r)) as z:
            pulled.append({k: z[k] for k in z.files})
    refusals = [json.loads((out / ("refusals_rank%d.json" % r)).read_text()) for r in (0, 1)]
    return pulled, refusals


def _assert_bit_equal(got, want, what):
    assert sorted(got) == sorted(want), what
    for name in want:
        assert got[name].dtype == want[name].dtype, (what, name)
        bad = got[name].tobytes() != want[name].tobytes()
        assert not bad, "%s: %s differs from MXNet's local kvstore (max abs diff %s)" % (
            what, name, np.max(np.abs(got[name].astype(np.float64) -
                                      want[name].astype(np.float64))))


def test_every_dtype_sums_over_2_workers_and_2_servers_as_mxnets_local_kvstore(tmp_path):
    want = _reference(tmp_path, "sum")
    assert {k.split("_")[0] for k in want} == {"float32", "float64", "float16", "uint8",
                                               "int32", "int8", "int64"}
    pulled, refusals = _mxps(tmp_path, "sum", servers=2)
    for r, got in enumerate(pulled):
        _assert_bit_equal(got, want, "worker %d" % r)
    for rep in refusals:
        assert rep["second_init"] == {"type": "ValueError", "message": SECOND_INIT % 0}


def test_float_dtypes_with_sgd_on_the_servers_match_mxnets_local_updates(tmp_path):
    want = _reference(tmp_path, "sgd")
    pulled, refusals = _mxps(tmp_path, "sgd", servers=2)
    for r, got in enumerate(pulled):
        _assert_bit_equal(got, want, "worker %d" % r)
    # the weights moved, float16 included (a float32 master copy on the servers)
    assert not np.array_equal(want["float16_round1"], want["float16_round4"])
    for rep in refusals:
        assert rep["int_key"]["type"] == "ValueError"
        assert rep["int_key"]["message"].startswith(
            "mxps: init: key 50 has dtype int32, but the optimizer on the servers updates "
            "floating-point keys only")



def test_with_failover_a_push_with_the_update_on_the_workers_is_refused_before_it_is_sent():
    # MXPS_FAILOVER rebuilds a lost slice from the weights the workers pulled; with the update
    # on the workers the servers hold round sums the workers overwrite
    kv = staging_kvstore()
    kv._cfg = types.SimpleNamespace(failover=True, divert=False)
    served = Served(kv, 0.0)
    with pytest.raises(ValueError, match="push of key 'w': MXPS_FAILOVER=1 needs the "
                                         "optimizer on the servers"):
        kv.push("w", mx.nd.ones((4,)))
    assert not served.pushed and kv._keys["w"].pushes == 0
    kv._optimizer = mx.optimizer.SGD()
    kv.push("w", mx.nd.ones((4,)))
    mx.nd.waitall()
    assert len(served.pushed) == 1


# --- arrays oneDNN left in its own layout ----------------------------------------------------

def test_operations_on_weights_in_a_onednn_layout_complete_with_their_values(tmp_path):
    # an inference-mode forward of a convolution leaves its weight in a oneDNN layout; mxps's
    # engine operations on such an array once waited for ever for MXNet's conversion of it
    # (tests/jobs/onednn_job.py): a Trainer's first step queued before its training forward
    # ran (the noise study's flaky hang, made certain), a pull into such a weight, a push of
    # one, a pushpull between two
    res = cluster.run_job([os.path.join(cluster.JOBS_DIR, "onednn_job.py"), str(tmp_path)],
                          1, 1, timeout=120)
    res.raise_for_failure()
    with open(os.path.join(str(tmp_path), "onednn.json")) as f:
        got = json.load(f)
    if mx.runtime.Features().is_enabled("MKLDNN"):
        assert got["onednn_layouts"] == [True] * 5, got     # the case is really there
    assert [got[c] for c in ("trainer", "pull", "push", "pushpull")] == [True] * 4, got
    assert got["layouts_after"] == [False] * 5, got
