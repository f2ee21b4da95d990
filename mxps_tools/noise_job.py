"""One node of a noise-study run (``mxps study noise``, mxps_tools.study_noise).

Run as every node of a job (``mxps_tools.jobs.Job``); on a scheduler or server node the import
of mxps takes the role over and the training code is never reached::

    python -m mxps_tools.noise_job --out DIR --kind cross --ratio 0.2 --kvstore mxps

Every worker loads the same split (``mxps_tools.noise.load``), applies the same noise to the
training labels (``noise.noisy_split``: the noise seed and the pairing seed are settings, so
every worker holds the same noisy labels) and trains on its own shard: worker r of W owns
training samples r, r + W, ...; each epoch it shuffles them (seeded by --seed, the epoch and r)
and takes ``steps * batch``, ``steps = (n_train // W) // batch`` the same for every worker.

Communication, ``--sync-every k``:

- k = 1: MXNet's own data-parallel SGD through the kvstore (``gluon.Trainer(kvstore=kv)``; for
  ``mxps`` the servers sum the workers' gradients and run the optimizer, dist_sync semantics:
  the learning rate applies to the sum of the workers' mean gradients; ``mxps_async`` applies
  every push on arrival; ``mxps_wsp`` runs WSP rounds).
- k > 1 (``mxps`` only): local SGD with periodic model averaging.  Each worker updates its own
  copy of the model (its own optimizer and momentum) with learning rate ``lr * W``, and after
  every k-th step and at every epoch's end pushes its weights, pulls the servers' sum (no
  optimizer on the servers: a synchronous round's sum is the stored value) and divides it by W.
  With ``lr * W`` on each worker's mean gradient, averaging after every step would be exactly
  the k = 1 update (SGD, momentum and weight decay are linear), so k only changes how often
  the workers talk.  Every worker ends every epoch with the same weights.  Async and WSP have
  no round in which every worker's weights meet, so k > 1 with them is refused.

Bytes moved: the job counts the bytes of the arrays it hands to the kvstore's ``push``,
``pull`` and ``pushpull`` (payload, not headers; the start-up pull of the initial weights
included), per worker.

Worker 0 evaluates the test split after every epoch; its epoch-end times are seconds of
training since its first step, evaluation time excluded.  Every worker writes
``<out>/rank<R>.json``: settings, the noise report, steps, per-epoch test accuracy (worker 0)
and training loss, bytes pushed and pulled, a SHA-256 of its final weights, seconds.

Models: ``mlp`` (64-128-64-10) and ``cnn`` (conv 3x3 x16, pool, dense 64, dense 10) for digits;
``squeezenet`` (``gluon.model_zoo.vision.squeezenet1_1``, from scratch, pretrained=False) for
image-sized inputs, its output's fixed 13x13 average pool (made for 224-pixel images) replaced
by a global one so that 28- and 32-pixel images fit.
"""
import argparse
import hashlib
import json
import os
import sys
import time

_p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
_p.add_argument("--out", required=True)
_p.add_argument("--kvstore", default="mxps",
                choices=("mxps", "mxps_async", "mxps_wsp", "dist_sync", "dist_async"),
                help="dist_sync / dist_async: native MXNet, for comparison (mxps not imported)")
_p.add_argument("--dataset", default="digits")
_p.add_argument("--data-root", default=None)
_p.add_argument("--limit", type=int, default=0, help="first N training and test samples")
_p.add_argument("--model", default="mlp", choices=("mlp", "cnn", "squeezenet"))
_p.add_argument("--kind", default="none")
_p.add_argument("--ratio", type=float, default=0.0, help="fraction of training labels")
_p.add_argument("--noise-seed", type=int, default=1)
_p.add_argument("--pair-seed", type=int, default=0)
_p.add_argument("--seed", type=int, default=1, help="initial weights and shuffling")
_p.add_argument("--epochs", type=int, default=5)
_p.add_argument("--batch", type=int, default=16, help="samples per worker per step")
_p.add_argument("--lr", type=float, default=0.02)
_p.add_argument("--momentum", type=float, default=0.9)
_p.add_argument("--sync-every", type=int, default=1)
_p.add_argument("--compression", default="",
                help="TYPE[:THRESHOLD]: the Trainer's gradient compression (2bit, 1bit; k = 1)")
