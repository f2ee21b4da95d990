"""The server's protocol (mxps/roles/server_state.py) in one process, message by message.

No sockets: each test hands ``ServerState`` one message at a time and looks at the messages it
returns, so every rule (rounds, early pushes, waiting pulls, refusals, async, moving slices in
a re-plan) is checked on its own, and a hypothesis state machine drives one server (and two,
with re-plans) through any interleaving real workers can produce against a reference model.
The multi-process tests (test_equivalence, test_replan, test_failures) check the same server
behind its sockets.
"""
import itertools
import json
import os
import pickle
import shutil
import tempfile

import mxnet as mx
import numpy as np
import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, invariant, precondition, rule)

from mxps.placement.plan import Slice, table_to_json
from mxps.roles.server_state import Out, ServerState, StoreSettings, optimizer_index
from mxps.wire import typed
from mxps.wire.frame import NO_DTYPE, Header, MsgType, dtype_code

F32 = dtype_code(np.float32)
_ids = itertools.count(1)


def worker(w):
    return b"w%d" % w


def request(type_, key, w=0, it=0, offset=0, length=None, value=None, version=0):
    """A worker's request header and payload (a float32 array or None)."""
    if value is not None:
        value = np.asarray(value, dtype=np.float32)
        length = value.size if length is None else length
    h = Header(type_, key=key, sender=w, iteration=it, plan_version=version, offset=offset,
               length=length or 0, request_id=next(_ids),
               dtype=F32 if value is not None else NO_DTYPE)
    return h, value


def send(state, type_, key, w=0, **kw):
    """Hand ``state`` one request from worker ``w``; the Outs it returns."""
    h, payload = request(type_, key, w=w, **kw)
    return state.on_request(worker(w), h, payload)


def only(outs, type_=None):
    """The one Out of ``outs`` (of ``type_``, when given)."""
    if type_ is not None:
        outs = [o for o in outs if o.header.type == type_]
    assert len(outs) == 1, outs
    return outs[0]


def error_text(outs):
    out = only(outs, MsgType.ERROR)
    assert out.to == Out.CLIENT
    return out.payload.decode()


def value_of(out):
    assert out.to == Out.CLIENT and out.header.type == MsgType.DATA, out
    return np.array(out.payload, dtype=np.float32)


def sgd(momentum=0.0):
    return pickle.dumps(mx.optimizer.SGD(learning_rate=1.0, momentum=momentum))


def new_server(workers=2, rank=0, sync=True, optimizer=None, keys=None, store=None, **kw):
    """A server with ``keys`` ({key: initial value}, whole keys) and an optimizer, if any
    (``store``: StoreSettings, the disk store; ``kw``: more of ServerState's arguments)."""
    s = ServerState(rank, workers, sync, store=store, **kw)
    if optimizer is not None:
        only(s.on_request(worker(0), Header(MsgType.SET_OPTIMIZER, sender=0), optimizer),
             MsgType.ACK)
    for key, value in (keys or {}).items():
        only(send(s, MsgType.INIT, key, value=value), MsgType.ACK)
    return s


def counts(state):
    return state.updater.optimizer._index_update_count


def test_a_large_init_is_stored_in_blocks_calling_progress_between_them():
    """Copying a slice of GBs into the stored value takes seconds: the server's ``progress``
    (its heartbeat) is called between blocks, not once after the whole copy."""
    from mxps.store.memory import MemorySlice
    calls = []
    s = ServerState(0, 1, True, progress=lambda: calls.append(1))
    value = np.arange(3 * MemorySlice.COPY_BLOCK + 5, dtype=np.float32)
    only(send(s, MsgType.INIT, 9, value=value), MsgType.ACK)
    assert len(calls) >= 4
    got = value_of(only(send(s, MsgType.PULL, 9, w=0, it=0, length=value.size)))
    np.testing.assert_array_equal(got, value)


# --- rounds ----------------------------------------------------------------------------------

def test_a_round_is_the_sum_of_all_workers_pushes_then_one_optimizer_update():
    s = new_server(workers=3, optimizer=sgd(), keys={4: [10, 20, 30]})
    grads = [[1, 2, 3], [4, 5, 6], [-1, 0, 2]]
    for w, g in enumerate(grads):
        only(send(s, MsgType.PUSH, 4, w=w, it=1, value=g), MsgType.ACK)
        assert counts(s).get(4, 0) == (1 if w == 2 else 0)      # no update before the last
    got = value_of(only(send(s, MsgType.PULL, 4, w=0, it=1, length=3)))
    np.testing.assert_array_equal(got, [10 - 4, 20 - 7, 30 - 11])
    assert counts(s)[4] == 1


def test_a_pull_of_an_incomplete_round_waits_and_is_answered_when_it_completes():
    s = new_server(workers=2, keys={4: [0, 0]})
    only(send(s, MsgType.PUSH, 4, w=0, it=1, value=[1, 2]), MsgType.ACK)
    assert send(s, MsgType.PULL, 4, w=0, it=1, length=2) == []           # waits
    outs = send(s, MsgType.PUSH, 4, w=1, it=1, value=[3, 4])
    assert only(outs, MsgType.ACK).dest == worker(1)
    data = only(outs, MsgType.DATA)
    assert data.dest == worker(0) and data.header.iteration == 1
    np.testing.assert_array_equal(value_of(data), [4, 6])


def test_a_pushpull_is_answered_with_its_own_round_once_complete():
    s = new_server(workers=2, keys={4: [0, 0]})
    assert send(s, MsgType.PUSHPULL, 4, w=0, it=1, value=[1, 1]) == []
    outs = send(s, MsgType.PUSHPULL, 4, w=1, it=1, value=[2, 5])
    assert sorted(o.dest for o in outs) == [worker(0), worker(1)]
    for o in outs:
        np.testing.assert_array_equal(value_of(o), [3, 6])


def test_an_early_push_of_the_next_round_is_kept_apart_from_the_current_one():
    s = new_server(workers=2, keys={4: [0, 0]})
    send(s, MsgType.PUSH, 4, w=0, it=1, value=[1, 1])
    send(s, MsgType.PUSH, 4, w=0, it=2, value=[100, 100])                # worker 0 runs ahead
    send(s, MsgType.PUSH, 4, w=1, it=1, value=[2, 3])
    np.testing.assert_array_equal(value_of(only(send(s, MsgType.PULL, 4, w=1, it=1, length=2))),
                                  [3, 4])
    assert send(s, MsgType.PULL, 4, w=0, it=2, length=2) == []           # round 2 is not done
    outs = send(s, MsgType.PUSH, 4, w=1, it=2, value=[5, 7])
    np.testing.assert_array_equal(value_of(only(outs, MsgType.DATA)), [105, 107])


def test_update_on_workers_stores_each_rounds_sum_not_a_running_total():
    s = new_server(workers=2, keys={4: [9, 9]})
    for it, (a, b) in enumerate([([1, 2], [3, 4]), ([0, 1], [1, 0])], start=1):
        send(s, MsgType.PUSH, 4, w=0, it=it, value=a)
        send(s, MsgType.PUSH, 4, w=1, it=it, value=b)
        got = value_of(only(send(s, MsgType.PULL, 4, w=0, it=it, length=2)))
        np.testing.assert_array_equal(got, np.add(a, b))
    assert s.updater is None


def test_a_second_push_of_the_same_round_is_refused_naming_key_worker_and_round():
    s = new_server(workers=2, keys={4: [0, 0]})
    send(s, MsgType.PUSH, 4, w=0, it=1, value=[1, 1])
    msg = error_text(send(s, MsgType.PUSH, 4, w=0, it=1, value=[50, 50]))
    assert msg == "key 4: worker 0 pushed round 1 twice"
    send(s, MsgType.PUSH, 4, w=1, it=1, value=[2, 2])
    np.testing.assert_array_equal(value_of(only(send(s, MsgType.PULL, 4, it=1, length=2))),
                                  [3, 3])                 # the refused push was not added


def test_a_push_to_a_completed_round_is_refused_and_changes_nothing():
    s = new_server(workers=2, keys={4: [0, 0]})
    send(s, MsgType.PUSH, 4, w=0, it=1, value=[1, 1])
    send(s, MsgType.PUSH, 4, w=1, it=1, value=[2, 2])
    msg = error_text(send(s, MsgType.PUSH, 4, w=1, it=1, value=[7, 7]))
    assert msg == "key 4: worker 1 pushed round 1, but round 1 is already complete"
    np.testing.assert_array_equal(value_of(only(send(s, MsgType.PULL, 4, it=1, length=2))),
                                  [3, 3])


def test_async_applies_every_push_on_arrival_and_pulls_see_it_at_once():
    s = new_server(workers=2, sync=False, optimizer=sgd(), keys={4: [10, 10]})
    only(send(s, MsgType.PUSH, 4, w=0, it=1, value=[1, 2]), MsgType.ACK)
    np.testing.assert_array_equal(value_of(only(send(s, MsgType.PULL, 4, w=1, length=2))),
                                  [9, 8])
    only(send(s, MsgType.PUSH, 4, w=0, it=2, value=[1, 1]), MsgType.ACK)  # no waiting for w1
    only(send(s, MsgType.PUSH, 4, w=1, it=1, value=[3, 0]), MsgType.ACK)
    np.testing.assert_array_equal(value_of(only(send(s, MsgType.PULL, 4, w=1, length=2))),
                                  [5, 7])
    assert counts(s)[4] == 3


def test_async_without_an_optimizer_on_the_servers_is_refused_naming_the_key():
    s = new_server(workers=2, sync=False, keys={4: [0]})
    msg = error_text(send(s, MsgType.PUSH, 4, value=[1], it=1))
    assert msg.startswith("key 4: dist_async needs the optimizer on the servers")


def test_a_request_of_another_plan_version_is_refused_naming_both_versions():
    s = new_server(keys={4: [0, 0]})
    msg = error_text(send(s, MsgType.PULL, 4, length=2, version=3))
    assert msg == "key 4: request of plan version 3, but server 0 is at plan 0"


def test_an_unknown_key_is_refused_and_the_server_keeps_serving():
    s = new_server(workers=1, keys={4: [5, 6]})
    msg = error_text(send(s, MsgType.PUSH, 99, it=1, value=[1]))
    assert msg.startswith("key 99 is not initialised on server 0")
    np.testing.assert_array_equal(value_of(only(send(s, MsgType.PULL, 4, length=2))), [5, 6])


def test_a_slice_the_server_does_not_hold_is_refused_naming_the_key_and_both_ranges():
    s = new_server(keys={7: [0, 0, 0, 0]})
    msg = error_text(send(s, MsgType.PUSH, 7, it=1, value=[1] * 6))
    assert msg.startswith("key 7: request for elements [0, 6) but server 0 holds [0, 4)")
    msg = error_text(send(s, MsgType.PULL, 7, offset=2, length=2))
    assert msg.startswith("key 7: request for elements [2, 4) but server 0 holds [0, 4)")


def test_a_push_of_another_dtype_is_refused_naming_both_dtypes():
    s = new_server(keys={4: [0, 0]})
    h, _ = request(MsgType.PUSH, 4, it=1, length=2)
    h.dtype = dtype_code(np.float64)
    msg = error_text(s.on_request(worker(0), h, np.zeros(2)))
    assert msg == "key 4: pushed dtype float64 differs from the initialised dtype float32"


def test_a_failing_optimizer_is_reported_to_the_worker_and_the_server_keeps_serving():
    s = new_server(workers=1, optimizer=sgd(), keys={4: [1, 1]})
    s.updater = lambda index, grad, weight: 1 / 0
    msg = error_text(send(s, MsgType.PUSH, 4, it=1, value=[1, 1]))
    assert msg == "server 0 failed on PUSH: ZeroDivisionError: division by zero"
    only(send(s, MsgType.PROBE, 0), MsgType.DATA)


# --- keys are initialised once, by worker 0 ------------------------------------------------------

