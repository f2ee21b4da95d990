"""save_optimizer_states / load_optimizer_states round-trip through the servers.

Training 0..10 in one job must equal training 0..5, saving parameters and the Trainer's states
(momentum / Adam moments and update counts, gathered from every server's slices), then starting
a new job that loads both and trains 5..10.  If the states were lost, misplaced between slices
or not restored on the servers, the momentum (Adam: moments and bias correction) would differ
and so would the weights.  Also: the saved file is MXNet's own Updater format, so states saved
with the update on the servers load into a Trainer that updates on the workers.
"""
import os
import pickle

import mxnet as mx
import numpy as np
import pytest

import cluster

JOB = os.path.join(cluster.JOBS_DIR, "states_job.py")


def _run(tmp, name, start, stop, load="", opt="adam", uok=True, servers=2, load_states=True,
         bound=64):
    out = str(tmp / name)
    r = cluster.run_job([JOB], num_workers=2, num_servers=servers, timeout=240, env={
        "STATES_KVSTORE": "mxps", "STATES_OPTIMIZER": opt, "STATES_START": start,
        "STATES_STOP": stop, "STATES_LOAD": load, "STATES_OUT": out,
        "STATES_UPDATE_ON_KVSTORE": "1" if uok else "0",
        "STATES_LOAD_STATES": "1" if load_states else "0",
        # a 16x8 weight: cut over both servers, so every state is gathered from two slices
        "MXNET_KVSTORE_BIGARRAY_BOUND": bound})
    r.raise_for_failure()
    return out


# bound 64: the weight is cut over both servers (server 1's part has its own optimizer index);
# 10**6: every key whole, the weight on the server whose optimizer is not the one saved (its
# update counts must still come back)
@pytest.mark.parametrize("opt,bound", [("adam", 64), ("sgd", 10 ** 6)])
def test_training_resumed_from_saved_states_matches_uninterrupted_training(tmp_path, opt,
                                                                           bound):
    straight = _run(tmp_path, "straight", 0, 10, opt=opt, bound=bound)
    first = _run(tmp_path, "first", 0, 5, opt=opt, bound=bound)
    resumed = _run(tmp_path, "resumed", 5, 10, load=first, opt=opt, bound=bound)
    for rank in (0, 1):
        a = dict(np.load(os.path.join(straight, "weights_rank%d.npz" % rank)))
        b = dict(np.load(os.path.join(resumed, "weights_rank%d.npz" % rank)))
        cluster.assert_weights_close(b, a, rtol=1e-5, what="resumed vs straight (%s)" % opt)
    # and the states matter: resuming with fresh optimizer states gives other weights
    fresh = _run(tmp_path, "fresh", 5, 10, load=first, opt=opt, load_states=False, bound=bound)
    a = dict(np.load(os.path.join(straight, "weights_rank0.npz")))
    c = dict(np.load(os.path.join(fresh, "weights_rank0.npz")))
    assert max(cluster.relative_difference(c, a).values()) > 1e-3


def test_saved_states_are_mxnet_updater_format_with_full_shapes_and_counts(tmp_path):
    first = _run(tmp_path, "first", 0, 5, opt="adam")
    with open(os.path.join(first, "trainer.states"), "rb") as f:
        states, optimizer = pickle.loads(f.read())
    assert isinstance(optimizer, mx.optimizer.Adam)
    assert sorted(states) == [0, 1]                     # weight and bias of the Dense layer
    shapes = sorted(tuple(m.shape) for m, v in states.values())
    assert shapes == [(16,), (16, 8)]                   # whole arrays, joined from two slices
    wkey = [k for k, (m, v) in states.items() if m.shape == (16, 8)][0]
    mean, var = states[wkey]
    assert var.shape == (16, 8)
    assert float(mx.nd.abs(mean).sum().asscalar()) > 0
    assert optimizer._index_update_count == {0: 5, 1: 5}
    # loads into a Trainer that updates on the workers (MXNet's own Updater.set_states)
    updater = mx.optimizer.get_updater(mx.optimizer.Adam())
    with open(os.path.join(first, "trainer.states"), "rb") as f:
        updater.set_states(f.read())
    np.testing.assert_array_equal(updater.states[wkey][0].asnumpy(), mean.asnumpy())
