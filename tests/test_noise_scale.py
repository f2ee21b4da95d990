"""The noise study's synchronous SGD emulated in one process (mxps_tools.noise_scale): the
sharding, the update (the sum of the workers' mean gradients, i.e. plain SGD with lr x W on the
concatenated minibatch), the two ways of forming the sum, and a tiny grid end to end.  No
processes: everything runs in this one."""
import json
import os

import numpy as np
import pytest

mx = pytest.importorskip("mxnet")
from mxnet import autograd, gluon  # noqa: E402

from mxps_tools import noise, noise_scale as ns  # noqa: E402

N = 1347           # digits' training samples (noise.digits_split)


@pytest.fixture(scope="module")
def split():
    s, _ = ns.load_split("digits", "random", 20.0, 3)
    return s


# --------------------------------------------------------------------------- bookkeeping

@pytest.mark.parametrize("workers", [1, 2, 3, 8, 64])
def test_each_worker_draws_its_own_shard_as_noise_job_does(workers):
    b = 16
    steps = (N // workers) // b
    assert ns.steps_per_epoch(N, workers, b) == steps
    for epoch in (0, 1):
        got = ns.shard_batches(N, workers, b, 7, epoch)
        assert got.shape == (steps, workers, b)
        for r in range(workers):
            mine = got[:, r, :].reshape(-1)
            assert np.all(mine % workers == r)                     # only its shard
            assert len(set(mine.tolist())) == steps * b            # no sample twice
            own = np.arange(r, N, workers)                         # noise_job's lines
            order = own[np.random.RandomState([7, epoch, r]).permutation(len(own))]
            assert np.array_equal(got[:, r, :], order[:steps * b].reshape(steps, b))
    assert not np.array_equal(ns.shard_batches(N, workers, b, 7, 0),
                              ns.shard_batches(N, workers, b, 7, 1))


def test_sixty_four_workers_of_sixteen_leave_one_step_per_epoch():
    assert [ns.steps_per_epoch(N, w, 16) for w in ns.WORKERS] == [84, 42, 21, 10, 5, 2, 1]
    with pytest.raises(ValueError, match="do not fill one batch"):
        ns.Emulator(noise.Split(*(a[:100] for a in noise.load("digits"))), 8, 1,
                    ns.Settings())


def test_the_emulator_feeds_every_round_one_minibatch_per_worker_from_its_shard(split,
                                                                               monkeypatch):
    em = ns.Emulator(split, 4, 2, ns.Settings(max_epochs=2, evals_per_epoch=5))
    seen = []
    real_step = ns.Emulator.step
    monkeypatch.setattr(ns.Emulator, "step",
                        lambda self, idx: (seen.append(idx.copy()), real_step(self, idx))[1])
    rec = em.run()
    assert rec["steps_per_epoch"] == 21 and rec["steps"] == 42 and len(seen) == 42
    for epoch in (0, 1):
        assert np.array_equal(np.stack(seen[21 * epoch:21 * (epoch + 1)]),
                              ns.shard_batches(N, 4, 16, 2, epoch))
    # evaluations: step 0, every max(1, 21 // 5) = 4 steps, and every epoch end
    assert rec["eval_every"] == 4
    assert [s for s, _ in rec["curve"]] == [0, 4, 8, 12, 16, 20, 21, 25, 29, 33, 37, 41, 42]
    assert rec["epoch_accuracy"] == [rec["curve"][6][1], rec["curve"][-1][1]]


def test_steps_to_target_is_the_first_evaluation_at_or_above_it():
    curve = [[0, 0.1], [4, 0.79], [8, 0.85], [12, 0.84], [16, 0.91]]
    assert ns.first_reached(curve, 0.85) == 8
    assert ns.first_reached(curve, 0.9) == 16
    assert ns.first_reached(curve, 0.95) is None


# --------------------------------------------------------------------------- the update

def _weights(net):
    params = net.collect_params()
    return {k: params[k].data().asnumpy() for k in sorted(params.keys())}


def _plain_sgd(split, idx_rounds, lr, batch):
    """Plain SGD (Gluon's Trainer, no kvstore) on each round's concatenated minibatches."""
    net = ns.build_net(5, split.x_train)
    tr = gluon.Trainer(net.collect_params(), "sgd",
                       {"learning_rate": lr, "momentum": 0.9, "wd": 1e-4}, kvstore=None)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    for idx in idx_rounds:
        flat = idx.reshape(-1)
        with autograd.record():
            loss = loss_fn(net(mx.nd.array(split.x_train[flat])),
                           mx.nd.array(split.y_train[flat]))
        loss.backward()
        tr.step(len(flat))                  # the mean gradient of the W x batch samples
    return _weights(net)


@pytest.mark.parametrize("mode", ["workers", "concat"])
@pytest.mark.parametrize("workers", [2, 3])
def test_a_round_of_w_workers_is_plain_sgd_on_their_minibatches_with_lr_times_w(
        split, mode, workers):
    s = ns.Settings(mode=mode)
    em = ns.Emulator(split, workers, 5, s)
    start = em.weights()
    rounds = list(em.batches(0)[:3])
    for idx in rounds:
        em.step(idx)
    got = em.weights()
    want = _plain_sgd(split, rounds, s.lr * workers, s.batch)
    assert any(np.abs(got[k] - start[k]).max() > 1e-3 for k in got)        # it did move
    for k in got:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-6, err_msg=k)
    # the control: the learning rate without x W is measurably another update
    other = _plain_sgd(split, rounds, s.lr, s.batch)
    assert max(np.abs(got[k] - other[k]).max() for k in got) > 1e-3