ARGS = _p.parse_args()

if ARGS.kvstore.startswith("mxps"):
    import mxps  # noqa: F401,E402  (must precede mxnet: takes over server/scheduler roles)

import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402

from mxps_tools import compressed, noise  # noqa: E402


def build(model, classes):
    """The network (uninitialised)."""
    if model == "squeezenet":
        net = gluon.model_zoo.vision.squeezenet1_1(classes=classes, pretrained=False)
        with net.name_scope():
            net.output = gluon.nn.HybridSequential(prefix="")
            net.output.add(gluon.nn.Conv2D(classes, kernel_size=1), gluon.nn.Activation("relu"),
                           gluon.nn.GlobalAvgPool2D(), gluon.nn.Flatten())
        return net
    net = gluon.nn.HybridSequential(prefix="noise_")
    with net.name_scope():
        if model == "mlp":
            net.add(gluon.nn.Dense(128, activation="relu"), gluon.nn.Dense(64, activation="relu"),
                    gluon.nn.Dense(classes))
        else:
            net.add(gluon.nn.Conv2D(16, 3, padding=1, activation="relu"), gluon.nn.MaxPool2D(2),
                    gluon.nn.Flatten(), gluon.nn.Dense(64, activation="relu"),
                    gluon.nn.Dense(classes))
    return net


def input_shape(model, x):
    """digits' flat 64 pixels as an 8x8 image for the convolutional models."""
    if model != "mlp" and x.ndim == 2:
        side = int(round(np.sqrt(x.shape[1])))
        return (-1, 1, side, side)
    return (-1,) + x.shape[1:]


class Traffic:
    """Bytes this worker hands to the kvstore (counted by wrapping the kvstore's methods on the
    instance: the Trainer calls them there)."""

    def __init__(self, kv):
        self.pushed = self.pulled = 0
        push, pull, pushpull = kv.push, kv.pull, kv.pushpull

        def c_push(key, value, priority=0):
            self.pushed += _bytes(key, value)
            return push(key, value, priority=priority)

        def c_pull(key, out=None, priority=0, ignore_sparse=True):
            self.pulled += _bytes(key, out)
            return pull(key, out=out, priority=priority, ignore_sparse=ignore_sparse)

        def c_pushpull(key, value, out=None, priority=0):
            self.pushed += _bytes(key, value)
            self.pulled += _bytes(key, value if out is None else out)
            return pushpull(key, value, out=out, priority=priority)
        kv.push, kv.pull, kv.pushpull = c_push, c_pull, c_pushpull


def _bytes(key, value):
    """Payload bytes of one kvstore call: one array per key (the per-device copies of a key
    are reduced, or filled from one pull, on the worker)."""
    if isinstance(key, (list, tuple)):
        return sum(_bytes(k, v) for k, v in zip(key, value))
    a = value[0] if isinstance(value, (list, tuple)) else value
    return int(a.size) * np.dtype(a.dtype).itemsize


def digest(params):
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode())
        h.update(np.ascontiguousarray(params[name].data().asnumpy()).tobytes())
    return h.hexdigest()


def accuracy(net, x, y, shape, batch=500):
    right = 0
    for i in range(0, len(y), batch):
        pred = net(mx.nd.array(x[i:i + batch]).reshape(shape)).argmax(axis=1).asnumpy()
        right += int((pred.astype(np.int64) == y[i:i + batch]).sum())
    return right / len(y)


def average(kv, params, workers):
    """Model averaging: every worker pushes its weights, pulls the sum, divides by W."""
    for i, p in enumerate(params):
        kv.push(i, p.data())
    for i, p in enumerate(params):
        kv.pull(i, out=p.data())
    for p in params:
        p.data()[:] = p.data() / workers
    mx.nd.waitall()


