"""Train a small model on scikit-learn's digits to convergence and report its test accuracy
(LTP's accuracy study, ``mxps_tools.study_ltp``; tests/test_study_ltp.py).

Run it as every node of a job (``mxps_tools.jobs.Job`` / tests/cluster.py's ``run_job``): on a
scheduler or server node the import of mxps takes the role over and the training code is never
reached.  Every worker trains on its own shard of one fixed training split, from the same
initial weights, and evaluates the model it ends with on the fixed test split.

Environment:
  DIGITS_OUT       directory; every worker writes ``rank<R>.json`` (below).  Required.
  DIGITS_KVSTORE   kvstore name (default mxps; names starting with "mxps" import mxps before
                   mxnet).  The transport is mxps's business: MXPS_PUSH=tcp|ltp and friends.
  DIGITS_MODEL     mlp (64-128-64-10, ReLU) or cnn (8x8x1 -> conv 3x3 x16 (pad 1, ReLU) ->
                   max-pool 2 -> dense 64 (ReLU) -> dense 10).  Default mlp.
  DIGITS_EPOCHS    passes over the training split (default 20).
  DIGITS_BATCH     samples per worker per step (default 16).
  DIGITS_LR        base learning rate (default 0.03), on the *sum* of the workers' mean
                   gradients (MXNet's dist_sync semantics: Trainer.step(batch) rescales by
                   1/batch per worker and the kvstore adds the workers up); a cosine schedule
                   takes it to 0 at the last step, so the final accuracy is that of a model that
                   has settled, not a snapshot of a noisy trajectory.
  DIGITS_MOMENTUM  SGD momentum (default 0.9); weight decay 1e-4.
  DIGITS_SCHEDULE  cosine (default, above) or constant (the base rate throughout: a schedule
                   counts the servers' updates, and dist_async makes W times more of them).
  DIGITS_SLOW      "rank:seconds": that worker sleeps that long in every step, before its
                   push; "rank:Fx": it sleeps F - 1 times its own forward and backward time
                   of that step, so its compute takes F times as long (a straggler; WSP's
                   study, mxps_tools.study_wsp).
  DIGITS_SEED      the seed of the initial weights and of every epoch's shuffling of each
                   worker's shard (default 1); the transport's own randomness (MXPS_LTP_SEED)
                   is set by the caller.

The split: ``train_test_split(test_size=0.25, stratify=y, random_state=0)`` of the 1797 digits
(1347 train, 450 test), features scaled to [0, 1]; it never depends on DIGITS_SEED.  Worker r
of W owns training samples r, r + W, ...; each epoch it shuffles them (seeded by DIGITS_SEED,
the epoch and r) and takes ``steps * batch`` of them, ``steps = (1347 // W) // batch`` the same
for every worker (a synchronous job needs the same number of pushes from each).

``rank<R>.json``: rank, num_workers, kvstore type, model, settings, parameter shapes and
bytes, per-epoch test accuracy and mean training loss, the final test accuracy, the number of
test samples, a SHA-256 of the final weights (every worker of a synchronous job must end
with the same), training seconds, and the file of the ``mxps`` package it imported (the study
checks that it ran the code it meant to).
"""
import hashlib
import json
import os
import sys
import time

KVSTORE = os.environ.get("DIGITS_KVSTORE", "mxps")
if KVSTORE.startswith("mxps"):
    import mxps  # noqa: F401  (must precede mxnet: takes over server/scheduler roles)

import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402

MODELS = ("mlp", "cnn")
TEST_FRACTION = 0.25
SPLIT_SEED = 0


def _setting(name, kind, default):
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return kind(value)
    except ValueError:
        raise SystemExit("%s=%r is not a%s %s" % (name, value, "n" if kind is int else "",
                                                   kind.__name__)) from None


def settings():
    """The job's settings from the environment, checked (a bad one names itself)."""
    s = {"out": os.environ.get("DIGITS_OUT", ""), "model": os.environ.get("DIGITS_MODEL", "mlp"),
         "epochs": _setting("DIGITS_EPOCHS", int, 20), "batch": _setting("DIGITS_BATCH", int, 16),
         "lr": _setting("DIGITS_LR", float, 0.03),
         "momentum": _setting("DIGITS_MOMENTUM", float, 0.9),
         "seed": _setting("DIGITS_SEED", int, 1), "kvstore": KVSTORE,
         "schedule": os.environ.get("DIGITS_SCHEDULE", "cosine") or "cosine",
         "slow": os.environ.get("DIGITS_SLOW", "")}
    if s["schedule"] not in ("cosine", "constant"):
        raise SystemExit("DIGITS_SCHEDULE must be cosine or constant, got %r" % s["schedule"])
    if s["slow"]:
        try:
            rank, amount = s["slow"].split(":")
            factor = amount.endswith("x")
            value = float(amount[:-1] if factor else amount)
            if value < (1 if factor else 0):
                raise ValueError(amount)
            s["slow"] = (int(rank), value, factor)
        except ValueError:
            raise SystemExit("DIGITS_SLOW must be rank:seconds or rank:Fx (F >= 1), got %r"
                             % s["slow"]) from None
    if not s["out"]:
        raise SystemExit("DIGITS_OUT must name the output directory")
    if s["model"] not in MODELS:
        raise SystemExit("DIGITS_MODEL must be one of %s, got %r" % (", ".join(MODELS), s["model"]))
    if s["epochs"] < 1 or s["batch"] < 1:
        raise SystemExit("DIGITS_EPOCHS and DIGITS_BATCH must be at least 1, got %d and %d"
                         % (s["epochs"], s["batch"]))
    return s