def test_summing_the_workers_gradients_and_one_concatenated_backward_agree(split):
    recs = {}
    for mode in ("workers", "concat"):
        em = ns.Emulator(split, 4, 1, ns.Settings(mode=mode, max_epochs=1))
        recs[mode] = (em.run(), em.weights())
    (a, wa), (b, wb) = recs["workers"], recs["concat"]
    for k in wa:
        np.testing.assert_allclose(wa[k], wb[k], rtol=1e-3, atol=1e-5)
    assert abs(a["final"] - b["final"]) <= 2 / 450
    assert a["train_loss_worker0"] == pytest.approx(b["train_loss_worker0"], rel=1e-4)


def test_the_initial_weights_are_the_jobs_and_the_model_file_is_gluons_key_order(split):
    net = ns.build_net(1, split.x_train)
    again = ns.build_net(1, split.x_train)
    other = ns.build_net(2, split.x_train)
    w1, w2, w3 = _weights(net), _weights(again), _weights(other)
    assert all(np.array_equal(w1[k], w2[k]) for k in w1)
    assert not np.array_equal(w1["noise_dense0_weight"], w3["noise_dense0_weight"])
    m = ns.model_json(net)
    assert m["keys"] == [128, 128 * 64, 64, 64 * 128, 10, 10 * 64]    # sorted names: bias first
    assert m["layer"] == [1, 0, 3, 2, 5, 4]


# --------------------------------------------------------------------------- a tiny grid

def test_a_tiny_grid_gives_steps_and_time_to_target(tmp_path):
    out = str(tmp_path / "grid")
    s = ns.Settings(max_epochs=2, targets=(0.5, 0.99))
    logs = []
    summ = ns.run_grid(out, cells=[("none", 0.0), ("cross", 40.0)], workers=[1, 2],
                       seeds=[1], s=s, jobs=1, target=0.5, compute_s=0.0015,
                       log=logs.append)
    rows = {(r["cell"], r["workers"], r["target"]): r for r in summ["aggregates"]["rows"]}
    assert len(rows) == 2 * 2 * 2
    for cell in ("none", "cross 40%"):
        for w in (1, 2):
            r = rows[(cell, w, 0.5)]
            assert isinstance(r["steps_median"], int) and 0 < r["steps_median"] <= 2 * (84 // w)
            for name in ns.SYSTEMS:
                t = r["tta"][name]
                assert t["step_s"] > 0
                assert t["median_s"] == pytest.approx(r["steps_median"] * t["step_s"])
            never = rows[(cell, w, 0.99)]
            assert never["steps_median"] is None and never["reached"] == 0
    for name in ns.SYSTEMS:
        assert summ["step_times"]["2"][name] > 0
    assert summ["compute"]["used_s"] == 0.0015
    assert len(summ["compute"]["simulator"]["sha256"]) == 64
    c = ns.measure_compute(16, blocks=2, per_block=20, warmup=5)
    assert 0 < c["median_s"] == min(c["block_medians_s"]) and c["repeats"] == 40
    for f in ("runs.jsonl", "noise_scale.json", "noise_scale.md", "steps_to_target.png",
              "time_to_accuracy.png", "digits-mlp.json"):
        assert os.path.getsize(os.path.join(out, f)) > 0
    with open(os.path.join(out, "noise_scale.json")) as f:
        saved = json.load(f)
    assert len(saved["runs"]) == 4 and all(r["curve"] for r in saved["runs"])
    md = open(os.path.join(out, "noise_scale.md")).read()
    assert "| cross 40% |" in md and "never (0/1)" in md
    # a rerun with the same settings runs nothing again
    again = ns.run_grid(out, cells=[("none", 0.0), ("cross", 40.0)], workers=[1, 2],
                        seeds=[1], s=s, jobs=1, target=0.5, simulate=False, plots=False,
                        log=logs.append)
    assert any("4 runs (4 recorded already)" in line for line in logs)
    assert [r["steps_to"] for r in again["runs"]] == [r["steps_to"] for r in summ["runs"]]