def make_trainer(a, net, kv, workers, steps):
    """The Trainer (k = 1: on the kvstore) and, for local SGD, the parameters to average."""
    opt = {"learning_rate": a.lr, "momentum": a.momentum, "wd": 1e-4}
    if a.sync_every == 1:
        kw = {}
        if a.compression:
            kw["compression_params"] = compressed.params_from_arg(a.compression)
        return gluon.Trainer(net.collect_params(), "sgd", opt, kvstore=kv, **kw), None
    if a.compression:
        raise SystemExit("--compression compresses the Trainer's gradients (--sync-every 1)")
    params = list(net.collect_params().values())
    for i, p in enumerate(params):          # everybody starts from rank 0's weights
        kv.init(i, p.data())
        kv.pull(i, out=p.data())
    opt["learning_rate"] = a.lr * workers
    return gluon.Trainer(params, "sgd", opt, kvstore=None), params


def train(a, split, info):
    mx.random.seed(a.seed)
    np.random.seed(a.seed)
    classes = int(max(split.y_train.max(), split.y_test.max())) + 1
    net = build(a.model, classes)
    shape = input_shape(a.model, split.x_train)
    net.initialize(mx.init.Xavier(magnitude=2.0))
    net(mx.nd.array(split.x_train[:2]).reshape(shape))       # deferred shapes, before the kvstore
    net.hybridize()
    kv = mx.kv.create(a.kvstore)
    if a.compression:
        compressed.push_then_pull(kv)       # native refuses compression in pushpull
    traffic = Traffic(kv)
    rank, workers = kv.rank, kv.num_workers
    n = len(split.y_train)
    steps = (n // workers) // a.batch
    if steps < 1:
        raise SystemExit("%d training samples over %d workers do not fill one batch of %d"
                         % (n, workers, a.batch))
    trainer, local = make_trainer(a, net, kv, workers, steps)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    own = np.arange(rank, n, workers)
    curve, losses, ends, averages, step = [], [], [], 0, 0
    eval_seconds = 0.0
    t0 = time.perf_counter()
    for epoch in range(a.epochs):
        order = own[np.random.RandomState([a.seed, epoch, rank]).permutation(len(own))]
        total = 0.0
        for idx in order[:steps * a.batch].reshape(steps, a.batch):
            with autograd.record():
                loss = loss_fn(net(mx.nd.array(split.x_train[idx]).reshape(shape)),
                               mx.nd.array(split.y_train[idx]))
            loss.backward()
            trainer.step(a.batch)
            total += float(loss.mean().asscalar())
            step += 1
            if local is not None and (step % a.sync_every == 0 or step % steps == 0):
                average(kv, local, workers)
                averages += 1
        mx.nd.waitall()
        losses.append(total / steps)
        e0 = time.perf_counter()
        if rank == 0:
            curve.append(accuracy(net, split.x_test, split.y_test, shape))
        eval_seconds += time.perf_counter() - e0
        ends.append(time.perf_counter() - t0 - eval_seconds)
    params = net.collect_params()
    return {
        "rank": rank, "num_workers": workers, "kvstore_type": kv.type,
        "settings": {k: v for k, v in vars(a).items() if k != "out"}, "noise": info,
        "steps_per_epoch": steps, "steps": step, "averagings": averages,
        "train_samples": n, "test_samples": len(split.y_test),
        "param_bytes": sum(_bytes(0, p.data()) for p in params.values()),
        "test_accuracy": curve, "train_loss": losses,
        "bytes_pushed": traffic.pushed, "bytes_pulled": traffic.pulled,
        "weights_sha256": digest(params), "train_seconds": ends[-1] if ends else 0.0,
        "epoch_end_seconds": ends, "eval_seconds": eval_seconds,
        "mxps_file": getattr(sys.modules.get("mxps"), "__file__", None),
    }


def main(a=ARGS):
    if a.sync_every < 1:
        raise SystemExit("--sync-every must be at least 1, got %d" % a.sync_every)
    if a.sync_every > 1 and a.kvstore != "mxps":
        raise SystemExit("--sync-every %d (model averaging) needs synchronous rounds: kvstore "
                         "mxps, not %s" % (a.sync_every, a.kvstore))
    try:
        split, info = noise.noisy_split(noise.load(a.dataset, a.data_root, a.limit), a.kind,
                                        a.ratio, a.noise_seed, pair_seed=a.pair_seed)
    except noise.NoiseError as e:
        raise SystemExit("noise_job: %s" % e)
    result = train(a, split, info)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "rank%d.json" % result["rank"])
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(path + ".tmp", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