def test_a_second_init_of_a_key_is_refused_and_keeps_its_value_and_rounds():
    s = new_server(workers=1, keys={4: [1, 2]})
    send(s, MsgType.PUSH, 4, it=1, value=[5, 5])
    msg = error_text(send(s, MsgType.INIT, 4, value=[0, 0]))
    assert msg == ("key 4 is already initialised on server 0 (elements [0, 2)): a key is "
                   "initialised once, and a second init would reset its value and rounds; "
                   "push to change it, or init a new key")
    assert s.slots[(4, 0)].applied == 1
    np.testing.assert_array_equal(value_of(only(send(s, MsgType.PULL, 4, it=1, length=2))),
                                  [5, 5])


def test_an_init_overlapping_a_held_slice_is_refused_but_further_chunks_of_a_key_are_not():
    s = new_server(workers=1)
    only(send(s, MsgType.INIT, 4, offset=0, value=[1, 2, 3]), MsgType.ACK)
    only(send(s, MsgType.INIT, 4, offset=3, value=[4, 5]), MsgType.ACK)     # the next chunk
    msg = error_text(send(s, MsgType.INIT, 4, offset=2, value=[9, 9]))
    assert msg.startswith("key 4 is already initialised on server 0 (elements [0, 3))")
    assert sorted(s.slots) == [(4, 0), (4, 3)]


def test_an_init_from_another_worker_than_0_is_refused():
    s = new_server()
    assert error_text(send(s, MsgType.INIT, 4, w=1, value=[1])) == \
        "INIT of key 4 from worker 1 refused: worker 0 initialises the keys"
    assert s.slots == {}


def test_with_the_optimizer_on_the_server_integer_keys_are_refused_naming_key_and_dtype():
    s = new_server(optimizer=sgd())
    h = Header(MsgType.INIT, key=6, sender=0, length=2, dtype=dtype_code(np.int32))
    assert error_text(s.on_request(worker(0), h, np.zeros(2, np.int32))) == \
        "key 6 has dtype int32: the optimizer on the servers updates floating-point keys only"
    t = new_server()
    h = Header(MsgType.INIT, key=6, sender=0, length=2, dtype=dtype_code(np.uint8))
    only(t.on_request(worker(0), h, np.zeros(2, np.uint8)), MsgType.ACK)
    msg = error_text(t.on_request(worker(0), Header(MsgType.SET_OPTIMIZER, sender=0), sgd()))
    assert msg == "key 6 has dtype uint8: the optimizer on the servers updates floating-point " \
        "keys only"
    assert t.updater is None and t.optimizer is None


# --- every dtype MXNet's kvstore carries --------------------------------------------------------

def typed_round(s, key, grads, dtype, it=1):
    """Each worker pushes its gradient of ``dtype`` for round ``it``; the pulled value."""
    code = dtype_code(dtype)
    n = len(grads[0])
    for w, g in enumerate(grads):
        h = Header(MsgType.PUSH, key=key, sender=w, iteration=it, length=n, dtype=code)
        only(s.on_request(worker(w), h, np.asarray(g, dtype)), MsgType.ACK)
    out = only(s.on_request(worker(0), Header(MsgType.PULL, key=key, sender=0, iteration=it,
                                              length=n), None))
    return np.frombuffer(out.payload, dtype)


def typed_server(dtype, value, workers=2, optimizer=None):
    s = ServerState(0, workers, sync=True)
    if optimizer is not None:
        only(s.on_request(worker(0), Header(MsgType.SET_OPTIMIZER, sender=0),
                          pickle.dumps(optimizer)), MsgType.ACK)
    h = Header(MsgType.INIT, key=3, sender=0, length=len(value), dtype=dtype_code(dtype))
    only(s.on_request(worker(0), h, np.asarray(value, dtype)), MsgType.ACK)
    return s


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "uint8", "int32", "int8",
                                   "int64"])
def test_a_round_sums_every_wire_dtype_as_mxnet_does_wrapping_integers(dtype):
    rng = np.random.default_rng(7)
    if np.dtype(dtype).kind == "f":
        grads = [rng.standard_normal(64).astype(dtype) * 100 for _ in range(2)]
    else:
        info = np.iinfo(dtype)
        grads = [rng.integers(info.min, info.max, 64, dtype=dtype, endpoint=True)
                 for _ in range(2)]
    s = typed_server(dtype, np.zeros(64, dtype))
    got = typed_round(s, 3, grads, dtype)
    # MXNet's own sum of the two pushes (its local kvstore: the reduce a dist server does)
    kv = mx.kv.create("local")
    kv.init(3, mx.nd.zeros((64,), dtype=dtype))
    kv.push(3, [mx.nd.array(g, dtype=dtype) for g in grads])
    want = mx.nd.zeros((64,), dtype=dtype)
    kv.pull(3, out=want)
    assert got.dtype == np.dtype(dtype)
    assert got.tobytes() == want.asnumpy().tobytes()


def test_float16_halves_are_summed_bit_for_bit_as_mxnet_adds_them():
    # every rounding case: random bit patterns (finite), and pairs one ulp apart (ties)
    rng = np.random.default_rng(3)
    a = rng.integers(0, 1 << 16, 4096, dtype=np.uint16).view(np.float16)
    b = rng.integers(0, 1 << 16, 4096, dtype=np.uint16).view(np.float16)
    ok = np.isfinite(a) & np.isfinite(b)
    a, b = a[ok], b[ok]
    s = typed_server("float16", np.zeros(a.size, np.float16))
    got = typed_round(s, 3, [a, b], np.float16)
    want = (mx.nd.array(a, dtype="float16") + mx.nd.array(b, dtype="float16")).asnumpy()
    assert got.view(np.uint16).tolist() == want.view(np.uint16).tolist()


@pytest.mark.parametrize("multi_precision", [False, True])
def test_float16_with_the_optimizer_on_the_server_is_mxnets_update_of_the_sum(multi_precision):
    opt = dict(learning_rate=0.5, momentum=0.9, multi_precision=multi_precision)
    value = np.linspace(-1, 1, 16).astype(np.float16)
    s = typed_server("float16", value, optimizer=mx.optimizer.SGD(**opt))
    updater = mx.optimizer.get_updater(mx.optimizer.SGD(**opt))
    weight = mx.nd.array(value, dtype="float16")
    rng = np.random.default_rng(5)
    for it in (1, 2, 3):
        grads = [rng.standard_normal(16).astype(np.float16) for _ in range(2)]
        got = typed_round(s, 3, grads, np.float16, it=it)
        updater(3, mx.nd.array(grads[0] + grads[1], dtype="float16"), weight)
        assert got.tobytes() == weight.asnumpy().tobytes(), it


# --- optimizer states as data (GET_STATES / SET_STATES) -------------------------------------

def states_of(s):
    (out,) = s.on_request(worker(1), Header(MsgType.GET_STATES, sender=1), None)
    assert out.header.type == MsgType.DATA, out.payload
    return typed.unpack(out.payload)


def load_states(s, reply, w=0):
    """What worker 0's load_optimizer_states sends: the states by (key, offset), the counts."""
    body = typed.pack({"states": {(k, off): st for k, off, _, st in reply["states"]},
                       "counts": reply["counts"], "num_update": reply["num_update"]})
    return s.on_request(worker(w), Header(MsgType.SET_STATES, sender=w), body)


def test_states_taken_from_one_server_and_loaded_into_another_continue_identically():
    grads = [[np.full(8, 0.5), np.arange(8) * 0.25], [np.ones(8), -np.arange(8) * 0.5]]
    a = new_server(optimizer=pickle.dumps(mx.optimizer.Adam(learning_rate=0.1)),
                   keys={5: np.arange(8)})
    for it, (g0, g1) in enumerate(grads, start=1):
        send(a, MsgType.PUSH, 5, w=0, it=it, value=g0)
        send(a, MsgType.PUSH, 5, w=1, it=it, value=g1)
    reply = states_of(a)
    assert reply["counts"] == {5: 2} and reply["num_update"] == 2
    (key, offset, length, (mean, var)), = reply["states"]
    assert (key, offset, length) == (5, 0, 8) and mean.dtype == np.float32
    b = new_server(optimizer=pickle.dumps(mx.optimizer.Adam(learning_rate=0.1)),
                   keys={5: a.slots[(5, 0)].store.snapshot})
    only(load_states(b, reply), MsgType.ACK)
    assert counts(b) == {5: 2} and b.updater.optimizer.num_update == 2
    g0, g1 = np.linspace(-1, 1, 8), np.full(8, 0.125)
    for s, it in ((a, 3), (b, 1)):
        send(s, MsgType.PUSH, 5, w=0, it=it, value=g0)
        send(s, MsgType.PUSH, 5, w=1, it=it, value=g1)
    np.testing.assert_array_equal(b.slots[(5, 0)].store.snapshot,
                                  a.slots[(5, 0)].store.snapshot)    # bias correction too


@pytest.mark.parametrize("body,problem", [
    ({"states": {(9, 0): None}, "counts": {}, "num_update": 0},
     "SET_STATES: states for (9, 0), a slice server 0 does not hold"),
    ({"states": {(5, 0): np.zeros(3, np.float32)}, "counts": {}, "num_update": 0},
     "SET_STATES for key 5 at 0: an optimizer state is None, a float array of the slice's 8 "
     "elements or a tuple of states, got a float32 array of shape (3,)"),
    ({"states": {(5, 0): (np.zeros(8, np.int64),)}, "counts": {}, "num_update": 0},
     "got a int64 array of shape (8,)"),
    ({"states": {}, "counts": {5: -1}, "num_update": 0},
     "SET_STATES: the update count of key 5 must be a non-negative integer, got -1"),
    ({"states": {}, "counts": {}}, "SET_STATES: missing num_update"),
    ({"states": {}, "counts": {}, "num_update": 0, "optimizer": 1},
     "SET_STATES: unknown 'optimizer'"),
    ({"states": [], "counts": {}, "num_update": 0}, "SET_STATES: states and counts are dicts"),
])
def test_set_states_that_do_not_fit_are_refused_and_change_nothing(body, problem):
    s = new_server(workers=1, optimizer=pickle.dumps(mx.optimizer.Adam()),
                   keys={5: np.arange(8)})
    send(s, MsgType.PUSH, 5, it=1, value=np.ones(8))
    before = [x.asnumpy() for x in s.updater.states[5]]
    msg = error_text(s.on_request(worker(0), Header(MsgType.SET_STATES, sender=0),
                                  typed.pack(body)))
    assert problem in msg, msg
    assert counts(s) == {5: 1}
    for x, y in zip(s.updater.states[5], before):
        np.testing.assert_array_equal(x.asnumpy(), y)


# --- moving slices between servers (a re-plan) ------------------------------------------------

class Pair:
    """Two servers and the network between them: ``route`` delivers what they send each other
    (MIGRATE requests, their ACK/ERROR replies) and keeps what goes to the scheduler."""

    def __init__(self, servers):
        self.servers = servers
        self.queue = []                      # ("request", to, from, header, payload) or
        self.reports = {s.rank: [] for s in servers}   # ("reply", to, from, header)
        self.early = 0                       # PLANs that found parts waiting for them

    def take(self, rank, outs):
        for o in outs:
            if o.to == Out.PEER:
                self.queue.append(("request", o.dest, rank, o.header, o.payload))
            elif o.to == Out.SCHEDULER:
                assert o.header.type == MsgType.PLAN
                self.reports[rank].append(json.loads(o.payload))
            else:
                assert o.dest.startswith(b"peer"), "a worker got %r during a re-plan" % o
                self.queue.append(("reply", int(o.dest[4:]), rank, o.header))

    def plan(self, rank, version, old, new, seeds=None):
        plan = {"version": version, "old": table_to_json(old), "new": table_to_json(new)}
        if seeds:
            plan["seeds"] = [list(k) + [w] for k, w in seeds.items()]
        body = json.dumps(plan).encode()
        self.early += bool(self.servers[rank].early_parts)
        self.take(rank, self.servers[rank].on_scheduler(Header(MsgType.PLAN), body))

    def deliver(self, i=0):
        item = self.queue.pop(i)
        if item[0] == "request":
            _, to, frm, h, payload = item
            self.take(to, self.servers[to].on_request(b"peer%d" % frm, h, payload))
        else:
            _, to, frm, h = item
            self.take(to, self.servers[to].on_peer_reply(frm, h))

    def route(self):
        while self.queue:
            self.deliver()

    def route_to_workers(self):
        """``route``, keeping what the servers send workers (replies to requests that waited
        for a slice): those Outs, in order."""
        outs = []
        while self.queue:
            item = self.queue.pop(0)
            if item[0] == "request":
                _, to, frm, h, payload = item
                got = self.servers[to].on_request(b"peer%d" % frm, h, payload)
            else:
                _, to, frm, h = item
                got = self.servers[to].on_peer_reply(frm, h)
            to_worker = [o.to == Out.CLIENT and not o.dest.startswith(b"peer") for o in got]
            outs += [o for o, w in zip(got, to_worker) if w]
            self.take(to, [o for o, w in zip(got, to_worker) if not w])
        return outs