def load_split():
    """(x_train, y_train, x_test, y_test): the fixed split, features in [0, 1]."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    y = y.astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=TEST_FRACTION, stratify=y,
                                          random_state=SPLIT_SEED)
    return xtr, ytr, xte, yte


def build(model):
    """The network (uninitialised) and the shape its input takes."""
    net = gluon.nn.HybridSequential(prefix="digits_")
    with net.name_scope():
        if model == "mlp":
            net.add(gluon.nn.Dense(128, activation="relu", in_units=64),
                    gluon.nn.Dense(64, activation="relu", in_units=128),
                    gluon.nn.Dense(10, in_units=64))
            return net, (-1, 64)
        net.add(gluon.nn.Conv2D(16, 3, padding=1, activation="relu", in_channels=1),
                gluon.nn.MaxPool2D(2), gluon.nn.Flatten(),
                gluon.nn.Dense(64, activation="relu", in_units=16 * 4 * 4),
                gluon.nn.Dense(10, in_units=64))
    return net, (-1, 1, 8, 8)


def epoch_batches(n_train, rank, workers, steps, batch, seed, epoch):
    """Indices into the training split for this worker's steps of one epoch: (steps, batch)."""
    own = np.arange(rank, n_train, workers)
    order = np.random.RandomState([seed, epoch, rank]).permutation(len(own))
    return own[order][:steps * batch].reshape(steps, batch)


def digest(weights):
    """SHA-256 of every parameter's bytes, by name: equal iff the weights are identical."""
    h = hashlib.sha256()
    for name in sorted(weights):
        h.update(name.encode())
        h.update(np.ascontiguousarray(weights[name]).tobytes())
    return h.hexdigest()


def accuracy(net, x, y, shape):
    pred = net(mx.nd.array(x).reshape(shape)).argmax(axis=1).asnumpy()
    return float((pred == y).mean())


def train(s):
    mx.random.seed(s["seed"])
    np.random.seed(s["seed"])
    xtr, ytr, xte, yte = load_split()
    net, shape = build(s["model"])
    net.initialize(mx.init.Xavier(magnitude=2.0))
    net.hybridize()
    params = net.collect_params()
    kv = mx.kv.create(s["kvstore"])
    rank, workers = kv.rank, kv.num_workers
    steps = (len(ytr) // workers) // s["batch"]
    if steps < 1:
        raise SystemExit("%d training samples over %d workers do not fill one batch of %d"
                         % (len(ytr), workers, s["batch"]))
    opt = {"learning_rate": s["lr"], "momentum": s["momentum"], "wd": 1e-4}
    if s["schedule"] == "cosine":
        opt["lr_scheduler"] = mx.lr_scheduler.CosineScheduler(
            max_update=steps * s["epochs"], base_lr=s["lr"], final_lr=0.0)
    trainer = gluon.Trainer(params, "sgd", opt, kvstore=kv)
    slow = s["slow"][1:] if s["slow"] and s["slow"][0] == rank else None
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    curve, losses, ends, compute = [], [], [], []
    start_wall = time.time()
    t0 = time.perf_counter()
    for epoch in range(s["epochs"]):
        batches = epoch_batches(len(ytr), rank, workers, steps, s["batch"], s["seed"], epoch)
        total = 0.0
        for idx in batches:
            mx.nd.waitall()             # the last step's pulls: not this step's compute
            c0 = time.perf_counter()
            data = mx.nd.array(xtr[idx]).reshape(shape)
            with autograd.record():
                loss = loss_fn(net(data), mx.nd.array(ytr[idx]))
            loss.backward()
            mx.nd.waitall()
            compute.append(time.perf_counter() - c0)
            if slow:
                value, factor = slow
                time.sleep((value - 1) * compute[-1] if factor else value)
            trainer.step(s["batch"])
            total += float(loss.mean().asscalar())
        losses.append(total / steps)
        curve.append(accuracy(net, xte, yte, shape))
        ends.append(time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    weights = {name: p.data().asnumpy() for name, p in params.items()}
    return {
        "rank": rank, "num_workers": workers, "kvstore_type": kv.type,
        "update_on_kvstore": trainer._update_on_kvstore,
        "settings": {k: v for k, v in s.items() if k != "out"},
        "steps_per_epoch": steps, "train_samples": len(ytr), "test_samples": len(yte),
        "params": {n: {"shape": list(w.shape), "bytes": int(w.nbytes)}
                   for n, w in weights.items()},
        "test_accuracy": curve, "train_loss": losses, "final_accuracy": curve[-1],
        "weights_sha256": digest(weights),
        "train_seconds": seconds, "epoch_end_seconds": ends, "start_wall": start_wall,
        "compute_seconds_median": float(np.median(compute)),
        "mxps_file": getattr(sys.modules.get("mxps"), "__file__", None),
    }


def main():
    s = settings()
    result = train(s)
    os.makedirs(s["out"], exist_ok=True)
    path = os.path.join(s["out"], "rank%d.json" % result["rank"])
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(path + ".tmp", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
