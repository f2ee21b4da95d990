"""No peer's bytes run code in a server: data travels as typed payloads.

A crafted pickle whose ``__reduce__`` creates a file is sent as the payload of every message
type to an in-process ``ServerState``, from worker 1 and from worker 0 (and as a MIGRATE part
from a peer server, and as a GET_STATES reply to a worker): the file never appears, every
request that reads its payload is refused with an ERROR reply, and the server goes on serving
correct rounds.  MXNet's optimizer object is the one pickle left: only worker 0's is read (a
SET_OPTIMIZER from worker 1 is refused without touching its bytes), by an unpickler that
resolves optimizer and scheduler classes only, and nothing is installed unless it is an
``mxnet.optimizer.Optimizer``.  ``header.sender`` is the authenticated rank (the server loop
sets it from the connection), so these tests set it as the loop would.
"""
import io
import pickle
import sys
import types

import mxnet as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from mxps.adapter.kvstore import MXPS, read_states_reply
from mxps.roles.optimizer_states import _OptimizerUnpickler
from mxps.roles.server_state import Out, ServerState
from mxps.wire import typed
from mxps.wire.frame import NO_DTYPE, Header, MsgType, dtype_code

F32 = dtype_code("float32")
VALUE = [10.0, 20.0, 30.0]


class Plant:
    """Unpickling this creates the file ``path`` (what an attacker's code would do)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def crafted(path):
    """Pickles that create ``path`` when loaded: bare, inside what a states blob looked like,
    and inside a real optimizer's attributes."""
    opt = mx.optimizer.SGD(learning_rate=0.1)
    opt.lr_scheduler = Plant(path)
    return [pickle.dumps(Plant(path)),
            pickle.dumps({"states": {(4, 0): Plant(path)}, "optimizer": Plant(path)}),
            pickle.dumps(opt)]


def server(with_optimizer=True):
    s = ServerState(0, 2, sync=True)
    if with_optimizer:
        ack(s.on_request(b"worker:0", Header(MsgType.SET_OPTIMIZER, sender=0),
                         pickle.dumps(mx.optimizer.SGD(learning_rate=1.0, momentum=0.5))))
    ack(s.on_request(b"worker:0", Header(MsgType.INIT, key=4, sender=0, length=3, dtype=F32),
                     np.array(VALUE, np.float32)))
    return s


def ack(outs):
    assert [o.header.type for o in outs] == [MsgType.ACK], outs
    return outs[0]


def replies(outs, client):
    assert all(o.to == Out.CLIENT and o.dest == client for o in outs), outs
    return [(o.header.type, o.payload) for o in outs]


def a_round_still_works(s, grads=([1, 2, 3], [3, 2, 1]), it=1):
    for w, g in enumerate(grads):
        ack(s.on_request(b"worker:%d" % w, Header(MsgType.PUSH, key=4, sender=w, iteration=it,
                                                  length=3, dtype=F32), np.array(g, np.float32)))
    (out,) = s.on_request(b"worker:0", Header(MsgType.PULL, key=4, sender=0, iteration=it,
                                              length=3), None)
    return np.frombuffer(out.payload, np.float32)


# --- a crafted pickle as the payload of every message type ------------------------------------