def adam_pair(value, directory=None):
    """Two servers with Adam, key 5 on server 0 (``directory``: in disk stores under it)."""
    opt = pickle.dumps(mx.optimizer.Adam(learning_rate=0.1))
    stores = [None, None] if directory is None else \
        [StoreSettings(str(directory / ("server%d" % r)), 256) for r in (0, 1)]
    return [new_server(rank=0, optimizer=opt, keys={5: value}, store=stores[0]),
            new_server(rank=1, optimizer=opt, store=stores[1])]


def push_rounds(servers_and_slices, grads, first=1):
    """Push ``grads`` (round -> per worker, from round ``first``) of key 5 to the slices given
    as (server, Slice)."""
    for it, per_worker in enumerate(grads, start=first):
        for w, g in enumerate(per_worker):
            for s, x in servers_and_slices:
                only(send(s, MsgType.PUSH, 5, w=w, it=it, offset=x.offset,
                          value=np.asarray(g, np.float32)[x.offset:x.stop],
                          version=s.plan_version), MsgType.ACK)


VALUE = np.arange(8, dtype=np.float32)
GRADS = [[np.full(8, 0.5), np.arange(8) * 0.25], [np.ones(8), -np.arange(8) * 0.5],
         [np.arange(8) * 0.1, np.full(8, -1.0)]]
OLD = {5: (Slice(0, 0, 8),)}
NEW = {5: (Slice(0, 0, 3), Slice(1, 3, 5))}


def test_migration_moves_value_optimizer_state_and_update_count_to_the_new_owner():
    s0, s1 = adam_pair(VALUE)
    push_rounds([(s0, OLD[5][0])], GRADS[:2])
    before_value = s0.slots[(5, 0)].store.snapshot.copy()
    before_state = [x.asnumpy() for x in s0.updater.states[5]]
    net = Pair([s0, s1])
    net.plan(1, 1, OLD, NEW)          # server 1 expects one part from server 0
    net.plan(0, 1, OLD, NEW)
    net.route()
    assert net.reports == {0: [{"version": 1, "moved_bytes": 5 * 4 * 3}],   # value, mean, var
                           1: [{"version": 1, "moved_bytes": 0}]}
    kept, moved = s0.slots[(5, 0)], s1.slots[(5, 3)]
    np.testing.assert_array_equal(kept.store.snapshot, before_value[:3])
    np.testing.assert_array_equal(moved.store.snapshot, before_value[3:])
    assert (kept.applied, moved.applied) == (2, 2)
    far = optimizer_index(5, 3)
    for i, m in enumerate(before_state):     # Adam's mean and variance, cut by element
        np.testing.assert_array_equal(s0.updater.states[5][i].asnumpy(), m[:3])
        np.testing.assert_array_equal(s1.updater.states[far][i].asnumpy(), m[3:])
    assert counts(s0) == {5: 2} and counts(s1) == {far: 2}
    assert s1.updater.optimizer.num_update == 2

    # round 3 on the two new slices gives what one server that kept everything gives
    alone = adam_pair(VALUE)[0]
    push_rounds([(alone, OLD[5][0])], GRADS)
    for w, g in enumerate(GRADS[2]):
        for s, x in ((s0, NEW[5][0]), (s1, NEW[5][1])):
            send(s, MsgType.PUSH, 5, w=w, it=3, offset=x.offset, value=g[x.offset:x.stop],
                 version=1)
    got = np.concatenate([value_of(only(send(s, MsgType.PULL, 5, it=3, offset=x.offset,
                                             length=x.length, version=1)))
                          for s, x in ((s0, NEW[5][0]), (s1, NEW[5][1]))])
    np.testing.assert_allclose(got, alone.slots[(5, 0)].store.snapshot, rtol=1e-6)


def seed(s, w, x, value, version=1):
    """Worker ``w``'s SEED of key 5's slice ``x`` (MXPS_REPLAN_SEED) to server ``s``."""
    h, v = request(MsgType.SEED, 5, w=w, offset=x.offset, value=value, version=version)
    return s.on_request(worker(w), h, v)


@pytest.mark.parametrize("seed_first", [False, True], ids=["part_first", "seed_first"])
def test_a_seeded_move_takes_the_weights_from_a_worker_and_only_state_from_the_old_owner(
        seed_first):
    # MXPS_REPLAN_SEED: worker 1 holds the weights its last pull got; the old owner sends
    # Adam's state and a checksum of the weights, the worker the weights; the slice is built
    # once both are in, as an unseeded move builds it
    plain, seeded = adam_pair(VALUE), adam_pair(VALUE)
    for s0, _ in (plain, seeded):
        push_rounds([(s0, OLD[5][0])], GRADS[:2])
    weights = seeded[0].slots[(5, 0)].store.snapshot.copy()
    net = Pair(plain)
    net.plan(1, 1, OLD, NEW)
    net.plan(0, 1, OLD, NEW)
    net.route()
    s0, s1 = seeded
    moved = NEW[5][1]
    net = Pair(seeded)
    seeds = {(5, moved.offset, moved.length): 1}
    net.plan(1, 1, OLD, NEW, seeds)
    if seed_first:                                   # the worker's weights before the part
        only(seed(s1, 1, moved, weights[moved.offset:]), MsgType.ACK)
    net.plan(0, 1, OLD, NEW, seeds)
    net.route()
    assert net.reports[0] == [{"version": 1, "moved_bytes": 5 * 4 * 2}]   # Adam's state only
    if not seed_first:
        assert (5, 3) not in s1.slots and net.reports[1] == []   # waits for the weights
        outs = seed(s1, 1, moved, weights[moved.offset:])
        only(outs, MsgType.ACK)
        net.take(1, [o for o in outs if o.to != Out.CLIENT])
    assert net.reports[1] == [{"version": 1, "moved_bytes": 0}]
    a, b = plain[1].slots[(5, 3)], s1.slots[(5, 3)]
    np.testing.assert_array_equal(b.store.snapshot, a.store.snapshot)
    far = optimizer_index(5, 3)
    for x, y in zip(s1.updater.states[far], plain[1].updater.states[far]):
        np.testing.assert_array_equal(x.asnumpy(), y.asnumpy())
    assert b.applied == a.applied == 2 and counts(s1) == counts(plain[1])


def test_weights_a_worker_seeds_that_differ_from_the_old_owners_fail_the_plan_naming_them():
    s0, s1 = adam_pair(VALUE)
    push_rounds([(s0, OLD[5][0])], GRADS[:2])
    wrong = s0.slots[(5, 0)].store.snapshot[3:] + 1.0
    net = Pair([s0, s1])
    moved = NEW[5][1]
    seeds = {(5, moved.offset, moved.length): 0}
    net.plan(1, 1, OLD, NEW, seeds)
    net.plan(0, 1, OLD, NEW, seeds)
    net.route()
    outs = seed(s1, 0, moved, wrong)
    assert "not the ones its old owner holds" in error_text(outs)
    failed = [json.loads(o.payload) for o in outs if o.to == Out.SCHEDULER]
    assert failed and "key 5 [3, +5)" in failed[0]["error"], failed
    # a worker the plan does not name is refused too
    assert "does not ask of it" in error_text(seed(s1, 1, moved, wrong))


def test_a_part_that_arrives_before_its_plan_is_used_when_the_plan_comes():
    s0, s1 = adam_pair(VALUE)
    push_rounds([(s0, OLD[5][0])], GRADS[:1])
    before = s0.slots[(5, 0)].store.snapshot.copy()
    net = Pair([s0, s1])
    net.plan(0, 1, OLD, NEW)
    assert [q[:3] for q in net.queue] == [("request", 1, 0)]
    net.deliver()                                     # the part, before server 1's PLAN
    assert s1.early_parts and (5, 3) not in s1.slots and net.reports[1] == []
    assert net.queue[0][0] == "reply" and net.queue[0][3].type == MsgType.ACK
    net.route()                                       # server 0 gets its ACK: done
    assert net.reports[0] == [{"version": 1, "moved_bytes": 5 * 4 * 3}]   # value, mean, var
    net.plan(1, 1, OLD, NEW)
    assert net.reports[1] == [{"version": 1, "moved_bytes": 0}] and not s1.early_parts
    np.testing.assert_array_equal(s1.slots[(5, 3)].store.snapshot, before[3:])
    assert s1.slots[(5, 3)].applied == 1 and counts(s1) == {optimizer_index(5, 3): 1}


@pytest.mark.parametrize("store", ["memory", "disk"])
def test_overlapped_pushes_for_a_slice_still_being_built_are_acked_and_summed_once_built(
        tmp_path, store):
    # MXPS_REPLAN_OVERLAP: the workers push round 3 by plan 1 while server 1 still waits for
    # its part; the pushes are acknowledged at once, a pull waits, and once the part is in
    # the round is the same as on one server (in RAM) that kept everything; with the disk
    # store the slice is built as a table with Adam's state beside its rows
    s0, s1 = adam_pair(VALUE, tmp_path if store == "disk" else None)
    push_rounds([(s0, OLD[5][0])], GRADS[:2])
    alone = adam_pair(VALUE)[0]
    push_rounds([(alone, OLD[5][0])], GRADS)
    net = Pair([s0, s1])
    net.plan(1, 1, OLD, NEW)                          # server 1 waits for a part
    x = NEW[5][1]
    for w, g in enumerate(GRADS[2]):
        only(send(s1, MsgType.PUSH, 5, w=w, it=3, offset=x.offset, value=g[x.offset:x.stop],
                  version=1), MsgType.ACK)
    assert not send(s1, MsgType.PULL, 5, it=3, offset=x.offset, length=x.length, version=1)
    assert (5, 3) not in s1.slots and len(s1.deferred[(5, 3)]) == 3
    net.plan(0, 1, OLD, NEW)                          # server 0 cuts and sends the part
    outs = net.route_to_workers()
    assert (type(s1.slots[(5, 3)].store).__name__ == "DiskSlice") is (store == "disk")
    assert not s1.deferred and s1.slots[(5, 3)].applied == 3
    pulled = value_of(only(outs, MsgType.DATA))       # the waiting pull, answered
    np.testing.assert_allclose(pulled, alone.slots[(5, 0)].store.snapshot[3:], rtol=1e-6)


def row_request(type_, w, it, x, ids, values=None, version=0):
    """A PUSH_ROWS (with ``values``) or PULL_ROWS of rows ``ids`` (2 elements each) of key 5
    to the slice ``x``."""
    body = {"cols": 2, "ids": np.asarray(ids, np.int64)}
    if values is not None:
        body["values"] = np.asarray(values, np.float32)
    return Header(type_, key=5, sender=w, iteration=it, plan_version=version, offset=x.offset,
                  length=x.length, request_id=next(_ids),
                  dtype=F32 if values is not None else NO_DTYPE), typed.pack(body)


def test_overlapped_row_requests_for_a_slice_still_being_built_wait_for_it():
    # the same with row-sparse requests: pushes acknowledged at once and summed once the slice
    # is built, the pull of rows answered then, as one server that kept everything answers
    rows = [[2, 3], [3]]                               # elements 4..7, 6..7: inside [3, 8)
    vals = [np.array([1.0, -2.0, 0.5, 3.0]), np.array([-1.0, 4.0])]
    s0, s1 = adam_pair(VALUE)
    push_rounds([(s0, OLD[5][0])], GRADS[:2])
    alone = adam_pair(VALUE)[0]
    push_rounds([(alone, OLD[5][0])], GRADS[:2])
    for w in range(2):
        only(alone.on_request(worker(w), *row_request(MsgType.PUSH_ROWS, w, 3, OLD[5][0],
                                                      rows[w], vals[w])), MsgType.ACK)
    want = value_of(only(alone.on_request(worker(0), *row_request(
        MsgType.PULL_ROWS, 0, 3, OLD[5][0], [1, 2, 3]))))
    net = Pair([s0, s1])
    net.plan(1, 1, OLD, NEW)                          # server 1 waits for a part
    x = NEW[5][1]
    for w in range(2):
        only(s1.on_request(worker(w), *row_request(MsgType.PUSH_ROWS, w, 3, x, rows[w],
                                                   vals[w], version=1)), MsgType.ACK)
    assert not s1.on_request(worker(0), *row_request(MsgType.PULL_ROWS, 0, 3, x, [1, 2, 3],
                                                     version=1))
    assert (5, 3) not in s1.slots and len(s1.deferred[(5, 3)]) == 3
    net.plan(0, 1, OLD, NEW)
    outs = net.route_to_workers()
    assert not s1.deferred and s1.slots[(5, 3)].applied == 3
    # row 1 holds elements 2 and 3: the slice at 3 answers element 3 only
    np.testing.assert_allclose(value_of(only(outs, MsgType.DATA)), want[1:], rtol=1e-6)


def test_a_request_of_the_next_plan_waits_for_its_plan_and_is_served_by_it():
    s0 = new_server(optimizer=sgd(), keys={5: VALUE})
    h, v = request(MsgType.PUSH, 5, w=0, it=1, value=np.ones(8), version=1)
    assert s0.on_request(worker(0), h, v) == []       # plan 1 is not here yet: it waits
    assert len(s0.early_requests) == 1
    body = json.dumps({"version": 1, "old": table_to_json(OLD),
                       "new": table_to_json(OLD)}).encode()
    outs = s0.on_scheduler(Header(MsgType.PLAN), body)
    assert only(outs, MsgType.ACK).header.request_id == h.request_id
    assert not s0.early_requests and 0 in s0.slots[(5, 0)].rounds[1].senders
    # a flood of them is refused past the bound, naming the plan
    s0.EARLY_BYTES = 40
    assert send(s0, MsgType.PUSH, 5, w=1, it=1, value=np.ones(8), version=2) == []
    assert "before its PLAN" in error_text(send(s0, MsgType.PUSH, 5, w=1, it=2,
                                                 value=np.ones(8), version=2))


def test_a_plan_over_a_partly_pushed_round_fails_naming_the_key_and_the_round():
    s0, s1 = adam_pair(VALUE)
    send(s0, MsgType.PUSH, 5, w=0, it=1, value=GRADS[0][0])          # worker 1 never pushes
    net = Pair([s0, s1])
    net.plan(0, 1, OLD, NEW)
    (report,) = net.reports[0]
    assert report["version"] == 1
    assert report["error"] == ("RequestError: plan 1: key 5 has rounds [1] partly pushed on "
                               "server 0; workers push keys unequally")


def test_a_part_for_a_superseded_plan_is_refused_and_fails_the_plan_at_its_sender():
    s0, s1 = adam_pair(VALUE)
    net = Pair([s0, s1])
    net.plan(1, 2, {}, {})                 # server 1 is at plan 2 already
    net.reports[1].clear()
    net.plan(0, 1, OLD, NEW)
    net.deliver()
    assert net.queue[0][3].type == MsgType.ERROR
    net.route()
    (report,) = net.reports[0]
    assert report["error"] == "RequestError: plan 1: a moved part of key 5 was refused"


# --- failover: a lost server's slices rebuilt on a survivor (MXPS_FAILOVER) -----------------

LOST_OLD = {5: (Slice(0, 0, 3), Slice(2, 3, 5))}     # server 2 is lost ...
LOST_NEW = {5: (Slice(0, 0, 3), Slice(1, 3, 5))}     # ... its slice goes whole to server 1


def failover_plan(s, version=1, lost=(2,)):
    body = json.dumps({"version": version, "old": table_to_json(LOST_OLD),
                       "new": table_to_json(LOST_NEW), "lost": list(lost)}).encode()
    return s.on_scheduler(Header(MsgType.PLAN), body)


def lost_seed(s, w, it, value, version=1):
    """Worker ``w``'s copy of the lost slice [3, 8) and the round its last pull of it got
    (``value`` None: it never pulled it)."""
    if value is None:
        h = Header(MsgType.SEED, key=5, sender=w, iteration=it, plan_version=version,
                   offset=3, length=5, request_id=next(_ids), dtype=NO_DTYPE)
        return s.on_request(worker(w), h, None)
    h, v = request(MsgType.SEED, 5, w=w, it=it, offset=3, value=value, version=version)
    return s.on_request(worker(w), h, v)


def resent(s, w, it, g, version=1):
    """A push sent again after the failover (``wire.RESENT``)."""
    h, v = request(MsgType.PUSH, 5, w=w, it=it, offset=3, value=g[3:], version=version)
    h.flags |= 0x40
    return s.on_request(worker(w), h, v)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_a_lost_slice_is_rebuilt_from_the_latest_round_a_worker_pulled_and_ends_as_if_no_loss(
        momentum):
    # server 2 applied round 2 of [3, 8); worker 0 pulled it, worker 1 did not (its pull and
    # its round-2 push are sent again), worker 0's round-3 push was acknowledged and is sent
    # again, then server 2 died.  Server 1 builds the slice from worker 0's weights, drops the
    # round-2 push it applied already, and round 3 ends as on one server that kept everything
    alone = new_server(optimizer=sgd(momentum), keys={5: VALUE})
    push_rounds([(alone, OLD[5][0])], GRADS[:2])
    round2 = alone.slots[(5, 0)].store.snapshot.copy()
    round1_w1 = VALUE - 1.0 * (GRADS[0][0] + GRADS[0][1])     # what worker 1 pulled last
    push_rounds([(alone, OLD[5][0])], GRADS[2:], first=3)
    s0 = new_server(optimizer=sgd(momentum), keys={5: VALUE[:3]})
    push_rounds([(s0, LOST_OLD[5][0])], GRADS[:2])
    s1 = new_server(rank=1, optimizer=sgd(momentum))
    for s in (s0, s1):
        reports = [json.loads(o.payload) for o in failover_plan(s) if o.to == Out.SCHEDULER]
        if s is s0:       # it keeps its slice as it is: nothing to build, nothing sent
            assert reports == [{"version": 1, "moved_bytes": 0, "reset": []}]
    assert s0.plan_version == s1.plan_version == 1 and (5, 3) not in s1.slots
    only(lost_seed(s1, 1, 1, round1_w1[3:]), MsgType.ACK)
    # worker 1's pull of round 2 and its round-2 push, sent again, wait for the slice
    pull = send(s1, MsgType.PULL, 5, w=1, it=2, offset=3, length=5, version=1)
    assert pull == []
    only(resent(s1, 1, 2, GRADS[1][1]), MsgType.ACK)
    outs = lost_seed(s1, 0, 2, round2[3:])
    (report,) = [json.loads(o.payload) for o in outs if o.to == Out.SCHEDULER]
    assert report == {"version": 1, "moved_bytes": 0,
                      "reset": [[5, 3, 5]] if momentum else []}
    slot = s1.slots[(5, 3)]
    assert slot.applied == 2 and s1.resent_dropped == 1
    np.testing.assert_array_equal(value_of(only(outs, MsgType.DATA)), round2[3:])
    # round 3: worker 0's acknowledged push sent again, worker 1's new one; server 0 takes
    # worker 0's push of the plan before the failover, and worker 1's of the new plan
    only(resent(s1, 0, 3, GRADS[2][0]), MsgType.ACK)
    only(send(s1, MsgType.PUSH, 5, w=1, it=3, offset=3, value=GRADS[2][1][3:], version=1),
         MsgType.ACK)
    for w, version in ((0, 0), (1, 1)):
        only(send(s0, MsgType.PUSH, 5, w=w, it=3, value=GRADS[2][w][:3], version=version),
             MsgType.ACK)
    got = np.concatenate([
        value_of(only(send(s0, MsgType.PULL, 5, it=3, length=3, version=0))),
        value_of(only(send(s1, MsgType.PULL, 5, it=3, offset=3, length=5, version=1)))])
    want = alone.slots[(5, 0)].store.snapshot
    if momentum:        # the momentum of [3, 8) was on the lost server only: reset
        assert not np.allclose(got[3:], want[3:])
        np.testing.assert_allclose(got[:3], want[:3], rtol=1e-6)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-6)
    # a request of the plan before the failover for the moved slice is refused
    assert "plan version 0" in error_text(send(s1, MsgType.PULL, 5, it=3, offset=3, length=5,
                                               version=0))


@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
def test_with_a_replica_a_lost_slice_takes_its_state_from_the_buddy_and_ends_as_if_no_loss(
        optimizer):
    # MXPS_REPLICA: server 2 sends its buddy, server 0, key 5's state after every round and
    # answers the round's pulls only once server 0 has it; server 2 dies after round 2; server
    # 0 rebuilds the slice from the workers' weights and its replica of round 2, and round 3
    # ends as on one server that lost nothing (momentum and Adam's mean, variance and count)
    opt = sgd(0.9) if optimizer == "momentum" else pickle.dumps(
        mx.optimizer.Adam(learning_rate=0.1))
    alone = new_server(optimizer=opt, keys={5: VALUE})
    push_rounds([(alone, OLD[5][0])], GRADS)
    s2 = new_server(rank=2, optimizer=opt, keys={5: VALUE}, num_servers=3, replica=True)
    s0 = new_server(rank=0, optimizer=opt, num_servers=3, replica=True)
    assert s2.buddy() == 0 and s0.buddy() == 1
    whole = Slice(2, 0, 8)
    for it in (1, 2):
        for w in (0, 1):
            outs = send(s2, MsgType.PUSH, 5, w=w, it=it, value=GRADS[it - 1][w])
        (rep,) = [o for o in outs if o.to == Out.PEER]
        assert rep.dest == 0 and rep.header.type == MsgType.REPLICA
        assert send(s2, MsgType.PULL, 5, w=0, it=it, length=8) == [], \
            "a pull waits for the buddy's ack"
        ack = only(s0.on_request(b"peer2", rep.header, rep.payload), MsgType.ACK)
        np.testing.assert_array_equal(
            value_of(only(s2.on_peer_reply(0, ack.header), MsgType.DATA)),
            s2.slots[(5, 0)].store.snapshot)
    weights = s2.slots[(5, 0)].store.snapshot.copy()
    assert sorted(s0.replicas[(5, 0, 8)]) == [1, 2]
    old, new = {5: (whole,)}, {5: (Slice(0, 0, 8),)}
    body = json.dumps({"version": 1, "old": table_to_json(old), "new": table_to_json(new),
                       "lost": [2]}).encode()
    assert s0.on_scheduler(Header(MsgType.PLAN), body) == []
    for w in (0, 1):
        h, v = request(MsgType.SEED, 5, w=w, it=2, value=weights, version=1)
        outs = s0.on_request(worker(w), h, v)
    (report,) = [json.loads(o.payload) for o in outs if o.to == Out.SCHEDULER]
    assert report == {"version": 1, "moved_bytes": 0, "reset": []}
    # the rebuilt slice's state goes to server 0's own buddy, server 1
    (rep,) = [o for o in outs if o.to == Out.PEER]
    assert rep.dest == 1 and rep.header.iteration == 2
    s0.on_peer_reply(1, rep.header.reply(MsgType.ACK, length=0))
    for w in (0, 1):
        outs = send(s0, MsgType.PUSH, 5, w=w, it=3, value=GRADS[2][w], version=1)
    (rep,) = [o for o in outs if o.to == Out.PEER]
    assert send(s0, MsgType.PULL, 5, it=3, length=8, version=1) == []
    got = value_of(only(s0.on_peer_reply(1, rep.header.reply(MsgType.ACK, length=0)),
                        MsgType.DATA))
    np.testing.assert_allclose(got, alone.slots[(5, 0)].store.snapshot, rtol=1e-6)