@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("dtype", [NO_DTYPE, F32])
def test_a_crafted_pickle_sent_as_every_message_type_never_runs(tmp_path, rank, dtype):
    planted = tmp_path / "planted"
    s = server()
    client = b"worker:%d" % rank
    for payload in crafted(planted):
        for type_ in MsgType:
            h = Header(type_, key=4, sender=rank, iteration=0, length=3, dtype=dtype,
                       request_id=7)
            got = replies(s.on_request(client, h, payload), client)
            assert not planted.exists(), "%s from worker %d ran the pickle" % (type_.name, rank)
            if type_ == MsgType.PROBE:          # echoed as bytes, never decoded
                assert got == [(MsgType.DATA, payload)]
            elif type_ == MsgType.PULL:         # requests without a payload to read
                assert [t for t, _ in got] == [MsgType.DATA]
                np.testing.assert_array_equal(np.frombuffer(got[0][1], np.float32), VALUE)
            elif type_ == MsgType.GET_STATES:
                assert [t for t, _ in got] == [MsgType.DATA]
                assert typed.unpack(got[0][1])["num_update"] == 0
            else:
                assert [t for t, _ in got] == [MsgType.ERROR], (type_.name, got)
    # nothing changed: the key, its round and the optimizer are as before
    assert s.slots[(4, 0)].applied == 0 and not s.slots[(4, 0)].rounds
    assert isinstance(s.optimizer, mx.optimizer.SGD) and s.optimizer.momentum == 0.5
    np.testing.assert_array_equal(a_round_still_works(s), np.array(VALUE) - 4)


def test_the_refusals_name_what_was_refused(tmp_path):
    s = server()
    bare = crafted(tmp_path / "planted")[0]

    def error(type_, rank, **kw):
        h = Header(type_, key=4, sender=rank, **kw)
        ((t, text),) = replies(s.on_request(b"w", h, bare), b"w")
        assert t == MsgType.ERROR
        return text.decode()

    assert error(MsgType.SET_OPTIMIZER, 1) == \
        "SET_OPTIMIZER from worker 1 refused unread: only worker 0 sets the optimizer"
    assert error(MsgType.SET_STATES, 1) == \
        "SET_STATES from worker 1 refused unread: only worker 0 loads optimizer states"
    assert error(MsgType.SET_OPTIMIZER, 0).startswith(
        "SET_OPTIMIZER from worker 0: the optimizer cannot be read (UnpicklingError: "
        "io.open is not an optimizer or learning-rate scheduler class")
    assert "not a typed payload" in error(MsgType.SET_STATES, 0)
    assert "not a typed payload" in error(MsgType.MIGRATE, 1, length=3)
    assert error(MsgType.INIT, 1, length=3, dtype=F32) == \
        "INIT of key 4 from worker 1 refused: worker 0 initialises the keys"
    assert not (tmp_path / "planted").exists()


def test_a_crafted_migrate_part_from_a_peer_never_runs_during_or_before_a_plan(tmp_path):
    planted = tmp_path / "planted"
    s = server()
    s.on_scheduler(Header(MsgType.PLAN), b'{"version": 1, "old": {}, "new": {}}')
    for version in (1, 2):                     # the plan in progress; a plan still to come
        for payload in crafted(planted):
            h = Header(MsgType.MIGRATE, key=4, sender=1, plan_version=version, length=3)
            ((t, text),) = replies(s.on_request(b"server:1", h, payload), b"server:1")
            assert t == MsgType.ERROR and b"not a typed payload" in text, text
    assert not planted.exists() and s.early_parts == []


def test_a_set_optimizer_from_worker_1_is_refused_without_reading_its_bytes():
    s = ServerState(0, 2, sync=True)

    class Watched:
        touched = []

        @property
        def bytes(self):
            self.touched.append("bytes")
            return pickle.dumps(mx.optimizer.SGD())

        @property
        def buffer(self):
            self.touched.append("buffer")
            return memoryview(self.bytes)

    outs = s.on_request(b"worker:1", Header(MsgType.SET_OPTIMIZER, sender=1), Watched())
    assert [o.header.type for o in outs] == [MsgType.ERROR]
    assert Watched.touched == [] and s.updater is None and s.optimizer is None