def test_a_server_lost_during_a_move_rolls_the_move_back_and_ends_as_if_no_loss():
    # a re-plan moves key 5 from server 0's [0, 8) to server 0's [0, 3) and server 2's [3, 8)
    # (every worker drained, holding the weights of round 2, Adam's state on server 0 only);
    # server 0 cut both parts, built [0, 3), and sent [3, 8) when server 2 died.  The failover
    # plan rolls the move back: server 0 drops [0, 3) and puts [0, 8) back from its copy, with
    # Adam's state and count, and round 3 ends as on one server that moved nothing
    opt = pickle.dumps(mx.optimizer.Adam(learning_rate=0.1))
    alone = new_server(optimizer=opt, keys={5: VALUE})
    push_rounds([(alone, OLD[5][0])], GRADS)
    s0 = new_server(rank=0, optimizer=opt, keys={5: VALUE}, num_servers=3, failover=True)
    s1 = new_server(rank=1, optimizer=opt, num_servers=3, failover=True)
    push_rounds([(s0, OLD[5][0])], GRADS[:2])
    before = {5: (Slice(0, 0, 8),)}
    moving = {5: (Slice(0, 0, 3), Slice(2, 3, 5))}
    body = json.dumps({"version": 1, "old": table_to_json(before),
                       "new": table_to_json(moving)}).encode()
    outs = s0.on_scheduler(Header(MsgType.PLAN), body)
    assert [o.dest for o in outs if o.to == Out.PEER] == [2]     # the part for server 2
    assert (s0.slots[(5, 0)].length, s0.slots[(5, 0)].since) == (3, 1)
    s1.on_scheduler(Header(MsgType.PLAN), body)                  # nothing to do
    # the failover plan: back to the table before the move, server 2 lost (it held nothing)
    body = json.dumps({"version": 2, "old": table_to_json(before), "new": table_to_json(before),
                       "lost": [2], "abandon": 1}).encode()
    reports = [json.loads(o.payload) for o in s0.on_scheduler(Header(MsgType.PLAN), body)
               if o.to == Out.SCHEDULER]
    assert reports == [{"version": 2, "moved_bytes": 0, "reset": []}]
    slot = s0.slots[(5, 0)]
    assert (slot.length, slot.applied) == (8, 2) and counts(s0) == {5: 2}
    for w, g in enumerate(GRADS[2]):
        only(send(s0, MsgType.PUSH, 5, w=w, it=3, value=g, version=2), MsgType.ACK)
    got = value_of(only(send(s0, MsgType.PULL, 5, it=3, length=8, version=2)))
    np.testing.assert_allclose(got, alone.slots[(5, 0)].store.snapshot, rtol=1e-6)


def test_a_lazy_replica_is_sent_every_k_rounds_without_holding_pulls_and_is_used_stale():
    # MXPS_REPLICA=2: server 2 replicates key 5's momentum after rounds 2 only (of 1..3), and
    # answers every pull at once; lost after round 3, its slice is rebuilt on server 0 with the
    # momentum of round 2, one round old, and the job facts are told so
    s2 = new_server(rank=2, optimizer=sgd(0.9), keys={5: VALUE}, num_servers=3, replica=2)
    s0 = new_server(rank=0, optimizer=sgd(0.9), num_servers=3, replica=2)
    sent_at = []
    for it in (1, 2, 3):
        for w in (0, 1):
            outs = send(s2, MsgType.PUSH, 5, w=w, it=it, value=GRADS[it - 1][w])
        for rep in [o for o in outs if o.to == Out.PEER]:
            sent_at.append(rep.header.iteration)
            s0.on_request(b"peer2", rep.header, rep.payload)
        value_of(only(send(s2, MsgType.PULL, 5, w=0, it=it, length=8), MsgType.DATA))
    assert sent_at == [2] and sorted(s0.replicas[(5, 0, 8)]) == [2]
    weights = s2.slots[(5, 0)].store.snapshot.copy()
    old, new = {5: (Slice(2, 0, 8),)}, {5: (Slice(0, 0, 8),)}
    body = json.dumps({"version": 1, "old": table_to_json(old), "new": table_to_json(new),
                       "lost": [2]}).encode()
    s0.on_scheduler(Header(MsgType.PLAN), body)
    for w in (0, 1):
        h, v = request(MsgType.SEED, 5, w=w, it=3, value=weights, version=1)
        outs = s0.on_request(worker(w), h, v)
    (report,) = [json.loads(o.payload) for o in outs if o.to == Out.SCHEDULER]
    assert report == {"version": 1, "moved_bytes": 0, "reset": [], "stale": [[5, 0, 8, 1]]}
    assert s0.slots[(5, 0)].applied == 3 and counts(s0)[5] == 3
    np.testing.assert_array_equal(s0.slots[(5, 0)].store.snapshot, weights)


def test_a_lost_slice_no_worker_pulled_fails_the_plan_naming_it():
    s1 = new_server(rank=1, optimizer=sgd())
    failover_plan(s1)
    only(lost_seed(s1, 0, 0, None), MsgType.ACK)
    outs = lost_seed(s1, 1, 0, None)
    (report,) = [json.loads(o.payload) for o in outs if o.to == Out.SCHEDULER]
    assert "no worker holds key 5 [3, +5)" in report["error"], report
    # a worker's second seed of it is refused
    s1 = new_server(rank=1, optimizer=sgd())
    failover_plan(s1)
    only(lost_seed(s1, 0, 1, VALUE[3:]), MsgType.ACK)
    assert "twice" in error_text(lost_seed(s1, 0, 1, VALUE[3:]))


def test_a_plan_placing_a_key_on_a_lost_server_is_refused():
    s1 = new_server(rank=1, optimizer=sgd())
    (out,) = failover_plan(s1, lost=(1,))
    assert "placed on a lost server" in json.loads(out.payload)["error"]


# --- any interleaving against a reference model ------------------------------------------------

GRAD = st.lists(st.integers(-3, 3), min_size=6, max_size=6)


class Cluster(RuleBasedStateMachine):
    """W workers issuing what real workers may issue to the servers holding two keys: a worker
    pushes round r of a key once, pulls a round it has pushed (the pull may reach the server
    before the push, as a split PUSHPULL does), and may push round r+1 before the others
    finished round r, but not while a pull of its own on that key is unanswered (MXNet's
    engine runs a key's operations in order).  The reference: with the update on the workers
    the value after round r is the sum of the round's W pushes; with SGD (lr 1, momentum 1/2)
    the momentum rule on that sum.  Small integers: every sum is exact in float32."""

    WORKERS = 2
    SERVERS = 1
    MOMENTUM = None            # None: update on the workers; else SGD with this momentum
    SIZES = {1: 3, 2: 6}
    COLS = {}                  # a key's row width (its INIT says), when it has rows

    def store(self, rank):
        """The servers' store settings (None: in RAM)."""
        return None

    def __init__(self):
        super().__init__()
        W, S = self.WORKERS, self.SERVERS
        self.servers = [ServerState(s, W, sync=True, store=self.store(s)) for s in range(S)]
        self.table = self.first_table()
        self.version = 0
        self.pushed = {(w, k): 0 for w in range(W) for k in self.SIZES}
        self.values = {k: [np.arange(n, dtype=np.float64)] for k, n in self.SIZES.items()}
        self.mom = {k: np.zeros(n) for k, n in self.SIZES.items()}
        self.sums = {}             # (key, round) -> [sum, workers so far]
        self.arrived = {}          # (key, offset, round) -> workers whose push that slice has
        self.settled = {k: 0 for k in self.SIZES}    # rounds complete at the last re-plan
        self.pending = {}          # (worker, key) -> {request id: (round, server, offset)}
        for s in self.servers:
            if self.MOMENTUM is not None:
                only(s.on_request(worker(0), Header(MsgType.SET_OPTIMIZER, sender=0),
                                  sgd(self.MOMENTUM)), MsgType.ACK)
        for k, slices in self.table.items():
            for x in slices:
                only(send(self.servers[x.server], MsgType.INIT, k, offset=x.offset,
                          it=self.COLS.get(k, 0), value=self.values[k][0][x.offset:x.stop]),
                     MsgType.ACK)

    def first_table(self):
        return {1: (Slice(0, 0, 3),),
                2: (Slice(0, 0, 6),) if self.SERVERS == 1 else (Slice(0, 0, 2), Slice(1, 2, 4))}

    # -- the model ---------------------------------------------------------------------------
    def _account(self, w, k, r, grad):
        entry = self.sums.setdefault((k, r), [np.zeros(self.SIZES[k]), set()])
        entry[0] += grad
        entry[1].add(w)
        if len(entry[1]) == self.WORKERS:
            assert len(self.values[k]) == r, "rounds complete in order"
            total = entry[0]
            if self.MOMENTUM is None:
                self.values[k].append(total.copy())
            else:
                self.mom[k] = self.MOMENTUM * self.mom[k] - total
                self.values[k].append(self.values[k][-1] + self.mom[k])

    def _complete_on(self, k, offset, r):
        return r <= self.settled[k] or \
            len(self.arrived.get((k, offset, r), ())) == self.WORKERS

    def _eligible(self):
        return [(w, k) for w in range(self.WORKERS) for k in self.SIZES
                if (w, k) not in self.pending]

    def _quiet(self):
        """A re-plan point: every worker at the same round of each key, no pull unanswered."""
        return not self.pending and all(
            len({self.pushed[(w, k)] for w in range(self.WORKERS)}) == 1 for k in self.SIZES)

    # -- talking to the servers --------------------------------------------------------------
    def _operation(self, w, k, types, grad=None):
        """One worker operation on key k: ``types`` in order to every slice of the key."""
        r = self.pushed[(w, k)] + (1 if grad is not None else 0)
        if grad is not None:
            self.pushed[(w, k)] = r
            grad = np.asarray(grad[:self.SIZES[k]], dtype=np.float32)
            self._account(w, k, r, grad)
        for x in self.table[k]:
            server = self.servers[x.server]
            for type_ in types:
                carries = type_ in (MsgType.PUSH, MsgType.PUSHPULL)
                h, payload = request(type_, k, w=w, it=r, offset=x.offset, length=x.length,
                                     value=grad[x.offset:x.stop] if carries else None,
                                     version=self.version)
                if carries:
                    self.arrived.setdefault((k, x.offset, r), set()).add(w)
                if type_ != MsgType.PUSH:
                    self.pending.setdefault((w, k), {})[h.request_id] = (r, x.server,
                                                                         x.offset)
                self._sent(w, h, payload)
                self._receive(x.server, h, server.on_request(worker(w), h, payload))

    def _sent(self, w, h, payload):
        """A request is on its way (a subclass keeps it)."""

    def _receive(self, server, request_header, outs):
        for o in outs:
            h = o.header
            assert o.to == Out.CLIENT and h.type != MsgType.ERROR, o.payload
            w = int(o.dest[1:])
            if h.type == MsgType.ACK:
                assert request_header.type == MsgType.PUSH and o.dest == worker(
                    request_header.sender) and h.request_id == request_header.request_id
                continue
            r, at, offset = self.pending[(w, h.key)].pop(h.request_id)
            if not self.pending[(w, h.key)]:
                del self.pending[(w, h.key)]
            assert (at, h.iteration, h.offset) == (server, r, offset)
            assert self._complete_on(h.key, offset, r), \
                "pull of round %d of key %d answered before all pushes arrived" % (r, h.key)
            want = self.values[h.key][r][offset:offset + h.length]
            np.testing.assert_array_equal(value_of(o), want.astype(np.float32))
            self._pulled(w, h, value_of(o))

    def _pulled(self, w, h, value):
        """Worker ``w`` got ``value``, the answer to its pull ``h`` (a subclass keeps it)."""

    # -- what workers do ---------------------------------------------------------------------
    @precondition(lambda self: self._eligible())
    @rule(data=st.data(), grad=GRAD)
    def push(self, data, grad):
        w, k = data.draw(st.sampled_from(self._eligible()))
        self._operation(w, k, [MsgType.PUSH], grad)

    @precondition(lambda self: self._eligible())
    @rule(data=st.data())
    def pull(self, data):
        w, k = data.draw(st.sampled_from(self._eligible()))
        self._operation(w, k, [MsgType.PULL])

    @precondition(lambda self: self._eligible())
    @rule(data=st.data(), grad=GRAD)
    def pushpull(self, data, grad):
        w, k = data.draw(st.sampled_from(self._eligible()))
        self._operation(w, k, [MsgType.PUSHPULL], grad)

    @precondition(lambda self: self._eligible())
    @rule(data=st.data(), grad=GRAD)
    def pull_overtaking_its_push(self, data, grad):
        w, k = data.draw(st.sampled_from(self._eligible()))
        self._operation(w, k, [MsgType.PULL, MsgType.PUSH], grad)

    @rule(grad=GRAD)
    def everyone_catches_up(self, grad):
        """Every worker pushes until all are at the furthest round (so re-plan points come)."""
        while True:
            behind = [(w, k) for (w, k) in self._eligible()
                      if self.pushed[(w, k)] < max(self.pushed[(v, k)]
                                                   for v in range(self.WORKERS))]
            if not behind:
                return
            w, k = behind[0]
            self._operation(w, k, [MsgType.PUSH], grad)

    # -- invariants --------------------------------------------------------------------------
    @invariant()
    def a_pull_waits_only_while_its_round_is_incomplete(self):
        for (w, k), reqs in self.pending.items():
            for r, _, offset in reqs.values():
                assert not self._complete_on(k, offset, r), (w, k, r, offset)

    @invariant()
    def each_slice_is_updated_once_per_completed_round(self):
        if self.MOMENTUM is None:
            return
        for s in self.servers:
            for slot in s.slots.values():
                assert counts(s).get(slot.index, 0) == slot.applied, (s.rank, slot.key)


class Migrating(Cluster):
    """Two servers, and at a re-plan point (every worker at the same round of every key,
    nothing in flight) a new table with its PLAN and the parts delivered in any order: a part
    may reach a server before that server's PLAN."""

    SERVERS = 2

    @precondition(lambda self: self._quiet())
    @rule(data=st.data())
    def replan(self, data):
        old, new = self.table, {}
        for k, n in self.SIZES.items():
            cuts = sorted(data.draw(st.sets(st.integers(1, n - 1), max_size=3)))
            bounds = [0] + cuts + [n]
            new[k] = tuple(Slice(data.draw(st.integers(0, 1)), a, b - a)
                           for a, b in zip(bounds, bounds[1:]))
        self.version += 1
        net = Pair(self.servers)
        pending_plans = [0, 1]
        while pending_plans or net.queue:
            i = data.draw(st.integers(0, len(pending_plans) + len(net.queue) - 1))
            if i < len(pending_plans):
                net.plan(pending_plans.pop(i), self.version, old, new)
            else:
                net.deliver(i - len(pending_plans))
        for rank, reports in net.reports.items():
            assert len(reports) == 1 and "error" not in reports[0], (rank, reports)
            assert reports[0]["version"] == self.version
        for k, slices in new.items():
            r = self.pushed[(0, k)]
            self.settled[k] = r
            held = {(key, off) for s in self.servers for key, off in s.slots if key == k}
            assert held == {(k, x.offset) for x in slices}
            for x in slices:
                slot = self.servers[x.server].slots[(k, x.offset)]
                assert slot.applied == r
                np.testing.assert_array_equal(slot.store.snapshot,
                                              self.values[k][r][x.offset:x.stop])
        self.table = new
        self.check_store()
        event("re-plan" + (" with a part before its PLAN" if net.early else ""))

    def check_store(self):
        pass


class WithOptimizer(Cluster):
    MOMENTUM = 0.5


class MigratingWithOptimizer(Migrating):
    MOMENTUM = 0.5


class MigratingOnDisk(MigratingWithOptimizer):
    """The same with the disk store (a cache of a few rows, key 2 in rows of 2 elements, so a
    moved slice shares rows with its neighbours): each moved slice becomes a table on its new
    server, with its optimizer state, and leaves no file behind on the old one."""

    COLS = {2: 2}

    def store(self, rank):
        if not hasattr(self, "_dir"):
            self._dir = tempfile.mkdtemp(prefix="mxps-migrate-")
        return StoreSettings(os.path.join(self._dir, "server%d" % rank), 64)

    def check_store(self):
        for s in self.servers:
            tables = {f for f in os.listdir(s.store.directory) if f.endswith(".rows")}
            assert tables == {"key%d_at%d.rows" % k for k in s.slots}, (s.rank, tables)

    def teardown(self):
        shutil.rmtree(self._dir, ignore_errors=True)


class ThreeWorkers(Cluster):
    WORKERS = 3


class FailingOver(Cluster):
    """Three servers; at any moment of any interleaving one of them is lost (MXPS_FAILOVER):
    the survivors get the failover PLAN, and each worker does what ``roles.reroute`` does: a
    SEED of every lost slice (its last pulled copy and round, or none), then every request
    the lost server left unanswered and every push it acknowledged of a round the worker has
    not pulled back, sent again to the successor (``RESENT``), in an order drawn; later
    requests go by the new table.  As Gluon's workers, a worker pushes round r + 1 of a key
    only once it pulled round r (its gradient array is rewritten only then), and worker 0
    holds the value it initialised a slice with until it pulls it.  Plain SGD (no optimizer
    state to lose): every pull still gets the reference weights, and no round is counted
    twice or lost."""

    SERVERS = 3
    MOMENTUM = 0.0

    def __init__(self):
        super().__init__()
        self.lost = set()
        self.held = {}         # (worker, key, offset) -> (round, value) of its last pull
        self.acked = {}        # (worker, key, offset) -> [(header, payload)] of its pushes
        self.waiting = {}      # request id -> (worker, header, payload) of pulls unanswered
        for k, slices in self.table.items():
            for x in slices:
                self.held[(0, k, x.offset)] = (0, self.values[k][0][x.offset:x.stop])

    def _pushable(self):
        return [(w, k) for w, k in self._eligible() if all(
            self.held.get((w, k, x.offset), (-1,))[0] == self.pushed[(w, k)]
            for x in self.table[k])]

    @precondition(lambda self: self._pushable())
    @rule(data=st.data(), grad=GRAD)
    def push(self, data, grad):
        w, k = data.draw(st.sampled_from(self._pushable()))
        self._operation(w, k, [MsgType.PUSH], grad)

    @precondition(lambda self: self._pushable())
    @rule(data=st.data(), grad=GRAD)
    def pushpull(self, data, grad):
        w, k = data.draw(st.sampled_from(self._pushable()))
        self._operation(w, k, [MsgType.PUSHPULL], grad)

    @precondition(lambda self: self._pushable())
    @rule(data=st.data(), grad=GRAD)
    def pull_overtaking_its_push(self, data, grad):
        w, k = data.draw(st.sampled_from(self._pushable()))
        self._operation(w, k, [MsgType.PULL, MsgType.PUSH], grad)

    @rule()
    def everyone_catches_up(self):
        """Every worker pulls what it pushed, and pushes until all are at the furthest round."""
        for w, k in self._eligible():
            if (w, k) not in self._pushable():
                self._operation(w, k, [MsgType.PULL])

    def first_table(self):
        return {1: (Slice(2, 0, 3),), 2: (Slice(0, 0, 2), Slice(1, 2, 2), Slice(2, 4, 2))}

    def _sent(self, w, h, payload):
        if h.type in (MsgType.PUSH, MsgType.PUSHPULL):
            self.acked.setdefault((w, h.key, h.offset), []).append((h, payload))
        if h.type != MsgType.PUSH:
            self.waiting[h.request_id] = (w, h, payload)

    def _pulled(self, w, h, value):
        self.waiting.pop(h.request_id, None)
        self.held[(w, h.key, h.offset)] = (h.iteration, value)
        part = (w, h.key, h.offset)
        self.acked[part] = [(q, p) for q, p in self.acked.get(part, ()) if
                            q.iteration > h.iteration]

    def _outs(self, server, outs, request=None):
        """Outs of a message to ``server`` during the failover: replies to waiting pulls are
        checked as any; ACKs of seeds and pushes sent again, and PLAN acks, are consumed."""
        for o in outs:
            if o.to == Out.SCHEDULER:
                body = json.loads(o.payload)
                assert "error" not in body, body
                self.reports.append(body)
            elif o.header.type == MsgType.ACK:     # (a PLAN runs the requests that waited
                assert request is None or o.header.request_id == request.request_id  # for it)
            else:
                self._receive(server, request, [o])

    def _moved_on(self, new, what):
        """The successor table is in force: later requests go by it."""
        self.table = new
        self.acked = {}
        event("%s a server at round %s, %s" % (
            what, min(3, max(self.pushed.values())) if max(self.pushed.values()) < 3 else "3+",
            "pulls waiting" if self.waiting else "no pull waiting"))

    def _sent_again(self, w, gone, old, moved):
        """What worker ``w`` sends after server ``gone`` left its slices (``roles.reroute``):
        a SEED of every moved slice (its last pulled copy and round, or none), then every
        request ``gone`` left unanswered and every push it acknowledged of a round ``w`` has
        not pulled back, to the successor (``RESENT``)."""
        lengths = {(k, x.offset): x.length for k, xs in old.items() for x in xs}
        q = []
        for (k, off), to in sorted(moved.items()):
            got = self.held.get((w, k, off))
            if got is None:
                h = Header(MsgType.SEED, key=k, sender=w, iteration=0,
                           plan_version=self.version, offset=off, length=lengths[k, off],
                           request_id=next(_ids), dtype=NO_DTYPE)
                q.append(("msg", to, h, None))
            else:
                h, v = request(MsgType.SEED, k, w=w, it=got[0], offset=off,
                               value=got[1], version=self.version)
                q.append(("msg", to, h, v))
        for rid, (ww, h, payload) in list(self.waiting.items()):
            if ww == w and (h.key, h.offset) in moved and \
                    self.pending.get((w, h.key), {}).get(rid, (0, -1))[1] == gone:
                to = moved[(h.key, h.offset)]
                r, _, off = self.pending[(w, h.key)][rid]
                self.pending[(w, h.key)][rid] = (r, to, off)
                h.plan_version = self.version
                if h.type == MsgType.PUSHPULL:
                    h.flags |= 0x40
                q.append(("msg", to, h, payload))
        for (ww, k, off), pushes in self.acked.items():
            if ww == w and (k, off) in moved:
                for h, payload in pushes:
                    if h.type != MsgType.PUSH:
                        continue        # a PUSHPULL unanswered is sent again above
                    h.plan_version = self.version
                    h.flags |= 0x40
                    q.append(("msg", moved[(k, off)], h, payload))
        return q

    @precondition(lambda self: not self.lost)
    @rule(data=st.data())
    def lose_a_server(self, data):
        from mxps.placement.failover import successors
        dead = data.draw(st.integers(0, self.SERVERS - 1))
        self.lost.add(dead)
        old = self.table
        new, moved = successors(old, {dead}, self.SERVERS)
        self.version += 1
        self.reports = []
        body = json.dumps({"version": self.version, "old": table_to_json(old),
                           "new": table_to_json(new), "lost": [dead]}).encode()
        # each worker's messages in its own order; the workers' interleaved as drawn, with the
        # PLANs to the survivors anywhere among them
        queues = [[("plan", s) for s in range(self.SERVERS) if s != dead]]
        for w in range(self.WORKERS):
            queues.append(self._sent_again(w, dead, old, moved))
        while any(queues):
            i = data.draw(st.sampled_from([i for i, q in enumerate(queues) if q]))
            item = queues[i].pop(0)
            if item[0] == "plan":
                self._outs(item[1], self.servers[item[1]].on_scheduler(Header(MsgType.PLAN),
                                                                       body))
            else:
                _, to, h, payload = item
                self._outs(to, self.servers[to].on_request(worker(h.sender), h, payload), h)
        assert len(self.reports) == self.SERVERS - 1, self.reports
        self._moved_on(new, "lost")

    @invariant()
    def each_slice_is_updated_once_per_completed_round(self):
        # a slice rebuilt by a failover starts without its update count (plain SGD uses none)
        for s in self.servers:
            for slot in s.slots.values():
                if slot.since == 0:
                    assert counts(s).get(slot.index, 0) == slot.applied, (s.rank, slot.key)