@pytest.mark.parametrize("thing,name", [
    ({"learning_rate": 1.0}, "dict"),
    (mx.lr_scheduler.FactorScheduler(step=10), "FactorScheduler"),
    (None, "NoneType"),
])
def test_a_pickle_from_worker_0_that_is_not_an_optimizer_installs_nothing(thing, name):
    s = server()
    before = (s.optimizer, s.updater)
    outs = s.on_request(b"worker:0", Header(MsgType.SET_OPTIMIZER, sender=0),
                        pickle.dumps(thing))
    ((t, text),) = replies(outs, b"worker:0")
    assert t == MsgType.ERROR
    assert text.decode() == ("SET_OPTIMIZER from worker 0 carries a %s, not an "
                             "mxnet.optimizer.Optimizer; nothing installed" % name)
    assert (s.optimizer, s.updater) == before
    np.testing.assert_array_equal(a_round_still_works(s), np.array(VALUE) - 4)


def test_a_broken_optimizer_object_from_worker_0_installs_nothing():
    s = server(with_optimizer=False)
    hollow = mx.optimizer.SGD.__new__(mx.optimizer.SGD)       # none of its attributes
    hollow.param_dict = {}
    outs = s.on_request(b"worker:0", Header(MsgType.SET_OPTIMIZER, sender=0),
                        pickle.dumps(hollow))
    ((t, text),) = replies(outs, b"worker:0")
    assert t == MsgType.ERROR and text.startswith(b"SET_OPTIMIZER from worker 0: the SGD is "
                                                  b"not usable")
    assert s.optimizer is None and s.updater is None


# --- the optimizer unpickler reads every real optimizer ------------------------------------------

def _read(data):
    return _OptimizerUnpickler(io.BytesIO(data)).load()


@pytest.mark.parametrize("name", sorted(mx.optimizer.Optimizer.opt_registry))
def test_every_mxnet_optimizer_as_the_kvstore_sends_it_is_read_from_worker_0(name):
    schedulers = [mx.lr_scheduler.FactorScheduler(step=5, factor=0.5),
                  mx.lr_scheduler.MultiFactorScheduler(step=[3, 6], factor=0.1),
                  mx.lr_scheduler.CosineScheduler(max_update=100, base_lr=0.1)]
    for sched in schedulers:
        opt = mx.optimizer.create(name, lr_scheduler=sched, rescale_grad=np.float32(0.25),
                                  param_idx2name={0: "w", 1: "b"})
        opt.lr_mult = {0: 0.5}
        got = _read(pickle.dumps(MXPS._server_copy(opt)))
        assert type(got) is type(opt) and type(got.lr_scheduler) is type(sched)
        assert got.lr_mult == {0: 0.5} and got.idx2name == {0: "w", 1: "b"}
        assert got.rescale_grad == np.float32(0.25)
        s = ServerState(0, 1, sync=True)
        ack(s.on_request(b"worker:0", Header(MsgType.SET_OPTIMIZER, sender=0),
                         pickle.dumps(opt)))
        assert type(s.optimizer) is type(opt)


class Custom(mx.optimizer.SGD):
    """A user's optimizer: its module is imported in the server process."""


def test_a_custom_optimizer_is_read_when_its_module_is_loaded_and_refused_by_name_if_not():
    assert isinstance(_read(pickle.dumps(Custom(learning_rate=0.3))), Custom)
    mod = types.ModuleType("mxps_test_not_imported_here")
    mod.Later = type("Later", (mx.optimizer.SGD,), {"__module__": mod.__name__})
    sys.modules[mod.__name__] = mod
    try:
        data = pickle.dumps(mod.Later())
    finally:
        del sys.modules[mod.__name__]
    with pytest.raises(pickle.UnpicklingError, match="mxps_test_not_imported_here.Later is not "
                       "an optimizer .* must be imported before mxps"):
        _read(data)


@pytest.mark.parametrize("module,name", [("os", "system"), ("builtins", "eval"),
                                         ("subprocess", "Popen"), ("builtins", "open"),
                                         ("mxnet.ndarray", "load"), ("numpy", "load")])
def test_the_optimizer_unpickler_refuses_every_other_global(module, name):
    data = b"\x80\x04c%s\n%s\n." % (module.encode(), name.encode())     # GLOBAL, STOP
    with pytest.raises(pickle.UnpicklingError, match="%s.%s is not an optimizer" % (module, name)):
        _read(data)


# --- the worker reads servers' states as data -----------------------------------------------------

def test_a_crafted_pickle_as_a_get_states_reply_never_runs_in_the_worker(tmp_path):
    planted = tmp_path / "planted"
    for payload in crafted(planted):
        with pytest.raises(RuntimeError, match="server 3's optimizer states cannot be read: "
                           "not a typed payload"):
            read_states_reply(3, payload, {4: None})
    assert not planted.exists()


@pytest.mark.parametrize("reply,problem", [
    ({"states": [], "counts": {}}, "not {states, counts, num_update}"),
    ({"states": [[9, 0, 3, None]], "counts": {}, "num_update": 0}, "key held by this worker"),
    ({"states": [[4, 0, 3, np.zeros(2, np.float32)]], "counts": {}, "num_update": 0},
     "state of key 4 at 0 is not arrays of its 3 elements"),
    ({"states": [[4, 0, 3, np.zeros(3, np.int32)]], "counts": {}, "num_update": 0},
     "state of key 4 at 0"),
    ({"states": [], "counts": {4: "5"}, "num_update": 0}, "update counts are not integers"),
    ({"states": [[[4], 0, 3, None]], "counts": {}, "num_update": 0}, "key held by this worker"),
    ({"states": [], "counts": {}, "num_update": 0, 1: 2}, "not {states, counts, num_update}"),
])
def test_a_states_reply_that_does_not_fit_the_keys_is_refused_naming_the_server(reply,
                                                                                 problem):
    with pytest.raises(RuntimeError, match="server 1's optimizer states: .*" + problem):
        read_states_reply(1, typed.pack(reply), {4: None})



# --- any typed payload is refused by a rule, never by accident ------------------------------------

_leaf = st.one_of(st.none(), st.integers(-3, 2 ** 33), st.floats(allow_nan=False),
                  st.text(max_size=3),
                  st.sampled_from(["float32", "float16", "int32"]).flatmap(
                      lambda dt: hnp.arrays(dt, st.integers(0, 9))))
_any = st.recursive(_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.lists(inner, max_size=3).map(tuple),
    st.dictionaries(st.one_of(st.integers(0, 9), st.tuples(st.integers(0, 5),
                                                           st.integers(0, 8))),
                    inner, max_size=3)), max_leaves=8)
_part = st.fixed_dictionaries({}, optional={
    f: _any for f in ("key", "target", "offset", "length", "dtype", "value", "applied",
                      "state", "count", "other")})
_states = st.fixed_dictionaries({}, optional={"states": _any, "counts": _any,
                                              "num_update": _any, "optimizer": _any})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(part=_part, states=_states, version=st.integers(0, 2))
def test_any_typed_migrate_or_set_states_is_refused_by_a_rule_or_accepted(part, states,
                                                                          version):
    s = server()
    s.on_scheduler(Header(MsgType.PLAN), b'{"version": 1, "old": {}, "new": {}}')
    before = s.slots[(4, 0)].store.snapshot.copy()
    for h, body in ((Header(MsgType.MIGRATE, key=4, sender=1, plan_version=version, length=3),
                     part), (Header(MsgType.SET_STATES, sender=0), states)):
        outs = s.on_request(b"peer", h, typed.pack(body))
        for o in outs:
            if o.to == Out.SCHEDULER:             # a part accepted, then failing its plan
                continue
            assert o.header.type in (MsgType.ACK, MsgType.ERROR), o
            if o.header.type == MsgType.ERROR:    # a rule's refusal, not a caught crash
                assert not o.payload.startswith(b"server 0 failed on"), o.payload
    np.testing.assert_array_equal(s.slots[(4, 0)].store.snapshot, before)