class Diverting(FailingOver):
    """Three servers, SGD with momentum; at any moment of any interleaving one server is
    diverted (MXPS_DIVERT): it is alive and gets the PLAN too, drops its partial rounds and
    sends each successor the slice's state (``_divert_part``); the successors take the
    workers' seeds or ask the slow server for its weights (``VALUE``).  The workers do what
    ``roles.reroute`` does (a request that reaches the slow server after its PLAN is dropped
    there: ``test_a_diverted_slice_takes_weights_...``).  Every message between the
    servers (parts, VALUE, their acknowledgements) is delivered in an order drawn among the
    workers' messages and the PLANs.  The momentum moves with its slice: every pull gets the
    reference weights and every slice's update count is its rounds."""

    MOMENTUM = 0.5

    def _divert_outs(self, server, outs, request, peers):
        for o in outs:
            if o.to == Out.SCHEDULER:
                body = json.loads(o.payload)
                assert "error" not in body, body
                self.reports.append(body)
            elif o.to == Out.PEER:
                if o.header.type in (MsgType.STATE, MsgType.VALUE):
                    event("a successor sent %s" % MsgType(o.header.type).name)
                peers.append(("peer", o.dest, server, o.header, o.payload))
            elif isinstance(o.dest, bytes) and o.dest.startswith(b"peer"):
                # an ACK, or the answer to a STATE (DivertingWithAReplica)
                assert o.header.type in (MsgType.ACK, MsgType.DATA), o.payload
                peers.append(("reply", int(o.dest[4:]), server, o.header, o.payload))
            elif o.header.type == MsgType.ACK:
                assert request is None or o.header.request_id == request.request_id
            else:
                self._receive(server, request, [o])

    @precondition(lambda self: not self.lost)
    @rule(data=st.data())
    def lose_a_server(self, data):
        """Not here: a server is diverted (below), not lost."""

    @precondition(lambda self: not self.lost and any(self.pushed.values()))
    @rule(data=st.data())
    def divert_a_server(self, data):
        from mxps.placement.failover import successors
        slow = data.draw(st.integers(0, self.SERVERS - 1))
        self.lost.add(slow)
        for s in self.servers:
            s.failover = True
        old = self.table
        new, moved = successors(old, {slow}, self.SERVERS)
        self.version += 1
        self.reports = []
        body = json.dumps({"version": self.version, "old": table_to_json(old),
                           "new": table_to_json(new), "lost": [],
                           "diverted": [slow]}).encode()
        queues = [[("plan", s) for s in range(self.SERVERS)]]
        for w in range(self.WORKERS):
            queues.append(self._sent_again(w, slow, old, moved))
        peers = []
        queues.append(peers)
        while any(queues):
            i = data.draw(st.sampled_from([i for i, q in enumerate(queues) if q]))
            item = queues[i].pop(0)
            if item[0] == "plan":
                self._divert_outs(item[1], self.servers[item[1]].on_scheduler(
                    Header(MsgType.PLAN), body), None, peers)
            elif item[0] == "peer":
                _, to, frm, h, payload = item
                self._divert_outs(to, self.servers[to].on_request(b"peer%d" % frm, h, payload),
                                  None, peers)
            elif item[0] == "reply":
                _, to, frm, h, payload = item
                self._divert_outs(to, self.servers[to].on_peer_reply(frm, h, payload), None,
                                  peers)
            else:
                _, to, h, payload = item
                self._divert_outs(to, self.servers[to].on_request(worker(h.sender), h, payload),
                                  h, peers)
        assert len(self.reports) == self.SERVERS, self.reports
        assert not any(k for k, _ in self.servers[slow].slots), "the slow server holds nothing"
        self._moved_on(new, "diverted")

    @invariant()
    def each_slice_is_updated_once_per_completed_round(self):
        for s in self.servers:
            for slot in s.slots.values():
                assert counts(s).get(slot.index, 0) == slot.applied, (s.rank, slot.key)


class DivertingWithAReplica(Diverting):
    """The same with MXPS_REPLICA=1: each server sends its buddy a slice's state after every
    round and answers the round's pulls once the buddy acknowledged it (delivered at once
    outside a divert, in a drawn order inside one).  The slow server sends no state; each
    successor asks the buddy for its replica of the workers' round, or has it as the buddy,
    and rebuilds a round no worker pulled yet from the pushes sent again.  The momentum and
    counts end as the reference's all the same."""

    def __init__(self):
        super().__init__()
        for s in self.servers:
            s.num_servers = self.SERVERS
            s._init_replicas(1)

    def _receive(self, server, request_header, outs):
        rest = []
        while outs:
            o = outs.pop(0)
            if o.to == Out.PEER and o.header.type == MsgType.REPLICA:
                frm = o.header.sender
                ack = only(self.servers[o.dest].on_request(b"peer%d" % frm, o.header,
                                                           o.payload), MsgType.ACK)
                outs += self.servers[frm].on_peer_reply(o.dest, ack.header)
            else:
                rest.append(o)
        super()._receive(server, request_header, rest)


FAST = settings(max_examples=25, stateful_step_count=25, deadline=None)

TestAnyInterleavingOfThreeWorkersGivesTheRoundSums = ThreeWorkers.TestCase
TestAnyInterleavingWithTheOptimizerOnTheServerGivesTheReferenceWeights = WithOptimizer.TestCase
TestAnyInterleavingWithReplansBetweenTwoServersGivesTheRoundSums = Migrating.TestCase
TestAnyInterleavingWithReplansMovesOptimizerStateAndCounts = MigratingWithOptimizer.TestCase
TestAnyInterleavingWithReplansMovesDiskTablesWithTheirState = MigratingOnDisk.TestCase
TestAnyInterleavingWithALostServerGivesTheReferenceWeights = FailingOver.TestCase
TestAnyInterleavingWithADivertedServerGivesTheReferenceWeights = Diverting.TestCase
TestAnyInterleavingWithADivertedServerAndAReplicaGivesTheReferenceWeights = \
    DivertingWithAReplica.TestCase
for _case in (TestAnyInterleavingWithALostServerGivesTheReferenceWeights,
              TestAnyInterleavingWithADivertedServerGivesTheReferenceWeights,TestAnyInterleavingOfThreeWorkersGivesTheRoundSums,
              TestAnyInterleavingWithTheOptimizerOnTheServerGivesTheReferenceWeights,
              TestAnyInterleavingWithReplansBetweenTwoServersGivesTheRoundSums,
              TestAnyInterleavingWithReplansMovesOptimizerStateAndCounts,
              TestAnyInterleavingWithReplansMovesDiskTablesWithTheirState):
    _case.settings = FAST
for _case in (TestAnyInterleavingWithADivertedServerGivesTheReferenceWeights,
              TestAnyInterleavingWithADivertedServerAndAReplicaGivesTheReferenceWeights):
    _case.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)


# --- divert: a slow server's slices leave it inside the round (MXPS_DIVERT) -----------------

SLOW_OLD = {5: (Slice(1, 0, 8),)}     # server 1 holds key 5 and turns slow ...
SLOW_NEW = {5: (Slice(0, 0, 8),)}     # ... its slice goes whole to server 0, mid-round


def divert_plan(s):
    body = json.dumps({"version": 1, "old": table_to_json(SLOW_OLD),
                       "new": table_to_json(SLOW_NEW), "lost": [], "diverted": [1]}).encode()
    return s.on_scheduler(Header(MsgType.PLAN), body)


def divert_seed(s, w, it, value):
    h, v = request(MsgType.SEED, 5, w=w, it=it, value=value, version=1)
    return s.on_request(worker(w), h, v)


def reports(outs):
    return [json.loads(o.payload) for o in outs if o.to == Out.SCHEDULER]


@pytest.mark.parametrize("pulled", [2, 1], ids=["workers-pulled-it", "replies-still-on-the-link"])
def test_a_diverted_slice_takes_weights_from_the_workers_and_state_from_the_slow_server(pulled):
    # Server 1 applied round 2 and holds worker 0's round-3 push when it is diverted.  It sends
    # server 0 the slice's momentum and count with a checksum of its weights (no weights),
    # drops its partial round, and drops old-plan requests for the slice without an answer.
    # If the workers pulled round 2 (``pulled`` 2), server 0 takes their weights; if no worker
    # has round 2 yet (its replies still on the slow link), server 0 asks server 1 for them
    # (VALUE), drops the round-2 pushes sent again and answers the round-2 pulls.  Round 3 ends
    # as on one server that was never diverted: momentum and all.
    opt = sgd(0.9)
    alone = new_server(optimizer=opt, keys={5: VALUE})
    push_rounds([(alone, OLD[5][0])], GRADS[:1])
    round1 = alone.slots[(5, 0)].store.snapshot.copy()
    push_rounds([(alone, OLD[5][0])], GRADS[1:2], first=2)
    round2 = alone.slots[(5, 0)].store.snapshot.copy()
    push_rounds([(alone, OLD[5][0])], GRADS[2:], first=3)
    s1 = new_server(rank=1, optimizer=opt, keys={5: VALUE}, num_servers=2, failover=True)
    push_rounds([(s1, SLOW_OLD[5][0])], GRADS[:2])
    only(send(s1, MsgType.PUSH, 5, w=0, it=3, value=GRADS[2][0]), MsgType.ACK)
    s0 = new_server(rank=0, optimizer=opt, num_servers=2, failover=True)
    assert divert_plan(s0) == []
    outs = divert_plan(s1)
    part = only(outs, MsgType.MIGRATE)
    assert part.to == Out.PEER and part.dest == 0 and (5, 0) not in s1.slots
    assert part.payload and len(bytes(memoryview(part.payload).cast("B"))) < 2 * 8 * 4 + 400
    # an old-plan request for the slice at the slow server: dropped, no answer
    assert send(s1, MsgType.PULL, 5, w=1, it=2, length=8, version=0) == []
    assert s1.diverted_dropped == 1
    ack = only(s0.on_request(b"peer1", part.header, part.payload), MsgType.ACK)
    assert reports(s1.on_peer_reply(0, ack.header)) == [
        {"version": 1, "moved_bytes": s1.migration.moved, "reset": []}]
    # the workers' seeds, their resent requests (waiting for the slice)
    seed = round2 if pulled == 2 else round1
    only(divert_seed(s0, 0, pulled, seed), MsgType.ACK)
    if pulled == 1:
        for w in (0, 1):
            only(resent_whole(s0, w, 2, GRADS[1][w]), MsgType.ACK)
        assert send(s0, MsgType.PULL, 5, w=1, it=2, length=8, version=1) == []
    outs = divert_seed(s0, 1, pulled, seed)
    if pulled == 1:
        value = only(outs, MsgType.VALUE)
        assert value.to == Out.PEER and value.dest == 1
        outs = s1.on_request(b"peer0", value.header, value.payload)
        whole = only(outs, MsgType.MIGRATE)
        ack = only(outs, MsgType.ACK)
        outs = s0.on_request(b"peer1", whole.header, whole.payload)
        np.testing.assert_array_equal(value_of(only(outs, MsgType.DATA)), round2)
        assert s0.resent_dropped == 2
        outs = s0.on_peer_reply(1, ack.header)
    assert reports(outs) == [{"version": 1, "moved_bytes": 0, "reset": []}]
    slot = s0.slots[(5, 0)]
    assert slot.applied == 2
    np.testing.assert_array_equal(slot.store.snapshot, round2)
    # round 3: worker 0's push acknowledged by the slow server comes again, worker 1's anew
    only(resent_whole(s0, 0, 3, GRADS[2][0]), MsgType.ACK)
    only(send(s0, MsgType.PUSH, 5, w=1, it=3, value=GRADS[2][1], version=1), MsgType.ACK)
    got = value_of(only(send(s0, MsgType.PULL, 5, it=3, length=8, version=1)))
    np.testing.assert_allclose(got, alone.slots[(5, 0)].store.snapshot, rtol=1e-6)


def resent_whole(s, w, it, g):
    h, v = request(MsgType.PUSH, 5, w=w, it=it, value=g, version=1)
    h.flags |= 0x40
    return s.on_request(worker(w), h, v)


def test_a_worker_seed_that_differs_from_the_slow_servers_weights_is_not_taken():
    # Gluon's BatchNorm running statistics: pulled once, changed by the forward pass on the
    # workers; the successor asks the slow server for the weights instead
    opt = sgd(0.9)
    s1 = new_server(rank=1, optimizer=opt, keys={5: VALUE}, num_servers=2, failover=True)
    push_rounds([(s1, SLOW_OLD[5][0])], GRADS[:1])
    want = s1.slots[(5, 0)].store.snapshot.copy()
    s0 = new_server(rank=0, optimizer=opt, num_servers=2, failover=True)
    divert_plan(s0)
    part = only(divert_plan(s1), MsgType.MIGRATE)
    s0.on_request(b"peer1", part.header, part.payload)
    only(divert_seed(s0, 0, 1, VALUE + 1), MsgType.ACK)
    value = only(divert_seed(s0, 1, 1, VALUE + 1), MsgType.VALUE)
    outs = s1.on_request(b"peer0", value.header, value.payload)
    s0.on_request(b"peer1", only(outs, MsgType.MIGRATE).header,
                  only(outs, MsgType.MIGRATE).payload)
    assert reports(s0.on_peer_reply(1, only(outs, MsgType.ACK).header)) == [
        {"version": 1, "moved_bytes": 0, "reset": []}]
    np.testing.assert_array_equal(s0.slots[(5, 0)].store.snapshot, want)


# --- divert with a replica: the state need not leave the slow server (MXPS_REPLICA) ----------

def replicated_rounds(s, buddy, rounds):
    """Rounds of key 5 on server ``s`` (MXPS_REPLICA): each round's state to ``buddy``, which
    acknowledges it, so that the round's pulls may be answered."""
    for it in rounds:
        for w in (0, 1):
            outs = send(s, MsgType.PUSH, 5, w=w, it=it, value=GRADS[it - 1][w],
                        version=s.plan_version)
        for rep in [o for o in outs if o.to == Out.PEER]:
            assert rep.header.type == MsgType.REPLICA and rep.dest == buddy.rank
            ack = only(buddy.on_request(b"peer%d" % s.rank, rep.header, rep.payload),
                       MsgType.ACK)
            s.on_peer_reply(buddy.rank, ack.header)


def settle(outs, servers):
    """Deliver every REPLICA in ``outs`` to its server and its ACK back; the other Outs."""
    rest = []
    while outs:
        o = outs.pop(0)
        if o.to == Out.PEER and o.header.type == MsgType.REPLICA:
            sender = o.header.sender
            ack = only(servers[o.dest].on_request(b"peer%d" % sender, o.header, o.payload),
                       MsgType.ACK)
            outs += servers[sender].on_peer_reply(o.dest, ack.header)
        else:
            rest.append(o)
    return rest


def divert_with_replica(servers, replica, deliver=True, applied=2):
    """Server 1 (slow) applied rounds 1 to ``applied`` of key 5 with momentum, its buddy
    holding their state (``deliver``: else the buddy never got it, though server 1 took its
    acks), and holds worker 0's next push when it is diverted to server 0.  Returns (alone,
    s0, s1, buddy, the part server 1 sent)."""
    opt = sgd(0.9)
    alone = new_server(optimizer=opt, keys={5: VALUE})
    push_rounds([(alone, OLD[5][0])], GRADS)
    s1 = new_server(rank=1, optimizer=opt, keys={5: VALUE}, num_servers=servers,
                    replica=replica, failover=True)
    s0 = new_server(rank=0, optimizer=opt, num_servers=servers, replica=replica, failover=True)
    buddy = s0 if servers == 2 else new_server(rank=2, optimizer=opt, num_servers=servers,
                                               replica=replica, failover=True)
    assert s1.buddy() == buddy.rank
    replicated_rounds(s1, buddy if deliver else new_server(rank=buddy.rank, optimizer=opt,
                                                           num_servers=servers),
                      range(1, applied + 1))
    if applied < len(GRADS):
        only(send(s1, MsgType.PUSH, 5, w=0, it=applied + 1, value=GRADS[applied][0]),
             MsgType.ACK)
    assert divert_plan(s0) == []              # it waits for the slice
    if buddy is not s0:                        # nothing moves to or from it: in place at once
        assert [r["version"] for r in reports(divert_plan(buddy))] == [1]
    part = only(divert_plan(s1), MsgType.MIGRATE)
    return alone, s0, s1, buddy, part


def seeds_then_state(s0, buddy, round_, weights, peers):
    """Both workers' seeds of the diverted slice (of ``round_``); then, if the buddy is
    another server, the successor's STATE to it and its answer.  The Outs after the last."""
    only(divert_seed(s0, 0, round_, weights), MsgType.ACK)
    outs = settle(divert_seed(s0, 1, round_, weights), peers)
    if buddy is not s0:
        ask = only(outs, MsgType.STATE)
        assert ask.to == Out.PEER and ask.dest == buddy.rank and ask.header.iteration == round_
        reply = only(buddy.on_request(b"peer0", ask.header, ask.payload), MsgType.DATA)
        outs = settle(s0.on_peer_reply(buddy.rank, reply.header, reply.payload), peers)
    return outs


def round3_ends_as_alone(s0, alone, peers, resent_from=(0,)):
    """Round 3 on the successor: worker 0's push (and those in ``resent_from``) sent again,
    the rest anew; the pull gets the weights of one server that was never diverted."""
    for w in (0, 1):
        if w in resent_from:
            settle(resent_whole(s0, w, 3, GRADS[2][w]), peers)
        else:
            settle(send(s0, MsgType.PUSH, 5, w=w, it=3, value=GRADS[2][w], version=1), peers)
    outs = settle(send(s0, MsgType.PULL, 5, it=3, length=8, version=1), peers)
    np.testing.assert_allclose(value_of(only(outs, MsgType.DATA)),
                               alone.slots[(5, 0)].store.snapshot, rtol=1e-6)


@pytest.mark.parametrize("servers", [3, 2], ids=["buddy-is-a-third-server",
                                                 "successor-is-the-buddy"])
def test_with_a_replica_a_diverted_slice_takes_its_state_from_the_buddy(servers):
    # MXPS_REPLICA=1 and MXPS_DIVERT: server 1's part carries neither weights nor state; the
    # successor takes the weights from the workers and the state of their round from the
    # buddy (a STATE request, or its own replica when it is the buddy), and round 3 ends as
    # on one server that was never diverted, momentum and all
    alone, s0, s1, buddy, part = divert_with_replica(servers, replica=1)
    body = typed.unpack(part.payload)
    assert "state" not in body and "value" not in body and body["replica"] == 2
    assert len(bytes(memoryview(part.payload).cast("B"))) < 400
    only(s0.on_request(b"peer1", part.header, part.payload), MsgType.ACK)
    peers = {0: s0, 1: s1, 2: buddy}
    outs = seeds_then_state(s0, buddy, 2, s1.stash[(5, 0)]["value"], peers)
    assert reports(outs) == [{"version": 1, "moved_bytes": 0, "reset": []}]
    assert s0.slots[(5, 0)].applied == 2
    round3_ends_as_alone(s0, alone, peers)


def test_with_a_replica_a_round_no_worker_pulled_comes_whole_from_the_slow_server():
    # server 1 applied round 3 (both workers' pushes) but its replies are still on the slow
    # link: the workers hold round 2.  The buddy's state is not used: the successor asks the
    # slow server for the slice whole (VALUE), its weights and state of round 3, drops the
    # round-3 pushes sent again, and answers the round-3 pull exactly
    alone, s0, s1, buddy, part = divert_with_replica(3, replica=1, applied=3)
    assert typed.unpack(part.payload)["applied"] == 3
    only(s0.on_request(b"peer1", part.header, part.payload), MsgType.ACK)
    round2 = alone_after(2)
    only(divert_seed(s0, 0, 2, round2), MsgType.ACK)
    value = only(divert_seed(s0, 1, 2, round2), MsgType.VALUE)
    assert value.dest == 1
    peers = {0: s0, 1: s1, 2: buddy}
    whole_from_the_slow_server(s0, s1, value, peers)
    assert s0.slots[(5, 0)].applied == 3
    for w in (0, 1):
        only(resent_whole(s0, w, 3, GRADS[2][w]), MsgType.ACK)
    assert s0.resent_dropped == 2
    outs = settle(send(s0, MsgType.PULL, 5, it=3, length=8, version=1), peers)
    np.testing.assert_allclose(value_of(only(outs, MsgType.DATA)),
                               alone.slots[(5, 0)].store.snapshot, rtol=1e-6)


def whole_from_the_slow_server(s0, s1, value, peers):
    """Server 1 answers server 0's VALUE with the slice whole; server 0 builds it, and the
    divert is in place there."""
    outs = s1.on_request(b"peer0", value.header, value.payload)
    part = only(outs, MsgType.MIGRATE)
    settle(s0.on_request(b"peer1", part.header, part.payload), peers)
    assert reports(settle(s0.on_peer_reply(1, only(outs, MsgType.ACK).header), peers)) == [
        {"version": 1, "moved_bytes": 0, "reset": []}]


def alone_after(rounds):
    """Key 5's weights on one server after ``rounds`` rounds of GRADS (SGD, momentum 0.9)."""
    s = new_server(optimizer=sgd(0.9), keys={5: VALUE})
    push_rounds([(s, OLD[5][0])], GRADS[:rounds])
    return s.slots[(5, 0)].store.snapshot.copy()


def test_a_diverted_slice_whose_replica_the_buddy_lacks_comes_whole_from_the_slow_server():
    # the buddy answers STATE with an ACK (no replica of that round): the successor asks the
    # slow server for the slice whole (VALUE), state included, and round 3 ends exactly
    alone, s0, s1, buddy, part = divert_with_replica(3, replica=1, deliver=False)
    only(s0.on_request(b"peer1", part.header, part.payload), MsgType.ACK)
    round2 = s1.stash[(5, 0)]["value"]
    only(divert_seed(s0, 0, 2, round2), MsgType.ACK)
    ask = only(divert_seed(s0, 1, 2, round2), MsgType.STATE)
    none = only(buddy.on_request(b"peer0", ask.header, ask.payload), MsgType.ACK)
    value = only(s0.on_peer_reply(2, none.header, none.payload), MsgType.VALUE)
    peers = {0: s0, 1: s1, 2: buddy}
    whole_from_the_slow_server(s0, s1, value, peers)
    round3_ends_as_alone(s0, alone, peers)


def test_with_a_lazy_replica_a_diverted_slice_takes_stale_state_and_the_job_is_told():
    # MXPS_REPLICA=2: the buddy holds round 2's momentum; server 1 applied round 3 when
    # diverted: the successor (the buddy) builds the slice with that momentum, one round old,
    # the count of round 3, and reports the slice as stale
    opt = sgd(0.9)
    s1 = new_server(rank=1, optimizer=opt, keys={5: VALUE}, num_servers=2, replica=2,
                    failover=True)
    s0 = new_server(rank=0, optimizer=opt, num_servers=2, replica=2, failover=True)
    replicated_rounds(s1, s0, (1, 2, 3))
    assert sorted(s0.replicas[(5, 0, 8)]) == [2] and s1.slots[(5, 0)].replicated == 2
    divert_plan(s0)
    part = only(divert_plan(s1), MsgType.MIGRATE)
    assert typed.unpack(part.payload)["replica"] == 2
    s0.on_request(b"peer1", part.header, part.payload)
    round3 = s1.stash[(5, 0)]["value"]
    only(divert_seed(s0, 0, 3, round3), MsgType.ACK)
    outs = divert_seed(s0, 1, 3, round3)
    assert reports(outs) == [{"version": 1, "moved_bytes": 0, "reset": [],
                              "stale": [[5, 0, 8, 1]]}]
    slot = s0.slots[(5, 0)]
    assert slot.applied == 3 and counts(s0)[5] == 3
    np.testing.assert_array_equal(slot.store.snapshot, round3)
    np.testing.assert_array_equal(
        s0.updater.states[slot.index].asnumpy(), s0.replicas[(5, 0, 8)][2][0])


def test_a_state_request_with_a_payload_is_refused_naming_it():
    s = new_server(rank=2, optimizer=sgd(0.9), num_servers=3, replica=1, failover=True)
    h, v = request(MsgType.STATE, 5, w=1, it=2, length=8, value=VALUE)
    assert "STATE of key 5 from server 1 carries 32 bytes" in error_text(
        s.on_request(b"peer1", h, v))
